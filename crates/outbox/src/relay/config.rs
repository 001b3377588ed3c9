//! [`RelayConfig`]: the relay's settings, their defaults and validation.

use super::*;
use crate::retention::Retention;
use crate::two_phase::CheckBackPolicy;

/// Relay settings. Every field has a default ([`RelayConfig::default`]); [`RelayConfig::validate`]
/// names the first bad field.
///
/// Also the `[relay]` table of a configuration file, every key optional: `name`, `batch_size`,
/// `lease`, `publish_timeout`, `poll_interval`, `max_attempts`, `backoff_base` and
/// `backoff_max` (the [`backoff`](Self::backoff)'s `base` and `max`), `maintenance_interval`
/// (or its name before 0.2, `reap_interval`), `in_flight_batches`, `shutdown_timeout`,
/// `max_check_backs`, `retention` (a duration, `"forever"`, or a table of rules per state:
/// [`crate::retention`]),
/// `missing_destination_grace`, `check_back` (a table: [`CheckBackPolicy`]). Durations are written `"30s"`, `"500ms"`, `"7d"`; unknown keys
/// are errors. The backoff's factor and jitter and the [`probe_backoff`](Self::probe_backoff)
/// are not read from a file (they keep their defaults) and not written to one.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(from = "RelayFile", into = "RelayFile")]
pub struct RelayConfig {
    /// The relay's name: its membership row and the owner of its buckets. Default
    /// `relay-<pid>-<random>`. A stable name lets a restarted relay find its own expired
    /// buckets (still counted as a takeover: the previous run may have died mid-publish).
    pub name: String,
    /// Rows per read (one batch), 1 to 10,000. Default 500.
    pub batch_size: u32,
    /// Bucket lease, at least 3 × `publish_timeout`: how long a relay keeps its buckets without
    /// renewing them (renewed every `lease / 3`), and so how long the buckets of a relay that
    /// died wait before another relay takes them over. Default 30 s.
    pub lease: Duration,
    /// Longest time one batch may spend publishing. Default 10 s.
    pub publish_timeout: Duration,
    /// Longest idle sleep between claims (safety net behind the wake-ups). Default 1 s.
    pub poll_interval: Duration,
    /// Publish attempts before a message is dead-lettered, unless the message overrides it.
    /// Default 16.
    pub max_attempts: u32,
    /// Backoff between attempts of one message. Default [`Backoff::default`] (1 s, ×2, ≤ 5 min).
    pub backoff: Backoff,
    /// Backoff between probes of an unavailable transport and between retries of failed
    /// database calls. Default 200 ms, ×2, ≤ 10 s. During one outage the probe delay keeps
    /// growing across relapses (a probe that succeeds while the next publish fails again in the
    /// same way, as with a refused permission): only a publish the broker accepts ends the outage.
    pub probe_backoff: Backoff,
    /// How long a destination may be missing (a RabbitMQ exchange, a Kafka topic, a JetStream
    /// stream, a webhook answering 404: [`TransportError::is_missing_destination`]) before its
    /// messages are dead-lettered. Until then the transport is paused and probed and no attempt
    /// is counted (a missing destination is usually a deployment step not taken yet). Counted
    /// from the first publish that found it missing, per transport and destination; a publish
    /// the broker accepts for it resets it. Default 5 min; zero dead-letters at once.
    pub missing_destination_grace: Duration,
    /// How often maintenance runs (check-back of unconfirmed messages, retention). Default 5 s.
    /// Called `reap_interval` before 0.2 (the TOML configuration still accepts that name).
    pub maintenance_interval: Duration,
    /// Batches published concurrently (each of different buckets). Default 2.
    pub in_flight_batches: usize,
    /// How long shutdown waits for batches in flight. Default 15 s.
    pub shutdown_timeout: Duration,
    /// Check-backs of an unconfirmed message before it goes to FAILED as `unconfirmed`.
    /// Default 3.
    pub max_check_backs: u32,
    /// How long finished rows are kept, per state, and whether they are then deleted or moved
    /// to `<table>_archive` ([`crate::retention`]). Applied in bounded batches by one relay at a
    /// time (the holder of bucket 0). Default [`Retention::default`]: SENT (awaiting no
    /// confirmation), CONFIRMED and REJECTED rows deleted after 7 days; dead letters and the
    /// archive kept.
    pub retention: Retention,
    /// How PREPARED two-phase messages are checked back ([`crate::two_phase`]); the
    /// `[relay.check_back]` table of a file. Default [`CheckBackPolicy::default`].
    pub check_back: CheckBackPolicy,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: format!("relay-{}-{:04x}", std::process::id(), rand::random::<u16>()),
            batch_size: 500,
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            max_attempts: 16,
            backoff: Backoff::default(),
            probe_backoff: Backoff {
                base: Duration::from_millis(200),
                factor: 2.0,
                max: Duration::from_secs(10),
                jitter: 0.2,
            },
            missing_destination_grace: Duration::from_secs(300),
            maintenance_interval: Duration::from_secs(5),
            in_flight_batches: 2,
            shutdown_timeout: Duration::from_secs(15),
            max_check_backs: 3,
            retention: Retention::default(),
            check_back: CheckBackPolicy::default(),
        }
    }
}

