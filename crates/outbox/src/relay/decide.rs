//! The relay's decisions as pure functions of what it knows: what a publish result makes of a
//! message, where an ordered key stands, and whether it goes on after a generation. The batch
//! code ([`super::batch`]) gathers the inputs and applies the answers; the unit tests below
//! check each rule on its own.

use std::time::Duration;

use crate::error::{TransportError, TransportErrorKind};
use crate::store::{KeyHead, Outcome};
use crate::transport::DeadLetterPolicy;

use super::RelayConfig;

/// What a publish result says about the transport, besides the message's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Signal {
    /// The broker accepted the message: the transport works (an outage, if any, is over).
    Accepted,
    /// The transport is unavailable, with the reason: pause it and probe.
    Unavailable(String),
    /// The destination refuses messages for now, with the reason: back it off alone
    /// ([`TransportError::destination_busy`]).
    Busy(String),
    /// Nothing about the transport (a message's own failure).
    Nothing,
}

/// The message a publish result is about, for [`after_publish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Attempt {
    /// This attempt, counted from 1 (it included).
    pub(super) number: u32,
    /// The message's `max_attempts`.
    pub(super) max: u32,
    /// How long the message's route waits for a confirmation; `None` when the route asks for
    /// none.
    pub(super) confirm: Option<Duration>,
}

/// The outcome of one published message.
///
/// - `Ok` → SENT, or SENT awaiting confirmation within `attempt.confirm` on a route with
///   confirmations;
/// - `Unavailable` → released without counting the attempt (due again in 500 ms) and the
///   transport paused; a missing destination past `missing_destination_grace`
///   (`missing_too_long`, asked only for a missing destination) → FAILED naming the grace;
///   a busy destination (`TransportError::destination_busy`) → released without counting the
///   attempt, due again after `busy_delay` (the destination's backoff, asked only for a busy
///   destination), the transport not paused;
/// - `Permanent` → FAILED with the error;
/// - `Retryable` → PENDING again after `cfg.backoff.delay(attempt.number)`, or FAILED ("attempts
///   exhausted") when `attempt.number >= attempt.max`.
pub(super) fn after_publish(
    result: Result<(), TransportError>,
    attempt: Attempt,
    missing_too_long: impl FnOnce() -> bool,
    busy_delay: impl FnOnce() -> Duration,
    cfg: &RelayConfig,
) -> (Outcome, Signal) {
    let e = match result {
        Ok(()) => {
            let outcome = match attempt.confirm {
                Some(within) => Outcome::SentAwaitingConfirmation { within },
                None => Outcome::Sent,
            };
            return (outcome, Signal::Accepted);
        }
        Err(e) => e,
    };
    let outcome = match e.kind() {
        TransportErrorKind::Unavailable if e.is_missing_destination() && missing_too_long() => {
            Outcome::Failed {
                reason: format!(
                    "destination missing for longer than missing_destination_grace ({:?}): {}",
                    cfg.missing_destination_grace,
                    e.report()
                ),
            }
        }
        TransportErrorKind::Unavailable if e.is_destination_busy() => {
            return (
                Outcome::Release {
                    delay: busy_delay(),
                },
                Signal::Busy(e.report()),
            );
        }
        TransportErrorKind::Unavailable => {
            return (
                Outcome::Release {
                    delay: Duration::from_millis(500),
                },
                Signal::Unavailable(e.report()),
            );
        }
        TransportErrorKind::Permanent => Outcome::Failed { reason: e.report() },
        TransportErrorKind::Retryable if attempt.number >= attempt.max => Outcome::Failed {
            reason: format!("attempts exhausted ({}): {}", attempt.number, e.report()),
        },
        TransportErrorKind::Retryable => Outcome::Retry {
            delay: cfg.backoff.delay(attempt.number),
            error: e.report(),
        },
    };
    (outcome, Signal::Nothing)
}

/// Where an ordered key stands before its first message in a batch (id `first_id`) is
/// published, from the key's head in the table ([`crate::Store::key_heads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyStart {
    /// An earlier message of the key is still open, or dead-lettered under
    /// [`DeadLetterPolicy::Block`] (`behind_dead`): the key's rows wait.
    HeldBack { behind_dead: bool },
    /// The first message is the key's head: publish, `past_dead` when it goes past a
    /// dead-lettered earlier message ([`DeadLetterPolicy::Skip`]).
    Go { past_dead: bool },
}

