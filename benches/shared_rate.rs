//! Two processes, one account (issue 35): two runs of different pipelines (40 items × a
//! five-step chain, 200 paid calls each) started at once on one state database, against a
//! sandbox whose account allows 20 paid calls a second with a burst of 5
//! (`--rate-limit 20 --rate-burst 5 --rate-limit-scope paid`), neither told a rate: both learn
//! it from the account record and draw from it through the state database. Figures: the
//! sandbox's 429 count, and the wall time from the start of both processes to the end of the
//! later one (the 400 calls alone take 20 s at 20/s; the goal is 0 × 429 and ≤ 21.6 s plus
//! start).
//!
//! Run with `cargo bench --bench shared_rate` (SQLite: one state file for both);
//! IMGPIPE_BENCH_STATE=postgres://ADMIN@HOST:PORT/DB runs both on one fresh database of that
//! server instead. Medians of IMGPIPE_BENCH_RUNS runs (default 3).
//!
//! IMGPIPE_BENCH_CUT_DB_AT=N (PostgreSQL state only) cuts the database N seconds in: both
//! processes reach it through a proxy the bench owns on 127.0.0.1, which then stops
//! forwarding (a black hole: connections held open and silent, new ones accepted and never
//! answered). The bench watches the processes for IMGPIPE_BENCH_CUT_WAIT seconds (default 150),
//! sends SIGTERM to those still running and SIGKILL 60 s later, closes the proxy, and resumes
//! each run straight on the database. Figures: each process's calls after the cut against its
//! share (the limit ÷ 2), whether it said it fell back, how it ended (exit code, or stopped by
//! the bench), the resume's exit code, and calls paid twice (none expected). With
//! IMGPIPE_BENCH_CUT_RATE_ONLY=1 only the connection the shared rate is drawn from is cut
//! (the test-only IMGPIPE_TEST_RATE_STATE), the runs' records go on: the share measured.

// Benchmarks report on stdout by design.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

#[path = "support/mod.rs"]
mod support;
use support::black_hole::BlackHole;
use support::{Sandbox, binary, block_on, env_usize, failed, reap, spawn, state_for};

const DEFAULT_RUNS: usize = 3;
const ITEMS: usize = 40;
const STEPS: &str = r#"steps:
  - id: shot
    generate: { prompt: "a {{ item.id }}", n: 1, size: 2K }
  - id: clean
    erase: { from: shot, object_name: a scuff }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9" }
  - id: big
    upscale: { from: wide, desired_increase: 2 }
  - id: cutout
    remove_background: { from: big }
"#;

fn pipeline(dir: &Path, name: &str) -> String {
    let mut text = format!(
        "version: 1\nname: {name}\noutput_dir: out\npricing: {{ generation: 4 }}\nitems:\n"
    );
    for i in 0..ITEMS {
        text += &format!("  - {{ id: {name}{i:02} }}\n");
    }
    text += STEPS;
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).expect("write the pipeline");
    path.to_string_lossy().into_owned()
}

/// The account's limit, calls a second, and the processes that share it.
const LIMIT: f64 = 20.0;
const PROCESSES: f64 = 2.0;

fn sandbox() -> Sandbox {
    Sandbox::start(&[
        "--rate-limit".into(),
        "20".into(),
        "--rate-burst".into(),
        "5".into(),
        "--rate-limit-scope".into(),
        "paid".into(),
        "--image-side".into(),
        "64".into(),
    ])
}

/// `imgpipe ARGS` on the sandbox's account, its output in `dir`/`name`.json and .log.
fn start_imgpipe(sandbox: &Sandbox, dir: &Path, name: &str, args: &[&str]) -> (Child, PathBuf) {
    spawn_in(imgpipe(sandbox, args), dir, name)
}

/// `imgpipe ARGS --json` on the sandbox's account.
fn imgpipe(sandbox: &Sandbox, args: &[&str]) -> Command {
    let mut cmd = Command::new(binary());
    cmd.args(args)
        .arg("--json")
        .env("IMGPIPE_BASE_URL", &sandbox.base_url)
        .env("IMGPIPE_API_KEY", &sandbox.api_key)
        .env_remove("IMGPIPE_LOG")
        .env_remove("IMGPIPE_STATE");
    cmd
}

