//! Shared failure cases on MySQL/MariaDB (InnoDB's own traps): C01 with AUTO_INCREMENT gaps,
//! C21/C31 deadlocks between concurrent claimers and other sessions, C35 session time zones,
//! binary payloads and 4-byte UTF-8.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::store::{BucketCompletion, MembershipRequest, Outcome, Store as _};
use outbox::{
    Backoff, MemoryTransport, MySqlStore, NewMessage, Relay, Router, Status, StoreErrorKind,
    TransportErrorKind,
};
use outbox::{RelayConfig, StoreOptions};
use outbox_testkit::{MySqlFixture, StoreFixture as _, wait_until, within};
use sqlx::{AssertSqlSafe, Executor as _};

use crate::relay::{counts_by_id, fast_config, relay_to, wait_all_status};

/// C01 on MariaDB: session A draws the lower AUTO_INCREMENT id and commits late, a rolled-back
/// insert leaves a gap; the row committed late is still published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_c01_late_commit_across_auto_increment_gap_is_published() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let mem = Arc::new(MemoryTransport::new());
    let relay = relay_to(&fx, mem.clone(), fast_config("r1")).spawn();
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
    let m2 = fx
        .enqueue_commit(vec![NewMessage::new("t", "M2")])
        .await
        .unwrap()[0];
    within("M2 published", Duration::from_secs(5), mem.wait_for(1)).await;
    assert_eq!(mem.delivered()[0].message.message_id, m2);
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    assert!(id2 - id1 >= 2, "the rolled-back insert left a gap");
    relay.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// The error numbers MariaDB reports for a deadlock (1213, SQLSTATE 40001) and a lock wait
/// timeout (1205, SQLSTATE HY000) are transient store errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_deadlock_and_lock_wait_timeout_are_transient() {
    let fx = MySqlFixture::new().await;
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
    fx.cleanup().await;
}

/// C31/C21 on MariaDB: 4 relays (each with its own pool, like 4 processes) drain 5,000 messages
/// while another session keeps updating the same rows in descending id order (the opposite of
/// the claim order). Every message is published exactly once, none fails, and the deadlocks and
/// lock wait timeouts InnoDB raises are retried and counted, never surfacing as failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_c31_concurrent_relays_and_contending_updates_lose_nothing() {
    crate::init_tracing();
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
        let relay = outbox::Relay::builder(Arc::new(store.clone()))
            .router(outbox::Router::single(mem.clone()))
            .config(config)
            .build()
            .unwrap();
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
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(5)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(AssertSqlSafe(format!("SET time_zone = '{tz}'")))
                    .await?;
                Ok(())
            })
        })
        .connect(&outbox_testkit::mysql_url())
        .await
        .expect("MySQL/MariaDB (OUTBOX_TEST_MYSQL_URL)");
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_c35_session_time_zones_do_not_shift_times() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let shanghai = mysql_store_in_time_zone(&fx, "+08:00").await;
    let utc = mysql_store_in_time_zone(&fx, "+00:00").await;
    let offset: i64 = sqlx::query_scalar("SELECT TIMESTAMPDIFF(HOUR, UTC_TIMESTAMP(), NOW())")
        .fetch_one(shanghai.pool())
        .await
        .unwrap();
    assert_eq!(offset, 8, "the session time zone is applied");
    let enqueue = |store: MySqlStore, msg: NewMessage| async move {
        let mut tx = store.pool().begin().await.unwrap();
        let id = store.enqueue(&mut tx, msg).await.unwrap();
        tx.commit().await.unwrap();
        id
    };
    let (a, b) = tokio::join!(
        enqueue(shanghai.clone(), NewMessage::new("t", "sh")),
        enqueue(utc.clone(), NewMessage::new("t", "utc"))
    );
    let (da, db) = tokio::join!(
        enqueue(
            shanghai.clone(),
            NewMessage::new("t", "sh-late").with_delay(Duration::from_secs(60))
        ),
        enqueue(
            utc.clone(),
            NewMessage::new("t", "utc-late").with_delay(Duration::from_secs(60))
        )
    );
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
    for reader in [&shanghai, &utc] {
        for id in [da, db] {
            let d = seconds(reader, &due_in, id).await;
            assert!((58.0..=60.0).contains(&d), "delayed message due in {d} s");
        }
    }
    // Only a relay in the +08:00 session processes; the broker refuses each once, and the
    // retry backoff is exactly 60 s.
    let mem = Arc::new(MemoryTransport::new());
    for id in [a, b, plain] {
        mem.fail_next(id, vec![TransportErrorKind::Retryable]);
    }
    let relay = Relay::builder(Arc::new(shanghai.clone()))
        .router(Router::single(mem.clone()))
        .config(RelayConfig {
            backoff: Backoff {
                base: Duration::from_secs(60),
                factor: 1.0,
                max: Duration::from_secs(60),
                jitter: 0.0,
            },
            ..fast_config("shanghai")
        })
        .build()
        .unwrap()
        .spawn();
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
    for reader in [&shanghai, &utc] {
        for id in [a, b, plain] {
            let d = seconds(reader, &due_in, id).await;
            assert!((58.0..=60.0).contains(&d), "retry due in {d} s");
        }
    }
    // Nothing is due for a relay in the +00:00 session either.
    let due = utc.next_due_in().await.unwrap().unwrap();
    assert!(due > Duration::from_secs(55), "next due in {due:?}");
    let _ = (shanghai.pool().close().await, utc.pool().close().await);
    fx.cleanup().await;
}

