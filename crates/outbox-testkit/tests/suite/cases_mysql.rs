//! Shared failure cases on MySQL/MariaDB (InnoDB's own traps): C01 with AUTO_INCREMENT gaps,
//! C21/C31 deadlocks between concurrent claimers and other sessions, C35 session time zones,
//! binary payloads and 4-byte UTF-8.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::store::{BucketCompletion, MembershipRequest, Outcome, Store as _};
use outbox::{MemoryTransport, MySqlStore, NewMessage, Status, StoreErrorKind};
use outbox::{RelayConfig, StoreOptions};
use outbox_testkit::{MySqlFixture, StoreFixture as _, wait_until, within};
use sqlx::{AssertSqlSafe, Executor as _};

use outbox_testkit::store_suite::relay_over;

use crate::cases::{
    assert_due_in_a_minute, assert_nothing_due_soon, enqueue_in_both_zones, late_commit_published,
    pool_in_time_zone, relay_refusing_once,
};
use crate::relay::{
    counts_by_id, fast_config, memory_relay, polling_every, relay_to, wait_all_status,
};

/// C01 on MariaDB: session A draws the lower AUTO_INCREMENT id and commits late, a rolled-back
/// insert leaves a gap; the row committed late is still published.
#[suite_test]
async fn mysql_c01_late_commit_across_auto_increment_gap_is_published(fx: MySqlFixture) {
    let (mem, relay) = memory_relay(&fx);
    let mut a = fx.store.pool().begin().await.unwrap();
    let m1 = fx
        .store
        .enqueue(&mut a, NewMessage::new("t", "M1"))
        .await
        .unwrap();
    // A rolled-back insert burns an id: the gap.
    fx.enqueue_rollback(vec![NewMessage::new("t", "gone")])
        .await
        .unwrap();
    let m2 = fx.commit_one(NewMessage::new("t", "M2")).await;
    let (id1, id2) = late_commit_published(&mem, a, (m1, m2), Duration::from_millis(300)).await;
    assert!(id2 - id1 >= 2, "the rolled-back insert left a gap");
    relay.shutdown().await.unwrap();
}

/// The error numbers MariaDB reports for a deadlock (1213, SQLSTATE 40001) and a lock wait
/// timeout (1205, SQLSTATE HY000) are transient store errors.
#[suite_test]
async fn mysql_deadlock_and_lock_wait_timeout_are_transient(fx: MySqlFixture) {
    fx.enqueue_commit(vec![NewMessage::new("t", "a"), NewMessage::new("t", "b")])
        .await
        .unwrap();
    let t = fx.table.clone();
    let ids: Vec<i64> = fx.rows().await.iter().map(|r| r.id).collect();
    let pool = fx.store.pool().clone();
    let mut x = pool.begin().await.unwrap();
    let mut y = pool.begin().await.unwrap();
    let upd = |id: i64| format!("UPDATE {t} SET attempts = attempts WHERE id = {id}");
    x.execute(AssertSqlSafe(upd(ids[0]))).await.unwrap();
    y.execute(AssertSqlSafe(upd(ids[1]))).await.unwrap();
    let (rx, ry) = tokio::join!(
        async {
            let r = x.execute(AssertSqlSafe(upd(ids[1]))).await;
            (r, x)
        },
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let r = y.execute(AssertSqlSafe(upd(ids[0]))).await;
            (r, y)
        }
    );
    let errors: Vec<sqlx::Error> = [rx.0.err(), ry.0.err()].into_iter().flatten().collect();
    assert_eq!(errors.len(), 1, "one deadlock victim");
    let deadlock = &errors[0];
    let db = deadlock.as_database_error().unwrap();
    let my = db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .unwrap();
    assert_eq!((my.number(), db.code().as_deref()), (1213, Some("40001")));
    let e = outbox::store::db_error("test", &t, errors.into_iter().next().unwrap());
    assert_eq!(e.kind(), StoreErrorKind::Transient, "{e}");
    let _ = (rx.1.rollback().await, ry.1.rollback().await);

    let mut holder = pool.begin().await.unwrap();
    holder.execute(AssertSqlSafe(upd(ids[0]))).await.unwrap();
    let mut waiter = pool.acquire().await.unwrap();
    waiter
        .execute("SET SESSION innodb_lock_wait_timeout = 1")
        .await
        .unwrap();
    let err = waiter
        .execute(AssertSqlSafe(upd(ids[0])))
        .await
        .unwrap_err();
    let db = err.as_database_error().unwrap();
    let my = db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .unwrap();
    assert_eq!((my.number(), db.code().as_deref()), (1205, Some("HY000")));
    let e = outbox::store::db_error("test", &t, err);
    assert_eq!(e.kind(), StoreErrorKind::Transient, "{e}");
    waiter
        .execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        .await
        .unwrap();
    drop(waiter);
    holder.rollback().await.unwrap();
}

