//! Bucket leases, one write per message and per-key ordered routes (issue 6), on PostgreSQL,
//! MariaDB and SQLite: shared cases C11 and C13, dead-letter policies, fencing of a stale relay,
//! crash-loop protection, rebalancing, and 4 relays killed at random keeping every key in order.

use outbox_testkit::{PauseAt, PauseFirst};
use outbox_testkit_macros::suite_test;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::error::TransportErrorKind;
use outbox::store::BUCKETS;
use outbox::transport::memory::Delivered;
use outbox::{
    DeadLetterPolicy, MemoryTransport, NewMessage, Outgoing, Relay, RelayConfig, RelayHooks,
    Router, Status, Transport, TransportError,
};
use outbox_testkit::{PgFixture, StoreFixture, wait_until};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::relay::fast_config;

/// Test settings with a short bucket lease (1.5 s), so takeovers after a kill are quick.
pub(crate) fn ordered_config(name: &str) -> RelayConfig {
    RelayConfig {
        lease: Duration::from_millis(1500),
        publish_timeout: Duration::from_millis(400),
        ..fast_config(name)
    }
}

/// A relay publishing every topic to `transport` on one ordered route.
pub(crate) fn ordered_relay(
    fx: &dyn StoreFixture,
    transport: Arc<dyn Transport>,
    policy: DeadLetterPolicy,
    config: RelayConfig,
    hooks: Option<Arc<dyn RelayHooks>>,
) -> Relay {
    let mut b = Relay::builder(fx.store())
        .router(
            Router::new()
                .route("*", transport, "{topic}")
                .ordered(policy),
        )
        .config(config);
    if let Some(h) = hooks {
        b = b.hooks(h);
    }
    b.build().expect("relay config")
}

/// The [`ordered_relay`] named `name` over `fx` (dead letters skipped), spawned with its first
/// batch paused at `at`: returned once that batch is there, with the hooks that resume it.
async fn paused_relay(
    fx: &dyn StoreFixture,
    transport: Arc<dyn Transport>,
    name: &str,
    at: PauseAt,
) -> (outbox::RelayHandle, Arc<PauseFirst>) {
    let hook = PauseFirst::new(at);
    let relay = ordered_relay(
        fx,
        transport,
        DeadLetterPolicy::Skip,
        ordered_config(name),
        Some(hook.clone()),
    )
    .spawn();
    hook.entered.notified().await;
    (relay, hook)
}

pub(crate) fn keyed(topic: &str, key: &str, payload: &str) -> NewMessage {
    NewMessage::new(topic, payload.as_bytes().to_vec()).with_partition_key(key)
}

/// Position of the first delivery of each message id.
fn first_positions(delivered: &[Delivered]) -> HashMap<Uuid, usize> {
    let mut m = HashMap::new();
    for (i, d) in delivered.iter().enumerate() {
        m.entry(d.message.message_id).or_insert(i);
    }
    m
}

async fn status_of(fx: &dyn StoreFixture, id: Uuid) -> i16 {
    fx.row(id).await.status
}

/// C11: A (key K) committed; the relay dies after reading A and before publishing it; another
/// relay takes the bucket over after the lease; then B (key K) is committed. The consumer sees A
/// before B, each once at least, and A's attempt was recorded by the takeover.
async fn c11_order_survives_relay_crash(fx: &dyn StoreFixture) {
    let transport = Arc::new(MemoryTransport::new());
    let a = fx.commit_one(keyed("orders", "K", "A")).await;
    let (r1, _) = paused_relay(fx, transport.clone(), "c11-first", PauseAt::Publish).await;
    r1.abort(); // crash between read and publish
    assert_eq!(
        transport.count(),
        0,
        "nothing was published before the crash"
    );
    let r2 = ordered_relay(
        fx,
        transport.clone(),
        DeadLetterPolicy::Skip,
        ordered_config("c11-second"),
        None,
    )
    .spawn();
    wait_until(
        "A SENT by the second relay",
        Duration::from_secs(20),
        || async { status_of(fx, a).await == Status::Sent.as_i16() },
    )
    .await;
    let b = fx.commit_one(keyed("orders", "K", "B")).await;
    wait_until("B SENT", Duration::from_secs(20), || async {
        status_of(fx, b).await == Status::Sent.as_i16()
    })
    .await;
    let pos = first_positions(&transport.delivered());
    assert!(pos[&a] < pos[&b], "A must reach the consumer before B");
    assert!(
        r2.metrics().takeovers.load(Ordering::Relaxed) > 0,
        "the second relay took the dead relay's buckets over"
    );
    assert_eq!(fx.row(a).await.attempts, 1, "A's attempt counted once");
    r2.shutdown().await.expect("shutdown");
}

