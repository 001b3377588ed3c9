//! Two-phase messages' statements ([`crate::two_phase`]): prepare, the producer's decision
//! (compare and set), the due PREPARED rows of a relay's buckets, and a check-back's result
//! fenced by the bucket lease. One definition for the three databases.

use super::{Admin, AdminTarget, Affected, Arg, Sql, Target};
use crate::error::EnqueueError;
use crate::message::{NewMessage, Status};
use crate::store::status_sql::{PENDING, PREPARED, ROLLED_BACK, UNDECIDED};
use crate::store::{Bucket, FencedRow, StoreError};
use crate::two_phase_model::{
    CheckBack, CheckRequest, CheckUpdate, DecideError, Decided, DuePrepared, PreparedBatch,
};
use sqlx::Row;
use uuid::Uuid;

/// `at_ms(now + p ms)`: the database clock plus a parameter in milliseconds.
fn now_plus(sql: &mut Sql<'_>, ms: i64) -> String {
    let d = sql.d;
    let p = sql.arg(Arg::Int(ms));
    (d.at_ms)(&format!("({} + {p})", (d.ms)(d.now)))
}

/// [`Store::prepare`](crate::Store::prepare) on `target`.
pub(crate) async fn prepare_on(
    target: AdminTarget,
    msg: &crate::message::NewMessage,
    check_back: &crate::two_phase_model::CheckBack,
) -> Result<uuid::Uuid, crate::error::EnqueueError> {
    on_target!(&target.0, prepare(msg, check_back))
}

/// [`Store::commit_prepared`](crate::Store::commit_prepared) and
/// [`Store::rollback_prepared`](crate::Store::rollback_prepared) on `target`.
pub(crate) async fn decide_on(
    target: AdminTarget,
    message_id: uuid::Uuid,
    commit: bool,
) -> Result<crate::two_phase_model::Decided, crate::two_phase_model::DecideError> {
    on_target!(&target.0, decide(message_id, commit))
}

/// [`Store::due_prepared`](crate::Store::due_prepared) on `target`.
pub(crate) async fn due_prepared_on(
    target: AdminTarget,
    buckets: &[Bucket],
    limit: u32,
) -> Result<crate::two_phase_model::PreparedBatch, StoreError> {
    on_target!(&target.0, due_prepared(buckets, limit))
}

/// [`Store::record_check`](crate::Store::record_check) on `target`.
pub(crate) async fn record_check_on(
    target: AdminTarget,
    row: FencedRow<'_>,
    update: &crate::two_phase_model::CheckUpdate,
) -> Result<bool, StoreError> {
    on_target!(&target.0, record_check(row, update))
}

