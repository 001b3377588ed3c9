//! Crashes and stalls: a relay that dies between the broker's ack and recording SENT; a relay
//! paused past its lease (C15); two relays sharing 20,000 messages.

use outbox_testkit::{PauseAt, PauseFirst};
use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::transport::memory::Delivered;
use outbox::{
    InboundMessage, Inbox, InboxBackend, MemoryTransport, NewMessage, Processed, Relay,
    RelayConfig, Router, Status,
};
use outbox_testkit::{
    AckThenHang, NatsFixture, PgFixture, StoreFixture, TransportFixture as _, wait_metrics,
    wait_until, within,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::inbox::{EffectHandler, pg_count, pg_effects_of, pg_with_effects};
use crate::relay::{counts_by_id, fast_config, hooked_relay_to, relay_to, wait_all_status};

/// Feed every delivery (duplicates included) through an inbox on `pool`, as a consumer would.
/// Returns (applied, duplicates).
pub async fn apply_through_inbox<DB>(
    pool: &sqlx::Pool<DB>,
    inbox_table: &str,
    effects: &str,
    deliveries: &[Delivered],
) -> (usize, usize)
where
    DB: InboxBackend,
    EffectHandler: outbox::Handler<DB>,
{
    let inbox = Inbox::<DB>::new(pool.clone(), inbox_table, "consumer").unwrap();
    let h = EffectHandler::new(effects);
    let (mut applied, mut dup) = (0, 0);
    for d in deliveries {
        let m = InboundMessage::from_wire(d.message.wire_headers(), d.message.payload.clone(), 1)
            .unwrap();
        match inbox.process(&m, &h).await.unwrap() {
            Processed::Applied => applied += 1,
            Processed::Duplicate => dup += 1,
            Processed::Rejected { reason } => panic!("unexpected rejection: {reason}"),
        }
    }
    (applied, dup)
}

/// The relay dies after the broker acknowledged a batch but before it recorded SENT: the rows
/// stay SENDING until their lease expires, a new relay publishes them again (same message ids),
/// and the inbox applies each effect once. Shared by every store; `apply` feeds the deliveries
/// through that store's inbox and returns (applied, duplicates, effect rows).
pub async fn crash_after_ack_scenario(
    fx: &dyn StoreFixture,
    apply: impl AsyncFnOnce(Vec<Delivered>) -> (usize, usize, i64),
) {
    let mem = Arc::new(MemoryTransport::new());
    let hang = Arc::new(AckThenHang::new(mem.clone(), 1));
    // One batch in flight, so one batch holds all ten: with two, the lanes of SQLite and
    // MySQL/MariaDB split a backlog's buckets between them (`Store::lanes_share_buckets`) and
    // the second lane's half would be recorded SENT before the abort.
    let one_lane = RelayConfig {
        in_flight_batches: 1,
        ..fast_config("r1")
    };
    let r1 = relay_to(fx, hang.clone(), one_lane).spawn();
    let ids = fx.enqueue_numbered(10).await;
    hang.wait_acked().await;
    r1.abort();
    assert_eq!(mem.count(), 10);
    assert!(
        fx.rows()
            .await
            .iter()
            .all(|r| r.status == Status::Pending.as_i16() && r.attempts == 0),
        "acknowledged but not recorded: still PENDING, no write made"
    );
    let r2 = relay_to(fx, mem.clone(), fast_config("r2")).spawn();
    within("the re-publish", Duration::from_secs(10), mem.wait_for(20)).await;
    wait_all_status(fx, Status::Sent, Duration::from_secs(5)).await;
    let counts = counts_by_id(&mem.delivered());
    for id in &ids {
        assert_eq!(counts[id], 2, "published once before the crash, once after");
    }
    assert_eq!(
        apply(mem.delivered()).await,
        (10, 10, 10),
        "(applied, duplicates, effects)"
    );
    r2.shutdown().await.unwrap();
}

#[suite_test]
async fn crash_after_ack_before_completion_republishes_once_applied() {
    let (fx, pool, effects) = pg_with_effects().await;
    crash_after_ack_scenario(&fx, async |delivered| {
        let (applied, dup) =
            apply_through_inbox(&pool, &fx.inbox_table(), &effects, &delivered).await;
        (applied, dup, fx.count(&effects).await)
    })
    .await;
    fx.cleanup().await;
}

/// The same crash with NATS: the re-publish carries the same `Nats-Msg-Id`, so the stream keeps
/// one copy, and the consumer runner applies each message once.
#[suite_test]
async fn crash_after_ack_nats_duplicate_window_and_inbox(fx: PgFixture) {
    let nats = NatsFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = pg_effects_of(&fx).await;
    let dest = nats.topic_destination();
    let hang = Arc::new(AckThenHang::new(nats.transport.clone(), 1));
    let r1 = Relay::builder(fx.store())
        .router(Router::new().route("*", hang.clone(), dest.clone()))
        .config(fast_config("r1"))
        .build()
        .unwrap()
        .spawn();
    fx.enqueue_numbered(10).await;
    hang.wait_acked().await;
    r1.abort();
    let r2 = Relay::builder(fx.store())
        .router(Router::new().route("*", nats.transport.clone(), dest))
        .config(fast_config("r2"))
        .build()
        .unwrap()
        .spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(10)).await;
    assert_eq!(r2.metrics().snapshot().sent, 10, "r2 published them again");
    assert_eq!(
        nats.stored().await,
        10,
        "the duplicate window dropped the copies"
    );
    let cancel = CancellationToken::new();
    let consumer = tokio::spawn(outbox::consumer::nats::run(
        nats.transport.jetstream().clone(),
        NatsConsumerConfig::new(nats.stream.clone(), "billing"),
        Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap(),
        Arc::new(EffectHandler::new(&effects)),
        Arc::new(ConsumerMetrics::default()),
        cancel.clone(),
    ));
    wait_until("10 effects", Duration::from_secs(10), || async {
        fx.count(&effects).await >= 10
    })
    .await;
    assert_eq!(
        pg_count(
            &pool,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        10
    );
    cancel.cancel();
    let _ = within("consumer stop", Duration::from_secs(5), consumer).await;
    r2.shutdown().await.unwrap();
    nats.cleanup().await;
}

/// Relay R1 over `fx` to a fresh memory transport, paused by `hooks`, and one message `m1`
/// enqueued; once R1 paused on it (`what`, within 5 s): R1's transport, R1 and the message's id.
/// R1 has one batch in flight: while that batch is paused it reads nothing else, so a takeover
/// is another relay's.
pub(crate) async fn r1_paused(
    fx: &dyn StoreFixture,
    hooks: &Arc<PauseFirst>,
    what: &str,
) -> (Arc<MemoryTransport>, outbox::RelayHandle, Uuid) {
    let mem1 = Arc::new(MemoryTransport::new());
    let config = RelayConfig {
        in_flight_batches: 1,
        ..fast_config("r1")
    };
    let r1 = hooked_relay_to(fx, mem1.clone(), config, hooks.clone()).spawn();
    let id = fx.commit_one(NewMessage::new("t", "m1")).await;
    within(what, Duration::from_secs(5), hooks.entered.notified()).await;
    (mem1, r1, id)
}

/// Relay R2 over `fx` to a fresh memory transport; once R1's lease ran out it takes the message
/// over and publishes it (within 10 s), and every row is SENT (within 5 s): R2's transport and R2.
pub(crate) async fn r2_takes_over(
    fx: &dyn StoreFixture,
) -> (Arc<MemoryTransport>, outbox::RelayHandle) {
    let mem2 = Arc::new(MemoryTransport::new());
    let r2 = relay_to(fx, mem2.clone(), fast_config("r2")).spawn();
    within(
        "R2 to take over after R1's lease and publish",
        Duration::from_secs(10),
        mem2.wait_for(1),
    )
    .await;
    wait_all_status(fx, Status::Sent, Duration::from_secs(5)).await;
    (mem2, r2)
}

/// C15: R1 is paused right after its claim for longer than the lease. R2 takes the message over
/// and publishes it; R1, on resume, does not publish (stale batch) or has its completion refused
/// (lost lease). The inbox applies the message once; no row is left SENDING. Shared by every
/// store; `apply` feeds the deliveries through that store's inbox and returns (applied, effect
/// rows).
pub async fn c15_scenario(
    fx: &dyn StoreFixture,
    apply: impl AsyncFnOnce(Vec<Delivered>) -> (usize, i64),
) {
    let hooks = PauseFirst::new(PauseAt::Publish);
    let (mem1, r1, id) = r1_paused(fx, &hooks, "R1 to claim").await;
    let (mem2, r2) = r2_takes_over(fx).await;
    hooks.resume.notify_one();
    wait_metrics(r1.metrics(), 5, "R1 to notice its stale claim", |m| {
        m.stale_batches + m.lost_leases >= 1
    })
    .await;
    let mut all = mem1.delivered();
    all.extend(mem2.delivered());
    assert_eq!(apply(all).await, (1, 1), "(applied, effects)");
    let row = fx.row(id).await;
    assert_eq!(
        row.status,
        Status::Sent.as_i16(),
        "R1's late outcome overwrote R2's"
    );
    // R1 read the row and never published it (no write); R2's takeover counted the one attempt.
    assert_eq!(row.attempts, 1);
    r1.shutdown().await.unwrap();
    r2.shutdown().await.unwrap();
    assert!(
        fx.rows()
            .await
            .iter()
            .all(|r| r.status != Status::Sending.as_i16())
    );
}

#[suite_test]
async fn c15_paused_relay_past_its_lease() {
    let (fx, pool, effects) = pg_with_effects().await;
    c15_scenario(&fx, async |all| {
        let (applied, _) = apply_through_inbox(&pool, &fx.inbox_table(), &effects, &all).await;
        (applied, fx.count(&effects).await)
    })
    .await;
    fx.cleanup().await;
}

/// Two relays on PostgreSQL share 20,000 messages: none lost, none published twice.
#[suite_test]
async fn two_relays_share_20000_messages(fx: PgFixture) {
    for chunk in 0..20 {
        fx.enqueue_commit(
            (0..1000)
                .map(|i| NewMessage::new("bulk", format!("{chunk}-{i}")))
                .collect(),
        )
        .await
        .unwrap();
    }
    let mem1 = Arc::new(MemoryTransport::new());
    let mem2 = Arc::new(MemoryTransport::new());
    let config = |name: &str| RelayConfig {
        batch_size: 500,
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(10),
        ..fast_config(name)
    };
    let r1 = relay_to(&fx, mem1.clone(), config("r1")).spawn();
    let r2 = relay_to(&fx, mem2.clone(), config("r2")).spawn();
    let store = fx.store();
    wait_until("20,000 SENT", Duration::from_secs(60), || {
        let store = store.clone();
        async move { store.stats().await.unwrap().counts[&Status::Sent] == 20_000 }
    })
    .await;
    r1.shutdown().await.unwrap();
    r2.shutdown().await.unwrap();
    let mut counts: HashMap<Uuid, usize> = counts_by_id(&mem1.delivered());
    for (id, n) in counts_by_id(&mem2.delivered()) {
        *counts.entry(id).or_insert(0) += n;
    }
    assert_eq!(counts.len(), 20_000, "messages lost");
    let twice = counts.values().filter(|n| **n > 1).count();
    assert_eq!(twice, 0, "{twice} messages published more than once");
    eprintln!(
        "r1 published {}, r2 published {}",
        mem1.count(),
        mem2.count()
    );
}