/// C13: A's first publishes fail (retryable); B has A's key and was committed after it; C has
/// another key. B is never published before A, and C is not held back by A.
async fn c13_failed_head_holds_back_only_its_key(fx: &dyn StoreFixture) {
    let transport = Arc::new(MemoryTransport::new());
    let ids = fx
        .enqueue_commit(vec![
            keyed("orders", "K", "A"),
            keyed("orders", "K", "B"),
            keyed("orders", "other", "C"),
        ])
        .await
        .expect("enqueue");
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    transport.fail_next(
        a,
        vec![TransportErrorKind::Retryable, TransportErrorKind::Retryable],
    );
    let relay = ordered_relay(
        fx,
        transport.clone(),
        DeadLetterPolicy::Skip,
        ordered_config("c13"),
        None,
    )
    .spawn();
    wait_until("A and B SENT", Duration::from_secs(20), || async {
        status_of(fx, a).await == Status::Sent.as_i16()
            && status_of(fx, b).await == Status::Sent.as_i16()
    })
    .await;
    let delivered = transport.delivered();
    let pos = first_positions(&delivered);
    assert!(pos[&a] < pos[&b], "B overtook the failing A: {delivered:?}");
    assert!(pos[&c] < pos[&a], "C (another key) waited for A's retries");
    assert_eq!(fx.row(a).await.attempts, 3, "two failures then success");
    assert_eq!(fx.row(b).await.attempts, 1);
    let m = relay.metrics().snapshot();
    assert!(m.held_back >= 1, "B was held back at least once: {m:?}");
    relay.shutdown().await.expect("shutdown");
}

/// A and B of key K enqueued, A refused for good by the transport, and an ordered relay named
/// `name` with the policy `on_dead_letter` started: the transport, `[A, B]` and the relay.
async fn poisoned_head(
    fx: &dyn StoreFixture,
    on_dead_letter: DeadLetterPolicy,
    name: &str,
) -> (Arc<MemoryTransport>, Vec<uuid::Uuid>, outbox::RelayHandle) {
    let behind = vec![keyed("orders", "K", "B")];
    poisoned_head_with(fx, behind, on_dead_letter, name).await
}

/// [`poisoned_head`] with `behind` enqueued after A (in the same transaction) instead of B: the
/// transport, the ids (A's first) and the relay.
pub(crate) async fn poisoned_head_with(
    fx: &dyn StoreFixture,
    behind: Vec<NewMessage>,
    on_dead_letter: DeadLetterPolicy,
    name: &str,
) -> (Arc<MemoryTransport>, Vec<uuid::Uuid>, outbox::RelayHandle) {
    let transport = Arc::new(MemoryTransport::new());
    let mut msgs = vec![keyed("orders", "K", "A")];
    msgs.extend(behind);
    let ids = fx.enqueue_commit(msgs).await.expect("enqueue");
    transport.fail_next(ids[0], vec![TransportErrorKind::Permanent]);
    let relay = ordered_relay(
        fx,
        transport.clone(),
        on_dead_letter,
        ordered_config(name),
        None,
    )
    .spawn();
    (transport, ids, relay)
}

/// `on_dead_letter = skip`: A is dead-lettered (permanent error), B of the same key goes.
async fn dead_letter_skip_lets_the_key_go_on(fx: &dyn StoreFixture) {
    let (_transport, ids, relay) = poisoned_head(fx, DeadLetterPolicy::Skip, "skip").await;
    wait_until(
        "B SENT past the dead letter",
        Duration::from_secs(20),
        || async { status_of(fx, ids[1]).await == Status::Sent.as_i16() },
    )
    .await;
    assert_eq!(status_of(fx, ids[0]).await, Status::Failed.as_i16());
    relay.shutdown().await.expect("shutdown");
}

