//! Fixtures: a sandbox on port 0 with a client pointed at it, and a builder for running the
//! real `imgpipe` binary against it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use imgpipe::api::download::DEFAULT_MAX_BYTES;
use imgpipe::api::{ApiKey, Client, ClientConfig, Downloader};
use imgpipe::sandbox::{self, Faults, Sandbox};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::process::Command;

/// The sandbox's default starting balance.
pub const START_BALANCE: i64 = 1000;
/// Upper bound for one run of the binary; every run here normally takes well under a second.
pub const RUN_LIMIT: Duration = Duration::from_secs(30);

pub struct Env {
    pub sandbox: Sandbox,
    pub client: Client,
    pub downloader: Downloader,
    pub dir: tempfile::TempDir,
}

pub async fn start(config: sandbox::Config) -> Env {
    let sandbox = Sandbox::start(config).await.expect("sandbox starts");
    let client = client_for(&sandbox, sandbox.key());
    let downloader = Downloader::new(
        Duration::from_secs(5),
        Duration::from_secs(30),
        DEFAULT_MAX_BYTES,
    )
    .unwrap();
    Env {
        sandbox,
        client,
        downloader,
        dir: tempfile::tempdir().unwrap(),
    }
}

pub async fn start_default() -> Env {
    start(sandbox::Config::default()).await
}

/// A sandbox with the default configuration but for the given injected faults.
pub async fn start_with_faults(faults: Faults) -> Env {
    start(sandbox::Config {
        faults,
        ..sandbox::Config::default()
    })
    .await
}

pub fn client_for(sandbox: &Sandbox, key: &str) -> Client {
    let mut config =
        ClientConfig::new(sandbox.base_url().as_str(), ApiKey::new(key).unwrap()).unwrap();
    config.timeout = Duration::from_secs(30);
    Client::new(config).unwrap()
}

/// Posts a raw JSON body, bypassing the client's own checks, to see what the sandbox says.
pub async fn raw_post(env: &Env, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let response = reqwest::Client::new()
        .post(env.sandbox.base_url().join(path).unwrap())
        .header("X-API-Key", env.sandbox.key())
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (
        status,
        response.json().await.unwrap_or(serde_json::Value::Null),
    )
}

/// Asserts that the sandbox billed nothing: no ledger entry, no billed call, and the balance
/// untouched.
#[track_caller]
pub fn assert_nothing_billed(env: &Env) {
    assert!(
        env.sandbox.ledger().is_empty(),
        "{:?}",
        env.sandbox.ledger()
    );
    assert_eq!(env.sandbox.balance(), START_BALANCE);
    assert_eq!(env.sandbox.stats().billed, 0);
}

/// The binary with a clean environment (no IMGPIPE_* from the caller), killed if the test
/// gives up on it.
pub fn command(args: &[&str], cwd: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgpipe"));
    cmd.args(args)
        .current_dir(cwd)
        .env_remove("IMGPIPE_BASE_URL")
        .env_remove("IMGPIPE_API_KEY")
        .env_remove("IMGPIPE_LOG")
        .env_remove("IMGPIPE_STATE")
        .env_remove("IMGPIPE_NOTIFY_URL")
        .env_remove("IMGPIPE_NOTIFY_SECRET")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// Runs `cmd` to completion, failing the test if it does not finish within [`RUN_LIMIT`].
pub async fn finish(mut cmd: Command) -> Output {
    tokio::time::timeout(RUN_LIMIT, cmd.output())
        .await
        .expect("imgpipe finishes in time")
        .expect("imgpipe runs")
}

/// Runs the real binary with the given arguments, pointed at `env`'s sandbox unless the
/// arguments say otherwise.
pub async fn imgpipe(env: Option<&Env>, args: &[&str], cwd: &Path) -> Output {
    let mut cmd = command(args, cwd);
    if let Some(env) = env {
        cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
            .env("IMGPIPE_API_KEY", env.sandbox.key());
    }
    cmd.output().await.expect("imgpipe runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the exit code, showing both streams when it is not the expected one.
#[track_caller]
pub fn assert_exit(o: &Output, expected: i32) {
    assert_eq!(
        o.status.code(),
        Some(expected),
        "exit status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        stdout(o),
        stderr(o)
    );
}

/// [`assert_exit`], and stderr shows no panic either.
#[track_caller]
pub fn assert_exit_without_panic(o: &Output, expected: i32) {
    assert_exit(o, expected);
    assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
}

#[track_caller]
pub fn json_stdout(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", stdout(o)))
}

/// Whether `text` holds `phrase` with no digit right before or after it, so that a number at
/// either end of the phrase does not match within a longer one (`budget of 100` in `budget of
/// 1000`, `8 credits` in `28 credits`).
pub fn has_phrase(text: &str, phrase: &str) -> bool {
    let digit = |c: char| c.is_ascii_digit();
    text.match_indices(phrase)
        .any(|(i, _)| !text[..i].ends_with(digit) && !text[i + phrase.len()..].starts_with(digit))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// What a failed download left in `dir`: its entries, or none when the directory was never
/// made (a body held in memory is checked before anything is written).
pub fn leftovers(dir: &Path) -> Vec<PathBuf> {
    if dir.exists() {
        entries(dir)
    } else {
        Vec::new()
    }
}

/// Every entry of `dir`, sorted; hidden leftovers such as `.part` files included.
pub fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    all.sort();
    all
}

pub fn decode(path: &Path) -> image::DynamicImage {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).unwrap()
}

/// The rows of `table` in the state database at `state`, read-only while a run writes it; 0
/// while the database does not exist yet.
pub async fn rows_in(state: &Path, table: &str) -> i64 {
    use sqlx::{ConnectOptions, Connection};
    let count = async {
        let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(state)
            .read_only(true)
            .connect()
            .await
            .ok()?;
        let sql = format!("SELECT COUNT(*) FROM {table}");
        let n: Option<(i64,)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_optional(&mut conn)
            .await
            .ok()?;
        let _ = conn.close().await;
        n.map(|n| n.0)
    };
    count.await.unwrap_or(0)
}

/// A fresh, empty PostgreSQL database for one test, on the server `.ci/run` starts (its URL in
/// `IMGPIPE_TEST_POSTGRES`, an administrator's). `None` when there is no server outside CI;
/// under `CI=true` a missing server fails the test with the reason.
pub async fn postgres_database(tag: &str) -> Option<String> {
    use sqlx::Connection;
    let Some(admin) = std::env::var("IMGPIPE_TEST_POSTGRES")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "IMGPIPE_TEST_POSTGRES is unset: `bash .ci/run` starts a PostgreSQL server and sets it; CI must run the PostgreSQL tests"
        );
        eprintln!("skipped: IMGPIPE_TEST_POSTGRES is unset (`bash .ci/run` sets it)");
        return None;
    };
    let name = format!(
        "imgpipe_{tag}_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .unwrap_or_else(|e| panic!("cannot reach IMGPIPE_TEST_POSTGRES: {e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let mut url = url::Url::parse(&admin).unwrap();
    url.set_path(&name);
    Some(url.to_string())
}

/// A connection through sqlx's `Any` driver to the state at `state`: a SQLite file (opened
/// read-only) or a PostgreSQL URL, so one check reads either backend.
pub async fn state_connection(state: &str) -> sqlx::AnyConnection {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let url = if state.starts_with("postgres") {
        state.to_owned()
    } else {
        let file = url::Url::from_file_path(state).unwrap();
        format!("sqlite://{}?mode=ro", file.path())
    };
    sqlx::AnyConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot open the state {state}: {e}"))
}
