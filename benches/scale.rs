//! A run at batch scale (the issue "the executor at batch scale"): IMGPIPE_BENCH_ITEMS items
//! (default 100,000) from JSONL through the chain of `pipelines/product-shots.yaml` (generate
//! `n: 2` → erase → expand 16:9 → upscale 4× → remove_background: 9 tasks an item, no budget),
//! run by `imgpipe run --concurrency 16` (release) against `imgpipe sandbox` (32-pixel images,
//! no latency, no rate limit) in separate processes:
//!
//! - start-up: from spawning `imgpipe run` to its first paid call, i.e. the `started_at` of the
//!   first attempt it records (the state database polled read-only every 50 ms) less the
//!   spawn's wall-clock time. Goal: at most 1 s more than one read of the items file, timed
//!   here as reading the file and parsing every line;
//! - memory: the run's peak RSS, sampled (VmHWM) every 100 ms while it calls, and the kernel's
//!   final figure (wait4) once it has stopped. IMGPIPE_BENCH_RUN_SECS seconds (default 10)
//!   after its first call the run gets SIGINT, as from a user at the terminal. Goal: 100 MB;
//! - then, on that interrupted run: `resume --dry-run` (goal 2 s and 100 MB), `status` and
//!   `report` (goal 2 s each): wall time and peak RSS from wait4.
//!
//! Every run gets its own sandbox, state database and output directory (removed after it,
//! unless IMGPIPE_BENCH_KEEP is set). Medians of
//! IMGPIPE_BENCH_RUNS runs (default 1: a run of 100,000 items takes minutes). Run with
//! `cargo bench --bench scale`; IMGPIPE_BENCH_BINARY=PATH measures another build.
//!
//! Beyond one machine: IMGPIPE_BENCH_STATE=postgres://ADMIN@HOST:PORT/DB keeps each run's state
//! in a fresh database of that PostgreSQL server, and IMGPIPE_BENCH_OUT=s3 its outputs in a
//! bucket of an S3-compatible server the bench runs on 127.0.0.1 (s3s-fs), as `cargo bench
//! --bench run` does. IMGPIPE_BENCH_KILL=1 stops the run with SIGKILL instead of SIGINT,
//! IMGPIPE_BENCH_RUN_SECS (default 25 then) after its first paid call, as a pod is lost, then at
//! once (no ANALYZE, no wait) measures `resume --dry-run`, the takeover (a real `resume`, from
//! its spawn to its first paid call, i.e. the first attempt it records; then SIGINT), `status`,
//! `report` and `report` made again. Goals then: 2 s, 3 s, 1 s and 3 s. The requests the
//! takeover sent the S3 server before its first paid call are counted. IMGPIPE_BENCH_REPORT=0
//! leaves both reports out (a report of a run in object storage can take many minutes).
//! IMGPIPE_BENCH_S3_LIST_MS delays each listing page the S3 server answers (S3 takes about
//! 300 ms), and IMGPIPE_BENCH_SEED_OUTPUTS=N makes the killed night N stored outputs long
//! without paying for them ([`seed_outputs`]), for the takeover of a whole night.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sqlx::Connection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, Usage, binary, env_usize};

const DEFAULT_ITEMS: usize = 100_000;
const DEFAULT_RUNS: usize = 1;
const DEFAULT_RUN_SECS: usize = 10;
/// How long a killed run calls before its SIGKILL: enough for thousands of outputs.
const DEFAULT_KILL_SECS: usize = 25;
/// generate `n: 2`, then four tool steps on each of its two images.
const TASKS_PER_ITEM: usize = 9;
const CONCURRENCY: &str = "16";
const IMAGE_SIDE: &str = "32";
/// Enough for any size this bench makes: the run must never stop for want of credits.
const BALANCE: &str = "1000000000000";
const MIB: f64 = 1024.0 * 1024.0;
/// The issue's memory goal, 100 MB, in MiB.
const GOAL_MIB: f64 = 100e6 / MIB;
/// Start-up allowed on top of one read of the items file.
const GOAL_FIRST_CALL_S: f64 = 1.0;
const GOAL_COMMAND_S: f64 = 2.0;
/// After a kill -9: the takeover's first paid call, `status`, and `report` made again.
const GOAL_TAKEOVER_S: f64 = 3.0;
const GOAL_KILLED_STATUS_S: f64 = 1.0;
const GOAL_KILLED_REPORT_S: f64 = 3.0;
const POLL: Duration = Duration::from_millis(50);
/// VmHWM is read every this many polls (100 ms).
const SAMPLE_EVERY: u32 = 2;
/// Longest wait for the first paid call before the bench gives up.
const FIRST_CALL_TIMEOUT: Duration = Duration::from_secs(900);
/// Longest wait for the run to stop after SIGINT (its `--grace` is 60 s) before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(120);

