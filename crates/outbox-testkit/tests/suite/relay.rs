//! The relay end to end: SQLite + memory transport; PostgreSQL + NATS JetStream + the JetStream
//! consumer runner feeding an inbox; PostgreSQL LISTEN/NOTIFY wake-up.

use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::transport::memory::Delivered;
use outbox::{Inbox, MemoryTransport, NewMessage, Relay, RelayConfig, Router, Status};
use outbox_testkit::{
    NatsFixture, PgFixture, SqliteFixture, StoreFixture, TransportFixture as _, wait_until, within,
};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::inbox::{EffectHandler, pg_count, pg_effects_of};

/// Relay settings scaled down for tests ([`outbox_testkit::store_suite::relay_config`]).
pub fn fast_config(name: &str) -> RelayConfig {
    outbox_testkit::store_suite::relay_config(name)
}

/// [`fast_config`] named `name` that polls for due rows only every `poll_interval`: what is
/// published sooner was woken (by a NOTIFY or by the committing store).
pub fn polling_every(name: &str, poll_interval: Duration) -> RelayConfig {
    RelayConfig {
        poll_interval,
        ..fast_config(name)
    }
}

/// A relay over `fx` publishing every topic to `transport`.
pub fn relay_to(
    fx: &dyn StoreFixture,
    transport: Arc<dyn outbox::Transport>,
    config: RelayConfig,
) -> Relay {
    outbox_testkit::store_suite::relay_over(fx.store(), transport, config)
}

/// A relay `r1` ([`fast_config`]) over `fx` publishing to a fresh [`MemoryTransport`],
/// running: the transport and the relay's handle.
pub fn memory_relay(fx: &dyn StoreFixture) -> (Arc<MemoryTransport>, outbox::RelayHandle) {
    let mem = Arc::new(MemoryTransport::new());
    let handle = relay_to(fx, mem.clone(), fast_config("r1")).spawn();
    (mem, handle)
}

/// [`relay_to`] with `hooks` called at the relay's steps.
pub fn hooked_relay_to(
    fx: &dyn StoreFixture,
    transport: Arc<dyn outbox::Transport>,
    config: RelayConfig,
    hooks: Arc<dyn outbox::RelayHooks>,
) -> Relay {
    Relay::builder(fx.store())
        .router(Router::single(transport))
        .config(config)
        .hooks(hooks)
        .build()
        .expect("relay config")
}

/// Deliveries counted by message id.
pub fn counts_by_id(delivered: &[Delivered]) -> HashMap<Uuid, usize> {
    let mut m = HashMap::new();
    for d in delivered {
        *m.entry(d.message.message_id).or_insert(0) += 1;
    }
    m
}

/// Wait until every row of `fx` has status `status`.
pub async fn wait_all_status(fx: &dyn StoreFixture, status: Status, timeout: Duration) {
    wait_until(&format!("every row {status}"), timeout, || async {
        fx.rows().await.iter().all(|r| r.status == status.as_i16())
    })
    .await;
}

#[suite_test]
async fn sqlite_memory_end_to_end(fx: SqliteFixture) {
    let (mem, handle) = memory_relay(&fx);
    let mut msgs: Vec<NewMessage> = (0..50)
        .map(|i| NewMessage::new(format!("topic.{}", i % 3), format!("m{i}")))
        .collect();
    msgs.push(NewMessage::new("bin", vec![0xFF, 0xFE, 0x00]));
    let ids = fx.enqueue_commit(msgs).await.unwrap();
    within("51 deliveries", Duration::from_secs(10), mem.wait_for(51)).await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    let delivered = mem.delivered();
    let counts = counts_by_id(&delivered);
    assert_eq!(counts.len(), 51);
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice"
    );
    for id in &ids {
        assert!(counts.contains_key(id));
    }
    let bin = delivered.iter().find(|d| d.message.topic == "bin").unwrap();
    assert_eq!(bin.message.payload, vec![0xFF, 0xFE, 0x00]);
    assert_eq!(bin.destination, "bin");
    let metrics = handle.metrics().snapshot();
    assert_eq!(metrics.sent, 51);
    assert_eq!(metrics.lost_leases, 0);
    handle.shutdown().await.unwrap();
}

