//! Executing runs (`imgpipe run`) against the sandbox in a separate process:
//!
//! - overhead: no latency, no rate limit, 5,000 one-step tool tasks: tasks/s and CPU per task;
//! - rate: the sandbox limited to 50 requests/s (every `/v1` call counts) and imgpipe told
//!   `--rate 50/s`: the achieved rate (goal: at least 98% of 50/s) and no 429 over 1,000 calls;
//! - latency: 300 ms per paid call, concurrency 16: at least 95% of 16/0.3 calls/s;
//! - chain: the same latency over 40 items × a five-step chain (generate → erase → expand →
//!   upscale → remove_background, 200 calls) with a generation price the service states: the
//!   whole run within 3.95 s, i.e. at least 95% of 16/0.3 calls/s. No run can take less than
//!   3.90 s: each of the 16 slots makes whole 300 ms calls one after another, so one of them
//!   makes at least 13 of the 200;
//! - memory: peak RSS for 10,000 tasks; and 32 upscales ×4 of a 2048-pixel sample (8192-pixel
//!   PNGs of about 1 MiB, the largest the sandbox makes) with 16 downloads at once, against the
//!   same run on 64-pixel samples: streamed downloads keep it flat. On loopback a download is
//!   over in milliseconds, so these two runs go through a relay emulating a slow link (2 MiB/s
//!   per connection), and the calls of each wave of 16 end together; the bench counts the
//!   downloads it sees in progress at once.
//!
//! Every run gets its own sandbox (`imgpipe sandbox --json --port 0`), state database and output
//! directory. Wall time, CPU (user + sys) and peak RSS are the kernel's rusage of the
//! `imgpipe run` child. Call rates come from the attempts the run recorded, first call start to
//! last, so start-up and the last downloads do not dilute them; 429s and the peak of paid calls
//! in flight come from the sandbox's counters. Medians of IMGPIPE_BENCH_RUNS runs (default 3).
//! Run with `cargo bench --bench run`; IMGPIPE_BENCH_ONLY=TEXT runs only the scenarios whose
//! name contains TEXT (e.g. `dl`). IMGPIPE_BENCH_STATE=postgres://ADMIN@HOST:PORT/DB keeps each
//! run's state in a fresh database of that PostgreSQL server instead of a SQLite file, and
//! IMGPIPE_BENCH_OUT=s3 puts each run's outputs in a bucket of an S3-compatible server the bench
//! runs on 127.0.0.1 (s3s-fs, as the tests use) instead of a local directory.
//! IMGPIPE_BENCH_CAP=N sets a daily spending cap of N credits in each run's state first.

// Benchmarks and tests report on stdout and stderr by design, and share helpers between
// their own modules.
#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use sqlx::Connection;

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, binary, block_on, env_usize, out_for, state_for};

const DEFAULT_RUNS: usize = 3;
const MIB: f64 = 1024.0 * 1024.0;
const RATE: f64 = 50.0;
const LATENCY_MS: u64 = 300;
const CONCURRENCY: usize = 16;
const SMALL_SIDE: &str = "64";
/// Upscaled ×4 to 2048 px at photo weight (`--photo-weight`): about 5 MB an image, where the
/// sandbox's flat pictures compress to a fraction of a MiB and would say nothing of streaming.
const LARGE_SIDE: &str = "512";
const LARGE_TASKS: usize = 32;
/// Longer than 16 upscales ×4 take on two cores, so each wave of calls ends together.
const LARGE_LATENCY_MS: &str = "5000";

const ERASE: &str = r#"erase: { image_url: "{{ item.url }}", object_name: "{{ item.id }}" }"#;
/// Five calls an item, each reading the one before.
const CHAIN: &str = r#"generate: { prompt: "a {{ item.id }}", n: 1, size: 2K }
  - id: clean
    erase: { from: edit, object_name: a scuff }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9" }
  - id: big
    upscale: { from: wide, desired_increase: 2 }
  - id: cutout
    remove_background: { from: big }"#;
