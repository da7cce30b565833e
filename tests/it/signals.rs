//! Signals and the service's 429, against the in-process sandbox held mid-call: a 429 pauses
//! every paid call for its `Retry-After`; SIGTERM stops dispatching, lets the calls in flight
//! finish and exits 130 with the command that continues the run; and when `--grace` runs out
//! first, the calls still in flight are recorded as possibly billed.
//!
//! Nothing here races the clock: the sandbox's hold keeps calls in flight for as long as a
//! test needs, a 429 is aimed at one chosen call (`Sandbox::rate_limit_next`), and the only
//! time asserted is a lower bound (a gap of at least the `Retry-After`).

use std::process::Output;
use std::time::Duration;

use imgpipe::sandbox::{self, LedgerEntry, Sandbox};

use crate::common::{
    Db, Env, Imgpipe, assert_exit_without_panic, printed_continue_command, start, stderr,
    wait_until,
};

/// `items` items of one generation each, at most `concurrency` calls in flight.
fn pipeline(items: usize, concurrency: usize) -> String {
    let mut text =
        format!("version: 1\nname: sig\noutput_dir: out\nconcurrency: {concurrency}\nitems:\n");
    for i in 0..items {
        text += &format!("  - {{ id: i{i}, subject: thing {i} }}\n");
    }
    text += "steps:\n  - id: shot\n    generate: { prompt: \"Photo of {{ item.subject }}\" }\n";
    text
}

/// A sandbox that states its generation price, so that no step waits for a first bill before
/// sending the rest, and `p.yaml` in its directory.
async fn sandbox_with(items: usize, concurrency: usize) -> Env {
    let env = start(sandbox::Config {
        advertise_price: true,
        ..sandbox::Config::default()
    })
    .await;
    std::fs::write(env.dir.path().join("p.yaml"), pipeline(items, concurrency)).unwrap();
    env
}

fn state_of(env: &Env) -> String {
    env.dir
        .path()
        .join("state.db")
        .to_string_lossy()
        .into_owned()
}

fn send(pid: u32, signal: i32) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill(2) on our own child, not reaped yet, so the pid is still its own.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
}

/// Runs the command an interrupted run printed to continue it, as pasted into a shell (the
/// service's address and key still in the environment), within [`RUN_LIMIT`].
async fn continue_as_printed(env: &Env, interrupted: &Output, run_id: &str) -> Output {
    let printed = printed_continue_command(interrupted);
    assert!(
        printed.starts_with(&format!("imgpipe run p.yaml --run-id {run_id}")),
        "{printed}"
    );
    Imgpipe::pasted(&printed)
        .sandbox(env)
        .cwd(env.dir.path())
        .run()
        .await
        .output
}

/// The whole record against the ledger once the run is done: every task succeeded with a job
/// billed once, and the ledger holds nothing else but `extra` undelivered bills.
#[track_caller]
fn assert_paid_once(db: &Db, sandbox: &Sandbox, tasks: usize, extra: usize) {
    let ledger = sandbox.ledger();
    assert_eq!(db.count("succeeded"), tasks, "{:#?}", db.tasks);
    assert_eq!(ledger.len(), tasks + extra, "{ledger:#?}");
    let undelivered: Vec<&LedgerEntry> = ledger.iter().filter(|e| !e.delivered).collect();
    assert_eq!(undelivered.len(), extra, "{ledger:#?}");
    for task in db.live() {
        let job = task
            .job_id
            .as_deref()
            .expect("a succeeded task names its job");
        let bills = ledger.iter().filter(|e| e.job_id.as_str() == job).count();
        assert_eq!(
            bills,
            1,
            "{} billed {bills} times: {ledger:#?}",
            task.name()
        );
        assert!(
            !undelivered.iter().any(|e| e.job_id.as_str() == job),
            "{}",
            task.name()
        );
    }
    let billed: u64 = ledger.iter().map(|e| e.credits).sum();
    let wasted: u64 = undelivered.iter().map(|e| e.credits).sum();
    assert_eq!(
        billed - wasted,
        db.planned(),
        "the run cost other than its plan"
    );
    assert_eq!(db.billed(), db.planned(), "the record's bills");
}

