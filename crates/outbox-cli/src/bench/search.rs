//! The `search` scenario: the admin search ([`outbox::Store::search`], what `GET /api/messages`
//! and `outbox messages list` run) on a large table, without and with the optional search
//! indexes ([`outbox::admin::SearchIndexes`]), and what those indexes cost the producers and the
//! relay.
//!
//! The table (`--search-rows`, default 10,000,000) is filled by SQL in chunks of 1,000,000 rows
//! (through the producer API it would take longer than the rest of the bench): 50 topics,
//! 1,000,000 partition keys, one row every 360,000,000 / rows ms over the 100 hours before the
//! fill started, inserted in that order (ids follow `created_at`); 99.89 % CONFIRMED, 0.01 %
//! FAILED with an error (`error 0` … `error 9`, by `g / 10000`) spread through the table, and the newest 0.1 %
//! PENDING (the backlog of a live outbox is its newest rows); row `g` has message id
//! `00000000-0000-4000-8000-<g, 12 digits>`. Each filter is
//! searched 5 times (the first warms the cache): median and worst, in ms.
//!
//! The cost: `--messages` keyed messages loaded through the producer API and drained by one
//! relay, on tables without, with, with and without the indexes (in that order, so a drift of
//! the machine shows): the load and drain rates with the indexes over those without.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use outbox::admin::{MessageFilter, PageRequest, SearchOrder};
use serde::Serialize;
use tokio::time::Instant;

use super::db::{Dialect, Outbox};
use super::report::{Drain, ratio};
use super::{Bench, TOPIC};
use outbox::Status;

/// Rows per fill statement.
const FILL_CHUNK: u64 = 1_000_000;
/// Searches per filter; the first warms the cache and is left out.
const RUNS: usize = 5;
/// The span of `created_at` over the table.
const SPAN_MS: u64 = 100 * 3_600_000;

/// One filter's timings on one table.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Timing {
    /// Median of the timed runs, ms.
    pub median_ms: f64,
    /// Slowest of the timed runs, ms.
    pub max_ms: f64,
    /// Rows on the page.
    pub rows: usize,
    /// The page's order (`id`, `created_at`, `sent_at`).
    pub order: String,
}

/// One filter without and with the search indexes.
#[derive(Debug, Clone, Serialize, Default)]
pub struct SearchQuery {
    /// What is searched.
    pub name: String,
    /// Without the search indexes.
    pub without: Timing,
    /// With them.
    pub with: Timing,
}

/// One cost round: keyed messages loaded and drained.
#[derive(Debug, Clone, Serialize)]
pub struct IndexRound {
    /// Whether the table had the search indexes.
    pub indexes: bool,
    /// Messages loaded through `enqueue_many`, 1,000 per statement, per second.
    pub load_rate: f64,
    /// The relay's drain of them.
    pub drain: Drain,
}

/// The `search` scenario's figures.
#[derive(Debug, Clone, Serialize, Default)]
pub struct SearchRun {
    /// Rows of the searched table.
    pub rows: u64,
    /// Seconds the fill took.
    pub fill_seconds: f64,
    /// Seconds `create_search_indexes` took on the filled table.
    pub index_build_seconds: f64,
    /// The filters.
    pub queries: Vec<SearchQuery>,
    /// The cost rounds, in the order run.
    pub rounds: Vec<IndexRound>,
    /// Load rate with the indexes over without (all rounds).
    pub load_ratio: Option<f64>,
    /// Drain rate with the indexes over without (all rounds).
    pub drain_ratio: Option<f64>,
}

/// The fill's expressions for row number `g` (a column of the digits' cross join) and the
/// anchor time.
pub(super) struct Fill {
    pub dialect: Dialect,
    /// The database clock at the start, ms since the epoch.
    pub anchor_ms: i64,
    /// Milliseconds between two rows' `created_at`, as microseconds.
    pub step_us: i64,
    pub rows: u64,
    /// Set `partitioned_at` (a partitioned PostgreSQL table) to `created_at`.
    pub partitioned: bool,
}

