//! Shared failure cases (see `docs/design/cases.md`), one test per case id, driven through
//! the `Relay` (C17 is in `cases_fencing`). C08 and C25/C27 also have tests in the store,
//! transport and inbox modules; C10's compile-time half is the `compile_fail` doc test in the
//! test kit's crate docs.

use outbox_testkit::{PauseAt, PauseFirst};
use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store as _;
use outbox::{
    Backoff, HandlerError, InboundMessage, Inbox, MemoryTransport, NewMessage, PgStore, Processed,
    RelayConfig, SqliteStore, Status, StoreErrorKind, StoreOptions, TransportErrorKind,
};
use outbox_testkit::store_suite::relay_over;
use outbox_testkit::{
    PgFixture, Producer, SqliteFixture, StoreFixture, wait_metrics, wait_until, within,
};
use sqlx::{AssertSqlSafe, Executor as _, PgConnection};

use crate::inbox::inbound;
use crate::relay::{
    counts_by_id, fast_config, hooked_relay_to, memory_relay, relay_to, wait_all_status,
};

/// C01: a row whose transaction commits after a later row's is still published (claim by
/// state, no id cursor).
#[suite_test]
async fn c01_late_commit_is_published(fx: PgFixture) {
    let (mem, relay) = memory_relay(&fx);
    // Session A draws the lower id and does not commit.
    let mut a = fx.store.pool().begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *a).await.unwrap();
    let m1 = fx
        .store
        .enqueue(&mut a, NewMessage::new("t", "M1"))
        .await
        .unwrap();
    // Session B draws the next id and commits.
    let m2 = fx.commit_one(NewMessage::new("t", "M2")).await;
    // The scenario's "wait 2 poll intervals" while A stays open: M1 is invisible meanwhile.
    late_commit_published(&mem, a, (m1, m2), Duration::from_millis(250)).await;
    relay.shutdown().await.unwrap();
}

/// C01's check, session A (`a`) holding M1 uncommitted and M2 committed: M2 is published alone,
/// M1 stays invisible for `hold`, then A's commit publishes it; M1 drew the lower row id.
/// Returns the row ids of M1 and M2.
pub(crate) async fn late_commit_published<DB: sqlx::Database>(
    mem: &MemoryTransport,
    a: sqlx::Transaction<'_, DB>,
    (m1, m2): (uuid::Uuid, uuid::Uuid),
    hold: Duration,
) -> (i64, i64) {
    within("M2 published", Duration::from_secs(5), mem.wait_for(1)).await;
    assert_eq!(mem.delivered()[0].message.message_id, m2);
    tokio::time::sleep(hold).await;
    assert_eq!(mem.count(), 1, "M1 is invisible until A commits");
    a.commit().await.unwrap();
    within(
        "M1 published after A commits",
        Duration::from_secs(5),
        mem.wait_for(2),
    )
    .await;
    let delivered = mem.delivered();
    assert_eq!(delivered[1].message.message_id, m1);
    let (id1, id2) = (delivered[1].message.id, delivered[0].message.id);
    assert!(id1 < id2, "M1 drew the lower id");
    (id1, id2)
}

/// C05: while the broker is down, messages are not dead-lettered and their attempts are not
/// burned; they are delivered when it comes back (max_attempts = 5).
#[suite_test]
async fn c05_broker_outage_does_not_burn_attempts(fx: SqliteFixture) {
    let mem = Arc::new(MemoryTransport::new());
    mem.set_down(true);
    let relay = relay_to(
        &fx,
        mem.clone(),
        RelayConfig {
            max_attempts: 5,
            ..fast_config("r1")
        },
    )
    .spawn();
    fx.enqueue_numbered(5).await;
    wait_metrics(relay.metrics(), 5, "the outage to be noticed", |m| {
        m.outages >= 1
    })
    .await;
    // The outage lasts 2 s: about 20 poll intervals and many probes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let m = relay.metrics().snapshot();
    assert_eq!(m.failed, 0);
    assert!(
        m.claimed <= 10,
        "the relay kept claiming while the broker was down: {m:?}"
    );
    for r in fx.rows().await {
        assert_eq!(r.status, Status::Pending.as_i16(), "{r:?}");
        assert_eq!(r.attempts, 0, "an outage burned an attempt: {r:?}");
    }
    mem.set_down(false);
    within(
        "delivery after the outage",
        Duration::from_secs(5),
        mem.wait_for(5),
    )
    .await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    assert!(fx.rows().await.iter().all(|r| r.attempts == 1));
    relay.shutdown().await.unwrap();
}

