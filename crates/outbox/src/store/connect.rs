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
