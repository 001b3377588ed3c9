//! The raw-SQL relay loops the relay is compared with, written as directly as possible: one
//! loop, one connection at a time, no library code but the transport:
//!
//! ```text
//! loop {
//!     claim:   UPDATE t SET status = 1, lease_expires_at = now() + 30 s
//!              WHERE id IN (SELECT id FROM t WHERE status = 0 AND available_at <= now()
//!                           ORDER BY available_at, id LIMIT 500 FOR UPDATE SKIP LOCKED)
//!              RETURNING id, message_id, topic, payload
//!     publish: the same Transport the relay uses, the whole batch pipelined, await every ack
//!     mark:    UPDATE t SET status = 2, sent_at = now() WHERE id = ANY(ids)
//! }
//! ```
//!
//! Each loop runs on a copy of the outbox table (same rows, same columns) with only a primary
//! key and its claim index: **naive**, `(status, available_at)`; **tuned**, a partial index
//! `(available_at, id) WHERE status = 0`. On SQLite and MySQL/MariaDB a third copy keeps every
//! index of the relay's table beside the naive claim index (**relay-indexes**): what the index
//! set alone costs the same loop. MySQL/MariaDB has no `UPDATE … RETURNING` (the claim is
//! `SELECT … FOR UPDATE SKIP LOCKED` then `UPDATE` in one transaction) and no partial index (no
//! tuned loop); SQLite has no `SKIP LOCKED` (one writer at a time anyway).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, bail};
use outbox::{Message, Outgoing, Transport};
use sqlx::{AssertSqlSafe, Row};
use uuid::Uuid;

use super::db::{Db, Dialect, Pool};

/// SQLite's clock in integer milliseconds since the Unix epoch (the store's own expression).
const SQLITE_NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

/// The claim index of a baseline table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Index {
    /// `(status, available_at)`.
    Naive,
    /// `(available_at, id) WHERE status = 0`.
    Tuned,
    /// `(status, available_at)` and every index of the relay's table (search, retention,
    /// two-phase, key heads).
    RelayIndexes,
}

impl Index {
    /// `raw-naive` or `raw-tuned`.
    pub fn name(self) -> &'static str {
        match self {
            Index::Naive => "raw-naive",
            Index::Tuned => "raw-tuned",
            Index::RelayIndexes => "raw-relay-indexes",
        }
    }
}

/// A fresh random message id in SQL, so a copy's messages are not dropped by a broker that
/// deduplicates by id (JetStream's duplicate window) as repeats of the original's.
fn new_uuid_sql(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Postgres => "gen_random_uuid()",
        Dialect::MySql => "UUID()",
        Dialect::Sqlite => {
            "lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || \
             substr(hex(randomblob(2)), 2) || '-' || substr('89ab', 1 + abs(random()) % 4, 1) || \
             substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))"
        }
    }
}

