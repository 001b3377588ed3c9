//! The operator's actions on outbox rows ([`crate::Store::act`]): requeue, publish now,
//! discard, resume, in chunks of [`ACTION_CHUNK`] rows, each one transaction.

use super::{Admin, Arg, Sql, archive_into};
use crate::admin_model::{
    ACTION_CHUNK, Action, ActionReport, MessageFilter, NotChanged, Selection,
};
use crate::message::Status;
use crate::store::StoreError;
use crate::store::status_sql::{FAILED, PENDING, PREPARED, REJECTED, SENT, UNDECIDED};
use sqlx::Row;

/// The rows of one chunk: named ids, or the next [`ACTION_CHUNK`] rows a filter matches below an
/// id.
enum Pick<'a> {
    Ids(&'a [i64]),
    Filter(&'a MessageFilter, Option<i64>),
}

admin_impl! {
    /// [`Store::act`](crate::Store::act): the action in chunks of [`ACTION_CHUNK`] rows, each chunk
    /// one transaction that locks the rows it picked (re-checking their state) before it changes
    /// them.
    pub(super) async fn act(&self, action: Action, selection: &Selection) -> Result<ActionReport, StoreError> {
        let mut report = ActionReport::default();
        match selection {
            Selection::Ids(ids) => {
                let mut ids = ids.clone();
                ids.sort_unstable();
                ids.dedup();
                let mut changed = std::collections::BTreeSet::new();
                for chunk in ids.chunks(ACTION_CHUNK) {
                    changed.extend(self.act_chunk(action, Pick::Ids(chunk)).await?);
                }
                report.changed = changed.len() as u64;
                let rest: Vec<i64> = ids.into_iter().filter(|i| !changed.contains(i)).collect();
                report.not_changed = self.why_not(action, &rest).await?;
            }
            Selection::Filter(filter) => {
                let mut before = None;
                loop {
                    let done = self.act_chunk(action, Pick::Filter(filter, before)).await?;
                    let Some(&lowest) = done.iter().min() else {
                        break;
                    };
                    report.changed += done.len() as u64;
                    before = Some(lowest);
                }
            }
        }
        Ok(report)
    }

    /// One chunk in one transaction; the ids changed.
    async fn act_chunk(&self, action: Action, pick: Pick<'_>) -> Result<Vec<i64>, StoreError> {
        let (d, table) = (self.d, self.table);
        let now = d.now;
        let states = action
            .from_states()
            .iter()
            .map(|s| s.as_i16().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let mut pick_sql = Sql::new(
            d,
            format!("SELECT id FROM {table} WHERE status IN ({states})"),
        );
        if action == Action::PublishNow {
            pick_sql.push(&format!(" AND available_at > {now}"));
        }
        match pick {
            Pick::Ids(ids) => pick_sql.ids(ids),
            Pick::Filter(f, before) => {
                pick_sql.filter(f);
                if let Some(before) = before {
                    let p = pick_sql.arg(Arg::Int(before));
                    pick_sql.push(&format!(" AND id < {p}"));
                }
                pick_sql.push(&format!(" ORDER BY id DESC LIMIT {ACTION_CHUNK}"));
            }
        }
        pick_sql.push(d.for_update);
        let statements: Vec<String> = match action {
            Action::Requeue => vec![format!(
                "UPDATE {table} SET status = {PENDING}, attempts = 0, check_backs = 0, \
                 redelivery = redelivery + 1, available_at = {now}, updated_at = {now}, \
                 confirmed_at = NULL, confirm_deadline = NULL WHERE status IN ({FAILED}, {REJECTED}, {SENT})"
            )],
            Action::PublishNow => vec![format!(
                "UPDATE {table} SET available_at = {now}, updated_at = {now} WHERE status = {PENDING}"
            )],
            Action::Discard => vec![
                archive_into(table, now, "discarded", &format!("status = {FAILED}")),
                format!("DELETE FROM {table} WHERE status = {FAILED}"),
            ],
            Action::Resume => vec![format!(
                "UPDATE {table} SET status = {PREPARED}, check_backs = 0, attempts = 0, \
                 confirm_deadline = NULL, available_at = {now}, updated_at = {now} \
                 WHERE status = {UNDECIDED}"
            )],
        };
        self.locked_chunk("admin action", &pick_sql, &statements)
            .await
    }

    /// One transaction: run `pick` (which locks the rows it selects), then each of `statements`
    /// with ` AND id IN (<the picked ids>)` appended; the ids picked (none: nothing ran).
    pub(super) async fn locked_chunk(
        &self,
        op: &'static str,
        pick: &Sql<'_>,
        statements: &[String],
    ) -> Result<Vec<i64>, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| crate::store::db_error(op, table, e);
        let mut conn = pool.acquire().await.map_err(err)?;
        if !d.before_begin.is_empty() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(d.before_begin.to_owned()))
                .execute(&mut *conn)
                .await
                .map_err(err)?;
        }
        let mut tx =
            sqlx::Connection::begin_with(&mut *conn, sqlx::AssertSqlSafe(d.begin.to_owned()))
                .await
                .map_err(err)?;
        let rows = pick.query::<DB>().fetch_all(&mut *tx).await.map_err(err)?;
        let ids = rows
            .iter()
            .map(|r| r.try_get::<i64, _>(0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        if ids.is_empty() {
            tx.rollback().await.map_err(err)?;
            return Ok(ids);
        }
        for text in statements {
            let mut sql = Sql::new(d, text.as_str());
            sql.ids(&ids);
            sql.query::<DB>().execute(&mut *tx).await.map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(ids)
    }

    /// Why each of `ids` was not changed: its state now, or that there is no such row.
    async fn why_not(&self, action: Action, ids: &[i64]) -> Result<Vec<NotChanged>, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| crate::store::db_error("admin action", table, e);
        let wanted = action
            .from_states()
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(" or ");
        let mut found = std::collections::BTreeMap::new();
        for chunk in ids.chunks(ACTION_CHUNK) {
            let mut sql = Sql::new(
                d,
                format!("SELECT id, {} FROM {table} WHERE 1 = 1", (d.int)("status")),
            );
            sql.ids(chunk);
            for row in sql.query::<DB>().fetch_all(pool).await.map_err(err)? {
                let id: i64 = row.try_get(0).map_err(err)?;
                let status: i64 = row.try_get(1).map_err(err)?;
                found.insert(id, status);
            }
        }
        Ok(ids
            .iter()
            .map(|&id| {
                let status = found
                    .get(&id)
                    .and_then(|&n| i16::try_from(n).ok())
                    .and_then(Status::from_i16);
                let reason = match (found.get(&id), status) {
                    (None, _) => "no such message (never written, purged or archived)".to_owned(),
                    (Some(_), Some(Status::Pending)) if action == Action::PublishNow => {
                        "already due".to_owned()
                    }
                    (Some(_), Some(s)) => format!("{} is not {wanted}", s.name()),
                    (Some(n), None) => format!("status {n} is outside the schema"),
                };
                NotChanged { id, status, reason }
            })
            .collect())
    }
}
