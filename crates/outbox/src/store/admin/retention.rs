//! Retention's statements: finished rows deleted or archived, the archive purged.

use super::{Admin, Arg, Sql, archive_into, chunk};
use crate::retention::{Finished, RetentionAction};
use crate::store::StoreError;
use crate::store::status_sql::{CONFIRMED, FAILED, REJECTED, ROLLED_BACK, SENT};
use sqlx::Row;

/// The rows of a finished `state` as an SQL condition, and the column their age is read from
/// ([`crate::retention`]): one definition for row-wise retention and for the partition
/// retention of a partitioned PostgreSQL table.
pub(crate) fn finished(state: Finished) -> (String, &'static str) {
    match state {
        Finished::Sent => (
            format!("status = {SENT} AND confirm_deadline IS NULL"),
            "sent_at",
        ),
        Finished::Confirmed => (format!("status = {CONFIRMED}"), "confirmed_at"),
        Finished::Rejected => (format!("status = {REJECTED}"), "confirmed_at"),
        Finished::Failed => (format!("status = {FAILED}"), "updated_at"),
        Finished::RolledBack => (format!("status = {ROLLED_BACK}"), "updated_at"),
    }
}

admin_impl! {
    /// The database clock in epoch milliseconds.
    async fn clock(&self, op: &'static str) -> Result<i64, StoreError> {
        let sql = Sql::new(self.d, format!("SELECT {}", (self.d.ms)(self.d.now)));
        let row = sql
            .query::<DB>()
            .fetch_one(self.pool)
            .await
            .map_err(|e| crate::store::db_error(op, self.table, e))?;
        row.try_get::<i64, _>(0)
            .map_err(|e| crate::store::db_error(op, self.table, e))
    }

    /// `SELECT id FROM <from> WHERE ` with the instant `older_than` before the database's clock
    /// as its first argument, and that argument as a time expression to compare a column with.
    async fn pick_older(
        &self,
        op: &'static str,
        from: &str,
        older_than: std::time::Duration,
    ) -> Result<(Sql<'_>, String), StoreError> {
        let cutoff = self
            .clock(op)
            .await?
            .saturating_sub(crate::store::millis(older_than));
        let mut pick = Sql::new(self.d, format!("SELECT id FROM {from} WHERE "));
        let p = pick.arg(Arg::Int(cutoff));
        let before = (self.d.at_ms)(&p);
        Ok((pick, before))
    }

    /// [`Store::retire`](crate::Store::retire): one transaction of at most `limit` (and
    /// [`ACTION_CHUNK`]) rows of `state` finished more than `older_than` ago (by the database
    /// clock), skipping rows another transaction holds; deleted, or copied to the archive and
    /// deleted. The rows removed.
    pub(super) async fn retire(
        &self,
        state: Finished,
        older_than: std::time::Duration,
        action: RetentionAction,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let (d, table) = (self.d, self.table);
        let (mut pick, before) = self.pick_older("retention", table, older_than).await?;
        let (rows, age) = finished(state);
        pick.push(&format!("{rows} AND {age} < {before} LIMIT {}", chunk(limit)));
        pick.push(d.skip_locked);
        let mut statements = Vec::new();
        if action == RetentionAction::Archive {
            statements.push(archive_into(table, d.now, "retention", "1 = 1"));
        }
        statements.push(format!("DELETE FROM {table} WHERE 1 = 1"));
        let ids = self.locked_chunk("retention", &pick, &statements).await?;
        Ok(ids.len() as u64)
    }

    /// [`Store::purge_archive`](crate::Store::purge_archive): delete at most `limit` (and
    /// [`ACTION_CHUNK`]) archived rows archived more than `older_than` ago.
    pub(super) async fn purge_archive(
        &self,
        older_than: std::time::Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let (d, table) = (self.d, self.table);
        let archive = format!("{table}_archive");
        let (mut pick, before) = self
            .pick_older("archive retention", &archive, older_than)
            .await?;
        pick.push(&format!(
            "archived_at < {before} LIMIT {}{}",
            chunk(limit),
            d.skip_locked
        ));
        let delete = [format!("DELETE FROM {table}_archive WHERE 1 = 1")];
        let ids = self
            .locked_chunk("archive retention", &pick, &delete)
            .await?;
        Ok(ids.len() as u64)
    }
}
