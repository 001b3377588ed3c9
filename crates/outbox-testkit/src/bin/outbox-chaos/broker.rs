//! Restarting the broker itself (`--restart-broker`): the NATS server process (SIGTERM, then
//! started again with the same command line) or the RabbitMQ application (`rabbitmqctl
//! stop_app` / `start_app`). These are the machine's shared services: the option is off by
//! default.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::Command;

/// How to stop and start the broker of the run.
#[derive(Debug)]
pub(crate) struct BrokerProcess {
    kind: Kind,
    /// `host:port` the broker listens on (to wait for it).
    addr: String,
    stopped: AtomicBool,
}

#[derive(Debug)]
enum Kind {
    /// The `nats-server` command line, as `pgrep -a` showed it.
    Nats(Vec<String>),
    RabbitMq,
}

impl BrokerProcess {
    /// The broker behind `url` (`nats://…` or `amqp://…`) listening on `addr`.
    pub(crate) async fn find(url: &str, addr: String) -> anyhow::Result<BrokerProcess> {
        let kind = if url.starts_with("amqp") {
            Kind::RabbitMq
        } else {
            let out = Command::new("pgrep")
                .args(["-a", "-x", "nats-server"])
                .output()
                .await
                .context("pgrep")?;
            let line = String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .map(str::to_owned);
            let Some(line) = line else {
                bail!("--restart-broker: no nats-server process on this machine");
            };
            Kind::Nats(line.split_whitespace().skip(1).map(str::to_owned).collect())
        };
        Ok(BrokerProcess {
            kind,
            addr,
            stopped: AtomicBool::new(false),
        })
    }

    /// Stop the broker (returns once it no longer listens).
    pub(crate) async fn stop(&self) -> anyhow::Result<()> {
        self.stopped.store(true, Ordering::SeqCst);
        match &self.kind {
            Kind::Nats(_) => {
                let status = Command::new("pkill")
                    .args(["-TERM", "-x", "nats-server"])
                    .status()
                    .await?;
                if !status.success() {
                    bail!("pkill nats-server failed: {status}");
                }
                let deadline = Instant::now() + Duration::from_secs(20);
                while Command::new("pgrep")
                    .args(["-x", "nats-server"])
                    .status()
                    .await?
                    .success()
                {
                    if Instant::now() > deadline {
                        bail!("nats-server did not stop within 20 s");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            Kind::RabbitMq => rabbitmqctl("stop_app").await?,
        }
        Ok(())
    }

    /// Start the broker again (returns once it listens), if it was stopped.
    pub(crate) async fn start(&self) -> anyhow::Result<()> {
        if !self.stopped.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        match &self.kind {
            Kind::Nats(cmd) => {
                std::process::Command::new("setsid")
                    .arg("-f")
                    .args(cmd)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .context("start nats-server again")?;
            }
            Kind::RabbitMq => rabbitmqctl("start_app").await?,
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(&self.addr).await.is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the broker does not listen on {} 60 s after its start",
                    self.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

async fn rabbitmqctl(what: &str) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl")
        .arg(what)
        .output()
        .await
        .with_context(|| format!("rabbitmqctl {what}"))?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl {what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