// ---------------------------------------------------------------------------------------------
// A 429 pauses every paid call
// ---------------------------------------------------------------------------------------------

/// Two calls in flight (held); one is let through, and the call sent in its place gets a 429
/// with `Retry-After: 2`, the other still held. No paid call may then reach the service before
/// two seconds have passed since the 429 was answered: not the one refused, and not those
/// dispatched when the held call ends. The refused call is sent again and billed once.
#[tokio::test(flavor = "multi_thread")]
async fn a_429_pauses_every_paid_call_for_its_retry_after() {
    const ITEMS: usize = 6;
    const RETRY_AFTER: Duration = Duration::from_secs(2);
    let env = sandbox_with(ITEMS, 2).await;
    let hold = env.sandbox.hold();
    let mut run = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "rl"])
        .sqlite_in(env.dir.path())
        .watched();
    wait_until("two calls held in flight", || env.sandbox.held_calls() == 2).await;
    env.sandbox.rate_limit_next(RETRY_AFTER);
    env.sandbox.let_through(1);
    // The one let through is answered, and the call sent in its place gets the 429; the
    // other is still held, so both slots stay taken until the run has read the 429 and
    // paused (a call it sent before it had read it was in flight, as far as it knew).
    wait_until("the 429", || env.sandbox.rate_limits().len() == 1).await;
    run.wait_for_line("rate limited by the service; pausing")
        .await;
    drop(hold);
    let out = run.finish().await;
    assert_exit_without_panic(&out, 0);

    let answered_429 = env.sandbox.rate_limits()[0];
    let ledger = env.sandbox.ledger();
    let (before, after): (Vec<&LedgerEntry>, Vec<&LedgerEntry>) =
        ledger.iter().partition(|e| e.received_us < answered_429);
    assert_eq!(
        before.len(),
        2,
        "the two calls in flight at the 429: {ledger:#?}"
    );
    let resumed = answered_429 + RETRY_AFTER.as_micros() as u64;
    let early: Vec<&&LedgerEntry> = after.iter().filter(|e| e.received_us < resumed).collect();
    assert!(
        early.is_empty(),
        "paid calls reached the service within the 429's Retry-After ({RETRY_AFTER:?}), {} µs after it: {early:#?}",
        early[0].received_us - answered_429
    );
    let stats = env.sandbox.stats();
    assert_eq!(stats.rate_limited, 1);
    assert_eq!(stats.paid_requests, ITEMS as u64 + 1, "{stats:?}");

    let db = Db::read(&state_of(&env)).await;
    assert_eq!(db.run_status("rl"), "succeeded");
    let refused: Vec<_> = db
        .attempts
        .iter()
        .filter(|a| a.http_status == Some(429))
        .collect();
    assert_eq!(refused.len(), 1, "{:#?}", db.attempts);
    let task = db.task(refused[0].task_id);
    let attempts = db.attempts_of(task.id);
    assert_eq!(
        attempts.len(),
        2,
        "the 429 then the call again: {attempts:#?}"
    );
    let job = task.job_id.as_deref().unwrap();
    let sent_again = ledger.iter().find(|e| e.job_id.as_str() == job).unwrap();
    assert!(sent_again.received_us >= resumed, "{sent_again:?}");
    assert_paid_once(&db, &env.sandbox, ITEMS, 0);
}

// ---------------------------------------------------------------------------------------------
// SIGTERM
// ---------------------------------------------------------------------------------------------

