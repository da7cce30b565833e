//! What people read, pinned whole: the run summary, the plan (text and JSON), `status`, `runs`,
//! `spend` (text, JSON, CSV), `cap list`, the dry runs of `resume` and `reroll`, and the error
//! and hint of each refusal (exit 2, 3, 5, 6, 7), as `insta` snapshots in `snapshots/`.
//!
//! A `contains` check lets a garbled summary pass; a snapshot does not. What changes from run to
//! run is filtered out: times and days, the test's directory, ports, pids and hosts, durations.
//! Under CI (`CI=true`) insta never writes a snapshot: a new or changed one fails the test.

use std::path::Path;
use std::time::Duration;

use imgpipe::sandbox;

use crate::common::*;
use crate::plan_rerolls::checked_chain;
use crate::run::{config, edit_chain, write};

/// The filters of everything that is not the same from one run to the next.
fn filters(dir: &Path) -> Vec<(String, &'static str)> {
    let dir = dir.to_string_lossy();
    vec![
        (escape(&dir), "[DIR]"),
        // Times, days, weeks and months keep their width, so that tables stay aligned.
        (
            r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d+Z".to_owned(),
            "[TIME]",
        ),
        (
            r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z".to_owned(),
            "YYYY-MM-DDThh:mm:ssZ",
        ),
        (
            r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}[+-]\d{2}:\d{2}".to_owned(),
            "YYYY-MM-DDThh:mm:ss+hh:mm",
        ),
        (r"\b\d{4}-\d{2}-\d{2}\b".to_owned(), "YYYY-MM-DD"),
        (r"\b\d{4}-W\d{2}\b".to_owned(), "YYYY-Www"),
        (r"\b\d{4}-\d{2}\b".to_owned(), "YYYY-MM"),
        (r"127\.0\.0\.1:\d+".to_owned(), "127.0.0.1:[PORT]"),
        (r"pid \d+ on \S+".to_owned(), "pid [PID] on [HOST]"),
        // A revision digests the run's id and state, which differ from run to run.
        (
            r#""revision": "[0-9a-f]{16}""#.to_owned(),
            r#""revision": "[REVISION]""#,
        ),
        (
            r"\b\d+(\.\d+)?(ms|s) elapsed".to_owned(),
            "[DURATION] elapsed",
        ),
        (
            r#""(elapsed|duration)_ms": ?\d+"#.to_owned(),
            r#""$1_ms": [MS]"#,
        ),
    ]
}

/// `text` as a regular expression that matches it alone.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Asserts `text` against the snapshot `name`, with [`filters`] for `dir`.
#[track_caller]
pub(crate) fn said(dir: &Path, name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    for (from, to) in filters(dir) {
        settings.add_filter(&from, to);
    }
    settings.set_prepend_module_to_snapshot(true);
    settings.bind(|| insta::assert_snapshot!(name, text));
}

