//! The inbox's SQL on PostgreSQL.

use futures::future::BoxFuture;
use sqlx::{AssertSqlSafe, Pool};
use uuid::Uuid;

use super::{InboxBackend, PgRow, Row, VerdictRow, headers_json};
use crate::error::StoreError;
use crate::ident::TableName;
use crate::message::InboundMessage;

impl InboxBackend for sqlx::Postgres {
    fn insert<'c>(
        conn: &'c mut sqlx::PgConnection,
        table: &'c str,
        consumer: &'c str,
        msg: &'c InboundMessage,
        rejected: Option<&'c str>,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_id, topic, outcome, reason) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT DO NOTHING"
            )))
            .bind(consumer)
            .bind(msg.message_id)
            .bind(&msg.topic)
            .bind(i16::from(rejected.is_some()))
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
            let r: Option<(i16, Option<String>)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT outcome, reason FROM {table} WHERE consumer = $1 AND message_id = $2"
            )))
            .bind(consumer)
            .bind(id)
            .fetch_optional(pool)
            .await?;
            Ok(r.map(|(o, r)| (i64::from(o), r)))
        })
    }

    fn insert_dead_letter<'c>(
        conn: &'c mut sqlx::PgConnection,
        table: &'c str,
        consumer: &'c str,
        msg: &'c InboundMessage,
        error: &'c str,
        deliveries: u32,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table}_dlq (consumer, message_id, topic, partition_key, headers, payload, error, deliveries) \
                 VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8) \
                 ON CONFLICT (consumer, message_id) DO UPDATE SET error = EXCLUDED.error, \
                 deliveries = EXCLUDED.deliveries, failed_at = now(), replay_requested_at = NULL"
            )))
            .bind(consumer)
            .bind(msg.message_id)
            .bind(&msg.topic)
            .bind(&msg.partition_key)
            .bind(headers_json(&msg.headers))
            .bind(&msg.payload)
            .bind(error)
            .bind(i32::try_from(deliveries).unwrap_or(i32::MAX))
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
            let rows: Vec<PgRow> =
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT message_id::text, topic, partition_key, headers::text, payload, error, deliveries, \
                     replay_requested_at IS NOT NULL FROM {table}_dlq \
                     WHERE consumer = $1 AND (NOT $2 OR replay_requested_at IS NOT NULL) \
                     ORDER BY failed_at DESC LIMIT $3"
                )))
                .bind(consumer)
                .bind(replay_only)
                .bind(i64::from(limit))
                .fetch_all(pool)
                .await?;
            Ok(rows
                .into_iter()
                .map(|(a, b, c, d, e, f, g, h)| (a, b, c, d, e, f, i64::from(g), h))
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
                "UPDATE {table}_dlq SET replay_requested_at = CASE WHEN $3 THEN now() ELSE NULL END \
                 WHERE consumer = $1 AND message_id = $2"
            )))
            .bind(consumer)
            .bind(id)
            .bind(requested)
            .execute(pool)
            .await?;
            Ok(r.rows_affected())
        })
    }

    fn forget<'c>(
        conn: &'c mut sqlx::PgConnection,
        table: &'c str,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "WITH d AS (DELETE FROM {table}_dlq WHERE consumer = $1 AND message_id = $2) \
                 DELETE FROM {table} WHERE consumer = $1 AND message_id = $2"
            )))
            .bind(consumer)
            .bind(id)
            .execute(conn)
            .await?;
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
                "DELETE FROM {table} WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM {table} \
                 WHERE received_at < now() - make_interval(secs => $1::float8 / 1000) LIMIT $2 FOR UPDATE SKIP LOCKED)"
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
        Box::pin(crate::store::postgres::migrations::run_migrations(
            pool,
            crate::store::postgres::migrations::inbox_migrations(table),
        ))
    }
}