/// C31/C21 on MariaDB: 4 relays (each with its own pool, like 4 processes) drain 5,000 messages
/// while another session keeps updating the same rows in descending id order (the opposite of
/// the claim order). Every message is published exactly once, none fails, and the deadlocks and
/// lock wait timeouts InnoDB raises are retried and counted, never surfacing as failures.
#[suite_test(workers = 4)]
async fn mysql_c31_concurrent_relays_and_contending_updates_lose_nothing() {
    const N: usize = 5_000;
    let fx = MySqlFixture::new().await;
    let t = fx.table.clone();
    let msgs: Vec<NewMessage> = (0..N)
        .map(|i| {
            NewMessage::new("orders", format!("m{i}")).with_partition_key(format!("k{}", i % 7))
        })
        .collect();
    fx.enqueue_commit(msgs).await.unwrap();

    // The contending session: short transactions locking 200 rows from the top id down.
    let stop = Arc::new(AtomicBool::new(false));
    let victim = Arc::new(AtomicU64::new(0));
    let updates = Arc::new(AtomicU64::new(0));
    let contender = {
        let (stop, victim, updates) = (stop.clone(), victim.clone(), updates.clone());
        let pool = outbox_testkit::mysql_pool(2).await;
        let t = t.clone();
        tokio::spawn(async move {
            let mut offset = 0i64;
            while !stop.load(Ordering::SeqCst) {
                let sql = format!(
                    "UPDATE {t} SET partition_key = partition_key \
                     WHERE id <= (SELECT MAX(id) FROM (SELECT id FROM {t}) x) - {offset} \
                     ORDER BY id DESC LIMIT 200"
                );
                match sqlx::query(AssertSqlSafe(sql)).execute(&pool).await {
                    Ok(_) => {
                        updates.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        victim.fetch_add(1, Ordering::Relaxed);
                    }
                }
                offset = (offset + 97) % (N as i64);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };

    let mem = Arc::new(MemoryTransport::new());
    let mut stores = Vec::new();
    let mut relays = Vec::new();
    let started = Instant::now();
    for r in 0..4 {
        let store =
            MySqlStore::from_pool(outbox_testkit::mysql_pool(6).await, StoreOptions::table(&t))
                .unwrap();
        let config = RelayConfig {
            batch_size: 50,
            lease: Duration::from_secs(60),
            ..fast_config(&format!("r{r}"))
        };
        let relay = relay_over(Arc::new(store.clone()), mem.clone(), config);
        stores.push(store);
        relays.push(relay.spawn());
    }
    within(
        "5,000 deliveries",
        Duration::from_secs(120),
        mem.wait_for(N),
    )
    .await;
    let drained = started.elapsed();
    wait_all_status(&fx, Status::Sent, Duration::from_secs(30)).await;
    stop.store(true, Ordering::SeqCst);
    contender.await.unwrap();

    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), N, "a message was lost");
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice"
    );
    let mut failed = 0;
    let mut store_errors = 0;
    let mut claimed = 0;
    for h in &relays {
        let m = h.metrics().snapshot();
        failed += m.failed;
        store_errors += m.store_errors;
        claimed += m.claimed;
    }
    let conflicts: u64 = stores.iter().map(MySqlStore::conflicts_retried).sum();
    println!(
        "C31 MariaDB: {N} messages drained by 4 relays in {:.2} s ({:.0} msg/s); \
         {conflicts} deadlocks/lock waits retried inside the store, {store_errors} surfaced to the \
         relay loop, contender: {} updates, {} deadlock victims",
        drained.as_secs_f64(),
        N as f64 / drained.as_secs_f64(),
        updates.load(Ordering::Relaxed),
        victim.load(Ordering::Relaxed),
    );
    assert_eq!(failed, 0, "a lock conflict failed a message");
    assert_eq!(claimed, N as u64, "a row was claimed twice");
    assert!(
        updates.load(Ordering::Relaxed) > 0,
        "the contender never ran"
    );
    for h in relays {
        h.shutdown().await.unwrap();
    }
    for s in &stores {
        s.pool().close().await;
    }
    fx.cleanup().await;
}

async fn mysql_store_in_time_zone(fx: &MySqlFixture, tz: &'static str) -> MySqlStore {
    let pool = pool_in_time_zone(
        &outbox_testkit::mysql_url(),
        format!("SET time_zone = '{tz}'"),
        "MySQL/MariaDB (OUTBOX_TEST_MYSQL_URL)",
    )
    .await;
    MySqlStore::from_pool(pool, StoreOptions::table(&fx.table)).unwrap()
}

