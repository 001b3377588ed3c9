//! The database side of `outbox bench`: pools, the run's tables, the backlog, the business
//! transaction, and the statistics PostgreSQL keeps about a table.
//!
//! # Pools
//! Every pool the bench opens for its own work (loading, producers, statistics) has sqlx's
//! statement log switched off; the pools handed to the relays keep it on, so the statement
//! counter ([`super::StatementCounter`]) sees the relays' statements and nothing else, even while
//! producers run. On PostgreSQL each pool carries its own `application_name`
//! (`outbox-bench-<run>-<label>`), so the bench can wait for its backends to exit: a backend
//! flushes its table counters to `pg_stat_user_tables` when it exits, and only about once a
//! second (or after ten idle seconds) before that.
//!
//! # Tables
//! PostgreSQL: everything lives in a fresh schema `bench_<run>`, dropped at the end. MySQL/MariaDB
//! and SQLite: tables named `bench_<run>_<name>` in the URL's database, dropped at the end.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use indicatif::ProgressBar;
use outbox::{MySqlStore, NewMessage, PgStore, SqliteStore, Store, StoreOptions};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Row};
use tokio::time::Instant;
use uuid::Uuid;

use super::now_us;
use super::report::{PgWrites, TableStats};

pub use outbox::store::Dialect;

/// The dialect of the bench's `--database` URL ([`Dialect::of_url`]), refusing an in-memory
/// SQLite database: the bench's pools could not share it.
///
/// # Errors
/// An unsupported scheme (named, the URL redacted) or an in-memory SQLite URL.
pub fn dialect_of(url: &str) -> anyhow::Result<Dialect> {
    let dialect = Dialect::of_url(url)
        .map_err(|e| anyhow::anyhow!("--database {:?}: {e}", crate::redact(url)))?;
    if dialect == Dialect::Sqlite && (url.contains(":memory:") || url.contains("mode=memory")) {
        bail!(
            "--database {url:?}: the bench needs a SQLite file (sqlite://bench.db); an \
             in-memory database is private to one connection"
        );
    }
    Ok(dialect)
}

/// A pool of one of the three databases.
#[derive(Clone)]
pub enum Pool {
    /// PostgreSQL.
    Pg(PgPool),
    /// MySQL / MariaDB.
    My(MySqlPool),
    /// SQLite.
    Lite(SqlitePool),
}

impl Pool {
    /// Close every connection (waits for connections in use to come back).
    pub async fn close(&self) {
        match self {
            Pool::Pg(p) => p.close().await,
            Pool::My(p) => p.close().await,
            Pool::Lite(p) => p.close().await,
        }
    }
}

/// A pool the bench opened with a label, closed (and, on PostgreSQL, its backends' statistics
/// flushed) by [`Db::retire`].
pub struct Labeled {
    /// The pool.
    pub pool: Pool,
    /// Its `application_name` on PostgreSQL.
    pub app: String,
}

/// How a business transaction is opened and committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxMode {
    /// `pool.begin()` … `tx.commit()`: on PostgreSQL the outbox trigger's `NOTIFY` is sent in
    /// the transaction, as for a plain-SQL producer.
    Plain,
    /// `store.begin()` … `store.commit(tx)`: on PostgreSQL no `NOTIFY` in the transaction, one
    /// after the commit (coalesced); elsewhere the same as `Plain` plus the in-process wake-up
    /// of the producer's own store.
    Store,
}

/// The outbox through one of the library's stores (the public API the relay and the producers
/// use).
#[derive(Clone)]
pub enum Outbox {
    /// [`PgStore`].
    Pg(PgStore),
    /// [`MySqlStore`].
    My(MySqlStore),
    /// [`SqliteStore`].
    Lite(SqliteStore),
}

