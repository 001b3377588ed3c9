//! `outbox messages list|show|requeue|publish-now|discard`, the admin API's command-line twin,
//! and `outbox admin`, the API served for a database without a relay (docs/operations.md,
//! "Admin API").

use std::sync::Arc;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::Subcommand;
use outbox::Status;
use outbox::admin::http::AdminAuth;
use outbox::admin::{Action, ActionReport, MessageFilter, MessageSummary, PageRequest, Selection};
use tokio_util::sync::CancellationToken;

use crate::{Create, DbArgs, open_store};

mod status;
pub use status::{status, status_of_config};

/// Which messages (every option given must hold).
#[derive(Debug, Clone, clap::Args)]
pub struct FilterArgs {
    /// States, repeated or comma-separated: pending, sent, confirmed, failed, prepared,
    /// rejected, rolled_back, undecided.
    #[arg(long = "state", value_delimiter = ',')]
    states: Vec<Status>,
    /// Topic glob: `*` any run of characters, `?` one character (`orders.*`).
    #[arg(long)]
    topic: Option<String>,
    /// Exactly this partition key (the business key, e.g. the order id).
    #[arg(long)]
    key: Option<String>,
    /// Exactly this message id.
    #[arg(long)]
    message_id: Option<uuid::Uuid>,
    /// Created at or after (RFC 3339, e.g. `2026-12-01T10:00:00Z`).
    #[arg(long)]
    created_after: Option<DateTime<Utc>>,
    /// Created before (RFC 3339).
    #[arg(long)]
    created_before: Option<DateTime<Utc>>,
    /// Acknowledged by the broker at or after (RFC 3339).
    #[arg(long)]
    sent_after: Option<DateTime<Utc>>,
    /// Acknowledged by the broker before (RFC 3339).
    #[arg(long)]
    sent_before: Option<DateTime<Utc>>,
    /// The last error contains this text (any case).
    #[arg(long)]
    error: Option<String>,
}

impl From<FilterArgs> for MessageFilter {
    fn from(a: FilterArgs) -> Self {
        MessageFilter {
            states: a.states,
            topic: a.topic,
            partition_key: a.key,
            message_id: a.message_id,
            created_after: a.created_after,
            created_before: a.created_before,
            sent_after: a.sent_after,
            sent_before: a.sent_before,
            error: a.error,
        }
    }
}

/// The messages an action applies to and how to report.
#[derive(Debug, clap::Args)]
pub struct ActArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Row ids (as `outbox messages list` shows them). Each id not changed is named with why, and
    /// the command fails.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    ids: Vec<i64>,
    /// Every message the filter options match, in the states the action applies to.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    filter: FilterArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// `outbox messages …`.
