//! The consumer conformance suite: the same properties, run against every broker's production
//! consumer runner (`outbox::consumer::<broker>::run`, the generic runner over that broker's
//! `Source`) on the real broker, as the store suite runs on every database.
//!
//! Properties:
//! - `applies_once_and_acks_after_commit`: every message is applied once; after a restart nothing
//!   acknowledged comes back;
//! - `redelivers_after_a_transient_error`: a handler failing twice sees the message a third time,
//!   with a delivery count of 3, and applies it once;
//! - `dead_letters_at_max_deliveries`: a message that keeps failing is in the consumer's
//!   dead-letter table after `max_deliveries` deliveries, acknowledged (not delivered again after
//!   a restart);
//! - `confirms_the_verdict`: applied and rejected messages are confirmed to their reply
//!   destination with their verdict;
//! - `keeps_per_key_order`: with 4 lanes, each key's messages are applied in publication order;
//! - `survives_a_crash_between_commit_and_ack`: the consumer dies (its task aborted and its
//!   connections cut) after the inbox commit and before the ack; the broker delivers the message
//!   again, the inbox recognises it, the effect stays single and the verdict is confirmed again;
//! - `survives_crashes_in_an_inbox_batch`: with `inbox_batch` 16, the consumer dies inside a
//!   batch's transaction (its handler hangs on the fifth message; what ran with it in that
//!   transaction leaves nothing), then again after a commit and before its acks; after the
//!   second restart every message is applied once, what was committed comes back as duplicates
//!   and each message's verdict is confirmed;
//! - `contains_a_panicking_handler`: a handler that panics on one message is contained: that
//!   message is dead-lettered at `max_deliveries` with the panic as its error, the runner goes on,
//!   and the messages behind it (its own key's included) are applied;
//! - `rejects_malformed_input`: a message without outbox headers is counted and taken out of the
//!   way; the messages behind it are applied.
//!
//! The consumer's connections go through a [`FaultProxy`], so a "crash" cuts them as a dying
//! process would.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::HEADER_REPLY_TO;
use outbox::consumer::ConsumerMetrics;
use outbox::error::TransportError;
use outbox::{
    ConfigError, Confirmation, ConfirmationSender, HandlerError, InboundMessage, Inbox, Message,
    Transport, Verdict,
};
use outbox_testkit::{FaultProxy, SqliteFixture, claimed_message, publish_to, wait_until, within};
use sqlx::SqliteConnection;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::confirm::fast_retry;

type Runner = JoinHandle<Result<(), ConfigError>>;

/// What one broker contributes to the suite.
#[async_trait]
trait Broker: Send + Sync + Sized + 'static {
    /// Fresh broker resources (stream, queue, stream key) and a fault proxy for the consumer.
    async fn new() -> Self;
    /// The transport the relay would publish with, and the destination the runner consumes.
    fn transport(&self) -> Arc<dyn Transport>;
    fn destination(&self) -> String;
    /// Put a message without outbox headers where the runner consumes.
    async fn publish_garbage(&self);
    /// Start the broker's production runner.
    fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner;
    /// The proxy in front of the broker for the consumer's connections, where the consumer's
    /// connections can go through one (a Kafka client connects to the brokers the cluster
    /// advertises, not to the proxy).
    fn proxy(&self) -> Option<&FaultProxy> {
        None
    }
}

/// The settings every runner takes.
struct Settings {
    max_deliveries: u32,
    concurrency: usize,
    inbox_batch: usize,
    confirmations: Option<Arc<dyn ConfirmationSender>>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
}

impl Settings {
    fn new() -> Settings {
        Settings {
            max_deliveries: 5,
            concurrency: 1,
            inbox_batch: 1,
            confirmations: None,
            metrics: Arc::default(),
            cancel: CancellationToken::new(),
        }
    }
}