impl Outbox {
    /// The store of outbox table `table` (inbox `<table>_inbox`) on `pool`.
    ///
    /// # Errors
    /// An invalid table name.
    pub fn open(pool: &Pool, table: &str) -> anyhow::Result<Outbox> {
        let options = StoreOptions::table(table);
        Ok(match pool {
            Pool::Pg(p) => Outbox::Pg(PgStore::from_pool(p.clone(), options)?),
            Pool::My(p) => Outbox::My(MySqlStore::from_pool(p.clone(), options)?),
            Pool::Lite(p) => Outbox::Lite(SqliteStore::from_pool(p.clone(), options)?),
        })
    }

    /// The same store behind the [`Store`] trait, for a relay.
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Outbox::Pg(s) => Arc::new(s.clone()),
            Outbox::My(s) => Arc::new(s.clone()),
            Outbox::Lite(s) => Arc::new(s.clone()),
        }
    }

    /// Insert `msgs` in one statement on a connection of `pool` (autocommit).
    async fn enqueue_many(&self, pool: &Pool, msgs: Vec<NewMessage>) -> anyhow::Result<()> {
        match (self, pool) {
            (Outbox::Pg(s), Pool::Pg(p)) => {
                s.enqueue_many(&mut *p.acquire().await?, msgs).await?;
            }
            (Outbox::My(s), Pool::My(p)) => {
                s.enqueue_many(&mut *p.acquire().await?, msgs).await?;
            }
            (Outbox::Lite(s), Pool::Lite(p)) => {
                s.enqueue_many(&mut *p.acquire().await?, msgs).await?;
            }
            _ => bail!("store and pool of different databases"),
        }
        Ok(())
    }
}

/// Timings of one business transaction.
#[derive(Debug, Clone)]
pub struct TxTimes {
    /// The ids of the outbox messages the transaction enqueued (none, one, or more).
    pub message_ids: Vec<Uuid>,
    /// The database clock in the transaction's last statement before `COMMIT`, µs since the
    /// Unix epoch.
    pub db_clock_us: i64,
    /// This process's clock when `COMMIT` returned, µs since the Unix epoch.
    pub committed_us: i64,
    /// `BEGIN` … `COMMIT` returned, µs.
    pub transaction_us: u64,
    /// The `COMMIT` alone, µs.
    pub commit_us: u64,
}

/// The database under test and the run's tables on it.
pub struct Db {
    /// Which database.
    pub dialect: Dialect,
    url: String,
    run_id: String,
    /// The bench's own pool (statement log off): DDL, statistics, producers.
    pub control: Pool,
    /// `TCP_NODELAY` on every connection (`--tcp-nodelay`).
    nodelay: bool,
}

/// Counters of `pg_stat_user_tables` for one table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PgCounters {
    inserted: i64,
    updated: i64,
    hot_updated: i64,
    deleted: i64,
    /// `seq_scan + idx_scan`.
    pub scans: i64,
    /// `xact_commit` of the whole database.
    pub db_commits: i64,
}

impl PgCounters {
    /// The writes between `self` (before) and `after`, per message.
    pub fn writes_until(&self, after: &PgCounters, messages: u64) -> PgWrites {
        let inserted = after.inserted - self.inserted;
        let updated = after.updated - self.updated;
        let deleted = after.deleted - self.deleted;
        PgWrites {
            inserted,
            updated,
            hot_updated: after.hot_updated - self.hot_updated,
            deleted,
            rows_written_per_message: (inserted + updated + deleted) as f64
                / messages.max(1) as f64,
            db_commits_all_clients: after.db_commits - self.db_commits,
        }
    }
}

/// The SQL expression of the database clock in µs since the Unix epoch (at execution time, not
/// transaction start).
fn clock_sql(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Postgres => "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        Dialect::MySql => "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)",
        Dialect::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
    }
}

