//! PostgreSQL's error codes, classified here and nowhere else (SQLSTATE, from PostgreSQL's
//! manual, appendix A "PostgreSQL Error Codes").

use crate::error::DbErrorClass;

/// SQLSTATEs worth retrying: 40001 `serialization_failure`, 40P01 `deadlock_detected`, 55P03
/// `lock_not_available`, 57P01 `admin_shutdown`, 57P02 `crash_shutdown`, 57P03
/// `cannot_connect_now`, 08000 `connection_exception`, 08003 `connection_does_not_exist`, 08006
/// `connection_failure`.
const TRANSIENT: &[&str] = &[
    "40001", "40P01", "55P03", "57P01", "57P02", "57P03", "08000", "08003", "08006",
];

/// SQLSTATE 42P01 `undefined_table`.
pub(crate) const UNDEFINED_TABLE: &str = "42P01";

/// SQLSTATE 55P03 `lock_not_available` (a `lock_timeout` expired).
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The class of an error raised by PostgreSQL: 25006 `read_only_sql_transaction` (a read-only
/// transaction, a hot standby, `default_transaction_read_only`) is read-only; 42P01 a missing
/// table, named from `relation "s.t" does not exist`; [`TRANSIENT`] codes are transient.
pub(crate) fn classify(e: &sqlx::Error) -> DbErrorClass {
    let db = match DbErrorClass::server_error(e) {
        Ok(db) => db,
        Err(class) => return class,
    };
    match db.code().as_deref() {
        Some("25006") => DbErrorClass::ReadOnly,
        Some(UNDEFINED_TABLE) => {
            DbErrorClass::MissingTable(super::super::quoted_name(db.message()))
        }
        Some(code) if TRANSIENT.contains(&code) => DbErrorClass::Transient,
        _ => DbErrorClass::Other,
    }
}

/// Whether `e` is a missing table (42P01).
pub(crate) fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(UNDEFINED_TABLE))
}

/// Whether `e` is a `lock_timeout` expiry (55P03).
pub(crate) fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(LOCK_NOT_AVAILABLE))
}