/// The file form of [`RelayConfig`]: every key optional, the backoff flat.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct RelayFile {
    name: Option<String>,
    batch_size: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    publish_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    max_attempts: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    backoff_base: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    backoff_max: Option<Duration>,
    #[serde(default, with = "humantime_serde", alias = "reap_interval")]
    maintenance_interval: Option<Duration>,
    in_flight_batches: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    shutdown_timeout: Option<Duration>,
    max_check_backs: Option<u32>,
    retention: Option<Retention>,
    #[serde(default, with = "humantime_serde")]
    missing_destination_grace: Option<Duration>,
    check_back: Option<CheckBackPolicy>,
}

impl From<RelayFile> for RelayConfig {
    fn from(f: RelayFile) -> Self {
        let mut c = RelayConfig::default();
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = f.$f { c.$f = v; } )* };
        }
        set!(
            name,
            batch_size,
            lease,
            publish_timeout,
            poll_interval,
            max_attempts,
            maintenance_interval,
            in_flight_batches,
            shutdown_timeout,
            max_check_backs,
            retention,
            missing_destination_grace,
            check_back
        );
        c.backoff.base = f.backoff_base.unwrap_or(c.backoff.base);
        c.backoff.max = f.backoff_max.unwrap_or(c.backoff.max);
        c
    }
}

impl From<RelayConfig> for RelayFile {
    fn from(c: RelayConfig) -> Self {
        RelayFile {
            name: Some(c.name),
            batch_size: Some(c.batch_size),
            lease: Some(c.lease),
            publish_timeout: Some(c.publish_timeout),
            poll_interval: Some(c.poll_interval),
            max_attempts: Some(c.max_attempts),
            backoff_base: Some(c.backoff.base),
            backoff_max: Some(c.backoff.max),
            maintenance_interval: Some(c.maintenance_interval),
            in_flight_batches: Some(c.in_flight_batches),
            shutdown_timeout: Some(c.shutdown_timeout),
            max_check_backs: Some(c.max_check_backs),
            retention: Some(c.retention),
            missing_destination_grace: Some(c.missing_destination_grace),
            check_back: Some(c.check_back),
        }
    }
}

