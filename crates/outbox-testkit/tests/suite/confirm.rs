//! Confirmations end to end (docs/design/DESIGN.md §4, §9): relay → broker → consumer runner → inbox →
//! confirmation → producer, over NATS with PostgreSQL on both sides and over webhooks with SQLite
//! on both sides; rejections and the producer's compensation hook; a lost confirmation recovered
//! by the check-back; a consumer crash between commit and ack; poison messages in the consumer's
//! dead-letter table and their replay. Inbox retention and the upgrade from a v1 schema:
//! `confirm_upgrade.rs`.

use outbox_testkit_macros::suite_test;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::nats::NatsConfirmationSender;
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::store::Store;
use outbox::{
    Backoff, ConfirmPolicy, Confirmation, ConfirmationSender, HandlerError, InboundMessage, Inbox,
    NewMessage, Relay, RelayConfig, RelayHandle, Router, Status, TransportError, Verdict,
};
use outbox_testkit::{
    ConfirmFixture, HookControl, NatsFixture, PgFixture, SqliteFixture, StoreFixture,
    TransportFixture, wait_until,
};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker_support::{EFFECTS, Listener, Running, pg_effects, pg_inbox};
use crate::relay::fast_config;

/// A consumer handler driven by the payload: writes an effect row (no unique key, so a second
/// application shows), then `reject…` refuses it (business rejection), `poison…` fails
/// permanently and `flaky…` transiently, until `fixed` is set.
pub struct ScriptedHandler {
    effects: String,
    pub(crate) fixed: AtomicBool,
    pub(crate) calls: AtomicU64,
}

impl ScriptedHandler {
    pub(crate) fn new(effects: &str) -> Arc<Self> {
        Arc::new(ScriptedHandler {
            effects: effects.into(),
            fixed: AtomicBool::new(false),
            calls: AtomicU64::new(0),
        })
    }

    fn verdict(&self, msg: &InboundMessage) -> Result<(), HandlerError> {
        let p = String::from_utf8_lossy(&msg.payload);
        if p.starts_with("reject") {
            return Err(HandlerError::reject(format!("refused {p}")));
        }
        if self.fixed.load(Ordering::SeqCst) {
            return Ok(());
        }
        if p.starts_with("poison") {
            return Err(HandlerError::permanent(format!("cannot parse {p}")));
        }
        if p.starts_with("flaky") {
            return Err(HandlerError::transient(format!("{p} timed out")));
        }
        Ok(())
    }
}

effect_handler!(ScriptedHandler, sqlx::Postgres, sqlx::PgConnection, "($1, $2)",
    |this, msg| id: msg.message_id.to_string(), then: this.verdict(msg));
effect_handler!(ScriptedHandler, sqlx::Sqlite, sqlx::SqliteConnection, "(?1, ?2)",
    |this, msg| id: msg.message_id.to_string(), then: this.verdict(msg));

/// A confirmation sender that drops the first confirmation of each id in `lose` (as a lost
/// packet), hangs forever on the first confirmation of `hang` (a consumer that dies after its
/// commit, before the ack), and passes everything else to `inner`, recording what it sent.
pub struct FaultySender {
    inner: Arc<dyn ConfirmationSender>,
    pub(crate) lose: Mutex<HashSet<Uuid>>,
    hang: Mutex<HashSet<Uuid>>,
    /// Notified when a hung confirmation was reached (so the inbox commit is done).
    pub hung: tokio::sync::Notify,
    /// Confirmations dropped.
    pub lost: AtomicU64,
    /// Confirmations passed on.
    pub sent: Mutex<Vec<Confirmation>>,
    /// `send_all` calls that passed on more than one confirmation at once.
    pub together: AtomicU64,
}

impl FaultySender {
    pub(crate) fn new(inner: Arc<dyn ConfirmationSender>) -> Arc<Self> {
        Arc::new(FaultySender {
            inner,
            lose: Mutex::default(),
            hang: Mutex::default(),
            hung: tokio::sync::Notify::new(),
            lost: AtomicU64::new(0),
            sent: Mutex::default(),
            together: AtomicU64::new(0),
        })
    }

    pub(crate) fn sent_for(&self, id: Uuid) -> Vec<Verdict> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.message_id == id)
            .map(|c| c.verdict.clone())
            .collect()
    }
}

