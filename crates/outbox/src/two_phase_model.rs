//! The data and decisions of two-phase (half) messages: the check-back target, its answer and
//! policy, the producer's decision, the due PREPARED rows and a check-back's result. A contract,
//! below the store (which reads and writes it) and the relay; public as [`crate::two_phase`]
//! (see there).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{BoxError, ConfigError, StoreError};
use crate::message::Status;
use crate::retry::Backoff;

/// Default delay from `prepare` to the first check-back: 6 s, RocketMQ's `transactionTimeOut`.
pub const DEFAULT_CHECK_AFTER: Duration = Duration::from_secs(6);

/// Longest stored check-back target (a URL or `hook:<name>`), in bytes.
pub const MAX_TARGET_LEN: usize = 2048;

/// Whom the relay asks about a PREPARED message nobody decided: an HTTP endpoint or an
/// in-process hook, and when.
///
/// Stored with the row (column `check_back`: the URL, or `hook:<name>`), so each message names
/// its own check-back (as dtm's `QueryPrepared` URL), and any relay can check it.
///
/// # Examples
/// ```
/// use outbox::two_phase::CheckBack;
/// use std::time::Duration;
///
/// let http = CheckBack::http("https://orders.internal/outbox/check-back").unwrap();
/// let hook = CheckBack::hook("orders").unwrap().after(Duration::from_secs(2));
/// assert_eq!(hook.target(), "hook:orders");
/// assert!(CheckBack::http("ftp://x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckBack {
    target: String,
    after: Duration,
    deadline: Option<Duration>,
}

impl CheckBack {
    /// Ask `url` with an HTTP POST ([`HttpChecker`]): `http://` or `https://`, at most
    /// [`MAX_TARGET_LEN`] bytes, no whitespace or control characters.
    ///
    /// # Errors
    /// [`ConfigError`] on `check_back` naming what is wrong.
    pub fn http(url: impl Into<String>) -> Result<Self, ConfigError> {
        let url = url.into();
        let lower = url.to_ascii_lowercase();
        ConfigError::invalid_if(
            !(lower.starts_with("http://") || lower.starts_with("https://")) || url.len() < 8,
            "check_back",
            format!("{url:?} is not an http:// or https:// URL"),
        )?;
        CheckBack::stored(url)
    }

    /// Ask the in-process hook registered as `name` on the relay
    /// ([`RelayBuilder::check_back_hook`](crate::RelayBuilder::check_back_hook)): 1 to 64 of
    /// `A-Z a-z 0-9 - _ .`.
    ///
    /// # Errors
    /// [`ConfigError`] on `check_back` when the name breaks that rule.
    pub fn hook(name: &str) -> Result<Self, ConfigError> {
        ConfigError::invalid_if(
            !valid_hook_name(name),
            "check_back",
            format!("hook name {name:?}: 1 to 64 of A-Z a-z 0-9 - _ ."),
        )?;
        CheckBack::stored(format!("hook:{name}"))
    }

    /// A target as stored in the `check_back` column (a URL or `hook:<name>`), checked as
    /// [`CheckBack::http`] or [`CheckBack::hook`] would.
    ///
    /// # Errors
    /// [`ConfigError`] on `check_back`.
    pub fn parse(stored: &str) -> Result<Self, ConfigError> {
        match stored.strip_prefix("hook:") {
            Some(name) => CheckBack::hook(name),
            None => CheckBack::http(stored),
        }
    }

    fn stored(target: String) -> Result<Self, ConfigError> {
        if target.len() > MAX_TARGET_LEN
            || target.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(ConfigError::new(
                "check_back",
                format!("at most {MAX_TARGET_LEN} bytes without whitespace or control characters"),
            ));
        }
        Ok(CheckBack {
            target,
            after: DEFAULT_CHECK_AFTER,
            deadline: None,
        })
    }

    /// The first check-back comes `after` the prepare (database clock). Default
    /// [`DEFAULT_CHECK_AFTER`] (6 s); at most 365 days.
    pub fn after(mut self, after: Duration) -> Self {
        self.after = after;
        self
    }

    /// Park the message as UNDECIDED once it has been prepared for longer than `deadline`
    /// without a decision, whatever the number of checks. Default none (only
    /// [`CheckBackPolicy::max_checks`] parks it).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The stored target: the URL, or `hook:<name>`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The hook's name, for a hook target.
    pub fn hook_name(&self) -> Option<&str> {
        self.target.strip_prefix("hook:")
    }

    /// Delay from the prepare to the first check.
    pub fn check_after(&self) -> Duration {
        self.after
    }

    /// The decision deadline, counted from the prepare.
    pub fn decision_deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The delays, checked: each at most 365 days.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
        ConfigError::invalid_if(self.after > YEAR, "check_back.after", "at most 365 days")?;
        ConfigError::invalid_if(
            self.deadline.is_some_and(|d| d > YEAR || d.is_zero()),
            "check_back.deadline",
            "more than zero and at most 365 days",
        )?;
        Ok(())
    }
}

