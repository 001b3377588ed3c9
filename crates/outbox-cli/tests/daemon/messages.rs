//! `outbox messages …` and `outbox admin` as an operator runs them (docs/operations.md, "Admin
//! API"): the command-line twin of every API action, with exit codes a script can trust.

use std::io::BufRead as _;

use super::*;

fn messages(db: &str, args: &[&str]) -> Command {
    let mut cmd = outbox();
    cmd.arg("messages").args(args).args(["--database", db]);
    cmd
}

#[test]
fn messages_commands_list_show_requeue_publish_now_and_discard() {
    let f = Fixture::new("messages");
    let db = sqlite_with_rows(
        &f,
        "msgs.db",
        &[
            (
                Status::Failed,
                16,
                Some("attempts exhausted: broker said no"),
            ),
            (Status::Failed, 3, Some("permanent: too large")),
            (Status::Sent, 1, None),
            (Status::Pending, 0, None),
        ],
    );

    let listed: serde_json::Value = serde_json::from_str(&succeeds(&mut messages(
        &db,
        &["list", "--state", "failed", "--json"],
    )))
    .expect("list --json prints JSON");
    let ids: Vec<i64> = listed["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, vec![2, 1], "newest first");
    let table = succeeds(&mut messages(&db, &["list", "--error", "BROKER"]));
    assert!(
        table.contains("attempts exhausted") && !table.contains("too large"),
        "{table}"
    );

    let shown = succeeds(&mut messages(&db, &["show", "1"]));
    assert!(shown.contains("state FAILED"), "{shown}");
    assert!(shown.contains("last error: attempts exhausted"), "{shown}");
    assert!(shown.contains("payload (hex, 1 bytes)"), "{shown}");
    let missing = fails(&mut messages(&db, &["show", "99"]));
    assert!(missing.contains("no message 99"), "{missing}");

    // Ids named and not changed: each named with why, and the command fails.
    let out = messages(&db, &["requeue", "1", "3", "99"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("requeue: 2 message(s) changed"), "{stdout}");
    assert!(
        stdout.contains("id 99: not changed: no such message"),
        "{stdout}"
    );
    let out = messages(&db, &["publish-now", "4"]).output().unwrap();
    assert!(!out.status.success(), "a due PENDING row is not changed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("already due"));
    // Neither ids nor --all: refused before anything runs.
    fails(&mut messages(&db, &["discard"]));

    let out = succeeds(&mut messages(
        &db,
        &["discard", "--all", "--state", "failed"],
    ));
    assert!(out.contains("discard: 1 message(s) changed"), "{out}");
    let report: serde_json::Value = serde_json::from_str(&succeeds(&mut messages(
        &db,
        &["discard", "--all", "--json"],
    )))
    .unwrap();
    assert_eq!(report["changed"], 0, "nothing FAILED is left");

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT id, status FROM outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
        let pending = i64::from(Status::Pending.as_i16());
        assert_eq!(rows, vec![(1, pending), (3, pending), (4, pending)]);
        let archived: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, archive_reason FROM outbox_archive")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(archived, vec![(2, "discarded".to_owned())]);
    });
}

/// `outbox admin` serves the API for a database; a change without the token is refused with
/// 401, with it the change is made.
#[test]
fn admin_command_serves_the_api_with_its_token() {
    let f = Fixture::new("adminapi");
    let db = sqlite_with_rows(&f, "api.db", &[(Status::Failed, 16, Some("exhausted"))]);
    let mut child = outbox()
        .args(["admin", "--database", &db, "--listen", "127.0.0.1:0"])
        .args(["--token-env", "OUTBOX_TEST_ADMIN_TOKEN"])
        .env("OUTBOX_TEST_ADMIN_TOKEN", "tok")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (code, body) = request(&addr, "GET", "/api/messages?state=failed", None, "").await;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("\"exhausted\""), "{body}");
        let select = r#"{"ids":[1]}"#;
        let (code, _) = request(&addr, "POST", "/api/messages/requeue", None, select).await;
        assert_eq!(code, 401);
        let (code, body) =
            request(&addr, "POST", "/api/messages/requeue", Some("tok"), select).await;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("\"changed\":1"), "{body}");

        // Two-phase messages for producers in other languages (issue 16).
        let prepare = r#"{"topic":"orders","payload":"{\"id\":1}","check_back":"https://orders.example/check-back","check_after":"1h"}"#;
        let (code, _) = request(&addr, "POST", "/api/prepared", None, prepare).await;
        assert_eq!(code, 401, "preparing needs the token");
        let (code, body) = request(&addr, "POST", "/api/prepared", Some("tok"), prepare).await;
        assert_eq!(code, 201, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let id = v["message_id"].as_str().unwrap().to_owned();
        let (code, body) = request(&addr, "GET", &format!("/api/messages/{id}"), None, "").await;
        assert!(code == 200 && body.contains("\"PREPARED\""), "{code} {body}");
        assert!(body.contains("https://orders.example/check-back"), "the target shows: {body}");
        let again = prepare.replacen('{', &format!(r#"{{"message_id":"{id}","#), 1);
        let (code, body) = request(&addr, "POST", "/api/prepared", Some("tok"), &again).await;
        assert!(code == 409 && body.contains("already"), "a second prepare: {code} {body}");
        let commit = format!("/api/prepared/{id}/commit");
        let (code, body) = request(&addr, "POST", &commit, Some("tok"), "").await;
        assert!(code == 200 && body.contains("\"now\""), "{code} {body}");
        let (code, body) = request(&addr, "POST", &commit, Some("tok"), "").await;
        assert!(code == 200 && body.contains("\"already\""), "{code} {body}");
        let rollback = format!("/api/prepared/{id}/rollback");
        let (code, body) = request(&addr, "POST", &rollback, Some("tok"), "").await;
        assert!(code == 409 && body.contains("PENDING"), "a late rollback loses: {code} {body}");
        let unknown = "/api/prepared/0190a0a0-0000-7000-8000-000000000000/commit";
        let (code, _) = request(&addr, "POST", unknown, Some("tok"), "").await;
        assert_eq!(code, 404);
        let bad = r#"{"topic":"orders","payload":"x","check_back":"ftp://nowhere"}"#;
        let (code, body) = request(&addr, "POST", "/api/prepared", Some("tok"), bad).await;
        assert!(code == 400 && body.contains("check_back"), "{code} {body}");
    });
    child.kill().unwrap();
    child.wait().unwrap();
}

