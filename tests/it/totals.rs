//! The totals the store keeps as a run's rows are written (`run_totals`, `run_step_totals`:
//! what `status`, the spend a resume starts from and the progress display read) never drift
//! from a full recount of those rows: mid-run, after a `kill -9` with a call in flight, a
//! resume and a reroll, on SQLite and on PostgreSQL.

use sqlx::Row;

use crate::common::*;
use crate::run::{CHAIN_CREDITS, config, edit_chain, write};

/// The run's steps, as the store keeps them and as its tasks count now.
const STEPS_KEPT: &str = "SELECT step, CAST(SUM(tasks) AS BIGINT) AS tasks,
        CAST(SUM(succeeded) AS BIGINT) AS succeeded, CAST(SUM(failed) AS BIGINT) AS failed,
        CAST(SUM(blocked) AS BIGINT) AS blocked, CAST(SUM(pending) AS BIGINT) AS pending,
        CAST(SUM(planned_credits) AS BIGINT) AS planned,
        CAST(SUM(billed_credits) AS BIGINT) AS billed
    FROM run_step_totals WHERE run_id = $1 GROUP BY step HAVING SUM(tasks) <> 0 ORDER BY step";
const STEPS_COUNTED: &str = "SELECT step, COUNT(*) AS tasks,
        COUNT(*) FILTER (WHERE status = 'succeeded') AS succeeded,
        COUNT(*) FILTER (WHERE status = 'failed') AS failed,
        COUNT(*) FILTER (WHERE status = 'blocked') AS blocked,
        COUNT(*) FILTER (WHERE status IN ('pending', 'running')) AS pending,
        CAST(SUM(planned_credits) AS BIGINT) AS planned,
        CAST(SUM(credits_billed) AS BIGINT) AS billed
    FROM tasks WHERE run_id = $1 AND removed_at IS NULL GROUP BY step ORDER BY step";

/// The run's attempts and outputs, as the store keeps them and as their rows count now.
const RUN_KEPT: &str = "SELECT billed_credits AS billed, ambiguous_attempts AS ambiguous,
        possibly_billed_credits AS possibly, outputs, downloaded, download_failures AS failures
    FROM run_totals WHERE run_id = $1";
const RUN_COUNTED: &str = "SELECT
        (SELECT CAST(COALESCE(SUM(credits_billed), 0) AS BIGINT) FROM attempts
         WHERE run_id = $1) AS billed,
        (SELECT COUNT(*) FROM attempts
         WHERE run_id = $1 AND (outcome IS NULL OR outcome = 'ambiguous')) AS ambiguous,
        (SELECT CAST(COALESCE(SUM(t.planned_credits), 0) AS BIGINT)
         FROM attempts a JOIN tasks t ON t.id = a.task_id
         WHERE a.run_id = $1 AND (a.outcome IS NULL OR a.outcome = 'ambiguous')) AS possibly,
        (SELECT COUNT(*) FROM outputs WHERE run_id = $1) AS outputs,
        (SELECT COUNT(*) FROM outputs WHERE run_id = $1 AND path IS NOT NULL) AS downloaded,
        (SELECT COUNT(*) FROM outputs
         WHERE run_id = $1 AND path IS NULL AND download_error IS NOT NULL) AS failures";

const STEP_COLUMNS: [&str; 7] = [
    "tasks",
    "succeeded",
    "failed",
    "blocked",
    "pending",
    "planned",
    "billed",
];
const RUN_COLUMNS: [&str; 6] = [
    "billed",
    "ambiguous",
    "possibly",
    "outputs",
    "downloaded",
    "failures",
];

/// Rows of `sql` for run `r`, each as its first column (text) and `columns` (numbers).
async fn figures(state: &str, sql: &str, columns: &[&str]) -> Vec<(String, Vec<i64>)> {
    let mut conn = state_connection(state).await;
    let rows = within(
        &format!("reading {sql}"),
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind("r")
            .fetch_all(&mut conn),
    )
    .await
    .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.iter()
        .map(|r| {
            let first = r.try_get::<String, _>(0).unwrap_or_default();
            let n = columns
                .iter()
                .map(|c| r.try_get::<Option<i64>, _>(*c).unwrap().unwrap_or(0))
                .collect();
            (first, n)
        })
        .collect()
}

