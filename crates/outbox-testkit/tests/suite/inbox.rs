//! The inbox on SQLite, PostgreSQL and MySQL/MariaDB: duplicates skip the handler, handler errors roll back,
//! concurrent copies apply once (C25), a failing inbox write is an error, never an ack (C27).

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::message::{HEADER_MESSAGE_ID, HEADER_TOPIC};
use outbox::{HandlerError, Headers, InboundMessage, Inbox, InboxError, Processed};
use outbox_testkit::{MySqlFixture, PgFixture, StoreFixture as _};
use sqlx::{AssertSqlSafe, MySqlPool, PgConnection, PgPool};
use uuid::Uuid;

/// A handler that records its effect as a row of `effects` (no unique key, so a duplicate
/// effect would show as a second row), optionally waiting first or failing.
pub struct EffectHandler {
    pub effects: String,
    pub calls: AtomicUsize,
    pub delay: Duration,
    pub fail: bool,
}

impl EffectHandler {
    pub fn new(effects: &str) -> Self {
        EffectHandler {
            effects: effects.into(),
            calls: AtomicUsize::new(0),
            delay: Duration::ZERO,
            fail: false,
        }
    }

    /// After the effect: wait `delay` (holding the consumer transaction open), then
    /// [`EffectHandler::verdict`].
    async fn after_effect(&self) -> Result<(), HandlerError> {
        tokio::time::sleep(self.delay).await;
        self.verdict()
    }

    /// Refuse (transiently) when `fail` is set.
    fn verdict(&self) -> Result<(), HandlerError> {
        if self.fail {
            return Err(HandlerError::transient("handler refused"));
        }
        Ok(())
    }
}

effect_handler!(EffectHandler, sqlx::Postgres, sqlx::PgConnection, "($1, $2)",
    |this, msg| id: msg.message_id, then: this.after_effect().await);
effect_handler!(EffectHandler, sqlx::Sqlite, sqlx::SqliteConnection, "(?1, ?2)",
    |this, msg| id: msg.message_id.to_string(), then: this.verdict());
effect_handler!(EffectHandler, sqlx::MySql, sqlx::MySqlConnection, "(?, ?)",
    |this, msg| id: msg.message_id.to_string(), then: this.after_effect().await);

pub fn inbound(id: Uuid) -> InboundMessage {
    let mut h = Headers::new();
    h.insert(HEADER_MESSAGE_ID.into(), id.to_string());
    h.insert(HEADER_TOPIC.into(), "orders.created".into());
    InboundMessage::from_wire(h, b"{\"order\":1}".to_vec(), 1).unwrap()
}

/// Create the effects table `name` on PostgreSQL.
pub async fn pg_effects(pool: &PgPool, name: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {name} (message_id uuid NOT NULL, payload bytea)"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// A fresh PostgreSQL fixture with an `effects` table ([`pg_effects`]) in its schema: the
/// fixture, its pool and the table's name.
pub async fn pg_with_effects() -> (PgFixture, PgPool, String) {
    let fx = PgFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = pg_effects_of(&fx).await;
    (fx, pool, effects)
}

/// The effects table `<schema>.effects` ([`pg_effects`]), created in `fx`'s schema: its name.
pub async fn pg_effects_of(fx: &PgFixture) -> String {
    let effects = format!("{}.effects", fx.schema);
    pg_effects(fx.store.pool(), &effects).await;
    effects
}

pub async fn pg_count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A fresh SQLite fixture with an `effects` table and the migrated inbox `outbox_inbox` of
/// `consumer`: the fixture (which keeps the file), its pool and the inbox.
pub async fn sqlite_with_effects(
    consumer: &str,
) -> (
    outbox_testkit::SqliteFixture,
    sqlx::SqlitePool,
    Inbox<sqlx::Sqlite>,
) {
    let fx = outbox_testkit::SqliteFixture::new().await;
    let pool = fx.store.pool().clone();
    crate::inbox::sqlite_effects_table(&pool).await;
    let inbox = Inbox::<sqlx::Sqlite>::new(pool.clone(), "outbox_inbox", consumer).unwrap();
    inbox.migrate().await.unwrap();
    (fx, pool, inbox)
}

#[suite_test]
async fn sqlite_duplicate_skips_handler_and_error_rolls_back() {
    let (_fx, pool, inbox) = sqlite_with_effects("billing").await;
    let h = EffectHandler::new("effects");
    let m = inbound(Uuid::now_v7());
    assert_eq!(inbox.process(&m, &h).await.unwrap(), Processed::Applied);
    assert_eq!(inbox.process(&m, &h).await.unwrap(), Processed::Duplicate);
    assert_eq!(
        h.calls.load(Ordering::SeqCst),
        1,
        "the duplicate ran the handler"
    );
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    // Another consumer name is a separate dedup scope.
    let other = Inbox::<sqlx::Sqlite>::new(pool.clone(), "outbox_inbox", "shipping").unwrap();
    assert_eq!(other.process(&m, &h).await.unwrap(), Processed::Applied);

    let failing = EffectHandler {
        fail: true,
        ..EffectHandler::new("effects")
    };
    let m2 = inbound(Uuid::now_v7());
    let e = inbox.process(&m2, &failing).await.unwrap_err();
    assert!(matches!(e, InboxError::Handler(_)), "{e:?}");
    assert!(e.is_retryable());
    let (effects, rows): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM effects WHERE message_id = ?1), \
         (SELECT COUNT(*) FROM outbox_inbox WHERE message_id = ?1)",
    )
    .bind(m2.message_id.to_string())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((effects, rows), (0, 0), "a failed handler left traces");
    // Redelivery after the failure applies it.
    assert_eq!(inbox.process(&m2, &h).await.unwrap(), Processed::Applied);
}

