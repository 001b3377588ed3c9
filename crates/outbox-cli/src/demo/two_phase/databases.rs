//! The demo's three databases: the order service's orders and barrier, the outbox, and the
//! consumer's inbox with its record of applied messages.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use async_trait::async_trait;
use outbox::consumer::ConsumerMetrics;
use outbox::store::Dialect;
use outbox::two_phase::barrier::{Barrier, BarrierError};
use outbox::{HandlerError, InboundMessage, Inbox, SqliteStore, Store, StoreOptions};
use sqlx::ConnectOptions;
use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use uuid::Uuid;

use super::super::scenario::numbered;
use super::super::{CONSUMER, DemoArgs, TOPIC};

/// The outbox table (on a server database it may share with other demos, hence the prefix).
use super::*;
/// The order service's business database: its orders and its barrier.
#[derive(Clone)]
pub(super) enum OrdersDb {
    /// A SQLite file.
    Sqlite {
        /// The pool.
        pool: SqlitePool,
        /// The barrier on it.
        barrier: Barrier<sqlx::Sqlite>,
    },
    /// A PostgreSQL database.
    Postgres {
        /// The pool.
        pool: PgPool,
        /// The barrier on it.
        barrier: Barrier<sqlx::Postgres>,
    },
    /// A MySQL/MariaDB database.
    MySql {
        /// The pool.
        pool: MySqlPool,
        /// The barrier on it.
        barrier: Barrier<sqlx::MySql>,
    },
}

/// `$body` with `$pool` and `$barrier` bound to the orders database's pool and barrier,
/// whatever the database: the same code, compiled for each driver.
macro_rules! each_orders_db {
    ($db:expr, |$pool:ident, $barrier:ident| $body:expr) => {
        match $db {
            OrdersDb::Sqlite {
                pool: $pool,
                barrier: $barrier,
            } => $body,
            OrdersDb::Postgres {
                pool: $pool,
                barrier: $barrier,
            } => $body,
            OrdersDb::MySql {
                pool: $pool,
                barrier: $barrier,
            } => $body,
        }
    };
}

impl OrdersDb {
    /// Open the orders database afresh: the SQLite file recreated, or the demo's orders and
    /// barrier tables dropped and created again on the server.
    pub(super) async fn open(args: &DemoArgs) -> anyhow::Result<OrdersDb> {
        let db = match &args.orders_database {
            None => {
                let pool = fresh_sqlite(&args.data_dir, ORDERS_FILE)
                    .await
                    .context("cannot open the orders database")?;
                OrdersDb::Sqlite {
                    barrier: Barrier::new(pool.clone()).with_table(BARRIER_TABLE)?,
                    pool,
                }
            }
            Some(url) => match Dialect::of_url(url)? {
                Dialect::Postgres => {
                    let pool = server_pool(url, "the orders database (PostgreSQL)").await?;
                    OrdersDb::Postgres {
                        barrier: Barrier::new(pool.clone()).with_table(BARRIER_TABLE)?,
                        pool,
                    }
                }
                Dialect::MySql => {
                    let url = url.replacen("mariadb://", "mysql://", 1);
                    let pool = server_pool(&url, "the orders database (MySQL/MariaDB)").await?;
                    OrdersDb::MySql {
                        barrier: Barrier::new(pool.clone()).with_table(BARRIER_TABLE)?,
                        pool,
                    }
                }
                Dialect::Sqlite => bail!(
                    "--orders-database takes a PostgreSQL or MySQL/MariaDB URL; without it the \
                     orders are in {ORDERS_FILE} in --data-dir"
                ),
            },
        };
        let ddl = db.ddl();
        each_orders_db!(&db, |pool, barrier| {
            for statement in ddl {
                sqlx::query(sqlx::AssertSqlSafe(statement))
                    .execute(pool)
                    .await
                    .context("cannot create the orders table")?;
            }
            barrier.migrate().await?;
        });
        Ok(db)
    }

    /// The statements that drop (on a server) and create the orders table. The barrier table
    /// is dropped here and created by [`Barrier::migrate`].
    pub(super) fn ddl(&self) -> Vec<String> {
        let (o, b) = (ORDERS_TABLE, BARRIER_TABLE);
        match self {
            OrdersDb::Sqlite { .. } => vec![format!(
                "CREATE TABLE {o} (id INTEGER PRIMARY KEY, message_id TEXT NOT NULL UNIQUE, \
                 created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)"
            )],
            OrdersDb::Postgres { .. } => vec![
                format!("DROP TABLE IF EXISTS {o}, {b}"),
                format!(
                    "CREATE TABLE {o} (id bigint PRIMARY KEY, message_id text NOT NULL UNIQUE, \
                     created_at timestamptz NOT NULL DEFAULT now())"
                ),
            ],
            OrdersDb::MySql { .. } => vec![
                format!("DROP TABLE IF EXISTS {o}, {b}"),
                format!(
                    "CREATE TABLE {o} (id BIGINT PRIMARY KEY, message_id CHAR(36) CHARACTER SET \
                     ascii NOT NULL UNIQUE, created_at DATETIME(6) NOT NULL DEFAULT \
                     CURRENT_TIMESTAMP(6)) ENGINE=InnoDB"
                ),
            ],
        }
    }

