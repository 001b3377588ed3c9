//! `outbox-chaos`: the chaos run (issue 13, item 1; docs/reliability.md "Chaos run").
//!
//! Several `outbox relay` processes share one outbox table on PostgreSQL or MySQL/MariaDB and
//! publish to NATS JetStream or RabbitMQ through TCP fault proxies, while producers commit messages over many
//! keys (an ordered and an unordered route), roll some transactions back, hold some open, and
//! insert poison rows; an inbox consumer (the library's runner for the broker) applies every message. A
//! seeded schedule SIGKILLs and restarts relays, pauses one past its lease (SIGSTOP/SIGCONT),
//! cuts, slows and half-opens the database and broker connections and drops the broker's acks.
//! When the faults stop, the run waits for the backlog to drain and checks, from the database
//! and the consumer's effects: every committed message applied (lost 0), each once (applied
//! twice 0), per-key order on the ordered route, nothing of a rolled-back transaction applied,
//! every poison row FAILED with a reason, every relay alive and a member. It prints a report
//! (counts, faults, seed) and exits non-zero if any invariant fails.
//!
//! ```text
//! outbox-chaos --database postgres://postgres@127.0.0.1:5432/test            # small (CI)
//! outbox-chaos --database mysql://root@127.0.0.1:3306/test --messages 100000 --keys 1000 \
//!     --kills 24 --duration 120s                                              # full size
//! outbox-chaos --database … --broker amqp://guest:guest@127.0.0.1:5672/%2f     # RabbitMQ
//! outbox-chaos --database … --seed 42                                         # replay a seed
//! ```

mod broker;
mod db;
mod faults;
mod relays;
mod workload;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use outbox::{Inbox, Status};
use outbox_testkit::FaultProxy;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use db::{Db, Effects};
use faults::drive_faults;
use relays::RelaySlot;
use workload::{Broker, Produced, produce, spawn_consumer};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-chaos",
    about = "Chaos run of the outbox relay (docs/reliability.md)"
)]
pub(crate) struct Args {
    /// `postgres://…` or `mysql://…` (`mariadb://…`).
    #[arg(long, env = "OUTBOX_CHAOS_DATABASE")]
    pub(crate) database: String,
    /// The broker: `nats://…` (JetStream) or `amqp://…` (RabbitMQ).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub(crate) broker: String,
    /// Committed messages to publish (poison rows and rolled-back ones come on top).
    #[arg(long, default_value_t = 3000)]
    pub(crate) messages: u64,
    /// Partition keys of the ordered route.
    #[arg(long, default_value_t = 100)]
    pub(crate) keys: u64,
    /// Relay processes.
    #[arg(long, default_value_t = 4)]
    pub(crate) relays: usize,
    /// SIGKILLs (each followed by a restart).
    #[arg(long, default_value_t = 8)]
    pub(crate) kills: usize,
    /// How long the producers and the faults run.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) duration: Duration,
    /// Bucket lease of the relays.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub(crate) lease: Duration,
    /// Seed of the fault schedule and the workload (default: random, printed).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// The `outbox` binary (default: beside this one).
    #[arg(long)]
    pub(crate) outbox: Option<PathBuf>,
    /// Keep the tables, stream and logs afterwards.
    #[arg(long)]
    pub(crate) keep: bool,
    /// Also stop and start the broker itself (the NATS server process, or the RabbitMQ
    /// application with `rabbitmqctl`), once per minute of run. Off by default: it restarts a
    /// service the whole machine shares.
    #[arg(long)]
    pub(crate) restart_broker: bool,
}

