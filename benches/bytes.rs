//! Real bytes (issue 44): runs against `imgpipe sandbox --image-side 2048 --photo-weight`,
//! whose images weigh what photos weigh, each figure beside a plain copy of the same bytes.
//!
//! - night: IMGPIPE_BENCH_ITEMS items (default 8) × a generation of two 2K images (2048 px),
//!   each upscaled 4× (8192 px), concurrency 8. The run's wall time, CPU, peak RSS and bytes
//!   stored per second; `cp -r` of the run's directory to the same disk (its wall time and CPU:
//!   the limit); the desk's first page (`imgpipe review`: the run page, its first 50 items and
//!   every thumbnail they show, made on demand: bytes sent and time, beside the full images'
//!   bytes in view); `imgpipe report` cold (every image read, hashed, decoded and scaled) and
//!   warm, wall time and peak RSS; the desk's first page again, with the report's thumbnails;
//!   then the same night under another run id, every picture already drawn (the sandbox runs
//!   with `--remember-drawings`), so that its bytes stored per second are imgpipe's own, beside
//!   `cp -r`, and `cp -r` then `sync`;
//! - sample: the README's sample pipeline (`pipelines/product-shots.yaml`'s chain: generate,
//!   erase, expand to 16:9, upscale 4×, cut out) on 4 items at concurrency 8: its last two steps
//!   make 14,564 × 8,192 images of about 100 MB each. The run (its exit status, peak RSS, bytes
//!   stored per second), `cp -r`, and the report cold.
//!
//! IMGPIPE_BENCH_OUT=s3 stores the outputs in the bench's S3-compatible server on 127.0.0.1
//! (s3s-fs, its objects files on the same disk: `cp -r` of them is the limit);
//! IMGPIPE_BENCH_ONLY=night or sample runs one. The sandbox keeps every image in memory, and
//! every drawing once more: the night of 8 items holds about 2.6 GB, the sample about 4 GB.
//! `cargo bench --bench bytes`.

#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::Value;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, Usage, binary, env_usize, measure};

const NIGHT: &str = r#"
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.id }} on a white backdrop", n: 2, size: 2K }
  - id: big
    upscale: { from: shot, desired_increase: 4 }
"#;

/// A decimal megabyte: the unit of bytes moved.
const MB: f64 = 1e6;

fn main() {
    let only = std::env::var("IMGPIPE_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let place = if support::s3_out() {
        "S3"
    } else {
        "local disk"
    };
    println!("binary: {}; outputs on {place}", binary());
    if wanted("night") {
        let items = env_usize("IMGPIPE_BENCH_ITEMS", 8);
        night(&pipeline(NIGHT, items));
    }
    if wanted("sample") {
        sample();
    }
    support::s3_remove_bucket();
}

/// A pipeline of `steps` over `items` items (`item-0`, `item-1`, …), with the sample's
/// `subject` and `remove` fields.
fn pipeline(steps: &str, items: usize) -> String {
    let subjects = [
        ("a ceramic coffee mug", "the price sticker"),
        ("a brass desk lamp", "the power cable"),
        ("an oak dining chair", "the floor scuff"),
    ];
    let list: String = (0..items)
        .map(|i| {
            let (subject, remove) = subjects[i % subjects.len()];
            format!("  - {{ id: item-{i}, subject: {subject}, remove: {remove} }}\n")
        })
        .collect();
    format!(
        "version: 1\nname: bytes\npricing: {{ generation: 4 }}\nconcurrency: 8\n\
         items:\n{list}{}",
        steps.trim_start_matches('\n')
    )
}

fn night(yaml: &str) {
    let bench = Bench::new("night", yaml);
    let run = bench.run();
    let stored = bench.stored();
    let copy = bench.copy();
    println!(
        "night: run {} ({} files, {:.0} MB stored ({}): {:.1} MB/s, {:.2} s CPU per GB); \
         cp -r {} ({:.1} MB/s, {:.2} s CPU per GB): the run stores at {:.2} of the copy's rate",
        brief(&run),
        stored.files,
        stored.bytes / MB,
        stored.weights(),
        stored.bytes / MB / run.wall,
        run.cpu / (stored.bytes / 1e9),
        brief(&copy),
        stored.bytes / MB / copy.wall,
        copy.cpu / (stored.bytes / 1e9),
        copy.wall / run.wall,
    );
    bench.desk("cold");
    bench.reports();
    bench.desk("warm");
    bench.again();
}

fn sample() {
    let steps = std::fs::read_to_string("pipelines/product-shots.yaml")
        .expect("the sample pipeline (run from the repository's root)");
    let steps = &steps[steps.find("steps:").expect("its steps")..];
    let bench = Bench::new("sample", &pipeline(steps, 4));
    let run = bench.run();
    let stored = bench.stored();
    let copy = bench.copy();
    println!(
        "sample: run exit 0, {} ({} files, {:.0} MB stored ({}), the largest {:.0} MB: \
         {:.1} MB/s, {:.2} s CPU per GB); cp -r {} ({:.1} MB/s, {:.2} s CPU per GB)",
        brief(&run),
        stored.files,
        stored.bytes / MB,
        stored.weights(),
        stored.largest / MB,
        stored.bytes / MB / run.wall,
        run.cpu / (stored.bytes / 1e9),
        brief(&copy),
        stored.bytes / MB / copy.wall,
        copy.cpu / (stored.bytes / 1e9),
    );
    bench.reports();
}

