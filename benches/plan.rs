//! Validating and planning a large batch: 100,000 items from JSONL × the five-step chain
//! (generate n: 2 → erase → expand → upscale → remove_background; 900,000 tasks).
//!
//! Runs the release binary as users do (`validate`, then `plan --offline --json`), several
//! times each, and reports the median wall time and the peak resident memory of each run
//! (from the kernel's rusage of the child). Run with `cargo bench --bench plan`; set
//! IMGPIPE_BENCH_ITEMS or IMGPIPE_BENCH_RUNS to change the size or the number of runs.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::{BufWriter, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod support;

use support::{binary, env_usize};

const DEFAULT_ITEMS: usize = 100_000;
const DEFAULT_RUNS: usize = 7;

const PIPELINE: &str = r#"version: 1
name: bench
budget: { max_credits: 100000000 }
pricing: { generation: 4 }
items_from: items.jsonl
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.subject }} on a white backdrop", n: 2, size: 2K }
  - id: clean
    erase: { from: shot, object_name: "{{ item.remove }}" }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9", prompt: "extend the {{ item.backdrop }}" }
  - id: big
    upscale: { from: wide, desired_increase: 4 }
  - id: cutout
    remove_background: { from: big }
"#;

fn main() {
    let items = env_usize("IMGPIPE_BENCH_ITEMS", DEFAULT_ITEMS);
    let runs = env_usize("IMGPIPE_BENCH_RUNS", DEFAULT_RUNS).max(1);
    let dir = tempfile::tempdir().expect("temp dir");
    write_inputs(dir.path(), items);
    let file = dir.path().join("bench.yaml");
    let file = file.to_str().expect("utf-8 temp path");
    println!(
        "{items} items x 5 steps, {runs} runs each, binary: {}",
        binary()
    );
    for args in [
        vec!["validate", file],
        vec!["plan", "--offline", "--json", file],
    ] {
        let mut times = Vec::new();
        let mut peaks = Vec::new();
        for _ in 0..runs {
            let (time, peak_kib) = run(&args);
            times.push(time);
            peaks.push(peak_kib);
        }
        times.sort();
        peaks.sort();
        println!(
            "{:<10} median {:>7.3} s (min {:.3}, max {:.3})   peak RSS median {:>6.1} MiB (max {:.1})",
            args[0],
            times[runs / 2].as_secs_f64(),
            times[0].as_secs_f64(),
            times[runs - 1].as_secs_f64(),
            peaks[runs / 2] as f64 / 1024.0,
            peaks[runs - 1] as f64 / 1024.0,
        );
    }
}

fn write_inputs(dir: &Path, items: usize) {
    std::fs::write(dir.join("bench.yaml"), PIPELINE).expect("write pipeline");
    let file = std::fs::File::create(dir.join("items.jsonl")).expect("create items");
    let mut out = BufWriter::new(file);
    for i in 0..items {
        writeln!(
            out,
            r#"{{"id": "sku-{i:06}", "subject": "product {i}, a glazed ceramic mug with a thin gold rim", "remove": "the price sticker", "backdrop": "seamless grey paper backdrop"}}"#
        )
        .expect("write item");
    }
    out.flush().expect("flush items");
}

/// Runs the binary once; returns its wall time and peak resident set in KiB.
#[allow(clippy::zombie_processes)] // reaped by wait4 in `support::reap`, which reads its rusage
fn run(args: &[&str]) -> (Duration, i64) {
    let start = Instant::now();
    let child = Command::new(binary())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn imgpipe");
    let (usage, status) = support::reap(child.id(), start);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "imgpipe {args:?} failed with status {status}"
    );
    (
        Duration::from_secs_f64(usage.wall),
        (usage.peak_mib * 1024.0) as i64,
    )
}
