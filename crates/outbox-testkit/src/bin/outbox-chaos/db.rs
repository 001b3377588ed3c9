//! The chaos run's database side: the outbox and inbox tables, the producers' writes, the
//! consumer's effects and the final reads, on PostgreSQL or MySQL/MariaDB.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, bail};
use outbox::{HandlerError, InboundMessage, MySqlStore, NewMessage, PgStore, StoreOptions};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool};
use uuid::Uuid;

/// The payload of a chaos message: its key and per-key sequence number (ordered route), or
/// neither (unordered route); `rb` marks a message whose transaction is rolled back.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Payload {
    /// Partition key (ordered route).
    pub k: Option<String>,
    /// Sequence number within the key, from 0.
    pub s: u64,
    /// Written in a transaction that is rolled back.
    #[serde(default)]
    pub rb: bool,
}

/// A poison row and what makes it poison.
#[derive(Debug, Clone, Copy)]
pub enum Poison {
    /// A `Nats-*` header (reserved: it would steer JetStream).
    ReservedHeader,
    /// A header name with a line break.
    BadHeaderName,
    /// Headers that are not a JSON object.
    HeadersNotAnObject,
    /// A payload over the broker's limit (2 MiB; NATS' default `max_payload` is 1 MiB, the
    /// RabbitMQ transport is given `max_message_bytes` 1 MiB).
    Oversized,
    /// A topic no route matches.
    Unroutable,
}

impl Poison {
    /// Every kind, in turn.
    pub const ALL: [Poison; 5] = [
        Poison::ReservedHeader,
        Poison::BadHeaderName,
        Poison::HeadersNotAnObject,
        Poison::Oversized,
        Poison::Unroutable,
    ];