const PIPELINE: &str = r#"version: 1
name: scale-bench
pricing: { generation: 4 }
items_from: items.jsonl
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.subject }} on a white backdrop", n: 2, size: 2K }
  - id: clean
    erase: { from: shot, object_name: "{{ item.remove }}" }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9", prompt: extend the backdrop }
  - id: big
    upscale: { from: wide, desired_increase: 4 }
  - id: cutout
    remove_background: { from: big }
"#;

const SUBJECTS: [&str; 4] = [
    "a ceramic coffee mug",
    "a brass desk lamp",
    "an oak dining chair",
    "a linen cushion",
];
const REMOVALS: [&str; 4] = [
    "the price sticker",
    "the power cable",
    "the floor scuff",
    "the loose thread",
];

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Sample {
    /// Seconds to read the items file and parse every line, in this process.
    items_read: f64,
    /// Seconds from spawning `imgpipe run` to its first paid call.
    first_call: f64,
    /// VmHWM when the bench saw the first call (MiB).
    hwm_at_first_mib: f64,
    /// The most VmHWM sampled before SIGINT (MiB).
    sampled_peak_mib: f64,
    /// The run as the kernel accounted it, SIGINT and shutdown included.
    run: Usage,
    /// Seconds from SIGINT to the run's exit.
    stop: f64,
    tasks: u64,
    succeeded: u64,
    attempts: u64,
    /// Outputs stored (downloaded) when the run stopped.
    stored: u64,
    resume: Usage,
    /// Seconds from spawning the real `resume` to its first paid call (kill -9 only).
    takeover: f64,
    /// Requests to the S3 server from the takeover's spawn to its first paid call.
    takeover_s3: u64,
    /// Of them, LIST requests.
    takeover_lists: u64,
    status: Usage,
    report: Usage,
    /// `report` made again, its thumbnails made.
    report_again: Usage,
}

/// Where the state and outputs are, and how the run is stopped.
#[derive(Clone, Copy)]
struct Mode {
    postgres: bool,
    s3: bool,
    kill: bool,
    /// Whether `report` is measured (IMGPIPE_BENCH_REPORT=0 leaves it out).
    reports: bool,
}

impl Mode {
    fn from_env() -> Mode {
        Mode {
            postgres: std::env::var("IMGPIPE_BENCH_STATE").is_ok_and(|v| !v.is_empty()),
            s3: support::s3_out(),
            kill: std::env::var("IMGPIPE_BENCH_KILL").is_ok_and(|v| !v.is_empty() && v != "0"),
            reports: std::env::var("IMGPIPE_BENCH_REPORT").as_deref() != Ok("0"),
        }
    }

    fn describe(self) -> String {
        format!(
            "state {}, outputs {}, stopped by {}",
            if self.postgres {
                "PostgreSQL"
            } else {
                "SQLite"
            },
            if self.s3 { "S3" } else { "local" },
            if self.kill { "SIGKILL" } else { "SIGINT" }
        )
    }
}

fn main() {
    let items = env_usize("IMGPIPE_BENCH_ITEMS", DEFAULT_ITEMS).max(1);
    let runs = env_usize("IMGPIPE_BENCH_RUNS", DEFAULT_RUNS).max(1);
    let mode = Mode::from_env();
    let default_secs = if mode.kill {
        DEFAULT_KILL_SECS
    } else {
        DEFAULT_RUN_SECS
    };
    let run_secs = env_usize("IMGPIPE_BENCH_RUN_SECS", default_secs) as u64;
    println!(
        "{items} items x {TASKS_PER_ITEM} tasks, concurrency {CONCURRENCY}, {}, {run_secs} s \
         after the first paid call, {runs} run(s), binary: {}",
        mode.describe(),
        binary()
    );
    let samples: Vec<Sample> = (1..=runs)
        .map(|i| {
            let s = run_once(items, Duration::from_secs(run_secs), mode);
            print_sample(i, &s, mode);
            s
        })
        .collect();
    report(&median(&samples), runs, mode);
    support::s3_remove_bucket();
}

