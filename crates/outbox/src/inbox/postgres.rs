//! The inbox's SQL on PostgreSQL.

use uuid::Uuid;

use super::InboxSql;
use crate::ident::TableName;

super::backend::inbox_backend!(sqlx::Postgres, sqlx::PgConnection, postgres);

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
