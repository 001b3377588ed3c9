//! The inbox's seam to the databases. [`InboxBackend`] runs one statement per method; every
//! dialect implements it with [`inbox_backend!`](crate::inbox_backend) from its own
//! [`InboxSql`], so a dialect file holds its SQL and nothing else (sqlx's drivers likewise keep
//! each database's text apart from the shared execution).

use std::sync::Arc;

use futures::future::BoxFuture;
use sqlx::Pool;
use uuid::Uuid;

use crate::error::StoreError;
use crate::ident::TableName;
use crate::message::InboundMessage;

/// A dead letter as read: `message_id` (text), `topic`, `partition_key`, `headers` (JSON text),
/// `payload`, `error`, `deliveries`, replay requested (0 or 1); integers 64-bit.
pub(crate) type DeadLetterRow = (
    String,
    String,
    Option<String>,
    String,
    Vec<u8>,
    String,
    i64,
    i64,
);

/// A recorded verdict: outcome (0 processed, 1 rejected) and reason.
pub(crate) type VerdictRow = (i64, Option<String>);

/// The inbox's statements on one database for one inbox table (`<t>`, dead letters in
/// `<t>_dlq`), built once per [`Inbox`](crate::Inbox). Parameters are bound in the order given;
/// integers are 64-bit, message ids as the dialect stores them.
#[derive(Debug)]
pub struct InboxSql {
    /// Insert `consumer, message_id, topic, outcome (0 processed, 1 rejected), reason` unless
    /// the key `(consumer, message_id)` is present: one row affected when new, none when not.
    pub(crate) insert: Arc<str>,
    /// Insert the rows of many messages at once. PostgreSQL: the whole statement (`consumer`,
    /// then arrays of message ids and topics; returns the ids inserted). MySQL/MariaDB and
    /// SQLite: the statement up to its `VALUES` list, which [`values_rows`] completes (one
    /// `(consumer, message_id, topic)` row per message).
    pub(crate) insert_many: Arc<str>,
    /// `outcome, reason` of `consumer, message_id`.
    pub(crate) verdict: Arc<str>,
    /// Upsert the dead letter `consumer, message_id, topic, partition_key, headers (JSON text),
    /// payload, error, deliveries`, clearing any replay request.
    pub(crate) insert_dead_letter: Arc<str>,
    /// The dead letters of `consumer`, newest first, at most `limit`; only those with a replay
    /// requested when `replay_only`: parameters `consumer, replay_only, limit`, columns as
    /// [`DeadLetterRow`].
    pub(crate) dead_letters: Arc<str>,
    /// Request a replay of `consumer, message_id`.
    pub(crate) request_replay: Arc<str>,
    /// Clear the replay request of `consumer, message_id`.
    pub(crate) clear_replay: Arc<str>,
    /// Delete the dead letter, then the inbox row, of `consumer, message_id` (two statements).
    pub(crate) forget: [Arc<str>; 2],
    /// Delete up to `limit` inbox rows received more than `older_than_ms` ago: parameters
    /// `older_than_ms, limit`.
    pub(crate) purge: Arc<str>,
}

/// Rows per multi-row inbox insert on MySQL/MariaDB and SQLite: 3 parameters each, well under
/// both databases' limits on bound parameters (65,535 and 32,766).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const INSERT_ROWS: usize = 1_000;

/// `n` rows `(?, ?, ?, 0, NULL)` of a multi-row inbox insert (consumer, message id, topic; outcome
/// processed, no reason).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn values_rows(n: usize) -> String {
    vec!["(?, ?, ?, 0, NULL)"; n].join(", ")
}