/// A handler recording each application (message id, partition key, payload, delivery count) in
/// the consumer's transaction; scripted to fail transiently a number of times, or to reject.
#[derive(Default)]
struct Script {
    fail_times: Mutex<HashMap<Uuid, u32>>,
    reject: Mutex<Vec<Uuid>>,
    panic: Mutex<Vec<Uuid>>,
    seen: Mutex<HashMap<Uuid, Vec<u32>>>,
    /// Hang (for ever) in the handler of this message, once, after telling `hung`: the moment
    /// inside an inbox transaction, before its commit.
    hang: Mutex<Option<Uuid>>,
    hung: Notify,
}

impl Script {
    fn deliveries(&self, id: Uuid) -> Vec<u32> {
        self.seen
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .unwrap_or_default()
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for Script {
    async fn handle(
        &self,
        conn: &mut SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.seen
            .lock()
            .unwrap()
            .entry(msg.message_id)
            .or_default()
            .push(msg.delivery_count);
        let hang = {
            let mut hang = self.hang.lock().unwrap();
            *hang == Some(msg.message_id) && hang.take().is_some()
        };
        if hang {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        if self.panic.lock().unwrap().contains(&msg.message_id) {
            panic!("scripted panic in the handler");
        }
        if self.reject.lock().unwrap().contains(&msg.message_id) {
            return Err(HandlerError::reject("out of stock"));
        }
        if let Some(n) = self.fail_times.lock().unwrap().get_mut(&msg.message_id)
            && *n > 0
        {
            *n -= 1;
            return Err(HandlerError::transient("scripted failure"));
        }
        sqlx::query("INSERT INTO effects (message_id, key, payload) VALUES (?1, ?2, ?3)")
            .bind(msg.message_id.to_string())
            .bind(msg.partition_key.clone())
            .bind(&msg.payload)
            .execute(&mut *conn)
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// Records confirmations; optionally hangs on the first one after telling the test (the moment
/// between the inbox commit and the ack).
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<(String, Confirmation)>>,
    hang_first: AtomicBool,
    reached: Notify,
}

#[async_trait]
impl ConfirmationSender for Recorder {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        if self.hang_first.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            std::future::pending::<()>().await;
        }
        self.sent
            .lock()
            .unwrap()
            .push((reply_to.to_owned(), c.clone()));
        Ok(())
    }
}

impl Recorder {
    fn verdicts(&self, id: Uuid) -> Vec<Verdict> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, c)| c.message_id == id)
            .map(|(_, c)| c.verdict.clone())
            .collect()
    }
}

/// The consumer's database: an inbox and an `effects` table.
struct Consumer {
    db: SqliteFixture,
    inbox: Inbox<sqlx::Sqlite>,
}

impl Consumer {
    async fn new() -> Consumer {
        let db = SqliteFixture::new().await;
        sqlx::query("CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, key TEXT, payload BLOB)")
            .execute(db.store.pool())
            .await
            .unwrap();
        let inbox =
            Inbox::<sqlx::Sqlite>::new(db.store.pool().clone(), "consumer_inbox", "conformance")
                .unwrap();
        inbox.migrate().await.unwrap();
        Consumer { db, inbox }
    }

    /// Effects in the order applied: (message id, key, payload).
    async fn effects(&self) -> Vec<(String, Option<String>, Vec<u8>)> {
        sqlx::query_as("SELECT message_id, key, payload FROM effects ORDER BY n")
            .fetch_all(self.db.store.pool())
            .await
            .unwrap()
    }

    async fn effects_of(&self, id: Uuid) -> usize {
        let id = id.to_string();
        self.effects().await.iter().filter(|e| e.0 == id).count()
    }
}

fn message(key: Option<&str>, payload: &str) -> Message {
    let mut m = claimed_message("orders", payload.as_bytes().to_vec());
    m.partition_key = key.map(str::to_owned);
    m
}

/// `message` with a reply destination.
fn replying(key: Option<&str>, payload: &str) -> Message {
    let mut m = message(key, payload);
    m.headers.insert(HEADER_REPLY_TO.into(), "replies".into());
    m
}