/// Fails, naming `when`, unless the totals kept of run `r` are its rows counted again. Gives
/// the run's figures counted (billed, unanswered attempts, possibly billed, outputs, ...).
async fn assert_totals_true(state: &str, when: &str) -> Vec<i64> {
    let kept = figures(state, STEPS_KEPT, &STEP_COLUMNS).await;
    let counted = figures(state, STEPS_COUNTED, &STEP_COLUMNS).await;
    assert_eq!(
        kept, counted,
        "{when}: the steps' totals kept (left) are not their tasks counted (right), as {STEP_COLUMNS:?}"
    );
    assert!(!counted.is_empty(), "{when}: run r has no tasks");
    let kept = figures(state, RUN_KEPT, &RUN_COLUMNS).await;
    let counted = figures(state, RUN_COUNTED, &RUN_COLUMNS).await;
    let kept = kept.first().map(|(_, n)| n.clone());
    let counted = counted[0].1.clone();
    assert_eq!(
        kept.as_ref(),
        Some(&counted),
        "{when}: the run's totals kept (left) are not its attempts and outputs counted (right), as {RUN_COLUMNS:?}"
    );
    counted
}

/// Run `r` of four chains, one call at a time, through everything that writes its rows: paid
/// calls and downloads, a `kill -9` with a call held at the gate (an attempt left without an
/// answer), a resume that settles it and finishes, and a reroll that sets an item's outputs
/// aside and pays for its chain again. After each, the totals kept are the rows counted again.
async fn totals_stay_true(env: &Env, state: &str) {
    let dir = env.dir.path();
    write(dir, "night.yaml", &edit_chain(4, None));
    let hold = env.sandbox.hold();
    let args = ["run", "night.yaml", "--run-id", "r", "--concurrency", "1"];
    let mut run = Imgpipe::on(env, &args).state(state).watched();
    step_until(env, &mut run, |env| env.sandbox.ledger().len() >= 5).await;
    assert_totals_true(state, "mid-run, a call held at the gate").await;
    send_signal(run.id(), libc::SIGKILL);
    let killed = run.finish().await;
    assert_eq!(killed.status.code(), None, "killed: {killed:?}");
    release_after_kill(env, hold).await;
    let counted = assert_totals_true(state, "after the kill").await;
    assert_eq!(
        counted[1], 1,
        "the kill leaves the call it held without an answer: {counted:?}"
    );
    assert!(
        counted[2] > 0,
        "possibly billed after the kill: {counted:?}"
    );
    let resumed = Imgpipe::on(env, &["resume", "r"])
        .state(state)
        .retry_base_ms(10)
        .run()
        .await;
    assert_exit_without_panic(&resumed, 0);
    let counted = assert_totals_true(state, "after the resume").await;
    assert!(
        counted[0] >= (4 * CHAIN_CREDITS) as i64 && counted[3] > 0,
        "the resume finished the run: {counted:?}"
    );
    let reroll = Imgpipe::on(env, &["reroll", "r", "i00"])
        .state(state)
        .run()
        .await;
    assert_exit_without_panic(&reroll, 0);
    let after = assert_totals_true(state, "after the reroll").await;
    assert_eq!(
        after[0] - counted[0],
        CHAIN_CREDITS as i64,
        "the reroll paid for i00's chain again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_totals_kept_on_sqlite_are_the_rows_counted_through_a_kill_a_resume_and_a_reroll() {
    let env = start(config()).await;
    let state = env.dir.path().join("state.db");
    totals_stay_true(&env, &state.to_string_lossy()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_totals_kept_on_postgres_are_the_rows_counted_through_a_kill_a_resume_and_a_reroll() {
    let Some(url) = postgres_database("totals").await else {
        return;
    };
    let env = start(config()).await;
    totals_stay_true(&env, &url).await;
}
