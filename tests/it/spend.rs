//! `imgpipe spend` end to end: two pipelines run for real against the sandbox, the first with
//! its first call billed and then dropped, and the ledger held against the sandbox's own (the
//! truth about money), against `runs --json` and against `status --json`; on SQLite, and on
//! PostgreSQL when `IMGPIPE_TEST_POSTGRES` is set.

use std::collections::BTreeSet;
use std::path::Path;

use imgpipe::sandbox::{self, Faults};
use serde_json::Value;

use crate::common::*;
use crate::run::{CHAIN_CREDITS, config, edit_chain, seed_for, write};

/// What the sandbox billed, split as imgpipe must count it: delivered bills are billed; an
/// undelivered one was seen by imgpipe as a call that may have been billed.
#[derive(Debug, Default, PartialEq, Eq)]
struct Billed {
    billed: u64,
    possibly: u64,
    possibly_calls: u64,
}

fn billed(entries: &[imgpipe::sandbox::LedgerEntry]) -> Billed {
    let mut b = Billed::default();
    for e in entries {
        if e.delivered || e.partial {
            b.billed += e.credits;
        } else {
            b.possibly += e.credits;
            b.possibly_calls += 1;
        }
    }
    b
}

async fn spend_json(env: &Env, dir: &Path, state: &str, by: &str) -> Value {
    let o = Imgpipe::on(env, &["spend", "--json", "--by", by])
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    json_stdout(&o)
}

/// The group named `name` of a ledger.
#[track_caller]
fn group<'a>(ledger: &'a Value, name: &str) -> &'a Value {
    ledger["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == name)
        .unwrap_or_else(|| panic!("no group {name} in {ledger:#}"))
}

#[track_caller]
fn assert_figures(figures: &Value, expected: &Billed, what: &str) {
    assert_eq!(
        figures["credits_billed"], expected.billed,
        "{what}: {figures:#}"
    );
    assert_eq!(
        figures["possibly_billed"], expected.possibly,
        "{what}: {figures:#}"
    );
    assert_eq!(
        figures["possibly_billed_calls"], expected.possibly_calls,
        "{what}: {figures:#}"
    );
}

fn today() -> String {
    imgpipe::time::rfc3339(std::time::SystemTime::now())[..10].to_owned()
}