/// C07: a permanent error dead-letters that message after one attempt, with its reason, while
/// the rest of the batch is delivered.
#[suite_test]
async fn c07_permanent_error_dead_letters_only_that_message(fx: SqliteFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let msgs: Vec<NewMessage> = (0..5)
        .map(|i| NewMessage::new("t", format!("{i}")))
        .collect();
    let poison = msgs[2].message_id();
    let flaky = msgs[3].message_id();
    mem.fail_next(poison, vec![TransportErrorKind::Permanent]);
    mem.fail_next(flaky, vec![TransportErrorKind::Retryable]);
    fx.enqueue_commit(msgs).await.unwrap();
    let relay = relay_to(&fx, mem.clone(), fast_config("r1")).spawn();
    within("4 deliveries", Duration::from_secs(5), mem.wait_for(4)).await;
    wait_until("poison FAILED", Duration::from_secs(5), || async {
        fx.row(poison).await.status == Status::Failed.as_i16()
    })
    .await;
    let r = fx.row(poison).await;
    assert_eq!(r.attempts, 1);
    assert!(r.last_error.as_deref().is_some_and(|e| !e.is_empty()));
    let failed = fx.store().failed(10).await.unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].message_id, poison.to_string());
    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), 4);
    assert!(!counts.contains_key(&poison));
    // The last delivery's completion may still be on its way.
    wait_until("the others SENT", Duration::from_secs(5), || async {
        fx.rows()
            .await
            .iter()
            .all(|r| r.message_id == poison || r.status == Status::Sent.as_i16())
    })
    .await;
    // The attempt is written with its outcome (one write), so read it once SENT is recorded.
    assert_eq!(fx.row(flaky).await.attempts, 2, "retryable error retried");
    relay.shutdown().await.unwrap();
}

/// C08 end to end on PostgreSQL: a JSON payload with `\u0000` and raw bytes 0xFF 0xFE are
/// stored byte-exact (bytea, not jsonb) and delivered byte-identical.
#[suite_test]
async fn c08_nul_json_and_invalid_utf8_delivered_byte_identical(fx: PgFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let json = NewMessage::json("t", &serde_json::json!({"name": "nul\u{0000}here"})).unwrap();
    let json_bytes = json.payload().to_vec();
    let binary = vec![0xFF, 0xFE, 0x00, 0xFF];
    let ids = fx
        .enqueue_commit(vec![json, NewMessage::new("t", binary.clone())])
        .await
        .unwrap();
    let relay = relay_to(&fx, mem.clone(), fast_config("r1")).spawn();
    within("2 deliveries", Duration::from_secs(5), mem.wait_for(2)).await;
    for d in mem.delivered() {
        let expected = if d.message.message_id == ids[0] {
            &json_bytes
        } else {
            &binary
        };
        assert_eq!(&d.message.payload, expected);
    }
    relay.shutdown().await.unwrap();
}

/// A consumer handler that enqueues a reply in the inbox transaction (the C10 setting).
struct ReplyHandler {
    store: PgStore,
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for ReplyHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.store
            .enqueue(conn, NewMessage::new("reply", msg.payload.clone()))
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// C10 at run time: replies enqueued inside 300 consumer transactions are all delivered (the
/// enqueue is awaited inside the transaction; committing first does not compile, see the crate
/// docs).
#[suite_test]
async fn c10_replies_enqueued_in_consumer_transactions_are_all_delivered(fx: PgFixture) {
    let (mem, relay) = memory_relay(&fx);
    let inbox = Inbox::<sqlx::Postgres>::new(fx.store.pool().clone(), &fx.inbox_table(), "replier")
        .unwrap();
    let handler = Arc::new(ReplyHandler {
        store: fx.store.clone(),
    });
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let (inbox, handler) = (inbox.clone(), handler.clone());
        tasks.push(tokio::spawn(async move {
            inbox
                .process(&inbound(uuid::Uuid::now_v7()), handler.as_ref())
                .await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), Processed::Applied);
    }
    within("300 replies", Duration::from_secs(10), mem.wait_for(300)).await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    assert_eq!(counts_by_id(&mem.delivered()).len(), 300);
    assert_eq!(fx.rows().await.len(), 300, "no row deleted or lost");
    relay.shutdown().await.unwrap();
}

/// C20: the relay is killed (aborted) with a batch of 37 of 100 messages in flight (read, about
/// to be published) and before writing any result. A relay started after it takes the buckets
/// over once their lease expires and publishes every message once; nothing needs resetting by
/// hand and no row is left in flight.
#[suite_test]
async fn c20_rows_in_flight_at_a_crash_are_published_after_restart(fx: PgFixture) {
    fx.enqueue_numbered(100).await;
    let hooks = PauseFirst::new(PauseAt::Publish);
    let mem = Arc::new(MemoryTransport::new());
    let config = RelayConfig {
        batch_size: 37,
        in_flight_batches: 1,
        ..fast_config("r1")
    };
    let r1 = hooked_relay_to(&fx, mem.clone(), config, hooks.clone()).spawn();
    within(
        "R1 to claim",
        Duration::from_secs(5),
        hooks.entered.notified(),
    )
    .await;
    r1.abort();
    // Read, not claimed: the 37 rows in flight at the crash are still PENDING and untouched,
    // like the 63 others.
    let pending = fx
        .rows()
        .await
        .iter()
        .filter(|r| r.status == Status::Pending.as_i16() && r.attempts == 0)
        .count();
    assert_eq!(pending, 100);
    assert_eq!(mem.count(), 0);
    let restarted = tokio::time::Instant::now();
    let r2 = relay_to(&fx, mem.clone(), fast_config("r2")).spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(10)).await;
    // R1's bucket leases (2 s) expire, R2 takes them over at its next membership round and
    // publishes: lease + a round + a poll, well within 4 s.
    assert!(
        restarted.elapsed() < Duration::from_secs(4),
        "{:?}",
        restarted.elapsed()
    );
    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), 100);
    assert!(counts.values().all(|n| *n == 1));
    r2.shutdown().await.unwrap();
}

