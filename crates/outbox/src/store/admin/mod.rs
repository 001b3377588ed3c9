//! The admin operations ([`crate::admin`]) for the three databases: one definition of the SQL,
//! written through a [`Dialect`]'s few differences (placeholders, time and type conversions, the
//! clock, how a writing transaction starts), and one generic execution over sqlx.
//!
//! Times travel as milliseconds since the Unix epoch (UTC): each dialect turns a column into
//! milliseconds and a parameter into its own timestamp, so the comparisons stay on the column
//! (and its indexes).

/// `impl Admin<'_, DB> { … }` for every sqlx database the admin statements run on (the bounds
/// written once; the methods live in this module and its children by subject).
macro_rules! admin_impl {
    ($($body:tt)*) => {
        impl<DB: sqlx::Database> Admin<'_, DB>
        where
            for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
            DB::Arguments: sqlx::IntoArguments<DB>,
            for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
            for<'q> String: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
            for<'q> Vec<u8>: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
            usize: sqlx::ColumnIndex<DB::Row>,
            DB::QueryResult: $crate::store::admin::Affected,
            for<'q> Option<i64>: sqlx::Encode<'q, DB>,
            for<'q> Option<String>: sqlx::Encode<'q, DB>,
        {
            $($body)*
        }
    };
}

mod actions;
mod inbox;
pub(crate) mod retention;
mod search;

use chrono::{DateTime, TimeZone, Utc};
use sqlx::{Database, Encode, Row, Type};

/// The rows a statement changed, for each database's query result.
pub(crate) trait Affected {
    /// Rows changed.
    fn affected(&self) -> u64;
}

#[cfg(feature = "postgres")]
impl Affected for sqlx::postgres::PgQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl Affected for sqlx::mysql::MySqlQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "sqlite")]
impl Affected for sqlx::sqlite::SqliteQueryResult {
    fn affected(&self) -> u64 {
        self.rows_affected()
    }
}

/// The pool and table a store's admin operations run on: what [`Store::admin_target`]
/// (crate::Store::admin_target) gives the provided admin methods. Opaque.
pub struct AdminTarget(pub(crate) Target);

impl std::fmt::Debug for AdminTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminTarget")
    }
}

/// One database's pool, its outbox table and its [`Dialect`] (the dialect module's `ADMIN`).
pub(crate) enum Target {
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool, String, &'static Dialect),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool, String, &'static Dialect),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool, String, &'static Dialect),
}

/// Run [`Admin`]`::$f(args…)` on the database of `$target` (a `&Target`).
macro_rules! on_target {
    ($target:expr, $f:ident($($arg:expr),*)) => {
        match $target {
            #[cfg(feature = "postgres")]
            Target::Postgres(pool, table, d) => Admin { pool, d: *d, table }.$f($($arg),*).await,
            #[cfg(feature = "mysql")]
            Target::MySql(pool, table, d) => Admin { pool, d: *d, table }.$f($($arg),*).await,
            #[cfg(feature = "sqlite")]
            Target::Sqlite(pool, table, d) => Admin { pool, d: *d, table }.$f($($arg),*).await,
        }
    };
}

mod two_phase;
pub(crate) use two_phase::{decide_on, due_prepared_on, prepare_on, record_check_on};

/// [`InboxAdmin::consumers`](crate::admin::inbox::InboxAdmin::consumers) on `target` (its
/// table is the inbox table).
pub(crate) async fn inbox_consumers_on(
    target: &Target,
) -> Result<Vec<ConsumerDeadLetters>, StoreError> {
    on_target!(target, inbox_consumers())
}

/// [`InboxAdmin::dead_letters`](crate::admin::inbox::InboxAdmin::dead_letters) and
/// [`InboxAdmin::dead_letter`](crate::admin::inbox::InboxAdmin::dead_letter) on `target`.
pub(crate) async fn inbox_dead_letters_on(
    target: &Target,
    consumer: Option<&str>,
    message_id: Option<&str>,
    limit: u32,
) -> Result<Vec<InboxDeadLetter>, StoreError> {
    on_target!(target, inbox_dead_letters(consumer, message_id, limit))
}

