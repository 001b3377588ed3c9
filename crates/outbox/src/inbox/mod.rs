//! The inbox: apply each message's effect once (docs/design/DESIGN.md §1.3), record the consumer's verdict,
//! and keep the consumer's dead letters.
//!
//! [`Inbox::process`] opens a transaction on the consumer's database, inserts
//! `(consumer, message_id)` into the inbox table under its primary key **first**, runs the
//! handler in the same transaction, and commits. A second copy of the message finds the key taken
//! and is reported as [`Processed::Duplicate`] without running the handler; on PostgreSQL a copy
//! that arrives while the first is still in flight waits on the key's lock and then sees it
//! (shared case C25). A handler error or a failed insert rolls everything back and is returned,
//! so the runner does not acknowledge the message (shared case C27).
//!
//! A handler that refuses the message for a business reason returns [`HandlerError::reject`]:
//! its writes are rolled back, the inbox records the verdict `Rejected` with the reason, and the
//! runner acknowledges the message and sends a `Rejected` confirmation. [`Inbox::verdict`] gives
//! the recorded verdict, so a redelivered copy is confirmed again the same way.
//!
//! A message that keeps failing goes to the consumer's dead-letter table `<inbox>_dlq`
//! ([`Inbox::dead_letter`]) with its error and delivery count; the inbox records it as rejected so
//! copies are not retried, and the runner moves on. An operator lists them
//! ([`Inbox::dead_letters`], `outbox inbox dead-letters`) and asks for a replay
//! ([`Inbox::request_replay`], `outbox inbox replay`), which the consumer's runner performs with
//! its handler ([`Inbox::replay_requested`]).
//!
//! Runners that feed an inbox from a broker: [`consumer::nats`](crate::consumer::nats) (JetStream
//! pull consumer) and [`consumer::webhook`](crate::consumer::webhook) (axum handler).

// A build without a database feature (a consumer-only build) has no inbox backend to use these.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(unused_imports, dead_code)
)]

use std::time::Duration;

use async_trait::async_trait;
use sqlx::Pool;
use uuid::Uuid;

use crate::error::{HandlerError, InboxError, StoreError};
use crate::ident::TableName;
use crate::message::{Headers, InboundMessage};
use crate::verdict::Verdict;

/// What [`Inbox::process`] did with a message. Every variant means "acknowledge it".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    /// First delivery: the handler ran and its effect committed with the inbox row.
    Applied,
    /// First delivery: the handler refused it ([`HandlerError::reject`]); nothing of it
    /// committed, the verdict is recorded.
    Rejected {
        /// The handler's reason.
        reason: String,
    },
    /// Already recorded: the handler did not run.
    Duplicate,
}

/// How [`Inbox::process_batch`] ended when the database did not fail.
#[derive(Debug)]
pub enum BatchOutcome {
    /// The transaction committed: one [`Processed::Applied`] or [`Processed::Duplicate`] per
    /// message, in input order.
    Committed(Vec<Processed>),
    /// The handler of message `at` (an index into the batch) returned an error (a rejection
    /// included) or panicked: the transaction was rolled back and nothing of the batch
    /// committed. Apply `batch[..at]` again as a batch, `batch[at]` alone with
    /// [`Inbox::process`] (which records a rejection), then the rest.
    HandlerFailed {
        /// Index of the failing message in the batch.
        at: usize,
        /// Its handler's error (a panic as a transient error naming the panic).
        error: HandlerError,
    },
}

/// The text of a caught panic's payload (`&str` or `String`), else "a panic".
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned())
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
    /// [`HandlerError`]: the transaction is rolled back. Transient and permanent errors are not
    /// acknowledged (the runner redelivers or dead-letters); a rejection is recorded and confirmed.
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError>;
}

/// A message in the consumer's dead-letter table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The message as received.
    pub message: InboundMessage,
    /// The last error.
    pub error: String,
    /// Deliveries before it was dead-lettered.
    pub deliveries: u32,
    /// Whether an operator asked for a replay that has not run yet.
    pub replay_requested: bool,
}

/// A replay performed by [`Inbox::replay_requested`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The message.
    pub message: InboundMessage,
    /// The verdict now, or the error that sent it back to the dead-letter table.
    pub result: Result<Verdict, String>,
}

pub(crate) fn headers_json(h: &Headers) -> String {
    serde_json::to_string(h).expect("headers serialize")
}

