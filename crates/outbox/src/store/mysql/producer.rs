//! The MySQL/MariaDB store's own API: connecting, its options, and the producer's side (enqueue in
//! the caller's transaction, begin, commit), with the helpers the relay's operations share.

use super::*;

impl MySqlStore {
    /// One non-empty chunk of [`Store::complete_in_buckets`]: one statement.
    pub(super) async fn complete_chunk(
        &self,
        relay: &str,
        chunk: &[BucketCompletion],
    ) -> Result<u64, StoreError> {
        let c = crate::store::BucketColumns::from(chunk);
        // Tokens travel as strings: a JSON number that large may pass through a double.
        let rows: Vec<serde_json::Value> = (0..c.ids.len())
            .map(|i| {
                serde_json::json!({
                    "id": c.ids[i],
                    "st": c.statuses[i],
                    "d": c.delays_ms[i],
                    "e": c.errors[i],
                    "a": c.attempts[i],
                    "c": c.confirm_ms[i],
                    "tk": c.tokens[i].to_string(),
                })
            })
            .collect();
        let json = serde_json::Value::Array(rows).to_string();
        let t = self.table.as_str();
        // As in `complete`, no assignment reads `o.status` (multi-table UPDATE assignments have
        // no guaranteed order): a row in (0, 3, 6) without `confirmed_at` is PENDING, one with
        // it was confirmed or rejected meanwhile. Reading the bucket row share-locks it, so a
        // takeover (which writes a new token) and this completion are serialised.
        //
        // The join order is forced (JSON list → outbox row by PRIMARY KEY → bucket row), so the
        // statement locks exactly the rows it names. Left to itself the optimizer scans the
        // outbox first by `status IN (0, 3, 6)` whenever few rows are pending (it estimates a
        // JSON_TABLE at 40 rows), and that locking scan waits on every uncommitted producer
        // insert (a PENDING row) for up to `innodb_lock_wait_timeout`: one open producer
        // transaction stalled every completion, the leases ran out and the batches were
        // published again (issue 11, item 3).
        let pending = "o.confirmed_at IS NULL";
        let sql = format!(
            "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (\
               id BIGINT PATH '$.id', st SMALLINT PATH '$.st', d BIGINT PATH '$.d', \
               e LONGTEXT CHARACTER SET utf8mb4 PATH '$.e', a INT PATH '$.a', c BIGINT PATH '$.c', \
               tk VARCHAR(20) CHARACTER SET ascii PATH '$.tk')) j \
             STRAIGHT_JOIN {t} o FORCE INDEX (PRIMARY) ON o.id = j.id \
             STRAIGHT_JOIN {t}_buckets b ON b.bucket = o.bucket \
             SET o.attempts = CASE WHEN {pending} THEN j.a ELSE o.attempts END, \
             o.available_at = CASE WHEN {pending} AND j.st = {PENDING} \
               THEN {NOW} + INTERVAL (j.d * 1000) MICROSECOND ELSE o.available_at END, \
             o.sent_at = CASE WHEN j.st = {SENT} THEN {NOW} ELSE o.sent_at END, \
             o.confirm_deadline = CASE WHEN {pending} AND j.st = {SENT} AND j.c IS NOT NULL \
               THEN {NOW} + INTERVAL (j.c * 1000) MICROSECOND ELSE NULL END, \
             o.last_error = CASE WHEN {pending} THEN COALESCE(j.e, o.last_error) ELSE o.last_error END, \
             o.status = CASE WHEN {pending} THEN j.st ELSE o.status END, \
             o.lease_owner = NULL, o.lease_token = NULL, o.lease_expires_at = NULL, o.updated_at = {NOW} \
             WHERE o.status IN ({PENDING}, {CONFIRMED}, {REJECTED}) AND b.owner = ? AND b.token = CAST(j.tk AS SIGNED) \
               AND b.expires_at > {NOW}"
        );
        self.exec_rc(
            "complete_in_buckets",
            &sql,
            &[Bind::Str(&json), Bind::Str(relay)],
        )
        .await
    }

