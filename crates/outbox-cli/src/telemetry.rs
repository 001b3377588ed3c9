//! OpenTelemetry trace export for the `outbox` command (docs/operations.md, "Traces"): OTLP over
//! HTTP (protobuf), configured by the standard OpenTelemetry environment variables, as every
//! OpenTelemetry SDK reads them (<https://opentelemetry.io/docs/specs/otel/protocol/exporter/>):
//!
//! - `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` (e.g.
//!   `http://127.0.0.1:4318`; `/v1/traces` is appended to the latter) turns export on; neither
//!   set: nothing is exported and no exporter is built.
//! - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off again.
//! - `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`: only `http/protobuf` (the default) is built in; any
//!   other value is a startup error naming it.
//! - `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS`, `…_TIMEOUT`, `…_COMPRESSION`: read by the exporter.
//! - `OTEL_SERVICE_NAME` (default `outbox`) and `OTEL_RESOURCE_ATTRIBUTES`: the resource.
//!
//! What is exported: the spans of the `outbox` library at INFO and above (`outbox.publish`,
//! `outbox.confirmation`, `outbox.rejection_hook`, …; `outbox::otel` lists them), batched by the
//! SDK's batch span processor on a thread of its own.

use anyhow::{Context as _, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// The non-empty value of environment variable `name`.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Whether the environment asks for OTLP trace export (see the module docs).
pub fn requested() -> bool {
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
    !disabled
        && (env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
            || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some())
}

/// A tracer provider exporting over OTLP/HTTP as the environment says, or `None` when export
/// is not requested.
///
/// # Errors
/// A protocol other than `http/protobuf`, or an exporter that cannot be built (a malformed
/// endpoint URL), named.
pub fn provider_from_env() -> anyhow::Result<Option<SdkTracerProvider>> {
    if !requested() {
        return Ok(None);
    }
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(p) = env(var) {
            if p.trim() != "http/protobuf" {
                bail!(
                    "{var}={p:?} is not supported: this build exports OTLP over HTTP with \
                     protobuf only (\"http/protobuf\", usually port 4318)"
                );
            }
            break;
        }
    }
    // The HTTP client (reqwest with rustls) needs the process's crypto provider for https.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("building the OTLP trace exporter (OTEL_EXPORTER_OTLP_… variables)")?;
    let mut resource = Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("outbox");
    }
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build(),
    ))
}

/// The `tracing` layer sending the `outbox` library's spans (INFO and above) to `provider`.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("outbox"))
        .with_filter(
            tracing_subscriber::filter::Targets::new().with_target("outbox", tracing::Level::INFO),
        )
}

/// Export what is still buffered and stop the exporter (at exit; blocks up to the exporter's
/// timeout, so run it off the async runtime's threads).
pub fn shutdown(provider: SdkTracerProvider) {
    if let Err(e) = provider.shutdown() {
        eprintln!("warning: OpenTelemetry trace export did not shut down cleanly: {e}");
    }
}
