//! Fixtures: a sandbox on port 0 with a client pointed at it, and a builder for running the
//! real `imgpipe` binary against it.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::Duration;

use imgpipe::api::download::DEFAULT_MAX_BYTES;
use imgpipe::api::{ApiKey, Client, ClientConfig, Downloader};
use imgpipe::sandbox::{self, Faults, Sandbox};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::process::{Child, Command};

pub use crate::binary::Imgpipe;

/// The sandbox's default starting balance.
pub const START_BALANCE: i64 = 1000;
/// Upper bound for one run of the binary: only a stuck run reaches it. Most runs here take
/// well under a second, but the 30 images of `pipelines/product-shots.yaml` with their report
/// took 19 s alone on the 2-core machine under its load (30 s was missed beside a busy loop).
pub const RUN_LIMIT: Duration = Duration::from_secs(120);

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
    );
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

/// A sandbox with the default configuration but images of [`SAMPLE_SIDE`] pixels a side at
/// 2K, for the tests of the sample pipeline (`pipelines/product-shots.yaml`): at the default
/// 256, its chains expand to 16:9 and upscale 4×, 1,820×1,024 pixels an image that the
/// sandbox encodes, and imgpipe downloads, hashes and draws thumbnails of, each several times
/// in a test. What those tests check (the bill, the files kept and set aside, the pages) is
/// the same at 455×256.
pub async fn start_sample_sized() -> Env {
    start(sandbox::Config {
        image_side: SAMPLE_SIDE,
        ..sandbox::Config::default()
    })
    .await
}

/// The side of a 2K image in [`start_sample_sized`]'s sandbox.
pub const SAMPLE_SIDE: u32 = 64;

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

/// A plain HTTP client for the tests' own requests, each bounded by [`RUN_LIMIT`]: a request
/// that hangs fails with its URL instead of hanging the test.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(RUN_LIMIT)
        .build()
        .unwrap()
}

