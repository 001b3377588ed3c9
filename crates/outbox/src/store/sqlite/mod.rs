//! SQLite store: the embedded default.
//!
//! # Limits
//! - One writer at a time (SQLite's rule). The relay's writes (membership round, completion)
//!   are single short statements or transactions; writers wait up to the busy timeout (default
//!   10 s) instead of failing.
//! - No LISTEN/NOTIFY: an embedded relay is woken in-process by [`Store::wake`] (or
//!   [`SqliteStore::commit`]); other producers are picked up by adaptive polling.
//! - Times are integer milliseconds since the Unix epoch from SQLite's own clock
//!   (`julianday('now')`, millisecond resolution), which every SQLite 3 version has, so producers
//!   in other languages can insert rows through their platform's SQLite library.
//! - An in-memory database only lives as long as one of its connections (shared case C24):
//!   [`SqliteStore::connect`] pins a single never-recycled connection for in-memory URLs, and
//!   [`SqliteStore::from_pool`] refuses an in-memory pool that could close its last connection.
//! - Files are opened in WAL mode with `synchronous = FULL`, so a commit survives power loss.

pub(crate) mod errors;
pub(crate) mod migrations;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, SqliteConnection, SqlitePool};
use tokio::sync::Notify;
use uuid::Uuid;

use self::errors::is_busy;
use self::migrations::{migrations, run_migrations};
use super::shared::{On, due_in, stats_in};
use super::status_sql::{CONFIRMED, FAILED, PENDING, REJECTED, SENDING, SENT};
use super::{
    Bucket, BucketBatch, BucketCompletion, FailedMessage, HandOff, KeyHead, LeaseToken,
    MembershipRequest, MembershipRound, ReadRound, RelayInfo, Stats, Store, millis, new_token,
};
use crate::error::{EnqueueError, StoreError};
use crate::ident::TableName;
use crate::message::{Limits, NewMessage};
use crate::store::StoreOptions;
use crate::verdict::{ConfirmReport, Confirmation, RejectionHook};

mod producer;

/// SQLite's clock in integer milliseconds since the Unix epoch.
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

/// The bucket of a row (migration v4): SQLite has no hash function, so a deterministic mix of
/// built-in deterministic functions over the partition key (the message id when there is none)
/// modulo [`super::BUCKETS`]: its length and its last four characters with different odd
/// multipliers. Random UUIDs and keys that differ in their last characters (`order-17`,
/// `customer-42`) spread evenly; every message of one key lands in one bucket.
fn bucket_expr() -> String {
    let s = "COALESCE(partition_key, message_id)";
    format!(
        "((length({s}) * 31 \
          + COALESCE(unicode(substr({s}, -1, 1)), 0) \
          + COALESCE(unicode(substr({s}, -2, 1)), 0) * 7 \
          + COALESCE(unicode(substr({s}, -3, 1)), 0) * 49 \
          + COALESCE(unicode(substr({s}, -4, 1)), 0) * 23) % {})",
        super::BUCKETS
    )
}

/// The decoded columns of a row, then its bucket (index 9); the read adds the row's due age
/// (index 10, [`crate::store::rows::due_age`]).
const READ_COLS: &str = "id, message_id, topic, partition_key, headers, CAST(payload AS BLOB) AS payload, \
     attempts, max_attempts, redelivery, bucket";

struct Sql {
    complete_in_buckets: Arc<str>,
    insert: Arc<str>,
    /// Release SENDING rows left by a relay of the row-claim protocol ([`Store::migrate`]).
    release_sending: Arc<str>,
    next_due: Arc<str>,
    counts: Arc<str>,
    ages: Arc<str>,
    failed: Arc<str>,
}

/// The outbox on SQLite. Cheap to clone; clones share the pool and the in-process waker.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    table: TableName,
    inbox_table: TableName,
    limits: Limits,
    sql: Arc<Sql>,
    waker: Arc<Notify>,
    /// Taken by the relay's completions: SQLite has one writer, and a completion that finds the
    /// write lock taken by another of this process waits here, woken the moment it is free,
    /// rather than in SQLite's busy handler, which sleeps 1, 2, 5, 10, … ms between tries.
    writer: Arc<tokio::sync::Mutex<()>>,
    hook: Option<Arc<dyn RejectionHook<sqlx::Sqlite>>>,
    /// How long an enqueue waits for the write lock ([`SqliteStore::with_enqueue_timeout`]).
    enqueue_timeout: Option<Duration>,
}

/// Rows a connection's worker thread may hand over before the reading task takes them (sqlx's
/// `row_buffer_size`, default 50): a relay's read of a whole batch (500 rows by default) then
/// runs without the worker stopping ten times for the task to catch up. Set by
/// [`SqliteStore::connect`]; a pool passed to [`SqliteStore::from_pool`] keeps its own.
pub const ROW_BUFFER: usize = 1024;

