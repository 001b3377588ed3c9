//! MySQL/MariaDB: the test pool and a fixture with the outbox in tables of its own.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store;
use outbox::{MySqlStore, Status, StoreOptions};
use sqlx::{AssertSqlSafe, MySqlPool, Row};
use uuid::Uuid;

use crate::fixture::{exec_and_count, server_pool, store_fixture};
use crate::{ConfirmFixture, ConfirmState, HookControl, RecordingHook, RowState, unique};

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

    exec_and_count!();
}

store_fixture!(MySqlFixture, {
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

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        MySqlStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
    }

    async fn cleanup(&self) {
        let t = &self.table;
        self.exec(&format!(
                "DROP TABLE IF EXISTS {t}, {t}_inbox, {t}_inbox_dlq, {t}_compensations, {t}_buckets, {t}_relays; \
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
