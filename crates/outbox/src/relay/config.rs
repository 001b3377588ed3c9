//! [`RelayConfig`]: the relay's settings, their defaults and validation.

use super::*;

/// Relay settings. Every field has a default ([`RelayConfig::default`]); [`RelayConfig::validate`]
/// names the first bad field.
#[derive(Debug, Clone)]
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
    /// How long CONFIRMED and REJECTED rows (and SENT rows that await no confirmation) are kept
    /// before the relay deletes them, in bounded batches. `None` keeps them. Default 7 days.
    pub retention: Option<Duration>,
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
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
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
        if self.lease < self.publish_timeout * 3 {
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
        if self.backoff.factor < 1.0 || !(0.0..=1.0).contains(&self.backoff.jitter) {
            return f("backoff", "factor must be >= 1 and jitter within 0..=1");
        }
        if self.maintenance_interval.is_zero() {
            return f("maintenance_interval", "must be greater than zero");
        }
        if self.in_flight_batches == 0 {
            return f("in_flight_batches", "must be at least 1");
        }
        Ok(())
    }
}