/// A pool of at most `max` connections to `url`, named `app` on PostgreSQL, with sqlx's
/// statement log on (`log`) or off, and `TCP_NODELAY` on each connection (`nodelay`, as the
/// stores' own `connect` does; see `outbox::store::nodelay`) or sqlx's default (off).
async fn connect(
    dialect: Dialect,
    url: &str,
    app: &str,
    log: bool,
    max: u32,
    nodelay: bool,
) -> anyhow::Result<Pool> {
    let acquire = Duration::from_secs(30);
    Ok(match dialect {
        Dialect::Postgres => {
            let mut o = PgConnectOptions::from_str(url)?.application_name(app);
            if !log {
                o = o.disable_statement_logging();
            }
            let peers = peers(nodelay, o.get_host(), o.get_port()).await;
            Pool::Pg(server_pool(o, max, acquire, peers).await?)
        }
        Dialect::MySql => {
            let mut o = MySqlConnectOptions::from_str(&url.replacen("mariadb://", "mysql://", 1))?;
            if !log {
                o = o.disable_statement_logging();
            }
            let peers = peers(nodelay, o.get_host(), o.get_port()).await;
            Pool::My(server_pool(o, max, acquire, peers).await?)
        }
        Dialect::Sqlite => {
            // As SqliteStore::connect opens a file: WAL, synchronous FULL, 10 s busy timeout, its row
            // buffer.
            let mut o = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(10))
                .row_buffer_size(outbox::store::sqlite::ROW_BUFFER);
            if !log {
                o = o.disable_statement_logging();
            }
            Pool::Lite(
                SqlitePoolOptions::new()
                    .max_connections(max.min(8))
                    .acquire_timeout(acquire)
                    .connect_with(o)
                    .await?,
            )
        }
    })
}

/// The addresses of `host:port` to set `TCP_NODELAY` towards (none without `nodelay`).
async fn peers(nodelay: bool, host: &str, port: u16) -> Vec<std::net::SocketAddr> {
    match nodelay {
        true => outbox::store::nodelay::resolve(host, port).await,
        false => Vec::new(),
    }
}

/// A pool of a database server (PostgreSQL, MySQL) whose connections set `TCP_NODELAY`
/// towards `peers`.
async fn server_pool<DB: sqlx::Database>(
    options: <DB::Connection as sqlx::Connection>::Options,
    max: u32,
    acquire: Duration,
    peers: Vec<std::net::SocketAddr>,
) -> Result<sqlx::Pool<DB>, sqlx::Error> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(max)
        // As the stores' own pools (outbox::store::connect): every connection opened up front,
        // none on demand in the middle of a measurement (~90 ms each on loopback).
        .min_connections(max)
        .acquire_timeout(acquire)
        .after_connect(move |_, _| {
            outbox::store::nodelay::set_nodelay_towards(&peers);
            Box::pin(async { Ok(()) })
        })
        .connect_with(options)
        .await
}

impl Db {
    /// Connect the control pool and create the run's schema (PostgreSQL).
    ///
    /// # Errors
    /// An unreachable server or a failing `CREATE SCHEMA`, with the URL (password redacted).
    pub async fn open(url: &str, run_id: &str, nodelay: bool) -> anyhow::Result<Db> {
        let dialect = dialect_of(url)?;
        let app = format!("outbox-bench-{run_id}-control");
        let control = connect(dialect, url, &app, false, 16, nodelay)
            .await
            .with_context(|| format!("cannot open {}", crate::redact(url)))?;
        let db = Db {
            dialect,
            url: url.to_owned(),
            run_id: run_id.to_owned(),
            control,
            nodelay,
        };
        if dialect == Dialect::Postgres {
            db.exec(&format!("CREATE SCHEMA bench_{run_id}")).await?;
        }
        Ok(db)
    }

    /// A new pool of at most `max` connections, labelled `outbox-bench-<run>-<label>`, with
    /// sqlx's statement log on (`log`) or off.
    ///
    /// # Errors
    /// The driver's connection error.
    pub async fn pool(&self, label: &str, log: bool, max: u32) -> anyhow::Result<Labeled> {
        let app = format!("outbox-bench-{}-{label}", self.run_id);
        let pool = connect(self.dialect, &self.url, &app, log, max, self.nodelay).await?;
        Ok(Labeled { pool, app })
    }

