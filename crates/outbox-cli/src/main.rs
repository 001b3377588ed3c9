//! The `outbox` command: migrate, relay daemon, status, demo.

mod demo;

use clap::{Parser, Subcommand};

/// Transactional outbox (本地消息表): migrate the tables, run the relay, inspect the outbox, or
/// watch the order → inventory demo.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the order → inventory demo with injected faults and print a report.
    Demo(demo::DemoArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await,
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
