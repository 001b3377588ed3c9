//! The store seam: every database operation the relay needs, as whole operations
//! (docs/design/STYLE.md, after River's driver interface). Each dialect keeps its own SQL and migrations:
//! [`PgStore`](crate::PgStore) for PostgreSQL, [`SqliteStore`](crate::SqliteStore) for SQLite and
//! [`MySqlStore`](crate::MySqlStore) for MySQL 8.0.1+ / MariaDB 10.6+.
//!
//! Enqueue is not on this trait: it takes the caller's own connection or transaction, whose type
//! is per dialect (`PgStore::enqueue(&mut PgConnection, ..)`, `SqliteStore::enqueue(&mut
//! SqliteConnection, ..)`).
//!
//! # One protocol: bucket leases
//! The relay owns buckets, not rows (see `docs/architecture.md`, "Bucket leases"): a
//! [`Store::membership`] round heartbeats, renews and acquires bucket leases, each with a fresh
//! random 63-bit token; [`Store::read_buckets`] reads the due rows of owned buckets without
//! writing; [`Store::complete_in_buckets`] writes each row's outcome once, fenced by its bucket's
//! owner, token and unexpired lease, so a relay whose lease was taken over writes nothing (shared
//! case C17). A row is never "in flight" in the table: a relay that dies leaves its rows PENDING,
//! and the relay that takes its buckets over reads them again.
//!
//! Status 1 (SENDING) belonged to the row-claim protocol of earlier versions;
//! [`Store::migrate`] releases any SENDING row an older relay left behind (logged with its count).

// The helpers below serve the dialects; a build without a database feature compiles none.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::error::{DbErrorClass, StoreError};
use crate::message::Status;

/// The message status numbers as the dialects' SQL writes them (`status = {PENDING}` in a
/// `format!`), taken from [`Status`], the one definition of the numbers. Every message-status
/// number in the dialects' statements and migrations is one of these; other small numbers in the
/// SQL (bucket numbers, flags, counts, `LIMIT`s) are not statuses.
pub(crate) mod status_sql {
    use crate::message::Status;

    /// [`Status::Pending`].
    pub(crate) const PENDING: i16 = Status::Pending as i16;
    /// [`Status::Sending`] (retired; only `migrate` still reads it).
    pub(crate) const SENDING: i16 = Status::Sending as i16;
    /// [`Status::Sent`].
    pub(crate) const SENT: i16 = Status::Sent as i16;
    /// [`Status::Confirmed`].
    pub(crate) const CONFIRMED: i16 = Status::Confirmed as i16;
    /// [`Status::Failed`].
    pub(crate) const FAILED: i16 = Status::Failed as i16;
    /// [`Status::Rejected`].
    pub(crate) const REJECTED: i16 = Status::Rejected as i16;
    /// [`Status::Prepared`].
    pub(crate) const PREPARED: i16 = Status::Prepared as i16;
    /// [`Status::RolledBack`].
    pub(crate) const ROLLED_BACK: i16 = Status::RolledBack as i16;
    /// [`Status::Undecided`].
    pub(crate) const UNDECIDED: i16 = Status::Undecided as i16;
    /// The highest status number: the upper bound of the status column's `CHECK` (schema v8).
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) const LAST: i16 = UNDECIDED;
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) mod admin;
mod confirming;
mod connect;
mod leases;
mod rows;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod shared;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod upgrade;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use upgrade::*;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod nodelay;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use connect::server_pool;
pub use connect::{Dialect, connect, connect_existing};
pub use leases::{
    BUCKETS, Bucket, BucketBatch, BucketCompletion, BucketLease, BucketRow, FencedRow, HandOff,
    KeyHead, MembershipRequest, MembershipRound, RelayInfo, normalise_routes, routes_hash,
};
pub(crate) use leases::{BucketColumns, membership_round, relay_info, routes_json};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) use leases::{ReadRound, read_in_rounds};