    /// Close `pool`; on PostgreSQL wait (up to 30 s) until its backends exited, so their table
    /// counters are flushed to `pg_stat_user_tables`.
    ///
    /// # Errors
    /// A failing query of `pg_stat_activity`.
    pub async fn retire(&self, pool: Labeled) -> anyhow::Result<()> {
        pool.pool.close().await;
        if let Pool::Pg(p) = &self.control {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&pool.app)
                .fetch_one(p)
                .await?;
                if n == 0 {
                    break;
                }
                if Instant::now() > deadline {
                    tracing::warn!(
                        app = pool.app,
                        backends = n,
                        "backends still connected after 30 s; table statistics may be incomplete"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// The name of the run's table `name`.
    pub fn table(&self, name: &str) -> String {
        match self.dialect {
            Dialect::Postgres => format!("bench_{}.{name}", self.run_id),
            _ => format!("bench_{}_{name}", self.run_id),
        }
    }

    /// Run `sql` (one or more statements, simple protocol) on the control pool.
    ///
    /// # Errors
    /// The database error, with the statement.
    pub async fn exec(&self, sql: &str) -> anyhow::Result<()> {
        let q = sqlx::raw_sql(AssertSqlSafe(sql.to_owned()));
        match &self.control {
            Pool::Pg(p) => q.execute(p).await.map(drop),
            Pool::My(p) => q.execute(p).await.map(drop),
            Pool::Lite(p) => q.execute(p).await.map(drop),
        }
        .with_context(|| format!("failed: {sql}"))
    }

    /// Create outbox table `table` through the library's migration (and its inbox tables).
    ///
    /// # Errors
    /// The migration's error.
    pub async fn migrate(&self, table: &str) -> anyhow::Result<Outbox> {
        let outbox = Outbox::open(&self.control, table)?;
        outbox.store().migrate().await?;
        Ok(outbox)
    }

    /// Drop outbox table `table` and its inbox tables.
    ///
    /// # Errors
    /// The database error.
    pub async fn drop_outbox(&self, table: &str) -> anyhow::Result<()> {
        for t in [
            table.to_owned(),
            format!("{table}_inbox"),
            format!("{table}_inbox_dlq"),
        ] {
            self.drop_table(&t).await?;
        }
        Ok(())
    }

    /// Rows in `table`.
    ///
    /// # Errors
    /// The database error.
    pub async fn count(&self, table: &str) -> anyhow::Result<u64> {
        let sql = AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}"));
        let n: i64 = match &self.control {
            Pool::Pg(p) => sqlx::query_scalar(sql).fetch_one(p).await?,
            Pool::My(p) => sqlx::query_scalar(sql).fetch_one(p).await?,
            Pool::Lite(p) => sqlx::query_scalar(sql).fetch_one(p).await?,
        };
        Ok(n.max(0) as u64)
    }

    /// Drop table `table` if it exists.
    ///
    /// # Errors
    /// The database error.
    pub async fn drop_table(&self, table: &str) -> anyhow::Result<()> {
        self.exec(&format!("DROP TABLE IF EXISTS {table}")).await
    }

    /// Drop everything the run created and its migration records.
    ///
    /// # Errors
    /// The first failing statement.
    pub async fn cleanup(&self) -> anyhow::Result<()> {
        let run = &self.run_id;
        match &self.control {
            Pool::Pg(_) => {
                self.exec(&format!("DROP SCHEMA bench_{run} CASCADE"))
                    .await?
            }
            Pool::My(p) => {
                let names: Vec<String> = sqlx::query_scalar(
                    "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_name LIKE ?",
                )
                .bind(format!("bench\\_{run}\\_%"))
                .fetch_all(p)
                .await?;
                for n in names {
                    self.drop_table(&n).await?;
                }
            }
            Pool::Lite(p) => {
                let names: Vec<String> = sqlx::query_scalar(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE ?",
                )
                .bind(format!("bench_{run}_%"))
                .fetch_all(p)
                .await?;
                for n in names {
                    self.drop_table(&n).await?;
                }
            }
        }
        // The table exists as soon as one migration ran.
        self.exec(&format!(
            "DELETE FROM outbox_migrations WHERE table_name LIKE 'bench_{run}%'"
        ))
        .await
    }

    /// Server version and the settings that bound the figures.
    ///
    /// # Errors
    /// The database error.
    pub async fn server_info(
        &self,
    ) -> anyhow::Result<(String, std::collections::BTreeMap<String, String>)> {
        let mut settings = std::collections::BTreeMap::new();
        let version = match &self.control {
            Pool::Pg(p) => {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT name, current_setting(name) FROM pg_settings WHERE name IN \
                     ('synchronous_commit', 'fsync', 'autovacuum', 'shared_buffers', \
                      'max_wal_size', 'checkpoint_timeout', 'wal_level', 'full_page_writes', \
                      'max_connections') ORDER BY name",
                )
                .fetch_all(p)
                .await?;
                settings.extend(rows);
                sqlx::query_scalar("SELECT current_setting('server_version')")
                    .fetch_one(p)
                    .await?
            }
            Pool::My(p) => {
                let row = sqlx::query(
                    "SELECT CAST(@@innodb_flush_log_at_trx_commit AS CHAR), CAST(@@sync_binlog AS CHAR), \
                     CAST(@@innodb_buffer_pool_size AS CHAR), CAST(@@log_bin AS CHAR)",
                )
                .fetch_one(p)
                .await?;
                for (i, name) in [
                    "innodb_flush_log_at_trx_commit",
                    "sync_binlog",
                    "innodb_buffer_pool_size",
                    "log_bin",
                ]
                .iter()
                .enumerate()
                {
                    let v: Option<String> = row.try_get(i)?;
                    settings.insert((*name).to_owned(), v.unwrap_or_default());
                }
                sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)")
                    .fetch_one(p)
                    .await?
            }
            Pool::Lite(p) => {
                settings.insert("journal_mode".into(), "wal".into());
                settings.insert("synchronous".into(), "full".into());
                sqlx::query_scalar("SELECT sqlite_version()")
                    .fetch_one(p)
                    .await?
            }
        };
        Ok((version, settings))
    }

