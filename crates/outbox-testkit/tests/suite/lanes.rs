//! Batch lanes during a backlog (`Store::lanes_share_buckets`, docs/benchmarks.md "Lanes"), through
//! the `Relay` on the real databases: on SQLite and MariaDB the second lane publishes while the
//! first lane's publish is held; on every database every key stays in order and every message
//! is published once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::{
    DeadLetterPolicy, MemoryTransport, NewMessage, Outgoing, RelayConfig, Status, Transport,
    TransportError,
};
use outbox_testkit::{StoreFixture, within};
use tokio::sync::Notify;

use crate::ordering::ordered_relay;
use crate::relay::{counts_by_id, fast_config, wait_all_status};

fixture_tests!(stores, [super], [lanes_during_a_backlog],);

/// Holds the first publish call until `open` is notified; every other call (and the held one,
/// once opened) goes to the memory transport.
struct HoldFirst {
    inner: Arc<MemoryTransport>,
    calls: AtomicUsize,
    held: Notify,
    open: Notify,
}

#[async_trait]
impl Transport for HoldFirst {
    fn name(&self) -> &str {
        "hold-first"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.held.notify_one();
            self.open.notified().await;
        }
        self.inner.publish(batch).await
    }

    async fn probe(&self) -> Result<(), TransportError> {
        Ok(())
    }
}

const KEYS: usize = 500;
const MESSAGES: usize = 2000;
const BATCH: u32 = 500;

/// A backlog of 2,000 messages over 500 keys (the first batch of 500 touches nearly every one
/// of the 64 buckets), 2 lanes of 500: the first batch's publish is held.
pub async fn lanes_during_a_backlog(fx: &dyn StoreFixture) {
    let msgs = (0..MESSAGES)
        .map(|n| {
            NewMessage::new("orders", format!("{}", n / KEYS))
                .with_partition_key(format!("key-{}", n % KEYS))
        })
        .collect();
    fx.enqueue_commit(msgs).await.expect("enqueue");
    let mem = Arc::new(MemoryTransport::new());
    let hold = Arc::new(HoldFirst {
        inner: mem.clone(),
        calls: AtomicUsize::new(0),
        held: Notify::new(),
        open: Notify::new(),
    });
    let config = RelayConfig {
        batch_size: BATCH,
        in_flight_batches: 2,
        lease: Duration::from_secs(30),
        publish_timeout: Duration::from_secs(10),
        ..fast_config("lanes")
    };
    let relay = ordered_relay(fx, hold.clone(), DeadLetterPolicy::Skip, config, None).spawn();
    within(
        "the first publish",
        Duration::from_secs(10),
        hold.held.notified(),
    )
    .await;
    if fx.store().lanes_share_buckets() {
        // The other lane read the other share of the buckets (about 1,000 due rows) and
        // publishes a whole batch meanwhile. Without the split the first read takes nearly every
        // bucket, and what is left holds a few dozen rows at most.
        within(
            "the second lane to publish a whole batch while the first is held",
            Duration::from_secs(10),
            mem.wait_for(BATCH as usize),
        )
        .await;
    }
    hold.open.notify_one();
    within(
        "every message published",
        Duration::from_secs(30),
        mem.wait_for(MESSAGES),
    )
    .await;
    wait_all_status(fx, Status::Sent, Duration::from_secs(30)).await;
    relay.shutdown().await.unwrap();
    let delivered = mem.delivered();
    let counts = counts_by_id(&delivered);
    assert_eq!(counts.len(), MESSAGES, "a message was lost");
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice"
    );
    // Per key, the payloads (0, 1, 2, 3 in commit order) come out in order.
    let mut last: HashMap<String, i64> = HashMap::new();
    for d in &delivered {
        let key = d.message.partition_key.clone().expect("keyed");
        let n: i64 = std::str::from_utf8(&d.message.payload)
            .unwrap()
            .parse()
            .unwrap();
        let prev = last.insert(key.clone(), n);
        assert!(
            prev.is_none_or(|p| p < n),
            "key {key} out of order: {prev:?} then {n}"
        );
    }
}
