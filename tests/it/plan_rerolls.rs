//! The plan prices rerolls (issue 46): beside the total, the worst case of paying again for
//! outputs that fail a check, and the expected case from how often the same checks failed in
//! earlier runs; the verdict, and `run`'s admission, hold the total and the worst case
//! together against the budget and the balance.
//!
//! The figures are worked out by hand from the pipeline's shape (in the comments), never by
//! asking imgpipe.

use std::path::Path;

use imgpipe::pipeline::{Pipeline, StepRef};
use imgpipe::store::{Outcome, OutputId, Store, TaskId, VerdictRow};
use serde_json::{Value, json};

use crate::binary::Ran;
use crate::common::*;
use crate::run::{config, edit_chain, write};

/// The chain of 3 items (erase 2 → upscale 2x 2 → remove_background 5: 27 credits) with
/// checks: `clean` flags (no reroll), `big` rerolls once (3 tasks × 2 = 6 at worst), `cutout`
/// twice (3 tasks × 5 × 2 = 30 at worst). Without the cap, 36 credits at worst.
pub(crate) fn checked_chain(budget: Option<u64>, max_credits: u64) -> String {
    let text = edit_chain(3, budget)
        .replace(
            "object_name: \"the corner of {{ item.id }}\" }\n",
            "object_name: \"the corner of {{ item.id }}\" }\n    checks: [not_blank]\n    on_fail: flag\n",
        )
        .replace(
            "desired_increase: 2 }\n",
            "desired_increase: 2 }\n    checks: [size]\n",
        )
        .replace(
            "remove_background: { from: big }\n",
            "remove_background: { from: big }\n    checks: [not_blank, transparent]\n    max_rerolls: 2\n",
        );
    format!("{text}rerolls: {{ max_credits: {max_credits} }}\n")
}

/// `imgpipe ARGS p.yaml` with the state beside it.
async fn on_chain(env: &Env, args: &[&str]) -> Ran {
    let args = [args, &["p.yaml"]].concat();
    Imgpipe::on(env, &args)
        .sqlite_in(env.dir.path())
        .run()
        .await
}

/// `imgpipe --json plan p.yaml` with the state beside it, and the plan document.
async fn plan_json(env: &Env) -> (Ran, Value) {
    let o = on_chain(env, &["--json", "plan"]).await;
    let doc = json_stdout(&o);
    (o, doc)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plan_shows_the_rerolls_worst_case_beside_the_total() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &checked_chain(Some(100), 60));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(doc["costs"]["total_credits"], 27, "{doc:#}");
    // 6 (big) + 30 (cutout); clean flags and pays nothing again. A fresh state knows no
    // verdicts: the expected case is unknown.
    assert_eq!(
        doc["rerolls"],
        json!({ "worst_case_credits": 36, "expected_credits": null })
    );
    assert_eq!(doc["verdict"]["fits"], true, "{doc:#}");
    let text = on_chain(&env, &["plan"]).await;
    assert_exit(&text, 0);
    let said = stdout(&text);
    assert!(
        said.contains("total    27 credits\nrerolls  up to 36 credits more, 63 credits at worst"),
        "{said}"
    );

    // The part asked for is priced alone: one item, 2 (big) + 10 (cutout); `--until big`,
    // big's 6 alone.
    let one = on_chain(&env, &["--json", "plan", "--items", "first:1"]).await;
    assert_eq!(json_stdout(&one)["rerolls"]["worst_case_credits"], 12);
    let until = on_chain(&env, &["--json", "plan", "--until", "big"]).await;
    assert_eq!(json_stdout(&until)["rerolls"]["worst_case_credits"], 6);

    // The cap bounds the worst case: 36 at most 20.
    write(dir, "p.yaml", &checked_chain(Some(100), 20));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(doc["rerolls"]["worst_case_credits"], 20, "{doc:#}");

    // A pipeline that rerolls nothing has no `rerolls` at all.
    write(dir, "p.yaml", &edit_chain(3, Some(100)));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(doc.get("rerolls"), None, "{doc:#}");
    assert!(!stdout(&o).contains("rerolls"), "{}", stdout(&o));
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_budget_that_fits_the_total_but_not_its_rerolls_refuses_plan_and_run() {
    let env = start(config()).await;
    let dir = env.dir.path();
    // 27 + 36 = 63 at worst: a budget of 63 fits, one of 62 does not, though 27 fits either.
    write(dir, "p.yaml", &checked_chain(Some(63), 60));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(doc["verdict"]["fits"], true, "{doc:#}");
    write(dir, "p.yaml", &checked_chain(Some(62), 60));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 3);
    let reason = "the plan costs 27 credits and its rerolls up to 36 credits more, 63 credits at \
                  worst, over the budget of 62 (budget.max_credits); lower rerolls.max_credits to \
                  35 or raise the budget";
    assert_eq!(doc["verdict"]["reasons"], json!([reason]), "{doc:#}");
    assert!(
        stderr(&o).contains(&format!("error: the run does not fit: {reason}")),
        "{}",
        stderr(&o)
    );

    // `run` is refused the same way, before it pays for anything or records a run.
    let o = on_chain(&env, &["run"]).await;
    assert_exit(&o, 3);
    assert!(stderr(&o).contains(reason), "{}", stderr(&o));
    assert_eq!(
        o.ledger.as_deref().map(<[_]>::len),
        Some(0),
        "{:?}",
        o.ledger
    );
    assert_nothing_billed(&env);
    assert_eq!(rows_in(&dir.join("state.db"), "runs").await, 0);
    assert!(!dir.join("out").exists(), "nothing was written");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_balance_holds_the_total_and_the_worst_case_too() {
    // A balance of 50: the total (27) fits it, the total and the worst case (63) do not.
    let env = start(imgpipe::sandbox::Config {
        balance: 50,
        ..config()
    })
    .await;
    write(env.dir.path(), "p.yaml", &checked_chain(None, 60));
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 3);
    assert_eq!(
        doc["verdict"]["reasons"],
        json!([
            "the plan costs 27 credits and its rerolls up to 36 credits more, 63 credits at worst, \
             more than the balance of 50; lower rerolls.max_credits to 23 or top up the account"
        ]),
        "{doc:#}"
    );
    assert!(
        env.sandbox.ledger().is_empty(),
        "{:?}",
        env.sandbox.ledger()
    );
    assert_eq!(env.sandbox.balance(), 50);
}

