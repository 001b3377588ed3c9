//! A consumer inbox's dead letters (`<inbox>_dlq`, written by the consumer runners) as an
//! operator sees and settles them: which consumers have dead letters, each one in full, replay
//! (the consumer's runner runs it again within its maintenance interval, with its handler) and
//! discard (the dead letter is deleted; the inbox keeps its rejected verdict, so a redelivery is
//! still answered as rejected and the producer's compensation, if any, stands).
//!
//! One SQL definition for the three databases, in `store/admin/inbox.rs`.

use crate::error::StoreError;
use crate::ident::TableName;
use crate::store::admin::Target;

pub use crate::admin_model::inbox::*;

/// The dead letters of an inbox table, on the database that holds it. Cheap to clone.
#[derive(Clone)]
pub struct InboxAdmin {
    pub(crate) target: std::sync::Arc<Target>,
}

impl std::fmt::Debug for InboxAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InboxAdmin")
    }
}

impl InboxAdmin {
    /// The inbox `table` (dead letters in `<table>_dlq`) on the database of `store` (an
    /// outbox and its consumers' inboxes in one database, as the demo and many services run
    /// them).
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for a bad table name.
    pub fn on_store(store: &dyn crate::Store, table: &str) -> Result<Self, StoreError> {
        let table = TableName::new(table)?.as_str().to_owned();
        let target = match store.admin_target().0 {
            #[cfg(feature = "postgres")]
            Target::Postgres(pool, _, d) => Target::Postgres(pool, table, d),
            #[cfg(feature = "mysql")]
            Target::MySql(pool, _, d) => Target::MySql(pool, table, d),
            #[cfg(feature = "sqlite")]
            Target::Sqlite(pool, _, d) => Target::Sqlite(pool, table, d),
        };
        Ok(InboxAdmin {
            target: std::sync::Arc::new(target),
        })
    }

    /// The inbox `table` on a PostgreSQL pool.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for a bad table name.
    #[cfg(feature = "postgres")]
    pub fn postgres(pool: sqlx::PgPool, table: &str) -> Result<Self, StoreError> {
        Self::of(
            |t| Target::Postgres(pool, t, &crate::store::postgres::ADMIN),
            table,
        )
    }

    /// The inbox `table` on a MySQL/MariaDB pool.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for a bad table name.
    #[cfg(feature = "mysql")]
    pub fn mysql(pool: sqlx::MySqlPool, table: &str) -> Result<Self, StoreError> {
        Self::of(
            |t| Target::MySql(pool, t, &crate::store::mysql::ADMIN),
            table,
        )
    }

    /// The inbox `table` on a SQLite pool.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for a bad table name.
    #[cfg(feature = "sqlite")]
    pub fn sqlite(pool: sqlx::SqlitePool, table: &str) -> Result<Self, StoreError> {
        Self::of(
            |t| Target::Sqlite(pool, t, &crate::store::sqlite::ADMIN),
            table,
        )
    }

    fn of(make: impl FnOnce(String) -> Target, table: &str) -> Result<Self, StoreError> {
        let table = TableName::new(table)?.as_str().to_owned();
        Ok(InboxAdmin {
            target: std::sync::Arc::new(make(table)),
        })
    }

    /// Every consumer with dead letters, most dead letters first.
    ///
    /// # Errors
    /// [`StoreError`] from the database (a missing table names it).
    pub async fn consumers(&self) -> Result<Vec<ConsumerDeadLetters>, StoreError> {
        crate::store::admin::inbox_consumers_on(&self.target).await
    }

    /// Up to `limit` (at most [`super::MAX_PAGE`]) dead letters, newest first, of `consumer`
    /// or of every consumer; without headers and payload.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn dead_letters(
        &self,
        consumer: Option<&str>,
        limit: u32,
    ) -> Result<Vec<InboxDeadLetter>, StoreError> {
        crate::store::admin::inbox_dead_letters_on(&self.target, consumer, None, limit).await
    }

    /// One dead letter in full (headers, payload rendered); `None` when there is none.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn dead_letter(
        &self,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<InboxDeadLetter>, StoreError> {
        let found = crate::store::admin::inbox_dead_letters_on(
            &self.target,
            Some(consumer),
            Some(message_id),
            1,
        )
        .await?;
        Ok(found.into_iter().next())
    }

    /// Replay or discard the dead letters `message_ids` of `consumer` (one transaction);
    /// each id that is no dead letter of that consumer is reported.
    ///
    /// # Errors
    /// [`StoreError`] from the database; nothing changed then.
    pub async fn act(
        &self,
        action: InboxAction,
        consumer: &str,
        message_ids: &[String],
    ) -> Result<InboxActionReport, StoreError> {
        crate::store::admin::inbox_act_on(&self.target, action, consumer, message_ids).await
    }
}