/// One HTTP/1.0 request: status and body.
pub(super) async fn request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, body.to_owned())
}

/// `outbox keys blocked` names a key whose dead letter holds PENDING messages back, and `outbox
/// relays` reads the membership (none alive here: every bucket without a live lease).
#[test]
fn keys_blocked_and_relays_commands() {
    let f = Fixture::new("keys");
    let db = sqlite_with_rows(&f, "keys.db", &[]);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        for (i, (status, key, error)) in [
            (Status::Sent, "k1", None),
            (Status::Failed, "k1", Some("poison")),
            (Status::Pending, "k1", None),
            (Status::Pending, "k1", None),
            (Status::Pending, "k2", None),
        ]
        .into_iter()
        .enumerate()
        {
            sqlx::query(
                "INSERT INTO outbox (message_id, topic, partition_key, payload, status, last_error) \
                 VALUES (?1, 't', ?2, x'01', ?3, ?4)",
            )
            .bind(format!("00000000-0000-7000-8000-{:012}", i + 1))
            .bind(key)
            .bind(status.as_i16())
            .bind(error)
            .execute(&pool)
            .await
            .unwrap();
        }
    });
    let out = succeeds(outbox().args(["keys", "blocked", "--database", &db]));
    assert!(out.contains("k1") && out.contains("poison"), "{out}");
    assert!(!out.contains("k2"), "{out}");
    let keys: serde_json::Value = serde_json::from_str(&succeeds(outbox().args([
        "keys",
        "blocked",
        "--json",
        "--database",
        &db,
    ])))
    .unwrap();
    assert_eq!(keys[0]["held_by"], 2);
    assert_eq!(keys[0]["waiting"], 2);
    let out = succeeds(outbox().args(["relays", "--database", &db]));
    assert!(out.contains("64 buckets, 64 without a live lease"), "{out}");
}

