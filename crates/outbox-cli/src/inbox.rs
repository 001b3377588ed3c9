//! `outbox inbox`: a consumer's dead letters (list, replay, discard) over its inbox table.

use anyhow::{Context, bail};
use clap::Subcommand;
use outbox::store::Dialect;

use crate::redact;

#[derive(Debug, clap::Args)]
pub(crate) struct InboxArgs {
    /// The consumer's database URL: `postgres://…`, `mysql://…` (`mariadb://…`) or `sqlite://…`.
    #[arg(long, env = "OUTBOX_DATABASE_URL")]
    database: String,
    /// Inbox table (dead letters are in `<table>_dlq`).
    #[arg(long, default_value = "outbox_inbox")]
    inbox_table: String,
    /// Consumer name.
    #[arg(long)]
    consumer: String,
}

#[derive(Debug, Subcommand)]
pub(crate) enum InboxCommand {
    /// List the consumer's dead letters, newest first.
    DeadLetters {
        #[command(flatten)]
        inbox: InboxArgs,
        /// How many to list, 1 to 1000.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print JSON (the API's answer) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Ask the consumer's runner to run dead letters again (it does so within its maintenance
    /// interval, with its handler, and confirms the new verdict).
    Replay {
        #[command(flatten)]
        inbox: InboxArgs,
        /// Message ids of the dead letters.
        #[arg(required = true)]
        message_ids: Vec<String>,
    },
    /// Delete dead letters; the inbox keeps their rejected verdict.
    Discard {
        #[command(flatten)]
        inbox: InboxArgs,
        /// Message ids of the dead letters.
        #[arg(required = true)]
        message_ids: Vec<String>,
    },
}

pub(crate) async fn inbox_command(cmd: InboxCommand) -> anyhow::Result<()> {
    use outbox::admin::inbox::{InboxAction, InboxAdmin};
    let args = match &cmd {
        InboxCommand::DeadLetters { inbox, .. }
        | InboxCommand::Replay { inbox, .. }
        | InboxCommand::Discard { inbox, .. } => inbox,
    };
    let url = args.database.as_str();
    let cannot_open = || format!("cannot open {}", redact(url));
    let admin = match Dialect::of_url(url)? {
        Dialect::Postgres => InboxAdmin::postgres(
            sqlx::PgPool::connect(url).await.with_context(cannot_open)?,
            &args.inbox_table,
        )?,
        Dialect::MySql => InboxAdmin::mysql(
            sqlx::MySqlPool::connect(&url.replacen("mariadb://", "mysql://", 1))
                .await
                .with_context(cannot_open)?,
            &args.inbox_table,
        )?,
        Dialect::Sqlite => InboxAdmin::sqlite(
            sqlx::SqlitePool::connect(url)
                .await
                .with_context(cannot_open)?,
            &args.inbox_table,
        )?,
    };
    let consumer = args.consumer.as_str();
    let (action, ids) = match &cmd {
        InboxCommand::DeadLetters { limit, json, .. } => {
            let dead = admin.dead_letters(Some(consumer), *limit).await?;
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({ "dead_letters": dead }))?
                );
                return Ok(());
            }
            println!("dead letters of consumer {consumer:?} ({}):", dead.len());
            for d in dead {
                println!(
                    "  message_id={} topic={} deliveries={}{} error={}",
                    d.message_id,
                    d.topic,
                    d.deliveries,
                    if d.replay_requested_at.is_some() {
                        " replay=requested"
                    } else {
                        ""
                    },
                    d.error
                );
            }
            return Ok(());
        }
        InboxCommand::Replay { message_ids, .. } => (InboxAction::Replay, message_ids),
        InboxCommand::Discard { message_ids, .. } => (InboxAction::Discard, message_ids),
    };
    let report = admin.act(action, consumer, ids).await?;
    match action {
        InboxAction::Replay => println!(
            "replay of {} dead letter(s) requested; the consumer's runner runs them within its \
             maintenance interval",
            report.changed
        ),
        InboxAction::Discard => println!("discarded {} dead letter(s)", report.changed),
    }
    for (id, why) in &report.not_changed {
        println!("{id}: not changed: {why}");
    }
    if !report.not_changed.is_empty() {
        bail!(
            "{} of the named dead letters not changed ({}_dlq, consumer {consumer:?})",
            report.not_changed.len(),
            args.inbox_table
        );
    }
    Ok(())
}
