//! Publishing one transport's share of a batch under `publish_timeout`, containing panics.

use super::*;

/// What publishing did with one message.
pub(super) enum Published {
    /// The transport's result (or the relay's: timeout, panic).
    Done(Result<(), TransportError>),
    /// Never handed to the broker: released without counting an attempt.
    NotSent,
}

/// The text of a panic payload (`&str` or `String`; other payloads are not described).
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

impl Relay {
    /// Publish one transport's share of a batch under `publish_timeout`, containing panics: one
    /// result per message of `batch`, in order.
    ///
    /// - The transport records each message's result as it is known ([`Acks`]); when the time
    ///   runs out, the recorded results stand, the messages in doubt get a timeout error
    ///   (`Unavailable` when a probe says the broker is unreachable, else retryable) and those
    ///   never sent are released untouched. A warning gives the counts.
    /// - A panic is contained: the messages without a result are published again one at a time;
    ///   the one that panics alone is dead-lettered (`transport panicked: …`), the others get
    ///   their own outcomes. When every message panics alone the transport itself is broken:
    ///   they are retried with backoff instead.
    pub(super) async fn publish_group(
        &self,
        ti: usize,
        batch: &[Outgoing<'_>],
        work: &[Work],
        read_at: Instant,
    ) -> Vec<Published> {
        let inner = &self.inner;
        let transport = &inner.transports[ti];
        let acks = Acks::new(batch.len());
        let started = Instant::now();
        let run = AssertUnwindSafe(transport.publish_each(batch, &acks)).catch_unwind();
        let ran = tokio::time::timeout(inner.config.publish_timeout, run).await;
        inner
            .metrics
            .publish_duration
            .observe_duration(started.elapsed());
        inner.metrics.publish_batch.observe(batch.len() as f64);
        let states = acks.take();
        match ran {
            Ok(Ok(())) => states
                .into_iter()
                .map(|s| match s {
                    AckState::Done(r) => Published::Done(r),
                    AckState::InDoubt | AckState::NotSent => {
                        Published::Done(Err(TransportError::retryable(format!(
                            "transport {} returned no result for this message",
                            transport.name()
                        ))))
                    }
                })
                .collect(),
            Err(_) => self.timed_out(transport, states).await,
            Ok(Err(panic)) => {
                let reason = format!("transport panicked: {}", panic_message(panic.as_ref()));
                add(&inner.metrics.panics, 1);
                let mut out: Vec<Option<Published>> = Vec::with_capacity(batch.len());
                let mut todo = Vec::new();
                for (i, s) in states.into_iter().enumerate() {
                    match s {
                        AckState::Done(r) => out.push(Some(Published::Done(r))),
                        AckState::InDoubt | AckState::NotSent => {
                            out.push(None);
                            todo.push(i);
                        }
                    }
                }
                if batch.len() == 1 {
                    tracing::error!(
                        transport = transport.name(),
                        id = batch[0].message.id,
                        reason,
                        "the transport panicked publishing this message alone; dead-lettering it"
                    );
                    if out[0].is_none() {
                        out[0] = Some(Published::Done(Err(TransportError::permanent(reason))));
                    }
                    return out.into_iter().map(|o| o.expect("set")).collect();
                }
                tracing::error!(
                    transport = transport.name(),
                    messages = batch.len(),
                    without_result = todo.len(),
                    reason,
                    "the transport panicked publishing a batch; publishing its messages one at a time to find the poison message"
                );
                let cfg = &inner.config;
                let (mut panicked, mut succeeded) = (Vec::new(), 0usize);
                for &i in &todo {
                    if read_at.elapsed() + cfg.publish_timeout >= cfg.lease
                        || !self.leases_fresh(work)
                    {
                        // Out of time for this batch: the rest is read again.
                        break;
                    }
                    let one = Acks::new(1);
                    let single = std::slice::from_ref(&batch[i]);
                    let run = AssertUnwindSafe(transport.publish_each(single, &one)).catch_unwind();
                    let r = match tokio::time::timeout(cfg.publish_timeout, run).await {
                        Ok(Ok(())) => match one.take().pop() {
                            Some(AckState::Done(r)) => Published::Done(r),
                            _ => Published::Done(Err(TransportError::retryable(format!(
                                "transport {} returned no result for this message",
                                transport.name()
                            )))),
                        },
                        Err(_) => self
                            .timed_out(transport, one.take())
                            .await
                            .pop()
                            .expect("one"),
                        Ok(Err(panic)) => {
                            add(&inner.metrics.panics, 1);
                            let reason =
                                format!("transport panicked: {}", panic_message(panic.as_ref()));
                            tracing::error!(
                                transport = transport.name(),
                                id = batch[i].message.id,
                                reason,
                                "the transport panicked publishing this message alone"
                            );
                            panicked.push(i);
                            Published::Done(Err(TransportError::permanent(reason)))
                        }
                    };
                    if matches!(r, Published::Done(Ok(()))) {
                        succeeded += 1;
                    }
                    out[i] = Some(r);
                }
                if panicked.len() > 1 && succeeded == 0 {
                    // Every message panicked alone: the transport is broken, not the messages.
                    tracing::error!(
                        transport = transport.name(),
                        messages = panicked.len(),
                        "the transport panics on every message; retrying them with backoff instead of dead-lettering"
                    );
                    for &i in &panicked {
                        if let Some(Published::Done(Err(e))) = out[i].take() {
                            out[i] =
                                Some(Published::Done(Err(TransportError::retryable(e.message()))));
                        }
                    }
                }
                out.into_iter()
                    .map(|o| o.unwrap_or(Published::NotSent))
                    .collect()
            }
        }
    }

    /// The results of a publish whose `publish_timeout` ran out, from what the transport had
    /// recorded by then; logs the counts.
    pub(super) async fn timed_out(
        &self,
        transport: &Arc<dyn Transport>,
        states: Vec<AckState>,
    ) -> Vec<Published> {
        let cfg = &self.inner.config;
        let (mut acked, mut failed, mut in_doubt, mut not_sent) = (0usize, 0usize, 0usize, 0usize);
        for s in &states {
            match s {
                AckState::Done(Ok(())) => acked += 1,
                AckState::Done(Err(_)) => failed += 1,
                AckState::InDoubt => in_doubt += 1,
                AckState::NotSent => not_sent += 1,
            }
        }
        // A timeout while the broker is unreachable is an outage, not a failed attempt: ask
        // the transport which it was.
        let reason = format!("publish timed out after {:?}", cfg.publish_timeout);
        let kind = if in_doubt == 0 {
            TransportErrorKind::Retryable
        } else {
            match transport.probe().await {
                Err(e) if e.kind() == TransportErrorKind::Unavailable => {
                    TransportErrorKind::Unavailable
                }
                _ => TransportErrorKind::Retryable,
            }
        };
        tracing::warn!(
            transport = transport.name(),
            timeout = ?cfg.publish_timeout,
            acknowledged = acked,
            failed,
            timed_out = in_doubt,
            not_sent,
            "publish timed out: acknowledged messages are recorded, the unanswered ones retried, the unsent ones released"
        );
        add(&self.inner.metrics.publish_timeouts, 1);
        states
            .into_iter()
            .map(|s| match s {
                AckState::Done(r) => Published::Done(r),
                AckState::InDoubt => {
                    Published::Done(Err(TransportError::new(kind, reason.clone())))
                }
                AckState::NotSent => Published::NotSent,
            })
            .collect()
    }
}
