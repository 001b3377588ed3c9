//! The barrier: a check-back that the producer's **business** database answers (after dtm's
//! barrier, docs/two-phase.md).
//!
//! A table `outbox_barrier (message_id primary key, reason, created_at)` lives in the
//! producer's business database (PostgreSQL, MySQL/MariaDB or SQLite). The business
//! transaction calls [`Barrier::mark`] with the prepared message's id: it inserts
//! `(message_id, 'commit')`. The check-back calls [`Barrier::resolve`]: it inserts
//! `(message_id, 'rollback')` unless a row is there (a statement of its own), then reads the row:
//! `commit` answers COMMIT, `rollback` answers ROLLBACK. The primary key decides every race:
//!
//! - the business transaction marked and committed before the check: the insert finds the
//!   mark, the answer is COMMIT;
//! - it marked and is still running: the check's insert waits on the key's lock (PostgreSQL,
//!   InnoDB; SQLite's single writer) until it ends; committed, COMMIT; rolled back, the
//!   tombstone goes in and the answer is ROLLBACK;
//! - it had not marked yet (not started, or before its mark): the tombstone goes in and the
//!   answer is ROLLBACK; its later mark fails on the key ([`BarrierError::Decided`]) and it
//!   must roll back, so a message is never published for business data that did not commit,
//!   and never withheld for business data that did.

use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use sqlx::{Database, Pool, Row};
use uuid::Uuid;

use super::{Answer, CheckBackHook, CheckRequest};
use crate::error::{BoxError, ConfigError, StoreError};
use crate::ident::TableName;

/// Default barrier table name.
pub const DEFAULT_TABLE: &str = "outbox_barrier";

/// The databases a barrier runs on (PostgreSQL, MySQL/MariaDB, SQLite): the statements that
/// differ. Sealed.
pub trait BarrierDatabase: Database + sealed::Sealed {
    /// `CREATE TABLE IF NOT EXISTS` of the barrier table.
    fn create(table: &str) -> String;
    /// Insert `(message_id, reason)`; the primary key refuses a second row.
    fn insert(table: &str) -> String;
    /// Insert `(message_id, 'rollback')` unless a row is there.
    fn tombstone(table: &str) -> String;
    /// The row's reason.
    fn reason(table: &str) -> String;
    /// Whether `e` is the primary key's unique violation.
    fn is_duplicate(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
    }
    /// Run the statements `sql` on `pool` (the barrier's migration).
    #[doc(hidden)]
    fn run_script<'a>(pool: &'a Pool<Self>, sql: String) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Run `insert` (of [`BarrierDatabase::insert`]) for `(id, reason)` on `conn`.
    #[doc(hidden)]
    fn run_insert<'a>(
        conn: &'a mut Self::Connection,
        insert: String,
        id: String,
        reason: &'static str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// Run `tombstone`, then `reason` (of [`BarrierDatabase::tombstone`] and
    /// [`BarrierDatabase::reason`]) for `id` on `pool`: the row's reason.
    #[doc(hidden)]
    fn run_resolve<'a>(
        pool: &'a Pool<Self>,
        tombstone: String,
        reason: String,
        id: String,
    ) -> BoxFuture<'a, Result<String, sqlx::Error>>;
}

/// The execution methods of [`BarrierDatabase`] for one sqlx database: the same statements on
/// each, written once, compiled for the concrete database (so that [`Barrier`]'s users need no
/// sqlx bounds beyond `DB: BarrierDatabase`).
macro_rules! barrier_runs {
    ($db:ty) => {
        fn run_script<'a>(
            pool: &'a Pool<$db>,
            sql: String,
        ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await?;
                Ok(())
            })
        }

        fn run_insert<'a>(
            conn: &'a mut <$db as Database>::Connection,
            insert: String,
            id: String,
            reason: &'static str,
        ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(id)
                    .bind(reason)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }

        fn run_resolve<'a>(
            pool: &'a Pool<$db>,
            tombstone: String,
            reason: String,
            id: String,
        ) -> BoxFuture<'a, Result<String, sqlx::Error>> {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(tombstone))
                    .bind(id.clone())
                    .execute(pool)
                    .await?;
                sqlx::query(sqlx::AssertSqlSafe(reason))
                    .bind(id)
                    .fetch_one(pool)
                    .await?
                    .try_get(0)
            })
        }
    };
}

mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::Sqlite {}
}

