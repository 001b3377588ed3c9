//! The message search and its optional indexes ([`crate::admin::SearchIndexes`]).

use super::{Admin, Arg, MAX_PAGE, Sql, summary_columns};
use crate::admin_model::{MessageFilter, MessagePage, PageRequest, SearchIndexes, SearchOrder};
use crate::store::StoreError;
use sqlx::Row;

/// The optional search indexes: name suffix, columns, partial condition.
const SEARCH_INDEXES: [(&str, &str, &str); 3] = [
    ("_key_id", "partition_key, id", "partition_key IS NOT NULL"),
    ("_created_id", "created_at, id", ""),
    ("_sent_id", "sent_at, id", "sent_at IS NOT NULL"),
];

admin_impl! {
    /// [`Store::search`](crate::Store::search).
    pub(super) async fn search(
        &self,
        filter: &MessageFilter,
        page: &PageRequest,
    ) -> Result<MessagePage, StoreError> {
        let (pool, d, table) = (self.pool, self.d, self.table);
        let err = |e| crate::store::db_error("search", table, e);
        let limit = page.limit.clamp(1, MAX_PAGE);
        let order = self.order(filter).await?;
        let mut sql = Sql::new(
            d,
            format!("SELECT {} FROM {table} WHERE 1 = 1", summary_columns(d)),
        );
        sql.filter(filter);
        let column = match order {
            SearchOrder::Id => None,
            SearchOrder::CreatedAt => Some("created_at"),
            SearchOrder::SentAt => Some("sent_at"),
        };
        match (page.before, column) {
            (None, _) => {}
            (Some(before), None) => {
                let p = sql.arg(Arg::Int(before));
                sql.push(&format!(" AND id < {p}"));
            }
            (Some(before), Some(c)) => {
                // After the cursor row's (time, id), read where the row is now: the table, the
                // archive (discarded or retired meanwhile), or, if it was deleted, the nearest
                // older row still in the table (its id plus one, so that row is not skipped).
                let cursor = match self.cursor_home(before).await? {
                    Some(home) => {
                        let p = sql.arg(Arg::Int(before));
                        format!("SELECT {c}, id FROM {home} WHERE id = {p}")
                    }
                    None => {
                        let p = sql.arg(Arg::Int(before));
                        format!(
                            "SELECT {c}, id + 1 FROM {table} WHERE id < {p} AND {c} IS NOT NULL \
                             ORDER BY id DESC LIMIT 1"
                        )
                    }
                };
                sql.push(&format!(" AND ({c}, id) < ({cursor})"));
            }
        }
        // One more than the page: whether a next page exists.
        let p = sql.arg(Arg::Int(i64::from(limit) + 1));
        match column {
            None => sql.push(&format!(" ORDER BY id DESC LIMIT {p}")),
            Some(c) => sql.push(&format!(" ORDER BY {c} DESC, id DESC LIMIT {p}")),
        }
        let rows = sql.query::<DB>().fetch_all(pool).await.map_err(err)?;
        let mut messages = rows
            .iter()
            .map(Self::summary)
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let next = if messages.len() > limit as usize {
            messages.truncate(limit as usize);
            messages.last().map(|m| m.id)
        } else {
            None
        };
        Ok(MessagePage {
            messages,
            next,
            order,
        })
    }

    /// Which table holds row `id` now: the outbox table, its archive, or neither.
    async fn cursor_home(&self, id: i64) -> Result<Option<String>, StoreError> {
        for home in [self.table.to_owned(), format!("{}_archive", self.table)] {
            let mut sql = Sql::new(self.d, format!("SELECT id FROM {home} WHERE id = "));
            let p = sql.arg(Arg::Int(id));
            sql.push(&p);
            if !self.fetch("search", &sql, |_| Ok(())).await?.is_empty() {
                return Ok(Some(home));
            }
        }
        Ok(None)
    }

    /// The order of `filter`'s pages ([`SearchOrder`]): by a window's time when its index
    /// exists (looked up only for a filter with a window and no message id).
    async fn order(&self, filter: &MessageFilter) -> Result<SearchOrder, StoreError> {
        let created = filter.created_after.is_some() || filter.created_before.is_some();
        let sent = filter.sent_after.is_some() || filter.sent_before.is_some();
        if filter.message_id.is_some() || !(created || sent) {
            return Ok(SearchOrder::Id);
        }
        let present = self.search_indexes().await?;
        Ok(if created && present.created {
            SearchOrder::CreatedAt
        } else if sent && !created && present.sent {
            SearchOrder::SentAt
        } else {
            SearchOrder::Id
        })
    }

    /// The table's indexes: name and whether usable.
    async fn indexes(&self) -> Result<Vec<(String, bool)>, StoreError> {
        let sql = Sql::new(self.d, (self.d.index_list)(self.table));
        self.fetch("search indexes", &sql, |row| {
            Ok((row.try_get::<String, _>(0)?, row.try_get::<i64, _>(1)? != 0))
        })
        .await
    }

    /// [`Store::search_indexes`](crate::Store::search_indexes).
    pub(super) async fn search_indexes(&self) -> Result<SearchIndexes, StoreError> {
        let usable: Vec<String> = self
            .indexes()
            .await?
            .into_iter()
            .filter_map(|(name, ok)| ok.then_some(name))
            .collect();
        let has = |suffix: &str| {
            let name = (self.d.index_name)(self.table, suffix);
            usable.iter().any(|n| n.eq_ignore_ascii_case(&name))
        };
        Ok(SearchIndexes {
            key: has(SEARCH_INDEXES[0].0),
            created: has(SEARCH_INDEXES[1].0),
            sent: has(SEARCH_INDEXES[2].0),
        })
    }

    /// [`Store::create_search_indexes`](crate::Store::create_search_indexes): each missing one
    /// built (an unusable leftover of a failed build dropped first), one after the other.
    pub(super) async fn create_search_indexes(&self) -> Result<SearchIndexes, StoreError> {
        let (d, table) = (self.d, self.table);
        let err = |e| crate::store::db_error("create search indexes", table, e);
        let existing = self.indexes().await?;
        for (suffix, columns, partial) in SEARCH_INDEXES {
            let name = (d.index_name)(table, suffix);
            let found = existing.iter().find(|(n, _)| n.eq_ignore_ascii_case(&name));
            if matches!(found, Some((_, true))) {
                continue;
            }
            if found.is_some() {
                tracing::warn!(index = %name, "dropping an unusable index left by a failed build");
                let drop = (d.drop_index)(table, &name);
                sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                    .execute(self.pool)
                    .await
                    .map_err(err)?;
            }
            tracing::info!(index = %name, columns, "building a search index");
            // The simple protocol: PostgreSQL refuses `CONCURRENTLY` in any transaction block.
            let create = (d.create_index)(table, &name, columns, partial);
            match sqlx::raw_sql(sqlx::AssertSqlSafe(create.clone()))
                .execute(self.pool)
                .await
            {
                Ok(_) => {}
                // PostgreSQL builds no index on a partitioned table concurrently (0A000): built
                // the ordinary way, writers waiting for it (docs/operations.md).
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some("0A000") && create.contains(" CONCURRENTLY") =>
                {
                    tracing::warn!(index = %name, "a partitioned table: building without CONCURRENTLY, writers wait");
                    sqlx::raw_sql(sqlx::AssertSqlSafe(create.replacen(" CONCURRENTLY", "", 1)))
                        .execute(self.pool)
                        .await
                        .map_err(err)?;
                }
                Err(e) => return Err(err(e)),
            }
        }
        self.search_indexes().await
    }
}
