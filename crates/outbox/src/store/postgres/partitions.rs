//! A time-partitioned outbox table on PostgreSQL, whose retention drops whole partitions
//! (docs/operations.md, "Partitioned outbox table").
//!
//! The table is partitioned by range of `partitioned_at` (`now()` at insert), one partition a
//! UTC day, `<table>_pYYYYMMDD`, and a default partition `<table>_default` that catches a row
//! no day partition takes. `partitioned_at` is the table's own column, not `created_at`, so a
//! row that must outlive its day's partition (still to be published or confirmed, a dead letter
//! kept, a finished row younger than its rule) is carried forward into today's partition by
//! setting it to `now()`, with its id, message id and every other column unchanged.
//!
//! The holder of bucket 0 runs [`retire_partitions`] in its maintenance instead of row-wise
//! retention: it creates the day partitions of the next week, and for each day partition that
//! ended more than the longest retention age ago: carries the rows that must stay forward (in
//! chunks that skip locked rows), detaches the partition (a short `ACCESS EXCLUSIVE` lock of
//! the parent, given up after `lock_timeout` and tried again next round), then, with the
//! partition out of everyone's way, copies the rows of states ruled `archive` into the archive,
//! puts back any row that must stay after all, and drops it. A partition detached by a relay
//! that died before dropping it is finished by the next round.
//!
//! PostgreSQL cannot enforce a unique key across partitions that does not contain the
//! partition key: the message id is unique per partition only (`UNIQUE (message_id,
//! partitioned_at)`), so the database no longer refuses a message id enqueued twice on
//! different days; the consumer's inbox still applies it once.

use chrono::{Days, NaiveDate};
use sqlx::{AssertSqlSafe, PgPool};

use super::PgStore;
use super::migrations::outbox_columns;
use crate::error::StoreError;
use crate::retention::{Finished, PartitionRound, Retention, RetentionAction};
use crate::store::admin::ARCHIVED_COLUMNS;
use crate::store::admin::retention::finished;

/// Day partitions created ahead of today.
const DAYS_AHEAD: u64 = 7;
/// The columns a row keeps when it is put back from a detached partition (all but the generated
/// `bucket` and `partitioned_at`).
const KEPT_COLUMNS: &str = "id, message_id, topic, partition_key, headers, payload, status, \
     attempts, max_attempts, available_at, lease_owner, lease_token, lease_expires_at, created_at, \
     sent_at, confirmed_at, updated_at, last_error, confirm_deadline, check_backs, redelivery";
/// Rows carried forward per transaction.
const CHUNK: i64 = 500;
/// How long detaching or creating a partition waits for the parent's lock before it gives up
/// until the next round (producers queue behind a waiting `ACCESS EXCLUSIVE` request).
const LOCK_TIMEOUT: &str = "500ms";

/// The names a partitioned table's parts use.
struct Names<'a> {
    /// `schema.` or empty.
    schema: String,
    /// The unqualified table name.
    base: &'a str,
}

impl<'a> Names<'a> {
    fn of(table: &'a str) -> Self {
        match table.split_once('.') {
            Some((s, b)) => Names {
                schema: format!("{s}."),
                base: b,
            },
            None => Names {
                schema: String::new(),
                base: table,
            },
        }
    }

    /// The qualified name of the partition of `day`.
    fn day(&self, day: NaiveDate) -> String {
        format!("{}{}_p{}", self.schema, self.base, day.format("%Y%m%d"))
    }

    /// The day of a partition's unqualified name, if it is one of ours.
    fn day_of(&self, name: &str) -> Option<NaiveDate> {
        let digits = name.strip_prefix(self.base)?.strip_prefix("_p")?;
        NaiveDate::parse_from_str(digits, "%Y%m%d").ok()
    }
}