/// The class of a driver error, by the dialect that raised it (`store::<dialect>::errors`):
/// shared driver errors first ([`DbErrorClass::of_driver`]), then the database error's own type
/// (PostgreSQL, MySQL/MariaDB or SQLite, as compiled in). An error of no compiled dialect is
/// [`DbErrorClass::Other`].
pub fn classify(e: &sqlx::Error) -> DbErrorClass {
    let sqlx::Error::Database(db) = e else {
        return DbErrorClass::of_driver(e).unwrap_or(DbErrorClass::Other);
    };
    #[cfg(feature = "postgres")]
    if db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .is_some()
    {
        return postgres::errors::classify(e);
    }
    #[cfg(feature = "mysql")]
    if db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return mysql::errors::classify(e);
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return sqlite::errors::classify(e);
    }
    let _ = db;
    DbErrorClass::Other
}

/// Wrap a driver error raised during `op` on `table`, classified by its dialect ([`classify`],
/// [`StoreError::classified`]).
pub fn db_error(op: &'static str, table: &str, source: sqlx::Error) -> StoreError {
    let class = classify(&source);
    StoreError::classified(op, table, source, class)
}

/// A [`StoreError::Database`] for a driver error raised outside a table's operations
/// (connecting, migrating), transient as its dialect classifies it ([`classify`]).
pub(crate) fn database_error(op: &'static str, source: sqlx::Error) -> StoreError {
    StoreError::Database {
        op,
        transient: classify(&source) == DbErrorClass::Transient,
        source,
    }
}

/// The first quoted name in a server message (`relation "s.t" does not exist`, `Table 'db.t'
/// doesn't exist`), for the table a missing-table error names.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn quoted_name(message: &str) -> Option<String> {
    let quote = message.find(['"', '\''])?;
    let q = message[quote..].chars().next()?;
    let rest = &message[quote + 1..];
    let end = rest.find(q)?;
    Some(rest[..end].to_owned()).filter(|s| !s.is_empty())
}

/// A fencing token: random, drawn per bucket lease, stored on the bucket row and carried by every
/// completion of a row of that bucket.
pub type LeaseToken = i64;

/// What happened to one read message; written by [`Store::complete_in_buckets`].
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The broker acknowledged it: PENDING → SENT, `sent_at = now()`.
    Sent,
    /// The broker acknowledged it and the route requires the consumer's confirmation:
    /// PENDING → SENT with `confirm_deadline = now() + within`; past the deadline the message is
    /// checked back ([`Store::check_back`]).
    SentAwaitingConfirmation {
        /// How long the consumer has to confirm.
        within: Duration,
    },
    /// Publish failed and attempts remain: PENDING again, `available_at = now() + delay`,
    /// `last_error = error`.
    Retry {
        /// Backoff before the next read.
        delay: Duration,
        /// Why it failed.
        error: String,
    },
    /// Permanent error or attempts exhausted: PENDING → FAILED with the reason.
    Failed {
        /// Why it is dead-lettered.
        reason: String,
    },
    /// Not attempted (broker unavailable, shutdown): stays PENDING, attempts as stored before
    /// (the relay passes them in [`BucketCompletion::attempts`]), `available_at = now() + delay`.
    Release {
        /// Delay before the next read (zero on shutdown).
        delay: Duration,
    },
}

/// Counts and ages for `outbox status`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Rows per status (every status present, zero when empty).
    pub counts: BTreeMap<Status, u64>,
    /// Age of the oldest PENDING row that is due (`available_at <= now()`), by the database clock.
    pub oldest_pending_age: Option<Duration>,
    /// SENT rows waiting for the consumer's confirmation.
    pub awaiting_confirmation: u64,
    /// Age since SENT of the oldest message still waiting for its confirmation.
    pub oldest_unconfirmed_age: Option<Duration>,
}

/// A dead-lettered message, for `outbox status`.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedMessage {
    /// Row id.
    pub id: i64,
    /// Message id as stored (text, so a malformed id written by a foreign producer still shows).
    pub message_id: String,
    /// Topic.
    pub topic: String,
    /// Attempts made.
    pub attempts: u32,
    /// The reason recorded.
    pub last_error: Option<String>,
}

