//! SQLite's result codes, classified here and nowhere else (SQLite's "Result and Error Codes").

use crate::error::DbErrorClass;

/// Extended result codes worth retrying: 5 `SQLITE_BUSY`, 6 `SQLITE_LOCKED`, 261
/// `SQLITE_BUSY_RECOVERY`, 262 `SQLITE_LOCKED_SHAREDCACHE`, 517 `SQLITE_BUSY_SNAPSHOT`, 773
/// `SQLITE_BUSY_TIMEOUT`.
const TRANSIENT: &[&str] = &["5", "6", "261", "262", "517", "773"];

/// The class of an error raised by SQLite: `no such table: t` is a missing table; busy and
/// locked codes ([`TRANSIENT`]) and "database is locked" are transient.
pub(crate) fn classify(e: &sqlx::Error) -> DbErrorClass {
    let db = match DbErrorClass::server_error(e) {
        Ok(db) => db,
        Err(class) => return class,
    };
    let message = db.message();
    if let Some(table) = message.split("no such table: ").nth(1) {
        return DbErrorClass::MissingTable(Some(table.trim().to_owned()));
    }
    let busy = db.code().is_some_and(|c| TRANSIENT.contains(&c.as_ref()));
    if busy || message.contains("database is locked") {
        return DbErrorClass::Transient;
    }
    DbErrorClass::Other
}

/// Whether `e` is `SQLITE_BUSY` or one of its extended codes other than
/// `SQLITE_BUSY_SNAPSHOT` (517: retrying the statement cannot help, the transaction must restart).
pub(crate) fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == 5 && c != 517),
        _ => false,
    }
}

/// Whether `e` is a missing table.
pub(crate) fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(classify(e), DbErrorClass::MissingTable(_))
}
