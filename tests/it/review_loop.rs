//! The review loop end to end, on the sample pipeline (`pipelines/product-shots.yaml`: three
//! products, a generation of two images each, then erase → expand → upscale → cut-out for each
//! image; 40 credits an item): a priced sample of items, a stop after a step, a reroll of one
//! chain. The sandbox's ledger says what was paid, the files and the state database what was
//! kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::*;

const PIPELINE: &str = include_str!("../../pipelines/product-shots.yaml");
/// What each item's chain costs: a generation of two 2K images at 4, then per image erase 2,
/// expand 5, upscale 4x 4 and cut-out 5.
const ITEM: u64 = 8 + 2 * (2 + 5 + 4 + 5);

/// A directory with the sample pipeline in it; its outputs go to `out/` beside it.
fn pipeline_dir(env: &Env) -> PathBuf {
    let dir = env.dir.path().join("work");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("shots.yaml"), PIPELINE).unwrap();
    dir
}

/// The `hint:` line of what the command printed.
fn hint_of(o: &Output) -> String {
    let err = stderr(o);
    let hint = err.lines().find(|l| l.starts_with("hint:"));
    hint.unwrap_or_else(|| panic!("no hint: {err}")).to_owned()
}

fn billed(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

/// Each billed operation and how many times it was billed.
fn operations(env: &Env, from: usize) -> BTreeMap<String, usize> {
    let mut ops = BTreeMap::new();
    for e in &env.sandbox.ledger()[from..] {
        *ops.entry(e.operation.clone()).or_default() += 1;
    }
    ops
}

/// Each of the four tools billed `n` times.
fn tools(n: usize) -> BTreeMap<String, usize> {
    ["erase", "expand", "remove_background", "upscale"]
        .into_iter()
        .map(|t| (t.to_owned(), n))
        .collect()
}

/// Every file under `dir`, by its path relative to `dir`, with its sha256.
fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path
                    .strip_prefix(dir)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, sha256_hex(&std::fs::read(&path).unwrap()));
            }
        }
    }
    out
}

