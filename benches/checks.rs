//! Checks on stored outputs (issue 46), measured against its "Measures":
//!
//! - night: `imgpipe sandbox` making 10% bad images of each kind (`--fault-blank`,
//!   `--fault-opaque-cutout`, `--fault-wrong-size`, `--fault-duplicate` at 0.1, seed 46),
//!   IMGPIPE_BENCH_ITEMS items (default 200) × a generation of two images (`not_blank`,
//!   `distinct`), each upscaled 2× (`size`, `not_blank`) and cut out (`not_blank`,
//!   `transparent`), every step `on_fail: reroll` with `max_rerolls: 3`. The bench then reads
//!   every kept output back and judges it itself with `imgpipe::checks::image` (bad outputs
//!   left: goal 0; those flagged because `max_rerolls` ran out are counted apart), holds the
//!   sandbox's ledger against `check_rerolls` (calls per step = tasks + rerolls; credits of
//!   rerolls = their tasks' prices, at most `rerolls.max_credits`), and holds the plan's
//!   rerolls against what was billed: the worst case before the first run, the expected case
//!   (from the first run's verdicts) before a second run of as many new items on the same
//!   state database;
//! - cpu: `imgpipe::checks::image::read` and the built-in checks on a sandbox-drawn 2048-px
//!   photo-weight PNG, in this process: the thread's CPU time, median of IMGPIPE_BENCH_RUNS
//!   (default 15);
//! - big: the night's pipeline at `--image-side 2048 --photo-weight` (2048-px generations,
//!   4096-px upscales and cut-outs, the same bad images) on IMGPIPE_BENCH_BIG_ITEMS items
//!   (default 4): the run's peak RSS;
//! - hang: a command check that never returns (`exec sleep 600`, `timeout: 2`) on 4 upscales:
//!   the run's exit status and wall time, the verdicts, the ledger (nothing paid again), and no
//!   `sleep` left running.
//!
//! `cargo bench --bench checks` (`-- --quick`: 20 items, 1 big item, 5 CPU runs);
//! IMGPIPE_BENCH_ONLY=night, cpu, big or hang runs one; IMGPIPE_BENCH_KEEP=1 keeps each
//! scenario's directory (its path in the figures' lines). State in SQLite, outputs on local
//! disk.

#![allow(clippy::print_stdout, clippy::print_stderr, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::Command;

use imgpipe::checks::Outcome;
use imgpipe::checks::image::{self, SizePromise, Stats};
use imgpipe::pipeline::checks::{DEFAULT_MIN_DISTANCE, DEFAULT_MIN_STDDEV};
use imgpipe::sandbox::images::{Weight, generation_png};
use serde_json::Value;
use sqlx::{Connection, Row};

#[path = "support/mod.rs"]
mod support;
use support::{Sandbox, Usage, binary, block_on, env_usize, measure};

/// 10% of each kind of bad image, the same draws every time.
const BAD_IMAGES: [&str; 10] = [
    "--fault-blank",
    "0.1",
    "--fault-opaque-cutout",
    "0.1",
    "--fault-wrong-size",
    "0.1",
    "--fault-duplicate",
    "0.1",
    "--seed",
    "46",
];
/// The cut-outs' `transparent` bounds, in the pipeline and in the bench's own judging.
const TRANSPARENT: (f64, f64) = (0.05, 0.95);
const MAX_REROLLS: u32 = 3;
/// What rerolls may spend: far above what 10% bad images cost, below the worst case at 200
/// items (13,200 credits), so that the plan's worst case is this cap.
const REROLL_CREDITS: u64 = 5000;
/// generate (2 images × 4) + 2 × (upscale 2 + cut-out 5) = 22 credits an item.
const CREDITS_AN_ITEM: u64 = 22;

const STEPS: &str = r#"steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.id }} on a white backdrop", n: 2, size: 2K }
    checks: [not_blank, distinct]
    max_rerolls: @MAX@
  - id: big
    upscale: { from: shot, desired_increase: 2 }
    checks: [size, not_blank]
    max_rerolls: @MAX@
  - id: cutout
    remove_background: { from: big }
    checks: [not_blank, { transparent: { min: @LOW@, max: @HIGH@ } }]
    max_rerolls: @MAX@
