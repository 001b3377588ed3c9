//! The store fixtures of the three dialects: SQLite in a temporary file, PostgreSQL with the
//! outbox in its own schema, MySQL/MariaDB with tables of its own (and the test pools of the
//! servers).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store;
use outbox::{MySqlStore, PgStore, SqliteStore, Status, StoreOptions};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool, Row};
use uuid::Uuid;

use crate::fixture::{exec_and_count, server_pool, store_fixture};
use crate::{
    ConfirmFixture, ConfirmState, HookControl, RecordingHook, RowState, postgres_url, unique,
};

/// One message enqueued as a producer does, on the store of any dialect.
#[async_trait]
pub trait Producer {
    /// Enqueue `msg` in a plain transaction of its own from the store's pool (`pool().begin()`,
    /// then `tx.commit()`: the wake-ups are the database's own, none in-process); its id.
    ///
    /// # Panics
    /// On an error, naming the step.
    async fn enqueue_plain(&self, msg: outbox::NewMessage) -> Uuid;

    /// Enqueue `msg` in a transaction of its own from the store's `begin()`, committed by its
    /// `commit()` (the producer API's wake-ups); its id.
    ///
    /// # Panics
    /// On an error, naming the step.
    async fn enqueue_committed(&self, msg: outbox::NewMessage) -> Uuid;
}

/// [`Producer`] for the stores given (their `pool()`, `begin()`, `enqueue` and `commit` are
/// alike).
macro_rules! producer {
    ($($store:ty),+) => {$(
        #[async_trait]
        impl Producer for $store {
            async fn enqueue_plain(&self, msg: outbox::NewMessage) -> Uuid {
                let mut tx = self.pool().begin().await.expect("begin");
                let id = self.enqueue(&mut tx, msg).await.expect("enqueue");
                tx.commit().await.expect("commit");
                id
            }

            async fn enqueue_committed(&self, msg: outbox::NewMessage) -> Uuid {
                let mut tx = self.begin().await.expect("begin");
                let id = self.enqueue(&mut tx, msg).await.expect("enqueue");
                self.commit(tx).await.expect("commit");
                id
            }
        }
    )+};
}

producer!(PgStore, MySqlStore, SqliteStore);

/// SQLite in a temporary file.
pub struct SqliteFixture {
    /// The store.
    pub store: SqliteStore,
    path: std::path::PathBuf,
}

impl SqliteFixture {
    /// A fresh database file with migrated tables.
    ///
    /// # Panics
    /// When the file cannot be created or migrated.
    pub async fn new() -> SqliteFixture {
        let path = std::env::temp_dir().join(format!("{}.db", unique("outbox_test")));
        let url = format!("sqlite://{}", path.display());
        let store = SqliteStore::connect(&url, StoreOptions::default())
            .await
            .expect("open SQLite");
        store.migrate().await.expect("migrate SQLite");
        SqliteFixture { store, path }
    }
}

impl Drop for SqliteFixture {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

store_fixture!(SqliteFixture, SqliteStore, {
    async fn insert_prepared_sql(&self, topic: &str, payload: &[u8], check_back: &str) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO outbox (message_id, topic, payload, status, check_back) VALUES (?1, ?2, ?3, 5, ?4)",
        )
        .bind(id.to_string())
        .bind(topic)
        .bind(payload)
        .bind(check_back)
        .execute(self.store.pool())
        .await
        .expect("plain SQL prepare");
        id
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query("INSERT INTO outbox (message_id, topic, payload) VALUES (?1, ?2, ?3)")
            .bind(id.to_string())
            .bind(topic)
            .bind(payload)
            .execute(self.store.pool())
            .await
            .expect("plain SQL insert");
        id
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(
                "UPDATE outbox SET status = ?2, attempts = attempts + 1, lease_owner = 'relay-0.1', \
                 lease_token = 7, lease_expires_at = CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER) + 3600000 \
                 WHERE message_id = ?1",
            )
            .bind(message_id.to_string())
            .bind(Status::Sending.as_i16())
            .execute(self.store.pool())
            .await
            .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(
                "SELECT id, message_id, status, attempts, last_error, \
                 available_at - CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER), lease_token, sent_at IS NOT NULL, payload \
                 FROM outbox ORDER BY id",
            )
            .fetch_all(self.store.pool())
            .await
            .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: Uuid::parse_str(&r.get::<String, _>(1)).expect("uuid"),
                status: r.get::<i64, _>(2) as i16,
                attempts: r.get(3),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get(7),
                payload: r.get(8),
            })
            .collect()
    }

    async fn cleanup(&self) {}
});

