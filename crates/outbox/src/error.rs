//! Error types, one enum per layer (docs/design/STYLE.md "Errors"): [`EnqueueError`] for producers,
//! [`StoreError`] for the database seam, [`TransportError`] for the broker seam, [`ConfigError`]
//! for builders and configuration, [`HandlerError`] and [`InboxError`] for consumers.
//!
//! Each error keeps its `#[source]` chain. Tests and callers branch on kinds
//! ([`StoreError::is_retryable`], [`TransportError::kind`]), never on message text.

use std::time::Duration;

/// A boxed error from a library below us (a broker client, an HTTP client).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why an enqueue was refused. Every variant except [`EnqueueError::Database`] is raised before
/// anything is written, so the caller's transaction is untouched and can still commit or roll
/// back as the caller decides.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The topic is empty, longer than 255 characters, or has whitespace or control characters.
    #[error("invalid topic {0:?}: 1 to 255 characters, no whitespace or control characters")]
    InvalidTopic(String),
    /// The partition key is empty, longer than 255 bytes or has control characters.
    #[error("invalid partition key {0:?}: 1 to 255 bytes, no control characters")]
    InvalidPartitionKey(String),
    /// The payload is larger than [`Limits::max_payload_bytes`](crate::Limits).
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
    /// More headers than [`Limits::max_headers`](crate::Limits).
    #[error("{count} headers exceed the limit of {limit}")]
    TooManyHeaders {
        /// Headers given.
        count: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A header name outside `A-Z a-z 0-9 - _ .`, empty, longer than 128, or reserved
    /// (`outbox-*`, `webhook-*`).
    #[error(
        "invalid header name {0:?}: 1 to 128 of A-Z a-z 0-9 - _ . and not reserved (outbox-*, webhook-*)"
    )]
    InvalidHeaderName(String),
    /// A header whose name a broker reserves for itself
    /// ([`reserved::RESERVED`](crate::reserved::RESERVED)): `Nats-Msg-Id` and the
    /// rest of the `Nats-` namespace, HTTP connection headers such as `Content-Length`,
    /// RabbitMQ's `CC`/`BCC`/`x-death`/`x-delay`, RocketMQ system properties such as `DELAY`.
    /// Refused for every transport, since the relay may route the message to any of them.
    #[error("header {name:?} is reserved by {broker} ({why}): choose another name")]
    ReservedHeader {
        /// The header name.
        name: String,
        /// The broker that reserves it (`"NATS JetStream"`, `"RabbitMQ"`, ...).
        broker: &'static str,
        /// What the broker does with it.
        why: &'static str,
    },
    /// A header value that is too long or has control characters.
    #[error("invalid value for header {0:?}: too long or has control characters")]
    InvalidHeaderValue(String),
    /// `max_attempts` of 0.
    #[error("max_attempts must be at least 1")]
    InvalidMaxAttempts,
    /// A delay over 365 days.
    #[error("delay of {0:?} is longer than 365 days")]
    DelayTooLong(Duration),
    /// A two-phase message with a delay ([`crate::two_phase`]): it is published when
    /// committed; commit it later instead.
    #[error("a prepared message cannot have a delay: it is published when committed")]
    PreparedWithDelay,
    /// The message id is in the outbox table already (a prepare sent twice: the first one
    /// wrote the row; look it up, or decide it).
    #[error("message id {0} is already in the outbox")]
    DuplicateMessageId(uuid::Uuid),
    /// A check-back whose delays are out of range ([`crate::two_phase::CheckBack`]).
    #[error("invalid check-back: {0}")]
    InvalidCheckBack(String),
    /// The payload value could not be serialized to JSON.
    #[error("payload could not be serialized as JSON")]
    Serialize(#[source] serde_json::Error),
    /// The insert failed in the database; the caller's transaction should be rolled back.
    #[error("outbox insert failed")]
    Database(#[source] StoreError),
    /// The insert waited longer than the store's enqueue timeout for a lock on the outbox table
    /// (PostgreSQL: another session holds `LOCK TABLE`, a migration or `VACUUM FULL` rewrites
    /// it; MySQL/MariaDB: `LOCK TABLES … WRITE`, `ALTER TABLE`, or a row lock of another
    /// transaction; SQLite: another connection holds the database's write lock). Nothing was
    /// written; roll the caller's transaction back (PostgreSQL has aborted it). Retrying later
    /// may succeed. See `PgStore::with_enqueue_timeout`, `MySqlStore::with_enqueue_timeout`,
    /// `SqliteStore::with_enqueue_timeout`.
    #[error(
        "outbox insert into {table} waited longer than the enqueue timeout of {timeout:?} for a lock on the table"
    )]
    Timeout {
        /// The outbox table.
        table: String,
        /// The timeout that expired.
        timeout: Duration,
        /// The driver's error (PostgreSQL `lock_not_available`, SQLSTATE 55P03; MySQL/MariaDB
        /// 1205 `ER_LOCK_WAIT_TIMEOUT`; SQLite `SQLITE_BUSY`, "database is locked").
        #[source]
        source: sqlx::Error,
    },
}

