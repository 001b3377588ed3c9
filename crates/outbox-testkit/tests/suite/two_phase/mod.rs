//! Two-phase (half) messages (issue 16) through the `Relay`'s check-back loop, on each
//! database: the producer's decisions, check-backs over HTTP and in-process hooks, the budget
//! that only answers spend, parking and resuming, two relays, malformed rows, and the barrier's
//! races in the business database.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::admin::{Action, Selection};
use outbox::two_phase::{
    Answer, CheckBack, CheckBackHook, CheckBackPolicy, CheckRequest, DecideError, Decided, TwoPhase,
};
use outbox::{BoxError, MemoryTransport, NewMessage, Relay, RelayConfig, Router, Status};
use outbox_testkit::{StoreFixture, wait_metrics, wait_until};
use uuid::Uuid;

use crate::relay::fast_config;

fixture_tests!(
    stores,
    [crate::two_phase],
    [
        two_phase_commit_and_rollback_by_the_producer = producer_decides,
        two_phase_crash_before_commit_is_committed_by_the_check_back = check_back_commits,
        two_phase_business_rolled_back_is_rolled_back_by_the_check_back = check_back_rolls_back,
        two_phase_unknown_then_commit = unknown_then_commit,
        c29_garbled_check_back_answer_is_never_a_commit = garbled_answer,
        two_phase_unreachable_producer_never_spends_the_budget = unreachable_producer,
        two_phase_budget_spent_parks_undecided_then_resumed = budget_then_resume,
        two_phase_deadline_parks_undecided = deadline_parks,
        two_phase_late_commit_after_a_rollback_decision_loses = late_commit_loses,
        two_phase_two_relays_never_check_one_row_at_once = two_relays,
        two_phase_plain_sql_and_malformed_prepared_rows = plain_sql_rows,
        two_phase_relay_killed_during_a_check_back = relay_killed_mid_check,
    ],
);

const WAIT: Duration = Duration::from_secs(20);

/// A relay over `fx` publishing to `mem`, checking back quickly, with `hooks` registered.
fn relay(
    fx: &dyn StoreFixture,
    mem: Arc<MemoryTransport>,
    name: &str,
    policy: CheckBackPolicy,
    hooks: &[(&str, Arc<dyn CheckBackHook>)],
) -> outbox::RelayHandle {
    let config = RelayConfig {
        check_back: policy,
        ..fast_config(name)
    };
    let mut b = Relay::builder(fx.store())
        .router(Router::single(mem))
        .config(config);
    for (n, h) in hooks {
        b = b.check_back_hook(*n, h.clone());
    }
    b.build().expect("relay config").spawn()
}

/// Check-backs every 100 ms, errors retried after 20–100 ms, the first check 50 ms after the
/// prepare (see [`hooked`]).
fn fast_policy() -> CheckBackPolicy {
    CheckBackPolicy {
        interval: Duration::from_millis(100),
        error_backoff: Duration::from_millis(20),
        error_backoff_max: Duration::from_millis(100),
        poll_interval: Duration::from_millis(50),
        timeout: Duration::from_secs(2),
        ..CheckBackPolicy::default()
    }
}

/// A relay `tp-r1` with `hook` registered as the hook `orders`, publishing to a fresh memory
/// transport: the transport and the relay.
fn orders_relay(
    fx: &dyn StoreFixture,
    policy: CheckBackPolicy,
    hook: Arc<dyn CheckBackHook>,
) -> (Arc<MemoryTransport>, outbox::RelayHandle) {
    let mem = Arc::new(MemoryTransport::new());
    let h = relay(fx, mem.clone(), "tp-r1", policy, &[("orders", hook)]);
    (mem, h)
}

/// [`orders_relay`] with `script` as the hook, and one message prepared with that hook: the
/// transport, the relay, the id.
async fn scripted(
    fx: &dyn StoreFixture,
    policy: CheckBackPolicy,
    script: Arc<Script>,
) -> (Arc<MemoryTransport>, outbox::RelayHandle, Uuid) {
    let (mem, h) = orders_relay(fx, policy, script);
    let id = prepare_order(fx, &hooked("orders")).await;
    (mem, h, id)
}

fn hooked(name: &str) -> CheckBack {
    CheckBack::hook(name)
        .unwrap()
        .after(Duration::from_millis(50))
}