#[async_trait]
impl ConfirmationSender for FaultySender {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        if self.lose.lock().unwrap().remove(&c.message_id) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        if self.hang.lock().unwrap().remove(&c.message_id) {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        self.inner.send(reply_to, c).await?;
        self.sent.lock().unwrap().push(c.clone());
        Ok(())
    }

    /// Loses as `send` does; passes the rest on through the inner sender's `send_all`.
    async fn send_all(
        &self,
        reply_to: &str,
        cs: &[Confirmation],
    ) -> Vec<Result<(), TransportError>> {
        let lost: Vec<bool> = cs
            .iter()
            .map(|c| self.lose.lock().unwrap().remove(&c.message_id))
            .collect();
        let kept: Vec<Confirmation> = cs
            .iter()
            .zip(&lost)
            .filter(|(_, l)| !**l)
            .map(|(c, _)| c.clone())
            .collect();
        self.lost
            .fetch_add((cs.len() - kept.len()) as u64, Ordering::SeqCst);
        if kept.len() > 1 {
            self.together.fetch_add(1, Ordering::SeqCst);
        }
        let results = self.inner.send_all(reply_to, &kept).await;
        for (c, r) in kept.iter().zip(&results) {
            if r.is_ok() {
                self.sent.lock().unwrap().push(c.clone());
            }
        }
        let mut results = results.into_iter();
        lost.iter()
            .map(|l| {
                if *l {
                    Ok(())
                } else {
                    results.next().unwrap_or(Ok(()))
                }
            })
            .collect()
    }
}

pub(crate) fn confirm_config(name: &str) -> RelayConfig {
    RelayConfig {
        max_check_backs: 3,
        ..fast_config(name)
    }
}

pub(crate) fn fast_retry() -> Backoff {
    Backoff {
        base: Duration::from_millis(50),
        factor: 2.0,
        max: Duration::from_millis(200),
        jitter: 0.2,
    }
}

