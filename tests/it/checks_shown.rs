//! Checks' verdicts as people and machines read them (issue 46, "Recorded and shown"): a run
//! whose upscales the sandbox spoils, and one whose command check fails, cannot judge or passes
//! chosen items, are held against what `status` (text and `--json`), the report, the desk's
//! items and its "failed a check" filter, the metrics file and `run.finished` say of them.
//! Every figure is compared with the state database's rows and the sandbox's ledger.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use imgpipe::sandbox::{self, BadImages};
use serde_json::{Value, json};

use crate::binary::Imgpipe;
use crate::browser::Browser;
use crate::common::*;
use crate::desk::{Served, serve_on};
use crate::events::{parse_metrics, promtool_accepts, receiver};
use crate::run::{both, state_path, write};
use crate::said::{said, seen};

/// Side of the sandbox's images: small, so that chains stay quick.
const SIDE: u32 = 32;

/// Items of the spoilt run: more than `status` lists (10), so it says how many more.
const ITEMS: usize = 12;

/// Flagged outputs `status` lists at most.
const LISTED: usize = 10;

const SECRET: &str = "a-secret-for-the-checks-receiver";

/// The sandbox making `bad_images`, drawn from seed 5.
fn spoiling(bad_images: BadImages) -> sandbox::Config {
    crate::checks::sandbox_config(bad_images, 5)
}

/// A pipeline named `name` of `items` items (`i00`, `i01`, …), each erased (2 credits) with
/// `clean_checks` after its `erase:` line, upscaled 2× (2 credits) with `big_checks`, then cut
/// out (5 credits).
fn pipeline(name: &str, items: usize, clean_checks: &str, big_checks: &str) -> String {
    let mut text = format!(
        "version: 1\nname: {name}\noutput_dir: out\nrerolls: {{ max_credits: 100 }}\nitems:\n"
    );
    for i in 0..items {
        text +=
            &format!("  - {{ id: i{i:02}, url: \"https://sandbox.invalid/assets/mug.png\" }}\n");
    }
    text += &format!(
        "steps:\n  - id: clean\n    erase: {{ image_url: \"{{{{ item.url }}}}\", object_name: dust }}\n{clean_checks}  \
         - id: big\n    upscale: {{ from: clean, desired_increase: 2 }}\n{big_checks}  \
         - id: cutout\n    remove_background: {{ from: big }}\n"
    );
    text
}

/// The run's verdicts counted as the issue asks: by verdict, flagged outputs, rerolls and
/// their credits, from the state database's rows.
fn counted(db: &Db) -> Value {
    let verdicts = |v: &str| db.verdicts.iter().filter(|r| r.verdict == v).count();
    let flagged: BTreeSet<i64> = db
        .verdicts
        .iter()
        .filter(|r| r.acted.as_deref() == Some("flagged"))
        .map(|r| r.output_id)
        .collect();
    json!({
        "passed": verdicts("passed"),
        "failed": verdicts("failed"),
        "not_checked": verdicts("not_checked"),
        "flagged": flagged.len(),
        "rerolls": db.check_rerolls.len(),
        "reroll_credits": db.check_rerolls.iter().map(|r| r.credits).sum::<u64>(),
    })
}