/// PostgreSQL outbox → relay → NATS JetStream → consumer runner → PostgreSQL inbox: every message
/// applied exactly once, payload byte-identical.
#[suite_test]
async fn postgres_nats_consumer_inbox_end_to_end(fx: PgFixture) {
    let nats = NatsFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = pg_effects_of(&fx).await;
    let router = Router::new().route("*", nats.transport.clone(), nats.topic_destination());
    let relay = Relay::builder(fx.store())
        .router(router)
        .config(fast_config("r1"))
        .build()
        .unwrap();
    let handle = relay.spawn();
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    let handler = Arc::new(EffectHandler::new(&effects));
    let metrics = Arc::new(ConsumerMetrics::default());
    let cancel = CancellationToken::new();
    let consumer = tokio::spawn(outbox::consumer::nats::run(
        nats.transport.jetstream().clone(),
        NatsConsumerConfig::new(nats.stream.clone(), "billing"),
        inbox,
        handler.clone(),
        metrics.clone(),
        cancel.clone(),
    ));
    let mut msgs: Vec<NewMessage> = (0..200)
        .map(|i| NewMessage::json("orders.created", &serde_json::json!({"n": i})).unwrap())
        .collect();
    msgs.push(NewMessage::new("orders.bin", vec![0xFF, 0xFE, 0x00, 0x01]));
    fx.enqueue_commit(msgs).await.unwrap();
    wait_until("201 effects", Duration::from_secs(20), || async {
        fx.count(&effects).await >= 201
    })
    .await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    assert_eq!(
        pg_count(
            &pool,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        201
    );
    assert_eq!(fx.count(&effects).await, 201);
    let bin: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT payload FROM {effects} WHERE payload = '\\xfffe0001'::bytea"
    )))
    .fetch_one(&pool)
    .await
    .expect("binary payload arrived byte-identical");
    assert_eq!(bin, vec![0xFF, 0xFE, 0x00, 0x01]);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 201);
    assert_eq!(nats.stored().await, 201);
    cancel.cancel();
    within("consumer to stop", Duration::from_secs(5), consumer)
        .await
        .unwrap()
        .unwrap();
    handle.shutdown().await.unwrap();
    nats.cleanup().await;
}

/// A misnamed stream still stops the NATS consumer runner at its first set-up, with a
/// [`outbox::ConfigError`] naming `stream` (the server's "stream not found" is a refusal; only
/// timeouts and cluster errors are retried, `clusters::nats_consumer_started_without_a_majority_waits_for_the_cluster`).
#[suite_test]
async fn nats_consumer_refuses_a_missing_stream_at_start(fx: PgFixture) {
    let nats = NatsFixture::new().await;
    let refused = within(
        "the runner's first set-up",
        Duration::from_secs(30),
        outbox::consumer::nats::run(
            nats.transport.jetstream().clone(),
            NatsConsumerConfig::new(format!("{}_MISSING", nats.stream), "billing"),
            Inbox::<sqlx::Postgres>::new(fx.store.pool().clone(), &fx.inbox_table(), "billing")
                .unwrap(),
            Arc::new(EffectHandler::new("unused")),
            Arc::new(ConsumerMetrics::default()),
            CancellationToken::new(),
        ),
    )
    .await
    .expect_err("a missing stream is refused");
    assert_eq!(refused.field, "stream", "{refused}");
    assert!(refused.reason.contains("stream not found"), "{refused}");
}

/// Wait (up to 10 s) until a session LISTENs on the fixture's channel.
async fn wait_for_listen(fx: &PgFixture) {
    let channel = fx.store.channel().to_owned();
    wait_until("the relay to LISTEN", Duration::from_secs(10), || {
        let pool = fx.store.pool().clone();
        let channel = channel.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE query ILIKE '%LISTEN%' AND query LIKE '%' || $1 || '%'",
            )
            .bind(&channel)
            .fetch_one(&pool)
            .await
            .unwrap();
            n > 0
        }
    })
    .await;
}