/// `outbox archive`: finished rows older than `--older-than` into the archive (or deleted),
/// dead letters only when named, the archive purged on request; a bad state is refused.
/// `outbox migrate --search-indexes` builds the optional indexes (again: nothing to do), and
/// `outbox messages list` with a creation window then lists by creation time, not by id.
#[test]
fn migrate_builds_search_indexes_and_list_orders_a_window_by_time() {
    let f = Fixture::new("search-indexes");
    let rows = [(Status::Sent, 1, None); 4];
    let db = sqlite_with_rows(&f, "search.db", &rows);
    // Row 1 is the newest by creation time, then 3, 2, 4.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        for (id, hours) in [(1, 1), (2, 3), (3, 2), (4, 4)] {
            sqlx::query("UPDATE outbox SET created_at = created_at - ?1 WHERE id = ?2")
                .bind(hours * 3_600_000_i64)
                .bind(id)
                .execute(&pool)
                .await
                .unwrap();
        }
    });
    let after = (chrono::Utc::now() - chrono::Duration::hours(5)).to_rfc3339();
    let list = || -> (Vec<i64>, String) {
        let page: serde_json::Value = serde_json::from_str(&succeeds(&mut messages(
            &db,
            &["list", "--created-after", &after, "--json"],
        )))
        .expect("list --json prints JSON");
        let ids = page["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_i64().unwrap())
            .collect();
        (ids, page["order"].as_str().unwrap().to_owned())
    };
    assert_eq!(list(), (vec![4, 3, 2, 1], "id".to_owned()));
    for _ in 0..2 {
        let out = succeeds(outbox().args(["migrate", "--search-indexes", "--database", &db]));
        assert!(
            out.contains("search indexes of outbox: key true, created true, sent true"),
            "{out}"
        );
    }
    assert_eq!(list(), (vec![1, 3, 2, 4], "created_at".to_owned()));
}

/// `outbox migrate --partitioned` on PostgreSQL: the outbox table partitioned by day, today's
/// partition and the week ahead created, search indexes built with it; again: nothing to do.
/// On SQLite the flag is refused by name.
#[test]
fn migrate_partitioned_creates_day_partitions() {
    let f = Fixture::new("partitioned");
    let migrate = || {
        succeeds(
            outbox()
                .args([
                    "migrate",
                    "--partitioned",
                    "--search-indexes",
                    "--database",
                    &pg_url(),
                ])
                .args([
                    "--table",
                    &f.table,
                    "--inbox-table",
                    &format!("{}_inbox", f.table),
                ]),
        )
    };
    for _ in 0..2 {
        let out = migrate();
        assert!(
            out.contains(&format!("{} is partitioned by day", f.table)),
            "{out}"
        );
        assert!(out.contains("key true, created true, sent true"), "{out}");
    }
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = pg().await;
        let (kind, parts): (String, i64) = sqlx::query_as(
            "SELECT c.relkind::text, (SELECT count(*) FROM pg_inherits WHERE inhparent = c.oid) \
             FROM pg_class c WHERE c.oid = to_regclass($1)",
        )
        .bind(&f.table)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(kind, "p", "partitioned");
        assert_eq!(parts, 9, "today, 7 days ahead and the default partition");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE {t}, {t}_inbox, {t}_inbox_dlq, {t}_archive, {t}_buckets, {t}_relays CASCADE; \
             DELETE FROM outbox_migrations WHERE table_name LIKE '{t}%'",
            t = f.table
        )))
        .execute(&pool)
        .await
        .unwrap();
    });
    let db = format!("sqlite://{}", f.dir.join("p.db").display());
    let e = fails(outbox().args(["migrate", "--partitioned", "--database", &db]));
    assert!(
        e.contains("--partitioned") && e.contains("PostgreSQL"),
        "{e}"
    );
}