async fn stop(s: &Settings, runner: Runner) {
    s.cancel.cancel();
    within("the runner to stop", Duration::from_secs(15), runner)
        .await
        .expect("runner task")
        .expect("runner result");
}

const WAIT: Duration = Duration::from_secs(30);

/// One property's broker, consumer database and scripted handler.
struct Rig<B> {
    b: B,
    c: Consumer,
    script: Arc<Script>,
}

impl<B: Broker> Rig<B> {
    async fn new() -> Rig<B> {
        Rig {
            b: B::new().await,
            c: Consumer::new().await,
            script: Arc::default(),
        }
    }

    async fn publish(&self, msgs: &[Message]) {
        let dest = self.b.destination();
        let results = publish_to(self.b.transport().as_ref(), msgs, |_| dest.as_str()).await;
        for r in results {
            r.expect("publish to the broker");
        }
    }

    /// Start the broker's runner with `s` (sharing its metrics and cancel token).
    fn spawn(&self, s: &Settings) -> Runner {
        self.b.spawn(
            s.clone_settings(),
            self.c.inbox.clone(),
            self.script.clone(),
        )
    }

    /// Run the runner with `s` until `cond` holds, then stop it.
    async fn run_until<F, Fut>(&self, s: &Settings, what: &str, timeout: Duration, cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let runner = self.spawn(s);
        wait_until(what, timeout, cond).await;
        stop(s, runner).await;
    }

    /// A restart: publish a marker, run fresh settings until the marker is applied, and return
    /// them (their metrics show what else came back).
    async fn restart_until_a_marker(&self) -> Settings {
        let s = Settings::new();
        let marker = message(None, "marker");
        self.publish(std::slice::from_ref(&marker)).await;
        self.run_until(&s, "the marker", WAIT, || async {
            self.c.effects_of(marker.message_id).await == 1
        })
        .await;
        s
    }

    /// The dead letters: `want` of them, each with `deliveries` deliveries.
    async fn dead_letters(&self, want: &[&Message], deliveries: u32) -> Vec<outbox::DeadLetter> {
        let dead = self.c.inbox.dead_letters(10).await.unwrap();
        assert_eq!(dead.len(), want.len());
        for (d, m) in dead.iter().zip(want) {
            assert_eq!(d.message.message_id, m.message_id);
            assert_eq!(d.deliveries, deliveries);
        }
        dead
    }
}

async fn applies_once_and_acks_after_commit<B: Broker>() {
    let r = Rig::<B>::new().await;
    let msgs: Vec<Message> = (0..20).map(|i| message(None, &format!("m{i}"))).collect();
    r.publish(&msgs).await;
    r.run_until(&Settings::new(), "20 effects", WAIT, || async {
        r.c.effects().await.len() == 20
    })
    .await;
    // A restart delivers nothing already acknowledged: only the new marker arrives.
    let s = r.restart_until_a_marker().await;
    assert_eq!(r.c.effects().await.len(), 21);
    assert_eq!(
        s.metrics.duplicates.load(Ordering::Relaxed),
        0,
        "an acknowledged message came back"
    );
    for m in &msgs {
        assert_eq!(
            r.script.deliveries(m.message_id),
            vec![1],
            "{}",
            m.message_id
        );
    }
}

async fn redelivers_after_a_transient_error<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = message(None, "flaky");
    r.script.fail_times.lock().unwrap().insert(m.message_id, 2);
    r.publish(std::slice::from_ref(&m)).await;
    let s = Settings::new();
    r.run_until(&s, "the effect", WAIT, || async {
        r.c.effects_of(m.message_id).await == 1
    })
    .await;
    assert_eq!(r.script.deliveries(m.message_id), vec![1, 2, 3]);
    assert_eq!(r.c.effects_of(m.message_id).await, 1);
    assert_eq!(s.metrics.failures.load(Ordering::Relaxed), 2);
}

