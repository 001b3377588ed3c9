//! The SQLite store's own API: connecting, its options, and the producer's side (enqueue in
//! the caller's transaction, begin, commit), with the helpers the relay's operations share.

use super::*;

impl SqliteStore {
    /// Open (creating if missing) the database at `url` (`sqlite://path/to/file.db`,
    /// `sqlite::memory:`) with WAL, `synchronous = FULL` and a 10 s busy timeout (an enqueue's
    /// wait for the write lock is [`SqliteStore::with_enqueue_timeout`] instead). An in-memory
    /// URL gets a single pinned connection that is never closed (shared case C24).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a URL that cannot be parsed or an invalid table name;
    /// [`StoreError::Database`] when the database cannot be opened.
    pub async fn connect(url: &str, options: StoreOptions) -> Result<SqliteStore, StoreError> {
        Self::open(url, options, true).await
    }

    /// Like [`SqliteStore::connect`], but never creates the database: a file URL whose file
    /// does not exist is refused. For commands that only read or administer an existing outbox
    /// (`outbox status`, `outbox requeue`, the relay daemon), so a mistyped path is reported
    /// instead of leaving an empty database behind.
    ///
    /// # Errors
    /// [`StoreError::MissingDatabase`] naming the path when the file does not exist; otherwise
    /// as [`SqliteStore::connect`].
    pub async fn connect_existing(
        url: &str,
        options: StoreOptions,
    ) -> Result<SqliteStore, StoreError> {
        Self::open(url, options, false).await
    }