fn run_once(items: usize, run_for: Duration, mode: Mode) -> Sample {
    let dir = tempfile::tempdir().expect("temp dir");
    // IMGPIPE_BENCH_KEEP=1 leaves the run's directory behind, to look into by hand.
    let dir = if std::env::var_os("IMGPIPE_BENCH_KEEP").is_some() {
        let kept = dir.keep();
        println!("  kept {}", kept.display());
        kept
    } else {
        dir.path().to_path_buf()
    };
    let dir = dir.as_path();
    let pipeline = write_inputs(dir, items);
    let items_read = read_items(&dir.join("items.jsonl"), items);
    let sandbox =
        Sandbox::start_with_balance(BALANCE, &["--image-side".to_owned(), IMAGE_SIDE.to_owned()]);
    let state = support::state_for(dir);

    let mut run = imgpipe(Some(&sandbox));
    let out = support::out_for(dir, &mut run);
    run.arg("run")
        .arg(&pipeline)
        .args(["--state", &state, "--out", &out])
        .args(["--concurrency", CONCURRENCY]);
    let watched = run_and_stop(run, &state, dir, run_for, mode.kill);
    let mut record = recorded(&state);
    let seed = env_usize("IMGPIPE_BENCH_SEED_OUTPUTS", 0);
    if seed > 0 && mode.kill {
        record.stored = seed_outputs(&state, &record.run_id, seed);
    }

    // From here on, at once: a pod taking over does not wait for the server to analyse tables.
    // IMGPIPE_BENCH_DRY_RUN=0 leaves `resume --dry-run` out (at 900,000 outputs the bench's
    // one-thread S3 server takes minutes to list them).
    let resume = if std::env::var("IMGPIPE_BENCH_DRY_RUN").as_deref() == Ok("0") {
        Usage::default()
    } else {
        let mut resume = imgpipe(Some(&sandbox));
        resume.args(["resume", &record.run_id, "--dry-run", "--state", &state]);
        measure(resume, dir, "resume")
    };
    let (takeover, takeover_s3, takeover_lists) = if mode.kill {
        let mut cmd = imgpipe(Some(&sandbox));
        cmd.args(["resume", &record.run_id, "--state", &state]);
        // IMGPIPE_BENCH_TAKEOVER_LOG=debug: the takeover's log (takeover.log) says where its
        // time went.
        if let Ok(filter) = std::env::var("IMGPIPE_BENCH_TAKEOVER_LOG") {
            cmd.env("IMGPIPE_LOG", filter);
        }
        take_over(cmd, &state, dir)
    } else {
        (0.0, 0, 0)
    };
    let mut status = imgpipe(None);
    status.args(["status", &record.run_id, "--state", &state]);
    let status = measure(status, dir, "status");
    let report_cmd = || {
        let mut report = imgpipe(None);
        report
            .args(["report", &record.run_id, "--state", &state])
            .arg("--out")
            .arg(dir.join("report.html"));
        report
    };
    let (report, report_again) = if !mode.reports {
        (Usage::default(), Usage::default())
    } else {
        (
            measure(report_cmd(), dir, "report"),
            measure(report_cmd(), dir, "report-again"),
        )
    };

    Sample {
        items_read,
        first_call: watched.first_call,
        hwm_at_first_mib: watched.hwm_at_first_mib,
        sampled_peak_mib: watched.sampled_peak_mib,
        run: watched.usage,
        stop: watched.stop,
        tasks: record.tasks,
        succeeded: record.succeeded,
        attempts: record.attempts,
        stored: record.stored,
        resume,
        takeover,
        takeover_s3,
        takeover_lists,
        status,
        report,
        report_again,
    }
}

/// The binary, told the sandbox's address and key when given one, and the S3 server's with
/// IMGPIPE_BENCH_OUT=s3; never the user's state database or log settings.
fn imgpipe(sandbox: Option<&Sandbox>) -> Command {
    let mut cmd = Command::new(binary());
    cmd.env_remove("IMGPIPE_LOG")
        .env_remove("IMGPIPE_STATE")
        .env_remove("IMGPIPE_BASE_URL")
        .env_remove("IMGPIPE_API_KEY");
    support::s3_env(&mut cmd);
    if let Some(s) = sandbox {
        cmd.env("IMGPIPE_BASE_URL", &s.base_url)
            .env("IMGPIPE_API_KEY", &s.api_key);
    }
    cmd
}

/// Runs `cmd` to its end, output in `dir/NAME.out` and `dir/NAME.log`; panics unless it exits 0.
fn measure(cmd: Command, dir: &Path, name: &str) -> Usage {
    support::measure(
        cmd,
        &dir.join(format!("{name}.out")),
        &dir.join(format!("{name}.log")),
    )
}

fn write_inputs(dir: &Path, items: usize) -> PathBuf {
    let file = dir.join("bench.yaml");
    std::fs::write(&file, PIPELINE).expect("write pipeline");
    let out = std::fs::File::create(dir.join("items.jsonl")).expect("create items");
    let mut out = BufWriter::new(out);
    for i in 1..=items {
        let line = serde_json::json!({
            "id": format!("p{i:06}"),
            "subject": format!("{} (model {i})", SUBJECTS[i % SUBJECTS.len()]),
            "remove": REMOVALS[i % REMOVALS.len()],
        });
        writeln!(out, "{line}").expect("write item");
    }
    out.flush().expect("flush items");
    file
}

