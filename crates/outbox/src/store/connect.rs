//! [`connect`]: a store from a database URL, the dialect chosen by the URL's scheme.

use std::sync::Arc;

use super::{Store, StoreOptions};
use crate::error::StoreError;

/// The database a URL names, by its scheme: `postgres://` or `postgresql://`, `mysql://` or
/// `mariadb://`, `sqlite:` (`sqlite://path`, `sqlite::memory:`). A dialect is known whether or
/// not its cargo feature is on; [`Dialect::of_url`] refuses one that is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL (feature `postgres`).
    Postgres,
    /// MySQL 8 or MariaDB (feature `mysql`).
    MySql,
    /// SQLite (feature `sqlite`).
    Sqlite,
}

impl Dialect {
    /// The dialect of `url`, by its scheme, checked to be compiled in.
    ///
    /// # Errors
    /// [`StoreError::Config`] naming the scheme when it is unknown, or when its dialect's cargo
    /// feature is off (the message names the feature). The URL itself is never echoed: it may
    /// hold a password.
    pub fn of_url(url: &str) -> Result<Dialect, StoreError> {
        let scheme = url.split_once(':').map_or("", |(s, _)| s);
        let (dialect, feature, on) = match scheme {
            "postgres" | "postgresql" => {
                (Dialect::Postgres, "postgres", cfg!(feature = "postgres"))
            }
            "mysql" | "mariadb" => (Dialect::MySql, "mysql", cfg!(feature = "mysql")),
            "sqlite" => (Dialect::Sqlite, "sqlite", cfg!(feature = "sqlite")),
            _ => {
                return Err(StoreError::Config(format!(
                    "unsupported database URL scheme {scheme:?}: expected postgres://…, \
                     postgresql://…, mysql://…, mariadb://… or sqlite:…"
                )));
            }
        };
        if !on {
            return Err(StoreError::Config(format!(
                "database URL scheme {scheme:?} needs the `{feature}` cargo feature of the \
                 outbox crate, which this build does not have"
            )));
        }
        Ok(dialect)
    }

    /// The dialect's name as the cargo feature spells it: `postgres`, `mysql` or `sqlite`.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
            Dialect::Sqlite => "sqlite",
        }
    }
}

/// Open the store `url` names ([`Dialect::of_url`]): [`PgStore::connect`](crate::PgStore::connect),
/// [`MySqlStore::connect`](crate::MySqlStore::connect) or
/// [`SqliteStore::connect`](crate::SqliteStore::connect) (which creates a missing SQLite file;
/// see [`connect_existing`]). `options` gives the table names and limits.
///
/// # Errors
/// [`StoreError::Config`] naming an unknown scheme or one whose feature is off; otherwise the
/// dialect's own `connect` errors (a URL the driver rejects, an unreachable server, a bad table
/// name).
pub async fn connect(url: &str, options: StoreOptions) -> Result<Arc<dyn Store>, StoreError> {
    open(url, options, true).await
}

/// [`connect`], but a SQLite file that does not exist is refused
/// ([`SqliteStore::connect_existing`](crate::SqliteStore::connect_existing)) instead of created:
/// for programs that administer or relay an existing outbox, so a mistyped path is reported.
///
/// # Errors
/// As [`connect`], and [`StoreError::MissingDatabase`] for a missing SQLite file.
pub async fn connect_existing(
    url: &str,
    options: StoreOptions,
) -> Result<Arc<dyn Store>, StoreError> {
    open(url, options, false).await
}

#[allow(unused_variables)] // Without a dialect compiled in, every argument is unused.
async fn open(
    url: &str,
    options: StoreOptions,
    create: bool,
) -> Result<Arc<dyn Store>, StoreError> {
    match Dialect::of_url(url)? {
        #[cfg(feature = "postgres")]
        Dialect::Postgres => Ok(Arc::new(
            super::postgres::PgStore::connect(url, options).await?,
        )),
        #[cfg(feature = "mysql")]
        Dialect::MySql => Ok(Arc::new(
            super::mysql::MySqlStore::connect(url, options).await?,
        )),
        #[cfg(feature = "sqlite")]
        Dialect::Sqlite if create => Ok(Arc::new(
            super::sqlite::SqliteStore::connect(url, options).await?,
        )),
        #[cfg(feature = "sqlite")]
        Dialect::Sqlite => Ok(Arc::new(
            super::sqlite::SqliteStore::connect_existing(url, options).await?,
        )),
        #[allow(unreachable_patterns)]
        _ => unreachable!("Dialect::of_url refuses a dialect that is not compiled in"),
    }
}