impl RelayConfig {
    /// Check every field; the error names the first bad one as `relay.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field and the rule it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |n: &str, r: &str| Err(ConfigError::new(format!("relay.{n}"), r));
        if self.name.is_empty() {
            return f("name", "must not be empty");
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return f("batch_size", "must be 1 to 10000");
        }
        if self.publish_timeout.is_zero() {
            return f("publish_timeout", "must be greater than zero");
        }
        // Checked: a publish timeout of centuries (the config fuzz target wrote one) must be
        // an error, not an overflow panic.
        if self
            .publish_timeout
            .checked_mul(3)
            .is_none_or(|least| self.lease < least)
        {
            return f(
                "lease",
                "must be at least 3 x publish_timeout so a slow publish does not lose its lease",
            );
        }
        if self.poll_interval.is_zero() {
            return f("poll_interval", "must be greater than zero");
        }
        if self.max_attempts == 0 {
            return f("max_attempts", "must be at least 1");
        }
        if self.backoff.base.is_zero() {
            return f("backoff_base", "must be greater than zero");
        }
        if self.backoff.max < self.backoff.base {
            return f("backoff_max", "must not be less than relay.backoff_base");
        }
        if let Some(state) = self.retention.zero_field() {
            return f(
                &format!("retention.{state}"),
                "must be greater than zero, or \"forever\"",
            );
        }
        if self.backoff.factor < 1.0 || !(0.0..=1.0).contains(&self.backoff.jitter) {
            return f("backoff", "factor must be >= 1 and jitter within 0..=1");
        }
        if self.maintenance_interval.is_zero() {
            return f("maintenance_interval", "must be greater than zero");
        }
        if self.in_flight_batches == 0 {
            return f("in_flight_batches", "must be at least 1");
        }
        self.check_back.validate()
    }
}

#[cfg(test)]
mod file_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn relay_config_reads_the_file_form_and_writes_it_back() {
        let c: RelayConfig = serde_json::from_value(json!({
            "name": "r1", "batch_size": 100, "lease": "45s", "reap_interval": "2s",
            "backoff_base": "500ms", "backoff_max": "1m", "retention": "forever"
        }))
        .unwrap();
        assert_eq!(c.name, "r1");
        assert_eq!(c.batch_size, 100);
        assert_eq!(c.lease, Duration::from_secs(45));
        assert_eq!(c.maintenance_interval, Duration::from_secs(2));
        assert_eq!(c.backoff.base, Duration::from_millis(500));
        assert_eq!(c.backoff.max, Duration::from_secs(60));
        assert_eq!(c.retention, Retention::keep_all());
        assert_eq!(c.publish_timeout, RelayConfig::default().publish_timeout);
        let again: RelayConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(format!("{c:?}"), format!("{again:?}"));
        let e = serde_json::from_value::<RelayConfig>(json!({"retention": "soon"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("forever"), "{e}");
        let e = serde_json::from_value::<RelayConfig>(json!({"batch_sise": 1}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_sise"), "{e}");
    }

    /// The input the `config` fuzz target found (CI, this stop): a publish timeout so long that
    /// three of it overflow a `Duration`. Validation names the lease; it used to panic.
    #[test]
    fn a_huge_publish_timeout_is_an_error_not_a_panic() {
        let c: RelayConfig = serde_json::from_value(json!({
            "lease": "30s",
            "publish_timeout": "10248191152060861940s"
        }))
        .unwrap();
        let e = c.validate().unwrap_err();
        assert_eq!(e.field, "relay.lease", "{e}");
    }

    #[test]
    fn validate_names_the_backoff_and_retention_fields() {
        let field = |v: serde_json::Value| {
            serde_json::from_value::<RelayConfig>(v)
                .unwrap()
                .validate()
                .unwrap_err()
                .field
        };
        assert_eq!(field(json!({"backoff_base": "0s"})), "relay.backoff_base");
        assert_eq!(
            field(json!({"backoff_base": "2s", "backoff_max": "1s"})),
            "relay.backoff_max"
        );
        assert_eq!(field(json!({"retention": "0s"})), "relay.retention.sent");
        assert_eq!(
            field(json!({"retention": {"archived": "0s"}})),
            "relay.retention.archived"
        );
        assert_eq!(field(json!({"lease": "1s"})), "relay.lease");
    }
}