/// The kind of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// Connection lost, pool timed out, deadlock, serialization failure, busy database: try again.
    Transient,
    /// The outbox or inbox table does not exist: run `outbox migrate`.
    MissingTable,
    /// The configuration of the store is wrong (identifier, URL, in-memory SQLite pool).
    Config,
    /// A row holds a value outside the schema (unknown status, headers that are not a JSON object).
    Corrupt,
    /// The server cannot take writes now: a read-only replica, a hot standby, PostgreSQL
    /// `default_transaction_read_only`, MariaDB `read_only` (SQLSTATE 25006, MariaDB 1290 and
    /// 1792). Like a lost connection: try again; a store built with `connect` drops its
    /// connections to that server, so the next attempt reconnects (through DNS or a proxy) and
    /// reaches the primary.
    Unavailable,
    /// The table's schema version is not the one this build runs on: older (run `outbox
    /// migrate`) or newer (upgrade this build). Retrying cannot help.
    SchemaVersion,
    /// Any other database error.
    Other,
}

impl StoreErrorKind {
    /// Every kind, in declaration order (the index of a kind is its position here).
    pub const ALL: [StoreErrorKind; 7] = [
        StoreErrorKind::Transient,
        StoreErrorKind::MissingTable,
        StoreErrorKind::Config,
        StoreErrorKind::Corrupt,
        StoreErrorKind::Unavailable,
        StoreErrorKind::SchemaVersion,
        StoreErrorKind::Other,
    ];