const CHAIN_ITEMS: usize = 40;
const CHAIN_STEPS: usize = 5;
/// The chain's goal: 95% of what 16 slots of 300 ms calls allow for its 200 calls.
const CHAIN_GOAL_S: f64 = 3.95;
const UPSCALE: &str = r#"upscale: { image_url: "{{ item.url }}", desired_increase: 4 }"#;

struct Scenario {
    name: &'static str,
    items: usize,
    /// Paid calls per item: the steps of its chain.
    steps: usize,
    step: &'static str,
    sandbox: Vec<String>,
    run: Vec<String>,
    /// Relay everything through a [`slow_link`] and count the `.part` files the run holds open,
    /// i.e. downloads in progress.
    slow_downloads: bool,
}

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Sample {
    wall: f64,
    cpu: f64,
    peak_mib: f64,
    calls: u64,
    /// Calls per second from the first call's start to the last's.
    call_rate: f64,
    rate_limited: u64,
    peak_in_flight: u64,
    mean_output_mib: f64,
    downloads_at_once: usize,
}

fn main() {
    let runs = env_usize("IMGPIPE_BENCH_RUNS", DEFAULT_RUNS).max(1);
    println!("{runs} runs each, binary: {}", binary());
    let concurrency = CONCURRENCY.to_string();
    let scenarios = [
        Scenario {
            name: "overhead",
            items: 5_000,
            steps: 1,
            step: ERASE,
            sandbox: args(&["--image-side", SMALL_SIDE]),
            run: args(&["--concurrency", &concurrency]),
            slow_downloads: false,
        },
        Scenario {
            name: "rate 50/s",
            items: 1_000,
            steps: 1,
            step: ERASE,
            sandbox: args(&[
                "--image-side",
                SMALL_SIDE,
                "--rate-limit",
                &RATE.to_string(),
                "--rate-limit-scope",
                "all",
            ]),
            run: args(&[
                "--concurrency",
                &concurrency,
                "--rate",
                &format!("{RATE}/s"),
            ]),
            slow_downloads: false,
        },
        Scenario {
            name: "latency 300ms",
            items: 1_000,
            steps: 1,
            step: ERASE,
            sandbox: args(&[
                "--image-side",
                SMALL_SIDE,
                "--latency-ms",
                &LATENCY_MS.to_string(),
            ]),
            run: args(&["--concurrency", &concurrency]),
            slow_downloads: false,
        },
        Scenario {
            name: "chain 300ms",
            items: CHAIN_ITEMS,
            steps: CHAIN_STEPS,
            step: CHAIN,
            sandbox: args(&[
                "--image-side",
                SMALL_SIDE,
                "--latency-ms",
                &LATENCY_MS.to_string(),
                "--advertise-price",
            ]),
            run: args(&["--concurrency", &concurrency]),
            slow_downloads: false,
        },
        Scenario {
            name: "10k tasks",
            items: 10_000,
            steps: 1,
            step: ERASE,
            sandbox: args(&["--image-side", SMALL_SIDE]),
            run: args(&["--concurrency", &concurrency]),
            slow_downloads: false,
        },
        large(SMALL_SIDE, "dl small"),
        large(LARGE_SIDE, "dl large"),
    ];
    let only = std::env::var("IMGPIPE_BENCH_ONLY").unwrap_or_default();
    let mut medians = Vec::new();
    let mut kept = Vec::new();
    for scenario in scenarios.iter().filter(|s| s.name.contains(only.as_str())) {
        let samples: Vec<Sample> = (0..runs).map(|_| run_once(scenario, &mut kept)).collect();
        medians.push((scenario, median(&samples)));
    }
    report(&medians, runs);
    support::s3_remove_bucket();
}

