//! MySQL/MariaDB migrations: the steps of each table, applied once each under a named lock.

use super::*;
use crate::store::shared::MigrationLog;

/// Each step is a list of statements, of which only the last may be non-idempotent (MySQL DDL
/// is not transactional; `CREATE TABLE IF NOT EXISTS` is, and a single `ALTER TABLE` is atomic).
pub(super) type Step = (String, i64, Vec<String>);

pub(crate) fn migrations(table: &TableName, inbox: &TableName) -> Vec<Step> {
    let t = table.as_str();
    let f = table.unqualified();
    let mut steps = vec![
        (
            t.to_owned(),
            1,
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                    message_id CHAR(36) CHARACTER SET ascii NOT NULL DEFAULT (UUID()),
                    topic TEXT NOT NULL,
                    partition_key VARCHAR(255),
                    headers LONGTEXT NOT NULL DEFAULT ('{{}}'),
                    payload LONGBLOB NOT NULL,
                    status SMALLINT NOT NULL DEFAULT {PENDING} CHECK (status BETWEEN {PENDING} AND {REJECTED}),
                    attempts INT NOT NULL DEFAULT 0,
                    max_attempts INT CHECK (max_attempts >= 1),
                    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
                    lease_owner TEXT,
                    lease_token BIGINT,
                    lease_expires_at DATETIME(6),
                    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
                    sent_at DATETIME(6),
                    confirmed_at DATETIME(6),
                    updated_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
                    last_error LONGTEXT,
                    UNIQUE KEY {f}_message_id_key (message_id),
                    KEY {f}_claimable (status, available_at, id),
                    KEY {f}_leased (status, lease_expires_at),
                    KEY {f}_sent (status, sent_at),
                    KEY {f}_failed (status, updated_at),
                    KEY {f}_partition_key (partition_key)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            )],
        ),
        (
            t.to_owned(),
            2,
            vec![format!(
                "ALTER TABLE {t} ADD COLUMN confirm_deadline DATETIME(6), \
                 ADD COLUMN check_backs INT NOT NULL DEFAULT 0, \
                 ADD KEY {f}_unconfirmed (status, confirm_deadline), \
                 ADD KEY {f}_finished (status, confirmed_at)"
            )],
        ),
        (
            t.to_owned(),
            3,
            vec![format!(
                "ALTER TABLE {t} ADD COLUMN redelivery INT NOT NULL DEFAULT 0"
            )],
        ),
        (
            t.to_owned(),
            4,
            // Bucket leases and per-key order (docs/design/one-write-and-ordering.md). The
            // bucket is a stored generated column, so plain-SQL producers get it. MariaDB
            // refuses a CHAR column as such in a stored expression (its value would depend on
            // `PAD_CHAR_TO_FULL_LENGTH`); RTRIM removes that dependence and changes no UUID.
            // No partial indexes: pending rows of a bucket are found through
            // (status, bucket, id), the heads of a key through (partition_key, status, id),
            // which replaces the plain partition_key index.
            vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t}_buckets (
                        bucket SMALLINT NOT NULL PRIMARY KEY,
                        owner VARCHAR(255),
                        token BIGINT,
                        expires_at DATETIME(6) NOT NULL DEFAULT {LONG_AGO},
                        takeovers BIGINT NOT NULL DEFAULT 0
                    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                ),
                format!(
                    "INSERT INTO {t}_buckets (bucket) VALUES {} ON DUPLICATE KEY UPDATE bucket = bucket",
                    (0..super::super::BUCKETS)
                        .map(|b| format!("({b})"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {t}_relays (
                        name VARCHAR(255) NOT NULL PRIMARY KEY,
                        heartbeat_at DATETIME(6) NOT NULL
                    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                ),
                format!(
                    "ALTER TABLE {t} ADD COLUMN bucket SMALLINT AS \
                       (CRC32(COALESCE(partition_key, RTRIM(message_id))) % {buckets}) STORED, \
                     ADD KEY {f}_bucket_pending (status, bucket, id), \
                     ADD KEY {f}_key_open (partition_key, status, id), \
                     DROP KEY {f}_partition_key",
                    buckets = super::super::BUCKETS
                ),
            ],
        ),
        (
            t.to_owned(),
            6,
            // Route sets in the membership and bucket hand-over (docs/ordering.md, "Relays with
            // different routes"); only the small membership tables change. Version 5 is
            // PostgreSQL's deferred NOTIFY: MySQL has none.
            vec![
                format!(
                    "ALTER TABLE {t}_relays ADD COLUMN routes LONGTEXT NULL, \
                     ADD COLUMN routes_hash VARCHAR(64) NULL"
                ),
                format!("ALTER TABLE {t}_buckets ADD COLUMN handoff VARCHAR(255) NULL"),
            ],
        ),
        (
            t.to_owned(),
            7,
            // The archive (crate::admin): discarded dead letters, out of the outbox but kept. No
            // search index: MySQL has no partial index, and one on every row costs every insert
            // and every state change (docs/benchmarks.md).
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {t}_archive (
                    id BIGINT NOT NULL PRIMARY KEY,
                    message_id CHAR(36) CHARACTER SET ascii NOT NULL,
                    topic TEXT NOT NULL,
                    partition_key VARCHAR(255),
                    headers LONGTEXT NOT NULL,
                    payload LONGBLOB NOT NULL,
                    status SMALLINT NOT NULL,
                    attempts INT NOT NULL,
                    max_attempts INT,
                    available_at DATETIME(6) NOT NULL,
                    created_at DATETIME(6) NOT NULL,
                    sent_at DATETIME(6),
                    confirmed_at DATETIME(6),
                    updated_at DATETIME(6) NOT NULL,
                    last_error LONGTEXT,
                    confirm_deadline DATETIME(6),
                    check_backs INT NOT NULL,
                    redelivery INT NOT NULL,
                    archived_at DATETIME(6) NOT NULL,
                    archive_reason VARCHAR(64) NOT NULL,
                    KEY {f}_archive_archived_at (archived_at)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            )],
        ),
        (
            t.to_owned(),
            8,
            // Two-phase messages (crate::two_phase, docs/two-phase.md): the check-back target of
            // a PREPARED row, and the status range check dropped so that ROLLED_BACK and
            // UNDECIDED fit (adding a wider one would copy the whole table on MariaDB; the
            // statuses a relay writes come from `message::Status`). Due PREPARED rows of a bucket
            // are found through (status, bucket, id).
            vec![
                format!("ALTER TABLE {t} ADD COLUMN check_back TEXT NULL"),
                DROP_STATUS_CHECK.to_owned(),
            ],
        ),
    ];
    steps.extend(inbox_steps(inbox));
    steps
}