    /// The kind's name as a metric label (`kind` of `outbox_relay_store_errors_total`):
    /// `transient`, `missing_table`, `config`, `corrupt`, `unavailable`, `schema_version`,
    /// `other`.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::Transient => "transient",
            StoreErrorKind::MissingTable => "missing_table",
            StoreErrorKind::Config => "config",
            StoreErrorKind::Corrupt => "corrupt",
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::SchemaVersion => "schema_version",
            StoreErrorKind::Other => "other",
        }
    }

    /// The kind's position in [`StoreErrorKind::ALL`] (its declaration order).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// An error from a store (PostgreSQL, SQLite).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A database call failed during `op` (a short name such as `"read"`).
    #[error("database error during {op}")]
    Database {
        /// The store operation.
        op: &'static str,
        /// Whether the dialect that raised it classified it as worth retrying
        /// ([`StoreErrorKind::Transient`]): a lost connection, a deadlock, a busy database.
        transient: bool,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The table is missing; the message says which and how to create it.
    #[error("table {table:?} does not exist: run `outbox migrate --database URL` first")]
    MissingTable {
        /// The table name.
        table: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The SQLite database file does not exist and the caller opened it without creating it
    /// ([`SqliteStore::connect_existing`](crate::SqliteStore::connect_existing): operator
    /// commands and the relay daemon; only `outbox migrate` creates a database). Kind
    /// [`StoreErrorKind::MissingTable`].
    #[error(
        "SQLite database {path:?} does not exist: check the path, or create it with `outbox migrate --database URL` (only migrate creates a database)"
    )]
    MissingDatabase {
        /// The file path the URL names.
        path: String,
    },
    /// The server refused a write because it is read-only (see
    /// [`StoreErrorKind::Unavailable`]).
    #[error(
        "database is read-only during {op} (a replica or hot standby, or read-only mode is on): its connections are dropped and reopened; point the URL at the primary"
    )]
    ReadOnly {
        /// The store operation.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The outbox table's schema version (its highest migration recorded in
    /// `outbox_migrations`) is not the one this build needs: `found < needed` says "run `outbox
    /// migrate`", `found > needed` says this build is older than the schema and must be
    /// upgraded. `found` is 0 for a table no migration created.
    #[error("{}", schema_version_message(table, *found, *needed))]
    SchemaVersion {
        /// The outbox table.
        table: String,
        /// The version recorded for the table.
        found: i64,
        /// The version this build's migrations end at.
        needed: i64,
    },
    /// A table or schema name that is not a plain SQL identifier.
    #[error(
        "invalid identifier {0:?}: letters, digits and _ only, starting with a letter or _, at most 48 characters per part (optionally schema.table)"
    )]
    InvalidIdentifier(String),
    /// A configuration problem found before any data was touched.
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// A row that does not fit the schema.
    #[error("row {id} is corrupt: {reason}")]
    Corrupt {
        /// Row id.
        id: i64,
        /// What is wrong.
        reason: String,
    },
}

/// What a dialect found a driver error to be. Each store dialect classifies the errors of its
/// own database (`store::<dialect>::errors`, after sqlx's drivers, which each know their own
/// error codes); [`StoreError::classified`] turns the class into the error.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DbErrorClass {
    /// The server refused a write as read-only ([`StoreError::ReadOnly`]).
    ReadOnly,
    /// A table does not exist; the relation the server named, when it named one.
    MissingTable(Option<String>),
    /// Worth retrying: connection lost, pool timed out, deadlock, lock timeout, busy database.
    Transient,
    /// Anything else.
    Other,
}

impl DbErrorClass {
    /// The class of the errors every driver shares (not raised by a database server): I/O,
    /// pool timeout and a crashed worker are [`DbErrorClass::Transient`]; `None` for a
    /// database error, which only its dialect can classify.
    pub fn of_driver(e: &sqlx::Error) -> Option<DbErrorClass> {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => {
                Some(DbErrorClass::Transient)
            }
            sqlx::Error::Database(_) => None,
            _ => Some(DbErrorClass::Other),
        }
    }

    /// The server's own error in `e`, for its dialect to classify, or the class of a driver
    /// error ([`DbErrorClass::of_driver`]) when the server raised none.
    ///
    /// # Errors
    /// The class of `e` when it is not a database error.
    pub fn server_error(e: &sqlx::Error) -> Result<&dyn sqlx::error::DatabaseError, DbErrorClass> {
        match e {
            sqlx::Error::Database(db) => Ok(db.as_ref()),
            _ => Err(DbErrorClass::of_driver(e).unwrap_or(DbErrorClass::Other)),
        }
    }
}

impl StoreError {
    /// Wrap a driver error raised during `op` on `table`, as its dialect classified it: a
    /// read-only refusal, a missing table (the relation the server named, else `table`), or a
    /// [`StoreError::Database`] that is transient or not.
    pub fn classified(
        op: &'static str,
        table: &str,
        source: sqlx::Error,
        class: DbErrorClass,
    ) -> StoreError {
        match class {
            DbErrorClass::ReadOnly => StoreError::ReadOnly { op, source },
            DbErrorClass::MissingTable(named) => StoreError::MissingTable {
                table: named.unwrap_or_else(|| table.to_owned()),
                source,
            },
            DbErrorClass::Transient => StoreError::Database {
                op,
                transient: true,
                source,
            },
            DbErrorClass::Other => StoreError::Database {
                op,
                transient: false,
                source,
            },
        }
    }