/// Upscales ×4 whose paid calls all end together (the sandbox's latency outlasts the work), so
/// their downloads start together too.
fn large(side: &str, name: &'static str) -> Scenario {
    Scenario {
        name,
        items: LARGE_TASKS,
        steps: 1,
        step: UPSCALE,
        sandbox: args(&[
            "--image-side",
            side,
            "--photo-weight",
            "--latency-ms",
            LARGE_LATENCY_MS,
        ]),
        run: args(&[
            "--concurrency",
            &CONCURRENCY.to_string(),
            "--download-concurrency",
            &CONCURRENCY.to_string(),
        ]),
        slow_downloads: true,
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// Runs `s` once, in a directory left in `kept` until the bench ends: ext4 without a journal
/// (this machine's disk) passes over inodes deleted in the last minutes when it allocates new
/// ones, so removing one run's thousands of files would tax the next run's every file and
/// directory, and the bench would measure its own clean-up rather than imgpipe.
fn run_once(s: &Scenario, kept: &mut Vec<tempfile::TempDir>) -> Sample {
    let dir = tempfile::tempdir().expect("temp dir");
    let pipeline = write_inputs(dir.path(), s);
    let sandbox = Sandbox::start(&s.sandbox);
    let base_url = if s.slow_downloads {
        &slow_link(&sandbox.base_url)
    } else {
        &sandbox.base_url
    };
    let state = state_for(dir.path());
    set_cap(&state);
    let mut cmd = Command::new(binary());
    let out = out_for(dir.path(), &mut cmd);
    cmd.arg("run")
        .arg(&pipeline)
        .arg("--state")
        .arg(&state)
        .arg("--out")
        .arg(out)
        .arg("--json")
        .args(&s.run)
        .env("IMGPIPE_BASE_URL", base_url)
        .env("IMGPIPE_API_KEY", &sandbox.api_key)
        .env_remove("IMGPIPE_LOG")
        .env_remove("IMGPIPE_STATE");
    let stdout = dir.path().join("stdout.json");
    let stderr = dir.path().join("stderr.log");
    let measured = measure(cmd, &stdout, &stderr, s.slow_downloads);
    let summary: Value = serde_json::from_slice(&std::fs::read(&stdout).expect("read summary"))
        .expect("the summary is JSON");
    let count = |k: &str| summary[k].as_u64().unwrap_or(0);
    assert!(
        count("succeeded") == (s.items * s.steps) as u64 && count("downloaded") == count("outputs"),
        "{}: the run did not finish its work: {summary}",
        s.name
    );
    let stats = sandbox.stats();
    let counter = |k: &str| {
        stats["stats"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("no counter {k} in the sandbox's stats"))
    };
    let (calls, first_ms, last_ms, bytes) = recorded(&state);
    let span = (last_ms - first_ms) as f64 / 1000.0;
    let sample = Sample {
        calls,
        call_rate: if span > 0.0 {
            (calls - 1) as f64 / span
        } else {
            0.0
        },
        rate_limited: counter("rate_limited"),
        peak_in_flight: counter("peak_in_flight"),
        mean_output_mib: bytes as f64 / count("outputs").max(1) as f64 / MIB,
        ..measured
    };
    println!(
        "  {:<14} wall {:>6.2} s  cpu {:>6.2} s  peak RSS {:>6.1} MiB  {} calls at {:>6.1}/s  429s {}  in flight {}",
        s.name,
        sample.wall,
        sample.cpu,
        sample.peak_mib,
        sample.calls,
        sample.call_rate,
        sample.rate_limited,
        sample.peak_in_flight
    );
    kept.push(dir);
    sample
}

/// With IMGPIPE_BENCH_CAP=N, a daily spending cap of N credits in the run's state before it
/// starts: the run then leases its chains from the cap (a block a twentieth of it), and the
/// figures say what holding a cap costs the hot path, against the same bench without it.
fn set_cap(state: &str) {
    let Some(credits) = std::env::var("IMGPIPE_BENCH_CAP")
        .ok()
        .filter(|c| !c.is_empty())
    else {
        return;
    };
    let mut cmd = Command::new(binary());
    cmd.args([
        "cap",
        "set",
        "bench",
        "--credits",
        &credits,
        "--per",
        "day",
        "--state",
        state,
    ])
    .env_remove("IMGPIPE_STATE");
    support::run_to_end(cmd, "imgpipe cap set");
}

fn write_inputs(dir: &Path, s: &Scenario) -> PathBuf {
    let file = dir.join("bench.yaml");
    let yaml = format!(
        "version: 1\nname: bench\nitems_from: items.csv\nsteps:\n  - id: edit\n    {}\n",
        s.step
    );
    std::fs::write(&file, yaml).expect("write pipeline");
    let items = std::fs::File::create(dir.join("items.csv")).expect("create items");
    let mut out = std::io::BufWriter::new(items);
    writeln!(out, "id,url").expect("write items");
    let samples = ["mug", "lamp", "chair", "plant"];
    for i in 0..s.items {
        let name = samples[i % samples.len()];
        writeln!(out, "item-{i:05},https://sandbox.invalid/assets/{name}.png").expect("write item");
    }
    out.flush().expect("flush items");
    file
}

/// Runs `cmd` to its end; returns wall time, CPU time and peak RSS (and, when asked, the most
/// downloads seen in progress at once).
#[allow(clippy::zombie_processes)] // reaped below by wait4, which also reads its rusage
fn measure(mut cmd: Command, stdout: &Path, stderr: &Path, watch: bool) -> Sample {
    let (child, start) = support::spawn(&mut cmd, stdout, stderr);
    let pid = child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch.then(|| watch_downloads(pid, Arc::clone(&stop)));
    let usage = support::wait(pid, start, stderr);
    stop.store(true, Ordering::Relaxed);
    let downloads_at_once = watcher.map_or(0, |w| w.join().unwrap_or(0));
    Sample {
        wall: usage.wall,
        cpu: usage.cpu,
        peak_mib: usage.peak_mib,
        downloads_at_once,
        ..Sample::default()
    }
}

/// Samples the child's open files every millisecond; a `.part` file is a download under way.
fn watch_downloads(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let fds = PathBuf::from(format!("/proc/{pid}/fd"));
        let mut peak = 0;
        while !stop.load(Ordering::Relaxed) {
            let open = std::fs::read_dir(&fds).map_or(0, |entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| {
                        std::fs::read_link(e.path())
                            .is_ok_and(|p| p.to_string_lossy().ends_with(".part"))
                    })
                    .count()
            });
            peak = peak.max(open);
            std::thread::sleep(Duration::from_millis(1));
        }
        peak
    })
}

