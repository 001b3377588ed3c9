//! The `outbox` command: migrate, relay daemon, status, demo, bench.

mod admin;
mod bench;
mod config;
mod confirmations;
mod demo;
mod group;
mod inbox;
mod messages;
mod telemetry;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use outbox::{Status, Store, StoreOptions};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Transactional outbox (本地消息表): migrate the tables, run the relay, inspect the outbox, or
/// watch the order → inventory demo.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines on standard error: `text` (colours only when standard error is a terminal and
    /// `NO_COLOR` is unset) or `json` (one object per line). Filters: `RUST_LOG`, e.g.
    /// `RUST_LOG=outbox=debug,sqlx=warn`.
    #[arg(long, global = true, env = "OUTBOX_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
pub(crate) struct DbArgs {
    /// Database URL: `postgres://user@host:port/db`, `mysql://user@host:3306/db` (or
    /// `mariadb://…`) or `sqlite://path/to/file.db`.
    #[arg(long, env = "OUTBOX_DATABASE_URL")]
    pub(crate) database: String,
    /// Outbox table (optionally `schema.table` on PostgreSQL).
    #[arg(long, default_value = "outbox")]
    pub(crate) table: String,
    /// Inbox table.
    #[arg(long, default_value = "outbox_inbox")]
    pub(crate) inbox_table: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the outbox and inbox tables (idempotent, versioned).
    Migrate {
        #[command(flatten)]
        db: DbArgs,
        /// Also build the optional search indexes (docs/operations.md, "Search indexes"):
        /// fast admin searches by key over every state and by old time windows on a large
        /// table, at a cost on every insert and state change. On PostgreSQL built
        /// concurrently, writers and relays going on.
        #[arg(long)]
        search_indexes: bool,
        /// PostgreSQL: create the outbox table partitioned by day, so retention drops whole
        /// partitions (docs/operations.md, "Partitioned outbox table"). Only for a table that
        /// does not exist yet.
        #[arg(long)]
        partitioned: bool,
    },
    /// Run the relay daemon until SIGTERM or Ctrl-C.
    Relay {
        /// TOML configuration file (see docs/configuration.md).
        #[arg(long, short)]
        config: PathBuf,
        /// Override `[database] url`.
        #[arg(long, env = "OUTBOX_DATABASE_URL")]
        database: Option<String>,
    },
    /// Show counts per state, the oldest pending age and the latest dead letters; with
    /// `--config`, of every database of the daemon's configuration (`[[databases]]`, each
    /// tenant schema, or `[database]`), each named.
    Status {
        /// Database URL: `postgres://…`, `mysql://…` (`mariadb://…`) or `sqlite://path`.
        /// Required unless `--config` is given; with a `--config` whose file has `[database]`,
        /// it overrides its `url` (as for `outbox relay`).
        #[arg(long, env = "OUTBOX_DATABASE_URL", required_unless_present = "config")]
        database: Option<String>,
        /// Outbox table (optionally `schema.table` on PostgreSQL); with `--config`, the file's.
        #[arg(long, default_value = "outbox", conflicts_with = "config")]
        table: String,
        /// Inbox table; with `--config`, the file's.
        #[arg(long, default_value = "outbox_inbox", conflicts_with = "config")]
        inbox_table: String,
        /// The daemon's TOML configuration file: the status of each of its databases, read
        /// concurrently (each within 10 s; one that does not answer is reported beside the
        /// others, and the command then fails).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// How many dead letters to list.
        #[arg(long, default_value_t = 10)]
        failed: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Requeue dead letters: FAILED → PENDING with attempts and check-backs reset (the last error
    /// is kept).
    Requeue {
        #[command(flatten)]
        db: DbArgs,
        /// Row ids to requeue (as `outbox status` lists them).
        #[arg(long = "id", required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<i64>,
        /// Requeue every FAILED row.
        #[arg(long)]
        all: bool,
    },
    /// Search and act on messages: list, show, requeue, publish-now, discard (the admin API's
    /// twin, docs/operations.md).
    #[command(subcommand)]
    Messages(messages::MessagesCommand),
    /// Serve the admin API (`/api/…`) for a database, without a relay.
    Admin(messages::AdminArgs),
    /// The relays' heartbeats and routes and the buckets each holds.
    Relays {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON (the API's answer) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Retention now: move finished rows older than `--older-than` to `<table>_archive` (or
    /// delete them with `--delete`), in transactions of 500 rows.
    Archive(messages::ArchiveArgs),
    /// Partition keys: `outbox keys blocked` lists those held back by a dead letter.
    #[command(subcommand)]
    Keys(messages::KeysCommand),
    /// Inspect a consumer's inbox: its dead letters, and replays of them.
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
    /// Run the order → inventory demo with injected faults and print a report.
    Demo(demo::DemoArgs),
    /// Measure the relay on the real database and broker: drain rate against raw-SQL and raw
    /// broker baselines, commit → ack latency, enqueue overhead, database cost, scaling
    /// (docs/benchmarks.md).
    Bench(bench::BenchArgs),
}

/// Whether a command may create the database it opens: only `outbox migrate` does
/// ([`Create::IfMissing`]); every other command (`status`, `requeue`, the relay daemon) opens
/// an existing one ([`Create::Never`]), so a mistyped SQLite path is an error naming the path,
/// not a new empty database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// Create a missing SQLite database file (`outbox migrate`).
    IfMissing,
    /// Refuse a missing SQLite database file.
    Never,
}

/// Open the store named by `url`; a SQLite file is created only with [`Create::IfMissing`].
///
/// # Errors
/// An unsupported scheme, a URL the driver rejects, an unreachable server, or (with
/// [`Create::Never`]) a SQLite file that does not exist, each named.
pub async fn open_store(
    url: &str,
    table: &str,
    inbox_table: &str,
    create: Create,
) -> anyhow::Result<Arc<dyn Store>> {
    let options = StoreOptions {
        table: table.into(),
        inbox_table: inbox_table.into(),
        ..StoreOptions::default()
    };
    match create {
        Create::IfMissing => outbox::store::connect(url, options).await,
        Create::Never => outbox::store::connect_existing(url, options).await,
    }
    .with_context(|| format!("cannot open {}", redact(url)))
}

/// The URL with any password replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// `outbox requeue`: FAILED → PENDING. With `--id`, every id that is not requeued is named with
/// the reason (no such row, or its state) and the command fails.
async fn requeue(db: DbArgs, ids: Vec<i64>, all: bool) -> anyhow::Result<()> {
    let store = open_store(&db.database, &db.table, &db.inbox_table, Create::Never).await?;
    if all {
        let n = store.requeue_failed(None).await?;
        println!("requeued {n} dead letter(s) in {}", store.table());
        return Ok(());
    }
    let mut ids = ids;
    ids.sort_unstable();
    ids.dedup();
    // What each id is before: only FAILED rows can be requeued; name the others and why.
    let before: std::collections::BTreeMap<i64, Status> =
        store.statuses(&ids).await?.into_iter().collect();
    let refused: Vec<String> = ids
        .iter()
        .filter_map(|id| match before.get(id) {
            None => Some(format!("id {id}: no such row")),
            Some(Status::Failed) => None,
            Some(s) => Some(format!("id {id}: {}, not FAILED", s.name())),
        })
        .collect();
    let failed = ids.len() - refused.len();
    let n = store.requeue_failed(Some(&ids)).await?;
    println!("requeued {n} dead letter(s) in {}", store.table());
    if refused.is_empty() && n as usize == failed {
        return Ok(());
    }
    let mut reasons = refused;
    if (n as usize) < failed {
        reasons.push(format!(
            "{} FAILED row(s) changed state meanwhile",
            failed - n as usize
        ));
    }
    bail!(
        "{} of {} id(s) not requeued: {}",
        ids.len() - n as usize,
        ids.len(),
        reasons.join("; ")
    )
}

async fn relay(config: PathBuf, database: Option<String>) -> anyhow::Result<()> {
    let mut file = config::FileConfig::load(Some(&config))?;
    if let Some(url) = database {
        file.database.url = url;
    }
    if !file.databases.is_empty() {
        return group::run(file).await;
    }
    file.validate()?;
    let relay_config = file.relay_config()?;
    // The relay never creates a database: `outbox migrate` does (docs/configuration.md).
    let store = open_store(
        &file.database.url,
        &file.database.table,
        &file.database.inbox_table,
        Create::Never,
    )
    .await?;
    let router = file.router()?;
    // Connect the transports now, so their state is logged at start; a broker that is down does
    // not stop the daemon: the relay pauses its transport and probes it with backoff.
    for t in router.transports() {
        if let Err(e) = t.probe().await {
            tracing::warn!(
                transport = t.name(),
                error = %e.report(),
                "transport unreachable at start; the relay starts anyway and connects it once the broker answers"
            );
        }
    }
    let relay = outbox::Relay::builder(store.clone())
        .router(router)
        .config(relay_config)
        .build()?;
    if file.database.search_indexes {
        // In the background: a build on a large table takes minutes and the relay need not wait.
        let store = store.clone();
        tokio::spawn(async move {
            match store.create_search_indexes().await {
                Ok(present) => tracing::info!(?present, "search indexes present"),
                Err(e) => {
                    tracing::warn!(error = %e, "building the search indexes failed; searches stay correct, slower on a large table")
                }
            }
        });
    }
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutdown signal received; stopping the relay");
        c.cancel();
    });
    if file.confirmations.is_none() && file.routes.iter().any(|r| r.confirm.is_some()) {
        tracing::warn!(
            "routes require confirmation but there is no [confirmations] listener: unless another \
             process applies them, those messages will end FAILED as unconfirmed"
        );
    }
    let listener = match &file.confirmations {
        None => None,
        Some(c) => Some(confirmations::spawn(c, store.clone(), cancel.clone()).await?),
    };
    if let Some(admin) = &file.admin {
        let confirmations = file.confirmations.is_some();
        serve_admin(
            admin,
            &file.database.inbox_table,
            &relay,
            store.clone(),
            confirmations,
            cancel.clone(),
        )
        .await?;
    }
    if !file.logging.summary_interval.is_zero() {
        tokio::spawn(log_summaries(
            relay.clone(),
            file.logging.summary_interval,
            cancel.clone(),
        ));
    }
    let mut relay_task = {
        let relay = relay.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move { relay.run(cancel).await })
    };
    // A listener that stops while the relay runs would let every confirmed route end FAILED
    // "unconfirmed": stop the daemon instead, with an error.
    match listener {
        None => relay_task.await??,
        Some(mut l) => {
            tokio::select! {
                r = &mut relay_task => {
                    r??;
                    cancel.cancel();
                    let _ = l.await;
                }
                r = &mut l => {
                    let shutting_down = cancel.is_cancelled();
                    cancel.cancel();
                    relay_task.await??;
                    if shutting_down && matches!(r, Ok(Ok(()))) {
                        // SIGTERM reached the listener first: a normal shutdown.
                        return Ok(());
                    }
                    let e = match r {
                        Ok(Ok(())) => anyhow::anyhow!("the confirmation listener stopped"),
                        Ok(Err(e)) => e,
                        Err(e) => anyhow::anyhow!("the confirmation listener panicked: {e}"),
                    };
                    return Err(e.context("confirmation listener failed; relay stopped"));
                }
            }
        }
    }
    let m = relay.metrics().snapshot();
    eprintln!(
        "relay stopped: sent={} retried={} failed={} lost_leases={}",
        m.sent, m.retried, m.failed, m.lost_leases
    );
    Ok(())
}

