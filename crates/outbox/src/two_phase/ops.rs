//! [`TwoPhase`]: the two-phase operations on every [`Store`], written once for the three
//! databases (`store/admin/two_phase.rs`).

use async_trait::async_trait;
use uuid::Uuid;

use super::{CheckBack, CheckUpdate, DecideError, Decided, PreparedBatch};
use crate::error::{EnqueueError, StoreError};
use crate::message::NewMessage;
use crate::store::{Bucket, FencedRow, Store};

/// The two-phase operations of a [`Store`] (implemented for every store; `use
/// outbox::two_phase::TwoPhase` to call them).
///
/// # Examples
/// ```no_run
/// # async fn example(store: outbox::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::two_phase::{CheckBack, TwoPhase};
///
/// let msg = outbox::NewMessage::new("order-created", "{\"id\":1}");
/// let id = store
///     .prepare(msg, &CheckBack::http("https://orders.internal/check-back")?)
///     .await?;
/// // … the business transaction, in another database …
/// store.commit_prepared(id).await?; // or rollback_prepared(id)
/// # Ok(()) }
/// ```
#[async_trait]
pub trait TwoPhase {
    /// Write `msg` as a PREPARED row in its own short transaction, to be checked back through
    /// `check_back` when nobody decides it. The message id is the handle for
    /// [`TwoPhase::commit_prepared`] and [`TwoPhase::rollback_prepared`] (and what a barrier
    /// marks).
    ///
    /// # Errors
    /// A validation [`EnqueueError`] before anything is written (the store's [`Limits`]
    /// (crate::Limits), as for `enqueue`; [`EnqueueError::PreparedWithDelay`] for a message with a
    /// delay; [`EnqueueError::InvalidCheckBack`] for a check-back delay out of range), or
    /// [`EnqueueError::Database`] (a message id already used is the database's unique
    /// violation).
    async fn prepare(&self, msg: NewMessage, check_back: &CheckBack) -> Result<Uuid, EnqueueError>;

    /// PREPARED (or UNDECIDED) → PENDING: published as usual. Compare and set on the row; wakes
    /// the relays.
    ///
    /// # Errors
    /// [`DecideError::Lost`] when it was rolled back first (by a check-back answer or a call);
    /// [`DecideError::NotFound`]; [`DecideError::Store`] (call again: idempotent). Already
    /// committed: `Ok(Decided::Already)`.
    async fn commit_prepared(&self, message_id: Uuid) -> Result<Decided, DecideError>;

    /// PREPARED (or UNDECIDED) → ROLLED_BACK: final, never published. Compare and set.
    ///
    /// # Errors
    /// [`DecideError::Lost`] when it was committed first; [`DecideError::NotFound`];
    /// [`DecideError::Store`]. Already rolled back: `Ok(Decided::Already)`.
    async fn rollback_prepared(&self, message_id: Uuid) -> Result<Decided, DecideError>;

    /// Up to `limit` PREPARED rows of `buckets` due for a check-back (`available_at <= now`),
    /// earliest first. Reads only; the relay owning the buckets calls it.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    async fn due_prepared(
        &self,
        buckets: &[Bucket],
        limit: u32,
    ) -> Result<PreparedBatch, StoreError>;

    /// Write a check-back's result to `row`, fenced: only while it is PREPARED and its bucket
    /// is owned by the relay with its token and an unexpired lease. Whether it was written
    /// (false: decided meanwhile, or the bucket was lost; the new owner checks it again).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    async fn record_check(
        &self,
        row: FencedRow<'_>,
        update: &CheckUpdate,
    ) -> Result<bool, StoreError>;
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[async_trait]
impl<S: Store + ?Sized> TwoPhase for S {
    async fn prepare(
        &self,
        mut msg: NewMessage,
        check_back: &CheckBack,
    ) -> Result<Uuid, EnqueueError> {
        if msg.delay.is_some() {
            return Err(EnqueueError::PreparedWithDelay);
        }
        check_back
            .validate()
            .map_err(|e| EnqueueError::InvalidCheckBack(e.to_string()))?;
        self.limits().prepare(std::slice::from_mut(&mut msg))?;
        crate::store::admin::prepare_on(self.admin_target(), &msg, check_back).await
    }

    async fn commit_prepared(&self, message_id: Uuid) -> Result<Decided, DecideError> {
        let d = crate::store::admin::decide_on(self.admin_target(), message_id, true).await?;
        if d == Decided::Now {
            self.wake_relays();
        }
        Ok(d)
    }

    async fn rollback_prepared(&self, message_id: Uuid) -> Result<Decided, DecideError> {
        crate::store::admin::decide_on(self.admin_target(), message_id, false).await
    }

    async fn due_prepared(
        &self,
        buckets: &[Bucket],
        limit: u32,
    ) -> Result<PreparedBatch, StoreError> {
        crate::store::admin::due_prepared_on(self.admin_target(), buckets, limit).await
    }

    async fn record_check(
        &self,
        row: FencedRow<'_>,
        update: &CheckUpdate,
    ) -> Result<bool, StoreError> {
        crate::store::admin::record_check_on(self.admin_target(), row, update).await
    }
}