/// SIGTERM while three calls are held in flight: the run stops dispatching, lets the three
/// finish once released, records them and exits 130 with the command that continues it; that
/// command finishes the run at its plan, nothing paid twice.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_calls_in_flight_finish_and_the_run_continues_without_paying_twice() {
    const ITEMS: usize = 7;
    let env = sandbox_with(ITEMS, 3).await;
    let hold = env.sandbox.hold();
    let mut run = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "term"])
        .sqlite_in(env.dir.path())
        .watched();
    wait_until("three calls held in flight", || {
        env.sandbox.held_calls() == 3
    })
    .await;
    send(run.id(), libc::SIGTERM);
    run.wait_for_line("interrupted: no new calls").await;
    drop(hold);
    let out = run.finish().await;
    assert_exit_without_panic(&out, 130);
    let stats = env.sandbox.stats();
    assert_eq!(
        stats.paid_requests, 3,
        "calls sent after SIGTERM: {stats:?}"
    );
    assert_eq!(env.sandbox.ledger().len(), 3);

    let db = Db::read(&state_of(&env)).await;
    assert_eq!(db.run_status("term"), "interrupted");
    assert_eq!(db.attempts.len(), 3, "{:#?}", db.attempts);
    assert!(
        db.attempts
            .iter()
            .all(|a| a.outcome.as_deref() == Some("succeeded") && a.job_id.is_some()),
        "every call in flight answered and recorded: {:#?}",
        db.attempts
    );
    assert_eq!(db.count("running"), 0, "{:#?}", db.tasks);
    assert_eq!(db.count("succeeded"), 3, "{:#?}", db.tasks);

    let continued = continue_as_printed(&env, &out, "term").await;
    assert_exit_without_panic(&continued, 0);
    let db = Db::read(&state_of(&env)).await;
    assert_eq!(db.run_status("term"), "succeeded");
    assert_paid_once(&db, &env.sandbox, ITEMS, 0);
}

// ---------------------------------------------------------------------------------------------
// --grace running out
// ---------------------------------------------------------------------------------------------

/// SIGTERM with `--grace 1` while two calls are held and never released: the run exits 130
/// with the calls still held, recording them as possibly billed and saying so. Released, the
/// service bills them for nobody; the run continued pays again only for those two.
#[tokio::test(flavor = "multi_thread")]
async fn when_the_grace_runs_out_the_calls_in_flight_are_recorded_as_possibly_billed() {
    const ITEMS: usize = 5;
    let env = sandbox_with(ITEMS, 2).await;
    let hold = env.sandbox.hold();
    let run = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "grace", "--grace", "1"],
    )
    .sqlite_in(env.dir.path())
    .watched();
    wait_until("two calls held in flight", || env.sandbox.held_calls() == 2).await;
    send(run.id(), libc::SIGTERM);
    let out = run.finish().await;
    assert_exit_without_panic(&out, 130);
    assert_eq!(env.sandbox.held_calls(), 2, "the run waited for its calls");
    assert!(env.sandbox.ledger().is_empty());
    let text = stderr(&out);
    assert!(
        text.contains(
            "2 call(s) still in flight after the grace period; recorded as possibly billed"
        ),
        "{text}"
    );

    let db = Db::read(&state_of(&env)).await;
    assert_eq!(db.run_status("grace"), "interrupted");
    assert_eq!(db.attempts.len(), 2, "{:#?}", db.attempts);
    for a in &db.attempts {
        assert_eq!(a.outcome.as_deref(), Some("ambiguous"), "{a:?}");
        assert!(
            a.error
                .as_deref()
                .is_some_and(|e| e.contains("may have been billed")),
            "{a:?}"
        );
        assert_eq!(a.job_id, None, "no answer, so no job id: {a:?}");
    }
    assert_eq!(db.count("running"), 0, "{:#?}", db.tasks);

    drop(hold);
    wait_until("the released calls billed", || env.sandbox.in_flight() == 0).await;
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2, "{ledger:#?}");
    assert!(ledger.iter().all(|e| !e.delivered), "{ledger:#?}");

    let continued = continue_as_printed(&env, &out, "grace").await;
    assert_exit_without_panic(&continued, 0);
    let db = Db::read(&state_of(&env)).await;
    assert_eq!(db.run_status("grace"), "succeeded");
    // Paid twice only for what the record said may have been billed, and had no job to read
    // back.
    let unknown = db.ambiguous().iter().filter(|a| a.job_id.is_none()).count();
    assert_eq!(unknown, 2, "{:#?}", db.attempts);
    assert_paid_once(&db, &env.sandbox, ITEMS, unknown);
}