/// From the run's state: attempts, first and last start (unix ms), downloaded bytes.
fn recorded(state: &str) -> (u64, i64, i64, u64) {
    block_on(async {
        sqlx::any::install_default_drivers();
        let url = if state.starts_with("postgres") {
            state.to_owned()
        } else {
            format!("sqlite://{state}")
        };
        let mut conn = sqlx::AnyConnection::connect(&url)
            .await
            .expect("open the state database");
        let (calls, first, last): (i64, Option<i64>, Option<i64>) =
            sqlx::query_as("SELECT COUNT(*), MIN(started_at), MAX(started_at) FROM attempts")
                .fetch_one(&mut conn)
                .await
                .expect("read attempts");
        let (bytes,): (Option<i64>,) =
            sqlx::query_as("SELECT CAST(SUM(bytes) AS BIGINT) FROM outputs")
                .fetch_one(&mut conn)
                .await
                .expect("read outputs");
        let _ = conn.close().await;
        let u = |n: i64| u64::try_from(n).unwrap_or(0);
        (
            u(calls),
            first.unwrap_or(0),
            last.unwrap_or(0),
            u(bytes.unwrap_or(0)),
        )
    })
}

/// Bytes per second each relayed connection carries towards imgpipe: a 1 MiB image then takes
/// half a second, so the downloads of a wave of calls really overlap.
const LINK_BYTES_PER_SEC: f64 = 2.0 * MIB;
const LINK_CHUNK: usize = 16 * 1024;