"#;

/// Each step's operation, as the sandbox's ledger names it.
const OPERATIONS: [(&str, &str); 3] = [
    ("shot", "generate"),
    ("big", "upscale"),
    ("cutout", "remove_background"),
];

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let only = std::env::var("IMGPIPE_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    println!("binary: {}", binary());
    if wanted("night") {
        night(env_usize(
            "IMGPIPE_BENCH_ITEMS",
            if quick { 20 } else { 200 },
        ));
    }
    if wanted("cpu") {
        cpu(env_usize("IMGPIPE_BENCH_RUNS", if quick { 5 } else { 15 }));
    }
    if wanted("big") {
        big(env_usize(
            "IMGPIPE_BENCH_BIG_ITEMS",
            if quick { 1 } else { 4 },
        ));
    }
    if wanted("hang") {
        hang();
    }
}

/// The checked pipeline over items `first..first + items`, its budget enough for the worst.
fn pipeline(first: usize, items: usize) -> String {
    let list: String = (first..first + items)
        .map(|i| format!("  - {{ id: item-{i} }}\n"))
        .collect();
    let budget = items as u64 * CREDITS_AN_ITEM + REROLL_CREDITS;
    let steps = STEPS
        .replace("@MAX@", &MAX_REROLLS.to_string())
        .replace("@LOW@", &TRANSPARENT.0.to_string())
        .replace("@HIGH@", &TRANSPARENT.1.to_string());
    format!(
        "version: 1\nname: checks\npricing: {{ generation: 4 }}\nconcurrency: 8\n\
         budget: {{ max_credits: {budget} }}\nrerolls: {{ max_credits: {REROLL_CREDITS} }}\n\
         items:\n{list}{steps}"
    )
}

/// One scenario: its directory (pipeline files, state database, outputs, logs) and sandbox.
struct Bench {
    name: &'static str,
    dir: tempfile::TempDir,
    sandbox: Sandbox,
}

impl Bench {
    fn new(name: &'static str, sandbox_args: &[&str]) -> Bench {
        let args: Vec<String> = sandbox_args.iter().map(|a| a.to_string()).collect();
        Bench {
            name,
            dir: tempfile::Builder::new()
                .disable_cleanup(std::env::var_os("IMGPIPE_BENCH_KEEP").is_some())
                .tempdir()
                .expect("temp dir"),
            sandbox: Sandbox::start(&args),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.path(name), text).expect("write a bench file");
    }

    fn imgpipe(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(binary());
        cmd.current_dir(self.dir.path())
            .args(args)
            .arg("--state")
            .arg(self.path("state.db"))
            .env("IMGPIPE_BASE_URL", &self.sandbox.base_url)
            .env("IMGPIPE_API_KEY", &self.sandbox.api_key)
            .env_remove("IMGPIPE_STATE");
        cmd
    }

    /// `imgpipe run FILE --run-id RUN`, measured.
    fn run(&self, file: &str, run: &str) -> Usage {
        let out = self.path("out");
        let cmd = self.imgpipe(&[
            "run",
            file,
            "--run-id",
            run,
            "--out",
            &out.to_string_lossy(),
        ]);
        let log = |ext: &str| self.path(&format!("{}-{run}.{ext}", self.name));
        measure(cmd, &log("out"), &log("log"))
    }

    /// `plan --json`'s `rerolls`: the worst case, and the expected case when known.
    fn plan_rerolls(&self, file: &str) -> (u64, Option<u64>) {
        let out = self.path(&format!("{}-plan.json", self.name));
        let log = self.path(&format!("{}-plan.log", self.name));
        measure(self.imgpipe(&["--json", "plan", file]), &out, &log);
        let doc: Value = serde_json::from_slice(&std::fs::read(&out).expect("the plan"))
            .expect("the plan is JSON");
        let rerolls = &doc["rerolls"];
        (
            rerolls["worst_case_credits"]
                .as_u64()
                .unwrap_or_else(|| panic!("no rerolls in the plan: {doc}")),
            rerolls["expected_credits"].as_u64(),
        )
    }

