//! MySQL / MariaDB store (InnoDB).
//!
//! Needs `FOR UPDATE SKIP LOCKED`: MySQL 8.0.1+ or MariaDB 10.6+ (MariaDB 10.6 also brings
//! `JSON_TABLE`, used by the batched completion; MySQL has it since 8.0.4). Tested against
//! MariaDB 10.11.
//!
//! - Read: plain consistent reads of the owned buckets, a few buckets per statement
//!   ([`super::read_in_rounds`]); completion: one `UPDATE` joining a `JSON_TABLE` list to the
//!   outbox by primary key and to the bucket rows (the lease fence), per chunk of rows.
//! - Deadlocks (error 1213) and lock wait timeouts (1205) are InnoDB's normal answer when
//!   relays, the completion and other sessions touch the same index ranges (shared cases C21,
//!   C31). Every relay statement retries them with backoff (up to 8 times) and counts them
//!   ([`MySqlStore::conflicts_retried`]); one that still fails is reported as a transient
//!   [`StoreError`], which the relay loop backs off on and never treats as a message failure.
//! - Open producer transactions: an uncommitted insert holds a lock on its new row, and a
//!   locking read or an UPDATE/DELETE whose scan reaches that row waits for the producer's
//!   commit (up to `innodb_lock_wait_timeout`, 50 s by default). No relay statement reaches
//!   one: reads (`read_buckets`, the due check, key heads) are plain consistent reads; the
//!   completion joins its JSON list to the outbox by PRIMARY KEY in a forced join order
//!   (`STRAIGHT_JOIN`, `FORCE INDEX`), so it locks only the rows it names; confirmations go
//!   through the message id index; maintenance (check-back, retention) first picks its
//!   rows with `FOR UPDATE SKIP LOCKED`, then writes them by id; the membership statements
//!   touch only `<table>_buckets` and `<table>_relays`, at READ COMMITTED (no gap locks). A
//!   producer transaction held open for minutes delays only its own rows.
//! - Isolation: the relay's own transactions run at READ COMMITTED, so a REPEATABLE READ
//!   snapshot is never carried from one poll to the next (a row committed after a poll started
//!   is seen by the next poll). [`Store::stats`] deliberately uses one REPEATABLE READ consistent
//!   snapshot so its counts and ages agree.
//! - Ids: `AUTO_INCREMENT` values are drawn at insert, not at commit, and rolled-back inserts
//!   leave gaps; reads scan by state and bucket, never by "highest id seen", so a row
//!   committed late is still published (shared case C01).
//! - Times: `DATETIME(6)` in UTC from `UTC_TIMESTAMP(6)`, the database clock, never `NOW()`
//!   (which follows the session's `time_zone`, shared case C35). A foreign producer that inserts
//!   plain SQL gets UTC defaults for every time column.
//! - Text columns are `utf8mb4` (4-byte characters such as emoji survive); `payload` is
//!   `LONGBLOB` and binary-safe; `headers` is `LONGTEXT` holding a JSON object of strings;
//!   `message_id` is `CHAR(36)` (defaults to `UUID()` for plain SQL producers).
//! - Indexes: MySQL has no partial indexes, so the due rows of a bucket are found through
//!   `(status, bucket, id)` and the other scans through `(status, <time column>)`; each
//!   scan fixes `status` by equality, so it reads only the rows of its state.
//! - Wake-up: MySQL has no LISTEN/NOTIFY. An embedded relay is woken in-process by
//!   [`Store::wake`] (or [`MySqlStore::commit`]); rows from other processes or plain SQL are
//!   picked up by the relay's adaptive polling (its `poll_interval`, default 1 s, is the worst
//!   case). Measured on MariaDB 10.11: commit → broker p50 2 ms through the in-process wake-up,
//!   ~1 s (one poll interval) for a plain-SQL insert by another process; 4 relays drain 5,000
//!   messages at 6,000–7,500 msg/s while another session locks the same rows, retrying 50–80
//!   deadlocks / lock wait timeouts per run without a single failure.

pub(crate) mod errors;
pub(crate) mod migrations;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};
use tokio::sync::Notify;
use uuid::Uuid;

