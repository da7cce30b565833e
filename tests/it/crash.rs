//! Crash safety: `imgpipe run` killed (SIGKILL) or interrupted (SIGINT) at many instants, each
//! time continued with the same command, against `imgpipe sandbox` in a separate process with
//! every fault injected. At the end the files, the manifest, the state database and the
//! sandbox's ledger are held against each other: every output whole and recorded, nothing
//! billed twice that the database does not account for as possibly billed, no leftovers.
//!
//! The instants come from a seeded generator (a xorshift), so a schedule can be replayed; the
//! timing of the processes themselves is of course not reproducible. Each signal is set off by
//! something observed, plus a random delay: a time after the process started, its first call
//! billed, its taking the run lock, a download of it under way (a new `.part` file), or so many
//! output files on disk, which spreads the signals over the whole run.
//!
//! The pipeline sets `rate_limit`: without a known rate, a 429 met in a process's first second
//! (the sandbox injects some) makes imgpipe infer a rate of one call a second or less, which
//! never recovers above that, and these runs restart often.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sqlx::Connection;
use tokio::io::AsyncBufReadExt;
use tokio::process::Child;

use crate::common::{AttemptRow, Db, Imgpipe, OutputRow, TaskRow, files_under, sha256_hex};

// ---------------------------------------------------------------------------------------------
// The sandbox in a process of its own
// ---------------------------------------------------------------------------------------------

const KEY: &str = "sbx_crash_tests_key";
const BALANCE: i64 = 1_000_000;

/// `imgpipe sandbox --json --port 0 ...`, killed when dropped.
struct External {
    child: Child,
    base: String,
    http: reqwest::Client,
}

#[derive(Clone, Debug)]
struct LedgerEntry {
    job_id: String,
    operation: String,
    credits: u64,
    delivered: bool,
    /// The answer was cut after naming the job: it can be read back for free.
    partial: bool,
}

impl External {
    async fn start(dir: &Path, flags: &[&str]) -> External {
        let balance = BALANCE.to_string();
        let mut args = vec![
            "--json",
            "sandbox",
            "--port",
            "0",
            "--key",
            KEY,
            "--balance",
            &balance,
        ];
        args.extend_from_slice(flags);
        let log = std::fs::File::create(dir.join("sandbox.log")).unwrap();
        let mut cmd = Imgpipe::new(&args).cwd(dir).command();
        cmd.stdout(Stdio::piped()).stderr(Stdio::from(log));
        let mut child = cmd.spawn().expect("imgpipe sandbox starts");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the sandbox prints its address in time")
            .unwrap()
            .expect("the sandbox prints a line");
        let hello: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the sandbox printed {line:?}: {e}"));
        assert_eq!(hello["api_key"], KEY, "{hello}");
        let base = hello["base_url"].as_str().unwrap().to_owned();
        assert!(base.starts_with("http://127.0.0.1:"), "{base}");
        External {
            child,
            base,
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
        }
    }

    async fn get(&self, url: &str) -> reqwest::Response {
        self.http
            .get(url)
            .header("X-API-Key", KEY)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
    }

    /// `GET /_sandbox/stats`: `{"balance", "stats", "ledger"}`.
    async fn stats(&self) -> Value {
        let url = format!("{}_sandbox/stats", self.base);
        self.get(&url).await.json().await.unwrap()
    }

    async fn post(&self, path: &str) {
        let url = format!("{}{path}", self.base);
        let response = self
            .http
            .post(&url)
            .header("X-API-Key", KEY)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        assert!(
            response.status().is_success(),
            "POST {url}: {}",
            response.status()
        );
    }

    /// Holds paid calls at the gate, letting `calls` of them through.
    async fn hold_letting_through(&self, calls: usize) {
        self.post("_sandbox/hold").await;
        self.post(&format!("_sandbox/let-through?calls={calls}"))
            .await;
    }

    /// Releases the hold, and waits until no call waits at the gate any more: the calls held
    /// for a process ended are billed (undelivered when it was killed) and take no pass of
    /// the next round.
    async fn release(&self) {
        self.post("_sandbox/release").await;
        crate::common::wait_until_async("the held calls let go", || async {
            self.stats().await["held"] == 0
        })
        .await;
    }

    /// Whether the calls let through are used and another waits at the gate.
    async fn stalled(&self) -> bool {
        let stats = self.stats().await;
        stats["passes"] == 0 && stats["held"].as_u64().is_some_and(|n| n > 0)
    }

    async fn billed(&self) -> u64 {
        self.stats().await["stats"]["billed"].as_u64().unwrap()
    }

    /// The image behind output `k` of `job`, as the sandbox serves it now. Downloads are
    /// subject to the injected truncation too, so a short body is fetched again.
    async fn image(&self, job: &str, k: usize) -> Vec<u8> {
        let record: Value = self
            .get(&format!("{}v1/jobs/{job}", self.base))
            .await
            .json()
            .await
            .unwrap();
        let url = record["images"][k]["url"]
            .as_str()
            .or_else(|| record["data"]["url"].as_str().filter(|_| k == 0))
            .unwrap_or_else(|| panic!("no image {k} in {record}"))
            .to_owned();
        for _ in 0..20 {
            let response = self.http.get(&url).send().await.unwrap();
            assert!(
                response.status().is_success(),
                "{url}: {}",
                response.status()
            );
            let promised = response.content_length();
            if let Ok(body) = response.bytes().await
                && promised == Some(body.len() as u64)
            {
                return body.to_vec();
            }
        }
        panic!("{url} came back short 20 times");
    }
}

impl Drop for External {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

// ---------------------------------------------------------------------------------------------
// The pipeline and the runs
// ---------------------------------------------------------------------------------------------

/// `items` items, each a generation of two images, each image erased then upscaled 2×: five
/// tasks and six files an item, 8 + 2 × (2 + 2) = 16 credits.
fn pipeline(items: usize) -> String {
    let mut text = format!(
        "version: 1\nname: crash\noutput_dir: out\npricing: {{ generation: 4 }}\nconcurrency: {CONCURRENCY}\nrate_limit: 50/s\nitems:\n",
    );
    for i in 0..items {
        text += &format!("  - {{ id: i{i:02}, subject: product number {i} }}\n");
    }
    text += r#"steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.subject }}", n: 2 }
  - id: clean
    erase: { from: shot, object_name: the corner }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
"#;
    text
}

/// The task an output-reading task reads: clean[i] reads shot output i, big[i] reads clean[i].
fn upstream(step: &str, idx: i64) -> Option<(&'static str, i64, i64)> {
    match step {
        "clean" => Some(("shot", 0, idx)),
        "big" => Some(("clean", idx, 0)),
        _ => None,
    }
}

fn outputs_of(operation: &str) -> i64 {
    if operation == "generate" { 2 } else { 1 }
}

/// Runs of one pipeline and run id in one directory, each started with the same command.
struct Runner<'a> {
    dir: &'a Path,
    sandbox: &'a External,
    run_id: &'static str,
    extra: Vec<&'static str>,
    /// Environment variables of its runs (test-only settings).
    vars: Vec<(&'static str, &'static str)>,
    round: usize,
    /// `--state`: `state/state.db` in `dir`, or a PostgreSQL URL.
    state: String,
    /// Paid calls each round may make: the sandbox is held and lets this many through its gate
    /// per round, so that a round that used them stalls with its next call held and is
    /// signalled then, if its trigger has not come first. Fewer in all than the run needs: the
    /// run cannot end before its signals, however fast the machine.
    share: Option<usize>,
}