/// Serve on `[admin] listen` until `cancel`: `GET /metrics` (Prometheus text format: the relay's
/// counters and histograms, the sampled backlog and, with a `[confirmations]` listener
/// (`confirmations`), the confirmations applied), `GET /healthz` ([`outbox::Relay::health`]) and
/// `GET /readyz` ([`outbox::Relay::readiness`]): 200 `ok`, or 503 with one problem per line; and
/// the admin API and dashboard, with the dead letters of the inbox `inbox_table`.
async fn serve_admin(
    admin: &config::AdminSection,
    inbox_table: &str,
    relay: &outbox::Relay,
    store: Arc<dyn outbox::Store>,
    confirmations: bool,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let store_for_api = store.clone();
    // The overview's charts: the relay's counters every 10 s, one hour kept.
    let series = outbox::admin::series::Series::new(Duration::from_secs(10));
    series.spawn_sampler(relay.metrics().clone(), cancel.clone());
    let mut registry = prometheus_client::registry::Registry::default();
    outbox::prometheus::register(
        &mut registry,
        relay,
        store,
        admin.backlog_sample_interval,
        cancel.clone(),
    );
    if confirmations {
        registry.register_collector(Box::new(outbox::prometheus::ConfirmationCollector));
    }
    let app = admin::metrics_router(Arc::new(std::sync::Mutex::new(registry)))
        .merge(admin::health_router(relay.clone()))
        .merge(
            outbox::admin::http::AdminApi::new(store_for_api.clone(), admin.auth()?)
                .inbox(
                    outbox::admin::inbox::InboxAdmin::on_store(&*store_for_api, inbox_table)
                        .context("database.inbox_table")?,
                )
                .series(series)
                .router(),
        );
    let listener = tokio::net::TcpListener::bind(admin.listen)
        .await
        .with_context(|| format!("admin.listen: cannot listen on {}", admin.listen))?;
    let addr = admin::serve(listener, app, cancel)?;
    tracing::info!(%addr, "serving metrics on http://{addr}/metrics and the admin API on http://{addr}/api/");
    Ok(())
}

