//! Multi-host PostgreSQL URLs and failover: `postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`,
//! the form of libpq's connection strings
//! (<https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-MULTIPLE-HOSTS>), which
//! sqlx 0.9 does not parse.
//!
//! The pool connects to the first host that answers (and, with `read-write`, accepts writes: not
//! in recovery, `transaction_read_only` off). A watcher checks the host every
//! [`FAILOVER_CHECK`] through the pool (one trivial query); when it stops answering or turns
//! read-only (a standby promoted elsewhere, the old primary demoted), the watcher looks for the
//! host that now qualifies, points the pool at it ([`sqlx::Pool::set_connect_options`]) and has
//! every connection opened before dropped ([`ReadOnlyGuard`](crate::store::ReadOnlyGuard)), so
//! the pool, the relay's LISTEN connection (it reconnects through the pool) and every statement
//! after it go to the new primary without a restart. While no host qualifies, statements fail
//! (the relay backs off; its readiness is false) and the watcher logs one warning per state
//! change.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::error::StoreError;

/// How often the watcher of a multi-host pool checks its host.
pub const FAILOVER_CHECK: Duration = Duration::from_secs(1);

/// Longest wait for one host while looking for the one to use.
const HOST_TIMEOUT: Duration = Duration::from_secs(3);

/// `target_session_attrs`: which host qualifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SessionAttrs {
    /// Any host that answers (libpq's default).
    Any,
    /// A host that accepts writes (`read-write`, or `primary`).
    ReadWrite,
}

/// A URL naming several hosts, or `target_session_attrs`: one single-host URL per host, in order.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    /// One URL per host, without `target_session_attrs`.
    pub(crate) urls: Vec<String>,
    /// The hosts as written (`host:port`), for messages.
    pub(crate) names: Vec<String>,
    pub(crate) attrs: SessionAttrs,
}

impl Hosts {
    /// `None` for a URL of one host without `target_session_attrs` (sqlx takes it as it is).
    ///
    /// # Errors
    /// [`StoreError::Config`] for an empty host or an unknown `target_session_attrs` (libpq's
    /// `any`, `read-write` and `primary` are understood).
    pub(crate) fn parse(url: &str) -> Result<Option<Hosts>, StoreError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Ok(None);
        };
        let hosts_start = rest.find('@').map_or(0, |i| i + 1);
        let hosts_end = rest[hosts_start..]
            .find(['/', '?'])
            .map_or(rest.len(), |i| hosts_start + i);
        let (userinfo, hosts, tail) = (
            &rest[..hosts_start],
            &rest[hosts_start..hosts_end],
            &rest[hosts_end..],
        );
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let mut attrs = None;
        let kept: Vec<&str> = query
            .split('&')
            .filter(|kv| !kv.is_empty())
            .filter(|kv| match kv.split_once('=') {
                Some(("target_session_attrs", v)) => {
                    attrs = Some(v.to_owned());
                    false
                }
                _ => true,
            })
            .collect();
        if !hosts.contains(',') && attrs.is_none() {
            return Ok(None);
        }
        let attrs = match attrs.as_deref() {
            None | Some("any") => SessionAttrs::Any,
            Some("read-write" | "primary") => SessionAttrs::ReadWrite,
            Some(other) => {
                return Err(StoreError::Config(format!(
                    "target_session_attrs={other} is not supported (any, read-write, primary)"
                )));
            }
        };
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let mut urls = Vec::new();
        let mut names = Vec::new();
        for host in hosts.split(',') {
            if host.is_empty() {
                return Err(StoreError::Config(
                    "the database URL names an empty host (two commas, or one at an end)".into(),
                ));
            }
            urls.push(format!("{scheme}://{userinfo}{host}{path}{query}"));
            names.push(host.to_owned());
        }
        Ok(Some(Hosts { urls, names, attrs }))
    }

    /// The index of the first host that qualifies, or every host's reason.
    pub(crate) async fn select(&self) -> Result<usize, String> {
        let mut reasons = Vec::new();
        for (i, url) in self.urls.iter().enumerate() {
            match tokio::time::timeout(HOST_TIMEOUT, self.qualifies(url)).await {
                Ok(Ok(())) => return Ok(i),
                Ok(Err(reason)) => reasons.push(format!("{}: {reason}", self.names[i])),
                Err(_) => reasons.push(format!(
                    "{}: no answer within {HOST_TIMEOUT:?}",
                    self.names[i]
                )),
            }
        }
        Err(reasons.join("; "))
    }

    async fn qualifies(&self, url: &str) -> Result<(), String> {
        let mut conn = PgConnection::connect(url)
            .await
            .map_err(|e| e.to_string())?;
        let r = self.check(&mut conn).await;
        let _ = conn.close().await;
        r
    }

    /// Whether the server of `conn` qualifies.
    async fn check(&self, conn: &mut PgConnection) -> Result<(), String> {
        if self.attrs == SessionAttrs::Any {
            return sqlx::query("SELECT 1")
                .execute(&mut *conn)
                .await
                .map(drop)
                .map_err(|e| e.to_string());
        }
        let (recovery, read_only): (bool, String) =
            sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| e.to_string())?;
        if recovery {
            Err("in recovery (a standby): read-only".into())
        } else if read_only == "on" {
            Err("read-only (default_transaction_read_only)".into())
        } else {
            Ok(())
        }
    }
}