/// Verdicts an earlier run recorded on outputs `first_output..` of `step` (one each, `true`
/// for a failed one), under the key the executor records them by.
async fn record_verdicts(
    state: &Path,
    pipeline: &Pipeline,
    step: &str,
    first_output: i64,
    failed: &[bool],
) {
    let r = pipeline
        .step_refs()
        .find(|&r| pipeline.step(r).id == step)
        .unwrap_or_else(|| panic!("no step {step}"));
    let key = checks_key(pipeline, r);
    let rows: Vec<VerdictRow> = failed
        .iter()
        .zip(first_output..)
        .map(|(&failed, id)| VerdictRow {
            output_id: OutputId::new(id).unwrap(),
            job_id: format!("job-{id}").into(),
            task_id: TaskId::new(id).unwrap(),
            position: 0,
            checks_key: key.clone(),
            check: "not_blank".into(),
            outcome: if failed {
                Outcome::Failed
            } else {
                Outcome::Passed
            },
            score: Some(1.0),
            reason: "recorded by the test".into(),
            acted: None,
        })
        .collect();
    let store = Store::open(state).await.unwrap();
    store
        .verdicts()
        .record(&"earlier".into(), &rows)
        .await
        .unwrap();
    store.close().await;
}

fn checks_key(pipeline: &Pipeline, r: StepRef) -> String {
    let step = pipeline.step(r);
    let checks = step.checks.as_ref().expect("a step with checks");
    checks.key(&pipeline.name, &step.id)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_expected_case_follows_the_verdicts_of_the_same_checks_in_the_state_database() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let file = write(dir, "p.yaml", &checked_chain(Some(100), 60));
    let pipeline = imgpipe::pipeline::load(&file)
        .pipeline
        .expect("a valid pipeline");
    let state = dir.join("state.db");

    let (_, doc) = plan_json(&env).await;
    assert_eq!(doc["rerolls"]["expected_credits"], Value::Null, "{doc:#}");

    // cutout: 1 of 2 outputs failed, a share of 0.5: 15 credits × (0.5 + 0.25) = 11.25.
    // Until big's checks have verdicts too, the expected case is unknown.
    record_verdicts(&state, &pipeline, "cutout", 1, &[true, false]).await;
    let (_, doc) = plan_json(&env).await;
    assert_eq!(doc["rerolls"]["expected_credits"], Value::Null, "{doc:#}");

    // big: 1 of 4 failed, 0.25: 6 credits × 0.25 = 1.5. 11.25 + 1.5 = 12.75, 13 credits.
    record_verdicts(&state, &pipeline, "big", 10, &[true, false, false, false]).await;
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(
        doc["rerolls"],
        json!({ "worst_case_credits": 36, "expected_credits": 13 }),
        "{doc:#}"
    );
    let text = on_chain(&env, &["plan"]).await;
    assert!(
        stdout(&text).contains("\nexpected 13 credits of rerolls"),
        "{}",
        stdout(&text)
    );

    // Other settings are other checks: a stricter cut-out starts afresh.
    let stricter = checked_chain(Some(100), 60).replace(
        "checks: [not_blank, transparent]",
        "checks: [not_blank, { transparent: { min: 0.05, max: 0.95 } }]",
    );
    write(dir, "p.yaml", &stricter);
    let (o, doc) = plan_json(&env).await;
    assert_exit(&o, 0);
    assert_eq!(doc["rerolls"]["expected_credits"], Value::Null, "{doc:#}");
    assert_nothing_billed(&env);
}