/// An in-process check-back answering by a script of the call number (per message, from 1),
/// recording its calls and whether two calls of one message ever overlapped.
struct Script {
    answer: Box<dyn Fn(u32) -> Result<Answer, String> + Send + Sync>,
    calls: Mutex<HashMap<Uuid, u32>>,
    in_flight: Mutex<HashSet<Uuid>>,
    overlapped: AtomicBool,
    latency: Duration,
}

impl Script {
    fn new(answer: impl Fn(u32) -> Result<Answer, String> + Send + Sync + 'static) -> Arc<Self> {
        Script::slow(Duration::ZERO, answer)
    }

    fn slow(
        latency: Duration,
        answer: impl Fn(u32) -> Result<Answer, String> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Script {
            answer: Box::new(answer),
            calls: Mutex::default(),
            in_flight: Mutex::default(),
            overlapped: AtomicBool::new(false),
            latency,
        })
    }

    fn calls(&self, id: Uuid) -> u32 {
        self.calls.lock().unwrap().get(&id).copied().unwrap_or(0)
    }
}

#[async_trait::async_trait]
impl CheckBackHook for Script {
    async fn check(&self, request: &CheckRequest) -> Result<Answer, BoxError> {
        let id = request.message_id;
        if !self.in_flight.lock().unwrap().insert(id) {
            self.overlapped.store(true, Ordering::SeqCst);
        }
        let n = {
            let mut calls = self.calls.lock().unwrap();
            let n = calls.entry(id).or_default();
            *n += 1;
            *n
        };
        if !self.latency.is_zero() {
            // Simulated answer latency (the producer's own work), not synchronisation.
            tokio::time::sleep(self.latency).await;
        }
        self.in_flight.lock().unwrap().remove(&id);
        (self.answer)(n).map_err(Into::into)
    }
}

/// The status of `id`'s row.
/// Prepare the message `orders`/`x` with `check_back`; its id.
async fn prepare_order(fx: &dyn StoreFixture, check_back: &CheckBack) -> Uuid {
    let msg = NewMessage::new("orders", "x");
    fx.store().prepare(msg, check_back).await.expect("prepare")
}

async fn status(fx: &dyn StoreFixture, id: Uuid) -> Status {
    Status::from_i16(fx.row(id).await.status).expect("status in the schema")
}

/// The row's answered check-backs and last error, from the admin detail.
async fn checks(fx: &dyn StoreFixture, id: Uuid) -> (i64, Option<String>) {
    let row = fx.row(id).await;
    let d = fx.store().message(row.id).await.unwrap().unwrap();
    (d.summary.check_backs, d.summary.last_error)
}

async fn wait_status(fx: &dyn StoreFixture, id: Uuid, want: Status) {
    wait_until(&format!("message {id} {want}"), WAIT, || async {
        status(fx, id).await == want
    })
    .await;
}

async fn wait_published(mem: &MemoryTransport, id: Uuid) {
    wait_until(&format!("message {id} published"), WAIT, || async {
        mem.delivered().iter().any(|d| d.message.message_id == id)
    })
    .await;
}

fn published(mem: &MemoryTransport, id: Uuid) -> usize {
    mem.delivered()
        .iter()
        .filter(|d| d.message.message_id == id)
        .count()
}

