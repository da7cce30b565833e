//! A price shown is a price kept, whoever spends on a run at once (issue 42): confirms racing
//! on the desk, a command line racing the desk, a double click, and a confirm made after the
//! run changed. Each is held at the sandbox's gate, so the race is decided by the run's lock
//! and never by the machine's speed; the sandbox's ledger says what was paid.

use std::process::Stdio;

use crate::common::*;
use crate::desk::{CLEAN0, Catalogue, ITEM, billed, confirmed_at, serve_with};

/// `mug/shot` of a run stopped after mug's generation: its two images, nothing downstream.
const SHOT: u64 = 8;

/// Run `s`: mug's generation only (`--items mug --until shot`), stopped with exit 7.
async fn stopped_after_mugs_shot(c: &Catalogue<'_>, env: &Env) {
    let ran = c
        .imgpipe(&[
            "run",
            "shots.yaml",
            "--items",
            "mug",
            "--until",
            "shot",
            "--run-id",
            "s",
        ])
        .run()
        .await;
    assert_exit(&ran, 7);
    assert_eq!(billed(env), SHOT);
}

/// The answers' statuses, sorted.
fn statuses(answers: &[&(u16, serde_json::Value)]) -> Vec<u16> {
    let mut s: Vec<u16> = answers.iter().map(|(status, _)| *status).collect();
    s.sort_unstable();
    s
}

/// A continuation (the rest of the run) and a reroll of `mug/shot` (8 credits while mug has
/// nothing downstream), priced, then confirmed at the same instant on a desk started with
/// `--wait`: one holds the lock and runs (202); the other is refused at once (409), never
/// queued to pay, once the first has made mug's downstream tasks, more than was confirmed.
/// What is billed is exactly what was accepted, and the loser confirmed again is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_continuation_and_a_reroll_confirmed_together_pay_only_what_was_accepted() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    stopped_after_mugs_shot(&c, &env).await;
    let desk = serve_with(&c, &["--retry-base-ms", "1", "--wait"]).await;
    let (go_on, reroll) = ("/api/runs/s/continue", "/api/runs/s/reroll");
    let shot = serde_json::json!({"tasks": ["mug/shot"]});
    let (_, rest) = desk.post(go_on, serde_json::json!({"dry_run": true})).await;
    let (_, again) = desk
        .post(reroll, crate::desk::with(&shot, "dry_run", true.into()))
        .await;
    assert_eq!(rest["credits"], 3 * ITEM - SHOT, "{rest}");
    assert_eq!(again["credits"], SHOT, "{again}");

    env.sandbox.hold_calls();
    let before = billed(&env);
    let (a, b) = tokio::join!(
        desk.post(go_on, confirmed_at(&serde_json::json!({}), &rest)),
        desk.post(reroll, confirmed_at(&shot, &again)),
    );
    assert_eq!(
        statuses(&[&a, &b]),
        [202, 409],
        "one runs, one is refused:\n{a:?}\n{b:?}"
    );
    let (won, lost) = if a.0 == 202 { (&a, &b) } else { (&b, &a) };
    assert!(
        lost.1["error"]
            .as_str()
            .unwrap_or_default()
            .contains("nothing was spent"),
        "{lost:?}"
    );
    env.sandbox.release_calls();
    let work = desk.work_ended("s").await;
    assert!(work["state"] == "done", "{work}");
    let accepted = won.1["credits"].as_u64().unwrap();
    assert_eq!(
        billed(&env) - before,
        accepted,
        "billed exactly what was accepted"
    );

    // The loser, confirmed again as it was priced: refused, the run has changed since.
    let (body, priced) = if a.0 == 409 {
        (serde_json::json!({}), &rest)
    } else {
        (shot.clone(), &again)
    };
    let path = if a.0 == 409 { go_on } else { reroll };
    let (status, late) = desk.post(path, confirmed_at(&body, priced)).await;
    assert_eq!(status, 409, "{late}");
    assert_eq!(
        billed(&env) - before,
        accepted,
        "nothing more billed: {late}"
    );
    desk.stop().await;
}

/// A reroll confirmed on the command line at the price its dry run showed (`--expect-credits`,
/// `--expect-revision`), waiting (`--wait`) behind a continuation the desk runs: once it holds
/// the lock and plans again, mug has downstream tasks and the reroll costs a whole chain. It
/// pays nothing (exit 3) and says the price now.
#[tokio::test(flavor = "multi_thread")]
async fn a_cli_reroll_waiting_behind_a_desk_continuation_pays_nothing_it_did_not_confirm() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    stopped_after_mugs_shot(&c, &env).await;
    let dry = c
        .plain(&["reroll", "s", "mug/shot", "--dry-run", "--json"])
        .run()
        .await;
    assert_exit(&dry, 0);
    let dry = json_stdout(&dry);
    assert_eq!(dry["credits"], SHOT, "{dry}");
    let revision = dry["revision"]
        .as_str()
        .expect("the dry run's revision")
        .to_owned();

    let desk = serve_with(&c, &["--retry-base-ms", "1"]).await;
    let go_on = "/api/runs/s/continue";
    env.sandbox.hold_calls();
    let before = billed(&env);
    let (status, started) = desk.confirm(go_on, serde_json::json!({})).await;
    assert_eq!(status, 202, "{started}");
    let continued = started["credits"].as_u64().unwrap();

    let shot = SHOT.to_string();
    let mut cmd = c
        .imgpipe(&[
            "reroll",
            "s",
            "mug/shot",
            "--wait",
            "--expect-credits",
            &shot,
            "--expect-revision",
            &revision,
        ])
        .command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let cli = cmd.spawn().unwrap();
    env.sandbox.release_calls();
    let work = desk.work_ended("s").await;
    assert!(work["state"] == "done", "{work}");
    let cli = finish_child(cli, "the command line's reroll").await;
    assert_exit(&cli, 3);
    let err = stderr(&cli);
    assert!(
        has_phrase(
            &err,
            &format!("the price is now {ITEM} credits, not {SHOT}: nothing was spent")
        ),
        "{err}"
    );
    assert_eq!(
        billed(&env) - before,
        continued,
        "only the continuation was paid"
    );
    desk.stop().await;
}