/// Seconds to read the items file and parse each line, as any reader of it must at least once.
fn read_items(path: &Path, items: usize) -> f64 {
    let start = Instant::now();
    let bytes = std::fs::read(path).expect("read items");
    let mut parsed = 0;
    for line in bytes.split(|&b| b == b'\n').filter(|line| !line.is_empty()) {
        let item: Value = serde_json::from_slice(line).expect("an item is JSON");
        std::hint::black_box(item);
        parsed += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    assert_eq!(parsed, items, "items read back");
    seconds
}

/// What [`run_and_interrupt`] saw of the run.
struct Watched {
    first_call: f64,
    hwm_at_first_mib: f64,
    sampled_peak_mib: f64,
    usage: Usage,
    stop: f64,
}

/// Kills and reaps a child the bench has not reaped itself, e.g. when it panics.
struct Reaper {
    pid: u32,
    reaped: bool,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if !self.reaped {
            let pid = self.pid as libc::pid_t;
            // SAFETY: pid is our child and not reaped, so it names no other process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; a null status pointer is allowed.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }
    }
}

/// Spawns the run, waits for its first paid call, lets it call for `run_for`, sends SIGINT (or
/// SIGKILL with `kill`) and reaps it; samples its VmHWM all along.
fn run_and_stop(
    mut cmd: Command,
    state: &str,
    dir: &Path,
    run_for: Duration,
    kill: bool,
) -> Watched {
    let stderr = dir.join("run.log");
    let spawned_ms = unix_ms();
    let (child, start) = support::spawn(&mut cmd, &dir.join("run.out"), &stderr);
    let mut reaper = Reaper {
        pid: child.id(),
        reaped: false,
    };
    let pid = child.id();
    let mut db = Poller::new(state);
    let mut first: Option<(f64, Instant)> = None;
    let (mut hwm_at_first, mut sampled_peak) = (0.0_f64, 0.0_f64);
    let mut sigint: Option<Instant> = None;
    let mut killed = false;
    let mut tick = 0_u32;
    loop {
        let sample_now = tick.is_multiple_of(SAMPLE_EVERY);
        tick += 1;
        if sample_now {
            match proc_hwm_mib(pid) {
                Some(hwm) => {
                    if sigint.is_none() {
                        sampled_peak = sampled_peak.max(hwm);
                    }
                }
                None => break, // exited: a zombie until reaped below
            }
        }
        let now = Instant::now();
        match (first, sigint) {
            (None, _) => {
                if let Some(started_ms) = db.first_call_after(0) {
                    let after = (started_ms - spawned_ms).max(0) as f64 / 1000.0;
                    let deadline = start + Duration::from_secs_f64(after) + run_for;
                    first = Some((after, deadline));
                    hwm_at_first = proc_hwm_mib(pid).unwrap_or(sampled_peak);
                    sampled_peak = sampled_peak.max(hwm_at_first);
                } else if now - start > FIRST_CALL_TIMEOUT {
                    panic!("no paid call within {FIRST_CALL_TIMEOUT:?}: see {stderr:?}");
                }
            }
            (Some((_, deadline)), None) if now >= deadline => {
                let signal = if kill { libc::SIGKILL } else { libc::SIGINT };
                // SAFETY: pid is our child and not reaped, so it names no other process.
                unsafe { libc::kill(pid as libc::pid_t, signal) };
                sigint = Some(now);
            }
            (Some(_), Some(at)) if !killed && now - at > STOP_TIMEOUT => {
                // SAFETY: as above.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                killed = true;
                eprintln!("the run did not stop within {STOP_TIMEOUT:?} of SIGINT: killed");
            }
            _ => {}
        }
        std::thread::sleep(POLL);
    }
    let (usage, status) = support::reap(pid, start);
    reaper.reaped = true;
    let ended = Instant::now();
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    let killed_as_asked =
        kill && libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
    // 130: interrupted, as asked; 0: it finished all its work before the signal.
    if !matches!(code, Some(0 | 130)) && !killed_as_asked {
        support::failed(status, &stderr);
    }
    let Some((first_call, _)) = first else {
        panic!("the run ended before its first paid call: see {stderr:?}");
    };
    Watched {
        first_call,
        hwm_at_first_mib: hwm_at_first,
        sampled_peak_mib: sampled_peak,
        usage,
        stop: sigint.map_or(0.0, |at| (ended - at).as_secs_f64()),
    }
}

fn unix_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970");
    i64::try_from(since.as_millis()).expect("milliseconds fit")
}

/// The child's VmHWM in MiB, or `None` once it has exited (a zombie has no memory lines).
fn proc_hwm_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The takeover of a killed run: spawns the real `resume`, waits for its first paid call (the
/// first attempt recorded after those of the killed run), then interrupts it. Gives the
/// seconds from the spawn to that call, and the requests (and of them LISTs) the S3 server got
/// meanwhile.
fn take_over(mut cmd: Command, state: &str, dir: &Path) -> (f64, u64, u64) {
    let stderr = dir.join("takeover.log");
    let mut db = Poller::new(state);
    let before = db.last_attempt().unwrap_or(0);
    let requests = support::s3_requests();
    let lists = support::s3_lists();
    let spawned_ms = unix_ms();
    let (child, start) = support::spawn(&mut cmd, &dir.join("takeover.out"), &stderr);
    let mut reaper = Reaper {
        pid: child.id(),
        reaped: false,
    };
    let pid = child.id() as libc::pid_t;
    let first = loop {
        if let Some(started_ms) = db.first_call_after(before) {
            break (started_ms - spawned_ms).max(0) as f64 / 1000.0;
        }
        let mut status = 0;
        // SAFETY: pid is our child; WNOHANG only looks whether it has exited, reaping it if so.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            reaper.reaped = true;
            support::failed(status, &stderr);
        }
        assert!(
            start.elapsed() < FIRST_CALL_TIMEOUT,
            "no paid call within {FIRST_CALL_TIMEOUT:?}: see {stderr:?}"
        );
        std::thread::sleep(POLL / 5);
    };
    let requests = support::s3_requests() - requests;
    let lists = support::s3_lists() - lists;
    // SAFETY: pid is our child and not reaped, so it names no other process.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let stopping = Instant::now();
    while proc_hwm_mib(child.id()).is_some() && stopping.elapsed() < STOP_TIMEOUT {
        std::thread::sleep(POLL);
    }
    // SAFETY: as above; a run that did not stop in time is killed (it is reaped below).
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = support::reap(child.id(), start);
    reaper.reaped = true;
    (first, requests, lists)
}

