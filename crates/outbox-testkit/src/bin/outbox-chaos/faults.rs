//! The fault schedule: seeded, so a failing seed replays the same faults at the same offsets.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One fault, at an offset from the start of the run.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// SIGKILL relay `slot`; restart it after `down`.
    Kill { slot: usize, down: Duration },
    /// SIGSTOP relay `slot` for `pause` (past its lease), then SIGCONT.
    Pause { slot: usize, pause: Duration },
    /// Cut every database connection of the relays and refuse new ones for `cut`.
    CutDatabase { cut: Duration },
    /// The same for the broker (what the relays see of a broker restart).
    CutBroker { cut: Duration },
    /// Delay every chunk to and from the database by `delay` for `during`.
    SlowDatabase { delay: Duration, during: Duration },
    /// Delay every chunk to and from the broker by `delay` for `during`.
    SlowBroker { delay: Duration, during: Duration },
    /// Make the `n`-th open database connection of the relays half-open (nothing passes, nothing
    /// is closed), for good.
    HalfOpenDatabase { n: usize },
    /// Drop the broker's answers (publishes arrive, acks are lost) for `during`, then cut.
    DropBrokerReplies { during: Duration },
}

/// The faults of a run of `duration` with `relays` relays, `kills` of them SIGKILLs, from
/// `seed`; sorted by offset.
pub fn schedule(
    seed: u64,
    duration: Duration,
    relays: usize,
    kills: usize,
    lease: Duration,
) -> Vec<(Duration, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let span = duration.as_millis() as u64;
    let at = |rng: &mut StdRng| Duration::from_millis(rng.random_range(span / 20..span.max(2)));
    let mut out = Vec::new();
    for i in 0..kills {
        // Spread evenly, with jitter within each slot of the run.
        let slot_len = span / kills.max(1) as u64;
        let offset = slot_len * i as u64 + rng.random_range(0..slot_len.max(1));
        out.push((
            Duration::from_millis(offset),
            Fault::Kill {
                slot: rng.random_range(0..relays),
                down: Duration::from_millis(rng.random_range(0..1500)),
            },
        ));
    }
    // Every other kind at least once, and once per 30 s of run.
    let each = (duration.as_secs() / 30).max(1);
    for _ in 0..each {
        let f = [
            Fault::Pause {
                slot: rng.random_range(0..relays),
                pause: lease * 2 + Duration::from_millis(rng.random_range(0..1000)),
            },
            Fault::CutDatabase {
                cut: Duration::from_millis(rng.random_range(500..3000)),
            },
            Fault::CutBroker {
                cut: Duration::from_millis(rng.random_range(500..3000)),
            },
            Fault::SlowDatabase {
                delay: Duration::from_millis(rng.random_range(20..200)),
                during: Duration::from_millis(rng.random_range(1000..4000)),
            },
            Fault::SlowBroker {
                delay: Duration::from_millis(rng.random_range(20..200)),
                during: Duration::from_millis(rng.random_range(1000..4000)),
            },
            Fault::HalfOpenDatabase {
                n: rng.random_range(0..64),
            },
            Fault::DropBrokerReplies {
                during: Duration::from_millis(rng.random_range(300..2000)),
            },
        ];
        for f in f {
            let t = at(&mut rng);
            out.push((t, f));
        }
    }
    out.sort_by_key(|(t, _)| *t);
    out
}