/// `on_dead_letter = block`: B waits while A is dead-lettered, while another key flows; after
/// the operator requeues A, A then B are published.
async fn dead_letter_block_waits_for_requeue(fx: &dyn StoreFixture) {
    let (transport, ids, relay) = poisoned_head(fx, DeadLetterPolicy::Block, "block").await;
    wait_until("A dead-lettered", Duration::from_secs(20), || async {
        status_of(fx, ids[0]).await == Status::Failed.as_i16()
    })
    .await;
    // Another key committed after A's failure is published; B stays held back meanwhile.
    let d = fx.commit_one(keyed("orders", "other", "D")).await;
    wait_until("D SENT", Duration::from_secs(20), || async {
        status_of(fx, d).await == Status::Sent.as_i16()
    })
    .await;
    wait_until("B held back twice", Duration::from_secs(20), || async {
        relay.metrics().held_back.load(Ordering::Relaxed) >= 2
    })
    .await;
    assert_eq!(status_of(fx, ids[1]).await, Status::Pending.as_i16());
    assert!(!first_positions(&transport.delivered()).contains_key(&ids[1]));
    let requeued = fx
        .store()
        .requeue_failed(Some(&[fx.row(ids[0]).await.id]))
        .await
        .expect("requeue");
    assert_eq!(requeued, 1);
    wait_until(
        "A and B SENT after requeue",
        Duration::from_secs(20),
        || async { status_of(fx, ids[1]).await == Status::Sent.as_i16() },
    )
    .await;
    let pos = first_positions(&transport.delivered());
    assert!(pos[&ids[0]] < pos[&ids[1]]);
    relay.shutdown().await.expect("shutdown");
}

/// A transport that never answers for `poison` (the relay looks dead while publishing it) and
/// delivers everything else to `inner`.
struct HangOn {
    inner: Arc<MemoryTransport>,
    poison: Uuid,
    hung: Notify,
}