/// C24: an in-memory SQLite pool that can close idle connections is refused at start-up;
/// `SqliteStore::connect("sqlite::memory:")` pins its connection, keeps its tables through idle
/// time, and publishes 10 messages.
#[suite_test]
async fn c24_in_memory_sqlite_pool() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .idle_timeout(Duration::from_secs(1))
        .connect("sqlite::memory:")
        .await
        .unwrap();
    let e = SqliteStore::from_pool(pool, StoreOptions::default()).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Config, "{e:?}");

    let store = SqliteStore::connect("sqlite::memory:", StoreOptions::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    store
        .enqueue_many(
            &mut tx,
            (0..10)
                .map(|i| NewMessage::new("t", format!("{i}")))
                .collect(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Idle longer than the refused pool's idle timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mem = Arc::new(MemoryTransport::new());
    let relay = relay_over(Arc::new(store.clone()), mem.clone(), fast_config("r1")).spawn();
    within("10 deliveries", Duration::from_secs(5), mem.wait_for(10)).await;
    wait_until("10 SENT", Duration::from_secs(5), || {
        let store = store.clone();
        async move { store.stats().await.unwrap().counts[&Status::Sent] == 10 }
    })
    .await;
    relay.shutdown().await.unwrap();
}

/// A pool of 5 connections to `url` whose sessions each run `set_time_zone` first (C35: a
/// producer or relay in another session time zone); `service` names the server in a panic.
pub(crate) async fn pool_in_time_zone<DB>(
    url: &str,
    set_time_zone: String,
    service: &str,
) -> sqlx::Pool<DB>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(5)
        .after_connect(move |conn, _| {
            let sql = set_time_zone.clone();
            Box::pin(async move {
                conn.execute(AssertSqlSafe(sql)).await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect(service)
}

/// C35's messages, enqueued by plain producers in two session time zones at the same moment:
/// one due now and one due in 60 s in each. Their ids: `[shanghai, utc]` due now, then
/// `[shanghai, utc]` delayed.
pub(crate) async fn enqueue_in_both_zones<S: Producer + Sync>(
    shanghai: &S,
    utc: &S,
) -> ([uuid::Uuid; 2], [uuid::Uuid; 2]) {
    let later = |payload: &str| NewMessage::new("t", payload).with_delay(Duration::from_secs(60));
    let now = tokio::join!(
        shanghai.enqueue_plain(NewMessage::new("t", "sh")),
        utc.enqueue_plain(NewMessage::new("t", "utc"))
    );
    let delayed = tokio::join!(
        shanghai.enqueue_plain(later("sh-late")),
        utc.enqueue_plain(later("utc-late"))
    );
    (now.into(), delayed.into())
}

/// C35's checks of each of `ids` from each of `readers`: `due_in(reader, id)` seconds, between 58
/// and 60 (a delay or a retry of 60 s measured on the database clock); `what` names it.
pub(crate) async fn assert_due_in_a_minute<R>(
    what: &str,
    readers: [&R; 2],
    ids: &[uuid::Uuid],
    due_in: impl AsyncFn(&R, uuid::Uuid) -> f64,
) {
    for reader in readers {
        for id in ids {
            let d = due_in(reader, *id).await;
            assert!((58.0..=60.0).contains(&d), "{what} due in {d} s");
        }
    }
}

/// C35's relay in the Shanghai session, over a memory broker that refuses each of `ids` once
/// (retryable): their retries are due a minute later. The broker and the running relay.
pub(crate) fn relay_refusing_once(
    shanghai: Arc<dyn outbox::store::Store>,
    ids: &[uuid::Uuid],
) -> (Arc<MemoryTransport>, outbox::RelayHandle) {
    let mem = Arc::new(MemoryTransport::new());
    for id in ids {
        mem.fail_next(*id, vec![TransportErrorKind::Retryable]);
    }
    let relay = relay_over(shanghai, mem.clone(), retry_a_minute_later("shanghai")).spawn();
    (mem, relay)
}

/// C35's last check: nothing in `store` is due within 55 s for a relay in its session.
pub(crate) async fn assert_nothing_due_soon(store: &dyn outbox::store::Store) {
    let due = store.next_due_in().await.unwrap().unwrap();
    assert!(due > Duration::from_secs(55), "next due in {due:?}");
}

async fn pg_store_in_time_zone(fx: &PgFixture, tz: &'static str) -> PgStore {
    let pool = pool_in_time_zone(
        &outbox_testkit::postgres_url(),
        format!("SET TIME ZONE '{tz}'"),
        "PostgreSQL (OUTBOX_TEST_POSTGRES_URL)",
    )
    .await;
    PgStore::from_pool(pool, StoreOptions::table(fx.table())).unwrap()
}

async fn epoch(store: &PgStore, sql: &str, id: uuid::Uuid) -> f64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .bind(id)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// [`fast_config`] named `name` whose retries come 60 s later (no jitter, no growth): a retry's
/// `available_at` shows the relay measured the delay on the database clock.
pub(crate) fn retry_a_minute_later(name: &str) -> RelayConfig {
    let minute = Duration::from_secs(60);
    RelayConfig {
        backoff: Backoff {
            base: minute,
            factor: 1.0,
            max: minute,
            jitter: 0.0,
        },
        ..fast_config(name)
    }
}

/// C35: two instances whose sessions run in Asia/Shanghai and UTC enqueue at the same moment:
/// the stored instants agree within 1 s, and delays and the retries a relay in the Shanghai session
/// records are measured on the database clock whatever the session time zone.
#[suite_test]
async fn c35_session_time_zones_do_not_shift_times(fx: PgFixture) {
    let shanghai = pg_store_in_time_zone(&fx, "Asia/Shanghai").await;
    let utc = pg_store_in_time_zone(&fx, "UTC").await;
    let tz: String = sqlx::query_scalar("SHOW TimeZone")
        .fetch_one(shanghai.pool())
        .await
        .unwrap();
    assert_eq!(tz, "Asia/Shanghai");
    let ([a, b], [da, db]) = enqueue_in_both_zones(&shanghai, &utc).await;
    let t = fx.table();
    let created =
        format!("SELECT EXTRACT(EPOCH FROM created_at)::float8 FROM {t} WHERE message_id = $1");
    for reader in [&shanghai, &utc] {
        let (ca, cb) = (
            epoch(reader, &created, a).await,
            epoch(reader, &created, b).await,
        );
        assert!((ca - cb).abs() < 1.0, "created_at differ by {} s", ca - cb);
        let now: f64 = sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM now())::float8")
            .fetch_one(reader.pool())
            .await
            .unwrap();
        assert!(
            (now - ca).abs() < 5.0,
            "created_at is {} s from now()",
            now - ca
        );
    }
    let due_in = format!(
        "SELECT EXTRACT(EPOCH FROM available_at - now())::float8 FROM {t} WHERE message_id = $1"
    );
    let due = async |reader: &PgStore, id: uuid::Uuid| epoch(reader, &due_in, id).await;
    assert_due_in_a_minute("delayed message", [&shanghai, &utc], &[da, db], &due).await;
    // Only a relay in the Shanghai session processes; the broker refuses both once, and the
    // retry backoff is exactly 60 s.
    let (mem, relay) = relay_refusing_once(Arc::new(shanghai.clone()), &[a, b]);
    wait_metrics(relay.metrics(), 10, "both to fail once", |r| {
        r.retried >= 2 && r.completion_writes >= 1
    })
    .await;
    wait_until("both retries recorded", Duration::from_secs(5), || async {
        let (ra, rb) = (fx.row(a).await, fx.row(b).await);
        [ra, rb].iter().all(|r| {
            r.status == Status::Pending.as_i16() && r.attempts == 1 && r.last_error.is_some()
        })
    })
    .await;
    relay.shutdown().await.unwrap();
    assert_due_in_a_minute("retry", [&shanghai, &utc], &[a, b], &due).await;
    // Nothing is due for a relay in the UTC session either.
    assert_nothing_due_soon(&utc).await;
    assert_eq!(mem.count(), 0, "published before its retry was due");
    let _ = (shanghai.pool().close().await, utc.pool().close().await);
}
