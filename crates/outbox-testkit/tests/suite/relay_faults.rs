//! Issue 11, relay side: a panic anywhere in a batch is contained (items 1), a slow or hanging
//! broker keeps each message's own outcome (item 2), and `outbox-attempt` numbers attempts from
//! 1 (item 11). Every test drives the real `Relay` against a real store (PostgreSQL, SQLite) and,
//! for webhooks, real HTTP.

use outbox_testkit::{PauseAt, PauseFirst};
use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use outbox::transport::{Outgoing, Transport};
use outbox::{
    Backoff, HandlerError, InboundMessage, Inbox, MemoryTransport, Message, NewMessage,
    RelayConfig, RelayHooks, Status, TransportError,
};
use outbox_testkit::{PgFixture, SqliteFixture, StoreFixture, wait_until};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::relay::{counts_by_id, fast_config, relay_to, wait_all_status};

const POISON: &[u8] = b"poison";

/// A broker client that panics when a batch holds a message whose payload is [`POISON`] (as a
/// client panics on a header it cannot encode), before publishing anything of that batch.
struct PanicOnPoison {
    inner: Arc<MemoryTransport>,
}

#[async_trait]
impl Transport for PanicOnPoison {
    fn name(&self) -> &str {
        "panic-on-poison"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        if batch.iter().any(|o| o.message.payload == POISON) {
            panic!("poison pill");
        }
        self.inner.publish(batch).await
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

fn batch_of(n: usize, tag: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| NewMessage::new("orders", format!("{tag}-{i}")))
        .collect()
}

/// The row of `id`, whose last error names `reason` (a poison message dead-lettered with the
/// panic's message).
async fn failed_with(fx: &dyn StoreFixture, id: Uuid, reason: &str) -> outbox_testkit::RowState {
    let row = fx.row(id).await;
    assert!(
        row.last_error
            .as_deref()
            .is_some_and(|e| e.contains(reason)),
        "poison dead-lettered with the panic message {reason:?}: {row:?}"
    );
    row
}

async fn wait_resolved(fx: &dyn StoreFixture, poison: &[Uuid], timeout: Duration) {
    wait_until(
        "every poison message FAILED and every other message SENT",
        timeout,
        || async {
            fx.rows().await.iter().all(|r| {
                let want = if poison.contains(&r.message_id) {
                    Status::Failed
                } else {
                    Status::Sent
                };
                r.status == want.as_i16()
            })
        },
    )
    .await;
}

/// Item 1: a transport that panics on one message of a batch. Before: the batch task died, its
/// buckets stayed in flight, the relay stopped renewing and published nothing more, and so did
/// the relay that took the buckets over. After: the batch is published again one message at a
/// time; only the poison message is dead-lettered ("transport panicked: poison pill"), every other
/// message is SENT exactly once, and after one relay crashes the one that takes its buckets over
/// contains a second poison message the same way.
async fn defect_01_transport_panic_is_contained(fx: &dyn StoreFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let t: Arc<dyn Transport> = Arc::new(PanicOnPoison { inner: mem.clone() });
    let mut msgs = batch_of(39, "a");
    msgs.insert(17, NewMessage::new("orders", POISON));
    let poison1 = msgs[17].message_id();
    fx.enqueue_commit(msgs).await.expect("enqueue");
    let relay1 = relay_to(fx, t.clone(), fast_config("panic-1"));
    let relay2 = relay_to(fx, t.clone(), fast_config("panic-2"));
    let r1 = relay1.spawn();
    let r2 = relay2.spawn();
    wait_resolved(fx, &[poison1], Duration::from_secs(30)).await;
    let row = failed_with(fx, poison1, "transport panicked: poison pill").await;
    assert_eq!(row.attempts, 1, "{row:?}");
    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), 39, "every other message delivered");
    assert!(
        counts.values().all(|n| *n == 1),
        "each delivered exactly once: {counts:?}"
    );
    assert!(!counts.contains_key(&poison1));
    let panics = r1.metrics().snapshot().panics + r2.metrics().snapshot().panics;
    assert!(panics >= 1, "the panic was counted");
    assert!(r1.stalled().is_none() && r2.stalled().is_none());

    // Relay 1 crashes; relay 2 takes its buckets over and meets a second poison message.
    wait_until(
        "both relays hold buckets",
        Duration::from_secs(10),
        || async { !relay1.held_buckets().is_empty() && !relay2.held_buckets().is_empty() },
    )
    .await;
    r1.abort();
    wait_until(
        "relay 2 takes relay 1's buckets over",
        Duration::from_secs(20),
        || async { relay2.held_buckets().len() == outbox::store::BUCKETS as usize },
    )
    .await;
    let mut more = batch_of(19, "b");
    more.insert(5, NewMessage::new("orders", POISON));
    let poison2 = more[5].message_id();
    fx.enqueue_commit(more).await.expect("enqueue");
    wait_resolved(fx, &[poison1, poison2], Duration::from_secs(30)).await;
    failed_with(fx, poison2, "transport panicked: poison pill").await;
    assert!(r2.metrics().snapshot().takeovers > 0, "relay 2 took over");
    assert!(r2.stalled().is_none());
    r2.shutdown().await.expect("shutdown");
}