use self::errors::{is_already_applied, is_lock_conflict, is_lock_wait_timeout};
use self::migrations::{migrations, run_migrations};
use super::shared::{On, due_in, stats_in};
use super::status_sql::{CONFIRMED, FAILED, PENDING, REJECTED, SENDING, SENT};
use super::{
    Bucket, BucketBatch, BucketCompletion, FailedMessage, HandOff, KeyHead, LeaseToken,
    MembershipRequest, MembershipRound, ReadRound, RelayInfo, Stats, Store, StoreOptions, millis,
    new_token,
};
use crate::error::{EnqueueError, StoreError};
use crate::ident::TableName;
use crate::message::{Limits, NewMessage};
use crate::verdict::{ConfirmReport, Confirmation, RejectionHook};

mod leases;
mod producer;

/// The database clock in UTC.
const NOW: &str = "UTC_TIMESTAMP(6)";

/// Rows per completion statement (see `complete_in_buckets`).
const COMPLETION_CHUNK: usize = 125;
/// Most retries of a statement that hit a deadlock or lock wait timeout.
const MAX_CONFLICT_RETRIES: u32 = 8;
/// Rows per multi-row INSERT (7 placeholders each, well under the 65,535 limit).
const INSERT_CHUNK: usize = 1000;

/// The outbox on MySQL 8.0.1+ / MariaDB 10.6+. Cheap to clone; clones share the pool, the
/// in-process waker and the conflict counter.
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    table: TableName,
    inbox_table: TableName,
    limits: Limits,
    waker: Arc<Notify>,
    conflicts: Arc<AtomicU64>,
    hook: Option<Arc<dyn RejectionHook<sqlx::MySql>>>,
    /// Read-only refusals seen; the pool of [`MySqlStore::connect`] drops older connections.
    read_only: Arc<super::ReadOnlyGuard>,
    /// How long an enqueue waits for a lock ([`MySqlStore::with_enqueue_timeout`]).
    enqueue_timeout: Option<Duration>,
}

/// Default of [`MySqlStore::with_enqueue_timeout`].
pub const DEFAULT_ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// The admin statements' MySQL / MariaDB forms ([`crate::admin`]): times are `DATETIME(6)` in
/// UTC, so milliseconds are counted from `1970-01-01 00:00:00` without the session's time zone.
pub(crate) const ADMIN: super::admin::Dialect = super::admin::Dialect {
    numbered: false,
    ms: |c| {
        format!("CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {c}) DIV 1000 AS SIGNED)")
    },
    at_ms: |p| format!("TIMESTAMPADD(MICROSECOND, {p} * 1000, '1970-01-01 00:00:00')"),
    int: |c| format!("CAST({c} AS SIGNED)"),
    text: |c| c.to_owned(),
    uuid: |p| p.to_owned(),
    json: |p| p.to_owned(),
    contains: |c, p| format!("LOWER({c}) LIKE LOWER({p}) ESCAPE '!'"),
    now: NOW,
    begin: "BEGIN",
    before_begin: "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
    for_update: " FOR UPDATE",
    skip_locked: " FOR UPDATE SKIP LOCKED",
    index_name: |t, suffix| format!("{}{suffix}", t.rsplit('.').next().unwrap_or(t)),
    index_list: |t| {
        let (schema, table) = match t.split_once('.') {
            Some((s, t)) => (format!("'{s}'"), t),
            None => ("DATABASE()".to_owned(), t),
        };
        format!(
            "SELECT DISTINCT CAST(index_name AS CHAR), 1 FROM information_schema.statistics \
             WHERE table_schema = {schema} AND table_name = '{table}'"
        )
    },
    // InnoDB builds a secondary index online; no partial indexes in MySQL.
    create_index: |t, name, columns, _| {
        format!("CREATE INDEX {name} ON {t} ({columns}) ALGORITHM=INPLACE LOCK=NONE")
    },
    drop_index: |t, name| format!("DROP INDEX {name} ON {t}"),
};

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// `timeout` in whole seconds, rounded up, at least 1 (`lock_wait_timeout` and
/// `innodb_lock_wait_timeout` are whole seconds; 0 would mean "do not wait" or be refused).
fn whole_seconds(timeout: Duration) -> u64 {
    let secs = timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0);
    secs.max(1)
}

/// `?, ?, …` with `n` placeholders.
fn placeholders(n: usize) -> String {
    let mut s = String::with_capacity(n * 3);
    for i in 0..n {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('?');
    }
    s
}

