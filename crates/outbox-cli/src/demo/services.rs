//! The two services' databases: the order service's outbox store and orders table, the
//! inventory service's inbox, stock and deduction log; on two SQLite files, or both on one
//! PostgreSQL or MySQL/MariaDB database. Also the statements the clients and the report run on
//! them.
//!
//! Each query is written once: [`each_db!`] runs the same code on whichever database the run
//! uses, and [`Services::sql`] puts `?` placeholders into the database's syntax.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use outbox::store::Dialect;
use outbox::{Inbox, MySqlStore, NewMessage, PgStore, SqliteStore, Store, StoreOptions};
use sqlx::ConnectOptions;
use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::scenario::{CancelOrder, Order, initial_stock, numbered};
use super::{CONSUMER, DemoArgs, PLACED, SKUS, TOPIC};

/// Table names of both services.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tables {
    /// The order service's orders.
    pub(super) orders: &'static str,
    /// The order service's outbox.
    pub(super) outbox: &'static str,
    /// The inventory service's stock per SKU.
    pub(super) stock: &'static str,
    /// The inventory service's inbox.
    pub(super) inbox: &'static str,
    /// The inventory service's deduction log.
    pub(super) deductions: &'static str,
}

/// SQLite: each service has its own file, so plain names.
const SQLITE_TABLES: Tables = Tables {
    orders: "orders",
    outbox: "outbox",
    stock: "stock",
    inbox: "inbox",
    deductions: "deductions",
};

/// PostgreSQL: both services share the database, so distinct prefixed names.
const PG_TABLES: Tables = Tables {
    orders: "demo_orders",
    outbox: "demo_outbox",
    stock: "demo_stock",
    inbox: "demo_inbox",
    deductions: "demo_deductions",
};

/// The two services' databases.
#[derive(Clone)]
pub(super) enum Services {
    /// Two SQLite files.
    Sqlite {
        /// The order service's outbox (its pool holds the orders table too).
        store: SqliteStore,
        /// The inventory service's database.
        inventory: SqlitePool,
        /// The inventory service's inbox.
        inbox: Inbox<sqlx::Sqlite>,
    },
    /// One PostgreSQL database.
    Postgres {
        /// The order service's outbox (its pool holds the orders table too).
        store: PgStore,
        /// The inventory service's pool.
        inventory: PgPool,
        /// The inventory service's inbox.
        inbox: Inbox<sqlx::Postgres>,
    },
    /// One MySQL/MariaDB database.
    MySql {
        /// The order service's outbox (its pool holds the orders table too).
        store: MySqlStore,
        /// The inventory service's pool.
        inventory: MySqlPool,
        /// The inventory service's inbox.
        inbox: Inbox<sqlx::MySql>,
    },
}

/// `$body` with `$var` bound to the field `$field` (`store`, `inventory` or `inbox`) of
/// `$services`, whatever the database: the same code, compiled for each driver.
macro_rules! each_db {
    ($services:expr, $field:ident, |$var:ident| $body:expr) => {
        match $services {
            Services::Sqlite { $field: $var, .. } => $body,
            Services::Postgres { $field: $var, .. } => $body,
            Services::MySql { $field: $var, .. } => $body,
        }
    };
}
pub(super) use each_db;

/// The statements creating each service's own tables (beside the outbox and the inbox, which
/// their migrations create).
struct Ddl {
    /// The orders table.
    orders: String,
    /// The stock and the deduction log (several statements).
    inventory: String,
}

impl Services {
    /// Create fresh databases for both services: two SQLite files in `--data-dir`, or the
    /// `--database` server both share.
    pub(super) async fn open(args: &DemoArgs) -> anyhow::Result<Services> {
        let services = match &args.database {
            None => Services::open_sqlite(&args.data_dir).await?,
            Some(url) => match Dialect::of_url(url)? {
                Dialect::Postgres => Services::open_postgres(url).await?,
                Dialect::MySql => {
                    Services::open_mysql(&url.replacen("mariadb://", "mysql://", 1)).await?
                }
                Dialect::Sqlite => bail!(
                    "--database takes a PostgreSQL or MySQL/MariaDB URL; without it the demo \
                     uses two SQLite files in --data-dir"
                ),
            },
        };
        services.prepare(args.total_orders()).await
    }