/// The inbox table and the consumer dead-letter table `<inbox>_dlq`.
pub(crate) fn inbox_steps(inbox: &TableName) -> Vec<Step> {
    let i = inbox.as_str();
    let fi = inbox.unqualified();
    vec![
        (
            i.to_owned(),
            1,
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {i} (
                    consumer VARCHAR(255) NOT NULL,
                    message_id CHAR(36) CHARACTER SET ascii NOT NULL,
                    topic TEXT NOT NULL,
                    received_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
                    outcome SMALLINT NOT NULL DEFAULT 0,
                    PRIMARY KEY (consumer, message_id),
                    KEY {fi}_received_at (received_at)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            )],
        ),
        (
            i.to_owned(),
            2,
            vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {i}_dlq (
                        consumer VARCHAR(255) NOT NULL,
                        message_id CHAR(36) CHARACTER SET ascii NOT NULL,
                        topic TEXT NOT NULL,
                        partition_key VARCHAR(255),
                        headers LONGTEXT NOT NULL,
                        payload LONGBLOB NOT NULL,
                        error LONGTEXT NOT NULL,
                        deliveries INT NOT NULL,
                        failed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
                        replay_requested_at DATETIME(6),
                        PRIMARY KEY (consumer, message_id),
                        KEY {fi}_dlq_replay (consumer, replay_requested_at)
                    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                ),
                format!("ALTER TABLE {i} ADD COLUMN reason LONGTEXT"),
            ],
        ),
    ]
}

pub(crate) fn inbox_migrations(inbox: &TableName) -> Vec<Step> {
    inbox_steps(inbox)
}

/// A migration statement standing for [`drop_status_check`] (its constraint's name differs: the
/// column's name on MariaDB, `<table>_chk_<n>` on MySQL).
const DROP_STATUS_CHECK: &str = "-- outbox: drop the status range check";

