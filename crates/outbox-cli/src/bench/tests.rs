use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn parse(extra: &[&str]) -> Result<BenchArgs, String> {
    let mut argv = vec!["bench", "--database", "postgres://u@h/db"];
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
    cli.args.validate()?;
    Ok(cli.args)
}

#[test]
fn defaults_match_the_issue() {
    let a = parse(&[]).unwrap();
    assert_eq!(a.messages, 1_000_000);
    assert_eq!(a.payload_bytes, 256);
    assert_eq!(a.batch_size, 500);
    assert_eq!(a.relays, vec![1, 2, 4]);
    assert_eq!(a.transport, "nats://127.0.0.1:4222");
    assert_eq!(a.only.len(), 7, "every scenario by default");
    assert_eq!(a.in_flight(), RelayConfig::default().in_flight_batches);
    assert_eq!(a.warmup(), Duration::from_secs(1));
}

#[test]
fn scenarios_and_lists_parse() {
    let a = parse(&[
        "--only",
        "drain,latency",
        "--relays",
        "2,8",
        "--transport",
        "memory",
    ])
    .unwrap();
    assert_eq!(a.only, vec![Scenario::Drain, Scenario::Latency]);
    assert!(a.runs(Scenario::Drain) && !a.runs(Scenario::Broker));
    assert_eq!(a.relays, vec![2, 8]);
    assert!(parse(&["--only", "drain,nonsense"]).is_err());
    // A short latency run warms up for a fifth of it.
    let a = parse(&["--latency-duration", "2s"]).unwrap();
    assert_eq!(a.warmup(), Duration::from_millis(400));
}

#[test]
fn bad_options_are_named() {
    // Each value is refused naming its option.
    let cases: [(&str, &str); 12] = [
        ("--messages", "9"),
        ("--payload-bytes", "0"),
        ("--payload-bytes", "2000000"),
        ("--batch-size", "0"),
        ("--in-flight", "0"),
        ("--broker-window", "0"),
        ("--relays", "0,2"),
        ("--rate", "0"),
        ("--producers", "0"),
        ("--idle-duration", "500ms"),
        ("--transport", "mqtt://x:1883"),
        ("--rate", "NaN"),
    ];
    for (option, value) in cases {
        let args = [option, value];
        let e = parse(&args).unwrap_err();
        assert!(e.contains(option), "{args:?}: {e}");
    }
    // The databases scenario needs its databases, each a database URL.
    let e = parse(&["--only", "databases"]).unwrap_err();
    assert!(e.contains("--databases"), "{e}");
    let e = parse(&["--databases", "redis://x"]).unwrap_err();
    assert!(e.contains("--databases"), "{e}");
    let a = parse(&[
        "--only",
        "databases",
        "--databases",
        "postgres://u@h2/db",
        "sqlite://b.db",
        "--databases",
        "mysql://u@h3/db",
    ])
    .unwrap();
    assert_eq!(a.databases.len(), 3);
    let mut argv = vec!["bench", "--database", "redis://x"];
    argv.push("--messages");
    argv.push("100");
    let cli = Cli::try_parse_from(argv).unwrap();
    let e = cli.args.validate().unwrap_err();
    assert!(e.contains("--database"), "{e}");
}

#[test]
fn render_shows_ratios_and_load_beside_each_figure() {
    let mut r = Report {
        baseline_tuned: Some(Drain {
            name: "raw-tuned".into(),
            relays: 1,
            rate: 10_000.0,
            load: Some([1.5, 1.0, 1.0]),
            ..Drain::default()
        }),
        drain: Some(Drain {
            name: "relay".into(),
            relays: 1,
            rate: 20_000.0,
            deciles: vec![20_000.0; 10],
            load: Some([2.25, 1.0, 1.0]),
            ..Drain::default()
        }),
        ..Report::default()
    };
    report::fill_ratios(&mut r);
    r.targets = report::targets(&r);
    let text = render(&r);
    let relay_line = text
        .lines()
        .find(|l| l.starts_with("outbox::Relay x1") && l.contains("20,000"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(relay_line.contains("2.00x"), "{relay_line}");
    assert!(relay_line.trim_end().ends_with("2.25"), "{relay_line}");
    assert!(text.contains("Rate in each tenth"), "{text}");
    assert!(text.contains("drain vs tuned raw-SQL loop"), "{text}");
    // Sections without figures are left out.
    assert!(
        !text.contains("Enqueue overhead") && !text.contains("Idle cost"),
        "{text}"
    );
}
