//! Issue 11, items 5 and 7: database roles and connections (a read-only server, the LISTEN
//! connection, a locked outbox table) and schema versions, on the real PostgreSQL, MariaDB and
//! SQLite.

use std::sync::Arc;
use std::time::Duration;

use outbox::store::Store;
use outbox::{
    EnqueueError, MemoryTransport, NewMessage, PgStore, Relay, RelayConfig, StoreError,
    StoreErrorKind, StoreOptions,
};
use outbox_testkit::{
    FaultProxy, MySqlFixture, PgFixture, Producer as _, SqliteFixture, StoreFixture as _, pg_pool,
    postgres_url, unique, wait_until, within,
};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

use crate::logs::Logs;
use crate::relay::fast_config;

/// `postgres_url()` with another `host:port` or database.
fn pg_url_with(host_port_: Option<&str>, database: Option<&str>) -> String {
    let url = postgres_url();
    let (scheme, rest) = url.split_once("://").expect("postgres URL");
    let (auth, rest) = rest.rsplit_once('@').map_or(("", rest), |(a, r)| (a, r));
    let (hp, path) = rest.split_once('/').unwrap_or((rest, "postgres"));
    let (db, query) = path.split_once('?').map_or((path, ""), |(d, q)| (d, q));
    let auth = if auth.is_empty() {
        String::new()
    } else {
        format!("{auth}@")
    };
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    format!(
        "{scheme}://{auth}{}/{}{query}",
        host_port_.unwrap_or(hp),
        database.unwrap_or(db)
    )
}

/// The `host:port` of `postgres_url()`.
fn pg_host_port() -> String {
    let rest = postgres_url()
        .split_once("://")
        .expect("postgres URL")
        .1
        .to_owned();
    let rest = rest.rsplit_once('@').map_or(rest.as_str(), |(_, r)| r);
    rest.split(['/', '?']).next().unwrap().to_owned()
}

/// A relay over `store` publishing everything to `transport`.
fn relay(store: Arc<dyn Store>, transport: Arc<MemoryTransport>, config: RelayConfig) -> Relay {
    outbox_testkit::store_suite::relay_over(store, transport, config)
}

