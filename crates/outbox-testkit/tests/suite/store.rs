//! The store conformance suite, run against SQLite (temporary file), PostgreSQL (own schema) and
//! MySQL/MariaDB (own tables).

use outbox_testkit_macros::suite_test;
fixture_tests!(
    stores_and_partitioned,
    [outbox_testkit::store_suite],
    [
        migrate_is_idempotent,
        rollback_is_never_visible,
        relays_never_share_a_bucket,
        lease_expiry_takeover_reads_again,
        stale_completion_writes_nothing,
        retry_backs_off_on_the_database_clock,
        dead_letter,
        relay_dead_letters_at_max_attempts,
        release_gives_the_attempt_back,
        validation_errors_write_nothing,
        c08_payload_round_trips_byte_exact = payload_round_trips_byte_exact,
        plain_sql_insert_is_delivered,
        migrate_releases_sending_rows_of_an_older_relay,
        invalid_table_identifiers_are_rejected,
        delayed_message_and_stats,
        confirmations_apply_in_batches,
        rejection_runs_the_hook_once,
        check_back_then_unconfirmed,
        retention_removes_only_old_finished_rows,
        stats_show_awaiting_confirmation,
        bucket_membership_fair_share,
        bucket_takeover_after_expiry,
        bucket_hand_over_and_route_sets,
        read_buckets_due_pending_in_order,
        bucket_fenced_completion,
        key_heads_first_open_and_failed,
        next_due_in_buckets_is_per_bucket,
    ],
);

/// Drop the PostgreSQL outbox `table` (unqualified, on `pool`'s search path) and what migrating it
/// made beside it: its buckets, relays and archive tables, its inbox `<table>_inbox` and that
/// inbox's dead letters, its NOTIFY function and their migration records. For a test that
/// migrated an outbox outside a [`PgFixture`](outbox_testkit::PgFixture)'s schema.
///
/// # Panics
/// On a database error.
pub(crate) async fn drop_pg_outbox(pool: &sqlx::PgPool, table: &str) {
    let t = table;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {t}, {t}_buckets, {t}_relays, {t}_archive, {t}_inbox, {t}_inbox_dlq; \
         DROP FUNCTION IF EXISTS {t}_notify(); \
         DELETE FROM outbox_migrations WHERE table_name IN ('{t}', '{t}_inbox')"
    )))
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("drop the outbox {t}: {e}"));
}

/// Concurrent `migrate` calls on PostgreSQL are serialised and all succeed.
#[suite_test]
async fn postgres_concurrent_migrate() {
    use outbox::store::Store as _;
    use outbox_testkit::StoreFixture as _;
    let fx = outbox_testkit::PgFixture::new().await;
    let (a, b, c) = tokio::join!(fx.store.migrate(), fx.store.migrate(), fx.store.migrate());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    fx.cleanup().await;
}

/// An unqualified PostgreSQL table name (the default layout) migrates and works too.
#[suite_test]
async fn postgres_unqualified_table() {
    use outbox::store::{MembershipRequest, Store as _};
    let pool = outbox_testkit::pg_pool(4).await;
    let t = outbox_testkit::unique("obx");
    let store = outbox::PgStore::from_pool(pool.clone(), outbox::StoreOptions::table(&t)).unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let id = store
        .enqueue(&mut tx, outbox::NewMessage::new("t", "x"))
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    // As the relay: a membership round, then a read of the buckets it holds.
    let round = store
        .membership(&MembershipRequest {
            relay: "t".into(),
            lease: std::time::Duration::from_secs(30),
            held: Vec::new(),
            acquire: true,
            routes: vec!["*".into()],
        })
        .await
        .unwrap();
    let buckets: Vec<_> = round.acquired.iter().map(|l| l.bucket).collect();
    assert_eq!(buckets.len(), usize::from(outbox::store::BUCKETS));
    let batch = store.read_buckets(&buckets, &[], 10).await.unwrap();
    assert_eq!(batch.rows[0].message.message_id, id);
    drop_pg_outbox(&pool, &t).await;
}

/// Concurrent `migrate` calls on MySQL/MariaDB are serialised by `GET_LOCK` and all succeed.
#[suite_test]
async fn mysql_concurrent_migrate() {
    use outbox::store::Store as _;
    use outbox_testkit::StoreFixture as _;
    let fx = outbox_testkit::MySqlFixture::new().await;
    let (a, b, c) = tokio::join!(fx.store.migrate(), fx.store.migrate(), fx.store.migrate());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    let versions = fx
        .count(&format!(
            "outbox_migrations WHERE table_name IN ('{t}', '{t}_inbox')",
            t = fx.table
        ))
        .await;
    assert_eq!(
        versions, 9,
        "seven outbox versions (v5 is PostgreSQL's alone) and two inbox versions, once each"
    );
    fx.cleanup().await;
}