#[async_trait]
impl ConfirmFixture for SqliteFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS compensations (message_id TEXT NOT NULL, reason TEXT)",
        )
        .execute(self.store.pool())
        .await
        .expect("create compensations");
        let hook = RecordingHook {
            table: "compensations".into(),
            ctl,
        };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM compensations WHERE message_id = ?1")
            .bind(message_id.to_string())
            .fetch_one(self.store.pool())
            .await
            .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i64, bool) = sqlx::query_as(
            "SELECT confirm_deadline - CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER), \
             check_backs, confirmed_at IS NOT NULL FROM outbox WHERE message_id = ?1",
        )
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs,
            confirmed,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        let ms = i64::try_from(by.as_millis()).expect("duration");
        sqlx::query(
            "UPDATE outbox SET created_at = created_at - ?1, updated_at = updated_at - ?1, \
             sent_at = sent_at - ?1, confirmed_at = confirmed_at - ?1 WHERE message_id = ?2",
        )
        .bind(ms)
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}

/// Connect a pool of up to `max` connections to the test PostgreSQL.
///
/// # Panics
/// When PostgreSQL does not answer, naming the URL and `OUTBOX_TEST_POSTGRES_URL`.
pub async fn pg_pool(max: u32) -> PgPool {
    server_pool(
        &postgres_url(),
        max,
        "PostgreSQL",
        "OUTBOX_TEST_POSTGRES_URL",
    )
    .await
}

/// PostgreSQL with the outbox in its own schema (`<schema>.outbox`, `<schema>.outbox_inbox`).
pub struct PgFixture {
    /// The store.
    pub store: PgStore,
    /// The schema holding the tables.
    pub schema: String,
}

impl PgFixture {
    /// A fresh schema with migrated tables.
    ///
    /// # Panics
    /// When PostgreSQL does not answer (naming `OUTBOX_TEST_POSTGRES_URL`) or migration fails.
    pub async fn new() -> PgFixture {
        Self::with_pool(pg_pool(10).await).await
    }

    /// As [`PgFixture::new`] on an existing pool.
    ///
    /// # Panics
    /// When migration fails.
    pub async fn with_pool(pool: PgPool) -> PgFixture {
        let schema = unique("obx");
        let store = PgStore::from_pool(pool, StoreOptions::table(format!("{schema}.outbox")))
            .expect("valid table name");
        store.migrate().await.expect("migrate PostgreSQL");
        PgFixture { store, schema }
    }

    /// A fresh schema with a time-partitioned outbox table
    /// ([`PgStore::migrate_partitioned`]).
    ///
    /// # Panics
    /// When PostgreSQL does not answer (naming `OUTBOX_TEST_POSTGRES_URL`) or migration fails.
    pub async fn partitioned() -> PgFixture {
        let schema = unique("obp");
        let store = PgStore::from_pool(
            pg_pool(10).await,
            StoreOptions::table(format!("{schema}.outbox")),
        )
        .expect("valid table name");
        store
            .migrate_partitioned()
            .await
            .expect("migrate a partitioned table on PostgreSQL");
        PgFixture { store, schema }
    }

    /// The outbox table, schema-qualified.
    pub fn table(&self) -> String {
        format!("{}.outbox", self.schema)
    }

    /// The inbox table created beside the outbox, schema-qualified.
    pub fn inbox_table(&self) -> String {
        format!("{}.outbox_inbox", self.schema)
    }

    /// Make every `INSERT` into `table` (of this fixture's schema) fail with "writes to
    /// `table` are refused", through a trigger, until [`allow_inserts`](Self::allow_inserts).
    ///
    /// # Panics
    /// On a database error.
    pub async fn refuse_inserts(&self, table: &str) {
        let s = &self.schema;
        self.exec(&format!(
            "CREATE OR REPLACE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'writes to % are refused', TG_TABLE_NAME; END $$; \
             CREATE TRIGGER refuse BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {s}.refuse();"
        ))
        .await;
    }

    /// Undo [`refuse_inserts`](Self::refuse_inserts) on `table`.
    ///
    /// # Panics
    /// On a database error.
    pub async fn allow_inserts(&self, table: &str) {
        self.exec(&format!("DROP TRIGGER refuse ON {table}")).await;
    }

    exec_and_count!();
}

