//! `outbox status`: the one-screen summary of an outbox table, or of each database of the
//! daemon's configuration.

use std::time::Duration;

use anyhow::Context;
use outbox::Status;

use super::cut;
use crate::{Create, DbArgs, open_store};

fn fmt_age(d: Option<Duration>) -> String {
    match d {
        None => "-".into(),
        Some(d) if d < Duration::from_secs(1) => format!("{} ms", d.as_millis()),
        Some(d) => humantime::format_duration(Duration::from_secs(d.as_secs())).to_string(),
    }
}

/// `outbox status`: the one-screen summary (counts of the states that occur, backlog ages, the
/// latest dead letters), pointing to `outbox messages` for details.
pub async fn status(db: DbArgs, failed: u32, json: bool) -> anyhow::Result<()> {
    let store = open_store(&db.database, &db.table, &db.inbox_table, Create::Never).await?;
    let s = StoreStatus::read(store.as_ref(), failed).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s.json())?);
    } else {
        print!("{}", s.text(""));
    }
    Ok(())
}

/// How long `outbox status --config` waits for one database before reporting it unreachable.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// `outbox status --config FILE`: the status of each database of the daemon's configuration
/// (each `[[databases]]` entry, each tenant schema of an entry with `schemas` or
/// `schemas_query`, or its `[database]`), read concurrently, each within 10 s. A database that
/// does not answer is reported with its error beside the others; the command then fails, after
/// printing every one.
pub async fn status_of_config(
    config: &std::path::Path,
    database: Option<String>,
    failed: u32,
    json: bool,
) -> anyhow::Result<()> {
    let mut file = crate::config::FileConfig::load(Some(config))?;
    if file.databases.is_empty()
        && let Some(url) = &database
    {
        file.database.url = url.clone();
    }
    // The checks `outbox relay` makes of the same file (names, tenant options, routes).
    if file.databases.is_empty() || database.is_none() {
        file.validate()
            .with_context(|| format!("{} is not a valid configuration", config.display()))?;
    }
    let targets: Vec<(String, String, String, String, bool)> = if file.databases.is_empty() {
        let url = database.unwrap_or_else(|| file.database.url.clone());
        anyhow::ensure!(
            !url.is_empty(),
            "{}: no [database] url and no [[databases]]; give --database",
            config.display()
        );
        vec![(
            "[database]".to_owned(),
            url,
            file.database.table.clone(),
            file.database.inbox_table.clone(),
            false,
        )]
    } else {
        if let Some(url) = database {
            anyhow::bail!(
                "--database {} (or OUTBOX_DATABASE_URL) with {}, which lists [[databases]]: give one or the other",
                crate::redact(&url),
                config.display()
            );
        }
        file.databases
            .iter()
            .map(|d| {
                (
                    d.name.clone(),
                    d.url.clone(),
                    d.table.clone(),
                    d.inbox_table.clone(),
                    d.discovers(),
                )
            })
            .collect()
    };
    let entries = file.databases.clone();
    let reads = targets
        .into_iter()
        .enumerate()
        .map(|(i, (name, url, table, inbox, discovers))| {
            let entry = entries.get(i).cloned();
            async move {
                let read = async {
                    if discovers {
                        let d = entry.expect("a discovering entry is a [[databases]] entry");
                        tenant_statuses(&d, failed).await
                    } else {
                        let store = open_store(&url, &table, &inbox, Create::Never).await?;
                        Ok(vec![(
                            name.clone(),
                            Ok(StoreStatus::read(store.as_ref(), failed).await?),
                        )])
                    }
                };
                match tokio::time::timeout(STATUS_TIMEOUT, read).await {
                    Ok(Ok(v)) => v,
                    Ok(Err(e)) => vec![(name, Err(format!("{e:#}")))],
                    Err(_) => vec![(name, Err(format!("no answer within {STATUS_TIMEOUT:?}")))],
                }
            }
        });
    let results: Vec<(String, Result<StoreStatus, String>)> = futures::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect();
    let failing: Vec<&str> = results
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|(n, _)| n.as_str())
        .collect();
    if json {
        let out: Vec<serde_json::Value> = results
            .iter()
            .map(|(name, r)| match r {
                Ok(s) => {
                    let mut v = s.json();
                    v["name"] = name.clone().into();
                    v
                }
                Err(e) => serde_json::json!({ "name": name, "error": e }),
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "databases": out }))?
        );
    } else {
        for (name, r) in &results {
            match r {
                Ok(s) => print!("database {name}: {}", s.text("  ")),
                Err(e) => println!("database {name}: ERROR: {e}"),
            }
        }
    }
    if !failing.is_empty() {
        anyhow::bail!(
            "the status of {} of {} database(s) could not be read: {}",
            failing.len(),
            results.len(),
            failing.join(", ")
        );
    }
    Ok(())
}

