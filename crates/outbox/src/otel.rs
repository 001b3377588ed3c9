//! OpenTelemetry traces from the producer's request to the consumer's effect (feature `otel`).
//!
//! The `tracing` spans stay the API: an application that installs
//! [`tracing-opentelemetry`](https://docs.rs/tracing-opentelemetry)'s layer (the `outbox relay`
//! daemon does when OTLP is configured, see docs/operations.md) gets these spans as OpenTelemetry
//! spans, one trace per request:
//!
//! | where | span | kind | parent |
//! |---|---|---|---|
//! | enqueue ([`PgStore::enqueue`](crate::PgStore::enqueue) and the other stores) | none: the current span's context is written to the headers [`HEADER_TRACEPARENT`] and [`HEADER_TRACESTATE`] (W3C Trace Context) | | |
//! | the relay publishing a message that carries `traceparent` | `outbox.publish` | producer | the enqueuing span on the first attempt; a root **linked** to it on later attempts |
//! | a consumer runner delivering it ([`consumer::deliver`](crate::consumer::deliver)) | `outbox.consume` (the handler runs inside it) | consumer | the publish span on the first delivery; a root **linked** to it on redeliveries |
//! | the producer applying the consumer's confirmation ([`confirm`](crate::confirm)) | `outbox.confirmation` | consumer | the consume span (the confirmation carries its context) |
//! | the rejection hook ([`RejectionHook`](crate::RejectionHook)) | `outbox.rejection_hook` | internal | the confirmation span |
//!
//! A retry or a redelivery happens seconds to hours after the request that caused the message; it
//! starts a trace of its own with a link to the earlier span, so it neither stretches the
//! request's trace nor hides among its spans (the OpenTelemetry messaging conventions' advice
//! for work that is not a direct result of one request).
//!
//! The relay rewrites `traceparent` in what it sends (not in the row) to its publish span, so the
//! consumer's span is the publish span's child; the row keeps the producer's context, so each
//! attempt starts again from it.
//!
//! # What is written, and when not
//! Enqueue writes `traceparent` (55 bytes) and, when not empty, `tracestate`, only when the
//! current span (or the current OpenTelemetry context) has a valid span context, the caller did
//! not set either header (any letter case), and the message keeps within its
//! [`Limits`](crate::Limits) with them (else the message is enqueued without them: tracing never
//! refuses a message). Without the `otel` feature nothing is written and no span is created.
//!
//! Propagation is W3C Trace Context (<https://www.w3.org/TR/trace-context/>) whatever global
//! propagator the application set, because every broker carries these two header names unchanged
//! and the consumer side of this crate reads them.

use crate::message::{Headers, InboundMessage, Limits, Message};
use crate::verdict::Confirmation;

/// Header carrying the W3C `traceparent` (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`).
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// Header carrying the W3C `tracestate` (vendor key/value pairs), written only when not empty.
pub const HEADER_TRACESTATE: &str = "tracestate";

#[cfg(feature = "otel")]
mod imp {
    use super::*;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::{SpanContext, TraceContextExt};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// Whether `headers` holds `name` in any letter case.
    fn has(headers: &Headers, name: &str) -> bool {
        headers.keys().any(|k| k.eq_ignore_ascii_case(name))
    }

