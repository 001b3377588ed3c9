//! PostgreSQL store.
//!
//! - Read: one statement per batch over the owned buckets (`UNNEST` of buckets, `LATERAL` index
//!   range scan on `(bucket, id) WHERE status = 0`); completion: one `UPDATE … FROM UNNEST`
//!   per chunk of 125 rows, fenced by the bucket leases, whose bucket rows it share-locks until
//!   it commits (docs/lease-model.md).
//! - Wake-up: a statement-level `AFTER INSERT` trigger calls `pg_notify('<table>_outbox', '')`,
//!   delivered at commit and merged per transaction, so rows inserted by any producer (this crate,
//!   or plain SQL from another language) wake a listening relay at once. The listener reconnects
//!   by itself and wakes the relay after each reconnect in case a notification was missed; the
//!   poll timer stays as the safety net.
//! - A transaction that issued `NOTIFY` holds PostgreSQL's notify lock from its pre-commit until
//!   the end of its commit, WAL flush included, so notifying producers commit one at a time (no
//!   group commit: pgbench with 8 producers on this project's bench machine, business row plus
//!   outbox row, went from 4,800 to 2,300 transactions/s with the trigger's NOTIFY). Transactions
//!   opened with [`PgStore::begin`] and committed with [`PgStore::commit`] avoid it: `begin` marks
//!   the transaction (`SET LOCAL outbox.deferred_notify`, sent with the `BEGIN` in one round
//!   trip), the trigger then skips its `NOTIFY` (schema v5), and `commit` sends one `NOTIFY`
//!   after the commit from a background task, on a connection of its own (not the pool's)
//!   with `synchronous_commit = off`, coalesced (commits that arrive while one is in flight share the
//!   next). See docs/benchmarks.md, "Enqueue overhead".
//! - All times are `timestamptz` from the server clock (`now()`).
//! - The relay's completion statement commits with `synchronous_commit = off`: it does not wait
//!   for the WAL flush (the flush follows within `wal_writer_delay`, 200 ms by default). This is
//!   safe because a completion is only bookkeeping of a publish that already happened: if a
//!   database crash loses it, the rows are PENDING again and are published again, and the
//!   consumer's inbox absorbs the copy. Enqueue (the producer's own transaction), bucket
//!   leases and confirmations commit synchronously as configured on the server.
//! - Needs PostgreSQL 13 or newer (`gen_random_uuid()` as the default message id for plain SQL
//!   producers).

pub(crate) mod errors;
pub mod hosts;
mod listen;
pub(crate) mod migrations;
mod partitions;

use self::listen::listen;
use self::migrations::{migrations, run_migrations};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::shared::{On, due_in, stats_in};
use super::status_sql::{CONFIRMED, FAILED, PENDING, REJECTED, SENDING, SENT};
use super::{
    Bucket, BucketBatch, BucketCompletion, FailedMessage, HandOff, KeyHead, LeaseToken,
    MembershipRequest, MembershipRound, RelayInfo, Stats, Store, StoreOptions, millis, new_token,
};
use crate::error::{EnqueueError, StoreError};
use crate::ident::TableName;
use crate::message::{Limits, NewMessage};
use crate::verdict::{ConfirmReport, Confirmation, RejectionHook};

mod producer;

/// Rows per completion statement (each statement commits on its own; see `complete_in_buckets`).
const COMPLETION_CHUNK: usize = 125;

struct Sql {
    insert: Arc<str>,
    /// `insert` that also restores `lock_timeout` to `$8` once it holds its locks
    /// ([`PgStore::with_enqueue_timeout`]).
    insert_timed: Arc<str>,
    /// Release SENDING rows left by a relay of the row-claim protocol ([`Store::migrate`]).
    release_sending: Arc<str>,
    next_due: Arc<str>,
    counts: Arc<str>,
    ages: Arc<str>,
    failed: Arc<str>,
    heartbeat: Arc<str>,
    live: Arc<str>,
    renew: Arc<str>,
    acquire: Arc<str>,
    /// Acquire the buckets handed over to this relay (migration v6).
    take_handoffs: Arc<str>,
    hand_off: Arc<str>,
    relays: Arc<str>,
    release: Arc<str>,
    read_buckets: Arc<str>,
    key_heads: Arc<str>,
    complete_in_buckets: Arc<str>,
    next_due_in_buckets: Arc<str>,
    /// `BEGIN` plus the deferred-notify mark ([`PgStore::begin`]).
    begin: Arc<str>,
    /// The post-commit `NOTIFY` ([`PgStore::commit`]), on the notifier's own connection.
    notify: Arc<str>,
}

