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

/// How long a new connection has to be made: a server that accepts and never answers (a host
/// frozen, a network dropping every packet) would otherwise hold a command, or a CronJob, for
/// ever before it has done anything.
pub(crate) const CONNECT_WITHIN: Duration = Duration::from_secs(10);

/// What a connection not made within [`CONNECT_WITHIN`] is told.
pub(crate) fn silent() -> String {
    format!(
        "the server did not answer within {}s (is it up, and is its address reachable from here?)",
        CONNECT_WITHIN.as_secs()
    )
}

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
    let connected = tokio::time::timeout(CONNECT_WITHIN, AnyConnection::connect_with(&options))
        .await
        .map_err(|_| StoreError::Io {
            path: shown(),
            reason: silent(),
        })?;
    let mut conn = connected.map_err(|e| {
        if refused_login(&e) {
            StoreError::Login {
                path: shown(),
                reason: describe(&e),
            }
        } else {
            failed(e)
        }
    })?;
    let prepared = prepare(&mut conn, url, create).await;
    let _ = conn.close().await;
    prepared?;
    let pool = AnyPoolOptions::new()
        .max_connections(CONNECTIONS)
        .acquire_timeout(Duration::from_secs(30))
        .after_connect(|conn, _| Box::pin(async move { no_jit(conn).await }))
        .connect_lazy_with(options);
    Ok(Store::new(
        pool,
        Backend::Postgres,
        Location::Postgres(url.clone()),
    ))
}

/// Turns PostgreSQL's JIT compilation off for the session. The store's statements are short,
/// but a read of many tasks' outputs by id (a `IN` list, a subquery per row) is costed above
/// `jit_above_cost` on tables never analysed, and compiling it took 40 ms idle and up to a
/// second under load, each of the 14 batches a takeover of 18,000 outputs reads before its
/// first paid call (2.3 s of 4.2 s); run, it takes under a millisecond.
async fn no_jit(conn: &mut AnyConnection) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    conn.execute("SET jit = off").await.map(drop)
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

/// Whether the server refused who we said we are (SQLSTATE class 28: a wrong or missing
/// password, an unknown user), which a password in the environment mends and a retry does not.
fn refused_login(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("28")))
}

