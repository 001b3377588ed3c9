//! PostgreSQL: the test pool and a fixture with the outbox in its own schema.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store;
use outbox::{PgStore, Status, StoreOptions};
use sqlx::{AssertSqlSafe, PgPool, Row};
use uuid::Uuid;

use crate::fixture::{exec_and_count, server_pool, store_fixture};
use crate::{
    ConfirmFixture, ConfirmState, HookControl, RecordingHook, RowState, postgres_url, unique,
};

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

    /// The outbox table, schema-qualified.
    pub fn table(&self) -> String {
        format!("{}.outbox", self.schema)
    }

    /// The inbox table created beside the outbox, schema-qualified.
    pub fn inbox_table(&self) -> String {
        format!("{}.outbox_inbox", self.schema)
    }

    exec_and_count!();
}

store_fixture!(PgFixture, {
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

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        PgStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
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
