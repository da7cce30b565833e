//! Checks in a run, end to end: the sandbox makes bad images on request (`--fault-*`), the
//! run judges every output of a checked step before anything reads it, and the sandbox's
//! ledger, the state database and the files on disk are held against what the checks
//! promise: a failed output set aside and its task paid for once more, within `max_rerolls`
//! and `rerolls.max_credits`; nothing downstream of a failed output ever paid for; what no
//! reroll could mend flagged (or its task failed) and the run going on.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use imgpipe::sandbox::{self, BadImages, Faults};

use crate::binary::Imgpipe;
use crate::common::*;
use crate::run::{both, state_path, write};

/// Side of the sandbox's images: small, so that chains stay quick.
const SIDE: u32 = 32;

const SAMPLES: [&str; 4] = ["mug", "lamp", "chair", "plant"];

pub(crate) fn sandbox_config(bad_images: BadImages, seed: u64) -> sandbox::Config {
    sandbox::Config {
        image_side: SIDE,
        bad_images,
        faults: Faults {
            seed,
            ..Faults::default()
        },
        ..sandbox::Config::default()
    }
}

/// `items` items, each erased (2 credits), upscaled 2× (2, checked by `size` with `checks`'s
/// settings), then cut out (5).
fn checked_chain(items: usize, max_credits: u64, settings: &str) -> String {
    let mut text = format!(
        "version: 1\nname: checked\noutput_dir: out\nrerolls: {{ max_credits: {max_credits} }}\nitems:\n"
    );
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
    checks: [size]
"#;
    text += settings;
    text += "  - id: cutout\n    remove_background: { from: big }\n";
    text
}

