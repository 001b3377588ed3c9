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

mod db;
mod faults;
mod relays;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use outbox::RabbitMqConfig;
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::consumer::rabbitmq::{QueueSetup, RabbitMqConsumerConfig};
use outbox::{Inbox, InboxBackend, NewMessage, Status};
use outbox_testkit::FaultProxy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use db::{Db, Effects, Payload, Poison};
use faults::Fault;
use relays::RelaySlot;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-chaos",
    about = "Chaos run of the outbox relay (docs/reliability.md)"
)]
struct Args {
    /// `postgres://…` or `mysql://…` (`mariadb://…`).
    #[arg(long, env = "OUTBOX_CHAOS_DATABASE")]
    database: String,
    /// The broker: `nats://…` (JetStream) or `amqp://…` (RabbitMQ).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    broker: String,
    /// Committed messages to publish (poison rows and rolled-back ones come on top).
    #[arg(long, default_value_t = 3000)]
    messages: u64,
    /// Partition keys of the ordered route.
    #[arg(long, default_value_t = 100)]
    keys: u64,
    /// Relay processes.
    #[arg(long, default_value_t = 4)]
    relays: usize,
    /// SIGKILLs (each followed by a restart).
    #[arg(long, default_value_t = 8)]
    kills: usize,
    /// How long the producers and the faults run.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Bucket lease of the relays.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Seed of the fault schedule and the workload (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// The `outbox` binary (default: beside this one).
    #[arg(long)]
    outbox: Option<PathBuf>,
    /// Keep the tables, stream and logs afterwards.
    #[arg(long)]
    keep: bool,
}