/// Binary payloads (0xFF 0xFE, NUL) and 4-byte UTF-8 (emoji) in topic, key, headers, payload and
/// error text round-trip byte-exact through MariaDB and a relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_binary_payloads_and_emoji_round_trip() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
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
    let mem = Arc::new(MemoryTransport::new());
    let relay = relay_to(&fx, mem.clone(), fast_config("r1")).spawn();
    within("3 deliveries", Duration::from_secs(10), mem.wait_for(3)).await;
    relay.shutdown().await.unwrap();
    let mut delivered = mem.delivered();
    delivered.sort_by_key(|d| d.message.id);
    assert_eq!(delivered[0].message.payload, binary);
    assert_eq!(delivered[1].message.payload, all_bytes);
    assert_eq!(delivered[2].message.payload, emoji.as_bytes());
    assert_eq!(delivered[2].message.topic, "订单.😀");
    fx.cleanup().await;
}

/// No LISTEN/NOTIFY on MySQL: a commit through [`MySqlStore::commit`] wakes the embedded relay at
/// once; a plain-SQL insert from elsewhere waits for the next poll. Measured with a 1 s poll
/// interval (the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_in_process_wake_beats_polling() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let mem = Arc::new(MemoryTransport::new());
    let config = RelayConfig {
        poll_interval: Duration::from_secs(1),
        ..fast_config("r1")
    };
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
    fx.cleanup().await;
}

/// The statements of this table's sessions that wait on a row lock now (MariaDB's
/// `information_schema.INNODB_TRX`), for tests that must see no relay statement blocked.
async fn lock_waits_on(fx: &MySqlFixture) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT COALESCE(trx_query, '?') FROM information_schema.INNODB_TRX \
         WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE CONCAT('%', ?, '%')",
    )
    .bind(&fx.table)
    .fetch_all(fx.store.pool())
    .await
    .expect("read information_schema.INNODB_TRX")
}

/// Wait until every row of `ids` is SENT; returns how long that took.
async fn wait_sent(fx: &MySqlFixture, ids: &[uuid::Uuid], what: &str, bound: Duration) -> Duration {
    let started = Instant::now();
    outbox_testkit::wait_until(what, bound, || async {
        let rows = fx.rows().await;
        ids.iter().all(|id| {
            rows.iter()
                .any(|r| r.message_id == *id && r.status == Status::Sent.as_i16())
        })
    })
    .await;
    started.elapsed()
}

