//! What an operator asks of the outbox table and does to it: search messages, read one, requeue,
//! publish now, discard (docs/operations.md, "Admin API").
//!
//! The operations are [`Store`](crate::Store) methods ([`Store::search`](crate::Store::search),
//! [`Store::message`](crate::Store::message), [`Store::act`](crate::Store::act)), one SQL
//! definition for the three databases (`store/admin/`). With the feature `admin`,
//! [`http::router`] serves them as a JSON API described by an OpenAPI document; the daemon mounts
//! it on its `[admin]` listener, `outbox admin --database URL` serves it alone, and `outbox
//! messages …` is its command-line twin.
//!
//! Pages are keyset pages, newest first (`id` descending): a page is the `limit` rows below the
//! previous page's last id, so rows written meanwhile never shift or repeat a page. A search
//! with a time window is ordered by that time instead ([`SearchOrder`]) when the table has the
//! optional [`SearchIndexes`], which make every filter fast on a large table at a cost on every
//! insert and state change (docs/benchmarks.md, "Admin search"). Actions run
//! in bounded chunks of [`ACTION_CHUNK`] rows, each chunk one short transaction that locks its
//! rows and re-checks their state, so a relay or another operator acting at the same time makes
//! a row count as *not changed*, never changed twice.

#[cfg(all(
    feature = "admin",
    any(feature = "postgres", feature = "mysql", feature = "sqlite")
))]
pub mod http;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod inbox;
#[cfg(all(
    feature = "admin",
    any(feature = "postgres", feature = "mysql", feature = "sqlite")
))]
pub use http::prepared;
pub mod series;

pub use crate::admin_model::*;
