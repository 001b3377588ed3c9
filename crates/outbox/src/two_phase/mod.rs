//! Two-phase (half) messages with check-back, on the outbox database: for a producer whose
//! business data is **not** in the outbox database (another database, another service, no
//! database at all), after RocketMQ's transactional messages, without a broker that has them
//! and without a server of our own (docs/two-phase.md).
//!
//! 1. [`Store::prepare`](crate::Store::prepare) writes the message as a PREPARED row (its own
//!    short transaction), with a [`CheckBack`]: whom to ask when the producer never decides.
//!    The relay does not publish it.
//! 2. The producer runs its business transaction elsewhere, then calls
//!    [`Store::commit_prepared`](crate::Store::commit_prepared) (PREPARED → PENDING: published
//!    as usual) or [`Store::rollback_prepared`](crate::Store::rollback_prepared) (PREPARED →
//!    ROLLED_BACK, final, never published). Both compare and set on the row: calling again is a
//!    no-op ([`Decided::Already`]); the opposite of a decision already taken loses
//!    ([`DecideError::Lost`]).
//! 3. A PREPARED row still undecided `check_after` (default 6 s) after it was prepared is
//!    checked back by the relay holding its bucket: the [`CheckBack`] answers exactly
//!    [`Answer::Commit`], [`Answer::Rollback`] or [`Answer::Unknown`]. Unknown asks again every
//!    [`CheckBackPolicy::interval`] (30 s); an error (anything else: a garbled answer, a
//!    timeout, a 5xx, an unreachable producer) asks again with exponential backoff and is **not**
//!    counted; past [`CheckBackPolicy::max_checks`] (15) answered checks, or past the message's
//!    deadline, the row is parked as UNDECIDED for an operator (`outbox messages resume`, or a
//!    decision). All times are the database clock's.
//!
//! | value | status | meaning |
//! |---|---|---|
//! | 5 | PREPARED | written by `prepare`, not published, checked back when due |
//! | 7 | ROLLED_BACK | rolled back by the producer or a check-back; final |
//! | 8 | UNDECIDED | check-backs gave no decision; parked, resumable |
//!
//! The [`barrier`] (features `postgres`, `mysql`, `sqlite`) is the check-back to use when the
//! producer's business data is in a database: the business transaction marks the message id,
//! and the check-back answers from the mark, deciding the race with a business transaction still
//! running (or not started yet) in that database.

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod barrier;
#[cfg(feature = "webhook")]
mod http;
mod ops;

pub use crate::two_phase_model::*;
#[cfg(feature = "webhook")]
pub use http::HttpChecker;
pub use ops::TwoPhase;