    /// The value of `name` in `headers`, an exact match first, then in any letter case (HTTP and
    /// some clients change the case of header names).
    fn get<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
        headers.get(name).map(String::as_str).or_else(|| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        })
    }

    /// Whether the message carries a trace context worth a span.
    fn traced(headers: &Headers) -> bool {
        has(headers, HEADER_TRACEPARENT)
    }

    struct Inject<'a>(&'a mut Headers);

    impl Injector for Inject<'_> {
        fn set(&mut self, key: &str, value: String) {
            if !value.is_empty() {
                self.0.insert(key.to_owned(), value);
            }
        }
    }

    struct Extract<'a>(&'a Headers);

    impl Extractor for Extract<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            get(self.0, key)
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    /// The W3C headers of `cx` (empty when its span context is not valid).
    fn headers_of(cx: &opentelemetry::Context) -> Headers {
        let mut out = Headers::new();
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new().inject_context(cx, &mut Inject(&mut out));
        }
        out
    }

    /// The context of the current span, or the current OpenTelemetry context when the current
    /// span has none (an application using the OpenTelemetry API directly).
    fn current() -> opentelemetry::Context {
        let cx = tracing::Span::current().context();
        if cx.span().span_context().is_valid() {
            cx
        } else {
            opentelemetry::Context::current()
        }
    }

    /// The span context `headers` carry, when valid.
    fn extract(headers: &Headers) -> Option<SpanContext> {
        let cx = TraceContextPropagator::new()
            .extract_with_context(&opentelemetry::Context::new(), &Extract(headers));
        let sc = cx.span().span_context().clone();
        sc.is_valid().then_some(sc)
    }

    /// Make `span` continue the context `headers` carry: as its child when `child`, else as a
    /// root linked to it.
    fn continue_from(span: &tracing::Span, headers: &Headers, child: bool) {
        let Some(sc) = extract(headers) else { return };
        if child {
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
        } else {
            span.add_link(sc);
        }
    }

    pub(super) fn inject_current(headers: &mut Headers, limits: &Limits) {
        if has(headers, HEADER_TRACEPARENT) || has(headers, HEADER_TRACESTATE) {
            return;
        }
        let add = headers_of(&current());
        if add.is_empty()
            || headers.len() + add.len() > limits.max_headers
            || add
                .values()
                .any(|v| v.len() > limits.max_header_value_bytes)
        {
            return;
        }
        headers.extend(add);
    }

    pub(super) fn publish_span(
        message: &mut Message,
        attempt: u32,
        destination: &str,
    ) -> Option<tracing::Span> {
        if !traced(&message.headers) {
            return None;
        }
        let span = tracing::info_span!(
            parent: None,
            "outbox.publish",
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            messaging.message.id = %message.message_id,
            messaging.destination.name = destination,
            outbox.topic = %message.topic,
            outbox.attempt = attempt,
            outbox.outcome = tracing::field::Empty,
        );
        if span.is_disabled() {
            return None;
        }
        continue_from(&span, &message.headers, attempt <= 1);
        // What the consumer continues: this span (the row keeps the producer's context).
        let own = headers_of(&span.context());
        if !own.is_empty() {
            message.headers.retain(|k, _| {
                !k.eq_ignore_ascii_case(HEADER_TRACEPARENT)
                    && !k.eq_ignore_ascii_case(HEADER_TRACESTATE)
            });
            message.headers.extend(own);
        }
        Some(span)
    }

    pub(super) fn consume_span(msg: &InboundMessage, consumer: &str) -> tracing::Span {
        if !traced(&msg.headers) {
            return tracing::Span::none();
        }
        let span = tracing::info_span!(
            parent: None,
            "outbox.consume",
            otel.kind = "consumer",
            otel.status_code = tracing::field::Empty,
            messaging.message.id = %msg.message_id,
            messaging.consumer.group.name = consumer,
            outbox.topic = %msg.topic,
            outbox.delivery = msg.delivery_count.max(1),
            outbox.outcome = tracing::field::Empty,
        );
        if !span.is_disabled() {
            continue_from(&span, &msg.headers, msg.delivery_count <= 1);
        }
        span
    }

    pub(super) fn current_context() -> (Option<String>, Option<String>) {
        let mut h = headers_of(&tracing::Span::current().context());
        (h.remove(HEADER_TRACEPARENT), h.remove(HEADER_TRACESTATE))
    }

    /// The W3C headers confirmation `c` carries; `None` without a `traceparent`.
    fn carried(c: &Confirmation) -> Option<Headers> {
        let mut carried = Headers::new();
        carried.insert(HEADER_TRACEPARENT.to_owned(), c.traceparent.clone()?);
        if let Some(s) = &c.tracestate {
            carried.insert(HEADER_TRACESTATE.to_owned(), s.clone());
        }
        Some(carried)
    }

    pub(super) fn confirmation_span(c: &mut Confirmation) -> Option<tracing::Span> {
        let carried = carried(c)?;
        let span = tracing::info_span!(
            parent: None,
            "outbox.confirmation",
            otel.kind = "consumer",
            otel.status_code = tracing::field::Empty,
            messaging.message.id = %c.message_id,
            messaging.consumer.group.name = %c.consumer,
            outbox.verdict = c.verdict.outcome(),
            outbox.outcome = tracing::field::Empty,
        );
        if span.is_disabled() {
            return None;
        }
        continue_from(&span, &carried, true);
        // The rejection hook's span (inside the store) is this span's child.
        let mut own = headers_of(&span.context());
        if let Some(p) = own.remove(HEADER_TRACEPARENT) {
            c.traceparent = Some(p);
            c.tracestate = own.remove(HEADER_TRACESTATE);
        }
        Some(span)
    }

    pub(super) fn rejection_hook_span(c: &Confirmation, table: &str) -> tracing::Span {
        if c.traceparent.is_none() {
            return tracing::Span::none();
        }
        let span = tracing::info_span!(
            parent: None,
            "outbox.rejection_hook",
            otel.status_code = tracing::field::Empty,
            messaging.message.id = %c.message_id,
            messaging.consumer.group.name = %c.consumer,
            outbox.table = table,
        );
        if !span.is_disabled()
            && let Some(carried) = carried(c)
        {
            continue_from(&span, &carried, true);
        }
        span
    }
}