/// Starts a relay in front of the sandbox at `base_url` that emulates a slow link, and returns
/// its base URL. It rewrites the sandbox's address to its own in all it relays (both are
/// `127.0.0.1:` and a port of the same length, so every Content-Length holds), so result URLs
/// lead through it too. Its threads end with their connections; the acceptor stays, idle.
fn slow_link(base_url: &str) -> String {
    let url = url::Url::parse(base_url).expect("sandbox URL");
    let upstream = format!(
        "{}:{}",
        url.host_str().expect("sandbox host"),
        url.port().expect("sandbox port")
    );
    let listener = (0..1000)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind the link"))
        .find(|l| {
            l.local_addr()
                .is_ok_and(|a| a.to_string().len() == upstream.len())
        })
        .expect("a port as long as the sandbox's");
    let own = listener.local_addr().expect("link address").to_string();
    let (from, to) = (upstream.clone().into_bytes(), own.clone().into_bytes());
    std::thread::spawn(move || {
        for client in listener.incoming().filter_map(Result::ok) {
            let (upstream, from, to) = (upstream.clone(), from.clone(), to.clone());
            std::thread::spawn(move || relay(client, &upstream, &from, &to));
        }
    });
    format!("http://{own}/")
}

fn relay(client: TcpStream, upstream: &str, from: &[u8], to: &[u8]) {
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    let (Ok(mut client_in), Ok(mut server_out)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut client_in, &mut server_out);
        let _ = server_out.shutdown(Shutdown::Write);
    });
    let _ = slow_copy(server, client, from, to);
}

/// Copies `server` to `client` at the link's pace, rewriting `from` to `to` (equal lengths).
fn slow_copy(
    mut server: TcpStream,
    mut client: TcpStream,
    from: &[u8],
    to: &[u8],
) -> std::io::Result<()> {
    // A quiet server releases what was held back (below) within this time.
    server.set_read_timeout(Some(Duration::from_millis(20)))?;
    let mut pending = Vec::new();
    let mut buf = vec![0; LINK_CHUNK];
    loop {
        let (n, quiet) = match server.read(&mut buf) {
            Ok(0) => {
                paced(&mut client, &pending)?;
                return client.shutdown(Shutdown::Write);
            }
            Ok(n) => (n, false),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => (0, true),
            Err(e) => return Err(e),
        };
        pending.extend_from_slice(&buf[..n]);
        let mut i = 0;
        while i + from.len() <= pending.len() {
            if pending[i..].starts_with(from) {
                pending[i..i + from.len()].copy_from_slice(to);
                i += from.len();
            } else {
                i += 1;
            }
        }
        // Hold back an ending that may be the start of `from`, to rewrite it whole.
        let held = if quiet {
            0
        } else {
            (1..from.len())
                .rev()
                .find(|&k| pending.ends_with(&from[..k]))
                .unwrap_or(0)
        };
        let ready = pending.len() - held;
        paced(&mut client, &pending[..ready])?;
        pending.drain(..ready);
    }
}

fn paced(client: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    for chunk in bytes.chunks(LINK_CHUNK) {
        client.write_all(chunk)?;
        std::thread::sleep(Duration::from_secs_f64(
            chunk.len() as f64 / LINK_BYTES_PER_SEC,
        ));
    }
    Ok(())
}