    pub(super) async fn open(
        url: &str,
        options: StoreOptions,
        create: bool,
    ) -> Result<SqliteStore, StoreError> {
        let connect = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::Config(format!("bad SQLite URL {url:?}: {e}")))?
            .create_if_missing(create)
            .busy_timeout(Duration::from_secs(10))
            .row_buffer_size(ROW_BUFFER);
        if !create && !url_is_in_memory(url) {
            let path = connect.get_filename();
            if !path.exists() {
                return Err(StoreError::MissingDatabase {
                    path: path.display().to_string(),
                });
            }
        }
        let pool = if url_is_in_memory(url) {
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(connect)
                .await
        } else {
            SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(
                    connect
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Full),
                )
                .await
        }
        .map_err(|e| crate::store::database_error("connect", e))?;
        SqliteStore::from_pool(pool, options)
    }

    /// Use an existing pool (the application's own, so enqueue can share its transactions).
    ///
    /// # Errors
    /// [`StoreError::Config`] for an in-memory pool that may close its last connection (it must
    /// have `min_connections >= 1`, no idle timeout and no max lifetime), or an invalid table name.
    pub fn from_pool(pool: SqlitePool, options: StoreOptions) -> Result<SqliteStore, StoreError> {
        let connect = pool.connect_options();
        let filename = connect.get_filename().to_string_lossy().into_owned();
        let in_memory = filename == ":memory:"
            || filename.starts_with("file:sqlx-in-memory")
            || format!("{connect:?}").contains("in_memory: true");
        let opts = pool.options();
        if in_memory
            && (opts.get_min_connections() < 1
                || opts.get_idle_timeout().is_some()
                || opts.get_max_lifetime().is_some())
        {
            return Err(StoreError::Config(
                "in-memory SQLite pool would lose the database when its last connection closes: \
                 set min_connections(1), idle_timeout(None) and max_lifetime(None), or use \
                 SqliteStore::connect, which pins one connection (shared case C24)"
                    .into(),
            ));
        }
        let table = TableName::new(&options.table)?;
        let inbox_table = TableName::new(&options.inbox_table)?;
        if table.as_str().contains('.') || inbox_table.as_str().contains('.') {
            return Err(StoreError::Config(
                "SQLite table names cannot be schema-qualified".into(),
            ));
        }
        let t = table.as_str();
        let sql = Sql {
            complete_in_buckets: format!(
                "UPDATE {t} SET status = CASE WHEN {t}.status = {PENDING} THEN j.st ELSE {t}.status END, \
                 attempts = CASE WHEN {t}.status = {PENDING} THEN j.att ELSE {t}.attempts END, \
                 available_at = CASE WHEN {t}.status = {PENDING} AND j.st = {PENDING} THEN {NOW_MS} + j.delay ELSE {t}.available_at END, \
                 sent_at = CASE WHEN j.st = {SENT} THEN {NOW_MS} ELSE {t}.sent_at END, \
                 confirm_deadline = CASE WHEN {t}.status = {PENDING} AND j.st = {SENT} AND j.confirm IS NOT NULL \
                   THEN {NOW_MS} + j.confirm ELSE NULL END, \
                 last_error = CASE WHEN {t}.status = {PENDING} THEN COALESCE(j.err, {t}.last_error) ELSE {t}.last_error END, \
                 lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = {NOW_MS} \
                 FROM (SELECT value ->> '$[0]' AS id, value ->> '$[1]' AS st, value ->> '$[2]' AS delay, \
                       value ->> '$[3]' AS err, value ->> '$[4]' AS att, value ->> '$[5]' AS confirm, \
                       value ->> '$[6]' AS token FROM json_each(?1)) AS j, {t}_buckets AS b \
                 WHERE {t}.id = j.id AND {t}.status IN ({PENDING}, {CONFIRMED}, {REJECTED}) AND b.bucket = {t}.bucket \
                   AND b.owner = ?2 AND b.token = j.token AND b.expires_at > {NOW_MS}"
            )
            .into(),
            insert: format!(
                "INSERT INTO {t} (message_id, topic, partition_key, headers, payload, max_attempts, available_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, {NOW_MS} + ?7)"
            )
            .into(),
            release_sending: format!(
                "UPDATE {t} SET status = {PENDING}, available_at = {NOW_MS}, lease_owner = NULL, lease_token = NULL, \
                 lease_expires_at = NULL, updated_at = {NOW_MS} WHERE status = {SENDING}"
            )
            .into(),
            next_due: format!("SELECT MAX(MIN(available_at) - {NOW_MS}, 0) FROM {t} WHERE status = {PENDING}").into(),
            counts: format!("SELECT status, COUNT(*) FROM {t} GROUP BY status").into(),
            ages: format!(
                "SELECT (SELECT {NOW_MS} - MIN(created_at) FROM {t} WHERE status = {PENDING} AND available_at <= {NOW_MS}), \
                 (SELECT COUNT(*) FROM {t} WHERE status = {SENT} AND confirm_deadline IS NOT NULL), \
                 (SELECT {NOW_MS} - MIN(sent_at) FROM {t} WHERE status = {SENT} AND confirm_deadline IS NOT NULL)"
            )
            .into(),
            failed: format!(
                "SELECT id, CAST(message_id AS TEXT), CAST(topic AS TEXT), attempts, last_error FROM {t} WHERE status = {FAILED} \
                 ORDER BY updated_at DESC, id DESC LIMIT ?1"
            )
            .into(),
        };
        Ok(SqliteStore {
            pool,
            table,
            inbox_table,
            limits: options.limits,
            sql: Arc::new(sql),
            waker: Arc::new(Notify::new()),
            writer: Arc::new(tokio::sync::Mutex::new(())),
            hook: None,
            enqueue_timeout: Some(DEFAULT_ENQUEUE_TIMEOUT),
        })
    }

    /// How long [`SqliteStore::enqueue`] waits for the database's write lock before it gives up
    /// with [`EnqueueError::Timeout`]; `None` waits as long as the connection's own busy timeout
    /// (10 s for [`SqliteStore::connect`], the pool's setting for [`SqliteStore::from_pool`]).
    /// Default [`DEFAULT_ENQUEUE_TIMEOUT`] (10 s).
    ///
    /// SQLite has one writer at a time: the insert waits while another connection holds a write
    /// transaction (`BEGIN IMMEDIATE`, or any transaction that has written), then fails with
    /// `SQLITE_BUSY` ("database is locked"). The timeout is SQLite's busy timeout of the
    /// caller's connection, set for the insert alone: `enqueue` reads the connection's
    /// `PRAGMA busy_timeout`, sets it to this timeout, inserts and sets it back (three
    /// statements on the in-process connection instead of one). It bounds the wait for the lock
    /// of this insert; when the caller's transaction already holds the write lock (it wrote
    /// before), the insert does not wait at all. Rounded up to whole milliseconds; zero is
    /// treated as `None`.
    pub fn with_enqueue_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.enqueue_timeout = timeout.filter(|t| !t.is_zero());
        self
    }

    /// Run `hook` for every message the consumer rejects, inside the producer transaction that
    /// records REJECTED (see [`crate::confirm`]). Default: no hook.
    pub fn with_rejection_hook(mut self, hook: Arc<dyn RejectionHook<sqlx::Sqlite>>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Insert `msg` into the outbox through the caller's connection or transaction
    /// (`&mut *tx`). It becomes visible to relays when the caller's transaction commits and is
    /// never published if it rolls back.
    ///
    /// The borrow of the connection lasts until the insert is done, so the transaction cannot be
    /// committed while an enqueue is still pending (shared case C10).
    ///
    /// # Errors
    /// A validation [`EnqueueError`] before anything is written,
    /// [`EnqueueError::Timeout`] when another connection held the write lock for longer than
    /// the enqueue timeout ([`SqliteStore::with_enqueue_timeout`]), or
    /// [`EnqueueError::Database`] when the insert fails otherwise (roll the transaction back).
    ///
    /// # Examples
    /// ```no_run
    /// # async fn example(store: outbox::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store.enqueue(&mut tx, outbox::NewMessage::new("order-created", "{\"id\":1}")).await?;
    /// store.commit(tx).await?; // commit, then wake the embedded relay
    /// # Ok(()) }
    /// ```
    pub async fn enqueue(
        &self,
        conn: &mut SqliteConnection,
        msg: NewMessage,
    ) -> Result<Uuid, EnqueueError> {
        self.enqueue_many(conn, vec![msg]).await.map(|ids| ids[0])
    }

    /// Insert several messages through the caller's connection; all are validated before the
    /// first is written.
    ///
    /// # Errors
    /// As [`SqliteStore::enqueue`].
    pub async fn enqueue_many(
        &self,
        conn: &mut SqliteConnection,
        mut msgs: Vec<NewMessage>,
    ) -> Result<Vec<Uuid>, EnqueueError> {
        self.limits.prepare(&mut msgs)?;
        if msgs.is_empty() {
            return Ok(Vec::new());
        }
        let Some(timeout) = self.enqueue_timeout else {
            return self.insert_all(conn, &msgs, None).await;
        };
        // The connection's busy timeout for these inserts alone (see `with_enqueue_timeout`).
        let db =
            |e| EnqueueError::Database(crate::store::db_error("enqueue", self.table.as_str(), e));
        let previous: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .map_err(db)?;
        let ms = u64::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(u64::MAX);
        let ms = ms.clamp(1, i32::MAX as u64);
        sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA busy_timeout = {ms}")))
            .execute(&mut *conn)
            .await
            .map_err(db)?;
        let inserted = self.insert_all(conn, &msgs, Some(timeout)).await;
        let restored = sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA busy_timeout = {previous}")))
            .execute(&mut *conn)
            .await;
        let ids = inserted?;
        restored.map_err(db)?;
        Ok(ids)
    }

    pub(super) async fn insert_all(
        &self,
        conn: &mut SqliteConnection,
        msgs: &[NewMessage],
        timeout: Option<Duration>,
    ) -> Result<Vec<Uuid>, EnqueueError> {
        let mut ids = Vec::with_capacity(msgs.len());
        for m in msgs {
            let headers = serde_json::to_string(&m.headers).map_err(EnqueueError::Serialize)?;
            self.insert(conn, m, headers)
                .await
                .map_err(|e| match timeout {
                    Some(timeout) if is_busy(&e) => EnqueueError::Timeout {
                        table: self.table.as_str().to_owned(),
                        timeout,
                        source: e,
                    },
                    _ => EnqueueError::Database(crate::store::db_error(
                        "enqueue",
                        self.table.as_str(),
                        e,
                    )),
                })?;
            ids.push(m.message_id);
        }
        Ok(ids)
    }

    pub(super) async fn insert(
        &self,
        conn: &mut SqliteConnection,
        msg: &NewMessage,
        headers: String,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(self.sql.insert.clone()))
            .bind(msg.message_id.to_string())
            .bind(&msg.topic)
            .bind(&msg.partition_key)
            .bind(headers)
            .bind(&msg.payload)
            .bind(msg.max_attempts.map(i64::from))
            .bind(msg.delay.map(millis).unwrap_or(0))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Begin a transaction on the store's pool, for a producer that commits it with
    /// [`SqliteStore::commit`]. The same as `pool().begin()`: it exists so that producer code reads
    /// the same on every database ([`crate::PgStore::begin`] also defers the wake-up to the
    /// commit there).
    ///
    /// # Errors
    /// The pool's error (no connection, `BEGIN` failed).
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
        self.pool.begin().await
    }

    /// Commit `tx` and wake the embedded relay.
    ///
    /// # Errors
    /// The commit's error; nothing was published.
    pub async fn commit(&self, tx: sqlx::Transaction<'_, sqlx::Sqlite>) -> Result<(), sqlx::Error> {
        tx.commit().await?;
        self.wake();
        Ok(())
    }

    pub(super) fn err(&self, op: &'static str) -> impl Fn(sqlx::Error) -> StoreError + '_ {
        move |e| crate::store::db_error(op, self.table.as_str(), e)
    }

    /// One membership round in one `BEGIN IMMEDIATE` transaction (see [`Store::membership`]).
    pub(super) async fn membership_tx(
        &self,
        req: &MembershipRequest,
    ) -> Result<MembershipRound, sqlx::Error> {
        let t = self.table.as_str();
        let lease = millis(req.lease);
        let mut conn = self.pool.acquire().await?;
        let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE").await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {t}_relays (name, heartbeat_at, routes, routes_hash) VALUES (?1, {NOW_MS}, ?2, ?3) \
             ON CONFLICT (name) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, \
             routes = excluded.routes, routes_hash = excluded.routes_hash"
        )))
        .bind(&req.relay)
        .bind(crate::store::routes_json(&req.routes))
        .bind(crate::store::routes_hash(&req.routes))
        .execute(&mut *tx)
        .await?;
        // Forget relays silent for 10 leases, then count the live ones.
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {t}_relays WHERE heartbeat_at < {NOW_MS} - ?1 * 10 AND name <> ?2"
        )))
        .bind(lease)
        .bind(&req.relay)
        .execute(&mut *tx)
        .await?;
        let live: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {t}_relays WHERE heartbeat_at > {NOW_MS} - ?1"
        )))
        .bind(lease)
        .fetch_one(&mut *tx)
        .await?;
        let mut renewed: Vec<Bucket> = Vec::new();
        if !req.held.is_empty() {
            let held = serde_json::to_string(&req.held).expect("buckets serialize");
            renewed = sqlx::query_scalar(AssertSqlSafe(format!(
                "UPDATE {t}_buckets SET expires_at = {NOW_MS} + ?3 WHERE owner = ?1 AND expires_at > {NOW_MS} AND EXISTS \
                 (SELECT 1 FROM json_each(?2) h WHERE h.value ->> '$[0]' = {t}_buckets.bucket \
                  AND h.value ->> '$[1]' = {t}_buckets.token) RETURNING bucket"
            )))
            .bind(&req.relay)
            .bind(held)
            .bind(lease)
            .fetch_all(&mut *tx)
            .await?;
            renewed.sort_unstable();
        }
        let mut round = crate::store::membership_round(live, renewed);
        if req.acquire {
            // Buckets handed over to this relay (migration v6), even above the fair share.
            let token = new_token();
            let handed: Vec<Bucket> = sqlx::query_scalar(AssertSqlSafe(format!(
                "UPDATE {t}_buckets SET owner = ?1, token = ?2, expires_at = {NOW_MS} + ?3, handoff = NULL \
                 WHERE owner IS NULL AND handoff = ?1 RETURNING bucket"
            )))
            .bind(&req.relay)
            .bind(token)
            .bind(lease)
            .fetch_all(&mut *tx)
            .await?;
            round.take_handed_over(handed, token);
        }
        let need = round.need();
        if req.acquire && need > 0 {
            // The transaction holds the write lock: what is read here is what is updated. A
            // bucket handed over to another relay is reserved for it until its lease ends.
            let free: Vec<(Bucket, bool)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT bucket, owner IS NOT NULL FROM {t}_buckets \
                 WHERE expires_at < {NOW_MS} OR (owner IS NULL AND handoff IS NULL) \
                 ORDER BY bucket LIMIT ?1"
            )))
            .bind(i64::from(need))
            .fetch_all(&mut *tx)
            .await?;
            if !free.is_empty() {
                let token = new_token();
                let list: Vec<Bucket> = free.iter().map(|(b, _)| *b).collect();
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {t}_buckets SET takeovers = takeovers + (owner IS NOT NULL), owner = ?1, \
                     token = ?2, expires_at = {NOW_MS} + ?3, handoff = NULL \
                     WHERE bucket IN (SELECT value FROM json_each(?4))"
                )))
                .bind(&req.relay)
                .bind(token)
                .bind(lease)
                .bind(serde_json::to_string(&list).expect("buckets serialize"))
                .execute(&mut *tx)
                .await?;
                round.acquire(token, free);
            }
        }
        tx.commit().await?;
        Ok(round)
    }

    /// One round of [`Store::read_buckets`] ([`crate::store::read_in_rounds`]): a `UNION ALL` of one
    /// `ORDER BY id LIMIT per_bucket` range scan of the partial index `(bucket, id) WHERE status = 0` per
    /// bucket, the first `limit` ids of them all, then those rows by id.
    pub(super) async fn read_parts(
        &self,
        round: ReadRound,
    ) -> Result<Vec<sqlx::sqlite::SqliteRow>, StoreError> {
        let t = self.table.as_str();
        // ?1 the overall limit, ?2 the per-bucket limit, ?3 the keys to skip (if any), then a
        // bucket and the id to read after per part.
        let (skip, first) = match round.skip {
            Some(_) => (
                " AND (partition_key IS NULL OR partition_key NOT IN (SELECT value FROM json_each(?3)))",
                4,
            ),
            None => ("", 3),
        };
        let sql = (0..round.parts.len())
            .map(|i| {
                let (b, a) = (first + 2 * i, first + 2 * i + 1);
                format!(
                    "SELECT * FROM (SELECT id FROM {t} WHERE status = {PENDING} AND bucket = ?{b} \
                     AND id > ?{a} AND available_at <= {NOW_MS}{skip} ORDER BY id LIMIT ?2)"
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        // The candidates' ids first, their rows only for the chosen ones: the sort then carries
        // ids, not payloads (a read of 500 rows sorts up to 4 x 500 candidates).
        let mut q = sqlx::query(AssertSqlSafe(format!(
            "SELECT {READ_COLS}, ({NOW_MS} - MAX(created_at, available_at)) * 1000 FROM {t} \
             WHERE id IN (SELECT id FROM ({sql}) ORDER BY id LIMIT ?1) ORDER BY id"
        )))
        .bind(i64::from(round.limit))
        .bind(i64::from(round.per_bucket));
        if let Some(json) = round.skip {
            q = q.bind(json.to_string());
        }
        for (bucket, after) in &round.parts {
            q = q.bind(*bucket).bind(*after);
        }
        let rows = q
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("read_buckets"))?;
        Ok(rows)
    }
}