#[test]
fn archive_command_moves_finished_rows_and_purges_the_archive() {
    let f = Fixture::new("archive");
    let db = sqlite_with_rows(
        &f,
        "archive.db",
        &[
            (Status::Sent, 1, None),
            (Status::Confirmed, 1, None),
            (Status::Failed, 16, Some("attempts exhausted")),
            (Status::Pending, 0, None),
            (Status::Sent, 1, None),
        ],
    );
    let exec = |sql: &str| {
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&pool)
                .await
                .unwrap();
        })
    };
    // Two days old: the first SENT, the CONFIRMED and the FAILED row; the last SENT row is new.
    let now = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";
    let two_days = 2 * 86_400_000;
    exec(&format!(
        "UPDATE outbox SET sent_at = {now} - {two_days}, confirmed_at = {now} - {two_days}, \
         updated_at = {now} - {two_days} WHERE id IN (1, 2, 3)"
    ));
    exec(&format!("UPDATE outbox SET sent_at = {now} WHERE id = 5"));
    let archive = |args: &[&str]| {
        let mut cmd = outbox();
        cmd.arg("archive").args(args).args(["--database", &db]);
        cmd
    };
    let json = |args: &[&str]| -> serde_json::Value {
        serde_json::from_str(&succeeds(&mut archive(args))).expect("--json prints JSON")
    };

    let r = json(&["--older-than", "1d", "--json"]);
    assert_eq!(r["archived"]["sent"], 1, "{r}");
    assert_eq!(r["archived"]["confirmed"], 1, "{r}");
    assert_eq!(r["archived"]["rejected"], 0, "{r}");
    let r = json(&[
        "--state",
        "failed",
        "--older-than",
        "1d",
        "--delete",
        "--json",
    ]);
    assert_eq!(r["deleted"]["failed"], 1, "{r}");
    let e = fails(&mut archive(&["--state", "finished"]));
    assert!(e.contains("finished") && e.contains("rejected"), "{e}");
    let r = json(&[
        "--state",
        "rejected",
        "--purge-archive-older-than",
        "0s",
        "--json",
    ]);
    assert_eq!(r["archive_purged"], 2, "{r}");

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        let left: Vec<(i64,)> = sqlx::query_as("SELECT id FROM outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(
            left,
            vec![(4,), (5,)],
            "the PENDING and the recent SENT row stay"
        );
        let archived: (i64,) = sqlx::query_as("SELECT count(*) FROM outbox_archive")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(archived.0, 0, "purged");
    });
}

/// `outbox inbox dead-letters|replay|discard`: the inbox half of the admin API from the command
/// line, on dead letters the consumer runner's `Inbox::dead_letter` wrote.
#[test]
fn inbox_commands_list_replay_and_discard_dead_letters() {
    let f = Fixture::new("inbox-cmd");
    let db = sqlite_with_rows(&f, "inbox.db", &[]);
    let ids: Vec<uuid::Uuid> = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
        let inbox = outbox::Inbox::<sqlx::Sqlite>::new(pool, "outbox_inbox", "inventory").unwrap();
        inbox.migrate().await.unwrap();
        let mut ids = Vec::new();
        for i in 0..2 {
            let msg = outbox::InboundMessage {
                message_id: uuid::Uuid::now_v7(),
                topic: "orders.created".into(),
                partition_key: None,
                headers: Default::default(),
                payload: format!("m{i}").into_bytes(),
                delivery_count: 3,
            };
            inbox.dead_letter(&msg, "no stock", 3).await.unwrap();
            ids.push(msg.message_id);
        }
        ids
    });
    let inbox = |args: &[&str]| {
        let mut cmd = outbox();
        cmd.arg("inbox")
            .args(args)
            .args(["--database", &db, "--consumer", "inventory"]);
        cmd
    };
    let listed: serde_json::Value =
        serde_json::from_str(&succeeds(&mut inbox(&["dead-letters", "--json"]))).unwrap();
    assert_eq!(
        listed["dead_letters"].as_array().unwrap().len(),
        2,
        "{listed}"
    );
    assert_eq!(listed["dead_letters"][0]["error"], "no stock", "{listed}");

    let (a, b) = (ids[0].to_string(), ids[1].to_string());
    let missing = uuid::Uuid::now_v7().to_string();
    let out = inbox(&["replay", &a, &missing]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "a missing id fails the command: {stdout}"
    );
    assert!(
        stdout.contains("replay of 1 dead letter(s) requested"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{missing}: not changed")),
        "{stdout}"
    );
    let out = succeeds(&mut inbox(&["discard", &b]));
    assert!(out.contains("discarded 1 dead letter(s)"), "{out}");
    let listed: serde_json::Value =
        serde_json::from_str(&succeeds(&mut inbox(&["dead-letters", "--json"]))).unwrap();
    let left = listed["dead_letters"].as_array().unwrap();
    assert_eq!(left.len(), 1, "{listed}");
    assert_eq!(left[0]["message_id"], a.as_str());
    assert!(left[0]["replay_requested_at"].is_string(), "{listed}");
}
