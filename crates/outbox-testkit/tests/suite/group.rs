//! `RelayGroup` (issue 18), the library's many-databases relay, on the real PostgreSQL and
//! SQLite: a member whose opening panics is contained, reopened with backoff and meanwhile named
//! by readiness, and delays no other member; members are removed and the group shut down
//! gracefully. (The daemon's `[[databases]]`, which runs it, is tested in
//! `crates/outbox-cli/tests/daemon/databases.rs`.)

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use outbox::relay::group::{MemberState, Opener, RelayGroup};
use outbox::{MemoryTransport, Relay, Router};
use outbox_testkit::{PgFixture, SqliteFixture, StoreFixture, wait_until};

use crate::relay::fast_config;

/// An opener of a relay over `store` to `sink` that panics on its first `panics` calls.
fn opener(
    store: Arc<dyn outbox::Store>,
    sink: Arc<MemoryTransport>,
    name: &str,
    panics: u32,
    calls: Arc<AtomicU32>,
) -> Opener {
    let name = name.to_owned();
    Arc::new(move || {
        let (store, sink, name, calls) = (store.clone(), sink.clone(), name.clone(), calls.clone());
        Box::pin(async move {
            if calls.fetch_add(1, Ordering::SeqCst) < panics {
                panic!("a driver panicked while connecting to {name}");
            }
            Ok(Relay::builder(store)
                .router(Router::single(sink))
                .config(fast_config(&name))
                .build()?)
        })
    })
}

#[tokio::test]
async fn a_member_that_panics_is_reopened_and_delays_no_other() {
    let pg = PgFixture::new().await;
    let lite = SqliteFixture::new().await;
    let sink = Arc::new(MemoryTransport::new());
    let pg_ids: HashSet<_> = pg.enqueue_numbered(20).await.into_iter().collect();
    let lite_ids: HashSet<_> = lite.enqueue_numbered(20).await.into_iter().collect();
    let group = RelayGroup::new();
    let (pg_calls, lite_calls) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    group
        .add(
            "pg",
            opener(pg.store(), sink.clone(), "group-pg", 0, pg_calls.clone()),
        )
        .unwrap();
    group
        .add(
            "lite",
            opener(
                lite.store(),
                sink.clone(),
                "group-lite",
                2,
                lite_calls.clone(),
            ),
        )
        .unwrap();
    let err = group
        .add(
            "pg",
            opener(pg.store(), sink.clone(), "again", 0, Arc::default()),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("two members are named \"pg\""),
        "{err}"
    );

    // pg drains while lite's opening panics (and waits 1 s, then 2 s, to be opened again).
    let published = |ids: &HashSet<uuid::Uuid>| {
        sink.delivered()
            .iter()
            .filter(|d| ids.contains(&d.message.message_id))
            .count()
    };
    wait_until(
        "pg's 20 messages published",
        Duration::from_secs(10),
        || async { published(&pg_ids) == 20 },
    )
    .await;
    assert_eq!(published(&lite_ids), 0, "lite is not open yet");
    let lite_ready = group.member_readiness("lite").expect("a member");
    assert!(
        lite_ready
            .problems
            .iter()
            .any(|p| p
                .contains("opening panicked: a driver panicked while connecting to group-lite")),
        "{lite_ready:?}"
    );
    assert!(group.relays().iter().any(|(n, _)| n == "pg"), "pg runs");
    let all = group.readiness();
    assert!(
        all.problems
            .iter()
            .any(|p| p.starts_with("database lite: ")),
        "{all:?}"
    );
    assert!(
        group.health().is_ok(),
        "a member not open is no liveness problem"
    );

    // lite opens at its third attempt and drains.
    wait_until(
        "lite's 20 messages published",
        Duration::from_secs(15),
        || async { published(&lite_ids) == 20 },
    )
    .await;
    assert_eq!(lite_calls.load(Ordering::SeqCst), 3);
    assert_eq!(pg_calls.load(Ordering::SeqCst), 1, "pg was opened once");
    wait_until("every member ready", Duration::from_secs(10), || async {
        group.readiness().is_ok()
    })
    .await;
    assert_eq!(sink.count(), 40, "each message once");

    // Removing a member stops its relay gracefully; shutting down stops the rest.
    assert!(group.remove("pg").await);
    assert!(!group.remove("pg").await);
    assert_eq!(group.names(), ["lite"]);
    assert!(matches!(group.members()[0].1, MemberState::Running(_)));
    group.shutdown().await;
    assert!(group.names().is_empty());
    assert!(
        group
            .add("late", opener(pg.store(), sink, "late", 0, Arc::default()))
            .is_err(),
        "no member is added after the shutdown"
    );
}