/// The column list of `table`, in order.
async fn columns(db: &Db, table: &str) -> anyhow::Result<Vec<String>> {
    Ok(match &db.control {
        Pool::Pg(p) => {
            sqlx::query_scalar(
                "SELECT attname::text FROM pg_attribute WHERE attrelid = $1::text::regclass \
                 AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            )
            .bind(table)
            .fetch_all(p)
            .await?
        }
        Pool::My(p) => {
            sqlx::query_scalar(
                "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = ? ORDER BY ordinal_position",
            )
            .bind(table)
            .fetch_all(p)
            .await?
        }
        Pool::Lite(p) => {
            sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                .bind(table)
                .fetch_all(p)
                .await?
        }
    })
}

/// The `SELECT` list copying `columns` with a fresh `message_id`.
fn copy_list(columns: &[String], new_uuid: &str) -> String {
    columns
        .iter()
        .map(|c| {
            if c == "message_id" {
                format!("{new_uuid} AS message_id")
            } else {
                c.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Copy outbox table `src` into `dst` (same rows and columns, fresh message ids) with a primary
/// key and `index`, on a pool of its own (retired afterwards, so PostgreSQL's counters include
/// the copy). `Ok(false)` when the database has no such index (a partial index on
/// MySQL/MariaDB).
///
/// # Errors
/// The failing DDL statement.
pub async fn prepare(db: &Db, src: &str, dst: &str, index: Index) -> anyhow::Result<bool> {
    let flat = dst.rsplit('.').next().unwrap_or(dst);
    let claim_index = match index {
        Index::Naive | Index::RelayIndexes => "(status, available_at)",
        Index::Tuned => "(available_at, id) WHERE status = 0",
    };
    match (db.dialect, index) {
        (Dialect::MySql, Index::Tuned) | (Dialect::Postgres, Index::RelayIndexes) => {
            return Ok(false);
        }
        _ => {}
    }
    let cols = columns(db, src).await?;
    let select = format!(
        "SELECT {} FROM {src}",
        copy_list(&cols, new_uuid_sql(db.dialect))
    );
    let sql = match (db.dialect, index) {
        (Dialect::MySql, Index::RelayIndexes) => {
            // `LIKE` keeps the indexes and the generated `bucket`, which takes no value.
            let Pool::My(p) = &db.control else {
                bail!("not a MySQL database");
            };
            let generated: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = ? AND extra LIKE '%GENERATED%'",
            )
            .bind(src)
            .fetch_all(p)
            .await?;
            let cols: Vec<String> = cols
                .into_iter()
                .filter(|c| !generated.contains(c))
                .collect();
            vec![
                format!("CREATE TABLE {dst} LIKE {src}"),
                format!("ALTER TABLE {dst} ADD KEY {flat}_claim (status, available_at)"),
                format!(
                    "INSERT INTO {dst} ({}) SELECT {} FROM {src}",
                    cols.join(", "),
                    copy_list(&cols, new_uuid_sql(db.dialect))
                ),
            ]
        }
        (Dialect::Sqlite, Index::RelayIndexes) => {
            // The table's own definition (its generated `bucket` and constraints), its
            // indexes, the claim index, then the rows (`pragma_table_info` leaves the
            // generated column out of `cols`).
            let mut sql = sqlite_schema(db, src, dst).await?;
            sql.push(format!("CREATE INDEX {flat}_claim ON {dst} {claim_index}"));
            sql.push(format!("INSERT INTO {dst} ({}) {select}", cols.join(", ")));
            sql
        }
        (Dialect::MySql, _) => vec![format!(
            "CREATE TABLE {dst} (PRIMARY KEY (id), KEY {flat}_claim (status, available_at)) \
             ENGINE=InnoDB {select}"
        )],
        (Dialect::Postgres, _) => vec![
            format!("CREATE TABLE {dst} AS {select}"),
            format!("ALTER TABLE {dst} ADD PRIMARY KEY (id)"),
            format!("CREATE INDEX {flat}_claim ON {dst} {claim_index}"),
        ],
        (Dialect::Sqlite, _) => vec![
            format!("CREATE TABLE {dst} AS {select}"),
            format!("CREATE UNIQUE INDEX {flat}_id ON {dst} (id)"),
            format!("CREATE INDEX {flat}_claim ON {dst} {claim_index}"),
        ],
    };
    let pool = db.pool("copy", false, 1).await?;
    for s in &sql {
        let q = sqlx::raw_sql(AssertSqlSafe(s.clone()));
        match &pool.pool {
            Pool::Pg(p) => q.execute(p).await.map(drop),
            Pool::My(p) => q.execute(p).await.map(drop),
            Pool::Lite(p) => q.execute(p).await.map(drop),
        }
        .with_context(|| format!("failed: {s}"))?;
    }
    db.retire(pool).await?;
    Ok(true)
}

/// The statements that give SQLite table `dst` the definition of `src` (its `CREATE TABLE`
/// text under the new name: columns, generated columns, constraints) and every index declared
/// on it (each one's own text, partial ones keeping their `WHERE`, under a new name). Indexes
/// behind constraints come with the table.
async fn sqlite_schema(db: &Db, src: &str, dst: &str) -> anyhow::Result<Vec<String>> {
    let Pool::Lite(p) = &db.control else {
        bail!("not a SQLite database");
    };
    let objects: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT type, name, sql FROM sqlite_master \
         WHERE tbl_name = ?1 AND type IN ('table', 'index') AND sql IS NOT NULL \
         ORDER BY type = 'index', name",
    )
    .bind(src)
    .fetch_all(p)
    .await?;
    let flat = dst.rsplit('.').next().unwrap_or(dst);
    let mut out = Vec::new();
    for (k, (kind, name, sql)) in objects.into_iter().enumerate() {
        // `CREATE TABLE name (…)` / `CREATE [UNIQUE] INDEX name ON table (…) [WHERE …]`: keep
        // from the `(` (of the column list, after `ON` for an index).
        let from = if kind == "index" {
            sql.find(" ON ")
                .with_context(|| format!("index {name}: no ON in {sql}"))?
        } else {
            0
        };
        let open = sql[from..]
            .find('(')
            .with_context(|| format!("{kind} {name}: no column list in {sql}"))?;
        let tail = &sql[from + open..];
        out.push(if kind == "index" {
            let unique = if sql.to_ascii_uppercase().starts_with("CREATE UNIQUE") {
                "UNIQUE "
            } else {
                ""
            };
            format!("CREATE {unique}INDEX {flat}_r{k} ON {dst} {tail}")
        } else {
            format!("CREATE TABLE {dst} {tail}")
        });
    }
    Ok(out)
}

/// Claimed rows: id, message id, topic, payload.
type Rows = Vec<(i64, Uuid, String, Vec<u8>)>;

/// Claim up to `batch` rows of `table`.
async fn claim(pool: &Pool, table: &str, batch: u32) -> anyhow::Result<Rows> {
    let limit = i64::from(batch);
    Ok(match pool {
        Pool::Pg(p) => {
            sqlx::query_as(AssertSqlSafe(format!(
                "UPDATE {table} SET status = 1, lease_expires_at = now() + interval '30 seconds' \
                 WHERE id IN (SELECT id FROM {table} WHERE status = 0 AND available_at <= now() \
                              ORDER BY available_at, id LIMIT $1 FOR UPDATE SKIP LOCKED) \
                 RETURNING id, message_id, topic, payload"
            )))
            .bind(limit)
            .fetch_all(p)
            .await?
        }
        Pool::My(p) => {
            let mut tx = p.begin().await?;
            let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT id, message_id, topic, payload FROM {table} \
                 WHERE status = 0 AND available_at <= UTC_TIMESTAMP(6) \
                 ORDER BY available_at, id LIMIT ? FOR UPDATE SKIP LOCKED"
            )))
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
            let rows = decode_text_ids(rows)?;
            if !rows.is_empty() {
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {table} SET status = 1, \
                     lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND WHERE id IN ({})",
                    id_list(rows.iter().map(|r| r.0))
                )))
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            rows
        }
        Pool::Lite(p) => {
            let rows = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET status = 1, lease_expires_at = {SQLITE_NOW_MS} + 30000 \
                 WHERE id IN (SELECT id FROM {table} WHERE status = 0 AND available_at <= {SQLITE_NOW_MS} \
                              ORDER BY available_at, id LIMIT ?1) \
                 RETURNING id, message_id, topic, payload"
            )))
            .bind(limit)
            .fetch_all(p)
            .await?;
            decode_text_ids(rows)?
        }
    })
}