/// The statement creating `table` partitioned by day, with its default partition (the columns of
/// migration v1 plus `partitioned_at`; the migrations then add the rest as for a plain table).
fn create_statement(table: &str) -> String {
    let n = Names::of(table);
    let schema = match table.split_once('.') {
        Some((s, _)) => format!("CREATE SCHEMA IF NOT EXISTS {s};"),
        None => String::new(),
    };
    format!(
        "{schema}
        CREATE TABLE IF NOT EXISTS {table} (
            {columns},
            partitioned_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (id, partitioned_at),
            CONSTRAINT {base}_message_id_key UNIQUE (message_id, partitioned_at)
        ) PARTITION BY RANGE (partitioned_at);
        CREATE TABLE IF NOT EXISTS {schema_dot}{base}_default PARTITION OF {table} DEFAULT;",
        columns = outbox_columns(),
        base = n.base,
        schema_dot = n.schema,
    )
}

impl PgStore {
    /// Create the outbox table partitioned by day (module docs; docs/operations.md,
    /// "Partitioned outbox table"), then migrate as [`Store::migrate`](crate::Store::migrate)
    /// does and create the day partitions from today to a week ahead. Idempotent on a table
    /// it created.
    ///
    /// # Errors
    /// [`StoreError::Config`] when the table exists and is not partitioned (converting a table
    /// is a manual step, docs/operations.md); [`StoreError`] from the database.
    pub async fn migrate_partitioned(&self) -> Result<(), StoreError> {
        let table = self.table.as_str();
        match kind(&self.pool, table).await? {
            Some(b'p') => {}
            Some(_) => {
                return Err(StoreError::Config(format!(
                    "{table} exists and is not partitioned; a partitioned outbox table is \
                     created new (docs/operations.md, \"Partitioned outbox table\")"
                )));
            }
            None => {
                sqlx::raw_sql(AssertSqlSafe(create_statement(table)))
                    .execute(&self.pool)
                    .await
                    .map_err(self.err("migrate"))?;
            }
        }
        crate::Store::migrate(self).await?;
        ensure_days(&self.pool, table).await?;
        Ok(())
    }

    /// Whether the outbox table is partitioned ([`PgStore::migrate_partitioned`]).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn is_partitioned(&self) -> Result<bool, StoreError> {
        Ok(kind(&self.pool, self.table.as_str()).await? == Some(b'p'))
    }
}

/// `pg_class.relkind` of `table` (`p`: partitioned, `r`: plain), `None` if it does not exist.
async fn kind(pool: &PgPool, table: &str) -> Result<Option<u8>, StoreError> {
    let k: Option<String> =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(table)
            .fetch_optional(pool)
            .await
            .map_err(|e| crate::store::db_error("partitions", table, e))?;
    Ok(k.and_then(|k| k.bytes().next()))
}

/// Today by the database clock (UTC).
async fn today(pool: &PgPool, table: &str) -> Result<NaiveDate, StoreError> {
    sqlx::query_scalar("SELECT (now() AT TIME ZONE 'UTC')::date")
        .fetch_one(pool)
        .await
        .map_err(|e| crate::store::db_error("partitions", table, e))
}

/// Run `statement` in a transaction whose lock waits end after [`LOCK_TIMEOUT`]. `Ok(false)`:
/// the lock was not granted in time (try again next round).
async fn with_lock_timeout(
    pool: &PgPool,
    table: &str,
    statement: &str,
) -> Result<bool, StoreError> {
    let err = |e| crate::store::db_error("partitions", table, e);
    let mut tx = pool.begin().await.map_err(err)?;
    sqlx::query(AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"
    )))
    .execute(&mut *tx)
    .await
    .map_err(err)?;
    match sqlx::raw_sql(AssertSqlSafe(statement.to_owned()))
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {
            tx.commit().await.map_err(err)?;
            Ok(true)
        }
        // Dropping `tx` rolls it back.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => Ok(false),
        Err(e) => Err(err(e)),
    }
}