/// One scenario: its directory, its sandbox, and where its run's outputs are.
struct Bench {
    name: &'static str,
    dir: tempfile::TempDir,
    sandbox: Sandbox,
    state: String,
    /// `--out`, and the same place as files on this disk (the S3 server's are files too).
    out: String,
    out_dir: PathBuf,
}

const RUN_ID: &str = "bytes";

impl Bench {
    fn new(name: &'static str, yaml: &str) -> Bench {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("bytes.yaml"), yaml).expect("write the pipeline");
        let sandbox = Sandbox::start(
            &[
                "--image-side",
                "2048",
                "--photo-weight",
                "--remember-drawings",
            ]
            .map(String::from),
        );
        let state = support::state_for(dir.path());
        let out = support::out_for(dir.path(), &mut Command::new("true"));
        let out_dir = match out.strip_prefix("s3://") {
            Some(key) => support::s3_root().expect("the S3 server").join(key),
            None => PathBuf::from(&out),
        };
        Bench {
            name,
            dir,
            sandbox,
            state,
            out,
            out_dir,
        }
    }

    fn imgpipe(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(binary());
        cmd.current_dir(self.dir.path())
            .args(args)
            .args(["--state", &self.state])
            .env("IMGPIPE_BASE_URL", &self.sandbox.base_url)
            .env("IMGPIPE_API_KEY", &self.sandbox.api_key)
            .env_remove("IMGPIPE_STATE");
        support::s3_env(&mut cmd);
        cmd
    }

    fn log(&self, what: &str) -> (PathBuf, PathBuf) {
        let at = |ext: &str| self.dir.path().join(format!("{}-{what}.{ext}", self.name));
        (at("out"), at("log"))
    }

    fn run(&self) -> Usage {
        self.run_as(RUN_ID)
    }

    fn run_as(&self, run_id: &str) -> Usage {
        let cmd = self.imgpipe(&["run", "bytes.yaml", "--run-id", run_id, "--out", &self.out]);
        let (stdout, stderr) = self.log(&format!("run-{run_id}"));
        measure(cmd, &stdout, &stderr)
    }

    fn run_dir(&self) -> PathBuf {
        self.out_dir.join(RUN_ID)
    }

    fn stored(&self) -> Stored {
        Stored::of(&self.run_dir())
    }

    /// `cp -r` of the run's directory beside it, on the same disk, measured, then removed.
    fn copy(&self) -> Usage {
        self.copy_with("cp -r \"$0\" \"$1\"", "cp")
    }

    /// `script` (`sh -c`, given the run's directory and a copy's path beside it on the same
    /// disk), measured; the copy is then removed.
    fn copy_with(&self, script: &str, what: &str) -> Usage {
        let copy = self.dir.path().join(format!("{}-copy", self.name));
        let mut cp = Command::new("sh");
        cp.arg("-c").arg(script).arg(self.run_dir()).arg(&copy);
        let (stdout, stderr) = self.log(what);
        let usage = measure(cp, &stdout, &stderr);
        std::fs::remove_dir_all(&copy).expect("remove the copy");
        usage
    }

    /// The same night again under another run id, every picture already drawn (the sandbox
    /// remembers its drawings): the run waits on its own downloads, hashing, writes and
    /// fsyncs, not on the sandbox drawing photos on the same cores. Beside it, `cp -r` and
    /// `cp -r` then `sync` (the run makes each file durable; `cp` alone leaves its bytes in the
    /// page cache).
    fn again(&self) {
        let run = self.run_as("again");
        let stored = Stored::of(&self.out_dir.join("again"));
        let copy = self.copy();
        let synced = self.copy_with("cp -r \"$0\" \"$1\" && sync -f \"$1\"", "cp-sync");
        let rate = |u: &Usage| stored.bytes / MB / u.wall;
        println!(
            "{}: again, every picture drawn before: run {} ({:.0} MB stored: {:.1} MB/s, \
             {:.2} s CPU per GB); cp -r {} ({:.1} MB/s); cp -r and sync {} ({:.1} MB/s): the run \
             stores at {:.2} of cp -r's rate, {:.2} of cp -r and sync's",
            self.name,
            brief(&run),
            stored.bytes / MB,
            rate(&run),
            run.cpu / (stored.bytes / 1e9),
            brief(&copy),
            rate(&copy),
            brief(&synced),
            rate(&synced),
            copy.wall / run.wall,
            synced.wall / run.wall,
        );
    }

    /// `imgpipe report` with no thumbnail made (cold), then again (warm).
    fn reports(&self) {
        let _ = std::fs::remove_dir_all(self.run_dir().join("_thumbs"));
        let (stdout, stderr) = self.log("report");
        let cold = measure(self.imgpipe(&["report", RUN_ID]), &stdout, &stderr);
        let warm = measure(self.imgpipe(&["report", RUN_ID]), &stdout, &stderr);
        let stored = self.stored();
        println!(
            "{}: report cold {} ({:.1} MB/s of images read), warm {}",
            self.name,
            brief(&cold),
            stored.bytes / MB / cold.wall,
            brief(&warm)
        );
    }