/// A MySQL/MariaDB migration interrupted between its DDL statements (each commits by itself):
/// v6's first `ALTER` applied, its second not, the version not recorded (a crash or a lost
/// connection in between, or membership tables left behind by a dropped outbox table). `migrate`
/// runs again, meets the column that is already there, applies the rest and records v6. Before
/// the fix it failed for good with "1060 Duplicate column name 'routes'" (CI's MariaDB demo).
#[suite_test]
async fn mysql_migration_interrupted_between_statements_completes_on_the_next_run() {
    use outbox::store::Store as _;
    use outbox_testkit::StoreFixture as _;
    let fx = outbox_testkit::MySqlFixture::new().await;
    fx.store.migrate().await.unwrap();
    let t = fx.table.clone();
    for sql in [
        format!("ALTER TABLE {t}_buckets DROP COLUMN handoff"),
        format!("DELETE FROM outbox_migrations WHERE table_name = '{t}' AND version = 6"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(fx.store.pool())
            .await
            .unwrap();
    }
    fx.store
        .migrate()
        .await
        .expect("migrate completes an interrupted migration");
    let handoff: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE() \
         AND table_name = ? AND column_name = 'handoff'",
    )
    .bind(format!("{t}_buckets"))
    .fetch_one(fx.store.pool())
    .await
    .unwrap();
    assert_eq!(
        handoff, 1,
        "the statement not applied before is applied now"
    );
    assert_eq!(
        fx.count(&format!(
            "outbox_migrations WHERE table_name = '{t}' AND version = 6"
        ))
        .await,
        1
    );
    fx.cleanup().await;
}

/// `PgStore::connect` and `MySqlStore::connect` against the real servers: their pools (with the
/// `TCP_NODELAY` hook after each connect) open, migrate, and carry a producer's
/// `begin` / `enqueue` / `commit` to a committed PENDING row.
#[suite_test]
async fn connect_pools_carry_a_producer_transaction() {
    use outbox::store::Store as _;
    use outbox_testkit::Producer as _;
    let table = outbox_testkit::unique("obx_connect");
    let options = || outbox::StoreOptions {
        inbox_table: format!("{table}_inbox"),
        ..outbox::StoreOptions::table(table.clone())
    };
    let pg = outbox::PgStore::connect(&outbox_testkit::postgres_url(), options())
        .await
        .expect("PgStore::connect");
    pg.migrate().await.unwrap();
    let id = pg
        .enqueue_committed(outbox::NewMessage::new("t", "pg"))
        .await;
    let status: i16 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {table} WHERE message_id = $1"
    )))
    .bind(id)
    .fetch_one(pg.pool())
    .await
    .unwrap();
    assert_eq!(status, 0);
    drop_pg_outbox(pg.pool(), &table).await;

    let my = outbox::MySqlStore::connect(&outbox_testkit::mysql_url(), options())
        .await
        .expect("MySqlStore::connect");
    my.migrate().await.unwrap();
    let id = my
        .enqueue_committed(outbox::NewMessage::new("t", "mysql"))
        .await;
    let status: i16 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {table} WHERE message_id = ?"
    )))
    .bind(id.to_string())
    .fetch_one(my.pool())
    .await
    .unwrap();
    assert_eq!(status, 0);
    for t in ["", "_buckets", "_relays", "_inbox", "_inbox_dlq"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {table}{t}"
        )))
        .execute(my.pool())
        .await
        .unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM outbox_migrations WHERE table_name LIKE '{table}%'"
    )))
    .execute(my.pool())
    .await
    .unwrap();
}

/// MariaDB: a pooled connection that comes back with a transaction still open on the server (a
/// future cancelled between `START TRANSACTION` and its answer leaves sqlx unaware of it) does not
/// make the store's next READ COMMITTED transaction or its stats snapshot fail (MySQL refuses
/// `SET TRANSACTION` inside a transaction: error 1568, seen in CI's MariaDB demo).
#[suite_test]
async fn mysql_connection_left_in_a_transaction_is_recovered() {
    use outbox::store::Store as _;
    use outbox_testkit::StoreFixture as _;
    // One connection, so the store gets the one that was left in a transaction.
    let fx = outbox_testkit::MySqlFixture::with_pool(outbox_testkit::mysql_pool(1).await).await;
    let leak = || async {
        let mut conn = fx.store.pool().acquire().await.unwrap();
        // Behind sqlx's back, as the cancelled future left it.
        sqlx::raw_sql("START TRANSACTION")
            .execute(&mut *conn)
            .await
            .unwrap();
    };
    leak().await;
    let stats = fx
        .store
        .stats()
        .await
        .expect("stats after a leaked transaction");
    assert!(stats.counts.values().all(|n| *n == 0), "{stats:?}");
    let id = fx.insert_plain_sql("t", b"x").await;
    leak().await;
    // The relay's membership round runs in a READ COMMITTED transaction (`begin_rc`).
    let round = fx
        .store
        .membership(&outbox::store::MembershipRequest {
            relay: "r".into(),
            lease: std::time::Duration::from_secs(5),
            held: Vec::new(),
            acquire: true,
            routes: vec!["*".into()],
        })
        .await
        .expect("membership after a leaked transaction");
    let buckets: Vec<_> = round.acquired.iter().map(|l| l.bucket).collect();
    assert_eq!(buckets.len(), usize::from(outbox::store::BUCKETS));
    let batch = fx.store.read_buckets(&buckets, &[], 10).await.unwrap();
    assert_eq!(batch.rows.len(), 1);
    assert_eq!(batch.rows[0].message.message_id, id);
    fx.cleanup().await;
}