store_fixture!(PgFixture, PgStore, {
    async fn insert_prepared_sql(&self, topic: &str, payload: &[u8], check_back: &str) -> Uuid {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} (topic, payload, status, check_back) VALUES ($1, $2, 5, $3) RETURNING message_id",
            self.table()
        )))
        .bind(topic)
        .bind(payload)
        .bind(check_back)
        .fetch_one(self.store.pool())
        .await
        .expect("plain SQL prepare")
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} (topic, payload) VALUES ($1, $2) RETURNING message_id",
            self.table()
        )))
        .bind(topic)
        .bind(payload)
        .fetch_one(self.store.pool())
        .await
        .expect("plain SQL insert")
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(AssertSqlSafe(format!(
                "UPDATE {} SET status = $2, attempts = attempts + 1, lease_owner = 'relay-0.1', \
                 lease_token = 7, lease_expires_at = now() + interval '1 hour' WHERE message_id = $1",
                self.table()
            )))
            .bind(message_id)
            .bind(Status::Sending.as_i16())
            .execute(self.store.pool())
            .await
            .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT id, message_id, status, attempts, last_error, \
                 (EXTRACT(EPOCH FROM available_at - now()) * 1000)::bigint, lease_token, sent_at IS NOT NULL, payload \
                 FROM {} ORDER BY id",
                self.table()
            )))
            .fetch_all(self.store.pool())
            .await
            .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: r.get(1),
                status: r.get(2),
                attempts: i64::from(r.get::<i32, _>(3)),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get(7),
                payload: r.get(8),
            })
            .collect()
    }

    async fn cleanup(&self) {
        let s = &self.schema;
        self.exec(&format!(
            "DROP SCHEMA IF EXISTS {s} CASCADE; \
                 DELETE FROM outbox_migrations WHERE table_name LIKE '{s}.%';"
        ))
        .await;
    }
});

#[async_trait]
impl ConfirmFixture for PgFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        let table = format!("{}.compensations", self.schema);
        self.exec(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (message_id text NOT NULL, reason text)"
        ))
        .await;
        let hook = RecordingHook { table, ctl };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}.compensations WHERE message_id = $1",
            self.schema
        )))
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i32, bool) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT (EXTRACT(EPOCH FROM confirm_deadline - now()) * 1000)::bigint, check_backs, \
                 confirmed_at IS NOT NULL FROM {} WHERE message_id = $1",
                self.table()
            )))
            .bind(message_id)
            .fetch_one(self.store.pool())
            .await
            .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs: i64::from(check_backs),
            confirmed,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET created_at = created_at - make_interval(secs => $1), \
             updated_at = updated_at - make_interval(secs => $1), \
             sent_at = sent_at - make_interval(secs => $1), \
             confirmed_at = confirmed_at - make_interval(secs => $1) WHERE message_id = $2",
            self.table()
        )))
        .bind(by.as_secs_f64())
        .bind(message_id)
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}

/// [`PgFixture::partitioned`] under a name `fixture_tests!` takes: every suite that runs on
/// PostgreSQL runs on a time-partitioned outbox table too.
pub struct PgPartitionedFixture;

impl PgPartitionedFixture {
    /// [`PgFixture::partitioned`] (named `new` for `fixture_tests!`).
    #[allow(clippy::new_ret_no_self)]
    pub async fn new() -> PgFixture {
        PgFixture::partitioned().await
    }
}

/// Default MySQL/MariaDB URL when `OUTBOX_TEST_MYSQL_URL` is unset.
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// `OUTBOX_TEST_MYSQL_URL`, or [`DEFAULT_MYSQL_URL`].
pub fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.into())
}

/// Connect a pool of up to `max` connections to the test MySQL/MariaDB.
///
/// # Panics
/// When the server does not answer, naming the URL and `OUTBOX_TEST_MYSQL_URL`.
pub async fn mysql_pool(max: u32) -> MySqlPool {
    server_pool(&mysql_url(), max, "MySQL/MariaDB", "OUTBOX_TEST_MYSQL_URL").await
}

/// MySQL/MariaDB with the outbox in tables of its own (`<prefix>`, `<prefix>_inbox`).
pub struct MySqlFixture {
    /// The store.
    pub store: MySqlStore,
    /// The outbox table.
    pub table: String,
}

impl MySqlFixture {
    /// Fresh tables, migrated.
    ///
    /// # Panics
    /// When MySQL/MariaDB does not answer (naming `OUTBOX_TEST_MYSQL_URL`) or migration fails.
    pub async fn new() -> MySqlFixture {
        Self::with_pool(mysql_pool(10).await).await
    }

