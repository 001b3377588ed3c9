//! The text tables `outbox bench` prints at the end.

use super::report::{TableStats, fmt_fixed};
use super::*;

/// The report as text tables (every figure with the 1-minute load beside it).
pub(super) fn render(r: &Report) -> String {
    let mut out = String::new();
    let mut section = |title: &str, t: &Table| {
        if !t.is_empty() {
            out.push_str(&format!("\n{title}\n{}", t.render()));
        }
    };
    let label = |d: &Drain| match d.name.as_str() {
        "broker" => "broker publish, no database".to_owned(),
        "raw-naive" => "raw SQL loop, index (status, available_at)".to_owned(),
        "raw-tuned" => "raw SQL loop, partial index on pending".to_owned(),
        "raw-relay-indexes" => {
            "raw SQL loop, (status, available_at) + the relay's indexes".to_owned()
        }
        _ => format!("outbox::Relay x{}", d.relays),
    };
    let mut drains: Vec<&Drain> = [
        &r.broker,
        &r.baseline_naive,
        &r.baseline_tuned,
        &r.baseline_relay_indexes,
        &r.drain,
    ]
    .into_iter()
    .flatten()
    .collect();
    drains.extend(
        r.scaling
            .iter()
            .filter(|d| d.relays != 1 || r.drain.is_none()),
    );

    let mut t = Table::new([
        "throughput",
        "msg/s",
        "x naive",
        "x tuned",
        "x broker",
        "x 1 relay",
        "last/first 10%",
        "seconds",
        "load",
    ]);
    for d in &drains {
        t.row([
            label(d),
            fmt_count(d.rate),
            fmt_ratio(d.vs_naive),
            fmt_ratio(d.vs_tuned),
            fmt_ratio(d.vs_broker),
            fmt_ratio(d.vs_one_relay),
            fmt_fixed(d.flatness, 2),
            format!("{:.1}", d.seconds),
            fmt_load(d.load),
        ]);
    }
    section("Throughput (ratios against the baselines of this run)", &t);

    let mut t = Table::new(
        std::iter::once("rate per tenth (msg/s)".to_owned())
            .chain((1..=10).map(|k| format!("{}%", k * 10))),
    );
    for d in drains.iter().filter(|d| !d.deciles.is_empty()) {
        t.row(std::iter::once(label(d)).chain(d.deciles.iter().map(|v| fmt_count(*v))));
    }
    section("Rate in each tenth of the drain", &t);

    // CPU per message of each side, for every drain and consumer that measured it.
    let measured: Vec<(String, &Drain)> = drains
        .iter()
        .map(|d| (label(d), *d))
        .chain(r.consume.iter().map(|d| (d.name.clone(), d)))
        .filter(|(_, d)| !d.cpu_us_per_message.is_empty())
        .collect();
    let sides: std::collections::BTreeSet<&String> = measured
        .iter()
        .flat_map(|(_, d)| d.cpu_us_per_message.keys())
        .collect();
    let mut t = Table::new(
        std::iter::once("CPU per message (µs)".to_owned())
            .chain(sides.iter().map(|s| s.to_string())),
    );
    for (name, d) in &measured {
        t.row(
            std::iter::once(name.clone()).chain(
                sides
                    .iter()
                    .map(|s| fmt_fixed(d.cpu_us_per_message.get(*s).copied(), 1)),
            ),
        );
    }
    section(
        "CPU per message (process: the relay, the raw loop or the consumer, with the bench's \
         sampling; servers on this machine by name; sides under a tenth of a core left out)",
        &t,
    );

    let mut t = Table::new([
        "consumer",
        "msg/s",
        "x raw consumer",
        "x 1 msg/transaction",
        "batches",
        "last/first 10%",
        "seconds",
        "load",
    ]);
    for d in &r.consume {
        t.row([
            match d.name.as_str() {
                "consume-raw" => "raw consumer: ack, no database".to_owned(),
                "consume-inbox-1" => "inbox, 1 message per transaction".to_owned(),
                _ => "inbox, batched transactions".to_owned(),
            },
            fmt_count(d.rate),
            fmt_ratio(d.vs_raw_consumer),
            fmt_ratio(d.vs_inbox_1),
            d.inbox_batches.map_or("-".into(), |b| fmt_count(b as f64)),
            fmt_fixed(d.flatness, 2),
            format!("{:.1}", d.seconds),
            fmt_load(d.load),
        ]);
    }
    section(
        "Consumers (same run, same messages, a consumer group each)",
        &t,
    );

    let mut t = Table::new([
        "database cost",
        "stmts/msg",
        "rows affected/msg",
        "pg rows written/msg",
        "ins/upd/del",
        "dead tuples before -> after",
        "index size before -> after",
        "load",
    ]);
    for d in drains
        .iter()
        .filter(|d| d.cost.is_some() || d.table.is_some())
    {
        let c = d.cost.as_ref();
        let pg = c.and_then(|c| c.pg.as_ref());
        let stmts = c.filter(|c| c.statements > 0);
        // A figure of the table before the drain and after it.
        let growth = |figure: fn(&TableStats) -> String| {
            d.table.as_ref().map_or("-".into(), |g| {
                format!("{} -> {}", figure(&g.before), figure(&g.after))
            })
        };
        t.row([
            label(d),
            fmt_fixed(stmts.map(|c| c.statements_per_message), 4),
            fmt_fixed(stmts.map(|c| c.rows_affected_per_message), 2),
            fmt_fixed(pg.map(|p| p.rows_written_per_message), 2),
            pg.map_or("-".into(), |p| {
                format!("{}/{}/{}", p.inserted, p.updated, p.deleted)
            }),
            growth(|s| fmt_count(s.dead_tuples as f64)),
            growth(|s| fmt_mib(s.index_bytes)),
            fmt_load(d.load),
        ]);
    }
    section("Database cost of the drains", &t);

    let mut t = Table::new([
        "commit -> ack (ms)",
        "offered/s",
        "commits/s",
        "p50",
        "p90",
        "p99",
        "max",
        "received p50",
        "received p99",
        "stmts/msg",
        "load",
    ]);
    for l in &r.latency {
        let p = l.commit_to_ack;
        let q = l.commit_to_received;
        t.row([
            format!("wake-up {}", l.wakeup),
            l.offered_rate.map_or("max".into(), fmt_count),
            fmt_count(l.commit_rate),
            fmt_ms(p.map(|p| p.p50_ms)),
            fmt_ms(p.map(|p| p.p90_ms)),
            fmt_ms(p.map(|p| p.p99_ms)),
            fmt_ms(p.map(|p| p.max_ms)),
            fmt_ms(q.map(|p| p.p50_ms)),
            fmt_ms(q.map(|p| p.p99_ms)),
            fmt_fixed(l.relay_statements_per_message, 3),
            fmt_load(l.load),
        ]);
    }
    section(
        "Steady state: database clock before COMMIT -> broker ack (relay) / received (subscriber)",
        &t,
    );

    let mut t = Table::new([
        "pipeline",
        "committed msg/s",
        "end-to-end msg/s",
        "ack p50",
        "ack p99",
        "effect p50",
        "effect p90",
        "effect p99",
        "effect max",
        "inbox txs",
        "load",
    ]);
    for p in &r.pipeline {
        let (a, e) = (p.commit_to_ack, p.commit_to_effect);
        t.row([
            format!(
                "{}{}",
                p.offered_rate.map_or("producers at max".into(), |r| {
                    format!("paced at {} msg/s", fmt_count(r))
                }),
                match p.messages_per_transaction {
                    1 => String::new(),
                    n => format!(", {n} msgs/tx"),
                }
            ),
            fmt_count(p.commit_rate),
            fmt_count(p.end_to_end_rate),
            fmt_ms(a.map(|p| p.p50_ms)),
            fmt_ms(a.map(|p| p.p99_ms)),
            fmt_ms(e.map(|p| p.p50_ms)),
            fmt_ms(e.map(|p| p.p90_ms)),
            fmt_ms(e.map(|p| p.p99_ms)),
            fmt_ms(e.map(|p| p.max_ms)),
            fmt_count(p.inbox_batches as f64),
            fmt_load(p.load),
        ]);
    }
    section(
        "End to end: producers -> relay -> broker -> inbox consumer (ms from the database clock \
         before COMMIT to the broker ack / to the consumer's ack after its inbox commit)",
        &t,
    );

    for e in [&r.enqueue_fixed_rate, &r.enqueue].into_iter().flatten() {
        let mut t = Table::new([
            "business transaction",
            "tx/s",
            "tx p50 ms",
            "tx p99 ms",
            "commit p50 ms",
            "commit p99 ms",
            "load",
        ]);
        let mut variants = vec![
            ("without outbox", &e.without),
            ("with outbox (store.begin/commit)", &e.with_outbox),
        ];
        if let Some(w) = &e.with_outbox_trigger {
            variants.push(("with outbox (NOTIFY in the tx)", w));
        }
        for (name, v) in variants {
            t.row([
                name.to_owned(),
                fmt_count(v.rate),
                fmt_ms(v.transaction.map(|p| p.p50_ms)),
                fmt_ms(v.transaction.map(|p| p.p99_ms)),
                fmt_ms(v.commit.map(|p| p.p50_ms)),
                fmt_ms(v.commit.map(|p| p.p99_ms)),
                fmt_load(e.load),
            ]);
        }
        let pct = |o: Option<f64>| o.map_or("-".into(), |o| format!("{:+.1}%", o * 100.0));
        t.row([
            "overhead (store.begin/commit)".to_owned(),
            String::new(),
            pct(e.overhead_p50),
            pct(e.overhead_p99),
        ]);
        if e.with_outbox_trigger.is_some() {
            t.row([
                "overhead (NOTIFY in the tx)".to_owned(),
                String::new(),
                pct(e.overhead_trigger_p50),
                pct(e.overhead_trigger_p99),
            ]);
        }
        let title = match e.offered_rate {
            Some(r) => format!("Enqueue overhead at {} transactions/s", fmt_count(r)),
            None => "Enqueue overhead at the producers' maximum".to_owned(),
        };
        section(&title, &t);
    }

    if let Some(i) = &r.idle {
        let mut t = Table::new([
            "idle relay",
            "stmts/s",
            "stmts/poll interval",
            "table scans/s",
            "db commits/s (all clients)",
            "load",
        ]);
        t.row([
            format!(
                "poll interval {} ms, {:.0} s",
                i.poll_interval_ms, i.seconds
            ),
            format!("{:.2}", i.statements_per_second),
            format!("{:.2}", i.statements_per_poll_interval),
            fmt_fixed(i.table_scans_per_second, 2),
            fmt_fixed(i.db_commits_per_second_all_clients, 2),
            fmt_load(i.load),
        ]);
        section("Idle cost", &t);
    }

    if let Some(m) = &r.metrics_cost {
        let mut t = Table::new(["metrics export", "msg/s", "seconds", "load"]);
        let mut row = |what: &str, d: &Drain| {
            t.row([
                what.to_owned(),
                fmt_count(d.rate),
                format!("{:.1}", d.seconds),
                fmt_load(d.load),
            ])
        };
        let (off, on) = (&m.off, &m.on);
        let order = [
            (off.first(), "off"),
            (on.first(), "on"),
            (on.get(1), "on"),
            (off.get(1), "off"),
        ];
        for (d, what) in order {
            if let Some(d) = d {
                row(what, d);
            }
        }
        t.row([
            format!("on / off ({} scrapes)", m.scrapes),
            fmt_ratio(m.ratio),
        ]);
        section(
            "Cost of the Prometheus metrics (drain without / with the export)",
            &t,
        );
    }

    if let Some(s) = &r.search {
        let mut t = Table::new([
            "search",
            "no index ms",
            "max",
            "order",
            "indexed ms",
            "max",
            "order",
            "rows",
        ]);
        for q in &s.queries {
            t.row([
                q.name.clone(),
                format!("{:.1}", q.without.median_ms),
                format!("{:.1}", q.without.max_ms),
                q.without.order.clone(),
                format!("{:.1}", q.with.median_ms),
                format!("{:.1}", q.with.max_ms),
                q.with.order.clone(),
                q.with.rows.to_string(),
            ]);
        }
        section(
            &format!(
                "Admin search on {} rows (filled in {:.0} s; search indexes built in {:.0} s)",
                fmt_count(s.rows as f64),
                s.fill_seconds,
                s.index_build_seconds
            ),
            &t,
        );
        let mut t = Table::new(["search indexes", "load msg/s", "drain msg/s", "drain load"]);
        for round in &s.rounds {
            t.row([
                if round.indexes { "with" } else { "without" }.to_owned(),
                fmt_count(round.load_rate),
                fmt_count(round.drain.rate),
                fmt_load(round.drain.load),
            ]);
        }
        t.row([
            "with / without".to_owned(),
            fmt_ratio(s.load_ratio),
            fmt_ratio(s.drain_ratio),
        ]);
        section(
            "Cost of the search indexes (keyed messages loaded, then drained by one relay)",
            &t,
        );
    }

    if let Some(r) = &r.retention {
        let mut t = Table::new([
            "retention",
            "rows removed",
            "seconds",
            "rows/s",
            "transactions/rounds",
            "carried",
        ]);
        for (what, m) in [
            ("row by row (plain table)", &r.delete),
            ("day partitions dropped", &r.partitions),
        ] {
            t.row([
                what.to_owned(),
                fmt_count(m.rows as f64),
                format!("{:.1}", m.seconds),
                fmt_count(m.rate),
                m.steps.to_string(),
                m.carried.to_string(),
            ]);
        }
        t.row([
            "partitions / rows".to_owned(),
            String::new(),
            String::new(),
            fmt_ratio(r.ratio),
        ]);
        section(
            &format!(
                "Retention of {} rows past one hour (PostgreSQL)",
                fmt_count(r.rows as f64)
            ),
            &t,
        );
    }

    let mut t = Table::new([
        "databases",
        "msg/s",
        "x 1 database",
        "each database (msg/s)",
        "msg per CPU s: relays",
        "database",
        "broker",
        "seconds",
        "load",
    ]);
    for d in &r.databases {
        // Messages per CPU second of the first of `sides` that was measured.
        let per_cpu = |sides: &[&str]| {
            sides
                .iter()
                .find_map(|s| d.messages_per_cpu_second.get(*s))
                .map_or("-".into(), |v| fmt_count(*v))
        };
        t.row([
            d.databases.to_string(),
            fmt_count(d.rate),
            fmt_ratio(d.vs_one_database),
            d.per_database
                .iter()
                .map(|v| fmt_count(*v))
                .collect::<Vec<_>>()
                .join(" / "),
            per_cpu(&["relays"]),
            per_cpu(&["postgres", "mariadb"]),
            per_cpu(&["nats", "redis", "rabbitmq"]),
            format!("{:.1}", d.seconds),
            fmt_load(d.load),
        ]);
    }
    section(
        "One relay group, many databases (CPU of the servers on this machine)",
        &t,
    );

    let mut t = Table::new(["target (issue 6)", "goal", "measured", "met"]);
    for g in &r.targets {
        t.row([
            g.name.clone(),
            g.goal.clone(),
            fmt_fixed(g.value, 2),
            match g.met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "not measured".into(),
            },
        ]);
    }
    section("Targets", &t);
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}