/// Commit publishes, rollback never does; both are idempotent; the opposite of a decision
/// loses and says so; an unknown id is named.
pub async fn producer_decides(fx: &dyn StoreFixture) {
    let store = fx.store();
    let mem = Arc::new(MemoryTransport::new());
    let h = relay(fx, mem.clone(), "tp-r1", fast_policy(), &[]);
    let late = CheckBack::http("http://127.0.0.1:9/never")
        .unwrap()
        .after(Duration::from_secs(3600));
    let a = store
        .prepare(NewMessage::new("orders", "a"), &late)
        .await
        .unwrap();
    let b = store
        .prepare(NewMessage::new("orders", "b"), &late)
        .await
        .unwrap();
    assert_eq!(status(fx, a).await, Status::Prepared);
    // A prepare sent again (a retry after a timeout) is named, not a database error.
    let again = NewMessage::new("orders", "a").with_message_id(a);
    assert!(matches!(
        store.prepare(again, &late).await,
        Err(outbox::EnqueueError::DuplicateMessageId(id)) if id == a
    ));
    // A third, plain message: once it is published, the relay has read past the prepared ones.
    let plain = fx.commit_one(NewMessage::new("orders", "plain")).await;
    wait_published(&mem, plain).await;
    assert_eq!(
        published(&mem, a),
        0,
        "a PREPARED message is never published"
    );

    assert_eq!(store.commit_prepared(a).await.unwrap(), Decided::Now);
    wait_published(&mem, a).await;
    assert_eq!(store.commit_prepared(a).await.unwrap(), Decided::Already);
    match store.rollback_prepared(a).await {
        Err(DecideError::Lost { status, .. }) => {
            assert!(matches!(status, Status::Pending | Status::Sent), "{status}")
        }
        other => panic!("a late rollback of a committed message must lose: {other:?}"),
    }

    assert_eq!(store.rollback_prepared(b).await.unwrap(), Decided::Now);
    assert_eq!(store.rollback_prepared(b).await.unwrap(), Decided::Already);
    match store.commit_prepared(b).await {
        Err(DecideError::Lost { status, .. }) => assert_eq!(status, Status::RolledBack),
        other => panic!("a late commit of a rolled-back message must lose: {other:?}"),
    }
    assert_eq!(status(fx, b).await, Status::RolledBack);

    let unknown = Uuid::now_v7();
    assert!(matches!(
        store.commit_prepared(unknown).await,
        Err(DecideError::NotFound(id)) if id == unknown
    ));
    // A delayed message cannot be prepared; nothing is written.
    let delayed = NewMessage::new("orders", "d").with_delay(Duration::from_secs(1));
    assert!(matches!(
        store.prepare(delayed, &late).await,
        Err(outbox::EnqueueError::PreparedWithDelay)
    ));
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, a), 1);
    assert_eq!(
        published(&mem, b),
        0,
        "a rolled-back message is never published"
    );
}

/// The producer crashed between prepare and commit (it never calls `commit_prepared`); its
/// business transaction committed, so the check-back answers COMMIT: published once.
pub async fn check_back_commits(fx: &dyn StoreFixture) {
    let script = Script::new(|_| Ok(Answer::Commit));
    let (mem, h, id) = scripted(fx, fast_policy(), script.clone()).await;
    wait_published(&mem, id).await;
    assert_eq!(script.calls(id), 1);
    let m = h.metrics().snapshot();
    assert_eq!(m.prepared_committed, 1);
    // Deciding again after the check-back decided: a no-op, and the same way wins.
    assert_eq!(
        fx.store().commit_prepared(id).await.unwrap(),
        Decided::Already
    );
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, id), 1);
}

/// The business transaction rolled back: the check-back answers ROLLBACK, the message is
/// ROLLED_BACK and never published.
pub async fn check_back_rolls_back(fx: &dyn StoreFixture) {
    let script = Script::new(|_| Ok(Answer::Rollback));
    let (mem, h, id) = scripted(fx, fast_policy(), script.clone()).await;
    wait_status(fx, id, Status::RolledBack).await;
    let plain = fx.commit_one(NewMessage::new("orders", "after")).await;
    wait_published(&mem, plain).await;
    assert_eq!(h.metrics().snapshot().prepared_rolled_back, 1);
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, id), 0);
}

/// UNKNOWN twice (counted, asked again after the interval), then COMMIT.
pub async fn unknown_then_commit(fx: &dyn StoreFixture) {
    let script = Script::new(|n| {
        Ok(if n < 3 {
            Answer::Unknown
        } else {
            Answer::Commit
        })
    });
    let (mem, h, id) = scripted(fx, fast_policy(), script.clone()).await;
    wait_published(&mem, id).await;
    assert_eq!(script.calls(id), 3);
    let m = h.metrics().snapshot();
    assert_eq!((m.prepared_unknown, m.prepared_committed), (2, 1));
    h.shutdown().await.unwrap();
}

/// A check-back endpoint answering HTTP: the status and body it answers now, and the requests it
/// received (headers and body).
struct Endpoint {
    url: String,
    answer: Arc<Mutex<(u16, String)>>,
    requests: Requests,
}