    /// The error's kind.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Database {
                transient: true, ..
            } => StoreErrorKind::Transient,
            StoreError::Database { .. } => StoreErrorKind::Other,
            StoreError::MissingTable { .. } | StoreError::MissingDatabase { .. } => {
                StoreErrorKind::MissingTable
            }
            StoreError::ReadOnly { .. } => StoreErrorKind::Unavailable,
            StoreError::SchemaVersion { .. } => StoreErrorKind::SchemaVersion,
            StoreError::InvalidIdentifier(_) | StoreError::Config(_) => StoreErrorKind::Config,
            StoreError::Corrupt { .. } => StoreErrorKind::Corrupt,
        }
    }

    /// Whether trying the same operation again later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind(),
            StoreErrorKind::Transient | StoreErrorKind::Unavailable
        )
    }

    /// The message followed by its source chain (`database error during read: error returned
    /// from database: …`), for logs: `Display` alone gives only the first part.
    pub fn report(&self) -> String {
        with_sources(self.to_string(), std::error::Error::source(self))
    }
}

/// The message of [`StoreError::SchemaVersion`].
fn schema_version_message(table: &str, found: i64, needed: i64) -> String {
    if found > needed {
        format!(
            "table {table} is at schema v{found}, this build supports up to v{needed}: upgrade outbox (or run the build that migrated it)"
        )
    } else {
        format!("run `outbox migrate` (table {table} at v{found}, this build needs v{needed})")
    }
}

/// The kind of a [`TransportError`], decided where the error is born (docs/design/DESIGN.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportErrorKind {
    /// The transport cannot publish anything now, whatever the message: the broker cannot be
    /// reached (connection refused, disconnected), the client is dead (a fenced or fatally failed
    /// producer, a closed connection), or the transport's configuration is refused
    /// (authentication, permission, TLS, a missing destination: see
    /// [`TransportError::missing_destination`]). The relay releases the message without counting
    /// the attempt, pauses the transport and probes it with backoff (the probe rebuilds a dead
    /// client); it never dead-letters for this kind, except a destination missing for longer
    /// than its grace period. A destination that refuses messages for now
    /// ([`TransportError::destination_busy`]) is backed off alone, without pausing the
    /// transport.
    Unavailable,
    /// This publish failed but a later one may succeed (timeout, 5xx). A destination that
    /// refuses every message for a while (a RabbitMQ nack, an HTTP 429) is
    /// [`TransportError::destination_busy`] instead, which spends no attempt.
    Retryable,
    /// This message can never be published as it is (too large, unknown destination, 4xx).
    /// The message goes to FAILED at once.
    Permanent,
}

/// What an [`Unavailable`](TransportErrorKind::Unavailable) error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// The transport, or an error of another kind.
    Any,
    /// [`TransportError::missing_destination`].
    MissingDestination,
    /// [`TransportError::destination_busy`].
    DestinationBusy,
}

/// An error from a transport: the broker did not acknowledge the message.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} transport error: {message}")]
pub struct TransportError {
    kind: TransportErrorKind,
    message: String,
    scope: Scope,
    #[source]
    source: Option<BoxError>,
}

impl TransportError {
    /// A new error of `kind` with a human-readable `message` (stored as the row's `last_error`).
    pub fn new(kind: TransportErrorKind, message: impl Into<String>) -> Self {
        TransportError {
            kind,
            message: message.into(),
            scope: Scope::Any,
            source: None,
        }
    }

