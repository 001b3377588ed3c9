//! The log lines of a test's own thread, captured as text: for tests on a current-thread runtime
//! (`#[tokio::test]`), where every task they spawn logs on the test's thread.

use std::sync::{Arc, Mutex};

/// The captured log lines of the current thread (see [`Logs::capture`]).
#[derive(Clone, Default)]
pub(crate) struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Capture this thread's events at `level` and above (without colours) until the guard is
    /// dropped.
    pub(crate) fn capture(level: tracing::Level) -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Lines that contain every one of `parts`.
    pub(crate) fn lines_with(&self, parts: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
            .collect()
    }

    /// How many lines at `level` (`"WARN"`, `"INFO"`, `"DEBUG"`) contain `needle`.
    pub(crate) fn count(&self, level: &str, needle: &str) -> usize {
        self.lines_with(&[level, needle]).len()
    }

    /// The last 40 lines, for an assertion's message.
    pub(crate) fn dump(&self) -> String {
        let text = self.text();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(40);
        lines[from..].join("\n")
    }
}
