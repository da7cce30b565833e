//! Opening state kept in PostgreSQL. The database itself is the administrator's to create;
//! imgpipe creates its tables there (the migrations of `migrations/postgres/`) when it has none
//! of anyone's, and refuses a database that holds another application's tables or a newer
//! imgpipe's schema, exactly as it refuses such a SQLite file.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{AnyConnection, ConnectOptions, Connection};

use crate::store::{Backend, Location, PgUrl, Store, StoreError, install_drivers};

pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// Connections: the group writer's, and room for reads beside it (the run lock has its own).
const CONNECTIONS: u32 = 4;

/// Opens the state at `url`; with `create`, gives an empty database imgpipe's tables.
pub(crate) async fn open(url: &PgUrl, create: bool) -> Result<Store, StoreError> {
    let shown = || PathBuf::from(url.to_string());
    let failed = |e: sqlx::Error| StoreError::Io {
        path: shown(),
        reason: describe(&e),
    };
    install_drivers();
    let options = AnyConnectOptions::from_str(url.secret())
        .map_err(failed)?
        .log_statements(log::LevelFilter::Trace)
        .log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
    // One connection first, to look and migrate: its failure is the server's own reason (a
    // pool would retry until its timeout and say only that it timed out).
    let mut conn = AnyConnection::connect_with(&options)
        .await
        .map_err(failed)?;
    let prepared = prepare(&mut conn, url, create).await;
    let _ = conn.close().await;
    prepared?;
    let pool = AnyPoolOptions::new()
        .max_connections(CONNECTIONS)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(options);
    Ok(Store::new(
        pool,
        Backend::Postgres,
        Location::Postgres(url.clone()),
    ))
}

/// The advisory lock under which a database is looked at and migrated: hosts started at once
/// on a new database would otherwise see each other's half-made tables as another
/// application's. ("imgpip\0m" in ASCII.)
const PREPARE_KEY: i64 = i64::from_be_bytes(*b"imgpip\0m");

/// Refuses a database that is not imgpipe's, then brings imgpipe's tables up to date (making
/// them when `create` and there are none), one host at a time.
async fn prepare(conn: &mut AnyConnection, url: &PgUrl, create: bool) -> Result<(), StoreError> {
    let failed = |e: sqlx::Error| StoreError::Io {
        path: PathBuf::from(url.to_string()),
        reason: describe(&e),
    };
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(PREPARE_KEY)
        .execute(&mut *conn)
        .await
        .map_err(failed)?;
    let prepared = prepare_locked(conn, url, create).await;
    // The session ends right after, which would let go of the lock anyway.
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(PREPARE_KEY)
        .execute(&mut *conn)
        .await;
    prepared
}

async fn prepare_locked(
    conn: &mut AnyConnection,
    url: &PgUrl,
    create: bool,
) -> Result<(), StoreError> {
    let shown = || PathBuf::from(url.to_string());
    match whose(conn, url).await? {
        Tables::Ours => {}
        Tables::None if create => {}
        Tables::None => return Err(StoreError::Absent { location: shown() }),
    }
    match MIGRATOR.run(conn).await {
        Ok(()) => Ok(()),
        Err(MigrateError::VersionMissing(version)) => Err(StoreError::Newer {
            path: shown(),
            version,
        }),
        Err(e) => Err(StoreError::Migrate {
            path: shown(),
            reason: e.to_string(),
        }),
    }
}

/// What the database's schema holds.
enum Tables {
    /// Nothing: imgpipe may make its tables there.
    None,
    /// imgpipe's: its first migration is recorded with the same checksum.
    Ours,
}

async fn whose(conn: &mut AnyConnection, url: &PgUrl) -> Result<Tables, StoreError> {
    let failed = |e: sqlx::Error| StoreError::Io {
        path: PathBuf::from(url.to_string()),
        reason: describe(&e),
    };
    let tables: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = current_schema() ORDER BY table_name LIMIT 6",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(failed)?;
    let names: Vec<String> = tables.into_iter().map(|(t,)| t).collect();
    if names.is_empty() {
        return Ok(Tables::None);
    }
    if names.iter().any(|n| n == "_sqlx_migrations")
        && let Some(first) = MIGRATOR.iter().min_by_key(|m| m.version)
    {
        let (rows,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM _sqlx_migrations")
            .fetch_one(&mut *conn)
            .await
            .map_err(failed)?;
        // Only sqlx's own table, empty: an imgpipe stopped before its first migration was
        // committed (each migration is a transaction; the table is made before them).
        if rows == 0 && names.len() == 1 {
            return Ok(Tables::None);
        }
        let applied: Option<(Vec<u8>,)> =
            sqlx::query_as("SELECT checksum FROM _sqlx_migrations WHERE version = $1")
                .bind(first.version)
                .fetch_optional(&mut *conn)
                .await
                .map_err(failed)?;
        if applied.is_some_and(|(sum,)| sum == *first.checksum) {
            return Ok(Tables::Ours);
        }
    }
    Err(StoreError::Foreign {
        path: PathBuf::from(url.to_string()),
        reason: format!(
            "its schema holds another application's tables ({})",
            super::listed(names)
        ),
    })
}

/// The driver's error, which names the server and the user but never the password.
pub(crate) fn describe(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}
