//! `imgpipe run` end to end: the real binary against the in-process sandbox, then the state
//! database, the manifest, the files on disk and the sandbox's own ledger held against each
//! other. The ledger is the truth about money: whatever imgpipe records or prints must agree
//! with what the sandbox billed.
//!
//! Every run passes `--state` inside the test's directory and `--retry-base-ms 10`; sandboxes
//! draw small images so that the chains stay fast. Where a fault pattern must be exact, the
//! run uses one call at a time and a seed chosen by replaying the sandbox's own dice.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use image::GenericImageView;
use imgpipe::sandbox::faults::Dice;
use imgpipe::sandbox::{self, Faults};
use serde_json::Value;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

use crate::binary::Imgpipe;
use crate::common::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Side of a 2K image in these tests: big enough for every tool, small enough to be quick.
const SIDE: u32 = 32;

/// erase 2 + upscale 2× 2 + remove_background 5 credits: one item of [`edit_chain`].
pub(crate) const CHAIN_CREDITS: u64 = 9;

pub(crate) fn config() -> sandbox::Config {
    sandbox::Config {
        image_side: SIDE,
        ..sandbox::Config::default()
    }
}

fn faults(seed: u64) -> Faults {
    Faults {
        seed,
        ..Faults::default()
    }
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Copies a committed sample pipeline (and its items file) into `dir`.
pub(crate) fn copy_sample(dir: &Path, name: &str) {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
    std::fs::copy(from.join(name), dir.join(name)).unwrap();
    if name == "edit-only.yaml" {
        std::fs::copy(
            from.join("sample-images.csv"),
            dir.join("sample-images.csv"),
        )
        .unwrap();
    }
}

const SAMPLES: [&str; 4] = ["mug", "lamp", "chair", "plant"];

/// An edit-only pipeline of `items` items, each erase → upscale 2× → remove_background
/// ([`CHAIN_CREDITS`] an item), with an optional budget line. Items share the four samples,
/// but each erase names its item, so that no two tasks make the same request (see
/// [`assert_no_request_billed_twice`]).
pub(crate) fn edit_chain(items: usize, budget: Option<u64>) -> String {
    let mut text = String::from("version: 1\nname: chain\noutput_dir: out\n");
    if let Some(b) = budget {
        text += &format!("budget: {{ max_credits: {b} }}\n");
    }
    text += "items:\n";
    for i in 0..items {
        let sample = SAMPLES[i % SAMPLES.len()];
        text += &format!(
            "  - {{ id: i{i:02}, url: \"https://sandbox.invalid/assets/{sample}.png\" }}\n"
        );
    }
    text += r#"steps:
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: "the corner of {{ item.id }}" }
  - id: big
    upscale: { from: clean, desired_increase: 2 }
  - id: cutout
    remove_background: { from: big }
"#;
    text
}

pub(crate) fn state_path(dir: &Path) -> PathBuf {
    dir.join("state.db")
}

/// Both streams, for messages that may go to either.
pub(crate) fn both(o: &Output) -> String {
    format!("{}\n{}", stdout(o), stderr(o))
}

/// Tasks by item, in task order.
fn by_item(db: &Db) -> BTreeMap<String, Vec<&TaskRow>> {
    let mut items: BTreeMap<String, Vec<&TaskRow>> = BTreeMap::new();
    for t in db.live() {
        items.entry(t.item.clone()).or_default().push(t);
    }
    items
}

