//! Routes and confirmations: the daemon applying confirmations and checking back the unconfirmed,
//! one relay routing topics to two brokers, and relays with different routes sharing one table
//! (issue 11 item 10).

use super::*;

/// The daemon with a route that requires confirmation and a NATS confirmation listener: a
/// consumer that confirms gets its message CONFIRMED (or REJECTED with the reason); a message
/// nobody confirms is checked back (published again with the same id) and, after the configured
/// check-backs, FAILED as unconfirmed.
#[tokio::test]
async fn daemon_applies_confirmations_and_checks_back_the_unconfirmed() {
    let (f, pool, js) = Fixture::started("confirm").await;
    // Outside the stream's subjects, so confirmations are not stored as messages.
    let reply = format!("replies.{}", f.table);
    let config = f.config("30s", "5s");
    let mut toml = std::fs::read_to_string(&config).unwrap();
    toml = toml.replace(
        "destination = \"daemon.confirm.",
        &format!("confirm = {{ reply_to = \"{reply}\", timeout = \"1s\" }}\ndestination = \"daemon.confirm."),
    );
    toml = toml.replace("batch_size = 200", "batch_size = 200\nmax_check_backs = 1");
    toml.push_str(&format!(
        "\n[confirmations]\nkind = \"nats\"\nurl = \"{}\"\nsubject = \"{reply}\"\n",
        nats_url()
    ));
    std::fs::write(&config, toml).unwrap();
    let mut relay = f.spawn_relay(&config);
    for payload in ["confirm-me", "reject-me", "ignore-me"] {
        insert_message(&pool, &f.table, "order-created", payload).await;
    }
    // A consumer reading the stream: answers the first two, never the third.
    let client = async_nats::connect(nats_url()).await.unwrap();
    let started = tokio::time::Instant::now();
    let stream = loop {
        // The relay creates the stream at start-up.
        match js.get_stream(&f.stream).await {
            Ok(s) => break s,
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "stream never created: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let consumer = unacked_consumer(&stream).await;
    let mut copies_of_ignored = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status_of = |payload: &'static str| {
        let pool = pool.clone();
        let table = f.table.clone();
        async move {
            let (status, err): (i16, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(
                format!("SELECT status, last_error FROM {table} WHERE payload = $1"),
            ))
            .bind(payload.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap();
            (status, err)
        }
    };
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "confirmations not applied in time"
        );
        let mut batch = fetch(&consumer, 10, Duration::from_millis(300)).await;
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            let id = header(&m, "outbox-message-id");
            let reply_to = header(&m, "outbox-reply-to");
            assert_eq!(reply_to, reply);
            let body = match &m.payload[..] {
                b"confirm-me" => format!(
                    "{{\"message_id\":\"{id}\",\"consumer\":\"c\",\"outcome\":\"processed\"}}"
                ),
                b"reject-me" => format!(
                    "{{\"message_id\":\"{id}\",\"consumer\":\"c\",\"outcome\":\"rejected\",\"reason\":\"no stock\"}}"
                ),
                _ => {
                    copies_of_ignored += 1;
                    continue;
                }
            };
            client.publish(reply_to, body.into()).await.unwrap();
        }
        client.flush().await.unwrap();
        if status_of("confirm-me").await.0 == 3
            && status_of("reject-me").await.0 == 6
            && status_of("ignore-me").await.0 == 4
        {
            break;
        }
    }
    let (_, reason) = status_of("reject-me").await;
    assert!(reason.unwrap().contains("no stock"));
    let (_, reason) = status_of("ignore-me").await;
    assert!(reason.unwrap().starts_with("unconfirmed"));
    assert_eq!(
        copies_of_ignored, 2,
        "the unconfirmed message is published once, then once per check-back"
    );
    let out = outbox()
        .args(["status", "--database", &pg_url(), "--table", &f.table])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("CONFIRMED") && text.contains("SENT awaiting confirmation: 0"),
        "{text}"
    );
    nix_kill(&relay, "TERM");
    assert_eq!(
        wait_exit(&mut relay, Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
}

/// Routing: one `outbox relay` with a TOML file that sends `order-*` topics to Redis Streams and
/// every other topic to NATS JetStream delivers both, each message to its own broker once.
#[cfg(feature = "redis")]
#[tokio::test]
async fn one_relay_routes_two_topics_to_two_brokers() {
    let redis_url =
        std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let (f, pool, js) = Fixture::started("route").await;
    let nats_config = f.config("30s", "5s");
    let redis_stream = format!("daemon:{}:orders", f.table);
    let config = std::fs::read_to_string(&nats_config).unwrap().replace(
        "[[routes]]",
        &format!(
            "[transports.streams]\nkind = \"redis\"\nurl = \"{redis_url}\"\n\n\
                 [[routes]]\ntopics = \"order-*\"\ntransport = \"streams\"\n\
                 destination = \"{redis_stream}\"\n\n[[routes]]"
        ),
    );
    std::fs::write(&nats_config, config).unwrap();
    let mut relay = f.spawn_relay(&nats_config);
    let mut tx = pool.begin().await.unwrap();
    for (topic, n) in [("order-created", 20), ("audit", 15)] {
        for i in 0..n {
            insert_message(&mut *tx, &f.table, topic, format!("{{\"n\":{i}}}")).await;
        }
    }
    tx.commit().await.unwrap();
    wait_until_sent(&pool, &f.table, 35, Duration::from_secs(15)).await;
    let ids_of = |topic: &'static str| {
        let pool = pool.clone();
        let table = f.table.clone();
        async move {
            let ids: Vec<uuid::Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT message_id FROM {table} WHERE topic = $1"
            )))
            .bind(topic)
            .fetch_all(&pool)
            .await
            .unwrap();
            ids.into_iter()
                .map(|u| u.to_string())
                .collect::<HashSet<_>>()
        }
    };
    assert_eq!(stream_ids(&js, &f.stream, 15).await, ids_of("audit").await);
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| {
            panic!("Redis is required at {redis_url} (set OUTBOX_TEST_REDIS_URL): {e}")
        });
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&redis_stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let in_redis: Vec<String> = entries
        .ids
        .iter()
        .map(|e| e.get::<String>("id").expect("id field"))
        .collect();
    assert_eq!(in_redis.len(), 20, "each order message in Redis once");
    assert_eq!(
        in_redis.into_iter().collect::<HashSet<_>>(),
        ids_of("order-created").await
    );
    nix_kill(&relay, "TERM");
    assert_eq!(
        wait_exit(&mut relay, Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
    redis::cmd("DEL")
        .arg(&redis_stream)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap();
}

/// Issue 11 item 10, rolling upgrade: relay A routes `a-*`, relay B (the new version) routes
/// `a-*` and `b-*`, on one table. Every message is delivered and none is dead-lettered although
/// A holds half the buckets, `b-…` messages among them (A hands those buckets to B); then A
/// stops and B alone drains the rest. Before the fix A dead-lettered the `b-…` messages of its
/// buckets as "no route".
#[tokio::test]
async fn defect_10_rolling_upgrade_adding_a_route_dead_letters_nothing() {
    let (f, pool, js) = Fixture::started("upgrade").await;
    let a_cfg = f.routes_config("relay-a", &["a-*"]);
    let b_cfg = f.routes_config("relay-b", &["a-*", "b-*"]);
    let mut relays = Relays(vec![f.spawn_relay_logged(&a_cfg, "relay-a")]);
    wait_live(&pool, &f.table, &["relay-a"]).await;
    relays.0.push(f.spawn_relay_logged(&b_cfg, "relay-b"));
    wait_live(&pool, &f.table, &["relay-a", "relay-b"]).await;

    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 300).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;

    // A stops (the upgrade goes on): what comes now is drained by B alone.
    nix_kill(&relays.0[0], "TERM");
    assert_eq!(
        wait_exit(&mut relays.0[0], Duration::from_secs(20)).code(),
        Some(0)
    );
    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 100).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;
    let ids = stream_ids(&js, &f.stream, 800).await;
    assert_eq!(ids.len(), 800, "every message in the stream once");

    nix_kill(&relays.0[1], "TERM");
    assert_eq!(
        wait_exit(&mut relays.0[1], Duration::from_secs(20)).code(),
        Some(0)
    );
    js.delete_stream(&f.stream).await.unwrap();
}

