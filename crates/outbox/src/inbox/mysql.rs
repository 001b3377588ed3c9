//! The inbox's SQL on MySQL/MariaDB.

use futures::future::BoxFuture;
use sqlx::{AssertSqlSafe, Pool};
use uuid::Uuid;

use super::{InboxBackend, Row, VerdictRow, headers_json};
use crate::error::StoreError;
use crate::ident::TableName;
use crate::message::InboundMessage;

impl InboxBackend for sqlx::MySql {
    fn insert<'c>(
        conn: &'c mut sqlx::MySqlConnection,
        table: &'c str,
        consumer: &'c str,
        msg: &'c InboundMessage,
        rejected: Option<&'c str>,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            // INSERT IGNORE: a duplicate key inserts nothing (0 rows); a concurrent insert of the
            // same key waits for the first transaction and then counts as a duplicate. (ON
            // DUPLICATE KEY UPDATE cannot tell: sqlx sets CLIENT_FOUND_ROWS.)
            let r = sqlx::query(AssertSqlSafe(format!(
                "INSERT IGNORE INTO {table} (consumer, message_id, topic, outcome, reason) VALUES (?, ?, ?, ?, ?)"
            )))
            .bind(consumer)
            .bind(msg.message_id.hyphenated().to_string())
            .bind(&msg.topic)
            .bind(i64::from(rejected.is_some()))
            .bind(rejected)
            .execute(conn)
            .await?;
            Ok(r.rows_affected() == 1)
        })
    }

    fn verdict<'c>(
        pool: &'c Pool<Self>,
        table: &'c str,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, Result<Option<VerdictRow>, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT outcome, reason FROM {table} WHERE consumer = ? AND message_id = ?"
            )))
            .bind(consumer)
            .bind(id.hyphenated().to_string())
            .fetch_optional(pool)
            .await
        })
    }

    fn insert_dead_letter<'c>(
        conn: &'c mut sqlx::MySqlConnection,
        table: &'c str,
        consumer: &'c str,
        msg: &'c InboundMessage,
        error: &'c str,
        deliveries: u32,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table}_dlq (consumer, message_id, topic, partition_key, headers, payload, error, deliveries) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
                 ON DUPLICATE KEY UPDATE error = VALUES(error), deliveries = VALUES(deliveries), \
                 failed_at = UTC_TIMESTAMP(6), replay_requested_at = NULL"
            )))
            .bind(consumer)
            .bind(msg.message_id.hyphenated().to_string())
            .bind(&msg.topic)
            .bind(&msg.partition_key)
            .bind(headers_json(&msg.headers))
            .bind(&msg.payload)
            .bind(error)
            .bind(i64::from(deliveries))
            .execute(conn)
            .await?;
            Ok(())
        })
    }

    fn dead_letters<'c>(
        pool: &'c Pool<Self>,
        table: &'c str,
        consumer: &'c str,
        replay_only: bool,
        limit: u32,
    ) -> BoxFuture<'c, Result<Vec<Row>, sqlx::Error>> {
        Box::pin(async move {
            type MyRow = (
                String,
                String,
                Option<String>,
                String,
                Vec<u8>,
                String,
                i64,
                i64,
            );
            let rows: Vec<MyRow> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT message_id, topic, partition_key, headers, payload, error, deliveries, \
                 CASE WHEN replay_requested_at IS NULL THEN 0 ELSE 1 END FROM {table}_dlq \
                 WHERE consumer = ? AND (? = 0 OR replay_requested_at IS NOT NULL) \
                 ORDER BY failed_at DESC LIMIT ?"
            )))
            .bind(consumer)
            .bind(i64::from(replay_only))
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(a, b, c, d, e, f, g, h)| (a, b, c, d, e, f, g, h != 0))
                .collect())
        })
    }

    fn set_replay<'c>(
        pool: &'c Pool<Self>,
        table: &'c str,
        consumer: &'c str,
        id: Uuid,
        requested: bool,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {table}_dlq SET replay_requested_at = CASE WHEN ? THEN UTC_TIMESTAMP(6) ELSE NULL END \
                 WHERE consumer = ? AND message_id = ?"
            )))
            .bind(requested)
            .bind(consumer)
            .bind(id.hyphenated().to_string())
            .execute(pool)
            .await?;
            Ok(r.rows_affected())
        })
    }

    fn forget<'c>(
        conn: &'c mut sqlx::MySqlConnection,
        table: &'c str,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let id = id.hyphenated().to_string();
            for t in [format!("{table}_dlq"), table.to_owned()] {
                sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {t} WHERE consumer = ? AND message_id = ?"
                )))
                .bind(consumer)
                .bind(&id)
                .execute(&mut *conn)
                .await?;
            }
            Ok(())
        })
    }

    fn purge<'c>(
        pool: &'c Pool<Self>,
        table: &'c str,
        older_than_ms: i64,
        limit: u32,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE received_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND LIMIT ?"
            )))
            .bind(older_than_ms)
            .bind(i64::from(limit))
            .execute(pool)
            .await?;
            Ok(r.rows_affected())
        })
    }

    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(crate::store::mysql::migrations::run_migrations(
            pool,
            crate::store::mysql::migrations::inbox_migrations(table),
        ))
    }
}
