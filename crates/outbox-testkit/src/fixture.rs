//! What the store suites need of a dialect ([`StoreFixture`], [`ConfirmFixture`]) and the
//! rejection hook they install ([`RecordingHook`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::store::Store;
use outbox::{EnqueueError, NewMessage};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

/// One outbox row as the tests see it, times measured on the database clock.
#[derive(Debug, Clone, PartialEq)]
pub struct RowState {
    /// Row id.
    pub id: i64,
    /// Message id.
    pub message_id: Uuid,
    /// Status number.
    pub status: i16,
    /// Attempts so far.
    pub attempts: i64,
    /// Last error.
    pub last_error: Option<String>,
    /// `available_at - now()` in milliseconds (negative when due).
    pub due_in_ms: i64,
    /// Lease token, if leased.
    pub lease_token: Option<i64>,
    /// Whether `sent_at` is set.
    pub sent: bool,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// A store under test plus the dialect-specific operations the conformance suite needs (enqueue
/// through the caller's transaction is per dialect, not on [`Store`]).
#[async_trait]
pub trait StoreFixture: Send + Sync + 'static {
    /// The store as the relay sees it.
    fn store(&self) -> Arc<dyn Store>;
    /// Enqueue in one transaction, then commit.
    async fn enqueue_commit(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError>;
    /// Enqueue in one transaction, then roll back; the enqueue result is returned.
    async fn enqueue_rollback(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError>;
    /// Insert a row with plain SQL giving only the columns a foreign producer must give.
    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid;
    /// Insert a PREPARED two-phase row with plain SQL, as a producer sharing the outbox
    /// database does (docs/two-phase.md): status 5 and `check_back`, due now.
    async fn insert_prepared_sql(&self, topic: &str, payload: &[u8], check_back: &str) -> Uuid;
    /// Every row, by id.
    async fn rows(&self) -> Vec<RowState>;
    /// Every row of the archive table `<table>_archive`: `(id, archive_reason, status)`, by id.
    async fn archived(&self) -> Vec<(i64, String, i16)>;
    /// Put the row of `message_id` where a 0.1 relay's row claim left it when that relay
    /// stopped: status 1 (SENDING), one more attempt, a lease owner and token, a lease that
    /// expires in an hour.
    async fn leave_sending(&self, message_id: Uuid);
    /// Validate `table` as this dialect would (the error for an invalid name).
    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError>;
    /// Drop what the fixture created.
    async fn cleanup(&self);

    /// Enqueue `n` messages on topic `t`, payloads `0` to `n - 1`, in one transaction, then
    /// commit; their ids.
    ///
    /// # Panics
    /// When the enqueue fails.
    async fn enqueue_numbered(&self, n: usize) -> Vec<Uuid> {
        self.commit_numbered("t", "", n).await
    }

    /// Enqueue `n` messages on `topic`, payloads `{prefix}0` to `{prefix}{n - 1}`, in one
    /// transaction, then commit; their ids.
    ///
    /// # Panics
    /// When the enqueue fails, naming the error.
    async fn commit_numbered(&self, topic: &str, prefix: &str, n: usize) -> Vec<Uuid> {
        let msgs = (0..n)
            .map(|i| NewMessage::new(topic, format!("{prefix}{i}")))
            .collect();
        match self.enqueue_commit(msgs).await {
            Ok(ids) => ids,
            Err(e) => panic!("enqueue {n} messages on {topic}: {e}"),
        }
    }

    /// Enqueue one message in its own transaction, then commit; its id.
    ///
    /// # Panics
    /// When the enqueue fails, naming the error.
    async fn commit_one(&self, msg: NewMessage) -> Uuid {
        match self.enqueue_commit(vec![msg]).await {
            Ok(ids) => ids[0],
            Err(e) => panic!("enqueue one message: {e}"),
        }
    }

    /// The row of `message_id`.
    async fn row(&self, message_id: Uuid) -> RowState {
        self.rows()
            .await
            .into_iter()
            .find(|r| r.message_id == message_id)
            .unwrap_or_else(|| panic!("no row for message {message_id}"))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConfirmState {
    /// `confirm_deadline - now()` in milliseconds, when a deadline is set.
    pub deadline_in_ms: Option<i64>,
    /// Check-backs so far.
    pub check_backs: i64,
    /// Whether `confirmed_at` is set.
    pub confirmed: bool,
}

/// The dialect-specific operations the confirmation part of the store suite needs.
#[async_trait]
pub trait ConfirmFixture: StoreFixture {
    /// The store with a [`RecordingHook`] controlled by `ctl` (its table is created if missing).
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store>;
    /// Compensation rows written for `message_id`.
    async fn compensations(&self, message_id: Uuid) -> i64;
    /// The confirmation columns of `message_id`.
    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState;
    /// Move every timestamp of `message_id` except the confirmation deadline `by` into the past.
    async fn backdate(&self, message_id: Uuid, by: Duration);
}

/// Controls a [`RecordingHook`]: make it fail, slow it down, count its runs.
#[derive(Debug, Default)]
pub struct HookControl {
    /// When set, the hook writes its row and then fails (so the write must roll back).
    pub fail: AtomicBool,
    /// Milliseconds the hook waits after writing (holding the producer transaction open).
    pub delay_ms: std::sync::atomic::AtomicU64,
    /// Runs, including failed ones.
    pub calls: std::sync::atomic::AtomicU64,
}

/// A rejection hook that records each compensation as a row `(message_id, reason)` of its table
/// (no unique key, so a second run shows as a second row), controlled by a [`HookControl`].
pub struct RecordingHook {
    /// The compensations table.
    pub table: String,
    /// The control.
    pub ctl: Arc<HookControl>,
}

impl RecordingHook {
    async fn after_write(&self) -> Result<(), outbox::BoxError> {
        let delay = self.ctl.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.ctl.fail.load(Ordering::SeqCst) {
            return Err("compensation refused (test)".into());
        }
        Ok(())
    }
}

/// `RejectionHook<$db>` for [`RecordingHook`]: the compensation row inserted on the hook's
/// connection with the dialect's placeholders `$values`, then `after_write`.
macro_rules! recording_hook {
    ($db:ty, $conn:ty, $values:literal) => {
        #[async_trait]
        impl outbox::RejectionHook<$db> for RecordingHook {
            async fn on_rejected(
                &self,
                conn: &mut $conn,
                rejected: &outbox::RejectedMessage,
            ) -> Result<(), outbox::BoxError> {
                self.ctl.calls.fetch_add(1, Ordering::SeqCst);
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {} (message_id, reason) VALUES {}",
                    self.table, $values
                )))
                .bind(rejected.message_id.to_string())
                .bind(&rejected.reason)
                .execute(&mut *conn)
                .await?;
                self.after_write().await
            }
        }
    };
}

recording_hook!(sqlx::Postgres, sqlx::PgConnection, "($1, $2)");
recording_hook!(sqlx::Sqlite, sqlx::SqliteConnection, "(?1, ?2)");
recording_hook!(sqlx::MySql, sqlx::MySqlConnection, "(?, ?)");

/// A pool of up to `max` connections to the `service` database at `url`. A probe connection
/// first fails fast (5 s), naming `service`, the URL and the variable `var`, when nothing answers
/// (the pool itself would wait 20 s).
///
/// # Panics
/// When the server does not answer.
pub(crate) async fn server_pool<DB: sqlx::Database>(
    url: &str,
    max: u32,
    service: &str,
    var: &str,
) -> sqlx::Pool<DB> {
    let probe = tokio::time::timeout(
        Duration::from_secs(5),
        <DB::Connection as sqlx::Connection>::connect(url),
    )
    .await;
    match probe {
        Ok(Ok(conn)) => drop(conn),
        Ok(Err(e)) => panic!("{service} is not reachable at {url} ({e}); start it or set {var}"),
        Err(_) => panic!("{service} at {url} did not answer within 5 s; start it or set {var}"),
    }
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .connect(url)
        .await
        .unwrap_or_else(|e| {
            panic!("{service} is not reachable at {url} ({e}); start it or set {var}")
        })
}

/// `impl StoreFixture for $fixture` with the methods every dialect writes alike over its
/// `store` field, a `$store` (`store`, `enqueue_commit`, `enqueue_rollback`, `archived`,
/// `open_with_table`), plus the items given.
macro_rules! store_fixture {
    ($fixture:ty, $store:ty, { $($item:tt)* }) => {
        #[async_trait::async_trait]
        impl $crate::StoreFixture for $fixture {
            fn store(&self) -> std::sync::Arc<dyn outbox::store::Store> {
                std::sync::Arc::new(self.store.clone())
            }

            async fn enqueue_commit(
                &self,
                msgs: Vec<outbox::NewMessage>,
            ) -> Result<Vec<uuid::Uuid>, outbox::EnqueueError> {
                let mut tx = self.store.pool().begin().await.expect("begin");
                let ids = self.store.enqueue_many(&mut tx, msgs).await?;
                self.store.commit(tx).await.expect("commit");
                Ok(ids)
            }

            async fn enqueue_rollback(
                &self,
                msgs: Vec<outbox::NewMessage>,
            ) -> Result<Vec<uuid::Uuid>, outbox::EnqueueError> {
                let mut tx = self.store.pool().begin().await.expect("begin");
                let r = self.store.enqueue_many(&mut tx, msgs).await;
                tx.rollback().await.expect("rollback");
                r
            }

            async fn archived(&self) -> Vec<(i64, String, i16)> {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT id, archive_reason, status FROM {}_archive ORDER BY id",
                    outbox::store::Store::table(&self.store)
                )))
                .fetch_all(self.store.pool())
                .await
                .expect("read the archive")
            }