/// The outbox on PostgreSQL. Cheap to clone; clones share the pool and the in-process waker.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    table: TableName,
    inbox_table: TableName,
    channel: String,
    limits: Limits,
    sql: Arc<Sql>,
    waker: Arc<Notify>,
    /// The post-commit notifier of [`PgStore::commit`], started on first use (shared by clones).
    notifier: Arc<std::sync::OnceLock<tokio::sync::mpsc::Sender<()>>>,
    hook: Option<Arc<dyn RejectionHook<sqlx::Postgres>>>,
    /// Read-only refusals seen; the pool of [`PgStore::connect`] drops older connections.
    read_only: Arc<super::ReadOnlyGuard>,
    /// The failover watcher of a multi-host URL ([`hosts`]), stopped with the last clone.
    failover: Option<Arc<hosts::Watcher>>,
    /// How long an enqueue waits for a lock on the table ([`PgStore::with_enqueue_timeout`]).
    enqueue_timeout: Option<Duration>,
    /// Interval of the listener's liveness ping ([`PgStore::with_listener_check`]).
    listener_check: Duration,
}

/// Default of [`PgStore::with_enqueue_timeout`].
pub const DEFAULT_ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`PgStore::with_listener_check`].
pub const DEFAULT_LISTENER_CHECK: Duration = Duration::from_secs(5);