/// Shared by PostgreSQL and MariaDB: a copy skips the handler, a failing handler leaves no
/// trace (no effect, no inbox row), and the redelivery applies it. `count` runs a
/// `SELECT COUNT(*)` on the database.
pub async fn duplicate_and_failure_scenario<DB>(
    inbox: &Inbox<DB>,
    effects: &str,
    count: impl AsyncFn(String) -> i64,
) where
    DB: outbox::InboxBackend,
    EffectHandler: outbox::Handler<DB>,
{
    let h = EffectHandler::new(effects);
    let m = inbound(Uuid::now_v7());
    assert_eq!(inbox.process(&m, &h).await.unwrap(), Processed::Applied);
    assert_eq!(inbox.process(&m, &h).await.unwrap(), Processed::Duplicate);
    assert_eq!(h.calls.load(Ordering::SeqCst), 1);
    assert_eq!(count(format!("SELECT COUNT(*) FROM {effects}")).await, 1);

    let failing = EffectHandler {
        fail: true,
        ..EffectHandler::new(effects)
    };
    let m2 = inbound(Uuid::now_v7());
    let e = inbox.process(&m2, &failing).await.unwrap_err();
    assert!(matches!(e, InboxError::Handler(_)), "{e:?}");
    let traces = format!(
        "SELECT (SELECT COUNT(*) FROM {effects} WHERE message_id = '{id}') + \
         (SELECT COUNT(*) FROM {inbox} WHERE message_id = '{id}')",
        id = m2.message_id,
        inbox = inbox.table(),
    );
    assert_eq!(count(traces).await, 0, "a failed handler left traces");
    assert_eq!(inbox.process(&m2, &h).await.unwrap(), Processed::Applied);
}

#[suite_test]
async fn postgres_duplicate_skips_handler_and_error_rolls_back() {
    let (fx, pool, effects) = pg_with_effects().await;
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    inbox.migrate().await.unwrap();
    duplicate_and_failure_scenario(&inbox, &effects, async |sql| pg_count(&pool, &sql).await).await;
    fx.cleanup().await;
}

/// C25, shared by PostgreSQL and MariaDB: two consumer instances (separate pools, same consumer
/// name, inbox `inbox_table`) process two copies of one message at the same time with a handler
/// that waits: one is applied, the other is a duplicate. The caller checks one effect and one
/// inbox row.
pub async fn c25_scenario<DB>(
    (pool_a, pool_b): (sqlx::Pool<DB>, sqlx::Pool<DB>),
    inbox_table: &str,
    effects: &str,
) where
    DB: outbox::InboxBackend,
    EffectHandler: outbox::Handler<DB>,
{
    let inbox_a = Inbox::<DB>::new(pool_a, inbox_table, "billing").unwrap();
    let inbox_b = Inbox::<DB>::new(pool_b, inbox_table, "billing").unwrap();
    let h = Arc::new(EffectHandler {
        delay: Duration::from_millis(1500),
        ..EffectHandler::new(effects)
    });
    let m = inbound(Uuid::now_v7());
    let (a, b) = tokio::join!(
        {
            let (h, m) = (h.clone(), m.clone());
            tokio::spawn(async move { inbox_a.process(&m, h.as_ref()).await })
        },
        {
            let (h, m) = (h.clone(), m.clone());
            tokio::spawn(async move { inbox_b.process(&m, h.as_ref()).await })
        }
    );
    let mut outcomes = vec![a.unwrap().unwrap(), b.unwrap().unwrap()];
    outcomes.sort_by_key(|p| *p == Processed::Duplicate);
    assert_eq!(outcomes, vec![Processed::Applied, Processed::Duplicate]);
}