/// The SQL a database needs for the inbox. Implemented for `sqlx::Postgres`, `sqlx::Sqlite` and
/// `sqlx::MySql`; each method but [`InboxBackend::sql`] and [`InboxBackend::migrate`] is one
/// statement of [`InboxSql`] on `conn` or `pool`.
pub trait InboxBackend: sqlx::Database {
    /// The statements for inbox table `table`.
    fn sql(table: &TableName) -> InboxSql;
    /// Insert `(consumer, message_id, topic, outcome, reason)` unless present; `true` when new.
    /// `outcome` 0 = processed, 1 = rejected.
    fn insert<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c InboxSql,
        consumer: &'c str,
        msg: &'c InboundMessage,
        rejected: Option<&'c str>,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;
    /// Insert the rows of `msgs` (outcome processed) unless present, in order: one `bool` per
    /// message, `true` when new (for two copies of one id in `msgs`, the first). Multi-row
    /// statements: PostgreSQL `unnest … RETURNING`, SQLite `VALUES … RETURNING`, MySQL/MariaDB
    /// `INSERT IGNORE … VALUES` after a savepoint.
    fn insert_many<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c InboxSql,
        consumer: &'c str,
        msgs: &'c [&'c InboundMessage],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>>;
    /// The recorded `(outcome, reason)`.
    fn verdict<'c>(
        pool: &'c Pool<Self>,
        sql: &'c InboxSql,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, Result<Option<VerdictRow>, sqlx::Error>>;
    /// Upsert a dead letter (and clear any replay request) after `deliveries` deliveries.
    fn insert_dead_letter<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c InboxSql,
        consumer: &'c str,
        dead: (&'c InboundMessage, &'c str, u32),
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;
    /// Dead letters of `consumer`, newest first; only those with a replay requested when
    /// `replay_only`.
    fn dead_letters<'c>(
        pool: &'c Pool<Self>,
        sql: &'c InboxSql,
        consumer: &'c str,
        replay_only: bool,
        limit: u32,
    ) -> BoxFuture<'c, Result<Vec<DeadLetterRow>, sqlx::Error>>;
    /// Set or clear the replay request; rows matched.
    fn set_replay<'c>(
        pool: &'c Pool<Self>,
        sql: &'c InboxSql,
        consumer: &'c str,
        id: Uuid,
        requested: bool,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;
    /// Delete the inbox row and the dead letter of `id` (the start of a replay).
    fn forget<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c InboxSql,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;
    /// Delete up to `limit` inbox rows received more than `older_than_ms` ago; rows deleted.
    fn purge<'c>(
        pool: &'c Pool<Self>,
        sql: &'c InboxSql,
        older_than_ms: i64,
        limit: u32,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;
    /// Create the inbox tables if missing.
    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// Implement [`InboxBackend`] for database `$db` (connection type `$conn`) in a dialect's inbox