/// The [`KeyStart`] of a key whose first message in the batch has id `first_id`.
pub(super) fn key_start(
    first_id: i64,
    head: Option<&KeyHead>,
    policy: DeadLetterPolicy,
) -> KeyStart {
    let open_before = head
        .and_then(|h| h.first_open)
        .is_some_and(|open| open < first_id);
    let dead_before = head
        .and_then(|h| h.first_failed)
        .is_some_and(|failed| failed < first_id);
    let behind_dead = policy == DeadLetterPolicy::Block && dead_before;
    if open_before || behind_dead {
        KeyStart::HeldBack { behind_dead }
    } else {
        KeyStart::Go {
            past_dead: dead_before,
        }
    }
}

/// What an ordered key does after one of its messages was published in a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyStep {
    /// The message is done (acknowledged, or dead-lettered under `Skip`): the next one may go.
    Next,
    /// The message will be tried again after `delay`: the key is held back until then.
    HoldBack(Duration),
    /// The key stops in this batch (dead-lettered under `Block`, or no outcome).
    Stop,
}

/// The [`KeyStep`] after a key's message got `outcome`.
pub(super) fn key_step(outcome: Option<&Outcome>, policy: DeadLetterPolicy) -> KeyStep {
    match outcome {
        Some(Outcome::Sent | Outcome::SentAwaitingConfirmation { .. }) => KeyStep::Next,
        Some(Outcome::Failed { .. }) if policy == DeadLetterPolicy::Skip => KeyStep::Next,
        Some(Outcome::Failed { .. }) | None => KeyStep::Stop,
        Some(Outcome::Retry { delay, .. } | Outcome::Release { delay }) => {
            KeyStep::HoldBack(*delay)
        }
    }
}