/// Kill the post-commit notifier's connection of `fx`'s store, found by its last statement: the
/// NOTIFY on this channel (waiting until it has sent one).
async fn kill_notifier(fx: &PgFixture) {
    let notifier = |kill: bool| {
        let (pool, channel) = (fx.store.pool().clone(), fx.store.channel().to_owned());
        async move {
            let what = if kill {
                "pg_terminate_backend(pid)"
            } else {
                "true"
            };
            let rows: Vec<bool> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT {what} FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
                 AND query LIKE 'SELECT pg_notify(''' || $1 || '''%'"
            )))
            .bind(channel)
            .fetch_all(&pool)
            .await
            .unwrap();
            rows
        }
    };
    wait_until("the notifier's NOTIFY", Duration::from_secs(5), || async {
        notifier(false).await.len() == 1
    })
    .await;
    assert_eq!(notifier(true).await, [true], "the notifier's connection");
}

/// The next notification on `listener`, within 5 s.
async fn next_notification(listener: &mut sqlx::postgres::PgListener) -> String {
    within("a notification", Duration::from_secs(5), listener.recv())
        .await
        .expect("notification")
        .payload()
        .to_owned()
}

/// A transaction holding one message on topic `t` with `payload`: begun by `PgStore::begin`
/// (marked, its wake-up deferred to `PgStore::commit`) when `marked`, else on the pool (as any
/// other producer).
async fn one_enqueued(
    fx: &PgFixture,
    marked: bool,
    payload: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = if marked {
        fx.store.begin().await.unwrap()
    } else {
        fx.store.pool().begin().await.unwrap()
    };
    fx.store
        .enqueue(&mut tx, NewMessage::new("t", payload))
        .await
        .unwrap();
    tx
}

/// Notify the marker `tag` on `fx`'s channel and assert it is the next notification on
/// `listener`: notifications arrive in commit order, so nothing else was sent before it.
async fn nothing_else_notified(
    fx: &PgFixture,
    listener: &mut sqlx::postgres::PgListener,
    tag: &str,
) {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(fx.store.channel())
        .bind(tag)
        .execute(fx.store.pool())
        .await
        .unwrap();
    assert_eq!(next_notification(listener).await, tag);
}

/// Deferred wake-up (`PgStore::begin` / `PgStore::commit`): a marked transaction sends no NOTIFY
/// of its own at commit, `PgStore::commit` sends exactly the one after it, and an unmarked
/// transaction still notifies through the trigger. Notifications arrive in commit order, so a
/// marker notified after each commit shows what that commit sent.
#[suite_test]
async fn postgres_deferred_notify_is_sent_after_commit_only(fx: PgFixture) {
    let channel = fx.store.channel().to_owned();
    let mut listener = sqlx::postgres::PgListener::connect_with(fx.store.pool())
        .await
        .unwrap();
    listener.listen(&channel).await.unwrap();

    // Marked, committed by hand: no NOTIFY at all (the row waits for the relays' poll).
    let tx = one_enqueued(&fx, true, "deferred").await;
    tx.commit().await.unwrap();
    nothing_else_notified(&fx, &mut listener, "after-plain-commit").await;

    // Marked, committed by the store: exactly one NOTIFY, sent after the commit.
    let tx = one_enqueued(&fx, true, "deferred, woken").await;
    fx.store.commit(tx).await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "");
    nothing_else_notified(&fx, &mut listener, "after-store-commit").await;

    // The notifier's connection dies between commits: the next commit's NOTIFY is sent again
    // on a new connection, not lost.
    kill_notifier(&fx).await;
    let tx = one_enqueued(&fx, true, "after a lost connection").await;
    fx.store.commit(tx).await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "");
    nothing_else_notified(&fx, &mut listener, "after-reconnect").await;

    // Not marked (any other producer): the trigger notifies at the commit.
    let tx = one_enqueued(&fx, false, "plain").await;
    tx.commit().await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "");
    nothing_else_notified(&fx, &mut listener, "after-unmarked").await;

    // A rolled-back marked transaction notifies nothing and leaves nothing.
    let tx = one_enqueued(&fx, true, "rolled back").await;
    tx.rollback().await.unwrap();
    nothing_else_notified(&fx, &mut listener, "after-rollback").await;
    assert_eq!(fx.count_status(Status::Pending).await, 4);
}

/// A relay elsewhere (another store instance, 30 s poll interval) publishes at once what a
/// producer commits through `PgStore::begin` / `PgStore::commit`: the post-commit NOTIFY wakes
/// it, although the transaction itself notified nothing. When the notifier's connection is
/// killed between commits, the next commit's NOTIFY is sent again on a new connection at once
/// (not left to the poll interval).
#[suite_test]
async fn postgres_post_commit_notify_wakes_a_relay_elsewhere(fx: PgFixture) {
    let mem = Arc::new(MemoryTransport::new());
    // The relay's own store: its in-process waker is not the producer's.
    let relay_store = outbox::PgStore::from_pool(
        outbox_testkit::pg_pool(4).await,
        outbox::StoreOptions::table(fx.table()),
    )
    .unwrap();
    let config = polling_every("elsewhere", Duration::from_secs(30));
    let handle =
        outbox_testkit::store_suite::relay_over(Arc::new(relay_store), mem.clone(), config).spawn();
    wait_for_listen(&fx).await;
    for (i, n) in [1usize, 2, 3, 4].into_iter().enumerate() {
        if i == 2 {
            kill_notifier(&fx).await;
        }
        let mut tx = fx.store.begin().await.unwrap();
        let id = fx
            .store
            .enqueue(&mut tx, NewMessage::new("t", format!("m{i}")))
            .await
            .unwrap();
        fx.store.commit(tx).await.unwrap();
        // Well inside the 30 s poll interval: only the post-commit NOTIFY can have woken it.
        within(
            "the post-commit NOTIFY",
            Duration::from_secs(5),
            mem.wait_for(n),
        )
        .await;
        assert_eq!(mem.delivered()[i].message.message_id, id);
    }
    handle.shutdown().await.unwrap();
}

/// A relay with a 30 s poll interval publishes a row inserted by plain SQL (another language's
/// producer) within a few seconds: the insert trigger's NOTIFY wakes it.
#[suite_test]
async fn postgres_listen_notify_wakes_relay(fx: PgFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let config = polling_every("listener", Duration::from_secs(30));
    let handle = relay_to(&fx, mem.clone(), config).spawn();
    wait_for_listen(&fx).await;
    // First row: may be picked up by the wake-up that follows LISTEN or by NOTIFY.
    fx.insert_plain_sql("foreign", b"one").await;
    within(
        "first plain-SQL row",
        Duration::from_secs(5),
        mem.wait_for(1),
    )
    .await;
    // Second row: the relay is now in its 30 s sleep; only NOTIFY can wake it.
    let started = tokio::time::Instant::now();
    let id = fx.insert_plain_sql("foreign", b"two").await;
    within(
        "second plain-SQL row (NOTIFY)",
        Duration::from_secs(5),
        mem.wait_for(2),
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(mem.delivered()[1].message.message_id, id);
    handle.shutdown().await.unwrap();
}