fn valid_hook_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A check-back's answer: the strict grammar is the whole answer being exactly `COMMIT`,
/// `ROLLBACK` or `UNKNOWN` (one trailing line break allowed); anything else is an error, never a
/// decision (shared case C29: a 200 with an error text must not commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Answer {
    /// The business transaction committed: publish the message.
    Commit,
    /// The business transaction rolled back (or never ran): never publish it.
    Rollback,
    /// Still running: ask again after [`CheckBackPolicy::interval`]; counted toward
    /// [`CheckBackPolicy::max_checks`].
    Unknown,
}

impl Answer {
    /// The answer's word.
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::Commit => "COMMIT",
            Answer::Rollback => "ROLLBACK",
            Answer::Unknown => "UNKNOWN",
        }
    }

    /// Read an answer by the strict grammar.
    ///
    /// # Errors
    /// A text quoting (the start of) what was answered instead.
    ///
    /// ```
    /// use outbox::two_phase::Answer;
    /// assert_eq!(Answer::parse("COMMIT\n"), Ok(Answer::Commit));
    /// assert!(Answer::parse("commit").is_err());
    /// assert!(Answer::parse("error: permission denied").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Answer, String> {
        let word = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(text);
        match word {
            "COMMIT" => Ok(Answer::Commit),
            "ROLLBACK" => Ok(Answer::Rollback),
            "UNKNOWN" => Ok(Answer::Unknown),
            _ => {
                let shown: String = text.chars().take(80).collect();
                Err(format!(
                    "answer {shown:?} is not exactly COMMIT, ROLLBACK or UNKNOWN"
                ))
            }
        }
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a check-back is asked about: the JSON body of the HTTP check-back's POST, and the
/// argument of a [`CheckBackHook`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRequest {
    /// The message id given at `prepare` (the id a barrier marks).
    pub message_id: Uuid,
    /// The outbox row id.
    pub id: i64,
    /// The topic.
    pub topic: String,
    /// The partition key, if any.
    pub partition_key: Option<String>,
    /// The headers given at `prepare`.
    pub headers: BTreeMap<String, String>,
    /// Check-backs answered so far (UNKNOWN answers), 0 at the first.
    pub checks: u32,
}

/// An in-process check-back, registered on the relay under a name
/// ([`RelayBuilder::check_back_hook`](crate::RelayBuilder::check_back_hook)) and named by the
/// messages that use it ([`CheckBack::hook`]).
///
/// Each call is bounded by [`CheckBackPolicy::timeout`]; an error, a timeout or a panic is an
/// error (asked again with backoff, not counted), never a decision.
#[async_trait]
pub trait CheckBackHook: Send + Sync + 'static {
    /// Decide `request`'s message.
    ///
    /// # Errors
    /// Anything that prevents a decision.
    async fn check(&self, request: &CheckRequest) -> Result<Answer, BoxError>;
}

#[async_trait]
impl<F, Fut> CheckBackHook for F
where
    F: Fn(CheckRequest) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Answer, BoxError>> + Send,
{
    async fn check(&self, request: &CheckRequest) -> Result<Answer, BoxError> {
        self(request.clone()).await
    }
}