    /// Paid calls and credits in the sandbox's ledger so far, by operation.
    fn ledger(&self) -> BTreeMap<String, (u64, u64)> {
        let stats = self.sandbox.stats();
        let mut by = BTreeMap::new();
        for entry in stats["ledger"].as_array().expect("the ledger") {
            let op = entry["operation"]
                .as_str()
                .expect("an operation")
                .to_owned();
            let row: &mut (u64, u64) = by.entry(op).or_default();
            row.0 += 1;
            row.1 += entry["credits"].as_u64().expect("credits");
        }
        by
    }

    fn state(&self) -> State {
        State::read(&self.path("state.db"))
    }
}

/// The ledger's growth between two readings, by operation.
fn billed_since(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> BTreeMap<String, (u64, u64)> {
    after
        .iter()
        .map(|(op, (calls, credits))| {
            let (c0, k0) = before.get(op).copied().unwrap_or_default();
            (op.clone(), (calls - c0, credits - k0))
        })
        .collect()
}

fn night(items: usize) {
    let bench = Bench::new("night", &BAD_IMAGES);
    bench.write("first.yaml", &pipeline(0, items));
    bench.write("second.yaml", &pipeline(items, items));
    let (worst, none) = bench.plan_rerolls("first.yaml");
    let before = bench.ledger();
    let run = bench.run("first.yaml", "first");
    let after = bench.ledger();
    println!(
        "night: {items} items × 3 steps ({} tasks), 10% bad images of each kind, in {}: run {}",
        items * 5,
        bench.dir.path().display(),
        brief(&run)
    );
    let state = bench.state();
    let first = state.run("first");
    first.judge_outputs();
    let spent = first.rerolls(&billed_since(&before, &after));
    println!(
        "night: plan before the first run: rerolls worst case {worst} credits (expected {}), \
         billed {spent}: worst ≥ billed {}",
        none.map_or("unknown".into(), |e| e.to_string()),
        verdict(worst >= spent)
    );
    let (worst, expected) = bench.plan_rerolls("second.yaml");
    let before = bench.ledger();
    let run = bench.run("second.yaml", "second");
    let after = bench.ledger();
    let state = bench.state();
    let second = state.run("second");
    println!(
        "night: a second run of {items} new items, same state: {}",
        brief(&run)
    );
    second.judge_outputs();
    let spent = second.rerolls(&billed_since(&before, &after));
    let expected = expected.expect("the second plan knows the first run's verdicts");
    let off = (expected as f64 - spent as f64) / spent.max(1) as f64;
    println!(
        "night: plan before the second run: worst {worst}, expected {expected} credits; billed \
         {spent}: expected {:+.0}% of billed (goal within 20%) {}",
        off * 100.0,
        verdict(off.abs() <= 0.2)
    );
    second.explain_expected(&state);
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

fn brief(u: &Usage) -> String {
    format!(
        "{:.2} s (CPU {:.2} s, peak RSS {:.1} MiB)",
        u.wall, u.cpu, u.peak_mib
    )
}

/// What the state database holds, read once after a run.
struct State {
    tasks: Vec<TaskRow>,
    outputs: Vec<OutputRow>,
    /// (run, step, credits) of each reroll.
    rerolls: Vec<(String, String, u64)>,
    /// (output id, job) of the outputs flagged, and of those flagged with a failed check.
    flagged: BTreeSet<(i64, String)>,
    /// (run, step, output id, job, any failed) of each judged output.
    judged: Vec<(String, String, i64, String, bool)>,
}

struct TaskRow {
    id: i64,
    run: String,
    item: String,
    step: String,
    inputs: Vec<String>,
    planned: u64,
}

struct OutputRow {
    id: i64,
    task_id: i64,
    k: i64,
    job_id: String,
    path: Option<String>,
}

impl State {
    fn read(db: &Path) -> State {
        block_on(async {
            let url = format!("sqlite://{}?mode=ro", db.display());
            let mut conn = sqlx::SqliteConnection::connect(&url)
                .await
                .expect("open the state database");
            let rows = |sql: &'static str| sqlx::query(sql);
            let tasks = rows(
                "SELECT id, run_id, item, step, idx, inputs, planned_credits FROM tasks
                 WHERE removed_at IS NULL ORDER BY step, item, idx",
            )
            .fetch_all(&mut conn)
            .await
            .expect("tasks")
            .iter()
            .map(|r| TaskRow {
                id: r.get("id"),
                run: r.get("run_id"),
                item: r.get("item"),
                step: r.get("step"),
                inputs: serde_json::from_str(&r.get::<String, _>("inputs")).expect("inputs"),
                planned: r.get::<i64, _>("planned_credits") as u64,
            })
            .collect();
            let outputs =
                rows("SELECT id, task_id, k, job_id, path FROM outputs ORDER BY task_id, k")
                    .fetch_all(&mut conn)
                    .await
                    .expect("outputs")
                    .iter()
                    .map(|r| OutputRow {
                        id: r.get("id"),
                        task_id: r.get("task_id"),
                        k: r.get("k"),
                        job_id: r.get("job_id"),
                        path: r.get("path"),
                    })
                    .collect();
            let rerolls = rows(
                "SELECT r.run_id, t.step, r.credits FROM check_rerolls r
                 JOIN tasks t ON t.id = r.task_id",
            )
            .fetch_all(&mut conn)
            .await
            .expect("check_rerolls")
            .iter()
            .map(|r| {
                (
                    r.get("run_id"),
                    r.get("step"),
                    r.get::<i64, _>("credits") as u64,
                )
            })
            .collect();
            let flagged = rows(
                "SELECT DISTINCT output_id, job_id FROM check_verdicts WHERE acted = 'flagged'",
            )
            .fetch_all(&mut conn)
            .await
            .expect("check_verdicts")
            .iter()
            .map(|r| (r.get("output_id"), r.get("job_id")))
            .collect();
            let judged = rows(
                "SELECT v.run_id, t.step, v.output_id, v.job_id,
                        MAX(v.verdict = 'failed') AS failed
                 FROM check_verdicts v JOIN tasks t ON t.id = v.task_id
                 GROUP BY v.run_id, t.step, v.output_id, v.job_id",
            )
            .fetch_all(&mut conn)
            .await
            .expect("check_verdicts by output")
            .iter()
            .map(|r| {
                (
                    r.get("run_id"),
                    r.get("step"),
                    r.get("output_id"),
                    r.get("job_id"),
                    r.get::<i64, _>("failed") == 1,
                )
            })
            .collect();
            let _ = conn.close().await;
            State {
                tasks,
                outputs,
                rerolls,
                flagged,
                judged,
            }
        })
    }

    fn run<'a>(&'a self, run: &'a str) -> RunState<'a> {
        RunState { state: self, run }
    }
}

/// One run's part of the state.
struct RunState<'a> {
    state: &'a State,
    run: &'a str,
}

/// A kept output as the bench judged it.
struct Kept<'a> {
    output: &'a OutputRow,
    task: &'a TaskRow,
    stats: Stats,
}