    /// The destination does not exist (a RabbitMQ exchange, a Kafka topic, a JetStream stream for
    /// the subject, a webhook answering 404): an [`Unavailable`](TransportErrorKind::Unavailable)
    /// error, because a missing destination is almost always a deployment step not taken yet
    /// (the transport is paused and probed, no attempt is counted), that the relay dead-letters
    /// once the destination has been missing for longer than
    /// [`RelayConfig::missing_destination_grace`](crate::RelayConfig::missing_destination_grace).
    pub fn missing_destination(message: impl Into<String>) -> Self {
        let mut e = Self::new(TransportErrorKind::Unavailable, message);
        e.scope = Scope::MissingDestination;
        e
    }

    /// Whether this error says the destination does not exist
    /// ([`TransportError::missing_destination`]).
    pub fn is_missing_destination(&self) -> bool {
        self.scope == Scope::MissingDestination
    }

    /// The destination exists but refuses messages for now, whatever the message: a RabbitMQ
    /// `basic.nack` (a quorum queue electing a new leader after its leader's node went down, or
    /// a queue at its `x-max-length` with `x-overflow=reject-publish`: RabbitMQ's publisher
    /// confirms documentation), an HTTP 429 (Too Many Requests; not a 503, which receivers, this
    /// crate's webhook consumer among them, also answer for one message's transient failure). An
    /// [`Unavailable`](TransportErrorKind::Unavailable) error scoped to one destination: the
    /// relay releases the message without counting the attempt and tries that destination
    /// again with [`RelayConfig::probe_backoff`](crate::RelayConfig::probe_backoff), growing
    /// per destination while it stays busy, and never dead-letters for it; the transport is
    /// not paused, so other destinations go on. (Counted as attempts, a minute of nacks after a
    /// node failure dead-lettered thousands of messages: docs/scaling.md.)
    pub fn destination_busy(message: impl Into<String>) -> Self {
        let mut e = Self::new(TransportErrorKind::Unavailable, message);
        e.scope = Scope::DestinationBusy;
        e
    }

    /// Whether this error says the destination refuses messages for now
    /// ([`TransportError::destination_busy`]).
    pub fn is_destination_busy(&self) -> bool {
        self.scope == Scope::DestinationBusy
    }

    /// Shorthand for [`TransportErrorKind::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(TransportErrorKind::Unavailable, message)
    }

    /// Shorthand for [`TransportErrorKind::Retryable`].
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::new(TransportErrorKind::Retryable, message)
    }

    /// Shorthand for [`TransportErrorKind::Permanent`].
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(TransportErrorKind::Permanent, message)
    }

    /// Attach the underlying error.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The kind.
    pub fn kind(&self) -> TransportErrorKind {
        self.kind
    }

    /// The message, without the kind.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message followed by the source chain, for `last_error`.
    pub fn report(&self) -> String {
        with_sources(
            self.message.clone(),
            self.source
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static)),
        )
    }
}

/// A configuration value that failed validation; `field` names it as it is spelled in the TOML
/// file or builder (for example `relay.lease`).
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration field `{field}`: {reason}")]
pub struct ConfigError {
    /// The field, as spelled in the configuration.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ConfigError {
    /// A new error for `field`.
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// `Err` for `field` with the reason "must be greater than zero" when `zero` holds, else
    /// `Ok(())`: the rule of every duration, size and count that 0 would break, as in
    /// `ConfigError::zero_if(self.linger.is_zero(), "linger")?`.
    pub fn zero_if(zero: bool, field: impl Into<String>) -> Result<(), ConfigError> {
        ConfigError::invalid_if(zero, field, "must be greater than zero")
    }