/// `scheme://user@host:port/db` with `host:port` replaced by `addr`.
fn via(url: &str, addr: std::net::SocketAddr) -> anyhow::Result<(String, String)> {
    let (scheme, rest) = url.split_once("://").context("a URL with a scheme")?;
    let (auth, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let (user, host) = auth.rsplit_once('@').map_or(("", auth), |(u, h)| (u, h));
    let at = if user.is_empty() { "" } else { "@" };
    let slash = if path.is_empty() && !rest.contains('/') {
        ""
    } else {
        "/"
    };
    Ok((
        host.to_owned(),
        format!("{scheme}://{user}{at}{addr}{slash}{path}"),
    ))
}

fn relay_toml(
    args: &Args,
    name: &str,
    db_url: &str,
    broker_url: &str,
    table: &str,
    stream: &str,
) -> String {
    let lease = args.lease.as_millis();
    let pt = lease / 3;
    let subj = stream.to_lowercase();
    let (transport, ordered, plain) = if rabbitmq(args) {
        (
            format!(
                "kind = \"rabbitmq\"\nurl = \"{broker_url}\"\nconfirm_timeout = \"{pt}ms\"\n\
                 connect_timeout = \"{pt}ms\"\nmax_message_bytes = 1048576\n"
            ),
            subj.clone(),
            subj.clone(),
        )
    } else {
        (
            format!(
                "kind = \"nats\"\nurl = \"{broker_url}\"\nstream = \"{stream}\"\n\
                 subjects = [\"{subj}.>\"]\ncreate_stream = false\nack_timeout = \"{pt}ms\"\n"
            ),
            format!("{subj}.ordered"),
            format!("{subj}.plain"),
        )
    };
    format!(
        r#"[database]
url = "{db_url}"
table = "{table}"
inbox_table = "{table}_inbox"

[relay]
name = "{name}"
lease = "{lease}ms"
publish_timeout = "{pt}ms"
poll_interval = "250ms"
batch_size = 200
max_attempts = 1000
backoff_base = "100ms"
backoff_max = "2s"
maintenance_interval = "1s"
shutdown_timeout = "2s"

[transports.bus]
{transport}
[[routes]]
topics = "chaos-ordered"
transport = "bus"
destination = "{ordered}"
ordered = true

[[routes]]
topics = "chaos-plain"
transport = "bus"
destination = "{plain}"
"#,
    )
}

fn rabbitmq(args: &Args) -> bool {
    args.broker.starts_with("amqp")
}

#[tokio::main]
async fn main() {
    match run(Args::parse()).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("outbox-chaos: {e:#}");
            std::process::exit(2);
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let seed = args.seed.unwrap_or_else(rand::random);
    let id = format!("{:08x}", rand::random::<u32>());
    let table = format!("chaos_{id}");
    let stream = format!("CHAOS_{id}");
    let subj = stream.to_lowercase();
    let outbox_bin = match &args.outbox {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the directory of this binary")?
            .join("outbox"),
    };
    if !outbox_bin.exists() {
        bail!(
            "no outbox binary at {} (build it with `cargo build -p outbox-cli`, or pass --outbox)",
            outbox_bin.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("outbox-chaos-{id}"));
    std::fs::create_dir_all(&dir)?;
    println!(
        "chaos run {id}: seed {seed}, {} messages over {} keys, {} relays, {} kills, {:?}, lease {:?}, {}",
        args.messages,
        args.keys,
        args.relays,
        args.kills,
        args.duration,
        args.lease,
        outbox::store::Dialect::of_url(&args.database)?.name()
    );

    let db = Db::open(&args.database, &table).await?;
    let broker = if rabbitmq(&args) {
        Broker::RabbitMq {
            url: args.broker.clone(),
            queue: subj.clone(),
        }
    } else {
        let nats = async_nats::connect(&args.broker)
            .await
            .with_context(|| format!("NATS at {} does not answer", args.broker))?;
        let js = async_nats::jetstream::new(nats);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{subj}.>")],
            ..Default::default()
        })
        .await
        .context("create the stream")?;
        Broker::Nats {
            js,
            stream: stream.clone(),
        }
    };

    // Proxies in front of the database and the broker, for the relays only.
    let (db_host, _) = via(&args.database, "127.0.0.1:1".parse()?)?;
    let db_proxy = FaultProxy::start(db_host).await;
    let (broker_host, _) = via(&args.broker, "127.0.0.1:1".parse()?)?;
    let broker_process = if args.restart_broker {
        Some(broker::BrokerProcess::find(&args.broker, broker_host.clone()).await?)
    } else {
        None
    };
    let broker_proxy = FaultProxy::start(broker_host).await;
    let (_, db_via) = via(
        &args.database.replacen("mariadb://", "mysql://", 1),
        db_proxy.addr,
    )?;
    let (_, broker_via) = via(&args.broker, broker_proxy.addr)?;
    let mut slots = Vec::new();
    for i in 0..args.relays {
        let name = format!("chaos-relay-{i}");
        let toml = relay_toml(&args, &name, &db_via, &broker_via, &table, &stream);
        let mut slot = RelaySlot::new(&dir, name, &toml)?;
        slot.start(&outbox_bin)?;
        slots.push(slot);
    }
    let slots = Arc::new(Mutex::new(slots));

    // The consumer.
    let cancel = CancellationToken::new();
    let effects = Arc::new(Effects {
        table: format!("{table}_effects"),
        applied: AtomicU64::new(0),
    });
    let consumer = match &db {
        Db::Pg(pool, _) => spawn_consumer(
            Inbox::<sqlx::Postgres>::new(pool.clone(), &format!("{table}_inbox"), "chaos")?,
            broker.clone(),
            effects.clone(),
            cancel.clone(),
        ),
        Db::My(pool, _) => spawn_consumer(
            Inbox::<sqlx::MySql>::new(pool.clone(), &format!("{table}_inbox"), "chaos")?,
            broker.clone(),
            effects.clone(),
            cancel.clone(),
        ),
    };

    // Producers and faults, side by side.
    let started = Instant::now();
    let produced = Arc::new(Mutex::new(Produced::default()));
    let progress = indicatif::ProgressBar::new(args.messages);
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} applied  {msg}",
        )?
        .progress_chars("=> "),
    );
    let faults_done = Arc::new(AtomicU64::new(0));
    let ticker = {
        let (progress, effects, faults_done) =
            (progress.clone(), effects.clone(), faults_done.clone());
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut last_line = Instant::now();
            while !cancel.is_cancelled() {
                let n = effects.applied.load(Ordering::Relaxed);
                progress.set_position(n);
                progress.set_message(format!("{} faults", faults_done.load(Ordering::Relaxed)));
                if progress.is_hidden() && last_line.elapsed() > Duration::from_secs(10) {
                    println!(
                        "  {:>5.0}s  applied {n}, faults {}",
                        progress.elapsed().as_secs_f64(),
                        faults_done.load(Ordering::Relaxed)
                    );
                    last_line = Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let schedule = faults::schedule(
        seed,
        args.duration,
        args.relays,
        args.kills,
        args.lease,
        args.restart_broker,
    );
    let fault_log = Arc::new(Mutex::new(Vec::<String>::new()));
    let producer = produce(&args, &db, &table, seed, produced.clone(), rabbitmq(&args));
    let driver = drive_faults(
        &schedule,
        started,
        slots.clone(),
        &db_proxy,
        &broker_proxy,
        &outbox_bin,
        broker_process.as_ref(),
        fault_log.clone(),
        faults_done.clone(),
    );
    let (p, d) = tokio::join!(producer, driver);
    // Whatever happened, the broker runs again.
    if let Some(b) = &broker_process {
        b.start().await?;
    }
    p?;
    d?;

    // The faults stop: everything back, every relay running.
    db_proxy.set_blocked(false);
    db_proxy.set_delay(Duration::ZERO);
    broker_proxy.set_blocked(false);
    broker_proxy.set_replies_dropped(false);
    broker_proxy.set_delay(Duration::ZERO);
    {
        let mut slots = slots.lock().await;
        for s in slots.iter_mut() {
            if s.paused {
                s.signal_pause(false);
            }
            if !s.running() {
                s.start(&outbox_bin)?;
            }
        }
    }
    let faults_stopped = Instant::now();
    let produced = std::mem::take(&mut *produced.lock().await);
    let good: BTreeSet<String> = produced.good.iter().map(Uuid::to_string).collect();
    progress.set_length(good.len() as u64);

    // Wait for the backlog to drain: every committed message applied, every poison row FAILED.
    // The backlog left when the faults stop drains at the relays' pace: allow four leases (a
    // relay killed last is taken over after one) and a minute, plus 200 messages a second of
    // backlog (far below what four relays publish; a wedged relay stops the drain outright).
    let backlog = (good.len() as u64).saturating_sub(effects.applied.load(Ordering::Relaxed));
    let limit = args.lease * 4 + Duration::from_secs(60 + backlog / 200);
    let store = db.store();
    let drained = loop {
        let applied = db
            .pairs(&format!(
                "SELECT message_id, COUNT(*) FROM {table}_effects GROUP BY message_id"
            ))
            .await?;
        let open = store.stats().await?;
        let applied: BTreeSet<String> = applied.into_iter().filter_map(|(m, _)| m).collect();
        if good.is_subset(&applied) && open.counts.get(&Status::Pending).copied().unwrap_or(0) == 0
        {
            break Some(faults_stopped.elapsed());
        }
        if faults_stopped.elapsed() > limit {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    progress.finish_and_clear();

    // The invariants.
    let mut failures = Vec::new();
    let effects_rows = db
        .pairs(&format!(
            "SELECT message_id, COUNT(*) FROM {table}_effects GROUP BY message_id"
        ))
        .await?;
    let applied: BTreeMap<String, i64> = effects_rows
        .into_iter()
        .filter_map(|(m, n)| m.map(|m| (m, n)))
        .collect();
    let lost: Vec<&String> = good.iter().filter(|m| !applied.contains_key(*m)).collect();
    let twice = applied.values().filter(|n| **n > 1).count();
    let foreign = applied.keys().filter(|m| !good.contains(*m)).count();
    let rolled_back_applied = db
        .pairs(&format!(
            "SELECT message_id, 0 FROM {table}_effects WHERE rb"
        ))
        .await?
        .len();
    let order = db
        .pairs(&format!(
            "SELECT pkey, seq FROM {table}_effects WHERE pkey IS NOT NULL ORDER BY id"
        ))
        .await?;
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut out_of_order = 0;
    for (k, s) in order {
        let k = k.unwrap_or_default();
        if let Some(prev) = last.get(&k)
            && s <= *prev
        {
            out_of_order += 1;
        }
        last.insert(k, s);
    }
    let states = row_states(&db, &table).await?;
    let not_sent_good = good
        .iter()
        .filter(|m| {
            states
                .get(*m)
                .is_some_and(|(s, _)| *s != Status::Sent.as_i16() as i64)
        })
        .count();
    let mut poison_ok = 0;
    let mut poison_bad = Vec::new();
    for (m, kind) in &produced.poison {
        match states.get(&m.to_string()) {
            Some((s, true)) if *s == Status::Failed.as_i16() as i64 => poison_ok += 1,
            other => poison_bad.push(format!("{m} ({kind:?}): {other:?}")),
        }
    }
    // Every relay a live member again: a relay cut off from the database backs off its
    // membership rounds, so it rejoins up to a few leases after the faults stop; one that never
    // does is wedged.
    let rejoin_limit = args.lease * 3 + Duration::from_secs(10);
    let (members, rejoined) = loop {
        let members = store.relays(args.lease).await?;
        if members.len() == args.relays {
            break (members, Some(faults_stopped.elapsed()));
        }
        if faults_stopped.elapsed() > rejoin_limit {
            break (members, None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut slots = slots.lock().await;
    let alive = slots
        .iter_mut()
        .map(RelaySlot::running)
        .filter(|r| *r)
        .count();

    if !lost.is_empty() {
        failures.push(format!(
            "lost {} committed messages, e.g. {:?}",
            lost.len(),
            &lost[..lost.len().min(5)]
        ));
    }
    if twice > 0 {
        failures.push(format!("{twice} messages applied more than once"));
    }
    if foreign > 0 || rolled_back_applied > 0 {
        failures.push(format!(
            "{foreign} applied messages were never committed ({rolled_back_applied} of rolled-back transactions)"
        ));
    }
    if out_of_order > 0 {
        failures.push(format!("{out_of_order} effects out of per-key order"));
    }
    if not_sent_good > 0 {
        failures.push(format!("{not_sent_good} committed messages are not SENT"));
    }
    if !poison_bad.is_empty() {
        failures.push(format!(
            "{} poison rows not FAILED with a reason: {:?}",
            poison_bad.len(),
            &poison_bad[..poison_bad.len().min(5)]
        ));
    }
    if drained.is_none() {
        failures.push(format!("not drained {limit:?} after the faults stopped"));
    }
    if alive != args.relays || rejoined.is_none() {
        failures.push(format!(
            "{alive} of {} relay processes alive, {} live members {rejoin_limit:?} after the faults stopped: {:?}",
            args.relays,
            members.len(),
            members.iter().map(|m| &m.name).collect::<Vec<_>>()
        ));
    }

    // The report.
    let faults_log = fault_log.lock().await;
    println!(
        "\nchaos run {id} ({}), seed {seed}",
        if failures.is_empty() {
            "PASSED"
        } else {
            "FAILED"
        }
    );
    println!(
        "  committed {} messages ({} keys ordered, the rest unordered), {} rolled-back transactions, {} long transactions, {} poison rows",
        good.len(),
        args.keys,
        produced.rolled_back,
        produced.long_transactions,
        produced.poison.len()
    );
    println!(
        "  applied {} (lost {}, applied twice {}, never committed {}), out of order {}, poison FAILED with a reason {}/{}",
        applied.len(),
        lost.len(),
        twice,
        foreign,
        out_of_order,
        poison_ok,
        produced.poison.len()
    );
    println!(
        "  drained {} after the faults stopped (backlog then about {backlog}, limit {:.0} s); relays alive {alive}/{}, members {} ({})",
        drained.map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
        limit.as_secs_f64(),
        args.relays,
        members.len(),
        rejoined.map_or("not all rejoined".to_owned(), |d| format!(
            "all members {:.1} s after the faults stopped",
            d.as_secs_f64()
        ))
    );
    println!("  faults ({}), offsets from the start:", faults_log.len());
    for f in faults_log.iter() {
        println!("    {f}");
    }
    for f in &failures {
        println!("  INVARIANT FAILED: {f}");
    }
    if !failures.is_empty() {
        println!("  relay logs: {}", dir.display());
        println!("  replay: outbox-chaos --database … --seed {seed} (same sizes)");
    }

    cancel.cancel();
    let _ = ticker.await;
    let _ = consumer.await;
    for s in slots.iter_mut() {
        s.kill().await;
    }
    if !args.keep && failures.is_empty() {
        db.drop_tables(&table).await;
        broker.delete().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(failures.is_empty())
}

/// Every row not SENT: message id → (status, has a last error).
async fn row_states(db: &Db, table: &str) -> anyhow::Result<BTreeMap<String, (i64, bool)>> {
    let sent = Status::Sent.as_i16();
    let sql = match db {
        Db::Pg(..) => format!(
            "SELECT message_id::text, status::int8 * 2 + (CASE WHEN last_error IS NULL THEN 0 ELSE 1 END) FROM {table} WHERE status <> {sent}"
        ),
        Db::My(..) => format!(
            "SELECT message_id, CAST(status AS SIGNED) * 2 + (CASE WHEN last_error IS NULL THEN 0 ELSE 1 END) FROM {table} WHERE status <> {sent}"
        ),
    };
    Ok(db
        .pairs(&sql)
        .await?
        .into_iter()
        .filter_map(|(m, v)| m.map(|m| (m, (v / 2, v % 2 == 1))))
        .collect())
}
