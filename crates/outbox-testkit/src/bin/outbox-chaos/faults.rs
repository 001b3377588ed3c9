//! The fault schedule: seeded, so a failing seed replays the same faults at the same offsets.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_testkit::FaultProxy;
use tokio::sync::Mutex;

use crate::broker::BrokerProcess;
use crate::relays::RelaySlot;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One fault, at an offset from the start of the run.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// SIGKILL relay `slot`; restart it after `down`.
    Kill { slot: usize, down: Duration },
    /// SIGSTOP relay `slot` for `pause` (past its lease), then SIGCONT.
    Pause { slot: usize, pause: Duration },
    /// Cut every connection of the relays over `link` and refuse new ones for `cut` (for the
    /// broker, what the relays see of a broker restart).
    Cut { link: Link, cut: Duration },
    /// Delay every chunk to and from the other end of `link` by `delay` for `during`.
    Slow {
        link: Link,
        delay: Duration,
        during: Duration,
    },
    /// Make the `n`-th open database connection of the relays half-open (nothing passes, nothing
    /// is closed), for good.
    HalfOpenDatabase { n: usize },
    /// Drop the broker's answers (publishes arrive, acks are lost) for `during`, then cut.
    DropBrokerReplies { during: Duration },
    /// Stop the broker itself (`--restart-broker`) and start it again after `down`.
    RestartBroker { down: Duration },
}

/// Which of the relays' connections a fault acts on (each runs through its own [`FaultProxy`]).
#[derive(Debug, Clone, Copy)]
pub enum Link {
    /// To the database.
    Database,
    /// To the broker.
    Broker,
}

impl Link {
    /// The proxy the link runs through: `db_proxy` or `broker_proxy`.
    fn proxy<'a>(self, db_proxy: &'a FaultProxy, broker_proxy: &'a FaultProxy) -> &'a FaultProxy {
        match self {
            Link::Database => db_proxy,
            Link::Broker => broker_proxy,
        }
    }
}

impl std::fmt::Display for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Link::Database => "database",
            Link::Broker => "broker",
        })
    }
}