/// The database operations of the relay. Implemented by [`PgStore`](crate::PgStore) and
/// [`SqliteStore`](crate::SqliteStore); the conformance suite in `outbox-testkit` runs against
/// each on the real database.
///
/// All times are the database clock's (docs/design/DESIGN.md §1.5).
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name of the backend for logs (`"postgres"`, `"sqlite"`).
    fn backend(&self) -> &'static str;

    /// The outbox table name.
    fn table(&self) -> &str;

    /// Create or upgrade the outbox and inbox tables, idempotently.
    ///
    /// # Errors
    /// The database error of the failing migration step; earlier steps stay applied.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Check that the outbox table is at the schema version this build's migrations end at
    /// (its highest version recorded in `outbox_migrations`). The relay calls it at start-up.
    ///
    /// # Errors
    /// [`StoreError::SchemaVersion`] naming both versions when the table is older ("run
    /// `outbox migrate`") or newer ("upgrade outbox") than this build; [`StoreError::MissingTable`]
    /// when the table does not exist; a database error when the check cannot run. The default
    /// (stores without migrations) accepts every table.
    async fn check_schema(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Heartbeat, renew and acquire bucket leases, in one transaction (see the relay's module
    /// docs). Upserts `req.relay`'s heartbeat, counts the live relays, renews every held bucket
    /// whose owner and token still match and whose lease has not expired yet (`expires_at =
    /// now() + lease`; an expired lease is lost even if nobody took it: the relay acquires it
    /// again as a takeover), and, when `acquire` and
    /// fewer than the fair share are held, takes free buckets and buckets whose lease expired
    /// (`owner = relay`, a fresh token, `takeovers + 1` for an expired one) with `SKIP LOCKED`.
    async fn membership(&self, req: &MembershipRequest) -> Result<MembershipRound, StoreError>;

    /// The relays whose heartbeat is younger than `lease` (this one included), with the route
    /// sets they advertised, by name. One statement.
    async fn relays(&self, lease: Duration) -> Result<Vec<RelayInfo>, StoreError>;

    /// Hand `h.buckets` over to the relay `h.to`, where owner (`h.relay`) and token still
    /// match: the bucket is free (`owner = NULL`) but reserved for `to` for one `h.lease`
    /// (`handoff = to`, `expires_at = now() + lease`): no other relay acquires it meanwhile,
    /// and `to` acquires it at its next membership round even above its fair share. Used by a
    /// relay that holds messages only `to` can route; after the reservation expired anyone may
    /// take it. No buckets: the statement matches no row (the relay calls it only with some).
    async fn hand_off_buckets(&self, h: &HandOff<'_>) -> Result<(), StoreError>;

    /// The status of each of `ids` that exists, in id order (ids without a row are left out).
    /// For operator commands (`outbox requeue` names the ids it could not requeue).
    async fn statuses(&self, ids: &[i64]) -> Result<Vec<(i64, Status)>, StoreError>;

    /// Give buckets back (`owner = NULL`, lease expired at once) where owner and token still
    /// match; with `leave`, also delete the relay's membership row. Used when a relay holds more
    /// than its fair share, and on shutdown.
    async fn release_buckets(
        &self,
        relay: &str,
        buckets: &[(Bucket, LeaseToken)],
        leave: bool,
    ) -> Result<(), StoreError>;

    /// Read up to `limit` due PENDING rows (`available_at <= now()`) of `buckets`, in id order
    /// within each bucket, skipping rows whose partition key is in `skip_keys` (keys held back by
    /// per-key order). Writes nothing: the caller owns the buckets, so no other relay reads them.
    async fn read_buckets(
        &self,
        buckets: &[Bucket],
        skip_keys: &[String],
        limit: u32,
    ) -> Result<BucketBatch, StoreError>;

    /// For each of `keys`: the smallest id still to publish and the smallest dead-lettered id
    /// (one indexed statement). Keys with neither are omitted.
    async fn key_heads(&self, keys: &[String]) -> Result<Vec<KeyHead>, StoreError>;

    /// Record outcomes in ONE statement, each row fenced by its bucket lease: the row must be
    /// PENDING and its bucket owned by `relay` with the completion's token and an unexpired
    /// lease. Returns the rows matched; a row of a bucket taken over is left alone (counted as a
    /// lost lease by the relay). As in [`Store::complete`], a row the consumer already confirmed
    /// or rejected keeps its verdict.
    async fn complete_in_buckets(
        &self,
        relay: &str,
        completions: &[BucketCompletion],
    ) -> Result<u64, StoreError>;

    /// Whether the relay's batch lanes should read disjoint shares of the free buckets while a
    /// backlog lasts (`RelayConfig::in_flight_batches` > 1), so that one batch's read overlaps
    /// another's completion. Default `false`: on PostgreSQL the relay is CPU-bound and the split
    /// measured 5-10 % slower. SQLite (one writer; a completion waits on its WAL sync) and
    /// MySQL/MariaDB answer `true`: their drains ran 1.6x faster with it (docs/benchmarks.md,
    /// "Lanes").
    fn lanes_share_buckets(&self) -> bool {
        false
    }

    /// Like [`Store::next_due_in`], restricted to `buckets`.
    async fn next_due_in_buckets(&self, buckets: &[Bucket])
    -> Result<Option<Duration>, StoreError>;

    /// Time until the earliest PENDING row becomes due: `Some(ZERO)` when one is due now, `None`
    /// when there is no PENDING row.
    async fn next_due_in(&self) -> Result<Option<Duration>, StoreError>;

    /// Counts per state and ages.
    async fn stats(&self) -> Result<Stats, StoreError>;

    /// Apply consumer confirmations (see [`crate::confirm`]): `Processed` → CONFIRMED in one
    /// statement; each `Rejected` → REJECTED with the reason in its own transaction that also runs
    /// the store's rejection hook. Only rows in PENDING, SENDING, SENT or FAILED move, so a
    /// duplicate or late confirmation changes nothing and a hook never runs twice.
    async fn apply_confirmations(
        &self,
        batch: &[crate::verdict::Confirmation],
    ) -> Result<crate::verdict::ConfirmReport, StoreError>;

    /// Check back up to `limit` SENT rows whose confirmation deadline passed: back to PENDING (due
    /// now, `check_backs + 1`, `attempts = 0`: each check-back starts a new round of at most
    /// `max_attempts` publish attempts) so they are published again and the consumer's inbox
    /// answers the copy, or FAILED with reason `unconfirmed` once `check_backs` reached
    /// `max_check_backs` (attempts kept).
    /// One conditional statement, safe to run on every relay. Returns the rows moved.
    async fn check_back(&self, limit: u32, max_check_backs: u32) -> Result<u64, StoreError>;

    /// Operator requeue of dead letters: FAILED → PENDING, due now, `attempts` and
    /// `check_backs` reset to 0, `redelivery + 1` (so a broker that deduplicates by id accepts the
    /// new copy), `last_error` kept for the record. `ids = None` requeues every FAILED row. Rows in any other
    /// state are left alone. Returns the rows moved.
    async fn requeue_failed(&self, ids: Option<&[i64]>) -> Result<u64, StoreError>;

    /// The most recently failed messages, newest first.
    async fn failed(&self, limit: u32) -> Result<Vec<FailedMessage>, StoreError>;

    /// The pool and outbox table the admin operations below run on.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    fn admin_target(&self) -> admin::AdminTarget;

    /// One page of the messages `filter` matches, newest first (keyset pagination by id, or by
    /// a window's time where the search indexes exist: [`crate::admin::SearchOrder`]).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn search(
        &self,
        filter: &crate::admin_model::MessageFilter,
        page: &crate::admin_model::PageRequest,
    ) -> Result<crate::admin_model::MessagePage, StoreError> {
        admin::search_on(self.admin_target(), filter, page).await
    }

    /// Which of the optional search indexes the outbox table has
    /// ([`crate::admin::SearchIndexes`]).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn search_indexes(&self) -> Result<crate::admin_model::SearchIndexes, StoreError> {
        admin::search_indexes_on(self.admin_target()).await
    }

    /// Build the optional search indexes the outbox table lacks
    /// ([`crate::admin::SearchIndexes`]; `outbox migrate --search-indexes`, the daemon's
    /// `[database] search_indexes = true`): on PostgreSQL `CREATE INDEX CONCURRENTLY` (writers
    /// and the relay go on; an unusable index a failed build left is dropped and built again),
    /// on MySQL/MariaDB an online InnoDB build, on SQLite a plain `CREATE INDEX` (the single
    /// writer waits for it). Takes about a minute per index on 10,000,000 rows. Returns the
    /// indexes present afterwards.
    ///
    /// # Errors
    /// [`StoreError`] from the database (a build that failed leaves the others in place).
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn create_search_indexes(&self) -> Result<crate::admin_model::SearchIndexes, StoreError> {
        admin::create_search_indexes_on(self.admin_target()).await
    }

    /// One message in full by row id; `None` when there is no such row.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn message(
        &self,
        id: i64,
    ) -> Result<Option<crate::admin_model::MessageDetail>, StoreError> {
        admin::message_on(self.admin_target(), id).await
    }

    /// One message in full by row id or message id; `None` when there is no such message.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn find_message(
        &self,
        message: crate::admin_model::MessageRef,
    ) -> Result<Option<crate::admin_model::MessageDetail>, StoreError> {
        let row = match message {
            crate::admin_model::MessageRef::Row(row) => row,
            crate::admin_model::MessageRef::Id(id) => {
                let filter = crate::admin_model::MessageFilter {
                    message_id: Some(id),
                    ..crate::admin_model::MessageFilter::default()
                };
                let page = self
                    .search(&filter, &crate::admin_model::PageRequest::default())
                    .await?;
                match page.messages.first() {
                    Some(m) => m.id,
                    None => return Ok(None),
                }
            }
        };
        self.message(row).await
    }

    /// Rows per state of the `limit` topics with the most rows. Counts the whole table: for an
    /// operator's page, not for a scrape.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn topic_counts(
        &self,
        limit: u32,
    ) -> Result<Vec<crate::admin_model::TopicCounts>, StoreError> {
        admin::topic_counts_on(self.admin_target(), limit).await
    }

    /// The relays' membership rows and every bucket lease, with the database clock.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn leases(&self) -> Result<crate::admin_model::Leases, StoreError> {
        admin::leases_on(self.admin_target()).await
    }

    /// Up to `limit` partition keys held back by a dead letter (a FAILED message with PENDING
    /// messages of its key after it), oldest head first.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn blocked_keys(
        &self,
        limit: u32,
    ) -> Result<Vec<crate::admin_model::BlockedKey>, StoreError> {
        admin::blocked_keys_on(self.admin_target(), limit).await
    }

    /// Retention of one finished state ([`crate::retention`]): up to `limit` rows (at most
    /// [`crate::admin::ACTION_CHUNK`]) of `state` that finished more than `older_than` ago by
    /// the database clock, deleted or moved to `<table>_archive`, in one transaction that skips
    /// rows another transaction holds (so it never waits on a producer or a confirmation). Call
    /// again while it returns the chunk size. Returns the rows removed from the outbox table.
    ///
    /// # Errors
    /// [`StoreError`] from the database; nothing of the failed transaction is applied.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn retire(
        &self,
        state: crate::retention::Finished,
        older_than: Duration,
        action: crate::retention::RetentionAction,
        limit: u32,
    ) -> Result<u64, StoreError> {
        admin::retire_on(self.admin_target(), state, older_than, action, limit).await
    }

    /// Retention by whole partitions, where the outbox table is partitioned by time (PostgreSQL,
    /// [`PgStore::migrate_partitioned`](crate::PgStore::migrate_partitioned)): day partitions
    /// created ahead, and each day partition older than the longest rule of `retention`
    /// dropped, after the rows that must stay were carried forward and the rows ruled
    /// `archive` copied to the archive. `None` (the default, and a table that is not
    /// partitioned): row-wise retention ([`Store::retire`]) applies.
    ///
    /// # Errors
    /// [`StoreError`] from the database; a lock not granted within 500 ms is not an error (the
    /// partition waits for the next round).
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn retire_partitions(
        &self,
        retention: &crate::retention::Retention,
    ) -> Result<Option<crate::retention::PartitionRound>, StoreError> {
        let _ = retention;
        Ok(None)
    }

    /// Delete up to `limit` rows (at most [`crate::admin::ACTION_CHUNK`]) of `<table>_archive`
    /// archived more than `older_than` ago. Returns the rows deleted.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn purge_archive(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        admin::purge_archive_on(self.admin_target(), older_than, limit).await
    }

    /// Apply an operator's `action` to `selection` ([`crate::admin::Action`]), in chunks of
    /// [`crate::admin::ACTION_CHUNK`] rows, each one transaction.
    ///
    /// # Errors
    /// [`StoreError`] from the database; the chunks before the failing one stay done.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    async fn act(
        &self,
        action: crate::admin_model::Action,
        selection: &crate::admin_model::Selection,
    ) -> Result<crate::admin_model::ActionReport, StoreError> {
        admin::act_on(self.admin_target(), action, selection).await
    }

    /// The limits messages are validated against ([`crate::two_phase::TwoPhase::prepare`]
    /// uses them; `enqueue` is each store's own). Default [`Limits::default`](crate::Limits).
    fn limits(&self) -> &crate::Limits {
        static DEFAULT: std::sync::LazyLock<crate::Limits> =
            std::sync::LazyLock::new(crate::Limits::default);
        &DEFAULT
    }

    /// Wake every relay of this table, in this process and others, after rows became due
    /// outside an enqueue (a two-phase commit): [`Store::wake`], and on PostgreSQL a `NOTIFY`.
    fn wake_relays(&self) {
        self.wake();
    }

    /// The shared in-process wake-up: [`Store::wake`] notifies it and the relay waits on it.
    fn waker(&self) -> Arc<Notify>;

    /// Wake an embedded relay now (call after committing a transaction that enqueued).
    fn wake(&self) {
        self.waker().notify_one();
    }

    /// Start a task that wakes `waker` when the database announces new rows (PostgreSQL
    /// LISTEN/NOTIFY), until `cancel`. `None` where the database has no such mechanism.
    fn spawn_listener(&self, cancel: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let _ = cancel;
        None
    }
}