/// Issue 11 item 10, disjoint routes: relay A routes only `a-*`, relay B only `b-*`. Each
/// holds buckets with the other's messages; nothing is dead-lettered and everything is
/// delivered (each hands such buckets to the other). Before the fix each dead-lettered the
/// other's topics as "no route". A topic that no live relay routes is still dead-lettered.
#[tokio::test]
async fn defect_10_relays_with_disjoint_routes_dead_letter_nothing() {
    let (f, pool, js) = Fixture::started("disjoint").await;
    let mut relays = Relays(vec![
        f.spawn_relay_logged(&f.routes_config("relay-a", &["a-*"]), "relay-a"),
        f.spawn_relay_logged(&f.routes_config("relay-b", &["b-*"]), "relay-b"),
    ]);
    wait_live(&pool, &f.table, &["relay-a", "relay-b"]).await;

    enqueue_topics(&pool, &f.table, &["a-created", "b-created"], 300).await;
    wait_all_sent_none_failed(&pool, &f.table, Duration::from_secs(60)).await;
    let ids = stream_ids(&js, &f.stream, 600).await;
    assert_eq!(ids.len(), 600, "every message in the stream once");

    // Nobody routes `c-…`: dead-lettered, with the reason.
    enqueue_topics(&pool, &f.table, &["c-created"], 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let reason: String = loop {
        let r: Option<Option<String>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT last_error FROM {} WHERE topic = 'c-created' AND status = {}",
            f.table,
            Status::Failed.as_i16()
        )))
        .fetch_optional(&pool)
        .await
        .unwrap();
        if let Some(r) = r {
            break r.unwrap_or_default();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an unroutable message was not dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(reason.contains("no route"), "{reason}");

    for r in relays.0.iter_mut() {
        nix_kill(r, "TERM");
        assert_eq!(wait_exit(r, Duration::from_secs(20)).code(), Some(0));
    }
    js.delete_stream(&f.stream).await.unwrap();
}