/// Issue 11, item 3: on MariaDB one producer transaction held open stalled the relay. The
/// completion statement (`UPDATE … JOIN JSON_TABLE`) scanned the outbox by status when few rows
/// were pending and waited on the producer's uncommitted row for `innodb_lock_wait_timeout`
/// (50 s): both lanes blocked, leases ran out, batches were published again. Now an open
/// producer transaction, holding an outbox row of a bucket the relay owns and a business row for
/// more than three leases, delays nothing but its own row: the real relay publishes and records
/// every other row of that bucket and of others at once, each exactly once, with no lease lost
/// and no relay statement waiting on a lock; after the commit the held row is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_03_open_producer_transaction_delays_only_its_own_rows() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let t = fx.table.clone();
    fx.exec(&format!(
        "CREATE TABLE {t}_orders (id BIGINT NOT NULL PRIMARY KEY) ENGINE=InnoDB"
    ))
    .await;
    let lease = Duration::from_secs(3);
    // Far below the lease: a blocked completion (50 s lock wait) cannot meet it.
    let bound = lease / 2;
    let mem = Arc::new(MemoryTransport::new());
    let config = RelayConfig {
        lease,
        publish_timeout: Duration::from_secs(1),
        ..fast_config("r1")
    };
    let relay = relay_to(&fx, mem.clone(), config).spawn();
    outbox_testkit::wait_until(
        "the relay holds every bucket",
        Duration::from_secs(10),
        || async { relay.metrics().snapshot().buckets_acquired >= 64 },
    )
    .await;

    // The producer: a business row and an outbox row, not committed.
    let mut producer = fx.store.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {t}_orders (id) VALUES (1)"
    )))
    .execute(&mut *producer)
    .await
    .unwrap();
    let held = fx
        .store
        .enqueue(
            &mut producer,
            NewMessage::new("t", "held").with_partition_key("k-held"),
        )
        .await
        .unwrap();
    let opened = Instant::now();

    // Other producers commit rows of the held row's bucket (its key) and of other buckets, one
    // at a time (a quiet table: the completion statement's plan then scanned the outbox by
    // status, into the uncommitted row), while the transaction stays open.
    let mut others = Vec::new();
    let mut took = Vec::new();
    for i in 0..12 {
        let key = if i % 2 == 0 {
            "k-held".to_owned()
        } else {
            format!("k-{i}")
        };
        let msg = NewMessage::new("t", format!("m{i}")).with_partition_key(key);
        let ids = fx.enqueue_commit(vec![msg]).await.unwrap();
        took.push(wait_sent(&fx, &ids, "another row SENT", bound).await);
        others.extend(ids);
    }
    took.sort();

    // Keep the producer open for more than three leases, watching for relay statements that
    // wait on a lock (sampled every 50 ms).
    let mut waited: Vec<String> = Vec::new();
    while opened.elapsed() < lease * 3 + lease / 2 {
        waited.extend(lock_waits_on(&fx).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = relay.metrics().snapshot();
    println!(
        "defect_03: {} rows committed one by one, each SENT after median {:?}, max {:?}, while a \
         producer held its transaction {:?}; lost_leases {}, takeovers {}, stale batches {}, \
         lock conflicts retried {}",
        others.len(),
        took[took.len() / 2],
        took[took.len() - 1],
        opened.elapsed(),
        m.lost_leases,
        m.takeovers,
        m.stale_batches,
        fx.store.conflicts_retried()
    );
    assert!(
        waited.is_empty(),
        "relay statements waited on a lock: {waited:?}"
    );
    assert_eq!(
        m.lost_leases, 0,
        "a completion was refused: a lease ran out"
    );
    assert_eq!(m.takeovers, 0, "a bucket's lease ran out");
    assert_eq!(
        fx.store.conflicts_retried(),
        0,
        "a relay statement hit a lock conflict"
    );
    let counts = counts_by_id(&mem.delivered());
    assert!(
        !counts.contains_key(&held),
        "the uncommitted row was published"
    );
    for id in &others {
        assert_eq!(
            counts.get(id),
            Some(&1),
            "message {id} delivered {:?} times",
            counts.get(id)
        );
    }

    // The producer commits: its row is published once, like any other.
    fx.store.commit(producer).await.unwrap();
    wait_sent(&fx, &[held], "the held row SENT after its commit", bound).await;
    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), others.len() + 1);
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice: {counts:?}"
    );
    relay.shutdown().await.unwrap();
    fx.exec(&format!("DROP TABLE {t}_orders")).await;
    fx.cleanup().await;
}