/// Stops a pool's watcher when the last store sharing the pool is dropped.
#[derive(Debug)]
pub(crate) struct Watcher(#[allow(dead_code)] tokio_util::sync::DropGuard);

/// Watch `pool`, connected to host `current` of `hosts`, every [`FAILOVER_CHECK`] (see the module
/// docs), until the returned guard is dropped.
pub(crate) fn watch(
    pool: PgPool,
    hosts: Hosts,
    mut current: usize,
    guard: Arc<crate::store::ReadOnlyGuard>,
) -> Arc<Watcher> {
    let stop = CancellationToken::new();
    let done = stop.clone();
    tokio::spawn(async move {
        let mut stranded = false;
        loop {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(FAILOVER_CHECK) => {}
            }
            let healthy = tokio::time::timeout(HOST_TIMEOUT, async {
                let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
                hosts.check(&mut conn).await
            })
            .await
            .unwrap_or_else(|_| Err("no answer".into()));
            let Err(problem) = healthy else {
                continue;
            };
            match hosts.select().await {
                Ok(i) => {
                    if i != current {
                        match hosts.urls[i].parse::<PgConnectOptions>() {
                            Ok(options) => pool.set_connect_options(options),
                            Err(e) => {
                                tracing::error!(host = %hosts.names[i], error = %e, "cannot use the host");
                                continue;
                            }
                        }
                        tracing::warn!(
                            from = %hosts.names[current],
                            to = %hosts.names[i],
                            reason = %problem,
                            "database failover: the pool now connects to another host"
                        );
                        current = i;
                    } else if stranded {
                        tracing::info!(host = %hosts.names[i], "database host usable again");
                    }
                    stranded = false;
                    // Connections opened before now may be to the old server: dropped.
                    guard.mark();
                }
                Err(reasons) => {
                    if !stranded {
                        tracing::warn!(
                            reasons = %reasons,
                            "no database host qualifies (target_session_attrs); statements fail until one does"
                        );
                    }
                    stranded = true;
                }
            }
        }
    });
    Arc::new(Watcher(stop.drop_guard()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libpq_multi_host_urls() {
        let h = Hosts::parse(
            "postgres://u:p%40w@a:5433,b:5434/db?sslmode=disable&target_session_attrs=read-write",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            h.urls,
            [
                "postgres://u:p%40w@a:5433/db?sslmode=disable",
                "postgres://u:p%40w@b:5434/db?sslmode=disable"
            ]
        );
        assert_eq!(h.names, ["a:5433", "b:5434"]);
        assert_eq!(h.attrs, SessionAttrs::ReadWrite);
        let any = Hosts::parse("postgresql://a,b/db").unwrap().unwrap();
        assert_eq!(any.urls, ["postgresql://a/db", "postgresql://b/db"]);
        assert_eq!(any.attrs, SessionAttrs::Any);
        assert!(Hosts::parse("postgres://u@a:1/db?x=1").unwrap().is_none());
        let one = Hosts::parse("postgres://a/db?target_session_attrs=primary")
            .unwrap()
            .unwrap();
        assert_eq!(one.urls, ["postgres://a/db"]);
        for bad in [
            "postgres://a,,b/db",
            "postgres://a/db?target_session_attrs=standby",
        ] {
            assert!(Hosts::parse(bad).is_err(), "{bad}");
        }
    }
}
