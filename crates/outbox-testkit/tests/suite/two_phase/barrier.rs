//! The barrier's races, in the business database (here the fixture's own database, another
//! table), and the barrier as the check-back of a relay, in process and over HTTP.

use super::*;
use futures::future::BoxFuture;
use outbox::two_phase::barrier::{Barrier, BarrierDatabase, BarrierError};
use outbox_testkit_macros::suite_test;
use sqlx::{Pool, Row};

/// Whether a statement on the barrier table waits for a row lock (PostgreSQL, InnoDB);
/// `None` where that cannot be seen (SQLite: its single writer waits in the busy handler).
type Waiting<'a> = Option<Box<dyn Fn() -> BoxFuture<'a, bool> + Send + Sync + 'a>>;

async fn scenarios<DB: BarrierDatabase + 'static>(
    fx: &dyn StoreFixture,
    pool: Pool<DB>,
    table: &str,
    waiting: Waiting<'_>,
) {
    let barrier = Barrier::new(pool.clone()).with_table(table).unwrap();
    barrier.migrate().await.unwrap();
    barrier.migrate().await.expect("migrate is idempotent");

    // 1. The business transaction marked and is still running when the check comes: the
    //    check waits for it; it commits: COMMIT.
    for commit in [true, false] {
        let id = Uuid::now_v7();
        let mut tx = pool.begin().await.unwrap();
        barrier.mark(&mut *tx, id).await.unwrap();
        let b = barrier.clone();
        let check = tokio::spawn(async move { b.resolve(id).await });
        if let Some(w) = &waiting {
            wait_until("the check-back waits for the business transaction", WAIT, w).await;
            assert!(!check.is_finished());
        }
        let want = if commit {
            tx.commit().await.unwrap();
            Answer::Commit
        } else {
            tx.rollback().await.unwrap();
            Answer::Rollback
        };
        assert_eq!(check.await.unwrap().unwrap(), want, "commit = {commit}");
        // Asked again: the same answer (the tombstone or the mark stays).
        assert_eq!(barrier.resolve(id).await.unwrap(), want);
    }

    // 2. The check came first (the business transaction had not started, or not marked
    //    yet): ROLLBACK, and the transaction that marks afterwards is refused.
    let id = Uuid::now_v7();
    assert_eq!(barrier.resolve(id).await.unwrap(), Answer::Rollback);
    let mut tx = pool.begin().await.unwrap();
    match barrier.mark(&mut *tx, id).await {
        Err(BarrierError::Decided(d)) => assert_eq!(d, id),
        other => panic!("a mark after the tombstone must be refused: {other:?}"),
    }
    tx.rollback().await.unwrap();
    assert_eq!(barrier.resolve(id).await.unwrap(), Answer::Rollback);

    // 3. Through the relay: the producer crashed after its business commit (check-back
    //    COMMIT, in process), and after a business rollback (check-back ROLLBACK, over
    //    HTTP, signed).
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/outbox/check-back",
        listener.local_addr().unwrap()
    );
    let app = barrier.router("/outbox/check-back", Some(secret)).unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let policy = CheckBackPolicy {
        secret: Some(secret.into()),
        ..fast_policy()
    };
    let (mem, h) = orders_relay(fx, policy, barrier.hook());
    let store = fx.store();
    // The first check 2 s after the prepare: the business transaction commits long before it.
    // Should the check still come first (a stalled test machine), the barrier refuses the late
    // mark and the message must be rolled back instead: either way, published iff committed.
    let committed = store
        .prepare(
            NewMessage::new("orders", "1"),
            &hooked("orders").after(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let business_committed = match barrier.mark(&mut *tx, committed).await {
        Ok(()) => {
            tx.commit().await.unwrap();
            true
        }
        Err(BarrierError::Decided(_)) => {
            tx.rollback().await.unwrap();
            false
        }
        Err(e) => panic!("mark: {e}"),
    };
    let http = CheckBack::http(&url)
        .unwrap()
        .after(Duration::from_millis(50));
    let rolled_back = store
        .prepare(NewMessage::new("orders", "2"), &http)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    // Refused when the check came first: rolled back all the same.
    let _ = barrier.mark(&mut *tx, rolled_back).await;
    tx.rollback().await.unwrap();
    if business_committed {
        wait_published(&mem, committed).await;
    } else {
        wait_status(fx, committed, Status::RolledBack).await;
    }
    wait_status(fx, rolled_back, Status::RolledBack).await;
    h.shutdown().await.unwrap();
    assert_eq!(published(&mem, committed), usize::from(business_committed));
    assert_eq!(published(&mem, rolled_back), 0);
}

#[suite_test]
async fn barrier_races_and_check_back_sqlite(fx: outbox_testkit::SqliteFixture) {
    scenarios(&fx, fx.store.pool().clone(), "outbox_barrier", None).await;
}

#[suite_test]
async fn barrier_races_and_check_back_postgres(fx: outbox_testkit::PgFixture) {
    let pool = fx.store.pool().clone();
    let table = format!("{}.outbox_barrier", fx.schema);
    let p = outbox_testkit::pg_pool(1).await;
    let waiting: Waiting = Some(Box::new(move || {
        let p = p.clone();
        Box::pin(async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query LIKE 'INSERT INTO %outbox_barrier%'",
            )
            .fetch_one(&p)
            .await
            .unwrap();
            n > 0
        })
    }));
    scenarios(&fx, pool, &table, waiting).await;
}

#[suite_test]
async fn barrier_races_and_check_back_mysql(fx: outbox_testkit::MySqlFixture) {
    let pool = fx.store.pool().clone();
    let table = format!("{}_barrier", fx.table);
    // The probe has a connection of its own: on the store's pool it took the connection the
    // check-back waited for (seen: the check never started while the probe polled).
    let (p, t) = (outbox_testkit::mysql_pool(1).await, table.clone());
    let waiting: Waiting = Some(Box::new(move || {
        let (p, t) = (p.clone(), t.clone());
        Box::pin(async move {
            let row = sqlx::query(
                // The check's insert in progress, whatever it waits on (the row lock, or the
                // table's metadata lock before InnoDB sees it as a transaction).
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                 WHERE ID <> CONNECTION_ID() AND INFO LIKE CONCAT('INSERT IGNORE INTO %', ?, '%')",
            )
            .bind(t)
            .fetch_one(&p)
            .await
            .unwrap();

            row.get::<i64, _>(0) > 0
        })
    }));
    scenarios(&fx, pool, &table, waiting).await;
    fx.exec(&format!("DROP TABLE IF EXISTS {table}")).await;
}