    /// (topic, headers JSON, payload size) for NATS, or for RabbitMQ when `rabbitmq`.
    fn row(self, rabbitmq: bool) -> (&'static str, String, usize) {
        let (topic, headers, size) = match self {
            Poison::ReservedHeader if rabbitmq => ("chaos-plain", r#"{"BCC":"x"}"#, 8),
            Poison::ReservedHeader => ("chaos-plain", r#"{"Nats-Msg-Id":"x"}"#, 8),
            // An AMQP short string holds at most 255 bytes.
            Poison::BadHeaderName if rabbitmq => {
                return (
                    "chaos-plain",
                    format!(r#"{{"{}":"v"}}"#, "n".repeat(300)),
                    8,
                );
            }
            Poison::BadHeaderName => ("chaos-plain", r#"{"bad\nname":"v"}"#, 8),
            Poison::HeadersNotAnObject => ("chaos-plain", "[1,2,3]", 8),
            Poison::Oversized => ("chaos-plain", "{}", 2 << 20),
            Poison::Unroutable => ("chaos-nowhere", "{}", 8),
        };
        (topic, headers.to_owned(), size)
    }
}

/// The database under test.
#[derive(Clone)]
pub enum Db {
    /// PostgreSQL.
    Pg(PgPool, PgStore),
    /// MySQL/MariaDB.
    My(MySqlPool, MySqlStore),
}

impl Db {
    /// Connect to `url` and create the outbox `table` (with its inbox) and an effects table.
    pub async fn open(url: &str, table: &str) -> anyhow::Result<Db> {
        let db = match outbox::store::Dialect::of_url(url)? {
            outbox::store::Dialect::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(16)
                    .connect(url)
                    .await
                    .with_context(|| format!("PostgreSQL at {url} does not answer"))?;
                let store = PgStore::from_pool(pool.clone(), StoreOptions::table(table))?;
                Db::Pg(pool, store)
            }
            outbox::store::Dialect::MySql => {
                let url = url.replacen("mariadb://", "mysql://", 1);
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(16)
                    .connect(&url)
                    .await
                    .with_context(|| format!("MySQL/MariaDB at {url} does not answer"))?;
                let store = MySqlStore::from_pool(pool.clone(), StoreOptions::table(table))?;
                Db::My(pool, store)
            }
            outbox::store::Dialect::Sqlite => {
                bail!(
                    "--database: the chaos run needs a server database (postgres:// or mysql://), not {url}"
                )
            }
        };
        let (store, effects) = match &db {
            Db::Pg(_, s) => (
                s as &dyn outbox::Store,
                format!(
                    "CREATE TABLE {table}_effects (id bigserial PRIMARY KEY, message_id text NOT NULL, \
                     pkey text, seq bigint NOT NULL, rb boolean NOT NULL)"
                ),
            ),
            Db::My(_, s) => (
                s as &dyn outbox::Store,
                format!(
                    "CREATE TABLE {table}_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                     message_id CHAR(36) NOT NULL, pkey VARCHAR(64), seq BIGINT NOT NULL, rb BOOLEAN NOT NULL)"
                ),
            ),
        };
        store.migrate().await.context("migrate the outbox")?;
        db.exec(&effects).await?;
        Ok(db)
    }

    /// The store.
    pub fn store(&self) -> Arc<dyn outbox::Store> {
        match self {
            Db::Pg(_, s) => Arc::new(s.clone()),
            Db::My(_, s) => Arc::new(s.clone()),
        }
    }

    /// Run one statement.
    pub async fn exec(&self, sql: &str) -> anyhow::Result<u64> {
        let sql = AssertSqlSafe(sql.to_owned());
        Ok(match self {
            Db::Pg(p, _) => sqlx::query(sql).execute(p).await?.rows_affected(),
            Db::My(p, _) => sqlx::query(sql).execute(p).await?.rows_affected(),
        })
    }

    /// Rows of `(text, integer)` from `sql` (the integer cast to 64 bits by the query).
    pub async fn pairs(&self, sql: &str) -> anyhow::Result<Vec<(Option<String>, i64)>> {
        let sql = AssertSqlSafe(sql.to_owned());
        Ok(match self {
            Db::Pg(p, _) => sqlx::query_as(sql).fetch_all(p).await?,
            Db::My(p, _) => sqlx::query_as(sql).fetch_all(p).await?,
        })
    }

    /// Enqueue `msgs` in one transaction; commit, or roll back after `hold` when `commit` is
    /// false. The transaction stays open `hold` before its end (a long transaction).
    pub async fn produce(
        &self,
        msgs: Vec<NewMessage>,
        commit: bool,
        hold: std::time::Duration,
    ) -> anyhow::Result<Vec<Uuid>> {
        macro_rules! produce {
            ($pool:expr, $store:expr) => {{
                let mut tx = $pool.begin().await?;
                let ids = $store.enqueue_many(&mut tx, msgs).await?;
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                if commit {
                    $store.commit(tx).await?;
                } else {
                    tx.rollback().await?;
                }
                ids
            }};
        }
        Ok(match self {
            Db::Pg(p, s) => produce!(p, s),
            Db::My(p, s) => produce!(p, s),
        })
    }

    /// Insert one poison row with plain SQL, as a foreign producer could; its message id.
    pub async fn poison(&self, table: &str, kind: Poison, rabbitmq: bool) -> anyhow::Result<Uuid> {
        let (topic, headers, size) = kind.row(rabbitmq);
        let id = Uuid::now_v7();
        let payload = vec![b'x'; size];
        match self {
            Db::Pg(p, _) => {
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {table} (message_id, topic, headers, payload) VALUES ($1, $2, $3::jsonb, $4)"
                )))
                .bind(id)
                .bind(topic)
                .bind(headers)
                .bind(payload)
                .execute(p)
                .await?;
            }
            Db::My(p, _) => {
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {table} (message_id, topic, headers, payload) VALUES (?, ?, ?, ?)"
                )))
                .bind(id.to_string())
                .bind(topic)
                .bind(headers)
                .bind(payload)
                .execute(p)
                .await?;
            }
        }
        Ok(id)
    }

    /// Drop what the run created.
    pub async fn drop_tables(&self, table: &str) {
        let stmts = match self {
            Db::Pg(..) => vec![
                format!(
                    "DROP TABLE IF EXISTS {table}_effects, {table}_inbox_dlq, {table}_inbox, {table}_buckets, {table}_relays, {table}_archive, {table} CASCADE"
                ),
                format!(
                    "DELETE FROM outbox_migrations WHERE table_name IN ('{table}', '{table}_inbox')"
                ),
            ],
            Db::My(..) => vec![
                format!(
                    "DROP TABLE IF EXISTS {table}_effects, {table}_inbox_dlq, {table}_inbox, {table}_buckets, {table}_relays, {table}_archive, {table}"
                ),
                format!(
                    "DELETE FROM outbox_migrations WHERE table_name IN ('{table}', '{table}_inbox')"
                ),
            ],
        };
        for s in stmts {
            let _ = self.exec(&s).await;
        }
    }
}

/// The inventory side of the run: inserts one effect row per applied message, in the inbox's
/// transaction, and counts them.
pub struct Effects {
    /// The effects table.
    pub table: String,
    /// Messages applied.
    pub applied: AtomicU64,
}

impl Effects {
    fn row(msg: &InboundMessage) -> Result<Payload, HandlerError> {
        msg.json::<Payload>()
            .map_err(|e| HandlerError::permanent(format!("not a chaos payload: {e}")))
    }
}

/// `outbox::Handler<$db>` for [`Effects`]: one effect row inserted with the dialect's
/// placeholders `$values` on the inbox transaction's connection.
macro_rules! effects_handler {
    ($db:ty, $conn:ty, $values:literal) => {
        #[async_trait::async_trait]
        impl outbox::Handler<$db> for Effects {
            async fn handle(
                &self,
                conn: &mut $conn,
                msg: &InboundMessage,
            ) -> Result<(), HandlerError> {
                let p = Self::row(msg)?;
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {} (message_id, pkey, seq, rb) VALUES {}",
                    self.table, $values
                )))
                .bind(msg.message_id.to_string())
                .bind(p.k)
                .bind(i64::try_from(p.s).unwrap_or(i64::MAX))
                .bind(p.rb)
                .execute(&mut *conn)
                .await
                .map_err(HandlerError::transient)?;
                self.applied.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
    };
}

effects_handler!(sqlx::Postgres, sqlx::PgConnection, "($1, $2, $3, $4)");
effects_handler!(sqlx::MySql, sqlx::MySqlConnection, "(?, ?, ?, ?)");