/// `status r --json`'s `checks`.
async fn status_checks(env: &Env, dir: &Path) -> Value {
    let o = Imgpipe::on(env, &["status", "r", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit(&o, 0);
    let status: Value = serde_json::from_str(&stdout(&o)).unwrap();
    status["checks"].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn spoilt_upscales_are_counted_and_their_reasons_shown_in_status_the_report_metrics_and_run_finished()
 {
    let env = start(spoiling(BadImages {
        wrong_size: 1.0,
        ..BadImages::default()
    }))
    .await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &pipeline("spoilt", ITEMS, "", "    checks: [size]\n"),
    );
    let metrics = dir.join("imgpipe.prom");
    let hook = receiver(false).await;
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r",
            "--report",
            "--notify",
            &hook.url,
            "--metrics-file",
            &metrics.to_string_lossy(),
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read_file(&state_path(dir)).await;
    // Each upscale paid twice (max_rerolls 1), each judged wrong twice, the second flagged.
    let expected = json!({
        "passed": 0, "failed": 2 * ITEMS, "not_checked": 0, "flagged": ITEMS,
        "rerolls": ITEMS, "reroll_credits": 2 * ITEMS,
    });
    let unjudged: Vec<_> = db
        .outputs
        .iter()
        .filter(|o| {
            db.live().any(|t| t.id == o.task_id && t.step == "big")
                && !db
                    .verdicts
                    .iter()
                    .any(|v| v.output_id == o.id && v.task_id == o.task_id)
        })
        .collect();
    assert!(
        unjudged.is_empty(),
        "upscales kept without a verdict of their own (a verdict of another task's output, \
         set aside, holding the same id?): {unjudged:?}\n{:?}\n{}",
        db.verdicts,
        both(&o)
    );
    assert_eq!(counted(&db), expected, "{:?}", db.verdicts);
    let upscales = env
        .sandbox
        .ledger()
        .iter()
        .filter(|e| e.operation == "upscale")
        .count();
    assert_eq!(upscales, 2 * ITEMS, "the rerolls were paid for");

    // status --json: the counts, and the first flagged outputs each with its verdicts.
    let checks = status_checks(&env, dir).await;
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&checks[k], v, "checks.{k}: {checks}");
    }
    let listed = checks["flagged_outputs"].as_array().unwrap();
    assert_eq!(listed.len(), LISTED, "{checks}");
    assert_eq!(checks["more_flagged"], ITEMS - LISTED, "{checks}");
    for (i, o) in listed.iter().enumerate() {
        assert_eq!(o["task"], format!("i{i:02}/big[0]"), "{o}");
        assert_eq!(o["output"], 0, "{o}");
        let verdict = &o["checks"][0];
        assert_eq!(
            (&verdict["check"], &verdict["verdict"], &verdict["acted"]),
            (&json!("size"), &json!("failed"), &json!("flagged")),
            "{o}"
        );
        let reason = verdict["reason"].as_str().unwrap();
        let recorded = db
            .verdicts
            .iter()
            .find(|v| v.acted.as_deref() == Some("flagged") && v.reason == reason);
        assert!(recorded.is_some(), "{reason} is a flagged verdict's reason");
        assert!(reason.contains(&format!("{SIDE}x{SIDE}")), "{reason}");
    }

    // status, as people read it: counts, ten flagged outputs, how many more.
    let text = Imgpipe::on(&env, &["status", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit(&text, 0);
    said(dir, "checked_status_text", &seen(&text));

    // The report: the counts in its header, each flagged output's badge and reason.
    let report = std::fs::read_to_string(dir.join("out/r/report.html")).unwrap();
    assert!(
        report.contains(&format!(
            "<dd>0 passed, {} failed, 0 not checked</dd>",
            2 * ITEMS
        )),
        "the report's counts"
    );
    assert!(
        report.contains(&format!("<dd>{ITEMS} for {} cr</dd>", 2 * ITEMS)),
        "the report's rerolls"
    );
    let badges = report.matches(r#"<span class="badge b-failed">flagged</span>"#);
    assert_eq!(badges.count(), ITEMS, "a badge per flagged output");
    let reason = &db
        .verdicts
        .iter()
        .find(|v| v.acted.as_deref() == Some("flagged"))
        .unwrap()
        .reason;
    assert!(
        report.contains(&format!(r#"<span class="why">size: {reason}</span>"#)),
        "the reason {reason:?} beside its badge"
    );

    // The metrics file and run.finished count the same.
    let text = std::fs::read_to_string(&metrics).unwrap();
    promtool_accepts(&text);
    let m = parse_metrics(&text);
    let p = "pipeline=\"spoilt\"";
    for verdict in ["passed", "failed", "not_checked"] {
        assert_eq!(
            m[&format!("imgpipe_checks_total{{{p},verdict=\"{verdict}\"}}")],
            expected[verdict].as_f64().unwrap(),
            "{verdict}:\n{text}"
        );
    }
    assert_eq!(
        m[&format!("imgpipe_check_rerolls_total{{{p}}}")],
        ITEMS as f64
    );
    assert_eq!(
        m[&format!("imgpipe_check_reroll_credits_total{{{p}}}")],
        (2 * ITEMS) as f64
    );
    let finished = hook.wait_for("run.finished").await.json();
    assert_eq!(finished["checks"], expected, "{finished}");
}

/// A command check judging `clean`'s outputs by their item: `i01` and `i04` fail (with a
/// reason that is markup), `i00` cannot be judged (exit 3), every other item passes.
const JUDGE: &str = r#"case "$1" in
  */i01/*|*/i04/*) echo '{"score": 0.1, "reason": "a smudge <b>here</b>"}'; exit 1 ;;
  */i00/*) exit 3 ;;
esac
echo '{"score": 0.9}'
exit 0
"#;

/// The items a person must look at: a check failed their output or could not judge it.
const TO_LOOK_AT: [&str; 3] = ["i00", "i01", "i04"];

/// Runs 6 items with [`JUDGE`] flagging `clean`'s outputs, on the state `state`, then asks the
/// desk for the items that failed a check, and makes the report.
async fn the_desk_filters_what_failed_a_check(state: Option<String>) {
    let env = start(spoiling(BadImages::default())).await;
    let dir = env.dir.path();
    let judge = write(dir, "judge.sh", JUDGE);
    let checks = format!(
        "    checks:\n      - command: [\"sh\", \"{}\", \"{{file}}\"]\n    on_fail: flag\n",
        judge.display()
    );
    write(dir, "p.yaml", &pipeline("judged", 6, &checks, ""));
    let on_postgres = state.is_some();
    let state = state.unwrap_or_else(|| state_path(dir).to_string_lossy().into_owned());
    let imgpipe = |args: &[&str]| Imgpipe::on(&env, args).cwd(dir).state(&state);
    // One call at a time: the first verdict written has no score, the next ones have one.
    let o = imgpipe(&["run", "p.yaml", "--run-id", "r", "--concurrency", "1"])
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let db = Db::read(&state).await;
    assert_eq!(
        counted(&db),
        json!({ "passed": 3, "failed": 2, "not_checked": 1, "flagged": 3, "rerolls": 0, "reroll_credits": 0 }),
        "{:?}",
        db.verdicts
    );
    // Flagged outputs are kept and read on: every task succeeded, nothing was paid again.
    assert!(db.live().all(|t| t.status == "succeeded"), "{:?}", db.tasks);
    assert_eq!(env.sandbox.ledger().len(), 6 * 3);

    let desk = serve_on(imgpipe(&["review", "--no-open"])).await;
    let get = |query: &'static str| {
        let url = format!("{}/api/runs/r/items?{query}", desk.base);
        let token = desk.token.clone();
        async move {
            let r = http()
                .get(&url)
                .header("authorization", format!("Bearer {token}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "GET {url}");
            r.json::<Value>().await.unwrap()
        }
    };
    let page = get("flagged=1").await;
    let items: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["item"].as_str().unwrap())
        .collect();
    assert_eq!(items, TO_LOOK_AT, "{page}");
    for item in page["items"].as_array().unwrap() {
        let clean = item["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["step"] == "clean")
            .unwrap();
        let verdict = &clean["outputs"][0]["checks"][0];
        assert_eq!(verdict["check"], "command", "{verdict}");
        assert_eq!(verdict["acted"], "flagged", "{verdict}");
        if item["item"] == "i00" {
            assert_eq!(verdict["verdict"], "not_checked", "{verdict}");
        } else {
            assert_eq!(verdict["verdict"], "failed", "{verdict}");
            assert_eq!(verdict["reason"], "a smudge <b>here</b>", "{verdict}");
            assert_eq!(verdict["score"], 0.1, "{verdict}");
        }
    }
    // Every item, each output with its verdicts: a pass says so too.
    let all = get("limit=50").await;
    assert_eq!(all["items"].as_array().unwrap().len(), 6, "{all}");
    assert_eq!(
        all["items"][2]["tasks"][0]["outputs"][0]["checks"][0]["verdict"], "passed",
        "{all}"
    );
    // Combined with another filter, and refused when it is not a flag.
    assert_eq!(
        get("flagged=1&q=i04").await["items"][0]["item"],
        "i04",
        "flagged and text"
    );
    let bad = http()
        .get(format!("{}/api/runs/r/items?flagged=maybe", desk.base))
        .header("authorization", format!("Bearer {}", desk.token))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // The run's page offers the filter.
    let page = http()
        .get(format!("{}/runs/r", desk.base))
        .header("authorization", format!("Bearer {}", desk.token))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(r#"data-filter="flagged">failed a check</button>"#),
        "{page}"
    );
    assert!(page.contains(r#"name="flagged" value="1""#), "{page}");
    if !on_postgres {
        cards_say_why(&desk).await;
    }
    desk.stop().await;

    // The report escapes the reason: markup in it is text.
    let o = imgpipe(&["report", "r"]).run().await;
    assert_exit(&o, 0);
    let report = std::fs::read_to_string(dir.join("out/r/report.html")).unwrap();
    assert!(
        report.contains("command: a smudge &lt;b&gt;here&lt;/b&gt;"),
        "the reason, escaped"
    );
    assert!(!report.contains("<b>here</b>"), "no markup from a reason");
    assert_eq!(
        report
            .matches(r#"<span class="badge b-pending">not checked</span>"#)
            .count(),
        1
    );
}

/// In Chromium, the run's page filtered by "failed a check" shows the items to look at, each
/// card with its check's verdict and reason, a reason's markup as text.
async fn cards_say_why(desk: &Served) {
    let Some(browser) = Browser::start().await else {
        return;
    };
    // The browser resolves no name but `localhost`.
    let base = desk.base.replace("127.0.0.1", "localhost");
    browser
        .visit(&format!("{base}/runs/r?token={}", desk.token))
        .await;
    browser
        .wait_for(
            "every item drawn",
            "return document.querySelectorAll('#list .item').length === 6;",
            Duration::from_secs(20),
        )
        .await;
    browser.click(r#"button.show[data-filter="flagged"]"#).await;
    browser
        .wait_for(
            "the items that failed a check",
            "return document.querySelectorAll('#list .item').length === 3;",
            Duration::from_secs(20),
        )
        .await;
    let cards = browser
        .run(
            "return { items: [...document.querySelectorAll('#list .item')].map(i => i.dataset.item), \
               checks: [...document.querySelectorAll('#list .check')].map(c => c.textContent), \
               markup: document.querySelectorAll('#list .check b').length };",
        )
        .await;
    assert_eq!(cards["items"], json!(TO_LOOK_AT), "{cards}");
    assert_eq!(
        cards["checks"],
        json!([
            "not checked command: exited with status 3, neither 0 (pass) nor 1 (fail)",
            "flagged command: a smudge <b>here</b>",
            "flagged command: a smudge <b>here</b>",
        ]),
        "{cards}"
    );
    assert_eq!(cards["markup"], 0, "a reason's markup stays text: {cards}");
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_desk_filters_exactly_the_outputs_that_failed_a_check_or_were_not_checked() {
    the_desk_filters_what_failed_a_check(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_the_desk_filters_exactly_the_outputs_that_failed_a_check() {
    let Some(pg) = postgres_database("checks_shown").await else {
        return;
    };
    the_desk_filters_what_failed_a_check(Some(pg.to_string())).await;
    drop(pg);
}