/// The status of each tenant schema of a discovering `[[databases]]` entry (PostgreSQL), named
/// `<name>/<schema>` as the daemon's members are.
async fn tenant_statuses(
    d: &crate::config::DatabasesEntry,
    failed: u32,
) -> anyhow::Result<Vec<(String, Result<StoreStatus, String>)>> {
    let base = outbox::PgStore::connect(&d.url, outbox::StoreOptions::default())
        .await
        .map_err(|e| anyhow::anyhow!("{}", e.report()))?;
    let schemas = match (&d.schemas, &d.schemas_query) {
        (Some(pattern), _) => base.schemas_with_table(pattern, &d.table).await,
        (None, Some(q)) => base.list_by_query(q).await,
        (None, None) => Ok(Vec::new()),
    }
    .map_err(|e| anyhow::anyhow!("listing the tenant schemas: {}", e.report()))?;
    let mut out = Vec::new();
    for schema in schemas {
        let name = format!("{}/{schema}", d.name);
        let options = outbox::StoreOptions {
            table: format!("{schema}.{}", d.table),
            inbox_table: format!("{schema}.{}", d.inbox_table),
            ..outbox::StoreOptions::default()
        };
        let r = match base.for_tables(options) {
            Ok(store) => StoreStatus::read(&store, failed)
                .await
                .map_err(|e| format!("{e:#}")),
            Err(e) => Err(e.to_string()),
        };
        out.push((name, r));
    }
    Ok(out)
}

/// What `outbox status` shows of one outbox table.
struct StoreStatus {
    table: String,
    backend: &'static str,
    stats: outbox::store::Stats,
    dead: Vec<outbox::store::FailedMessage>,
}

impl StoreStatus {
    async fn read(store: &dyn outbox::Store, failed: u32) -> anyhow::Result<StoreStatus> {
        Ok(StoreStatus {
            table: store.table().to_owned(),
            backend: store.backend(),
            stats: store.stats().await?,
            dead: store.failed(failed).await?,
        })
    }

    fn json(&self) -> serde_json::Value {
        let stats = &self.stats;
        let counts: serde_json::Map<String, serde_json::Value> = stats
            .counts
            .iter()
            .map(|(s, n)| (s.name().to_owned(), (*n).into()))
            .collect();
        serde_json::json!({
            "table": self.table,
            "counts": counts,
            "oldest_pending_age_ms": stats.oldest_pending_age.map(|d| d.as_millis() as u64),
            "awaiting_confirmation": stats.awaiting_confirmation,
            "oldest_unconfirmed_age_ms": stats.oldest_unconfirmed_age.map(|d| d.as_millis() as u64),
            "failed": self.dead.iter().map(|f| serde_json::json!({
                "id": f.id, "message_id": f.message_id, "topic": f.topic,
                "attempts": f.attempts, "last_error": f.last_error,
            })).collect::<Vec<_>>(),
        })
    }

    /// The text form, every line after the first indented by `indent`.
    fn text(&self, indent: &str) -> String {
        use std::fmt::Write;
        let stats = &self.stats;
        let mut out = String::new();
        let _ = writeln!(out, "outbox table {} ({})", self.table, self.backend);
        // Only the states that occur; an empty table says so.
        let mut any = false;
        for s in Status::ALL {
            let n = stats.counts.get(&s).copied().unwrap_or(0);
            if n > 0 {
                any = true;
                let _ = writeln!(out, "{indent}  {:<12} {:>10}", s.name(), n);
            }
        }
        if !any {
            let _ = writeln!(out, "{indent}  (no messages)");
        }
        let _ = writeln!(
            out,
            "{indent}  oldest pending (due) age: {}",
            fmt_age(stats.oldest_pending_age)
        );
        let _ = writeln!(
            out,
            "{indent}  SENT awaiting confirmation: {} (oldest {})",
            stats.awaiting_confirmation,
            fmt_age(stats.oldest_unconfirmed_age)
        );
        if !self.dead.is_empty() {
            let _ = writeln!(out, "{indent}latest dead letters (FAILED):");
            for f in &self.dead {
                let _ = writeln!(
                    out,
                    "{indent}  id={} message_id={} topic={} attempts={} reason={}",
                    f.id,
                    f.message_id,
                    cut(&f.topic, 48),
                    f.attempts,
                    cut(f.last_error.as_deref().unwrap_or_default(), 120).replace('\n', " ")
                );
            }
            let _ = writeln!(
                out,
                "{indent}details: outbox messages list --state failed; outbox messages show ID; \
                 outbox messages requeue|discard ID…"
            );
        }
        out
    }
}
