//! Making run reports (`imgpipe report`), on runs made first against `imgpipe sandbox`:
//!
//! - many: IMGPIPE_BENCH_ITEMS items (default 1,000) through erase (512 px) → upscale 2× →
//!   remove_background: 3 images per item;
//! - large: 8 upscales ×4 of a 2048-pixel sample, i.e. 8192-pixel PNGs, the largest the
//!   sandbox makes.
//!
//! For each: the report with no thumbnail made yet (cold: every image decoded and scaled), and
//! again with all made (warm: only the database and image headers read). Wall time, CPU and
//! peak RSS are the kernel's rusage of the `imgpipe report` child; page and thumbnail sizes are
//! read off the disk. Medians of IMGPIPE_BENCH_RUNS runs (default 3). Run with
//! `cargo bench --bench report`.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, Usage, binary, env_usize, measure};

struct Scenario {
    name: &'static str,
    items: usize,
    side: &'static str,
    steps: &'static str,
}

const MANY: &str = r#"
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: "{{ item.id }}" }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
  - id: cutout
    remove_background: { from: big }
"#;

const LARGE: &str = r#"
  - id: big
    upscale: { image_url: "{{ item.url }}", desired_increase: 4 }
"#;

fn main() {
    let runs = env_usize("IMGPIPE_BENCH_RUNS", 3).max(1);
    let scenarios = [
        Scenario {
            name: "many",
            items: env_usize("IMGPIPE_BENCH_ITEMS", 1000),
            side: "512",
            steps: MANY,
        },
        Scenario {
            name: "large",
            items: 8,
            side: "2048",
            steps: LARGE,
        },
    ];
    println!("{runs} runs each, binary: {}", binary());
    for s in &scenarios {
        bench(s, runs);
    }
}

fn bench(s: &Scenario, runs: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (state, run_id) = make_run(dir.path(), s);
    let run_dir = dir.path().join("out").join(&run_id);
    let thumbs = run_dir.join("_thumbs");
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut images = 0;
    for _ in 0..runs {
        let _ = std::fs::remove_dir_all(&thumbs);
        let (usage, made) = report(dir.path(), &state, &run_id);
        assert!(made > 0, "a cold report made no thumbnail");
        images = made;
        cold.push(usage);
        let (usage, made) = report(dir.path(), &state, &run_id);
        assert_eq!(made, 0, "a warm report made thumbnails again");
        warm.push(usage);
    }
    let page = std::fs::metadata(run_dir.join("report.html"))
        .expect("the report")
        .len() as f64;
    let thumb_bytes: u64 = std::fs::read_dir(&thumbs)
        .expect("thumbnails")
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let (cold, warm) = (median(&cold), median(&warm));
    println!(
        "{:<6} {images} images: cold {:.2} s ({:.1} ms per image, cpu {:.2} s, peak RSS {:.1} MiB); \
         warm {:.2} s (peak RSS {:.1} MiB); page {:.0} KiB ({:.0} bytes per image); \
         thumbnails {:.1} KiB each",
        s.name,
        cold.wall,
        cold.wall * 1000.0 / images as f64,
        cold.cpu,
        cold.peak_mib,
        warm.wall,
        warm.peak_mib,
        page / 1024.0,
        page / images as f64,
        thumb_bytes as f64 / images as f64 / 1024.0,
    );
}

/// Runs the scenario's pipeline to its end; returns the state database and the run's id.
fn make_run(dir: &Path, s: &Scenario) -> (PathBuf, String) {
    let sandbox = Sandbox::start(&["--image-side".to_owned(), s.side.to_owned()]);
    let pipeline = dir.join("bench.yaml");
    std::fs::write(
        &pipeline,
        format!(
            "version: 1\nname: bench\nitems_from: items.csv\nsteps:{}",
            s.steps
        ),
    )
    .expect("write pipeline");
    let mut items =
        std::io::BufWriter::new(std::fs::File::create(dir.join("items.csv")).expect("items"));
    writeln!(items, "id,url").expect("write items");
    let samples = ["mug", "lamp", "chair", "plant"];
    for i in 0..s.items {
        let name = samples[i % samples.len()];
        writeln!(
            items,
            "item-{i:05},https://sandbox.invalid/assets/{name}.png"
        )
        .expect("item");
    }
    items.flush().expect("flush items");
    let state = dir.join("state.db");
    let mut cmd = Command::new(binary());
    cmd.arg("run")
        .arg(&pipeline)
        .args(["--concurrency", "16", "--json", "--state"])
        .arg(&state)
        .arg("--out")
        .arg(dir.join("out"))
        .env("IMGPIPE_BASE_URL", &sandbox.base_url)
        .env("IMGPIPE_API_KEY", &sandbox.api_key)
        .env_remove("IMGPIPE_STATE");
    let stdout = dir.join("run.json");
    measure(cmd, &stdout, &dir.join("run.log"));
    let summary: Value =
        serde_json::from_slice(&std::fs::read(&stdout).expect("summary")).expect("JSON summary");
    let run_id = summary["run_id"].as_str().expect("run_id").to_owned();
    (state, run_id)
}

/// `imgpipe report`: its usage, and the thumbnails it made.
fn report(dir: &Path, state: &Path, run_id: &str) -> (Usage, usize) {
    let mut cmd = Command::new(binary());
    cmd.args(["report", run_id, "--json", "--state"])
        .arg(state)
        .env_remove("IMGPIPE_STATE");
    let stdout = dir.join("report.json");
    let usage = measure(cmd, &stdout, &dir.join("report.log"));
    let written: Value =
        serde_json::from_slice(&std::fs::read(&stdout).expect("report JSON")).expect("JSON");
    let made = written["thumbnails_made"]
        .as_u64()
        .expect("thumbnails_made") as usize;
    (usage, made)
}

fn median(samples: &[Usage]) -> Usage {
    let pick = |f: &dyn Fn(&Usage) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Usage {
        wall: pick(&|s| s.wall),
        cpu: pick(&|s| s.cpu),
        user: pick(&|s| s.user),
        sys: pick(&|s| s.sys),
        peak_mib: pick(&|s| s.peak_mib),
    }
}