    async fn open_sqlite(dir: &Path) -> anyhow::Result<Services> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for db in ["orders.db", "inventory.db"] {
            for suffix in ["", "-wal", "-shm"] {
                let file = dir.join(format!("{db}{suffix}"));
                match std::fs::remove_file(&file) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).context(format!("cannot delete {}", file.display())),
                }
            }
        }
        let orders = sqlite_pool(&dir.join("orders.db"))
            .await
            .context("cannot open the order database")?;
        let inventory = sqlite_pool(&dir.join("inventory.db"))
            .await
            .context("cannot open the inventory database")?;
        Ok(Services::Sqlite {
            store: SqliteStore::from_pool(orders, StoreOptions::table(SQLITE_TABLES.outbox))?,
            inbox: Inbox::new(inventory.clone(), SQLITE_TABLES.inbox, CONSUMER)?,
            inventory,
        })
    }

    async fn open_postgres(url: &str) -> anyhow::Result<Services> {
        let (orders, inventory) = server_pools(url, "PostgreSQL").await?;
        let options = StoreOptions::table(PG_TABLES.outbox);
        // Start from scratch: drop the demo tables (with the inboxes' dead-letter tables) and
        // forget their migrations.
        let (ours, all) = shared_tables(&options);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {all} CASCADE"
        )))
        .execute(&inventory)
        .await?;
        let has_migrations: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('outbox_migrations')::text")
                .fetch_one(&inventory)
                .await?;
        if has_migrations.is_some() {
            sqlx::query("DELETE FROM outbox_migrations WHERE table_name = ANY($1)")
                .bind(ours)
                .execute(&inventory)
                .await?;
        }
        Ok(Services::Postgres {
            store: PgStore::from_pool(orders, options)?,
            inbox: Inbox::new(inventory.clone(), PG_TABLES.inbox, CONSUMER)?,
            inventory,
        })
    }

    async fn open_mysql(url: &str) -> anyhow::Result<Services> {
        let (orders, inventory) = server_pools(url, "MySQL/MariaDB").await?;
        let options = StoreOptions::table(PG_TABLES.outbox);
        // As on PostgreSQL; the migrations are forgotten by a list of quoted names.
        let (ours, all) = shared_tables(&options);
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {all}")))
            .execute(&inventory)
            .await?;
        let has_migrations: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = 'outbox_migrations'",
        )
        .fetch_one(&inventory)
        .await?;
        if has_migrations > 0 {
            let quoted: Vec<String> = ours.iter().map(|t| format!("'{t}'")).collect();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM outbox_migrations WHERE table_name IN ({})",
                quoted.join(", ")
            )))
            .execute(&inventory)
            .await?;
        }
        Ok(Services::MySql {
            store: MySqlStore::from_pool(orders, options)?,
            inbox: Inbox::new(inventory.clone(), PG_TABLES.inbox, CONSUMER)?,
            inventory,
        })
    }

    /// The services' own tables on this database.
    fn ddl(&self) -> Ddl {
        let t = self.tables();
        let (stock, log) = (t.stock, t.deductions);
        match self {
            Services::Sqlite { .. } => Ddl {
                orders: format!(
                    "CREATE TABLE {} (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, qty INTEGER NOT NULL, \
                     status TEXT NOT NULL DEFAULT '{PLACED}', \
                     created_at INTEGER NOT NULL DEFAULT (CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)))",
                    t.orders
                ),
                inventory: format!(
                    "CREATE TABLE {stock} (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
                     CREATE TABLE {log} (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
                         sku TEXT NOT NULL, qty INTEGER NOT NULL, message_id TEXT NOT NULL);
                     CREATE INDEX {log}_order_id ON {log} (order_id);"
                ),
            },
            Services::Postgres { .. } => Ddl {
                orders: format!(
                    "CREATE TABLE {} (id bigint PRIMARY KEY, sku text NOT NULL, qty bigint NOT NULL, \
                     status text NOT NULL DEFAULT '{PLACED}', created_at timestamptz NOT NULL DEFAULT now())",
                    t.orders
                ),
                inventory: format!(
                    "CREATE TABLE {stock} (sku text PRIMARY KEY, qty bigint NOT NULL);
                     CREATE TABLE {log} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                         order_id bigint NOT NULL, sku text NOT NULL, qty bigint NOT NULL,
                         message_id uuid NOT NULL);
                     CREATE INDEX {log}_order_id ON {log} (order_id);"
                ),
            },
            Services::MySql { .. } => Ddl {
                orders: format!(
                    "CREATE TABLE {} (id BIGINT PRIMARY KEY, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, \
                     status VARCHAR(32) NOT NULL DEFAULT '{PLACED}', \
                     created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))) ENGINE=InnoDB",
                    t.orders
                ),
                inventory: format!(
                    "CREATE TABLE {stock} (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL) ENGINE=InnoDB;
                     CREATE TABLE {log} (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                         order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL,
                         message_id CHAR(36) NOT NULL, KEY {log}_order_id (order_id)) ENGINE=InnoDB;"
                ),
            },
        }
    }

    /// Migrate the outbox and the inbox, create the services' own tables, give the store its
    /// rejection hook and fill the stock: the part of opening every database shares.
    async fn prepare(mut self, orders: usize) -> anyhow::Result<Services> {
        let t = self.tables();
        let ddl = self.ddl();
        each_db!(&mut self, store, |store| {
            store.migrate().await?;
            sqlx::query(sqlx::AssertSqlSafe(ddl.orders))
                .execute(store.pool())
                .await?;
            // The compensation enqueues through a store without a hook of its own (enqueue
            // needs only the table); the store the relay and the confirmation listener use
            // runs it.
            let hook = Arc::new(CancelOrder {
                orders: t.orders,
                outbox: store.clone(),
            });
            *store = store.clone().with_rejection_hook(hook);
        });
        each_db!(&self, inbox, |inbox| inbox.migrate().await?);
        each_db!(&self, inventory, |pool| {
            sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.inventory))
                .execute(pool)
                .await?;
        });
        let insert = self.sql(&format!("INSERT INTO {} (sku, qty) VALUES (?, ?)", t.stock));
        for sku in SKUS {
            each_db!(&self, inventory, |pool| {
                sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                    .bind(sku)
                    .bind(initial_stock(orders))
                    .execute(pool)
                    .await?;
            });
        }
        Ok(self)
    }

    /// The databases, for the banner.
    pub(super) fn describe(&self, args: &DemoArgs) -> String {
        match self {
            Services::Sqlite { .. } => format!(
                "SQLite ({0}/orders.db, {0}/inventory.db)",
                args.data_dir.display()
            ),
            Services::Postgres { .. } => {
                "PostgreSQL (demo_orders + demo_outbox, demo_stock + demo_inbox + demo_deductions)"
                    .into()
            }
            Services::MySql { .. } => "MySQL/MariaDB (demo_orders + demo_outbox, demo_stock + \
                 demo_inbox + demo_deductions)"
                .into(),
        }
    }

    /// The tables' names on this database.
    pub(super) fn tables(&self) -> Tables {
        match self {
            Services::Sqlite { .. } => SQLITE_TABLES,
            Services::Postgres { .. } | Services::MySql { .. } => PG_TABLES,
        }
    }

    /// The type a `CAST` to a 64-bit integer names on this database.
    fn bigint(&self) -> &'static str {
        match self {
            Services::MySql { .. } => "SIGNED",
            Services::Sqlite { .. } | Services::Postgres { .. } => "BIGINT",
        }
    }

    /// `sql`, written with `?` placeholders, in this database's syntax.
    fn sql(&self, sql: &str) -> String {
        match self {
            Services::Postgres { .. } => numbered(sql),
            Services::Sqlite { .. } | Services::MySql { .. } => sql.to_owned(),
        }
    }

    /// The order service's outbox store, for the relay.
    pub(super) fn store(&self) -> Arc<dyn Store> {
        each_db!(self, store, |store| Arc::new(store.clone()))
    }

    /// Place one order: the order row and its `order-created` message in one transaction.
    pub(super) async fn place_order(&self, order: &Order) -> anyhow::Result<()> {
        let message =
            NewMessage::json(TOPIC, order)?.with_partition_key(order.order_id.to_string());
        let insert = self.sql(&format!(
            "INSERT INTO {} (id, sku, qty) VALUES (?, ?, ?)",
            self.tables().orders
        ));
        each_db!(self, store, |store| {
            let mut tx = store.begin().await?;
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(order.order_id)
                .bind(&order.sku)
                .bind(order.qty)
                .execute(&mut *tx)
                .await?;
            store.enqueue(&mut tx, message).await?;
            store.commit(tx).await?;
        });
        Ok(())
    }

    /// Every order row: (id, sku, qty, status).
    pub(super) async fn orders(&self) -> anyhow::Result<Vec<(i64, String, i64, String)>> {
        let sql = format!("SELECT id, sku, qty, status FROM {}", self.tables().orders);
        Ok(each_db!(self, store, |store| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(store.pool())
                .await?
        }))
    }

    /// Every outbox row: (topic, partition key = order id, status number). Read from the table:
    /// the store's API has counts by status ([`Store::stats`]), not rows by topic and key.
    pub(super) async fn outbox_rows(&self) -> anyhow::Result<Vec<(String, Option<String>, i64)>> {
        // MySQL has no CAST to TEXT (its text columns read as strings already).
        let (topic, key) = match self {
            Services::MySql { .. } => ("topic", "partition_key"),
            Services::Sqlite { .. } | Services::Postgres { .. } => {
                ("CAST(topic AS TEXT)", "CAST(partition_key AS TEXT)")
            }
        };
        let sql = format!(
            "SELECT {topic}, {key}, CAST(status AS {}) FROM {}",
            self.bigint(),
            self.tables().outbox
        );
        Ok(each_db!(self, store, |store| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(store.pool())
                .await?
        }))
    }

    /// Commit-to-verdict latency of every `order-created` message that got its verdict
    /// (`confirmed_at - created_at`, database clock), in microseconds. Read from the outbox
    /// table: the store's API has no per-message timestamps.
    pub(super) async fn verdict_latencies(&self) -> anyhow::Result<Vec<i64>> {
        let t = self.tables().outbox;
        let sql = self.sql(&match self {
            Services::Sqlite { .. } => format!(
                "SELECT (confirmed_at - created_at) * 1000 FROM {t} \
                 WHERE topic = ? AND confirmed_at IS NOT NULL"
            ),
            Services::Postgres { .. } => format!(
                "SELECT CAST(EXTRACT(EPOCH FROM confirmed_at - created_at) * 1000000 AS BIGINT) \
                 FROM {t} WHERE topic = ? AND confirmed_at IS NOT NULL"
            ),
            Services::MySql { .. } => format!(
                "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, confirmed_at) \
                 FROM {t} WHERE topic = ? AND confirmed_at IS NOT NULL"
            ),
        });
        Ok(each_db!(self, store, |store| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(TOPIC)
                .fetch_all(store.pool())
                .await?
        }))
    }

    /// Every deduction log row: (order id, sku, qty).
    pub(super) async fn deductions(&self) -> anyhow::Result<Vec<(i64, String, i64)>> {
        let sql = format!(
            "SELECT order_id, sku, qty FROM {}",
            self.tables().deductions
        );
        Ok(each_db!(self, inventory, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await?
        }))
    }

    /// Orders with at least one deduction.
    pub(super) async fn orders_with_deduction(&self) -> anyhow::Result<u64> {
        let sql = format!(
            "SELECT COUNT(DISTINCT order_id) FROM {}",
            self.tables().deductions
        );
        let n: i64 = each_db!(self, inventory, |pool| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(pool)
                .await?
        });
        Ok(n as u64)
    }

    /// Stock per SKU now.
    pub(super) async fn stock(&self) -> anyhow::Result<Vec<(String, i64)>> {
        let sql = format!("SELECT sku, qty FROM {}", self.tables().stock);
        Ok(each_db!(self, inventory, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await?
        }))
    }

    /// Publish attempts recorded in the outbox (the sum of `attempts`). Read from the table:
    /// the store's API does not sum them.
    pub(super) async fn publish_attempts(&self) -> anyhow::Result<i64> {
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(attempts), 0) AS {}) FROM {}",
            self.bigint(),
            self.tables().outbox
        );
        Ok(each_db!(self, store, |store| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(store.pool())
                .await?
        }))
    }
}