    /// The database, for the banner.
    pub(super) fn describe(&self, args: &DemoArgs) -> String {
        let tables = format!("tables {ORDERS_TABLE} + {BARRIER_TABLE}");
        match (self, &args.orders_database) {
            (OrdersDb::Sqlite { .. }, _) => format!(
                "SQLite {} ({tables})",
                args.data_dir.join(ORDERS_FILE).display()
            ),
            (OrdersDb::Postgres { .. }, Some(url)) => {
                format!("PostgreSQL {} ({tables})", crate::redact(url))
            }
            (OrdersDb::MySql { .. }, Some(url)) => {
                format!("MySQL/MariaDB {} ({tables})", crate::redact(url))
            }
            _ => tables,
        }
    }

    /// `sql`, written with `?` placeholders, in this database's syntax.
    pub(super) fn sql(&self, sql: &str) -> String {
        match self {
            OrdersDb::Postgres { .. } => numbered(sql),
            OrdersDb::Sqlite { .. } | OrdersDb::MySql { .. } => sql.to_owned(),
        }
    }

    /// The business transaction of order `order_id`: mark `message_id` in the barrier, insert
    /// the order, then commit (or roll back when `commit` is false). A mark the barrier refuses
    /// (a check-back decided ROLLBACK first) rolls the transaction back.
    pub(super) async fn place(
        &self,
        order_id: i64,
        message_id: Uuid,
        commit: bool,
    ) -> anyhow::Result<Business> {
        let insert = self.sql(&format!(
            "INSERT INTO {ORDERS_TABLE} (id, message_id) VALUES (?, ?)"
        ));
        Ok(each_orders_db!(self, |pool, barrier| {
            let mut tx = pool.begin().await?;
            match barrier.mark(&mut *tx, message_id).await {
                Ok(()) => {}
                Err(BarrierError::Decided(_)) => {
                    tx.rollback().await?;
                    return Ok(Business::Refused);
                }
                Err(e) => return Err(e).context("the barrier mark failed"),
            }
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(order_id)
                .bind(message_id.to_string())
                .execute(&mut *tx)
                .await?;
            if commit {
                tx.commit().await?;
                Business::Committed
            } else {
                tx.rollback().await?;
                Business::RolledBack
            }
        }))
    }

    /// The barrier's HTTP check-back endpoint at [`CHECK_BACK_PATH`] (unsigned: it listens on
    /// 127.0.0.1 only).
    pub(super) fn check_back_router(&self) -> anyhow::Result<axum::Router> {
        Ok(each_orders_db!(self, |_pool, barrier| barrier
            .router(CHECK_BACK_PATH, None)?))
    }

    /// Every order row: (order id, message id).
    pub(super) async fn orders(&self) -> anyhow::Result<Vec<(i64, String)>> {
        let sql = format!("SELECT id, message_id FROM {ORDERS_TABLE}");
        Ok(each_orders_db!(self, |pool, _barrier| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await?
        }))
    }
}

/// Open the outbox afresh: the SQLite file recreated, or the demo's outbox tables dropped (and
/// their migrations forgotten) on the server; migrated either way.
pub(super) async fn open_outbox(args: &DemoArgs) -> anyhow::Result<Arc<dyn Store>> {
    let options = StoreOptions::table(OUTBOX_TABLE);
    let store: Arc<dyn Store> = match &args.database {
        None => {
            let pool = fresh_sqlite(&args.data_dir, OUTBOX_FILE)
                .await
                .context("cannot open the outbox database")?;
            Arc::new(SqliteStore::from_pool(pool, options)?)
        }
        Some(url) => {
            let dialect = Dialect::of_url(url)?;
            let url = url.replacen("mariadb://", "mysql://", 1);
            match dialect {
                Dialect::Postgres => reset_outbox::<sqlx::Postgres>(&url, &options, true).await?,
                Dialect::MySql => reset_outbox::<sqlx::MySql>(&url, &options, false).await?,
                Dialect::Sqlite => bail!(
                    "--database takes a PostgreSQL or MySQL/MariaDB URL; without it the outbox \
                     is in {OUTBOX_FILE} in --data-dir"
                ),
            }
            outbox::store::connect(&url, options)
                .await
                .context("cannot open the outbox database")?
        }
    };
    store.migrate().await?;
    Ok(store)
}

