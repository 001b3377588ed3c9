//! Crashes and stalls on MySQL/MariaDB: a relay that dies between the broker's ack and recording
//! SENT, and a relay paused past its lease (C15); effects applied through a MariaDB inbox.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use outbox::transport::memory::Delivered;
use outbox::{
    InboundMessage, Inbox, MemoryTransport, NewMessage, Processed, Relay, RelayConfig, Router,
    Status,
};
use outbox_testkit::{AckThenHang, MySqlFixture, StoreFixture, wait_until, within};
use sqlx::MySqlPool;
use tokio::sync::Notify;

use crate::crash::PauseFirstClaim;
use crate::inbox::{EffectHandler, mysql_count, mysql_effects};
use crate::relay::{counts_by_id, fast_config, relay_to, wait_all_status};

/// Feed every delivery (duplicates included) through a MariaDB inbox, as a consumer would.
async fn apply_through_inbox(
    pool: &MySqlPool,
    inbox_table: &str,
    effects: &str,
    deliveries: &[Delivered],
) -> (usize, usize) {
    let inbox = Inbox::<sqlx::MySql>::new(pool.clone(), inbox_table, "consumer").unwrap();
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
/// and the MariaDB inbox applies each effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_crash_after_ack_before_completion_republishes_once_applied() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = format!("{}_effects", fx.table);
    mysql_effects(&pool, &effects).await;
    let mem = Arc::new(MemoryTransport::new());
    let hang = Arc::new(AckThenHang::new(mem.clone(), 1));
    let r1 = relay_to(&fx, hang.clone(), fast_config("r1")).spawn();
    let ids = fx
        .enqueue_commit(
            (0..10)
                .map(|i| NewMessage::new("t", format!("{i}")))
                .collect(),
        )
        .await
        .unwrap();
    within(
        "the broker ack",
        Duration::from_secs(10),
        hang.acked.notified(),
    )
    .await;
    r1.abort();
    assert_eq!(mem.count(), 10);
    assert!(
        fx.rows()
            .await
            .iter()
            .all(|r| r.status == Status::Sending.as_i16()),
        "acknowledged but not recorded: still SENDING"
    );
    let r2 = relay_to(&fx, mem.clone(), fast_config("r2")).spawn();
    within("the re-publish", Duration::from_secs(10), mem.wait_for(20)).await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    let counts = counts_by_id(&mem.delivered());
    for id in &ids {
        assert_eq!(counts[id], 2, "published once before the crash, once after");
    }
    let (applied, dup) =
        apply_through_inbox(&pool, &fx.inbox_table(), &effects, &mem.delivered()).await;
    assert_eq!((applied, dup), (10, 10));
    assert_eq!(
        mysql_count(&pool, &format!("SELECT COUNT(*) FROM {effects}")).await,
        10
    );
    r2.shutdown().await.unwrap();
    fx.exec(&format!("DROP TABLE {effects}")).await;
    fx.cleanup().await;
}

/// C15 on MariaDB: R1 is paused right after its claim for longer than the lease; R2 takes the
/// message over and publishes it; R1's late batch is stale or its completion refused (lost
/// lease). The inbox applies the message once; no row is left SENDING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_c15_paused_relay_past_its_lease() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let pool = fx.store.pool().clone();
    let effects = format!("{}_effects", fx.table);
    mysql_effects(&pool, &effects).await;
    let hooks = Arc::new(PauseFirstClaim {
        first: AtomicBool::new(true),
        entered: Notify::new(),
        resume: Notify::new(),
    });
    let mem1 = Arc::new(MemoryTransport::new());
    let mem2 = Arc::new(MemoryTransport::new());
    let r1 = Relay::builder(fx.store())
        .router(Router::single(mem1.clone()))
        .config(RelayConfig {
            in_flight_batches: 1,
            ..fast_config("r1")
        })
        .hooks(hooks.clone())
        .build()
        .unwrap()
        .spawn();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "m1")])
        .await
        .unwrap();
    within(
        "R1 to claim",
        Duration::from_secs(5),
        hooks.entered.notified(),
    )
    .await;
    let r2 = relay_to(&fx, mem2.clone(), fast_config("r2")).spawn();
    within(
        "R2 to take over after the lease",
        Duration::from_secs(10),
        mem2.wait_for(1),
    )
    .await;
    wait_all_status(&fx, Status::Sent, Duration::from_secs(5)).await;
    hooks.resume.notify_one();
    wait_until(
        "R1 to notice its stale claim",
        Duration::from_secs(5),
        || async {
            let m = r1.metrics().snapshot();
            m.stale_batches + m.lost_leases >= 1
        },
    )
    .await;
    let mut all = mem1.delivered();
    all.extend(mem2.delivered());
    let (applied, _) = apply_through_inbox(&pool, &fx.inbox_table(), &effects, &all).await;
    assert_eq!(applied, 1);
    let row = fx.row(ids[0]).await;
    assert_eq!(
        row.status,
        Status::Sent.as_i16(),
        "R1's late outcome overwrote R2's"
    );
    assert_eq!(row.attempts, 2);
    r1.shutdown().await.unwrap();
    r2.shutdown().await.unwrap();
    assert!(
        fx.rows()
            .await
            .iter()
            .all(|r| r.status != Status::Sending.as_i16())
    );
    fx.exec(&format!("DROP TABLE {effects}")).await;
    fx.cleanup().await;
}
