//! SQLite migrations: the steps of each table, applied once each.

use super::*;
use crate::store::shared::MigrationLog;
use crate::store::status_sql::{LAST, PREPARED};

pub(crate) fn migrations(t: &str, inbox: &str) -> Vec<(String, i64, String)> {
    let mut steps = vec![
        (
            t.to_owned(),
            1,
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    message_id TEXT NOT NULL UNIQUE,
                    topic TEXT NOT NULL,
                    partition_key TEXT,
                    headers TEXT NOT NULL DEFAULT '{{}}',
                    payload BLOB NOT NULL,
                    status INTEGER NOT NULL DEFAULT {PENDING} CHECK (status BETWEEN {PENDING} AND {REJECTED}),
                    attempts INTEGER NOT NULL DEFAULT 0,
                    max_attempts INTEGER CHECK (max_attempts >= 1),
                    available_at INTEGER NOT NULL DEFAULT ({NOW_MS}),
                    lease_owner TEXT,
                    lease_token INTEGER,
                    lease_expires_at INTEGER,
                    created_at INTEGER NOT NULL DEFAULT ({NOW_MS}),
                    sent_at INTEGER,
                    confirmed_at INTEGER,
                    updated_at INTEGER NOT NULL DEFAULT ({NOW_MS}),
                    last_error TEXT
                );
                CREATE INDEX IF NOT EXISTS {t}_claimable ON {t} (available_at, id) WHERE status = {PENDING};
                CREATE INDEX IF NOT EXISTS {t}_leased ON {t} (lease_expires_at) WHERE status = {SENDING};
                CREATE INDEX IF NOT EXISTS {t}_sent ON {t} (sent_at) WHERE status = {SENT};
                CREATE INDEX IF NOT EXISTS {t}_failed ON {t} (updated_at) WHERE status = {FAILED};
                CREATE INDEX IF NOT EXISTS {t}_partition_key ON {t} (partition_key) WHERE partition_key IS NOT NULL;"
            ),
        ),
        (
            t.to_owned(),
            2,
            format!(
                "ALTER TABLE {t} ADD COLUMN confirm_deadline INTEGER;
                ALTER TABLE {t} ADD COLUMN check_backs INTEGER NOT NULL DEFAULT 0;
                CREATE INDEX IF NOT EXISTS {t}_unconfirmed ON {t} (confirm_deadline) WHERE status = {SENT} AND confirm_deadline IS NOT NULL;
                CREATE INDEX IF NOT EXISTS {t}_finished ON {t} (confirmed_at) WHERE status IN ({CONFIRMED}, {REJECTED});"
            ),
        ),
        (
            t.to_owned(),
            3,
            format!("ALTER TABLE {t} ADD COLUMN redelivery INTEGER NOT NULL DEFAULT 0;"),
        ),
        (
            t.to_owned(),
            4,
            // Bucket leases and per-key order (docs/design/one-write-and-ordering.md). ALTER
            // TABLE can add only a VIRTUAL generated column; it is computed on read and stored
            // in the indexes that name it. Times are milliseconds of SQLite's clock; a bucket
            // nobody holds expired at 0.
            format!(
                "ALTER TABLE {t} ADD COLUMN bucket INTEGER GENERATED ALWAYS AS {bucket} VIRTUAL;
                CREATE INDEX IF NOT EXISTS {t}_bucket_pending ON {t} (bucket, id) WHERE status = {PENDING};
                CREATE INDEX IF NOT EXISTS {t}_key_open ON {t} (partition_key, id) \
                  WHERE status IN ({PENDING}, {SENDING}, {FAILED}) AND partition_key IS NOT NULL;
                DROP INDEX IF EXISTS {t}_partition_key;
                CREATE TABLE IF NOT EXISTS {t}_buckets (
                    bucket INTEGER PRIMARY KEY,
                    owner TEXT,
                    token INTEGER,
                    expires_at INTEGER NOT NULL DEFAULT 0,
                    takeovers INTEGER NOT NULL DEFAULT 0
                );
                WITH RECURSIVE n(b) AS (SELECT 0 UNION ALL SELECT b + 1 FROM n WHERE b < {last})
                  INSERT OR IGNORE INTO {t}_buckets (bucket) SELECT b FROM n;
                CREATE TABLE IF NOT EXISTS {t}_relays (
                    name TEXT PRIMARY KEY,
                    heartbeat_at INTEGER NOT NULL
                );",
                bucket = bucket_expr(),
                last = super::super::BUCKETS - 1,
            ),
        ),
        (
            t.to_owned(),
            6,
            // Route sets in the membership and bucket hand-over (docs/ordering.md, "Relays with
            // different routes"). Version 5 is PostgreSQL's deferred NOTIFY: SQLite has none.
            format!(
                "ALTER TABLE {t}_relays ADD COLUMN routes TEXT;
                ALTER TABLE {t}_relays ADD COLUMN routes_hash TEXT;
                ALTER TABLE {t}_buckets ADD COLUMN handoff TEXT;"
            ),
        ),
        (
            t.to_owned(),
            7,
            // The archive (crate::admin): discarded dead letters, out of the outbox but kept; and
            // two small partial indexes for the admin search on a large table: dead letters and
            // rows with an error, in id order (docs/benchmarks.md).
            format!(
                "CREATE TABLE IF NOT EXISTS {t}_archive (
                    id INTEGER PRIMARY KEY,
                    message_id TEXT NOT NULL,
                    topic TEXT NOT NULL,
                    partition_key TEXT,
                    headers TEXT NOT NULL,
                    payload BLOB NOT NULL,
                    status INTEGER NOT NULL,
                    attempts INTEGER NOT NULL,
                    max_attempts INTEGER,
                    available_at INTEGER NOT NULL,
                    created_at INTEGER NOT NULL,
                    sent_at INTEGER,
                    confirmed_at INTEGER,
                    updated_at INTEGER NOT NULL,
                    last_error TEXT,
                    confirm_deadline INTEGER,
                    check_backs INTEGER NOT NULL,
                    redelivery INTEGER NOT NULL,
                    archived_at INTEGER NOT NULL,
                    archive_reason TEXT NOT NULL
                );
                CREATE INDEX IF NOT EXISTS {t}_archive_archived_at ON {t}_archive (archived_at);
                CREATE INDEX IF NOT EXISTS {t}_dead_id ON {t} (id) WHERE status IN ({FAILED}, {REJECTED});
                CREATE INDEX IF NOT EXISTS {t}_error_id ON {t} (id) WHERE last_error IS NOT NULL;"
            ),
        ),
        (
            t.to_owned(),
            8,
            // Two-phase messages (crate::two_phase, docs/two-phase.md): the check-back target of
            // a PREPARED row; ROLLED_BACK and UNDECIDED in the status check, by SQLite's
            // documented edit of the table's definition for a loosened CHECK (lang_altertable.html
            // §7: no row changes; `run_migrations` bumps the schema version so every connection
            // reloads it); the due PREPARED rows of a bucket.
            format!(
                "ALTER TABLE {t} ADD COLUMN check_back TEXT;
                PRAGMA writable_schema = ON;
                UPDATE sqlite_master SET sql = replace(sql, 'CHECK (status BETWEEN {PENDING} AND {REJECTED})', \
                  'CHECK (status BETWEEN {PENDING} AND {LAST})') WHERE type = 'table' AND name = '{t}';
                PRAGMA writable_schema = OFF;
                CREATE INDEX IF NOT EXISTS {t}_prepared_due ON {t} (bucket, available_at) WHERE status = {PREPARED};"
            ),
        ),
    ];
    steps.extend(inbox_steps(inbox));
    steps
}