async fn dead_letters_at_max_deliveries<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = message(None, "poison");
    r.script
        .fail_times
        .lock()
        .unwrap()
        .insert(m.message_id, u32::MAX);
    r.publish(std::slice::from_ref(&m)).await;
    let mut s = Settings::new();
    s.max_deliveries = 3;
    r.run_until(&s, "the dead letter", WAIT, || async {
        !r.c.inbox.dead_letters(10).await.unwrap().is_empty()
    })
    .await;
    r.dead_letters(&[&m], 3).await;
    assert_eq!(r.script.deliveries(m.message_id), vec![1, 2, 3]);
    // Acknowledged: a restart does not deliver it again.
    r.restart_until_a_marker().await;
    assert_eq!(
        r.script.deliveries(m.message_id).len(),
        3,
        "the dead letter came back"
    );
}

async fn confirms_the_verdict<B: Broker>() {
    let r = Rig::<B>::new().await;
    let ok = replying(None, "ok");
    let refused = replying(None, "refused");
    r.script.reject.lock().unwrap().push(refused.message_id);
    let silent = message(None, "no reply destination");
    r.publish(&[ok.clone(), refused.clone(), silent.clone()])
        .await;
    let recorder = Arc::new(Recorder::default());
    let s = Settings::confirming_to(&recorder);
    let runner = r.spawn(&s);
    wait_until("two confirmations", WAIT, || async {
        recorder.sent.lock().unwrap().len() == 2
    })
    .await;
    wait_until("the silent message", WAIT, || async {
        r.c.effects_of(silent.message_id).await == 1
    })
    .await;
    stop(&s, runner).await;
    assert_eq!(recorder.verdicts(ok.message_id), vec![Verdict::Processed]);
    assert_eq!(
        recorder.verdicts(refused.message_id),
        vec![Verdict::Rejected {
            reason: "out of stock".into()
        }]
    );
    assert!(
        recorder
            .sent
            .lock()
            .unwrap()
            .iter()
            .all(|(to, c)| to == "replies" && c.consumer == "conformance")
    );
    assert_eq!(
        recorder.sent.lock().unwrap().len(),
        2,
        "a message without a reply destination was confirmed"
    );
}

async fn contains_a_panicking_handler<B: Broker>() {
    let r = Rig::<B>::new().await;
    let bad = message(Some("k"), "panics");
    let after = message(Some("k"), "after the panic, same key");
    let other = message(Some("other"), "another key");
    r.script.panic.lock().unwrap().push(bad.message_id);
    r.publish(&[bad.clone(), after.clone(), other.clone()])
        .await;
    let mut s = Settings::new();
    s.max_deliveries = 3;
    r.run_until(
        &s,
        "the dead letter and both other effects",
        WAIT,
        || async {
            !r.c.inbox.dead_letters(10).await.unwrap().is_empty()
                && r.c.effects_of(after.message_id).await == 1
                && r.c.effects_of(other.message_id).await == 1
        },
    )
    .await;
    let dead = r.dead_letters(&[&bad], 3).await;
    assert!(dead[0].error.contains("panicked"), "{}", dead[0].error);
    assert_eq!(r.c.effects_of(bad.message_id).await, 0);
}

/// `n` messages over `keys` in turn, payloads numbered in publication order.
fn keyed(n: usize, keys: &[&str]) -> Vec<Message> {
    (0..n)
        .map(|i| message(Some(keys[i % keys.len()]), &format!("{i:03}")))
        .collect()
}

async fn keeps_per_key_order<B: Broker>() {
    let r = Rig::<B>::new().await;
    let keys = ["k0", "k1", "k2", "k3", "k4"];
    let msgs = keyed(100, &keys);
    r.publish(&msgs).await;
    let mut s = Settings::new();
    s.concurrency = 4;
    r.run_until(&s, "100 effects", WAIT, || async {
        r.c.effects().await.len() == 100
    })
    .await;
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (_, key, payload) in r.c.effects().await {
        by_key
            .entry(key.expect("key"))
            .or_default()
            .push(String::from_utf8(payload).unwrap());
    }
    assert_eq!(by_key.len(), keys.len());
    for (key, seq) in by_key {
        let mut sorted = seq.clone();
        sorted.sort();
        assert_eq!(seq, sorted, "key {key} applied out of order");
        assert_eq!(seq.len(), 20);
    }
}