/// Drop the demo's outbox tables on the server at `url` and forget their migrations, so the
/// store's migration creates them again; `postgres` picks the PostgreSQL spelling.
pub(super) async fn reset_outbox<DB>(
    url: &str,
    options: &StoreOptions,
    postgres: bool,
) -> anyhow::Result<()>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments: sqlx::IntoArguments<DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::Connection;
    let mut conn = DB::Connection::connect(url)
        .await
        .context("cannot connect to the outbox database")?;
    let (t, i) = (options.table.as_str(), options.inbox_table.as_str());
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {t}, {t}_buckets, {t}_relays, {t}_archive, {i}, {i}_dlq"
    )))
    .execute(&mut conn)
    .await
    .context("cannot drop the demo's outbox tables")?;
    let exists = if postgres {
        "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = current_schema() AND table_name = 'outbox_migrations'"
    } else {
        "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name = 'outbox_migrations'"
    };
    let exists: i64 = sqlx::query_scalar(exists).fetch_one(&mut conn).await?;
    if exists > 0 {
        // Names checked by StoreOptions' rules when the store opens; ours are constants.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM outbox_migrations WHERE table_name IN ('{t}', '{i}')"
        )))
        .execute(&mut conn)
        .await?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// The consumer's side: its SQLite file (recreated), with its inbox and its record of
/// received messages, its handler and its counters.
pub(super) struct ConsumerDb {
    /// The inbox.
    pub(super) inbox: Inbox<sqlx::Sqlite>,
    /// The pool.
    pub(super) pool: SqlitePool,
    /// The handler, counting its runs.
    pub(super) recorder: Arc<Recorder>,
    /// The consumer runner's counters.
    pub(super) metrics: Arc<ConsumerMetrics>,
}

impl ConsumerDb {
    /// Recreate [`CONSUMER_FILE`] in `dir`, with the inbox and the received table.
    pub(super) async fn open(dir: &Path) -> anyhow::Result<ConsumerDb> {
        let pool = fresh_sqlite(dir, CONSUMER_FILE)
            .await
            .context("cannot open the consumer database")?;
        let inbox = Inbox::new(pool.clone(), INBOX_TABLE, CONSUMER)?;
        inbox.migrate().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {RECEIVED_TABLE} (id INTEGER PRIMARY KEY AUTOINCREMENT, \
             message_id TEXT NOT NULL, order_id INTEGER NOT NULL)"
        )))
        .execute(&pool)
        .await?;
        Ok(ConsumerDb {
            inbox,
            pool,
            recorder: Arc::default(),
            metrics: Arc::default(),
        })
    }

    /// Distinct messages applied so far.
    pub(super) async fn distinct_received(&self) -> anyhow::Result<u64> {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(DISTINCT message_id) FROM {RECEIVED_TABLE}"
        )))
        .fetch_one(&self.pool)
        .await?;
        Ok(n as u64)
    }

    /// Applications per message id.
    pub(super) async fn received(&self) -> anyhow::Result<HashMap<String, i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT message_id, COUNT(*) FROM {RECEIVED_TABLE} GROUP BY message_id"
        )))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().collect())
    }
}

/// The consumer's handler: records each `order-created` message it applies, in the inbox
/// transaction, and counts its runs per message id (a run whose transaction rolled back
/// included).
#[derive(Default)]
pub(super) struct Recorder {
    /// Handler runs per message id.
    pub(super) runs: Mutex<HashMap<Uuid, u32>>,
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for Recorder {
    async fn handle(
        &self,
        conn: &mut SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        if msg.topic != TOPIC {
            return Err(HandlerError::permanent(format!(
                "unexpected topic {:?}",
                msg.topic
            )));
        }
        let order: OrderCreated = msg.json().map_err(HandlerError::permanent)?;
        *self
            .runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(msg.message_id)
            .or_default() += 1;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {RECEIVED_TABLE} (message_id, order_id) VALUES (?, ?)"
        )))
        .bind(msg.message_id.to_string())
        .bind(order.order_id)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// A pool on the SQLite file `name` in `dir`, deleted first (with its WAL files): WAL,
/// `synchronous = FULL`, a 10 s busy timeout, statement logging off (waiting for the single
/// write lock is the expected contention here).
pub(super) async fn fresh_sqlite(dir: &Path, name: &str) -> anyhow::Result<SqlitePool> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for suffix in ["", "-wal", "-shm"] {
        let file: PathBuf = dir.join(format!("{name}{suffix}"));
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).context(format!("cannot delete {}", file.display())),
        }
    }
    Ok(SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(dir.join(name))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(10))
                .disable_statement_logging(),
        )
        .await?)
}

/// A pool of up to 16 connections on the server at `url` (`what` names it in errors),
/// statement logging off (a check-back waiting for a business transaction's barrier row is the
/// expected contention here).
pub(super) async fn server_pool<DB: sqlx::Database>(
    url: &str,
    what: &str,
) -> anyhow::Result<sqlx::Pool<DB>>
where
    <DB::Connection as sqlx::Connection>::Options: FromStr<Err = sqlx::Error>,
{
    let options =
        <DB::Connection as sqlx::Connection>::Options::from_str(url)?.disable_statement_logging();
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .with_context(|| format!("cannot connect to {what}"))
}