/// The demo's tables on a database both services share (PostgreSQL, MySQL): those whose
/// migrations are recorded, and all of them with the inboxes' dead-letter tables, comma-separated
/// (for `DROP TABLE`).
fn shared_tables(outbox_options: &StoreOptions) -> (Vec<String>, String) {
    let t = PG_TABLES;
    let ours: Vec<String> = [
        t.orders,
        t.outbox,
        outbox_options.inbox_table.as_str(),
        t.stock,
        t.inbox,
        t.deductions,
    ]
    .map(str::to_owned)
    .to_vec();
    let dead_letters = [
        format!("{}_dlq", outbox_options.inbox_table),
        format!("{}_dlq", t.inbox),
    ];
    let all = format!("{}, {}", ours.join(", "), dead_letters.join(", "));
    (ours, all)
}

/// A pool on a fresh SQLite file: WAL, `synchronous = FULL`, a 10 s busy timeout. Statement
/// logging is off: waiting for SQLite's single write lock under 16 concurrent clients is the
/// expected contention here, not a slow query worth a warning.
async fn sqlite_pool(file: &Path) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(file)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(10))
                .disable_statement_logging(),
        )
        .await
}

/// The order service's and the inventory service's pools on the `server` (named in errors) at
/// `url`: up to 10 connections each, statement logging off (row-lock waits on the hot stock rows
/// are expected contention).
async fn server_pools<DB: sqlx::Database>(
    url: &str,
    server: &str,
) -> anyhow::Result<(sqlx::Pool<DB>, sqlx::Pool<DB>)>
where
    <DB::Connection as sqlx::Connection>::Options: FromStr<Err = sqlx::Error>,
{
    let options =
        <DB::Connection as sqlx::Connection>::Options::from_str(url)?.disable_statement_logging();
    let pool = || {
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
    };
    let orders = pool()
        .await
        .with_context(|| format!("cannot connect to {server} for the order service"))?;
    let inventory = pool()
        .await
        .with_context(|| format!("cannot connect to {server} for the inventory service"))?;
    Ok((orders, inventory))
}
