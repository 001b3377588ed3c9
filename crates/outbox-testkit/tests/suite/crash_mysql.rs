//! Crashes and stalls on MySQL/MariaDB: the shared scenarios of `crash.rs` (a relay that dies
//! between the broker's ack and recording SENT; a relay paused past its lease, C15) with effects
//! applied through a MariaDB inbox.

use outbox_testkit::{MySqlFixture, StoreFixture};
use outbox_testkit_macros::suite_test;

use crate::crash::{apply_through_inbox, c15_scenario, crash_after_ack_scenario};
use crate::inbox::{mysql_count, mysql_effects_of};

#[suite_test]
async fn mysql_crash_after_ack_before_completion_republishes_once_applied(fx: MySqlFixture) {
    let pool = fx.store.pool().clone();
    let effects = mysql_effects_of(&fx).await;
    crash_after_ack_scenario(&fx, async |delivered| {
        let (applied, dup) =
            apply_through_inbox(&pool, &fx.inbox_table(), &effects, &delivered).await;
        (
            applied,
            dup,
            mysql_count(&pool, &format!("SELECT COUNT(*) FROM {effects}")).await,
        )
    })
    .await;
    fx.exec(&format!("DROP TABLE {effects}")).await;
}

#[suite_test]
async fn mysql_c15_paused_relay_past_its_lease(fx: MySqlFixture) {
    let pool = fx.store.pool().clone();
    let effects = mysql_effects_of(&fx).await;
    c15_scenario(&fx, async |all| {
        let (applied, _) = apply_through_inbox(&pool, &fx.inbox_table(), &effects, &all).await;
        (
            applied,
            mysql_count(&pool, &format!("SELECT COUNT(*) FROM {effects}")).await,
        )
    })
    .await;
    fx.exec(&format!("DROP TABLE {effects}")).await;
}