/// How the relay checks back PREPARED messages: the `[relay.check_back]` table of a
/// configuration file (durations written `"30s"`; every key optional, unknown keys are errors).
/// Defaults follow RocketMQ (`transactionCheckInterval` 30 s, `transactionCheckMax` 15).
#[derive(Clone, Serialize, Deserialize, derive_more::Debug)]
#[serde(default, deny_unknown_fields)]
pub struct CheckBackPolicy {
    /// Delay after an UNKNOWN answer. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Answered check-backs (UNKNOWN) after which the message is parked as UNDECIDED, 1 to
    /// 1,000. Default 15. Errors are not counted.
    pub max_checks: u32,
    /// Longest wait for one answer. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// First delay after an error, doubled per consecutive error. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub error_backoff: Duration,
    /// Largest delay after errors. Default 5 min.
    #[serde(with = "humantime_serde")]
    pub error_backoff_max: Duration,
    /// Check-backs in flight at once per relay, 1 to 256. Default 16.
    pub concurrency: usize,
    /// How often the relay looks for due PREPARED rows. Default 1 s.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// `whsec_…` secret that signs HTTP check-backs the Standard Webhooks way
    /// (`webhook-id`, `webhook-timestamp`, `webhook-signature`). Default none (unsigned). Never
    /// written out or shown.
    #[serde(skip_serializing)]
    #[debug("{:?}", crate::redact::secret(secret))]
    pub secret: Option<String>,
    /// The name of an environment variable holding the `whsec_…` secret instead (read when
    /// the relay is built), so the secret need not be written in a file.
    pub secret_env: Option<String>,
}

impl Default for CheckBackPolicy {
    fn default() -> Self {
        CheckBackPolicy {
            interval: Duration::from_secs(30),
            max_checks: 15,
            timeout: Duration::from_secs(5),
            error_backoff: Duration::from_secs(1),
            error_backoff_max: Duration::from_secs(300),
            concurrency: 16,
            poll_interval: Duration::from_secs(1),
            secret: None,
            secret_env: None,
        }
    }
}

impl CheckBackPolicy {
    /// Check every field; the error names the first bad one as `relay.check_back.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field and the rule it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |n: &str, r: &str| Err(ConfigError::new(format!("relay.check_back.{n}"), r));
        for (name, d) in [
            ("interval", self.interval),
            ("timeout", self.timeout),
            ("error_backoff", self.error_backoff),
            ("poll_interval", self.poll_interval),
        ] {
            if d.is_zero() {
                return f(name, "must be greater than zero");
            }
        }
        if self.error_backoff_max < self.error_backoff {
            return f("error_backoff_max", "must be at least error_backoff");
        }
        if !(1..=1000).contains(&self.max_checks) {
            return f("max_checks", "must be 1 to 1000");
        }
        if !(1..=256).contains(&self.concurrency) {
            return f("concurrency", "must be 1 to 256");
        }
        if self.secret.is_some() && self.secret_env.is_some() {
            return f("secret_env", "give secret or secret_env, not both");
        }
        #[cfg(feature = "webhook")]
        if let Some(s) = self.resolved_secret()? {
            crate::transport::webhook::WebhookSigner::new(&s)
                .map_err(|e| ConfigError::new("relay.check_back.secret", e.reason))?;
        }
        Ok(())
    }

    /// The signing secret: `secret`, or the value of the variable `secret_env` names.
    ///
    /// # Errors
    /// [`ConfigError`] on `relay.check_back.secret_env` when that variable is not set.
    pub fn resolved_secret(&self) -> Result<Option<String>, ConfigError> {
        match (&self.secret, &self.secret_env) {
            (Some(s), _) => Ok(Some(s.clone())),
            (None, Some(var)) => std::env::var(var).map(Some).map_err(|_| {
                ConfigError::new(
                    "relay.check_back.secret_env",
                    format!("the environment variable {var} is not set"),
                )
            }),
            (None, None) => Ok(None),
        }
    }

    /// The backoff after `errors` consecutive errors.
    pub(crate) fn backoff(&self, errors: u32) -> Duration {
        Backoff {
            base: self.error_backoff,
            factor: 2.0,
            max: self.error_backoff_max,
            jitter: 0.2,
        }
        .delay(errors)
    }
}

/// The in-process check-backs of a relay, by name.
pub(crate) type Hooks = BTreeMap<String, Arc<dyn CheckBackHook>>;

/// What a call of `commit_prepared` / `rollback_prepared` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decided {
    /// This call decided it.
    Now,
    /// It was already decided the same way (by an earlier call or a check-back): nothing
    /// changed.
    Already,
}