#[cfg(feature = "postgres")]
impl BarrierDatabase for sqlx::Postgres {
    fn create(t: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (message_id uuid PRIMARY KEY, reason text NOT NULL, \
             created_at timestamptz NOT NULL DEFAULT now())"
        )
    }
    fn insert(t: &str) -> String {
        format!("INSERT INTO {t} (message_id, reason) VALUES ($1::uuid, $2)")
    }
    fn tombstone(t: &str) -> String {
        format!(
            "INSERT INTO {t} (message_id, reason) VALUES ($1::uuid, 'rollback') ON CONFLICT DO NOTHING"
        )
    }
    fn reason(t: &str) -> String {
        format!("SELECT reason FROM {t} WHERE message_id = $1::uuid")
    }
    barrier_runs!(sqlx::Postgres);
}

#[cfg(feature = "mysql")]
impl BarrierDatabase for sqlx::MySql {
    fn create(t: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (message_id CHAR(36) CHARACTER SET ascii NOT NULL \
             PRIMARY KEY, reason VARCHAR(16) NOT NULL, created_at DATETIME(6) NOT NULL DEFAULT \
             CURRENT_TIMESTAMP(6)) ENGINE=InnoDB"
        )
    }
    fn insert(t: &str) -> String {
        format!("INSERT INTO {t} (message_id, reason) VALUES (?, ?)")
    }
    fn tombstone(t: &str) -> String {
        format!("INSERT IGNORE INTO {t} (message_id, reason) VALUES (?, 'rollback')")
    }
    fn reason(t: &str) -> String {
        format!("SELECT reason FROM {t} WHERE message_id = ?")
    }
    barrier_runs!(sqlx::MySql);
}

#[cfg(feature = "sqlite")]
impl BarrierDatabase for sqlx::Sqlite {
    fn create(t: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (message_id TEXT PRIMARY KEY, reason TEXT NOT NULL, \
             created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)"
        )
    }
    fn insert(t: &str) -> String {
        format!("INSERT INTO {t} (message_id, reason) VALUES (?1, ?2)")
    }
    fn tombstone(t: &str) -> String {
        format!("INSERT OR IGNORE INTO {t} (message_id, reason) VALUES (?1, 'rollback')")
    }
    fn reason(t: &str) -> String {
        format!("SELECT reason FROM {t} WHERE message_id = ?1")
    }
    barrier_runs!(sqlx::Sqlite);
}

/// Why [`Barrier::mark`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BarrierError {
    /// The message id has a barrier row already: the check-back decided ROLLBACK before this
    /// transaction marked it (or it was marked before). Roll the business transaction back
    /// (on PostgreSQL it is aborted already).
    #[error(
        "message {0} is already decided by the barrier (a check-back answered ROLLBACK, or it was marked before): roll the business transaction back"
    )]
    Decided(Uuid),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The barrier of a business database `DB` (see the module docs).
///
/// # Examples
/// ```no_run
/// # async fn example(pool: sqlx::PgPool, store: outbox::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::two_phase::{barrier::Barrier, CheckBack, TwoPhase};
///
/// let barrier = Barrier::new(pool.clone());
/// barrier.migrate().await?;
/// let id = store
///     .prepare(outbox::NewMessage::new("order-created", "{}"), &CheckBack::hook("orders")?)
///     .await?;
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
/// barrier.mark(&mut tx, id).await?;
/// tx.commit().await?;
/// store.commit_prepared(id).await?;
/// # Ok(()) }
/// ```
pub struct Barrier<DB: Database> {
    pool: Pool<DB>,
    table: TableName,
}

impl<DB: Database> Clone for Barrier<DB> {
    fn clone(&self) -> Self {
        Barrier {
            pool: self.pool.clone(),
            table: self.table.clone(),
        }
    }
}

impl<DB: Database> std::fmt::Debug for Barrier<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Barrier")
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

impl<DB: BarrierDatabase> Barrier<DB> {
    /// A barrier on `pool`'s database, table [`DEFAULT_TABLE`].
    pub fn new(pool: Pool<DB>) -> Self {
        Barrier {
            pool,
            table: TableName::new(DEFAULT_TABLE).expect("the default name is valid"),
        }
    }

    /// Use the table `name` (`[schema.]table`, [`TableName`]'s rules).
    ///
    /// # Errors
    /// [`ConfigError`] naming `barrier.table` when the name is not valid.
    pub fn with_table(mut self, name: &str) -> Result<Self, ConfigError> {
        self.table =
            TableName::new(name).map_err(|e| ConfigError::new("barrier.table", e.to_string()))?;
        Ok(self)
    }

