//! MySQL's and MariaDB's error numbers, classified here and nowhere else (MySQL's "Server Error
//! Message Reference", MariaDB's "MariaDB Error Codes"). Their errors carry a SQLSTATE (`40001`
//! for a deadlock, the generic `HY000` for a lock wait timeout) and a number; sqlx reports the
//! SQLSTATE as `code()`, so the number is what is checked.

use crate::error::DbErrorClass;

/// 1213 `ER_LOCK_DEADLOCK`.
const DEADLOCK: u16 = 1213;
/// 1205 `ER_LOCK_WAIT_TIMEOUT`.
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The error number of a server error, if `e` is one.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|my| my.number()),
        _ => None,
    }
}

/// The class of an error raised by MySQL/MariaDB: 1792 (a write in a read-only transaction) and
/// 1290 `ER_OPTION_PREVENTS_STATEMENT` naming read-only (`--read-only`; 1290 is raised for
/// other options too) are read-only; SQLSTATE 42S02 a missing table, named from `Table 'db.t'
/// doesn't exist`; deadlocks (1213, SQLSTATE 40001) and lock wait timeouts (1205) transient.
pub(crate) fn classify(e: &sqlx::Error) -> DbErrorClass {
    let db = match DbErrorClass::server_error(e) {
        Ok(db) => db,
        Err(class) => return class,
    };
    let message = db.message();
    match (number(e), db.code().as_deref()) {
        (Some(1792), _) => DbErrorClass::ReadOnly,
        (Some(1290), _) if message.contains("read-only") || message.contains("read_only") => {
            DbErrorClass::ReadOnly
        }
        (_, Some("42S02")) => DbErrorClass::MissingTable(super::super::quoted_name(message)),
        _ if is_lock_conflict(e) => DbErrorClass::Transient,
        (_, Some("40001")) => DbErrorClass::Transient,
        _ => DbErrorClass::Other,
    }
}

/// Whether `e` is an InnoDB deadlock (1213) or lock wait timeout (1205): retry the statement.
pub(crate) fn is_lock_conflict(e: &sqlx::Error) -> bool {
    matches!(number(e), Some(DEADLOCK | LOCK_WAIT_TIMEOUT))
}

/// Whether `e` is a lock wait timeout (1205 `ER_LOCK_WAIT_TIMEOUT`): a row lock past
/// `innodb_lock_wait_timeout`, or on MariaDB a table or metadata lock past `lock_wait_timeout`.
pub(crate) fn is_lock_wait_timeout(e: &sqlx::Error) -> bool {
    number(e) == Some(LOCK_WAIT_TIMEOUT)
}

/// Whether `e` says a migration statement's effect is already there: 1050
/// `ER_TABLE_EXISTS_ERROR`, 1060 `ER_DUP_FIELDNAME` (a column), 1061 `ER_DUP_KEYNAME` (an index).
/// Each migration statement is one atomic DDL statement, so its effect is there whole or not at
/// all.
pub(crate) fn is_already_applied(e: &sqlx::Error) -> bool {
    matches!(number(e), Some(1050 | 1060 | 1061))
}

/// Whether `e` is a missing table (SQLSTATE 42S02).
pub(crate) fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42S02"))
}
