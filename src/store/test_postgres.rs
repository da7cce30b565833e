//! Unit tests' PostgreSQL: a database of its own for each test, on the server whose
//! administrator's URL is in `IMGPIPE_TEST_POSTGRES` (`bash .ci/run` starts one and sets it).
//! Without it a test says on stdout that it skipped (`test NAME ... skipped: …`, where
//! `cargo test` shows it) and returns; under CI (`CI=true` or `CI=1`) it fails with the reason,
//! as the integration tests do (`tests/it/common.rs`).

use std::io::Write as _;

use sqlx::{Connection, PgConnection};

use crate::store::{Location, PgUrl};

/// The server's administrator URL, `None` (the skip said) when there is none outside CI.
pub(crate) fn admin() -> Option<String> {
    if let Some(url) = std::env::var("IMGPIPE_TEST_POSTGRES")
        .ok()
        .filter(|v| !v.is_empty())
    {
        return Some(url);
    }
    let ci = std::env::var("CI").unwrap_or_default();
    assert!(
        !matches!(ci.trim().to_ascii_lowercase().as_str(), "true" | "1"),
        "PostgreSQL unavailable, and CI={ci} requires it: IMGPIPE_TEST_POSTGRES is unset\n\
         hint: `bash .ci/run` starts a server and sets it"
    );
    let thread = std::thread::current();
    let line = format!(
        "test {} ... skipped: no PostgreSQL: IMGPIPE_TEST_POSTGRES is unset (`bash .ci/run` \
         starts a server and sets it; under CI this fails)\n",
        thread.name().unwrap_or("<unnamed>")
    );
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
    None
}

/// A test's own database: reads as its [`PgUrl`]; dropped when the test passes, kept (and
/// named on stderr) when it fails, for a look at what it left.
pub(crate) struct TestDatabase {
    url: PgUrl,
    admin: String,
    name: String,
}

impl std::ops::Deref for TestDatabase {
    type Target = PgUrl;

    fn deref(&self) -> &PgUrl {
        &self.url
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = writeln!(
                std::io::stderr(),
                "kept the failed test's database {}",
                self.name
            );
            return;
        }
        drop_database(&self.admin, &self.name);
    }
}

/// `DROP DATABASE … WITH (FORCE)` (connections the test left open are ended), from a thread of
/// its own: a `Drop` cannot await, and may run inside the test's runtime. Cleaning up never
/// fails a test that passed: a database that cannot be dropped within [`PG_LIMIT`] is named on
/// stderr and left.
pub(crate) fn drop_database(admin: &str, name: &str) {
    let (admin, sql) = (
        admin.to_owned(),
        format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
    );
    let dropped = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("no runtime: {e}"))?;
        runtime.block_on(async {
            let work = async {
                let mut conn = PgConnection::connect(&admin).await?;
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&mut conn)
                    .await?;
                conn.close().await
            };
            match tokio::time::timeout(PG_LIMIT, work).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {PG_LIMIT:?}")),
            }
        })
    });
    let outcome = dropped
        .join()
        .unwrap_or_else(|_| Err("the thread dropping it panicked".to_owned()));
    if let Err(why) = outcome {
        let _ = writeln!(
            std::io::stderr(),
            "left the test database {name}: cannot drop it: {why}"
        );
    }
}

/// A fresh, empty database for one test, named after `tag`; `None` as [`admin`] says.
pub(crate) async fn database(tag: &str) -> Option<TestDatabase> {
    let admin = admin()?;
    let name = format!(
        "imgpipe_unit_{tag}_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos()
    );
    let mut conn = bounded(
        "reaching IMGPIPE_TEST_POSTGRES",
        PgConnection::connect(&admin),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach IMGPIPE_TEST_POSTGRES: {e}"));
    bounded(
        &format!("creating database {name}"),
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\""))).execute(&mut conn),
    )
    .await
    .unwrap();
    bounded("closing the administrator's connection", conn.close())
        .await
        .unwrap();
    let mut url = url::Url::parse(&admin).unwrap();
    url.set_path(&name);
    match Location::parse(url.as_str(), "IMGPIPE_TEST_POSTGRES") {
        Ok(Location::Postgres(url)) => Some(TestDatabase { url, admin, name }),
        other => panic!("not a PostgreSQL URL: {other:?}"),
    }
}

/// A plain connection to `url`, to look at what the code under test left there.
pub(crate) async fn connect(url: &PgUrl) -> PgConnection {
    bounded(
        &format!("reaching {url}"),
        PgConnection::connect(url.secret()),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot reach {url}: {e}"))
}

/// How long a test waits for the server (to connect, to create a database) before it fails
/// saying what it waited for, instead of hanging: a loaded machine answers within seconds.
const PG_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// `fut` within [`PG_LIMIT`], else the test fails naming `what`.
async fn bounded<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(PG_LIMIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer from PostgreSQL within {PG_LIMIT:?}"))
}