async fn seconds(store: &MySqlStore, sql: &str, id: uuid::Uuid) -> f64 {
    let us: i64 = sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .bind(id.to_string())
        .fetch_one(store.pool())
        .await
        .unwrap();
    us as f64 / 1e6
}

/// C35 on MariaDB: sessions in '+08:00' and '+00:00' enqueue at the same moment: the stored
/// instants agree, and delays and the retries a relay in the '+08:00' session records are
/// measured on the UTC database clock whatever the session time zone.
#[suite_test]
async fn mysql_c35_session_time_zones_do_not_shift_times(fx: MySqlFixture) {
    let shanghai = mysql_store_in_time_zone(&fx, "+08:00").await;
    let utc = mysql_store_in_time_zone(&fx, "+00:00").await;
    let offset: i64 = sqlx::query_scalar("SELECT TIMESTAMPDIFF(HOUR, UTC_TIMESTAMP(), NOW())")
        .fetch_one(shanghai.pool())
        .await
        .unwrap();
    assert_eq!(offset, 8, "the session time zone is applied");
    let ([a, b], [da, db]) = enqueue_in_both_zones(&shanghai, &utc).await;
    // A plain-SQL producer in the +08:00 session gets UTC defaults too.
    let plain = uuid::Uuid::now_v7();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (message_id, topic, payload) VALUES (?, 't', 'x')",
        fx.table
    )))
    .bind(plain.to_string())
    .execute(shanghai.pool())
    .await
    .unwrap();
    let t = &fx.table;
    let age = format!(
        "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) FROM {t} WHERE message_id = ?"
    );
    for reader in [&shanghai, &utc] {
        let ages = [
            seconds(reader, &age, a).await,
            seconds(reader, &age, b).await,
            seconds(reader, &age, plain).await,
        ];
        assert!(
            (ages[0] - ages[1]).abs() < 1.0,
            "created_at differ: {ages:?}"
        );
        assert!(
            ages.iter().all(|s| (-1.0..5.0).contains(s)),
            "created_at is not the UTC clock: {ages:?}"
        );
    }
    let due_in = format!(
        "SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), available_at) FROM {t} WHERE message_id = ?"
    );
    let due = async |reader: &MySqlStore, id: uuid::Uuid| seconds(reader, &due_in, id).await;
    assert_due_in_a_minute("delayed message", [&shanghai, &utc], &[da, db], &due).await;
    // Only a relay in the +08:00 session processes; the broker refuses each once, and the
    // retry backoff is exactly 60 s.
    let (mem, relay) = relay_refusing_once(Arc::new(shanghai.clone()), &[a, b, plain]);
    wait_until("3 retries recorded", Duration::from_secs(10), || async {
        let rows = fx.rows().await;
        [a, b, plain].iter().all(|id| {
            rows.iter().any(|r| {
                r.message_id == *id
                    && r.status == Status::Pending.as_i16()
                    && r.attempts == 1
                    && r.last_error.is_some()
            })
        })
    })
    .await;
    relay.shutdown().await.unwrap();
    assert_eq!(mem.count(), 0, "published before its retry was due");
    assert_due_in_a_minute("retry", [&shanghai, &utc], &[a, b, plain], &due).await;
    // Nothing is due for a relay in the +00:00 session either.
    assert_nothing_due_soon(&utc).await;
    let _ = (shanghai.pool().close().await, utc.pool().close().await);
}