/// The `attempts` value a row stores with `outcome`: a release gives the attempt back
/// (`stored`, what the row held), every other outcome records `attempt`.
pub(super) fn attempts_to_store(stored: u32, attempt: u32, outcome: &Outcome) -> u32 {
    match outcome {
        Outcome::Release { .. } => stored,
        _ => attempt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::Backoff;

    fn cfg() -> RelayConfig {
        RelayConfig {
            backoff: Backoff {
                base: Duration::from_millis(100),
                factor: 2.0,
                max: Duration::from_secs(10),
                jitter: 0.0,
            },
            missing_destination_grace: Duration::from_secs(300),
            ..RelayConfig::default()
        }
    }

    /// Attempt `number` of `max`, on a route without confirmations.
    fn at(number: u32, max: u32) -> Attempt {
        Attempt {
            number,
            max,
            confirm: None,
        }
    }

    fn never() -> bool {
        panic!("asked about a missing destination for another error")
    }

    fn no_busy() -> Duration {
        panic!("asked for a busy destination's delay for another error")
    }

    #[test]
    fn a_busy_destination_releases_without_pausing_the_transport() {
        let c = cfg();
        // Even at the last attempt: a busy destination never dead-letters and spends nothing.
        let (o, s) = after_publish(
            Err(TransportError::destination_busy("nacked")),
            at(5, 5),
            never,
            || Duration::from_millis(800),
            &c,
        );
        assert_eq!(
            o,
            Outcome::Release {
                delay: Duration::from_millis(800)
            }
        );
        assert!(matches!(s, Signal::Busy(r) if r.contains("nacked")));
        assert_eq!(attempts_to_store(4, 5, &o), 4);
    }

    #[test]
    fn acknowledged_is_sent_or_awaits_its_confirmation() {
        let c = cfg();
        assert_eq!(
            after_publish(Ok(()), at(1, 5), never, no_busy, &c),
            (Outcome::Sent, Signal::Accepted)
        );
        let within = Duration::from_secs(30);
        assert_eq!(
            after_publish(
                Ok(()),
                Attempt {
                    confirm: Some(within),
                    ..at(3, 5)
                },
                never,
                no_busy,
                &c
            ),
            (
                Outcome::SentAwaitingConfirmation { within },
                Signal::Accepted
            )
        );
    }

    #[test]
    fn unavailable_releases_and_pauses_the_transport() {
        let c = cfg();
        let (o, s) = after_publish(
            Err(TransportError::unavailable("broker down")),
            at(5, 5),
            never,
            no_busy,
            &c,
        );
        // Even at the last attempt: an outage never dead-letters.
        assert_eq!(
            o,
            Outcome::Release {
                delay: Duration::from_millis(500)
            }
        );
        assert!(matches!(s, Signal::Unavailable(r) if r.contains("broker down")));
    }

    #[test]
    fn a_missing_destination_fails_only_past_the_grace() {
        let c = cfg();
        let missing = || Err(TransportError::missing_destination("no stream"));
        let (o, s) = after_publish(missing(), at(1, 5), || false, no_busy, &c);
        assert!(matches!(o, Outcome::Release { .. }), "{o:?}");
        assert!(matches!(s, Signal::Unavailable(_)));
        let (o, s) = after_publish(missing(), at(1, 5), || true, no_busy, &c);
        match o {
            Outcome::Failed { reason } => {
                assert!(
                    reason.contains("missing_destination_grace (300s)"),
                    "{reason}"
                );
                assert!(reason.contains("no stream"), "{reason}");
            }
            o => panic!("{o:?}"),
        }
        assert_eq!(s, Signal::Nothing);
    }

    #[test]
    fn permanent_fails_at_once() {
        let (o, s) = after_publish(
            Err(TransportError::permanent("too large")),
            at(1, 5),
            never,
            no_busy,
            &cfg(),
        );
        assert!(
            matches!(&o, Outcome::Failed { reason } if reason.contains("too large")),
            "{o:?}"
        );
        assert_eq!(s, Signal::Nothing);
    }

    #[test]
    fn retryable_backs_off_by_attempt_until_exhausted() {
        let c = cfg();
        let err = || Err(TransportError::retryable("nack"));
        for (attempt, ms) in [(1, 100), (2, 200), (3, 400)] {
            let (o, s) = after_publish(err(), at(attempt, 5), never, no_busy, &c);
            assert_eq!(s, Signal::Nothing);
            match o {
                Outcome::Retry { delay, error } => {
                    assert_eq!(delay, Duration::from_millis(ms), "attempt {attempt}");
                    assert!(error.contains("nack"));
                }
                o => panic!("attempt {attempt}: {o:?}"),
            }
        }
        let (o, _) = after_publish(err(), at(5, 5), never, no_busy, &c);
        assert!(
            matches!(&o, Outcome::Failed { reason } if reason.starts_with("attempts exhausted (5)")),
            "{o:?}"
        );
    }

    fn head(first_open: Option<i64>, first_failed: Option<i64>) -> KeyHead {
        KeyHead {
            key: "k".into(),
            first_open,
            first_failed,
        }
    }

    #[test]
    fn key_start_waits_behind_an_open_message() {
        use DeadLetterPolicy::{Block, Skip};
        // No head known, or the batch's first message is the first open one: go.
        assert_eq!(
            key_start(10, None, Block),
            KeyStart::Go { past_dead: false }
        );
        let h = head(Some(10), None);
        assert_eq!(
            key_start(10, Some(&h), Block),
            KeyStart::Go { past_dead: false }
        );
        // An earlier message is still open (a retry in backoff): wait, under both policies.
        let h = head(Some(7), None);
        for p in [Block, Skip] {
            assert_eq!(
                key_start(10, Some(&h), p),
                KeyStart::HeldBack { behind_dead: false }
            );
        }
    }

    #[test]
    fn key_start_behind_a_dead_letter_depends_on_the_policy() {
        let h = head(Some(10), Some(4));
        assert_eq!(
            key_start(10, Some(&h), DeadLetterPolicy::Block),
            KeyStart::HeldBack { behind_dead: true }
        );
        assert_eq!(
            key_start(10, Some(&h), DeadLetterPolicy::Skip),
            KeyStart::Go { past_dead: true }
        );
        // A dead letter after the first message does not hold it.
        let h = head(Some(10), Some(12));
        assert_eq!(
            key_start(10, Some(&h), DeadLetterPolicy::Block),
            KeyStart::Go { past_dead: false }
        );
    }

    #[test]
    fn key_step_goes_on_only_after_a_finished_message() {
        use DeadLetterPolicy::{Block, Skip};
        let within = Duration::from_secs(1);
        for p in [Block, Skip] {
            assert_eq!(key_step(Some(&Outcome::Sent), p), KeyStep::Next);
            assert_eq!(
                key_step(Some(&Outcome::SentAwaitingConfirmation { within }), p),
                KeyStep::Next
            );
            let delay = Duration::from_millis(250);
            assert_eq!(
                key_step(
                    Some(&Outcome::Retry {
                        delay,
                        error: "x".into()
                    }),
                    p
                ),
                KeyStep::HoldBack(delay)
            );
            assert_eq!(
                key_step(Some(&Outcome::Release { delay }), p),
                KeyStep::HoldBack(delay)
            );
            assert_eq!(key_step(None, p), KeyStep::Stop);
        }
        let failed = Outcome::Failed { reason: "x".into() };
        assert_eq!(key_step(Some(&failed), Skip), KeyStep::Next);
        assert_eq!(key_step(Some(&failed), Block), KeyStep::Stop);
    }

    #[test]
    fn a_release_gives_the_attempt_back() {
        let release = Outcome::Release {
            delay: Duration::ZERO,
        };
        assert_eq!(attempts_to_store(2, 3, &release), 2);
        assert_eq!(attempts_to_store(2, 3, &Outcome::Sent), 3);
        let failed = Outcome::Failed { reason: "x".into() };
        assert_eq!(attempts_to_store(2, 3, &failed), 3);
    }
}