/// A read-only look at the state while the run writes it: the SQLite file, or the PostgreSQL
/// database.
struct Poller {
    runtime: tokio::runtime::Runtime,
    state: String,
    conn: Option<Polled>,
}

enum Polled {
    Sqlite(SqliteConnection),
    Postgres(sqlx::PgConnection),
}

impl Poller {
    fn new(state: &str) -> Poller {
        Poller {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime"),
            state: state.to_owned(),
            conn: None,
        }
    }

    /// The unix ms at which the first attempt after attempt `after` started, once there is one.
    fn first_call_after(&mut self, after: i64) -> Option<i64> {
        self.scalar("SELECT MIN(started_at) FROM attempts WHERE id > $1", after)
    }

    /// The id of the latest attempt recorded.
    fn last_attempt(&mut self) -> Option<i64> {
        self.scalar("SELECT MAX(id) FROM attempts WHERE id > $1", 0)
    }

    /// One number. Until the run has made the database (and its tables) every error means
    /// "not yet"; the connection is opened again after one.
    fn scalar(&mut self, sql: &'static str, arg: i64) -> Option<i64> {
        let Poller {
            runtime,
            state,
            conn,
        } = self;
        runtime.block_on(async {
            if conn.is_none() {
                *conn = if state.starts_with("postgres") {
                    sqlx::PgConnection::connect(state)
                        .await
                        .ok()
                        .map(Polled::Postgres)
                } else {
                    let options = SqliteConnectOptions::new()
                        .filename(state.as_str())
                        .read_only(true)
                        // Never hold the loop up: a busy database is asked again at the next poll.
                        .busy_timeout(Duration::from_millis(10));
                    SqliteConnection::connect_with(&options)
                        .await
                        .ok()
                        .map(Polled::Sqlite)
                };
            }
            let answer: Result<(Option<i64>,), sqlx::Error> = match conn.as_mut()? {
                Polled::Sqlite(c) => sqlx::query_as(sql).bind(arg).fetch_one(c).await,
                Polled::Postgres(c) => sqlx::query_as(sql).bind(arg).fetch_one(c).await,
            };
            match answer {
                Ok((n,)) => n,
                Err(_) => {
                    match conn.take() {
                        Some(Polled::Sqlite(c)) => drop(c.close().await),
                        Some(Polled::Postgres(c)) => drop(c.close().await),
                        None => {}
                    }
                    None
                }
            }
        })
    }
}

/// What the state holds once the run has stopped.
struct Record {
    run_id: String,
    tasks: u64,
    succeeded: u64,
    attempts: u64,
    stored: u64,
}

fn recorded(state: &str) -> Record {
    support::block_on(async {
        sqlx::any::install_default_drivers();
        let url = if state.starts_with("postgres") {
            state.to_owned()
        } else {
            format!("sqlite://{state}?mode=ro")
        };
        let mut conn = sqlx::AnyConnection::connect(&url)
            .await
            .expect("open the state database");
        let ids: Vec<(String,)> = sqlx::query_as("SELECT id FROM runs")
            .fetch_all(&mut conn)
            .await
            .expect("read runs");
        assert_eq!(ids.len(), 1, "one run in the state database");
        let (tasks, succeeded): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*), COUNT(*) FILTER (WHERE status = 'succeeded') FROM tasks",
        )
        .fetch_one(&mut conn)
        .await
        .expect("read tasks");
        let (attempts,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM attempts")
            .fetch_one(&mut conn)
            .await
            .expect("read attempts");
        let (stored,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL")
                .fetch_one(&mut conn)
                .await
                .expect("read outputs");
        let _ = conn.close().await;
        let u = |n: i64| u64::try_from(n).unwrap_or(0);
        Record {
            run_id: ids[0].0.clone(),
            tasks: u(tasks),
            succeeded: u(succeeded),
            attempts: u(attempts),
            stored: u(stored),
        }
    })
}