/// The requests an [`Endpoint`] received: headers and body.
type Requests = Arc<Mutex<Vec<(axum::http::HeaderMap, Vec<u8>)>>>;

/// Serve [`Endpoint`] on `listener` (a fresh port when `None`).
async fn endpoint(listener: Option<tokio::net::TcpListener>, status: u16, body: &str) -> Endpoint {
    let listener = match listener {
        Some(l) => l,
        None => tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let url = format!("http://{}/check-back", listener.local_addr().unwrap());
    let answer = Arc::new(Mutex::new((status, body.to_owned())));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let (a, r) = (answer.clone(), requests.clone());
    let app = axum::Router::new().route(
        "/check-back",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
            let (a, r) = (a.clone(), r.clone());
            async move {
                r.lock().unwrap().push((headers, body.to_vec()));
                let (s, b) = a.lock().unwrap().clone();
                (axum::http::StatusCode::from_u16(s).unwrap(), b)
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Endpoint {
        url,
        answer,
        requests,
    }
}

/// Shared case C29: the check-back answers 200 with an error text (a middleware turned the
/// failure into a 200). Never a commit: an error, not counted, asked again with backoff; the
/// message is published only once the endpoint answers exactly COMMIT. The requests carry the
/// Standard Webhooks signature, verified with the reference implementation.
pub async fn garbled_answer(fx: &dyn StoreFixture) {
    let ep = endpoint(
        None,
        200,
        "error: permission denied for table outbox_barrier",
    )
    .await;
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let policy = CheckBackPolicy {
        max_checks: 2,
        secret: Some(secret.into()),
        ..fast_policy()
    };
    let mem = Arc::new(MemoryTransport::new());
    let h = relay(fx, mem.clone(), "tp-r1", policy, &[]);
    let cb = CheckBack::http(&ep.url)
        .unwrap()
        .after(Duration::from_millis(50));
    let id = prepare_order(fx, &cb).await;
    // More garbled answers than max_checks: none counted.
    wait_until("5 garbled answers", WAIT, || async {
        ep.requests.lock().unwrap().len() >= 5
    })
    .await;
    assert_eq!(status(fx, id).await, Status::Prepared);
    let (answered, last_error) = checks(fx, id).await;
    assert_eq!(answered, 0, "a garbled answer is not counted");
    let last_error = last_error.unwrap_or_default();
    assert!(
        last_error.contains("not exactly COMMIT, ROLLBACK or UNKNOWN"),
        "{last_error}"
    );
    assert_eq!(published(&mem, id), 0);
    // 500 with the word COMMIT is not an answer either.
    *ep.answer.lock().unwrap() = (500, "COMMIT".into());
    let seen = ep.requests.lock().unwrap().len();
    wait_until("a 500 answer", WAIT, || async {
        ep.requests.lock().unwrap().len() > seen + 1
    })
    .await;
    assert_eq!(status(fx, id).await, Status::Prepared);
    *ep.answer.lock().unwrap() = (200, "COMMIT".into());
    wait_published(&mem, id).await;
    assert!(h.metrics().snapshot().prepared_check_errors >= 5);
    // Every request was signed; the reference implementation accepts the last one.
    let (headers, body) = ep.requests.lock().unwrap().last().cloned().unwrap();
    let wh = standardwebhooks::Webhook::new(secret).unwrap();
    wh.verify(&body, &headers)
        .expect("a valid Standard Webhooks signature");
    let req: CheckRequest = serde_json::from_slice(&body).unwrap();
    assert_eq!((req.message_id, req.topic.as_str()), (id, "orders"));
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, id), 1);
}

/// The producer is unreachable (connection refused) for far longer than `max_checks ×
/// interval`: the budget is untouched; once it is back and answers COMMIT, the message is
/// published.
pub async fn unreachable_producer(fx: &dyn StoreFixture) {
    // A port nobody listens on (taken, then let go; bound again below).
    let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = reserved.local_addr().unwrap();
    drop(reserved);
    let policy = CheckBackPolicy {
        max_checks: 2,
        ..fast_policy()
    };
    let mem = Arc::new(MemoryTransport::new());
    let h = relay(fx, mem.clone(), "tp-r1", policy, &[]);
    let cb = CheckBack::http(format!("http://{addr}/check-back"))
        .unwrap()
        .after(Duration::from_millis(50));
    let id = prepare_order(fx, &cb).await;
    wait_metrics(h.metrics(), WAIT.as_secs(), "10 failed check-backs", |m| {
        m.prepared_check_errors >= 10
    })
    .await;
    assert_eq!(status(fx, id).await, Status::Prepared);
    assert_eq!(
        checks(fx, id).await.0,
        0,
        "an unreachable producer spends no budget"
    );
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let _ep = endpoint(Some(listener), 200, "COMMIT").await;
    wait_published(&mem, id).await;
    h.shutdown().await.unwrap();
}

/// UNKNOWN answers up to `max_checks`: parked as UNDECIDED (counted, logged); the operator
/// resumes it (`Action::Resume`), and the next answer decides it.
pub async fn budget_then_resume(fx: &dyn StoreFixture) {
    let decided = Arc::new(AtomicBool::new(false));
    let d = decided.clone();
    let script = Script::new(move |_| {
        Ok(if d.load(Ordering::SeqCst) {
            Answer::Commit
        } else {
            Answer::Unknown
        })
    });
    let policy = CheckBackPolicy {
        max_checks: 3,
        ..fast_policy()
    };
    let (mem, h, id) = scripted(fx, policy, script.clone()).await;
    let store = fx.store();
    wait_status(fx, id, Status::Undecided).await;
    assert_eq!(script.calls(id), 3);
    let (answered, note) = checks(fx, id).await;
    assert_eq!(answered, 3);
    assert!(note.unwrap_or_default().contains("undecided"));
    assert_eq!(h.metrics().snapshot().prepared_undecided, 1);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Undecided], 1, "status shows it");

    decided.store(true, Ordering::SeqCst);
    let row = fx.row(id).await.id;
    let report = store
        .act(Action::Resume, &Selection::Ids(vec![row]))
        .await
        .unwrap();
    assert_eq!(report.changed, 1);
    wait_published(&mem, id).await;
    assert_eq!(script.calls(id), 4);
    h.shutdown().await.unwrap();
}