/// Why `commit_prepared` / `rollback_prepared` did not decide.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// No row has this message id: never prepared, or removed by retention.
    #[error("no prepared message {0}")]
    NotFound(Uuid),
    /// The other decision was taken first (by a check-back answer or another call): the
    /// message stays as decided. `status` is what it is now.
    #[error("message {message_id} was already decided otherwise: it is {status}")]
    Lost {
        /// The message id.
        message_id: Uuid,
        /// Its status now (ROLLED_BACK for a late commit; PENDING or later for a late
        /// rollback).
        status: Status,
    },
    /// The row is not a two-phase message's (status number outside the schema).
    #[error("message {message_id} has status number {status}, outside the schema")]
    Corrupt {
        /// The message id.
        message_id: Uuid,
        /// The stored number.
        status: i64,
    },
    /// The database failed; the decision may or may not have been written (call again: it is
    /// idempotent).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The outcome of one check-back, as the relay records it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CheckResult {
    /// An answer by the grammar.
    Answered(Answer),
    /// No answer: why (not counted).
    Error(String),
}

/// One PREPARED row due for a check-back, as read by the relay.
#[derive(Debug, Clone)]
pub struct DuePrepared {
    /// What the check-back is asked.
    pub request: CheckRequest,
    /// The stored target, as written (validated when used).
    pub target: String,
    /// The row's bucket.
    pub bucket: crate::message::Bucket,
    /// Consecutive errors so far (the row's `attempts` while PREPARED).
    pub errors: u32,
    /// Whether the row's decision deadline has passed (database clock).
    pub past_deadline: bool,
    /// Time left until the decision deadline (zero once past), if it has one.
    pub until_deadline: Option<Duration>,
}

/// The due PREPARED rows of some buckets ([`Store::due_prepared`](crate::Store::due_prepared)).
#[derive(Debug, Default)]
pub struct PreparedBatch {
    /// Rows to check back, earliest due first.
    pub due: Vec<DuePrepared>,
    /// Rows that cannot be checked back (a foreign producer's garbage: no valid message id,
    /// headers or target): `(row id, bucket, why)`. The relay parks them as UNDECIDED with the
    /// reason, so they neither block the rest nor get published.
    pub malformed: Vec<(i64, crate::message::Bucket, String)>,
}

/// What a check-back's result does to its row: [`next`].
#[derive(Debug, Clone, PartialEq)]
pub struct CheckUpdate {
    /// The row's new status: PENDING (commit), ROLLED_BACK, UNDECIDED, or PREPARED (ask again).
    pub status: Status,
    /// Answered checks (`check_backs`).
    pub checks: u32,
    /// Consecutive errors (`attempts` while PREPARED; 0 once answered).
    pub errors: u32,
    /// Delay until the next check (PREPARED only).
    pub delay: Duration,
    /// The text recorded in `last_error` (none on commit).
    pub note: Option<String>,
}

/// The next state of a due row after `result` (a pure decision: the relay writes it fenced by
/// the bucket lease). The next check is never later than the decision deadline, so a message is
/// parked at its deadline whatever the interval or backoff.
pub(crate) fn next(
    row: &DuePrepared,
    result: &CheckResult,
    policy: &CheckBackPolicy,
) -> CheckUpdate {
    let mut update = decide(row, result, policy);
    if let Some(left) = row.until_deadline {
        update.delay = update.delay.min(left);
    }
    update
}