            async fn open_with_table(
                &self,
                table: &str,
            ) -> Result<(), outbox::StoreError> {
                <$store>::from_pool(self.store.pool().clone(), outbox::StoreOptions::table(table))
                    .map(|_| ())
            }

            $($item)*
        }
    };
}
pub(crate) use store_fixture;

/// `exec`, `count` and `count_status` for a fixture over a server database (its `store` field's
/// pool).
macro_rules! exec_and_count {
    () => {
        /// Run one statement (or several, `;`-separated).
        ///
        /// # Panics
        /// On a database error.
        pub async fn exec(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(self.store.pool())
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        /// Count rows of `table` (qualified as the dialect needs) with an optional `WHERE`
        /// clause: `count("t WHERE status = 0")`.
        ///
        /// # Panics
        /// On a database error.
        pub async fn count(&self, table_and_where: &str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM {table_and_where}"
            )))
            .fetch_one(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("count {table_and_where}: {e}"))
        }

        /// Count the rows of the outbox table with `status`.
        ///
        /// # Panics
        /// On a database error.
        pub async fn count_status(&self, status: outbox::Status) -> i64 {
            self.count(&format!(
                "{} WHERE status = {}",
                outbox::store::Store::table(&self.store),
                status.as_i16()
            ))
            .await
        }
    };
}
pub(crate) use exec_and_count;
