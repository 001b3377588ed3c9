//! SQLite fixture: a temporary database file.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store;
use outbox::{SqliteStore, Status, StoreOptions};
use sqlx::Row;
use uuid::Uuid;

use crate::fixture::store_fixture;
use crate::{ConfirmFixture, ConfirmState, HookControl, RecordingHook, RowState, unique};

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

store_fixture!(SqliteFixture, {
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

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        SqliteStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
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