/// Panics in `before_publish` whenever its batch holds the poison message: a panic of the batch
/// task outside the transport.
struct PanickingHook;

#[async_trait]
impl RelayHooks for PanickingHook {
    async fn before_publish(&self, messages: &[Message]) {
        if messages.iter().any(|m| m.payload == POISON) {
            panic!("hook poison");
        }
    }
}

/// Item 1: a batch task that panics outside the transport (here a hook). Before: the relay
/// wedged as above. After: the batch's buckets are released, their rows are processed one at a
/// time, the other messages are SENT (one attempt each) and the poison message is dead-lettered
/// after `max_attempts` with the panic message; the relay goes on.
async fn defect_01_batch_panic_is_contained(fx: &dyn StoreFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let mut msgs = batch_of(29, "c");
    msgs.insert(3, NewMessage::new("orders", POISON));
    let poison = msgs[3].message_id();
    fx.enqueue_commit(msgs).await.expect("enqueue");
    let relay = outbox::Relay::builder(fx.store())
        .router(outbox::Router::single(mem.clone()))
        .config(RelayConfig {
            max_attempts: 3,
            ..fast_config("hook-panic")
        })
        .hooks(Arc::new(PanickingHook))
        .build()
        .expect("relay")
        .spawn();
    wait_resolved(fx, &[poison], Duration::from_secs(30)).await;
    let row = failed_with(fx, poison, "batch panicked: hook poison").await;
    assert_eq!(row.attempts, 3, "{row:?}");
    for r in fx.rows().await {
        if r.message_id != poison {
            assert_eq!(
                r.attempts, 1,
                "an innocent message paid for the poison: {r:?}"
            );
        }
    }
    // The relay goes on.
    let later = fx.enqueue_commit(batch_of(5, "d")).await.expect("enqueue");
    wait_resolved(fx, &[poison], Duration::from_secs(10)).await;
    for id in later {
        assert_eq!(fx.row(id).await.status, Status::Sent.as_i16());
    }
    assert!(relay.metrics().snapshot().panics >= 3);
    relay.shutdown().await.expect("shutdown");
}

/// Item 1: a relay that cannot make progress says so: a batch stuck past its lease shows in
/// `stalled()` and `stalled_batches` (and an error log), and clears when it returns.
async fn defect_01_a_stalled_relay_says_so(fx: &dyn StoreFixture) {
    let hook = PauseFirst::new(PauseAt::Complete);
    fx.enqueue_commit(batch_of(3, "e")).await.expect("enqueue");
    let relay = outbox::Relay::builder(fx.store())
        .router(outbox::Router::single(Arc::new(MemoryTransport::new())))
        .config(fast_config("stalled"))
        .hooks(hook.clone())
        .build()
        .expect("relay")
        .spawn();
    wait_until(
        "the relay reports its stall",
        Duration::from_secs(10),
        || async { relay.stalled().is_some() && relay.metrics().snapshot().stalled_batches == 1 },
    )
    .await;
    hook.resume.notify_one();
    wait_until("the stall clears", Duration::from_secs(10), || async {
        relay.stalled().is_none()
    })
    .await;
    relay.shutdown().await.expect("shutdown");
}

fixture_tests!(
    [sqlite: SqliteFixture, postgres: PgFixture],
    [super],
    [
        defect_01_transport_panic_is_contained,
        defect_01_batch_panic_is_contained,
        defect_01_a_stalled_relay_says_so,
    ],
);

/// A webhook receiver on real HTTP: counts posts per `webhook-id` and answers by `mode`.
#[derive(Default)]
struct Receiver {
    /// Posts per message id, counted when the request is processed.
    posts: Mutex<HashMap<String, usize>>,
    /// `outbox-attempt` of each post, per message id.
    attempts: Mutex<HashMap<String, Vec<String>>>,
    /// Serialises processing (a receiver that answers one request at a time).
    one_at_a_time: tokio::sync::Mutex<()>,
}

