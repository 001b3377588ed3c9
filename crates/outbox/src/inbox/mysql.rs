//! The inbox's SQL on MySQL/MariaDB.

use uuid::Uuid;

use super::InboxSql;
use crate::ident::TableName;

super::backend::inbox_backend!(sqlx::MySql, sqlx::MySqlConnection, mysql);

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
        insert_many: None,
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