/// Rows whose message id is text (MySQL `CHAR(36)`, SQLite `TEXT`).
fn decode_text_ids<R: Row>(rows: Vec<R>) -> anyhow::Result<Rows>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    rows.iter()
        .map(|r| {
            let id: String = r.try_get(1)?;
            Ok((
                r.try_get(0)?,
                Uuid::parse_str(&id).with_context(|| format!("message id {id:?}"))?,
                r.try_get(2)?,
                r.try_get(3)?,
            ))
        })
        .collect()
}

/// `1,2,3`: ids are integers, so the list is safe to inline.
fn id_list(ids: impl Iterator<Item = i64>) -> String {
    ids.map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// Mark `ids` sent.
async fn mark(pool: &Pool, table: &str, ids: Vec<i64>) -> anyhow::Result<()> {
    let in_list = |now: &str| {
        AssertSqlSafe(format!(
            "UPDATE {table} SET status = 2, sent_at = {now} WHERE id IN ({})",
            id_list(ids.iter().copied())
        ))
    };
    match pool {
        Pool::Pg(p) => {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table} SET status = 2, sent_at = now() WHERE id = ANY($1)"
            )))
            .bind(&ids)
            .execute(p)
            .await?;
        }
        Pool::My(p) => {
            sqlx::query(in_list("UTC_TIMESTAMP(6)")).execute(p).await?;
        }
        Pool::Lite(p) => {
            sqlx::query(in_list(SQLITE_NOW_MS)).execute(p).await?;
        }
    }
    Ok(())
}

/// Drain `table` with the raw loop until a claim comes back empty, publishing through
/// `transport` to `destination` (`{topic}` replaced); `done` counts rows marked sent.
///
/// # Errors
/// A database error, or a message the broker did not acknowledge (the baseline would be
/// meaningless).
pub async fn run(
    pool: &Pool,
    table: &str,
    batch: u32,
    transport: &dyn Transport,
    destination: &str,
    done: &AtomicU64,
) -> anyhow::Result<()> {
    let mut destinations: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let rows = claim(pool, table, batch).await?;
        if rows.is_empty() {
            return Ok(());
        }
        let messages: Vec<Message> = rows
            .into_iter()
            .map(|(id, message_id, topic, payload)| Message {
                id,
                message_id,
                topic,
                partition_key: None,
                headers: Default::default(),
                payload,
                attempts: 1,
                max_attempts: 1,
                redelivery: 0,
            })
            .collect();
        for m in &messages {
            if !destinations.contains_key(&m.topic) {
                destinations.insert(m.topic.clone(), destination.replace("{topic}", &m.topic));
            }
        }
        let outgoing: Vec<Outgoing<'_>> = messages
            .iter()
            .map(|m| Outgoing {
                message: m,
                destination: &destinations[&m.topic],
            })
            .collect();
        let results = transport.publish(&outgoing).await;
        if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
            bail!("raw loop: the broker refused a message: {}", e.report());
        }
        let n = messages.len() as u64;
        mark(pool, table, messages.iter().map(|m| m.id).collect()).await?;
        done.fetch_add(n, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_get_fresh_message_ids() {
        let cols: Vec<String> = ["id", "message_id", "payload"].map(String::from).to_vec();
        assert_eq!(
            super::copy_list(&cols, "gen_random_uuid()"),
            "id, gen_random_uuid() AS message_id, payload"
        );
    }

    #[test]
    fn id_lists_are_plain_integers() {
        assert_eq!(super::id_list([1, 22, -3].into_iter()), "1,22,-3");
        assert_eq!(super::id_list(std::iter::empty()), "");
    }
}
