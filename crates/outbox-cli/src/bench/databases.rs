//! The `databases` scenario of `outbox bench`: one [`RelayGroup`] (what `outbox relay` runs for
//! `[[databases]]`) drains a backlog of `--messages` in each of 1, 2, 4, … databases at once
//! (`--database` first, then each `--databases`, the whole list last), with the CPU each side
//! spent: the figures behind the fleet arithmetic of docs/scaling.md.
//!
//! CPU is read from `/proc/<pid>/stat` (user + system time, in clock ticks of 1/100 s, Linux's
//! `USER_HZ`) before and after each drain, for this process (the relays) and for the servers on
//! the machine by process name ([`SERVERS`]); a server on another machine is not seen. The
//! figures are shares of a shared machine: a 2-core machine running four PostgreSQL clusters
//! measures how the work divides, not how four machines would scale.

use std::collections::BTreeMap;

use outbox::relay::group::RelayGroup;
use serde::Serialize;

use super::*;

/// Process names whose CPU is counted, as the server they belong to.
const SERVERS: &[(&str, &str)] = &[
    ("postgres", "postgres"),
    ("mariadbd", "mariadb"),
    ("mysqld", "mariadb"),
    ("nats-server", "nats"),
    ("redis-server", "redis"),
    ("beam.smp", "rabbitmq"),
    ("tansu", "kafka"),
];

/// Clock ticks per second of `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// One drain of the `databases` scenario.
#[derive(Debug, Clone, Serialize, Default)]
pub struct DatabasesRun {
    /// Databases drained at once, one group member each.
    pub databases: usize,
    /// Messages moved in all (`--messages` per database).
    pub messages: u64,
    /// Wall time from the start to the last database's last message, seconds.
    pub seconds: f64,
    /// `messages / seconds`.
    pub rate: f64,
    /// Each database's own rate: its messages over the time its last one was sent (msg/s).
    pub per_database: Vec<f64>,
    /// `rate` over the one-database run's.
    pub vs_one_database: Option<f64>,
    /// CPU seconds spent during the drain: `relays` (this process), and each server on this
    /// machine by name (`postgres`, `mariadb`, `nats`, `redis`, `rabbitmq`) when it runs here.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// Messages per CPU second of each side that used a tenth of a core or more during the
    /// drain (`messages / cpu_seconds`): the fleet arithmetic's inputs (docs/scaling.md).
    pub messages_per_cpu_second: BTreeMap<String, f64>,
    /// Load at the end.
    pub load: Option<[f64; 3]>,
}

/// The name of this process's side in [`cpu_now`].
pub(super) const PROCESS: &str = "process";

/// CPU seconds so far of this process ([`PROCESS`]) and of the servers on this machine.
pub(super) fn cpu_now() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let own = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((comm, ticks)) = parse_stat(&stat) else {
            continue;
        };
        let side = if pid == own {
            PROCESS
        } else if let Some((_, side)) = SERVERS.iter().find(|(name, _)| *name == comm) {
            side
        } else {
            continue;
        };
        *out.entry(side.to_owned()).or_insert(0.0) += ticks as f64 / TICKS_PER_SECOND;
    }
    out
}

/// The command name and user + system ticks of a `/proc/<pid>/stat` line, the process's own and
/// those of its children it has reaped (`"1234 (postgres) S 1 … utime stime cutime cstime …"`;
/// the name may hold spaces and parentheses, so the fields are counted after the last `)`:
/// utime, stime, cutime and cstime are the 12th to 15th). The children's part keeps a server's
/// CPU whole when its workers exit during a measurement: a PostgreSQL backend that exits takes
/// its ticks out of its own line and the postmaster, which reaps it, adds them to its `cutime`
/// (without it a drain during which other connections closed could count less than nothing).
fn parse_stat(stat: &str) -> Option<(&str, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let cutime: u64 = fields.get(13)?.parse().ok()?;
    let cstime: u64 = fields.get(14)?.parse().ok()?;
    Some((comm, utime + stime + cutime + cstime))
}

/// The database counts of the scenario: 1, 2, 4, … below `total`, then `total`.
fn counts(total: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut k = 1;
    while k < total {
        out.push(k);
        k *= 2;
    }
    out.push(total);
    out
}

impl Bench {
    /// The `databases` scenario (see the module docs).
    pub(super) async fn databases_run(&mut self) -> anyhow::Result<()> {
        let all: Vec<Arc<Db>> = std::iter::once(self.db.clone())
            .chain(self.extra.iter().cloned())
            .collect();
        for k in counts(all.len()) {
            let run = self.databases_drain(&all[..k]).await?;
            self.report.databases.push(run);
        }
        let one = self.report.databases.first().map(|r| r.rate);
        for r in &mut self.report.databases {
            r.vs_one_database = report::ratio(Some(r.rate), one);
        }
        Ok(())
    }