/// The claimed-for-rejection row a dialect read back: id, topic, partition key, headers JSON,
/// payload.
pub(crate) type RejectedRow = (i64, String, Option<String>, String, Vec<u8>);

/// Finish one rejection inside `tx` (whose UPDATE to REJECTED returned `row`): run the hook, then
/// commit; a failing hook rolls back and is counted. Shared by every dialect.
pub(crate) async fn finish_rejection<DB: sqlx::Database>(
    mut tx: sqlx::Transaction<'_, DB>,
    hook: Option<&std::sync::Arc<dyn crate::verdict::RejectionHook<DB>>>,
    c: &crate::verdict::Confirmation,
    reason: &str,
    (id, topic, partition_key, headers, payload): RejectedRow,
    report: &mut crate::verdict::ConfirmReport,
    table: &str,
) -> Result<(), StoreError> {
    let err = |e| db_error("confirm", table, e);
    if let Some(hook) = hook {
        let rejected = crate::verdict::RejectedMessage {
            id,
            message_id: c.message_id,
            topic,
            partition_key,
            headers: parse_headers(id, &headers).unwrap_or_default(),
            payload,
            consumer: c.consumer.clone(),
            reason: reason.to_owned(),
        };
        let span = crate::otel::rejection_hook_span(c, table);
        let ran = {
            use tracing::Instrument;
            hook.on_rejected(&mut tx, &rejected)
                .instrument(span.clone())
                .await
        };
        if let Err(e) = ran {
            crate::otel::record_outcome(&span, "failed", true);
            tracing::error!(error = %e, message_id = %c.message_id, "rejection hook failed; rolled back");
            tx.rollback().await.map_err(err)?;
            report.failed_hooks += 1;
            return Ok(());
        }
    }
    tx.commit().await.map_err(err)?;
    report.rejected += 1;
    Ok(())
}