#[derive(Clone, Copy)]
enum Mode {
    /// Every request takes 300 ms, concurrently; the first post of a `hang` payload never answers.
    SlowAndOneHangs,
    /// One request at a time, 20 ms each.
    Serial,
}

async fn serve(rx: Arc<Receiver>, mode: Mode) -> (String, CancellationToken) {
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let rx = rx.clone();
            async move {
                let id = headers
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let attempt = headers
                    .get("outbox-attempt")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                match mode {
                    Mode::SlowAndOneHangs => {
                        let n = {
                            let mut p = rx.posts.lock().unwrap();
                            let n = p.entry(id.clone()).or_insert(0);
                            *n += 1;
                            *n
                        };
                        rx.attempts
                            .lock()
                            .unwrap()
                            .entry(id)
                            .or_default()
                            .push(attempt);
                        if &body[..] == b"hang" && n == 1 {
                            std::future::pending::<()>().await;
                        }
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Mode::Serial => {
                        let _one = rx.one_at_a_time.lock().await;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        *rx.posts.lock().unwrap().entry(id).or_insert(0) += 1;
                    }
                }
                StatusCode::OK
            }
        }),
    );
    let (base, stop) = crate::admin::serve_app(app).await;
    (format!("{base}/hook"), stop)
}

fn webhook(url: &str, timeout: Duration, concurrency: usize) -> Arc<dyn Transport> {
    let mut c = outbox::WebhookConfig::new(url);
    c.timeout = timeout;
    c.concurrency = concurrency;
    Arc::new(outbox::WebhookTransport::new(c).expect("webhook"))
}

/// A relay posting every topic to the webhook's own URL.
fn relay_to_webhook(
    fx: &dyn StoreFixture,
    transport: Arc<dyn Transport>,
    config: RelayConfig,
) -> outbox::Relay {
    outbox::Relay::builder(fx.store())
        .router(outbox::Router::new().route("*", transport, ""))
        .config(config)
        .build()
        .expect("relay")
}

/// Item 2: one webhook request hangs while the others of its batch are answered (300 ms each).
/// Before: the batch's publish timeout marked every message retryable, the answered ones were
/// posted again and nothing of the batch was SENT. After: each answered message is SENT after
/// exactly one post; only the hanging one is retried (attempt 2) and then SENT.
#[suite_test]
async fn defect_02_acknowledged_messages_survive_a_publish_timeout(fx: PgFixture) {
    let rx = Arc::new(Receiver::default());
    let (url, stop) = serve(rx.clone(), Mode::SlowAndOneHangs).await;
    let mut msgs = batch_of(49, "w");
    msgs.insert(20, NewMessage::new("orders", "hang"));
    let hang = msgs[20].message_id();
    let ids = fx.enqueue_commit(msgs).await.expect("enqueue");
    let config = RelayConfig {
        publish_timeout: Duration::from_secs(2),
        lease: Duration::from_secs(6),
        ..fast_config("slow-webhook")
    };
    // The per-request timeout is longer than the relay's publish timeout: the relay's cut
    // decides.
    let relay = relay_to_webhook(&fx, webhook(&url, Duration::from_secs(30), 64), config).spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(30)).await;
    let posts = rx.posts.lock().unwrap().clone();
    for id in &ids {
        let n = posts.get(&id.to_string()).copied().unwrap_or(0);
        if *id == hang {
            assert_eq!(n, 2, "the hanging message: one timed out, one answered");
        } else {
            assert_eq!(n, 1, "message {id} posted {n} times");
        }
    }
    let row = fx.row(hang).await;
    assert_eq!(row.attempts, 2, "{row:?}");
    assert_eq!(
        rx.attempts.lock().unwrap()[&hang.to_string()],
        ["1", "2"],
        "outbox-attempt of the two posts"
    );
    for id in ids.iter().filter(|id| **id != hang) {
        assert_eq!(fx.row(*id).await.attempts, 1);
    }
    assert!(relay.metrics().snapshot().publish_timeouts >= 1);
    relay.shutdown().await.expect("shutdown");
    stop.cancel();
}