impl Fill {
    /// The time `back_us` microseconds (an SQL expression) before the anchor.
    fn back(&self, back_us: &str) -> String {
        let a = self.anchor_ms;
        match self.dialect {
            Dialect::Postgres => {
                format!("to_timestamp({a} / 1000.0) - ({back_us}) * interval '1 microsecond'")
            }
            Dialect::MySql => format!(
                "TIMESTAMPADD(MICROSECOND, {a} * 1000 - ({back_us}), '1970-01-01 00:00:00')"
            ),
            Dialect::Sqlite => format!("({a} - ({back_us}) / 1000)"),
        }
    }

    fn concat(&self, prefix: &str, e: &str) -> String {
        match self.dialect {
            Dialect::MySql => format!("CONCAT('{prefix}', {e})"),
            _ => format!("'{prefix}' || ({e})"),
        }
    }

    /// A fill of `rows` rows spread over the 100 hours before the database clock's now.
    pub(super) async fn new(bench: &Bench, rows: u64, partitioned: bool) -> anyhow::Result<Fill> {
        let (_, anchor_us, _) = bench.db.clock_sample().await?;
        Ok(Fill {
            dialect: bench.db.dialect,
            anchor_ms: anchor_us / 1000,
            step_us: (SPAN_MS * 1000 / rows.max(1)).max(1) as i64,
            rows,
            partitioned,
        })
    }

    /// Fill `table`, chunk by chunk, with a progress bar; the seconds it took.
    pub(super) async fn run(&self, bench: &Bench, table: &str) -> anyhow::Result<f64> {
        let bar = bench.bar(self.rows, &format!("fill {table}"));
        let started = Instant::now();
        for base in (0..self.rows).step_by(FILL_CHUNK as usize) {
            bench.db.exec(&self.statement(table, base)).await?;
            bar.set_position((base + FILL_CHUNK).min(self.rows));
        }
        bar.finish_and_clear();
        Ok(started.elapsed().as_secs_f64())
    }

    /// `INSERT … SELECT` of rows `base + 1` to `min(base + FILL_CHUNK, rows)`.
    fn statement(&self, table: &str, base: u64) -> String {
        let digits = "(SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                      UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                      UNION ALL SELECT 8 UNION ALL SELECT 9)";
        let from: Vec<String> = (0..6).map(|i| format!("{digits} d{i}")).collect();
        // 64-bit arithmetic from the start (PostgreSQL's integers are 32-bit).
        let base = match self.dialect {
            Dialect::Postgres => format!("{base}::bigint"),
            _ => base.to_string(),
        };
        let g = format!(
            "{base} + 1 + d0.n + 10 * d1.n + 100 * d2.n + 1000 * d3.n + 10000 * d4.n + 100000 * d5.n"
        );
        let (failed, pending, confirmed) = (
            Status::Failed.as_i16(),
            Status::Pending.as_i16(),
            Status::Confirmed.as_i16(),
        );
        let mid = match self.dialect {
            Dialect::Postgres => {
                "('00000000-0000-4000-8000-' || lpad(g::text, 12, '0'))::uuid".into()
            }
            Dialect::MySql => "CONCAT('00000000-0000-4000-8000-', LPAD(g, 12, '0'))".into(),
            Dialect::Sqlite => "printf('00000000-0000-4000-8000-%012d', g)".to_owned(),
        };
        let (headers, payload) = match self.dialect {
            Dialect::Postgres => ("'{}'::jsonb", "'\\x7b7d'::bytea"),
            _ => ("'{}'", "X'7B7D'"),
        };
        let back = format!("({} - g) * {}", self.rows, self.step_us);
        let created = self.back(&back);
        let sent = self.back(&format!("{back} - 5000"));
        let confirmed_at = self.back(&format!("{back} - 10000"));
        // The newest 0.1 % are PENDING.
        let newest = self.rows - self.rows / 1000;
        let status = format!(
            "CASE WHEN g % 10000 = 7 THEN {failed} WHEN g > {newest} THEN {pending} ELSE {confirmed} END"
        );
        format!(
            "INSERT INTO {table} (message_id, topic, partition_key, headers, payload, status, \
             attempts, available_at, created_at, sent_at, confirmed_at, updated_at, last_error{pcol}) \
             SELECT {mid}, {topic}, {key}, {headers}, {payload}, {status}, 1, {created}, {created}, \
             CASE WHEN g > {newest} AND g % 10000 <> 7 THEN NULL ELSE {sent} END, \
             CASE WHEN g > {newest} OR g % 10000 = 7 THEN NULL ELSE {confirmed_at} END, {created}, \
             CASE WHEN g % 10000 = 7 THEN {error} END{pval} \
             FROM (SELECT {g} AS g FROM {from}) s WHERE g <= {rows} ORDER BY g",
            topic = self.concat("topic.", "g % 50"),
            key = self.concat("key-", "g % 1000000"),
            error = self.concat("error ", "(g / 10000) % 10"),
            from = from.join(", "),
            rows = self.rows,
            pcol = if self.partitioned {
                ", partitioned_at"
            } else {
                ""
            },
            pval = if self.partitioned {
                format!(", {created}")
            } else {
                String::new()
            },
        )
    }