admin_impl! {
    /// [`Store::prepare`](crate::Store::prepare): one PREPARED row in its own transaction (the
    /// statement's), due for its first check-back `check_back.check_after()` from now.
    pub(super) async fn prepare(
        &self,
        msg: &NewMessage,
        check_back: &CheckBack,
    ) -> Result<Uuid, EnqueueError> {
        let (d, table) = (self.d, self.table);
        let headers = serde_json::to_string(&msg.headers).map_err(EnqueueError::Serialize)?;
        let mut sql = Sql::new(d, String::new());
        let mid = sql.arg(Arg::Text(msg.message_id.to_string()));
        let topic = sql.arg(Arg::Text(msg.topic.clone()));
        let key = sql.arg(Arg::OptText(msg.partition_key.clone()));
        let h = sql.arg(Arg::Text(headers));
        let payload = sql.arg(Arg::Bytes(msg.payload.clone()));
        let max = sql.arg(Arg::OptInt(msg.max_attempts.map(i64::from)));
        // The first check no later than the deadline, so that a message is parked at its
        // deadline even when `check_after` is longer.
        let first = match check_back.decision_deadline() {
            Some(d) => check_back.check_after().min(d),
            None => check_back.check_after(),
        };
        let due = now_plus(&mut sql, crate::store::millis(first));
        let deadline = match check_back.decision_deadline() {
            Some(d) => now_plus(&mut sql, crate::store::millis(d)),
            None => "NULL".to_owned(),
        };
        let target = sql.arg(Arg::Text(check_back.target().to_owned()));
        sql.push(&format!(
            "INSERT INTO {table} (message_id, topic, partition_key, headers, payload, max_attempts, \
             status, available_at, confirm_deadline, check_back) \
             VALUES ({}, {topic}, {key}, {}, {payload}, {max}, {PREPARED}, {due}, {deadline}, {target})",
            (d.uuid)(&mid),
            (d.json)(&h),
        ));
        sql.query::<DB>()
            .execute(self.pool)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(d) if d.is_unique_violation() => {
                    EnqueueError::DuplicateMessageId(msg.message_id)
                }
                _ => EnqueueError::Database(crate::store::db_error("prepare", table, e)),
            })?;
        Ok(msg.message_id)
    }

    /// [`Store::commit_prepared`](crate::Store::commit_prepared) (`commit`) and
    /// [`Store::rollback_prepared`](crate::Store::rollback_prepared): PREPARED or UNDECIDED →
    /// PENDING (due now) or ROLLED_BACK, compare and set; otherwise what the row's state says.
    pub(super) async fn decide(&self, message_id: Uuid, commit: bool) -> Result<Decided, DecideError> {
        let (d, table) = (self.d, self.table);
        let now = d.now;
        let err = |e| DecideError::Store(crate::store::db_error("decide prepared", table, e));
        let set = if commit {
            format!(
                "status = {PENDING}, available_at = {now}, attempts = 0, check_backs = 0, \
                 last_error = NULL, confirm_deadline = NULL"
            )
        } else {
            format!("status = {ROLLED_BACK}, last_error = 'rolled back by the producer'")
        };
        let mut sql = Sql::new(d, format!("UPDATE {table} SET {set}, updated_at = {now} WHERE "));
        let p = sql.arg(Arg::Text(message_id.to_string()));
        sql.push(&format!(
            "message_id = {} AND status IN ({PREPARED}, {UNDECIDED})",
            (d.uuid)(&p)
        ));
        let done = sql.query::<DB>().execute(self.pool).await.map_err(err)?;
        if done.affected() > 0 {
            return Ok(Decided::Now);
        }
        let mut sql = Sql::new(
            d,
            format!("SELECT {} FROM {table} WHERE ", (d.int)("status")),
        );
        let p = sql.arg(Arg::Text(message_id.to_string()));
        sql.push(&format!("message_id = {}", (d.uuid)(&p)));
        let Some(row) = sql.query::<DB>().fetch_optional(self.pool).await.map_err(err)? else {
            return Err(DecideError::NotFound(message_id));
        };
        let n: i64 = row.try_get(0).map_err(err)?;
        let Some(status) = i16::try_from(n).ok().and_then(Status::from_i16) else {
            return Err(DecideError::Corrupt { message_id, status: n });
        };
        let rolled_back = status == Status::RolledBack;
        if status == Status::Prepared || status == Status::Undecided {
            // Decided and reopened by others between the two statements: rare; say so.
            return Err(DecideError::Store(StoreError::Config(format!(
                "message {message_id} changed while being decided; call again"
            ))));
        }
        if rolled_back != commit {
            Ok(Decided::Already)
        } else {
            Err(DecideError::Lost { message_id, status })
        }
    }

    /// [`Store::due_prepared`](crate::Store::due_prepared).
    pub(super) async fn due_prepared(
        &self,
        buckets: &[Bucket],
        limit: u32,
    ) -> Result<PreparedBatch, StoreError> {
        let (d, table) = (self.d, self.table);
        let mut batch = PreparedBatch::default();
        if buckets.is_empty() {
            return Ok(batch);
        }
        let now = d.now;
        let mut sql = Sql::new(
            d,
            format!(
                "SELECT id, {mid}, topic, partition_key, {headers}, check_back, {checks}, {errors}, \
                 {bucket}, {past}, {left} FROM {table} WHERE status = {PREPARED} AND available_at <= {now}",
                left = (d.int)(&format!("({}) - ({})", (d.ms)("confirm_deadline"), (d.ms)(now))),
                past = (d.int)(&format!(
                    "CASE WHEN confirm_deadline IS NOT NULL AND confirm_deadline <= {now} THEN 1 ELSE 0 END"
                )),
                mid = (d.text)("message_id"),
                headers = (d.text)("headers"),
                checks = (d.int)("check_backs"),
                errors = (d.int)("attempts"),
                bucket = (d.int)("bucket"),
            ),
        );
        let list: Vec<String> = buckets
            .iter()
            .map(|&b| sql.arg(Arg::Int(i64::from(b))))
            .collect();
        sql.push(&format!(" AND bucket IN ({})", list.join(", ")));
        let p = sql.arg(Arg::Int(i64::from(limit.max(1))));
        sql.push(&format!(" ORDER BY available_at LIMIT {p}"));
        let err = |e| crate::store::db_error("due prepared", table, e);
        let rows = sql.query::<DB>().fetch_all(self.pool).await.map_err(err)?;
        for row in &rows {
            let id: i64 = row.try_get(0).map_err(err)?;
            let bucket = row
                .try_get::<i64, _>(8)
                .ok()
                .and_then(|b| Bucket::try_from(b).ok())
                .unwrap_or_default();
            match Self::due_row(row, id, bucket) {
                Ok(due) => batch.due.push(due),
                Err(reason) => batch.malformed.push((id, bucket, reason)),
            }
        }
        Ok(batch)
    }

    /// One due row, or why it cannot be checked back (a foreign producer's garbage).
    fn due_row(row: &DB::Row, id: i64, bucket: Bucket) -> Result<DuePrepared, String> {
        let text = |i: usize, what: &str| {
            row.try_get::<Option<String>, _>(i)
                .map_err(|e| format!("{what} is not text: {e}"))
        };
        let mid = text(1, "message_id")?.unwrap_or_default();
        let message_id = Uuid::parse_str(&mid).map_err(|_| format!("message_id {mid:?} is not a UUID"))?;
        let topic = text(2, "topic")?.unwrap_or_default();
        let partition_key = text(3, "partition_key")?;
        let headers = crate::store::parse_headers(id, &text(4, "headers")?.unwrap_or_default())
            .map_err(|e| e.to_string())?;
        let target = text(5, "check_back")?.ok_or("no check_back target")?;
        crate::two_phase_model::CheckBack::parse(&target)
            .map_err(|e| format!("check_back {target:?}: {}", e.reason))?;
        let int = |i: usize| row.try_get::<Option<i64>, _>(i).ok().flatten().unwrap_or(0);
        Ok(DuePrepared {
            request: CheckRequest {
                message_id,
                id,
                topic,
                partition_key,
                headers: headers.into_iter().collect(),
                checks: u32::try_from(int(6)).unwrap_or(0),
            },
            target,
            bucket,
            errors: u32::try_from(int(7)).unwrap_or(0),
            past_deadline: int(9) != 0,
            until_deadline: row
                .try_get::<Option<i64>, _>(10)
                .ok()
                .flatten()
                .map(|ms| std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        })
    }

    /// [`Store::record_check`](crate::Store::record_check).
    pub(super) async fn record_check(
        &self,
        row: FencedRow<'_>,
        update: &CheckUpdate,
    ) -> Result<bool, StoreError> {
        let FencedRow {
            relay,
            id,
            bucket,
            token,
        } = row;
        let (d, table) = (self.d, self.table);
        let now = d.now;
        let mut sql = Sql::new(d, format!("UPDATE {table} SET "));
        let status = sql.arg(Arg::Int(i64::from(update.status.as_i16())));
        let checks = sql.arg(Arg::Int(i64::from(update.checks)));
        let errors = sql.arg(Arg::Int(i64::from(update.errors)));
        let due = now_plus(&mut sql, crate::store::millis(update.delay));
        let note = sql.arg(Arg::OptText(update.note.clone()));
        let deadline = if update.status == Status::Pending {
            "NULL"
        } else {
            "confirm_deadline"
        };
        sql.push(&format!(
            "status = {status}, check_backs = {checks}, attempts = {errors}, available_at = {due}, \
             last_error = {note}, confirm_deadline = {deadline}, updated_at = {now} WHERE id = "
        ));
        let p = sql.arg(Arg::Int(id));
        sql.push(&format!("{p} AND status = {PREPARED} AND EXISTS (SELECT 1 FROM {table}_buckets WHERE bucket = "));
        let b = sql.arg(Arg::Int(i64::from(bucket)));
        let o = sql.arg(Arg::Text(relay.to_owned()));
        let t = sql.arg(Arg::Int(token));
        sql.push(&format!("{b} AND owner = {o} AND token = {t} AND expires_at > {now})"));
        let done = sql
            .query::<DB>()
            .execute(self.pool)
            .await
            .map_err(|e| crate::store::db_error("record check-back", table, e))?;
        Ok(done.affected() > 0)
    }
}