fn print_sample(i: usize, s: &Sample, mode: Mode) {
    let stop = if mode.kill { "SIGKILL" } else { "SIGINT" };
    println!(
        "  run {i}: items read {:.3} s; first paid call {:.2} s after spawn (VmHWM then {:.1} MiB); \
         {} of {} tasks recorded so far succeeded, {} attempts, {} outputs stored; run peak RSS \
         {:.1} MiB sampled before {stop}, {:.1} MiB (wait4), wall {:.2} s, cpu {:.2} s, exit {:.2} s \
         after {stop}; resume --dry-run {:.2} s {:.1} MiB; status {:.2} s {:.1} MiB; report {:.2} s \
         {:.1} MiB, again {:.2} s {:.1} MiB",
        s.items_read,
        s.first_call,
        s.hwm_at_first_mib,
        s.succeeded,
        s.tasks,
        s.attempts,
        s.stored,
        s.sampled_peak_mib,
        s.run.peak_mib,
        s.run.wall,
        s.run.cpu,
        s.stop,
        s.resume.wall,
        s.resume.peak_mib,
        s.status.wall,
        s.status.peak_mib,
        s.report.wall,
        s.report.peak_mib,
        s.report_again.wall,
        s.report_again.peak_mib,
    );
    if mode.kill {
        println!(
            "         takeover: first paid call {:.2} s after spawn, {} requests to the S3 server ({} LIST)",
            s.takeover, s.takeover_s3, s.takeover_lists
        );
    }
}

fn median(samples: &[Sample]) -> Sample {
    let pick = |f: &dyn Fn(&Sample) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let usage = |f: &dyn Fn(&Sample) -> Usage| Usage {
        wall: pick(&|s| f(s).wall),
        cpu: pick(&|s| f(s).cpu),
        user: pick(&|s| f(s).user),
        sys: pick(&|s| f(s).sys),
        peak_mib: pick(&|s| f(s).peak_mib),
    };
    Sample {
        items_read: pick(&|s| s.items_read),
        first_call: pick(&|s| s.first_call),
        hwm_at_first_mib: pick(&|s| s.hwm_at_first_mib),
        sampled_peak_mib: pick(&|s| s.sampled_peak_mib),
        run: usage(&|s| s.run),
        stop: pick(&|s| s.stop),
        tasks: pick(&|s| s.tasks as f64) as u64,
        succeeded: pick(&|s| s.succeeded as f64) as u64,
        attempts: pick(&|s| s.attempts as f64) as u64,
        stored: pick(&|s| s.stored as f64) as u64,
        resume: usage(&|s| s.resume),
        takeover: pick(&|s| s.takeover),
        takeover_s3: pick(&|s| s.takeover_s3 as f64) as u64,
        takeover_lists: pick(&|s| s.takeover_lists as f64) as u64,
        status: usage(&|s| s.status),
        report: usage(&|s| s.report),
        report_again: usage(&|s| s.report_again),
    }
}

fn report(m: &Sample, runs: usize, mode: Mode) {
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let first_goal = GOAL_FIRST_CALL_S + m.items_read;
    println!(
        "\ngoals (medians of {runs} run(s); {}; 100 MB = {GOAL_MIB:.1} MiB)",
        mode.describe()
    );
    println!(
        "  first paid call   {:.2} s after spawn (goal {GOAL_FIRST_CALL_S} s + {:.2} s to read \
         the items file = {first_goal:.2} s): {}",
        m.first_call,
        m.items_read,
        verdict(m.first_call <= first_goal)
    );
    println!(
        "  run memory        peak RSS {:.1} MiB (wait4; sampled before the signal {:.1} MiB, at \
         the first call {:.1} MiB; goal 100 MB, held against the larger): {}; {} tasks \
         succeeded, {} outputs stored",
        m.run.peak_mib,
        m.sampled_peak_mib,
        m.hwm_at_first_mib,
        verdict(m.run.peak_mib.max(m.sampled_peak_mib) <= GOAL_MIB),
        m.succeeded,
        m.stored
    );
    println!(
        "  resume --dry-run  {:.2} s, peak RSS {:.1} MiB (goal {GOAL_COMMAND_S} s and 100 MB): {}",
        m.resume.wall,
        m.resume.peak_mib,
        verdict(m.resume.wall <= GOAL_COMMAND_S && m.resume.peak_mib <= GOAL_MIB)
    );
    if mode.kill {
        println!(
            "  takeover          first paid call {:.2} s after spawn (goal {GOAL_TAKEOVER_S} s): \
             {}; {} requests to the S3 server before it ({} LIST)",
            m.takeover,
            verdict(m.takeover <= GOAL_TAKEOVER_S),
            m.takeover_s3,
            m.takeover_lists
        );
    }
    let (status_goal, again_goal) = if mode.kill {
        (GOAL_KILLED_STATUS_S, GOAL_KILLED_REPORT_S)
    } else {
        (GOAL_COMMAND_S, GOAL_COMMAND_S)
    };
    let reports = [
        ("report", m.report, GOAL_COMMAND_S),
        ("report again", m.report_again, again_goal),
    ];
    let measured = if mode.reports { &reports[..] } else { &[] };
    for &(name, u, goal) in [("status", m.status, status_goal)].iter().chain(measured) {
        println!(
            "  {name:<17} {:.2} s, peak RSS {:.1} MiB (goal {goal} s): {}",
            u.wall,
            u.peak_mib,
            verdict(u.wall <= goal)
        );
    }
}