/// The `client_port` of the session LISTENing on `channel` (as the server sees it).
async fn listener_port(admin: &sqlx::PgPool, channel: &str) -> u16 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let p: Option<i32> = sqlx::query_scalar(
            "SELECT client_port FROM pg_stat_activity WHERE query LIKE 'LISTEN%' \
             AND query LIKE '%' || $1 || '%' LIMIT 1",
        )
        .bind(channel)
        .fetch_optional(admin)
        .await
        .unwrap();
        if let Some(p) = p.filter(|p| *p > 0) {
            return p as u16;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after 10 s waiting for the relay to LISTEN"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Item 5a: a pool whose connections sit on a read-only server (sessions of a database whose
/// default is `default_transaction_read_only = on`, as on a replica) after the server became
/// writable again (the URL moved back to the primary). The setting applies to new sessions only,
/// so the pool opened (all its 10 connections) while the database is read-only keeps read-only
/// sessions after the reset, as a pool keeps its connections to a replica. Before: the pool
/// kept its read-only sessions (sqlx closes connections on I/O errors only), every relay write
/// failed with 25006 and nothing was delivered. After: the read-only refusal drops the pool's
/// older connections, the next attempt reconnects to a writable session and the message is
/// delivered.
#[tokio::test]
async fn defect_05_read_only_server_connections_are_dropped_and_relay_recovers() {
    let (logs, _guard) = Logs::capture(tracing::Level::INFO);
    let admin = pg_pool(2).await;
    let db = unique("ro");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    let url = pg_url_with(None, Some(&db));
    {
        let setup = PgStore::connect(&url, StoreOptions::default())
            .await
            .expect("connect");
        setup.migrate().await.expect("migrate");
        setup.pool().close().await;
    }

    // The server is read-only for every session opened from now on.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER DATABASE {db} SET default_transaction_read_only = on"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let store = PgStore::connect(&url, StoreOptions::default())
        .await
        .expect("connect");
    // Fill the pool (10 connections) with read-only sessions, so that the relay never needs a
    // new one: without the fix every session it uses stays read-only.
    let mut held = Vec::new();
    for _ in 0..10 {
        let mut c = store.pool().acquire().await.unwrap();
        let ro: String = sqlx::query_scalar("SHOW default_transaction_read_only")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert_eq!(ro, "on", "a read-only session");
        held.push(c);
    }
    drop(held);
    // A producer on a writable session of its own.
    let mut producer = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    sqlx::raw_sql("SET default_transaction_read_only = off")
        .execute(&mut producer)
        .await
        .unwrap();
    let mut tx = sqlx::Connection::begin(&mut producer).await.unwrap();
    store
        .enqueue(&mut tx, NewMessage::new("after", "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let transport = Arc::new(MemoryTransport::new());
    let mut config = fast_config(&unique("relay"));
    config.poll_interval = Duration::from_millis(200);
    let handle = relay(Arc::new(store.clone()), transport.clone(), config).spawn();
    wait_until(
        "a relay error naming read-only",
        Duration::from_secs(15),
        || async { !logs.lines_with(&["read-only"]).is_empty() },
    )
    .await;
    assert_eq!(transport.count(), 0, "nothing delivered while read-only");

    // The URL reaches a writable server again: sessions opened from now on are writable; the
    // pool's read-only ones stay read-only until they are closed.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER DATABASE {db} RESET default_transaction_read_only"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let started = std::time::Instant::now();
    within(
        "the relay to deliver once the server is writable",
        Duration::from_secs(20),
        transport.wait_for(1),
    )
    .await;
    eprintln!(
        "defect_05 read-only: delivered {:?} after the server became writable",
        started.elapsed()
    );
    let line = logs.lines_with(&["read-only"]).remove(0);
    assert!(
        line.contains("WARN") || line.contains("ERROR"),
        "logged as a warning: {line}"
    );

    handle.shutdown().await.unwrap();
    store.pool().close().await;
    drop(producer);
    let kill = format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}' AND pid <> pg_backend_pid()"
    );
    let _ = sqlx::raw_sql(AssertSqlSafe(kill)).execute(&admin).await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
        .execute(&admin)
        .await
        .unwrap();
}

/// The PostgreSQL error is classified as a read-only server: retryable, kind `Unavailable`.
#[tokio::test]
async fn defect_05_read_only_refusal_is_classified_unavailable() {
    let fx = PgFixture::new().await;
    let mut tx = fx.store.pool().begin().await.unwrap();
    sqlx::raw_sql("SET TRANSACTION READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    let e = fx
        .store
        .enqueue(&mut tx, NewMessage::new("t", "x"))
        .await
        .unwrap_err();
    let EnqueueError::Database(e) = e else {
        panic!("a database error, got {e:?}")
    };
    assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{}", e.report());
    assert!(e.is_retryable());
    assert!(e.report().contains("read-only"), "{}", e.report());
    fx.cleanup().await;
}

/// Item 5b: the relay's LISTEN connection goes half-open (a proxy stops forwarding it without
/// closing it). Before: nothing noticed; NOTIFY wake-ups were lost and a message waited for the
/// poll interval (30 s here). After: the listener's ping goes unanswered, the connection is
/// replaced within two check intervals (300 ms here) and a NOTIFY-woken publish is fast again.
///
/// The message is enqueued only once the relay is idle (its reader asleep after its `next_due`
/// query, no batch in flight), and the lease is long enough that no membership round wakes the
/// reader within the test: otherwise the reader's own re-read after a batch (or after a round
/// that acquired buckets) publishes it without any NOTIFY.
#[tokio::test]
async fn defect_05_half_open_listener_is_detected_and_replaced() {
    let (logs, _guard) = Logs::capture(tracing::Level::INFO);
    let admin = pg_pool(2).await;
    let proxy = FaultProxy::start(pg_host_port()).await;
    let schema = unique("obx");
    let options = StoreOptions::table(format!("{schema}.outbox"));
    // The relay's sessions are named, to see when its reader is idle.
    let app = unique("halfopen");
    let url = pg_url_with(Some(&proxy.addr.to_string()), None);
    let sep = if url.contains('?') { '&' } else { '?' };
    let store = PgStore::connect(
        &format!("{url}{sep}application_name={app}"),
        options.clone(),
    )
    .await
    .expect("connect through the proxy")
    .with_listener_check(Duration::from_millis(300));
    store.migrate().await.unwrap();
    // The producer connects directly, so only the relay's connections pass the proxy.
    let producer = PgStore::from_pool(admin.clone(), options).unwrap();
    let transport = Arc::new(MemoryTransport::new());
    let mut config = fast_config(&unique("relay"));
    config.poll_interval = Duration::from_secs(30);
    // Membership rounds (every lease / 3) can wake the reader: none within the test.
    config.lease = Duration::from_secs(60);
    // Neither does maintenance, but its statements would hide the reader's last one.
    config.maintenance_interval = Duration::from_secs(60);
    let handle = relay(Arc::new(store.clone()), transport.clone(), config).spawn();
    let port = listener_port(&admin, store.channel()).await;
    // Wait until the reader sleeps: no relay statement running and the reader's `next_due`
    // query (the last before its idle sleep) done. No message is published before the
    // stall: a batch in flight wakes the reader when it ends, and that re-read would find the
    // next message without any NOTIFY.
    wait_until("the relay idle", Duration::from_secs(10), || {
        let (admin, app) = (admin.clone(), app.clone());
        async move {
            let (active, next_due): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state <> 'idle'), \
                 count(*) FILTER (WHERE query LIKE '%EXTRACT(EPOCH FROM (available_at%') \
                 FROM pg_stat_activity WHERE application_name = $1 AND query NOT LIKE 'LISTEN%'",
            )
            .bind(&app)
            .fetch_one(&admin)
            .await
            .unwrap();
            active == 0 && next_due > 0
        }
    })
    .await;

    assert!(
        proxy.stall_connection(port),
        "the listener's connection passes the proxy"
    );
    // A plain transaction (`tx.commit()`): the trigger's NOTIFY, no in-process wake-up.
    producer.enqueue_plain(NewMessage::new("second", "x")).await;
    let started = std::time::Instant::now();
    within(
        "a publish after the LISTEN connection went half-open (poll interval 30 s)",
        Duration::from_secs(10),
        transport.wait_for(1),
    )
    .await;
    eprintln!(
        "defect_05 half-open LISTEN: published {:?} after the stall",
        started.elapsed()
    );
    assert!(
        !logs
            .lines_with(&["WARN", "LISTEN connection lost", "ping"])
            .is_empty(),
        "the loss is logged with its cause"
    );
    // And the next one is woken by the new listener at once.
    producer.enqueue_plain(NewMessage::new("third", "x")).await;
    within(
        "a publish on the new listener",
        Duration::from_secs(10),
        transport.wait_for(2),
    )
    .await;
    handle.shutdown().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// Item 5b: a killed LISTEN connection. Before: sqlx reconnected it silently (a debug line at
/// most). After: a warning with the cause, then an info line when it listens again; NOTIFY
/// wake-ups work again.
#[tokio::test]
async fn defect_05_killed_listener_logs_its_reconnect() {
    let (logs, _guard) = Logs::capture(tracing::Level::INFO);
    let fx = PgFixture::new().await;
    let transport = Arc::new(MemoryTransport::new());
    let mut config = fast_config(&unique("relay"));
    config.poll_interval = Duration::from_secs(30);
    let handle = relay(Arc::new(fx.store.clone()), transport.clone(), config).spawn();
    let channel = fx.store.channel().to_owned();
    listener_port(fx.store.pool(), &channel).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%' \
         AND query LIKE '%' || $1 || '%'",
    )
    .bind(&channel)
    .fetch_all(fx.store.pool())
    .await
    .unwrap();
    assert_eq!(killed, [true]);
    wait_until(
        "the loss and the reconnect logged",
        Duration::from_secs(10),
        || async {
            !logs
                .lines_with(&["WARN", "LISTEN connection lost", &channel])
                .is_empty()
                && !logs
                    .lines_with(&["INFO", "LISTEN connection re-established", &channel])
                    .is_empty()
        },
    )
    .await;
    let lost = logs.lines_with(&["LISTEN connection lost"]).remove(0);
    assert!(lost.contains("cause"), "the cause is logged: {lost}");
    fx.store.enqueue_plain(NewMessage::new("after", "x")).await;
    within(
        "a NOTIFY-woken publish",
        Duration::from_secs(10),
        transport.wait_for(1),
    )
    .await;
    handle.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// Item 5c: `enqueue` while another transaction holds `LOCK TABLE … IN ACCESS EXCLUSIVE MODE`.
/// Before: it waited as long as the lock was held. After: it returns
/// `EnqueueError::Timeout` naming the table and the timeout, and the session's own
/// `lock_timeout` is left as it was.
#[tokio::test]
async fn defect_05_enqueue_on_a_locked_table_times_out_with_a_typed_error() {
    let fx = PgFixture::new().await;
    let timeout = Duration::from_millis(500);
    let store = fx.store.clone().with_enqueue_timeout(Some(timeout));
    let mut locker = fx.store.pool().begin().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        fx.table()
    )))
    .execute(&mut *locker)
    .await
    .unwrap();

    // In a producer transaction.
    let mut tx = store.begin().await.unwrap();
    gives_up_naming(
        "enqueue to give up on the locked table",
        Duration::from_secs(10),
        (&fx.table(), timeout),
        store.enqueue(&mut tx, NewMessage::new("t", "x")),
    )
    .await;
    tx.rollback().await.unwrap();

    // Outside a transaction block: the session's lock_timeout is restored after the failure.
    let mut conn = fx.store.pool().acquire().await.unwrap();
    gives_up_keeping::<_, String, _>(
        &mut *conn,
        "SHOW lock_timeout",
        "enqueue outside a transaction to give up",
        Duration::from_secs(10),
        (&fx.table(), timeout),
        async |conn| store.enqueue(conn, NewMessage::new("t", "x")).await,
    )
    .await;
    drop(conn);

    locker.rollback().await.unwrap();
    // Unlocked: the enqueue goes through, and the caller's setting is untouched after it.
    let mut tx = store.begin().await.unwrap();
    sqlx::raw_sql("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .enqueue(&mut tx, NewMessage::new("t", "x"))
        .await
        .unwrap();
    let kept: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(kept, "7s");
    store.commit(tx).await.unwrap();
    assert_eq!(fx.count(&fx.table()).await, 1);
    fx.cleanup().await;
}

