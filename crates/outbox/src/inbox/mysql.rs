//! The inbox's SQL on MySQL/MariaDB.

use uuid::Uuid;

use super::InboxSql;
use crate::ident::TableName;

super::backend::inbox_backend!(
    sqlx::MySql,
    sqlx::MySqlConnection,
    mysql,
    insert_many = insert_many
);

/// The inbox rows of `msgs` in multi-row `INSERT IGNORE` statements (of up to
/// [`INSERT_ROWS`](super::backend::INSERT_ROWS) rows) after a savepoint, two round trips for a
/// batch of new messages instead of one per message. MySQL has no `RETURNING`: when the
/// statements inserted a row for every distinct id, every message is new (the first of two
/// copies of one id); when they inserted fewer (some messages were recorded already, or a
/// concurrent copy committed first), the transaction goes back to the savepoint and inserts one
/// row per message, which tells each one apart.
async fn insert_many(
    conn: &mut sqlx::MySqlConnection,
    sql: &InboxSql,
    consumer: &str,
    msgs: &[&crate::InboundMessage],
) -> Result<Vec<bool>, sqlx::Error> {
    use sqlx::Executor as _;
    let prefix = &*sql.insert_many;
    let mut seen = std::collections::HashSet::new();
    let first: Vec<bool> = msgs.iter().map(|m| seen.insert(m.message_id)).collect();
    let distinct: Vec<&crate::InboundMessage> = msgs
        .iter()
        .zip(&first)
        .filter_map(|(m, f)| f.then_some(*m))
        .collect();
    conn.execute("SAVEPOINT outbox_inbox_batch").await?;
    let mut inserted = 0;
    for chunk in distinct.chunks(super::backend::INSERT_ROWS) {
        let statement = format!("{prefix} {}", super::backend::values_rows(chunk.len()));
        let mut q = sqlx::query(sqlx::AssertSqlSafe(statement));
        for m in chunk {
            q = q
                .bind(consumer)
                .bind(message_id(m.message_id))
                .bind(&m.topic);
        }
        inserted += q.execute(&mut *conn).await?.rows_affected();
    }
    if inserted == distinct.len() as u64 {
        return Ok(first);
    }
    conn.execute("ROLLBACK TO SAVEPOINT outbox_inbox_batch")
        .await?;
    let mut fresh = Vec::with_capacity(msgs.len());
    for m in msgs {
        fresh.push(
            <sqlx::MySql as super::InboxBackend>::insert(&mut *conn, sql, consumer, m, None)
                .await?,
        );
    }
    Ok(fresh)
}

/// MySQL stores message ids as `CHAR(36)`, hyphenated.
fn message_id(id: Uuid) -> String {
    id.hyphenated().to_string()
}

fn sql(table: &TableName) -> InboxSql {
    let t = table.as_str();
    let by_key = "WHERE consumer = ? AND message_id = ?";
    InboxSql {
        // INSERT IGNORE: a duplicate key inserts nothing (0 rows); a concurrent insert of the
        // same key waits for the first transaction and then counts as a duplicate. (ON
        // DUPLICATE KEY UPDATE cannot tell: sqlx sets CLIENT_FOUND_ROWS.)
        insert: format!(
            "INSERT IGNORE INTO {t} (consumer, message_id, topic, outcome, reason) VALUES (?, ?, ?, ?, ?)"
        )
        .into(),
        insert_many: format!("INSERT IGNORE INTO {t} (consumer, message_id, topic, outcome, reason) VALUES").into(),
        verdict: format!("SELECT outcome, reason FROM {t} {by_key}").into(),
        insert_dead_letter: format!(
            "INSERT INTO {t}_dlq (consumer, message_id, topic, partition_key, headers, payload, error, deliveries) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
             ON DUPLICATE KEY UPDATE error = VALUES(error), deliveries = VALUES(deliveries), \
             failed_at = UTC_TIMESTAMP(6), replay_requested_at = NULL"
        )
        .into(),
        dead_letters: format!(
            "SELECT message_id, topic, partition_key, headers, payload, error, deliveries, \
             CASE WHEN replay_requested_at IS NULL THEN 0 ELSE 1 END FROM {t}_dlq \
             WHERE consumer = ? AND (? = 0 OR replay_requested_at IS NOT NULL) \
             ORDER BY failed_at DESC LIMIT ?"
        )
        .into(),
        request_replay: format!("UPDATE {t}_dlq SET replay_requested_at = UTC_TIMESTAMP(6) {by_key}")
            .into(),
        clear_replay: format!("UPDATE {t}_dlq SET replay_requested_at = NULL {by_key}").into(),
        forget: [
            format!("DELETE FROM {t}_dlq {by_key}").into(),
            format!("DELETE FROM {t} {by_key}").into(),
        ],
        purge: format!(
            "DELETE FROM {t} WHERE received_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND LIMIT ?"
        )
        .into(),
    }
}