/// Default of [`SqliteStore::with_enqueue_timeout`].
pub const DEFAULT_ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// The admin statements' SQLite forms ([`crate::admin`]): times are already milliseconds; the
/// one writer needs no row locks, a writing transaction starts `IMMEDIATE`. `LIKE` ignores
/// ASCII case here, also for topic globs.
pub(crate) const ADMIN: super::admin::Dialect = super::admin::Dialect {
    numbered: false,
    ms: |c| c.to_owned(),
    at_ms: |p| p.to_owned(),
    int: |c| c.to_owned(),
    text: |c| c.to_owned(),
    uuid: |p| p.to_owned(),
    json: |p| p.to_owned(),
    contains: |c, p| format!("{c} LIKE {p} ESCAPE '!'"),
    now: NOW_MS,
    begin: "BEGIN IMMEDIATE",
    before_begin: "",
    for_update: "",
    skip_locked: "",
    index_name: |t, suffix| format!("{t}{suffix}"),
    index_list: |t| {
        format!("SELECT name, 1 FROM sqlite_master WHERE type = 'index' AND tbl_name = '{t}'")
    },
    create_index: |t, name, columns, partial| {
        let only = if partial.is_empty() {
            String::new()
        } else {
            format!(" WHERE {partial}")
        };
        format!("CREATE INDEX IF NOT EXISTS {name} ON {t} ({columns}){only}")
    },
    drop_index: |_, name| format!("DROP INDEX IF EXISTS {name}"),
};

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// Whether `url` names an in-memory SQLite database.
fn url_is_in_memory(url: &str) -> bool {
    url.contains(":memory:") || url.contains("mode=memory")
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        run_migrations(
            &self.pool,
            migrations(self.table.as_str(), self.inbox_table.as_str()),
        )
        .await?;
        let released = sqlx::query(AssertSqlSafe(self.sql.release_sending.clone()))
            .execute(&self.pool)
            .await
            .map_err(self.err("migrate"))?;
        super::log_released_sending(self.table.as_str(), released.rows_affected());
        Ok(())
    }

    async fn check_schema(&self) -> Result<(), StoreError> {
        let t = self.table.as_str();
        let steps = migrations(self.table.as_str(), self.inbox_table.as_str());
        On(&self.pool)
            .check_schema(
                t,
                "SELECT MAX(version) FROM outbox_migrations WHERE table_name = ?1",
                super::latest_version(&steps, t),
                errors::is_missing_table,
                self.err("check_schema"),
            )
            .await
    }

    async fn membership(&self, req: &MembershipRequest) -> Result<MembershipRound, StoreError> {
        self.membership_tx(req)
            .await
            .map_err(self.err("membership"))
    }

    async fn relays(&self, lease: Duration) -> Result<Vec<RelayInfo>, StoreError> {
        let t = self.table.as_str();
        let sql = AssertSqlSafe(format!(
            "SELECT name, routes, routes_hash FROM {t}_relays \
                 WHERE heartbeat_at > {NOW_MS} - ?1 ORDER BY name"
        ));
        On(&self.pool)
            .all(sql, millis(lease), super::rows::relays)
            .await
            .map_err(self.err("relays"))
    }

    async fn hand_off_buckets(&self, h: &HandOff<'_>) -> Result<(), StoreError> {
        let t = self.table.as_str();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t}_buckets SET owner = NULL, token = NULL, handoff = ?3, expires_at = {NOW_MS} + ?4 \
             WHERE owner = ?1 AND EXISTS (SELECT 1 FROM json_each(?2) h \
             WHERE h.value ->> '$[0]' = {t}_buckets.bucket AND h.value ->> '$[1]' = {t}_buckets.token)"
        )))
        .bind(h.relay)
        .bind(serde_json::to_string(h.buckets).expect("buckets serialize"))
        .bind(h.to)
        .bind(millis(h.lease))
        .execute(&self.pool)
        .await
        .map_err(self.err("hand_off_buckets"))?;
        Ok(())
    }

    async fn statuses(&self, ids: &[i64]) -> Result<Vec<(i64, crate::Status)>, StoreError> {
        let t = self.table.as_str();
        let rows: Vec<(i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status FROM {t} WHERE id IN (SELECT value FROM json_each(?1))"
        )))
        .bind(serde_json::to_string(ids).expect("ids serialize"))
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("statuses"))?;
        super::statuses_from(rows)
    }

    async fn release_buckets(
        &self,
        relay: &str,
        buckets: &[(Bucket, LeaseToken)],
        leave: bool,
    ) -> Result<(), StoreError> {
        if buckets.is_empty() && !leave {
            return Ok(());
        }
        let t = self.table.as_str();
        let err = self.err("release_buckets");
        let mut conn = self.pool.acquire().await.map_err(&err)?;
        let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE")
            .await
            .map_err(&err)?;
        if !buckets.is_empty() {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {t}_buckets SET owner = NULL, token = NULL, expires_at = 0 WHERE owner = ?1 \
                 AND EXISTS (SELECT 1 FROM json_each(?2) h WHERE h.value ->> '$[0]' = {t}_buckets.bucket \
                 AND h.value ->> '$[1]' = {t}_buckets.token)"
            )))
            .bind(relay)
            .bind(serde_json::to_string(buckets).expect("buckets serialize"))
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        }
        if leave {
            sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {t}_relays WHERE name = ?1"
            )))
            .bind(relay)
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        }
        tx.commit().await.map_err(&err)
    }

    async fn read_buckets(
        &self,
        buckets: &[Bucket],
        skip_keys: &[String],
        limit: u32,
    ) -> Result<BucketBatch, StoreError> {
        super::read_in_rounds(
            buckets,
            skip_keys,
            limit,
            self.err("read_buckets"),
            |round| self.read_parts(round),
        )
        .await
    }

    async fn key_heads(&self, keys: &[String]) -> Result<Vec<KeyHead>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let t = self.table.as_str();
        let rows: Vec<super::rows::KeyHeadRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT partition_key, MIN(CASE WHEN status IN ({PENDING}, {SENDING}) THEN id END), \
             MIN(CASE WHEN status = {FAILED} THEN id END) FROM {t} \
             WHERE partition_key IN (SELECT value FROM json_each(?1)) AND status IN ({PENDING}, {SENDING}, {FAILED}) \
               AND partition_key IS NOT NULL GROUP BY partition_key"
        )))
        .bind(serde_json::to_string(keys).expect("keys serialize"))
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("key_heads"))?;
        Ok(super::rows::key_heads(rows))
    }

    async fn complete_in_buckets(
        &self,
        relay: &str,
        completions: &[BucketCompletion],
    ) -> Result<u64, StoreError> {
        if completions.is_empty() {
            return Ok(0);
        }
        let c = super::BucketColumns::from(completions);
        let rows: Vec<serde_json::Value> = (0..c.ids.len())
            .map(|i| {
                serde_json::json!([
                    c.ids[i],
                    c.statuses[i],
                    c.delays_ms[i],
                    c.errors[i],
                    c.attempts[i],
                    c.confirm_ms[i],
                    c.tokens[i]
                ])
            })
            .collect();
        let _writer = self.writer.lock().await;
        let done = sqlx::query(AssertSqlSafe(self.sql.complete_in_buckets.clone()))
            .bind(serde_json::Value::Array(rows).to_string())
            .bind(relay)
            .execute(&self.pool)
            .await
            .map_err(self.err("complete_in_buckets"))?;
        Ok(done.rows_affected())
    }

    /// SQLite: one writer, a completion waits on its WAL sync; the next read overlaps it.
    fn lanes_share_buckets(&self) -> bool {
        true
    }

    async fn next_due_in_buckets(
        &self,
        buckets: &[Bucket],
    ) -> Result<Option<Duration>, StoreError> {
        if buckets.is_empty() {
            return Ok(None);
        }
        let t = self.table.as_str();
        let ms: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT MAX(available_at - {NOW_MS}, 0) FROM {t} \
             WHERE status = {PENDING} AND bucket IN (SELECT value FROM json_each(?1)) \
             ORDER BY available_at LIMIT 1"
        )))
        .bind(serde_json::to_string(buckets).expect("buckets serialize"))
        .fetch_optional(&self.pool)
        .await
        .map_err(self.err("next_due"))?;
        Ok(due_in(ms))
    }

    async fn next_due_in(&self) -> Result<Option<Duration>, StoreError> {
        let sql = AssertSqlSafe(self.sql.next_due.clone());
        On(&self.pool)
            .next_due(sql)
            .await
            .map_err(self.err("next_due"))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        // One snapshot for both statements, so counts and ages agree.
        let err = self.err("stats");
        let mut tx = self.pool.begin().await.map_err(&err)?;
        let counts = AssertSqlSafe(self.sql.counts.clone());
        let ages = AssertSqlSafe(self.sql.ages.clone());
        let stats = stats_in::<sqlx::Sqlite>(&mut tx, counts, ages, &err).await?;
        tx.commit().await.map_err(&err)?;
        Ok(stats)
    }

    async fn apply_confirmations(
        &self,
        batch: &[Confirmation],
    ) -> Result<ConfirmReport, StoreError> {
        super::confirming::apply(self, batch).await
    }

    async fn check_back(&self, limit: u32, max_check_backs: u32) -> Result<u64, StoreError> {
        let t = self.table.as_str();
        let done = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET \
             status = CASE WHEN check_backs >= ?2 THEN {FAILED} ELSE {PENDING} END, \
             last_error = CASE WHEN check_backs >= ?2 \
               THEN 'unconfirmed: no confirmation after ' || check_backs || ' check-backs' \
               ELSE 'check-back: no confirmation by the deadline' END, \
             check_backs = check_backs + CASE WHEN check_backs >= ?2 THEN 0 ELSE 1 END, \
             redelivery = redelivery + CASE WHEN check_backs >= ?2 THEN 0 ELSE 1 END, \
             attempts = CASE WHEN check_backs >= ?2 THEN attempts ELSE 0 END, \
             available_at = {NOW_MS}, confirm_deadline = NULL, updated_at = {NOW_MS} \
             WHERE id IN (SELECT id FROM {t} WHERE status = {SENT} AND confirm_deadline < {NOW_MS} \
                          ORDER BY confirm_deadline LIMIT ?1) \
               AND status = {SENT} AND confirm_deadline < {NOW_MS}"
        )))
        .bind(i64::from(limit))
        .bind(i64::from(max_check_backs))
        .execute(&self.pool)
        .await
        .map_err(self.err("check_back"))?;
        Ok(done.rows_affected())
    }

    async fn requeue_failed(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        let t = self.table.as_str();
        let sql = format!(
            "UPDATE {t} SET status = {PENDING}, attempts = 0, check_backs = 0, redelivery = redelivery + 1, \
             available_at = {NOW_MS}, updated_at = {NOW_MS} \
             WHERE status = {FAILED} AND (?1 IS NULL OR id IN (SELECT value FROM json_each(?1)))"
        );
        let ids = ids.map(|ids| serde_json::to_string(ids).expect("ids serialize"));
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .execute(&self.pool)
            .await
            .map_err(self.err("requeue"))?;
        Ok(done.rows_affected())
    }

    async fn failed(&self, limit: u32) -> Result<Vec<FailedMessage>, StoreError> {
        let sql = AssertSqlSafe(self.sql.failed.clone());
        On(&self.pool)
            .all(sql, i64::from(limit), super::rows::failed_messages)
            .await
            .map_err(self.err("failed"))
    }

    fn admin_target(&self) -> super::admin::AdminTarget {
        super::admin::AdminTarget(super::admin::Target::Sqlite(
            self.pool.clone(),
            self.table.as_str().to_owned(),
            &ADMIN,
        ))
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn waker(&self) -> Arc<Notify> {
        self.waker.clone()
    }
}

