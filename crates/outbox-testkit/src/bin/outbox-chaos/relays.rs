//! The relay processes: `outbox relay --config FILE` children, killed, paused and restarted
//! by the fault schedule.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context;
use tokio::process::{Child, Command};

/// One relay slot (its membership name kept across restarts, as a restarted pod keeps its
/// name): its configuration file, log file and current process.
pub struct RelaySlot {
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Whether it is paused (SIGSTOP) now.
    pub paused: bool,
}

impl RelaySlot {
    /// Write the slot's configuration into `dir`.
    pub fn new(dir: &Path, name: String, toml: &str) -> anyhow::Result<RelaySlot> {
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, toml).with_context(|| format!("write {}", config.display()))?;
        Ok(RelaySlot {
            log: dir.join(format!("{name}.log")),
            config,
            child: None,
            paused: false,
        })
    }

    /// Start the process (its output appended to the slot's log).
    pub fn start(&mut self, outbox: &Path) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(outbox)
            .arg("relay")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "outbox=info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", outbox.display()))?;
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    /// Whether a process runs in the slot.
    pub fn running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL the process and reap it.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
        self.paused = false;
    }

    /// SIGSTOP (`pause`) or SIGCONT the process.
    pub fn signal_pause(&mut self, pause: bool) {
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            let sig = if pause { "-STOP" } else { "-CONT" };
            let _ = std::process::Command::new("kill")
                .arg(sig)
                .arg(pid.to_string())
                .status();
            self.paused = pause;
        }
    }
}
