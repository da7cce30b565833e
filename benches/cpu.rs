//! CPU per call against a Python asyncio peer: `imgpipe run` and `benches/support/peer.py` (a
//! small aiohttp client doing per call what the run does: a row committed before the paid call
//! and one after it, the result downloaded, hashed, written through a temporary file, fsynced
//! and linked in, its directory fsynced, the output recorded) take turns against one sandbox,
//! IMGPIPE_BENCH_ITEMS (500) unlimited `erase` calls of the sandbox's default 256-pixel images,
//! at imgpipe's default concurrency (4: the sandbox's account states no limit), a fresh SQLite
//! state and output directory per run. Each process's user + sys CPU comes from the kernel's
//! rusage of the child (`wait4`); the figure is the least of IMGPIPE_BENCH_RUNS (3) runs each,
//! and their ratio (goal: imgpipe at most 0.6 of the peer's). The turns alternate so that the
//! load of a shared machine weighs on both alike.
//!
//! The peer needs aiohttp: Debian's `python3-aiohttp` (for `/usr/bin/python3`, used when it
//! exists) or `pip install aiohttp`; IMGPIPE_BENCH_PYTHON names another interpreter.
//! Run with `cargo bench --bench cpu`.

// Benchmarks report on stdout by design, and share helpers between their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::Write;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, Usage, binary, env_usize};

const DEFAULT_RUNS: usize = 3;
const DEFAULT_ITEMS: usize = 500;
/// imgpipe's concurrency when neither the pipeline, the command line nor the account says one.
const DEFAULT_CONCURRENCY: usize = 4;
/// The goal of issue 35: imgpipe's CPU at most this share of the peer's.
const GOAL: f64 = 0.6;

const PIPELINE: &str = r#"version: 1
name: bench
items_from: items.csv
steps:
  - id: edit
    erase: { image_url: "{{ item.url }}", object_name: "{{ item.id }}" }
"#;

fn main() {
    let runs = env_usize("IMGPIPE_BENCH_RUNS", DEFAULT_RUNS).max(1);
    let items = env_usize("IMGPIPE_BENCH_ITEMS", DEFAULT_ITEMS).max(1);
    let python = python();
    println!(
        "{runs} runs each of {items} calls, binary: {}, peer: {python} {}",
        binary(),
        peer_script()
    );
    let sandbox = Sandbox::start(&[]);
    let mut kept = Vec::new();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let (mut our_start, mut their_start) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let dir = tempfile::tempdir().expect("temp dir");
        ours.push(run_imgpipe(&sandbox, &dir.path().join("a"), items));
        theirs.push(run_peer(&sandbox, &dir.path().join("a"), items, &python));
        our_start.push(run_imgpipe(&sandbox, &dir.path().join("b"), 1));
        their_start.push(run_peer(&sandbox, &dir.path().join("b"), 1, &python));
        // Kept until the end: removing thousands of files would tax the next run's.
        kept.push(dir);
    }
    report(&ours, &theirs, items);
    let (a, b) = (least(&our_start).cpu, least(&their_start).cpu);
    let (a_call, b_call) = (
        (least(&ours).cpu - a) / (items - 1).max(1) as f64,
        (least(&theirs).cpu - b) / (items - 1).max(1) as f64,
    );
    println!(
        "  a run of one call (start-up and one call, least of {runs}): imgpipe {a:.3} s, peer {b:.3} s; \
         beyond it, each further call: imgpipe {:.3} ms, peer {:.3} ms, ratio {:.3}",
        a_call * 1000.0,
        b_call * 1000.0,
        a_call / b_call
    );
}

/// The interpreter: IMGPIPE_BENCH_PYTHON, else Debian's (where `python3-aiohttp` installs),
/// else the first `python3` on the PATH.
fn python() -> String {
    std::env::var("IMGPIPE_BENCH_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| {
            if Path::new("/usr/bin/python3").exists() {
                "/usr/bin/python3".to_owned()
            } else {
                "python3".to_owned()
            }
        })
}

fn peer_script() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/benches/support/peer.py")
}