/// [`InboxAdmin::act`](crate::admin::inbox::InboxAdmin::act) on `target`.
pub(crate) async fn inbox_act_on(
    target: &Target,
    action: InboxAction,
    consumer: &str,
    message_ids: &[String],
) -> Result<InboxActionReport, StoreError> {
    on_target!(target, inbox_act(action, consumer, message_ids))
}

/// [`Store::search`](crate::Store::search) on `target`.
pub(crate) async fn search_on(
    target: AdminTarget,
    filter: &MessageFilter,
    page: &PageRequest,
) -> Result<MessagePage, StoreError> {
    on_target!(&target.0, search(filter, page))
}

/// [`Store::search_indexes`](crate::Store::search_indexes) on `target`.
pub(crate) async fn search_indexes_on(target: AdminTarget) -> Result<SearchIndexes, StoreError> {
    on_target!(&target.0, search_indexes())
}

/// [`Store::create_search_indexes`](crate::Store::create_search_indexes) on `target`.
pub(crate) async fn create_search_indexes_on(
    target: AdminTarget,
) -> Result<SearchIndexes, StoreError> {
    on_target!(&target.0, create_search_indexes())
}

/// [`Store::message`](crate::Store::message) on `target`.
pub(crate) async fn message_on(
    target: AdminTarget,
    id: i64,
) -> Result<Option<MessageDetail>, StoreError> {
    on_target!(&target.0, message(id))
}

/// [`Store::topic_counts`](crate::Store::topic_counts) on `target`.
pub(crate) async fn topic_counts_on(
    target: AdminTarget,
    limit: u32,
) -> Result<Vec<TopicCounts>, StoreError> {
    on_target!(&target.0, topic_counts(limit))
}

/// [`Store::leases`](crate::Store::leases) on `target`.
pub(crate) async fn leases_on(target: AdminTarget) -> Result<Leases, StoreError> {
    on_target!(&target.0, leases())
}

/// [`Store::blocked_keys`](crate::Store::blocked_keys) on `target`.
pub(crate) async fn blocked_keys_on(
    target: AdminTarget,
    limit: u32,
) -> Result<Vec<BlockedKey>, StoreError> {
    on_target!(&target.0, blocked_keys(limit))
}

/// [`Store::retire`](crate::Store::retire) on `target`.
pub(crate) async fn retire_on(
    target: AdminTarget,
    state: Finished,
    older_than: std::time::Duration,
    action: RetentionAction,
    limit: u32,
) -> Result<u64, StoreError> {
    on_target!(&target.0, retire(state, older_than, action, limit))
}

/// [`Store::purge_archive`](crate::Store::purge_archive) on `target`.
pub(crate) async fn purge_archive_on(
    target: AdminTarget,
    older_than: std::time::Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    on_target!(&target.0, purge_archive(older_than, limit))
}

/// [`Store::act`](crate::Store::act) on `target`.
pub(crate) async fn act_on(
    target: AdminTarget,
    action: Action,
    selection: &Selection,
) -> Result<ActionReport, StoreError> {
    on_target!(&target.0, act(action, selection))
}

use super::StoreError;
use super::status_sql::{FAILED, PENDING};
use crate::admin_model::inbox::{
    ConsumerDeadLetters, InboxAction, InboxActionReport, InboxDeadLetter,
};
use crate::admin_model::{
    ACTION_CHUNK, Action, ActionReport, BlockedKey, BucketRow, Leases, MAX_PAGE, MessageDetail,
    MessageFilter, MessagePage, MessageSummary, PageRequest, RelayRow, RenderedPayload,
    SearchIndexes, Selection, TopicCounts, contains_pattern, like_pattern,
};
use crate::message::Status;
use crate::retention::{Finished, RetentionAction};