/// A check-back that keeps failing past the message's decision deadline parks it.
pub async fn deadline_parks(fx: &dyn StoreFixture) {
    let script = Script::new(|_| Err("the orders database is down".into()));
    let (mem, h) = orders_relay(fx, fast_policy(), script.clone());
    // The first check would come after an hour: the deadline brings it forward.
    let cb = hooked("orders")
        .after(Duration::from_secs(3600))
        .deadline(Duration::from_millis(500));
    let id = prepare_order(fx, &cb).await;
    wait_status(fx, id, Status::Undecided).await;
    let (answered, note) = checks(fx, id).await;
    assert_eq!(answered, 0);
    let note = note.unwrap_or_default();
    assert!(
        note.contains("deadline") && note.contains("database is down"),
        "{note}"
    );
    // Resumed by an operator: the passed deadline goes with it, so failing checks keep it
    // PREPARED (not counted) instead of parking it again at once.
    let row = fx.row(id).await.id;
    let report = fx
        .store()
        .act(Action::Resume, &Selection::Ids(vec![row]))
        .await
        .unwrap();
    assert_eq!(report.changed, 1);
    let calls = script.calls(id);
    wait_until("two more failed check-backs", WAIT, || async {
        script.calls(id) >= calls + 2
    })
    .await;
    assert_eq!(
        status(fx, id).await,
        Status::Prepared,
        "resumed, not parked again"
    );
    // The producer comes back and decides: an undecided message can still be committed.
    assert_eq!(fx.store().commit_prepared(id).await.unwrap(), Decided::Now);
    wait_published(&mem, id).await;
    h.shutdown().await.unwrap();
}

/// The check-back decided ROLLBACK; the producer's commit arrives late and loses.
pub async fn late_commit_loses(fx: &dyn StoreFixture) {
    let script = Script::new(|_| Ok(Answer::Rollback));
    let (mem, h, id) = scripted(fx, fast_policy(), script).await;
    wait_status(fx, id, Status::RolledBack).await;
    match fx.store().commit_prepared(id).await {
        Err(e @ DecideError::Lost { .. }) => {
            assert!(e.to_string().contains("ROLLED_BACK"), "{e}");
        }
        other => panic!("the late commit must lose: {other:?}"),
    }
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, id), 0);
}