/// What the producers committed.
#[derive(Default)]
struct Produced {
    good: Vec<Uuid>,
    poison: Vec<(Uuid, Poison)>,
    rolled_back: u64,
    long_transactions: u64,
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
        if args.database.starts_with("postgres") {
            "PostgreSQL"
        } else {
            "MySQL/MariaDB"
        }
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
    let schedule = faults::schedule(seed, args.duration, args.relays, args.kills, args.lease);
    let fault_log = Arc::new(Mutex::new(Vec::<String>::new()));
    let producer = produce(&args, &db, &table, seed, produced.clone(), rabbitmq(&args));
    let driver = drive_faults(
        &schedule,
        started,
        slots.clone(),
        &db_proxy,
        &broker_proxy,
        &outbox_bin,
        fault_log.clone(),
        faults_done.clone(),
    );
    let (p, d) = tokio::join!(producer, driver);
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
    let limit = args.lease * 4 + Duration::from_secs(60);
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
    let members = store.relays(args.lease).await?;
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
    if alive != args.relays || members.len() != args.relays {
        failures.push(format!(
            "{alive} of {} relay processes alive, {} members: {:?}",
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
        "  drained {} after the faults stopped; relays alive {alive}/{}, members {}",
        drained.map_or("never".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
        args.relays,
        members.len()
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

fn spawn_consumer<DB: InboxBackend>(
    inbox: Inbox<DB>,
    broker: Broker,
    effects: Arc<Effects>,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()>
where
    Effects: outbox::Handler<DB>,
{
    tokio::spawn(async move {
        if let Err(e) = inbox.migrate().await {
            eprintln!("inbox migration failed: {e}");
            return;
        }
        let metrics = Arc::new(ConsumerMetrics::default());
        let result = match broker {
            Broker::Nats { js, stream } => {
                let config = NatsConsumerConfig {
                    concurrency: 16,
                    batch: 200,
                    ack_wait: Duration::from_secs(5),
                    max_deliveries: 1000,
                    ..NatsConsumerConfig::new(stream.clone(), format!("{stream}-consumer"))
                };
                outbox::consumer::nats::run(js, config, inbox, effects, metrics, cancel).await
            }
            Broker::RabbitMq { url, queue } => {
                let mut config = RabbitMqConsumerConfig::new(RabbitMqConfig::new(url), queue);
                config.declare = Some(QueueSetup::default());
                config.concurrency = 16;
                config.batch = 200;
                config.max_deliveries = 1000;
                outbox::consumer::rabbitmq::run(config, inbox, effects, metrics, cancel).await
            }
        };
        if let Err(e) = result {
            eprintln!("consumer failed: {e}");
        }
    })
}

/// The broker under test, as the consumer reaches it (directly, not through the proxy).
#[derive(Clone)]
enum Broker {
    Nats {
        js: async_nats::jetstream::Context,
        stream: String,
    },
    RabbitMq {
        url: String,
        queue: String,
    },
}

impl Broker {
    /// Delete the stream or queue of the run.
    async fn delete(&self) {
        match self {
            Broker::Nats { js, stream } => {
                let _ = js.delete_stream(stream).await;
            }
            Broker::RabbitMq { url, queue } => {
                let props = lapin::ConnectionProperties::default();
                if let Ok(c) = lapin::Connection::connect(url, props).await
                    && let Ok(ch) = c.create_channel().await
                {
                    let _ = ch
                        .queue_delete(queue.as_str().into(), Default::default())
                        .await;
                }
            }
        }
    }
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

/// The producers: paced over the run, 4 tasks, each owning a share of the keys (so a key's
/// sequence numbers are committed in order); 3 % of transactions rolled back, a long
/// transaction every 5 s, poison rows spread over the run.
async fn produce(
    args: &Args,
    db: &Db,
    table: &str,
    seed: u64,
    out: Arc<Mutex<Produced>>,
    rabbitmq: bool,
) -> anyhow::Result<()> {
    const TASKS: u64 = 4;
    let per_task = args.messages / TASKS;
    let poison_total = (args.messages / 500).max(Poison::ALL.len() as u64);
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let n = if t == TASKS - 1 {
            args.messages - per_task * (TASKS - 1)
        } else {
            per_task
        };
        let (db, out, table) = (db.clone(), out.clone(), table.to_owned());
        let keys: Vec<u64> = (0..args.keys).filter(|k| k % TASKS == t).collect();
        let duration = args.duration;
        let poison = if t == 0 { poison_total } else { 0 };
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ (t + 1));
            let mut seq: BTreeMap<u64, u64> = BTreeMap::new();
            let started = Instant::now();
            let mut done = 0u64;
            let mut poisoned = 0u64;
            let mut last_long = Instant::now();
            while done < n {
                // Pace: `done` messages are due after `done / n` of the run.
                let due = duration.mul_f64(done as f64 / n as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
                let size = rng.random_range(1..=8).min(n - done);
                let rollback = rng.random_bool(0.03);
                let mut msgs = Vec::new();
                let mut ordered = Vec::new();
                for _ in 0..size {
                    if rollback {
                        let p = Payload {
                            k: None,
                            s: 0,
                            rb: true,
                        };
                        msgs.push(NewMessage::new("chaos-plain", serde_json::to_vec(&p)?));
                    } else if !keys.is_empty() && rng.random_bool(0.5) {
                        let k = keys[rng.random_range(0..keys.len())];
                        let s = seq.entry(k).or_default();
                        let p = Payload {
                            k: Some(format!("k{k}")),
                            s: *s,
                            rb: false,
                        };
                        *s += 1;
                        ordered.push(k);
                        msgs.push(
                            NewMessage::new("chaos-ordered", serde_json::to_vec(&p)?)
                                .with_partition_key(format!("k{k}")),
                        );
                    } else {
                        let p = Payload {
                            k: None,
                            s: done,
                            rb: false,
                        };
                        msgs.push(NewMessage::new("chaos-plain", serde_json::to_vec(&p)?));
                    }
                }
                let hold = if t == 1 && last_long.elapsed() > Duration::from_secs(5) {
                    last_long = Instant::now();
                    Duration::from_millis(rng.random_range(2000..4000))
                } else {
                    Duration::ZERO
                };
                let ids = db.produce(msgs, !rollback, hold).await?;
                let mut o = out.lock().await;
                if !hold.is_zero() {
                    o.long_transactions += 1;
                }
                if rollback {
                    o.rolled_back += 1;
                    // The sequence numbers were not used: nothing to undo (rolled-back
                    // transactions carry no ordered messages).
                    continue;
                }
                o.good.extend(ids);
                drop(o);
                done += size;
                if poisoned < poison && done * poison >= poisoned * n {
                    let kind = Poison::ALL[(poisoned % Poison::ALL.len() as u64) as usize];
                    let id = db.poison(&table, kind, rabbitmq).await?;
                    out.lock().await.poison.push((id, kind));
                    poisoned += 1;
                }
            }
            while poisoned < poison {
                let kind = Poison::ALL[(poisoned % Poison::ALL.len() as u64) as usize];
                let id = db.poison(&table, kind, rabbitmq).await?;
                out.lock().await.poison.push((id, kind));
                poisoned += 1;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Run the fault schedule; each fault's end (restart, SIGCONT, unblock) is scheduled on its own.
#[allow(clippy::too_many_arguments)]
async fn drive_faults(
    schedule: &[(Duration, Fault)],
    started: Instant,
    slots: Arc<Mutex<Vec<RelaySlot>>>,
    db_proxy: &FaultProxy,
    broker_proxy: &FaultProxy,
    outbox_bin: &std::path::Path,
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
                        end(f, &slots, db_proxy, broker_proxy, outbox_bin).await?;
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
            Fault::CutDatabase { cut } => {
                db_proxy.set_blocked(true);
                ends.push((now + cut, *fault));
                format!("database cut for {} ms", cut.as_millis())
            }
            Fault::CutBroker { cut } => {
                broker_proxy.set_blocked(true);
                ends.push((now + cut, *fault));
                format!("broker cut for {} ms", cut.as_millis())
            }
            Fault::SlowDatabase { delay, during } => {
                db_proxy.set_delay(delay);
                ends.push((now + during, *fault));
                format!(
                    "database +{} ms per chunk for {} ms",
                    delay.as_millis(),
                    during.as_millis()
                )
            }
            Fault::SlowBroker { delay, during } => {
                broker_proxy.set_delay(delay);
                ends.push((now + during, *fault));
                format!(
                    "broker +{} ms per chunk for {} ms",
                    delay.as_millis(),
                    during.as_millis()
                )
            }
            Fault::HalfOpenDatabase { n } => match db_proxy.stall_nth(n) {
                Some(port) => format!("database connection from port {port} half-open"),
                None => "database half-open: no connection open".to_owned(),
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
        end(f, &slots, db_proxy, broker_proxy, outbox_bin).await?;
    }
    Ok(())
}

async fn end(
    fault: Fault,
    slots: &Mutex<Vec<RelaySlot>>,
    db_proxy: &FaultProxy,
    broker_proxy: &FaultProxy,
    outbox_bin: &std::path::Path,
) -> anyhow::Result<()> {
    match fault {
        Fault::Kill { slot, .. } => {
            let mut slots = slots.lock().await;
            if !slots[slot].running() {
                slots[slot].start(outbox_bin)?;
            }
        }
        Fault::Pause { slot, .. } => slots.lock().await[slot].signal_pause(false),
        Fault::CutDatabase { .. } => db_proxy.set_blocked(false),
        Fault::CutBroker { .. } => broker_proxy.set_blocked(false),
        Fault::SlowDatabase { .. } => db_proxy.set_delay(Duration::ZERO),
        Fault::SlowBroker { .. } => broker_proxy.set_delay(Duration::ZERO),
        Fault::HalfOpenDatabase { .. } => {}
        Fault::DropBrokerReplies { .. } => {
            broker_proxy.set_replies_dropped(false);
            broker_proxy.set_blocked(true);
            broker_proxy.set_blocked(false);
        }
    }
    Ok(())
}
