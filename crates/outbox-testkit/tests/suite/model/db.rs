//! What the model test reads and moves in each database beside the store's own calls.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use outbox::Status;
use outbox::store::Bucket;
use outbox_testkit::{MySqlFixture, PgFixture, SqliteFixture, StoreFixture};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

/// One row as the database holds it: status, attempts, check-backs, whether a confirmation
/// deadline is set, bucket.
pub(super) type RowView = (Status, u32, u32, bool, Bucket);

/// What the model test reads and moves in a database, beside the store's own calls.
pub(super) trait ModelDb: StoreFixture {
    /// Every row: id, then its [`RowView`] and message id.
    fn snapshot(&self) -> impl Future<Output = BTreeMap<i64, (RowView, Uuid)>> + Send;
    /// Every bucket: bucket, owner, token, whether its lease has expired.
    fn buckets(
        &self,
    ) -> impl Future<Output = Vec<(Bucket, Option<String>, Option<i64>, bool)>> + Send;
    /// Move `relay`'s bucket leases and heartbeat `by` into the past.
    fn expire(&self, relay: &str, by: Duration) -> impl Future<Output = ()> + Send;
    /// Move every row's delays, deadlines and finish times `by` into the past.
    fn advance(&self, by: Duration) -> impl Future<Output = ()> + Send;
}

pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).expect("duration")
}

pub(super) fn view(
    status: i64,
    attempts: i64,
    check_backs: i64,
    deadline: i64,
    bucket: i64,
    message_id: &str,
) -> (RowView, Uuid) {
    (
        (
            Status::from_i16(i16::try_from(status).expect("status")).expect("a known status"),
            u32::try_from(attempts).expect("attempts"),
            u32::try_from(check_backs).expect("check-backs"),
            deadline != 0,
            Bucket::try_from(bucket).expect("bucket"),
        ),
        message_id.parse().expect("message id"),
    )
}

pub(super) type Snap = (i64, i64, i64, i64, i64, i64, String);
pub(super) type BucketRow = (i64, Option<String>, Option<i64>, i64);

pub(super) fn bucket_rows(
    rows: Vec<BucketRow>,
) -> Vec<(Bucket, Option<String>, Option<i64>, bool)> {
    rows.into_iter()
        .map(|(b, owner, token, expired)| {
            (
                Bucket::try_from(b).expect("bucket"),
                owner,
                token,
                expired != 0,
            )
        })
        .collect()
}

pub(super) fn snapshot_rows(rows: Vec<Snap>) -> BTreeMap<i64, (RowView, Uuid)> {
    rows.into_iter()
        .map(|(id, s, a, c, d, b, m)| (id, view(s, a, c, d, b, &m)))
        .collect()
}