/// module, from the module's `fn sql(&TableName) -> InboxSql` and `fn message_id(Uuid) -> T`
/// (how the dialect binds a message id), migrating with `store::$dialect::migrations`.
///
/// `insert_many = f` implements [`InboxBackend::insert_many`] with the module's `f` (same
/// signature): the multi-row insert is the one statement each dialect writes differently.
macro_rules! inbox_backend {
    ($db:ty, $conn:ty, $dialect:ident, insert_many = $many:path) => {
        impl $crate::inbox::InboxBackend for $db {
            fn sql(table: &$crate::ident::TableName) -> $crate::inbox::InboxSql {
                sql(table)
            }

            fn insert_many<'c>(
                conn: &'c mut $conn,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                msgs: &'c [&'c $crate::InboundMessage],
            ) -> ::futures::future::BoxFuture<'c, Result<Vec<bool>, ::sqlx::Error>> {
                Box::pin($many(conn, sql, consumer, msgs))
            }

            fn insert<'c>(
                conn: &'c mut $conn,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                msg: &'c $crate::InboundMessage,
                rejected: Option<&'c str>,
            ) -> ::futures::future::BoxFuture<'c, Result<bool, ::sqlx::Error>> {
                Box::pin(async move {
                    let done = ::sqlx::query(::sqlx::AssertSqlSafe(sql.insert.clone()))
                        .bind(consumer)
                        .bind(message_id(msg.message_id))
                        .bind(&msg.topic)
                        .bind(i64::from(rejected.is_some()))
                        .bind(rejected)
                        .execute(conn)
                        .await?;
                    Ok(done.rows_affected() == 1)
                })
            }

            fn verdict<'c>(
                pool: &'c ::sqlx::Pool<Self>,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                id: ::uuid::Uuid,
            ) -> ::futures::future::BoxFuture<
                'c,
                Result<Option<$crate::inbox::VerdictRow>, ::sqlx::Error>,
            > {
                Box::pin(
                    ::sqlx::query_as(::sqlx::AssertSqlSafe(sql.verdict.clone()))
                        .bind(consumer)
                        .bind(message_id(id))
                        .fetch_optional(pool),
                )
            }

            fn insert_dead_letter<'c>(
                conn: &'c mut $conn,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                (msg, error, deliveries): (&'c $crate::InboundMessage, &'c str, u32),
            ) -> ::futures::future::BoxFuture<'c, Result<(), ::sqlx::Error>> {
                Box::pin(async move {
                    ::sqlx::query(::sqlx::AssertSqlSafe(sql.insert_dead_letter.clone()))
                        .bind(consumer)
                        .bind(message_id(msg.message_id))
                        .bind(&msg.topic)
                        .bind(&msg.partition_key)
                        .bind($crate::inbox::headers_json(&msg.headers))
                        .bind(&msg.payload)
                        .bind(error)
                        .bind(i64::from(deliveries.min(i32::MAX as u32)))
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            }

            fn dead_letters<'c>(
                pool: &'c ::sqlx::Pool<Self>,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                replay_only: bool,
                limit: u32,
            ) -> ::futures::future::BoxFuture<
                'c,
                Result<Vec<$crate::inbox::DeadLetterRow>, ::sqlx::Error>,
            > {
                Box::pin(
                    ::sqlx::query_as(::sqlx::AssertSqlSafe(sql.dead_letters.clone()))
                        .bind(consumer)
                        .bind(replay_only)
                        .bind(i64::from(limit))
                        .fetch_all(pool),
                )
            }

            fn set_replay<'c>(
                pool: &'c ::sqlx::Pool<Self>,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                id: ::uuid::Uuid,
                requested: bool,
            ) -> ::futures::future::BoxFuture<'c, Result<u64, ::sqlx::Error>> {
                let statement = if requested {
                    sql.request_replay.clone()
                } else {
                    sql.clear_replay.clone()
                };
                Box::pin(async move {
                    let done = ::sqlx::query(::sqlx::AssertSqlSafe(statement))
                        .bind(consumer)
                        .bind(message_id(id))
                        .execute(pool)
                        .await?;
                    Ok(done.rows_affected())
                })
            }

            fn forget<'c>(
                conn: &'c mut $conn,
                sql: &'c $crate::inbox::InboxSql,
                consumer: &'c str,
                id: ::uuid::Uuid,
            ) -> ::futures::future::BoxFuture<'c, Result<(), ::sqlx::Error>> {
                Box::pin(async move {
                    for statement in &sql.forget {
                        ::sqlx::query(::sqlx::AssertSqlSafe(statement.clone()))
                            .bind(consumer)
                            .bind(message_id(id))
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            }

            fn purge<'c>(
                pool: &'c ::sqlx::Pool<Self>,
                sql: &'c $crate::inbox::InboxSql,
                older_than_ms: i64,
                limit: u32,
            ) -> ::futures::future::BoxFuture<'c, Result<u64, ::sqlx::Error>> {
                Box::pin(async move {
                    let done = ::sqlx::query(::sqlx::AssertSqlSafe(sql.purge.clone()))
                        .bind(older_than_ms)
                        .bind(i64::from(limit))
                        .execute(pool)
                        .await?;
                    Ok(done.rows_affected())
                })
            }

            fn migrate<'a>(
                pool: &'a ::sqlx::Pool<Self>,
                table: &'a $crate::ident::TableName,
            ) -> ::futures::future::BoxFuture<'a, Result<(), $crate::StoreError>> {
                use $crate::store::$dialect::migrations::{inbox_migrations, run_migrations};
                Box::pin(run_migrations(pool, inbox_migrations(table)))
            }
        }
    };
}
pub(crate) use inbox_backend;