/// The faults of a run of `duration` with `relays` relays, `kills` of them SIGKILLs, from
/// `seed`; sorted by offset.
pub fn schedule(
    seed: u64,
    duration: Duration,
    relays: usize,
    kills: usize,
    lease: Duration,
    restart_broker: bool,
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
            Fault::Cut {
                link: Link::Database,
                cut: Duration::from_millis(rng.random_range(500..3000)),
            },
            Fault::Cut {
                link: Link::Broker,
                cut: Duration::from_millis(rng.random_range(500..3000)),
            },
            Fault::Slow {
                link: Link::Database,
                delay: Duration::from_millis(rng.random_range(20..200)),
                during: Duration::from_millis(rng.random_range(1000..4000)),
            },
            Fault::Slow {
                link: Link::Broker,
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
    // Broker restarts last in the generator, so a seed without them keeps its schedule.
    if restart_broker {
        for _ in 0..(duration.as_secs() / 60).max(1) {
            let t = at(&mut rng);
            let down = Duration::from_millis(rng.random_range(500..3000));
            out.push((t, Fault::RestartBroker { down }));
        }
    }
    out.sort_by_key(|(t, _)| *t);
    out
}

/// Run the fault schedule; each fault's end (restart, SIGCONT, unblock) is scheduled on its own.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn drive_faults(
    schedule: &[(Duration, Fault)],
    started: Instant,
    slots: Arc<Mutex<Vec<RelaySlot>>>,
    db_proxy: &FaultProxy,
    broker_proxy: &FaultProxy,
    outbox_bin: &std::path::Path,
    broker: Option<&BrokerProcess>,
    log: Arc<Mutex<Vec<String>>>,
    done: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let mut ends: Vec<(Instant, Fault)> = Vec::new();
    for (at, fault) in schedule {
        if let Some(wait) = at.checked_sub(started.elapsed()) {
            // Finish what ends before this fault starts.
            let until = Instant::now() + wait;
            loop {
                ends.sort_by_key(|(t, _)| *t);
                match ends.first() {
                    Some((t, _)) if *t <= until => {
                        let (t, f) = ends.remove(0);
                        tokio::time::sleep_until(t.into()).await;
                        end(f, &slots, db_proxy, broker_proxy, outbox_bin, broker).await?;
                    }
                    _ => break,
                }
            }
            tokio::time::sleep_until(until.into()).await;
        }
        let now = Instant::now();
        let what = match *fault {
            Fault::Kill { slot, down } => {
                slots.lock().await[slot].kill().await;
                ends.push((now + down, *fault));
                format!(
                    "SIGKILL relay {slot}, restart after {} ms",
                    down.as_millis()
                )
            }
            Fault::Pause { slot, pause } => {
                slots.lock().await[slot].signal_pause(true);
                ends.push((now + pause, *fault));
                format!("SIGSTOP relay {slot} for {} ms", pause.as_millis())
            }
            Fault::Cut { link, cut } => {
                link.proxy(db_proxy, broker_proxy).set_blocked(true);
                ends.push((now + cut, *fault));
                format!("{link} cut for {} ms", cut.as_millis())
            }
            Fault::Slow {
                link,
                delay,
                during,
            } => {
                link.proxy(db_proxy, broker_proxy).set_delay(delay);
                ends.push((now + during, *fault));
                format!(
                    "{link} +{} ms per chunk for {} ms",
                    delay.as_millis(),
                    during.as_millis()
                )
            }
            Fault::HalfOpenDatabase { n } => match db_proxy.stall_nth(n) {
                Some(port) => format!("database connection from port {port} half-open"),
                None => "database half-open: no connection open".to_owned(),
            },
            Fault::RestartBroker { down } => match broker {
                Some(b) => {
                    b.stop().await?;
                    ends.push((Instant::now() + down, *fault));
                    format!(
                        "broker stopped (the server itself), started again after {} ms",
                        down.as_millis()
                    )
                }
                None => "broker restart skipped (no --restart-broker)".to_owned(),
            },
            Fault::DropBrokerReplies { during } => {
                broker_proxy.set_replies_dropped(true);
                ends.push((now + during, *fault));
                format!(
                    "broker acks dropped for {} ms, then cut",
                    during.as_millis()
                )
            }
        };
        log.lock()
            .await
            .push(format!("{:>7.2} s  {what}", at.as_secs_f64()));
        done.fetch_add(1, Ordering::Relaxed);
    }
    ends.sort_by_key(|(t, _)| *t);
    for (t, f) in ends {
        tokio::time::sleep_until(t.into()).await;
        end(f, &slots, db_proxy, broker_proxy, outbox_bin, broker).await?;
    }
    Ok(())
}

pub(crate) async fn end(
    fault: Fault,
    slots: &Mutex<Vec<RelaySlot>>,
    db_proxy: &FaultProxy,
    broker_proxy: &FaultProxy,
    outbox_bin: &std::path::Path,
    broker: Option<&BrokerProcess>,
) -> anyhow::Result<()> {
    match fault {
        Fault::RestartBroker { .. } => {
            if let Some(b) = broker {
                b.start().await?;
            }
        }
        Fault::Kill { slot, .. } => {
            let mut slots = slots.lock().await;
            if !slots[slot].running() {
                slots[slot].start(outbox_bin)?;
            }
        }
        Fault::Pause { slot, .. } => slots.lock().await[slot].signal_pause(false),
        Fault::Cut { link, .. } => link.proxy(db_proxy, broker_proxy).set_blocked(false),
        Fault::Slow { link, .. } => link.proxy(db_proxy, broker_proxy).set_delay(Duration::ZERO),
        Fault::HalfOpenDatabase { .. } => {}
        Fault::DropBrokerReplies { .. } => {
            broker_proxy.set_replies_dropped(false);
            broker_proxy.set_blocked(true);
            broker_proxy.set_blocked(false);
        }
    }
    Ok(())
}