#[suite_test]
async fn c25_concurrent_copies_apply_once() {
    let (fx, pool, effects) = pg_with_effects().await;
    let pools = (pool, outbox_testkit::pg_pool(2).await);
    c25_scenario(pools, &fx.inbox_table(), &effects).await;
    assert_eq!(fx.count(&effects).await, 1);
    assert_eq!(fx.count(&fx.inbox_table()).await, 1);
    fx.cleanup().await;
}

/// C27: while the inbox insert fails (a trigger raises), `process` returns an error, so the
/// runner does not acknowledge and nothing is applied; after the trigger is dropped each message
/// is applied once.
#[suite_test]
async fn c27_failing_inbox_write_is_an_error_not_an_ack(fx: PgFixture) {
    let pool = fx.store.pool().clone();
    let s = &fx.schema;
    let effects = format!("{s}.effects");
    pg_effects(&pool, &effects).await;
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    fx.refuse_inserts(&fx.inbox_table()).await;
    let h = EffectHandler::new(&effects);
    refused_then_applied_once(&inbox, &h, async {
        assert_eq!(fx.count(&effects).await, 0);
        fx.allow_inserts(&fx.inbox_table()).await;
    })
    .await;
    assert_eq!(fx.count(&effects).await, 10);
    assert_eq!(
        pg_count(
            &pool,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        10
    );
}

/// C27's steps on an inbox whose writes are refused: ten messages each fail with a retryable
/// store error naming the refusal ("writes to <inbox table> are refused") and the handler never runs; then
/// `allow` (which may check that nothing was applied) lets writes through, and each message is
/// applied once and a duplicate the second time.
async fn refused_then_applied_once<DB>(
    inbox: &Inbox<DB>,
    h: &EffectHandler,
    allow: impl std::future::Future<Output = ()>,
) where
    DB: outbox::InboxBackend,
    EffectHandler: outbox::Handler<DB>,
{
    let msgs: Vec<InboundMessage> = (0..10).map(|_| inbound(Uuid::now_v7())).collect();
    for m in &msgs {
        let e = inbox.process(m, h).await.unwrap_err();
        assert!(matches!(e, InboxError::Store(_)), "{e:?}");
        assert!(
            format!("{e} {e:?}").contains("refused"),
            "the database's refusal is named: {e:?}"
        );
        assert!(
            e.is_retryable(),
            "a failed inbox write must lead to redelivery"
        );
    }
    assert_eq!(
        h.calls.load(Ordering::SeqCst),
        0,
        "handler ran without its inbox row"
    );
    allow.await;
    for m in &msgs {
        assert_eq!(inbox.process(m, h).await.unwrap(), Processed::Applied);
        assert_eq!(inbox.process(m, h).await.unwrap(), Processed::Duplicate);
    }
}

/// Create the effects table `effects` on SQLite.
pub async fn sqlite_effects_table(pool: &sqlx::SqlitePool) {
    sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL, payload BLOB)")
        .execute(pool)
        .await
        .unwrap();
}

/// Write `msg`'s effect into the `effects` table ([`sqlite_effects_table`]) on a handler's
/// connection (so it commits or rolls back with the inbox record); a failed write is transient.
pub async fn sqlite_effect(
    conn: &mut sqlx::SqliteConnection,
    msg: &InboundMessage,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (message_id, payload) VALUES (?1, ?2)")
        .bind(msg.message_id.to_string())
        .bind(&msg.payload)
        .execute(conn)
        .await
        .map_err(HandlerError::transient)?;
    Ok(())
}

/// Create the effects table `name` on MySQL/MariaDB.
pub async fn mysql_effects(pool: &MySqlPool, name: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {name} (message_id CHAR(36) NOT NULL, payload LONGBLOB) ENGINE=InnoDB"
    )))
    .execute(pool)
    .await
    .unwrap();
}