/// Every `every`, one INFO line: what the relay did since the last line and where the table
/// stands (`[logging] summary_interval`), so a plain log shows progress or its absence.
async fn log_summaries(relay: outbox::Relay, every: Duration, cancel: CancellationToken) {
    let mut last = relay.metrics().snapshot();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let now = relay.metrics().snapshot();
        let problems = relay.health().problems;
        let text = summary_text(&relay, &last, &now, every, "unhealthy", &problems).await;
        tracing::info!("{text}");
        last = now;
    }
}

/// The text of one summary line (`[logging] summary_interval`): what `relay` did between the
/// snapshots `last` and `now`, the buckets it holds, its table's backlog (one `outbox status`
/// query, given at most `every`), then `problems` after `label`, if any.
pub(crate) async fn summary_text(
    relay: &outbox::Relay,
    last: &outbox::MetricsSnapshot,
    now: &outbox::MetricsSnapshot,
    every: Duration,
    label: &str,
    problems: &[String],
) -> String {
    let backlog = match tokio::time::timeout(every, relay.store().stats()).await {
        Ok(Ok(s)) => format!(
            "pending={} oldest_pending_age={:.1}s failed={}",
            s.counts.get(&Status::Pending).copied().unwrap_or(0),
            s.oldest_pending_age.unwrap_or_default().as_secs_f64(),
            s.counts.get(&Status::Failed).copied().unwrap_or(0)
        ),
        Ok(Err(e)) => format!("backlog unknown ({e})"),
        Err(_) => "backlog unknown (timed out)".to_owned(),
    };
    format!(
        "summary of the last {:.0}s: published={} retried={} dead_lettered={} buckets={} {backlog}{}",
        every.as_secs_f64(),
        now.sent.saturating_sub(last.sent),
        now.retried.saturating_sub(last.retried),
        now.failed.saturating_sub(last.failed),
        relay.held_buckets().len(),
        if problems.is_empty() {
            String::new()
        } else {
            format!(" {label}: {}", problems.join("; "))
        }
    )
}

pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if !matches!(
        cli.command,
        Command::Relay { .. } | Command::Admin(_) | Command::Demo(_) | Command::Bench(_)
    ) {
        quiet_on_closed_pipe();
    }
    // The demo and the bench draw progress bars: only warnings unless RUST_LOG says otherwise.
    let default_filter = match cli.command {
        Command::Demo(_) => "warn",
        // The bench counts the relays' statements through sqlx's statement log; never print it.
        Command::Bench(_) => "warn,sqlx::query=off",
        _ => "info,sqlx=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    // OTLP trace export when the standard OTEL_EXPORTER_OTLP_… variables ask for it.
    let traces = match telemetry::provider_from_env() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let registry = tracing_subscriber::registry()
        .with(fmt)
        .with(traces.as_ref().map(telemetry::layer));
    match cli.command {
        Command::Bench(_) => registry.with(bench::StatementCounter::layer()).init(),
        _ => registry.init(),
    }
    let result = match cli.command {
        Command::Migrate {
            db,
            search_indexes,
            partitioned,
        } => {
            async {
                if partitioned {
                    if outbox::store::Dialect::of_url(&db.database).ok()
                        != Some(outbox::store::Dialect::Postgres)
                    {
                        anyhow::bail!("--partitioned: a partitioned outbox table needs PostgreSQL");
                    }
                    let options = StoreOptions {
                        table: db.table.clone(),
                        inbox_table: db.inbox_table.clone(),
                        ..StoreOptions::default()
                    };
                    let pg = outbox::PgStore::connect(&db.database, options)
                        .await
                        .with_context(|| format!("cannot open {}", redact(&db.database)))?;
                    pg.migrate_partitioned().await?;
                    println!("{} is partitioned by day", db.table);
                }
                let store =
                    open_store(&db.database, &db.table, &db.inbox_table, Create::IfMissing).await?;
                store.migrate().await?;
                println!(
                    "migrated {} and {} on {}",
                    db.table,
                    db.inbox_table,
                    store.backend()
                );
                if search_indexes {
                    let started = std::time::Instant::now();
                    let present = store.create_search_indexes().await?;
                    println!(
                        "search indexes of {}: key {}, created {}, sent {} ({:.1} s)",
                        db.table,
                        present.key,
                        present.created,
                        present.sent,
                        started.elapsed().as_secs_f64()
                    );
                }
                Ok(())
            }
            .await
        }
        Command::Relay { config, database } => relay(config, database).await,
        Command::Status {
            database,
            table,
            inbox_table,
            config,
            failed,
            json,
        } => match config {
            Some(path) => messages::status_of_config(&path, database, failed, json).await,
            None => {
                let db = DbArgs {
                    database: database.expect("clap requires --database without --config"),
                    table,
                    inbox_table,
                };
                messages::status(db, failed, json).await
            }
        },
        Command::Requeue { db, ids, all } => requeue(db, ids, all).await,
        Command::Messages(cmd) => messages::run(cmd).await,
        Command::Admin(args) => messages::serve(args).await,
        Command::Relays { db, json } => messages::relays(db, json).await,
        Command::Keys(cmd) => messages::keys(cmd).await,
        Command::Archive(a) => messages::archive(a).await,
        Command::Inbox(cmd) => inbox::inbox_command(cmd).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
    };
    if let Some(p) = traces {
        // The batch exporter's last flush blocks: off the runtime's threads.
        let _ = tokio::task::spawn_blocking(move || telemetry::shutdown(p)).await;
    }
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A one-shot command whose reader goes away (`outbox status --json | head -1`) ends as
/// coreutils do, killed quietly by `SIGPIPE`, instead of panicking in `println!` on "Broken
/// pipe": Rust's runtime ignores `SIGPIPE`, this puts its default action back. The long-running
/// commands (the relay, the admin server, the demo, the bench) keep ignoring it, so a closed log
/// pipe never kills a relay; they print nothing on stdout once running.
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: `signal` with `SIG_DFL` installs no handler (no code runs in signal context); the
    // disposition is process-wide and set before any command prints.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite://x.db"), "sqlite://x.db");
    }
}