/// What differs between the databases in the admin statements.
pub(crate) struct Dialect {
    /// `$1, $2, …` (PostgreSQL) rather than `?`.
    pub numbered: bool,
    /// A timestamp column as epoch milliseconds (`bigint`).
    pub ms: fn(&str) -> String,
    /// A timestamp from an epoch-milliseconds parameter.
    pub at_ms: fn(&str) -> String,
    /// An integer column as a 64-bit integer.
    pub int: fn(&str) -> String,
    /// A column as text (PostgreSQL's `uuid` and `jsonb`).
    pub text: fn(&str) -> String,
    /// A message-id text parameter compared with the `message_id` column.
    pub uuid: fn(&str) -> String,
    /// A JSON text parameter written to the `headers` column (PostgreSQL's `jsonb`).
    pub json: fn(&str) -> String,
    /// `col` contains the `LIKE` pattern `p` (escape `!`), ignoring case.
    pub contains: fn(&str, &str) -> String,
    /// The database clock.
    pub now: &'static str,
    /// How a transaction that will write starts.
    pub begin: &'static str,
    /// A statement run on the connection before `begin` (MySQL: `SET TRANSACTION ISOLATION
    /// LEVEL READ COMMITTED`, so locking reads take no gap locks that would stall producers
    /// and the relay), or empty.
    pub before_begin: &'static str,
    /// Appended to the select that picks an action's rows (row locks).
    pub for_update: &'static str,
    /// Appended to the select that picks retention's rows: lock them, skip rows locked by
    /// others (empty where the transaction's start already locks: SQLite).
    pub skip_locked: &'static str,
    /// The name of the table's index with `suffix` (`_created_id`), as `CREATE INDEX` names it.
    pub index_name: fn(table: &str, suffix: &str) -> String,
    /// A statement listing the table's indexes: name (text) and whether it is usable (an
    /// integer, 0 for PostgreSQL's invalid leftovers of a failed concurrent build).
    pub index_list: fn(table: &str) -> String,
    /// `CREATE INDEX` of the index `name` on `columns` of the table where `partial` holds (a
    /// condition, or empty; where the database has no partial indexes the condition is left
    /// out), without blocking writers where the database can (PostgreSQL `CONCURRENTLY`).
    pub create_index: fn(table: &str, name: &str, columns: &str, partial: &str) -> String,
    /// `DROP INDEX` of the index `name` of the table.
    pub drop_index: fn(table: &str, name: &str) -> String,
}

/// A bound value.
enum Arg {
    Int(i64),
    Text(String),
    OptInt(Option<i64>),
    OptText(Option<String>),
    Bytes(Vec<u8>),
}

/// A statement's text and its arguments, built in order.
struct Sql<'d> {
    d: &'d Dialect,
    text: String,
    args: Vec<Arg>,
}

impl<'d> Sql<'d> {
    fn new(d: &'d Dialect, text: impl Into<String>) -> Self {
        Sql {
            d,
            text: text.into(),
            args: Vec::new(),
        }
    }

    /// The placeholder of the argument added now.
    fn arg(&mut self, a: Arg) -> String {
        self.args.push(a);
        if self.d.numbered {
            format!("${}", self.args.len())
        } else {
            "?".to_owned()
        }
    }