/// IMGPIPE_BENCH_SEED_OUTPUTS=N (with IMGPIPE_BENCH_KILL=1, IMGPIPE_BENCH_OUT=s3 and PostgreSQL
/// state): after the kill, the night is made N stored outputs long without paying for them:
/// the first item's nine tasks, their attempts and ten outputs are copied in the state
/// database to the items after the last one recorded (its keys and inputs renamed; an item's
/// tasks given consecutive ids in the chain's order, as a run records them), and its
/// objects hard-linked under the new items' keys in the S3 server's bucket (s3s-fs: a file
/// and two sidecar files an object), so the takeover finds a night of N outputs as the record
/// and the bucket hold it. Gives the number of outputs stored once seeded.
fn seed_outputs(state: &str, run_id: &str, outputs: usize) -> u64 {
    let root = support::s3_root().expect("IMGPIPE_BENCH_SEED_OUTPUTS needs IMGPIPE_BENCH_OUT=s3");
    assert!(
        state.starts_with("postgres"),
        "IMGPIPE_BENCH_SEED_OUTPUTS needs PostgreSQL state"
    );
    let started = Instant::now();
    let (first, last, prefix) = support::block_on(async {
        let mut conn = sqlx::PgConnection::connect(state).await.expect("the state");
        let (recorded,): (String,) =
            sqlx::query_as("SELECT MAX(item) FROM tasks WHERE run_id = $1")
                .bind(run_id)
                .fetch_one(&mut conn)
                .await
                .expect("the last item recorded");
        let (stored,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM outputs WHERE run_id = $1 AND path IS NOT NULL")
                .bind(run_id)
                .fetch_one(&mut conn)
                .await
                .expect("outputs stored");
        let (path,): (String,) = sqlx::query_as(
            "SELECT o.path FROM outputs o JOIN tasks t ON t.id = o.task_id
             WHERE t.run_id = $1 AND t.item = 'p000001' AND o.path IS NOT NULL LIMIT 1",
        )
        .bind(run_id)
        .fetch_one(&mut conn)
        .await
        .expect("an object of the first item");
        let first: usize = recorded[1..].parse::<usize>().expect("item pNNNNNN") + 1;
        let items = outputs.saturating_sub(stored as usize) / 10;
        let last = (first + items).min(DEFAULT_ITEMS + 1) - 1;
        let at = path.find("/p000001/").expect("the item's directory");
        let prefix = path["s3://".len()..at].to_owned();
        let copy = [
            "INSERT INTO tasks (run_id, item, step, idx, operation, inputs, planned_credits,
                status, credits_billed, job_id, error, updated_at, identity, request)
             SELECT t.run_id, i.item, t.step, t.idx, t.operation,
                replace(t.inputs, 'p000001/', i.item || '/'), t.planned_credits, t.status,
                t.credits_billed, t.job_id || '-' || i.item, t.error, t.updated_at, t.identity,
                t.request
             FROM tasks t, (SELECT 'p' || lpad(g::text, 6, '0') AS item
                            FROM generate_series($2::bigint, $3::bigint) g) i
             WHERE t.run_id = $1 AND t.item = 'p000001'
             ORDER BY i.item, t.id",
            "INSERT INTO attempts (task_id, run_id, endpoint, started_at, finished_at, outcome,
                http_status, credits_billed, credits_remaining, job_id, error)
             SELECT n.id, a.run_id, a.endpoint, a.started_at, a.finished_at, a.outcome,
                a.http_status, a.credits_billed, a.credits_remaining, n.job_id, a.error
             FROM attempts a JOIN tasks t ON t.id = a.task_id AND t.item = 'p000001'
             JOIN tasks n ON n.run_id = t.run_id AND n.step = t.step AND n.idx = t.idx
             WHERE t.run_id = $1
               AND n.item BETWEEN 'p' || lpad($2::text, 6, '0') AND 'p' || lpad($3::text, 6, '0')",
            "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url, url_issued_at,
                path, sha256, bytes, downloaded_at, download_error, etag)
             SELECT n.id, o.run_id, o.k, n.job_id, o.parent_job_id, o.url, o.url_issued_at,
                replace(o.path, '/p000001/', '/' || n.item || '/'), o.sha256, o.bytes,
                o.downloaded_at, o.download_error, o.etag
             FROM outputs o JOIN tasks t ON t.id = o.task_id AND t.item = 'p000001'
             JOIN tasks n ON n.run_id = t.run_id AND n.step = t.step AND n.idx = t.idx
             WHERE t.run_id = $1
               AND n.item BETWEEN 'p' || lpad($2::text, 6, '0') AND 'p' || lpad($3::text, 6, '0')",
        ];
        for sql in copy {
            sqlx::query(sql)
                .bind(run_id)
                .bind(first as i64)
                .bind(last as i64)
                .execute(&mut conn)
                .await
                .expect("seed the state");
        }
        note_blocks(&mut conn, run_id, first, last).await;
        // A night written over hours is analysed by autovacuum many times over, but a takeover
        // may come before: left unanalysed by default (the worst case), analysed as autovacuum
        // would have with IMGPIPE_BENCH_SEED_ANALYZE=1.
        if std::env::var("IMGPIPE_BENCH_SEED_ANALYZE").as_deref() == Ok("1") {
            sqlx::query("ANALYZE tasks, attempts, outputs")
                .execute(&mut conn)
                .await
                .expect("analyse the seeded tables");
        }
        (first, last, prefix)
    });
    link_objects(root, &prefix, first, last);
    let stored = recorded(state).stored;
    println!(
        "  seeded items p{first:06}..p{last:06}: {stored} outputs stored, in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    stored
}