/// Issue 11, item 3, maintenance: check-back and retention never wait on a row another
/// session holds (a consumer's rejection hook runs inside a transaction that locks its outbox
/// row; an application may lock its own message). Before, the reaper's `UPDATE … ORDER BY …
/// LIMIT` waited on such a row for `innodb_lock_wait_timeout` and check-back and retention
/// waited behind it (the reaper is gone since issue 12). Now each step skips locked rows (`FOR UPDATE SKIP LOCKED`), handles the
/// others at once, and takes the skipped ones once they are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_03_maintenance_skips_rows_another_transaction_locks() {
    crate::init_tracing();
    let fx = MySqlFixture::new().await;
    let t = fx.table.clone();
    // Two rows each: past retention (SENT an hour ago), a confirmation deadline passed (SENT).
    let kinds = [
        "2, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, NULL, NULL, NULL",
        "2, UTC_TIMESTAMP(6), NULL, NULL, UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE",
    ];
    let mut ids: Vec<(i64, i64)> = Vec::new();
    for cols in kinds {
        let mut pair = Vec::new();
        for _ in 0..2 {
            let id: u64 = sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {t} (topic, payload, attempts, status, sent_at, lease_expires_at, \
                 lease_owner, confirm_deadline) VALUES ('t', 'm', 1, {cols})"
            )))
            .execute(fx.store.pool())
            .await
            .unwrap()
            .last_insert_id();
            pair.push(id as i64);
        }
        ids.push((pair[0], pair[1]));
    }
    let [(purge_locked, purge_free), (check_locked, check_free)] = ids[..] else {
        unreachable!()
    };
    // Another session locks one row of each kind (by primary key: a covering scan of a
    // secondary index at REPEATABLE READ would lock every row) and holds an uncommitted
    // producer row.
    let mut other = fx.store.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id, payload FROM {t} FORCE INDEX (PRIMARY) \
         WHERE id IN ({purge_locked}, {check_locked}) FOR UPDATE"
    )))
    .fetch_all(&mut *other)
    .await
    .unwrap();
    fx.store
        .enqueue(&mut other, NewMessage::new("t", "held"))
        .await
        .unwrap();

    let mem = Arc::new(MemoryTransport::new());
    let config = RelayConfig {
        lease: Duration::from_secs(3),
        publish_timeout: Duration::from_secs(1),
        retention: Some(Duration::from_secs(60)),
        ..fast_config("r1")
    };
    let relay = relay_to(&fx, mem.clone(), config).spawn();
    let status_of = |rows: &[outbox_testkit::RowState], id: i64| {
        rows.iter().find(|r| r.id == id).map(|r| r.status)
    };
    let sent = Status::Sent.as_i16();
    // Far below the 50 s a blocked step would wait.
    let started = Instant::now();
    outbox_testkit::wait_until(
        "the unlocked rows purged and checked back, then published",
        Duration::from_secs(5),
        || async {
            let rows = fx.rows().await;
            status_of(&rows, purge_free).is_none()
                && status_of(&rows, check_free) == Some(sent)
                && mem.count() == 1
        },
    )
    .await;
    let took = started.elapsed();
    let waited = lock_waits_on(&fx).await;
    assert!(
        waited.is_empty(),
        "relay statements wait on a lock: {waited:?}"
    );
    let rows = fx.rows().await;
    assert!(
        status_of(&rows, purge_locked).is_some(),
        "a locked row was purged"
    );
    assert_eq!(status_of(&rows, check_locked), Some(sent));

    // The other session commits: the rows it held are handled now, each published once.
    other.commit().await.unwrap();
    outbox_testkit::wait_until(
        "the formerly locked rows handled",
        Duration::from_secs(5),
        || async {
            let rows = fx.rows().await;
            status_of(&rows, purge_locked).is_none()
                && rows.iter().all(|r| r.status == sent)
                && mem.count() == 3
        },
    )
    .await;
    println!(
        "defect_03 maintenance: unlocked rows handled after {took:?} while other rows were locked"
    );
    let counts = counts_by_id(&mem.delivered());
    assert_eq!(counts.len(), 3);
    assert!(
        counts.values().all(|n| *n == 1),
        "a message was published twice: {counts:?}"
    );
    relay.shutdown().await.unwrap();
    fx.cleanup().await;
}