    fn push(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// ` AND <filter's conditions>`.
    fn filter(&mut self, f: &MessageFilter) {
        if !f.states.is_empty() {
            let list = f
                .states
                .iter()
                .map(|s| s.as_i16().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            self.push(&format!(" AND status IN ({list})"));
        }
        if let Some(topic) = &f.topic {
            let p = self.arg(Arg::Text(like_pattern(topic)));
            self.push(&format!(" AND topic LIKE {p} ESCAPE '!'"));
        }
        if let Some(key) = &f.partition_key {
            let p = self.arg(Arg::Text(key.clone()));
            self.push(&format!(" AND partition_key = {p}"));
        }
        if let Some(id) = f.message_id {
            let p = self.arg(Arg::Text(id.to_string()));
            self.push(&format!(" AND message_id = {}", (self.d.uuid)(&p)));
        }
        for (col, op, at) in [
            ("created_at", ">=", f.created_after),
            ("created_at", "<", f.created_before),
            ("sent_at", ">=", f.sent_after),
            ("sent_at", "<", f.sent_before),
        ] {
            if let Some(at) = at {
                let p = self.arg(Arg::Int(at.timestamp_millis()));
                self.push(&format!(" AND {col} {op} {}", (self.d.at_ms)(&p)));
            }
        }
        if let Some(text) = &f.error {
            let p = self.arg(Arg::Text(contains_pattern(text)));
            self.push(&format!(" AND {}", (self.d.contains)("last_error", &p)));
        }
    }

    /// ` AND id IN (…)`.
    fn ids(&mut self, ids: &[i64]) {
        let list: Vec<String> = ids.iter().map(|&i| self.arg(Arg::Int(i))).collect();
        self.push(&format!(" AND id IN ({})", list.join(", ")));
    }

    fn query<DB: Database>(&self) -> sqlx::query::Query<'_, DB, DB::Arguments>
    where
        for<'q> i64: Encode<'q, DB> + Type<DB>,
        for<'q> String: Encode<'q, DB> + Type<DB>,
        for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
        for<'q> Option<i64>: Encode<'q, DB>,
        for<'q> Option<String>: Encode<'q, DB>,
    {
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.text.clone()));
        for a in &self.args {
            q = match a {
                Arg::Int(i) => q.bind(*i),
                Arg::Text(s) => q.bind(s.clone()),
                Arg::OptInt(i) => q.bind(*i),
                Arg::OptText(s) => q.bind(s.clone()),
                Arg::Bytes(b) => q.bind(b.clone()),
            };
        }
        q
    }
}

/// The summary columns, in the order [`summary`] reads them (0–15).
fn summary_columns(d: &Dialect) -> String {
    let ms = d.ms;
    let int = d.int;
    format!(
        "id, {mid}, topic, partition_key, {status}, {attempts}, {max_attempts}, {check_backs}, \
         {redelivery}, {created}, {available}, {sent}, {confirmed}, {updated}, {deadline}, last_error",
        mid = (d.text)("message_id"),
        status = int("status"),
        attempts = int("attempts"),
        max_attempts = int("max_attempts"),
        check_backs = int("check_backs"),
        redelivery = int("redelivery"),
        created = ms("created_at"),
        available = ms("available_at"),
        sent = ms("sent_at"),
        confirmed = ms("confirmed_at"),
        updated = ms("updated_at"),
        deadline = ms("confirm_deadline"),
    )
}

fn at(ms: Option<i64>) -> Option<DateTime<Utc>> {
    ms.and_then(|ms| Utc.timestamp_millis_opt(ms).single())
}

/// One database's admin statements: its pool, outbox table and dialect.
struct Admin<'a, DB: Database> {
    pool: &'a sqlx::Pool<DB>,
    d: &'a Dialect,
    table: &'a str,
}

/// The columns the archive table shares with the outbox table.
pub(crate) const ARCHIVED_COLUMNS: &str = "id, message_id, topic, partition_key, headers, payload, \
     status, attempts, max_attempts, available_at, created_at, sent_at, confirmed_at, updated_at, \
     last_error, confirm_deadline, check_backs, redelivery";

/// `INSERT INTO <table>_archive … SELECT … FROM <table> WHERE <condition>`, with `reason`.
fn archive_into(table: &str, now: &str, reason: &str, condition: &str) -> String {
    format!(
        "INSERT INTO {table}_archive ({ARCHIVED_COLUMNS}, archived_at, archive_reason) \
         SELECT {ARCHIVED_COLUMNS}, {now}, '{reason}' FROM {table} WHERE {condition}"
    )
}

/// Rows per retention transaction: `limit`, at most [`ACTION_CHUNK`], at least 1.
fn chunk(limit: u32) -> usize {
    (limit as usize).clamp(1, ACTION_CHUNK)
}