/// `UTC_TIMESTAMP(6)` plus a bound number of milliseconds.
/// Run `set` (a `SET TRANSACTION …` for the next transaction) on a pooled connection. A
/// connection can come back to the pool with a transaction still open on the server: a future
/// cancelled between `START TRANSACTION` and its answer (a relay task aborted) leaves sqlx
/// unaware of it. MySQL then refuses the `SET` (error 1568, SQLSTATE 25001; seen in CI's
/// MariaDB demo, which kills relays); that transaction holds nothing of anyone's, so it is
/// rolled back and the `SET` runs again. No extra round trip otherwise.
async fn set_isolation(conn: &mut MySqlConnection, set: &'static str) -> Result<(), sqlx::Error> {
    match sqlx::query(set).execute(&mut *conn).await {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25001") => {
            tracing::debug!("pooled connection had a transaction left open; rolled back");
            sqlx::query("ROLLBACK").execute(&mut *conn).await?;
            sqlx::query(set).execute(&mut *conn).await.map(|_| ())
        }
        r => r.map(|_| ()),
    }
}

fn now_plus_ms() -> String {
    format!("{NOW} + INTERVAL (? * 1000) MICROSECOND")
}

/// A bound value of [`MySqlStore::exec_rc`].
enum Bind<'a> {
    I64(i64),
    Str(&'a str),
}

/// `expires_at` of a bucket nobody holds: long past (a `DATETIME` cannot be `-infinity`).
const LONG_AGO: &str = "'1970-01-01 00:00:01'";

/// `(bucket = ? AND token = ?) OR …` for `n` pairs; `FALSE` (no row) for none.
fn bucket_token_pairs(n: usize) -> String {
    if n == 0 {
        return "FALSE".into();
    }
    vec!["(bucket = ? AND token = ?)"; n].join(" OR ")
}