pub(crate) async fn pg_count(fx: &PgFixture, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(fx.store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Wait until the row of every id has `status`.
pub(crate) async fn wait_status(
    fx: &dyn StoreFixture,
    ids: &[Uuid],
    status: Status,
    timeout: Duration,
) {
    wait_until(
        &format!("{} messages {status}", ids.len()),
        timeout,
        || async {
            let rows = fx.rows().await;
            ids.iter().all(|id| {
                rows.iter()
                    .any(|r| r.message_id == *id && r.status == status.as_i16())
            })
        },
    )
    .await;
}

/// The producer and consumer databases of an end-to-end test, whatever the broker: PostgreSQL
/// producer with a compensation hook, a relay routing every topic with confirmations through
/// `transport` to `destination` (replies to `reply_to`), and an inbox in the same database (its
/// own table), with an `effects` table for the handler.
pub(crate) struct PgProducer {
    pub(crate) fx: PgFixture,
    pub(crate) ctl: Arc<HookControl>,
    /// The store with the hook, for the broker's confirmation listener.
    pub(crate) store: Arc<dyn Store>,
    pub(crate) relay: RelayHandle,
    pub(crate) inbox: Inbox<sqlx::Postgres>,
    pub(crate) effects: String,
}

impl PgProducer {
    pub(crate) async fn start(
        transport: Arc<dyn outbox::Transport>,
        destination: String,
        reply_to: String,
    ) -> PgProducer {
        PgProducer::start_with_timeout(transport, destination, reply_to, Duration::from_secs(1))
            .await
    }

    /// `start` with a confirmation timeout of `timeout`.
    pub(crate) async fn start_with_timeout(
        transport: Arc<dyn outbox::Transport>,
        destination: String,
        reply_to: String,
        timeout: Duration,
    ) -> PgProducer {
        let fx = PgFixture::new().await;
        let ctl = Arc::new(HookControl::default());
        let store = fx.store_with_hook(ctl.clone()).await;
        let effects = pg_effects(&fx, EFFECTS).await;
        let policy = ConfirmPolicy { reply_to, timeout };
        let relay = Relay::builder(store.clone())
            .router(Router::new().route_confirmed("*", transport, destination, policy))
            .config(confirm_config("r1"))
            .build()
            .expect("relay")
            .spawn();
        let inbox = pg_inbox(&fx).await;
        PgProducer {
            fx,
            ctl,
            store,
            relay,
            inbox,
            effects,
        }
    }

    pub(crate) async fn effects_of(&self, id: Uuid) -> i64 {
        pg_count(
            &self.fx,
            &format!(
                "SELECT COUNT(*) FROM {} WHERE message_id = '{id}'",
                self.effects
            ),
        )
        .await
    }

    pub(crate) async fn finish(self) {
        self.relay.shutdown().await.unwrap();
        self.fx.cleanup().await;
    }
}

/// The messages of the confirmed/rejected/lost scenario: 10 `ok-<n>`, 3 `reject-<n>` and one
/// `lost`, whose first confirmation `sender` drops.
pub(crate) fn lost_confirmation_messages(sender: &FaultySender) -> Vec<NewMessage> {
    let mut msgs: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new("orders", format!("ok-{i}")))
        .collect();
    msgs.extend((0..3).map(|i| NewMessage::new("orders", format!("reject-{i}"))));
    msgs.push(NewMessage::new("orders", "lost"));
    sender.lose.lock().unwrap().insert(msgs[13].message_id());
    msgs
}

/// The outcome of that scenario (`ids` as enqueued), awaited up to 15 s: processed messages
/// CONFIRMED with their effect once, rejected ones REJECTED with the compensation once and no
/// effect, the lost confirmation recovered by a check-back (the copy a duplicate at the inbox, its
/// verdict sent again).
pub(crate) async fn check_lost_confirmation_outcome(
    p: &PgProducer,
    ids: &[Uuid],
    sender: &FaultySender,
    metrics: &ConsumerMetrics,
) {
    check_lost_confirmation_outcome_within(p, ids, sender, metrics, Duration::from_secs(15)).await;
}

/// [`check_lost_confirmation_outcome`], the statuses awaited up to `timeout`. The lost
/// message's verdict is sent at least once and always `Processed`: more than once when a copy
/// comes again (one check-back per confirmation timeout of 1 s while the recovered verdict is
/// on its way, or a broker's own redelivery), as at-least-once confirmations allow.
pub(crate) async fn check_lost_confirmation_outcome_within(
    p: &PgProducer,
    ids: &[Uuid],
    sender: &FaultySender,
    metrics: &ConsumerMetrics,
    timeout: Duration,
) {
    let (ok, rejected, lost) = (&ids[..10], &ids[10..13], ids[13]);
    wait_status(&p.fx, ok, Status::Confirmed, timeout).await;
    wait_status(&p.fx, rejected, Status::Rejected, timeout).await;
    wait_status(&p.fx, &[lost], Status::Confirmed, timeout).await;

    for id in rejected {
        assert_eq!(p.fx.compensations(*id).await, 1, "compensation ran once");
        assert_eq!(p.effects_of(*id).await, 0, "a rejection leaves no effect");
        let err = p.fx.row(*id).await.last_error.unwrap_or_default();
        assert!(err.contains("refused reject-"), "{err}");
    }
    assert_eq!(p.ctl.calls.load(Ordering::SeqCst), 3);
    for id in ok.iter().chain([&lost]) {
        assert_eq!(p.effects_of(*id).await, 1, "effect exactly once");
        assert_eq!(p.fx.compensations(*id).await, 0);
    }
    assert_eq!(sender.lost.load(Ordering::SeqCst), 1);
    assert!(
        p.fx.confirm_state(lost).await.check_backs >= 1,
        "the lost confirmation was recovered by a check-back"
    );
    let verdicts = sender.sent_for(lost);
    assert!(
        !verdicts.is_empty() && verdicts.iter().all(|v| *v == Verdict::Processed),
        "{verdicts:?}"
    );
    assert!(metrics.duplicates.load(Ordering::Relaxed) >= 1);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 11);
    assert_eq!(metrics.rejected.load(Ordering::Relaxed), 3);
    assert!(p.relay.metrics().snapshot().checked_back >= 1);
    let stats = p.fx.store().stats().await.unwrap();
    assert_eq!(stats.awaiting_confirmation, 0);
}

/// The broker side of an end-to-end test: a [`PgProducer`] publishing through the broker
/// fixture `F`, and the producer's confirmation listener.
pub(crate) struct BrokerSetup<F> {
    producer: PgProducer,
    pub(crate) broker: F,
    listener: Listener,
}

impl<F> std::ops::Deref for BrokerSetup<F> {
    type Target = PgProducer;

    fn deref(&self) -> &PgProducer {
        &self.producer
    }
}