admin_impl! {
    /// A [`MessageSummary`] from columns 0–15 of [`summary_columns`].
    fn summary(row: &DB::Row) -> Result<MessageSummary, sqlx::Error> {
        // Leniently: a row a foreign producer filled with garbage (SQLite keeps any value in any
        // column) still lists, with what cannot be read as null or `<unreadable>`, so the
        // operator can find it; only the row id must read.
        let opt = |i: usize| row.try_get::<Option<i64>, _>(i).ok().flatten();
        let text = |i: usize| row.try_get::<Option<String>, _>(i).map_err(|_| ());
        let unreadable = || "<unreadable>".to_owned();
        let status_number = opt(4).unwrap_or(-1);
        Ok(MessageSummary {
            id: row.try_get(0)?,
            message_id: text(1).ok().flatten().unwrap_or_else(unreadable),
            topic: text(2).ok().flatten().unwrap_or_else(unreadable),
            partition_key: text(3).unwrap_or_else(|()| Some(unreadable())),
            status: i16::try_from(status_number).ok().and_then(Status::from_i16),
            status_number,
            attempts: opt(5).unwrap_or(0),
            max_attempts: opt(6),
            check_backs: opt(7).unwrap_or(0),
            redelivery: opt(8).unwrap_or(0),
            created_at: at(opt(9)),
            available_at: at(opt(10)),
            sent_at: at(opt(11)),
            confirmed_at: at(opt(12)),
            updated_at: at(opt(13)),
            confirm_deadline: at(opt(14)),
            last_error: text(15).unwrap_or_else(|()| Some(unreadable())),
        })
    }

    /// Run `sql` and decode each row with `decode`; errors are `op`'s.
    async fn fetch<T>(
        &self,
        op: &'static str,
        sql: &Sql<'_>,
        decode: impl Fn(&DB::Row) -> Result<T, sqlx::Error>,
    ) -> Result<Vec<T>, StoreError> {
        let err = |e| super::db_error(op, self.table, e);
        let rows = sql.query::<DB>().fetch_all(self.pool).await.map_err(err)?;
        rows.iter()
            .map(decode)
            .collect::<Result<_, _>>()
            .map_err(err)
    }

    /// [`Store::message`](crate::Store::message).
    async fn message(&self, id: i64) -> Result<Option<MessageDetail>, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| super::db_error("message", table, e);
        let mut sql = Sql::new(
            d,
            format!(
                "SELECT {}, {}, payload, check_back FROM {table} WHERE 1 = 1",
                summary_columns(d),
                (d.text)("headers")
            ),
        );
        sql.ids(&[id]);
        let Some(row) = sql.query::<DB>().fetch_optional(pool).await.map_err(err)? else {
            return Ok(None);
        };
        let summary = Self::summary(&row).map_err(err)?;
        // As leniently as the summary: garbage is shown as garbage, never a failed read.
        let payload: Vec<u8> = row
            .try_get::<Vec<u8>, _>(17)
            .or_else(|_| row.try_get::<String, _>(17).map(String::into_bytes))
            .unwrap_or_default();
        let (headers, headers_error, headers_raw) = match row.try_get::<String, _>(16) {
            Ok(raw) => match super::parse_headers(id, &raw) {
                Ok(h) => (h.into_iter().collect(), None, None),
                Err(e) => (Default::default(), Some(e.to_string()), Some(raw)),
            },
            Err(e) => (
                Default::default(),
                Some(format!("the headers column is not text: {e}")),
                None,
            ),
        };
        let check_back = row.try_get::<Option<String>, _>(18).ok().flatten();
        Ok(Some(MessageDetail {
            check_back,
            summary,
            headers,
            headers_error,
            headers_raw,
            payload: RenderedPayload::of(&payload),
        }))
    }

    /// [`Store::leases`](crate::Store::leases).
    async fn leases(&self) -> Result<Leases, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| super::db_error("leases", table, e);
        let now: Option<i64> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT {}", (d.ms)(d.now))))
                .fetch_one(pool)
                .await
                .map_err(err)?;
        let relays = Sql::new(
            d,
            format!(
                "SELECT name, {}, routes FROM {table}_relays ORDER BY name",
                (d.ms)("heartbeat_at")
            ),
        );
        let relays = self
            .fetch("leases", &relays, |r| {
                Ok(RelayRow {
                    name: r.try_get(0)?,
                    heartbeat_at: at(r.try_get(1)?),
                    routes: r.try_get(2)?,
                })
            })
            .await?;
        let buckets = Sql::new(
            d,
            format!(
                "SELECT {}, owner, {}, {}, {}, handoff FROM {table}_buckets ORDER BY bucket",
                (d.int)("bucket"),
                (d.int)("token"),
                (d.ms)("expires_at"),
                (d.int)("takeovers"),
            ),
        );
        let buckets = self
            .fetch("leases", &buckets, |r| {
                Ok(BucketRow {
                    bucket: r.try_get(0)?,
                    owner: r.try_get(1)?,
                    token: r.try_get(2)?,
                    // A bucket never leased expired at the dawn of time (PostgreSQL
                    // '-infinity', MySQL 1970-01-01 00:00:01, SQLite 0): no expiry to show.
                    expires_at: at(r.try_get::<Option<i64>, _>(3)?.filter(|&ms| ms > 1000)),
                    takeovers: r.try_get(4)?,
                    handoff: r.try_get(5)?,
                })
            })
            .await?;
        Ok(Leases {
            now: at(now),
            relays,
            buckets,
        })
    }

    /// [`Store::blocked_keys`](crate::Store::blocked_keys).
    async fn blocked_keys(&self, limit: u32) -> Result<Vec<BlockedKey>, StoreError> {
        let (d, table) = (self.d, self.table);
        let mut sql = Sql::new(
            d,
            format!(
                "SELECT f.partition_key, f.id, {since}, f.last_error, {waiting} \
                 FROM {table} f JOIN {table} w ON w.partition_key = f.partition_key \
                   AND w.status = {PENDING} AND w.id > f.id \
                 WHERE f.status = {FAILED} AND f.partition_key IS NOT NULL \
                   AND NOT EXISTS (SELECT 1 FROM {table} e WHERE e.partition_key = f.partition_key \
                     AND e.status = {FAILED} AND e.id < f.id) \
                 GROUP BY f.partition_key, f.id, f.updated_at, f.last_error ORDER BY f.id",
                since = (d.ms)("f.updated_at"),
                waiting = (d.int)("COUNT(w.id)"),
            ),
        );
        let p = sql.arg(Arg::Int(i64::from(limit.clamp(1, MAX_PAGE))));
        sql.push(&format!(" LIMIT {p}"));
        self.fetch("blocked_keys", &sql, |r| {
            Ok(BlockedKey {
                key: r.try_get(0)?,
                held_by: r.try_get(1)?,
                since: at(r.try_get(2)?),
                last_error: r.try_get(3)?,
                waiting: r.try_get(4)?,
            })
        })
        .await
    }

    /// [`Store::topic_counts`](crate::Store::topic_counts): the `limit` topics with the most rows.
    async fn topic_counts(&self, limit: u32) -> Result<Vec<TopicCounts>, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| super::db_error("topic_counts", table, e);
        let sql = Sql::new(
            d,
            format!(
                "SELECT topic, {}, {} FROM {table} GROUP BY topic, status",
                (d.int)("status"),
                (d.int)("COUNT(*)")
            ),
        );
        let rows = sql.query::<DB>().fetch_all(pool).await.map_err(err)?;
        let mut by_topic: std::collections::BTreeMap<String, TopicCounts> = Default::default();
        for row in &rows {
            let topic: String = row.try_get(0).map_err(err)?;
            let status: i64 = row.try_get(1).map_err(err)?;
            let n: i64 = row.try_get(2).map_err(err)?;
            let name = i16::try_from(status)
                .ok()
                .and_then(Status::from_i16)
                .map_or_else(|| format!("status {status}"), |s| s.name().to_owned());
            by_topic
                .entry(topic.clone())
                .or_insert_with(|| TopicCounts {
                    topic,
                    counts: Default::default(),
                })
                .counts
                .insert(name, u64::try_from(n).unwrap_or(0));
        }
        let mut all: Vec<TopicCounts> = by_topic.into_values().collect();
        all.sort_by_key(|t| std::cmp::Reverse(t.counts.values().sum::<u64>()));
        all.truncate(limit as usize);
        Ok(all)
    }
}
