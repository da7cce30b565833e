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

// Benchmarks report on stdout by design.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::path::Path;
use std::process::Command;
use std::time::Instant;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, binary, env_usize, failed, reap, spawn, state_for};

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

/// One sample: (429s, wall seconds).
fn run_once() -> (u64, f64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let sandbox = Sandbox::start(&[
        "--rate-limit".into(),
        "20".into(),
        "--rate-burst".into(),
        "5".into(),
        "--rate-limit-scope".into(),
        "paid".into(),
        "--image-side".into(),
        "64".into(),
    ]);
    let state = state_for(dir.path());
    let mut started = Vec::new();
    let start = Instant::now();
    for name in ["north", "south"] {
        let mut cmd = Command::new(binary());
        cmd.arg("run")
            .arg(pipeline(dir.path(), name))
            .args(["--state", &state, "--run-id", name, "--json"])
            .env("IMGPIPE_BASE_URL", &sandbox.base_url)
            .env("IMGPIPE_API_KEY", &sandbox.api_key)
            .env_remove("IMGPIPE_LOG")
            .env_remove("IMGPIPE_STATE");
        let stdout = dir.path().join(format!("{name}.json"));
        let stderr = dir.path().join(format!("{name}.log"));
        let (child, _) = spawn(&mut cmd, &stdout, &stderr);
        started.push((child, stderr));
    }
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