/// Drop the `CHECK (status BETWEEN …)` constraint(s) of `table`, found by their clause; none
/// found (dropped by an earlier, interrupted run) is done.
async fn drop_status_check(
    conn: &mut sqlx::MySqlConnection,
    table: &str,
) -> Result<(), StoreError> {
    let e = |e| crate::store::database_error("migrate", e);
    let (schema, name) = match table.split_once('.') {
        Some((s, n)) => (Some(s), n),
        None => (None, table),
    };
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT tc.CONSTRAINT_NAME FROM information_schema.TABLE_CONSTRAINTS tc \
         JOIN information_schema.CHECK_CONSTRAINTS cc \
           ON cc.CONSTRAINT_SCHEMA = tc.CONSTRAINT_SCHEMA AND cc.CONSTRAINT_NAME = tc.CONSTRAINT_NAME \
         WHERE tc.TABLE_SCHEMA = COALESCE(?, DATABASE()) AND tc.TABLE_NAME = ? \
           AND tc.CONSTRAINT_TYPE = 'CHECK' AND cc.CHECK_CLAUSE LIKE '%status%between%'",
    )
    .bind(schema)
    .bind(name)
    .fetch_all(&mut *conn)
    .await
    .map_err(e)?;
    for c in names {
        let dropped = sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE {table} DROP CONSTRAINT `{}`",
            c.replace('`', "``")
        )))
        .execute(&mut *conn)
        .await;
        match dropped {
            Ok(_) => {}
            // MariaDB: a column-level check belongs to the column's definition; redefining
            // the column without it is instant (no table copy).
            Err(err) if errors::number(&err) == Some(1091) => {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE {table} MODIFY status SMALLINT NOT NULL DEFAULT {PENDING}"
                )))
                .execute(&mut *conn)
                .await
                .map_err(e)?;
            }
            Err(err) => return Err(e(err)),
        }
    }
    Ok(())
}

/// Apply migrations once each, recorded in `outbox_migrations`, serialised by the named lock
/// `outbox_migrate` (`GET_LOCK`) so concurrent `migrate` calls are safe.
/// `outbox_migrations` on MySQL/MariaDB.
static LOG: MigrationLog = MigrationLog {
    newest: "SELECT MAX(version) FROM outbox_migrations WHERE table_name = ?",
    applied: "SELECT COUNT(*) FROM outbox_migrations WHERE table_name = ? AND version = ?",
    record: "INSERT INTO outbox_migrations (table_name, version) VALUES (?, ?)",
};

pub(crate) async fn run_migrations(pool: &MySqlPool, steps: Vec<Step>) -> Result<(), StoreError> {
    let e = |op| move |e| crate::store::database_error(op, e);
    let mut conn = pool.acquire().await.map_err(e("migrate"))?;
    let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK('outbox_migrate', 60)")
        .fetch_one(&mut *conn)
        .await
        .map_err(e("migrate"))?;
    if locked != Some(1) {
        return Err(StoreError::Config(
            "another migration held the lock `outbox_migrate` for 60 s".into(),
        ));
    }
    let r = async {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS outbox_migrations (table_name VARCHAR(255) NOT NULL, \
             version INT NOT NULL, applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)), \
             PRIMARY KEY (table_name, version)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        )
        .execute(&mut *conn)
        .await
        .map_err(e("migrate"))?;
        // A table migrated by a newer build is left alone: this build does not know its schema.
        LOG.on::<sqlx::MySql>(&mut *conn).refuse_newer(&steps).await?;
        for (table, version, stmts) in steps {
            if LOG.on::<sqlx::MySql>(&mut conn).applied(&table, version).await? {
                continue;
            }
            for sql in stmts {
                if sql == DROP_STATUS_CHECK {
                    drop_status_check(&mut conn, &table).await?;
                    continue;
                }
                match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await {
                    Ok(_) => {}
                    // DDL commits by itself on MySQL/MariaDB: a migration interrupted between
                    // its statements (a crash, a lost connection) left the earlier ones applied
                    // and the version unrecorded. Running it again meets their effect.
                    Err(err) if is_already_applied(&err) => tracing::warn!(
                        table,
                        version,
                        error = %err,
                        "migration statement already applied (an earlier migrate stopped before recording the version); going on"
                    ),
                    Err(err) => return Err(e("migrate")(err)),
                }
            }
            LOG.on::<sqlx::MySql>(&mut conn).record(&table, version).await?;
            tracing::info!(table, version, "applied MySQL migration");
        }
        Ok(())
    }
    .await;
    let _ = sqlx::query("SELECT RELEASE_LOCK('outbox_migrate')")
        .execute(&mut *conn)
        .await;
    r
}
