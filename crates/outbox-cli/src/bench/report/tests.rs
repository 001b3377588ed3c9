use super::*;

#[test]
fn percentiles_of_known_values() {
    // 1..=1000 ms in microseconds.
    let p = Percentiles::of_micros((1..=1000u64).map(|ms| ms * 1000)).unwrap();
    assert_eq!(p.count, 1000);
    assert!((p.p50_ms - 500.0).abs() <= 0.5, "{p:?}");
    assert!((p.p90_ms - 900.0).abs() <= 0.5, "{p:?}");
    assert!((p.p99_ms - 990.0).abs() <= 1.0, "{p:?}");
    assert!((p.max_ms - 1000.0).abs() <= 1.0, "{p:?}");
    assert_eq!(Percentiles::of_micros(std::iter::empty()), None);
    // Zero is recorded as one microsecond, not dropped.
    assert_eq!(Percentiles::of_micros([0]).unwrap().count, 1);
}

#[test]
fn ratios_need_both_sides_and_a_positive_base() {
    assert_eq!(ratio(Some(30.0), Some(10.0)), Some(3.0));
    assert_eq!(ratio(Some(30.0), None), None);
    assert_eq!(ratio(None, Some(10.0)), None);
    assert_eq!(ratio(Some(30.0), Some(0.0)), None);
    assert_eq!(ratio(Some(f64::INFINITY), Some(1.0)), None);
}

#[test]
fn crossing_interpolates_between_samples() {
    let s = [(1.0, 100), (2.0, 300), (3.0, 300), (4.0, 400)];
    assert_eq!(crossing(&s, 50), Some(0.5));
    assert_eq!(crossing(&s, 100), Some(1.0));
    assert_eq!(crossing(&s, 200), Some(1.5));
    assert_eq!(crossing(&s, 300), Some(2.0));
    assert_eq!(crossing(&s, 350), Some(3.5));
    assert_eq!(crossing(&s, 401), None);
    assert_eq!(crossing(&[], 1), None);
}

#[test]
fn decile_rates_of_a_steady_and_a_slowing_drain() {
    // 1000 messages at 100/s: each tenth takes one second.
    let steady: Vec<(f64, u64)> = (1..=100).map(|i| (i as f64 / 10.0, i * 10)).collect();
    let d = decile_rates(&steady, 1000);
    assert_eq!(d.len(), 10);
    assert!(d.iter().all(|r| (r - 100.0).abs() < 1e-6), "{d:?}");
    assert!((flatness(&d).unwrap() - 1.0).abs() < 1e-9);
    // The second half twice as slow.
    let mut slowing: Vec<(f64, u64)> = (1..=5).map(|i| (i as f64, i * 100)).collect();
    slowing.extend((1..=5).map(|i| (5.0 + 2.0 * i as f64, 500 + i * 100)));
    let d = decile_rates(&slowing, 1000);
    assert!(
        (d[0] - 100.0).abs() < 1e-6 && (d[9] - 50.0).abs() < 1e-6,
        "{d:?}"
    );
    assert!((flatness(&d).unwrap() - 0.5).abs() < 1e-9);
    // Not enough messages, or a drain that never finished.
    assert!(decile_rates(&steady, 9).is_empty());
    assert!(decile_rates(&steady, 2000).is_empty());
    // A total not divisible by ten still covers every message once.
    let odd: Vec<(f64, u64)> = (1..=13).map(|i| (i as f64, i)).collect();
    let d = decile_rates(&odd, 13);
    assert_eq!(d.len(), 10);
}

fn drain(name: &str, relays: usize, rate: f64) -> Drain {
    Drain {
        name: name.into(),
        relays,
        rate,
        ..Drain::default()
    }
}

#[test]
fn ratios_and_targets_from_one_report() {
    let mut r = Report {
        broker: Some(drain("broker", 1, 100_000.0)),
        baseline_naive: Some(drain("raw-naive", 1, 5_000.0)),
        baseline_tuned: Some(drain("raw-tuned", 1, 15_000.0)),
        drain: Some(Drain {
            flatness: Some(0.9),
            ..drain("relay", 1, 30_000.0)
        }),
        scaling: vec![drain("relay", 1, 20_000.0), drain("relay", 4, 36_000.0)],
        ..Report::default()
    };
    fill_ratios(&mut r);
    let d = r.drain.as_ref().unwrap();
    assert_eq!(d.vs_naive, Some(6.0));
    assert_eq!(d.vs_tuned, Some(2.0));
    assert_eq!(d.vs_broker, Some(0.3));
    // Scaling compares with its own one-relay run when it has one.
    assert_eq!(r.scaling[1].vs_one_relay, Some(1.8));
    let t = targets(&r);
    let met = |name: &str| t.iter().find(|t| t.name.starts_with(name)).unwrap().met;
    assert_eq!(met("drain vs tuned"), Some(true));
    assert_eq!(met("drain vs naive"), Some(true));
    assert_eq!(met("drain vs raw broker"), Some(false));
    assert_eq!(met("drain flatness"), Some(true));
    assert_eq!(met("4 relays"), Some(true));
    // Not measured in this report.
    assert_eq!(met("commit -> ack p50"), None);
    assert_eq!(met("outbox insert"), None);
}