/// Two relays share the table: 40 prepared messages, each answered UNKNOWN twice then COMMIT
/// with 30 ms of latency; no message is ever checked by two relays at once, each is published
/// once.
pub async fn two_relays(fx: &dyn StoreFixture) {
    let script = Script::slow(Duration::from_millis(30), |n| {
        Ok(if n < 3 {
            Answer::Unknown
        } else {
            Answer::Commit
        })
    });
    let mem = Arc::new(MemoryTransport::new());
    let hooks: [(&str, Arc<dyn CheckBackHook>); 1] = [("orders", script.clone())];
    let r1 = relay(fx, mem.clone(), "tp-r1", fast_policy(), &hooks);
    let r2 = relay(fx, mem.clone(), "tp-r2", fast_policy(), &hooks);
    let store = fx.store();
    let mut ids = Vec::new();
    for i in 0..40 {
        let msg = NewMessage::new("orders", format!("{i}")).with_partition_key(format!("k{i}"));
        ids.push(store.prepare(msg, &hooked("orders")).await.unwrap());
    }
    let all = ids.clone();
    wait_until("40 prepared messages published", WAIT * 2, || {
        let all = all.clone();
        let mem = mem.clone();
        async move { all.iter().all(|id| published(&mem, *id) >= 1) }
    })
    .await;
    r1.shutdown().await.unwrap();
    r2.shutdown().await.unwrap();
    assert!(
        !script.overlapped.load(Ordering::SeqCst),
        "a message was checked by two relays at once"
    );
    for id in &ids {
        assert_eq!(published(&mem, *id), 1, "{id} published once");
        assert!(script.calls(*id) >= 3);
    }
}

/// The relay dies while a check-back is in flight (its first call never returns): nothing was
/// written; once its lease expires another relay takes the bucket over, asks again and commits;
/// the message is published once.
pub async fn relay_killed_mid_check(fx: &dyn StoreFixture) {
    let hung = Arc::new(tokio::sync::Notify::new());
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (h2, c2) = (hung.clone(), calls.clone());
    let hook: Arc<dyn CheckBackHook> = Arc::new(move |_req: CheckRequest| {
        let (hung, calls) = (h2.clone(), c2.clone());
        async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                // The first producer call hangs until the test ends.
                hung.notified().await;
            }
            Ok::<_, BoxError>(Answer::Commit)
        }
    });
    let policy = CheckBackPolicy {
        timeout: Duration::from_secs(60),
        ..fast_policy()
    };
    let (mem, r1) = orders_relay(fx, policy.clone(), hook.clone());
    let id = prepare_order(fx, &hooked("orders")).await;
    wait_until("the first check-back in flight", WAIT, || async {
        calls.load(Ordering::SeqCst) >= 1
    })
    .await;
    r1.abort();
    assert_eq!(
        status(fx, id).await,
        Status::Prepared,
        "nothing written by the dead relay"
    );
    let r2 = relay(fx, mem.clone(), "tp-r2", policy, &[("orders", hook)]);
    wait_published(&mem, id).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    r2.shutdown().await.unwrap();
    hung.notify_waiters();
    assert_eq!(published(&mem, id), 1);
}

/// A producer that shares the outbox database prepares with plain SQL (status 5 and a
/// `check_back`), and a foreign producer's garbage PREPARED row (no valid target) is parked as
/// UNDECIDED with the reason instead of blocking the rest.
pub async fn plain_sql_rows(fx: &dyn StoreFixture) {
    let script = Script::new(|_| Ok(Answer::Commit));
    let (mem, h) = orders_relay(fx, fast_policy(), script.clone());
    let bad = fx
        .insert_prepared_sql("orders", b"garbage", "ftp://nowhere")
        .await;
    let good = fx
        .insert_prepared_sql("orders", b"sql", "hook:orders")
        .await;
    wait_published(&mem, good).await;
    wait_status(fx, bad, Status::Undecided).await;
    let (_, note) = checks(fx, bad).await;
    let note = note.unwrap_or_default();
    assert!(
        note.contains("malformed") && note.contains("ftp://nowhere"),
        "{note}"
    );
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, bad), 0);
}

mod barrier;