impl<F: TransportFixture> BrokerSetup<F> {
    /// Start the producer publishing through `broker` to `destination` (replies to `reply_to`)
    /// and the listener `listen` makes with the producer's store and the stop token.
    pub(crate) async fn start<L>(
        broker: F,
        destination: String,
        reply_to: &str,
        listen: impl FnOnce(Arc<dyn Store>, CancellationToken) -> L,
    ) -> BrokerSetup<F>
    where
        L: std::future::Future<Output = Result<outbox::ConfirmReport, outbox::ConfigError>>
            + Send
            + 'static,
    {
        let producer =
            PgProducer::start(broker.transport(), destination, reply_to.to_owned()).await;
        let store = producer.store.clone();
        let listener = Listener::spawn(|stop| listen(store, stop));
        BrokerSetup {
            producer,
            broker,
            listener,
        }
    }

    /// Stop the listener (it must have confirmed or rejected something), clean the broker's
    /// resources and the producer's.
    pub(crate) async fn finish(self) {
        let report = self.listener.report().await;
        assert!(report.confirmed + report.rejected > 0, "{report:?}");
        self.broker.cleanup().await;
        self.producer.finish().await;
    }
}

/// The NATS side of a test: a stream of its own.
pub(crate) type NatsSetup = BrokerSetup<NatsFixture>;

impl NatsSetup {
    pub(crate) async fn new() -> NatsSetup {
        let nats = NatsFixture::new().await;
        let reply = format!("{}_confirm.producer", nats.prefix);
        let destination = nats.topic_destination();
        let client = outbox_testkit::nats_client().await;
        BrokerSetup::start(nats, destination, &reply.clone(), |store, stop| {
            outbox::confirm::nats::listen(client, reply, "producer".into(), store, stop)
        })
        .await
    }

    /// The consumer's confirmation sender: NATS, on a client of its own.
    pub(crate) async fn sender() -> Arc<dyn ConfirmationSender> {
        Arc::new(NatsConfirmationSender::new(
            outbox_testkit::nats_client().await,
        ))
    }

    pub(crate) fn consumer_config(
        &self,
        sender: Arc<dyn ConfirmationSender>,
    ) -> NatsConsumerConfig {
        let mut c = NatsConsumerConfig::new(self.broker.stream.clone(), "billing")
            .with_confirmations(sender);
        c.runner.retry = fast_retry();
        c.ack_wait = Duration::from_secs(1);
        c.runner.maintenance_interval = Duration::from_millis(200);
        c
    }

    pub(crate) fn spawn_consumer(
        &self,
        config: NatsConsumerConfig,
        handler: Arc<ScriptedHandler>,
    ) -> Running {
        Running::start(|metrics, cancel| {
            tokio::spawn(outbox::consumer::nats::run(
                self.broker.transport.jetstream().clone(),
                config,
                self.inbox.clone(),
                handler,
                metrics,
                cancel,
            ))
        })
    }
}

/// NATS, PostgreSQL on both sides: every processed message ends CONFIRMED; rejected ones end
/// REJECTED with the compensation run once each and no effect; a lost confirmation is recovered
/// by the check-back (the redelivered copy is a duplicate at the inbox, its verdict is sent
/// again), and its effect happened exactly once.
#[suite_test(workers = 4)]
async fn nats_postgres_confirmed_rejected_and_lost_confirmation() {
    let s = NatsSetup::new().await;
    let sender = FaultySender::new(NatsSetup::sender().await);
    let msgs = lost_confirmation_messages(&sender);
    let handler = ScriptedHandler::new(&s.effects);
    let consumer = s.spawn_consumer(s.consumer_config(sender.clone()), handler);
    let ids = s.fx.enqueue_commit(msgs).await.unwrap();
    check_lost_confirmation_outcome(&s, &ids, &sender, &consumer.metrics).await;
    consumer.stop().await;
    s.finish().await;
}

