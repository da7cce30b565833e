//! Memory at batch scale: a batch of 20,000 items (100,000 tasks) must run, and be reviewed
//! for resuming, in about the memory of a batch of 200. Both runs do the same work (they are
//! interrupted after the same number of paid calls), so only the batch's size differs; each
//! process's peak RSS is the kernel's (`wait4`), not a sample.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::binary::Imgpipe;
use crate::common::{finish_blocking, start};

/// Paid calls each run makes before it is interrupted.
const CALLS: i64 = 300;
/// How long the run may take to reach [`CALLS`] at the largest size, on a loaded machine.
const CALLS_LIMIT: Duration = Duration::from_secs(120);
/// How much more a batch 100 times larger may take: the graph, the scheduler and the review
/// hold a few bytes per task, the items their ids and fields (measured: 1.35 for the run,
/// 1.5 for the review; at the 2.8 KB a task the issue measured before, the run would be
/// about 12).
const FACTOR: f64 = 2.0;

fn pipeline(dir: &Path, items: usize) {
    let mut jsonl = String::new();
    for i in 0..items {
        jsonl += &format!("{{\"id\": \"p{i:06}\", \"subject\": \"product {i}\"}}\n");
    }
    std::fs::write(dir.join("items.jsonl"), jsonl).unwrap();
    std::fs::write(
        dir.join("p.yaml"),
        r#"version: 1
name: scale
output_dir: out
pricing: { generation: 4 }
items_from: items.jsonl
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.subject }}", n: 2 }
  - id: clean
    erase: { from: shot, object_name: the corner }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
"#,
    )
    .unwrap();
}

/// How long one command of a batch may take before the test fails (measured: the review of
/// 20,000 items takes a few seconds).
const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// Peak RSS in KiB of child `pid`, reaped here, and its exit code; fails the test with `what`,
/// the child killed, if it has not ended within [`COMMAND_LIMIT`].
async fn reap_within(pid: u32, what: &str) -> (i64, Option<i32>) {
    let reaped = tokio::task::spawn_blocking(move || reap(pid));
    match tokio::time::timeout(COMMAND_LIMIT, reaped).await {
        Ok(reaped) => reaped.unwrap(),
        Err(_) => {
            // Not reaped yet (wait4 still waits), so the pid is still the child's; killed, it
            // is reaped by the blocked wait4.
            // SAFETY: kill(2) on our own child's pid; no memory involved.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("{what}: not ended within {COMMAND_LIMIT:?}, killed");
        }
    }
}

/// Peak RSS in KiB of child `pid`, reaped here, and its exit code.
fn reap(pid: u32) -> (i64, Option<i32>) {
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value, and wait4 writes it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child, not yet reaped; status and usage point at live locals.
    let reaped = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid as libc::pid_t, "wait4 failed");
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    (usage.ru_maxrss, code)
}

fn imgpipe(dir: &Path, base: &str, key: &str, args: &[&str]) -> Command {
    let mut cmd = Imgpipe::new(args)
        .state("state.db")
        .cwd(dir)
        .service(base, key)
        .std_command();
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    cmd
}

/// Runs a batch of `items` until it has made [`CALLS`] paid calls, interrupts it (SIGINT, as
/// from the terminal), then reviews it with `resume --dry-run`: the peak RSS of both, in KiB.
#[allow(clippy::zombie_processes)] // reaped by wait4, which also reads the peak RSS
async fn run_and_review(items: usize) -> (i64, i64) {
    let env = start(imgpipe::sandbox::Config {
        balance: 100_000_000,
        image_side: 16,
        ..imgpipe::sandbox::Config::default()
    })
    .await;
    let dir = env.dir.path();
    pipeline(dir, items);
    let (base, key) = (
        env.sandbox.base_url().to_string(),
        env.sandbox.key().to_owned(),
    );
    let args = ["run", "p.yaml", "--run-id", "big", "--concurrency", "8"];
    // The sandbox lets exactly CALLS calls through its gate and holds the rest, so the run is
    // interrupted in the middle however fast the machine is.
    env.sandbox.hold_calls();
    env.sandbox.let_through(CALLS as usize);
    let child = imgpipe(dir, &base, &key, &args).spawn().unwrap();
    let pid = child.id();
    let started = Instant::now();
    while env.sandbox.ledger().len() < CALLS as usize || env.sandbox.held_calls() == 0 {
        assert!(
            started.elapsed() < CALLS_LIMIT,
            "{items} items: waited {CALLS_LIMIT:?} for {CALLS} calls billed and the next held at \
             the gate; {} billed, {} held",
            env.sandbox.ledger().len(),
            env.sandbox.held_calls()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // SAFETY: sends SIGINT to our own child, not yet reaped.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    env.sandbox.release_calls();
    let (run, code) = reap_within(pid, &format!("{items} items: the interrupted run")).await;
    assert_eq!(code, Some(130), "{items} items: the interrupted run's exit");
    let review = imgpipe(dir, &base, &key, &["resume", "big", "--dry-run"])
        .spawn()
        .unwrap();
    let pid = review.id();
    let (dry, code) = reap_within(pid, &format!("{items} items: resume --dry-run")).await;
    assert_eq!(code, Some(0), "{items} items: resume --dry-run's exit");
    // Only the items the run reached are recorded; status counts the others from the plan.
    let o = finish_blocking(
        imgpipe(dir, &base, &key, &["status", "big", "--json"]),
        COMMAND_LIMIT,
        &format!("{items} items: status"),
    );
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let n = |k: &str| {
        doc[k]
            .as_u64()
            .unwrap_or_else(|| panic!("status has {k}: {doc}"))
    };
    assert_eq!(n("tasks"), items as u64 * 5, "{doc}");
    assert_eq!(n("planned_credits"), items as u64 * 16, "{doc}");
    assert!(n("succeeded") >= CALLS as u64 / 2, "{doc}");
    assert_eq!(n("succeeded") + n("pending"), n("tasks"), "{doc}");
    let steps = doc["steps"].as_array().unwrap();
    let per_step: Vec<u64> = steps.iter().map(|s| s["tasks"].as_u64().unwrap()).collect();
    assert_eq!(
        per_step,
        [items as u64, 2 * items as u64, 2 * items as u64],
        "{doc}"
    );
    let o = finish_blocking(
        imgpipe(dir, &base, &key, &["report", "big", "--out", "r.html"]),
        COMMAND_LIMIT,
        &format!("{items} items: report"),
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let page = std::fs::read_to_string(dir.join("r.html")).unwrap();
    let done = format!("{} of {}", n("succeeded"), items * 5);
    let planned = format!("of {} planned", items * 16);
    assert!(
        page.contains(&done) && page.contains(&planned),
        "report lacks {done:?}, {planned:?}"
    );
    (run, dry)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_20000_items_runs_and_is_reviewed_for_resume_in_the_memory_of_200() {
    let (small_run, small_dry) = run_and_review(200).await;
    let (large_run, large_dry) = run_and_review(20_000).await;
    println!(
        "peak RSS, 200 vs 20,000 items: run {small_run} vs {large_run} KiB, \
         resume --dry-run {small_dry} vs {large_dry} KiB"
    );
    assert!(
        large_run as f64 <= small_run as f64 * FACTOR,
        "the run of 20,000 items peaked at {large_run} KiB, the run of 200 at {small_run} KiB"
    );
    assert!(
        large_dry as f64 <= small_dry as f64 * FACTOR,
        "resume --dry-run of 20,000 items peaked at {large_dry} KiB, of 200 at {small_dry} KiB"
    );
}