    /// One group drains a fresh backlog of `--messages` in each of `dbs`.
    async fn databases_drain(&self, dbs: &[Arc<Db>]) -> anyhow::Result<DatabasesRun> {
        let n = self.args.messages;
        let k = dbs.len();
        let total = n * k as u64;
        let mut tables = Vec::new();
        for db in dbs {
            let table = db.table(&format!("dbs{k}"));
            self.backlog_in(db, &table).await?;
            db.settle(&table).await?;
            tables.push(table);
        }
        self.broker.reset().await?;
        let group = RelayGroup::new();
        let mut pools = Vec::new();
        let mut metrics = Vec::new();
        let mut relays = Vec::new();
        for (i, (db, table)) in dbs.iter().zip(&tables).enumerate() {
            let pool = db.pool(&format!("db{i}"), true, 10).await?;
            let store = Outbox::open(&pool.pool, table)?.store();
            let relay = Relay::builder(store)
                .router(self.router(self.broker.transport()))
                .config(self.relay_config(format!("bench-{}-db{i}", self.run_id)))
                .build()?;
            metrics.push(relay.metrics().clone());
            relays.push(relay);
            pools.push(pool);
        }
        let start = Instant::now();
        // Built up front, added together once the clock runs (a member starts at once): the
        // opener hands the same relay to the group, which runs and supervises it as it does a
        // daemon's member.
        for (i, relay) in relays.into_iter().enumerate() {
            group.add(
                format!("db{i}"),
                Arc::new(move || {
                    let relay = relay.clone();
                    Box::pin(async move { Ok(relay) })
                }),
            )?;
        }
        let finished_at: Arc<std::sync::Mutex<Vec<Option<f64>>>> =
            Arc::new(std::sync::Mutex::new(vec![None; k]));
        let count = |m: &Arc<RelayMetrics>| {
            let s = m.snapshot();
            s.sent + s.failed
        };
        let work = {
            let (metrics, finished_at, group) =
                (metrics.clone(), finished_at.clone(), group.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(TICK);
                let (mut last, mut since) = (0, Instant::now());
                loop {
                    tick.tick().await;
                    let mut sum = 0;
                    {
                        let mut at = finished_at.lock().expect("finish times");
                        for (i, m) in metrics.iter().enumerate() {
                            let c = count(m);
                            sum += c;
                            if c >= n && at[i].is_none() {
                                at[i] = Some(start.elapsed().as_secs_f64());
                            }
                        }
                    }
                    if sum >= total {
                        break;
                    }
                    if sum > last {
                        (last, since) = (sum, Instant::now());
                    } else if since.elapsed() > STALL {
                        group.shutdown().await;
                        bail!(
                            "the drain made no progress for {STALL:?} at {sum} of {total} messages"
                        );
                    }
                }
                Ok(())
            })
        };
        let bar = self.bar(total, &format!("group drain, {k} database(s)"));
        let w = self
            .watch(&bar, total, None, || metrics.iter().map(count).sum(), work)
            .await;
        group.shutdown().await;
        let w = w?;
        for (db, pool) in dbs.iter().zip(pools) {
            db.retire(pool).await?;
        }
        let stored = self.broker.stored().await?;
        if let Some(s) = stored
            && s < total
        {
            bail!("databases x{k}: the broker holds {s} of the {total} messages published");
        }
        for (db, table) in dbs.iter().zip(&tables) {
            self.verify_in(db, &format!("databases x{k}"), table)
                .await?;
            db.drop_outbox(table).await?;
        }
        // This process is the relays here.
        let cpu_seconds: BTreeMap<String, f64> = w
            .cpu_seconds
            .iter()
            .map(|(side, s)| {
                let side = if side == PROCESS { "relays" } else { side };
                (side.to_owned(), *s)
            })
            .collect();
        let messages_per_cpu_second = w
            .working_sides()
            .map(|(side, s)| {
                let side = if side == PROCESS { "relays" } else { side };
                (side.to_owned(), total as f64 / s)
            })
            .collect();
        let per_database = finished_at
            .lock()
            .expect("finish times")
            .iter()
            .map(|t| n as f64 / t.unwrap_or(w.seconds).max(1e-9))
            .collect();
        Ok(DatabasesRun {
            databases: k,
            messages: total,
            seconds: w.seconds,
            rate: total as f64 / w.seconds.max(1e-9),
            per_database,
            vs_one_database: None,
            cpu_seconds,
            messages_per_cpu_second,
            load: loadavg(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_past_odd_names() {
        let line = "4242 (postgres) S 1 4242 4242 0 -1 4194560 300 0 0 0 150 25 0 0 20 0 1 0 100 \
                    1000 10 18446744073709551615";
        assert_eq!(parse_stat(line), Some(("postgres", 175)));
        // A name with a space and a parenthesis: fields are counted after the last `)`.
        let odd = "7 (a b) c) R 1 7 7 0 -1 0 0 0 0 0 3 4 0 0 20 0 1 0 1 1 1 1";
        assert_eq!(parse_stat(odd), Some(("a b) c", 7)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
        // The reaped children's ticks count: a postmaster whose backends exited.
        let postmaster = "99 (postgres) S 1 99 99 0 -1 4194560 300 0 0 0 10 5 700 40 20 0 1 0 1 \
                          1000 10 18446744073709551615";
        assert_eq!(parse_stat(postmaster), Some(("postgres", 755)));
    }

    #[test]
    fn database_counts_double_then_end_at_the_total() {
        assert_eq!(counts(1), vec![1]);
        assert_eq!(counts(2), vec![1, 2]);
        assert_eq!(counts(3), vec![1, 2, 3]);
        assert_eq!(counts(4), vec![1, 2, 4]);
        assert_eq!(counts(6), vec![1, 2, 4, 6]);
    }

    #[test]
    fn this_process_cpu_is_seen() {
        let cpu = cpu_now();
        assert!(cpu.contains_key(PROCESS), "{cpu:?}");
    }
}