fn run_imgpipe(sandbox: &Sandbox, dir: &Path, items: usize) -> Usage {
    std::fs::create_dir_all(dir).expect("the run's directory");
    let pipeline = dir.join("bench.yaml");
    std::fs::write(&pipeline, PIPELINE).expect("write the pipeline");
    write_items(&dir.join("items.csv"), items);
    let mut cmd = Command::new(binary());
    cmd.arg("run")
        .arg(&pipeline)
        .arg("--state")
        .arg(dir.join("state.db"))
        .arg("--out")
        .arg(dir.join("out"))
        .arg("--json")
        .env("IMGPIPE_BASE_URL", &sandbox.base_url)
        .env("IMGPIPE_API_KEY", &sandbox.api_key)
        .env_remove("IMGPIPE_LOG")
        .env_remove("IMGPIPE_STATE")
        .env_remove("TOKIO_WORKER_THREADS");
    let (stdout, stderr) = (dir.join("imgpipe.json"), dir.join("imgpipe.log"));
    let usage = support::measure(cmd, &stdout, &stderr);
    let summary: Value = serde_json::from_slice(&std::fs::read(&stdout).expect("read summary"))
        .expect("the summary is JSON");
    let count = |k: &str| summary[k].as_u64().unwrap_or(0);
    assert!(
        count("succeeded") == items as u64 && count("downloaded") == items as u64,
        "imgpipe did not finish its work: {summary}"
    );
    println!("  imgpipe {items:>5} calls  {}", line(&usage));
    usage
}

fn run_peer(sandbox: &Sandbox, dir: &Path, items: usize, python: &str) -> Usage {
    let mut cmd = Command::new(python);
    cmd.arg(peer_script())
        .arg(&sandbox.base_url)
        .arg(&sandbox.api_key)
        .arg(items.to_string())
        .arg(dir.join("peer"))
        .arg(DEFAULT_CONCURRENCY.to_string());
    let (stdout, stderr) = (dir.join("peer.json"), dir.join("peer.log"));
    let usage = support::measure(cmd, &stdout, &stderr);
    let said: Value = serde_json::from_slice(&std::fs::read(&stdout).expect("read the peer's"))
        .expect("the peer prints JSON");
    assert_eq!(
        said["outputs"].as_u64(),
        Some(items as u64),
        "the peer did not keep every output: {said}"
    );
    println!("  peer    {items:>5} calls  {}", line(&usage));
    usage
}

fn write_items(path: &Path, items: usize) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("create items"));
    writeln!(out, "id,url").expect("write items");
    let samples = ["mug", "lamp", "chair", "plant"];
    for i in 0..items {
        let name = samples[i % samples.len()];
        writeln!(out, "item-{i:05},https://sandbox.invalid/assets/{name}.png").expect("write item");
    }
    out.flush().expect("flush items");
}

fn line(u: &Usage) -> String {
    format!(
        "cpu {:.3} s (user {:.3}, sys {:.3})  wall {:.2} s  peak RSS {:.1} MiB",
        u.cpu, u.user, u.sys, u.wall, u.peak_mib
    )
}

/// The run of least CPU.
fn least(samples: &[Usage]) -> Usage {
    *samples
        .iter()
        .min_by(|a, b| a.cpu.total_cmp(&b.cpu))
        .expect("at least one run")
}

fn report(ours: &[Usage], theirs: &[Usage], items: usize) {
    let (a, b) = (least(ours), least(theirs));
    let ratio = a.cpu / b.cpu;
    println!("\nleast of {} runs each", ours.len());
    println!(
        "  imgpipe {}  = {:.3} ms a call",
        line(&a),
        a.cpu * 1000.0 / items as f64
    );
    println!(
        "  peer    {}  = {:.3} ms a call",
        line(&b),
        b.cpu * 1000.0 / items as f64
    );
    let verdict = if ratio <= GOAL { "met" } else { "MISSED" };
    println!("  ratio   {ratio:.3} of the peer's CPU (goal {GOAL}): {verdict}");
    let mut each: Vec<f64> = ours
        .iter()
        .zip(theirs)
        .map(|(o, t)| o.cpu / t.cpu)
        .collect();
    each.sort_by(f64::total_cmp);
    println!(
        "  ratios of the runs taken in turn: {}",
        each.iter()
            .map(|r| format!("{r:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
