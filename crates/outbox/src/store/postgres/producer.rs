//! The PostgreSQL store's own API: connecting, its options, and the producer's side (enqueue in
//! the caller's transaction, begin, commit), with the helpers the relay's operations share.

use super::*;

impl PgStore {
    /// Connect to `url` (`postgres://user@host:port/db`) with a pool of up to 10 connections,
    /// each with `TCP_NODELAY` (see [`crate::store::nodelay`]: sqlx 0.9.0 does not set it; a pool of
    /// your own given to [`PgStore::from_pool`] can do the same in its `after_connect`).
    ///
    /// When the server refuses a write as read-only (SQLSTATE 25006: a replica, a hot standby,
    /// `default_transaction_read_only`), the error is [`StoreError::ReadOnly`] and this pool
    /// closes every connection opened before it instead of handing it out again, so the next
    /// attempt reconnects, through DNS or a proxy, to whatever server the URL names now. A pool
    /// given to [`PgStore::from_pool`] keeps its connections (its owner decides).
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid table name, [`StoreError::Database`] when the server
    /// cannot be reached (the error names the cause).
    ///
    /// `url` may name several hosts, as libpq does:
    /// `postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write` (`any`, the default,
    /// `read-write` or `primary`). The pool then connects to the first host that qualifies and a
    /// watcher moves it to another when its host stops answering or turns read-only (a
    /// failover), without a restart (see `store::postgres::hosts`, docs/scaling.md).
    pub async fn connect(url: &str, options: StoreOptions) -> Result<PgStore, StoreError> {
        let hosts = super::hosts::Hosts::parse(url)?;
        let (url, all) = match &hosts {
            None => (url.to_owned(), Vec::new()),
            Some(h) => {
                let i = h.select().await.map_err(|reasons| StoreError::Database {
                    op: "connect",
                    transient: true,
                    source: sqlx::Error::Io(std::io::Error::other(format!(
                        "no host of the URL qualifies (target_session_attrs): {reasons}"
                    ))),
                })?;
                (h.urls[i].clone(), h.urls.clone())
            }
        };
        let (pool, read_only) = crate::store::server_pool(&url, &all).await?;
        let mut store = PgStore::from_pool(pool.clone(), options)?;
        if let Some(h) = hosts {
            let i = h.urls.iter().position(|u| *u == url).unwrap_or(0);
            store.failover = Some(super::hosts::watch(pool, h, i, read_only.clone()));
        }
        store.read_only = read_only;
        Ok(store)
    }