/// Both streams, labelled, with the exit code: what a user sees of a command.
pub(crate) fn seen(o: &impl Printed) -> String {
    let o = o.printed();
    format!(
        "exit: {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    )
}

/// The pipelines of the snapshots: a chain of 3 items (erase → upscale → remove_background,
/// 9 credits an item) under a budget of 100.
async fn chain() -> Env {
    let env = start(config()).await;
    write(env.dir.path(), "p.yaml", &edit_chain(3, Some(100)));
    env
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_reads_as_a_table_and_as_json() {
    let env = chain().await;
    let dir = env.dir.path();
    let text = Imgpipe::on(&env, &["plan", "p.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&text, 0);
    said(dir, "plan_text", &seen(&text));
    let json = Imgpipe::on(&env, &["plan", "p.yaml", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "plan_json", &seen(&json));
    let offline = Imgpipe::on(&env, &["plan", "p.yaml", "--offline"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "plan_offline", &seen(&offline));
}

/// The chain with checks that reroll (36 credits at worst beside its 27), under `budget`.
async fn plan_with_rerolls(env: &Env, budget: u64) -> crate::binary::Ran {
    let dir = env.dir.path();
    write(dir, "p.yaml", &checked_chain(Some(budget), 60));
    Imgpipe::on(env, &["plan", "p.yaml"])
        .sqlite_in(dir)
        .run()
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_with_rerolls_reads_its_worst_case_and_refuses_what_it_cannot_pay() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let o = plan_with_rerolls(&env, 100).await;
    assert_exit_without_panic(&o, 0);
    said(dir, "plan_rerolls_text", &seen(&o));
    let o = plan_with_rerolls(&env, 62).await;
    said(dir, "refused_3_plan_rerolls_over_budget", &seen(&o));
    let o = Imgpipe::on(&env, &["run", "p.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_3_rerolls_over_budget", &seen(&o));
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_run_reads_the_same_in_its_summary_status_runs_and_spend() {
    let env = chain().await;
    let dir = env.dir.path();
    let run = |args: &[&str]| {
        Imgpipe::on(&env, args)
            .sqlite_in(dir)
            .retry_base_ms(10)
            .run()
    };
    let o = run(&["run", "p.yaml", "--run-id", "r"]).await;
    assert_exit_without_panic(&o, 0);
    said(dir, "run_summary", &seen(&o));
    let again = run(&["run", "p.yaml", "--run-id", "r", "--json"]).await;
    said(dir, "run_summary_again_json", &seen(&again));
    for (name, args) in [
        ("status_text", &["status", "r"][..]),
        ("status_json", &["status", "r", "--json"]),
        ("runs_text", &["runs"]),
        ("runs_json", &["runs", "--json"]),
        ("spend_text", &["spend"]),
        ("spend_json", &["spend", "--json"]),
        ("spend_csv", &["spend", "--csv"]),
        ("spend_by_step", &["spend", "--by", "step"]),
        ("spend_by_run", &["spend", "--by", "run"]),
        ("spend_by_week", &["spend", "--by", "week"]),
        ("spend_by_month", &["spend", "--by", "month"]),
        ("resume_finished_dry_run", &["resume", "r", "--dry-run"]),
    ] {
        let o = Imgpipe::on(&env, args).sqlite_in(dir).run().await;
        said(dir, name, &seen(&o));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn caps_read_as_a_table_and_a_run_stopped_by_one_says_when_it_reopens() {
    let env = chain().await;
    let dir = env.dir.path();
    let o = Imgpipe::on(
        &env,
        &["cap", "set", "nightly", "--credits", "10", "--per", "day"],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    said(dir, "cap_set", &seen(&o));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "capped"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 6);
    said(dir, "refused_6_cap_spent", &seen(&o));
    for (name, args) in [
        ("cap_list_text", &["cap", "list"][..]),
        ("cap_list_json", &["cap", "list", "--json"]),
        ("resume_capped_dry_run", &["resume", "capped", "--dry-run"]),
        (
            "resume_capped_dry_run_json",
            &["resume", "capped", "--dry-run", "--json"],
        ),
    ] {
        let o = Imgpipe::on(&env, args).sqlite_in(dir).run().await;
        said(dir, name, &seen(&o));
    }
    let o = Imgpipe::on(
        &env,
        &["cap", "set", "bad", "--credits", "1", "--per", "fortnight"],
    )
    .sqlite_in(dir)
    .run()
    .await;
    said(dir, "refused_2_cap_period", &seen(&o));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sample_stops_with_exit_7_and_a_reroll_dry_run_prices_the_redo() {
    let env = chain().await;
    let dir = env.dir.path();
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "s", "--items", "first:1"],
    )
    .sqlite_in(dir)
    .run()
    .await;
    assert_exit_without_panic(&o, 7);
    said(dir, "refused_7_sample_done", &seen(&o));
    for (name, args) in [
        ("resume_sample_dry_run", &["resume", "s", "--dry-run"][..]),
        ("reroll_dry_run", &["reroll", "s", "i00", "--dry-run"]),
        (
            "reroll_dry_run_json",
            &["reroll", "s", "i00", "--dry-run", "--json"],
        ),
        ("refused_2_unknown_run", &["status", "nope"]),
        (
            "refused_2_reroll_unknown_item",
            &["reroll", "s", "zz", "--dry-run"],
        ),
    ] {
        let o = Imgpipe::on(&env, args).sqlite_in(dir).run().await;
        said(dir, name, &seen(&o));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_say_what_is_wrong_and_what_to_do() {
    let env = chain().await;
    let dir = env.dir.path();
    let o = Imgpipe::new(&["run", "p.yaml"])
        .cwd(dir)
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_2_no_service", &seen(&o));
    write(
        dir,
        "bad.yaml",
        "version: 1\nname: bad\noutput_dir: out\nitems: []\nsteps:\n  - id: x\n    erase: { image_url: 3, colour: red }\n",
    );
    let o = Imgpipe::on(&env, &["run", "bad.yaml"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_2_bad_pipeline", &seen(&o));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--max-credits", "1"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_3_over_budget", &seen(&o));
    let o = Imgpipe::on(&env, &["plan", "p.yaml", "--max-credits", "1"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_3_plan_over_budget", &seen(&o));
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_already_going_refuses_a_second_process_with_exit_5() {
    let env = start(sandbox::Config { ..config() }).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let hold = env.sandbox.hold();
    let first = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "busy"])
        .sqlite_in(dir)
        .watched();
    wait_until("the first run's call held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    let second = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "busy"])
        .sqlite_in(dir)
        .run()
        .await;
    said(dir, "refused_5_run_locked", &seen(&second));
    drop(hold);
    let first = first.finish().await;
    assert_exit_without_panic(&first, 0);
}

/// A reroll of a run whose process is still going is refused with exit 5 (the lock) and pays
/// for nothing, while that run goes on to its end: the run held at the sandbox's gate, a call
/// in flight, when the reroll is given.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_of_a_run_going_is_refused_with_exit_5_and_the_run_goes_on() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let hold = env.sandbox.hold();
    let run = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "1"],
    )
    .sqlite_in(dir)
    .watched();
    wait_until("the run's first call held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    // A refused reroll ends at once; one let in would wait at the gate: the limit says so.
    let reroll = Imgpipe::on(&env, &["reroll", "r", "i00"])
        .sqlite_in(dir)
        .limit(Duration::from_secs(60))
        .run()
        .await;
    assert_exit_without_panic(&reroll, 5);
    assert!(
        stderr(&reroll).contains("another imgpipe is running pipeline chain: run r by pid"),
        "{}",
        stderr(&reroll)
    );
    drop(hold);
    assert_exit_without_panic(&run.finish().await, 0);
    assert_eq!(
        env.sandbox.ledger().len(),
        2 * 3,
        "the run paid its two chains once, the refused reroll nothing"
    );
}

/// A reroll while another reroll of the same run is going is refused the same way (exit 5,
/// nothing paid), and the first goes on to its end.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_while_another_reroll_of_the_run_goes_is_refused_with_exit_5() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let done = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&done, 0);
    let billed = env.sandbox.ledger().len();
    let hold = env.sandbox.hold();
    let first = Imgpipe::on(&env, &["reroll", "r", "i01"])
        .sqlite_in(dir)
        .watched();
    wait_until("the first reroll's call held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    let second = Imgpipe::on(&env, &["reroll", "r", "i00"])
        .sqlite_in(dir)
        .limit(Duration::from_secs(60))
        .run()
        .await;
    assert_exit_without_panic(&second, 5);
    said(dir, "refused_5_reroll_while_rerolling", &seen(&second));
    drop(hold);
    assert_exit_without_panic(&first.finish().await, 0);
    assert_eq!(
        env.sandbox.ledger().len(),
        billed + 3,
        "the first reroll paid its item's chain, the refused one nothing"
    );
}

/// A reroll is priced first and held against the balance: more than the account has is
/// refused with exit 3 before anything is paid.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_over_the_balance_is_refused_with_exit_3_and_pays_nothing() {
    let env = start(sandbox::Config {
        balance: 20,
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let done = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&done, 0);
    let billed = env.sandbox.ledger().len();
    // 2 credits left; the item's chain costs 9.
    let o = Imgpipe::on(&env, &["reroll", "r", "i00"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    said(dir, "refused_3_reroll_over_balance", &seen(&o));
    assert_eq!(env.sandbox.ledger().len(), billed, "nothing paid");
}
