//! Issue 11, item 3 on MySQL/MariaDB: a producer transaction held open, or rows another transaction
//! locks, delay only those rows; the relay's statements never wait on them.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::RelayConfig;
use outbox::{MemoryTransport, NewMessage, Status};
use outbox_testkit::{MySqlFixture, StoreFixture as _};
use sqlx::AssertSqlSafe;

use crate::relay::{counts_by_id, fast_config, relay_to};

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
#[suite_test]
async fn defect_03_open_producer_transaction_delays_only_its_own_rows(fx: MySqlFixture) {
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
    outbox_testkit::wait_metrics(relay.metrics(), 10, "the relay holds every bucket", |m| {
        m.buckets_acquired >= 64
    })
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
}

/// Issue 11, item 3, maintenance: check-back and retention never wait on a row another
/// session holds (a consumer's rejection hook runs inside a transaction that locks its outbox
/// row; an application may lock its own message). Before, the reaper's `UPDATE … ORDER BY …
/// LIMIT` waited on such a row for `innodb_lock_wait_timeout` and check-back and retention
/// waited behind it (the reaper is gone since issue 12). Now each step skips locked rows (`FOR UPDATE SKIP LOCKED`), handles the
/// others at once, and takes the skipped ones once they are free.
#[suite_test]
async fn defect_03_maintenance_skips_rows_another_transaction_locks(fx: MySqlFixture) {
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
        retention: outbox::retention::Retention::finished_after(Duration::from_secs(60)),
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
}
