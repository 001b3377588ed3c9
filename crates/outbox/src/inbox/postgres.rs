//! The inbox's SQL on PostgreSQL.

use uuid::Uuid;

use super::InboxSql;
use crate::ident::TableName;

super::backend::inbox_backend!(
    sqlx::Postgres,
    sqlx::PgConnection,
    postgres,
    insert_many = insert_many
);

/// The inbox rows of `msgs` in one statement (`unnest` of the ids and topics, `ON CONFLICT DO
/// NOTHING RETURNING message_id`): which messages are new, the first of two copies of one id.
async fn insert_many(
    conn: &mut sqlx::PgConnection,
    sql: &InboxSql,
    consumer: &str,
    msgs: &[&crate::InboundMessage],
) -> Result<Vec<bool>, sqlx::Error> {
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.message_id).collect();
    let topics: Vec<&str> = msgs.iter().map(|m| m.topic.as_str()).collect();
    let inserted: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.insert_many.clone()))
        .bind(consumer)
        .bind(&ids)
        .bind(&topics)
        .fetch_all(conn)
        .await?;
    let mut new: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
    Ok(ids.iter().map(|id| new.remove(id)).collect())
}

/// PostgreSQL stores message ids as `uuid`.
fn message_id(id: Uuid) -> Uuid {
    id
}

fn sql(table: &TableName) -> InboxSql {
    let t = table.as_str();
    let by_key = "WHERE consumer = $1 AND message_id = $2";
    InboxSql {
        insert: format!(
            "INSERT INTO {t} (consumer, message_id, topic, outcome, reason) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT DO NOTHING"
        )
        .into(),
        insert_many: format!(
            "INSERT INTO {t} (consumer, message_id, topic, outcome, reason) \
             SELECT $1, m, tp, 0, NULL FROM unnest($2::uuid[], $3::text[]) AS u(m, tp) \
             ON CONFLICT DO NOTHING RETURNING message_id"
        )
        .into(),
        verdict: format!("SELECT outcome::int8, reason FROM {t} {by_key}").into(),
        insert_dead_letter: format!(
            "INSERT INTO {t}_dlq (consumer, message_id, topic, partition_key, headers, payload, error, deliveries) \
             VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8) \
             ON CONFLICT (consumer, message_id) DO UPDATE SET error = EXCLUDED.error, \
             deliveries = EXCLUDED.deliveries, failed_at = now(), replay_requested_at = NULL"
        )
        .into(),
        dead_letters: format!(
            "SELECT message_id::text, topic, partition_key, headers::text, payload, error, deliveries::int8, \
             (CASE WHEN replay_requested_at IS NULL THEN 0 ELSE 1 END)::int8 FROM {t}_dlq \
             WHERE consumer = $1 AND (NOT $2 OR replay_requested_at IS NOT NULL) \
             ORDER BY failed_at DESC LIMIT $3"
        )
        .into(),
        request_replay: format!("UPDATE {t}_dlq SET replay_requested_at = now() {by_key}").into(),
        clear_replay: format!("UPDATE {t}_dlq SET replay_requested_at = NULL {by_key}").into(),
        forget: [
            format!("DELETE FROM {t}_dlq {by_key}").into(),
            format!("DELETE FROM {t} {by_key}").into(),
        ],
        purge: format!(
            "DELETE FROM {t} WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM {t} \
             WHERE received_at < now() - make_interval(secs => $1::float8 / 1000) LIMIT $2 FOR UPDATE SKIP LOCKED)"
        )
        .into(),
    }
}
