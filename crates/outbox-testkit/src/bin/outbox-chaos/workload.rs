//! The workload: the producers and the consumer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::consumer::ConsumerMetrics;
use outbox::consumer::nats::NatsConsumerConfig;
use outbox::consumer::rabbitmq::{QueueSetup, RabbitMqConsumerConfig};
use outbox::{Inbox, InboxBackend, NewMessage, RabbitMqConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Args;
use crate::db::{Db, Effects, Payload, Poison};

/// What the producers committed.
#[derive(Default)]
pub(crate) struct Produced {
    pub(crate) good: Vec<Uuid>,
    pub(crate) poison: Vec<(Uuid, Poison)>,
    pub(crate) rolled_back: u64,
    pub(crate) long_transactions: u64,
}

pub(crate) fn spawn_consumer<DB: InboxBackend>(
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
                let mut config =
                    NatsConsumerConfig::new(stream.clone(), format!("{stream}-consumer"));
                config.runner.concurrency = 16;
                config.runner.max_deliveries = 1000;
                config.batch = 200;
                config.ack_wait = Duration::from_secs(5);
                outbox::consumer::nats::run(js, config, inbox, effects, metrics, cancel).await
            }
            Broker::RabbitMq { url, queue } => {
                let mut config = RabbitMqConsumerConfig::new(RabbitMqConfig::new(url), queue);
                config.declare = Some(QueueSetup::default());
                config.runner.concurrency = 16;
                config.batch = 200;
                config.runner.max_deliveries = 1000;
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
pub(crate) enum Broker {
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
    pub(crate) async fn delete(&self) {
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

/// The producers: paced over the run, 4 tasks, each owning a share of the keys (so a key's
/// sequence numbers are committed in order); 3 % of transactions rolled back, a long
/// transaction every 5 s, poison rows spread over the run.
pub(crate) async fn produce(
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