/// Item 5c on MariaDB: `enqueue` while another session holds `LOCK TABLES <outbox> WRITE`.
/// Before: the insert waited on the table lock for `lock_wait_timeout` (one year by default).
/// After: it returns `EnqueueError::Timeout` naming the table after about the configured
/// timeout (1 s), the caller's connection is usable and its `lock_wait_timeout` unchanged.
#[tokio::test]
async fn defect_05_mysql_enqueue_on_a_locked_table_times_out_with_a_typed_error() {
    let fx = MySqlFixture::new().await;
    let timeout = Duration::from_secs(1);
    let store = fx.store.clone().with_enqueue_timeout(Some(timeout));
    let mut locker =
        <sqlx::MySqlConnection as sqlx::Connection>::connect(&outbox_testkit::mysql_url())
            .await
            .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("LOCK TABLES {} WRITE", fx.table)))
        .execute(&mut locker)
        .await
        .unwrap();

    let mut tx = store.begin().await.unwrap();
    gives_up_keeping::<_, u64, _>(
        &mut *tx,
        "SELECT @@SESSION.lock_wait_timeout",
        "enqueue to give up on the locked table (MySQL)",
        Duration::from_secs(15),
        (&fx.table, timeout),
        async |conn| store.enqueue(conn, NewMessage::new("t", "x")).await,
    )
    .await;
    tx.rollback().await.unwrap();

    sqlx::raw_sql("UNLOCK TABLES")
        .execute(&mut locker)
        .await
        .unwrap();
    // Unlocked: the enqueue goes through.
    store.enqueue_committed(NewMessage::new("t", "x")).await;
    assert_eq!(fx.count(&fx.table).await, 1);
    fx.cleanup().await;
}