impl super::confirming::ConfirmSteps for SqliteStore {
    type Db = sqlx::Sqlite;
    type Id = String;

    fn id(&self, message_id: Uuid) -> String {
        message_id.to_string()
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    fn hook(&self) -> Option<&Arc<dyn RejectionHook<sqlx::Sqlite>>> {
        self.hook.as_ref()
    }

    async fn confirm(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        let t = self.table.as_str();
        sqlx::query_scalar(AssertSqlSafe(format!(
            "UPDATE {t} SET status = {CONFIRMED}, confirmed_at = {NOW_MS}, confirm_deadline = NULL, updated_at = {NOW_MS} \
             WHERE message_id IN (SELECT value FROM json_each(?1)) AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) \
             RETURNING message_id"
        )))
        .bind(serde_json::to_string(ids).expect("ids serialize"))
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("confirm"))
    }

    async fn reject(
        &self,
        id: &String,
        error: String,
    ) -> Result<Option<super::confirming::Rejection<sqlx::Sqlite>>, StoreError> {
        let t = self.table.as_str();
        let mut tx = (self.pool)
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(self.err("confirm"))?;
        let row: Option<super::RejectedRow> = sqlx::query_as(AssertSqlSafe(format!(
            "UPDATE {t} SET status = {REJECTED}, confirmed_at = {NOW_MS}, confirm_deadline = NULL, \
             updated_at = {NOW_MS}, last_error = ?2 WHERE message_id = ?1 AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) \
             RETURNING id, topic, partition_key, headers, CAST(payload AS BLOB)"
        )))
        .bind(id)
        .bind(error)
        .fetch_optional(&mut *tx)
        .await
        .map_err(self.err("confirm"))?;
        super::confirming::rolled_back_unless(tx, row, self.err("confirm")).await
    }

    async fn known(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        let t = self.table.as_str();
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT message_id FROM {t} WHERE message_id IN (SELECT value FROM json_each(?1))"
        )))
        .bind(serde_json::to_string(ids).expect("ids serialize"))
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("confirm"))
    }
}
