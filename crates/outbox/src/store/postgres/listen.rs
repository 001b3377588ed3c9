//! The relay's LISTEN task on PostgreSQL: wake-ups from `NOTIFY`, with a liveness ping.

use super::*;

/// The relay's LISTEN task ([`Store::spawn_listener`]): wakes `waker` on every notification of
/// `channel`, checks its connection every `check` with a ping, and replaces a connection that
/// died or stopped answering, logging the loss (`warn`, with the cause) and the reconnect
/// (`info`). Ends at `cancel`.
///
/// The listening connection comes from a pool of one of its own (same connect options), never
/// from the store's pool: a connection found dead is dropped with its pool instead of going back
/// to the application's.
pub(crate) async fn listen(
    pool: PgPool,
    channel: String,
    waker: Arc<Notify>,
    check: Duration,
    cancel: CancellationToken,
) {
    let backoff = crate::Backoff {
        base: Duration::from_millis(200),
        max: Duration::from_secs(10),
        ..Default::default()
    };
    // The ping goes to a channel only this listener listens on, so it wakes no relay.
    let ping_channel = format!("outbox_ping_{:016x}", rand::random::<u64>());
    let ping = format!("SELECT pg_notify('{ping_channel}', '')");
    let setup_deadline = check.max(Duration::from_secs(5));
    let mut failures = 0u32;
    let mut listened_before = false;
    while !cancel.is_cancelled() {
        let own: PgPool = PgPoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(setup_deadline)
            .connect_lazy_with((*pool.connect_options()).clone());
        let setup = async {
            let mut l = PgListener::connect_with(&own).await?;
            // A lost connection ends `try_recv` with `Ok(None)` instead of a silent reconnect:
            // this task reconnects itself, on a new pool, and logs it.
            l.eager_reconnect(false);
            l.listen_all([channel.as_str(), ping_channel.as_str()])
                .await?;
            Ok::<_, sqlx::Error>(l)
        };
        let setup = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(setup_deadline, setup) => r,
        };
        let mut listener = match setup {
            Ok(Ok(l)) => l,
            failed => {
                failures += 1;
                let cause = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {setup_deadline:?}"),
                };
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(
                        channel,
                        failures,
                        cause,
                        "LISTEN connection failed; polling meanwhile"
                    );
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff.delay(failures)) => continue,
                }
            }
        };
        if listened_before || failures > 0 {
            tracing::info!(channel, "LISTEN connection re-established");
        }
        failures = 0;
        listened_before = true;
        // Rows may have been inserted while we were not listening.
        waker.notify_one();
        let cause = match receive(
            &mut listener,
            &pool,
            &ping,
            &ping_channel,
            check,
            &waker,
            &cancel,
        )
        .await
        {
            None => return,
            Some(cause) => cause,
        };
        tracing::warn!(
            channel,
            cause,
            "LISTEN connection lost; reconnecting (polling meanwhile)"
        );
        waker.notify_one();
        // Dropping the listener sends `UNLISTEN` on its connection from a background task; on a
        // half-open connection that task waits until the kernel gives the connection up. It
        // holds only this listener's own pool.
        drop(listener);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff.delay(1)) => {}
        }
    }
}

/// Receive on `listener` until it fails (returning the cause) or `cancel` (returning `None`).
/// Every `check` a ping goes out through `pool`; a ping still unanswered at the next `check`
/// means the connection is dead. A ping that cannot be sent (the database itself is down)
/// proves nothing and is not counted.
pub(crate) async fn receive(
    listener: &mut PgListener,
    pool: &PgPool,
    ping: &str,
    ping_channel: &str,
    check: Duration,
    waker: &Notify,
    cancel: &CancellationToken,
) -> Option<String> {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + check, check);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unanswered = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return None,
            // Cancel safe: sqlx reads a notification only once it has all of it.
            n = listener.try_recv() => match n {
                Ok(Some(n)) if n.channel() == ping_channel => unanswered = false,
                Ok(Some(_)) => waker.notify_one(),
                Ok(None) => return Some("the connection was closed".to_owned()),
                Err(e) => return Some(e.to_string()),
            },
            _ = ticker.tick() => {
                if unanswered {
                    return Some(format!(
                        "no answer to a ping through the listening connection within {check:?} (half-open connection?)"
                    ));
                }
                let sent = tokio::time::timeout(
                    check,
                    sqlx::query(AssertSqlSafe(ping.to_owned())).execute(pool),
                )
                .await;
                match sent {
                    Ok(Ok(_)) => unanswered = true,
                    Ok(Err(e)) => tracing::debug!(error = %e, "listener ping not sent"),
                    Err(_) => tracing::debug!("listener ping not sent within the check interval"),
                }
            }
        }
    }
}