impl<'a> RunState<'a> {
    fn tasks(&self) -> impl Iterator<Item = &'a TaskRow> + '_ {
        self.state.tasks.iter().filter(|t| t.run == self.run)
    }

    /// Every kept output of the run, read back from its file, by `item/step[n]` (the n-th
    /// output of the item's step, in task then output order: what a task's `inputs` name).
    fn kept(&self) -> BTreeMap<String, Kept<'a>> {
        let mut kept = BTreeMap::new();
        let mut nth: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for task in self.tasks() {
            for output in self.state.outputs.iter().filter(|o| o.task_id == task.id) {
                let path = output.path.as_deref().expect("every output kept");
                let file = File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
                let stats =
                    image::read(BufReader::new(file)).unwrap_or_else(|e| panic!("{path}: {e}"));
                let n = nth.entry((&task.item, &task.step)).or_default();
                let key = format!("{}/{}[{n}]", task.item, task.step);
                *n += 1;
                kept.insert(
                    key,
                    Kept {
                        output,
                        task,
                        stats,
                    },
                );
            }
        }
        kept
    }

    /// Judges every kept output with the library's built-in checks, as the pipeline asks,
    /// and prints how many are bad: flagged by the run (its `max_rerolls` spent), and not.
    fn judge_outputs(&self) {
        let kept = self.kept();
        let mut bad: BTreeMap<&str, Vec<(&str, String)>> = BTreeMap::new();
        // Each generation's images, in output order: `distinct` judges them together.
        let mut generations: BTreeMap<i64, Vec<(&str, u64)>> = BTreeMap::new();
        for (key, o) in &kept {
            let mut verdicts = vec![image::not_blank(&o.stats, DEFAULT_MIN_STDDEV)];
            match o.task.step.as_str() {
                "shot" => generations
                    .entry(o.task.id)
                    .or_default()
                    .push((key.as_str(), o.stats.hash())),
                "big" => {
                    let input = &kept[&o.task.inputs[0]];
                    let promise = SizePromise::Scaled {
                        input: (input.stats.width, input.stats.height),
                        factor: 2,
                    };
                    verdicts.push(image::size(&o.stats, promise));
                }
                _ => verdicts.push(image::transparent(&o.stats, TRANSPARENT.0, TRANSPARENT.1)),
            }
            if let Some(v) = verdicts.iter().find(|v| v.outcome != Outcome::Passed) {
                bad.entry(o.task.step.as_str())
                    .or_default()
                    .push((key.as_str(), format!("{}: {}", v.check, v.reason)));
            }
        }
        for generation in generations.values_mut() {
            generation.sort_by_key(|(key, _)| kept[*key].output.k);
            let hashes: Vec<u64> = generation.iter().map(|(_, h)| *h).collect();
            let verdicts = image::distinct(&hashes, DEFAULT_MIN_DISTANCE);
            let copies = generation
                .iter()
                .zip(verdicts)
                .filter(|(_, v)| v.outcome != Outcome::Passed)
                .map(|((key, _), v)| (*key, format!("distinct: {}", v.reason)));
            bad.entry("shot").or_default().extend(copies);
        }
        let flagged = |key: &str| {
            let o = &kept[key];
            self.state
                .flagged
                .contains(&(o.output.id, o.output.job_id.clone()))
        };
        // A flagged output's readers were made from it: their faults are its own.
        let from_flagged = |key: &str| kept[key].task.inputs.iter().any(|i| flagged(i));
        let all: Vec<(&str, &str, &String)> = bad
            .iter()
            .flat_map(|(step, list)| list.iter().map(move |(k, why)| (*step, *k, why)))
            .collect();
        let unflagged: Vec<_> = all.iter().filter(|(_, k, _)| !flagged(k)).collect();
        let inherited = all
            .iter()
            .filter(|(_, k, _)| flagged(k) && from_flagged(k))
            .count();
        let ran_out = all.len() - unflagged.len() - inherited;
        println!(
            "{}: {} kept outputs judged again by imgpipe::checks::image: {} bad not flagged \
             (goal 0) {}; {} flagged by the run: {ran_out} after their max_rerolls ran out, \
             {inherited} made from such a flagged input",
            self.run,
            kept.len(),
            unflagged.len(),
            verdict(unflagged.is_empty()),
            all.len() - unflagged.len(),
        );
        for (step, key, why) in all {
            let how = if !flagged(key) {
                "NOT FLAGGED"
            } else if from_flagged(key) {
                "flagged, from a flagged input"
            } else {
                "flagged, max_rerolls spent"
            };
            println!("{}:   {step} {key}: {why} ({how})", self.run);
        }
    }

    /// Holds the rerolls recorded against the ledger's calls; returns the credits rerolls
    /// billed.
    fn rerolls(&self, billed: &BTreeMap<String, (u64, u64)>) -> u64 {
        let recorded: Vec<(&str, u64)> = self
            .state
            .rerolls
            .iter()
            .filter(|(run, _, _)| run == self.run)
            .map(|(_, step, credits)| (step.as_str(), *credits))
            .collect();
        let mut each = Vec::new();
        let mut exact = true;
        let mut extra_billed = 0;
        for (step, op) in OPERATIONS {
            let tasks: Vec<&TaskRow> = self.tasks().filter(|t| t.step == step).collect();
            let rerolls = recorded.iter().filter(|(s, _)| *s == step).count() as u64;
            let (calls, credits) = billed.get(op).copied().unwrap_or_default();
            let planned: u64 = tasks.iter().map(|t| t.planned).sum();
            exact &= calls == tasks.len() as u64 + rerolls;
            extra_billed += credits - planned;
            each.push(format!(
                "{step} {calls} calls = {} tasks + {rerolls} rerolls",
                tasks.len()
            ));
        }
        let spent: u64 = recorded.iter().map(|(_, c)| c).sum();
        println!(
            "{}: rerolls {} for {spent} credits (check_rerolls), the ledger {extra_billed} \
             credits over the tasks' prices: equal {}; {} {}; ≤ rerolls.max_credits \
             ({REROLL_CREDITS}) {}",
            self.run,
            recorded.len(),
            verdict(spent == extra_billed),
            each.join(", "),
            verdict(exact),
            verdict(spent <= REROLL_CREDITS),
        );
        spent
    }

    /// The share of this run's judged outputs, and of its tasks' judgements, that failed,
    /// by step: the plan's expected case takes the first as a task's chance to be paid again.
    fn explain_expected(&self, state: &State) {
        for (step, _) in OPERATIONS {
            let judged: Vec<&(String, String, i64, String, bool)> = state
                .judged
                .iter()
                .filter(|(run, s, ..)| run == self.run && s == step)
                .collect();
            let failed = judged.iter().filter(|j| j.4).count();
            let jobs: BTreeSet<&str> = judged.iter().map(|j| j.3.as_str()).collect();
            let failed_jobs: BTreeSet<&str> = judged
                .iter()
                .filter(|j| j.4)
                .map(|j| j.3.as_str())
                .collect();
            println!(
                "{}: {step}: {failed} of {} judged outputs failed ({:.1}%), {} of {} judgements \
                 of a task ({:.1}%)",
                self.run,
                judged.len(),
                100.0 * failed as f64 / judged.len().max(1) as f64,
                failed_jobs.len(),
                jobs.len(),
                100.0 * failed_jobs.len() as f64 / jobs.len().max(1) as f64,
            );
        }
    }
}