/// Notes the seeded items' tasks as the executor notes each chunk of 1,024 items it records
/// whole (`task_blocks`), after checking that their ids are what a block says: each item's
/// nine consecutive ids, items one after the other from the first seeded one.
async fn note_blocks(conn: &mut sqlx::PgConnection, run_id: &str, first: usize, last: usize) {
    const CHUNK: usize = 1024;
    const TASKS: usize = 9;
    let (base,): (i64,) =
        sqlx::query_as("SELECT MIN(id) FROM tasks WHERE run_id = $1 AND item = $2")
            .bind(run_id)
            .bind(format!("p{first:06}"))
            .fetch_one(&mut *conn)
            .await
            .expect("the first seeded item's tasks");
    let (wrong,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM (
             SELECT item, MIN(id) AS low, MAX(id) AS high, COUNT(*) AS n FROM tasks
             WHERE run_id = $1
               AND item BETWEEN 'p' || lpad($2::text, 6, '0') AND 'p' || lpad($3::text, 6, '0')
             GROUP BY item) s
         WHERE low <> $4 + 9 * (substr(item, 2)::bigint - $2) OR high <> low + 8 OR n <> 9",
    )
    .bind(run_id)
    .bind(first as i64)
    .bind(last as i64)
    .bind(base)
    .fetch_one(&mut *conn)
    .await
    .expect("check the seeded ids");
    assert_eq!(wrong, 0, "seeded items whose ids are not a block's");
    // Item pNNNNNN is the items file's line NNNNNN: the graph's item NNNNNN - 1.
    let mut item = first;
    while item <= last {
        let items = CHUNK.min(last + 1 - item);
        sqlx::query(
            "INSERT INTO task_blocks (run_id, first_item, items, first_id, tasks,
                 pipeline_sha256, items_sha256)
             SELECT id, $2, $3, $4, $5, pipeline_sha256, items_sha256 FROM runs WHERE id = $1",
        )
        .bind(run_id)
        .bind((item - 1) as i64)
        .bind(items as i64)
        .bind(base + ((item - first) * TASKS) as i64)
        .bind((items * TASKS) as i64)
        .execute(&mut *conn)
        .await
        .expect("note a block");
        item += items;
    }
}

/// Hard-links the first item's objects (and s3s-fs's two sidecar files of each) under the keys
/// of items `first..=last`, in `prefix` (`bucket/…`, the run's directory).
fn link_objects(root: &Path, prefix: &str, first: usize, last: usize) {
    let (bucket, dir) = prefix.split_once('/').expect("bucket/prefix");
    let names: Vec<String> = std::fs::read_dir(root.join(prefix).join("p000001"))
        .expect("the first item's objects")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    let sidecar = |key: &str, ext: &str| {
        root.join(format!(
            ".bucket-{}.object-{}.{ext}.json",
            base64_url(bucket),
            base64_url(key)
        ))
    };
    // A file takes at most 65,000 links (ext4): every 60,000 items, one is a copy, which the
    // next ones link to.
    let mut source = "p000001".to_owned();
    for i in first..=last {
        let item = format!("p{i:06}");
        let copy = (i - first) % 60_000 == 59_999;
        std::fs::create_dir_all(root.join(prefix).join(&item)).expect("an item's directory");
        for name in &names {
            let (from, to) = (
                format!("{dir}/{source}/{name}"),
                format!("{dir}/{item}/{name}"),
            );
            let link = |a: PathBuf, b: PathBuf| {
                let made = if copy {
                    std::fs::copy(&a, &b).map(drop)
                } else {
                    std::fs::hard_link(&a, &b)
                };
                made.unwrap_or_else(|e| panic!("link {a:?}: {e}"));
            };
            link(root.join(bucket).join(&from), root.join(bucket).join(&to));
            link(sidecar(&from, "internal"), sidecar(&to, "internal"));
            link(sidecar(&from, "metadata"), sidecar(&to, "metadata"));
        }
        if copy {
            source = item;
        }
    }
}

/// Base64 of `s`, URL-safe, without padding: how s3s-fs names an object's sidecar files.
fn base64_url(s: &str) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ABC[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}