/// The inbox table and the consumer dead-letter table `<inbox>_dlq`.
pub(crate) fn inbox_steps(inbox: &str) -> Vec<(String, i64, String)> {
    vec![
        (
            inbox.to_owned(),
            1,
            format!(
                "CREATE TABLE IF NOT EXISTS {inbox} (
                    consumer TEXT NOT NULL,
                    message_id TEXT NOT NULL,
                    topic TEXT NOT NULL,
                    received_at INTEGER NOT NULL DEFAULT ({NOW_MS}),
                    outcome INTEGER NOT NULL DEFAULT 0,
                    PRIMARY KEY (consumer, message_id)
                );
                CREATE INDEX IF NOT EXISTS {inbox}_received_at ON {inbox} (received_at);"
            ),
        ),
        (
            inbox.to_owned(),
            2,
            format!(
                "ALTER TABLE {inbox} ADD COLUMN reason TEXT;
                CREATE TABLE IF NOT EXISTS {inbox}_dlq (
                    consumer TEXT NOT NULL,
                    message_id TEXT NOT NULL,
                    topic TEXT NOT NULL,
                    partition_key TEXT,
                    headers TEXT NOT NULL,
                    payload BLOB NOT NULL,
                    error TEXT NOT NULL,
                    deliveries INTEGER NOT NULL,
                    failed_at INTEGER NOT NULL DEFAULT ({NOW_MS}),
                    replay_requested_at INTEGER,
                    PRIMARY KEY (consumer, message_id)
                );"
            ),
        ),
    ]
}