/// Create the day partitions from today to [`DAYS_AHEAD`] days ahead that do not exist (not
/// yesterday's: retention may have dropped it; a late row of yesterday goes to the default
/// partition). Returns how many were created.
async fn ensure_days(pool: &PgPool, table: &str) -> Result<u32, StoreError> {
    let n = Names::of(table);
    let today = today(pool, table).await?;
    let days: Vec<NaiveDate> = (0..=DAYS_AHEAD)
        .filter_map(|i| today.checked_add_days(Days::new(i)))
        .collect();
    let names: Vec<String> = days.iter().map(|d| n.day(*d)).collect();
    let missing: Vec<bool> = sqlx::query_scalar(
        "SELECT to_regclass(name) IS NULL FROM unnest($1::text[]) WITH ORDINALITY AS u(name, i) ORDER BY i",
    )
    .bind(&names)
    .fetch_all(pool)
    .await
    .map_err(|e| crate::store::db_error("partitions", table, e))?;
    let mut created = 0;
    for ((day, name), missing) in days.iter().zip(&names).zip(missing) {
        if !missing {
            continue;
        }
        let next = day.checked_add_days(Days::new(1)).expect("a date in range");
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF {table} \
             FOR VALUES FROM ('{day} 00:00:00+00') TO ('{next} 00:00:00+00')"
        );
        match with_lock_timeout(pool, table, &create).await {
            Ok(true) => created += 1,
            Ok(false) => {}
            // Rows of that day in the default partition (no relay ran for a week): they stay
            // there, retained by nobody, until an operator moves them (docs/operations.md).
            Err(e) => {
                tracing::warn!(partition = %name, error = %e, "creating a day partition failed")
            }
        }
    }
    Ok(created)
}

/// The condition a row must meet to stay past its day's partition: it is not in a finished
/// state whose rule removes it, or it is younger than that rule (ages by the database clock; a
/// missing time counts as young).
fn must_stay(r: &Retention) -> String {
    let may_go: Vec<String> = Finished::ALL
        .iter()
        .filter_map(|&state| {
            let after = r.rule(state).after?;
            let (rows, age) = finished(state);
            Some(format!(
                "({rows} AND COALESCE({age}, 'infinity') < now() - interval '{} milliseconds')",
                crate::store::millis(after)
            ))
        })
        .collect();
    if may_go.is_empty() {
        "TRUE".to_owned()
    } else {
        format!("NOT ({})", may_go.join(" OR "))
    }
}

/// [`Store::retire_partitions`](crate::Store::retire_partitions) for [`PgStore`]: `None` when
/// the table is not partitioned.
pub(super) async fn retire_partitions(
    store: &PgStore,
    retention: &Retention,
) -> Result<Option<PartitionRound>, StoreError> {
    let (pool, table) = (&store.pool, store.table.as_str());
    if kind(pool, table).await? != Some(b'p') {
        return Ok(None);
    }
    let mut round = PartitionRound {
        created: ensure_days(pool, table).await?,
        ..PartitionRound::default()
    };
    // The longest age of a rule that removes rows: a day partition older than that holds
    // (nearly) nothing that must stay.
    let Some(horizon) = Finished::ALL
        .iter()
        .filter_map(|s| retention.rule(*s).after)
        .max()
    else {
        return Ok(Some(round));
    };
    let n = Names::of(table);
    let err = |e| crate::store::db_error("partition retention", table, e);
    // Our partitions of the table (attached) and our tables detached and not yet dropped.
    let parts: Vec<(String, bool)> = sqlx::query_as(
        "SELECT c.relname::text, c.relispartition FROM pg_class c \
         WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass($1)) \
           AND c.relkind = 'r' AND c.relname LIKE $2 ORDER BY c.relname",
    )
    .bind(table)
    .bind(format!("{}\\_p%", n.base))
    .fetch_all(pool)
    .await
    .map_err(err)?;
    let cutoff: NaiveDate = sqlx::query_scalar(
        "SELECT ((now() - $1 * interval '1 millisecond') AT TIME ZONE 'UTC')::date",
    )
    .bind(crate::store::millis(horizon) as f64)
    .fetch_one(pool)
    .await
    .map_err(err)?;
    let stay = must_stay(retention);
    for (name, attached) in parts {
        let Some(day) = n.day_of(&name) else { continue };
        // The partition holds [day, day + 1): wholly older than the horizon when day + 1 <=
        // the cutoff's date.
        if day
            .checked_add_days(Days::new(1))
            .is_none_or(|end| end > cutoff)
        {
            continue;
        }
        let part = format!("{}{name}", n.schema);
        if attached {
            round.carried += carry_forward(pool, table, &part, &stay).await?;
            let detach = format!("ALTER TABLE {table} DETACH PARTITION {part}");
            if !with_lock_timeout(pool, table, &detach).await? {
                tracing::debug!(partition = %part, "parent table busy; detaching next round");
                continue;
            }
        }
        let (archived, dropped) = finish_detached(pool, table, &part, &stay, retention).await?;
        round.archived += archived;
        round.deleted += dropped;
        round.dropped += 1;
        tracing::info!(partition = %part, archived, deleted = dropped, "dropped a day partition past retention");
    }
    Ok(Some(round))
}

