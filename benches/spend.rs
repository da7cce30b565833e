//! The spend ledger on a large state (issue 23: "fast on a state database of millions of
//! attempts"). A SQLite state is made by a real one-item run (`imgpipe run --sandbox`, so it is
//! marked and migrated as imgpipe makes it), then filled by SQL with IMGPIPE_BENCH_RUNS_FILLED
//! runs (default 2,000) of 1,000 tasks and one attempt each (2,000,000 attempts), over the 60
//! days before now; one attempt in 1,000 possibly billed. Then each ledger below runs 3 times
//! as a whole process (`imgpipe spend ... --json`): the median wall time and the largest peak
//! RSS (wait4). Run with `cargo bench --bench spend`; IMGPIPE_BENCH_BINARY=PATH measures
//! another build.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::path::Path;
use std::process::Command;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

#[path = "support/mod.rs"]
mod support;
use support::{Usage, binary, env_usize};

const TASKS_PER_RUN: usize = 1_000;
const DAYS: i64 = 60;
const TIMES: usize = 3;

fn main() {
    let runs = env_usize("IMGPIPE_BENCH_RUNS_FILLED", 2_000);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db");
    first_run(dir.path(), &state);
    let started = Instant::now();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(fill(&state, runs));
    let attempts = runs * TASKS_PER_RUN;
    println!(
        "filled {runs} runs, {attempts} attempts in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let week_ago = days_ago(7);
    for args in [
        vec!["--by", "day"],
        vec!["--by", "month"],
        vec!["--by", "pipeline"],
        vec!["--by", "step"],
        vec!["--by", "day", "--since", &week_ago],
    ] {
        let (usage, calls) = measure(dir.path(), &state, &args);
        let whole = !args.contains(&"--since");
        assert!(
            !whole || calls > attempts as u64,
            "every attempt counted: {calls}"
        );
        println!(
            "spend {:<28} median {:.2} s, peak RSS {:.0} MiB ({calls} calls)",
            args.join(" "),
            usage.wall,
            usage.peak_mib
        );
    }
}

/// One real run in the built-in sandbox: the state is made as imgpipe makes it.
fn first_run(dir: &Path, state: &Path) {
    let samples = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
    for f in ["edit-only.yaml", "sample-images.csv"] {
        std::fs::copy(samples.join(f), dir.join(f)).unwrap();
    }
    let mut cmd = Command::new(binary());
    cmd.args(["run", "edit-only.yaml", "--sandbox", "--quiet", "--state"])
        .arg(state)
        .current_dir(dir);
    support::run_to_end(cmd, "the first run");
}

/// `YYYY-MM-DD`, `days` days ago (UTC).
fn days_ago(days: u64) -> String {
    let now = SystemTime::now() - std::time::Duration::from_secs(days * 86_400);
    imgpipe::time::rfc3339(now)[..10].to_owned()
}

/// Adds `runs` runs of [`TASKS_PER_RUN`] tasks, one attempt each, by SQL: ids above the first
/// run's, times spread over the [`DAYS`] days before now.
async fn fill(state: &Path, runs: usize) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let span = DAYS * 86_400_000;
    let first = now - span;
    let per_run = span / runs as i64;
    let tasks = runs * TASKS_PER_RUN;
    let step_ms = per_run / TASKS_PER_RUN as i64;
    let sql = format!(
        "BEGIN;
         WITH RECURSIVE r(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM r WHERE n < {runs} - 1)
         INSERT INTO runs (id, pipeline_name, pipeline_file, pipeline_text, pipeline_sha256,
             items_sha256, plan_json, output_dir, status, credits_planned, created_at)
         SELECT printf('bench%05d', n), printf('pipeline%d', n % 5), 'p.yaml', '', '', '', '{{}}',
             'out', 'succeeded', {TASKS_PER_RUN} * 3, {first} + n * {per_run} FROM r;
         WITH RECURSIVE r(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM r WHERE n < {tasks} - 1)
         INSERT INTO tasks (id, run_id, item, step, idx, operation, inputs, planned_credits,
             status, credits_billed, updated_at)
         SELECT 1000000 + n, printf('bench%05d', n / {TASKS_PER_RUN}), printf('i%d', n / 3),
             CASE n % 3 WHEN 0 THEN 'clean' WHEN 1 THEN 'big' ELSE 'cutout' END, 0, 'erase',
             '[]', 3, 'succeeded', 3, 0 FROM r;
         WITH RECURSIVE r(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM r WHERE n < {tasks} - 1)
         INSERT INTO attempts (id, task_id, run_id, endpoint, started_at, finished_at, outcome,
             credits_billed)
         SELECT 1000000 + n, 1000000 + n, printf('bench%05d', n / {TASKS_PER_RUN}), '/v1/x',
             {first} + n / {TASKS_PER_RUN} * {per_run} + n % {TASKS_PER_RUN} * {step_ms},
             0, CASE WHEN n % 1000 = 7 THEN 'ambiguous' ELSE 'succeeded' END,
             CASE WHEN n % 1000 = 7 THEN 0 ELSE 3 END FROM r;
         COMMIT;"
    );
    let mut conn = SqliteConnectOptions::new()
        .filename(state)
        .connect()
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

/// `imgpipe spend ARGS --json` [`TIMES`] times: the median wall time, the largest peak RSS,
/// and the calls the ledger counted.
#[allow(clippy::zombie_processes)] // reaped below by wait4, which also reads its rusage
fn measure(dir: &Path, state: &Path, args: &[&str]) -> (Usage, u64) {
    let mut walls = Vec::new();
    let mut peak: f64 = 0.0;
    let mut calls = 0;
    for _ in 0..TIMES {
        let out = dir.join("spend.json");
        let log = dir.join("spend.log");
        let start = Instant::now();
        let child = Command::new(binary())
            .args(["spend", "--json"])
            .args(args)
            .arg("--state")
            .arg(state)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let usage = support::wait(child.id(), start, &log);
        walls.push(usage.wall);
        peak = peak.max(usage.peak_mib);
        let ledger: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        calls = ledger["totals"]["calls"].as_u64().unwrap();
    }
    walls.sort_by(f64::total_cmp);
    let usage = Usage {
        wall: walls[TIMES / 2],
        peak_mib: peak,
        ..Usage::default()
    };
    (usage, calls)
}
