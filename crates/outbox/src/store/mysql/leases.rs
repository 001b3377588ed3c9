//! The bucket-lease operations of the MySQL/MariaDB store, each one READ COMMITTED transaction
//! retried on a deadlock or lock timeout: membership, release, and reading due rows.

use super::*;

impl MySqlStore {
    /// One membership round in one READ COMMITTED transaction (see [`Store::membership`]).
    pub(super) async fn membership_once(
        &self,
        req: &MembershipRequest,
    ) -> Result<MembershipRound, sqlx::Error> {
        let t = self.table.as_str();
        let lease = millis(req.lease);
        let (routes, hash) = (
            crate::store::routes_json(&req.routes),
            crate::store::routes_hash(&req.routes),
        );
        let mut tx = self.begin_rc().await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {t}_relays (name, heartbeat_at, routes, routes_hash) VALUES (?, {NOW}, ?, ?) \
             ON DUPLICATE KEY UPDATE heartbeat_at = {NOW}, routes = ?, routes_hash = ?"
        )))
        .bind(&req.relay)
        .bind(&routes)
        .bind(&hash)
        .bind(&routes)
        .bind(&hash)
        .execute(&mut *tx)
        .await?;
        // Forget relays silent for 10 leases, then count the live ones.
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {t}_relays WHERE heartbeat_at < {NOW} - INTERVAL (? * 10000) MICROSECOND \
             AND name <> ?"
        )))
        .bind(lease)
        .bind(&req.relay)
        .execute(&mut *tx)
        .await?;
        let live: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {t}_relays WHERE heartbeat_at > {NOW} - INTERVAL (? * 1000) MICROSECOND"
        )))
        .bind(lease)
        .fetch_one(&mut *tx)
        .await?;
        let mut renewed: Vec<Bucket> = Vec::new();
        if !req.held.is_empty() {
            // No UPDATE … RETURNING: lock the held rows still ours, then renew exactly those.
            let mut q = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT bucket, token FROM {t}_buckets WHERE owner = ? AND expires_at > {NOW} AND ({}) FOR UPDATE",
                bucket_token_pairs(req.held.len())
            )))
            .bind(&req.relay);
            for (bucket, token) in &req.held {
                q = q.bind(*bucket).bind(*token);
            }
            let rows: Vec<(Bucket, i64)> = q.fetch_all(&mut *tx).await?;
            renewed = rows.into_iter().map(|(b, _)| b).collect();
            renewed.sort_unstable();
            renewed.dedup();
            if !renewed.is_empty() {
                let mut q = sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {t}_buckets SET expires_at = {} WHERE owner = ? AND bucket IN ({})",
                    now_plus_ms(),
                    placeholders(renewed.len())
                )))
                .bind(lease)
                .bind(&req.relay);
                for b in &renewed {
                    q = q.bind(*b);
                }
                q.execute(&mut *tx).await?;
            }
        }
        let mut round = crate::store::membership_round(live, renewed);
        if req.acquire {
            // Buckets handed over to this relay (migration v6), even above the fair share.
            let mut handed: Vec<Bucket> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT bucket FROM {t}_buckets WHERE owner IS NULL AND handoff = ? \
                 FOR UPDATE SKIP LOCKED"
            )))
            .bind(&req.relay)
            .fetch_all(&mut *tx)
            .await?;
            if !handed.is_empty() {
                handed.sort_unstable();
                let token = new_token();
                let mut q = sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {t}_buckets SET owner = ?, token = ?, expires_at = {}, handoff = NULL \
                     WHERE bucket IN ({})",
                    now_plus_ms(),
                    placeholders(handed.len())
                )))
                .bind(&req.relay)
                .bind(token)
                .bind(lease);
                for b in &handed {
                    q = q.bind(*b);
                }
                q.execute(&mut *tx).await?;
                round.take_handed_over(handed, token);
            }
        }
        let need = round.need();
        if req.acquire && need > 0 {
            // A bucket handed over to another relay is reserved for it until its lease ends.
            let free: Vec<(Bucket, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT bucket, owner IS NOT NULL FROM {t}_buckets \
                 WHERE expires_at < {NOW} OR (owner IS NULL AND handoff IS NULL) \
                 ORDER BY bucket LIMIT ? FOR UPDATE SKIP LOCKED"
            )))
            .bind(i64::from(need))
            .fetch_all(&mut *tx)
            .await?;
            if !free.is_empty() {
                let token = new_token();
                // The rows are locked: `owner` still holds the value just read. Single-table
                // assignments run left to right, so `takeovers` reads the old owner.
                let mut q = sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {t}_buckets SET takeovers = takeovers + CASE WHEN owner IS NULL THEN 0 ELSE 1 END, \
                     owner = ?, token = ?, expires_at = {}, handoff = NULL WHERE bucket IN ({})",
                    now_plus_ms(),
                    placeholders(free.len())
                )))
                .bind(&req.relay)
                .bind(token)
                .bind(lease);
                for (b, _) in &free {
                    q = q.bind(*b);
                }
                q.execute(&mut *tx).await?;
                round.acquire(token, free.into_iter().map(|(b, owned)| (b, owned != 0)));
            }
        }
        tx.commit().await?;
        Ok(round)
    }

    /// Release buckets (and leave) in one READ COMMITTED transaction.
    pub(super) async fn release_once(
        &self,
        relay: &str,
        buckets: &[(Bucket, LeaseToken)],
        leave: bool,
    ) -> Result<(), sqlx::Error> {
        let t = self.table.as_str();
        let mut tx = self.begin_rc().await?;
        if !buckets.is_empty() {
            let mut q = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {t}_buckets SET owner = NULL, token = NULL, expires_at = {LONG_AGO} \
                 WHERE owner = ? AND ({})",
                bucket_token_pairs(buckets.len())
            )))
            .bind(relay);
            for (bucket, token) in buckets {
                q = q.bind(*bucket).bind(*token);
            }
            q.execute(&mut *tx).await?;
        }
        if leave {
            sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {t}_relays WHERE name = ?"
            )))
            .bind(relay)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }

    /// One round of [`Store::read_buckets`] ([`crate::store::read_in_rounds`]): a `UNION ALL` of one
    /// `ORDER BY id LIMIT per_bucket` range scan of `(status, bucket, id)` per bucket (MariaDB has no
    /// `LATERAL`), then the first `limit` by id.
    pub(super) async fn read_parts(&self, round: ReadRound) -> Result<Vec<MySqlRow>, StoreError> {
        let t = self.table.as_str();
        let (with, skip) = match &round.skip {
            // The keys as a derived table (one placeholder however many keys and buckets).
            Some(_) => (
                "WITH s AS (SELECT k COLLATE utf8mb4_bin AS k FROM JSON_TABLE(?, '$[*]' COLUMNS (\
                   k VARCHAR(255) CHARACTER SET utf8mb4 PATH '$')) j) ",
                " AND (partition_key IS NULL OR partition_key NOT IN (SELECT k FROM s))",
            ),
            None => ("", ""),
        };
        let part = format!(
            "(SELECT id, message_id, topic, partition_key, headers, payload, attempts, max_attempts, \
             redelivery, bucket, TIMESTAMPDIFF(MICROSECOND, GREATEST(created_at, available_at), {NOW}) \
             FROM {t} WHERE status = {PENDING} AND bucket = ? AND id > ? \
             AND available_at <= {NOW}{skip} ORDER BY id LIMIT ?)"
        );
        let sql = format!(
            "{with}SELECT * FROM ({}) r ORDER BY id LIMIT ?",
            vec![part.as_str(); round.parts.len()].join(" UNION ALL ")
        );
        let mut q = sqlx::query(AssertSqlSafe(sql));
        if let Some(json) = &round.skip {
            q = q.bind(&**json);
        }
        for (bucket, after) in &round.parts {
            q = q
                .bind(*bucket)
                .bind(*after)
                .bind(i64::from(round.per_bucket));
        }
        let rows = q
            .bind(i64::from(round.limit))
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("read_buckets"))?;
        Ok(rows)
    }
}