/// A store's pool of 10 connections ([`POOL_SIZE`], all opened at once in the background and
/// kept) to the database server at `url` (PostgreSQL, MySQL; `other_hosts`: the URLs of other
/// hosts the pool may be moved to, for `TCP_NODELAY`):
/// one direct connection first, so an unreachable server or a bad URL is reported with its cause
/// instead of as a pool timeout; each connection sets `TCP_NODELAY` towards the server
/// ([`nodelay`](super::nodelay)) and is dropped when the returned guard says so (a server that
/// turned read-only, see `store::upgrade`).
///
/// # Errors
/// [`StoreError::Database`] (`op` "connect") with the driver's error.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn server_pool<DB: sqlx::Database>(
    url: &str,
    other_hosts: &[String],
) -> Result<(sqlx::Pool<DB>, std::sync::Arc<super::ReadOnlyGuard>), StoreError>
where
    <DB::Connection as sqlx::Connection>::Options: ServerAddress,
{
    let connect_error = |e| super::database_error("connect", e);
    let conn = <DB::Connection as sqlx::Connection>::connect(url)
        .await
        .map_err(connect_error)?;
    let _ = sqlx::Connection::close(conn).await;
    // `TCP_NODELAY` towards the server, and towards every other host the pool may move to.
    let mut peers = Vec::new();
    for u in std::iter::once(url).chain(other_hosts.iter().map(String::as_str)) {
        if let Ok(o) = u.parse::<<DB::Connection as sqlx::Connection>::Options>() {
            let (host, port) = o.address();
            peers.extend(super::nodelay::resolve(host, port).await);
        }
    }
    let read_only = super::ReadOnlyGuard::new();
    let (on_acquire, on_release) = (read_only.clone(), read_only.clone());
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(POOL_SIZE)
        // Opened up front and kept: a connection opened on demand made the waiting statement
        // wait ~90 ms on loopback (sqlx 0.9 sets no `TCP_NODELAY` during the handshake, so
        // its small writes meet the server's delayed ACK), the relay's latency tail
        // (docs/benchmarks.md, "The latency tail").
        .min_connections(POOL_SIZE)
        .idle_timeout(None)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .after_connect(move |_, _| {
            super::nodelay::set_nodelay_towards(&peers);
            Box::pin(async { Ok(()) })
        })
        .before_acquire(move |_, meta| {
            let keep = on_acquire.keep(meta.age);
            Box::pin(async move { Ok(keep) })
        })
        .after_release(move |_, meta| {
            let keep = on_release.keep(meta.age);
            Box::pin(async move { Ok(keep) })
        })
        .connect_lazy(url)
        .map_err(connect_error)?;
    // Open every connection now, concurrently and in the background (one after the other they
    // took ~1 s, which a one-shot `outbox status` would wait for), holding them until all are
    // open so that each acquire opens one of its own.
    let warm = pool.clone();
    tokio::spawn(async move {
        let held = futures::future::join_all((0..POOL_SIZE).map(|_| warm.acquire())).await;
        drop(held);
    });
    Ok((pool, read_only))
}

/// Connections of a store's pool ([`server_pool`]): all opened when the pool is, and kept.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const POOL_SIZE: u32 = 10;

/// The host and port a database server's connect options name.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) trait ServerAddress: std::str::FromStr {
    /// `(host, port)`.
    fn address(&self) -> (&str, u16);
}

#[cfg(feature = "postgres")]
impl ServerAddress for sqlx::postgres::PgConnectOptions {
    fn address(&self) -> (&str, u16) {
        (self.get_host(), self.get_port())
    }
}

#[cfg(feature = "mysql")]
impl ServerAddress for sqlx::mysql::MySqlConnectOptions {
    fn address(&self) -> (&str, u16) {
        (self.get_host(), self.get_port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_choose_the_dialect() {
        for (url, d) in [
            ("postgres://u@h/db", Dialect::Postgres),
            ("postgresql://u@h/db", Dialect::Postgres),
            ("mysql://root@h/db", Dialect::MySql),
            ("mariadb://root@h/db", Dialect::MySql),
            ("sqlite://x.db", Dialect::Sqlite),
            ("sqlite::memory:", Dialect::Sqlite),
        ] {
            let on = match d {
                Dialect::Postgres => cfg!(feature = "postgres"),
                Dialect::MySql => cfg!(feature = "mysql"),
                Dialect::Sqlite => cfg!(feature = "sqlite"),
            };
            match Dialect::of_url(url) {
                Ok(found) => assert_eq!(found, d, "{url}"),
                Err(e) => assert!(!on && e.to_string().contains("cargo feature"), "{url}: {e}"),
            }
        }
    }

    #[tokio::test]
    async fn unknown_scheme_is_named_and_the_url_not_echoed() {
        let Err(e) = connect("oracle://u:secret@h/db", StoreOptions::default()).await else {
            panic!("oracle:// accepted");
        };
        let text = e.to_string();
        assert!(text.contains("\"oracle\""), "{text}");
        assert!(!text.contains("secret"), "{text}");
        assert!(matches!(e, StoreError::Config(_)));
        let Err(e) = connect("no scheme", StoreOptions::default()).await else {
            panic!("accepted");
        };
        assert!(e.to_string().contains("unsupported"), "{e}");
    }
}