mod backend;
pub(crate) use backend::{DeadLetterRow, VerdictRow};
pub use backend::{InboxBackend, InboxSql};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// A consumer's inbox on database `DB` (see the module docs).
pub struct Inbox<DB: InboxBackend> {
    pool: Pool<DB>,
    table: TableName,
    sql: std::sync::Arc<InboxSql>,
    consumer: String,
}

impl<DB: InboxBackend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            consumer: self.consumer.clone(),
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

fn verdict_of(outcome: i64, reason: Option<String>) -> Verdict {
    if outcome == 0 {
        Verdict::Processed
    } else {
        Verdict::Rejected {
            reason: reason.unwrap_or_default(),
        }
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// An inbox in `table` (default name `outbox_inbox`; dead letters in `<table>_dlq`) for the
    /// consumer named `consumer` (one name per logical consumer; its instances share it so they
    /// deduplicate together).
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
        Ok(Inbox {
            pool,
            sql: std::sync::Arc::new(DB::sql(&table)),
            table,
            consumer,
        })
    }

    /// Create the inbox and dead-letter tables if missing (idempotent, versioned).
    ///
    /// # Errors
    /// The database error.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        DB::migrate(&self.pool, &self.table).await
    }

    /// The inbox table name (dead letters are in `<table>_dlq`).
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    fn err(&self, op: &'static str) -> impl Fn(sqlx::Error) -> StoreError + '_ {
        move |e| crate::store::db_error(op, self.table.as_str(), e)
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
        let t = &*self.sql;
        let mut tx = self.pool.begin().await.map_err(self.err("inbox begin"))?;
        let fresh = DB::insert(&mut tx, t, &self.consumer, msg, None)
            .await
            .map_err(self.err("inbox insert"))?;
        if !fresh {
            tx.rollback().await.map_err(self.err("inbox rollback"))?;
            return Ok(Processed::Duplicate);
        }
        match handler.handle(&mut tx, msg).await {
            Ok(()) => {
                tx.commit().await.map_err(self.err("inbox commit"))?;
                Ok(Processed::Applied)
            }
            Err(e) => {
                tx.rollback().await.map_err(self.err("inbox rollback"))?;
                let Some(reason) = e.rejection() else {
                    return Err(e.into());
                };
                let reason = reason.to_owned();
                let mut tx = self.pool.begin().await.map_err(self.err("inbox begin"))?;
                let fresh = DB::insert(&mut tx, t, &self.consumer, msg, Some(&reason))
                    .await
                    .map_err(self.err("inbox insert"))?;
                tx.commit().await.map_err(self.err("inbox commit"))?;
                Ok(if fresh {
                    Processed::Rejected { reason }
                } else {
                    Processed::Duplicate
                })
            }
        }
    }

    /// The inbox rows of `batch` (see [`InboxBackend::insert_many`]), inserted in message-id
    /// order whatever the batch's order: two batches that share messages (a redelivery, a
    /// duplicate) then take the rows' locks in the same order, so neither can hold one the
    /// other waits for while waiting for one the other holds (PostgreSQL's and InnoDB's
    /// deadlock). Returns, in the batch's order, whether each message is new.
    async fn insert_in_id_order(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        batch: &[&InboundMessage],
    ) -> Result<Vec<bool>, InboxError> {
        // A stable sort: of two copies of one id, the first in the batch stays the first.
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order.sort_by_key(|&i| batch[i].message_id);
        let sorted: Vec<&InboundMessage> = order.iter().map(|&i| batch[i]).collect();
        let fresh_sorted = DB::insert_many(tx, &self.sql, &self.consumer, &sorted)
            .await
            .map_err(self.err("inbox insert"))?;
        let mut fresh = vec![false; batch.len()];
        for (i, f) in order.into_iter().zip(fresh_sorted) {
            fresh[i] = f;
        }
        Ok(fresh)
    }

    /// Apply `batch` in **one** transaction, each message once: insert the batch's inbox rows
    /// (multi-row statements: one on PostgreSQL, one per 1,000 rows on SQLite, and on
    /// MySQL/MariaDB one per 1,000 rows after a savepoint, or one per message when some were
    /// recorded already), then, in order, run `handler` for each message whose row
    /// is new (in that message's `outbox.consume` span, feature `otel`); commit once at the
    /// end. One commit (one WAL
    /// flush) for the batch instead of one per message is what makes a batched consumer fast.
    ///
    /// The first handler that fails, rejects or panics stops the batch: everything is rolled
    /// back and [`BatchOutcome::HandlerFailed`] names it, so the caller applies the messages
    /// before it again as a batch and the failing one alone with [`Inbox::process`] (the
    /// runner's `runner.inbox_batch` does that: the handlers of the messages before a failing
    /// one run twice, the first run's effects rolled back). Per-key order is the batch's order.
    ///
    /// # Errors
    /// [`InboxError`] for a database error (begin, an inbox insert, the commit): nothing
    /// committed, or, for the commit, maybe everything; delivering each message again through
    /// [`Inbox::process`] is correct either way (the inbox recognises what committed).
    pub async fn process_batch<H: Handler<DB> + ?Sized>(
        &self,
        batch: &[&InboundMessage],
        handler: &H,
    ) -> Result<BatchOutcome, InboxError> {
        use futures::FutureExt;
        use tracing::Instrument;
        let at = std::sync::atomic::AtomicUsize::new(0);
        let run = async {
            let mut tx = self.pool.begin().await.map_err(self.err("inbox begin"))?;
            let fresh = self.insert_in_id_order(&mut tx, batch).await?;
            let mut processed = Vec::with_capacity(batch.len());
            let mut spans = Vec::new();
            for (i, (msg, fresh)) in batch.iter().zip(fresh).enumerate() {
                at.store(i, std::sync::atomic::Ordering::Relaxed);
                if !fresh {
                    processed.push(Processed::Duplicate);
                    continue;
                }
                let span = crate::otel::consume_span(msg, &self.consumer);
                if let Err(error) = handler.handle(&mut tx, msg).instrument(span.clone()).await {
                    tx.rollback().await.map_err(self.err("inbox rollback"))?;
                    return Ok(BatchOutcome::HandlerFailed { at: i, error });
                }
                if !span.is_disabled() {
                    spans.push(span);
                }
                processed.push(Processed::Applied);
            }
            tx.commit().await.map_err(self.err("inbox commit"))?;
            for span in spans {
                crate::otel::record_outcome(&span, "processed", false);
            }
            Ok(BatchOutcome::Committed(processed))
        };
        // A panicking handler is contained as in `consumer::deliver`: the transaction is
        // dropped (rolled back) as the future unwinds, and the panic names the message.
        match std::panic::AssertUnwindSafe(run).catch_unwind().await {
            Ok(r) => r,
            Err(panic) => Ok(BatchOutcome::HandlerFailed {
                at: at.load(std::sync::atomic::Ordering::Relaxed),
                error: HandlerError::transient(format!(
                    "the handler panicked: {}",
                    panic_text(panic.as_ref())
                )),
            }),
        }
    }

    /// The verdict recorded for `message_id`, if any: what to confirm for a duplicate.
    ///
    /// # Errors
    /// The database error.
    pub async fn verdict(&self, message_id: Uuid) -> Result<Option<Verdict>, StoreError> {
        let r = DB::verdict(&self.pool, &self.sql, &self.consumer, message_id)
            .await
            .map_err(self.err("inbox verdict"))?;
        Ok(r.map(|(o, reason)| verdict_of(o, reason)))
    }

    /// Move `msg` to the dead-letter table with `error` after `deliveries` deliveries, and record
    /// it as rejected in the inbox (one transaction). Returns the verdict to confirm.
    ///
    /// # Errors
    /// The database error; the message must then not be acknowledged.
    pub async fn dead_letter(
        &self,
        msg: &InboundMessage,
        error: &str,
        deliveries: u32,
    ) -> Result<Verdict, StoreError> {
        let t = &*self.sql;
        let reason = format!(
            "dead-lettered by {} after {deliveries} deliveries: {error}",
            self.consumer
        );
        let mut tx = self.pool.begin().await.map_err(self.err("dead letter"))?;
        DB::insert_dead_letter(&mut tx, t, &self.consumer, (msg, error, deliveries))
            .await
            .map_err(self.err("dead letter"))?;
        DB::insert(&mut tx, t, &self.consumer, msg, Some(&reason))
            .await
            .map_err(self.err("dead letter"))?;
        tx.commit().await.map_err(self.err("dead letter"))?;
        Ok(Verdict::Rejected { reason })
    }

    /// The consumer's dead letters, newest first.
    ///
    /// # Errors
    /// The database error, or [`StoreError::Corrupt`] for a row that does not decode.
    pub async fn dead_letters(&self, limit: u32) -> Result<Vec<DeadLetter>, StoreError> {
        self.load_dead_letters(false, limit).await
    }

    async fn load_dead_letters(
        &self,
        replay_only: bool,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = DB::dead_letters(&self.pool, &self.sql, &self.consumer, replay_only, limit)
            .await
            .map_err(self.err("dead letters"))?;
        rows.into_iter()
            .map(
                |(id, topic, partition_key, headers, payload, error, deliveries, replay)| {
                    let message_id = Uuid::parse_str(&id).map_err(|e| StoreError::Corrupt {
                        id: 0,
                        reason: format!("dead letter id {id:?}: {e}"),
                    })?;
                    let replay = replay != 0;
                    let headers = crate::store::parse_headers(0, &headers)?;
                    Ok(DeadLetter {
                        message: InboundMessage {
                            message_id,
                            topic,
                            partition_key,
                            headers,
                            payload,
                            delivery_count: u32::try_from(deliveries).unwrap_or(0),
                        },
                        error,
                        deliveries: u32::try_from(deliveries).unwrap_or(0),
                        replay_requested: replay,
                    })
                },
            )
            .collect()
    }

    /// Ask the consumer's runner to run dead letter `message_id` again. Returns whether it exists.
    ///
    /// # Errors
    /// The database error.
    pub async fn request_replay(&self, message_id: Uuid) -> Result<bool, StoreError> {
        let n = DB::set_replay(&self.pool, &self.sql, &self.consumer, message_id, true)
            .await
            .map_err(self.err("replay"))?;
        Ok(n > 0)
    }

    /// Run up to `limit` dead letters whose replay was requested through `handler`. For each, one
    /// transaction forgets the dead letter and its inbox record and processes the message afresh;
    /// if the handler fails again, that transaction rolls back and the dead letter stays (with
    /// its replay request cleared and the new error).
    ///
    /// # Errors
    /// A database error while loading the requests.
    pub async fn replay_requested<H: Handler<DB> + ?Sized>(
        &self,
        handler: &H,
        limit: u32,
    ) -> Result<Vec<Replayed>, StoreError> {
        let t = &*self.sql;
        let mut done = Vec::new();
        for dl in self.load_dead_letters(true, limit).await? {
            let msg = dl.message;
            let mut tx = self.pool.begin().await.map_err(self.err("replay"))?;
            DB::forget(&mut tx, t, &self.consumer, msg.message_id)
                .await
                .map_err(self.err("replay"))?;
            DB::insert(&mut tx, t, &self.consumer, &msg, None)
                .await
                .map_err(self.err("replay"))?;
            let result = match handler.handle(&mut tx, &msg).await {
                Ok(()) => {
                    tx.commit().await.map_err(self.err("replay"))?;
                    Ok(Verdict::Processed)
                }
                Err(e) => {
                    tx.rollback().await.map_err(self.err("replay"))?;
                    if let Some(reason) = e.rejection() {
                        let mut tx = self.pool.begin().await.map_err(self.err("replay"))?;
                        DB::forget(&mut tx, t, &self.consumer, msg.message_id)
                            .await
                            .map_err(self.err("replay"))?;
                        DB::insert(&mut tx, t, &self.consumer, &msg, Some(reason))
                            .await
                            .map_err(self.err("replay"))?;
                        tx.commit().await.map_err(self.err("replay"))?;
                        Ok(Verdict::Rejected {
                            reason: reason.to_owned(),
                        })
                    } else {
                        let mut conn = self.pool.acquire().await.map_err(self.err("replay"))?;
                        let error = e.to_string();
                        DB::insert_dead_letter(
                            &mut conn,
                            t,
                            &self.consumer,
                            (&msg, &error, dl.deliveries + 1),
                        )
                        .await
                        .map_err(self.err("replay"))?;
                        Err(error)
                    }
                }
            };
            done.push(Replayed {
                message: msg,
                result,
            });
        }
        Ok(done)
    }

    /// Delete up to `limit` inbox records received more than `older_than` ago (the dedup
    /// window); call again while it returns `limit`. Dead letters are kept.
    ///
    /// # Errors
    /// The database error.
    pub async fn purge(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        DB::purge(
            &self.pool,
            &self.sql,
            crate::store::millis(older_than),
            limit,
        )
        .await
        .map_err(self.err("inbox purge"))
    }
}