    /// The anchor minus `hours`.
    fn hours_back(&self, hours: i64) -> DateTime<Utc> {
        Utc.timestamp_millis_opt(self.anchor_ms - hours * 3_600_000)
            .single()
            .expect("a time in range")
    }
}

impl Bench {
    /// The `search` scenario.
    pub(super) async fn search_run(&self) -> anyhow::Result<SearchRun> {
        let rows = self.args.search_rows;
        let table = self.db.table("search");
        let outbox = self.db.migrate(&table).await?;
        let store = outbox.store();
        let fill = Fill::new(self, rows, false).await?;
        let fill_seconds = fill.run(self, &table).await?;
        self.db.settle(&table).await?;

        let filters = filters(&fill);
        let mut queries: Vec<SearchQuery> = Vec::new();
        for (name, filter, pages) in &filters {
            let without = time_search(&*store, filter, *pages).await?;
            queries.push(SearchQuery {
                name: name.clone(),
                without,
                with: Timing::default(),
            });
        }
        let started = Instant::now();
        let present = store.create_search_indexes().await?;
        anyhow::ensure!(
            present.all(),
            "search indexes missing after the build: {present:?}"
        );
        let index_build_seconds = started.elapsed().as_secs_f64();
        self.db.settle(&table).await?;
        for (q, (_, filter, pages)) in queries.iter_mut().zip(&filters) {
            q.with = time_search(&*store, filter, *pages).await?;
        }
        self.db.drop_outbox(&table).await?;

        let mut rounds = Vec::new();
        for (round, indexes) in [false, true, true, false].into_iter().enumerate() {
            let table = self.db.table(&format!("searchcost{round}"));
            let outbox: Outbox = self.db.migrate(&table).await?;
            if indexes {
                outbox.store().create_search_indexes().await?;
            }
            let bar = self.bar(self.args.messages, &format!("load {table}"));
            let started = Instant::now();
            self.db
                .load(&table, self.args.messages, &self.payload, TOPIC, true, &bar)
                .await?;
            bar.finish_and_clear();
            let load_rate = self.args.messages as f64 / started.elapsed().as_secs_f64();
            let drain = self.relay_drain(&table, 1).await?;
            self.db.drop_outbox(&table).await?;
            rounds.push(IndexRound {
                indexes,
                load_rate,
                drain,
            });
        }
        let mean = |indexes: bool, f: &dyn Fn(&IndexRound) -> f64| {
            let v: Vec<f64> = rounds
                .iter()
                .filter(|r| r.indexes == indexes)
                .map(f)
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        let load_ratio = ratio(mean(true, &|r| r.load_rate), mean(false, &|r| r.load_rate));
        let drain_ratio = ratio(
            mean(true, &|r| r.drain.rate),
            mean(false, &|r| r.drain.rate),
        );
        Ok(SearchRun {
            rows,
            fill_seconds,
            index_build_seconds,
            queries,
            rounds,
            load_ratio,
            drain_ratio,
        })
    }
}

/// The filters searched: name, filter, and how many pages are read (the last one timed, so
/// paging deep into a window is measured too).
fn filters(fill: &Fill) -> Vec<(String, MessageFilter, usize)> {
    let f = MessageFilter::default;
    let states = |s: Status| MessageFilter {
        states: vec![s],
        ..f()
    };
    let topic = |t: &str| MessageFilter {
        topic: Some(t.into()),
        ..f()
    };
    // Created from `from` hours back to `to` hours back (`None`: to now).
    let created = |from: i64, to: Option<i64>| MessageFilter {
        created_after: Some(fill.hours_back(from)),
        created_before: to.map(|h| fill.hours_back(h)),
        ..f()
    };
    let middle = fill.rows / 2 + 1;
    let key = format!("key-{}", middle % 1_000_000);
    vec![
        ("the newest page".into(), f(), 1),
        ("state=failed".into(), states(Status::Failed), 1),
        ("state=pending".into(), states(Status::Pending), 1),
        ("topic=topic.1* (glob)".into(), topic("topic.1*"), 1),
        ("topic=topic.17".into(), topic("topic.17"), 1),
        (
            "message_id (a row in the middle)".into(),
            MessageFilter {
                message_id: Some(
                    format!("00000000-0000-4000-8000-{middle:012}")
                        .parse()
                        .expect("a valid uuid"),
                ),
                ..f()
            },
            1,
        ),
        (
            "error=error 3".into(),
            MessageFilter {
                error: Some("error 3".into()),
                ..f()
            },
            1,
        ),
        (
            format!("key={key}, every state"),
            MessageFilter {
                partition_key: Some(key.clone()),
                ..f()
            },
            1,
        ),
        (
            format!("key={key}, state=failed or pending"),
            MessageFilter {
                partition_key: Some(key),
                states: vec![Status::Failed, Status::Pending],
                ..f()
            },
            1,
        ),
        (
            "created in 1 hour, 80 hours back".into(),
            created(80, Some(79)),
            1,
        ),
        (
            "created in 1 hour, 80 hours back, 3rd page".into(),
            created(80, Some(79)),
            3,
        ),
        (
            "created in 24 hours, 50 hours back".into(),
            created(50, Some(26)),
            1,
        ),
        ("created after 2 hours back".into(), created(2, None), 1),
        (
            "sent in 1 hour, 80 hours back".into(),
            MessageFilter {
                sent_after: Some(fill.hours_back(80)),
                sent_before: Some(fill.hours_back(79)),
                ..f()
            },
            1,
        ),
    ]
}

/// [`RUNS`] searches of `pages` pages of `filter`; the last page of each run is timed.
async fn time_search(
    store: &dyn outbox::Store,
    filter: &MessageFilter,
    pages: usize,
) -> anyhow::Result<Timing> {
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..RUNS {
        let mut page = PageRequest::default();
        let mut elapsed = Duration::ZERO;
        for _ in 0..pages {
            let started = Instant::now();
            let p = store.search(filter, &page).await?;
            elapsed = started.elapsed();
            page.before = p.next;
            last = Some(p);
            if page.before.is_none() {
                break;
            }
        }
        times.push(elapsed.as_secs_f64() * 1000.0);
    }
    let mut timed: Vec<f64> = times[1..].to_vec();
    timed.sort_by(f64::total_cmp);
    let last = last.expect("at least one run");
    Ok(Timing {
        median_ms: timed[timed.len() / 2],
        max_ms: *timed.last().expect("timed runs"),
        rows: last.messages.len(),
        order: match last.order {
            SearchOrder::Id => "id",
            SearchOrder::CreatedAt => "created_at",
            SearchOrder::SentAt => "sent_at",
        }
        .into(),
    })
}