/// The driver's error, which names the server and the user but never the password.
pub(crate) fn describe(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use sqlx::PgConnection;

    use super::*;
    use crate::store::test_postgres::{connect, database};

    /// The tables of the database's schema, by name.
    async fn tables(conn: &mut PgConnection) -> Vec<String> {
        sqlx::query_as::<_, (String,)>(
            "SELECT table_name::text FROM information_schema.tables
             WHERE table_schema = current_schema() ORDER BY table_name",
        )
        .fetch_all(conn)
        .await
        .unwrap()
        .into_iter()
        .map(|(t,)| t)
        .collect()
    }

    #[tokio::test]
    async fn the_stores_connections_never_compile_a_statement() {
        let Some(url) = database("nojit").await else {
            return;
        };
        let store = open(&url, true).await.unwrap();
        let jit: String = sqlx::query_scalar("SELECT current_setting('jit')")
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(jit, "off");
    }

    #[tokio::test]
    async fn an_empty_database_gets_imgpipes_tables_only_when_asked_to_create_them() {
        let Some(url) = database("empty").await else {
            return;
        };
        let refused = open(&url, false).await.unwrap_err();
        assert!(matches!(refused, StoreError::Absent { .. }), "{refused}");
        let mut conn = connect(&url).await;
        assert_eq!(tables(&mut conn).await, Vec::<String>::new());

        let store = open(&url, true).await.unwrap();
        let made = tables(&mut conn).await;
        for table in [
            "_sqlx_migrations",
            "runs",
            "tasks",
            "attempts",
            "outputs",
            "run_locks",
        ] {
            assert!(made.iter().any(|t| t == table), "{table} in {made:?}");
        }
        let (applied,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM _sqlx_migrations")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(applied, i64::try_from(MIGRATOR.iter().count()).unwrap());
        store.pool().close().await;
        open(&url, false).await.unwrap().pool().close().await;
        conn.close().await.unwrap();
    }

    #[tokio::test]
    async fn another_applications_tables_are_refused_and_left_untouched() {
        let Some(url) = database("foreign").await else {
            return;
        };
        let mut conn = connect(&url).await;
        sqlx::query("CREATE TABLE invoices (id BIGINT PRIMARY KEY)")
            .execute(&mut conn)
            .await
            .unwrap();
        for create in [true, false] {
            let refused = open(&url, create).await.unwrap_err();
            let StoreError::Foreign { reason, .. } = &refused else {
                panic!("{refused}");
            };
            assert!(reason.contains("invoices"), "{refused}");
        }
        assert_eq!(tables(&mut conn).await, ["invoices"]);
        conn.close().await.unwrap();
    }

    #[tokio::test]
    async fn sqlxs_own_table_left_empty_by_a_first_run_that_died_counts_as_no_tables() {
        let Some(url) = database("halfmade").await else {
            return;
        };
        let mut conn = connect(&url).await;
        sqlx::query(
            "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
             installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL,
             checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
        )
        .execute(&mut conn)
        .await
        .unwrap();
        open(&url, true).await.unwrap().pool().close().await;
        assert!(tables(&mut conn).await.iter().any(|t| t == "runs"));
        conn.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_newer_imgpipes_schema_is_refused_and_left_untouched() {
        let Some(url) = database("newer").await else {
            return;
        };
        open(&url, true).await.unwrap().pool().close().await;
        let mut conn = connect(&url).await;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99991231000000, 'from the future', TRUE, '\\x00', 0)",
        )
        .execute(&mut conn)
        .await
        .unwrap();
        let before = tables(&mut conn).await;
        let refused = open(&url, true).await.unwrap_err();
        assert!(
            matches!(
                refused,
                StoreError::Newer {
                    version: 99_991_231_000_000,
                    ..
                }
            ),
            "{refused}"
        );
        assert_eq!(tables(&mut conn).await, before);
        conn.close().await.unwrap();
    }

    /// Hosts of a CronJob started at the same instant on a new database: each waits for the
    /// one making the tables, then finds them imgpipe's (not another application's half-made
    /// ones).
    #[tokio::test]
    async fn hosts_opening_a_new_database_at_once_all_find_imgpipes_tables() {
        let Some(url) = database("together").await else {
            return;
        };
        let opened = futures::future::join_all((0..8).map(|_| open(&url, true))).await;
        for store in opened {
            store.unwrap_or_else(|e| panic!("{e}")).pool().close().await;
        }
    }

    /// Another host's session holds the lock under which a database is looked at and
    /// migrated: opening waits for it (seen waiting by the server) and finishes only after.
    #[tokio::test]
    async fn opening_waits_while_another_host_prepares_the_database() {
        let Some(url) = database("prepare").await else {
            return;
        };
        let mut other = connect(&url).await;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(PREPARE_KEY)
            .execute(&mut other)
            .await
            .unwrap();
        let bits = PREPARE_KEY.cast_unsigned();
        let mut watcher = connect(&url).await;
        let waiting = async {
            loop {
                let (waiters,): (i64,) = sqlx::query_as(
                    "SELECT COUNT(*) FROM pg_locks
                     WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
                       AND database = (SELECT oid FROM pg_database
                                       WHERE datname = current_database())
                       AND classid::bigint = $1 AND objid::bigint = $2",
                )
                .bind(i64::from((bits >> 32) as u32))
                .bind(i64::from(bits as u32))
                .fetch_one(&mut watcher)
                .await
                .unwrap();
                if waiters > 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let opening = open(&url, true);
        tokio::pin!(opening);
        tokio::select! {
            opened = &mut opening => {
                panic!("opened while another host held the lock: {:?}", opened.map(|_| ()));
            }
            seen = tokio::time::timeout(Duration::from_secs(30), waiting) => {
                seen.expect("the server sees the opening session wait for the lock");
            }
        }
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(PREPARE_KEY)
            .execute(&mut other)
            .await
            .unwrap();
        let store = tokio::time::timeout(Duration::from_secs(30), opening)
            .await
            .expect("opened once the lock was let go")
            .unwrap();
        store.pool().close().await;
        other.close().await.unwrap();
        watcher.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_failure_names_the_server_and_never_the_password() {
        let Some(admin) = crate::store::test_postgres::admin() else {
            return;
        };
        let mut url = url::Url::parse(&admin).unwrap();
        url.set_path("imgpipe_unit_no_such_database");
        url.set_password(Some("hunter2-secret")).unwrap();
        let Ok(Location::Postgres(url)) = Location::parse(url.as_str(), "test") else {
            panic!("{url}");
        };
        let refused = open(&url, true).await.unwrap_err();
        let text = refused.to_string();
        assert!(matches!(refused, StoreError::Io { .. }), "{text}");
        assert!(text.contains("imgpipe_unit_no_such_database"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }
}