/// A fresh fencing token: random, non-negative.
pub(crate) fn new_token() -> LeaseToken {
    rand::random::<i64>() & i64::MAX
}

/// Stats from `(status, count)` rows, the oldest due pending age, the SENT rows awaiting
/// confirmation and the oldest of them (milliseconds and counts as the database returns them).
pub(crate) fn stats_from(
    counts: impl IntoIterator<Item = (i64, i64)>,
    (oldest_pending_ms, awaiting, oldest_unconfirmed_ms): (Option<i64>, i64, Option<i64>),
) -> Result<Stats, StoreError> {
    let mut stats = Stats::default();
    for s in Status::ALL {
        stats.counts.insert(s, 0);
    }
    for (status, n) in counts {
        let known = i16::try_from(status).ok().and_then(Status::from_i16);
        let status = known.ok_or_else(|| StoreError::Corrupt {
            id: 0,
            reason: format!("unknown status {status}"),
        })?;
        stats.counts.insert(status, n.max(0) as u64);
    }
    stats.oldest_pending_age = oldest_pending_ms.map(|ms| Duration::from_millis(ms.max(0) as u64));
    stats.awaiting_confirmation = awaiting.max(0) as u64;
    stats.oldest_unconfirmed_age =
        oldest_unconfirmed_ms.map(|ms| Duration::from_millis(ms.max(0) as u64));
    Ok(stats)
}