/// Item 2: a receiver that answers one request at a time (20 ms each) cannot take a whole batch
/// within the publish timeout. Before: every round timed out, every message of the batch was
/// retried, the same first messages were posted again and again, and nothing was SENT. After:
/// every round records what was answered, releases what was never sent, and the table drains;
/// a message is posted more than once only if it was in flight when a round timed out.
#[suite_test]
async fn defect_02_a_slow_receiver_still_drains(fx: PgFixture) {
    let rx = Arc::new(Receiver::default());
    let (url, stop) = serve(rx.clone(), Mode::Serial).await;
    let ids = fx
        .enqueue_commit(batch_of(300, "s"))
        .await
        .expect("enqueue");
    let concurrency = 8;
    let config = RelayConfig {
        batch_size: 100,
        publish_timeout: Duration::from_secs(1),
        lease: Duration::from_secs(3),
        in_flight_batches: 1,
        max_attempts: 16,
        ..fast_config("serial-webhook")
    };
    let relay = relay_to_webhook(
        &fx,
        webhook(&url, Duration::from_secs(30), concurrency),
        config,
    )
    .spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(60)).await;
    let posts = rx.posts.lock().unwrap().clone();
    assert!(ids.iter().all(|id| posts.contains_key(&id.to_string())));
    let repeated = posts.values().filter(|n| **n > 1).count() as u64;
    let timeouts = relay.metrics().snapshot().publish_timeouts;
    assert!(
        repeated <= timeouts * concurrency as u64,
        "{repeated} ids posted more than once after {timeouts} timeouts"
    );
    relay.shutdown().await.expect("shutdown");
    stop.cancel();
}

/// Fails every delivery of a payload `fail` transiently; records each delivery's
/// `outbox-attempt` and delivery count.
#[derive(Default)]
struct FailingHandler {
    seen: Mutex<Vec<(String, String, u32)>>,
    calls: AtomicUsize,
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for FailingHandler {
    async fn handle(
        &self,
        _conn: &mut sqlx::SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let payload = String::from_utf8_lossy(&msg.payload).into_owned();
        let attempt = msg
            .headers
            .get("outbox-attempt")
            .cloned()
            .unwrap_or_default();
        self.seen
            .lock()
            .unwrap()
            .push((payload.clone(), attempt, msg.delivery_count));
        if payload == "fail" {
            Err(HandlerError::transient("always failing"))
        } else {
            Ok(())
        }
    }
}

/// Serve the production webhook receiver of `inbox` at `/in` (3 deliveries before a dead
/// letter, retries `retry_ms` apart, up to `inbox_batch` messages per inbox transaction) until
/// the returned token is cancelled: its URL, the token and its metrics.
async fn serve_receiver<H: outbox::Handler<sqlx::Sqlite>>(
    inbox: Inbox<sqlx::Sqlite>,
    handler: Arc<H>,
    retry_ms: u64,
    inbox_batch: usize,
) -> (
    String,
    CancellationToken,
    Arc<outbox::consumer::ConsumerMetrics>,
) {
    let retry = Duration::from_millis(retry_ms);
    let policy = outbox::consumer::DeliveryPolicy {
        max_deliveries: 3,
        retry: Backoff {
            base: retry,
            factor: 1.0,
            max: retry,
            jitter: 0.0,
        },
        confirmations: None,
        inbox_batch,
    };
    let metrics = Arc::new(outbox::consumer::ConsumerMetrics::default());
    let app = outbox::consumer::webhook::router_with(
        "/in",
        inbox,
        handler,
        None,
        metrics.clone(),
        policy,
    )
    .unwrap();
    let (base, stop) = crate::admin::serve_app(app).await;
    (format!("{base}/in"), stop, metrics)
}

/// Item 11: through the real relay (PostgreSQL) and the webhook consumer (SQLite inbox), the
/// first delivery carries `outbox-attempt: 1`, each retry one more, and the consumer with
/// `max_deliveries = 3` dead-letters at the third delivery. Before: the first delivery said 0,
/// so the consumer dead-lettered one delivery late (at the fourth).
#[suite_test]
async fn defect_11_attempt_header_counts_from_one() {
    let fx = PgFixture::new().await;
    let consumer_db = SqliteFixture::new().await;
    let inbox = Inbox::<sqlx::Sqlite>::new(
        consumer_db.store.pool().clone(),
        "consumer_inbox",
        "attempts",
    )
    .unwrap();
    inbox.migrate().await.unwrap();
    let handler = Arc::new(FailingHandler::default());
    let (url, stop, _) = serve_receiver(inbox.clone(), handler.clone(), 50, 1).await;
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("orders", "ok"),
            NewMessage::new("orders", "fail"),
        ])
        .await
        .unwrap();
    let relay = relay_to_webhook(
        &fx,
        webhook(&url, Duration::from_secs(5), 8),
        fast_config("attempts"),
    )
    .spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(20)).await;
    let seen = handler.seen.lock().unwrap().clone();
    let of = |p: &str| -> Vec<(String, u32)> {
        seen.iter()
            .filter(|(payload, _, _)| payload == p)
            .map(|(_, a, d)| (a.clone(), *d))
            .collect()
    };
    assert_eq!(
        of("ok"),
        [("1".to_owned(), 1)],
        "first delivery is attempt 1"
    );
    assert_eq!(
        of("fail"),
        [
            ("1".to_owned(), 1),
            ("2".to_owned(), 2),
            ("3".to_owned(), 3)
        ],
        "attempts 1, 2, 3; dead-lettered at the third"
    );
    let dead = inbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].deliveries, 3);
    assert_eq!(fx.row(ids[1]).await.attempts, 3, "the table agrees");
    assert_eq!(fx.row(ids[0]).await.attempts, 1);
    relay.shutdown().await.unwrap();
    stop.cancel();
    fx.cleanup().await;
    consumer_db.cleanup().await;
}