/// Posts a raw JSON body, bypassing the client's own checks, to see what the sandbox says.
pub async fn raw_post(env: &Env, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let response = http()
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

/// Asserts that no request was billed twice: each bill in the sandbox's ledger paid for a
/// request of its own (its `request` digest), for runs without faults that legitimately bill
/// a request again. Job ids cannot tell: the sandbox gives every bill a new one.
#[track_caller]
pub fn assert_no_request_billed_twice(env: &Env) {
    let ledger = env.sandbox.ledger();
    let mut seen: BTreeMap<&str, &sandbox::LedgerEntry> = BTreeMap::new();
    for entry in &ledger {
        if let Some(first) = seen.insert(entry.request.as_str(), entry) {
            panic!("a request billed twice: {first:?} and {entry:?}");
        }
    }
}

/// How long a process killed with SIGKILL may take to be reaped: the kernel ends it at once,
/// so only a machine stalled outright takes this long.
pub const KILL_LIMIT: Duration = Duration::from_secs(10);

/// `program arg…` of `cmd`, the program by its file name, for messages.
pub fn describe(cmd: &std::process::Command) -> String {
    let program = Path::new(cmd.get_program());
    let mut text = program
        .file_name()
        .unwrap_or(program.as_os_str())
        .to_string_lossy()
        .into_owned();
    for arg in cmd.get_args() {
        text += " ";
        text += &arg.to_string_lossy();
    }
    text
}

/// Runs `cmd` to completion, failing the test, with the command line, if it does not finish
/// within [`RUN_LIMIT`].
pub fn finish(cmd: Command) -> impl Future<Output = Output> {
    finish_within(cmd, RUN_LIMIT)
}

/// [`finish`] within `limit`; the process is killed when the limit passes.
pub fn finish_within(mut cmd: Command, limit: Duration) -> impl Future<Output = Output> {
    let what = describe(cmd.as_std());
    cmd.kill_on_drop(true);
    async move {
        tokio::time::timeout(limit, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("`{what}` did not finish within {limit:?}"))
            .unwrap_or_else(|e| panic!("`{what}` did not run: {e}"))
    }
}

/// What a started `child` printed, once it ends: fails the test with `what` (the command or
/// what it should do) if it has not ended within [`RUN_LIMIT`].
pub async fn finish_child(child: Child, what: &str) -> Output {
    tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{what}: not ended within {RUN_LIMIT:?}"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Waits for `child` to end by itself, failing the test with `what` if it has not within
/// `limit`.
pub async fn wait_child(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    tokio::time::timeout(limit, child.wait())
        .await
        .unwrap_or_else(|_| panic!("{what}: not ended within {limit:?}"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// How long a test waits for something it expects of a run (a file, a call, a row) before it
/// fails naming it. Only a stuck run should reach it: a run's start on PostgreSQL once took
/// over 20 s on the loaded 2-core CI machine, so it is far above what a slow machine takes,
/// and no verdict depends on it (what a test waits for comes, or the test is wrong).
pub const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Waits until `cond` holds, failing the test with `what` after [`WAIT_LIMIT`].
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what} ({WAIT_LIMIT:?})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// [`wait_until`] for a condition that must await (a database read).
pub async fn wait_until_async<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what} ({WAIT_LIMIT:?})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A started process whose stderr is read line by line as it comes, so a test can wait for
/// what it says (`waiting for …`) before going on.
pub struct Watched {
    child: Child,
    what: String,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Watched {
    /// Starts `cmd`, its stdout and stderr piped.
    pub fn start(mut cmd: Command) -> Watched {
        use tokio::io::AsyncBufReadExt as _;
        let what = describe(cmd.as_std());
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("`{what}` did not start: {e}"));
        let stderr = child.stderr.take().unwrap();
        let lines = std::sync::Arc::<std::sync::Mutex<Vec<String>>>::default();
        let seen = std::sync::Arc::clone(&lines);
        let reader = tokio::spawn(async move {
            let mut stderr = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = stderr.next_line().await {
                seen.lock().unwrap().push(line);
            }
        });
        Watched {
            child,
            what,
            lines,
            reader,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id().expect("still running")
    }

    /// Waits until a line of its stderr holds `text`, failing the test after [`WAIT_LIMIT`]
    /// (or when the process ends first) with what it said.
    pub async fn wait_for_line(&mut self, text: &str) {
        self.wait_for_line_within(text, WAIT_LIMIT).await;
    }

    /// [`Watched::wait_for_line`] with its own limit, for a line that is due only after a
    /// while; returns the first line holding `text`.
    pub async fn wait_for_line_within(&mut self, text: &str, limit: Duration) -> String {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(line) = self.lines.lock().unwrap().iter().find(|l| l.contains(text)) {
                return line.clone();
            }
            let said = || self.lines.lock().unwrap().join("\n");
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "`{}` ended ({status}) without saying {text:?}:\n{}",
                    self.what,
                    said()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "`{}` did not say {text:?} within {limit:?}:\n{}",
                self.what,
                said()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// What it printed once it ends, within [`RUN_LIMIT`].
    pub async fn finish(self) -> Output {
        let Watched {
            child,
            what,
            lines,
            reader,
        } = self;
        let mut output = finish_child(child, &format!("`{what}`")).await;
        tokio::time::timeout(KILL_LIMIT, reader)
            .await
            .unwrap_or_else(|_| panic!("`{what}`: its stderr did not close"))
            .unwrap();
        let mut text = lines.lock().unwrap().join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        output.stderr = text.into_bytes();
        output
    }
}

/// Sends `signal` to our own child `pid`, failing the test if it cannot.
pub fn send_signal(pid: u32, signal: i32) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill(2) on our own child, not reaped yet, so the pid is still its own.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
}

/// Freezes our own child `pid` (SIGSTOP) at a moment it holds no write transaction on the
/// SQLite state at `state`: a process frozen in the middle of one would keep every other
/// process from writing for as long as it stays frozen, which is SQLite's nature and not what
/// a test of a frozen run is about. Frozen while the database takes a write from us, it is
/// left frozen; otherwise it is let go on (SIGCONT) and frozen again a moment later.
pub async fn freeze_between_writes(pid: u32, state: &Path) {
    use sqlx::{ConnectOptions, Connection};
    let started = std::time::Instant::now();
    loop {
        send_signal(pid, libc::SIGSTOP);
        let writable = async {
            let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(state)
                .busy_timeout(Duration::ZERO)
                .connect()
                .await
                .ok()?;
            sqlx::query("BEGIN IMMEDIATE")
                .execute(&mut conn)
                .await
                .ok()?;
            sqlx::query("ROLLBACK").execute(&mut conn).await.ok()?;
            conn.close().await.ok()
        };
        if writable.await.is_some() {
            return;
        }
        send_signal(pid, libc::SIGCONT);
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "waited {WAIT_LIMIT:?} to freeze process {pid} outside a write to {}",
            state.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `cond` holds while `run` is still running, failing the test with `what` and
/// what the run said if it ends first or [`WAIT_LIMIT`] passes.
pub async fn wait_while_running(run: &mut Watched, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    while !cond() {
        let said = || run.lines.lock().unwrap().join("\n");
        if let Ok(Some(status)) = run.child.try_wait() {
            panic!("`{}` ended ({status}) before {what}:\n{}", run.what, said());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "`{}`: not {what} within {WAIT_LIMIT:?}:\n{}",
            run.what,
            said()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// With `env`'s sandbox held (the caller holds it), lets `run`'s paid calls through the gate
/// one at a time, each waited for until billed, until `cond` holds of the sandbox while a call
/// waits at the gate: the run is then stopped in the middle, with a call in flight, however
/// fast or slow the machine is. Fails the test if the run ends or stops calling first.
pub async fn step_until(env: &Env, run: &mut Watched, cond: impl Fn(&Env) -> bool) {
    loop {
        wait_while_running(run, "a paid call held at the sandbox's gate", || {
            env.sandbox.held_calls() >= 1
        })
        .await;
        if cond(env) {
            return;
        }
        let billed = env.sandbox.ledger().len();
        env.sandbox.let_through(1);
        wait_while_running(run, "the call let through the gate billed", || {
            env.sandbox.ledger().len() > billed
        })
        .await;
    }
}

/// Releases `hold` once the service has seen every caller of the calls held at its gate hang
/// up (their process was killed): released, they are billed for nobody (undelivered), as a
/// call in flight at a kill is.
pub async fn release_after_kill(env: &Env, hold: sandbox::Hold) {
    wait_until(
        "the service to see the killed process's held calls hung up",
        || env.sandbox.held_calls_hung_up() == env.sandbox.held_calls(),
    )
    .await;
    drop(hold);
}

/// Kills `child` with SIGKILL and reaps it, within [`KILL_LIMIT`].
pub async fn kill_child(child: &mut Child, what: &str) {
    child
        .start_kill()
        .unwrap_or_else(|e| panic!("{what}: cannot kill: {e}"));
    wait_child(child, KILL_LIMIT, &format!("{what}, killed")).await;
}

/// Runs a blocking `cmd` to completion, its output piped, failing the test with `what` if it
/// has not ended within `limit` (it is killed then, so nothing outlives the test).
#[track_caller]
pub fn finish_blocking(cmd: std::process::Command, limit: Duration, what: &str) -> Output {
    try_finish_blocking(cmd, limit, what).unwrap_or_else(|e| panic!("{e}"))
}

/// [`finish_blocking`], saying why instead of failing (for a property test, which must not
/// panic to report).
pub fn try_finish_blocking(
    mut cmd: std::process::Command,
    limit: Duration,
    what: &str,
) -> Result<Output, String> {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let pid = child.id();
    let (done, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match outcome.recv_timeout(limit) {
        Ok(output) => output.map_err(|e| format!("{what}: {e}")),
        Err(_) => {
            // Not reaped yet (its waiter still waits), so the pid is still the child's.
            // SAFETY: kill(2) on our own child's pid; no memory involved.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            Err(format!("{what}: still running after {limit:?}, killed"))
        }
    }
}

/// One test of this very binary run alone in a process of its own, with the variables `remove`
/// removed and `env` set: how a test proves what another does where this process is not (no
/// browser, no PostgreSQL, not CI). Fails if it has not ended within `limit`.
pub fn test_alone(test: &str, remove: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test]).stdin(Stdio::null());
    for name in remove {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().copied());
    finish_blocking(cmd, limit, &format!("the test {test} run alone"))
}

/// Runs the real binary with the given arguments, pointed at `env`'s sandbox unless the
/// arguments say otherwise.
pub async fn imgpipe(env: Option<&Env>, args: &[&str], cwd: &Path) -> Output {
    let cmd = crate::binary::Imgpipe::new(args).cwd(cwd);
    match env {
        Some(env) => cmd.sandbox(env),
        None => cmd,
    }
    .run()
    .await
    .into()
}

/// The command an interrupted or stopped run printed after `continue with: `, as a user would
/// copy it.
pub fn printed_continue_command(o: &Output) -> String {
    let text = stderr(o);
    text.lines()
        .find_map(|l| l.split("continue with: ").nth(1))
        .unwrap_or_else(|| panic!("no continue command in:\n{text}"))
        .trim()
        .to_owned()
}

/// What a process that ended printed: its [`Output`], or the builder's [`Ran`] that holds one.
/// The helpers below take either, so that a test can write `stdout(&Imgpipe::…run().await)`.
pub trait Printed {
    fn printed(&self) -> &Output;
}

impl Printed for Output {
    fn printed(&self) -> &Output {
        self
    }
}

impl Printed for crate::binary::Ran {
    fn printed(&self) -> &Output {
        &self.output
    }
}

pub fn stdout(o: &impl Printed) -> String {
    String::from_utf8_lossy(&o.printed().stdout).into_owned()
}

pub fn stderr(o: &impl Printed) -> String {
    String::from_utf8_lossy(&o.printed().stderr).into_owned()
}

/// Asserts the exit code, showing both streams when it is not the expected one.
#[track_caller]
pub fn assert_exit(o: &impl Printed, expected: i32) {
    let o = o.printed();
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
pub fn assert_exit_without_panic(o: &impl Printed, expected: i32) {
    assert_exit(o, expected);
    assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
}

#[track_caller]
pub fn json_stdout(o: &impl Printed) -> Value {
    serde_json::from_slice(&o.printed().stdout)
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

/// Every file and directory under `root`, relative to it, sorted; hidden ones included. A
/// symlink is listed, not followed.
pub fn tree(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for path in entries(dir) {
            out.push(path.strip_prefix(root).unwrap().to_path_buf());
            if path.is_dir() && !path.is_symlink() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// Every file under `dir` (all but directories: symlinks and hidden leftovers included),
/// relative to it, as text.
pub fn files_under(dir: &Path) -> BTreeSet<String> {
    tree(dir)
        .into_iter()
        .filter(|p| {
            let path = dir.join(p);
            path.is_symlink() || !path.is_dir()
        })
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

/// Every file under `dir` with its sha256; none when `dir` does not exist.
pub fn file_digests(dir: &Path) -> BTreeMap<String, String> {
    if !dir.exists() {
        return BTreeMap::new();
    }
    files_under(dir)
        .into_iter()
        .map(|f| {
            let digest = sha256_hex(&std::fs::read(dir.join(&f)).unwrap());
            (f, digest)
        })
        .collect()
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

/// `Some("NAME=value")` when the environment variable `name`, read through `var`, is `true` or
/// `1` in any case (blanks around it ignored): how every switch of the tests is read, CI's
/// own included.
pub fn flag_in(var: impl Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    var(name)
        .filter(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"))
        .map(|v| format!("{name}={v}"))
}

/// Whether the tests run under CI (`CI=true` or `CI=1`, as CI services set it): `Some("CI=…")`,
/// for the message, when they do. There a test that lacks what it needs (a browser, a
/// PostgreSQL server, promtool) fails instead of skipping.
pub fn ci() -> Option<String> {
    flag_in(|name| std::env::var(name).ok(), "CI")
}

/// Whether a program of that name is on `PATH`: a tool CI installs (promtool,
/// kubernetes-validate, systemd-analyze).
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Says that the running test skips, and why, in a line that names it as libtest's result line
/// does: `test NAME ... skipped: WHY`. libtest captures what `print!` writes and shows it only
/// for failing tests (or with `--nocapture` / `--show-output`), so the line is written to the
/// process's stdout directly and shows in every `cargo test` output, next to the test's `ok`.
pub fn say_skipped(why: &str) {
    use std::io::Write as _;
    // libtest runs each test on a thread named after it.
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("<unnamed>");
    let line = format!("test {name} ... skipped: {why}\n");
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
}

/// A test cannot have `what` it needs: under CI it fails with `why` and `hint`; elsewhere it
/// says it skips ([`say_skipped`]) and the caller returns.
#[track_caller]
pub fn skip_unless_ci(what: &str, why: &str, hint: &str) {
    if let Some(ci) = ci() {
        panic!("{what} unavailable, and {ci} requires it: {why}\nhint: {hint}");
    }
    say_skipped(&format!("no {what}: {why} ({hint}; under CI this fails)"));
}

/// A fresh, empty PostgreSQL database for one test, on the server `.ci/run` starts (its URL in
/// `IMGPIPE_TEST_POSTGRES`, an administrator's). `None` when there is no server outside CI, the
/// skip said in the test's output ([`skip_unless_ci`]); under CI a missing server fails the
/// test with the reason.
pub async fn postgres_database(tag: &str) -> Option<TestDatabase> {
    use sqlx::Connection;
    let Some(admin) = std::env::var("IMGPIPE_TEST_POSTGRES")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        skip_unless_ci(
            "PostgreSQL",
            "IMGPIPE_TEST_POSTGRES is unset",
            "`bash .ci/run` starts a server and sets it",
        );
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
    let mut conn = tokio::time::timeout(RUN_LIMIT, sqlx::PgConnection::connect(&admin))
        .await
        .unwrap_or_else(|_| panic!("IMGPIPE_TEST_POSTGRES did not answer within {RUN_LIMIT:?}"))
        .unwrap_or_else(|e| panic!("cannot reach IMGPIPE_TEST_POSTGRES: {e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let mut url = url::Url::parse(&admin).unwrap();
    url.set_path(&name);
    Some(TestDatabase {
        url: url.to_string(),
        admin,
        name,
    })
}

/// A test's own PostgreSQL database: reads as its URL (a `String`); dropped when the test
/// passes, kept (and named on stderr) when it fails, for a look at what it left.
pub struct TestDatabase {
    url: String,
    admin: String,
    name: String,
}

impl std::ops::Deref for TestDatabase {
    type Target = String;

    fn deref(&self) -> &String {
        &self.url
    }
}

impl std::fmt::Display for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept the failed test's database {}", self.name);
            return;
        }
        drop_database(&self.admin, &self.name);
    }
}

/// `DROP DATABASE … WITH (FORCE)` (connections a test or its processes left are ended), from a
/// thread of its own: a `Drop` cannot await, and runs inside the test's runtime. Cleaning up
/// never fails a test that passed: a database that cannot be dropped within [`RUN_LIMIT`] is
/// named on stderr and left.
fn drop_database(admin: &str, name: &str) {
    use sqlx::Connection;
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
                let mut conn = sqlx::PgConnection::connect(&admin).await?;
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&mut conn)
                    .await?;
                conn.close().await
            };
            match tokio::time::timeout(RUN_LIMIT, work).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {RUN_LIMIT:?}")),
            }
        })
    });
    let outcome = dropped
        .join()
        .unwrap_or_else(|_| Err("the thread dropping it panicked".to_owned()));
    if let Err(why) = outcome {
        eprintln!("left the test database {name}: cannot drop it: {why}");
    }
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
    within(
        &format!("opening the state {state}"),
        sqlx::AnyConnection::connect(&url),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot open the state {state}: {e}"))
}

/// `fut`, awaited for at most [`RUN_LIMIT`]: a server that never answers (a PostgreSQL
/// connection, a query behind a lock) fails the test naming `what` rather than hanging it.
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(RUN_LIMIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {RUN_LIMIT:?}"))
}

/// A connection to the PostgreSQL database at `url`, made within [`RUN_LIMIT`].
pub async fn pg_connect(url: &str) -> sqlx::PgConnection {
    use sqlx::Connection;
    within(
        &format!("connecting to {url}"),
        sqlx::PgConnection::connect(url),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The state database, read back
// ---------------------------------------------------------------------------------------------

/// A row of `runs`.
#[derive(Clone, Debug)]
pub struct RunRow {
    pub id: String,
    pub status: String,
    pub output_dir: PathBuf,
    pub pipeline_text: String,
    pub credits_planned: u64,
    pub balance_before: Option<i64>,
    pub balance_after: Option<i64>,
}

/// A row of `tasks`.
#[derive(Clone, Debug)]
pub struct TaskRow {
    pub id: i64,
    pub run_id: String,
    pub item: String,
    pub step: String,
    pub idx: i64,
    pub operation: String,
    pub status: String,
    pub inputs: Vec<String>,
    pub planned: u64,
    pub billed: u64,
    pub job_id: Option<String>,
    pub error: Option<String>,
    /// Dropped from the pipeline by a later version of it (`removed_at` set).
    pub removed: bool,
    pub reused_from: Option<i64>,
}

impl TaskRow {
    /// `item/step[idx]`.
    pub fn name(&self) -> String {
        format!("{}/{}[{}]", self.item, self.step, self.idx)
    }
}

/// A row of `attempts`.
#[derive(Clone, Debug)]
pub struct AttemptRow {
    pub id: i64,
    pub task_id: i64,
    pub run_id: String,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub outcome: Option<String>,
    pub http_status: Option<i64>,
    pub billed: u64,
    pub job_id: Option<String>,
    /// The error, or a success's note (such as that it was read back by its job id).
    pub error: Option<String>,
}

/// A row of `outputs`.
#[derive(Clone, Debug)]
pub struct OutputRow {
    pub id: i64,
    pub task_id: i64,
    pub run_id: String,
    pub k: i64,
    pub job_id: String,
    pub parent_job_id: Option<String>,
    pub url: String,
    pub url_issued_at: i64,
    pub path: Option<String>,
    pub sha256: Option<String>,
    pub bytes: Option<i64>,
    pub download_error: Option<String>,
}

/// A row of `superseded_outputs`.
#[derive(Clone, Debug)]
pub struct SupersededRow {
    pub task_id: i64,
    pub job_id: String,
    pub path: Option<String>,
    pub sha256: Option<String>,
    pub bytes: Option<i64>,
    pub reason: String,
}

/// A row of `check_verdicts`: one check's verdict on one output.
#[derive(Clone, Debug)]
pub struct VerdictRow {
    pub output_id: i64,
    pub task_id: i64,
    pub check: String,
    pub verdict: String,
    pub reason: String,
    pub acted: Option<String>,
}

/// A row of `check_rerolls`: a task paid for again because a check failed its outputs.
#[derive(Clone, Debug)]
pub struct CheckRerollRow {
    pub task_id: i64,
    pub job_id: String,
    pub credits: u64,
}

/// The whole state (a SQLite file or a PostgreSQL database), read at once through one
/// connection, in row order. Its questions ask of the tasks still in the pipeline ([`Db::live`])
/// unless they say otherwise.
#[derive(Debug)]
pub struct Db {
    /// In the order they were made.
    pub runs: Vec<RunRow>,
    /// Every task, those removed from the pipeline too.
    pub tasks: Vec<TaskRow>,
    pub attempts: Vec<AttemptRow>,
    pub outputs: Vec<OutputRow>,
    pub superseded: Vec<SupersededRow>,
    pub verdicts: Vec<VerdictRow>,
    pub check_rerolls: Vec<CheckRerollRow>,
    /// SQLite's `integrity_check` (`ok` for PostgreSQL, which checks its own pages).
    pub integrity: String,
    /// Rows SQLite's `foreign_key_check` reports (0 for PostgreSQL, which enforces its keys).
    pub foreign_key_faults: usize,
}

fn unsigned(n: i64) -> u64 {
    u64::try_from(n).unwrap()
}

impl Db {
    /// The state in the SQLite file at `path`.
    pub async fn read_file(path: &Path) -> Db {
        Db::read(&path.to_string_lossy()).await
    }

    /// The state at `state`: a SQLite file (opened read-only) or a PostgreSQL URL.
    pub async fn read(state: &str) -> Db {
        use sqlx::{Connection, Row};
        let mut conn = state_connection(state).await;
        let (integrity, foreign_key_faults) = if state.starts_with("postgres") {
            ("ok".to_owned(), 0)
        } else {
            let (integrity,): (String,) = sqlx::query_as("PRAGMA integrity_check")
                .fetch_one(&mut conn)
                .await
                .unwrap();
            let faults = sqlx::query("PRAGMA foreign_key_check")
                .fetch_all(&mut conn)
                .await
                .unwrap()
                .len();
            (integrity, faults)
        };
        macro_rules! rows {
            ($sql:expr, |$r:ident| $make:expr) => {
                sqlx::query($sql)
                    .fetch_all(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("{}: {e}", $sql))
                    .iter()
                    .map(|$r| $make)
                    .collect()
            };
        }
        let runs = rows!(
            "SELECT id, status, output_dir, pipeline_text, credits_planned, balance_before,
                    balance_after
             FROM runs ORDER BY created_at, id",
            |r| RunRow {
                id: r.get("id"),
                status: r.get("status"),
                output_dir: PathBuf::from(r.get::<String, _>("output_dir")),
                pipeline_text: r.get("pipeline_text"),
                credits_planned: unsigned(r.get("credits_planned")),
                balance_before: r.get("balance_before"),
                balance_after: r.get("balance_after"),
            }
        );
        let tasks = rows!(
            "SELECT id, run_id, item, step, idx, operation, status, inputs, planned_credits,
                    credits_billed, job_id, error, removed_at, reused_from
             FROM tasks ORDER BY id",
            |r| TaskRow {
                id: r.get("id"),
                run_id: r.get("run_id"),
                item: r.get("item"),
                step: r.get("step"),
                idx: r.get("idx"),
                operation: r.get("operation"),
                status: r.get("status"),
                inputs: serde_json::from_str(&r.get::<String, _>("inputs")).unwrap(),
                planned: unsigned(r.get("planned_credits")),
                billed: unsigned(r.get("credits_billed")),
                job_id: r.get("job_id"),
                error: r.get("error"),
                removed: r.get::<Option<i64>, _>("removed_at").is_some(),
                reused_from: r.get("reused_from"),
            }
        );
        let attempts = rows!(
            "SELECT id, task_id, run_id, started_at, finished_at, outcome, http_status,
                    credits_billed, job_id, error
             FROM attempts ORDER BY id",
            |r| AttemptRow {
                id: r.get("id"),
                task_id: r.get("task_id"),
                run_id: r.get("run_id"),
                started_at: r.get("started_at"),
                finished_at: r.get("finished_at"),
                outcome: r.get("outcome"),
                http_status: r.get("http_status"),
                billed: unsigned(r.get("credits_billed")),
                job_id: r.get("job_id"),
                error: r.get("error"),
            }
        );
        let outputs = rows!(
            "SELECT id, task_id, run_id, k, job_id, parent_job_id, url, url_issued_at, path,
                    sha256, bytes, download_error
             FROM outputs ORDER BY task_id, k, id",
            |r| OutputRow {
                id: r.get("id"),
                task_id: r.get("task_id"),
                run_id: r.get("run_id"),
                k: r.get("k"),
                job_id: r.get("job_id"),
                parent_job_id: r.get("parent_job_id"),
                url: r.get("url"),
                url_issued_at: r.get("url_issued_at"),
                path: r.get("path"),
                sha256: r.get("sha256"),
                bytes: r.get("bytes"),
                download_error: r.get("download_error"),
            }
        );
        let superseded = rows!(
            "SELECT task_id, job_id, path, sha256, bytes, reason
             FROM superseded_outputs ORDER BY id",
            |r| SupersededRow {
                task_id: r.get("task_id"),
                job_id: r.get("job_id"),
                path: r.get("path"),
                sha256: r.get("sha256"),
                bytes: r.get("bytes"),
                reason: r.get("reason"),
            }
        );
        let verdicts = rows!(
            "SELECT output_id, task_id, check_name, verdict, reason, acted
             FROM check_verdicts ORDER BY checked_at, task_id, output_id, position",
            |r| VerdictRow {
                output_id: r.get("output_id"),
                task_id: r.get("task_id"),
                check: r.get("check_name"),
                verdict: r.get("verdict"),
                reason: r.get("reason"),
                acted: r.get("acted"),
            }
        );
        let check_rerolls = rows!(
            "SELECT task_id, job_id, credits FROM check_rerolls ORDER BY rerolled_at, task_id",
            |r| CheckRerollRow {
                task_id: r.get("task_id"),
                job_id: r.get("job_id"),
                credits: unsigned(r.get("credits")),
            }
        );
        conn.close().await.unwrap();
        Db {
            runs,
            tasks,
            attempts,
            outputs,
            superseded,
            verdicts,
            check_rerolls,
            integrity,
            foreign_key_faults,
        }
    }

    /// The run `id`.
    #[track_caller]
    pub fn run(&self, id: &str) -> &RunRow {
        self.runs
            .iter()
            .find(|r| r.id == id)
            .unwrap_or_else(|| panic!("no run {id}"))
    }

    pub fn run_status(&self, id: &str) -> &str {
        &self.run(id).status
    }

    /// Tasks still in the pipeline.
    pub fn live(&self) -> impl Iterator<Item = &TaskRow> {
        self.tasks.iter().filter(|t| !t.removed)
    }

    /// Tasks of the run `run` still in the pipeline.
    pub fn tasks_of(&self, run: &str) -> Vec<&TaskRow> {
        self.live().filter(|t| t.run_id == run).collect()
    }

    /// The task with the row id `id`, removed or not.
    #[track_caller]
    pub fn task(&self, id: i64) -> &TaskRow {
        self.tasks
            .iter()
            .find(|t| t.id == id)
            .unwrap_or_else(|| panic!("no task {id}"))
    }

    /// The live task `item/step[idx]` of any run.
    pub fn find(&self, item: &str, step: &str, idx: i64) -> Option<&TaskRow> {
        self.live()
            .find(|t| t.item == item && t.step == step && t.idx == idx)
    }

    /// Live tasks in `status`.
    pub fn count(&self, status: &str) -> usize {
        self.live().filter(|t| t.status == status).count()
    }

    /// Live tasks of `run` in `status`.
    pub fn count_in(&self, run: &str, status: &str) -> usize {
        self.tasks_of(run)
            .iter()
            .filter(|t| t.status == status)
            .count()
    }

    pub fn attempts_of(&self, task: i64) -> Vec<&AttemptRow> {
        self.attempts.iter().filter(|a| a.task_id == task).collect()
    }

    pub fn outputs_of(&self, task: i64) -> Vec<&OutputRow> {
        self.outputs.iter().filter(|o| o.task_id == task).collect()
    }

    /// Credits billed by every attempt.
    pub fn billed(&self) -> u64 {
        self.attempts.iter().map(|a| a.billed).sum()
    }

    /// Credits planned for the live tasks.
    pub fn planned(&self) -> u64 {
        self.live().map(|t| t.planned).sum()
    }

    /// Outputs on disk (or in the bucket): recorded with a path.
    pub fn downloaded(&self) -> Vec<&OutputRow> {
        self.outputs.iter().filter(|o| o.path.is_some()).collect()
    }

    /// The record of the run `run` alone: its row, tasks, attempts and outputs.
    pub fn only_run(mut self, run: &str) -> Db {
        self.runs.retain(|r| r.id == run);
        assert_eq!(self.runs.len(), 1, "no run {run}");
        let tasks: std::collections::HashSet<i64> = self
            .tasks
            .iter()
            .filter(|t| t.run_id == run)
            .map(|t| t.id)
            .collect();
        self.tasks.retain(|t| t.run_id == run);
        self.attempts.retain(|a| a.run_id == run);
        self.outputs.retain(|o| o.run_id == run);
        self.superseded.retain(|s| tasks.contains(&s.task_id));
        self
    }

    /// The one run of a record made [`Db::only_run`].
    #[track_caller]
    pub fn the_run(&self) -> &RunRow {
        assert_eq!(self.runs.len(), 1, "not one run: {:#?}", self.runs);
        &self.runs[0]
    }

    /// Attempts sent without a complete answer (or still marked in flight): possibly billed.
    pub fn ambiguous(&self) -> Vec<&AttemptRow> {
        self.attempts
            .iter()
            .filter(|a| a.outcome.as_deref().is_none_or(|o| o == "ambiguous"))
            .collect()
    }
}

/// Every row of every table of the SQLite state at `path`, column by column, to tell whether
/// anything at all was written.
pub async fn dump(path: &Path) -> BTreeMap<String, Vec<String>> {
    use sqlx::{Connection, Row};
    let mut conn = state_connection(&path.to_string_lossy()).await;
    let mut all = BTreeMap::new();
    for table in ["runs", "tasks", "attempts", "outputs", "superseded_outputs"] {
        let columns: Vec<String> =
            sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA table_info({table})")))
                .fetch_all(&mut conn)
                .await
                .unwrap()
                .iter()
                .map(|r| format!("quote({})", r.get::<String, _>("name")))
                .collect();
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM {table} ORDER BY rowid",
            columns.join(" || '|' || ")
        )))
        .fetch_all(&mut conn)
        .await
        .unwrap();
        all.insert(table.to_owned(), rows.into_iter().map(|(r,)| r).collect());
    }
    conn.close().await.unwrap();
    all
}

// ---------------------------------------------------------------------------------------------
// A fake service, for what the sandbox never serves
// ---------------------------------------------------------------------------------------------

/// The key the binary and the client send to a [`Fake`] service (which checks none).
pub const FAKE_KEY: &str = "fake-key-0123456789";

/// A request a [`Fake`] service received.
#[derive(Clone, Debug)]
pub struct Hit {
    pub method: String,
    pub path: String,
    pub with_key: bool,
}

type Log = std::sync::Arc<std::sync::Mutex<Vec<Hit>>>;

/// A fake service on 127.0.0.1:0 that answers what its router says and counts what it is
/// asked; stops serving when dropped.
pub struct Fake {
    /// `http://127.0.0.1:<port>/`
    pub base: String,
    log: Log,
    task: tokio::task::JoinHandle<()>,
}

impl Fake {
    /// Serves the router `build` makes; `build` gets the base URL, so canned answers can hold
    /// URLs that lead back to the fake.
    pub async fn start(build: impl FnOnce(&str) -> axum::Router) -> Fake {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/", listener.local_addr().unwrap());
        let log: Log = Log::default();
        let app = build(&base).layer(axum::middleware::from_fn_with_state(log.clone(), record));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Fake { base, log, task }
    }

    /// A URL on the fake; `path` starts with '/'.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base.trim_end_matches('/'), path)
    }

    /// The requests seen for `METHOD /path`.
    pub fn hits(&self, method: &str, path: &str) -> Vec<Hit> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.method == method && h.path == path)
            .cloned()
            .collect()
    }

    /// How many requests were seen for `METHOD /path`.
    pub fn count(&self, method: &str, path: &str) -> usize {
        self.hits(method, path).len()
    }

    /// How many requests were seen in all.
    pub fn total(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// A client pointed at the fake.
    pub fn client(&self) -> Client {
        let mut config = ClientConfig::new(&self.base, ApiKey::new(FAKE_KEY).unwrap()).unwrap();
        config.timeout = Duration::from_secs(10);
        Client::new(config).unwrap()
    }

    /// The real binary pointed at the fake, with a clean environment.
    pub async fn run(&self, args: &[&str], cwd: &Path) -> Output {
        crate::binary::Imgpipe::new(args)
            .cwd(cwd)
            .service(&self.base, FAKE_KEY)
            .run()
            .await
            .into()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn record(
    axum::extract::State(log): axum::extract::State<Log>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    log.lock().unwrap().push(Hit {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
        with_key: request.headers().get("x-api-key").is_some(),
    });
    next.run(request).await
}

/// A small real PNG, as the service would serve it.
pub fn sample_png() -> Vec<u8> {
    sandbox::images::sample_png("mug", 32, sandbox::Weight::Flat)
}

/// A documented generation answer with one image at `url`.
pub fn generation(id: &str, url: &str) -> Value {
    serde_json::json!({
        "id": id,
        "status": "succeeded",
        "model": "fake-1",
        "credits_used": 4,
        "credits_remaining": 996,
        "images": [{"url": url}],
    })
}

/// A process that hangs fails the test, named, well before it would have ended; it is killed.
#[tokio::test]
#[should_panic(expected = "`sleep 20` did not finish within 200ms")]
async fn a_command_that_hangs_fails_the_test_with_its_command_line() {
    let mut cmd = Command::new("sleep");
    cmd.arg("20").stdin(Stdio::null());
    finish_within(cmd, Duration::from_millis(200)).await;
}

#[test]
fn a_blocking_command_that_hangs_fails_the_test_and_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "echo $$ > \"$0\"; exec sleep 20"])
        .arg(&pid_file)
        .stdin(Stdio::null());
    let e = try_finish_blocking(cmd, Duration::from_secs(2), "sleep 20").unwrap_err();
    assert_eq!(e, "sleep 20: still running after 2s, killed");
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let proc = PathBuf::from(format!("/proc/{}", pid.trim()));
    let deadline = std::time::Instant::now() + KILL_LIMIT;
    while proc.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the hung process {} still lives",
            pid.trim()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP proxy on 127.0.0.1 to `target`, which a test closes to cut every connection through
/// it at once: the connections are dropped and new ones refused (its port is no longer bound).
pub struct TcpProxy {
    pub port: u16,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(target: std::net::SocketAddr) -> TcpProxy {
        TcpProxy::start_on(target, 0).await
    }

    /// On a chosen port (0: any free one), e.g. the port of a proxy closed before: the
    /// connection comes back where its clients look for it.
    pub async fn start_on(target: std::net::SocketAddr, port: u16) -> TcpProxy {
        let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            // Dropped at the end: every connection's task is aborted, its sockets closed.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((mut inbound, _)) = accepted else { continue };
                        connections.spawn(async move {
                            if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            }
                        });
                    }
                    _ = stopped.changed() => return,
                }
            }
        });
        TcpProxy { port, stop, task }
    }

    /// Cuts every connection and refuses new ones.
    pub async fn close(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }
}