/// `imgpipe run p.yaml` in `dir`, its state there, run to its end (exit 0).
async fn ran(env: &Env, dir: &Path) -> crate::binary::Ran {
    let o = Imgpipe::on(env, &["run", "p.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    o
}

/// Paid calls the sandbox billed, by tool or `generate`.
fn calls_by_path(env: &Env) -> BTreeMap<String, usize> {
    let mut calls = BTreeMap::new();
    for entry in env.sandbox.ledger() {
        *calls.entry(entry.operation).or_default() += 1;
    }
    calls
}

/// Credits the sandbox billed, in all.
fn credits_billed(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

fn png_size(path: &Path) -> (u32, u32) {
    image::image_dimensions(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The size of every kept output of step `step`, by item.
fn kept_sizes(db: &Db, step: &str) -> BTreeMap<String, (u32, u32)> {
    let mut sizes = BTreeMap::new();
    for task in db.live().filter(|t| t.step == step) {
        for o in db.outputs.iter().filter(|o| o.task_id == task.id) {
            let path = o.path.as_deref().expect("a kept output");
            sizes.insert(task.item.clone(), png_size(Path::new(path)));
        }
    }
    sizes
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upscale_that_keeps_failing_is_paid_max_rerolls_more_then_flagged_and_read_once() {
    let env = start(sandbox_config(
        BadImages {
            wrong_size: 1.0,
            ..BadImages::default()
        },
        7,
    ))
    .await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &checked_chain(3, 100, "    max_rerolls: 2\n"),
    );
    let o = ran(&env, dir).await;
    let calls = calls_by_path(&env);
    assert_eq!(
        (calls["erase"], calls["upscale"], calls["remove_background"]),
        (3, 9, 3),
        "each upscale paid 1 + max_rerolls times, each cut-out once: {calls:?}\n{}",
        both(&o)
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.check_rerolls.len(), 6, "{:?}", db.check_rerolls);
    assert!(db.check_rerolls.iter().all(|r| r.credits == 2));
    let aside: Vec<&str> = db.superseded.iter().map(|s| s.reason.as_str()).collect();
    assert_eq!(aside, ["check: size"; 6], "{:?}", db.superseded);
    for s in &db.superseded {
        let path = s.path.as_deref().expect("the set-aside file's place");
        assert!(path.contains("/_superseded/"), "{path}");
        assert_eq!(png_size(Path::new(path)), (SIDE, SIDE), "{path}");
    }
    // Three judgements a task: two acted on by a reroll, the last flagged.
    let acted: Vec<Option<&str>> = db.verdicts.iter().map(|v| v.acted.as_deref()).collect();
    assert_eq!(acted.len(), 9, "{:?}", db.verdicts);
    assert_eq!(
        acted.iter().filter(|a| **a == Some("rerolled")).count(),
        6,
        "{:?}",
        db.verdicts
    );
    assert_eq!(
        acted.iter().filter(|a| **a == Some("flagged")).count(),
        3,
        "{:?}",
        db.verdicts
    );
    assert!(db.verdicts.iter().all(|v| v.verdict == "failed"));
    assert!(
        db.verdicts[0].reason.contains(&format!("{SIDE}x{SIDE}")),
        "{:?}",
        db.verdicts[0]
    );
    // The flagged upscale is what the cut-out read: the run went on.
    assert!(db.live().all(|t| t.status == "succeeded"), "{:?}", db.tasks);
    assert_eq!(
        kept_sizes(&db, "big").values().collect::<Vec<_>>(),
        [&(SIDE, SIDE); 3]
    );
    assert_eq!(credits_billed(&env), 3 * 2 + 9 * 2 + 3 * 5);
}

/// Every image the sandbox makes is a flat frame: each erase fails `not_blank`, is paid again
/// `max_rerolls` times, then kept flagged. Its upscale, made from that flat frame, fails
/// `not_blank` too; paying for it again would make the same flat frame from the same input, so
/// it is flagged at once and paid for once, and the log says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_tool_whose_input_was_kept_with_the_same_fault_is_flagged_at_once_not_paid_again() {
    a_tool_with_a_flagged_input(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_tool_whose_input_was_kept_with_the_same_fault_is_not_paid_again() {
    let Some(pg) = postgres_database("checks_inherited").await else {
        return;
    };
    a_tool_with_a_flagged_input(Some(pg.to_string())).await;
    drop(pg);
}

/// The test above, its state in SQLite or in the PostgreSQL database `state`.
async fn a_tool_with_a_flagged_input(state: Option<String>) {
    let env = start(sandbox_config(
        BadImages {
            blank: 1.0,
            ..BadImages::default()
        },
        11,
    ))
    .await;
    let dir = env.dir.path();
    let mut text = String::from(
        "version: 1\nname: inherited\noutput_dir: out\nrerolls: { max_credits: 100 }\nitems:\n",
    );
    for (i, sample) in SAMPLES.iter().take(2).enumerate() {
        text += &format!(
            "  - {{ id: i{i:02}, url: \"https://sandbox.invalid/assets/{sample}.png\" }}\n"
        );
    }
    text += r#"steps:
  - id: clean
    erase: { image_url: "{{ item.url }}", object_name: "the corner of {{ item.id }}" }
    checks: [not_blank]
    max_rerolls: 1
  - id: big
    upscale: { from: clean, desired_increase: 2 }
    checks: [not_blank]
    max_rerolls: 2
"#;
    write(dir, "p.yaml", &text);
    let state = state.unwrap_or_else(|| state_path(dir).to_string_lossy().into_owned());
    let o = Imgpipe::on(&env, &["run", "p.yaml"])
        .cwd(dir)
        .state(&state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let calls = calls_by_path(&env);
    assert_eq!(
        (calls["erase"], calls["upscale"]),
        (4, 2),
        "each erase paid 1 + max_rerolls times, each upscale once: {calls:?}\n{}",
        both(&o)
    );
    assert!(
        has_phrase(
            &stderr(&o),
            "not paid for again: its input i00/clean[0] failed not_blank too"
        ),
        "{}",
        both(&o)
    );
    let db = Db::read(&state).await;
    assert_eq!(
        db.check_rerolls.len(),
        2,
        "the erases' only: {:?}",
        db.check_rerolls
    );
    let big: BTreeSet<i64> = db
        .live()
        .filter(|t| t.step == "big")
        .map(|t| t.id)
        .collect();
    let acted: Vec<Option<&str>> = db
        .verdicts
        .iter()
        .filter(|v| big.contains(&v.task_id))
        .map(|v| v.acted.as_deref())
        .collect();
    assert_eq!(acted, [Some("flagged"); 2], "{:?}", db.verdicts);
    for v in db.verdicts.iter().filter(|v| big.contains(&v.task_id)) {
        assert!(
            has_phrase(&v.reason, "not paid for again: its input")
                && has_phrase(&v.reason, "failed not_blank too"),
            "what status, the report and the desk show says why: {v:?}"
        );
    }
    assert_eq!(credits_billed(&env), 4 * 2 + 2 * 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_upscales_are_paid_again_until_they_pass_and_nothing_downstream_is_paid_twice() {
    // Downloads cut short and tried again: an upscale's answer often comes before its
    // input's file, which its `size` check must wait for.
    let mut config = sandbox_config(
        BadImages {
            wrong_size: 0.5,
            ..BadImages::default()
        },
        11,
    );
    config.faults.truncate_download = 0.2;
    let env = start(config).await;
    let dir = env.dir.path();
    let items = 8;
    write(
        dir,
        "p.yaml",
        &checked_chain(items, 200, "    max_rerolls: 10\n"),
    );
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--concurrency", "4"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let calls = calls_by_path(&env);
    let db = Db::read_file(&state_path(dir)).await;
    let rerolls = db.check_rerolls.len();
    assert!(rerolls > 0, "the seed makes some upscales fail: {calls:?}");
    assert_eq!(calls["upscale"], items + rerolls, "{calls:?}");
    assert_eq!(calls["erase"], items, "{calls:?}");
    assert_eq!(
        calls["remove_background"], items,
        "nothing downstream of a failed upscale was paid for: {calls:?}"
    );
    // Every upscale kept is twice its input: no bad output is left in the run's directory.
    let inputs = kept_sizes(&db, "clean");
    for (item, size) in kept_sizes(&db, "big") {
        let (w, h) = inputs[&item];
        assert_eq!(size, (2 * w, 2 * h), "{item}");
    }
    assert_eq!(db.superseded.len(), rerolls);
    // Each cut-out read the upscale that was kept, never one set aside.
    for cutout in db.live().filter(|t| t.step == "cutout") {
        let big = db
            .live()
            .find(|t| t.step == "big" && t.item == cutout.item)
            .unwrap();
        let read = db.outputs.iter().find(|o| o.task_id == cutout.id).unwrap();
        assert_eq!(read.parent_job_id, big.job_id, "{}", cutout.item);
    }
    for v in &db.verdicts {
        let ok = match v.verdict.as_str() {
            "passed" => v.acted.is_none(),
            "failed" => v.acted.as_deref() == Some("rerolled"),
            _ => false,
        };
        assert!(ok, "every upscale judged, each failure rerolled: {v:?}");
    }
    let billed = (items * (2 + 5) + (items + rerolls) * 2) as u64;
    assert_eq!(credits_billed(&env), billed);
}

/// Every generation of two or more images comes back as its first image repeated.
async fn start_duplicates() -> Env {
    start(sandbox_config(
        BadImages {
            duplicate: 1.0,
            ..BadImages::default()
        },
        5,
    ))
    .await
}

/// The head of a one-item pipeline of generations, up to its `steps:`.
const SHOTS: &str = "version: 1
name: shots
output_dir: out
rerolls: { max_credits: 40 }
pricing: { generation: 4 }
items:
  - { id: mug }
steps:
";

/// Every upscale comes back at its input's size: `size` fails it every time.
async fn start_wrong_sizes() -> Env {
    start(sandbox_config(
        BadImages {
            wrong_size: 1.0,
            ..BadImages::default()
        },
        3,
    ))
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn on_fail_fail_fails_the_task_blocks_its_readers_and_a_resume_never_pays_for_it_again() {
    let env = start_wrong_sizes().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &checked_chain(2, 100, "    on_fail: fail\n"));
    let args = ["run", "p.yaml", "--run-id", "r"];
    let o = Imgpipe::on(&env, &args).sqlite_in(dir).run().await;
    assert_exit_without_panic(&o, 4);
    let text = both(&o);
    assert!(text.contains("check: size: "), "{text}");
    let calls = calls_by_path(&env);
    assert_eq!(
        (
            calls["erase"],
            calls["upscale"],
            calls.get("remove_background")
        ),
        (2, 2, None),
        "{calls:?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    let status = |step: &str| -> Vec<String> {
        db.live()
            .filter(|t| t.step == step)
            .map(|t| t.status.clone())
            .collect()
    };
    assert_eq!(status("big"), ["failed", "failed"]);
    assert_eq!(status("cutout"), ["blocked", "blocked"]);
    assert!(
        db.verdicts
            .iter()
            .all(|v| v.acted.as_deref() == Some("failed"))
    );
    assert!(db.check_rerolls.is_empty() && db.superseded.is_empty());

    let dry = Imgpipe::on(&env, &["resume", "r", "--dry-run"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit(&dry, 0);
    assert!(
        stdout(&dry).contains("not paid again (a check failed it): i00/big[0]"),
        "{}",
        both(&dry)
    );
    let resumed = Imgpipe::on(&env, &["resume", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&resumed, 4);
    assert_eq!(
        calls_by_path(&env),
        calls,
        "nothing paid again: {}",
        both(&resumed)
    );
    let after = Db::read_file(&state_path(dir)).await;
    let big = after.live().find(|t| t.step == "big").unwrap();
    assert!(
        big.error
            .as_deref()
            .unwrap_or_default()
            .starts_with("check: size: "),
        "the task keeps the check's reason: {big:?}"
    );
}

/// One item at one call at a time, killed at `point` in its first judgement, then resumed:
/// each upscale is paid 1 + max_rerolls times in all, whatever the kill left recorded.
async fn killed_while_judging_then_resumed(point: &str) -> (Env, Db) {
    let env = start_wrong_sizes().await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &checked_chain(1, 100, "    max_rerolls: 1\n"),
    );
    let args = ["run", "p.yaml", "--run-id", "r", "--concurrency", "1"];
    let killed = Imgpipe::on(&env, &args)
        .sqlite_in(dir)
        .env(imgpipe::failpoint::ENV, point)
        .run()
        .await;
    assert!(
        killed.status.code().is_none(),
        "aborted at {point}: {}",
        both(&killed)
    );
    assert_eq!(
        calls_by_path(&env)["upscale"],
        1,
        "one upscale before the kill"
    );
    let resumed = Imgpipe::on(&env, &["resume", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit(&resumed, 0);
    let calls = calls_by_path(&env);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(
        (calls["erase"], calls["upscale"], calls["remove_background"]),
        (1, 2, 1),
        "{point}: {calls:?}\n{}\n{:?}",
        both(&resumed),
        db.verdicts
    );
    assert_eq!(db.check_rerolls.len(), 1, "{point}: {:?}", db.check_rerolls);
    assert_eq!(db.superseded.len(), 1, "{point}: {:?}", db.superseded);
    let aside = db.superseded[0].path.as_deref().expect("moved aside");
    assert_eq!(png_size(Path::new(aside)), (SIDE, SIDE), "{point}: {aside}");
    let acted: Vec<Option<&str>> = db.verdicts.iter().map(|v| v.acted.as_deref()).collect();
    assert_eq!(acted, [Some("rerolled"), Some("flagged")], "{point}");
    (env, db)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_before_its_verdicts_are_recorded_is_judged_again_on_resume_and_paid_once() {
    killed_while_judging_then_resumed("exec-checked-judged").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_after_a_reroll_is_recorded_moves_its_files_on_resume_and_pays_it_once() {
    killed_while_judging_then_resumed("exec-checked-recorded").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_generation_of_one_picture_repeated_fails_distinct_and_is_paid_again_whole() {
    let env = start_duplicates().await;
    let dir = env.dir.path();
    let text = SHOTS.to_owned()
        + r#"  - id: shot
    generate: { prompt: "a mug", n: 3 }
    checks: [distinct]
    max_rerolls: 1
  - id: big
    upscale: { from: shot, desired_increase: 2 }
"#;
    write(dir, "p.yaml", &text);
    ran(&env, dir).await;
    let calls = calls_by_path(&env);
    assert_eq!(
        (calls["generate"], calls["upscale"]),
        (2, 3),
        "the generation paid twice, each of its kept images upscaled once: {calls:?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    // Each judgement: the first image passes, the two copies of it fail.
    let verdicts: Vec<(&str, Option<&str>)> = db
        .verdicts
        .iter()
        .map(|v| (v.verdict.as_str(), v.acted.as_deref()))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("passed", None),
            ("failed", Some("rerolled")),
            ("failed", Some("rerolled")),
            ("passed", None),
            ("failed", Some("flagged")),
            ("failed", Some("flagged")),
        ]
    );
    assert_eq!(db.superseded.len(), 3, "the whole generation set aside");
    assert_eq!(db.check_rerolls.len(), 1);
    assert_eq!(db.check_rerolls[0].credits, 12);
}

/// A program that judges each output: `reject.sh` fails it with a reason, `hang.sh` never
/// answers.
fn judges(dir: &Path) {
    write(
        dir,
        "reject.sh",
        "test -s \"$1\" || exit 2\necho '{\"score\": 0.1, \"reason\": \"too dark for the catalogue\"}'\nexit 1\n",
    );
    write(dir, "hang.sh", "exec sleep 600\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_that_fails_an_output_rerolls_it_and_one_that_never_answers_flags_it_unpaid() {
    let env = start(sandbox_config(BadImages::default(), 1)).await;
    let dir = env.dir.path();
    judges(dir);
    let chain = |script: &str| {
        let mut text = checked_chain(2, 100, "    max_rerolls: 1\n");
        text = text.replace(
            "    checks: [size]\n",
            &format!("    checks:\n      - command: {{ argv: [sh, {script}, \"{{file}}\"], timeout: 1 }}\n"),
        );
        text
    };
    write(dir, "reject.yaml", &chain("reject.sh"));
    let o = Imgpipe::on(&env, &["run", "reject.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(
        calls_by_path(&env)["upscale"],
        4,
        "each upscale paid again once: {}",
        both(&o)
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert!(
        db.verdicts
            .iter()
            .all(|v| v.check == "command" && v.reason == "too dark for the catalogue"),
        "{:?}",
        db.verdicts
    );

    let before = calls_by_path(&env);
    write(dir, "hang.yaml", &chain("hang.sh"));
    let o = Imgpipe::on(&env, &["run", "hang.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let after = calls_by_path(&env);
    assert_eq!(
        after["upscale"] - before["upscale"],
        2,
        "a check that cannot judge pays nothing again: {}",
        both(&o)
    );
    assert_eq!(after["remove_background"] - before["remove_background"], 2);
    let db = Db::read_file(&state_path(dir)).await;
    let hung: Vec<&VerdictRow> = db.verdicts.iter().skip(4).collect();
    assert_eq!(hung.len(), 2, "{:?}", db.verdicts);
    for v in hung {
        assert_eq!(
            (v.verdict.as_str(), v.acted.as_deref()),
            ("not_checked", Some("flagged"))
        );
        assert_eq!(v.reason, "no verdict after 1 s", "{v:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rerolls_stop_at_max_credits_and_what_they_could_not_mend_is_flagged() {
    let env = start_wrong_sizes().await;
    let dir = env.dir.path();
    // Four upscales of 2 credits each fail every time; 5 credits pay for two rerolls.
    write(dir, "p.yaml", &checked_chain(4, 5, "    max_rerolls: 3\n"));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--concurrency", "2"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    let spent: u64 = db.check_rerolls.iter().map(|r| r.credits).sum();
    assert_eq!(spent, 4, "{:?}", db.check_rerolls);
    let calls = calls_by_path(&env);
    assert_eq!(calls["upscale"], 4 + 2, "{calls:?}");
    assert_eq!(calls["remove_background"], 4, "{calls:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_set_aside_twice_keeps_both_files_and_its_last_output_in_place() {
    // One item at one call at a time: each new output takes the row id of the one set
    // aside before it (SQLite reuses the last id deleted).
    let env = start_wrong_sizes().await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &checked_chain(1, 100, "    max_rerolls: 2\n"),
    );
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--concurrency", "1"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(calls_by_path(&env)["upscale"], 3);
    let db = Db::read_file(&state_path(dir)).await;
    let aside: BTreeSet<&str> = db
        .superseded
        .iter()
        .map(|s| s.path.as_deref().expect("moved aside"))
        .collect();
    assert_eq!(
        aside.len(),
        2,
        "two places for two files: {:?}",
        db.superseded
    );
    for path in &aside {
        assert_eq!(png_size(Path::new(path)), (SIDE, SIDE), "{path}");
    }
    let jobs: BTreeSet<&str> = db.superseded.iter().map(|s| s.job_id.as_str()).collect();
    assert_eq!(jobs.len(), 2, "{:?}", db.superseded);
}

#[tokio::test(flavor = "multi_thread")]
async fn outputs_in_a_bucket_are_judged_from_a_copy_and_set_aside_in_the_bucket() {
    let env = start(sandbox_config(
        BadImages {
            wrong_size: 0.5,
            ..BadImages::default()
        },
        11,
    ))
    .await;
    let s3 = crate::objects::S3::start().await;
    let dir = env.dir.path();
    let items = 4;
    write(
        dir,
        "p.yaml",
        &checked_chain(items, 100, "    max_rerolls: 10\n"),
    );
    let args = [
        "run",
        "p.yaml",
        "--run-id",
        "r",
        "--out",
        "s3://shots/runs/",
    ];
    let o = Imgpipe::on(&env, &args).s3(&s3).sqlite_in(dir).run().await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    let rerolls = db.check_rerolls.len();
    assert!(rerolls > 0, "the seed makes some upscales fail");
    assert_eq!(calls_by_path(&env)["upscale"], items + rerolls);
    for i in 0..items {
        let clean = png_size(&s3.file(&format!("runs/r/i{i:02}/clean.png")));
        let big = png_size(&s3.file(&format!("runs/r/i{i:02}/big.png")));
        assert_eq!(big, (2 * clean.0, 2 * clean.1), "i{i:02}");
    }
    for s in &db.superseded {
        let url = s.path.as_deref().expect("moved aside");
        let key = url.strip_prefix("s3://shots/").expect("in the bucket");
        assert!(key.starts_with("runs/r/_superseded/"), "{key}");
        assert_eq!(png_size(&s3.file(key)), (SIDE, SIDE), "{key}");
    }
}

/// A generation of two images, each upscaled and judged by `distinct` with `settings`.
fn upscaled_pair(settings: &str) -> String {
    SHOTS.to_owned()
        + r#"  - id: shot
    generate: { prompt: "a mug", n: 2 }
  - id: big
    upscale: { from: shot, desired_increase: 2 }
    checks: [distinct]
"# + settings
}

/// Every verdict's outcome and what was done about it, sorted.
fn verdicts_acted(db: &Db) -> Vec<(String, Option<String>)> {
    let mut v: Vec<_> = db
        .verdicts
        .iter()
        .map(|v| (v.verdict.clone(), v.acted.clone()))
        .collect();
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn distinct_after_a_generation_judges_each_upscale_against_its_siblings_kept() {
    let env = start_duplicates().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &upscaled_pair("    max_rerolls: 1\n"));
    ran(&env, dir).await;
    let calls = calls_by_path(&env);
    assert_eq!(
        (calls["generate"], calls["upscale"]),
        (1, 3),
        "the second upscale of one picture paid again once: {calls:?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    let acted = |a: &str| Some(a.to_owned());
    assert_eq!(
        verdicts_acted(&db),
        [
            ("failed".to_owned(), acted("flagged")),
            ("failed".to_owned(), acted("rerolled")),
            ("passed".to_owned(), None)
        ]
    );
}

/// `distinct` after a generation compares an upscale with what its siblings kept in earlier
/// processes too: a reroll of the second upscale of a picture repeated (a process of its own)
/// reads the first one's file, and its copy fails `distinct` again.
#[tokio::test(flavor = "multi_thread")]
async fn distinct_compares_with_the_siblings_an_earlier_process_kept() {
    let env = start_duplicates().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &upscaled_pair("    on_fail: flag\n"));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    let flagged = ("failed".to_owned(), Some("flagged".to_owned()));
    let passed = ("passed".to_owned(), None);
    assert_eq!(verdicts_acted(&db), [flagged.clone(), passed.clone()]);
    let second = db
        .verdicts
        .iter()
        .find(|v| v.verdict == "failed")
        .map(|v| v.task_id)
        .unwrap();
    let target = db.tasks.iter().find(|t| t.id == second).unwrap();
    let target = format!("{}/{}[{}]", target.item, target.step, target.idx);
    let o = Imgpipe::on(&env, &["reroll", "r", &target])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(calls_by_path(&env)["upscale"], 3, "{}", both(&o));
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(
        verdicts_acted(&db),
        [flagged.clone(), flagged, passed],
        "the copy paid again is judged against the first upscale, kept by the first process"
    );
}