/// Runs pipeline `chain` (two items; its first call billed and dropped, then paid again) and
/// pipeline `other` (one item), one call at a time, then checks every ledger `spend` gives of
/// them against the sandbox's. `state` is a SQLite file or a PostgreSQL URL.
async fn ledger_agrees_with_the_sandbox(state: &str) {
    let mut pattern = vec![true];
    pattern.extend([false; 12]);
    let env = start(sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.3,
            seed: seed_for(0.3, &pattern),
            ..Faults::default()
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    let mut days = BTreeSet::from([today()]);
    write(dir, "chain.yaml", &edit_chain(2, None));
    let other = edit_chain(1, None).replace("name: chain", "name: other");
    write(dir, "other.yaml", &other);
    let one_at_a_time = ["--concurrency", "1", "--retry-base-ms", "10"];
    let o = Imgpipe::on(&env, &["run", "chain.yaml"])
        .args(&one_at_a_time)
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let chain = billed(&env.sandbox.ledger());
    assert_eq!(chain.possibly_calls, 1, "{:#?}", env.sandbox.ledger());
    let o = Imgpipe::on(&env, &["run", "other.yaml"])
        .args(&one_at_a_time)
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    days.insert(today());
    let all = billed(&env.sandbox.ledger());
    let other = Billed {
        billed: all.billed - chain.billed,
        ..Billed::default()
    };
    assert_eq!(other.billed, CHAIN_CREDITS);

    // Per pipeline: each as the sandbox billed it, the dropped call possibly billed.
    let by_pipeline = spend_json(&env, dir, state, "pipeline").await;
    assert_eq!(
        by_pipeline["groups"].as_array().unwrap().len(),
        2,
        "{by_pipeline:#}"
    );
    assert_figures(group(&by_pipeline, "chain"), &chain, "chain");
    assert_figures(group(&by_pipeline, "other"), &other, "other");
    assert_figures(&by_pipeline["totals"], &all, "totals by pipeline");
    // The retry of the dropped call is a call; the dropped one a failure.
    assert_eq!(group(&by_pipeline, "chain")["calls"], 7, "{by_pipeline:#}");
    assert_eq!(
        group(&by_pipeline, "chain")["failures"],
        1,
        "{by_pipeline:#}"
    );
    assert_eq!(
        group(&by_pipeline, "other")["credits_planned"],
        CHAIN_CREDITS
    );

    // Per day: the days the test ran on (one, unless it crossed midnight UTC), summing to it.
    let by_day = spend_json(&env, dir, state, "day").await;
    let groups = by_day["groups"].as_array().unwrap();
    assert!(
        groups
            .iter()
            .all(|g| days.contains(g["group"].as_str().unwrap())),
        "days {days:?}: {by_day:#}"
    );
    let sum = |field: &str| {
        groups
            .iter()
            .map(|g| g[field].as_u64().unwrap())
            .sum::<u64>()
    };
    let summed = Billed {
        billed: sum("credits_billed"),
        possibly: sum("possibly_billed"),
        possibly_calls: sum("possibly_billed_calls"),
    };
    assert_eq!(summed, all, "{by_day:#}");
    assert_eq!(by_day["totals"], by_pipeline["totals"]);

    // Every grouping has the same totals, and they are the sums of `runs` and `status`.
    for by in ["week", "month", "step", "run"] {
        assert_eq!(
            spend_json(&env, dir, state, by).await["totals"],
            by_day["totals"],
            "{by}"
        );
    }
    assert_totals_agree_with_runs_and_status(&env, dir, state, &by_day["totals"]).await;
    assert_csv_and_windows(&env, dir, state, &by_day).await;
}

async fn assert_totals_agree_with_runs_and_status(env: &Env, dir: &Path, state: &str, t: &Value) {
    let o = Imgpipe::on(env, &["runs", "--json"])
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let runs = json_stdout(&o);
    let runs = runs.as_array().unwrap();
    assert_eq!(runs.len(), 2);
    let sum = |field: &str| runs.iter().map(|r| r[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!(t["credits_planned"], sum("credits_planned"), "{runs:#?}");
    assert_eq!(t["credits_billed"], sum("credits_billed"), "{runs:#?}");
    assert_eq!(t["possibly_billed"], sum("possibly_billed"), "{runs:#?}");
    let (mut planned, mut billed, mut possibly) = (0, 0, 0);
    for run in runs {
        let o = Imgpipe::on(env, &["status", run["id"].as_str().unwrap(), "--json"])
            .cwd(dir)
            .state(state)
            .run()
            .await;
        assert_exit_without_panic(&o, 0);
        let s = json_stdout(&o);
        planned += s["planned_credits"].as_u64().unwrap();
        billed += s["billed_credits"].as_u64().unwrap();
        possibly += s["possibly_billed_credits"].as_u64().unwrap();
    }
    assert_eq!(t["credits_planned"], planned);
    assert_eq!(t["credits_billed"], billed);
    assert_eq!(t["possibly_billed"], possibly);
}

async fn assert_csv_and_windows(env: &Env, dir: &Path, state: &str, by_day: &Value) {
    let o = Imgpipe::on(env, &["spend", "--csv"])
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let mut csv = csv::Reader::from_reader(o.stdout.as_slice());
    let header = csv.headers().unwrap().clone();
    assert_eq!(&header[0], "group");
    let rows: Vec<csv::StringRecord> = csv.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), by_day["groups"].as_array().unwrap().len() + 1);
    let total = rows.last().unwrap();
    assert_eq!(&total[0], "total");
    for (name, value) in header.iter().zip(total.iter()).skip(2) {
        assert_eq!(
            by_day["totals"][name].as_u64(),
            value.parse().ok(),
            "{name}"
        );
    }

    // A window from today holds everything; one that ended yesterday, nothing.
    let days: Vec<&str> = by_day["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["group"].as_str().unwrap())
        .collect();
    let o = Imgpipe::on(env, &["spend", "--json", "--since", days[0]])
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["totals"], by_day["totals"]);
    let o = Imgpipe::on(env, &["spend", "--json", "--until", "2026-01-01"])
        .cwd(dir)
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["groups"], Value::Array(Vec::new()));
    assert_eq!(json_stdout(&o)["totals"]["credits_billed"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_agrees_with_the_sandbox_runs_and_status_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db");
    ledger_agrees_with_the_sandbox(state.to_str().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_ledger_agrees_with_the_sandbox_runs_and_status_on_postgres() {
    let Some(url) = postgres_database("spend").await else {
        return;
    };
    ledger_agrees_with_the_sandbox(&url).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_dates_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db");
    let state = state.to_str().unwrap();
    for (args, flag) in [
        (["--since", "2026-13-01"], "--since"),
        (["--until", "yesterday"], "--until"),
        (["--since", "2026-11-25T25:00:00Z"], "--since"),
    ] {
        let o = imgpipe(
            None,
            &[&["spend", "--state", state][..], &args].concat(),
            dir.path(),
        )
        .await;
        assert_exit_without_panic(&o, 2);
        assert!(stderr(&o).contains(flag), "{args:?}: {}", stderr(&o));
    }
    let o = imgpipe(
        None,
        &[
            "spend",
            "--state",
            state,
            "--since",
            "2026-11-25",
            "--until",
            "2026-11-24",
        ],
        dir.path(),
    )
    .await;
    assert_exit_without_panic(&o, 2);
    assert!(
        stderr(&o).contains("--since must come before --until"),
        "{}",
        stderr(&o)
    );
}

/// `--until` an instant excludes it: a call sent at that very millisecond is not counted, one
/// a millisecond later the bound is; `--until DAY` includes the whole day.
#[tokio::test(flavor = "multi_thread")]
async fn until_an_instant_excludes_it_and_until_a_day_includes_the_day() {
    use sqlx::Row as _;
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(1, None));
    let o = Imgpipe::on(&env, &["run", "chain.yaml", "--concurrency", "1"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let state = dir.join("state.db").to_string_lossy().into_owned();
    let mut conn = state_connection(&state).await;
    let first: i64 = sqlx::query("SELECT MIN(started_at) FROM attempts")
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .try_get(0)
        .unwrap();
    let at = |ms: i64| {
        chrono::DateTime::from_timestamp_millis(ms)
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    };
    let calls = |args: Vec<String>| {
        let env = &env;
        let state = &state;
        async move {
            let mut all = vec!["spend".to_owned(), "--json".to_owned()];
            all.extend(args);
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            let o = Imgpipe::on(env, &all).state(state).run().await;
            assert_exit_without_panic(&o, 0);
            json_stdout(&o)["totals"]["calls"].as_u64().unwrap()
        }
    };
    let until = |ms: i64| vec!["--until".to_owned(), at(ms)];
    assert_eq!(
        calls(until(first)).await,
        0,
        "the first call's instant is excluded"
    );
    // (At least: a fast sandbox may answer the first call within its millisecond.)
    assert!(
        calls(until(first + 1)).await >= 1,
        "a millisecond later it counts"
    );
    let day = at(first)[..10].to_owned();
    assert_eq!(
        calls(vec![
            "--since".to_owned(),
            day.clone(),
            "--until".to_owned(),
            day
        ])
        .await,
        3,
        "--until DAY includes the day"
    );
}