    /// Use an existing pool (the application's own).
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for an invalid table name.
    pub fn from_pool(pool: PgPool, options: StoreOptions) -> Result<PgStore, StoreError> {
        let table = TableName::new(&options.table)?;
        let inbox_table = TableName::new(&options.inbox_table)?;
        let t = table.as_str();
        // At most 63 bytes, so neither LISTEN nor pg_notify truncates or refuses it.
        let channel: String = format!("{}_outbox", table.flat())
            .chars()
            .take(63)
            .collect();
        // The columns `rows::decode_message` reads, in its order and types.
        let cols = "o.id, o.message_id::text, o.topic, o.partition_key, o.headers::text, o.payload, \
                    o.attempts::int8, o.max_attempts::int8, o.redelivery::int8";
        let sql = Sql {
            insert: format!(
                "INSERT INTO {t} (message_id, topic, partition_key, headers, payload, max_attempts, available_at) \
                 SELECT m, tp, k, h::jsonb, p, ma, now() + make_interval(secs => d::float8 / 1000) \
                 FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::int[], $7::bigint[]) \
                 AS u(m, tp, k, h, p, ma, d)"
            )
            .into(),
            // The restore is evaluated while the insert runs, after the table lock was taken
            // (at Bind, before execution), so the timeout covers that wait and nothing after.
            insert_timed: format!(
                "INSERT INTO {t} (message_id, topic, partition_key, headers, payload, max_attempts, available_at) \
                 SELECT m, tp, k, h::jsonb, p, ma, now() + make_interval(secs => d::float8 / 1000) \
                 FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::int[], $7::bigint[]) \
                 AS u(m, tp, k, h, p, ma, d) \
                 CROSS JOIN (SELECT set_config('lock_timeout', $8, false)) AS restore_lock_timeout"
            )
            .into(),
            release_sending: format!(
                "UPDATE {t} SET status = {PENDING}, available_at = now(), lease_owner = NULL, lease_token = NULL, \
                 lease_expires_at = NULL, updated_at = now() WHERE status = {SENDING}"
            )
            .into(),
            next_due: format!(
                // GREATEST ignores NULLs, so an empty table needs the CASE to answer NULL (no row).
                "SELECT CASE WHEN MIN(available_at) IS NULL THEN NULL ELSE \
                 GREATEST(CEIL(EXTRACT(EPOCH FROM (MIN(available_at) - now())) * 1000), 0)::bigint END \
                 FROM {t} WHERE status = {PENDING}"
            )
            .into(),
            counts: format!("SELECT status::bigint, COUNT(*) FROM {t} GROUP BY status").into(),
            ages: format!(
                "SELECT (SELECT (EXTRACT(EPOCH FROM now() - MIN(created_at)) * 1000)::bigint FROM {t} \
                         WHERE status = {PENDING} AND available_at <= now()), \
                        (SELECT COUNT(*) FROM {t} WHERE status = {SENT} AND confirm_deadline IS NOT NULL), \
                        (SELECT (EXTRACT(EPOCH FROM now() - MIN(sent_at)) * 1000)::bigint FROM {t} \
                         WHERE status = {SENT} AND confirm_deadline IS NOT NULL)"
            )
            .into(),
            failed: format!(
                "SELECT id, message_id::text, topic, attempts::int8, last_error FROM {t} WHERE status = {FAILED} \
                 ORDER BY updated_at DESC, id DESC LIMIT $1"
            )
            .into(),
            heartbeat: format!(
                "INSERT INTO {t}_relays (name, heartbeat_at, routes, routes_hash) VALUES ($1, now(), $2, $3) \
                 ON CONFLICT (name) DO UPDATE SET heartbeat_at = now(), routes = EXCLUDED.routes, \
                 routes_hash = EXCLUDED.routes_hash"
            )
            .into(),
            // Forgets relays silent for 10 leases, then counts the live ones.
            live: format!(
                "WITH gone AS (DELETE FROM {t}_relays \
                   WHERE heartbeat_at < now() - make_interval(secs => $1::float8 * 10 / 1000)) \
                 SELECT COUNT(*) FROM {t}_relays \
                 WHERE heartbeat_at > now() - make_interval(secs => $1::float8 / 1000)"
            )
            .into(),
            // Locks the bucket rows in bucket order, as the completion's fence does: a renewal
            // waiting for a completion's share lock never holds one the completion waits for.
            renew: format!(
                "UPDATE {t}_buckets b SET expires_at = now() + make_interval(secs => $4::float8 / 1000) \
                 FROM (SELECT x.bucket FROM {t}_buckets x \
                       JOIN UNNEST($2::smallint[], $3::bigint[]) AS h(bucket, token) \
                         ON x.bucket = h.bucket AND x.token = h.token \
                       WHERE x.owner = $1 AND x.expires_at > now() ORDER BY x.bucket FOR UPDATE OF x) c \
                 WHERE b.bucket = c.bucket RETURNING b.bucket"
            )
            .into(),
            acquire: format!(
                "UPDATE {t}_buckets b SET owner = $1, token = $2, \
                 expires_at = now() + make_interval(secs => $3::float8 / 1000), \
                 takeovers = b.takeovers + CASE WHEN c.was_owned THEN 1 ELSE 0 END, handoff = NULL \
                 FROM (SELECT bucket, owner IS NOT NULL AS was_owned FROM {t}_buckets \
                       WHERE expires_at < now() OR (owner IS NULL AND handoff IS NULL) \
                       ORDER BY bucket LIMIT $4 FOR UPDATE SKIP LOCKED) c \
                 WHERE b.bucket = c.bucket RETURNING b.bucket, c.was_owned"
            )
            .into(),
            take_handoffs: format!(
                "UPDATE {t}_buckets SET owner = $1, token = $2, \
                 expires_at = now() + make_interval(secs => $3::float8 / 1000), handoff = NULL \
                 WHERE owner IS NULL AND handoff = $1 RETURNING bucket"
            )
            .into(),
            hand_off: format!(
                "UPDATE {t}_buckets b SET owner = NULL, token = NULL, handoff = $4, \
                 expires_at = now() + make_interval(secs => $5::float8 / 1000) \
                 FROM UNNEST($2::smallint[], $3::bigint[]) AS h(bucket, token) \
                 WHERE b.bucket = h.bucket AND b.owner = $1 AND b.token = h.token"
            )
            .into(),
            relays: format!(
                "SELECT name, routes, routes_hash FROM {t}_relays \
                 WHERE heartbeat_at > now() - make_interval(secs => $1::float8 / 1000) ORDER BY name"
            )
            .into(),
            // One statement (no transaction block to be cut off in, D4): with `$4`, the
            // relay's membership row goes too (on shutdown).
            release: format!(
                "WITH gone AS (DELETE FROM {t}_relays WHERE name = $1 AND $4) \
                 UPDATE {t}_buckets b SET owner = NULL, token = NULL, expires_at = '-infinity' \
                 FROM UNNEST($2::smallint[], $3::bigint[]) AS h(bucket, token) \
                 WHERE b.bucket = h.bucket AND b.owner = $1 AND b.token = h.token"
            )
            .into(),
            // One index range scan per bucket on (bucket, id) WHERE status = 0; the outer LIMIT
            // stops the nested loop as soon as enough rows came, so a deep backlog in the first
            // bucket costs no more than the rows returned.
            read_buckets: format!(
                "SELECT r.* FROM UNNEST($1::smallint[]) AS b(bucket) \
                 CROSS JOIN LATERAL (SELECT {cols}, o.bucket, \
                   (EXTRACT(EPOCH FROM now() - GREATEST(o.created_at, o.available_at)) * 1000000)::int8 \
                   FROM {t} o \
                   WHERE o.bucket = b.bucket AND o.status = {PENDING} AND o.available_at <= now() \
                   AND (o.partition_key IS NULL OR NOT (o.partition_key = ANY($2::text[]))) \
                   ORDER BY o.id LIMIT $3) r \
                 LIMIT $3"
            )
            .into(),
            key_heads: format!(
                "SELECT partition_key, MIN(id) FILTER (WHERE status IN ({PENDING}, {SENDING})), \
                 MIN(id) FILTER (WHERE status = {FAILED}) FROM {t} \
                 WHERE partition_key = ANY($1::text[]) AND status IN ({PENDING}, {SENDING}, {FAILED}) GROUP BY partition_key"
            )
            .into(),
            // One statement per chunk, committed on its own (no transaction block): no window
            // between the fence and the commit in which the relay could be cut off holding
            // row locks (docs/lease-model.md, D4). The fence share-locks the bucket rows it
            // checks, in bucket order, until the commit: a takeover (`acquire`, `FOR UPDATE SKIP
            // LOCKED`) skips a bucket while one of its completions is running, and a renewal
            // waits for it, so a completion that passed the fence cannot commit after another
            // relay took the bucket over and read its rows (D1). The expiry is tested against
            // the statement's clock. `set_config(…, true)` makes this commit asynchronous (see
            // the module docs); the CTE is materialized so it is evaluated once.
            complete_in_buckets: format!(
                "WITH durability AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true) AS v), \
                 fence AS MATERIALIZED (SELECT b.bucket, b.token FROM {t}_buckets b \
                   WHERE b.bucket = ANY($9::smallint[]) AND b.owner = $8 AND b.expires_at > statement_timestamp() \
                   ORDER BY b.bucket FOR SHARE) \
                 UPDATE {t} o SET status = CASE WHEN o.status = {PENDING} THEN u.st ELSE o.status END, \
                 attempts = CASE WHEN o.status = {PENDING} THEN u.att ELSE o.attempts END, \
                 available_at = CASE WHEN o.status = {PENDING} AND u.st = {PENDING} \
                   THEN now() + make_interval(secs => u.delay_ms::float8 / 1000) ELSE o.available_at END, \
                 sent_at = CASE WHEN u.st = {SENT} THEN now() ELSE o.sent_at END, \
                 confirm_deadline = CASE WHEN o.status = {PENDING} AND u.st = {SENT} AND u.confirm_ms IS NOT NULL \
                   THEN now() + make_interval(secs => u.confirm_ms::float8 / 1000) ELSE NULL END, \
                 last_error = CASE WHEN o.status = {PENDING} THEN COALESCE(u.err, o.last_error) ELSE o.last_error END, \
                 lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = now() \
                 FROM UNNEST($1::bigint[], $2::smallint[], $3::bigint[], $4::text[], $5::int[], $6::bigint[], $7::bigint[], $9::smallint[]) \
                   AS u(id, st, delay_ms, err, att, confirm_ms, token, bucket) \
                   JOIN fence f ON f.bucket = u.bucket AND f.token = u.token \
                   CROSS JOIN durability \
                 WHERE o.id = u.id AND o.bucket = u.bucket AND o.status IN ({PENDING}, {CONFIRMED}, {REJECTED})"
            )
            .into(),
            next_due_in_buckets: format!(
                "SELECT GREATEST(CEIL(EXTRACT(EPOCH FROM (available_at - now())) * 1000), 0)::bigint \
                 FROM {t} WHERE status = {PENDING} AND bucket = ANY($1::smallint[]) ORDER BY available_at LIMIT 1"
            )
            .into(),
            // The channel is built from a validated table name: letters, digits and `_` only.
            begin: format!("BEGIN; SET LOCAL outbox.deferred_notify = '{channel}'").into(),
            notify: format!("SELECT pg_notify('{channel}', '')").into(),
        };
        Ok(PgStore {
            pool,
            channel,
            table,
            inbox_table,
            limits: options.limits,
            sql: Arc::new(sql),
            waker: Arc::new(Notify::new()),
            notifier: Arc::new(std::sync::OnceLock::new()),
            hook: None,
            read_only: crate::store::ReadOnlyGuard::new(),
            failover: None,
            enqueue_timeout: Some(DEFAULT_ENQUEUE_TIMEOUT),
            listener_check: DEFAULT_LISTENER_CHECK,
        })
    }