    /// The desk's first page as a browser loads it: the page, its first 50 items, and the
    /// thumbnail of every output they show: `cold`, none made before (each made on demand);
    /// `warm`, those the report made.
    fn desk(&self, when: &str) {
        if when == "cold" {
            let _ = std::fs::remove_dir_all(self.run_dir().join("_thumbs"));
        }
        let mut desk = self
            .imgpipe(&["review", "--no-open"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the desk");
        let mut first = String::new();
        BufReader::new(desk.stdout.take().expect("its stdout"))
            .read_line(&mut first)
            .expect("the desk's URL");
        let (base, token) = support::desk_url(&first);
        let (sent, seconds, full, thumbs) = support::block_on(first_page(&base, &token));
        let _ = desk.kill();
        let _ = desk.wait();
        let full_bytes: u64 = full
            .iter()
            .filter_map(|f| std::fs::metadata(self.run_dir().join(f)).ok())
            .map(|m| m.len())
            .sum();
        println!(
            "{}: desk first page, {when}: {:.2} s, {:.2} MB sent ({thumbs} thumbnails), where \
             its {} full images are {:.0} MB",
            self.name,
            seconds,
            sent as f64 / MB,
            full.len(),
            full_bytes as f64 / MB
        );
    }
}

/// Loads the desk's first page; returns the bytes sent, the time, the files of the outputs
/// shown, and the number of thumbnails.
async fn first_page(base: &str, token: &str) -> (usize, f64, Vec<String>, usize) {
    let http = reqwest::Client::new();
    let get = |path: String| {
        let request = http.get(format!("{base}{path}")).bearer_auth(token).send();
        async move {
            let r = request.await.expect("the desk answers");
            assert!(r.status().is_success(), "{path}: {}", r.status());
            r.bytes().await.expect("a body")
        }
    };
    let at = Instant::now();
    let page = get(format!("/runs/{RUN_ID}")).await;
    let items = get(format!("/api/runs/{RUN_ID}/items?limit=50")).await;
    let listed: Value = serde_json::from_slice(&items).expect("JSON");
    let outputs: Vec<&Value> = listed["items"]
        .as_array()
        .expect("items")
        .iter()
        .flat_map(|i| i["tasks"].as_array().into_iter().flatten())
        .flat_map(|t| t["outputs"].as_array().into_iter().flatten())
        .collect();
    let mut sent = page.len() + items.len();
    // Two at a time, as a browser's images are fetched over few connections.
    let thumbs: Vec<String> = outputs
        .iter()
        .filter_map(|o| o["thumb"].as_str().map(str::to_owned))
        .collect();
    for pair in thumbs.chunks(2) {
        let bodies = futures::future::join_all(pair.iter().map(|t| get(t.clone()))).await;
        sent += bodies.iter().map(|b| b.len()).sum::<usize>();
    }
    let files = outputs
        .iter()
        .filter_map(|o| o["file"].as_str().map(str::to_owned))
        .collect();
    (sent, at.elapsed().as_secs_f64(), files, thumbs.len())
}

/// The images of a run's directory (not its thumbnails): how many, their bytes, the largest,
/// and the mean weight of each step's (a file's name up to its `-`).
struct Stored {
    files: usize,
    bytes: f64,
    largest: f64,
    steps: std::collections::BTreeMap<String, (usize, f64)>,
}

impl Stored {
    fn of(dir: &Path) -> Stored {
        let mut stored = Stored {
            files: 0,
            bytes: 0.0,
            largest: 0.0,
            steps: std::collections::BTreeMap::new(),
        };
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for entry in std::fs::read_dir(&d)
                .expect("the run's directory")
                .flatten()
            {
                let meta = entry.metadata().expect("metadata");
                if meta.is_dir() && entry.file_name() != "_thumbs" {
                    todo.push(entry.path());
                } else if entry.path().extension().is_some_and(|e| e == "png") {
                    stored.files += 1;
                    stored.bytes += meta.len() as f64;
                    stored.largest = stored.largest.max(meta.len() as f64);
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let step = name.split('-').next().unwrap_or_default().to_owned();
                    let of_step = stored.steps.entry(step).or_default();
                    *of_step = (of_step.0 + 1, of_step.1 + meta.len() as f64);
                }
            }
        }
        stored
    }

    /// `step N × W MB` for each step.
    fn weights(&self) -> String {
        let each = self
            .steps
            .iter()
            .map(|(step, (n, bytes))| format!("{step} {n} × {:.1} MB", bytes / *n as f64 / MB));
        each.collect::<Vec<_>>().join(", ")
    }
}

fn brief(u: &Usage) -> String {
    format!(
        "{:.2} s (CPU {:.2} s, peak RSS {:.1} MiB)",
        u.wall, u.cpu, u.peak_mib
    )
}
