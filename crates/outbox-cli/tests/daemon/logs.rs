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