    /// `Err` for `field` with `reason` when `invalid` holds, else `Ok(())`: one rule of a
    /// `validate()`, as in `ConfigError::invalid_if(self.batch == 0, "batch", "must be at least
    /// 1")?`. The reason is built whether or not the rule is broken, so it must not depend on
    /// the rule being broken (no indexing the condition guards).
    pub fn invalid_if(
        invalid: bool,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Result<(), ConfigError> {
        if invalid {
            Err(ConfigError::new(field, reason))
        } else {
            Ok(())
        }
    }
}

/// What a consumer's handler says when it does not apply a message. In every case the inbox
/// transaction is rolled back.
///
/// - [`HandlerError::transient`]: may pass (a timeout, a locked row); the message is not
///   acknowledged and the broker redelivers it with backoff, up to the runner's
///   `max_deliveries`, after which it goes to the consumer's dead-letter table.
/// - [`HandlerError::permanent`]: will not pass by retrying (a payload the handler cannot parse);
///   the message goes to the dead-letter table at once.
/// - [`HandlerError::reject`]: a business refusal ("insufficient stock"); not an error of the
///   consumer: the inbox records the verdict, the message is acknowledged, and a `Rejected`
///   confirmation lets the producer compensate.
#[derive(Debug, thiserror::Error)]
#[error("handler failed: {source}")]
pub struct HandlerError {
    kind: HandlerErrorKind,
    #[source]
    source: BoxError,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HandlerErrorKind {
    Transient,
    Permanent,
    Rejected(String),
}

impl HandlerError {
    /// A failure that may pass: redeliver with backoff.
    pub fn transient(source: impl Into<BoxError>) -> Self {
        HandlerError {
            kind: HandlerErrorKind::Transient,
            source: source.into(),
        }
    }

    /// A failure that will not pass by retrying: dead-letter at once.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        HandlerError {
            kind: HandlerErrorKind::Permanent,
            source: source.into(),
        }
    }

    /// A business refusal with its `reason`: recorded, acknowledged and confirmed as `Rejected`.
    pub fn reject(reason: impl Into<String>) -> Self {
        let reason = reason.into();
        HandlerError {
            source: format!("rejected: {reason}").into(),
            kind: HandlerErrorKind::Rejected(reason),
        }
    }

    /// Whether the handler said retrying cannot help (permanent failure or rejection).
    pub fn is_permanent(&self) -> bool {
        self.kind != HandlerErrorKind::Transient
    }

    /// The reason, when this is a business rejection.
    pub fn rejection(&self) -> Option<&str> {
        match &self.kind {
            HandlerErrorKind::Rejected(r) => Some(r),
            _ => None,
        }
    }
}

/// An error from [`Inbox::process`](crate::inbox::Inbox::process). In every case the transaction
/// was rolled back and the message must not be acknowledged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The handler failed.
    #[error(transparent)]
    Handler(#[from] HandlerError),
    /// The inbox insert, the begin or the commit failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl InboxError {
    /// Whether redelivering can help (everything except a permanent handler error).
    pub fn is_retryable(&self) -> bool {
        match self {
            InboxError::Handler(h) => !h.is_permanent(),
            InboxError::Store(_) => true,
        }
    }
}

/// `first` followed by `source` and its own sources, each after `": "`.
pub(crate) fn with_sources(
    mut first: String,
    source: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    let mut src = source;
    while let Some(e) = src {
        first.push_str(": ");
        first.push_str(&e.to_string());
        src = e.source();
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_error_kinds_are_listed_in_declaration_order() {
        for (i, k) in StoreErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }

    /// `report` gives the whole chain, `Display` only the store's own part.
    #[test]
    fn store_error_report_carries_the_cause() {
        let e = StoreError::classified(
            "read",
            "outbox",
            sqlx::Error::PoolTimedOut,
            DbErrorClass::Transient,
        );
        assert_eq!(e.kind(), StoreErrorKind::Transient);
        let cause = sqlx::Error::PoolTimedOut.to_string();
        assert_eq!(e.to_string(), "database error during read");
        assert_eq!(e.report(), format!("database error during read: {cause}"));
        let e = EnqueueError::Database(e);
        assert!(e.to_string().starts_with("outbox insert failed"));
    }
}