/// Starts `cmd`, its output in `dir`/`name`.json and .log.
fn spawn_in(mut cmd: Command, dir: &Path, name: &str) -> (Child, PathBuf) {
    let stdout = dir.join(format!("{name}.json"));
    let stderr = dir.join(format!("{name}.log"));
    let (child, _) = spawn(&mut cmd, &stdout, &stderr);
    (child, stderr)
}

fn start_run(sandbox: &Sandbox, dir: &Path, state: &str, name: &str) -> (Child, PathBuf) {
    let file = pipeline(dir, name);
    let args = ["run", &file, "--state", state, "--run-id", name];
    start_imgpipe(sandbox, dir, name, &args)
}

/// One sample: (429s, wall seconds).
fn run_once() -> (u64, f64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = sandbox();
    let state = state_for(dir.path());
    let start = Instant::now();
    let started: Vec<_> = ["north", "south"]
        .map(|name| start_run(&sandbox, dir.path(), &state, name))
        .into();
    for (child, stderr) in started {
        let (_, status) = reap(child.id(), start);
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            failed(status, &stderr);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let stats = sandbox.stats();
    let limited = stats["stats"]["rate_limited"]
        .as_u64()
        .expect("rate_limited");
    let billed = stats["ledger"].as_array().map_or(0, Vec::len);
    assert_eq!(billed, 400, "400 calls paid");
    println!("  429s {limited:>3}  wall {wall:>6.2} s");
    (limited, wall)
}

fn main() {
    if let Some(at) = std::env::var("IMGPIPE_BENCH_CUT_DB_AT")
        .ok()
        .filter(|v| !v.is_empty())
    {
        let at: f64 = at.parse().expect("IMGPIPE_BENCH_CUT_DB_AT is seconds");
        return cut_the_database(Duration::from_secs_f64(at));
    }
    let runs = env_usize("IMGPIPE_BENCH_RUNS", DEFAULT_RUNS).max(1);
    let backend = if std::env::var("IMGPIPE_BENCH_STATE").is_ok_and(|v| !v.is_empty()) {
        "PostgreSQL"
    } else {
        "SQLite"
    };
    println!("{runs} runs, {backend} state, binary: {}", binary());
    let mut samples: Vec<(u64, f64)> = (0..runs).map(|_| run_once()).collect();
    samples.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut limited: Vec<u64> = samples.iter().map(|s| s.0).collect();
    limited.sort_unstable();
    println!(
        "two processes, one account at 20/s (burst 5), 400 calls, {backend}: median {} × 429, median wall {:.2} s",
        limited[limited.len() / 2],
        samples[samples.len() / 2].1
    );
}

/// Seconds the bench watches the processes after the cut before it stops them.
const DEFAULT_CUT_WAIT: usize = 150;
/// How long a process has to end after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(60);
const FALLBACK_SAID: &str = "keeping to this process's share of the account's rate";

/// IMGPIPE_BENCH_CUT_DB_AT: both processes on PostgreSQL through a proxy cut `at` in.
fn cut_the_database(at: Duration) {
    let Some(admin) = std::env::var("IMGPIPE_BENCH_STATE")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        panic!(
            "IMGPIPE_BENCH_CUT_DB_AT cuts a PostgreSQL state: set IMGPIPE_BENCH_STATE=postgres://… (a SQLite file has no connection to cut; see benches/README.md)"
        );
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = sandbox();
    let direct = state_for(dir.path());
    let url = url::Url::parse(&direct).expect("a database URL");
    let target = (
        url.host_str().expect("the database's host"),
        url.port().unwrap_or(5432),
    )
        .to_socket_addrs()
        .expect("the database's address")
        .next()
        .expect("an address");
    assert!(
        target.ip().is_loopback(),
        "the bench cuts a database on loopback only"
    );
    let proxy = BlackHole::start(target);
    let mut proxied = url.clone();
    proxied.set_port(Some(proxy.port)).expect("a port");
    let proxied = proxied.to_string();
    // IMGPIPE_BENCH_CUT_RATE_ONLY=1: only the connection the rate is drawn from goes through
    // the proxy (the test-only IMGPIPE_TEST_RATE_STATE), the runs' records go on: the share
    // itself measured.
    let rate_only = std::env::var_os("IMGPIPE_BENCH_CUT_RATE_ONLY").is_some();
    println!(
        "PostgreSQL state {} ({}) through a proxy on 127.0.0.1:{}, cut {:.1} s in, binary: {} (admin {})",
        url.path(),
        if rate_only {
            "the rate's connection only"
        } else {
            "every connection"
        },
        proxy.port,
        at.as_secs_f64(),
        binary(),
        admin.split('@').next_back().unwrap_or_default()
    );
    let start = Instant::now();
    let mut procs: Vec<Proc> = ["north", "south"]
        .into_iter()
        .map(|name| {
            let (child, log) = if rate_only {
                let file = pipeline(dir.path(), name);
                let args = ["run", &file, "--state", &direct, "--run-id", name];
                let mut cmd = imgpipe(&sandbox, &args);
                cmd.env("IMGPIPE_TEST_RATE_STATE", &proxied);
                spawn_in(cmd, dir.path(), name)
            } else {
                start_run(&sandbox, dir.path(), &proxied, name)
            };
            Proc {
                name,
                child,
                log,
                ended: None,
            }
        })
        .collect();
    std::thread::sleep(at.saturating_sub(start.elapsed()));
    let before_cut = ledger(&sandbox).len();
    proxy.cut();
    let cut = Instant::now();
    println!(
        "  cut at {:.2} s, {before_cut} calls paid",
        cut.duration_since(start).as_secs_f64()
    );
    let watch = Duration::from_secs(env_usize("IMGPIPE_BENCH_CUT_WAIT", DEFAULT_CUT_WAIT) as u64);
    watch_until(&mut procs, cut, cut + watch);
    for p in procs.iter_mut().filter(|p| p.ended.is_none()) {
        // SAFETY: a plain kill(2) of our own child, not yet reaped.
        unsafe { libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let termed = Instant::now();
    watch_until(&mut procs, cut, termed + TERM_GRACE);
    for p in procs.iter_mut().filter(|p| p.ended.is_none()) {
        let _ = p.child.kill();
        let _ = p.child.wait();
        p.ended = Some(format!(
            "still running {:.0} s after SIGTERM: SIGKILL",
            TERM_GRACE.as_secs_f64()
        ));
    }
    let stopped = start.elapsed();
    let before_resume = ledger(&sandbox).len();
    // The held connections close with the proxy: the server ends their sessions and lets go
    // of the run locks.
    drop(proxy);
    let mut resumed = Vec::new();
    for p in &procs {
        let name = format!("{}-resume", p.name);
        let t = Instant::now();
        let (child, log) = start_imgpipe(
            &sandbox,
            dir.path(),
            &name,
            &["resume", p.name, "--state", &direct],
        );
        let (_, status) = reap(child.id(), t);
        resumed.push((p.name, status_text(status), t.elapsed(), log));
    }
    let paid = (before_cut, before_resume);
    report_cut(&sandbox, &direct, &procs, paid, stopped, &resumed);
}

/// A process of the cut run: how it ended, once it did.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
    ended: Option<String>,
}

/// Polls the processes still running until `until`, noting how and when each ends.
fn watch_until(procs: &mut [Proc], cut: Instant, until: Instant) {
    while Instant::now() < until && procs.iter().any(|p| p.ended.is_none()) {
        for p in procs.iter_mut().filter(|p| p.ended.is_none()) {
            if let Some(status) = p.child.try_wait().expect("wait for a run") {
                let code = status
                    .code()
                    .map_or_else(|| format!("{status}"), |c| format!("exit {c}"));
                p.ended = Some(format!(
                    "{code}, {:.1} s after the cut",
                    cut.elapsed().as_secs_f64()
                ));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn status_text(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("exit {}", libc::WEXITSTATUS(status))
    } else {
        format!("wait status {status}")
    }
}

/// The sandbox's ledger in billing order: (job id, the hash of what was paid for, arrival µs).
fn ledger(sandbox: &Sandbox) -> Vec<(String, String, u64)> {
    let stats = sandbox.stats();
    stats["ledger"]
        .as_array()
        .expect("the ledger")
        .iter()
        .map(|e| {
            (
                e["job_id"].as_str().unwrap_or_default().to_owned(),
                e["request"].as_str().unwrap_or_default().to_owned(),
                e["received_us"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

/// Which run each job the state recorded belongs to.
fn runs_of_jobs(state: &str) -> HashMap<String, String> {
    use sqlx::Connection;
    block_on(async {
        let mut conn = sqlx::PgConnection::connect(state)
            .await
            .expect("reach the state");
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT job_id, run_id FROM attempts WHERE job_id IS NOT NULL
             UNION SELECT job_id, run_id FROM outputs",
        )
        .fetch_all(&mut conn)
        .await
        .expect("read the jobs");
        let _ = conn.close().await;
        rows.into_iter().collect()
    })
}

/// The most of `times` (µs, in order) within any one second.
fn most_in_a_second(times: &[u64]) -> usize {
    let mut most = 0;
    let mut from = 0;
    for (to, t) in times.iter().enumerate() {
        while times[from] + 1_000_000 <= *t {
            from += 1;
        }
        most = most.max(to - from + 1);
    }
    most
}

fn report_cut(
    sandbox: &Sandbox,
    state: &str,
    procs: &[Proc],
    (before_cut, before_resume): (usize, usize),
    stopped: Duration,
    resumed: &[(&str, String, Duration, PathBuf)],
) {
    let entries = ledger(sandbox);
    let jobs = runs_of_jobs(state);
    // Billed after the cut and before the resumes (the ledger is in billing order).
    let after = &entries[before_cut.min(entries.len())..before_resume.min(entries.len())];
    let share = LIMIT / PROCESSES;
    for p in procs {
        let mut times: Vec<u64> = after
            .iter()
            .filter(|e| jobs.get(&e.0).map(String::as_str) == Some(p.name))
            .map(|e| e.2)
            .collect();
        times.sort_unstable();
        let seconds = match (times.first(), times.last()) {
            (Some(a), Some(b)) if b > a => (b - a) as f64 / 1e6,
            _ => 0.0,
        };
        let log = std::fs::read_to_string(&p.log).unwrap_or_default();
        println!(
            "  {}: {} calls after the cut over {seconds:.2} s, at most {} in any second (its share {share:.0}/s); fell back and said so: {}; {}",
            p.name,
            times.len(),
            most_in_a_second(&times),
            log.contains(FALLBACK_SAID),
            p.ended.as_deref().unwrap_or("?")
        );
        let said = ["WARN", "ERROR", "error:"];
        for line in log.lines().filter(|l| said.iter().any(|s| l.contains(s))) {
            println!("      | {line}");
        }
    }
    let unknown = after.iter().filter(|e| !jobs.contains_key(&e.0)).count();
    println!("  calls billed after the cut that no run recorded: {unknown}");
    println!(
        "  both stopped {:.2} s after the start",
        stopped.as_secs_f64()
    );
    for (name, status, wall, log) in resumed {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        let last = log
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        println!(
            "  resume {name}: {status} in {:.2} s | {last}",
            wall.as_secs_f64()
        );
    }
    let requests: HashSet<&str> = entries.iter().map(|e| e.1.as_str()).collect();
    let limited = sandbox.stats()["stats"]["rate_limited"]
        .as_u64()
        .expect("rate_limited");
    println!(
        "  in all: {} calls paid ({} distinct requests, so {} paid twice), {limited} × 429",
        entries.len(),
        requests.len(),
        entries.len() - requests.len()
    );
}
