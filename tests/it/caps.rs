//! Spending caps: set, listed and removed by the binary; runs started at once under a cap
//! smaller than their sum, on SQLite and on PostgreSQL, never bill more than it together (the
//! sandbox's ledger says so) and stop with exit 6; a run stopped by a cap continues in the
//! next window (the clock moved by `IMGPIPE_TEST_CAP_CLOCK_OFFSET_SECS`, a test-only setting)
//! and pays each task once.

use std::path::Path;

use imgpipe::sandbox::{self, Faults};

use crate::common::*;
use crate::run::{CHAIN_CREDITS, config, edit_chain, write};

const CAP_EXIT: i32 = 6;

/// A pipeline of [`edit_chain`] named `name`.
fn chain_named(dir: &Path, name: &str, items: usize) {
    let text = edit_chain(items, None).replace("name: chain\n", &format!("name: {name}\n"));
    write(dir, &format!("{name}.yaml"), &text);
}

fn billed(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn caps_are_set_listed_and_removed_and_a_bad_one_is_named() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let state = dir.join("state.db").to_string_lossy().into_owned();
    let cap = |args: &[&str]| Imgpipe::on(&env, args).state(&state).run();
    let o = cap(&[
        "cap",
        "set",
        "night",
        "--credits",
        "100",
        "--per",
        "day",
        "--tz",
        "Mars/Olympus",
    ])
    .await;
    assert_exit_without_panic(&o, 2);
    assert!(stderr(&o).contains("Mars/Olympus"), "{}", stderr(&o));
    let o = cap(&[
        "cap",
        "set",
        "night",
        "--credits",
        "100",
        "--per",
        "day",
        "--tz",
        "Europe/Paris",
    ])
    .await;
    assert_exit_without_panic(&o, 0);
    let o = cap(&[
        "cap",
        "set",
        "shots",
        "--credits",
        "40",
        "--per",
        "month",
        "--pipeline",
        "shots",
    ])
    .await;
    assert_exit_without_panic(&o, 0);
    let o = cap(&["cap", "list", "--json"]).await;
    assert_exit_without_panic(&o, 0);
    let listed = json_stdout(&o);
    assert_eq!(listed[0]["name"], "night", "{listed}");
    assert_eq!(listed[0]["tz"], "Europe/Paris");
    assert_eq!(listed[0]["left"], 100);
    assert_eq!(listed[1]["per"], "month");
    assert_eq!(listed[1]["pipeline"], "shots");
    let o = cap(&["cap", "remove", "nothing"]).await;
    assert_exit_without_panic(&o, 2);
    let o = cap(&["cap", "remove", "night"]).await;
    assert_exit_without_panic(&o, 0);
    let o = cap(&["cap", "list", "--json"]).await;
    assert_eq!(json_stdout(&o).as_array().map(Vec::len), Some(1));
}

/// Two runs of different pipelines, started at once on one state, each alone more than the
/// cap, with calls billed and then dropped: together they bill no more than the cap, and each
/// stops with exit 6.
async fn two_runs_under_one_cap(env: &Env, state: &str) {
    let dir = env.dir.path();
    chain_named(dir, "left", 8);
    chain_named(dir, "right", 8);
    let cap = 5 * CHAIN_CREDITS + 4;
    let set = [
        "cap",
        "set",
        "daily",
        "--credits",
        &cap.to_string(),
        "--per",
        "day",
    ];
    assert_exit_without_panic(&Imgpipe::on(env, &set).state(state).run().await, 0);
    let plan = Imgpipe::on(env, &["plan", "left.yaml", "--offline", "--json"])
        .state(state)
        .run()
        .await;
    let doc = json_stdout(&plan);
    assert_eq!(doc["caps"][0]["name"], "daily", "{doc}");
    assert_eq!(doc["caps"][0]["fits"], false, "{doc}");
    let run = |name: &str| {
        let file = format!("{name}.yaml");
        let run_id = format!("r-{name}");
        Imgpipe::on(
            env,
            &["run", &file, "--run-id", &run_id, "--concurrency", "4"],
        )
        .state(state)
    };
    let (a, b) = tokio::join!(run("left").run(), run("right").run());
    for o in [&a, &b] {
        assert_exit_without_panic(o, CAP_EXIT);
        assert!(both(o).contains("cap daily"), "{}", both(o));
    }
    let billed = billed(env);
    assert!(billed <= cap, "billed {billed} under a cap of {cap}");
    assert!(billed >= CHAIN_CREDITS, "something ran: {billed}");
    // The cap's window counts what was billed or possibly billed, never less than the ledger.
    let o = Imgpipe::on(env, &["cap", "list", "--json"])
        .state(state)
        .run()
        .await;
    let listed = json_stdout(&o);
    let spent = listed[0]["spent"].as_u64().unwrap();
    assert!(
        spent >= billed && spent <= cap,
        "spent {spent}, billed {billed}: {listed}"
    );
}