/// The default `--state` of a runner in `dir`: a SQLite file.
fn file_state(dir: &Path) -> String {
    dir.join("state")
        .join("state.db")
        .to_string_lossy()
        .into_owned()
}

impl Runner<'_> {
    /// The `--grace` its runs are given.
    fn grace(&self) -> Duration {
        self.extra
            .iter()
            .position(|a| *a == "--grace")
            .and_then(|i| self.extra.get(i + 1))
            .map_or(DEFAULT_GRACE, |s| {
                Duration::from_secs_f64(s.parse().expect("--grace is a number"))
            })
    }

    fn state(&self) -> &str {
        &self.state
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("out").join(self.run_id)
    }

    fn lock_dir(&self) -> PathBuf {
        self.dir.join("state").join("state.db.locks")
    }

    /// `imgpipe run p.yaml --run-id ID --state state/state.db --retry-base-ms 20 ...`, its
    /// stdout and stderr in `logs/`.
    fn spawn(&mut self) -> (Child, PathBuf) {
        self.round += 1;
        let logs = self.dir.join("logs");
        std::fs::create_dir_all(&logs).unwrap();
        let log = logs.join(format!("{}-{:02}.log", self.run_id, self.round));
        let state = self.state.clone();
        let mut args = vec![
            "run",
            "p.yaml",
            "--run-id",
            self.run_id,
            "--state",
            &state,
            "--retry-base-ms",
            "20",
        ];
        args.extend_from_slice(&self.extra);
        let mut cmd = Imgpipe::new(&args).cwd(self.dir).command();
        let file = std::fs::File::create(&log).unwrap();
        cmd.env("IMGPIPE_BASE_URL", &self.sandbox.base)
            .env("IMGPIPE_API_KEY", KEY)
            .envs(self.vars.iter().copied())
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file));
        (cmd.spawn().expect("imgpipe run starts"), log)
    }

    /// [`Runner::spawn`], the sandbox first held with the round's share let through when the
    /// runner has one.
    async fn start(&mut self) -> (Child, PathBuf) {
        if let Some(calls) = self.share {
            self.sandbox.hold_letting_through(calls).await;
        }
        self.spawn()
    }

    /// Releases the round's hold, if it took one.
    async fn open(&self) {
        if self.share.is_some() {
            self.sandbox.release().await;
        }
    }

    /// Runs to the end, within `limit`.
    async fn finish(&mut self, limit: Duration) -> (ExitStatus, String) {
        let (mut child, log) = self.spawn();
        let status = tokio::time::timeout(limit, child.wait())
            .await
            .unwrap_or_else(|_| panic!("the run did not finish in {limit:?}: {}", read(&log)))
            .unwrap();
        (status, read(&log))
    }
}

fn read(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

// ---------------------------------------------------------------------------------------------
// Instants and signals
// ---------------------------------------------------------------------------------------------

/// xorshift64: reproducible instants without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.between(lo, hi))
    }
}

/// What sets off a signal, and how long after it the signal is sent.
#[derive(Clone, Copy, Debug)]
enum Trigger {
    /// This long after the process was started.
    After(Duration),
    /// Once the sandbox has billed a call of this process.
    Billed(Duration),
    /// Once the run's directory holds this many output files, and one more than when this
    /// process started: the signals spread over the whole run this way.
    Files(usize, Duration),
    /// Once this process holds the run lock.
    Locked(Duration),
    /// Once a download of this process is under way: a `.part` file not seen before.
    Downloading(Duration),
}

/// How one process ended.
enum Driven {
    /// By itself, before its trigger.
    Exited(ExitStatus),
    /// After the signal sent at `at_ms` (unix ms), `after` it.
    Signalled {
        status: ExitStatus,
        at_ms: i64,
        after: Duration,
    },
    /// Still running `after` the SIGINT sent at `at_ms`: it was then killed.
    Ignored { at_ms: i64, after: Duration },
}

/// Nothing a trigger waits for takes this long unless the run is stuck.
const ROUND_LIMIT: Duration = Duration::from_secs(30);
/// How long an interrupted run may take, past its grace period for the calls in flight, to
/// record and exit. A run still there after its grace and this ignored the signal; one that
/// exits within them kept its promise, however slow the machine made it.
const RECORD_LIMIT: Duration = Duration::from_secs(10);
/// imgpipe's `--grace` when none is given.
const DEFAULT_GRACE: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(1);
/// The `concurrency` of [`pipeline`]: calls in flight at once.
const CONCURRENCY: usize = 4;

/// `.part` files under the run's directory.
fn part_files(run_dir: &Path) -> HashSet<PathBuf> {
    let mut found = HashSet::new();
    let Ok(items) = std::fs::read_dir(run_dir) else {
        return found;
    };
    for item in items.flatten() {
        if let Ok(files) = std::fs::read_dir(item.path()) {
            for f in files.flatten() {
                if f.file_name().to_string_lossy().ends_with(".part") {
                    found.insert(f.path());
                }
            }
        }
    }
    found
}

/// Output files (`<item>/<name>.png`) under the run's directory.
fn output_files(run_dir: &Path) -> usize {
    let Ok(items) = std::fs::read_dir(run_dir) else {
        return 0;
    };
    items
        .flatten()
        .filter_map(|item| std::fs::read_dir(item.path()).ok())
        .flat_map(|files| files.flatten())
        .filter(|f| {
            let name = f.file_name();
            let name = name.to_string_lossy();
            !name.starts_with('.') && name.ends_with(".png")
        })
        .count()
}

/// Whether the run lock names this process: its lock file, or its row in PostgreSQL.
async fn holds_lock(runner: &Runner<'_>, pid: u32) -> bool {
    if runner.state.starts_with("postgres") {
        let mut conn = crate::common::state_connection(&runner.state).await;
        let held: Result<(i64,), _> =
            sqlx::query_as("SELECT COUNT(*) FROM run_locks WHERE pid = $1")
                .bind(i64::from(pid))
                .fetch_one(&mut conn)
                .await;
        let _ = conn.close().await;
        return held.is_ok_and(|(n,)| n > 0);
    }
    let Ok(files) = std::fs::read_dir(runner.lock_dir()) else {
        return false;
    };
    files.flatten().any(|f| {
        std::fs::read(f.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|h| h["pid"] == pid)
    })
}