/// `runner.inbox_batch`: the runner applies many messages per inbox transaction, and a message
/// whose handler fails, rejects or panics in the middle of a batch costs the others nothing:
/// every other message is applied exactly once, the failing ones end as they would alone
/// (applied after retries, rejected, dead-lettered), and a key without failures keeps its order.
async fn applies_in_batches_around_failures<B: Broker>() {
    let r = Rig::<B>::new().await;
    let msgs = keyed(60, &["k0", "k1", "k2"]);
    let (flaky, refused, poison) = (&msgs[10], &msgs[20], &msgs[31]);
    r.script
        .fail_times
        .lock()
        .unwrap()
        .insert(flaky.message_id, 2);
    r.script.reject.lock().unwrap().push(refused.message_id);
    r.script.panic.lock().unwrap().push(poison.message_id);
    r.publish(&msgs).await;
    let mut s = Settings::new();
    s.inbox_batch = 16;
    s.concurrency = 2;
    s.max_deliveries = 3;
    r.run_until(
        &s,
        "58 effects, one rejection, one dead letter",
        WAIT,
        || async {
            r.c.effects().await.len() >= 58
                && s.metrics.rejected.load(Ordering::Relaxed) == 1
                && s.metrics.dead_lettered.load(Ordering::Relaxed) == 1
        },
    )
    .await;
    for m in &msgs {
        let want =
            usize::from(m.message_id != refused.message_id && m.message_id != poison.message_id);
        assert_eq!(
            r.c.effects_of(m.message_id).await,
            want,
            "effects of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
    }
    assert_eq!(r.c.effects().await.len(), 58);
    let k0: Vec<Vec<u8>> =
        r.c.effects()
            .await
            .into_iter()
            .filter(|(_, key, _)| key.as_deref() == Some("k0"))
            .map(|(_, _, payload)| payload)
            .collect();
    let mut sorted = k0.clone();
    sorted.sort();
    assert_eq!(k0, sorted, "key k0 (no failures) applied out of order");
    let dead = r.c.inbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.message_id, poison.message_id);
    assert!(dead[0].error.contains("panicked"), "{}", dead[0].error);
    assert_eq!(
        r.c.inbox.verdict(refused.message_id).await.unwrap(),
        Some(Verdict::Rejected {
            reason: "out of stock".into()
        })
    );
    assert!(
        s.metrics.inbox_batches.load(Ordering::Relaxed) > 0,
        "no inbox transaction held more than one message"
    );
    assert!(
        s.metrics.inbox_batch_splits.load(Ordering::Relaxed) >= 1,
        "no batch was split at a failing handler"
    );
}

async fn survives_a_crash_between_commit_and_ack<B: Broker>() {
    let r = Rig::<B>::new().await;
    let m = replying(None, "crash");
    r.publish(std::slice::from_ref(&m)).await;
    let recorder = Arc::new(Recorder::default());
    recorder.hang_first.store(true, Ordering::SeqCst);
    let reached = recorder.reached.notified();
    let runner = r.spawn(&Settings::confirming_to(&recorder));
    within("the commit", WAIT, reached).await;
    // Committed, not acknowledged: the process dies.
    assert_eq!(r.c.effects_of(m.message_id).await, 1);
    crash(&r.b, runner).await;
    let s = Settings::confirming_to(&recorder);
    r.run_until(
        &s,
        "the confirmation after the restart",
        Duration::from_secs(60),
        || async { !recorder.verdicts(m.message_id).is_empty() },
    )
    .await;
    assert_eq!(r.c.effects_of(m.message_id).await, 1, "applied twice");
    assert_eq!(recorder.verdicts(m.message_id), vec![Verdict::Processed]);
    assert_eq!(s.metrics.duplicates.load(Ordering::Relaxed), 1);
    assert_eq!(
        r.script.deliveries(m.message_id).len(),
        1,
        "the handler ran again"
    );
}