/// `outbox_migrations` on SQLite.
static LOG: MigrationLog = MigrationLog {
    newest: "SELECT MAX(version) FROM outbox_migrations WHERE table_name = ?1",
    applied: "SELECT COUNT(*) FROM outbox_migrations WHERE table_name = ?1 AND version = ?2",
    record: "INSERT INTO outbox_migrations (table_name, version) VALUES (?1, ?2)",
};

/// Apply migrations for the given tables, each once, recorded in `outbox_migrations`.
pub(crate) async fn run_migrations(
    pool: &SqlitePool,
    steps: Vec<(String, i64, String)>,
) -> Result<(), StoreError> {
    let e = |op| move |e| crate::store::database_error(op, e);
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS outbox_migrations (table_name TEXT NOT NULL, version INTEGER NOT NULL, \
         applied_at INTEGER NOT NULL DEFAULT (CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)), \
         PRIMARY KEY (table_name, version))",
    )
    .execute(pool)
    .await
    .map_err(e("migrate"))?;
    // A table migrated by a newer build is left alone: this build does not know its schema.
    let mut conn = pool.acquire().await.map_err(e("migrate"))?;
    LOG.on::<sqlx::Sqlite>(&mut *conn)
        .refuse_newer(&steps)
        .await?;
    drop(conn);
    for (table, version, sql) in steps {
        let mut conn = pool.acquire().await.map_err(e("migrate"))?;
        let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE")
            .await
            .map_err(e("migrate"))?;
        if LOG
            .on::<sqlx::Sqlite>(&mut tx)
            .applied(&table, version)
            .await?
        {
            continue;
        }
        let edits_schema = sql.contains("writable_schema");
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await
            .map_err(e("migrate"))?;
        if edits_schema {
            // A step that edited `sqlite_master` itself: one more schema version, so every
            // connection (this pool's and other processes') re-reads the definitions.
            let v: i64 = sqlx::query_scalar("PRAGMA schema_version")
                .fetch_one(&mut *tx)
                .await
                .map_err(e("migrate"))?;
            sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA schema_version = {}", v + 1)))
                .execute(&mut *tx)
                .await
                .map_err(e("migrate"))?;
        }
        LOG.on::<sqlx::Sqlite>(&mut tx)
            .record(&table, version)
            .await?;
        tx.commit().await.map_err(e("migrate"))?;
        tracing::info!(table, version, "applied SQLite migration");
    }
    Ok(())
}

pub(crate) fn inbox_migrations(inbox: &crate::ident::TableName) -> Vec<(String, i64, String)> {
    inbox_steps(inbox.as_str())
}