/// The thread's CPU time so far, in seconds.
fn thread_cpu() -> f64 {
    // SAFETY: an all-zero timespec is a valid value; clock_gettime writes it.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: t points at a live local.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(r, 0, "clock_gettime");
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The built-in checks on one 2048-px photo-weight generation, read from its file as a run
/// reads it: CPU and wall time, medians of `runs`.
fn cpu(runs: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("shot.png");
    let png = generation_png("Studio photo of item-0", 0, 0, 2048, Weight::Photo);
    std::fs::write(&file, &png).expect("write the image");
    let (mut cpu, mut wall, mut decoding) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..runs {
        // The decoder alone, every row handed to nothing: what reading costs before any check.
        let c0 = thread_cpu();
        imgpipe::pixels::rows(
            BufReader::new(File::open(&file).expect("the image")),
            |_, _| {},
        )
        .expect("a PNG");
        decoding.push(thread_cpu() - c0);
        let (c0, w0) = (thread_cpu(), std::time::Instant::now());
        let stats =
            image::read(BufReader::new(File::open(&file).expect("the image"))).expect("a PNG");
        let verdicts = [
            image::not_blank(&stats, DEFAULT_MIN_STDDEV),
            image::size(
                &stats,
                SizePromise::Scaled {
                    input: (1024, 1024),
                    factor: 2,
                },
            ),
            image::transparent(&stats, TRANSPARENT.0, TRANSPARENT.1),
        ];
        let hash = stats.hash();
        cpu.push(thread_cpu() - c0);
        wall.push(w0.elapsed().as_secs_f64());
        last = Some((stats.width, stats.height, verdicts, hash));
    }
    let (w, h, verdicts, _) = last.expect("a run");
    let said: Vec<String> = verdicts
        .iter()
        .map(|v| format!("{} {:?}", v.check, v.outcome))
        .collect();
    let (cpu, wall, decoding) = (median(cpu), median(wall), median(decoding));
    println!(
        "cpu: read + not_blank, size, transparent and the hash of a {w}x{h} photo-weight PNG \
         ({:.1} MB; {}): {:.1} ms CPU (goal ≤ 10 ms) {}, {:.1} ms wall; the decoder alone \
         {:.1} ms CPU; medians of {runs}",
        png.len() as f64 / 1e6,
        said.join(", "),
        cpu * 1e3,
        verdict(cpu <= 0.010),
        wall * 1e3,
        decoding * 1e3,
    );
}

/// The night's pipeline on `items` items at 2048 px, photo weight: the run's peak RSS.
fn big(items: usize) {
    let args = [&BAD_IMAGES[..], &["--image-side", "2048", "--photo-weight"]].concat();
    let bench = Bench::new("big", &args);
    bench.write("big.yaml", &pipeline(0, items));
    let run = bench.run("big.yaml", "big");
    let state = bench.state();
    let judged = state.judged.len();
    let rerolls = state.rerolls.len();
    let kept = state.run("big").kept();
    let largest = kept
        .values()
        .map(|k| (k.stats.width, k.stats.height))
        .max()
        .unwrap_or_default();
    println!(
        "big: {items} items at 2048 px, photo weight: run {}, {judged} outputs judged \
         ({rerolls} rerolls), the largest {}x{}: peak RSS ≤ 100 MB {}",
        brief(&run),
        largest.0,
        largest.1,
        verdict(run.peak_mib * 1024.0 * 1024.0 <= 100e6),
    );
}

/// A command check that never answers, on 4 upscales.
fn hang() {
    let bench = Bench::new("hang", &[]);
    bench.write("hang.sh", "exec sleep 600\n");
    let list: String = (0..4)
        .map(|i| format!("  - {{ id: item-{i} }}\n"))
        .collect();
    bench.write(
        "hang.yaml",
        &format!(
            "version: 1\nname: hang\npricing: {{ generation: 4 }}\nconcurrency: 8\n\
             budget: {{ max_credits: 200 }}\nrerolls: {{ max_credits: 100 }}\nitems:\n{list}\
             steps:\n  - id: shot\n    generate: {{ prompt: \"a photo of {{{{ item.id }}}}\" }}\n  \
             - id: big\n    upscale: {{ from: shot, desired_increase: 2 }}\n    checks:\n      \
             - command: {{ argv: [sh, hang.sh, \"{{file}}\"], timeout: 2 }}\n    \
             max_rerolls: 2\n  - id: cutout\n    remove_background: {{ from: big }}\n"
        ),
    );
    let run = bench.run("hang.yaml", "hang");
    let calls: Vec<String> = bench
        .ledger()
        .iter()
        .map(|(op, (calls, _))| format!("{op} {calls}"))
        .collect();
    let state = bench.state();
    let flagged = state.flagged.len();
    let paid_once =
        bench.ledger().values().all(|(calls, _)| *calls == 4) && state.rerolls.is_empty();
    let left = sleeps_in(bench.dir.path());
    println!(
        "hang: a command check that never answers (timeout 2 s) on 4 upscales: run exit 0 in \
         {:.2} s, {flagged} outputs flagged not checked, calls {} (each task paid once, no \
         reroll) {}; {left} `sleep` left running {}",
        run.wall,
        calls.join(", "),
        verdict(paid_once && flagged == 4),
        verdict(left == 0),
    );
}

/// Processes whose working directory is `dir` (the command checks' `sleep`s, if left behind).
fn sleeps_in(dir: &Path) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .flatten()
        .filter(|p| {
            std::fs::read_link(p.path().join("cwd")).is_ok_and(|cwd| cwd == dir)
                && std::fs::read(p.path().join("cmdline")).is_ok_and(|c| c.starts_with(b"sleep\0"))
        })
        .count()
}