#[async_trait]
impl Store for MySqlStore {
    fn backend(&self) -> &'static str {
        "mysql"
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        run_migrations(&self.pool, migrations(&self.table, &self.inbox_table)).await?;
        // SENDING rows of an older relay, found through the (status, lease_expires_at) index so
        // no producer's uncommitted PENDING row is touched. A SENDING row another session locks
        // is waited for, not skipped: no relay would ever release it afterwards.
        let t = self.table.as_str();
        let f = self.table.unqualified();
        let released = self
            .exec_rc(
                "migrate",
                &format!(
                    "UPDATE {t} FORCE INDEX ({f}_leased) SET status = {PENDING}, available_at = {NOW}, \
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = {NOW} \
                     WHERE status = {SENDING}"
                ),
                &[],
            )
            .await?;
        super::log_released_sending(t, released);
        Ok(())
    }

    async fn check_schema(&self) -> Result<(), StoreError> {
        let t = self.table.as_str();
        let steps = migrations(&self.table, &self.inbox_table);
        On(&self.pool)
            .check_schema(
                t,
                "SELECT MAX(version) FROM outbox_migrations WHERE table_name = ?",
                super::latest_version(&steps, t),
                errors::is_missing_table,
                self.err("check_schema"),
            )
            .await
    }

    async fn membership(&self, req: &MembershipRequest) -> Result<MembershipRound, StoreError> {
        self.retrying("membership", move || self.membership_once(req))
            .await
    }

    async fn relays(&self, lease: Duration) -> Result<Vec<RelayInfo>, StoreError> {
        let t = self.table.as_str();
        let sql = AssertSqlSafe(format!(
            "SELECT name, routes, routes_hash FROM {t}_relays \
                 WHERE heartbeat_at > {NOW} - INTERVAL (? * 1000) MICROSECOND ORDER BY name"
        ));
        On(&self.pool)
            .all(sql, millis(lease), super::rows::relays)
            .await
            .map_err(self.err("relays"))
    }

    async fn hand_off_buckets(&self, h: &HandOff<'_>) -> Result<(), StoreError> {
        let t = self.table.as_str();
        let sql = format!(
            "UPDATE {t}_buckets SET owner = NULL, token = NULL, handoff = ?, expires_at = {} \
             WHERE owner = ? AND ({})",
            now_plus_ms(),
            bucket_token_pairs(h.buckets.len())
        );
        let mut binds = vec![
            Bind::Str(h.to),
            Bind::I64(millis(h.lease)),
            Bind::Str(h.relay),
        ];
        for (bucket, token) in h.buckets {
            binds.push(Bind::I64(i64::from(*bucket)));
            binds.push(Bind::I64(*token));
        }
        self.exec_rc("hand_off_buckets", &sql, &binds).await?;
        Ok(())
    }

    async fn statuses(&self, ids: &[i64]) -> Result<Vec<(i64, crate::Status)>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let t = self.table.as_str();
        let mut q = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(status AS SIGNED) FROM {t} WHERE id IN ({})",
            placeholders(ids.len())
        )));
        for id in ids {
            q = q.bind(*id);
        }
        let rows: Vec<(i64, i64)> = q
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
        self.retrying("release_buckets", move || {
            self.release_once(relay, buckets, leave)
        })
        .await
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
        let t = self.table.as_str();
        let mut heads = Vec::new();
        // One statement per 10,000 keys (far under the 65,535 placeholders of a statement).
        for chunk in keys.chunks(10_000) {
            let mut q = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT partition_key, MIN(CASE WHEN status IN ({PENDING}, {SENDING}) THEN id END), \
                 MIN(CASE WHEN status = {FAILED} THEN id END) FROM {t} \
                 WHERE partition_key IN ({}) AND status IN ({PENDING}, {SENDING}, {FAILED}) GROUP BY partition_key",
                placeholders(chunk.len())
            )));
            for k in chunk {
                q = q.bind(k);
            }
            let rows: Vec<super::rows::KeyHeadRow> = q
                .fetch_all(&self.pool)
                .await
                .map_err(self.err("key_heads"))?;
            heads.extend(super::rows::key_heads(rows));
        }
        Ok(heads)
    }

    async fn complete_in_buckets(
        &self,
        relay: &str,
        completions: &[BucketCompletion],
    ) -> Result<u64, StoreError> {
        // Chunks keep each statement's JSON parameter small: sqlx sets no TCP_NODELAY, and on
        // PostgreSQL a parameter of tens of KiB stalled ~40 ms on Nagle / delayed ACK. Each
        // chunk is its own statement; a row is still written once.
        let mut matched = 0;
        for chunk in completions.chunks(COMPLETION_CHUNK) {
            matched += self.complete_chunk(relay, chunk).await?;
        }
        Ok(matched)
    }

    /// MySQL/MariaDB: a completion waits on its commit; the next read overlaps it.
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
        let mut q = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT CAST(GREATEST(CEIL(TIMESTAMPDIFF(MICROSECOND, {NOW}, available_at) / 1000), 0) AS SIGNED) \
             FROM {t} WHERE status = {PENDING} AND bucket IN ({}) ORDER BY available_at LIMIT 1",
            placeholders(buckets.len())
        )));
        for b in buckets {
            q = q.bind(*b);
        }
        let ms: Option<i64> = q
            .fetch_optional(&self.pool)
            .await
            .map_err(self.err("next_due"))?;
        Ok(due_in(ms))
    }

    async fn next_due_in(&self) -> Result<Option<Duration>, StoreError> {
        let t = self.table.as_str();
        // GREATEST is NULL when any argument is NULL: an empty table answers NULL.
        let sql = AssertSqlSafe(format!(
            "SELECT CAST(GREATEST(CEIL(TIMESTAMPDIFF(MICROSECOND, {NOW}, MIN(available_at)) / 1000), 0) AS SIGNED) \
             FROM {t} WHERE status = {PENDING}"
        ));
        On(&self.pool)
            .next_due(sql)
            .await
            .map_err(self.err("next_due"))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let t = self.table.as_str();
        let err = self.err("stats");
        // One consistent snapshot for both statements, so counts and ages agree.
        let mut conn = self.pool.acquire().await.map_err(&err)?;
        set_isolation(&mut conn, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .await
            .map_err(&err)?;
        let mut tx = sqlx::Connection::begin_with(
            &mut *conn,
            "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
        )
        .await
        .map_err(&err)?;
        let counts = AssertSqlSafe(format!("SELECT status, COUNT(*) FROM {t} GROUP BY status"));
        let ages = AssertSqlSafe(format!(
            "SELECT (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(created_at), {NOW}) DIV 1000 FROM {t} \
                     WHERE status = {PENDING} AND available_at <= {NOW}), \
                    (SELECT COUNT(*) FROM {t} WHERE status = {SENT} AND confirm_deadline IS NOT NULL), \
                    (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(sent_at), {NOW}) DIV 1000 FROM {t} \
                     WHERE status = {SENT} AND confirm_deadline IS NOT NULL)"
        ));
        let stats = stats_in::<sqlx::MySql>(&mut tx, counts, ages, &err).await?;
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
        let select = format!(
            "SELECT id FROM {t} WHERE status = {SENT} AND confirm_deadline < {NOW} \
             ORDER BY confirm_deadline LIMIT ? FOR UPDATE SKIP LOCKED"
        );
        // Single-table UPDATE assignments run left to right: check_backs is written last.
        let write = format!(
            "UPDATE {t} SET \
             last_error = CASE WHEN check_backs >= ? \
               THEN CONCAT('unconfirmed: no confirmation after ', check_backs, ' check-backs') \
               ELSE 'check-back: no confirmation by the deadline' END, \
             redelivery = redelivery + CASE WHEN check_backs >= ? THEN 0 ELSE 1 END, \
             attempts = CASE WHEN check_backs >= ? THEN attempts ELSE 0 END, \
             status = CASE WHEN check_backs >= ? THEN {FAILED} ELSE {PENDING} END, \
             check_backs = check_backs + CASE WHEN check_backs >= ? THEN 0 ELSE 1 END, \
             available_at = {NOW}, confirm_deadline = NULL, updated_at = {NOW} \
             WHERE status = {SENT} AND id IN "
        );
        let max = i64::from(max_check_backs);
        self.write_selected(
            "check_back",
            &select,
            limit,
            &write,
            &[
                Bind::I64(max),
                Bind::I64(max),
                Bind::I64(max),
                Bind::I64(max),
                Bind::I64(max),
            ],
        )
        .await
    }

    async fn requeue_failed(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        let t = self.table.as_str();
        let filter = match ids {
            None => String::new(),
            Some([]) => return Ok(0),
            Some(ids) => format!(" AND id IN ({})", placeholders(ids.len())),
        };
        let sql = format!(
            "UPDATE {t} SET status = {PENDING}, attempts = 0, check_backs = 0, redelivery = redelivery + 1, \
             available_at = {NOW}, updated_at = {NOW} WHERE status = {FAILED}{filter}"
        );
        let binds: Vec<Bind<'_>> = ids
            .unwrap_or_default()
            .iter()
            .map(|id| Bind::I64(*id))
            .collect();
        self.exec_rc("requeue", &sql, &binds).await
    }

    async fn failed(&self, limit: u32) -> Result<Vec<FailedMessage>, StoreError> {
        let t = self.table.as_str();
        let sql = AssertSqlSafe(format!(
            "SELECT id, message_id, topic, attempts, last_error FROM {t} WHERE status = {FAILED} \
                 ORDER BY updated_at DESC, id DESC LIMIT ?"
        ));
        On(&self.pool)
            .all(sql, i64::from(limit), super::rows::failed_messages)
            .await
            .map_err(self.err("failed"))
    }

    fn admin_target(&self) -> super::admin::AdminTarget {
        super::admin::AdminTarget(super::admin::Target::MySql(
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

impl super::confirming::ConfirmSteps for MySqlStore {
    type Db = sqlx::MySql;
    type Id = String;

    fn id(&self, message_id: Uuid) -> String {
        message_id.hyphenated().to_string()
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    fn hook(&self) -> Option<&Arc<dyn RejectionHook<sqlx::MySql>>> {
        self.hook.as_ref()
    }

    async fn confirm(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        self.retrying("confirm", move || self.confirm_processed(ids))
            .await
    }

    async fn reject(
        &self,
        id: &String,
        error: String,
    ) -> Result<Option<super::confirming::Rejection<sqlx::MySql>>, StoreError> {
        let t = self.table.as_str();
        let mut tx = self.begin_rc().await.map_err(self.err("confirm"))?;
        let row: Option<super::RejectedRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, topic, partition_key, headers, payload FROM {t} \
             WHERE message_id = ? AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) FOR UPDATE"
        )))
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(self.err("confirm"))?;
        if let Some(row) = &row {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {t} SET status = {REJECTED}, confirmed_at = {NOW}, confirm_deadline = NULL, \
                 updated_at = {NOW}, last_error = ? WHERE id = ?"
            )))
            .bind(error)
            .bind(row.0)
            .execute(&mut *tx)
            .await
            .map_err(self.err("confirm"))?;
        }
        super::confirming::rolled_back_unless(tx, row, self.err("confirm")).await
    }

    async fn known(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        let t = self.table.as_str();
        let mut q = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT message_id FROM {t} WHERE message_id IN ({})",
            placeholders(ids.len())
        )));
        for id in ids {
            q = q.bind(id);
        }
        q.fetch_all(&self.pool).await.map_err(self.err("confirm"))
    }
}