    /// One reading of the database clock bracketed by this process's clock:
    /// `(sent_us, db_us, received_us)`.
    ///
    /// # Errors
    /// The database error.
    pub async fn clock_sample(&self) -> anyhow::Result<(i64, i64, i64)> {
        let sql = format!("SELECT {}", clock_sql(self.dialect));
        let q = AssertSqlSafe(sql);
        let sent = now_us();
        let db: i64 = match &self.control {
            Pool::Pg(p) => sqlx::query_scalar(q).fetch_one(p).await?,
            Pool::My(p) => sqlx::query_scalar(q).fetch_one(p).await?,
            Pool::Lite(p) => sqlx::query_scalar(q).fetch_one(p).await?,
        };
        Ok((sent, db, now_us()))
    }

    /// Insert `n` messages of `payload` on topic `topic` into `outbox` through the store's
    /// `enqueue_many` (the public producer API), 1,000 per statement, on a pool of its own that
    /// is retired afterwards so PostgreSQL's counters include the inserts. `keyed`: message `i`
    /// has partition key `key-<i mod 100,000>`.
    ///
    /// # Errors
    /// The first failing insert.
    pub async fn load(
        &self,
        table: &str,
        n: u64,
        payload: &[u8],
        topic: &str,
        keyed: bool,
        bar: &ProgressBar,
    ) -> anyhow::Result<()> {
        const CHUNK: u64 = 1_000;
        let loaders = if self.dialect == Dialect::Sqlite {
            1
        } else {
            2
        };
        let pool = self.pool("load", false, loaders).await?;
        let outbox = Outbox::open(&pool.pool, table)?;
        let chunks = (0..n.div_ceil(CHUNK)).map(|i| i * CHUNK..((i + 1) * CHUNK).min(n));
        let mut inserts = futures::stream::iter(chunks)
            .map(|range| {
                let msgs: Vec<NewMessage> = range
                    .map(|i| {
                        let m = NewMessage::new(topic, payload.to_vec());
                        if keyed {
                            m.with_partition_key(format!("key-{}", i % 100_000))
                        } else {
                            m
                        }
                    })
                    .collect();
                let count = msgs.len() as u64;
                let (outbox, pool) = (&outbox, &pool.pool);
                async move { outbox.enqueue_many(pool, msgs).await.map(|()| count) }
            })
            .buffer_unordered(loaders as usize);
        while let Some(done) = inserts.next().await {
            bar.inc(done?);
        }
        drop(inserts);
        self.retire(pool).await
    }