/// Waits, within the tests' `WAIT_LIMIT`, until no session holds an advisory lock on the run's
/// PostgreSQL database (a killed run's session ends when the server notices); at once on
/// SQLite, whose file lock the kernel drops with the process.
async fn lock_let_go(runner: &Runner<'_>) {
    if !runner.state.starts_with("postgres") {
        return;
    }
    crate::common::wait_until_async("the killed run's lock session to end", || async {
        let mut conn = crate::common::state_connection(&runner.state).await;
        let held: (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        let _ = conn.close().await;
        held.0 == 0
    })
    .await;
}

/// Waits for `trigger`, then sends `signal` and waits for the process to end.
async fn drive(runner: &Runner<'_>, child: &mut Child, trigger: Trigger, signal: i32) -> Driven {
    let pid = child.id().expect("the run is running");
    let started = Instant::now();
    let old_parts = part_files(&runner.run_dir());
    let billed_before = match trigger {
        Trigger::Billed(..) => runner.sandbox.billed().await,
        _ => 0,
    };
    let files_before = output_files(&runner.run_dir());
    let mut polls = 0u64;
    let then = loop {
        if let Some(status) = child.try_wait().unwrap() {
            runner.open().await;
            return Driven::Exited(status);
        }
        // The round used its share of calls and waits at the gate: now or never.
        if runner.share.is_some() && polls.is_multiple_of(3) && runner.sandbox.stalled().await {
            break Duration::ZERO;
        }
        let fired = match trigger {
            Trigger::After(d) => (started.elapsed() >= d).then_some(Duration::ZERO),
            // The sandbox's answer carries the whole ledger: ask it every few polls.
            Trigger::Billed(d) => (polls.is_multiple_of(3)
                && runner.sandbox.billed().await > billed_before)
                .then_some(d),
            Trigger::Files(n, d) => {
                (output_files(&runner.run_dir()) >= n.max(files_before + 1)).then_some(d)
            }
            Trigger::Locked(d) => holds_lock(runner, pid).await.then_some(d),
            Trigger::Downloading(d) => part_files(&runner.run_dir())
                .difference(&old_parts)
                .next()
                .map(|_| d),
        };
        if let Some(then) = fired {
            break then;
        }
        assert!(
            started.elapsed() < ROUND_LIMIT,
            "round {}: {trigger:?} did not happen in {ROUND_LIMIT:?}; is the run stuck?\n{}",
            runner.round,
            stats_line(&runner.sandbox.stats().await)
        );
        polls += 1;
        tokio::time::sleep(POLL).await;
    };
    tokio::time::sleep(then).await;
    if let Some(status) = child.try_wait().unwrap() {
        runner.open().await;
        return Driven::Exited(status);
    }
    let at_ms = now_ms();
    let sent = Instant::now();
    // The child is not reaped before `wait` below, so its pid cannot have been reused.
    let pid = libc::pid_t::try_from(pid).unwrap();
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
    // The calls held in flight go on: billed, and answered to a run that is still there.
    runner.open().await;
    let limit = if signal == libc::SIGKILL {
        crate::common::KILL_LIMIT
    } else {
        runner.grace() + RECORD_LIMIT
    };
    match tokio::time::timeout(limit, child.wait()).await {
        Ok(status) => Driven::Signalled {
            status: status.unwrap(),
            at_ms,
            after: sent.elapsed(),
        },
        Err(_) => {
            crate::common::kill_child(child, "the run that ignored the signal").await;
            Driven::Ignored {
                at_ms,
                after: sent.elapsed(),
            }
        }
    }
}

/// The sandbox's counters that tell what happened on the way.
fn stats_line(doc: &Value) -> String {
    let s = &doc["stats"];
    let shown = [
        "paid_requests",
        "server_errors",
        "rate_limited",
        "dropped_after_billing",
        "gateway_timeouts",
        "partial_answers",
        "abandoned",
        "truncated_downloads",
        "invalid",
    ];
    let counts: Vec<String> = shown.iter().map(|k| format!("{k} {}", s[k])).collect();
    format!("sandbox: {}", counts.join(", "))
}

/// A schedule of `n` signals: the first once the very first calls are billed, then, shuffled,
/// `locked` just after a process takes the run lock, and of the rest about a quarter soon after
/// a process starts, a fifth as soon as a download is under way, and the others at growing
/// counts of output files on disk, up to `last_files`, so that the signals spread over the
/// whole run.
fn schedule(rng: &mut Rng, n: usize, last_files: usize, locked: usize) -> Vec<Trigger> {
    let mut kinds: Vec<u8> = (1..n)
        .map(|i| match (i <= locked, rng.between(0, 19)) {
            (true, _) => 1,
            (false, 0..=4) => 0,
            (false, 5..=8) => 2,
            (false, _) => 3,
        })
        .collect();
    // Fisher-Yates.
    for i in (1..kinds.len()).rev() {
        let j = rng.between(0, i as u64) as usize;
        kinds.swap(i, j);
    }
    let progress = kinds.iter().filter(|k| **k == 3).count().max(1);
    let mut nth = 0;
    let mut out = vec![Trigger::Billed(rng.ms(0, 40))];
    for k in kinds {
        out.push(match k {
            0 => Trigger::After(rng.ms(0, 400)),
            1 => Trigger::Locked(rng.ms(0, 6)),
            2 => Trigger::Downloading(rng.ms(0, 3)),
            _ => {
                nth += 1;
                Trigger::Files(last_files * nth / progress, rng.ms(0, 60))
            }
        });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The state database
// ---------------------------------------------------------------------------------------------

/// The state at `state` (a SQLite file or a PostgreSQL URL), whole.
async fn read_db(state: &str) -> Db {
    Db::read(state).await
}

/// (id, status) of every run.
fn runs(db: &Db) -> Vec<(String, String)> {
    db.runs
        .iter()
        .map(|r| (r.id.clone(), r.status.clone()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The checks
// ---------------------------------------------------------------------------------------------

/// Every broken promise found, reported together so that one failure does not hide the rest.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.0.push(what());
        }
    }

    #[track_caller]
    fn assert_none(&self, context: &str) {
        assert!(
            self.0.is_empty(),
            "{context}: {} problem(s):\n- {}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }
}

fn ledger_of(stats: &Value) -> Vec<LedgerEntry> {
    stats["ledger"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| LedgerEntry {
            job_id: e["job_id"].as_str().unwrap().to_owned(),
            operation: e["operation"].as_str().unwrap().to_owned(),
            credits: e["credits"].as_u64().unwrap(),
            delivered: e["delivered"].as_bool().unwrap(),
            partial: e["partial"].as_bool().unwrap(),
        })
        .collect()
}

/// What the books say, for the summary.
#[derive(Debug, Default)]
struct Books {
    ledger_jobs: usize,
    /// Answers lost without naming their job (dropped, 504, abandoned).
    undelivered: usize,
    /// Answers cut after naming their job.
    partial: usize,
    /// Of those, the jobs a succeeded attempt took by reading them back.
    read_back: usize,
    /// Billed jobs no attempt names: paid for, answer never recorded.
    unrecorded: usize,
    ambiguous: usize,
}

/// The ledger against the database. A job the sandbox billed is either named by the one
/// succeeded attempt of one task (with the same credits), or it is not named at all: then it
/// must be one of the calls the database holds as possibly billed (an ambiguous attempt of a
/// task of the same operation, planned at those credits). A job whose answer was cut after
/// naming it and that an attempt recorded is that attempt's result, read back: never paid for
/// again. No task succeeded twice, and nothing the database says was billed is missing from
/// the ledger.
fn check_books(db: &Db, stats: &Value, p: &mut Problems) -> Books {
    let ledger = ledger_of(stats);
    let total: u64 = ledger.iter().map(|e| e.credits).sum();
    let balance = stats["balance"].as_i64().unwrap();
    p.check(BALANCE - balance == total as i64, || {
        format!(
            "the balance moved by {} but the ledger holds {total}",
            BALANCE - balance
        )
    });
    let by_job: HashMap<&str, &LedgerEntry> =
        ledger.iter().map(|e| (e.job_id.as_str(), e)).collect();
    p.check(by_job.len() == ledger.len(), || {
        "the ledger names a job twice".into()
    });
    let mut named: HashMap<&str, Vec<&AttemptRow>> = HashMap::new();
    for a in &db.attempts {
        if let Some(job) = &a.job_id {
            named.entry(job).or_default().push(a);
        }
    }
    for (job, attempts) in &named {
        p.check(by_job.contains_key(job), || {
            format!("{attempts:?} name job {job}, which the sandbox never billed")
        });
        p.check(attempts.len() == 1, || {
            format!(
                "job {job} is named by {} attempts: {attempts:?}",
                attempts.len()
            )
        });
    }
    p.check(db.attempts.iter().all(|a| a.outcome.is_some()), || {
        "attempts are left without an outcome after a finished run".into()
    });
    for t in &db.tasks {
        let won: Vec<&AttemptRow> = db
            .attempts_of(t.id)
            .into_iter()
            .filter(|a| a.outcome.as_deref() == Some("succeeded"))
            .collect();
        p.check(t.status == "succeeded", || format!("{t:?} did not succeed"));
        p.check(won.len() == 1, || {
            format!(
                "{}/{}[{}] has {} succeeded attempts: {won:?}",
                t.item,
                t.step,
                t.idx,
                won.len()
            )
        });
        let Some(a) = won.first() else { continue };
        p.check(t.job_id == a.job_id && t.billed == a.billed, || {
            format!("{t:?} does not agree with its succeeded attempt {a:?}")
        });
        if let Some(entry) = a.job_id.as_deref().and_then(|j| by_job.get(j)) {
            p.check(
                entry.credits == a.billed && entry.operation == t.operation,
                || format!("{a:?} of {t:?} against the ledger's {entry:?}"),
            );
        }
    }
    let billed: u64 = db.attempts.iter().map(|a| a.billed).sum();
    let recorded: u64 = ledger
        .iter()
        .filter(|e| named.contains_key(e.job_id.as_str()))
        .map(|e| e.credits)
        .sum();
    p.check(billed == recorded, || {
        format!("the database holds {billed} credits billed, the ledger {recorded} for its jobs")
    });
    // Jobs billed that no attempt names, against the possibly billed attempts, operation by
    // operation (each operation has one price here, so counts bound credits too).
    let mut unrecorded: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for e in ledger
        .iter()
        .filter(|e| !named.contains_key(e.job_id.as_str()))
    {
        let slot = unrecorded.entry(e.operation.as_str()).or_default();
        slot.0 += 1;
        slot.1 += e.credits;
    }
    let mut possible: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for a in db.ambiguous().into_iter().filter(|a| a.job_id.is_none()) {
        let t = db.task(a.task_id);
        let slot = possible.entry(t.operation.as_str()).or_default();
        slot.0 += 1;
        slot.1 += t.planned;
    }
    for (op, (n, credits)) in &unrecorded {
        let (can, can_credits) = possible.get(op).copied().unwrap_or_default();
        p.check(*n <= can && *credits <= can_credits, || {
            format!(
                "{n} {op} job(s) ({credits} credits) were billed and never recorded, but only {can} {op} attempt(s) ({can_credits} credits) are recorded as possibly billed"
            )
        });
    }
    let mut read_back = 0;
    for e in ledger.iter().filter(|e| e.partial) {
        let Some(attempts) = named.get(e.job_id.as_str()) else {
            continue;
        };
        let took = attempts.iter().any(|a| {
            a.outcome.as_deref() == Some("succeeded")
                && a.error.as_deref().is_some_and(|n| n.contains("recovered"))
        });
        read_back += usize::from(took);
        p.check(took, || {
            format!(
                "job {} was cut after naming itself, recorded by {attempts:?}, and never read back",
                e.job_id
            )
        });
    }
    Books {
        ledger_jobs: ledger.len(),
        undelivered: ledger.iter().filter(|e| !e.delivered && !e.partial).count(),
        partial: ledger.iter().filter(|e| e.partial).count(),
        read_back,
        unrecorded: unrecorded.values().map(|v| v.0).sum(),
        ambiguous: db.ambiguous().len(),
    }
}

/// The files against the database, the manifest and the sandbox: every output of every task
/// recorded and downloaded, each file's digest and size the recorded ones and the very bytes
/// the sandbox holds for its job, the lineage of each call, and nothing else in the run's
/// directory: no `.part` or temporary file left behind.
async fn check_outputs(
    dir: &Path,
    run_dir: &Path,
    db: &Db,
    sandbox: &External,
    p: &mut Problems,
) -> usize {
    let mut expected: BTreeSet<String> = BTreeSet::new();
    let mut by_path: HashMap<String, &OutputRow> = HashMap::new();
    for t in &db.tasks {
        let outs: Vec<&OutputRow> = db.outputs.iter().filter(|o| o.task_id == t.id).collect();
        p.check(outs.len() as i64 == outputs_of(&t.operation), || {
            format!("{t:?} has outputs {outs:?}")
        });
        for o in outs {
            let name = format!("{}/{}-{}.png", t.item, t.step, t.idx + o.k);
            expected.insert(name.clone());
            p.check(Some(&o.job_id) == t.job_id.as_ref(), || {
                format!("{o:?} is not of its task's job {:?}", t.job_id)
            });
            if let Some((step, idx, k)) = upstream(&t.step, t.idx) {
                let parent = db.find(&t.item, step, idx).and_then(|u| u.job_id.clone());
                p.check(o.parent_job_id == parent, || {
                    format!(
                        "{name} was made from {:?}, not from {step}[{idx}] output {k} ({parent:?})",
                        o.parent_job_id
                    )
                });
            }
            let Some(path) = &o.path else {
                p.check(false, || format!("{name} was never downloaded: {o:?}"));
                continue;
            };
            p.check(o.download_error.is_none(), || {
                format!("{name} keeps a download error: {o:?}")
            });
            let file = dir.join(path);
            p.check(file == run_dir.join(&name), || {
                format!("{name} was recorded at {}", file.display())
            });
            let Ok(bytes) = std::fs::read(&file) else {
                p.check(false, || format!("{} is missing", file.display()));
                continue;
            };
            let digest = sha256_hex(&bytes);
            p.check(o.sha256.as_deref() == Some(digest.as_str()), || {
                format!(
                    "{name} has sha256 {digest}, the database says {:?}",
                    o.sha256
                )
            });
            p.check(o.bytes == Some(bytes.len() as i64), || {
                format!(
                    "{name} has {} bytes, the database says {:?}",
                    bytes.len(),
                    o.bytes
                )
            });
            let truth = sandbox.image(&o.job_id, o.k as usize).await;
            p.check(truth == bytes, || {
                format!("{name} is not the image of job {} output {}", o.job_id, o.k)
            });
            p.check(
                image::load_from_memory_with_format(&bytes, image::ImageFormat::Png).is_ok(),
                || format!("{name} is not a whole PNG"),
            );
            by_path.insert(name, o);
        }
    }
    let manifest = std::fs::read_to_string(run_dir.join("manifest.jsonl")).unwrap_or_default();
    let lines: Vec<Value> = manifest
        .lines()
        .filter_map(|l| {
            let line = serde_json::from_str(l).ok();
            p.check(line.is_some(), || {
                format!("a manifest line is not JSON: {l:?}")
            });
            line
        })
        .collect();
    p.check(lines.len() == expected.len(), || {
        format!(
            "the manifest has {} lines for {} outputs",
            lines.len(),
            expected.len()
        )
    });
    for line in &lines {
        let path = line["path"].as_str().unwrap_or_default();
        let Some(o) = by_path.get(path) else {
            p.check(false, || format!("the manifest names {path}: {line}"));
            continue;
        };
        let t = db.task(o.task_id);
        p.check(
            line["sha256"].as_str() == o.sha256.as_deref()
                && line["bytes"].as_i64() == o.bytes
                && line["job_id"] == o.job_id.as_str()
                && line["item"] == t.item.as_str()
                && line["step"] == t.step.as_str()
                && line["index"] == t.idx + o.k
                && line["credits"] == t.billed,
            || format!("the manifest's {line} against {o:?} of {t:?}"),
        );
    }
    expected.insert("manifest.jsonl".into());
    let on_disk = files_under(run_dir);
    let extra: Vec<&String> = on_disk.difference(&expected).collect();
    let missing: Vec<&String> = expected.difference(&on_disk).collect();
    p.check(extra.is_empty(), || {
        format!(
            "files left in {} that no record names: {extra:?}",
            run_dir.display()
        )
    });
    p.check(missing.is_empty(), || format!("files missing: {missing:?}"));
    expected.len() - 1
}

/// The database is sound and holds one run, finished.
fn check_db(db: &Db, run_id: &str, tasks: usize, p: &mut Problems) {
    p.check(db.integrity == "ok", || {
        format!("PRAGMA integrity_check: {}", db.integrity)
    });
    p.check(db.foreign_key_faults == 0, || {
        format!("{} rows break a foreign key", db.foreign_key_faults)
    });
    p.check(
        runs(db) == [(run_id.to_owned(), "succeeded".to_owned())],
        || format!("runs: {:?}", runs(db)),
    );
    p.check(db.tasks.len() == tasks, || {
        format!("{} tasks recorded of {tasks}", db.tasks.len())
    });
}

/// Runs until the run finishes: a run may legitimately end 4 when a task or a download ran out
/// of tries under the injected faults; continuing it then finishes it.
async fn finish_run(runner: &mut Runner<'_>) -> usize {
    for finishing in 1..=3 {
        let (status, log) = runner.finish(Duration::from_secs(60)).await;
        match status.code() {
            Some(0) => return finishing,
            Some(4) if finishing < 3 => eprintln!("a finishing run ended 4; continuing it:\n{log}"),
            _ => panic!("the finishing run ended {status}:\n{log}"),
        }
    }
    unreachable!()
}

const FAULTS: [&str; 12] = [
    "--fault-server-error",
    "0.05",
    "--fault-rate-limit",
    "0.01",
    "--fault-drop",
    "0.03",
    "--fault-gateway-timeout",
    "0.02",
    "--fault-partial",
    "0.05",
    "--fault-truncate",
    "0.05",
];

/// A sandbox whose calls take 60 to 140 ms, with every fault, and `p.yaml` of `items` items.
async fn faulty_sandbox(dir: &Path, items: usize, seed: &str) -> External {
    std::fs::write(dir.join("p.yaml"), pipeline(items)).unwrap();
    let mut flags = vec![
        "--latency-ms",
        "60",
        "--jitter-ms",
        "80",
        "--image-side",
        "64",
        "--seed",
        seed,
    ];
    flags.extend_from_slice(&FAULTS);
    External::start(dir, &flags).await
}

/// `imgpipe plan p.yaml --json`: the number of tasks.
async fn planned_tasks(dir: &Path, sandbox: &External) -> usize {
    let mut cmd = Imgpipe::new(&["plan", "p.yaml", "--json"])
        .cwd(dir)
        .command();
    cmd.env("IMGPIPE_BASE_URL", &sandbox.base)
        .env("IMGPIPE_API_KEY", KEY);
    let o = crate::common::finish(cmd).await;
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    doc["costs"]["tasks"].as_u64().unwrap() as usize
}

// ---------------------------------------------------------------------------------------------
// 1. SIGKILL
// ---------------------------------------------------------------------------------------------

/// 40 items, 200 tasks, 240 files; killed 24 times, then finished.
#[tokio::test(flavor = "multi_thread")]
async fn killed_24_times_under_every_fault_the_run_finishes_without_paying_twice() {
    killed_24_times(None).await;
}

/// The same, with the state in PostgreSQL: its run lock, intents and results.
#[tokio::test(flavor = "multi_thread")]
async fn killed_24_times_with_the_state_in_postgres_the_run_finishes_without_paying_twice() {
    if let Some(url) = crate::common::postgres_database("crash").await {
        killed_24_times(Some(url.to_string())).await;
    }
}

/// Kills the run 24 times at instants spread over it, with its state at `state` (else a
/// SQLite file), then finishes it and holds the books, files and records against each other.
async fn killed_24_times(state: Option<String>) {
    let clock = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sandbox = faulty_sandbox(dir, 40, "20261122").await;
    let tasks = planned_tasks(dir, &sandbox).await;
    assert_eq!(tasks, 200);
    let mut runner = Runner {
        dir,
        sandbox: &sandbox,
        run_id: "crash1",
        extra: vec![],
        vars: Vec::new(),
        round: 0,
        state: state.unwrap_or_else(|| file_state(dir)),
        // 24 rounds of 8 calls, 192, fewer than the 200 tasks: every round is killed.
        share: Some(tasks / 25),
    };
    let mut rng = Rng(0x5EED_0001_C0FF_EE11);
    let plan = schedule(&mut rng, 24, 220, 2);
    let mut kills = 0;
    for trigger in plan {
        let (mut child, log) = runner.start().await;
        match drive(&runner, &mut child, trigger, libc::SIGKILL).await {
            Driven::Signalled { status, .. } if status.signal() == Some(libc::SIGKILL) => {
                kills += 1;
                // The server lets the lock go when it sees the session end, a moment after
                // the process died: the next run would find it held (exit 5, as README says).
                lock_let_go(&runner).await;
            }
            Driven::Signalled { status, .. } | Driven::Exited(status) => match status.code() {
                Some(0) => break,
                Some(4) => eprintln!("a run ended 4 under the faults; continuing"),
                _ => panic!(
                    "round {}: the run ended {status}:\n{}",
                    runner.round,
                    read(&log)
                ),
            },
            Driven::Ignored { .. } => unreachable!("SIGKILL cannot be ignored"),
        }
    }
    assert!(
        kills >= 20,
        "only {kills} kills landed before the run ended"
    );
    let finishing = finish_run(&mut runner).await;

    let stats = sandbox.stats().await;
    let db = read_db(runner.state()).await;
    let mut p = Problems::default();
    check_db(&db, "crash1", tasks, &mut p);
    let books = check_books(&db, &stats, &mut p);
    // Answers cut after naming their job were met and read back (a kill between the cut and
    // its record may leave one unnamed, counted above among the possibly billed).
    p.check(books.read_back > 0, || {
        format!("no cut answer was read back: {books:?}")
    });
    let files = check_outputs(dir, &runner.run_dir(), &db, &sandbox, &mut p).await;
    eprintln!(
        "crash (SIGKILL): {kills} kills, {finishing} finishing run(s), {} processes; {} attempts, {} ambiguous; {} ledger jobs, {} undelivered, {} cut after naming the job ({} read back), {} billed but never recorded; {files} files; {}; {:.1}s",
        runner.round,
        db.attempts.len(),
        books.ambiguous,
        books.ledger_jobs,
        books.undelivered,
        books.partial,
        books.read_back,
        books.unrecorded,
        stats_line(&stats),
        clock.elapsed().as_secs_f64()
    );
    p.assert_none("after 24 kills");
}

/// A run records its items' tasks lazily, a chunk of items at a time (1,024; 16 here, by the
/// test-only `IMGPIPE_TEST_CHUNK_ITEMS`), as the scheduler comes near them. 40 items (200
/// tasks, three chunks) killed once the first chunk is recorded, its calls held at the
/// sandbox's gate so that the run cannot record a second before the signal, leave the others
/// unrecorded: the continued run records the rest, pays for each task once, and the books,
/// files and database agree.
#[tokio::test(flavor = "multi_thread")]
async fn killed_as_the_run_is_being_recorded_it_is_continued() {
    const CHUNK: usize = 16;
    const ITEMS: usize = 40;
    const TASKS: usize = ITEMS * 5;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("p.yaml"), pipeline(ITEMS)).unwrap();
    let sandbox = External::start(dir, &["--image-side", "16"]).await;
    let mut runner = Runner {
        dir,
        sandbox: &sandbox,
        run_id: "early",
        extra: vec!["--rate", "2000/s"],
        vars: vec![("IMGPIPE_TEST_CHUNK_ITEMS", "16")],
        round: 0,
        state: file_state(dir),
        // Every call held: the scheduler records the next chunk only as calls come back.
        share: Some(0),
    };
    let (mut child, _) = runner.start().await;
    let state = runner.state().to_owned();
    let started = Instant::now();
    // Kill once the first chunk of tasks is committed and the run's first calls wait at the
    // gate.
    loop {
        if crate::common::rows_in(Path::new(&state), "tasks").await > 0 && sandbox.stalled().await {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended first");
        assert!(
            started.elapsed() < ROUND_LIMIT,
            "no task recorded and call held within {ROUND_LIMIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    crate::common::kill_child(&mut child, "the recording run").await;
    runner.open().await;
    let first = read_db(&state).await;
    let recorded = first.tasks.len();
    eprintln!("crash (recording): killed with {recorded} of {TASKS} tasks recorded");
    assert_eq!(
        recorded,
        CHUNK * 5,
        "tasks recorded at first: not one chunk of items"
    );
    assert!(
        first.attempts.len() < TASKS,
        "the killed run had all but finished"
    );
    assert_eq!(
        runs(&first),
        [("early".to_owned(), "running".to_owned())],
        "the run was recorded before its tasks, and the kill left it unfinished"
    );
    // Items are recorded whole or not at all: each recorded item has its five tasks.
    let mut per_item: BTreeMap<&str, usize> = BTreeMap::new();
    for t in &first.tasks {
        *per_item.entry(t.item.as_str()).or_default() += 1;
    }
    let broken: Vec<_> = per_item.iter().filter(|(_, n)| **n != 5).collect();
    assert!(broken.is_empty(), "items recorded in part: {broken:?}");
    // Calls in flight at the kill may have been billed; no other call can have been.
    let in_flight = first
        .attempts
        .iter()
        .filter(|a| a.outcome.is_none())
        .count();

    let finishing = finish_run(&mut runner).await;
    let stats = sandbox.stats().await;
    let db = read_db(runner.state()).await;
    let mut p = Problems::default();
    check_db(&db, "early", TASKS, &mut p);
    let books = check_books(&db, &stats, &mut p);
    // No fault is injected: every task is billed exactly once, but for calls in flight at the
    // kill, which the database holds as possibly billed.
    let billed = ledger_of(&stats).len();
    p.check((TASKS..=TASKS + in_flight).contains(&billed), || {
        format!(
            "{billed} calls billed for {TASKS} tasks and {in_flight} calls in flight at the kill"
        )
    });
    p.check(books.ambiguous == in_flight, || {
        format!(
            "{} attempts possibly billed, {in_flight} in flight at the kill",
            books.ambiguous
        )
    });
    check_outputs(dir, &runner.run_dir(), &db, &sandbox, &mut p).await;
    p.assert_none(&format!(
        "after a kill with {recorded} of {TASKS} tasks recorded, and {finishing} run(s) to finish ({books:?})"
    ));
}

// ---------------------------------------------------------------------------------------------
// 2. SIGINT
// ---------------------------------------------------------------------------------------------

/// The attempts recorded so far: how many, and the last id.
async fn attempts_so_far(state: &str) -> (usize, i64) {
    if !state.starts_with("postgres") && !Path::new(state).exists() {
        return (0, 0);
    }
    let db = read_db(state).await;
    (db.attempts.len(), db.attempts.last().map_or(0, |a| a.id))
}

/// When the run saw its signal (unix ms, by its own clock) and how many calls it had in flight
/// then, from its log line `… interrupted: no new calls; waiting up to 10s for N in flight`;
/// `None` when it never said so.
fn seen_signal(log: &str) -> Option<(i64, usize)> {
    let line = log
        .lines()
        .find(|l| l.contains("interrupted: no new calls"))?;
    let parsed = (|| {
        let stamp: jiff::Timestamp = line.split_whitespace().next()?.parse().ok()?;
        let (_, n) = line.rsplit_once(" for ")?;
        let n = n.trim().strip_suffix(" in flight")?.parse().ok()?;
        Some((stamp.as_millisecond(), n))
    })();
    Some(parsed.unwrap_or_else(|| panic!("cannot read the time and the calls of {line:?}")))
}

/// The calls of this round (attempts after `after_id`) started after the run stopped
/// dispatching, the most there may be, and since when they are counted. A call started after
/// the run saw its signal (by its own log and clock) must be one it had already sent on its
/// way: at most the calls it said were in flight. Without that line (the signal came as the
/// calls ended), those started after the signal was sent at `at_ms` are counted, at most a
/// concurrency's worth that had passed their last check. No duration decides: a slow machine
/// delays every stamp alike.
fn late_calls<'a>(
    db: &'a Db,
    after_id: i64,
    at_ms: i64,
    log: &str,
) -> (Vec<&'a AttemptRow>, usize, String) {
    let (since, ceiling, what) = match seen_signal(log) {
        Some((seen, in_flight)) => (seen, in_flight, "the run saw the signal"),
        None => (at_ms, CONCURRENCY, "SIGINT was sent"),
    };
    let late = db
        .attempts
        .iter()
        .filter(|a| a.id > after_id && a.started_at > since)
        .collect();
    (late, ceiling, what.to_owned())
}

/// The same run interrupted 20 times: each time it must stop sending calls at once, let the
/// calls in flight finish, record everything and exit 130 with the command that continues it.
#[tokio::test(flavor = "multi_thread")]
async fn interrupted_20_times_each_run_stops_at_once_and_records_everything() {
    let clock = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sandbox = faulty_sandbox(dir, 40, "20261123").await;
    let mut runner = Runner {
        dir,
        sandbox: &sandbox,
        run_id: "int1",
        extra: vec!["--grace", "10"],
        vars: Vec::new(),
        round: 0,
        state: file_state(dir),
        // 20 rounds of 9 calls, 180, fewer than the 200 tasks: every round is interrupted.
        share: Some(200 / 21),
    };
    let mut rng = Rng(0x5EED_0002_DEAD_BEEF);
    let plan = schedule(&mut rng, 20, 220, 4);
    let mut broken = Problems::default();
    let (mut interrupted, mut before_handler, mut killed) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    for trigger in plan {
        let before = attempts_so_far(runner.state()).await;
        let parts_before = part_files(&runner.run_dir());
        let (mut child, log) = runner.start().await;
        let round = runner.round;
        let driven = drive(&runner, &mut child, trigger, libc::SIGINT).await;
        let text = read(&log);
        let (status, at_ms) = match driven {
            Driven::Exited(status) => match status.code() {
                Some(0) => break,
                Some(4) => continue,
                _ => panic!("round {round}: the run ended {status} by itself:\n{text}"),
            },
            Driven::Ignored { at_ms, after } => {
                killed += 1;
                broken.check(false, || {
                    format!("round {round} ({trigger:?}): still running {after:?} after SIGINT; killed. Its log:\n{text}")
                });
                (None, at_ms)
            }
            Driven::Signalled {
                status,
                at_ms,
                after,
            } => {
                slowest = slowest.max(after);
                (Some(status), at_ms)
            }
        };
        let db = read_db(runner.state()).await;
        let (late, ceiling, since) = late_calls(&db, before.1, at_ms, &text);
        let over = late.len() > ceiling;
        broken.check(!over, || {
            format!(
                "round {round} ({trigger:?}): {} call(s) started after {since}, more than the {ceiling} that may have passed their last check: {late:#?}",
                late.len()
            )
        });
        let Some(status) = status else { continue };
        let run = db.runs.first().map(|r| r.status.as_str());
        match (status.code(), status.signal()) {
            // Interrupted while waiting for the run lock: nothing was touched.
            (Some(130), _) if text.contains("interrupted; nothing was started") => {
                interrupted += 1;
                broken.check(attempts_so_far(runner.state()).await == before, || {
                    format!("round {round}: said nothing was started, yet made calls")
                });
            }
            (Some(130), _) => {
                interrupted += 1;
                broken.check(
                    text.contains("continue with: imgpipe run p.yaml --run-id int1")
                        || text.contains("continue with: imgpipe resume int1"),
                    || format!("round {round}: exit 130 without the way to continue:\n{text}"),
                );
                let parts: Vec<PathBuf> = part_files(&runner.run_dir())
                    .difference(&parts_before)
                    .cloned()
                    .collect();
                broken.check(parts.is_empty(), || {
                    format!(
                        "round {round} ({trigger:?}): exit 130 leaving partial downloads {parts:?}"
                    )
                });
                broken.check(
                    run.is_none_or(|s| s == "interrupted")
                        && db.attempts.iter().all(|a| a.outcome.is_some())
                        && db.tasks.iter().all(|t| t.status != "running"),
                    || format!("round {round}: interrupted, yet the run reads {run:?} with calls still marked in flight"),
                );
            }
            // SIGINT before the run installed its handler: allowed only when it had not
            // started anything.
            (None, Some(libc::SIGINT)) => {
                before_handler += 1;
                broken.check(attempts_so_far(runner.state()).await == before, || {
                    format!("round {round}: died of SIGINT after it had started calls")
                });
            }
            (Some(0), _) if run == Some("succeeded") && !over => {
                eprintln!("round {round}: SIGINT came after the work was done; the run finished");
                break;
            }
            _ => broken.check(false, || {
                format!("round {round} ({trigger:?}): SIGINT gave {status}, not 130:\n{text}")
            }),
        }
    }
    let landed = interrupted + before_handler + killed;
    broken.check(landed >= 18, || {
        format!("only {landed} interruptions landed before the run ended")
    });
    let finishing = finish_run(&mut runner).await;

    let stats = sandbox.stats().await;
    let db = read_db(runner.state()).await;
    let mut p = Problems::default();
    check_db(&db, "int1", 200, &mut p);
    let books = check_books(&db, &stats, &mut p);
    // Interrupted gracefully, every call in flight was answered and recorded: the only
    // possibly billed calls are those the sandbox's faults cut off without naming the job,
    // every answer cut after naming its job was read back, and every bill the sandbox
    // delivered is recorded. (Not so if a run had to be killed above.)
    if killed == 0 {
        let s = &stats["stats"];
        let faults =
            s["dropped_after_billing"].as_u64().unwrap() + s["gateway_timeouts"].as_u64().unwrap();
        p.check(
            books.unrecorded == books.undelivered
                && books.ambiguous as u64 == faults
                && books.undelivered as u64 == faults
                && books.partial > 0
                && books.read_back == books.partial
                && s["abandoned"] == 0,
            || {
                format!(
                    "after graceful interruptions: {books:?}, {faults} calls cut off by faults, {}",
                    stats_line(&stats)
                )
            },
        );
    }
    let files = check_outputs(dir, &runner.run_dir(), &db, &sandbox, &mut p).await;
    eprintln!(
        "crash (SIGINT): {interrupted} exits 130, {before_handler} deaths by SIGINT before any work, {killed} SIGINTs ignored (killed), slowest exit {slowest:?} after SIGINT, {finishing} finishing run(s); {} attempts, {} ambiguous; {} ledger jobs, {} undelivered, {} cut after naming the job ({} read back), {} billed but never recorded; {files} files; {}; {:.1}s",
        db.attempts.len(),
        books.ambiguous,
        books.ledger_jobs,
        books.undelivered,
        books.partial,
        books.read_back,
        books.unrecorded,
        stats_line(&stats),
        clock.elapsed().as_secs_f64()
    );
    // The interruptions first: a run that ignored its SIGINT was killed, which may explain
    // some of the rest (a leftover file, a bill never recorded).
    broken.0.extend(p.0);
    broken.assert_none("20 interruptions");
}

// ---------------------------------------------------------------------------------------------
// 3. Continuing after the result URLs expired
// ---------------------------------------------------------------------------------------------

/// Interrupted once the first generations are done and before their edits ran, continued after
/// every URL it holds has expired: the edits get fresh URLs from the jobs, nothing is paid for
/// twice and no expired URL reaches the service.
#[tokio::test(flavor = "multi_thread")]
async fn continued_after_its_urls_expired_the_run_pays_nothing_twice() {
    let clock = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("p.yaml"), pipeline(8)).unwrap();
    let sandbox = External::start(
        dir,
        &[
            "--url-ttl",
            "2",
            "--latency-ms",
            "150",
            "--image-side",
            "32",
        ],
    )
    .await;
    let mut runner = Runner {
        dir,
        sandbox: &sandbox,
        run_id: "ttl",
        extra: vec!["--url-ttl", "2", "--url-margin", "0.5"],
        vars: Vec::new(),
        round: 0,
        state: file_state(dir),
        // One call let through the gate, the next held: the SIGINT lands while the first
        // generation is done and the calls after it (other generations, its first edit) wait
        // at the gate, whatever the machine's speed; they finish once it has landed.
        share: Some(1),
    };
    let (mut child, log) = runner.start().await;
    let driven = drive(
        &runner,
        &mut child,
        // Never by itself: `drive` signals once the share is used and a call waits.
        Trigger::After(Duration::MAX),
        libc::SIGINT,
    )
    .await;
    let Driven::Signalled { status, .. } = driven else {
        panic!("the run was not interrupted:\n{}", read(&log));
    };
    assert_eq!(status.code(), Some(130), "{}", read(&log));
    let first = read_db(runner.state()).await;
    let interrupted_at = now_ms();
    // Items whose generation succeeded and whose edits were never tried.
    let waiting: Vec<&TaskRow> = first
        .tasks
        .iter()
        .filter(|t| {
            t.step == "shot"
                && t.status == "succeeded"
                && first
                    .tasks
                    .iter()
                    .filter(|d| d.item == t.item && d.step != "shot")
                    .all(|d| first.attempts_of(d.id).is_empty())
        })
        .collect();
    assert!(
        !waiting.is_empty(),
        "no generation was left waiting for its edits: {:#?}",
        first.tasks
    );
    let shots: Vec<(String, Option<String>)> = waiting
        .iter()
        .map(|t| (t.item.clone(), t.job_id.clone()))
        .collect();
    // Longer than a URL lives: the URLs the run holds are refused now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for o in first.outputs.iter().filter(|o| o.task_id == waiting[0].id) {
        let status = sandbox.http.get(&o.url).send().await.unwrap().status();
        assert_eq!(status, 403, "{} is still served", o.url);
    }
    let (status, log) = runner.finish(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(0), "{log}");

    let stats = sandbox.stats().await;
    let db = read_db(runner.state()).await;
    let mut p = Problems::default();
    check_db(&db, "ttl", 40, &mut p);
    let books = check_books(&db, &stats, &mut p);
    p.check(
        books.ledger_jobs == 40 && books.undelivered == 0 && books.ambiguous == 0,
        || format!("each of the 40 tasks billed once: {books:?}"),
    );
    p.check(db.attempts.len() == 40, || {
        format!("{} attempts for 40 tasks", db.attempts.len())
    });
    p.check(stats["stats"]["invalid"] == 0, || {
        format!("an expired URL reached the service: {}", stats_line(&stats))
    });
    for (item, job) in &shots {
        let shot = db.find(item, "shot", 0).unwrap();
        p.check(&shot.job_id == job, || {
            format!(
                "{item}'s generation was replaced: {job:?} then, {:?} now",
                shot.job_id
            )
        });
        for o in db.outputs.iter().filter(|o| o.task_id == shot.id) {
            p.check(o.url_issued_at > interrupted_at, || {
                format!("{item}'s shot output {} was never refreshed: {o:?}", o.k)
            });
        }
    }
    let files = check_outputs(dir, &runner.run_dir(), &db, &sandbox, &mut p).await;
    eprintln!(
        "crash (expired URLs): {} generation(s) waited for their edits; {} ledger jobs; {files} files; {}; {:.1}s",
        shots.len(),
        books.ledger_jobs,
        stats_line(&stats),
        clock.elapsed().as_secs_f64()
    );
    p.assert_none("after continuing with expired URLs");
}