pub async fn mysql_count(pool: &MySqlPool, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A MySQL fixture, its pool and its effects table `<table>_effects` (created).
async fn mysql_with_effects() -> (MySqlFixture, MySqlPool, String) {
    let fx = MySqlFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = mysql_effects_of(&fx).await;
    (fx, pool, effects)
}

/// The effects table `<outbox table>_effects` ([`mysql_effects`]), created beside `fx`'s outbox:
/// its name.
pub async fn mysql_effects_of(fx: &MySqlFixture) -> String {
    let effects = format!("{}_effects", fx.table);
    mysql_effects(fx.store.pool(), &effects).await;
    effects
}

async fn mysql_drop(fx: &MySqlFixture, effects: &str) {
    fx.exec(&format!("DROP TABLE IF EXISTS {effects}")).await;
    fx.cleanup().await;
}

#[suite_test]
async fn mysql_duplicate_skips_handler_and_error_rolls_back() {
    let (fx, pool, effects) = mysql_with_effects().await;
    let inbox = Inbox::<sqlx::MySql>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    inbox.migrate().await.unwrap();
    duplicate_and_failure_scenario(&inbox, &effects, async |sql| mysql_count(&pool, &sql).await)
        .await;
    let h = EffectHandler::new(&effects);
    let m = inbound(Uuid::now_v7());
    assert_eq!(inbox.process(&m, &h).await.unwrap(), Processed::Applied);
    let other = Inbox::<sqlx::MySql>::new(pool.clone(), &fx.inbox_table(), "shipping").unwrap();
    assert_eq!(
        other.process(&m, &h).await.unwrap(),
        Processed::Applied,
        "another consumer name is a separate scope"
    );

    // Dead letters and replay on MySQL.
    let m3 = inbound(Uuid::now_v7());
    inbox.dead_letter(&m3, "poison", 5).await.unwrap();
    inbox.dead_letter(&m3, "poison again", 6).await.unwrap();
    let dl = inbox.dead_letters(10).await.unwrap();
    assert_eq!(dl.len(), 1);
    assert!(inbox.request_replay(m3.message_id).await.unwrap());
    let replayed = inbox.replay_requested(&h, 10).await.unwrap();
    assert_eq!(replayed.len(), 1, "{replayed:?}");
    assert!(inbox.dead_letters(10).await.unwrap().is_empty());
    // Two messages of the shared scenario, one under two consumer names, one dead letter.
    assert_eq!(inbox.purge(Duration::ZERO, 100).await.unwrap(), 5);
    mysql_drop(&fx, &effects).await;
}

/// C25 on MariaDB: two instances process two copies of one message at the same time with a
/// handler that waits: the effect is applied once and the inbox holds one row.
#[suite_test]
async fn mysql_c25_concurrent_copies_apply_once() {
    let (fx, pool, effects) = mysql_with_effects().await;
    let pools = (pool, outbox_testkit::mysql_pool(2).await);
    c25_scenario(pools, &fx.inbox_table(), &effects).await;
    assert_eq!(fx.count(&effects).await, 1);
    assert_eq!(fx.count(&fx.inbox_table()).await, 1);
    mysql_drop(&fx, &effects).await;
}

/// C27 on MariaDB: while the inbox insert fails (a trigger SIGNALs), `process` returns an error
/// and nothing is applied; after the trigger is dropped each message is applied once.
#[suite_test]
async fn mysql_c27_failing_inbox_write_is_an_error_not_an_ack() {
    let (fx, pool, effects) = mysql_with_effects().await;
    let inbox = Inbox::<sqlx::MySql>::new(pool.clone(), &fx.inbox_table(), "billing").unwrap();
    fx.refuse_inserts(&fx.inbox_table()).await;
    let h = EffectHandler::new(&effects);
    refused_then_applied_once(&inbox, &h, async {
        assert_eq!(
            mysql_count(&pool, &format!("SELECT COUNT(*) FROM {effects}")).await,
            0
        );
        fx.allow_inserts(&fx.inbox_table()).await;
    })
    .await;
    assert_eq!(
        mysql_count(
            &pool,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        10
    );
    assert_eq!(
        mysql_count(&pool, &format!("SELECT COUNT(*) FROM {effects}")).await,
        10
    );
    mysql_drop(&fx, &effects).await;
}

/// Records the order in which messages are applied per partition key; fails one chosen message
/// transiently while `fail_once` holds it; the first messages of two chosen keys meet at a
/// barrier (so the test only completes if their lanes run at the same time).
struct KeyOrderHandler {
    applied: std::sync::Mutex<Vec<(String, u32)>>,
    fail_once: std::sync::Mutex<Option<Uuid>>,
    meet: tokio::sync::Barrier,
    meeting: Vec<Uuid>,
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for KeyOrderHandler {
    async fn handle(
        &self,
        _conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        if self.meeting.contains(&msg.message_id) {
            tokio::time::timeout(Duration::from_secs(10), self.meet.wait())
                .await
                .map_err(|_| HandlerError::permanent("lanes did not run concurrently"))?;
        }
        if self
            .fail_once
            .lock()
            .unwrap()
            .take_if(|id| *id == msg.message_id)
            .is_some()
        {
            return Err(HandlerError::transient("chosen failure"));
        }
        let seq: u32 = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
        let key = msg.partition_key.clone().unwrap();
        self.applied.lock().unwrap().push((key, seq));
        Ok(())
    }
}

/// `keys` keys × `per_key` messages, interleaved: k0#0, k1#0, …, k0#1, …; partition key `k<i>`,
/// payload the sequence number in its key as text.
pub fn interleaved(keys: usize, per_key: u32) -> Vec<InboundMessage> {
    (0..per_key)
        .flat_map(|seq| {
            (0..keys).map(move |k| {
                let mut m = inbound(Uuid::now_v7());
                m.partition_key = Some(format!("k{k}"));
                m.payload = seq.to_string().into_bytes();
                m
            })
        })
        .collect()
}

/// `deliver_batch`: different keys run in parallel lanes, each key's messages are applied in
/// batch order, and a failing message holds back the later messages of its own key only (they
/// are retried with it, never applied before it).
#[suite_test(workers = 4)]
async fn deliver_batch_keeps_per_key_order_and_holds_back_only_the_failing_key() {
    use outbox::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver_batch, lane_of};
    let fx = PgFixture::new().await;
    let inbox =
        Inbox::<sqlx::Postgres>::new(fx.store.pool().clone(), &fx.inbox_table(), "lanes").unwrap();
    inbox.migrate().await.unwrap();
    let lanes = 4;
    let batch = interleaved(8, 10);
    let first_of = |key: &str| {
        batch
            .iter()
            .find(|m| m.partition_key.as_deref() == Some(key))
            .unwrap()
    };
    // Two keys in different lanes must meet at the barrier.
    let a = first_of("k0");
    let b = (1..8)
        .map(|k| first_of(&format!("k{k}")))
        .find(|m| lane_of(m, lanes) != lane_of(a, lanes))
        .expect("8 keys over 4 lanes use at least two lanes");
    let failing = batch
        .iter()
        .find(|m| m.partition_key.as_deref() == Some("k3") && m.payload == b"4")
        .unwrap()
        .message_id;
    let h = KeyOrderHandler {
        applied: Default::default(),
        fail_once: std::sync::Mutex::new(Some(failing)),
        meet: tokio::sync::Barrier::new(2),
        meeting: vec![a.message_id, b.message_id],
    };
    let policy = DeliveryPolicy::default();
    let metrics = ConsumerMetrics::default();
    let d = deliver_batch(&inbox, &h, &batch, lanes, &policy, &metrics).await;
    assert_eq!(d.len(), batch.len());
    let mut retried = Vec::new();
    for (m, d) in batch.iter().zip(&d) {
        let seq: u32 = std::str::from_utf8(&m.payload).unwrap().parse().unwrap();
        let held = m.partition_key.as_deref() == Some("k3") && seq >= 4;
        match d {
            Disposition::Retry(_) if held => retried.push(m.clone()),
            Disposition::Ack(_) if !held => {}
            other => panic!("{:?} #{seq}: unexpected {other:?}", m.partition_key),
        }
    }
    assert_eq!(retried.len(), 6);
    // The broker redelivers the held messages; now they apply, still in order.
    for m in &mut retried {
        m.delivery_count = 2;
    }
    let d = deliver_batch(&inbox, &h, &retried, lanes, &policy, &metrics).await;
    assert!(d.iter().all(|d| matches!(d, Disposition::Ack(_))), "{d:?}");
    let applied = h.applied.into_inner().unwrap();
    assert_eq!(applied.len(), 80, "every message applied once");
    for k in 0..8 {
        let seqs: Vec<u32> = applied
            .iter()
            .filter(|(key, _)| *key == format!("k{k}"))
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(seqs, (0..10).collect::<Vec<_>>(), "key k{k} out of order");
    }
    assert_eq!(metrics.failures.load(Ordering::Relaxed), 1);
    fx.cleanup().await;
}