/// NATS consumer crash between the inbox commit and the broker ack: the effect is committed, the
/// ack and the confirmation are never sent; after a restart the broker redelivers, the inbox sees
/// a duplicate, the confirmation goes out and the message ends CONFIRMED, effect once.
#[suite_test(workers = 4)]
async fn nats_consumer_crash_between_commit_and_ack() {
    let s = NatsSetup::new().await;
    let real = NatsSetup::sender().await;
    let sender = FaultySender::new(real.clone());
    let msg = NewMessage::new("orders", "crash");
    let id = msg.message_id();
    sender.hang.lock().unwrap().insert(id);
    let handler = ScriptedHandler::new(&s.effects);
    let consumer = s.spawn_consumer(s.consumer_config(sender.clone()), handler.clone());
    s.fx.enqueue_commit(vec![msg]).await.unwrap();
    consumer
        .crash_at(
            "the consumer to commit and reach its confirmation",
            Duration::from_secs(10),
            sender.hung.notified(),
        )
        .await;
    assert_eq!(s.effects_of(id).await, 1, "the commit happened");
    assert_eq!(
        s.inbox.verdict(id).await.unwrap(),
        Some(Verdict::Processed),
        "the verdict is recorded"
    );
    // No confirmation was sent (under load the deadline may already have passed and the
    // row been checked back; it is still not confirmed).
    assert_ne!(
        s.fx.row(id).await.status,
        Status::Confirmed.as_i16(),
        "no confirmation was sent"
    );

    // Restart with a working sender: the unacked copy comes back after ack_wait.
    let consumer = s.spawn_consumer(s.consumer_config(real), handler.clone());
    wait_status(&s.fx, &[id], Status::Confirmed, Duration::from_secs(15)).await;
    assert_eq!(s.effects_of(id).await, 1, "effect exactly once");
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1, "handler ran once");
    assert!(consumer.metrics.duplicates.load(Ordering::Relaxed) >= 1);
    assert!(consumer.metrics.confirmations_sent.load(Ordering::Relaxed) >= 1);
    consumer.stop().await;
    s.finish().await;
}

/// Poison messages at a NATS consumer: a permanent failure is dead-lettered at once, a transient
/// one after `max_deliveries`; both land in `<inbox>_dlq` with their error, the producer gets a
/// `Rejected` confirmation (REJECTED, compensation once), and the other messages keep flowing.
/// An operator replay with a now-working handler applies each once and empties the DLQ.
#[suite_test(workers = 4)]
async fn nats_poison_messages_dead_lettered_and_replayed() {
    let s = NatsSetup::new().await;
    let sender = FaultySender::new(NatsSetup::sender().await);
    let handler = ScriptedHandler::new(&s.effects);
    let mut config = s.consumer_config(sender.clone());
    config.runner.max_deliveries = 3;
    let consumer = s.spawn_consumer(config, handler.clone());
    let metrics = consumer.metrics.clone();
    let mut msgs = vec![
        NewMessage::new("orders", "poison-1"),
        NewMessage::new("orders", "flaky-1"),
    ];
    msgs.extend((0..8).map(|i| NewMessage::new("orders", format!("ok-{i}"))));
    let ids = s.fx.enqueue_commit(msgs).await.unwrap();
    let (poison, flaky, ok) = (ids[0], ids[1], &ids[2..]);

    wait_status(&s.fx, ok, Status::Confirmed, Duration::from_secs(15)).await;
    wait_status(
        &s.fx,
        &[poison, flaky],
        Status::Rejected,
        Duration::from_secs(15),
    )
    .await;
    let dlq = s.inbox.dead_letters(100).await.unwrap();
    assert_eq!(dlq.len(), 2, "{dlq:?}");
    let p = dlq.iter().find(|d| d.message.message_id == poison).unwrap();
    assert!(p.error.contains("cannot parse poison-1"), "{}", p.error);
    assert_eq!(
        p.deliveries, 1,
        "a permanent failure is dead-lettered at once"
    );
    assert_eq!(p.message.payload, b"poison-1");
    let f = dlq.iter().find(|d| d.message.message_id == flaky).unwrap();
    assert!(f.error.contains("flaky-1 timed out"), "{}", f.error);
    assert_eq!(f.deliveries, 3, "transient failures until max_deliveries");
    assert!(!p.replay_requested && !f.replay_requested);
    for id in [poison, flaky] {
        assert_eq!(s.fx.compensations(id).await, 1);
        assert_eq!(s.effects_of(id).await, 0);
        let err = s.fx.row(id).await.last_error.unwrap_or_default();
        assert!(err.contains("dead-lettered"), "{err}");
        assert!(matches!(
            s.inbox.verdict(id).await.unwrap(),
            Some(Verdict::Rejected { .. })
        ));
    }
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 2);
    for id in ok {
        assert_eq!(s.effects_of(*id).await, 1);
    }

    // Replay with the handler fixed.
    handler.fixed.store(true, Ordering::SeqCst);
    assert!(s.inbox.request_replay(poison).await.unwrap());
    assert!(s.inbox.request_replay(flaky).await.unwrap());
    assert!(!s.inbox.request_replay(Uuid::now_v7()).await.unwrap());
    wait_until("replays to run", Duration::from_secs(10), || async {
        s.inbox.dead_letters(100).await.unwrap().is_empty()
    })
    .await;
    // The runner counts a replay after the transaction that removed its dead letter committed.
    wait_until("the replays counted", Duration::from_secs(5), || async {
        metrics.replayed.load(Ordering::Relaxed) >= 2
    })
    .await;
    assert_eq!(metrics.replayed.load(Ordering::Relaxed), 2);
    for id in [poison, flaky] {
        assert_eq!(s.effects_of(id).await, 1, "replay applied once");
        assert_eq!(s.inbox.verdict(id).await.unwrap(), Some(Verdict::Processed));
        wait_until(
            "the replay's confirmation",
            Duration::from_secs(5),
            || async { sender.sent_for(id).last() == Some(&Verdict::Processed) },
        )
        .await;
        // The producer's verdict was final: the late Processed is a duplicate there.
        assert_eq!(s.fx.row(id).await.status, Status::Rejected.as_i16());
        assert_eq!(s.fx.compensations(id).await, 1);
    }
    // A second replay request finds nothing; nothing runs twice.
    assert!(!s.inbox.request_replay(poison).await.unwrap());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.effects_of(poison).await, 1);
    consumer.stop().await;
    s.finish().await;
}