pub(crate) fn manifest(run_dir: &Path) -> Vec<Value> {
    let path = run_dir.join("manifest.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

/// Every output of the database was downloaded, and the manifest, the database's outputs and
/// the files on disk name the same files with the same digests and sizes. Returns the
/// manifest's lines.
#[track_caller]
fn assert_outputs_agree(cwd: &Path, run_dir: &Path, db: &Db) -> Vec<Value> {
    let lines = manifest(run_dir);
    let failed: Vec<_> = db
        .outputs
        .iter()
        .filter(|o| o.path.is_none())
        .map(|o| (&o.job_id, &o.download_error))
        .collect();
    assert!(failed.is_empty(), "outputs not downloaded: {failed:#?}");
    assert_eq!(lines.len(), db.outputs.len(), "manifest {lines:#?}");
    let on_disk = files_under(run_dir);
    let mut expected: BTreeSet<String> = lines
        .iter()
        .map(|l| l["path"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(expected.len(), lines.len(), "two lines name one file");
    expected.insert("manifest.jsonl".into());
    assert_eq!(on_disk, expected, "files on disk against the manifest");
    let by_path: HashMap<PathBuf, &OutputRow> = db
        .outputs
        .iter()
        .map(|o| {
            let p = cwd.join(o.path.as_deref().unwrap());
            (p.canonicalize().unwrap(), o)
        })
        .collect();
    for line in &lines {
        let file = run_dir.join(line["path"].as_str().unwrap());
        let bytes = std::fs::read(&file).unwrap();
        let digest = sha256_hex(&bytes);
        assert_eq!(line["sha256"], digest.as_str(), "{line}");
        assert_eq!(line["bytes"], bytes.len(), "{line}");
        let row = by_path
            .get(&file.canonicalize().unwrap())
            .unwrap_or_else(|| panic!("no output row for {}", file.display()));
        assert_eq!(row.sha256.as_deref(), Some(digest.as_str()), "{row:?}");
        assert_eq!(row.bytes, Some(bytes.len() as i64), "{row:?}");
        assert_eq!(line["job_id"], row.job_id.as_str(), "{line}");
        let task = db.task(row.task_id);
        assert_eq!(line["item"], task.item.as_str(), "{line}");
        assert_eq!(line["step"], task.step.as_str(), "{line}");
        assert_eq!(line["credits"], task.billed, "{line}");
        assert!(decode(&file).width() > 0);
    }
    lines
}

/// The sandbox's ledger against the database: every bill whose answer named its job (whole,
/// or cut after the job id) is one succeeded attempt and one task with the same job and
/// credits, a cut one read back by its id; every other undelivered bill is one ambiguous
/// attempt; the balance moved by exactly the ledger's total.
#[track_caller]
fn assert_ledger_agrees(env: &Env, db: &Db, start_balance: i64) {
    let ledger = env.sandbox.ledger();
    let total: u64 = ledger.iter().map(|e| e.credits).sum();
    assert_eq!(
        start_balance - env.sandbox.balance(),
        total as i64,
        "balance against ledger {ledger:#?}"
    );
    let delivered: Vec<_> = ledger.iter().filter(|e| e.delivered || e.partial).collect();
    let undelivered: Vec<_> = ledger
        .iter()
        .filter(|e| !e.delivered && !e.partial)
        .collect();
    assert_eq!(
        db.billed(),
        delivered.iter().map(|e| e.credits).sum::<u64>(),
        "billed in the database against delivered bills"
    );
    assert_eq!(
        db.ambiguous().len(),
        undelivered.len(),
        "ambiguous attempts against undelivered bills {undelivered:#?}"
    );
    // An undelivered bill costs what its task was planned at (the prices are the plan's).
    let possibly: u64 = db
        .ambiguous()
        .iter()
        .map(|a| db.task(a.task_id).planned)
        .sum();
    assert_eq!(
        possibly,
        undelivered.iter().map(|e| e.credits).sum::<u64>(),
        "planned credits of ambiguous attempts against undelivered bills"
    );
    for entry in &delivered {
        let attempts: Vec<_> = db
            .attempts
            .iter()
            .filter(|a| a.job_id.as_deref() == Some(entry.job_id.as_str()))
            .collect();
        assert_eq!(attempts.len(), 1, "{entry:?} in attempts {attempts:#?}");
        assert_eq!(attempts[0].outcome.as_deref(), Some("succeeded"));
        assert_eq!(attempts[0].billed, entry.credits, "{entry:?}");
        let read_back = format!("recovered from GET /v1/jobs/{}", entry.job_id);
        assert_eq!(
            attempts[0]
                .error
                .as_deref()
                .is_some_and(|note| note.contains(&read_back)),
            entry.partial,
            "{entry:?}: {:?}",
            attempts[0]
        );
        let tasks: Vec<_> = db
            .tasks
            .iter()
            .filter(|t| t.job_id.as_deref() == Some(entry.job_id.as_str()))
            .collect();
        assert_eq!(tasks.len(), 1, "{entry:?} in tasks {tasks:#?}");
        assert_eq!(tasks[0].billed, entry.credits, "{entry:?}");
        assert_eq!(tasks[0].id, attempts[0].task_id);
    }
    let known: BTreeSet<&str> = ledger.iter().map(|e| e.job_id.as_str()).collect();
    for a in &db.attempts {
        if let Some(job) = &a.job_id {
            assert!(
                known.contains(job.as_str()),
                "{a:?} names a job never billed"
            );
        }
    }
}

/// Each item's chain is whole: all succeeded, or never touched (pending, no attempt), or
/// stopped by a failed task whose descendants are all blocked. No item may hold succeeded
/// tasks beside pending ones: that is money stranded in a half-finished chain.
#[track_caller]
fn assert_no_half_chains(db: &Db) {
    for (item, tasks) in by_item(db) {
        let statuses: Vec<&str> = tasks.iter().map(|t| t.status.as_str()).collect();
        let untouched = tasks
            .iter()
            .all(|t| t.status == "pending" && db.attempts_of(t.id).is_empty());
        let done = statuses.iter().all(|s| *s == "succeeded");
        let failed = statuses.contains(&"failed")
            && statuses
                .iter()
                .all(|s| matches!(*s, "succeeded" | "failed" | "blocked"));
        assert!(
            untouched || done || failed,
            "item {item} is half finished: {:?}",
            tasks
                .iter()
                .map(|t| (t.name(), t.status.as_str()))
                .collect::<Vec<_>>()
        );
    }
}

/// For a chain pipeline (one task per step per item, in step order), every task after a
/// failed one is blocked.
#[track_caller]
fn assert_descendants_blocked(db: &Db) {
    for (item, tasks) in by_item(db) {
        if let Some(first) = tasks.iter().position(|t| t.status == "failed") {
            for t in &tasks[first + 1..] {
                assert_eq!(t.status, "blocked", "{item}: {t:?}");
                assert!(db.attempts_of(t.id).is_empty(), "{t:?} was tried");
                let why = t.error.as_deref().unwrap_or_default();
                assert!(why.contains("failed"), "{t:?}");
            }
        }
    }
}

/// A seed whose first draws with probability `p` are exactly `pattern` (true: the fault
/// strikes). With one call at a time and only the drop fault on, the sandbox draws once per
/// billed call, in call order, so this fixes which calls are dropped.
pub(crate) fn seed_for(p: f64, pattern: &[bool]) -> u64 {
    (0..1_000_000u64)
        .find(|seed| {
            let dice = Dice::new(*seed);
            pattern.iter().all(|want| dice.chance(p) == *want)
        })
        .expect("a seed with this pattern")
}

// ---------------------------------------------------------------------------------------------
// 1. The full chain of the sample
// ---------------------------------------------------------------------------------------------

#[track_caller]
fn pixels_differing(a: &image::DynamicImage, b: &image::DynamicImage) -> usize {
    assert_eq!(a.dimensions(), b.dimensions());
    a.to_rgba8()
        .pixels()
        .zip(b.to_rgba8().pixels())
        .filter(|(x, y)| x != y)
        .count()
}

/// A cut-out at the end of the sample's chain: the backdrop is gone (the border is
/// transparent) and the subject kept. The shot's subject is a circle of a quarter of its side
/// in its middle; expand only widens the shot and upscale keeps it centred, so a square of
/// 0.3 × the height around the centre lies within the subject: at least 90% of it is opaque
/// (erase may blur a sliver of its edge).
#[track_caller]
fn assert_cut_out(img: &image::RgbaImage, what: &str) {
    let (w, h) = img.dimensions();
    let border = (0..w)
        .flat_map(|x| [(x, 0), (x, h - 1)])
        .chain((0..h).flat_map(|y| [(0, y), (w - 1, y)]));
    let shown = border
        .filter(|(x, y)| img.get_pixel(*x, *y)[3] != 0)
        .count();
    assert_eq!(shown, 0, "{what}: {shown} border pixels not transparent");
    let half = h * 15 / 100;
    let centre: Vec<u8> = (h / 2 - half..h / 2 + half)
        .flat_map(|y| (w / 2 - half..w / 2 + half).map(move |x| (x, y)))
        .map(|(x, y)| img.get_pixel(x, y)[3])
        .collect();
    let opaque = centre.iter().filter(|a| **a == 255).count();
    assert!(
        opaque * 10 >= centre.len() * 9,
        "{what}: {opaque} of {} pixels around the centre opaque",
        centre.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn product_shots_runs_the_whole_chain_and_every_record_agrees() {
    let env = start(sandbox::Config {
        image_side: 64,
        ..sandbox::Config::default()
    })
    .await;
    let dir = env.dir.path();
    copy_sample(dir, "product-shots.yaml");
    // The sample's 10/s would make this test take three seconds; the rate has its own test.
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "product-shots.yaml",
            "--json",
            "--run-id",
            "full",
            "--rate",
            "100/s",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    // 3 items × (shot 1 + 2 × (clean, wide, big, cutout)) = 27 tasks; per item 2 × 4 (two 2K
    // images) + 2 × (2 + 5 + 4 + 5) = 40 credits; 3 × 40 = 120. Outputs: 3 × (2 + 8) = 30.
    assert_eq!(summary["status"], "succeeded", "{summary:#}");
    assert_eq!(summary["tasks"], 27, "{summary:#}");
    assert_eq!(summary["succeeded"], 27, "{summary:#}");
    assert_eq!(summary["failed"], 0, "{summary:#}");
    assert_eq!(summary["planned_credits"], 120, "{summary:#}");
    assert_eq!(summary["billed_credits"], 120, "{summary:#}");
    assert_eq!(summary["ambiguous_attempts"], 0, "{summary:#}");
    assert_eq!(summary["outputs"], 30, "{summary:#}");
    assert_eq!(summary["downloaded"], 30, "{summary:#}");
    assert_eq!(summary["balance_before"], START_BALANCE, "{summary:#}");
    assert_eq!(summary["balance_after"], START_BALANCE - 120, "{summary:#}");
    assert_eq!(summary["failures"], serde_json::json!([]), "{summary:#}");
    // Free reads: the account to plan and to reconcile, the models to price the generation.
    // The pipeline and --rate give the limits, so the account is not read a third time.
    let stats = env.sandbox.stats();
    assert_eq!(
        stats.api_requests - stats.paid_requests,
        3,
        "free reads: {stats:?}"
    );

    let db = Db::read_file(&state_path(dir)).await;
    let runs: Vec<(&str, &str)> = db
        .runs
        .iter()
        .map(|r| (r.id.as_str(), r.status.as_str()))
        .collect();
    assert_eq!(runs, [("full", "succeeded")]);
    assert_eq!(db.count("succeeded"), 27);
    assert_eq!(db.attempts.len(), 27, "one attempt per task: no retries");
    assert_eq!(db.billed(), 120);
    assert_eq!(env.sandbox.ledger().len(), 27);
    assert_ledger_agrees(&env, &db, START_BALANCE);

    let run_dir = dir.join("out").join("full");
    let lines = assert_outputs_agree(dir, &run_dir, &db);
    let line = |item: &str, step: &str, index: u64| -> &Value {
        lines
            .iter()
            .find(|l| l["item"] == item && l["step"] == step && l["index"] == index)
            .unwrap_or_else(|| panic!("no {item}/{step}-{index} in the manifest"))
    };
    for item in ["mug", "lamp", "chair"] {
        let img = |step: &str, i: u64| {
            let path = run_dir.join(item).join(format!("{step}-{i}.png"));
            assert_eq!(
                line(item, step, i)["path"],
                format!("{item}/{step}-{i}.png")
            );
            decode(&path)
        };
        let shots = [img("shot", 0), img("shot", 1)];
        assert_ne!(shots[0], shots[1], "{item}: two different shots");
        let shot_job = &line(item, "shot", 0)["job_id"];
        assert_eq!(&line(item, "shot", 1)["job_id"], shot_job, "one call, n: 2");
        assert_eq!(line(item, "shot", 0)["credits"], 8);
        for i in 0..2u64 {
            // Lineage: each call read its own parent's output.
            assert_eq!(&line(item, "clean", i)["parent_job_id"], shot_job);
            for (step, parent) in [("wide", "clean"), ("big", "wide"), ("cutout", "big")] {
                assert_eq!(
                    line(item, step, i)["parent_job_id"],
                    line(item, parent, i)["job_id"],
                    "{item}/{step}-{i}"
                );
            }
            let shot = &shots[i as usize];
            let clean = img("clean", i);
            assert_eq!(shot.dimensions(), (64, 64), "2K is 64 px in this sandbox");
            assert_eq!(
                clean.dimensions(),
                shot.dimensions(),
                "erase keeps the size"
            );
            // clean-i was made from shot-i, not from the other shot: erase changes a region.
            let own = pixels_differing(&clean, shot);
            let other = pixels_differing(&clean, &shots[1 - i as usize]);
            assert!(own > 0 && own < other, "{item} clean-{i}: {own} vs {other}");
            let wide = img("wide", i);
            let (w, h) = wide.dimensions();
            assert!(w >= 64 && h >= 64, "expand contains its input: {w}x{h}");
            assert!(
                (i64::from(w) * 9 - i64::from(h) * 16).abs() < 16,
                "16:9: {w}x{h}"
            );
            let big = img("big", i);
            assert_eq!(big.dimensions(), (4 * w, 4 * h), "upscale 4×");
            let cutout = img("cutout", i);
            assert_eq!(cutout.dimensions(), big.dimensions());
            assert!(cutout.color().has_alpha(), "{:?}", cutout.color());
            assert_cut_out(&cutout.to_rgba8(), &format!("{item} cutout-{i}"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Refusals before anything is spent
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_max_credits_below_the_plan_is_refused_before_any_call() {
    let env = start(config()).await;
    let dir = env.dir.path();
    copy_sample(dir, "product-shots.yaml");
    let o = Imgpipe::on(&env, &["run", "product-shots.yaml", "--max-credits", "100"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let text = both(&o);
    assert!(
        has_phrase(&text, "the plan costs 120 credits, over the budget of 100 "),
        "{text}"
    );
    assert_nothing_billed(&env);
    assert_eq!(env.sandbox.stats().paid_requests, 0);
    assert!(!dir.join("out").exists(), "a refused run makes no output");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_balance_below_the_plan_is_refused_before_any_call() {
    let env = start(sandbox::Config {
        balance: 50,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    copy_sample(dir, "product-shots.yaml");
    let o = Imgpipe::on(&env, &["run", "product-shots.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let text = both(&o);
    assert!(
        has_phrase(
            &text,
            "the plan costs 120 credits, more than the balance of 50"
        ),
        "{text}"
    );
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.balance(), 50);
    assert_eq!(env.sandbox.stats().paid_requests, 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Tight budgets
// ---------------------------------------------------------------------------------------------

/// A seed whose first drop-after-billing draw strikes and the next `then` do as `p` says:
/// the very first call billed, whichever it is, is dropped and must be paid again.
fn seed_dropping_first_bill(p: f64, then: &[bool]) -> u64 {
    seed_for(p, &[&[true][..], then].concat())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_budget_that_a_retry_leaves_short_at_high_concurrency_is_spent_on_whole_chains_only() {
    // Forty items, sixteen calls in flight, the budget exactly the plan (360), so the plan
    // passes. The first call billed (an erase, 2 credits) is dropped after billing and paid
    // again: 358 is left for forty chains of 9. Thirty-nine fit whole, with 7 over; the
    // fortieth must not start, or it would strand money in a chain the budget cannot finish.
    let items = 40;
    let budget = items as u64 * CHAIN_CREDITS;
    let seed = seed_dropping_first_bill(0.01, &[false; 150]);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.01,
            ..faults(seed)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, Some(budget)));
    let args = [
        "p.yaml",
        "--json",
        "--concurrency",
        "16",
        "--retry-base-ms",
        "10",
    ];
    let o = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "stopped", "{summary:#}");
    let stopped = summary["stopped"].as_str().unwrap_or_default();
    assert!(
        stopped.contains("needs 9") && stopped.contains("leaves 7"),
        "{summary:#}"
    );
    assert_eq!(env.sandbox.stats().dropped_after_billing, 1);
    assert!(
        env.sandbox.stats().peak_in_flight > 4,
        "calls overlapped: {:?}",
        env.sandbox.stats()
    );
    let ledger: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert_eq!(ledger, budget - 7, "39 chains and the erase paid twice");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_no_half_chains(&db);
    let chains = by_item(&db);
    let done = chains
        .values()
        .filter(|tasks| tasks.iter().all(|t| t.status == "succeeded"))
        .count();
    assert_eq!(done, items - 1, "{summary:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn high_concurrency_with_ambiguous_retries_never_bills_past_a_tight_budget() {
    // The budget is exactly the plan, so every retry of a dropped (possibly billed) call must
    // come out of what later items would have used.
    let items = 30;
    let budget = items as u64 * CHAIN_CREDITS;
    // The first bill is dropped, so the retries make the plan too big before the last item
    // starts: the run must stop for budget. Two more drops follow among the next nine bills.
    let f = false;
    let seed = seed_dropping_first_bill(0.1, &[f, f, f, true, f, f, f, f, true]);
    let env = start(sandbox::Config {
        latency: Duration::from_millis(30),
        faults: Faults {
            drop_after_billing: 0.1,
            ..faults(seed)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, Some(budget)));
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--json",
            "--concurrency",
            "16",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    let ledger: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert!(ledger <= budget, "billed {ledger} of a budget of {budget}");
    assert!(
        env.sandbox.stats().peak_in_flight > 4,
        "calls overlapped: {:?}\n{}",
        env.sandbox.stats(),
        stderr(&o)
    );
    // The point of the test: calls were dropped after billing and tried again.
    let dropped = env.sandbox.stats().dropped_after_billing;
    assert!(dropped >= 3, "dropped calls: {:?}", env.sandbox.stats());
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_eq!(db.ambiguous().len() as u64, dropped);
    assert!(
        db.ambiguous()
            .iter()
            .any(|a| db.attempts_of(a.task_id).len() > 1),
        "a dropped call was tried again: {:#?}",
        db.attempts
    );
    assert!(
        db.attempts.iter().all(|a| a.outcome.is_some()),
        "nothing left in flight"
    );
    assert_no_half_chains(&db);
    // More to do than the budget pays for: a run stopped for budget, exit 3.
    assert_exit_without_panic(&o, 3);
    assert_eq!(json_stdout(&o)["status"], "stopped");
}

#[tokio::test(flavor = "multi_thread")]
async fn retries_that_use_up_the_budget_stop_before_the_next_item_starts() {
    // Three items, one at a time, the budget exactly the plan (27). The very first call (i00's
    // erase, 2 credits) is dropped after billing and retried, so i00 costs 11; i01 costs 9;
    // i02 then needs 9 where 27 - 20 = 7 is left: it must not start at all.
    let seed = seed_for(0.3, &[true, false, false, false, false, false, false]);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.3,
            ..faults(seed)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, Some(27)));
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--json",
            "--concurrency",
            "1",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 3);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "stopped", "{summary:#}");
    let stopped = summary["stopped"].as_str().unwrap();
    assert!(
        stopped.contains("needs 9") && stopped.contains("leaves 7"),
        "{stopped}"
    );
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.iter().filter(|e| !e.delivered).count(), 1);
    assert_eq!(ledger.iter().map(|e| e.credits).sum::<u64>(), 20);
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_no_half_chains(&db);
    let i02: Vec<_> = db.tasks.iter().filter(|t| t.item == "i02").collect();
    assert!(i02.iter().all(|t| t.status == "pending"), "{i02:#?}");
    assert_eq!(summary["succeeded"], 6, "{summary:#}");
    assert_eq!(summary["pending"], 3, "{summary:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ambiguous_call_given_up_for_budget_leaves_no_half_finished_item() {
    // Four items, one at a time, budget 36 = the plan. i00's cutout (5) is dropped and retried
    // (i00 costs 14), i01 costs 9; i02's cutout is dropped with 32 committed: a retry would
    // make 37, so it fails. 32 credits are now spent or possibly spent and 4 are left: i03
    // (9) must not start. imgpipe admits it anyway, pays its erase and upscale (4), then
    // cannot afford its cutout: 4 credits stranded in a half-finished chain.
    let f = false;
    let pattern = [f, f, true, f, f, f, f, f, f, true, f, f];
    let seed = seed_for(0.2, &pattern);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.2,
            ..faults(seed)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(4, Some(36)));
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--concurrency",
            "1",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_no_half_chains(&db);
    let ledger: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert_eq!(ledger, 32, "i03 must cost nothing");
    assert_exit_without_panic(&o, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn continuing_a_run_counts_its_possibly_billed_calls_against_the_budget() {
    // Four items, one at a time, budget 36 = the plan, --on-ambiguous fail. i00's cutout (5)
    // is dropped after billing: the sandbox billed 36, imgpipe knows of 31 and of one call
    // that may have cost 5. Continuing the run, the cutout would need 5 more where the budget
    // leaves 36 - 31 - 5 = 0: it must be refused, not paid for a second time.
    let f = false;
    let mut pattern = vec![f, f, true];
    pattern.extend([f; 10]);
    let seed = seed_for(0.2, &pattern);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.2,
            ..faults(seed)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(4, Some(36)));
    let args = [
        "p.yaml",
        "--run-id",
        "r",
        "--concurrency",
        "1",
        "--retry-base-ms",
        "10",
    ];
    let fail_mode = [&args[..], &["--on-ambiguous", "fail"][..]].concat();
    let first = Imgpipe::on(&env, &["run"])
        .args(&fail_mode)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&first, 4);
    assert_eq!(START_BALANCE - env.sandbox.balance(), 36);
    let second = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    let spent = START_BALANCE - env.sandbox.balance();
    assert!(
        spent <= 36,
        "the sandbox billed {spent} against a budget of 36"
    );
    assert_exit_without_panic(&second, 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_underpriced_plan_at_high_concurrency_never_bills_past_the_budget() {
    // The pipeline says a 2K image costs 3; the service bills 4. Sixteen items, sixteen calls
    // in flight: the plan (48) fits a budget of 48, and all sixteen are sent before the first
    // bill shows the price: 64 billed. The budget is a promise about money, so imgpipe must
    // not have more in flight than the budget covers at a price it has not seen billed.
    let env = start(sandbox::Config {
        latency: Duration::from_millis(100),
        ..config()
    })
    .await;
    let dir = env.dir.path();
    let mut text = String::from(
        "version: 1\nname: cheap\noutput_dir: out\nbudget: { max_credits: 48 }\npricing: { generation: 3 }\nitems:\n",
    );
    for i in 0..16 {
        text += &format!("  - {{ id: i{i:02} }}\n");
    }
    text += "steps:\n  - id: shot\n    generate: { prompt: \"A mug, take {{ item.id }}\" }\n";
    write(dir, "p.yaml", &text);
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--concurrency", "16"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let spent = START_BALANCE - env.sandbox.balance();
    assert!(
        spent <= 48,
        "the sandbox billed {spent} against a budget of 48"
    );
}

// ---------------------------------------------------------------------------------------------
// The balance running out during the run, and continuing after a top-up
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_balance_running_out_stops_the_run_and_a_top_up_finishes_it_without_paying_twice() {
    let items = 10;
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    let args = ["p.yaml", "--json", "--run-id", "r", "--concurrency", "8"];
    // Someone else spends the account down once six calls are billed, while the calls sent
    // after them are held in flight: those are then refused for lack of credits.
    let hold = env.sandbox.hold();
    let mut child = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .watched();
    step_until(&env, &mut child, |env| env.sandbox.ledger().len() >= 6).await;
    env.sandbox.set_balance(4);
    drop(hold);
    let o = child.finish().await;
    assert_exit_without_panic(&o, 3);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "stopped", "{summary:#}");
    assert!(
        summary["stopped"]
            .as_str()
            .unwrap()
            .starts_with("the service refused a call for lack of credits"),
        "a balance stop, not a budget stop: {summary:#}"
    );
    assert!(env.sandbox.stats().insufficient_credits > 0);
    let billed_first = env.sandbox.ledger().len();
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.count("running"), 0, "no task left in flight");
    assert!(db.count("pending") > 0, "{db:#?}");
    assert_eq!(db.count("failed"), 0, "402 is not a task's failure");
    let paid_first = db.billed();

    env.sandbox.set_balance(1000);
    let o = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 3 * items, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert!(ledger.len() > billed_first);
    // Every task paid exactly once over both runs.
    assert_eq!(ledger.len(), 3 * items);
    assert_no_request_billed_twice(&env);
    let db = Db::read_file(&state_path(dir)).await;
    assert!(db.billed() > paid_first);
    assert_eq!(db.billed(), items as u64 * CHAIN_CREDITS);
    assert_eq!(
        ledger.iter().map(|e| e.credits).sum::<u64>(),
        items as u64 * CHAIN_CREDITS
    );
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
}

// ---------------------------------------------------------------------------------------------
// 4. The service's rate limit below imgpipe's
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_service_rate_limit_below_imgpipes_slows_it_down_without_losing_anything() {
    // 10 items × 3 steps = 30 paid calls; the sandbox takes 20 requests a second, imgpipe is
    // told 100. Whether imgpipe reaches 20 a second depends on the machine, so the service's
    // first 429 is not left to it: the call after the first one (held at the gate meanwhile)
    // is refused with a 429 whatever the machine's speed, and any others come from the limit.
    let items = 10;
    let env = start(sandbox::Config {
        rate_limit: Some(20.0),
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    let hold = env.sandbox.hold();
    let args = [
        "p.yaml",
        "--json",
        "--run-id",
        "r",
        "--rate",
        "100/s",
        "--concurrency",
        "8",
    ];
    let mut child = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .watched();
    wait_while_running(&mut child, "the first call held at the gate", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    env.sandbox.rate_limit_next(Duration::from_secs(1));
    drop(hold);
    let o = child.finish().await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert!(stats.rate_limited > 0, "the limit was met: {stats:?}");
    assert!(stats.rate_limited < 10, "imgpipe slowed down: {stats:?}");
    // It paused for the first 429's Retry-After (1 s): within that second only the calls
    // already past its limiter when the 429 came back (at most the other 7 of the
    // concurrency) reached the sandbox. Counted on the sandbox's clock; a slow machine only
    // sends fewer.
    let first_429 = env.sandbox.rate_limits()[0];
    let ledger = env.sandbox.ledger();
    let during_pause = ledger
        .iter()
        .filter(|e| e.received_us > first_429 && e.received_us < first_429 + 1_000_000)
        .count();
    assert!(
        during_pause <= 7,
        "{during_pause} calls reached the sandbox within the second after the first 429"
    );
    assert_eq!(ledger.len(), 3 * items);
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    let lines = assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
    assert_eq!(lines.len(), 3 * items);
    let answered_429 = db
        .attempts
        .iter()
        .filter(|a| a.http_status == Some(429))
        .count() as u64;
    assert!(answered_429 <= stats.rate_limited);
}

/// Burst of imgpipe's paid-call limiter (`governor_for` in `src/exec/limiter.rs`): at a rate
/// of 2/s or more, two calls may pass at once, so that a call woken late is made up for.
const LIMITER_BURST: usize = 2;

/// Runs `items` edit chains (3 paid calls each) at `RATE` per second, told by `--rate` or by
/// the pipeline's `rate_limit`, against a sandbox that refuses more than 1.5 times that, and
/// checks the pace from the times the sandbox received the calls.
///
/// What is guaranteed however loaded the machine: a call passes the limiter, then writes its
/// intent and is sent; load can only delay the sending. At most `CONCURRENCY` calls are on
/// their way at once (each holds a slot from before it waits for the limiter), so any window of
/// `L` seconds at the sandbox holds at most `RATE × L + LIMITER_BURST` calls let through in it
/// plus `CONCURRENCY` let through before it. Hence: no one-second window holds more than
/// `RATE + LIMITER_BURST + CONCURRENCY` calls, `N` calls span at least
/// `(N - LIMITER_BURST - CONCURRENCY) / RATE` seconds, and since the sandbox lets through a
/// second's worth at once (`1.5 × RATE`, more than `LIMITER_BURST + CONCURRENCY`), no call is
/// refused with a 429. Without the limiter the run would take a fraction of a second.
async fn assert_paced(flag: bool) {
    const RATE: usize = 10;
    const CONCURRENCY: usize = 4;
    let items = 14;
    let env = start(sandbox::Config {
        rate_limit: Some(RATE as f64 * 1.5),
        rate_scope: sandbox::RateScope::Paid,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    let mut text = edit_chain(items, None);
    let rate = format!("{RATE}/s");
    let concurrency = CONCURRENCY.to_string();
    let mut args = vec!["p.yaml", "--json", "--concurrency", &concurrency];
    if flag {
        args.extend_from_slice(&["--rate", &rate]);
    } else {
        text = text.replacen(
            "output_dir: out\n",
            &format!("output_dir: out\nrate_limit: {rate}\n"),
            1,
        );
    }
    write(dir, "p.yaml", &text);
    let o = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert_eq!(stats.rate_limited, 0, "no 429: {stats:?}");
    let mut times: Vec<u64> = env.sandbox.ledger().iter().map(|e| e.received_us).collect();
    let n = times.len();
    assert_eq!(n, 3 * items);
    assert_eq!(
        stats.paid_requests, n as u64,
        "every paid call was billed: {stats:?}"
    );
    times.sort_unstable();
    let ceiling = RATE + LIMITER_BURST + CONCURRENCY;
    for (i, start) in times.iter().enumerate() {
        let within = times[i..]
            .iter()
            .take_while(|t| **t < start + 1_000_000)
            .count();
        assert!(
            within <= ceiling,
            "{within} calls in the second from {start} µs, more than {ceiling}: {times:?}"
        );
    }
    // A little slack for the sandbox's clock against the limiter's.
    let floor_us = (n - LIMITER_BURST - CONCURRENCY) as u64 * 1_000_000 / RATE as u64 - 20_000;
    let span = times[n - 1] - times[0];
    assert!(
        span >= floor_us,
        "{n} calls in {span} µs, less than {floor_us}: {times:?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_flag_paces_every_paid_call_under_the_rate() {
    assert_paced(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pipelines_rate_limit_paces_every_paid_call_under_the_rate() {
    assert_paced(false).await;
}

// ---------------------------------------------------------------------------------------------
// 5. Result URLs that expire between steps
// ---------------------------------------------------------------------------------------------

/// One item: a generation of two images, each erased, one call at a time. The second erase
/// reads a URL issued before the first erase was billed.
const TWO_ERASES: &str = r#"
version: 1
name: slow
output_dir: out
pricing: { generation: 4 }
items:
  - { id: mug, subject: a mug }
steps:
  - id: shot
    generate: { prompt: "Photo of {{ item.subject }}", n: 2 }
  - id: clean
    erase: { from: shot, object_name: the handle }
"#;

/// Runs [`TWO_ERASES`] with `args`, the sandbox held: the shot is let through, then, with the
/// first erase waiting at the gate (its input already read), `meanwhile` runs and every URL
/// issued so far is expired, before everything is let go. The second erase is sent after
/// that, reading a URL the service now refuses, whatever the machine's speed.
async fn urls_expired_between_the_erases(
    env: &Env,
    args: &[&str],
    meanwhile: impl Future<Output = ()>,
) -> Output {
    let dir = env.dir.path();
    write(dir, "p.yaml", TWO_ERASES);
    let all = [&["p.yaml", "--run-id", "r", "--concurrency", "1"][..], args].concat();
    env.sandbox.hold_calls();
    let mut cmd = Imgpipe::on(env, &["run"])
        .args(&all)
        .sqlite_in(dir)
        .command();
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().expect("imgpipe starts");
    wait_until("the shot waiting at the gate", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    env.sandbox.let_through(1);
    wait_until(
        "the first erase waiting at the gate, the shot billed",
        || env.sandbox.held_calls() == 1 && env.sandbox.ledger().len() == 1,
    )
    .await;
    // The shot's two images stored too: a download refused for an expired URL would make
    // imgpipe fetch fresh URLs from the job, and the second erase would never send an expired
    // one (seen once on a loaded machine).
    wait_until_async("the shot's two images stored", || async {
        let db = Db::read_file(&state_path(dir)).await;
        db.outputs.iter().filter(|o| o.path.is_some()).count() == 2
    })
    .await;
    meanwhile.await;
    env.sandbox.expire_urls();
    env.sandbox.release_calls();
    finish_child(child, "the run of two erases").await
}

#[tokio::test(flavor = "multi_thread")]
async fn urls_near_expiry_are_refreshed_before_a_call_reads_them_and_nothing_is_billed_twice() {
    // imgpipe is told URLs live 2 s and are refreshed within 1.5 s of expiry: once half a
    // second has passed since the shot's URLs were issued (the test waits that long, a lower
    // bound), the second erase's input is near expiry and must be fetched anew first; the
    // sandbox has expired the old URL, so sending it would be refused.
    let env = start(config()).await;
    let dir = env.dir.path();
    let ttl = ["--url-ttl", "2", "--url-margin", "1.5"];
    // Lazy: the half second counts from when the first erase is seen held.
    let past_the_margin = async { tokio::time::sleep(Duration::from_millis(600)).await };
    let o = urls_expired_between_the_erases(&env, &ttl, past_the_margin).await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert_eq!(stats.invalid, 0, "no expired URL was sent: {stats:?}");
    assert_eq!(env.sandbox.ledger().len(), 3, "shot, clean-0, clean-1");
    assert_no_request_billed_twice(&env);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.attempts.len(), 3);
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
    // The shot's URLs were fetched again from GET /v1/jobs after the call returned them.
    let shot = db.tasks.iter().find(|t| t.step == "shot").unwrap();
    let answered = db.attempts_of(shot.id)[0].finished_at.unwrap();
    let refreshed = db
        .outputs
        .iter()
        .filter(|o| o.task_id == shot.id && o.url_issued_at > answered)
        .count();
    assert!(refreshed > 0, "{:#?}", db.outputs);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_url_refused_by_the_service_is_refreshed_and_the_call_made_once_more() {
    // imgpipe believes the spec's hour; the sandbox expires its URLs while the first erase is
    // held. The second erase is refused (400, not billed), and imgpipe fetches fresh URLs
    // from the job and calls again: billed once.
    let env = start(config()).await;
    let dir = env.dir.path();
    let o = urls_expired_between_the_erases(&env, &[], async {}).await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert!(
        stats.invalid >= 1,
        "an expired URL reached the sandbox: {stats:?}"
    );
    assert_eq!(env.sandbox.ledger().len(), 3, "shot, clean-0, clean-1");
    assert_no_request_billed_twice(&env);
    let db = Db::read_file(&state_path(dir)).await;
    let refused: Vec<_> = db
        .attempts
        .iter()
        .filter(|a| a.outcome.as_deref() == Some("answered_error"))
        .collect();
    assert_eq!(refused.len(), 1, "{:#?}", db.attempts);
    assert_eq!(refused[0].http_status, Some(400), "{:#?}", db.attempts);
    let clean = db.task(refused[0].task_id);
    assert_eq!(
        (clean.step.as_str(), clean.status.as_str()),
        ("clean", "succeeded")
    );
    assert_eq!(
        db.attempts_of(clean.id).len(),
        2,
        "refused, then made once more"
    );
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
}

/// Calls that outpace downloads wait for them: outputs never pile up undownloaded, their URLs
/// ageing, however fast the service answers.
#[tokio::test(flavor = "multi_thread")]
async fn calls_wait_for_downloads_that_fall_behind() {
    let env = start(sandbox::Config {
        download_latency: Duration::from_millis(20),
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(40, None));
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--json",
            "--concurrency",
            "16",
            "--download-concurrency",
            "2",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 120, "{summary:#}");
    assert_eq!(summary["downloaded"], 120, "{summary:#}");
    // At most 4 downloads waiting per download slot (8), plus what the 16 calls in flight
    // when the bound was reached bring; without the bound, about 100 wait at once.
    let peak = env.sandbox.stats().peak_undownloaded;
    assert!(
        peak <= 2 * 4 + 16,
        "{peak} outputs waited for their download at once"
    );
    assert!(peak >= 2, "the downloads did fall behind ({peak})");
}

// ---------------------------------------------------------------------------------------------
// 6. Every injected fault at once
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn under_every_fault_everything_arrives_and_possibly_billed_calls_are_counted_exactly() {
    let env = start(sandbox::Config {
        faults: Faults {
            server_error: 0.15,
            rate_limit: 0.03,
            drop_after_billing: 0.1,
            gateway_timeout: 0.08,
            partial_answer: 0.1,
            truncate_download: 0.08,
            seed: 42,
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    copy_sample(dir, "product-shots.yaml");
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "product-shots.yaml",
            "--json",
            "--run-id",
            "r",
            "--rate",
            "100/s",
            "--on-ambiguous",
            "retry",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    let struck = stats.server_errors
        + stats.rate_limited
        + stats.dropped_after_billing
        + stats.gateway_timeouts
        + stats.partial_answers
        + stats.truncated_downloads;
    assert!(struck >= 5, "faults struck: {stats:?}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.count("succeeded"), 27);
    assert_ledger_agrees(&env, &db, START_BALANCE);
    let undelivered = env
        .sandbox
        .ledger()
        .iter()
        .filter(|e| !e.delivered && !e.partial)
        .count();
    assert_eq!(
        undelivered as u64,
        stats.dropped_after_billing + stats.gateway_timeouts
    );
    let summary = json_stdout(&o);
    assert_eq!(summary["ambiguous_attempts"], undelivered, "{summary:#}");
    assert_eq!(summary["billed_credits"], db.billed(), "{summary:#}");
    let lines = assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
    assert_eq!(lines.len(), 30);
}

/// Half the answers are cut after their start named the job: each such task reads its job
/// back with `GET /v1/jobs/{id}` for free, every task is billed exactly once, and every output
/// arrives.
#[tokio::test(flavor = "multi_thread")]
async fn answers_cut_after_naming_their_job_are_read_back_and_never_paid_for_twice() {
    let items = 12;
    let planned = items as u64 * CHAIN_CREDITS;
    let env = start(sandbox::Config {
        latency: Duration::from_millis(5),
        faults: Faults {
            partial_answer: 0.5,
            ..faults(11)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--json",
            "--run-id",
            "cut",
            "--concurrency",
            "8",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    let ledger = env.sandbox.ledger();
    let cut = ledger.iter().filter(|e| e.partial).count();
    assert!(cut >= 6, "answers cut: {stats:?}");
    assert_eq!(cut as u64, stats.partial_answers);
    assert!(
        ledger.iter().all(|e| e.delivered != e.partial),
        "{ledger:#?}"
    );
    // One bill per task, whether its answer came whole or was read back.
    assert_eq!(ledger.len(), 3 * items, "{ledger:#?}");
    assert_eq!(ledger.iter().map(|e| e.credits).sum::<u64>(), planned);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 3 * items, "{summary:#}");
    assert_eq!(summary["planned_credits"], planned, "{summary:#}");
    assert_eq!(summary["billed_credits"], planned, "{summary:#}");
    assert_eq!(summary["ambiguous_attempts"], 0, "{summary:#}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.attempts.len(), 3 * items, "one attempt per task");
    // Each cut answer's attempt says it was read back by its job id.
    assert_ledger_agrees(&env, &db, START_BALANCE);
    let lines = assert_outputs_agree(dir, &dir.join("out").join("cut"), &db);
    assert_eq!(lines.len(), 3 * items);
}

// ---------------------------------------------------------------------------------------------
// 7. Dry runs, saved plans and discovered prices
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_prints_the_plan_and_spends_nothing() {
    let env = start(config()).await;
    let dir = env.dir.path();
    copy_sample(dir, "product-shots.yaml");
    let o = Imgpipe::on(&env, &["run", "product-shots.yaml", "--dry-run"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("total    120 credits"), "{text}");
    let o = Imgpipe::on(&env, &["run", "product-shots.yaml", "--dry-run", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["costs"]["total_credits"], 120, "{doc:#}");
    assert_eq!(doc["verdict"]["fits"], true, "{doc:#}");
    assert_nothing_billed(&env);
    assert_eq!(env.sandbox.stats().paid_requests, 0);
    assert!(!dir.join("out").exists());
    assert!(!state_path(dir).exists(), "a dry run records no run");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_saved_plan_runs_as_saved() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, Some(50)));
    assert_exit(
        &Imgpipe::on(&env, &["plan", "p.yaml", "--save", "plan.json"])
            .run()
            .await,
        0,
    );
    let o = Imgpipe::on(
        &env,
        &["run", "--plan", "plan.json", "--run-id", "r", "--json"],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["billed_credits"], 2 * CHAIN_CREDITS, "{summary:#}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pipeline_changed_after_its_plan_was_saved_is_refused() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, Some(50)));
    assert_exit(
        &Imgpipe::on(&env, &["plan", "p.yaml", "--save", "plan.json"])
            .run()
            .await,
        0,
    );
    // One more item: the file and the items both changed.
    write(dir, "p.yaml", &edit_chain(3, Some(50)));
    let o = Imgpipe::on(&env, &["run", "--plan", "plan.json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let text = both(&o);
    assert!(text.contains("pipeline file p.yaml changed"), "{text}");
    assert!(has_phrase(&text, "2 then, 3 now"), "{text}");
    assert_nothing_billed(&env);
    // The same with the file named as well.
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--plan", "plan.json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    assert_nothing_billed(&env);
}

/// product-shots without its `pricing:` line.
fn unpriced(dir: &Path) {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/product-shots.yaml"),
    )
    .unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.starts_with("pricing:"))
        .map(|l| format!("{l}\n"))
        .collect();
    write(dir, "p.yaml", &text);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_generation_price_is_refused_with_a_hint_to_discover_it() {
    let env = start(sandbox::Config {
        generation_price: 6,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    unpriced(dir);
    let o = Imgpipe::on(&env, &["run", "p.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        err.contains("hint:") && err.contains("--discover-price"),
        "{err}"
    );
    assert_nothing_billed(&env);
}

/// `run p.yaml --discover-price --json --run-id r` on [`unpriced`] product-shots against a
/// sandbox billing 6 credits a 2K image.
async fn discover(env: &Env) -> Output {
    let dir = env.dir.path();
    unpriced(dir);
    Imgpipe::on(
        env,
        &[
            "run",
            "p.yaml",
            "--discover-price",
            "--json",
            "--run-id",
            "r",
            "--rate",
            "100/s",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await
    .output
}

#[tokio::test(flavor = "multi_thread")]
async fn discover_price_learns_it_from_one_generation_and_bills_the_rest_correctly() {
    let env = start(sandbox::Config {
        generation_price: 6,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    let o = discover(&env).await;
    assert_exit_without_panic(&o, 0);
    // Per item: two 2K images at 6 = 12, plus 2 × (2 + 5 + 4 + 5) = 32; 3 × 44 = 132.
    let summary = json_stdout(&o);
    assert_eq!(summary["billed_credits"], 132, "{summary:#}");
    assert_eq!(summary["succeeded"], 27, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(
        ledger.len(),
        27,
        "the discovering generation is not paid twice"
    );
    assert_eq!(START_BALANCE - env.sandbox.balance(), 132);
    let db = Db::read_file(&state_path(dir)).await;
    let shots: Vec<_> = db.tasks.iter().filter(|t| t.step == "shot").collect();
    assert!(shots.iter().all(|t| t.billed == 12), "{shots:#?}");
    // The generations after the discovery were planned at the discovered price.
    let repriced = shots.iter().filter(|t| t.planned == 12).count();
    assert!(repriced >= 2, "{shots:#?}");
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
}

/// `--discover-price` checks the whole plan again at the price it learned before anything
/// else is spent: a plan that no longer fits the budget is refused (exit 3) having paid only
/// for the one generation that told the price.
#[tokio::test(flavor = "multi_thread")]
async fn a_discovered_price_over_the_budget_is_refused_after_the_one_generation() {
    let env = start(sandbox::Config {
        generation_price: 6,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    unpriced(dir);
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--discover-price",
            "--run-id",
            "r",
            "--max-credits",
            "100",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 3);
    let ledger = env.sandbox.ledger();
    assert_eq!(
        ledger.len(),
        1,
        "only the discovering generation: {ledger:#?}"
    );
    assert_eq!(ledger[0].operation, "generate");
    assert_eq!(START_BALANCE - env.sandbox.balance(), 12);
    let said = stderr(&o);
    assert!(
        said.contains("132") && said.contains("100"),
        "the new total against the budget: {said}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn discover_price_plans_the_discovering_generation_too() {
    let env = start(sandbox::Config {
        generation_price: 6,
        ..config()
    })
    .await;
    let o = discover(&env).await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["planned_credits"], 132, "{summary:#}");
    let db = Db::read_file(&state_path(env.dir.path())).await;
    for t in db.tasks.iter().filter(|t| t.step == "shot") {
        assert_eq!(t.planned, 12, "{t:?}");
    }
    // The run's own plan is the discovered one: tasks not recorded yet are counted from it.
    assert_eq!(
        crate::common::rows_in(
            &state_path(env.dir.path()),
            "runs WHERE credits_planned = 132"
        )
        .await,
        1
    );
}

// ---------------------------------------------------------------------------------------------
// 8. --on-ambiguous fail
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn on_ambiguous_fail_fails_the_dropped_tasks_blocks_their_chains_and_finishes_the_rest() {
    let items = 8;
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.2,
            ..faults(11)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    // One call at a time: the dice fall in the same order on every run.
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r",
            "--concurrency",
            "1",
            "--on-ambiguous",
            "fail",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 4);
    let db = Db::read_file(&state_path(dir)).await;
    let failed: Vec<_> = db.tasks.iter().filter(|t| t.status == "failed").collect();
    assert!(!failed.is_empty(), "seed 11 drops some calls");
    assert!(db.count("succeeded") > 0);
    let text = stdout(&o);
    for t in &failed {
        assert_eq!(db.attempts_of(t.id).len(), 1, "not tried again: {t:?}");
        assert!(
            text.contains(&format!("failed    {}: ", t.name())),
            "{text}"
        );
        let why = t.error.as_deref().unwrap();
        assert!(why.contains("--on-ambiguous fail"), "{why}");
    }
    assert_descendants_blocked(&db);
    assert_no_half_chains(&db);
    assert_eq!(db.count("pending") + db.count("running"), 0);
    let undelivered = env.sandbox.ledger().iter().filter(|e| !e.delivered).count();
    assert_eq!(undelivered, failed.len());
    assert_ledger_agrees(&env, &db, START_BALANCE);
    assert_outputs_agree(dir, &dir.join("out").join("r"), &db);
    assert!(
        text.contains(&format!(
            "{} attempt(s) possibly billed without a result",
            failed.len()
        )),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. A finished run, run again
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn running_a_finished_run_again_prints_its_summary_and_spends_nothing() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let args = ["p.yaml", "--run-id", "again"];
    let first = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&first, 0);
    let paid = env.sandbox.stats().paid_requests;
    let balance = env.sandbox.balance();
    let manifest_before = std::fs::read(dir.join("out/again/manifest.jsonl")).unwrap();

    let second = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&second, 0);
    assert_eq!(stdout(&second), stdout(&first), "the same summary");
    assert!(stdout(&second).starts_with("run again: succeeded"));
    assert_eq!(env.sandbox.stats().paid_requests, paid, "no paid call");
    assert_eq!(env.sandbox.balance(), balance);
    assert_eq!(env.sandbox.ledger().len(), 9);
    assert_eq!(
        std::fs::read(dir.join("out/again/manifest.jsonl")).unwrap(),
        manifest_before
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.attempts.len(), 9);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_run_is_summarised_even_when_the_balance_no_longer_covers_its_plan() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let args = ["p.yaml", "--run-id", "paid"];
    let first = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&first, 0);
    env.sandbox.set_balance(1);
    let second = Imgpipe::on(&env, &["run"])
        .args(&args)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&second, 0);
    assert!(
        stdout(&second).starts_with("run paid: succeeded"),
        "{}",
        stdout(&second)
    );
    assert_eq!(env.sandbox.ledger().len(), 9, "nothing paid again");
}

// ---------------------------------------------------------------------------------------------
// 10. The key stays secret
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_appears_in_no_output_file_database_or_stream() {
    let env = start(sandbox::Config {
        faults: Faults {
            server_error: 0.2,
            drop_after_billing: 0.2,
            gateway_timeout: 0.1,
            truncate_download: 0.1,
            ..faults(5)
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(4, None));
    // Maximum logging, and failures whose messages end up in the database.
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "-vv",
            "--run-id",
            "r",
            "--on-ambiguous",
            "fail",
            "--retry-base-ms",
            "10",
        ],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert!(matches!(o.status.code(), Some(0 | 4)), "{}", both(&o));
    let key = env.sandbox.key().as_bytes();
    let contains = |hay: &[u8]| hay.windows(key.len()).any(|w| w == key);
    assert!(!contains(&o.stdout), "the key is on stdout");
    assert!(!contains(&o.stderr), "the key is on stderr");
    let files = files_under(dir);
    assert!(files.contains("state.db") && files.contains("out/r/manifest.jsonl"));
    for f in &files {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        assert!(!contains(&bytes), "the key is in {f}");
    }
    let db = Db::read_file(&state_path(dir)).await;
    assert!(!db.attempts.is_empty());
}

// ---------------------------------------------------------------------------------------------
// The run lock
// ---------------------------------------------------------------------------------------------

/// Holds `env`'s sandbox and starts `imgpipe run ARGS` in `dir`; returns once its first paid
/// call waits at the hold, so it holds the run lock (taken before any call) for as long as the
/// hold is kept.
async fn started_and_held(
    env: &Env,
    dir: &Path,
    args: &[&str],
) -> (sandbox::Hold, tokio::task::JoinHandle<Output>) {
    let hold = env.sandbox.hold();
    let run = tokio::spawn(finish(
        Imgpipe::on(env, &["run"])
            .args(args)
            .cwd(dir)
            .sqlite_in(dir)
            .command(),
    ));
    wait_until("the first run's call held mid-flight", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    (hold, run)
}

/// A second run of the pipeline while the first is held mid-call: refused with exit 5 naming
/// the first; with `--wait`, seen waiting for it, and paying only once the first has finished.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_run_of_a_pipeline_exits_5_naming_the_first_or_waits_its_turn() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let (hold, first) = started_and_held(&env, dir, &["p.yaml", "--run-id", "first"]).await;

    let refused = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "second"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&refused, 5);
    let text = stderr(&refused);
    assert!(text.contains("run first by pid"), "{text}");
    assert!(text.contains("--wait"), "{text}");

    let mut waiting = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "second", "--wait"])
        .sqlite_in(dir)
        .watched();
    waiting.wait_for_line("waiting for run first by pid").await;
    assert!(env.sandbox.ledger().is_empty(), "nothing billed while held");
    drop(hold);
    let waited = waiting.finish().await;
    assert_exit_without_panic(&waited, 0);
    let first = first.await.unwrap();
    assert_exit_without_panic(&first, 0);
    assert_eq!(
        env.sandbox.ledger().len(),
        18,
        "each run paid once for its 9 calls"
    );

    let db = Db::read_file(&state_path(dir)).await;
    let first_done = db
        .attempts
        .iter()
        .filter(|a| a.run_id == "first")
        .filter_map(|a| a.finished_at)
        .max()
        .unwrap();
    let second_began = db
        .attempts
        .iter()
        .filter(|a| a.run_id == "second")
        .map(|a| a.started_at)
        .min()
        .unwrap();
    assert!(
        second_began >= first_done,
        "the waiting run called before the first finished"
    );
}

/// A run killed (SIGKILL) while it holds the lock, mid-call: the lock goes with the process,
/// and the next run is not blocked by it.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_left_by_a_killed_run_does_not_block_the_next() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let hold = env.sandbox.hold();
    let mut child = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "killed"])
        .sqlite_in(dir)
        .command()
        .spawn()
        .unwrap();
    wait_until("the run's call held mid-flight", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    kill_child(&mut child, "the first run").await;
    drop(hold);
    let next = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "next"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&next, 0);
}

/// A second process given the same run id with `--wait` waits for the first (seen waiting
/// while the first is held mid-call), then finds the run finished: it says so and pays
/// nothing, rather than "resuming" it.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_for_a_run_that_then_finishes_says_it_is_finished_and_pays_nothing() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let (hold, first) = started_and_held(&env, dir, &["p.yaml", "--run-id", "same"]).await;
    let mut waiting = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "same", "--wait"])
        .sqlite_in(dir)
        .watched();
    waiting.wait_for_line("waiting for run same by pid").await;
    drop(hold);
    let waited = waiting.finish().await;
    assert_exit_without_panic(&waited, 0);
    let first = first.await.unwrap();
    assert_exit_without_panic(&first, 0);
    let text = stderr(&waited);
    assert!(text.contains("run same is already finished"), "{text}");
    assert!(!text.contains("resuming run"), "{text}");
    assert!(!text.contains("started:"), "{text}");
    assert!(
        stdout(&waited).contains("run same: succeeded"),
        "{}",
        stdout(&waited)
    );
    assert_eq!(env.sandbox.ledger().len(), 9, "the run was paid for once");
}

/// The command printed after Ctrl-C works as pasted: it carries the key file, the service's
/// address and the state database that were given as flags, with no environment to help.
#[tokio::test(flavor = "multi_thread")]
async fn the_continue_command_printed_after_an_interruption_works_when_pasted() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    write(dir, "key", env.sandbox.key());
    let base = env.sandbox.base_url().to_string();
    let flags = [
        "--run-id",
        "night2",
        "--api-key-file",
        "key",
        "--base-url",
        base.as_str(),
        "--state",
        "my state.db",
        "--concurrency",
        "1",
    ];
    let mut args = vec!["run", "p.yaml"];
    args.extend_from_slice(&flags);
    // Interrupted once two calls are billed, with the third held in flight.
    let interrupted =
        crate::resume::interrupt_when(&env, Imgpipe::new(&args).cwd(dir).command(), |env| {
            env.sandbox.ledger().len() >= 2
        })
        .await;
    assert_exit_without_panic(&interrupted, 130);
    let printed = printed_continue_command(&interrupted);
    assert!(
        printed.starts_with("imgpipe run p.yaml --run-id night2"),
        "{printed}"
    );
    assert!(printed.contains("'my state.db'"), "{printed}");
    let billed_before = env.sandbox.ledger().len();
    assert!(billed_before < 9, "the run was interrupted before its end");
    // Pasted into a shell, with no IMGPIPE_* in the environment.
    let pasted = Imgpipe::pasted(&printed).cwd(dir).run().await.output;
    assert_exit_without_panic(&pasted, 0);
    assert!(
        stdout(&pasted).contains("run night2: succeeded"),
        "{}",
        stdout(&pasted)
    );
    assert!(dir.join("my state.db").exists());
    // The call in flight at the interruption was let finish and recorded: each of the nine
    // tasks was paid for exactly once.
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 9, "{ledger:#?}");
    assert!(ledger.iter().all(|e| e.delivered), "{ledger:#?}");
}

/// `runs` where there is no database says where it looked and how to look elsewhere,
/// `--sandbox` included (the README's first command records its run in sandbox.db).
#[tokio::test]
async fn runs_without_a_database_says_where_to_look() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let o = Imgpipe::new(&["runs"])
        .cwd(dir.path())
        .env("HOME", &home)
        .env_remove("XDG_STATE_HOME")
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains("no runs yet: there is no state database at"),
        "{text}"
    );
    assert!(text.contains("state.db"), "{text}");
    assert!(text.contains("add --sandbox"), "{text}");
    assert!(!home.exists(), "looking created nothing");
}

/// Whether the run's first two calls overlapped: the second was sent before the first
/// answered. A step whose price is only the file's word sends one call first.
async fn first_calls_overlap(dir: &Path, run_id: &str) -> bool {
    let mut conn = SqliteConnectOptions::new()
        .filename(state_path(dir))
        .read_only(true)
        .connect()
        .await
        .unwrap();
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT started_at, finished_at FROM attempts WHERE run_id = ? ORDER BY started_at LIMIT 2",
    )
    .bind(run_id)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    rows[1].0 < rows[0].1
}

const FOUR_GENERATIONS: &str = r#"
version: 1
name: gens
pricing: { generation: 4 }
items: [{ id: a }, { id: b }, { id: c }, { id: d }]
steps:
  - id: shot
    generate: { prompt: "a {{ item.id }}" }
"#;

/// The price test costs one lone call only while the price is the file's word: not when the
/// service states it, nor once a call of the same kind was billed that price before.
#[tokio::test(flavor = "multi_thread")]
async fn a_price_the_service_states_or_billed_before_needs_no_lone_first_call() {
    let slow = |advertise_price| sandbox::Config {
        latency: Duration::from_millis(200),
        advertise_price,
        ..config()
    };
    // The file's word alone, on a fresh state database: one call first. (The latency only
    // makes calls sent together overlap in the record if the price were not tested alone; a
    // pass never depends on it.)
    let env = start(slow(false)).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", FOUR_GENERATIONS);
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "first", "--concurrency", "4"],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        !first_calls_overlap(dir, "first").await,
        "the price was not tested alone"
    );
    // The same price billed before, in the same database: all four go at once.
    four_at_once(
        &env,
        dir,
        &["p.yaml", "--run-id", "second", "--concurrency", "4"],
    )
    .await;
    assert_eq!(env.sandbox.ledger().len(), 8);

    // The service states the price (and the file agrees): no lone first call either.
    let env = start(slow(true)).await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &FOUR_GENERATIONS.replace("pricing: { generation: 4 }\n", ""),
    );
    four_at_once(
        &env,
        dir,
        &["p.yaml", "--run-id", "stated", "--concurrency", "4"],
    )
    .await;
    assert_eq!(env.sandbox.ledger().len(), 4);
}

/// Runs `args` while the sandbox holds every paid call before billing it, and fails unless all
/// four generations are held in flight together: none waited for another's bill. (A lone
/// first call would keep the other three from being sent until it was billed.)
async fn four_at_once(env: &Env, dir: &Path, args: &[&str]) {
    let hold = env.sandbox.hold();
    let mut cmd = Imgpipe::on(env, &["run"])
        .args(args)
        .cwd(dir)
        .sqlite_in(dir)
        .command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    wait_until(
        "the four generations in flight at once, none billed",
        || env.sandbox.held_calls() == 4,
    )
    .await;
    drop(hold);
    let o = finish_child(child, "the run").await;
    assert_exit_without_panic(&o, 0);
}

/// The reads a run starts with (account, models) bill nothing: a 429 on each is waited out
/// (its Retry-After honoured) instead of ending the run with exit 1 before anything is spent.
/// The sandbox answers exactly the first read of each 429 (counted, not timed), so the run
/// must read each again to go on.
#[tokio::test(flavor = "multi_thread")]
async fn a_429_on_the_reads_a_run_starts_with_is_waited_out() {
    // The price is the service's word alone: a models read not waited out leaves it unknown.
    let env = start(sandbox::Config {
        advertise_price: true,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", SHOT_THEN_UPSCALE);
    env.sandbox.rate_limit_reads(1, Duration::from_secs(1));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--json", "--run-id", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let stats = env.sandbox.stats();
    assert_eq!(
        (stats.reads_rate_limited, stats.rate_limited),
        (2, 2),
        "the first account read and the first models read met a 429, and nothing else: {stats:?}"
    );
    assert!(
        stats.account_reads >= 2 && stats.models_reads >= 2,
        "each of the two reads was tried again after its 429: {stats:?}"
    );
    let operations: Vec<String> = env
        .sandbox
        .ledger()
        .into_iter()
        .map(|e| e.operation)
        .collect();
    assert_eq!(
        (
            operations.len(),
            operations.iter().filter(|o| *o == "generate").count()
        ),
        (4, 2),
        "each call billed once, as planned: {operations:?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db, START_BALANCE);
}

/// Two items, each generated (at the price the service states) then upscaled: four bills.
const SHOT_THEN_UPSCALE: &str = r#"
version: 1
name: shots
output_dir: out
items: [{ id: a }, { id: b }]
steps:
  - id: shot
    generate: { prompt: "a {{ item.id }}" }
  - id: big
    upscale: { from: shot, desired_increase: 2 }
"#;

/// A second process given the same run id with `--wait` waits for the first; when the first is
/// interrupted with work left, the waiting one takes the run over and finishes it, paying for
/// each task once: the calls the first paid for are not paid again.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_for_a_run_that_is_then_interrupted_continues_it_paying_each_task_once() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let hold = env.sandbox.hold();
    env.sandbox.let_through(2);
    let mut first = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "same", "--concurrency", "1"],
    )
    .sqlite_in(dir)
    .watched();
    wait_until("two calls billed and the third held at the gate", || {
        env.sandbox.ledger().len() == 2 && env.sandbox.held_calls() >= 1
    })
    .await;
    let mut waiting = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "same", "--wait"])
        .sqlite_in(dir)
        .watched();
    waiting.wait_for_line("waiting for run same by pid").await;
    send_signal(first.id(), libc::SIGINT);
    first.wait_for_line("interrupted: no new calls").await;
    drop(hold);
    assert_exit_without_panic(&first.finish().await, 130);
    let paid_by_first = env.sandbox.ledger().len();
    assert!(
        paid_by_first < 9,
        "the first left work: {paid_by_first} of 9 paid"
    );
    let waited = waiting.finish().await;
    assert_exit_without_panic(&waited, 0);
    assert!(
        stdout(&waited).contains("run same: succeeded"),
        "{}",
        stdout(&waited)
    );
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 9, "each task paid once: {ledger:#?}");
    assert_no_request_billed_twice(&env);
}