    /// Bring `table` to the state a backlog would be in after autovacuum caught up: vacuumed and
    /// analysed (PostgreSQL `VACUUM (ANALYZE)`, MySQL `ANALYZE TABLE`, SQLite `ANALYZE`), then a
    /// checkpoint where the bench may take one, so every drain starts from the same state.
    ///
    /// # Errors
    /// A failing `VACUUM`/`ANALYZE`; a refused `CHECKPOINT` is only logged.
    pub async fn settle(&self, table: &str) -> anyhow::Result<()> {
        match self.dialect {
            Dialect::Postgres => {
                self.exec(&format!("VACUUM (ANALYZE) {table}")).await?;
                if let Err(e) = self.exec("CHECKPOINT").await {
                    tracing::warn!(error = %e, "CHECKPOINT refused (needs pg_checkpoint or superuser); drains may start with a checkpoint pending");
                }
            }
            Dialect::MySql => self.exec(&format!("ANALYZE TABLE {table}")).await?,
            Dialect::Sqlite => {
                self.exec(&format!("ANALYZE {table}")).await?;
                self.exec("PRAGMA wal_checkpoint(TRUNCATE)").await?;
            }
        }
        Ok(())
    }

    /// PostgreSQL: the table's counters (and the database's commits). `None` elsewhere.
    ///
    /// # Errors
    /// The database error.
    pub async fn pg_counters(&self, table: &str) -> anyhow::Result<Option<PgCounters>> {
        let Pool::Pg(p) = &self.control else {
            return Ok(None);
        };
        let (inserted, updated, hot_updated, deleted, scans, db_commits): (
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
        ) = sqlx::query_as(
            "SELECT COALESCE(s.n_tup_ins, 0), COALESCE(s.n_tup_upd, 0), COALESCE(s.n_tup_hot_upd, 0), \
             COALESCE(s.n_tup_del, 0), COALESCE(s.seq_scan, 0) + COALESCE(s.idx_scan, 0), \
             (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) \
             FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
             WHERE c.oid = $1::text::regclass",
        )
        .bind(table)
        .fetch_one(p)
        .await?;
        Ok(Some(PgCounters {
            inserted,
            updated,
            hot_updated,
            deleted,
            scans,
            db_commits,
        }))
    }

    /// PostgreSQL: live and dead row versions, table and index sizes. `None` elsewhere.
    ///
    /// # Errors
    /// The database error.
    pub async fn table_stats(&self, table: &str) -> anyhow::Result<Option<TableStats>> {
        let Pool::Pg(p) = &self.control else {
            return Ok(None);
        };
        let (live_tuples, dead_tuples, table_bytes, index_bytes): (i64, i64, i64, i64) =
            sqlx::query_as(
                "SELECT COALESCE(s.n_live_tup, 0), COALESCE(s.n_dead_tup, 0), \
                 pg_table_size(c.oid), pg_indexes_size(c.oid) \
                 FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
                 WHERE c.oid = $1::text::regclass",
            )
            .bind(table)
            .fetch_one(p)
            .await?;
        let indexes: Vec<(String, i64)> = sqlx::query_as(
            "SELECT c.relname::text, pg_relation_size(i.indexrelid) FROM pg_index i \
             JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = $1::text::regclass",
        )
        .bind(table)
        .fetch_all(p)
        .await?;
        Ok(Some(TableStats {
            live_tuples,
            dead_tuples,
            table_bytes,
            index_bytes,
            indexes: indexes.into_iter().collect(),
        }))
    }