    /// Connect to `url` (`mysql://user:pass@host:3306/db`; `mariadb://` is accepted too) with a
    /// pool of up to 10 connections, each with `TCP_NODELAY` (see [`crate::store::nodelay`]: sqlx 0.9.0
    /// does not set it).
    ///
    /// When the server refuses a write as read-only (`--read-only`: error 1290; a read-only
    /// transaction: 1792), the error is [`StoreError::ReadOnly`] and this pool closes every
    /// connection opened before it instead of handing it out again, so the next attempt
    /// reconnects, through DNS or a proxy, to whatever server the URL names now. A pool given to
    /// [`MySqlStore::from_pool`] keeps its connections.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid table name, [`StoreError::Database`] when the server
    /// cannot be reached (the error names the cause).
    pub async fn connect(url: &str, options: StoreOptions) -> Result<MySqlStore, StoreError> {
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        let (pool, read_only) = crate::store::server_pool(&url, &[]).await?;
        let mut store = MySqlStore::from_pool(pool, options)?;
        store.read_only = read_only;
        Ok(store)
    }

    /// Use an existing pool (the application's own). The session time zone and default
    /// isolation level of its connections do not matter: every time is `UTC_TIMESTAMP(6)` and
    /// the relay sets its own isolation per transaction.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for an invalid table name.
    pub fn from_pool(pool: MySqlPool, options: StoreOptions) -> Result<MySqlStore, StoreError> {
        let table = TableName::new(&options.table)?;
        let inbox_table = TableName::new(&options.inbox_table)?;
        Ok(MySqlStore {
            pool,
            table,
            inbox_table,
            limits: options.limits,
            waker: Arc::new(Notify::new()),
            conflicts: Arc::new(AtomicU64::new(0)),
            hook: None,
            read_only: crate::store::ReadOnlyGuard::new(),
            enqueue_timeout: Some(DEFAULT_ENQUEUE_TIMEOUT),
        })
    }