fn decide(row: &DuePrepared, result: &CheckResult, policy: &CheckBackPolicy) -> CheckUpdate {
    let checks = row.request.checks;
    match result {
        CheckResult::Answered(Answer::Commit) => CheckUpdate {
            status: Status::Pending,
            checks: 0,
            errors: 0,
            delay: Duration::ZERO,
            note: None,
        },
        CheckResult::Answered(Answer::Rollback) => CheckUpdate {
            status: Status::RolledBack,
            checks: checks.saturating_add(1),
            errors: 0,
            delay: Duration::ZERO,
            note: Some("rolled back: the check-back answered ROLLBACK".into()),
        },
        CheckResult::Answered(Answer::Unknown) => {
            let checks = checks.saturating_add(1);
            if checks >= policy.max_checks || row.past_deadline {
                let why = if row.past_deadline {
                    "past its decision deadline".to_owned()
                } else {
                    format!("{checks} check-backs answered UNKNOWN")
                };
                CheckUpdate {
                    status: Status::Undecided,
                    checks,
                    errors: 0,
                    delay: Duration::ZERO,
                    note: Some(format!("undecided: {why}")),
                }
            } else {
                CheckUpdate {
                    status: Status::Prepared,
                    checks,
                    errors: 0,
                    delay: policy.interval,
                    note: Some(format!("check-back {checks} answered UNKNOWN")),
                }
            }
        }
        CheckResult::Error(e) => {
            let errors = row.errors.saturating_add(1);
            if row.past_deadline {
                CheckUpdate {
                    status: Status::Undecided,
                    checks,
                    errors,
                    delay: Duration::ZERO,
                    note: Some(format!(
                        "undecided: past its decision deadline; last check-back: {e}"
                    )),
                }
            } else {
                CheckUpdate {
                    status: Status::Prepared,
                    checks,
                    errors,
                    delay: policy.backoff(errors),
                    note: Some(format!("check-back failed (not counted): {e}")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(checks: u32, errors: u32, past_deadline: bool) -> DuePrepared {
        DuePrepared {
            request: CheckRequest {
                message_id: Uuid::nil(),
                id: 1,
                topic: "t".into(),
                partition_key: None,
                headers: Default::default(),
                checks,
            },
            target: "hook:x".into(),
            bucket: 0,
            errors,
            past_deadline,
            until_deadline: None,
        }
    }

    #[test]
    fn the_next_check_is_never_after_the_deadline() {
        let p = CheckBackPolicy::default();
        let mut r = row(1, 3, false);
        r.until_deadline = Some(Duration::from_millis(700));
        let u = next(&r, &CheckResult::Answered(Answer::Unknown), &p);
        assert_eq!(
            (u.status, u.delay),
            (Status::Prepared, Duration::from_millis(700))
        );
        let u = next(&r, &CheckResult::Error("down".into()), &p);
        assert!(u.delay <= Duration::from_millis(700));
    }

    #[test]
    fn answers_follow_the_strict_grammar() {
        for ok in ["COMMIT", "COMMIT\n", "COMMIT\r\n"] {
            assert_eq!(Answer::parse(ok), Ok(Answer::Commit));
        }
        for bad in [
            "",
            "commit",
            " COMMIT",
            "COMMIT\n\n",
            "OK",
            "{\"answer\":\"COMMIT\"}",
            "200 error: permission denied",
        ] {
            assert!(Answer::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn errors_are_never_counted_and_back_off() {
        let p = CheckBackPolicy::default();
        let u = next(&row(3, 0, false), &CheckResult::Error("refused".into()), &p);
        assert_eq!((u.status, u.checks, u.errors), (Status::Prepared, 3, 1));
        // Many errors in a row: still PREPARED, still 3 answered checks, the delay capped.
        let u = next(
            &row(3, 40, false),
            &CheckResult::Error("refused".into()),
            &p,
        );
        assert_eq!((u.status, u.checks), (Status::Prepared, 3));
        assert!(u.delay <= p.error_backoff_max);
    }

    #[test]
    fn unknown_counts_and_parks_at_the_budget_or_deadline() {
        let p = CheckBackPolicy {
            max_checks: 3,
            ..Default::default()
        };
        let u = next(
            &row(1, 2, false),
            &CheckResult::Answered(Answer::Unknown),
            &p,
        );
        assert_eq!(
            (u.status, u.checks, u.errors, u.delay),
            (Status::Prepared, 2, 0, p.interval)
        );
        let u = next(
            &row(2, 0, false),
            &CheckResult::Answered(Answer::Unknown),
            &p,
        );
        assert_eq!((u.status, u.checks), (Status::Undecided, 3));
        let u = next(&row(0, 0, true), &CheckResult::Error("down".into()), &p);
        assert_eq!(u.status, Status::Undecided);
    }

    #[test]
    fn decisions_end_the_checks() {
        let p = CheckBackPolicy::default();
        let c = next(&row(5, 1, true), &CheckResult::Answered(Answer::Commit), &p);
        assert_eq!((c.status, c.checks, c.errors), (Status::Pending, 0, 0));
        let r = next(
            &row(5, 1, false),
            &CheckResult::Answered(Answer::Rollback),
            &p,
        );
        assert_eq!(r.status, Status::RolledBack);
    }

    #[test]
    fn targets_are_checked() {
        assert!(CheckBack::http("https://a.example/x").is_ok());
        assert!(CheckBack::http("http://a b").is_err());
        assert!(CheckBack::hook("").is_err());
        assert!(CheckBack::hook("a/b").is_err());
        assert_eq!(
            CheckBack::parse("hook:orders").unwrap().hook_name(),
            Some("orders")
        );
        assert!(CheckBack::http(format!("https://{}", "a".repeat(3000))).is_err());
    }
}