fn median(samples: &[Sample]) -> Sample {
    let pick = |f: &dyn Fn(&Sample) -> f64| {
        let mut v: Vec<f64> = samples.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Sample {
        wall: pick(&|s| s.wall),
        cpu: pick(&|s| s.cpu),
        peak_mib: pick(&|s| s.peak_mib),
        calls: pick(&|s| s.calls as f64) as u64,
        call_rate: pick(&|s| s.call_rate),
        rate_limited: samples.iter().map(|s| s.rate_limited).max().unwrap_or(0),
        peak_in_flight: pick(&|s| s.peak_in_flight as f64) as u64,
        mean_output_mib: pick(&|s| s.mean_output_mib),
        downloads_at_once: pick(&|s| s.downloads_at_once as f64) as usize,
    }
}

fn report(medians: &[(&Scenario, Sample)], runs: usize) {
    println!(
        "\nmedians of {runs} runs (429s: the most in any run)\n{:<14} {:>6} {:>8} {:>9} {:>10} {:>11} {:>9} {:>5} {:>9} {:>8} {:>10}",
        "scenario",
        "tasks",
        "wall s",
        "tasks/s",
        "calls/s",
        "CPU ms/task",
        "RSS MiB",
        "429s",
        "in flight",
        "MiB/out",
        "dl at once"
    );
    for (s, m) in medians {
        let tasks = (s.items * s.steps) as f64;
        println!(
            "{:<14} {:>6} {:>8.2} {:>9.1} {:>10.1} {:>11.3} {:>9.1} {:>5} {:>9} {:>8.3} {:>10}",
            s.name,
            tasks,
            m.wall,
            tasks / m.wall,
            m.call_rate,
            m.cpu * 1000.0 / tasks,
            m.peak_mib,
            m.rate_limited,
            m.peak_in_flight,
            m.mean_output_mib,
            m.downloads_at_once
        );
    }
    let by = |name: &str| {
        medians
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, m)| *m)
    };
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    println!("\ngoals");
    if let Some(m) = by("overhead") {
        println!(
            "  overhead   {:.0} tasks/s over the whole run, {:.0} calls/s while calling, {:.2} ms CPU per task",
            5_000.0 / m.wall,
            m.call_rate,
            m.cpu * 1000.0 / 5_000.0
        );
    }
    if let Some(m) = by("rate 50/s") {
        let share = m.call_rate / RATE;
        println!(
            "  rate       {:.2} calls/s = {:.1}% of {RATE} (goal 98%): {}; 429s {} (goal 0): {}",
            m.call_rate,
            share * 100.0,
            verdict(share >= 0.98),
            m.rate_limited,
            verdict(m.rate_limited == 0)
        );
    }
    if let Some(m) = by("latency 300ms") {
        let ideal = CONCURRENCY as f64 / (LATENCY_MS as f64 / 1000.0);
        let share = m.call_rate / ideal;
        println!(
            "  latency    {:.2} calls/s = {:.1}% of {ideal:.1} (goal 95%): {}",
            m.call_rate,
            share * 100.0,
            verdict(share >= 0.95)
        );
    }
    if let Some(m) = by("chain 300ms") {
        let calls = (CHAIN_ITEMS * CHAIN_STEPS) as f64;
        // Each slot makes whole calls one after another, so some slot makes ceil(calls / C).
        let rounds = (calls / CONCURRENCY as f64).ceil();
        let floor = rounds * (LATENCY_MS as f64 / 1000.0);
        println!(
            "  chain      {calls:.0} calls in {:.2} s (floor {floor:.2} s: {rounds:.0} rounds of calls; goal {CHAIN_GOAL_S} s): {}; {:.1} calls/s while calling",
            m.wall,
            verdict(m.wall <= CHAIN_GOAL_S),
            m.call_rate
        );
    }
    if let Some(ten) = by("10k tasks") {
        print!(
            "  memory     peak RSS {:.1} MiB for 10,000 tasks",
            ten.peak_mib
        );
        match by("overhead") {
            Some(five) => println!(
                " ({:.1} MiB for 5,000: {:.2} KiB more per task)",
                five.peak_mib,
                (ten.peak_mib - five.peak_mib) * 1024.0 / 5_000.0
            ),
            None => println!(),
        }
    }
    if let (Some(small), Some(large)) = (by("dl small"), by("dl large")) {
        let extra = large.peak_mib - small.peak_mib;
        let each = extra / large.downloads_at_once.max(1) as f64;
        println!(
            "  streaming  {:.2} MiB outputs, {} downloads at once: peak RSS {:.1} MiB against {:.1} MiB \
             with {:.3} MiB ones, {extra:+.1} MiB, {each:.2} MiB per download in progress \
             (goal: less than a whole image): {}",
            large.mean_output_mib,
            large.downloads_at_once,
            large.peak_mib,
            small.peak_mib,
            small.mean_output_mib,
            verdict(each < large.mean_output_mib)
        );
    }
}