/// Binary payloads (0xFF 0xFE, NUL) and 4-byte UTF-8 (emoji) in topic, key, headers, payload and
/// error text round-trip byte-exact through MariaDB and a relay.
#[suite_test]
async fn mysql_binary_payloads_and_emoji_round_trip(fx: MySqlFixture) {
    let binary: Vec<u8> = vec![0xFF, 0xFE, 0x00, 0x01, 0x00, 0x80, 0xC3, 0x28, 0xFF];
    let all_bytes: Vec<u8> = (0..=255u8).rev().collect();
    let emoji = "订单 😀🚀 \u{1F9D1}\u{200D}\u{1F4BB}".to_owned();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("bin", binary.clone()),
            NewMessage::new("all", all_bytes.clone()),
            NewMessage::new("订单.😀", emoji.clone().into_bytes())
                .with_partition_key("客户-🦀")
                .with_header("note", "✅ 4-byte: 😀"),
        ])
        .await
        .unwrap();
    // Read back by the store methods the relay calls, in its sequence: a membership round
    // acquires the buckets (the only relay: all of them), then their due rows are read.
    let round = fx
        .store
        .membership(&MembershipRequest {
            relay: "case".into(),
            lease: Duration::from_secs(30),
            held: Vec::new(),
            acquire: true,
            routes: vec!["*".into()],
        })
        .await
        .unwrap();
    let held: Vec<_> = round.acquired.iter().map(|l| (l.bucket, l.token)).collect();
    assert_eq!(held.len(), usize::from(outbox::store::BUCKETS));
    let buckets: Vec<_> = held.iter().map(|(b, _)| *b).collect();
    let batch = fx.store.read_buckets(&buckets, &[], 100).await.unwrap();
    assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
    let mut rows = batch.rows;
    rows.sort_by_key(|r| r.message.id);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].message.payload, binary);
    assert_eq!(rows[1].message.payload, all_bytes);
    let m = &rows[2].message;
    assert_eq!(m.message_id, ids[2]);
    assert_eq!(m.topic, "订单.😀");
    assert_eq!(m.partition_key.as_deref(), Some("客户-🦀"));
    assert_eq!(
        m.headers.get("note").map(String::as_str),
        Some("✅ 4-byte: 😀")
    );
    assert_eq!(m.payload, emoji.as_bytes());
    // An error text with emoji is stored intact too (the relay's fenced completion).
    let token = held.iter().find(|(b, _)| *b == rows[2].bucket).unwrap().1;
    let comps = vec![BucketCompletion {
        id: m.id,
        bucket: rows[2].bucket,
        token,
        attempts: 1,
        outcome: Outcome::Failed {
            reason: "拒绝 🙅 \u{0}nul".into(),
        },
    }];
    assert_eq!(
        fx.store.complete_in_buckets("case", &comps).await.unwrap(),
        1
    );
    let failed = fx.store.failed(10).await.unwrap();
    assert_eq!(failed[0].last_error.as_deref(), Some("拒绝 🙅 \u{0}nul"));
    assert_eq!(failed[0].topic, "订单.😀");
    // Through a relay: byte-identical at the broker, once this one has left.
    assert_eq!(fx.store.requeue_failed(None).await.unwrap(), 1);
    fx.store.release_buckets("case", &held, true).await.unwrap();
    let (mem, relay) = memory_relay(&fx);
    within("3 deliveries", Duration::from_secs(10), mem.wait_for(3)).await;
    relay.shutdown().await.unwrap();
    let mut delivered = mem.delivered();
    delivered.sort_by_key(|d| d.message.id);
    assert_eq!(delivered[0].message.payload, binary);
    assert_eq!(delivered[1].message.payload, all_bytes);
    assert_eq!(delivered[2].message.payload, emoji.as_bytes());
    assert_eq!(delivered[2].message.topic, "订单.😀");
}

/// No LISTEN/NOTIFY on MySQL: a commit through [`MySqlStore::commit`] wakes the embedded relay at
/// once; a plain-SQL insert from elsewhere waits for the next poll. Measured with a 1 s poll
/// interval (the default).
#[suite_test]
async fn mysql_in_process_wake_beats_polling(fx: MySqlFixture) {
    let mem = Arc::new(MemoryTransport::new());
    let config = polling_every("r1", Duration::from_secs(1));
    let relay = relay_to(&fx, mem.clone(), config);
    let handle = relay.spawn();
    wait_until(
        "the relay to hold every bucket",
        Duration::from_secs(5),
        || async { relay.held_buckets().len() == usize::from(outbox::store::BUCKETS) },
    )
    .await;
    let relay = handle;
    let mut woken = Vec::new();
    for i in 0..20 {
        let started = Instant::now();
        fx.enqueue_commit(vec![NewMessage::new("t", format!("w{i}"))])
            .await
            .unwrap();
        within(
            "woken delivery",
            Duration::from_secs(5),
            mem.wait_for(i + 1),
        )
        .await;
        woken.push(started.elapsed());
    }
    woken.sort();
    let mut polled = Vec::new();
    for i in 0..3 {
        let started = Instant::now();
        fx.insert_plain_sql("t", b"plain").await;
        within(
            "polled delivery",
            Duration::from_secs(5),
            mem.wait_for(21 + i),
        )
        .await;
        polled.push(started.elapsed());
    }
    polled.sort();
    println!(
        "MariaDB latency commit -> broker: in-process wake p50 {:?} max {:?}; plain SQL (polling, 1 s) p50 {:?} max {:?}",
        woken[10], woken[19], polled[1], polled[2]
    );
    assert!(
        woken[10] < Duration::from_millis(200),
        "the in-process wake-up did not work: p50 {:?}",
        woken[10]
    );
    relay.shutdown().await.unwrap();
}
