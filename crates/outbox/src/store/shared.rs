//! The statements the three dialects run alike around their own SQL: each call chain written
//! once, generic over the sqlx database. The SQL stays with its dialect; a dialect passes its
//! statement in and maps the `sqlx::Error` through its own classification (`self.err(op)`).

use std::time::Duration;

use sqlx::{Database, Pool, SqlSafeStr};

use crate::error::StoreError;
use crate::store::Stats;

/// The pool a dialect's shared statements run on.
pub(crate) struct On<'a, DB: Database>(pub(crate) &'a Pool<DB>);

impl<DB: Database> On<'_, DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// Every row `sql` answers for its one BIGINT parameter, decoded as `R` and turned into
    /// what the caller wants by `map`: [`Store::relays`](crate::Store::relays) (the lease in
    /// milliseconds, [`RelayRow`]s, [`rows::relays`]) and
    /// [`Store::failed`](crate::Store::failed) (the limit, [`FailedRow`]s,
    /// [`rows::failed_messages`]).
    pub(crate) async fn all<R, T>(
        &self,
        sql: impl SqlSafeStr,
        param: i64,
        map: fn(Vec<R>) -> T,
    ) -> Result<T, sqlx::Error>
    where
        R: for<'r> sqlx::FromRow<'r, DB::Row> + Send + Unpin,
    {
        let rows: Vec<R> = sqlx::query_as(sql).bind(param).fetch_all(self.0).await?;
        Ok(map(rows))
    }

    /// [`Store::next_due_in`](crate::Store::next_due_in): `sql` answers one nullable
    /// BIGINT, the milliseconds until the next PENDING row is due (NULL: none; negative: due).
    pub(crate) async fn next_due(
        &self,
        sql: impl SqlSafeStr,
    ) -> Result<Option<Duration>, sqlx::Error> {
        let ms: Option<i64> = sqlx::query_scalar(sql).fetch_one(self.0).await?;
        Ok(due_in(ms))
    }

    /// The end of [`Store::check_schema`](crate::Store::check_schema): `version` (the
    /// highest migration recorded for `table`, a nullable BIGINT from `version_sql`, which takes
    /// the table's name) against `needed`. A missing `outbox_migrations` table
    /// (`is_missing_table`) counts as none recorded; with none recorded, a missing outbox table
    /// is named by the database's error, and one made by other means is at version 0.
    ///
    /// # Errors
    /// [`StoreError::SchemaVersion`] when the table is behind or ahead of this build; what
    /// `err` makes of a database error.
    pub(crate) async fn check_schema(
        &self,
        table: &str,
        version_sql: &'static str,
        needed: i64,
        is_missing_table: fn(&sqlx::Error) -> bool,
        err: impl Fn(sqlx::Error) -> StoreError,
    ) -> Result<(), StoreError> {
        let found: Option<i64> = match sqlx::query_scalar(version_sql)
            .bind(table.to_owned())
            .fetch_one(self.0)
            .await
        {
            Ok(v) => v,
            Err(e) if is_missing_table(&e) => None,
            Err(e) => return Err(err(e)),
        };
        if super::compare_version(table, found, needed)? {
            return Ok(());
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM {table} LIMIT 0"
        )))
        .execute(self.0)
        .await
        .map_err(err)?;
        Err(StoreError::SchemaVersion {
            table: table.to_owned(),
            found: 0,
            needed,
        })
    }
}

/// [`Store::stats`](crate::Store::stats) in the snapshot transaction `tx` the dialect opened:
/// `counts` answers `(status, count)` BIGINT pairs, `ages` one row of the oldest due PENDING
/// row's age in milliseconds (nullable), the count of SENT rows awaiting a confirmation and the
/// oldest of those's age (nullable).
///
/// # Errors
/// What `err` makes of a database error; [`StoreError::Corrupt`] for an unknown status.
pub(crate) async fn stats_in<DB: Database>(
    tx: &mut DB::Connection,
    counts: impl SqlSafeStr,
    ages: impl SqlSafeStr,
    err: impl Fn(sqlx::Error) -> StoreError,
) -> Result<Stats, StoreError>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let rows: Vec<(i64, i64)> = sqlx::query_as(counts)
        .fetch_all(&mut *tx)
        .await
        .map_err(&err)?;
    let ages: (Option<i64>, i64, Option<i64>) = sqlx::query_as(ages)
        .fetch_one(&mut *tx)
        .await
        .map_err(&err)?;
    super::stats_from(rows, ages)
}

/// A dialect's statements on `outbox_migrations`, where each table's applied migration
/// versions are recorded; each takes the table's name, and `applied` and `record` the version
/// (a BIGINT) after it.
pub(crate) struct MigrationLog {
    /// The highest version recorded, a nullable BIGINT.
    pub(crate) newest: &'static str,
    /// How many rows record the version, a BIGINT (0 or 1).
    pub(crate) applied: &'static str,
    /// Record the version.
    pub(crate) record: &'static str,
}

impl MigrationLog {
    /// This log's statements on `conn` (a migration's connection or transaction).
    pub(crate) fn on<'c, DB: Database>(
        &'static self,
        conn: &'c mut DB::Connection,
    ) -> LogOn<'c, DB> {
        LogOn { log: self, conn }
    }
}

/// A [`MigrationLog`]'s statements bound to the connection a migration runs on.
pub(crate) struct LogOn<'c, DB: Database> {
    log: &'static MigrationLog,
    conn: &'c mut DB::Connection,
}

impl<DB: Database> LogOn<'_, DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// Before migrating: refuse when a table of `steps` was migrated by a newer build (this
    /// build does not know its schema, so it leaves the table alone).
    ///
    /// # Errors
    /// [`StoreError::SchemaVersion`] naming the first such table; a database error as
    /// `migrate`.
    pub(crate) async fn refuse_newer<S>(
        &mut self,
        steps: &[(String, i64, S)],
    ) -> Result<(), StoreError> {
        for (table, needed) in super::newest_versions(steps) {
            let found: Option<i64> = sqlx::query_scalar(self.log.newest)
                .bind(table.clone())
                .fetch_one(&mut *self.conn)
                .await
                .map_err(migrate_error)?;
            if let Some(found) = found.filter(|f| *f > needed) {
                return Err(StoreError::SchemaVersion {
                    table,
                    found,
                    needed,
                });
            }
        }
        Ok(())
    }

    /// Whether migration `version` of `table` is recorded.
    ///
    /// # Errors
    /// A database error as `migrate`.
    pub(crate) async fn applied(&mut self, table: &str, version: i64) -> Result<bool, StoreError> {
        let n: i64 = sqlx::query_scalar(self.log.applied)
            .bind(table.to_owned())
            .bind(version)
            .fetch_one(&mut *self.conn)
            .await
            .map_err(migrate_error)?;
        Ok(n > 0)
    }

    /// Record migration `version` of `table` as applied.
    ///
    /// # Errors
    /// A database error as `migrate`.
    pub(crate) async fn record(&mut self, table: &str, version: i64) -> Result<(), StoreError> {
        sqlx::query(self.log.record)
            .bind(table.to_owned())
            .bind(version)
            .execute(&mut *self.conn)
            .await
            .map_err(migrate_error)?;
        Ok(())
    }
}

fn migrate_error(e: sqlx::Error) -> StoreError {
    super::database_error("migrate", e)
}

/// Milliseconds until due (negative: already due, `None`: nothing) as a wait.
pub(crate) fn due_in(ms: Option<i64>) -> Option<Duration> {
    ms.map(|ms| Duration::from_millis(ms.max(0) as u64))
}