    /// As [`MySqlFixture::new`] on an existing pool.
    ///
    /// # Panics
    /// When migration fails.
    pub async fn with_pool(pool: MySqlPool) -> MySqlFixture {
        let table = unique("obx");
        let store =
            MySqlStore::from_pool(pool, StoreOptions::table(&table)).expect("valid table name");
        store.migrate().await.expect("migrate MySQL");
        MySqlFixture { store, table }
    }

    /// The inbox table created beside the outbox.
    pub fn inbox_table(&self) -> String {
        format!("{}_inbox", self.table)
    }

    /// Make every `INSERT` into `table` fail with "writes to `table` are refused" (SQLSTATE
    /// 45000), through a trigger, until [`allow_inserts`](Self::allow_inserts).
    ///
    /// # Panics
    /// On a database error.
    pub async fn refuse_inserts(&self, table: &str) {
        self.exec(&format!(
            "CREATE TRIGGER {table}_refuse BEFORE INSERT ON {table} FOR EACH ROW \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'writes to {table} are refused'"
        ))
        .await;
    }

    /// Undo [`refuse_inserts`](Self::refuse_inserts) on `table`.
    ///
    /// # Panics
    /// On a database error.
    pub async fn allow_inserts(&self, table: &str) {
        self.exec(&format!("DROP TRIGGER {table}_refuse")).await;
    }

    exec_and_count!();
}

store_fixture!(MySqlFixture, MySqlStore, {
    async fn insert_prepared_sql(&self, topic: &str, payload: &[u8], check_back: &str) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, topic, payload, status, check_back) VALUES (?, ?, ?, 5, ?)",
            self.table
        )))
        .bind(id.to_string())
        .bind(topic)
        .bind(payload)
        .bind(check_back)
        .execute(self.store.pool())
        .await
        .expect("plain SQL prepare");
        id
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, topic, payload) VALUES (?, ?, ?)",
            self.table
        )))
        .bind(id.to_string())
        .bind(topic)
        .bind(payload)
        .execute(self.store.pool())
        .await
        .expect("plain SQL insert");
        id
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(AssertSqlSafe(format!(
                "UPDATE {} SET status = ?, attempts = attempts + 1, lease_owner = 'relay-0.1', \
                 lease_token = 7, lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE message_id = ?",
                self.table
            )))
            .bind(Status::Sending.as_i16())
            .bind(message_id.to_string())
            .execute(self.store.pool())
            .await
            .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT id, message_id, status, attempts, last_error, \
                 CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), available_at) DIV 1000 AS SIGNED), \
                 lease_token, CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END, payload \
                 FROM {} ORDER BY id",
                self.table
            )))
            .fetch_all(self.store.pool())
            .await
            .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: Uuid::parse_str(&r.get::<String, _>(1)).expect("uuid"),
                status: r.get::<i64, _>(2) as i16,
                attempts: r.get(3),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get::<i64, _>(7) != 0,
                payload: r.get(8),
            })
            .collect()
    }

    async fn cleanup(&self) {
        let t = &self.table;
        self.exec(&format!(
                "DROP TABLE IF EXISTS {t}, {t}_inbox, {t}_inbox_dlq, {t}_compensations, {t}_buckets, {t}_relays, {t}_archive; \
                 DELETE FROM outbox_migrations WHERE table_name IN ('{t}', '{t}_inbox');"
            ))
            .await;
    }
});

#[async_trait]
impl ConfirmFixture for MySqlFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        let table = format!("{}_compensations", self.table);
        self.exec(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (message_id CHAR(36) NOT NULL, reason TEXT) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ))
        .await;
        let hook = RecordingHook { table, ctl };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}_compensations WHERE message_id = ?",
            self.table
        )))
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i64, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), confirm_deadline) DIV 1000 AS SIGNED), \
                 check_backs, CASE WHEN confirmed_at IS NULL THEN 0 ELSE 1 END FROM {} WHERE message_id = ?",
                self.table
            )))
            .bind(message_id.to_string())
            .fetch_one(self.store.pool())
            .await
            .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs,
            confirmed: confirmed != 0,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        let us = i64::try_from(by.as_micros()).expect("duration");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET created_at = created_at - INTERVAL ? MICROSECOND, \
             updated_at = updated_at - INTERVAL ? MICROSECOND, \
             sent_at = sent_at - INTERVAL ? MICROSECOND, \
             confirmed_at = confirmed_at - INTERVAL ? MICROSECOND WHERE message_id = ?",
            self.table
        )))
        .bind(us)
        .bind(us)
        .bind(us)
        .bind(us)
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}