impl ModelDb for SqliteFixture {
    async fn snapshot(&self) -> BTreeMap<i64, (RowView, Uuid)> {
        let rows: Vec<Snap> = sqlx::query_as(
            "SELECT id, status, attempts, check_backs, confirm_deadline IS NOT NULL, bucket, \
             message_id FROM outbox ORDER BY id",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        snapshot_rows(rows)
    }

    async fn buckets(&self) -> Vec<(Bucket, Option<String>, Option<i64>, bool)> {
        let rows: Vec<BucketRow> = sqlx::query_as(
            "SELECT bucket, owner, token, \
             expires_at <= CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER) \
             FROM outbox_buckets ORDER BY bucket",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("read buckets");
        bucket_rows(rows)
    }

    async fn expire(&self, relay: &str, by: Duration) {
        for sql in [
            "UPDATE outbox_buckets SET expires_at = expires_at - ?1 WHERE owner = ?2",
            "UPDATE outbox_relays SET heartbeat_at = heartbeat_at - ?1 WHERE name = ?2",
        ] {
            sqlx::query(sql)
                .bind(ms(by))
                .bind(relay)
                .execute(self.store.pool())
                .await
                .expect("expire a relay");
        }
    }

    async fn advance(&self, by: Duration) {
        sqlx::query(
            "UPDATE outbox SET available_at = available_at - ?1, \
             confirm_deadline = confirm_deadline - ?1, sent_at = sent_at - ?1, \
             confirmed_at = confirmed_at - ?1",
        )
        .bind(ms(by))
        .execute(self.store.pool())
        .await
        .expect("advance the clock");
    }
}

impl ModelDb for PgFixture {
    async fn snapshot(&self) -> BTreeMap<i64, (RowView, Uuid)> {
        let rows: Vec<Snap> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status::int8, attempts::int8, check_backs::int8, \
             (CASE WHEN confirm_deadline IS NULL THEN 0 ELSE 1 END)::int8, bucket::int8, \
             message_id::text FROM {} ORDER BY id",
            self.table()
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        snapshot_rows(rows)
    }

    async fn buckets(&self) -> Vec<(Bucket, Option<String>, Option<i64>, bool)> {
        let rows: Vec<BucketRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT bucket::int8, owner, token, \
             (CASE WHEN expires_at <= now() THEN 1 ELSE 0 END)::int8 \
             FROM {}_buckets ORDER BY bucket",
            self.table()
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read buckets");
        bucket_rows(rows)
    }

    async fn expire(&self, relay: &str, by: Duration) {
        let t = self.table();
        for sql in [
            format!(
                "UPDATE {t}_buckets SET expires_at = expires_at - make_interval(secs => $1) \
                 WHERE owner = $2"
            ),
            format!(
                "UPDATE {t}_relays SET heartbeat_at = heartbeat_at - make_interval(secs => $1) \
                 WHERE name = $2"
            ),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .bind(by.as_secs_f64())
                .bind(relay)
                .execute(self.store.pool())
                .await
                .expect("expire a relay");
        }
    }

    async fn advance(&self, by: Duration) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET available_at = available_at - make_interval(secs => $1), \
             confirm_deadline = confirm_deadline - make_interval(secs => $1), \
             sent_at = sent_at - make_interval(secs => $1), \
             confirmed_at = confirmed_at - make_interval(secs => $1)",
            self.table()
        )))
        .bind(by.as_secs_f64())
        .execute(self.store.pool())
        .await
        .expect("advance the clock");
    }
}

impl ModelDb for MySqlFixture {
    async fn snapshot(&self) -> BTreeMap<i64, (RowView, Uuid)> {
        let rows: Vec<Snap> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(status AS SIGNED), CAST(attempts AS SIGNED), \
             CAST(check_backs AS SIGNED), CASE WHEN confirm_deadline IS NULL THEN 0 ELSE 1 END, \
             CAST(bucket AS SIGNED), message_id FROM {} ORDER BY id",
            self.table
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        snapshot_rows(rows)
    }

    async fn buckets(&self) -> Vec<(Bucket, Option<String>, Option<i64>, bool)> {
        let rows: Vec<BucketRow> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT CAST(bucket AS SIGNED), owner, token, \
             CASE WHEN expires_at <= UTC_TIMESTAMP(6) THEN 1 ELSE 0 END \
             FROM {}_buckets ORDER BY bucket",
            self.table
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read buckets");
        bucket_rows(rows)
    }

    async fn expire(&self, relay: &str, by: Duration) {
        let t = &self.table;
        for sql in [
            format!(
                "UPDATE {t}_buckets SET expires_at = expires_at - INTERVAL ? MICROSECOND \
                 WHERE owner = ?"
            ),
            format!(
                "UPDATE {t}_relays SET heartbeat_at = heartbeat_at - INTERVAL ? MICROSECOND \
                 WHERE name = ?"
            ),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .bind(ms(by) * 1000)
                .bind(relay)
                .execute(self.store.pool())
                .await
                .expect("expire a relay");
        }
    }

    async fn advance(&self, by: Duration) {
        let us = ms(by) * 1000;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET available_at = available_at - INTERVAL ? MICROSECOND, \
             confirm_deadline = confirm_deadline - INTERVAL ? MICROSECOND, \
             sent_at = sent_at - INTERVAL ? MICROSECOND, \
             confirmed_at = confirmed_at - INTERVAL ? MICROSECOND",
            self.table
        )))
        .bind(us)
        .bind(us)
        .bind(us)
        .bind(us)
        .execute(self.store.pool())
        .await
        .expect("advance the clock");
    }
}