/// The admin statements' PostgreSQL forms ([`crate::admin`]).
pub(crate) const ADMIN: super::admin::Dialect = super::admin::Dialect {
    numbered: true,
    // A bucket never leased expires at '-infinity': no milliseconds for it.
    ms: |c| format!("CASE WHEN isfinite({c}) THEN (extract(epoch FROM {c}) * 1000)::bigint END"),
    at_ms: |p| format!("to_timestamp({p}::bigint / 1000.0)"),
    int: |c| format!("{c}::bigint"),
    text: |c| format!("{c}::text"),
    uuid: |p| format!("{p}::uuid"),
    json: |p| format!("{p}::jsonb"),
    contains: |c, p| format!("{c} ILIKE {p} ESCAPE '!'"),
    now: "now()",
    begin: "BEGIN",
    before_begin: "",
    for_update: " FOR UPDATE",
    skip_locked: " FOR UPDATE SKIP LOCKED",
    index_name: |t, suffix| format!("{}{suffix}", t.rsplit('.').next().unwrap_or(t)),
    index_list: |t| {
        format!(
            "SELECT c.relname::text, (CASE WHEN i.indisvalid AND i.indisready THEN 1 ELSE 0 END)::bigint \
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass('{t}')"
        )
    },
    // Concurrently: writers go on while a large table is indexed.
    create_index: |t, name, columns, partial| {
        let only = if partial.is_empty() {
            String::new()
        } else {
            format!(" WHERE {partial}")
        };
        format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {t} ({columns}){only}")
    },
    drop_index: |t, name| match t.split_once('.') {
        Some((schema, _)) => format!("DROP INDEX CONCURRENTLY IF EXISTS {schema}.{name}"),
        None => format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"),
    },
};

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// The task behind [`PgStore::commit`]'s wake-up: one `NOTIFY` per request, requests that
/// arrive meanwhile merged; ends when every clone of the store is gone.
async fn post_commit_notifier(
    pool: PgPool,
    notify: Arc<str>,
    mut requests: tokio::sync::mpsc::Receiver<()>,
) {
    // A connection of its own, outside the pool (which stays the application's), with
    // `synchronous_commit = off` for the session: each NOTIFY is one statement whose commit does
    // not wait for the WAL flush. Opened at once (the first commit is usually under way when
    // this starts), and reopened at once when a NOTIFY fails on it.
    let options = pool.connect_options();
    let peers = super::nodelay::resolve(options.get_host(), options.get_port()).await;
    let open = || async {
        let mut c = <PgConnection as sqlx::Connection>::connect_with(&*options).await?;
        super::nodelay::set_nodelay_towards(&peers);
        sqlx::raw_sql("SET synchronous_commit = off")
            .execute(&mut c)
            .await?;
        Ok::<_, sqlx::Error>(c)
    };
    let mut conn: Option<PgConnection> = open().await.ok();
    let mut failures = 0u64;
    while requests.recv().await.is_some() {
        // One NOTIFY on the open connection (opening one if there is none); a failure drops it.
        let mut send = async || {
            if conn.is_none() {
                conn = Some(open().await?);
            }
            let c = conn.as_mut().expect("opened above");
            let sent = sqlx::query(AssertSqlSafe(notify.clone())).execute(c).await;
            if sent.is_err() {
                conn = None;
            }
            sent.map(|_| ())
        };
        // The connection may have died since the last NOTIFY (server restart, idle timeout, a
        // proxy): then the NOTIFY goes again at once on a new connection, so the wake-up of this
        // commit is not left to the poll interval.
        let sent = match send().await {
            Ok(()) => Ok(()),
            Err(_) => send().await,
        };
        match sent {
            Ok(()) => failures = 0,
            Err(e) => {
                failures += 1;
                // One warning per run of failures; the relays' poll timer covers the rows.
                if failures == 1 {
                    tracing::warn!(error = %e, "post-commit NOTIFY failed; relays elsewhere find the rows at their next poll");
                }
            }
        }
    }
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        run_migrations(
            &self.pool,
            migrations(&self.table, &self.inbox_table, &self.channel),
        )
        .await?;
        let released = sqlx::query(AssertSqlSafe(self.sql.release_sending.clone()))
            .execute(&self.pool)
            .await
            .map_err(self.err("migrate"))?;
        super::log_released_sending(self.table.as_str(), released.rows_affected());
        Ok(())
    }

    async fn membership(&self, req: &MembershipRequest) -> Result<MembershipRound, StoreError> {
        let err = self.err("membership");
        let lease = millis(req.lease);
        // A session cut off while this transaction is open would keep the bucket rows it
        // renewed or acquired locked, and `acquire` skips locked rows: the server ends such a
        // session once it is idle in the transaction for half a lease (docs/lease-model.md, D4).
        let mut tx = self
            .pool
            .begin_with(AssertSqlSafe(format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}",
                (lease / 2).max(1)
            )))
            .await
            .map_err(&err)?;
        sqlx::query(AssertSqlSafe(self.sql.heartbeat.clone()))
            .bind(&req.relay)
            .bind(super::routes_json(&req.routes))
            .bind(super::routes_hash(&req.routes))
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        let live: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql.live.clone()))
            .bind(lease)
            .fetch_one(&mut *tx)
            .await
            .map_err(&err)?;
        let (buckets, tokens): (Vec<Bucket>, Vec<LeaseToken>) = req.held.iter().copied().unzip();
        let renewed: Vec<Bucket> = sqlx::query_scalar(AssertSqlSafe(self.sql.renew.clone()))
            .bind(&req.relay)
            .bind(&buckets)
            .bind(&tokens)
            .bind(lease)
            .fetch_all(&mut *tx)
            .await
            .map_err(&err)?;
        let mut round = super::membership_round(live, renewed);
        if req.acquire {
            let token = new_token();
            let handed: Vec<Bucket> =
                sqlx::query_scalar(AssertSqlSafe(self.sql.take_handoffs.clone()))
                    .bind(&req.relay)
                    .bind(token)
                    .bind(lease)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(&err)?;
            round.take_handed_over(handed, token);
        }
        let need = round.need();
        if req.acquire && need > 0 {
            let token = new_token();
            let rows: Vec<(Bucket, bool)> = sqlx::query_as(AssertSqlSafe(self.sql.acquire.clone()))
                .bind(&req.relay)
                .bind(token)
                .bind(lease)
                .bind(i64::from(need))
                .fetch_all(&mut *tx)
                .await
                .map_err(&err)?;
            round.acquire(token, rows);
        }
        tx.commit().await.map_err(&err)?;
        Ok(round)
    }

    async fn relays(&self, lease: Duration) -> Result<Vec<RelayInfo>, StoreError> {
        let sql = AssertSqlSafe(self.sql.relays.clone());
        On(&self.pool)
            .all(sql, millis(lease), super::rows::relays)
            .await
            .map_err(self.err("relays"))
    }

    async fn hand_off_buckets(&self, h: &HandOff<'_>) -> Result<(), StoreError> {
        let (b, t): (Vec<Bucket>, Vec<LeaseToken>) = h.buckets.iter().copied().unzip();
        sqlx::query(AssertSqlSafe(self.sql.hand_off.clone()))
            .bind(h.relay)
            .bind(&b)
            .bind(&t)
            .bind(h.to)
            .bind(millis(h.lease))
            .execute(&self.pool)
            .await
            .map_err(self.err("hand_off_buckets"))?;
        Ok(())
    }

    async fn statuses(&self, ids: &[i64]) -> Result<Vec<(i64, crate::Status)>, StoreError> {
        let t = self.table.as_str();
        let rows: Vec<(i64, i16)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status FROM {t} WHERE id = ANY($1)"
        )))
        .bind(ids)
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("statuses"))?;
        super::statuses_from(rows.into_iter().map(|(i, s)| (i, i64::from(s))))
    }

    async fn release_buckets(
        &self,
        relay: &str,
        buckets: &[(Bucket, LeaseToken)],
        leave: bool,
    ) -> Result<(), StoreError> {
        let (b, t): (Vec<Bucket>, Vec<LeaseToken>) = buckets.iter().copied().unzip();
        sqlx::query(AssertSqlSafe(self.sql.release.clone()))
            .bind(relay)
            .bind(&b)
            .bind(&t)
            .bind(leave)
            .execute(&self.pool)
            .await
            .map_err(self.err("release_buckets"))?;
        Ok(())
    }

    async fn read_buckets(
        &self,
        buckets: &[Bucket],
        skip_keys: &[String],
        limit: u32,
    ) -> Result<BucketBatch, StoreError> {
        if buckets.is_empty() || limit == 0 {
            return Ok(BucketBatch::default());
        }
        let err = self.err("read_buckets");
        let rows = sqlx::query(AssertSqlSafe(self.sql.read_buckets.clone()))
            .bind(buckets)
            .bind(skip_keys)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(&err)?;
        let mut batch = BucketBatch::default();
        for row in &rows {
            let id: i64 = row.try_get(0).map_err(&err)?;
            let bucket: Bucket = row.try_get(9).map_err(&err)?;
            batch.push(
                bucket,
                id,
                super::rows::decode_message(id, row),
                super::rows::due_age(row),
            );
        }
        Ok(batch)
    }

    async fn key_heads(&self, keys: &[String]) -> Result<Vec<KeyHead>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<super::rows::KeyHeadRow> =
            sqlx::query_as(AssertSqlSafe(self.sql.key_heads.clone()))
                .bind(keys)
                .fetch_all(&self.pool)
                .await
                .map_err(self.err("key_heads"))?;
        Ok(super::rows::key_heads(rows))
    }

    async fn complete_in_buckets(
        &self,
        relay: &str,
        completions: &[BucketCompletion],
    ) -> Result<u64, StoreError> {
        if completions.is_empty() {
            return Ok(0);
        }
        let err = self.err("complete_in_buckets");
        // Each chunk is one statement that commits on its own, without waiting for the WAL
        // flush (see the module docs and the statement's comment): a completion lost in a
        // database crash leaves its rows PENDING, so they are published again and the
        // consumer's inbox absorbs the copies. Chunks keep each Bind message small: a Bind of
        // several tens of KiB stalled ~40 ms on Nagle / delayed ACK over TCP (measured with the
        // server's statement log: the gap was between Parse and Bind). A chunk that fails
        // leaves the chunks before it recorded; the relay's retry finds those rows no longer
        // PENDING.
        let mut matched = 0;
        for chunk in completions.chunks(COMPLETION_CHUNK) {
            let c = super::BucketColumns::from(chunk);
            let done = sqlx::query(AssertSqlSafe(self.sql.complete_in_buckets.clone()))
                .bind(c.ids)
                .bind(c.statuses)
                .bind(c.delays_ms)
                .bind(c.errors)
                .bind(c.attempts)
                .bind(c.confirm_ms)
                .bind(c.tokens)
                .bind(relay)
                .bind(c.buckets)
                .execute(&self.pool)
                .await
                .map_err(&err)?;
            matched += done.rows_affected();
        }
        Ok(matched)
    }

    async fn next_due_in_buckets(
        &self,
        buckets: &[Bucket],
    ) -> Result<Option<Duration>, StoreError> {
        if buckets.is_empty() {
            return Ok(None);
        }
        let ms: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(self.sql.next_due_in_buckets.clone()))
                .bind(buckets)
                .fetch_optional(&self.pool)
                .await
                .map_err(self.err("next_due"))?;
        Ok(due_in(ms))
    }

    async fn next_due_in(&self) -> Result<Option<Duration>, StoreError> {
        let sql = AssertSqlSafe(self.sql.next_due.clone());
        On(&self.pool)
            .next_due(sql)
            .await
            .map_err(self.err("next_due"))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        // One snapshot for both statements, so counts and ages agree.
        let err = self.err("stats");
        let mut tx = self.pool.begin().await.map_err(&err)?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        let counts = AssertSqlSafe(self.sql.counts.clone());
        let ages = AssertSqlSafe(self.sql.ages.clone());
        let stats = stats_in::<sqlx::Postgres>(&mut tx, counts, ages, &err).await?;
        tx.commit().await.map_err(&err)?;
        Ok(stats)
    }

    async fn apply_confirmations(
        &self,
        batch: &[Confirmation],
    ) -> Result<ConfirmReport, StoreError> {
        super::confirming::apply(self, batch).await
    }

    async fn check_back(&self, limit: u32, max_check_backs: u32) -> Result<u64, StoreError> {
        let t = self.table.as_str();
        let done = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} o SET \
             status = CASE WHEN o.check_backs >= $2 THEN {FAILED} ELSE {PENDING} END, \
             last_error = CASE WHEN o.check_backs >= $2 \
               THEN 'unconfirmed: no confirmation after ' || o.check_backs || ' check-backs' \
               ELSE 'check-back: no confirmation by the deadline' END, \
             check_backs = o.check_backs + CASE WHEN o.check_backs >= $2 THEN 0 ELSE 1 END, \
             redelivery = o.redelivery + CASE WHEN o.check_backs >= $2 THEN 0 ELSE 1 END, \
             attempts = CASE WHEN o.check_backs >= $2 THEN o.attempts ELSE 0 END, \
             available_at = now(), confirm_deadline = NULL, updated_at = now() \
             FROM (SELECT id FROM {t} WHERE status = {SENT} AND confirm_deadline < now() \
                   ORDER BY confirm_deadline LIMIT $1 FOR UPDATE SKIP LOCKED) c \
             WHERE o.id = c.id AND o.status = {SENT} AND o.confirm_deadline < now()"
        )))
        .bind(i64::from(limit))
        .bind(i32::try_from(max_check_backs).unwrap_or(i32::MAX))
        .execute(&self.pool)
        .await
        .map_err(self.err("check_back"))?;
        Ok(done.rows_affected())
    }

    async fn requeue_failed(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        let t = self.table.as_str();
        let sql = format!(
            "UPDATE {t} SET status = {PENDING}, attempts = 0, check_backs = 0, redelivery = redelivery + 1, \
             available_at = now(), updated_at = now() \
             WHERE status = {FAILED} AND ($1::bigint[] IS NULL OR id = ANY($1))"
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(ids.map(<[i64]>::to_vec))
            .execute(&self.pool)
            .await
            .map_err(self.err("requeue"))?;
        Ok(done.rows_affected())
    }

    async fn failed(&self, limit: u32) -> Result<Vec<FailedMessage>, StoreError> {
        let sql = AssertSqlSafe(self.sql.failed.clone());
        On(&self.pool)
            .all(sql, i64::from(limit), super::rows::failed_messages)
            .await
            .map_err(self.err("failed"))
    }

    async fn retire_partitions(
        &self,
        retention: &crate::retention::Retention,
    ) -> Result<Option<crate::retention::PartitionRound>, StoreError> {
        partitions::retire_partitions(self, retention).await
    }

    fn admin_target(&self) -> super::admin::AdminTarget {
        super::admin::AdminTarget(super::admin::Target::Postgres(
            self.pool.clone(),
            self.table.as_str().to_owned(),
            &ADMIN,
        ))
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn wake_relays(&self) {
        self.wake();
        self.notify_after_commit();
    }

    fn waker(&self) -> Arc<Notify> {
        self.waker.clone()
    }

    fn spawn_listener(&self, cancel: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        use tracing::Instrument;
        Some(tokio::spawn(
            listen(
                self.pool.clone(),
                self.channel.clone(),
                self.waker.clone(),
                self.listener_check,
                cancel,
            )
            .in_current_span(),
        ))
    }

    async fn check_schema(&self) -> Result<(), StoreError> {
        let t = self.table.as_str();
        let steps = migrations(&self.table, &self.inbox_table, &self.channel);
        On(&self.pool)
            .check_schema(
                t,
                "SELECT MAX(version)::bigint FROM outbox_migrations WHERE table_name = $1",
                super::latest_version(&steps, t),
                errors::is_missing_table,
                self.err("check_schema"),
            )
            .await
    }
}

impl super::confirming::ConfirmSteps for PgStore {
    type Db = sqlx::Postgres;
    type Id = Uuid;

    fn id(&self, message_id: Uuid) -> Uuid {
        message_id
    }

    fn table(&self) -> &str {
        self.table.as_str()
    }

    fn hook(&self) -> Option<&Arc<dyn RejectionHook<sqlx::Postgres>>> {
        self.hook.as_ref()
    }

    async fn confirm(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        let t = self.table.as_str();
        sqlx::query_scalar(AssertSqlSafe(format!(
            "UPDATE {t} SET status = {CONFIRMED}, confirmed_at = now(), confirm_deadline = NULL, updated_at = now() \
             WHERE message_id = ANY($1) AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) RETURNING message_id"
        )))
        .bind(ids)
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("confirm"))
    }

    async fn reject(
        &self,
        id: &Uuid,
        error: String,
    ) -> Result<Option<super::confirming::Rejection<sqlx::Postgres>>, StoreError> {
        let t = self.table.as_str();
        let mut tx = self.pool.begin().await.map_err(self.err("confirm"))?;
        let row: Option<super::RejectedRow> = sqlx::query_as(AssertSqlSafe(format!(
            "UPDATE {t} SET status = {REJECTED}, confirmed_at = now(), confirm_deadline = NULL, updated_at = now(), \
             last_error = $2 WHERE message_id = $1 AND status IN ({PENDING}, {SENDING}, {SENT}, {FAILED}) \
             RETURNING id, topic, partition_key, headers::text, payload"
        )))
        .bind(id)
        .bind(error)
        .fetch_optional(&mut *tx)
        .await
        .map_err(self.err("confirm"))?;
        super::confirming::rolled_back_unless(tx, row, self.err("confirm")).await
    }

    async fn known(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        let t = self.table.as_str();
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT message_id FROM {t} WHERE message_id = ANY($1)"
        )))
        .bind(ids)
        .fetch_all(&self.pool)
        .await
        .map_err(self.err("confirm"))
    }
}
