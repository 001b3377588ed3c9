//! The inbox: apply each message's effect once (DESIGN.md §1.3).
//!
//! [`Inbox::process`] opens a transaction on the consumer's database, inserts
//! `(consumer, message_id)` into the inbox table under its primary key **first**, runs the
//! handler in the same transaction, and commits. A second copy of the message finds the key taken
//! and is reported as [`Processed::Duplicate`] without running the handler; on PostgreSQL a copy
//! that arrives while the first is still in flight waits on the key's lock and then sees it
//! (shared case C25). A handler error or a failed insert rolls everything back and is returned,
//! so the runner does not acknowledge the message (shared case C27).
//!
//! Runners that feed an inbox from a broker: [`consumer::nats`](crate::consumer::nats) (JetStream
//! pull consumer) and [`consumer::webhook`](crate::consumer::webhook) (axum handler).

use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use sqlx::{AssertSqlSafe, Pool};

use crate::error::{HandlerError, InboxError, StoreError};
use crate::ident::TableName;
use crate::message::InboundMessage;

/// What [`Inbox::process`] did with a message. Both variants mean "acknowledge it".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processed {
    /// First delivery: the handler ran and its effect committed with the inbox row.
    Applied,
    /// Already recorded: the handler did not run.
    Duplicate,
}

/// A consumer's message handler, run inside the inbox transaction on `conn`.
///
/// Write the business effect through `conn` (a `&mut PgConnection` or `&mut SqliteConnection`)
/// so it commits, or rolls back, together with the inbox row.
#[async_trait]
pub trait Handler<DB: sqlx::Database>: Send + Sync + 'static {
    /// Apply `msg`.
    ///
    /// # Errors
    /// [`HandlerError`]: the transaction is rolled back and the message is not acknowledged.
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError>;
}

/// The SQL a database needs for the inbox. Implemented for `sqlx::Postgres` and `sqlx::Sqlite`.
pub trait InboxBackend: sqlx::Database {
    /// `INSERT … ON CONFLICT DO NOTHING` for `table`.
    fn insert_sql(table: &str) -> String;
    /// Run the insert; `true` when the row was new.
    fn insert<'c>(
        conn: &'c mut Self::Connection,
        sql: Arc<str>,
        consumer: &'c str,
        msg: &'c InboundMessage,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;
    /// Create the inbox table if it does not exist.
    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

#[cfg(feature = "postgres")]
impl InboxBackend for sqlx::Postgres {
    fn insert_sql(table: &str) -> String {
        format!(
            "INSERT INTO {table} (consumer, message_id, topic) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
        )
    }

    fn insert<'c>(
        conn: &'c mut sqlx::PgConnection,
        sql: Arc<str>,
        consumer: &'c str,
        msg: &'c InboundMessage,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(msg.message_id)
                .bind(&msg.topic)
                .execute(conn)
                .await?;
            Ok(r.rows_affected() == 1)
        })
    }

    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(crate::store::postgres::run_migrations(
            pool,
            crate::store::postgres::inbox_migrations(table),
        ))
    }
}

#[cfg(feature = "sqlite")]
impl InboxBackend for sqlx::Sqlite {
    fn insert_sql(table: &str) -> String {
        format!(
            "INSERT INTO {table} (consumer, message_id, topic) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING"
        )
    }

    fn insert<'c>(
        conn: &'c mut sqlx::SqliteConnection,
        sql: Arc<str>,
        consumer: &'c str,
        msg: &'c InboundMessage,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(msg.message_id.to_string())
                .bind(&msg.topic)
                .execute(conn)
                .await?;
            Ok(r.rows_affected() == 1)
        })
    }

    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(crate::store::sqlite::run_migrations(
            pool,
            crate::store::sqlite::inbox_migrations(table.as_str()),
        ))
    }
}

/// A consumer's inbox on database `DB` (see the module docs).
pub struct Inbox<DB: InboxBackend> {
    pool: Pool<DB>,
    table: TableName,
    consumer: String,
    insert: Arc<str>,
}

impl<DB: InboxBackend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            consumer: self.consumer.clone(),
            insert: self.insert.clone(),
        }
    }
}

impl<DB: InboxBackend> std::fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.table)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// An inbox in `table` (default name `outbox_inbox`) for the consumer named `consumer` (one
    /// name per logical consumer; its instances share it so they deduplicate together).
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for a bad table name; [`StoreError::Config`] for an
    /// empty consumer name.
    pub fn new(
        pool: Pool<DB>,
        table: &str,
        consumer: impl Into<String>,
    ) -> Result<Self, StoreError> {
        let table = TableName::new(table)?;
        let consumer = consumer.into();
        if consumer.is_empty() {
            return Err(StoreError::Config("consumer name must not be empty".into()));
        }
        let insert = DB::insert_sql(table.as_str()).into();
        Ok(Inbox {
            pool,
            table,
            consumer,
            insert,
        })
    }

    /// Create the inbox table if missing (idempotent).
    ///
    /// # Errors
    /// The database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        DB::migrate(&self.pool, &self.table).await
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Apply `msg` once (see the module docs).
    ///
    /// # Errors
    /// [`InboxError`]; the transaction was rolled back; do not acknowledge the message.
    pub async fn process<H: Handler<DB> + ?Sized>(
        &self,
        msg: &InboundMessage,
        handler: &H,
    ) -> Result<Processed, InboxError> {
        let e = |op| {
            let table = self.table.as_str().to_owned();
            move |err| InboxError::Store(StoreError::db(op, &table, err))
        };
        let mut tx = self.pool.begin().await.map_err(e("inbox begin"))?;
        let fresh = DB::insert(&mut tx, self.insert.clone(), &self.consumer, msg)
            .await
            .map_err(e("inbox insert"))?;
        if !fresh {
            tx.rollback().await.map_err(e("inbox rollback"))?;
            return Ok(Processed::Duplicate);
        }
        handler.handle(&mut tx, msg).await?;
        tx.commit().await.map_err(e("inbox commit"))?;
        Ok(Processed::Applied)
    }
}