fn both(o: &std::process::Output) -> String {
    format!("{}\n{}", stdout(o), stderr(o))
}

fn dropping() -> sandbox::Config {
    sandbox::Config {
        faults: Faults {
            drop_after_billing: 0.15,
            seed: 7,
            ..Faults::default()
        },
        ..config()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn runs_at_once_on_sqlite_never_bill_more_than_their_cap_together() {
    let env = start(dropping()).await;
    let state = env
        .dir
        .path()
        .join("state.db")
        .to_string_lossy()
        .into_owned();
    two_runs_under_one_cap(&env, &state).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn runs_at_once_on_postgres_never_bill_more_than_their_cap_together() {
    let Some(url) = postgres_database("caps").await else {
        return;
    };
    let env = start(dropping()).await;
    two_runs_under_one_cap(&env, &url).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_stopped_by_its_cap_continues_in_the_next_window_paying_each_task_once() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let state = dir.join("state.db").to_string_lossy().into_owned();
    chain_named(dir, "night", 4);
    let cap = 2 * CHAIN_CREDITS + 1;
    let set = [
        "cap",
        "set",
        "nightly",
        "--credits",
        &cap.to_string(),
        "--per",
        "day",
        "--pipeline",
        "night",
    ];
    assert_exit_without_panic(&Imgpipe::on(&env, &set).state(&state).run().await, 0);
    let run = ["run", "night.yaml", "--run-id", "backlog"];
    let first = Imgpipe::on(&env, &run).state(&state).run().await;
    assert_exit_without_panic(&first, CAP_EXIT);
    assert!(both(&first).contains("reopens"), "{}", both(&first));
    assert_eq!(billed(&env), 2 * CHAIN_CREDITS, "two whole chains fit");
    // The same window again: nothing more fits, nothing is paid.
    let again = Imgpipe::on(&env, &run).state(&state).run().await;
    assert_exit_without_panic(&again, CAP_EXIT);
    assert_eq!(billed(&env), 2 * CHAIN_CREDITS);
    // A day later: the rest, each task paid once.
    let next = Imgpipe::on(&env, &run)
        .state(&state)
        .caps_clock_offset(86_400)
        .run()
        .await;
    assert_exit_without_panic(&next, 0);
    let ledger = env.sandbox.ledger();
    assert_eq!(billed(&env), 4 * CHAIN_CREDITS, "{ledger:?}");
    assert_eq!(
        ledger.len(),
        12,
        "three calls an item, each once: {ledger:?}"
    );
}

/// What cap `name` has spent in its window, as `cap list --json` says (open leases whole).
async fn spent(env: &Env, name: &str) -> u64 {
    let o = Imgpipe::on(env, &["cap", "list", "--json"])
        .sqlite_in(env.dir.path())
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    let cap = doc
        .as_array()
        .and_then(|caps| caps.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no cap {name} in {doc}"));
    cap["spent"].as_u64().unwrap()
}

/// Sets cap `wide` (400 credits a day: leases in blocks of 20, a twentieth), starts run `dead`
/// of three chains of [`CHAIN_CREDITS`] one call at a time, and kills it (SIGKILL) while its
/// first call is held at the sandbox's gate: it leaves one open lease of a whole block, and an
/// attempt without an answer (2 credits, an erase, at its planned price).
async fn a_run_killed_with_its_lease_open(env: &Env) {
    let dir = env.dir.path();
    chain_named(dir, "night", 3);
    let set = ["cap", "set", "wide", "--credits", "400", "--per", "day"];
    assert_exit_without_panic(&Imgpipe::on(env, &set).sqlite_in(dir).run().await, 0);
    let hold = env.sandbox.hold();
    let run = Imgpipe::on(
        env,
        &[
            "run",
            "night.yaml",
            "--run-id",
            "dead",
            "--concurrency",
            "1",
        ],
    )
    .sqlite_in(dir)
    .watched();
    wait_until("the first call of run dead held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    send_signal(run.id(), libc::SIGKILL);
    let killed = run.finish().await;
    assert_eq!(killed.status.code(), None, "killed: {killed:?}");
    release_after_kill(env, hold).await;
    assert_eq!(
        spent(env, "wide").await,
        400 / 20,
        "the dead run's lease, a twentieth of the cap (more than its chain's {CHAIN_CREDITS}), counts whole while open"
    );
}

/// A process that died stops beating; the next run that leases from the cap after 60 s of its
/// silence (not before) closes its lease with what its attempts say it spent. The 60 s pass on
/// the caps' clock (`IMGPIPE_TEST_CAP_CLOCK_OFFSET_SECS`), not the test's.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_runs_lease_is_reclaimed_by_the_next_run_after_60_s_of_silence() {
    let env = start(config()).await;
    let dir = env.dir.path();
    a_run_killed_with_its_lease_open(&env).await;
    chain_named(dir, "other", 1);
    let other = |run_id: &str, offset: i64| {
        Imgpipe::on(&env, &["run", "other.yaml", "--run-id", run_id])
            .sqlite_in(dir)
            .caps_clock_offset(offset)
            .run()
    };
    // 45 s on: still alive as far as anyone can tell: its block counts whole. (Not 59 s: the
    // real seconds between its last beat and this run's lease add to the offset, and a loaded
    // machine took more than one; 15 s of margin is a ceiling any machine meets.)
    assert_exit_without_panic(&other("o45", 45).await, 0);
    assert_eq!(spent(&env, "wide").await, 20 + CHAIN_CREDITS);
    // 61 s: dead. Its lease is closed with the 2 credits of its call without an answer; the
    // rest of its block returns to the window.
    assert_exit_without_panic(&other("o61", 61).await, 0);
    assert_eq!(spent(&env, "wide").await, 2 + 2 * CHAIN_CREDITS);
}

/// A resume of a run whose process died closes that process's leases at once (it holds the
/// run's lock, so their holder is gone), without waiting for 60 s of silence.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_closes_its_dead_processes_lease_at_once() {
    let env = start(config()).await;
    let dir = env.dir.path();
    a_run_killed_with_its_lease_open(&env).await;
    let o = Imgpipe::on(&env, &["resume", "dead"])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let billed = billed(&env);
    // The dead process's lease counts the 2 credits of its call without an answer, not its
    // whole block; the resume's counts what it billed.
    assert_eq!(
        spent(&env, "wide").await,
        2 + 3 * CHAIN_CREDITS,
        "billed {billed}: {:?}",
        env.sandbox.ledger()
    );
}

/// A process frozen past 60 s (SIGSTOP here; a suspended machine alike) may have had its
/// lease closed by a run that took it for dead: it beats before it sends anything more, finds
/// the lease closed, sends nothing (not even the rest of the chain it had committed), and
/// stops with exit 6. Its 61 s pass on the caps' clock, through the file it reads that clock's
/// offset from (`IMGPIPE_TEST_CAP_CLOCK_FILE`).
#[tokio::test(flavor = "multi_thread")]
async fn a_process_frozen_past_60_s_finds_its_lease_closed_sends_nothing_more_and_exits_6() {
    let env = start(config()).await;
    let dir = env.dir.path();
    chain_named(dir, "night", 3);
    chain_named(dir, "other", 1);
    let set = ["cap", "set", "wide", "--credits", "400", "--per", "day"];
    assert_exit_without_panic(&Imgpipe::on(&env, &set).sqlite_in(dir).run().await, 0);
    let clock = dir.join("frozen-clock");
    std::fs::write(&clock, "0").unwrap();
    let hold = env.sandbox.hold();
    let run = Imgpipe::on(
        &env,
        &[
            "run",
            "night.yaml",
            "--run-id",
            "frozen",
            "--concurrency",
            "1",
        ],
    )
    .sqlite_in(dir)
    .env("IMGPIPE_TEST_CAP_CLOCK_FILE", &clock)
    .watched();
    wait_until("the frozen run's first call held at the gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    freeze_between_writes(run.id(), &dir.join("state.db")).await;
    drop(hold);
    // 61 s later, for everyone: another run takes the frozen one for dead and closes its lease.
    std::fs::write(&clock, "61").unwrap();
    let other = Imgpipe::on(&env, &["run", "other.yaml", "--run-id", "other"])
        .sqlite_in(dir)
        .caps_clock_offset(61)
        .run()
        .await;
    assert_exit_without_panic(&other, 0);
    let calls = env.sandbox.ledger().len();
    send_signal(run.id(), libc::SIGCONT);
    let frozen = run.finish().await;
    assert_exit_without_panic(&frozen, 6);
    assert!(
        stderr(&frozen).contains("closed by another run"),
        "{}",
        stderr(&frozen)
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        calls,
        "the frozen run sent nothing after it woke: {:?}",
        env.sandbox.ledger()
    );
}

/// Credits count in the window they were leased in: a run that crosses midnight spends the
/// rest of the lease it took before midnight in that day, and leases what it needs after it
/// from the next. Its clock is the caps' (`IMGPIPE_TEST_CAP_CLOCK_FILE`): an hour before the
/// next midnight (UTC, the cap's zone) when it leases, an hour after when it goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_crossing_midnight_spends_each_lease_in_the_day_it_was_leased() {
    let env = start(config()).await;
    let dir = env.dir.path();
    chain_named(dir, "night", 3);
    let set = ["cap", "set", "wide", "--credits", "400", "--per", "day"];
    assert_exit_without_panic(&Imgpipe::on(&env, &set).sqlite_in(dir).run().await, 0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let midnight = (now / 86_400 + 1) * 86_400;
    let before = i64::try_from(midnight - 3_600 - now).unwrap();
    let after = before + 7_200;
    let clock = dir.join("clock");
    std::fs::write(&clock, before.to_string()).unwrap();
    let hold = env.sandbox.hold();
    let run = Imgpipe::on(
        &env,
        &[
            "run",
            "night.yaml",
            "--run-id",
            "late",
            "--concurrency",
            "1",
        ],
    )
    .sqlite_in(dir)
    .env("IMGPIPE_TEST_CAP_CLOCK_FILE", &clock)
    .watched();
    wait_until(
        "the first call, leased before midnight, held at the gate",
        || env.sandbox.held_calls() >= 1,
    )
    .await;
    std::fs::write(&clock, after.to_string()).unwrap();
    drop(hold);
    assert_exit_without_panic(&run.finish().await, 0);
    assert_eq!(billed(&env), 3 * CHAIN_CREDITS);
    let spent_on = |offset: i64| {
        let env = &env;
        async move {
            let o = Imgpipe::on(env, &["cap", "list", "--json"])
                .sqlite_in(dir)
                .caps_clock_offset(offset)
                .run()
                .await;
            assert_exit_without_panic(&o, 0);
            json_stdout(&o)[0]["spent"].as_u64().unwrap()
        }
    };
    // The block leased before midnight (20: two chains of 9 and 2 over) is spent that day; the
    // third chain's 9 were leased after it, of which 7 are left to spend after the first
    // block's 20 are used up.
    assert_eq!(spent_on(before).await, 20, "the day before midnight");
    assert_eq!(
        spent_on(after).await,
        3 * CHAIN_CREDITS - 20,
        "the day after"
    );
}

/// A reroll pays again, so it is held against the caps as a run is: with too little left in
/// the window for the chain it redoes, it pays for nothing and stops with exit 6, saying which
/// cap and when it reopens.
#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_is_held_against_the_caps() {
    let env = start(config()).await;
    let dir = env.dir.path();
    chain_named(dir, "night", 2);
    let set = ["cap", "set", "nightly", "--credits", "20", "--per", "day"];
    assert_exit_without_panic(&Imgpipe::on(&env, &set).sqlite_in(dir).run().await, 0);
    let run = Imgpipe::on(&env, &["run", "night.yaml", "--run-id", "r"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&run, 0);
    assert_eq!(billed(&env), 2 * CHAIN_CREDITS, "the run fits its cap");
    // 2 credits left today; the reroll of an item redoes its chain of 9.
    let reroll = Imgpipe::on(&env, &["reroll", "r", "i00"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&reroll, 6);
    assert!(
        stderr(&reroll).contains("cap nightly") && stderr(&reroll).contains("reopens"),
        "{}",
        stderr(&reroll)
    );
    assert_eq!(
        billed(&env),
        2 * CHAIN_CREDITS,
        "the reroll paid for nothing"
    );
    // The next window: the reroll goes through, paying the chain once.
    let next = Imgpipe::on(&env, &["reroll", "r", "i00"])
        .sqlite_in(dir)
        .caps_clock_offset(86_400)
        .run()
        .await;
    assert_exit_without_panic(&next, 0);
    assert_eq!(billed(&env), 3 * CHAIN_CREDITS);
}