/// Log the SENDING rows [`Store::migrate`] released: rows an older relay, running the row-claim
/// protocol of earlier versions, had claimed and not completed. They are PENDING again and
/// will be published (again, if that relay had published them: at-least-once, the consumer's
/// inbox absorbs the copy).
pub(crate) fn log_released_sending(table: &str, rows: u64) {
    if rows > 0 {
        tracing::warn!(
            table,
            rows,
            "released SENDING rows left by a relay of an earlier version; they are PENDING again"
        );
    }
}

/// Milliseconds of a duration as i64, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Parse the headers column (a JSON object of strings).
pub(crate) fn parse_headers(id: i64, raw: &str) -> Result<crate::Headers, StoreError> {
    serde_json::from_str(raw).map_err(|e| StoreError::Corrupt {
        id,
        reason: format!("headers are not a JSON object of strings: {e}"),
    })
}

/// Table names and limits of a store.
///
/// Defaults: outbox table `outbox`, inbox table `outbox_inbox`, [`Limits::default`](crate::Limits).
/// Table names are validated ([`TableName`](crate::TableName)); on PostgreSQL they may be
/// schema-qualified (`app.outbox`).
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Outbox table. Default `outbox`.
    pub table: String,
    /// Inbox table created by `migrate` beside the outbox. Default `outbox_inbox`.
    pub inbox_table: String,
    /// Enqueue limits.
    pub limits: crate::Limits,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            table: "outbox".into(),
            inbox_table: "outbox_inbox".into(),
            limits: crate::Limits::default(),
        }
    }
}

impl StoreOptions {
    /// Options with outbox table `table` and inbox table `{table}_inbox`.
    pub fn table(table: impl Into<String>) -> Self {
        let table = table.into();
        StoreOptions {
            inbox_table: format!("{table}_inbox"),
            table,
            ..StoreOptions::default()
        }
    }
}

/// `(id, status)` rows as read (status as the database returns it), sorted by id.
pub(crate) fn statuses_from(
    rows: impl IntoIterator<Item = (i64, i64)>,
) -> Result<Vec<(i64, Status)>, StoreError> {
    let mut out = Vec::new();
    for (id, status) in rows {
        let s = i16::try_from(status)
            .ok()
            .and_then(Status::from_i16)
            .ok_or_else(|| StoreError::Corrupt {
                id,
                reason: format!("unknown status {status}"),
            })?;
        out.push((id, s));
    }
    out.sort_by_key(|(id, _)| *id);
    Ok(out)
}