/// Finding D2 (docs/lease-model.md) through the relay: a message acknowledged at its last
/// attempt and then checked back gets a new round of attempts. With `max_attempts = 2`: the
/// first publication is acknowledged (SENT, attempts 1); no confirmation comes, the check-back
/// makes it PENDING with attempts 0; the copy's first publication fails retryably and is retried
/// (before the fix the count was kept, so this failure was attempt 2 and dead-lettered it); the
/// retry is acknowledged (SENT, attempts 2); after `max_check_backs` it is FAILED "unconfirmed".
async fn check_back_starts_a_new_round_of_attempts<F: StoreFixture + ConfirmFixture>(fx: &F) {
    let mem = Arc::new(outbox::MemoryTransport::new());
    let policy = ConfirmPolicy {
        reply_to: "nobody.answers".into(),
        timeout: Duration::from_secs(1),
    };
    let router = Router::new().route_confirmed("*", mem.clone(), "{topic}", policy);
    let config = RelayConfig {
        max_attempts: 2,
        max_check_backs: 1,
        ..fast_config("r1")
    };
    let relay = Relay::builder(fx.store())
        .router(router)
        .config(config)
        .build()
        .expect("relay config")
        .spawn();
    let id = fx.commit_one(NewMessage::new("t", "m")).await;
    let copies = || {
        mem.delivered()
            .iter()
            .filter(|d| d.message.message_id == id)
            .count()
    };
    // SENT is recorded after the broker's ack; the check-back comes a second later at the
    // earliest, so the failure below is armed before the copy is published.
    wait_status(fx, &[id], Status::Sent, Duration::from_secs(10)).await;
    assert_eq!(copies(), 1);
    assert_eq!(fx.row(id).await.attempts, 1);
    mem.fail_next(id, vec![outbox::TransportErrorKind::Retryable]);
    wait_status(fx, &[id], Status::Failed, Duration::from_secs(20)).await;
    relay.shutdown().await.expect("relay shutdown");
    let row = fx.row(id).await;
    let error = row.last_error.unwrap_or_default();
    assert!(error.starts_with("unconfirmed"), "dead-lettered: {error}");
    assert_eq!(
        row.attempts, 2,
        "the check-back's round: a retry, then acknowledged"
    );
    assert_eq!(
        copies(),
        2,
        "published, then published again after the check-back"
    );
    assert_eq!(fx.confirm_state(id).await.check_backs, 1);
}

#[suite_test]
async fn sqlite_check_back_starts_a_new_round_of_attempts(fx: SqliteFixture) {
    check_back_starts_a_new_round_of_attempts(&fx).await;
}

#[suite_test]
async fn pg_check_back_starts_a_new_round_of_attempts(fx: PgFixture) {
    check_back_starts_a_new_round_of_attempts(&fx).await;
}