    /// Create the barrier table if it does not exist.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let t = self.table.as_str();
        DB::run_script(&self.pool, DB::create(t))
            .await
            .map_err(|e| crate::store::db_error("barrier migrate", t, e))
    }

    /// Mark `message_id` as committed by the business transaction on `conn` (call it inside
    /// that transaction, before its commit).
    ///
    /// # Errors
    /// [`BarrierError::Decided`] when a check-back decided ROLLBACK first: roll the transaction
    /// back; [`BarrierError::Store`] otherwise.
    pub async fn mark(
        &self,
        conn: &mut DB::Connection,
        message_id: Uuid,
    ) -> Result<(), BarrierError> {
        let t = self.table.as_str();
        DB::run_insert(conn, DB::insert(t), message_id.to_string(), "commit")
            .await
            .map_err(|e| {
                if DB::is_duplicate(&e) {
                    BarrierError::Decided(message_id)
                } else {
                    BarrierError::Store(crate::store::db_error("barrier mark", t, e))
                }
            })
    }

    /// The check-back's answer for `message_id`: COMMIT if the business transaction marked it
    /// and committed; otherwise a tombstone is written (so it can never commit afterwards) and
    /// the answer is ROLLBACK. Waits for a business transaction that marked it and is still
    /// running. Never UNKNOWN.
    ///
    /// # Errors
    /// [`StoreError`] from the database (the relay counts it as an error, asks again).
    pub async fn resolve(&self, message_id: Uuid) -> Result<Answer, StoreError> {
        let t = self.table.as_str();
        let err = |e| crate::store::db_error("barrier resolve", t, e);
        let reason = DB::run_resolve(
            &self.pool,
            DB::tombstone(t),
            DB::reason(t),
            message_id.to_string(),
        )
        .await
        .map_err(err)?;
        match reason.as_str() {
            "commit" => Ok(Answer::Commit),
            "rollback" => Ok(Answer::Rollback),
            other => Err(StoreError::Config(format!(
                "barrier row of {message_id} holds reason {other:?}, neither commit nor rollback"
            ))),
        }
    }

    /// This barrier as an in-process check-back, to register on the relay
    /// ([`RelayBuilder::check_back_hook`](crate::RelayBuilder::check_back_hook)) when the relay
    /// runs in the producer's process.
    pub fn hook(&self) -> Arc<dyn CheckBackHook>
    where
        DB: 'static,
    {
        Arc::new(BarrierHook(self.clone()))
    }

    /// An axum router answering HTTP check-backs at `path` from this barrier (POST, the body a
    /// [`CheckRequest`]; `200` with `COMMIT` or `ROLLBACK`, `500` with the error when the
    /// database fails, `400` for a body that is not a check request, `401` when `secret` is set
    /// and the Standard Webhooks signature does not match within 5 minutes).
    ///
    /// # Errors
    /// [`ConfigError`] when `secret` is not a `whsec_…` secret.
    #[cfg(feature = "webhook")]
    pub fn router(&self, path: &str, secret: Option<&str>) -> Result<axum::Router, ConfigError>
    where
        DB: 'static,
    {
        let signer = secret
            .map(crate::transport::webhook::WebhookSigner::new)
            .transpose()?;
        let barrier = self.clone();
        let handler = move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let barrier = barrier.clone();
            let signer = signer.clone();
            async move {
                use axum::http::StatusCode;
                if let Some(signer) = &signer {
                    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
                    let ts = h("webhook-timestamp").parse::<i64>().unwrap_or(0);
                    let now = chrono::Utc::now().timestamp();
                    let tolerance = std::time::Duration::from_secs(300);
                    if let Err(e) = signer.verify(
                        h("webhook-id"),
                        ts,
                        &body,
                        h("webhook-signature"),
                        now,
                        tolerance,
                    ) {
                        return (StatusCode::UNAUTHORIZED, e);
                    }
                }
                let req: CheckRequest = match serde_json::from_slice(&body) {
                    Ok(r) => r,
                    Err(e) => {
                        return (StatusCode::BAD_REQUEST, format!("not a check request: {e}"));
                    }
                };
                match barrier.resolve(req.message_id).await {
                    Ok(a) => (StatusCode::OK, a.as_str().to_owned()),
                    Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.report().to_string()),
                }
            }
        };
        Ok(axum::Router::new().route(path, axum::routing::post(handler)))
    }
}

struct BarrierHook<DB: Database>(Barrier<DB>);

#[async_trait]
impl<DB: BarrierDatabase + 'static> CheckBackHook for BarrierHook<DB> {
    async fn check(&self, request: &CheckRequest) -> Result<Answer, BoxError> {
        Ok(self.0.resolve(request.message_id).await?)
    }
}
