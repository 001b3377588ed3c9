//! Log output as a log collector reads it: no terminal colour codes when standard error is not a
//! terminal, and `--log-format json` (or `OUTBOX_LOG_FORMAT=json`) one JSON object per line.

use super::*;

/// `outbox migrate` on a new SQLite file (it logs one line per migration): its standard error.
fn migrate_log(f: &Fixture, file: &str, extra: &[&str], env: Option<(&str, &str)>) -> String {
    let db = format!("sqlite://{}", f.dir.join(file).display());
    let mut cmd = outbox();
    cmd.args(extra).args(["migrate", "--database", &db]);
    cmd.env_remove("NO_COLOR").env_remove("OUTBOX_LOG_FORMAT");
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?} failed");
    String::from_utf8(out.stderr).expect("UTF-8 log")
}

#[test]
fn logs_carry_no_colour_codes_off_a_terminal_and_json_on_request() {
    let f = Fixture::new("logs");
    let text = migrate_log(&f, "text.db", &[], None);
    assert!(text.contains("applied SQLite migration"), "{text}");
    assert!(
        !text.contains('\x1b'),
        "colour codes in a log file: {text:?}"
    );
    for (file, extra, env) in [
        ("json.db", &["--log-format", "json"][..], None),
        ("env.db", &[][..], Some(("OUTBOX_LOG_FORMAT", "json"))),
    ] {
        let json = migrate_log(&f, file, extra, env);
        let lines: Vec<&str> = json.lines().collect();
        assert!(!lines.is_empty());
        for line in lines {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            assert_eq!(v["level"], "INFO", "{line}");
            assert!(v["fields"]["message"].is_string(), "{line}");
        }
    }
}

/// `[logging] summary_interval`: with nothing scraping, the log shows the relay's progress.
#[tokio::test]
async fn the_daemon_logs_a_periodic_summary() {
    let (f, pool, js) = Fixture::started("summary").await;
    let relay = "poll_interval = \"200ms\"\nlease = \"3s\"\npublish_timeout = \"1s\"\n";
    let mut toml = f.toml(relay, &f.route("order-*"));
    toml.push_str("\n[logging]\nsummary_interval = \"300ms\"\n");
    let config = f.write("summary.toml", &toml);
    let _relays = Relays(vec![f.spawn_relay_logged(&config, "summary")]);
    for i in 0..5 {
        insert_message(&pool, &f.table, "order-created", format!("{i}")).await;
    }
    wait_until_sent(&pool, &f.table, 5, Duration::from_secs(20)).await;
    let log = f.dir.join("summary.log");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        // The five may be spread over several lines: sum them.
        let published: u64 = text
            .lines()
            .filter(|l| l.contains("summary of the last"))
            .filter_map(|l| l.split("published=").nth(1))
            .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        if published == 5 && text.contains("pending=0") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no summary lines adding up to 5 published: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    js.delete_stream(&f.stream).await.unwrap();
}