/// Abort `runner` as a dying process would end: its task dropped mid-await (an open inbox
/// transaction rolls back with its connection) and its broker connections cut.
async fn crash<B: Broker>(b: &B, runner: Runner) {
    runner.abort();
    let _ = runner.await;
    if let Some(proxy) = b.proxy() {
        proxy.set_blocked(true);
        proxy.set_blocked(false);
    }
}

async fn survives_crashes_in_an_inbox_batch<B: Broker>() {
    let r = Rig::<B>::new().await;
    // One partition key: in order on every broker (one Kafka partition, one lane), so the four
    // messages before the fifth reach the handler before it.
    let msgs: Vec<Message> = (0..24)
        .map(|i| replying(Some("batch"), &format!("{i:02}")))
        .collect();
    r.publish(&msgs).await;
    let recorder = Arc::new(Recorder::default());
    let settings = || {
        let mut s = Settings::confirming_to(&recorder);
        s.inbox_batch = 16;
        s
    };

    // 1. Death inside a batch's transaction: nothing of it is committed.
    *r.script.hang.lock().unwrap() = Some(msgs[4].message_id);
    let hung = r.script.hung.notified();
    let runner = r.spawn(&settings());
    within("the handler of the fifth message", WAIT, hung).await;
    crash(&r.b, runner).await;
    assert_eq!(r.c.effects_of(msgs[4].message_id).await, 0);
    // The four before it ran first, in its batch or in batches of their own that committed.
    // Those of its batch left nothing.
    let mut rolled_back = 0;
    for m in &msgs[..4] {
        assert!(!r.script.deliveries(m.message_id).is_empty());
        if r.c.effects_of(m.message_id).await == 0 {
            rolled_back += 1;
        }
    }
    assert!(
        rolled_back >= 1,
        "the fifth message was not applied in a batch with those before it"
    );

    // 2. Death after a batch's commit, before its acks (the first confirmation hangs). Messages
    // applied in step 1 in a batch of their own before the fifth's were acknowledged then: they
    // are not counted as committed here.
    let applied_before = r.c.effects().await.len();
    recorder.hang_first.store(true, Ordering::SeqCst);
    let reached = recorder.reached.notified();
    let s = settings();
    let runner = r.spawn(&s);
    within("a commit", WAIT, reached).await;
    let committed = r.c.effects().await.len() - applied_before;
    crash(&r.b, runner).await;
    let batches = s.metrics.inbox_batches.load(Ordering::Relaxed);

    // 3. The restart applies the rest and recognises the committed batch.
    let s = settings();
    r.run_until(
        &s,
        "every message confirmed",
        Duration::from_secs(60),
        || async {
            msgs.iter()
                .all(|m| !recorder.verdicts(m.message_id).is_empty())
        },
    )
    .await;
    for m in &msgs {
        assert_eq!(
            r.c.effects_of(m.message_id).await,
            1,
            "effects of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
        assert!(
            recorder
                .verdicts(m.message_id)
                .iter()
                .all(|v| *v == Verdict::Processed),
            "verdicts of {:?}",
            String::from_utf8_lossy(&m.payload)
        );
    }
    assert!(
        committed >= 1 && s.metrics.duplicates.load(Ordering::Relaxed) >= committed as u64,
        "{} duplicates after the restart, {committed} messages committed but not acknowledged",
        s.metrics.duplicates.load(Ordering::Relaxed)
    );
    assert!(
        batches + s.metrics.inbox_batches.load(Ordering::Relaxed) >= 1,
        "no inbox transaction after the first crash held more than one message"
    );
}

async fn rejects_malformed_input<B: Broker>() {
    let r = Rig::<B>::new().await;
    r.b.publish_garbage().await;
    let after = message(None, "after the garbage");
    r.publish(std::slice::from_ref(&after)).await;
    let s = Settings::new();
    // Both, in either order: a broker with several queues per topic (RocketMQ) may deliver the
    // message before the garbage.
    r.run_until(
        &s,
        "the garbage and the message behind it",
        WAIT,
        || async {
            r.c.effects_of(after.message_id).await == 1
                && s.metrics.malformed.load(Ordering::Relaxed) == 1
        },
    )
    .await;
    assert_eq!(s.metrics.malformed.load(Ordering::Relaxed), 1);
    // Taken out of the way: a restart does not see it again.
    let s = r.restart_until_a_marker().await;
    assert_eq!(
        s.metrics.malformed.load(Ordering::Relaxed),
        0,
        "the garbage came back"
    );
}

impl Settings {
    /// Fresh settings sending confirmations to `recorder`.
    fn confirming_to(recorder: &Arc<Recorder>) -> Settings {
        let mut s = Settings::new();
        s.confirmations = Some(recorder.clone() as Arc<dyn ConfirmationSender>);
        s
    }

    /// The runner settings of a broker's config: these, fast retries, no inbox retention.
    fn runner(&self) -> outbox::consumer::RunnerSettings {
        outbox::consumer::RunnerSettings {
            retry: fast_retry(),
            max_deliveries: self.max_deliveries,
            concurrency: self.concurrency,
            inbox_batch: self.inbox_batch,
            confirmations: self.confirmations.clone(),
            dedup_window: None,
            ..Default::default()
        }
    }

    /// The same settings sharing the metrics, cancel token and confirmations.
    fn clone_settings(&self) -> Settings {
        Settings {
            max_deliveries: self.max_deliveries,
            concurrency: self.concurrency,
            inbox_batch: self.inbox_batch,
            confirmations: self.confirmations.clone(),
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
        }
    }
}

/// One test per property named, for `$broker`: `<name>` runs `super::<name>::<$broker>()`.
macro_rules! property_tests {
    ($broker:ty: $($property:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $property() {
                crate::init_tracing();
                super::$property::<$broker>().await;
            }
        )+
    };
}

/// One test per property for `$broker`; `without crash` leaves the crash properties out.
macro_rules! conformance {
    (@module $module:ident, $broker:ty $(, $extra:ident)*) => {
        mod $module {
            use super::*;

            property_tests!($broker:
                applies_once_and_acks_after_commit,
                redelivers_after_a_transient_error,
                dead_letters_at_max_deliveries,
                confirms_the_verdict,
                keeps_per_key_order,
                contains_a_panicking_handler,
                applies_in_batches_around_failures,
                rejects_malformed_input,
                $($extra,)*
            );
        }
    };
    ($module:ident, $broker:ty) => {
        conformance!(@module $module, $broker, survives_a_crash_between_commit_and_ack,
            survives_crashes_in_an_inbox_batch);
    };
    ($module:ident, $broker:ty, without crash) => {
        conformance!(@module $module, $broker);
    };
}

/// The broker's production runner `$run(config, inbox, handler, metrics, cancel)` spawned with
/// `$config` (a `mut` binding) taking the settings `$c`'s runner settings.
macro_rules! spawn_runner {
    ($run:path, $config:ident, $c:ident, $inbox:ident, $handler:ident) => {{
        $config.runner = $c.runner();
        tokio::spawn($run($config, $inbox, $handler, $c.metrics, $c.cancel))
    }};
}

mod brokers;
#[cfg(feature = "rocketmq")]
use brokers::rocketmq;
use brokers::{kafka, mqtt, nats, rabbitmq, redis};

conformance!(on_nats, nats::Nats);
conformance!(on_mqtt, mqtt::Mqtt);
conformance!(on_kafka, kafka::Kafka);
conformance!(on_rabbitmq, rabbitmq::Rabbit);
conformance!(on_redis, redis::Redis);
// A crash cannot be staged in-process on RocketMQ: the client keeps one instance per process, so
// the aborted runner's consumer would stay registered in the group beside its successor.
#[cfg(feature = "rocketmq")]
conformance!(on_rocketmq, rocketmq::RocketMq, without crash);