#[test]
fn latency_target_takes_the_worse_wakeup_at_max_rate() {
    let p = |p50, p99| Percentiles {
        count: 1,
        p50_ms: p50,
        p90_ms: p50,
        p99_ms: p99,
        max_ms: p99,
    };
    let run = |wakeup: &str, offered, lat| LatencyRun {
        wakeup: wakeup.into(),
        offered_rate: offered,
        commit_to_ack: Some(lat),
        ..LatencyRun::default()
    };
    let latency = vec![
        run("embedded", Some(1000.0), p(100.0, 900.0)), // fixed rate: not the target's
        run("embedded", None, p(2.0, 8.0)),
        run("external", None, p(4.0, 30.0)),
    ];
    let mut r = Report {
        database: DatabaseInfo {
            backend: "postgres".into(),
            ..DatabaseInfo::default()
        },
        latency,
        enqueue: Some(Enqueue {
            overhead_p50: Some(0.07),
            ..Enqueue::default()
        }),
        ..Report::default()
    };
    let t = targets(&r);
    let get = |name: &str| t.iter().find(|t| t.name.starts_with(name)).unwrap().clone();
    assert_eq!(get("commit -> ack p50").value, Some(4.0));
    assert_eq!(get("commit -> ack p99").met, Some(false));
    let o = get("outbox insert");
    assert!((o.value.unwrap() - 7.0).abs() < 1e-9 && o.met == Some(true));
    // On MySQL/SQLite the external mode is the poll timer: only the in-process wake-up counts.
    r.database.backend = "mysql".into();
    let t = targets(&r);
    let p50 = t
        .iter()
        .find(|t| t.name.starts_with("commit -> ack p50"))
        .unwrap();
    assert_eq!((p50.value, p50.met), (Some(2.0), Some(true)));
}

#[test]
fn table_aligns_columns() {
    let mut t = Table::new(["what", "msg/s", "load"]);
    t.row(["relay", "12,345", "1.20"]);
    t.row(["raw loop, naive index", "5", ""]);
    assert_eq!(
        t.render(),
        "what                    msg/s  load\n\
         -----------------------------------\n\
         relay                  12,345  1.20\n\
         raw loop, naive index       5\n"
    );
    assert!(!t.is_empty());
    assert!(Table::new(["a"]).is_empty());
}

#[test]
fn number_formats() {
    assert_eq!(fmt_count(1_234_567.6), "1,234,568");
    assert_eq!(fmt_count(999.0), "999");
    assert_eq!(fmt_count(1000.0), "1,000");
    assert_eq!(fmt_count(-1500.0), "-1,500");
    assert_eq!(fmt_count(f64::NAN), "-");
    assert_eq!(fmt_ratio(Some(1.5)), "1.50x");
    assert_eq!(fmt_ratio(None), "-");
    assert_eq!(fmt_ms(Some(4.567)), "4.57");
    assert_eq!(fmt_mib(3 * 1024 * 1024 / 2), "1.5 MiB");
    assert_eq!(fmt_load(Some([2.5, 1.0, 0.5])), "2.50");
    assert_eq!(fmt_load(None), "-");
}

#[test]
fn loadavg_parses() {
    assert_eq!(
        parse_loadavg("0.52 0.58 0.59 1/467 12345\n"),
        Some([0.52, 0.58, 0.59])
    );
    assert_eq!(parse_loadavg("garbage"), None);
    assert_eq!(parse_loadavg(""), None);
}

#[test]
fn clock_offset_uses_the_fastest_round_trip() {
    // (sent, db, received): the second sample has the smallest round trip (10 µs).
    let o =
        ClockOffset::estimate(&[(0, 1_000, 100), (200, 1_210, 210), (300, 5_000, 400)]).unwrap();
    assert_eq!(o.offset_us, 1_005);
    assert_eq!(o.uncertainty_us, 5);
    assert_eq!(ClockOffset::estimate(&[]), None);
}