#[async_trait]
impl Transport for HangOn {
    fn name(&self) -> &str {
        "hang-on-poison"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        if batch.iter().any(|o| o.message.message_id == self.poison) {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        self.inner.publish(batch).await
    }

    async fn probe(&self) -> Result<(), TransportError> {
        Ok(())
    }
}

/// A message during whose publish the relay dies every time is dead-lettered after
/// `max_attempts` takeovers, and the other messages are delivered.
async fn poison_that_kills_relays_is_dead_lettered(fx: &dyn StoreFixture) {
    let inner = Arc::new(MemoryTransport::new());
    let ids = fx
        .enqueue_commit(vec![keyed("orders", "P", "poison")])
        .await
        .expect("enqueue");
    let poison = ids[0];
    let transport = Arc::new(HangOn {
        inner: inner.clone(),
        poison,
        hung: Notify::new(),
    });
    let max_attempts = 3;
    let mut incarnation = 0;
    loop {
        incarnation += 1;
        assert!(incarnation <= 8, "the poison was never dead-lettered");
        let relay = ordered_relay(
            fx,
            transport.clone(),
            DeadLetterPolicy::Skip,
            RelayConfig {
                max_attempts,
                ..ordered_config(&format!("poison-{incarnation}"))
            },
            None,
        )
        .spawn();
        let failed = tokio::select! {
            _ = transport.hung.notified() => false,
            _ = wait_until("the poison dead-lettered", Duration::from_secs(20), || async {
                status_of(fx, poison).await == Status::Failed.as_i16()
            }) => true,
        };
        relay.abort();
        if failed {
            break;
        }
    }
    let row = fx.row(poison).await;
    assert!(
        row.last_error
            .as_deref()
            .is_some_and(|e| e.contains("relay stopped while publishing it")),
        "{row:?}"
    );
    assert_eq!(row.attempts, i64::from(max_attempts));
    // First run (no takeover, not counted) + one run per counted attempt + the run that fails it.
    assert_eq!(incarnation, max_attempts as usize + 2);
}

/// Relays share the buckets: one alone holds all, two converge to half each, a relay that
/// shuts down gives its buckets back (no takeover), one that dies is taken over after its lease.
async fn relays_rebalance_buckets(fx: &dyn StoreFixture) {
    let transport = Arc::new(MemoryTransport::new());
    let mk = |name: &str| {
        ordered_relay(
            fx,
            transport.clone(),
            DeadLetterPolicy::Skip,
            ordered_config(name),
            None,
        )
    };
    let r1 = mk("balance-1");
    let h1 = r1.spawn();
    wait_until(
        "relay 1 holds every bucket",
        Duration::from_secs(20),
        || async { r1.held_buckets().len() == BUCKETS as usize },
    )
    .await;
    let r2 = mk("balance-2");
    let h2 = r2.spawn();
    let half = BUCKETS as usize / 2;
    wait_until(
        "two relays hold half each",
        Duration::from_secs(20),
        || async { r1.held_buckets().len() == half && r2.held_buckets().len() == half },
    )
    .await;
    let one: HashSet<_> = r1.held_buckets().into_iter().collect();
    assert!(
        r2.held_buckets().iter().all(|b| !one.contains(b)),
        "no bucket held twice"
    );
    h1.shutdown().await.expect("shutdown");
    wait_until(
        "relay 2 holds every bucket",
        Duration::from_secs(20),
        || async { r2.held_buckets().len() == BUCKETS as usize },
    )
    .await;
    assert_eq!(
        h2.metrics().takeovers.load(Ordering::Relaxed),
        0,
        "buckets given back on shutdown are not takeovers"
    );
    let r3 = mk("balance-3");
    let h3 = r3.spawn();
    wait_until(
        "relay 3 gets its share",
        Duration::from_secs(20),
        || async { r3.held_buckets().len() == half },
    )
    .await;
    h2.abort();
    wait_until(
        "relay 3 takes the dead relay's buckets over",
        Duration::from_secs(20),
        || async { r3.held_buckets().len() == BUCKETS as usize },
    )
    .await;
    assert_eq!(h3.metrics().takeovers.load(Ordering::Relaxed), half as u64);
    h3.shutdown().await.expect("shutdown");
}

fixture_tests!(
    stores,
    [super],
    [
        c11_order_survives_relay_crash,
        c13_failed_head_holds_back_only_its_key,
        dead_letter_skip_lets_the_key_go_on,
        dead_letter_block_waits_for_requeue,
        poison_that_kills_relays_is_dead_lettered,
        relays_rebalance_buckets,
    ],
);

/// A relay that lost its bucket while publishing (another owner took it) writes nothing: its
/// completion is refused and counted, the row stays PENDING, and it is published again by the
/// bucket's next owner.
#[suite_test]
async fn postgres_stale_relay_completion_is_fenced(fx: PgFixture) {
    let transport = Arc::new(MemoryTransport::new());
    let id = fx.commit_one(keyed("orders", "K", "M")).await;
    let (relay, hook) = paused_relay(&fx, transport.clone(), "stale", PauseAt::Complete).await;
    assert_eq!(transport.count(), 1, "published, not yet recorded");
    // Another relay takes the bucket over while this one is paused.
    let t = fx.table();
    fx.exec(&format!(
        "UPDATE {t}_buckets SET owner = 'thief', token = 42, expires_at = now() + interval '1 hour' \
         WHERE bucket = (SELECT bucket FROM {t} WHERE message_id = '{id}')"
    ))
    .await;
    hook.resume.notify_one();
    wait_until(
        "the completion refused",
        Duration::from_secs(10),
        || async { relay.metrics().lost_leases.load(Ordering::Relaxed) == 1 },
    )
    .await;
    assert_eq!(fx.row(id).await.status, Status::Pending.as_i16());
    wait_until(
        "the lost bucket noticed",
        Duration::from_secs(10),
        || async { relay.metrics().buckets_lost.load(Ordering::Relaxed) == 1 },
    )
    .await;
    // The thief gives up; the relay acquires the bucket again and publishes M again.
    fx.exec(&format!(
        "UPDATE {t}_buckets SET owner = NULL, token = NULL, expires_at = '-infinity' WHERE owner = 'thief'"
    ))
    .await;
    wait_until("M SENT", Duration::from_secs(10), || async {
        fx.row(id).await.status == Status::Sent.as_i16()
    })
    .await;
    assert_eq!(
        transport.count(),
        2,
        "published again by the bucket's next owner"
    );
    relay.shutdown().await.expect("shutdown");
}

/// One relay write per message: a row trigger logs every UPDATE of the outbox table during a
/// drain of 3,000 messages (ordered and unordered, several keys): exactly one per message.
#[suite_test]
async fn postgres_one_write_per_message(fx: PgFixture) {
    let t = fx.table();
    let s = &fx.schema;
    fx.exec(&format!(
        "CREATE TABLE {s}.row_writes (id bigint NOT NULL);
         CREATE FUNCTION {s}.log_write() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN INSERT INTO {s}.row_writes VALUES (NEW.id); RETURN NULL; END $$;
         CREATE TRIGGER log_write AFTER UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {s}.log_write();"
    ))
    .await;
    let n = 3000;
    let msgs: Vec<NewMessage> = (0..n)
        .map(|i| {
            let m = NewMessage::new(
                if i % 2 == 0 { "ordered.x" } else { "free.y" },
                vec![0u8; 64],
            );
            if i % 3 == 0 {
                m
            } else {
                m.with_partition_key(format!("k{}", i % 50))
            }
        })
        .collect();
    fx.enqueue_commit(msgs).await.expect("enqueue");
    let transport = Arc::new(MemoryTransport::new());
    let relay = Relay::builder(fx.store())
        .router(
            Router::new()
                .route("ordered.*", transport.clone(), "{topic}")
                .ordered(DeadLetterPolicy::Skip)
                .route("*", transport.clone(), "{topic}"),
        )
        .config(ordered_config("one-write"))
        .build()
        .expect("relay");
    let handle = relay.spawn();
    wait_until("every row SENT", Duration::from_secs(60), || async {
        fx.count(&format!("{t} WHERE status <> {}", Status::Sent.as_i16()))
            .await
            == 0
    })
    .await;
    handle.shutdown().await.expect("shutdown");
    let writes = fx.count(&format!("{s}.row_writes")).await;
    let most = fx
        .count(&format!(
            "(SELECT id FROM {s}.row_writes GROUP BY id HAVING COUNT(*) > 1) x"
        ))
        .await;
    assert_eq!(writes, n as i64, "relay row writes for {n} messages");
    assert_eq!(most, 0, "no row written twice");
}

/// Issue 6: 4 relays, killed and restarted at random, publish `OUTBOX_TEST_ORDERED_MESSAGES`
/// (default 100,000) messages over 1,000 keys, committed while they run; the consumer's first
/// sight of each message is in commit order for every key, none is lost, none dead-lettered.
#[suite_test]
async fn postgres_four_relays_killed_at_random_keep_every_key_in_order() {
    let total: usize = std::env::var("OUTBOX_TEST_ORDERED_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let keys = 1000;
    let fx = Arc::new(PgFixture::new().await);
    let transport = Arc::new(MemoryTransport::new());
    let config = |name: String| RelayConfig {
        batch_size: 500,
        in_flight_batches: 2,
        lease: Duration::from_millis(1500),
        publish_timeout: Duration::from_millis(400),
        ..fast_config(&name)
    };
    let produced = Arc::new(AtomicUsize::new(0));
    let producer = {
        let fx = fx.clone();
        let produced = produced.clone();
        tokio::spawn(async move {
            let mut i = 0;
            while i < total {
                let end = (i + 1000).min(total);
                let msgs = (i..end)
                    .map(|n| {
                        NewMessage::new("orders", format!("{}", n / keys).into_bytes())
                            .with_partition_key(format!("key-{}", n % keys))
                    })
                    .collect();
                fx.enqueue_commit(msgs).await.expect("enqueue");
                produced.store(end, Ordering::Release);
                i = end;
            }
        })
    };
    let mk = |n: usize| {
        ordered_relay(
            fx.as_ref(),
            transport.clone(),
            DeadLetterPolicy::Skip,
            config(format!("four-{n}")),
            None,
        )
        .spawn()
    };
    let mut incarnations = 0;
    let mut relays: Vec<_> = (0..4)
        .map(|_| {
            incarnations += 1;
            mk(incarnations)
        })
        .collect();
    let t = fx.table();
    let mut kills = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    loop {
        let pending = fx
            .count(&format!("{t} WHERE status <> {}", Status::Sent.as_i16()))
            .await;
        if pending == 0 && produced.load(Ordering::Acquire) == total {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "drain did not finish: {pending} left"
        );
        // Kill one relay at random every 0.5–1.5 s while messages are still coming or left.
        tokio::time::sleep(Duration::from_millis(500 + rand::random::<u64>() % 1000)).await;
        if kills < 30 {
            let victim = rand::random::<u32>() as usize % relays.len();
            incarnations += 1;
            let old = std::mem::replace(&mut relays[victim], mk(incarnations));
            old.abort();
            kills += 1;
        }
    }
    producer.await.expect("producer");
    for r in relays {
        r.shutdown().await.expect("shutdown");
    }
    assert_eq!(fx.count_status(Status::Failed).await, 0, "no dead letters");
    let delivered = transport.delivered();
    let mut seen = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for d in &delivered {
        if !seen.insert(d.message.message_id) {
            continue; // a copy (published again after a kill): the inbox absorbs it
        }
        let key = d.message.partition_key.clone().expect("key");
        let seq: i64 = std::str::from_utf8(&d.message.payload)
            .expect("utf8")
            .parse()
            .expect("seq");
        let prev = last.insert(key.clone(), seq);
        assert!(
            prev.is_none_or(|p| p + 1 == seq),
            "key {key}: message {seq} first seen after {prev:?}"
        );
    }
    assert_eq!(seen.len(), total, "every message delivered");
    assert!(kills > 0);
    eprintln!(
        "four relays: {total} messages over {keys} keys, {kills} kills, {} deliveries ({} copies)",
        delivered.len(),
        delivered.len() - total
    );
    fx.cleanup().await;
}
