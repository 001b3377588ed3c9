//! The inbox's admin statements: consumers with dead letters, the dead letters, replay and discard.

use super::{ACTION_CHUNK, Admin, Arg, MAX_PAGE, RenderedPayload, Sql, at};
use crate::admin_model::inbox::{
    ConsumerDeadLetters, InboxAction, InboxActionReport, InboxDeadLetter,
};
use crate::store::StoreError;
use sqlx::Row;

admin_impl! {
    /// Every consumer of the inbox `self.table` with dead letters, most first.
    pub(super) async fn inbox_consumers(&self) -> Result<Vec<ConsumerDeadLetters>, StoreError> {
        let (d, t) = (self.d, self.table);
        let sql = Sql::new(
            d,
            format!(
                "SELECT consumer, {count}, {replays}, {oldest}, {newest} FROM {t}_dlq \
                 GROUP BY consumer ORDER BY 2 DESC, consumer LIMIT {MAX_PAGE}",
                count = (d.int)("COUNT(*)"),
                replays = (d.int)("SUM(CASE WHEN replay_requested_at IS NULL THEN 0 ELSE 1 END)"),
                oldest = (d.ms)("MIN(failed_at)"),
                newest = (d.ms)("MAX(failed_at)"),
            ),
        );
        self.fetch("inbox dead letters", &sql, |row| {
            Ok(ConsumerDeadLetters {
                consumer: row.try_get(0)?,
                dead_letters: u64::try_from(row.try_get::<i64, _>(1)?).unwrap_or(0),
                replay_requested: u64::try_from(row.try_get::<i64, _>(2)?).unwrap_or(0),
                oldest_failed_at: at(row.try_get(3)?),
                newest_failed_at: at(row.try_get(4)?),
            })
        })
        .await
    }

    /// Dead letters of the inbox `self.table`, newest first; with headers and payload when one
    /// message id is asked for.
    pub(super) async fn inbox_dead_letters(
        &self,
        consumer: Option<&str>,
        message_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<InboxDeadLetter>, StoreError> {
        let (d, t) = (self.d, self.table);
        let full = message_id.is_some();
        let extra = if full {
            format!(", {}, payload", (d.text)("headers"))
        } else {
            String::new()
        };
        let mut sql = Sql::new(
            d,
            format!(
                "SELECT consumer, {mid}, topic, partition_key, error, {deliveries}, {failed}, \
                 {replay}{extra} FROM {t}_dlq WHERE 1 = 1",
                mid = (d.text)("message_id"),
                deliveries = (d.int)("deliveries"),
                failed = (d.ms)("failed_at"),
                replay = (d.ms)("replay_requested_at"),
            ),
        );
        if let Some(c) = consumer {
            let p = sql.arg(Arg::Text(c.to_owned()));
            sql.push(&format!(" AND consumer = {p}"));
        }
        if let Some(id) = message_id {
            let p = sql.arg(Arg::Text(id.to_owned()));
            sql.push(&format!(" AND message_id = {}", (d.uuid)(&p)));
        }
        sql.push(&format!(
            " ORDER BY failed_at DESC LIMIT {}",
            limit.clamp(1, MAX_PAGE)
        ));
        self.fetch("inbox dead letters", &sql, |row| {
            Ok(InboxDeadLetter {
                consumer: row.try_get(0)?,
                message_id: row.try_get(1)?,
                topic: row.try_get(2)?,
                partition_key: row.try_get(3)?,
                error: row.try_get(4)?,
                deliveries: row.try_get(5)?,
                failed_at: at(row.try_get(6)?),
                replay_requested_at: at(row.try_get(7)?),
                headers: if full { row.try_get(8)? } else { None },
                payload: if full {
                    Some(RenderedPayload::of(&row.try_get::<Vec<u8>, _>(9)?))
                } else {
                    None
                },
            })
        })
        .await
    }

    /// Replay or discard dead letters of one consumer in one transaction that locks them
    /// first.
    pub(super) async fn inbox_act(
        &self,
        action: InboxAction,
        consumer: &str,
        message_ids: &[String],
    ) -> Result<InboxActionReport, StoreError> {
        let (pool, d, t) = (self.pool, self.d, self.table);
        let err = |e| crate::store::db_error("inbox admin action", t, e);
        let mut report = InboxActionReport::default();
        let mut ids: Vec<String> = Vec::new();
        for id in message_ids {
            match uuid::Uuid::parse_str(id.trim()) {
                Ok(u) => ids.push(u.to_string()),
                Err(e) => report
                    .not_changed
                    .push((id.clone(), format!("not a message id: {e}"))),
            }
        }
        ids.sort_unstable();
        ids.dedup();
        let mut found = std::collections::BTreeSet::new();
        for chunk in ids.chunks(ACTION_CHUNK) {
            // Arguments in the order of their placeholders (`?` is positional).
            let in_list = |sql: &mut Sql<'_>| {
                let c = sql.arg(Arg::Text(consumer.to_owned()));
                let list: Vec<String> = chunk
                    .iter()
                    .map(|id| (d.uuid)(&sql.arg(Arg::Text(id.clone()))))
                    .collect();
                sql.push(&format!(
                    " consumer = {c} AND message_id IN ({})",
                    list.join(", ")
                ));
            };
            let mut pick = Sql::new(
                d,
                format!("SELECT {} FROM {t}_dlq WHERE", (d.text)("message_id")),
            );
            in_list(&mut pick);
            pick.push(d.for_update);
            let mut change = Sql::new(
                d,
                match action {
                    InboxAction::Replay => {
                        format!("UPDATE {t}_dlq SET replay_requested_at = {} WHERE", d.now)
                    }
                    InboxAction::Discard => format!("DELETE FROM {t}_dlq WHERE"),
                },
            );
            in_list(&mut change);
            let mut conn = pool.acquire().await.map_err(err)?;
            let mut tx =
                sqlx::Connection::begin_with(&mut *conn, sqlx::AssertSqlSafe(d.begin.to_owned()))
                    .await
                    .map_err(err)?;
            for row in pick.query::<DB>().fetch_all(&mut *tx).await.map_err(err)? {
                found.insert(row.try_get::<String, _>(0).map_err(err)?);
            }
            change.query::<DB>().execute(&mut *tx).await.map_err(err)?;
            tx.commit().await.map_err(err)?;
        }
        report.changed = found.len() as u64;
        for id in ids.into_iter().filter(|id| !found.contains(id)) {
            report.not_changed.push((
                id,
                format!("no dead letter of consumer {consumer:?} has this id"),
            ));
        }
        Ok(report)
    }
}
