//! [`Store::apply_confirmations`](super::Store::apply_confirmations), written once: the
//! counting and the order of the steps are shared, each dialect supplies its three statements
//! ([`ConfirmSteps`]).

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

use uuid::Uuid;

use super::{RejectedRow, StoreError};
use crate::verdict::{ConfirmReport, Confirmation, RejectionHook, Verdict};

/// A rejection in progress: its open transaction and the row it moved to REJECTED.
pub(crate) type Rejection<DB> = (sqlx::Transaction<'static, DB>, RejectedRow);

/// What a dialect does to apply confirmations; [`apply`] drives it.
pub(crate) trait ConfirmSteps: Sync {
    /// The dialect's database.
    type Db: sqlx::Database;
    /// A message id as the dialect binds it: a `Uuid` on PostgreSQL, its hyphenated text on
    /// MySQL and SQLite.
    type Id: Eq + Hash + Clone + Send + Sync;

    /// `message_id` as the dialect binds it.
    fn id(&self, message_id: Uuid) -> Self::Id;

    /// The outbox table, for errors and spans.
    fn table(&self) -> &str;

    /// The rejection hook, run inside each rejection's transaction.
    fn hook(&self) -> Option<&Arc<dyn RejectionHook<Self::Db>>>;

    /// Move the rows of `ids` still PENDING, SENDING, SENT or FAILED to CONFIRMED, in one
    /// statement; the ids of the rows moved.
    fn confirm(
        &self,
        ids: &[Self::Id],
    ) -> impl Future<Output = Result<Vec<Self::Id>, StoreError>> + Send;

    /// Begin a transaction and move the row of `id`, if still PENDING, SENDING, SENT or FAILED,
    /// to REJECTED with `last_error = error`; the open transaction and the row, or `None` (the
    /// transaction rolled back) when no row was in those states.
    fn reject(
        &self,
        id: &Self::Id,
        error: String,
    ) -> impl Future<Output = Result<Option<Rejection<Self::Db>>, StoreError>> + Send;

    /// Those of `ids` that have a row, in any state.
    fn known(
        &self,
        ids: &[Self::Id],
    ) -> impl Future<Output = Result<Vec<Self::Id>, StoreError>> + Send;
}

/// What [`ConfirmSteps::reject`] returns for its transaction `tx` and the `row` its statement
/// found: both when there is a row, else `None` after rolling `tx` back.
pub(crate) async fn rolled_back_unless<DB: sqlx::Database>(
    tx: sqlx::Transaction<'static, DB>,
    row: Option<RejectedRow>,
    err: impl Fn(sqlx::Error) -> StoreError,
) -> Result<Option<Rejection<DB>>, StoreError> {
    match row {
        Some(row) => Ok(Some((tx, row))),
        None => {
            tx.rollback().await.map_err(err)?;
            Ok(None)
        }
    }
}

/// Apply `batch`: the processed confirmations in one statement, each rejection in a transaction
/// of its own with the hook ([`super::finish_rejection`]); then the confirmations that matched no
/// row in a confirmable state are counted as duplicates (the row exists: confirmed before) or
/// unknown, per confirmation, so an id repeated in the batch counts each time.
pub(crate) async fn apply<S: ConfirmSteps>(
    steps: &S,
    batch: &[Confirmation],
) -> Result<ConfirmReport, StoreError> {
    let mut report = ConfirmReport::default();
    let processed: Vec<S::Id> = batch
        .iter()
        .filter(|c| c.verdict == Verdict::Processed)
        .map(|c| steps.id(c.message_id))
        .collect();
    let mut unmatched: Vec<S::Id> = Vec::new();
    if !processed.is_empty() {
        // Each moved row counts once; any other copy of its id in the batch is a duplicate.
        let mut moved: HashSet<S::Id> = steps.confirm(&processed).await?.into_iter().collect();
        for id in processed {
            if moved.remove(&id) {
                report.confirmed += 1;
            } else {
                unmatched.push(id);
            }
        }
    }
    for c in batch {
        let Verdict::Rejected { reason } = &c.verdict else {
            continue;
        };
        let id = steps.id(c.message_id);
        let error = format!("rejected by {}: {reason}", c.consumer);
        match steps.reject(&id, error).await? {
            Some((tx, row)) => {
                super::finish_rejection(
                    tx,
                    steps.hook(),
                    c,
                    reason,
                    row,
                    &mut report,
                    steps.table(),
                )
                .await?;
            }
            None => unmatched.push(id),
        }
    }
    if !unmatched.is_empty() {
        let known: HashSet<S::Id> = steps.known(&unmatched).await?.into_iter().collect();
        report.duplicates = unmatched.iter().filter(|id| known.contains(*id)).count() as u64;
        report.unknown = unmatched.len() as u64 - report.duplicates;
    }
    Ok(report)
}
