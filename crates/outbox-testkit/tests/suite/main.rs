//! The outbox test suite against real PostgreSQL, NATS JetStream and SQLite (one test binary).
//!
//! Services: `OUTBOX_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
//! `OUTBOX_TEST_NATS_URL` (default `nats://127.0.0.1:4222`). A test whose service does not answer
//! fails with a message naming it.

mod cases;
mod crash;
mod inbox;
mod relay;
mod store;
mod transport;

/// Log to the test output with `RUST_LOG=outbox=debug`.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