#[derive(Debug, Subcommand)]
pub enum MessagesCommand {
    /// List messages, newest first, one page (`--before` the previous page's last id for the
    /// next): by id, or by the window's time where the table has the search indexes (`outbox
    /// migrate --search-indexes`).
    List {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        filter: FilterArgs,
        /// Rows, 1 to 1000.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Only ids below this one (the keyset cursor).
        #[arg(long)]
        before: Option<i64>,
        /// Print JSON (the API's page) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one message: state, every timestamp, attempts, last error, headers and payload.
    Show {
        #[command(flatten)]
        db: DbArgs,
        /// Row id or message id.
        id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// FAILED, REJECTED or SENT → PENDING: published again at once (attempts and check-backs
    /// reset, the last error kept).
    Requeue(ActArgs),
    /// A delayed PENDING message (or one waiting for its retry) is due now.
    PublishNow(ActArgs),
    /// FAILED → the archive table `<table>_archive` (out of the outbox, kept).
    Discard(ActArgs),
    /// UNDECIDED → PREPARED: a parked two-phase message is checked back again at once, with a
    /// fresh budget of checks.
    Resume(ActArgs),
}

/// `outbox archive`: retention now.
#[derive(Debug, clap::Args)]
pub struct ArchiveArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Finished states, repeated or comma-separated: sent (awaiting no confirmation),
    /// confirmed, rejected, failed, rolled_back. Default: sent, confirmed, rejected (dead letters
    /// only when named).
    #[arg(long = "state", value_delimiter = ',')]
    states: Vec<outbox::retention::Finished>,
    /// Finished more than this long ago, by the database clock (`7d`, `12h`, `0s` for every
    /// finished row).
    #[arg(long, default_value = "7d")]
    older_than: humantime::Duration,
    /// Delete the rows instead of moving them to `<table>_archive`.
    #[arg(long)]
    delete: bool,
    /// Also delete rows of `<table>_archive` archived more than this long ago.
    #[arg(long)]
    purge_archive_older_than: Option<humantime::Duration>,
    /// Print the counts as JSON.
    #[arg(long)]
    json: bool,
}

/// What `outbox archive` did.
#[derive(Debug, Default, serde::Serialize)]
struct ArchiveReport {
    /// Rows moved to the archive, per state.
    archived: std::collections::BTreeMap<&'static str, u64>,
    /// Rows deleted, per state.
    deleted: std::collections::BTreeMap<&'static str, u64>,
    /// Rows deleted from the archive.
    archive_purged: u64,
}

/// Run `outbox archive`: each state's rows in transactions of at most 500 rows until none is
/// left (the relay's retention step, run to the end).
pub async fn archive(a: ArchiveArgs) -> anyhow::Result<()> {
    use outbox::retention::{Finished, RetentionAction};
    let store = open(&a.db).await?;
    let states = if a.states.is_empty() {
        vec![Finished::Sent, Finished::Confirmed, Finished::Rejected]
    } else {
        a.states.clone()
    };
    let action = if a.delete {
        RetentionAction::Delete
    } else {
        RetentionAction::Archive
    };
    let chunk = outbox::admin::ACTION_CHUNK as u32;
    let mut report = ArchiveReport::default();
    for state in states {
        let mut total = 0;
        loop {
            let n = store
                .retire(state, a.older_than.into(), action, chunk)
                .await?;
            total += n;
            if n < u64::from(chunk) {
                break;
            }
        }
        let into = match action {
            RetentionAction::Archive => &mut report.archived,
            RetentionAction::Delete => &mut report.deleted,
        };
        *into.entry(state.name()).or_default() += total;
    }
    if let Some(after) = a.purge_archive_older_than {
        loop {
            let n = store.purge_archive(after.into(), chunk).await?;
            report.archive_purged += n;
            if n < u64::from(chunk) {
                break;
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for (verb, counts) in [("archived", &report.archived), ("deleted", &report.deleted)] {
        for (state, n) in counts {
            println!("{verb} {n} {state} row(s)");
        }
    }
    if a.purge_archive_older_than.is_some() {
        println!(
            "deleted {} row(s) from {}_archive",
            report.archive_purged, a.db.table
        );
    }
    Ok(())
}

/// `outbox keys …`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Keys held back by a dead letter (a FAILED message with PENDING messages of its key after
    /// it), oldest first; requeue or discard the head to free the key.
    Blocked {
        #[command(flatten)]
        db: DbArgs,
        /// How many keys, 1 to 1000.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `outbox admin`: serve the admin API for a database.
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Address to listen on (loopback by default; port 0 picks one, printed).
    #[arg(long, default_value = "127.0.0.1:9465")]
    listen: std::net::SocketAddr,
    /// Environment variable holding the bearer token changes need (without one, the API only
    /// reads).
    #[arg(long)]
    token_env: Option<String>,
    /// Reads need the token too.
    #[arg(long)]
    protect_reads: bool,
}

/// The API's authentication from a token variable's name.
///
/// # Errors
/// `protect_reads` without a token, naming the setting (`token_env: …`).
pub fn admin_auth(token_env: Option<&str>, protect_reads: bool) -> Result<AdminAuth, String> {
    let token = token_env
        .and_then(|name| std::env::var(name).ok())
        .filter(|t| !t.trim().is_empty());
    if protect_reads && token.is_none() {
        return Err(format!(
            "token_env: protect_reads needs a token, and {} holds none",
            token_env.unwrap_or("no variable is named")
        ));
    }
    Ok(AdminAuth {
        token,
        protect_reads,
    })
}

/// Run `outbox messages …`.
pub async fn run(cmd: MessagesCommand) -> anyhow::Result<()> {
    match cmd {
        MessagesCommand::List {
            db,
            filter,
            limit,
            before,
            json,
        } => {
            let store = open(&db).await?;
            let page = store
                .search(&filter.into(), &PageRequest { before, limit })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&page)?);
                return Ok(());
            }
            println!(
                "{:>10}  {:<11}  {:<32}  {:<16}  {:>3}  {:<20}  last error",
                "id", "state", "topic", "key", "att", "created"
            );
            for m in &page.messages {
                println!("{}", row(m));
            }
            let order = match page.order {
                outbox::admin::SearchOrder::Id => "id",
                outbox::admin::SearchOrder::CreatedAt => "creation time",
                outbox::admin::SearchOrder::SentAt => "publication time",
            };
            match page.next {
                Some(next) => println!("newest first by {order}; more: --before {next}"),
                None => println!(
                    "newest first by {order} ({} message(s))",
                    page.messages.len()
                ),
            }
            Ok(())
        }
        MessagesCommand::Show { db, id, json } => {
            let store = open(&db).await?;
            let message: outbox::admin::MessageRef =
                id.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            let detail = store.find_message(message).await?;
            let Some(d) = detail else {
                anyhow::bail!(
                    "no message {id} in {} (never written, purged or archived)",
                    db.table
                );
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&d)?);
                return Ok(());
            }
            let m = &d.summary;
            let state = state_name(m);
            println!("id {}  message_id {}", m.id, m.message_id);
            println!(
                "state {state}  topic {}  key {}",
                m.topic,
                m.partition_key.as_deref().unwrap_or("-")
            );
            println!(
                "attempts {}{}  check-backs {}  redelivery {}",
                m.attempts,
                m.max_attempts
                    .map(|n| format!(" of {n}"))
                    .unwrap_or_default(),
                m.check_backs,
                m.redelivery
            );
            if let Some(target) = &d.check_back {
                println!("check-back {target}");
            }
            for (name, t) in [
                ("created", m.created_at),
                ("available", m.available_at),
                ("sent", m.sent_at),
                ("confirmed", m.confirmed_at),
                ("confirm deadline", m.confirm_deadline),
                ("updated", m.updated_at),
            ] {
                if let Some(t) = t {
                    println!("{name:>16}: {}", t.to_rfc3339());
                }
            }
            if let Some(e) = &m.last_error {
                println!("last error: {e}");
            }
            println!("headers:");
            for (k, v) in &d.headers {
                println!("  {k}: {v}");
            }
            if let Some(e) = &d.headers_error {
                println!(
                    "  (unreadable: {e}; stored: {})",
                    d.headers_raw.as_deref().unwrap_or("")
                );
            }
            println!("payload ({}, {} bytes):", d.payload.kind, d.payload.bytes);
            println!("{}", d.payload.text);
            Ok(())
        }
        MessagesCommand::Requeue(a) => act(Action::Requeue, a).await,
        MessagesCommand::PublishNow(a) => act(Action::PublishNow, a).await,
        MessagesCommand::Discard(a) => act(Action::Discard, a).await,
        MessagesCommand::Resume(a) => act(Action::Resume, a).await,
    }
}