/// Writes each message's effect into `effects` on the inbox's connection, then fails a payload
/// `fail` transiently and panics on a payload `panic` (both after their effect, which must roll
/// back).
#[derive(Default)]
struct GroupedHandler {
    calls: AtomicUsize,
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for GroupedHandler {
    async fn handle(
        &self,
        conn: &mut sqlx::SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        crate::inbox::sqlite_effect(conn, msg).await?;
        match &msg.payload[..] {
            b"fail" => Err(HandlerError::transient("always failing")),
            b"panic" => panic!("scripted panic after the effect"),
            _ => Ok(()),
        }
    }
}

/// Group commit of the webhook receiver (`inbox_batch` 32): the production relay (PostgreSQL)
/// posts 300 messages with 64 requests in flight to the production router (SQLite inbox); the
/// requests that arrive while a transaction runs are applied together in the next. Every message
/// has exactly one effect, at far fewer transactions than messages; a message whose handler
/// fails or panics inside a group costs the others nothing, leaves no effect and is
/// dead-lettered at its third delivery (answered 200 then), so every row ends SENT.
#[suite_test]
async fn webhook_group_commit_applies_concurrent_requests_together_and_isolates_failures() {
    let fx = PgFixture::new().await;
    let (consumer_db, pool, inbox) = crate::inbox::sqlite_with_effects("grouped").await;
    let handler = Arc::new(GroupedHandler::default());
    let (url, stop, metrics) = serve_receiver(inbox.clone(), handler, 20, 32).await;
    let mut msgs = batch_of(300, "g");
    msgs.insert(100, NewMessage::new("orders", "fail"));
    msgs.insert(200, NewMessage::new("orders", "panic"));
    let (fail, panicked) = (msgs[100].message_id(), msgs[200].message_id());
    fx.enqueue_commit(msgs).await.unwrap();
    let relay = relay_to_webhook(
        &fx,
        webhook(&url, Duration::from_secs(5), 64),
        fast_config("grouped"),
    )
    .spawn();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(60)).await;
    relay.shutdown().await.unwrap();
    stop.cancel();

    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT message_id, COUNT(*) FROM effects GROUP BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects.len(), 300, "one effect per message that succeeds");
    assert!(
        effects.iter().all(|(_, n)| *n == 1),
        "a message applied twice: {effects:?}"
    );
    for id in [fail, panicked] {
        assert!(
            !effects.iter().any(|(e, _)| *e == id.to_string()),
            "the effect of {id} was not rolled back"
        );
    }
    let mut dead: Vec<(Uuid, u32)> = inbox
        .dead_letters(10)
        .await
        .unwrap()
        .iter()
        .map(|d| (d.message.message_id, d.deliveries))
        .collect();
    dead.sort();
    let mut want = vec![(fail, 3), (panicked, 3)];
    want.sort();
    assert_eq!(dead, want, "the failing messages end dead-lettered");
    let batches = metrics.inbox_batches.load(Ordering::Relaxed);
    let applied = metrics.applied.load(Ordering::Relaxed);
    assert_eq!(applied, 300, "applied counter");
    assert!(
        batches > 0 && batches < 150,
        "300 messages in {batches} multi-message transactions: the requests were not grouped"
    );
    fx.cleanup().await;
    consumer_db.cleanup().await;
}