    /// How long [`MySqlStore::enqueue`] waits for a lock before it gives up with
    /// [`EnqueueError::Timeout`]; `None` waits as long as the session's `lock_wait_timeout`
    /// (table and metadata locks, one year by default) and `innodb_lock_wait_timeout` (row
    /// locks, 50 s by default) let it. Default [`DEFAULT_ENQUEUE_TIMEOUT`] (10 s).
    ///
    /// The insert waits on a table or metadata lock when another session holds `LOCK TABLES …
    /// WRITE` or runs `ALTER TABLE`, and on a row lock when another transaction holds a
    /// conflicting one. The timeout sets both server variables for the insert statement alone,
    /// with no extra round trip and nothing left changed on the caller's session:
    /// - MariaDB: `SET STATEMENT lock_wait_timeout = N, innodb_lock_wait_timeout = N FOR INSERT …`
    ///   (written as a MariaDB executable comment, `/*M! … */`, which MySQL skips);
    /// - MySQL 8.0.3+: the optimizer hints `/*+ SET_VAR(lock_wait_timeout = N)
    ///   SET_VAR(innodb_lock_wait_timeout = N) */` on the insert (MariaDB 10.x reads them as a
    ///   plain comment). MySQL's manual lists `lock_wait_timeout` as settable by `SET_VAR`;
    ///   a hint the server does not apply is ignored with a warning, and that wait keeps the
    ///   session's value. Only the MariaDB form is tested here (MySQL 8 is not in the test
    ///   services).
    ///
    /// Both variables are whole seconds: the timeout is rounded up, to at least 1 s. The servers
    /// apply it to each lock the insert waits for (a table or metadata lock, then row locks), so
    /// an insert that waits for two locks in turn can take up to twice as long. Either expiry is
    /// error 1205 (`ER_LOCK_WAIT_TIMEOUT`, checked on MariaDB 10.11 for `LOCK TABLES … WRITE`),
    /// which `enqueue` returns as [`EnqueueError::Timeout`]. Zero is treated as `None`.
    pub fn with_enqueue_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.enqueue_timeout = timeout.filter(|t| !t.is_zero());
        self
    }

    /// Run `hook` for every message the consumer rejects, inside the producer transaction that
    /// records REJECTED (see [`crate::confirm`]). Default: no hook.
    pub fn with_rejection_hook(mut self, hook: Arc<dyn RejectionHook<sqlx::MySql>>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Deadlocks (1213) and lock wait timeouts (1205) this store (and its clones) retried.
    pub fn conflicts_retried(&self) -> u64 {
        self.conflicts.load(Ordering::Relaxed)
    }

    /// Insert `msg` through the caller's connection or transaction (`&mut *tx`). It becomes
    /// visible to relays when the caller's transaction commits and is never published if it
    /// rolls back.
    ///
    /// The borrow of the connection lasts until the insert is done, so the transaction cannot be
    /// committed while an enqueue is still pending (shared case C10).
    ///
    /// # Errors
    /// A validation [`EnqueueError`] before anything is written,
    /// [`EnqueueError::Timeout`] when the insert waited longer than the enqueue timeout for a
    /// lock ([`MySqlStore::with_enqueue_timeout`]), or [`EnqueueError::Database`] when the
    /// insert fails otherwise (roll the transaction back).
    ///
    /// # Examples
    /// ```no_run
    /// # async fn example(store: outbox::MySqlStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store.enqueue(&mut tx, outbox::NewMessage::new("order-created", "{\"id\":1}")).await?;
    /// store.commit(tx).await?; // commit, then wake the embedded relay
    /// # Ok(()) }
    /// ```
    pub async fn enqueue(
        &self,
        conn: &mut MySqlConnection,
        msg: NewMessage,
    ) -> Result<Uuid, EnqueueError> {
        let id = msg.message_id;
        self.enqueue_many(conn, vec![msg]).await?;
        Ok(id)
    }

    /// Insert several messages through the caller's connection (multi-row `INSERT`s of up to
    /// 1,000 rows); all are validated before anything is written.
    ///
    /// # Errors
    /// As [`MySqlStore::enqueue`].
    pub async fn enqueue_many(
        &self,
        conn: &mut MySqlConnection,
        mut msgs: Vec<NewMessage>,
    ) -> Result<Vec<Uuid>, EnqueueError> {
        self.limits.prepare(&mut msgs)?;
        let mut headers = Vec::with_capacity(msgs.len());
        for m in &msgs {
            headers.push(serde_json::to_string(&m.headers).map_err(EnqueueError::Serialize)?);
        }
        let t = self.table.as_str();
        let row = format!("(?, ?, ?, ?, ?, ?, {})", now_plus_ms());
        // The lock wait bound for this statement alone (see `with_enqueue_timeout`): MariaDB's
        // `SET STATEMENT … FOR` in an executable comment, MySQL's `SET_VAR` hints.
        let (set_statement, hints) = match self.enqueue_timeout {
            Some(timeout) => {
                let secs = whole_seconds(timeout);
                (
                    format!(
                        "/*M! SET STATEMENT lock_wait_timeout = {secs}, \
                         innodb_lock_wait_timeout = {secs} FOR */ "
                    ),
                    format!(
                        " /*+ SET_VAR(lock_wait_timeout = {secs}) \
                         SET_VAR(innodb_lock_wait_timeout = {secs}) */"
                    ),
                )
            }
            None => (String::new(), String::new()),
        };
        for (chunk, heads) in msgs.chunks(INSERT_CHUNK).zip(headers.chunks(INSERT_CHUNK)) {
            let values = vec![row.as_str(); chunk.len()].join(", ");
            let sql = format!(
                "{set_statement}INSERT{hints} INTO {t} (message_id, topic, partition_key, headers, payload, max_attempts, available_at) \
                 VALUES {values}"
            );
            let mut q = sqlx::query(AssertSqlSafe(sql));
            for (m, h) in chunk.iter().zip(heads) {
                q = q
                    .bind(m.message_id.hyphenated().to_string())
                    .bind(&m.topic)
                    .bind(&m.partition_key)
                    .bind(h)
                    .bind(&m.payload)
                    .bind(m.max_attempts.map(i64::from))
                    .bind(m.delay.map(millis).unwrap_or(0));
            }
            q.execute(&mut *conn)
                .await
                .map_err(|e| match self.enqueue_timeout {
                    Some(timeout) if is_lock_wait_timeout(&e) => EnqueueError::Timeout {
                        table: t.to_owned(),
                        timeout,
                        source: e,
                    },
                    _ => EnqueueError::Database(self.err("enqueue")(e)),
                })?;
        }
        Ok(msgs.iter().map(|m| m.message_id).collect())
    }

    /// Begin a transaction on the store's pool, for a producer that commits it with
    /// [`MySqlStore::commit`]. The same as `pool().begin()`: it exists so that producer code reads
    /// the same on every database ([`crate::PgStore::begin`] also defers the wake-up to the
    /// commit there).
    ///
    /// # Errors
    /// The pool's error (no connection, `BEGIN` failed).
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::MySql>, sqlx::Error> {
        self.pool.begin().await
    }

    /// Commit `tx` and wake an embedded relay in this process (MySQL has no LISTEN/NOTIFY;
    /// relays elsewhere find the rows by polling).
    ///
    /// # Errors
    /// The commit's error; nothing was published.
    pub async fn commit(&self, tx: sqlx::Transaction<'_, sqlx::MySql>) -> Result<(), sqlx::Error> {
        tx.commit().await?;
        self.wake();
        Ok(())
    }

    pub(super) fn err(&self, op: &'static str) -> impl Fn(sqlx::Error) -> StoreError + '_ {
        move |e| {
            self.read_only
                .check(crate::store::db_error(op, self.table.as_str(), e))
        }
    }

    /// Whether to retry after `e` on attempt `attempt` (counting and backing off if so).
    pub(super) async fn retry_conflict(
        &self,
        op: &'static str,
        e: &sqlx::Error,
        attempt: u32,
    ) -> bool {
        if !is_lock_conflict(e) || attempt >= MAX_CONFLICT_RETRIES {
            return false;
        }
        self.conflicts.fetch_add(1, Ordering::Relaxed);
        let backoff = crate::Backoff {
            base: Duration::from_millis(5),
            max: Duration::from_millis(500),
            ..Default::default()
        };
        tracing::debug!(op, attempt, error = %e, "InnoDB lock conflict; retrying");
        tokio::time::sleep(backoff.delay(attempt + 1)).await;
        true
    }

    /// Begin a READ COMMITTED transaction on a fresh pool connection.
    pub(super) async fn begin_rc(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::MySql>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        set_isolation(&mut conn, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED").await?;
        sqlx::Transaction::begin(conn, None).await
    }

    /// Run `run` again while it fails with a lock conflict ([`Self::retry_conflict`]); another
    /// error is `op`'s. `run` starts a fresh attempt each time (its own transaction).
    pub(super) async fn retrying<T, Fut>(
        &self,
        op: &'static str,
        mut run: impl FnMut() -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let mut attempt = 0;
        loop {
            match run().await {
                Ok(v) => return Ok(v),
                Err(e) if self.retry_conflict(op, &e, attempt).await => attempt += 1,
                Err(e) => return Err(self.err(op)(e)),
            }
        }
    }

    /// Run `body` in a READ COMMITTED transaction of its own ([`Self::begin_rc`]), which it
    /// hands back with the rows it wrote, and commit; a lock conflict
    /// ([`Self::retry_conflict`]) runs it again in a new transaction, other errors are `op`'s.
    async fn in_rc_retrying<'a, F>(&self, op: &'static str, body: F) -> Result<u64, StoreError>
    where
        F: Fn(
                RcTransaction,
            )
                -> futures::future::BoxFuture<'a, Result<(RcTransaction, u64), sqlx::Error>>
            + Send
            + Sync,
    {
        let body = &body;
        self.retrying(op, move || async move {
            let tx = self.begin_rc().await?;
            let (tx, n) = body(tx).await?;
            tx.commit().await?;
            Ok(n)
        })
        .await
    }

    /// Run one statement in its own READ COMMITTED transaction, retrying lock conflicts.
    pub(super) async fn exec_rc(
        &self,
        op: &'static str,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> Result<u64, StoreError> {
        self.in_rc_retrying(op, |mut tx| {
            Box::pin(async move {
                let q = bound(sqlx::query(AssertSqlSafe(sql.to_owned())), binds);
                let n = q.execute(&mut *tx).await?.rows_affected();
                Ok((tx, n))
            })
        })
        .await
    }

    /// A maintenance write that never waits on another session's row: in one READ COMMITTED
    /// transaction, `select` (`SELECT id … LIMIT ? FOR UPDATE SKIP LOCKED`, bound to `limit`)
    /// locks up to `limit` rows, skipping rows locked by anyone else (an open producer
    /// transaction, a consumer's confirmation), then `write` (ending in `id IN `, followed by
    /// `binds`) changes exactly those rows by primary key. Whatever plan the optimizer picks for
    /// the selection, nothing waits for `innodb_lock_wait_timeout`: a skipped row is taken by a
    /// later round. Returns the rows written; retries lock conflicts as [`Self::exec_rc`].
    pub(super) async fn write_selected(
        &self,
        op: &'static str,
        select: &str,
        limit: u32,
        write: &str,
        binds: &[Bind<'_>],
    ) -> Result<u64, StoreError> {
        self.in_rc_retrying(op, |mut tx| {
            Box::pin(async move {
                let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(select.to_owned()))
                    .bind(i64::from(limit))
                    .fetch_all(&mut *tx)
                    .await?;
                if ids.is_empty() {
                    return Ok((tx, 0));
                }
                let sql = format!("{write}({})", placeholders(ids.len()));
                let mut q = bound(sqlx::query(AssertSqlSafe(sql)), binds);
                for id in &ids {
                    q = q.bind(*id);
                }
                let n = q.execute(&mut *tx).await?.rows_affected();
                Ok((tx, n))
            })
        })
        .await
    }

    pub(super) async fn confirm_processed(
        &self,
        ids: &[String],
    ) -> Result<Vec<String>, sqlx::Error> {
        let t = self.table.as_str();
        let f = self.table.unqualified();
        let list = placeholders(ids.len());
        let mut tx = self.begin_rc().await?;
        // By the message id index only: a scan by status (the optimizer's choice on a small
        // table) would lock, and wait on, every uncommitted producer insert.
        let mut q = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT message_id FROM {t} FORCE INDEX ({f}_message_id_key) \
             WHERE message_id IN ({list}) AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) FOR UPDATE"
        )));
        for id in ids {
            q = q.bind(id);
        }
        let moved: Vec<String> = q.fetch_all(&mut *tx).await?;
        if !moved.is_empty() {
            let mut q = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {t} FORCE INDEX ({f}_message_id_key) SET status = {CONFIRMED}, confirmed_at = {NOW}, \
                 confirm_deadline = NULL, updated_at = {NOW} \
                 WHERE message_id IN ({}) AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED})",
                placeholders(moved.len())
            )));
            for id in &moved {
                q = q.bind(id);
            }
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }
}

/// A READ COMMITTED transaction of [`MySqlStore::begin_rc`].
type RcTransaction = sqlx::Transaction<'static, sqlx::MySql>;

/// `q` with `binds` bound in order.
fn bound<'q>(
    mut q: sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    binds: &[Bind<'_>],
) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    for b in binds {
        q = match b {
            Bind::I64(v) => q.bind(*v),
            Bind::Str(v) => q.bind(*v),
        };
    }
    q
}