async fn open(db: &DbArgs) -> anyhow::Result<Arc<dyn outbox::Store>> {
    open_store(&db.database, &db.table, &db.inbox_table, Create::Never).await
}

fn state_name(m: &MessageSummary) -> String {
    m.status.map_or_else(
        || format!("status {}", m.status_number),
        |s| s.name().to_owned(),
    )
}

/// Cut `s` to `n` characters, marking the cut with `…`.
pub(crate) fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(n.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

fn row(m: &MessageSummary) -> String {
    format!(
        "{:>10}  {:<11}  {:<32}  {:<16}  {:>3}  {:<20}  {}",
        m.id,
        state_name(m),
        cut(&m.topic, 32),
        cut(m.partition_key.as_deref().unwrap_or("-"), 16),
        m.attempts,
        m.created_at
            .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
            .unwrap_or_default(),
        cut(m.last_error.as_deref().unwrap_or(""), 60).replace('\n', " ")
    )
}

async fn act(action: Action, a: ActArgs) -> anyhow::Result<()> {
    let store = open(&a.db).await?;
    let selection = if a.all {
        Selection::Filter(a.filter.into())
    } else {
        Selection::Ids(a.ids)
    };
    let report = store.act(action, &selection).await?;
    print_report(action, &report, a.json)?;
    if !report.not_changed.is_empty() {
        anyhow::bail!(
            "{} of the ids named were not changed",
            report.not_changed.len()
        );
    }
    Ok(())
}

fn print_report(action: Action, report: &ActionReport, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    println!("{}: {} message(s) changed", action.name(), report.changed);
    for n in &report.not_changed {
        println!("  id {}: not changed: {}", n.id, n.reason);
    }
    Ok(())
}

/// Run `outbox admin` until Ctrl-C or SIGTERM.
pub async fn serve(args: AdminArgs) -> anyhow::Result<()> {
    let auth = admin_auth(args.token_env.as_deref(), args.protect_reads)
        .map_err(|e| anyhow::anyhow!("--{}", e.replacen('_', "-", 1)))?;
    let store = open(&args.db).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen: cannot listen on {}", args.listen))?;
    let cancel = CancellationToken::new();
    // The dead letters of `--inbox-table` (default `outbox_inbox`) under /api/inbox.
    let inbox = outbox::admin::inbox::InboxAdmin::on_store(&*store, &args.db.inbox_table)?;
    let app = outbox::admin::http::AdminApi::new(store, auth)
        .inbox(inbox)
        .router();
    let addr = crate::admin::serve(listener, app, cancel.clone())?;
    println!("admin API on http://{addr}/api/ (OpenAPI: http://{addr}/api/openapi.json)");
    crate::shutdown_signal().await;
    cancel.cancel();
    Ok(())
}

/// `outbox relays`: each relay's heartbeat age, routes and the buckets it holds.
pub async fn relays(db: DbArgs, json: bool) -> anyhow::Result<()> {
    let store = open(&db).await?;
    let leases = store.leases().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&leases)?);
        return Ok(());
    }
    let now = leases.now.unwrap_or_else(Utc::now);
    let ago = |t: Option<DateTime<Utc>>| {
        t.map_or_else(
            || "-".to_owned(),
            |t| format!("{:.1} s", (now - t).num_milliseconds() as f64 / 1000.0),
        )
    };
    println!(
        "{:<32}  {:>14}  {:>7}  routes",
        "relay", "heartbeat ago", "buckets"
    );
    for r in &leases.relays {
        let held = leases
            .buckets
            .iter()
            .filter(|b| b.owner.as_deref() == Some(&r.name) && b.expires_at > Some(now))
            .count();
        println!(
            "{:<32}  {:>14}  {:>7}  {}",
            cut(&r.name, 32),
            ago(r.heartbeat_at),
            held,
            r.routes.as_deref().unwrap_or("-")
        );
    }
    let unheld = leases
        .buckets
        .iter()
        .filter(|b| b.expires_at.is_none_or(|e| e <= now))
        .count();
    println!(
        "{} buckets, {unheld} without a live lease",
        leases.buckets.len()
    );
    Ok(())
}

/// `outbox keys …`.
pub async fn keys(cmd: KeysCommand) -> anyhow::Result<()> {
    let KeysCommand::Blocked { db, limit, json } = cmd;
    let store = open(&db).await?;
    let keys = store.blocked_keys(limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&keys)?);
        return Ok(());
    }
    if keys.is_empty() {
        println!("no key is held back by a dead letter");
        return Ok(());
    }
    println!(
        "{:<24}  {:>10}  {:>7}  {:<20}  reason",
        "key", "held by", "waiting", "since"
    );
    for k in &keys {
        println!(
            "{:<24}  {:>10}  {:>7}  {:<20}  {}",
            cut(&k.key, 24),
            k.held_by,
            k.waiting,
            k.since
                .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
                .unwrap_or_default(),
            cut(k.last_error.as_deref().unwrap_or(""), 60).replace('\n', " ")
        );
    }
    println!("free a key: outbox messages requeue|discard <held by>");
    Ok(())
}
