//! The steps proptest generates.

use std::time::Duration;

use outbox::store::Outcome;
use proptest::collection::vec;
use proptest::prelude::*;

use super::{HOUR, KEYS};

/// A completion's outcome, as generated (shrinks towards `Sent`).
#[derive(Debug, Clone, Copy)]
pub(super) enum Choice {
    Sent,
    AwaitConfirmation,
    RetryNow,
    RetryLater,
    Failed,
    Release,
}

impl Choice {
    pub(super) fn outcome(self) -> Outcome {
        match self {
            Choice::Sent => Outcome::Sent,
            Choice::AwaitConfirmation => Outcome::SentAwaitingConfirmation { within: HOUR },
            Choice::RetryNow => Outcome::Retry {
                delay: Duration::ZERO,
                error: "boom".into(),
            },
            Choice::RetryLater => Outcome::Retry {
                delay: HOUR,
                error: "boom".into(),
            },
            Choice::Failed => Outcome::Failed {
                reason: "poison".into(),
            },
            Choice::Release => Outcome::Release {
                delay: Duration::ZERO,
            },
        }
    }
}

/// One step. Indexes (`batch`, row picks) are taken modulo what exists when the step runs, so
/// every sequence is valid and shrinking keeps it so.
#[derive(Debug, Clone)]
pub(super) enum Op {
    /// A producer's transaction of 1 to 4 messages (key index or none), committed or not.
    Enqueue {
        keys: Vec<Option<usize>>,
        commit: bool,
    },
    /// A membership round, then the give-back of what is above the fair share.
    Membership {
        relay: usize,
    },
    /// A read of the relay's held buckets not in flight, up to `limit`, keys held back.
    Read {
        relay: usize,
        limit: u32,
        held_back: Vec<usize>,
    },
    /// A completion of one of the relay's read batches; outcome `i` is `outcomes[i % len]`.
    Complete {
        relay: usize,
        batch: usize,
        outcomes: Vec<Choice>,
    },
    /// Give back the held buckets not in flight whose bit is set in `mask`.
    GiveBack {
        relay: usize,
        mask: u64,
    },
    /// The relay stalls past its lease (keeps believing it holds its buckets).
    Stall {
        relay: usize,
    },
    /// The relay crashes (its batches are lost) and restarts holding nothing.
    Crash {
        relay: usize,
    },
    /// Two hours pass for the rows: delays and confirmation deadlines run out.
    Advance,
    CheckBack,
    /// Confirmations of rows picked by index (processed or rejected), plus an unknown id.
    Confirm {
        picks: Vec<(usize, bool)>,
    },
    KeyHeads,
    /// Purge rows finished more than an hour ago.
    Purge,
    /// Requeue every dead letter, or those of the rows picked by index.
    Requeue {
        picks: Option<Vec<usize>>,
    },
}

pub(super) fn choice() -> impl Strategy<Value = Choice> {
    prop_oneof![
        Just(Choice::Sent),
        Just(Choice::AwaitConfirmation),
        Just(Choice::RetryNow),
        Just(Choice::RetryLater),
        Just(Choice::Failed),
        Just(Choice::Release),
    ]
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    let relay = 0..2usize;
    prop_oneof![
        5 => (vec(proptest::option::of(0..KEYS.len()), 1..=4), proptest::bool::weighted(0.7))
            .prop_map(|(keys, commit)| Op::Enqueue { keys, commit }),
        4 => relay.clone().prop_map(|relay| Op::Membership { relay }),
        5 => (relay.clone(), 1..=6u32, vec(0..KEYS.len(), 0..=1))
            .prop_map(|(relay, limit, held_back)| Op::Read { relay, limit, held_back }),
        5 => (relay.clone(), any::<usize>(), vec(choice(), 1..=4))
            .prop_map(|(relay, batch, outcomes)| Op::Complete { relay, batch, outcomes }),
        1 => (relay.clone(), any::<u64>()).prop_map(|(relay, mask)| Op::GiveBack { relay, mask }),
        1 => relay.clone().prop_map(|relay| Op::Stall { relay }),
        1 => relay.prop_map(|relay| Op::Crash { relay }),
        1 => Just(Op::Advance),
        1 => Just(Op::CheckBack),
        2 => vec((any::<usize>(), proptest::bool::weighted(0.7)), 0..=3)
            .prop_map(|picks| Op::Confirm { picks }),
        1 => Just(Op::KeyHeads),
        1 => Just(Op::Purge),
        1 => proptest::option::of(vec(any::<usize>(), 1..=3))
            .prop_map(|picks| Op::Requeue { picks }),
    ]
}