#[cfg(not(feature = "otel"))]
mod imp {
    use super::*;

    pub(super) fn inject_current(_: &mut Headers, _: &Limits) {}

    pub(super) fn publish_span(_: &mut Message, _: u32, _: &str) -> Option<tracing::Span> {
        None
    }

    pub(super) fn consume_span(_: &InboundMessage, _: &str) -> tracing::Span {
        tracing::Span::none()
    }

    pub(super) fn current_context() -> (Option<String>, Option<String>) {
        (None, None)
    }

    pub(super) fn confirmation_span(_: &mut Confirmation) -> Option<tracing::Span> {
        None
    }

    pub(super) fn rejection_hook_span(_: &Confirmation, _: &str) -> tracing::Span {
        tracing::Span::none()
    }
}

impl Limits {
    /// Validate every message of an enqueue ([`Limits::validate`]) and record the current trace
    /// context in their headers (feature `otel`, [`inject_current`]). Here rather than in
    /// `message`, so that the contracts do not depend on tracing.
    pub(crate) fn prepare(
        &self,
        msgs: &mut [crate::message::NewMessage],
    ) -> Result<(), crate::error::EnqueueError> {
        for m in msgs.iter() {
            self.validate(m)?;
        }
        for m in msgs.iter_mut() {
            inject_current(&mut m.headers, self);
        }
        Ok(())
    }
}

/// Write the current span's W3C context into `headers` (enqueue), as the module docs describe.
pub(crate) fn inject_current(headers: &mut Headers, limits: &Limits) {
    imp::inject_current(headers, limits)
}

/// The relay's `outbox.publish` span for `message` (`None` when it carries no `traceparent` or
/// spans are off); rewrites the message's outgoing `traceparent` to this span.
pub(crate) fn publish_span(
    message: &mut Message,
    attempt: u32,
    destination: &str,
) -> Option<tracing::Span> {
    imp::publish_span(message, attempt, destination)
}

/// The consumer's `outbox.consume` span for one delivery (disabled when the message carries no
/// `traceparent`).
pub(crate) fn consume_span(msg: &InboundMessage, consumer: &str) -> tracing::Span {
    imp::consume_span(msg, consumer)
}

/// The current span's `traceparent` and `tracestate`, for a confirmation sent from inside it.
pub(crate) fn current_context() -> (Option<String>, Option<String>) {
    imp::current_context()
}

/// The producer's `outbox.confirmation` span for `c` (`None` when it carries no context); the
/// confirmation's context becomes this span's, so the rejection hook's span is its child.
pub(crate) fn confirmation_span(c: &mut Confirmation) -> Option<tracing::Span> {
    imp::confirmation_span(c)
}

/// The `outbox.rejection_hook` span for the hook run for `c` (disabled without a context).
pub(crate) fn rejection_hook_span(c: &Confirmation, table: &str) -> tracing::Span {
    imp::rejection_hook_span(c, table)
}

/// Record the outcome of a traced span: `outbox.outcome` and, for an error, the OpenTelemetry
/// status.
pub(crate) fn record_outcome(span: &tracing::Span, outcome: &'static str, error: bool) {
    span.record("outbox.outcome", outcome);
    if error {
        span.record("otel.status_code", "error");
    }
}