/// Carry the rows of attached partition `part` that must stay into today's partition, chunk by
/// chunk, skipping rows another transaction holds (the next round sees them). Returns the rows
/// carried.
async fn carry_forward(
    pool: &PgPool,
    table: &str,
    part: &str,
    stay: &str,
) -> Result<u64, StoreError> {
    let err = |e| crate::store::db_error("partition retention", table, e);
    let mut carried = 0;
    loop {
        let mut tx = pool.begin().await.map_err(err)?;
        let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {part} WHERE {stay} LIMIT {CHUNK} FOR UPDATE SKIP LOCKED"
        )))
        .fetch_all(&mut *tx)
        .await
        .map_err(err)?;
        if ids.is_empty() {
            tx.rollback().await.map_err(err)?;
            return Ok(carried);
        }
        // Through the parent: PostgreSQL moves an updated row to the partition its new key
        // belongs in.
        let moved = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {table} SET partitioned_at = now() WHERE id = ANY($1) \
             AND tableoid = to_regclass($2)"
        )))
        .bind(&ids)
        .bind(part)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        carried += moved.rows_affected();
        if ids.len() < CHUNK as usize {
            return Ok(carried);
        }
    }
}

/// Finish a detached partition in one transaction: rows of states ruled `archive` copied to the
/// archive, rows that must stay after all (changed between the carry and the detach) put back
/// into the table, the partition dropped. Returns (archived, deleted) rows.
async fn finish_detached(
    pool: &PgPool,
    table: &str,
    part: &str,
    stay: &str,
    retention: &Retention,
) -> Result<(u64, u64), StoreError> {
    let err = |e| crate::store::db_error("partition retention", table, e);
    let mut tx = pool.begin().await.map_err(err)?;
    let back = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} ({KEPT_COLUMNS}, partitioned_at) \
         SELECT {KEPT_COLUMNS}, now() FROM {part} WHERE {stay}"
    )))
    .execute(&mut *tx)
    .await
    .map_err(err)?
    .rows_affected();
    if back > 0 {
        tracing::warn!(partition = %part, rows = back, "rows that must stay were put back from a detached partition");
        sqlx::query(AssertSqlSafe(format!("DELETE FROM {part} WHERE {stay}")))
            .execute(&mut *tx)
            .await
            .map_err(err)?;
    }
    // What is left may go; the rows of states ruled `archive` go to the archive first.
    let archived_rows: Vec<String> = Finished::ALL
        .iter()
        .filter(|&&state| {
            let rule = retention.rule(state);
            rule.after.is_some() && rule.action == RetentionAction::Archive
        })
        .map(|&state| format!("({})", finished(state).0))
        .collect();
    let archived = if archived_rows.is_empty() {
        0
    } else {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table}_archive ({ARCHIVED_COLUMNS}, archived_at, archive_reason) \
             SELECT {ARCHIVED_COLUMNS}, now(), 'retention' FROM {part} WHERE {}",
            archived_rows.join(" OR ")
        )))
        .execute(&mut *tx)
        .await
        .map_err(err)?
        .rows_affected()
    };
    let total: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {part}")))
        .fetch_one(&mut *tx)
        .await
        .map_err(err)?;
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {part}")))
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    tx.commit().await.map_err(err)?;
    Ok((archived, (total.max(0) as u64).saturating_sub(archived)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_names_round_trip_and_ignore_others() {
        let n = Names::of("app.outbox");
        let d = NaiveDate::from_ymd_opt(2026, 12, 3).unwrap();
        assert_eq!(n.day(d), "app.outbox_p20261203");
        assert_eq!(n.day_of("outbox_p20261203"), Some(d));
        assert_eq!(n.day_of("outbox_default"), None);
        assert_eq!(n.day_of("outbox_pending"), None);
        assert_eq!(n.day_of("other_p20261203"), None);
    }
}