pub(crate) fn items_with_outputs(run_dir: &Path) -> Vec<String> {
    let mut items: Vec<String> = std::fs::read_dir(run_dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_dir() && !e.file_name().to_string_lossy().starts_with('_'))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    items.sort();
    items
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sample_bills_its_plan_and_the_whole_run_after_it_bills_only_the_rest() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);

    let plan = Imgpipe::on(
        &env,
        &["plan", "shots.yaml", "--items", "mug,chair", "--json"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .run()
    .await;
    assert_exit(&plan, 0);
    let doc = json_stdout(&plan);
    assert_eq!(doc["costs"]["total_credits"], 2 * ITEM, "{doc}");
    assert_eq!(doc["scope"]["items"], 2);
    assert_eq!(doc["scope"]["of_items"], 3);
    assert_eq!(doc["scope"]["whole_credits"], 3 * ITEM);
    assert_nothing_billed(&env);

    let sample = Imgpipe::on(
        &env,
        &[
            "run",
            "shots.yaml",
            "--items",
            "mug,chair",
            "--run-id",
            "cat",
        ],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&sample, 7);
    assert_eq!(billed(&env), 2 * ITEM, "the sample bills exactly its plan");
    assert_eq!(env.sandbox.ledger().len(), 18);
    let run_dir = dir.join("out/cat");
    assert_eq!(items_with_outputs(&run_dir), ["chair", "mug"]);
    let hint = hint_of(&sample);
    assert!(
        hint.contains("imgpipe run shots.yaml --run-id cat"),
        "{hint}"
    );
    assert!(
        !hint.contains("--items"),
        "the rest is continued without --items: {hint}"
    );
    assert!(
        run_dir.join("report.html").exists(),
        "a part done is reported unasked"
    );

    let dry = Imgpipe::on(&env, &["run", "shots.yaml", "--run-id", "cat", "--dry-run"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .retry_base_ms(1)
        .run()
        .await;
    assert_exit(&dry, 0);
    assert!(
        has_phrase(
            &stdout(&dry),
            &format!("9 task(s) to pay for, {ITEM} credits")
        ),
        "{}",
        stdout(&dry)
    );

    let rest = Imgpipe::on(&env, &["run", "shots.yaml", "--run-id", "cat"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .retry_base_ms(1)
        .run()
        .await;
    assert_exit(&rest, 0);
    assert_eq!(
        billed(&env),
        3 * ITEM,
        "the whole run afterwards bills only the third item"
    );
    assert_eq!(env.sandbox.ledger().len(), 27);
    assert_eq!(items_with_outputs(&run_dir), ["chair", "lamp", "mug"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sample_picks_the_same_items_again_from_its_printed_seed() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    let first = Imgpipe::on(&env, &["plan", "shots.yaml", "--items", "sample:2"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&first, 0);
    let text = stdout(&first);
    let asked = text
        .lines()
        .find_map(|l| l.strip_prefix("asked    --items "))
        .unwrap_or_else(|| panic!("the plan names the sample: {text}"));
    let selector = asked.split(':').take(3).collect::<Vec<_>>().join(":");
    let selector = selector.trim_end_matches(|c: char| !c.is_ascii_digit());
    assert!(selector.starts_with("sample:2:"), "{selector}");
    let run_a = Imgpipe::on(
        &env,
        &["run", "shots.yaml", "--items", selector, "--run-id", "a"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&run_a, 7);
    let run_b = Imgpipe::on(
        &env,
        &["run", "shots.yaml", "--items", selector, "--run-id", "b"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&run_b, 7);
    let (a, b) = (
        items_with_outputs(&dir.join("out/a")),
        items_with_outputs(&dir.join("out/b")),
    );
    assert_eq!(a.len(), 2);
    assert_eq!(a, b, "the same seed picks the same items");

    let typo = Imgpipe::on(&env, &["run", "shots.yaml", "--items", "mugg"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .retry_base_ms(1)
        .run()
        .await;
    assert_exit(&typo, 2);
    assert!(
        stderr(&typo).contains("no item has the id `mugg`"),
        "{}",
        stderr(&typo)
    );
    assert!(
        stderr(&typo).contains("did you mean mug"),
        "{}",
        stderr(&typo)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn until_a_step_bills_only_it_and_continuing_bills_only_the_rest() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    let shots = Imgpipe::on(
        &env,
        &["run", "shots.yaml", "--until", "shot", "--run-id", "u"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&shots, 7);
    assert_eq!(
        operations(&env, 0),
        BTreeMap::from([("generate".to_owned(), 3)])
    );
    assert_eq!(billed(&env), 3 * 8);
    let hint = hint_of(&shots);
    assert!(hint.contains("imgpipe run shots.yaml --run-id u"), "{hint}");
    assert!(!hint.contains("--until"), "{hint}");

    let bad = Imgpipe::on(
        &env,
        &["run", "shots.yaml", "--until", "shoot", "--run-id", "v"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&bad, 2);
    assert!(stderr(&bad).contains("no step `shoot`"), "{}", stderr(&bad));

    let rest = Imgpipe::on(&env, &["resume", "u", "--retry-base-ms", "1"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&rest, 0);
    assert_eq!(
        operations(&env, 3),
        tools(6),
        "every tool call of the three items, once"
    );
    assert_eq!(billed(&env), 3 * ITEM, "nothing billed twice");
}

/// A run stopped after a step (`--until shot`), then a reroll of one item's generation: the
/// reroll pays exactly that generation's price (one call of 8 credits on the sandbox's ledger),
/// stops where the run stopped (exit 7: what is downstream never ran and stays pending), its
/// new images are the ones the manifest lists, and the run continued afterwards pays only the
/// rest, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_after_until_bills_exactly_its_price_and_leaves_the_rest_pending() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    let shots = Imgpipe::on(
        &env,
        &["run", "shots.yaml", "--until", "shot", "--run-id", "u"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .retry_base_ms(1)
    .run()
    .await;
    assert_exit(&shots, 7);
    assert_eq!(billed(&env), 3 * 8);
    let calls = env.sandbox.ledger().len();

    let reroll = Imgpipe::on(&env, &["reroll", "u", "mug/shot", "--retry-base-ms", "1"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&reroll, 7);
    assert_eq!(
        operations(&env, calls),
        BTreeMap::from([("generate".to_owned(), 1)]),
        "the reroll paid for mug's generation alone"
    );
    assert_eq!(
        billed(&env),
        3 * 8 + 8,
        "the reroll billed exactly its price"
    );
    assert!(
        has_phrase(
            &crate::run::both(&reroll),
            "reroll mug/shot is done as asked; 24 task(s) left pending"
        ),
        "{}",
        crate::run::both(&reroll)
    );
    let new_job = env.sandbox.ledger()[calls].job_id.clone();
    let mug_shots: Vec<_> = crate::run::manifest(&dir.join("out/u"))
        .into_iter()
        .filter(|l| l["item"] == "mug" && l["step"] == "shot")
        .collect();
    assert!(!mug_shots.is_empty(), "the manifest lists mug/shot");
    for line in &mug_shots {
        assert_eq!(line["job_id"], new_job.as_str(), "the new images: {line}");
    }

    let calls = env.sandbox.ledger().len();
    let rest = Imgpipe::on(&env, &["resume", "u", "--retry-base-ms", "1"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&rest, 0);
    assert_eq!(
        operations(&env, calls),
        tools(6),
        "every tool call of the three items, once, and no generation again"
    );
    assert_eq!(billed(&env), 3 * ITEM + 8, "nothing billed twice");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_bills_its_chain_once_and_sets_the_old_files_aside() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    assert_exit(
        &Imgpipe::on(&env, &["run", "shots.yaml", "--run-id", "r"])
            .cwd(&dir)
            .sqlite_in(&dir)
            .retry_base_ms(1)
            .run()
            .await,
        0,
    );
    let run_dir = dir.join("out/r");
    let before = files(&run_dir);
    let calls = env.sandbox.ledger().len();

    let dry = Imgpipe::on(&env, &["reroll", "r", "mug/clean[0]", "--dry-run"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&dry, 0);
    let text = stdout(&dry);
    assert!(
        has_phrase(&text, "4 task(s) to pay for, 16 credits"),
        "{text}"
    );
    for task in ["mug/clean[0]", "mug/wide[0]", "mug/big[0]", "mug/cutout[0]"] {
        assert!(text.contains(task), "{task} is listed: {text}");
    }
    assert!(!text.contains("mug/clean[1]"), "{text}");
    assert_eq!(env.sandbox.ledger().len(), calls, "a dry run pays nothing");

    let over = Imgpipe::on(
        &env,
        &["reroll", "r", "mug/clean[0]", "--max-credits", "130"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .run()
    .await;
    assert_exit(&over, 3);
    assert!(
        stderr(&over).contains("16"),
        "the refusal gives the price: {}",
        stderr(&over)
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        calls,
        "a reroll over the budget pays nothing"
    );

    let reroll = Imgpipe::on(
        &env,
        &["reroll", "r", "mug/clean[0]", "--retry-base-ms", "1"],
    )
    .cwd(&dir)
    .sqlite_in(&dir)
    .run()
    .await;
    assert_exit(&reroll, 0);
    assert_eq!(operations(&env, calls), tools(1));
    assert_eq!(billed(&env), 3 * ITEM + 16);
    let new_erase = env.sandbox.ledger()[calls..]
        .iter()
        .find(|e| e.operation == "erase")
        .map(|e| e.job_id.clone())
        .unwrap();
    let lines = crate::run::manifest(&run_dir);
    let clean0 = lines
        .iter()
        .find(|l| l["item"] == "mug" && l["step"] == "clean" && l["index"] == 0)
        .expect("the manifest lists mug/clean[0]");
    assert_eq!(
        clean0["job_id"],
        new_erase.as_str(),
        "the manifest shows the new output"
    );

    let after = files(&run_dir);
    let rerolled = |path: &str| {
        path.starts_with("mug/")
            && ["clean", "wide", "big", "cutout"]
                .iter()
                .any(|s| path.contains(&format!("{s}_0")) || path.contains(&format!("{s}-0")))
    };
    let mut set_aside = 0;
    for (path, sha) in &before {
        if path.starts_with("_") || path.ends_with(".jsonl") || path.ends_with(".html") {
            continue;
        }
        if rerolled(path) {
            assert!(after.contains_key(path), "{path} has its new version");
            let kept = after
                .iter()
                .any(|(p, s)| p.starts_with("_superseded/mug/") && s == sha);
            assert!(
                kept,
                "the earlier {path} is under _superseded/, bytes unchanged"
            );
            set_aside += 1;
        } else {
            assert_eq!(after.get(path), Some(sha), "{path} is left byte for byte");
        }
    }
    assert_eq!(set_aside, 4, "{before:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_killed_half_way_and_given_again_pays_nothing_twice() {
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    assert_exit(
        &Imgpipe::on(&env, &["run", "shots.yaml", "--run-id", "r"])
            .cwd(&dir)
            .sqlite_in(&dir)
            .retry_base_ms(1)
            .run()
            .await,
        0,
    );
    let calls = env.sandbox.ledger().len();
    let args = [
        "reroll",
        "r",
        "mug/clean[0]",
        "--concurrency",
        "1",
        "--retry-base-ms",
        "1",
    ];
    let killed = Imgpipe::on(&env, &args)
        .cwd(&dir)
        .sqlite_in(&dir)
        .env(imgpipe::failpoint::ENV, "exec-task-succeeded")
        .run()
        .await;
    assert!(
        killed.status.code().is_none(),
        "aborted at the crash point: {killed:?}"
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        calls + 1,
        "one call paid before the kill"
    );

    let again = Imgpipe::on(&env, &args)
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert_exit(&again, 0);
    assert_eq!(
        operations(&env, calls),
        tools(1),
        "the reroll given again continues it: each of its calls paid once"
    );
    // Now done, the same command is a new reroll.
    let anew = Imgpipe::on(&env, &["reroll", "r", "mug/clean[0]", "--dry-run"])
        .cwd(&dir)
        .sqlite_in(&dir)
        .run()
        .await;
    assert!(
        has_phrase(&stdout(&anew), "4 task(s) to pay for, 16 credits"),
        "{}",
        stdout(&anew)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_sample_then_a_reroll_pay_each_task_once() {
    let Some(state) = postgres_database("review_loop").await else {
        return;
    };
    let env = start_sample_sized().await;
    let dir = pipeline_dir(&env);
    let run = |args: &[&str]| {
        Imgpipe::on(&env, &["run", "shots.yaml"])
            .args(args)
            .cwd(&dir)
            .state(&state)
            .retry_base_ms(1)
    };
    let sample = run(&["--items", "first:1", "--run-id", "p"]).run().await;
    assert_exit(&sample, 7);
    assert_eq!(billed(&env), ITEM);
    let rest = run(&["--run-id", "p"]).run().await;
    assert_exit(&rest, 0);
    assert_eq!(billed(&env), 3 * ITEM);
    let reroll = Imgpipe::on(&env, &["reroll", "p", "lamp/wide", "--retry-base-ms", "1"])
        .cwd(&dir)
        .state(&state)
        .run()
        .await;
    assert_exit(&reroll, 0);
    // Both of lamp's expands, and the upscale and cut-out below each.
    assert_eq!(billed(&env), 3 * ITEM + 2 * (5 + 4 + 5));
    assert_eq!(env.sandbox.ledger().len(), 27 + 6);
}