/// Item 5c on SQLite: `enqueue` while another connection holds the write lock
/// (`BEGIN IMMEDIATE` and an insert, uncommitted). Before: the insert waited the connection's
/// 10 s busy timeout and failed with a plain database error ("database is locked"). After: it
/// returns `EnqueueError::Timeout` naming the table after about the configured timeout (1 s),
/// and the caller's connection is usable with its busy timeout unchanged.
#[tokio::test]
async fn defect_05_sqlite_enqueue_on_a_locked_table_times_out_with_a_typed_error() {
    let fx = SqliteFixture::new().await;
    let timeout = Duration::from_secs(1);
    let store = fx.store.clone().with_enqueue_timeout(Some(timeout));
    let mut locker = fx.store.pool().acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *locker)
        .await
        .unwrap();
    fx.store
        .enqueue(&mut locker, NewMessage::new("held", "x"))
        .await
        .unwrap();

    let mut tx = store.begin().await.unwrap();
    gives_up_keeping::<_, i64, _>(
        &mut *tx,
        "PRAGMA busy_timeout",
        "enqueue to give up on the locked database (SQLite)",
        Duration::from_secs(5),
        ("outbox", timeout),
        async |conn| store.enqueue(conn, NewMessage::new("t", "x")).await,
    )
    .await;
    tx.rollback().await.unwrap();

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *locker)
        .await
        .unwrap();
    drop(locker);
    store.enqueue_committed(NewMessage::new("t", "x")).await;
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM outbox")
        .fetch_one(fx.store.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// Await `enqueue` on a locked table (at most `bound`) to its error: `EnqueueError::Timeout`
/// naming `table` with `timeout`, its message naming the table. Returns how long it took.
async fn gives_up_naming<T: std::fmt::Debug>(
    what: &str,
    bound: Duration,
    (table, timeout): (&str, Duration),
    enqueue: impl std::future::Future<Output = Result<T, EnqueueError>>,
) -> Duration {
    let started = std::time::Instant::now();
    let e = within(what, bound, enqueue).await.unwrap_err();
    let waited = started.elapsed();
    eprintln!("{what}: gave up after {waited:?}: {e}");
    match &e {
        EnqueueError::Timeout {
            table: t,
            timeout: d,
            ..
        } => {
            assert_eq!(t, table);
            assert_eq!(*d, timeout);
        }
        other => panic!("EnqueueError::Timeout, got {other:?}"),
    }
    assert!(e.to_string().contains(table), "{e}");
    waited
}

/// Await `enqueue` on `conn`, a producer's connection to a locked table (at most `bound`): it
/// gives up as [`gives_up_naming`] checks, after at least 90 % of `timeout`, and leaves the
/// connection usable with the session setting `setting` reads (its one value, a `T`) as it was.
async fn gives_up_keeping<C, T, F>(
    conn: &mut C,
    setting: &'static str,
    what: &str,
    bound: Duration,
    (table, timeout): (&str, Duration),
    enqueue: F,
) where
    C: sqlx::Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    <C::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<C::Database>,
    T: PartialEq + std::fmt::Debug + Send + Unpin,
    (T,): for<'r> sqlx::FromRow<'r, <C::Database as sqlx::Database>::Row>,
    F: AsyncFnOnce(&mut C) -> Result<uuid::Uuid, EnqueueError>,
{
    let before: T = sqlx::query_scalar(setting)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let waited = gives_up_naming(what, bound, (table, timeout), enqueue(&mut *conn)).await;
    assert!(waited >= timeout * 9 / 10, "waited {waited:?}");
    let after: T = sqlx::query_scalar(setting)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(after, before, "{setting} after the failure");
}

/// The version `migrate` recorded for `table` (the version this build needs).
async fn pg_version(fx: &PgFixture) -> i64 {
    let v: i32 =
        sqlx::query_scalar("SELECT MAX(version) FROM outbox_migrations WHERE table_name = $1")
            .bind(fx.table())
            .fetch_one(fx.store.pool())
            .await
            .unwrap();
    i64::from(v)
}

/// Run a relay over `store` and expect it to refuse to start with a schema version error.
async fn expect_refusal(store: Arc<dyn Store>) -> StoreError {
    let relay = relay(
        store,
        Arc::new(MemoryTransport::new()),
        fast_config(&unique("relay")),
    );
    let cancel = CancellationToken::new();
    let r = within(
        "the relay to refuse the table's schema",
        Duration::from_secs(5),
        relay.run(cancel.clone()),
    )
    .await;
    cancel.cancel();
    r.expect_err("the relay refuses to start")
}

/// A relay over `store` and `store`'s `migrate`, on a table a newer build migrated to `newer`:
/// both refuse with a schema version error naming `newer`. Their messages, relay's first.
///
/// # Panics
/// When either starts, or its error is another or does not name `newer`.
async fn refusals_of_a_newer_schema(
    store: Arc<dyn Store>,
    backend: &str,
    newer: i64,
) -> [String; 2] {
    let refusals = [
        expect_refusal(store.clone()).await,
        store.migrate().await.unwrap_err(),
    ];
    refusals.map(|e| {
        assert_eq!(
            e.kind(),
            StoreErrorKind::SchemaVersion,
            "{backend}: {}",
            e.report()
        );
        let msg = e.to_string();
        assert!(msg.contains(&format!("v{newer}")), "{backend}: {msg}");
        msg
    })
}

/// Item 7: a relay of this build on a table at an older schema (here v3: before bucket leases).
/// Before: it started, and its membership failed forever with "table … does not exist". After:
/// it refuses to start with "run `outbox migrate` (table … at v3, this build needs vN)".
#[tokio::test]
async fn defect_07_relay_refuses_an_older_schema_naming_both_versions() {
    let fx = PgFixture::new().await;
    let needed = pg_version(&fx).await;
    let t = fx.table();
    fx.exec(&format!(
        "DROP TABLE {t}_buckets; DROP TABLE {t}_relays; \
         DELETE FROM outbox_migrations WHERE table_name = '{t}' AND version > 3"
    ))
    .await;
    let e = expect_refusal(Arc::new(fx.store.clone())).await;
    assert_eq!(e.kind(), StoreErrorKind::SchemaVersion, "{}", e.report());
    let msg = e.to_string();
    assert!(
        msg.contains("outbox migrate") && msg.contains("v3") && msg.contains(&format!("v{needed}")),
        "{msg}"
    );
    // `migrate` brings it up to date, and the relay starts.
    fx.store.migrate().await.unwrap();
    fx.store.check_schema().await.unwrap();
    fx.cleanup().await;
}

/// Item 7: a table migrated by a newer build (v+2). Before: the relay started as if it knew the
/// schema and `migrate` said nothing. After: both refuse, naming both versions.
#[tokio::test]
async fn defect_07_relay_and_migrate_refuse_a_newer_schema() {
    // PostgreSQL.
    let fx = PgFixture::new().await;
    let needed = pg_version(&fx).await;
    let newer = needed + 2;
    fx.exec(&format!(
        "INSERT INTO outbox_migrations (table_name, version) VALUES ('{}', {newer})",
        fx.table()
    ))
    .await;
    for msg in refusals_of_a_newer_schema(Arc::new(fx.store.clone()), "postgres", newer).await {
        assert!(
            msg.contains(&format!("v{needed}")) && msg.contains("upgrade"),
            "postgres: {msg}"
        );
    }
    fx.exec(&format!(
        "DELETE FROM outbox_migrations WHERE table_name = '{}' AND version = {newer}",
        fx.table()
    ))
    .await;
    fx.cleanup().await;

    // MariaDB.
    let my = MySqlFixture::new().await;
    let needed: i64 =
        sqlx::query_scalar("SELECT MAX(version) FROM outbox_migrations WHERE table_name = ?")
            .bind(&my.table)
            .fetch_one(my.store.pool())
            .await
            .unwrap();
    let newer_my = needed + 2;
    my.exec(&format!(
        "INSERT INTO outbox_migrations (table_name, version) VALUES ('{}', {newer_my})",
        my.table
    ))
    .await;
    for msg in refusals_of_a_newer_schema(Arc::new(my.store.clone()), "mysql", newer_my).await {
        assert!(msg.contains(&format!("v{needed}")), "{msg}");
    }
    my.cleanup().await;

    // SQLite.
    let lite = SqliteFixture::new().await;
    let needed: i64 = sqlx::query_scalar(
        "SELECT MAX(version) FROM outbox_migrations WHERE table_name = 'outbox'",
    )
    .fetch_one(lite.store.pool())
    .await
    .unwrap();
    sqlx::query("INSERT INTO outbox_migrations (table_name, version) VALUES ('outbox', ?1)")
        .bind(needed + 2)
        .execute(lite.store.pool())
        .await
        .unwrap();
    refusals_of_a_newer_schema(Arc::new(lite.store.clone()), "sqlite", needed + 2).await;
}