    /// A store over other tables of the same database (another schema's `outbox`, a tenant's),
    /// sharing this store's pool (and its read-only guard): what a daemon that relays a schema
    /// per tenant opens per schema, so N tenants cost one pool, not N. Each store still opens its
    /// own LISTEN connection when its relay runs. The options' limits apply; the enqueue timeout
    /// and listener check are this store's.
    ///
    /// # Errors
    /// [`StoreError::InvalidIdentifier`] for an invalid table name.
    pub fn for_tables(&self, options: StoreOptions) -> Result<PgStore, StoreError> {
        let mut store = PgStore::from_pool(self.pool.clone(), options)?;
        store.read_only = self.read_only.clone();
        store.failover = self.failover.clone();
        store.enqueue_timeout = self.enqueue_timeout;
        store.listener_check = self.listener_check;
        Ok(store)
    }

    /// The names of the schemas of this database that `pattern` (SQL `LIKE`: `%` any run, `_`
    /// one character) matches and that hold a table named `table` (unqualified), in order: the
    /// tenants a schema-per-tenant daemon relays (a schema whose table is not migrated yet is left
    /// out until it is).
    ///
    /// # Errors
    /// [`StoreError::Database`] when the query fails.
    pub async fn schemas_with_table(
        &self,
        pattern: &str,
        table: &str,
    ) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT n.nspname::text FROM pg_namespace n \
             WHERE n.nspname LIKE $1 AND EXISTS (SELECT 1 FROM pg_class c \
               WHERE c.relnamespace = n.oid AND c.relname = $2 AND c.relkind IN ('r', 'p')) \
             ORDER BY 1",
        )
        .bind(pattern)
        .bind(table.to_ascii_lowercase())
        .fetch_all(&self.pool)
        .await
        .map_err(|e| crate::store::database_error("list the tenant schemas", e))
    }

    /// The values of the first column of `query`'s rows, as text, in the order returned: the
    /// tenants' schemas listed by a query of the operator's (`[[databases]] schemas_query`).
    ///
    /// # Errors
    /// [`StoreError::Database`] when the query fails or its first column is not text.
    pub async fn list_by_query(&self, query: &str) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(query.to_owned()))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| crate::store::database_error("run schemas_query", e))
    }

    /// How long [`PgStore::enqueue`] waits for a lock on the outbox table before it gives up
    /// with [`EnqueueError::Timeout`]; `None` waits as long as the server lets it
    /// (`lock_timeout` of the session). Default [`DEFAULT_ENQUEUE_TIMEOUT`] (10 s).
    ///
    /// The insert waits on a table lock only when another session holds a conflicting one
    /// (`LOCK TABLE`, `ALTER TABLE`, `VACUUM FULL`, a migration that rewrites the table). The
    /// timeout is PostgreSQL's `lock_timeout`, set for the insert statement alone: one extra
    /// round trip per enqueue call sets it and reads the session's value, which the insert
    /// itself restores. The caller's other statements keep their own setting. Rounded up to
    /// whole milliseconds; zero is treated as `None` (PostgreSQL's `0` disables the timeout).
    pub fn with_enqueue_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.enqueue_timeout = timeout.filter(|t| !t.is_zero());
        self
    }

    /// How often the relay's LISTEN connection is checked (default [`DEFAULT_LISTENER_CHECK`],
    /// 5 s): every interval the listener sends a `NOTIFY` to a channel of its own through the
    /// pool; when it has not come back through the listening connection by the next interval,
    /// the connection is taken for dead (half-open: a proxy, NAT or firewall dropped it without
    /// a reset) and replaced. A lost connection is found within two intervals, so NOTIFY
    /// wake-ups are back well before the poll interval would have found the rows. At least
    /// 100 ms.
    pub fn with_listener_check(mut self, interval: Duration) -> Self {
        self.listener_check = interval.max(Duration::from_millis(100));
        self
    }

    /// Run `hook` for every message the consumer rejects, inside the producer transaction that
    /// records REJECTED (see [`crate::confirm`]). Default: no hook.
    pub fn with_rejection_hook(mut self, hook: Arc<dyn RejectionHook<sqlx::Postgres>>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The LISTEN/NOTIFY channel of this outbox table (`<table>_outbox`, `.` replaced by `_`).
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// Insert `msg` through the caller's connection or transaction (`&mut *tx`, or `&mut tx`
    /// which derefs to it). It becomes visible to relays when the caller's transaction commits;
    /// nothing is published if it rolls back. Listening relays are notified at that commit (by
    /// the table's trigger), or right after it by [`PgStore::commit`] for a transaction from
    /// [`PgStore::begin`].
    ///
    /// The borrow of the connection lasts until the insert is done, so the transaction cannot be
    /// committed while an enqueue is still pending (shared case C10).
    ///
    /// # Errors
    /// A validation [`EnqueueError`] before anything is written, or
    /// [`EnqueueError::Database`] when the insert fails (roll the transaction back).
    ///
    /// # Examples
    /// ```no_run
    /// # async fn example(store: outbox::PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store.enqueue(&mut tx, outbox::NewMessage::new("order-created", "{\"id\":1}")).await?;
    /// store.commit(tx).await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        msg: NewMessage,
    ) -> Result<Uuid, EnqueueError> {
        let id = msg.message_id;
        self.enqueue_many(conn, vec![msg]).await?;
        Ok(id)
    }

    /// Insert several messages in one statement through the caller's connection; all are
    /// validated before anything is written.
    ///
    /// # Errors
    /// As [`PgStore::enqueue`].
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        mut msgs: Vec<NewMessage>,
    ) -> Result<Vec<Uuid>, EnqueueError> {
        self.limits.prepare(&mut msgs)?;
        if msgs.is_empty() {
            return Ok(Vec::new());
        }
        let n = msgs.len();
        let mut ids = Vec::with_capacity(n);
        let mut topics = Vec::with_capacity(n);
        let mut keys = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut max_attempts = Vec::with_capacity(n);
        let mut delays = Vec::with_capacity(n);
        for m in msgs {
            ids.push(m.message_id);
            headers.push(serde_json::to_string(&m.headers).map_err(EnqueueError::Serialize)?);
            topics.push(m.topic);
            keys.push(m.partition_key);
            payloads.push(m.payload);
            max_attempts.push(m.max_attempts.map(|a| i32::try_from(a).unwrap_or(i32::MAX)));
            delays.push(m.delay.map(millis).unwrap_or(0));
        }
        let database = |e| EnqueueError::Database(self.err("enqueue")(e));
        // With a timeout: `lock_timeout` for the insert alone, set here (returning the session's
        // value) and restored by the insert itself once it holds its locks. Session-level (not
        // LOCAL), so it also applies outside a transaction block; inside one, a rollback undoes
        // it anyway.
        let previous = match self.enqueue_timeout {
            None => None,
            Some(timeout) => {
                let ms = format!("{}ms", timeout.as_millis().max(1));
                // The target list is evaluated left to right: the session's value is read
                // before it is set.
                let (previous, _): (String, String) = sqlx::query_as(
                    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', $1, false)",
                )
                .bind(&ms)
                .fetch_one(&mut *conn)
                .await
                .map_err(database)?;
                Some((timeout, previous))
            }
        };
        let sql = match previous {
            None => &self.sql.insert,
            Some(_) => &self.sql.insert_timed,
        };
        let mut insert = sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(&ids)
            .bind(topics)
            .bind(keys)
            .bind(headers)
            .bind(payloads)
            .bind(max_attempts)
            .bind(delays);
        if let Some((_, previous)) = &previous {
            insert = insert.bind(previous);
        }
        let Err(e) = insert.execute(&mut *conn).await else {
            return Ok(ids);
        };
        let Some((timeout, previous)) = previous else {
            return Err(database(e));
        };
        // Outside a transaction block the setting would outlive the failed insert: restore it
        // (inside one, this fails on the aborted transaction and the rollback restores).
        let _ = sqlx::query("SELECT set_config('lock_timeout', $1, false)")
            .bind(&previous)
            .execute(&mut *conn)
            .await;
        if errors::is_lock_timeout(&e) {
            return Err(EnqueueError::Timeout {
                table: self.table.as_str().to_owned(),
                timeout,
                source: e,
            });
        }
        Err(database(e))
    }

    /// Begin a transaction on the store's pool for a producer that commits it with
    /// [`PgStore::commit`]: its outbox inserts do not `NOTIFY` inside the transaction (which
    /// would serialise every notifying producer's commit behind PostgreSQL's notify lock, WAL
    /// flush included); `commit` wakes the relays after the commit instead.
    ///
    /// The mark is `SET LOCAL outbox.deferred_notify = '<channel>'`, sent with the `BEGIN` in one
    /// simple-query round trip, so it costs no extra round trip. It applies to this store's
    /// table only (another outbox table written in the same transaction still notifies), and
    /// only once the table is at schema v5 (before that, the trigger notifies anyway).
    ///
    /// A transaction begun here and committed some other way (`tx.commit()`) loses nothing: its
    /// rows are published at the relays' next poll (`poll_interval`, 1 s by default) instead of
    /// at once.
    ///
    /// # Errors
    /// The pool's error (no connection, `BEGIN` failed).
    ///
    /// # Examples
    /// ```no_run
    /// # async fn example(store: outbox::PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store.enqueue(&mut tx, outbox::NewMessage::new("order-created", "{\"id\":1}")).await?;
    /// store.commit(tx).await?;
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        // Start the post-commit notifier now, so its connection opens while the transaction runs.
        self.notifier();
        self.pool
            .begin_with(AssertSqlSafe(self.sql.begin.clone()))
            .await
    }

    /// Commit `tx`, wake an embedded relay in this process, and wake the relays elsewhere:
    /// after the commit, a background task of this store sends `NOTIFY` on the table's channel
    /// (one statement on a connection of its own, opened on first use from the pool's connect
    /// options, `synchronous_commit = off`; commits that arrive while one is in flight
    /// share the next). For a transaction from [`PgStore::begin`] that is the only `NOTIFY`; for
    /// any other, the trigger already notified at the commit and this one is redundant but
    /// harmless.
    ///
    /// A failed post-commit `NOTIFY` is logged (`warn`) and costs latency only: the relays'
    /// poll timer finds the rows.
    ///
    /// # Errors
    /// The commit's error; nothing was published.
    pub async fn commit(
        &self,
        tx: sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(), sqlx::Error> {
        tx.commit().await?;
        self.wake();
        self.notify_after_commit();
        Ok(())
    }

    /// Ask the post-commit notifier for one `NOTIFY` (started on first use; a request made
    /// while one is pending is merged into it).
    pub(super) fn notify_after_commit(&self) {
        // Full: a NOTIFY is already pending and covers this commit too.
        let _ = self.notifier().try_send(());
    }

    /// The post-commit notifier's request channel, starting the task on first use.
    pub(super) fn notifier(&self) -> &tokio::sync::mpsc::Sender<()> {
        self.notifier.get_or_init(|| {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tokio::spawn(post_commit_notifier(
                self.pool.clone(),
                self.sql.notify.clone(),
                rx,
            ));
            tx
        })
    }

    pub(super) fn err(&self, op: &'static str) -> impl Fn(sqlx::Error) -> StoreError + '_ {
        move |e| {
            self.read_only
                .check(crate::store::db_error(op, self.table.as_str(), e))
        }
    }
}