    /// Create the business table `table` (id, customer, amount, created_at).
    ///
    /// # Errors
    /// The database error.
    pub async fn create_business_table(&self, table: &str) -> anyhow::Result<()> {
        self.exec(&match self.dialect {
            Dialect::Postgres => format!(
                "CREATE TABLE {table} (id bigserial PRIMARY KEY, customer text NOT NULL, \
                 amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
            ),
            Dialect::MySql => format!(
                "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, customer VARCHAR(64) NOT NULL, \
                 amount BIGINT NOT NULL, created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB"
            ),
            Dialect::Sqlite => format!(
                "CREATE TABLE {table} (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, \
                 amount INTEGER NOT NULL, created_at INTEGER)"
            ),
        })
        .await
    }

    /// One business transaction on a connection of the control pool: `BEGIN`, the outbox rows
    /// (`enqueue_many`, one statement, when `msgs` is not empty), the business row, whose statement also reads the
    /// database clock, `COMMIT`; opened and committed as `mode` says.
    ///
    /// # Errors
    /// The first failing statement (the transaction is rolled back).
    pub async fn business_tx(
        &self,
        outbox: &Outbox,
        business: &str,
        customer: &str,
        msgs: Vec<NewMessage>,
        mode: TxMode,
    ) -> anyhow::Result<TxTimes> {
        let clock = clock_sql(self.dialect);
        let amount = rand::random::<u16>() as i64;
        let started = Instant::now();
        // BEGIN, the outbox row, then `$clock` (the business row, reading the database clock),
        // COMMIT: the frame every dialect shares.
        macro_rules! transaction {
            ($pool:expr, $store:expr, |$tx:ident| $clock:expr) => {{
                let mut $tx = match mode {
                    TxMode::Plain => $pool.begin().await?,
                    TxMode::Store => $store.begin().await?,
                };
                let ids = match msgs.len() {
                    0 => Vec::new(),
                    _ => $store.enqueue_many(&mut $tx, msgs).await?,
                };
                let db: i64 = $clock;
                let t = Instant::now();
                match mode {
                    TxMode::Plain => $tx.commit().await?,
                    TxMode::Store => $store.commit($tx).await?,
                }
                (ids, db, t)
            }};
        }
        let insert = |placeholders: &str, returning: &str| {
            AssertSqlSafe(format!(
                "INSERT INTO {business} (customer, amount) VALUES ({placeholders}){returning}"
            ))
        };
        let returning = format!(" RETURNING {clock}");
        let (message_ids, db_clock_us, before_commit) = match (&self.control, outbox) {
            (Pool::Pg(p), Outbox::Pg(s)) => transaction!(p, s, |tx| {
                sqlx::query_scalar(insert("$1, $2", &returning))
                    .bind(customer)
                    .bind(amount)
                    .fetch_one(&mut *tx)
                    .await?
            }),
            (Pool::My(p), Outbox::My(s)) => transaction!(p, s, |tx| {
                // MySQL has no INSERT … RETURNING: the next statement reads the clock.
                sqlx::query(insert("?, ?", ""))
                    .bind(customer)
                    .bind(amount)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT {clock}")))
                    .fetch_one(&mut *tx)
                    .await?
            }),
            (Pool::Lite(p), Outbox::Lite(s)) => transaction!(p, s, |tx| {
                sqlx::query_scalar(insert("?1, ?2", &returning))
                    .bind(customer)
                    .bind(amount)
                    .fetch_one(&mut *tx)
                    .await?
            }),
            _ => bail!("store and pool of different databases"),
        };
        let committed_us = now_us();
        Ok(TxTimes {
            message_ids,
            db_clock_us,
            committed_us,
            transaction_us: started.elapsed().as_micros() as u64,
            commit_us: before_commit.elapsed().as_micros() as u64,
        })
    }
}
