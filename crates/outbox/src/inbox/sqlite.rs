//! The inbox's SQL on SQLite.

use uuid::Uuid;

use super::InboxSql;
use crate::ident::TableName;

super::backend::inbox_backend!(
    sqlx::Sqlite,
    sqlx::SqliteConnection,
    sqlite,
    insert_many = insert_many
);

/// The inbox rows of `msgs` in multi-row inserts (of up to
/// [`INSERT_ROWS`](super::backend::INSERT_ROWS) rows, `ON CONFLICT DO NOTHING RETURNING
/// message_id`): which messages are new, the first of two copies of one id.
async fn insert_many(
    conn: &mut sqlx::SqliteConnection,
    sql: &InboxSql,
    consumer: &str,
    msgs: &[&crate::InboundMessage],
) -> Result<Vec<bool>, sqlx::Error> {
    let prefix = &*sql.insert_many;
    let mut new = std::collections::HashSet::new();
    for chunk in msgs.chunks(super::backend::INSERT_ROWS) {
        let statement = format!(
            "{prefix} {} ON CONFLICT DO NOTHING RETURNING message_id",
            super::backend::values_rows(chunk.len())
        );
        let mut q = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(statement));
        for m in chunk {
            q = q
                .bind(consumer)
                .bind(message_id(m.message_id))
                .bind(&m.topic);
        }
        new.extend(q.fetch_all(&mut *conn).await?);
    }
    Ok(msgs
        .iter()
        .map(|m| new.remove(&message_id(m.message_id)))
        .collect())
}

/// SQLite stores message ids as text.
fn message_id(id: Uuid) -> String {
    id.to_string()
}

/// The database's clock in Unix milliseconds.
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

fn sql(table: &TableName) -> InboxSql {
    let t = table.as_str();
    let by_key = "WHERE consumer = ?1 AND message_id = ?2";
    InboxSql {
        insert: format!(
            "INSERT INTO {t} (consumer, message_id, topic, outcome, reason) VALUES (?1, ?2, ?3, ?4, ?5) \
             ON CONFLICT DO NOTHING"
        )
        .into(),
        insert_many: format!("INSERT INTO {t} (consumer, message_id, topic, outcome, reason) VALUES").into(),
        verdict: format!("SELECT outcome, reason FROM {t} {by_key}").into(),
        insert_dead_letter: format!(
            "INSERT INTO {t}_dlq (consumer, message_id, topic, partition_key, headers, payload, error, deliveries) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
             ON CONFLICT (consumer, message_id) DO UPDATE SET error = excluded.error, \
             deliveries = excluded.deliveries, failed_at = {NOW_MS}, replay_requested_at = NULL"
        )
        .into(),
        dead_letters: format!(
            "SELECT message_id, topic, partition_key, headers, CAST(payload AS BLOB), error, deliveries, \
             replay_requested_at IS NOT NULL FROM {t}_dlq \
             WHERE consumer = ?1 AND (NOT ?2 OR replay_requested_at IS NOT NULL) \
             ORDER BY failed_at DESC LIMIT ?3"
        )
        .into(),
        request_replay: format!("UPDATE {t}_dlq SET replay_requested_at = {NOW_MS} {by_key}").into(),
        clear_replay: format!("UPDATE {t}_dlq SET replay_requested_at = NULL {by_key}").into(),
        forget: [
            format!("DELETE FROM {t}_dlq {by_key}").into(),
            format!("DELETE FROM {t} {by_key}").into(),
        ],
        purge: format!(
            "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE received_at < {NOW_MS} - ?1 LIMIT ?2)"
        )
        .into(),
    }
}