/// One reroll confirmed three times at once (a double click, and one more): one 202, the
/// others 409 at once, billed once. Confirmed again once it is done: refused, not paid twice.
#[tokio::test(flavor = "multi_thread")]
async fn one_reroll_confirmed_three_times_at_once_is_paid_once() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let desk = serve_with(&c, &["--retry-base-ms", "1", "--wait"]).await;
    let reroll = "/api/runs/r/reroll";
    let body = serde_json::json!({"tasks": ["mug/clean[0]"]});
    let (_, priced) = desk
        .post(reroll, crate::desk::with(&body, "dry_run", true.into()))
        .await;
    assert_eq!(priced["credits"], CLEAN0, "{priced}");
    let confirm = confirmed_at(&body, &priced);

    env.sandbox.hold_calls();
    let before = billed(&env);
    let (a, b, d) = tokio::join!(
        desk.post(reroll, confirm.clone()),
        desk.post(reroll, confirm.clone()),
        desk.post(reroll, confirm.clone()),
    );
    assert_eq!(
        statuses(&[&a, &b, &d]),
        [202, 409, 409],
        "{a:?}\n{b:?}\n{d:?}"
    );
    env.sandbox.release_calls();
    let work = desk.work_ended("r").await;
    assert!(work["state"] == "done", "{work}");
    assert_eq!(billed(&env) - before, CLEAN0, "billed once");

    let (status, late) = desk.post(reroll, confirm).await;
    assert_eq!(status, 409, "a change done is not done again: {late}");
    assert_eq!(billed(&env) - before, CLEAN0, "still billed once");
    desk.stop().await;
}

/// `reroll --dry-run --json`, then another process changes the run, then the confirm with the
/// revision shown: exit 3, nothing spent. The price alone (`--expect-credits`) still binds:
/// another price is exit 3 with the price now; the price now is paid, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_confirm_after_another_process_changed_the_run_is_refused() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let dry = c
        .plain(&["reroll", "r", "mug/clean[0]", "--dry-run", "--json"])
        .run()
        .await;
    assert_exit(&dry, 0);
    let dry = json_stdout(&dry);
    let revision = dry["revision"].as_str().unwrap().to_owned();
    let other = c.imgpipe(&["reroll", "r", "lamp/clean[0]"]).run().await;
    assert_exit(&other, 0);
    let before = billed(&env);

    let clean0 = CLEAN0.to_string();
    let stale = c
        .imgpipe(&[
            "reroll",
            "r",
            "mug/clean[0]",
            "--expect-credits",
            &clean0,
            "--expect-revision",
            &revision,
        ])
        .run()
        .await;
    assert_exit(&stale, 3);
    assert!(
        has_phrase(&stale.stderr(), "the run changed since it was priced"),
        "{}",
        stale.stderr()
    );
    let status = c.plain(&["status", "r", "--json"]).run().await;
    assert_exit(&status, 0);
    let status = json_stdout(&status);
    assert_eq!(
        status["status"], "succeeded",
        "a refused confirm leaves the run as it was, never reopened: {status}"
    );
    let cheaper = c
        .imgpipe(&["reroll", "r", "mug/clean[0]", "--expect-credits", "1"])
        .run()
        .await;
    assert_exit(&cheaper, 3);
    assert!(
        has_phrase(
            &cheaper.stderr(),
            &format!("the price is now {CLEAN0} credits, not 1: nothing was spent")
        ),
        "{}",
        cheaper.stderr()
    );
    assert_eq!(billed(&env), before, "nothing spent");

    let paid = c
        .imgpipe(&["reroll", "r", "mug/clean[0]", "--expect-credits", &clean0])
        .run()
        .await;
    assert_exit(&paid, 0);
    assert_eq!(billed(&env) - before, CLEAN0, "the price confirmed, once");
}

/// `run --expect-credits`: a fresh run pays only the plan's price, checked once it holds the
/// lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_fresh_run_pays_only_the_price_it_expects() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    let low = c
        .imgpipe(&["run", "shots.yaml", "--expect-credits", "1"])
        .run()
        .await;
    assert_exit(&low, 3);
    let whole = 3 * ITEM;
    assert!(
        has_phrase(
            &low.stderr(),
            &format!("the price is now {whole} credits, not 1: nothing was spent")
        ),
        "{}",
        low.stderr()
    );
    assert_eq!(billed(&env), 0, "nothing spent");
    let total = whole.to_string();
    let ran = c
        .imgpipe(&["run", "shots.yaml", "--expect-credits", &total])
        .run()
        .await;
    assert_exit(&ran, 0);
    assert_eq!(billed(&env), whole);
}
