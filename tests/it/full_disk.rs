//! Storage that fails stops spending (issue 25): when a run's outputs cannot be kept (a full
//! disk, a bucket refusing writes), no new paid call is sent, the calls in flight finish and
//! are recorded, the run ends naming the place, the error and the command that fetches what
//! was paid for; a resume while the place still fails pays nothing, and one after it is fixed
//! fetches the outputs from their jobs without paying for them again. And no call is ever sent
//! without its intent in the state database, whichever database refuses to write it.
//!
//! The disk fills by `IMGPIPE_TEST_DISK_FULL_AFTER` (a test-only setting: the process keeps
//! that many outputs in a local directory, then every write there fails with ENOSPC), so the
//! tests need no root and behave the same on every machine; the bucket refuses in the test's
//! S3 server; the state database refuses by a trigger on its `attempts` table. The sandbox
//! holds every paid call until the test lets it through, one at a time and each only once the
//! outputs paid so far are kept or failed: the run goes in lockstep with its downloads, and
//! what counts as "in flight" when the place fails is exact, with no clock to race.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, Row};
use tokio::process::Command;

use crate::common::*;
use crate::objects::{BUCKET, S3};
use crate::run::{config, edit_chain, state_path, write};

/// Items of the pipeline: each erase → upscale → remove_background, one output a call.
const ITEMS: usize = 6;
const TASKS: usize = ITEMS * 3;
/// Outputs the place keeps before it fails.
const KEPT: usize = 4;

/// Outputs recorded in the SQLite state at `state` with a file or object, and without one
/// after a failed download; (0, 0) while the database does not exist yet.
async fn settled(state: &Path) -> (usize, usize) {
    use sqlx::ConnectOptions;
    let read = async {
        let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(state)
            .read_only(true)
            .connect()
            .await
            .ok()?;
        let row = sqlx::query(
            "SELECT COUNT(*) FILTER (WHERE path IS NOT NULL) AS stored,
                    COUNT(*) FILTER (WHERE path IS NULL AND download_error IS NOT NULL) AS failed
             FROM outputs",
        )
        .fetch_one(&mut conn)
        .await
        .ok()?;
        let _ = conn.close().await;
        let n = |c: &str| usize::try_from(row.get::<i64, _>(c)).unwrap_or(0);
        Some((n("stored"), n("failed")))
    };
    read.await.unwrap_or((0, 0))
}

/// Runs `cmd` (one call at a time) with the sandbox holding every paid call: one is let
/// through only once every output paid so far is kept, until an output fails; from then on
/// the calls that come are let through and counted. Returns the run's output and that count:
/// the calls that were in flight when the place failed, since imgpipe sends no other.
async fn lockstep(env: &Env, mut cmd: Command, state: &Path) -> (Output, usize) {
    env.sandbox.hold_calls();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("imgpipe starts");
    let deadline = Instant::now() + RUN_LIMIT;
    let (mut failed, mut after) = (false, 0);
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the run did not end within {RUN_LIMIT:?}"
        );
        let paid = env.sandbox.ledger().len();
        let (stored, failures) = settled(state).await;
        failed |= failures > 0;
        let held = env.sandbox.held_calls();
        if held > 0 && failed {
            after += held;
            assert!(
                after <= 1,
                "{after} calls were sent after the place failed, where one call at a time leaves at most one in flight"
            );
            env.sandbox.let_through(held);
        } else if held > 0 && stored == paid {
            env.sandbox.let_through(1);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    env.sandbox.release_calls();
    let output = tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
        .await
        .expect("imgpipe's streams close")
        .unwrap();
    assert!(failed, "no output failed:\n{}", stderr(&output));
    (output, after)
}

/// The ledger's job ids, no request billed twice.
#[track_caller]
fn billed_once(env: &Env) -> BTreeSet<String> {
    assert_no_request_billed_twice(env);
    env.sandbox
        .ledger()
        .iter()
        .map(|e| e.job_id.to_string())
        .collect()
}

/// The run's outputs: (job id, path, sha256), whatever the state's backend.
async fn outputs(state: &str) -> Vec<(String, Option<String>, Option<String>)> {
    let mut conn = state_connection(state).await;
    let rows = sqlx::query("SELECT job_id, path, sha256 FROM outputs ORDER BY id")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    rows.iter()
        .map(|r| (r.get("job_id"), r.get("path"), r.get("sha256")))
        .collect()
}

/// The last lines of stderr from `error: ` on, each of `names` (a path, say) written as its
/// placeholder.
fn error_said(o: &Output, names: &[(&str, &str)]) -> String {
    let err = stderr(o);
    let at = err
        .find("error: ")
        .unwrap_or_else(|| panic!("no error in:\n{err}"));
    names
        .iter()
        .fold(err[at..].to_owned(), |said, (name, shown)| {
            said.replace(name, shown)
        })
}

/// After every run of a test: all of the run's outputs are in the record with their place,
/// each paid for once, by the jobs of the ledger.
async fn assert_whole(env: &Env, state: &str) {
    let jobs = billed_once(env);
    assert_eq!(jobs.len(), TASKS, "every task paid for once");
    let recorded = outputs(state).await;
    assert_eq!(recorded.len(), TASKS);
    let recorded_jobs: BTreeSet<String> = recorded.iter().map(|o| o.0.clone()).collect();
    assert_eq!(
        recorded_jobs, jobs,
        "every output from a job the ledger billed"
    );
    for (job, path, _) in &recorded {
        assert!(path.is_some(), "the output of {job} is not stored");
    }
}

#[tokio::test]
async fn a_full_disk_stops_the_calls_and_a_resume_fetches_what_was_paid_for_without_paying_again() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(ITEMS, None));
    let state_file = state_path(dir);
    let state = state_file.display().to_string();
    let run_dir = dir.join("out/full").display().to_string();

    // Full from the start: said before anything is paid for.
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "early"])
        .state(&state)
        .retry_base_ms(10)
        .env("IMGPIPE_TEST_DISK_FULL_AFTER", "0")
        .run()
        .await;
    assert_exit_without_panic(&o, 1);
    assert_nothing_billed(&env);
    assert_eq!(
        error_said(&o, &[(&dir.display().to_string(), "[DIR]"), (&state, "[STATE]")]),
        "error: outputs cannot be written to [DIR]/out/early: cannot write [DIR]: No space left on device (os error 28); nothing was paid for
hint: free space there (or restore the permission, or give another --out), then run the same command again
"
    );

    // The disk holds KEPT outputs, then fills.
    let cmd = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "full", "--concurrency", "1"],
    )
    .state(&state)
    .retry_base_ms(10)
    .env("IMGPIPE_TEST_DISK_FULL_AFTER", KEPT.to_string())
    .command();
    let (o, in_flight) = lockstep(&env, cmd, &state_file).await;
    assert_exit_without_panic(&o, 1);
    // The output that failed was paid for, and the call in flight then: nothing more.
    let paid = env.sandbox.ledger().len();
    assert_eq!(paid, KEPT + 1 + in_flight, "{:?}", env.sandbox.ledger());
    billed_once(&env);
    let unstored = paid - KEPT;
    assert_eq!(
        error_said(&o, &[(&run_dir, "[RUN]"), (&state, "[STATE]")]),
        format!(
            "error: the run stopped: outputs cannot be written to [RUN]: cannot write [RUN]/i01: No space left on device (os error 28)
no call was sent after that; the calls in flight then finished and are recorded
hint: {unstored} paid output(s) are not stored; once [RUN] can be written again (free space, restore the permission), `imgpipe run p.yaml --run-id full --state [STATE] --concurrency 1` fetches them from their jobs without paying for them again, then goes on with the rest
"
        )
    );
    // Every call billed is recorded, its outputs with their URLs: what the resume fetches.
    let recorded = outputs(&state).await;
    assert_eq!(recorded.len(), paid);
    assert_eq!(recorded.iter().filter(|o| o.1.is_some()).count(), KEPT);
    let status = json_stdout(
        &Imgpipe::on(&env, &["status", "full", "--json"])
            .state(&state)
            .run()
            .await,
    );
    assert_eq!(status["status"], "stopped", "{status}");

    // Still full: the resume pays nothing.
    let o = Imgpipe::on(&env, &["resume", "full"])
        .state(&state)
        .retry_base_ms(10)
        .env("IMGPIPE_TEST_DISK_FULL_AFTER", "0")
        .run()
        .await;
    assert_exit_without_panic(&o, 1);
    assert!(
        stderr(&o).contains("No space left on device (os error 28); nothing was paid for"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        paid,
        "a resume on a full disk paid"
    );

    // Space freed: the outputs paid for are fetched from their jobs, the rest paid once.
    let o = Imgpipe::on(&env, &["resume", "full"])
        .state(&state)
        .retry_base_ms(10)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_whole(&env, &state).await;
    for (_, path, sha256) in outputs(&state).await {
        let bytes = std::fs::read(path.unwrap()).unwrap();
        assert_eq!(Some(sha256_hex(&bytes)), sha256);
    }
}

#[tokio::test]
async fn a_bucket_that_refuses_writes_stops_the_calls_and_a_resume_uploads_without_paying_again() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(ITEMS, None));
    let state_file = state_path(dir);
    let state = state_file.display().to_string();
    let out = format!("s3://{BUCKET}/runs");

    s3.refuse_writes_after(Some((KEPT, http::StatusCode::FORBIDDEN)));
    let args = [
        "run",
        "p.yaml",
        "--run-id",
        "r",
        "--concurrency",
        "1",
        "--out",
        &out,
    ];
    let (o, in_flight) = lockstep(
        &env,
        Imgpipe::on(&env, &args)
            .s3(&s3)
            .sqlite_in(dir)
            .retry_base_ms(20)
            .command(),
        &state_file,
    )
    .await;
    assert_exit_without_panic(&o, 1);
    let paid = env.sandbox.ledger().len();
    assert_eq!(paid, KEPT + 1 + in_flight, "{:?}", env.sandbox.ledger());
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "error: the run stopped: outputs cannot be written to {out}/r: cannot write {out}/r/i01/"
        )) && err.contains("403")
            && err.contains(&format!(
                "hint: {} paid output(s) are not stored; once {out}/r can be written again",
                paid - KEPT
            )),
        "{err}"
    );

    // A bucket that fails (507) after its store's retries is a place that fails too.
    s3.refuse_writes_after(Some((0, http::StatusCode::INSUFFICIENT_STORAGE)));
    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 1);
    assert!(stderr(&o).contains("507"), "{}", stderr(&o));
    assert_eq!(
        env.sandbox.ledger().len(),
        paid,
        "a resume into a refusing bucket paid"
    );

    s3.refuse_writes_after(None);
    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_whole(&env, &state).await;
    for (_, path, _) in outputs(&state).await {
        let key = path.unwrap().replace(&format!("s3://{BUCKET}/"), "");
        assert!(s3.file(&key).is_file(), "{key} is not in the bucket");
    }
}

/// Makes the state refuse every row of `table` past the `allowed`-th, as a full disk or a
/// database gone read-only would: SQLite's "database or disk is full", PostgreSQL's
/// `disk_full`.
async fn refuse_rows_after(state: &str, table: &str, allowed: usize) {
    let mut conn = writable(state).await;
    let statements = if state.starts_with("postgres") {
        vec![
            format!(
                "CREATE FUNCTION refuse_row() RETURNS trigger AS $$
                 BEGIN
                   IF (SELECT COUNT(*) FROM {table}) >= {allowed} THEN
                     RAISE EXCEPTION 'could not extend file: No space left on device'
                       USING ERRCODE = 'disk_full';
                   END IF;
                   RETURN NEW;
                 END $$ LANGUAGE plpgsql"
            ),
            format!(
                "CREATE TRIGGER refuse_row BEFORE INSERT ON {table}
                 FOR EACH ROW EXECUTE FUNCTION refuse_row()"
            ),
        ]
    } else {
        vec![format!(
            "CREATE TRIGGER refuse_row BEFORE INSERT ON {table}
             WHEN (SELECT COUNT(*) FROM {table}) >= {allowed}
             BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )]
    };
    for sql in statements {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    conn.close().await.unwrap();
}

async fn allow_rows(state: &str, table: &str) {
    let mut conn = writable(state).await;
    let sql = if state.starts_with("postgres") {
        format!("DROP TRIGGER refuse_row ON {table}")
    } else {
        "DROP TRIGGER refuse_row".to_owned()
    };
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

/// The state at `state` (a SQLite file or a PostgreSQL URL), opened to write.
async fn writable(state: &str) -> sqlx::AnyConnection {
    sqlx::any::install_default_drivers();
    let url = if state.starts_with("postgres") {
        state.to_owned()
    } else {
        format!("sqlite://{state}")
    };
    within(
        &format!("opening {url}"),
        sqlx::AnyConnection::connect(&url),
    )
    .await
    .unwrap()
}

/// The job of every attempt recorded, and how many attempts there are.
async fn attempts(state: &str) -> (usize, BTreeSet<String>) {
    let mut conn = state_connection(state).await;
    let rows = sqlx::query("SELECT job_id FROM attempts")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    let jobs = rows
        .iter()
        .filter_map(|r| r.get::<Option<String>, _>("job_id"))
        .collect();
    (rows.len(), jobs)
}

/// A state database that stops taking writes mid-run: the call whose intent it refused is
/// never sent, the calls whose intent it took are answered and recorded, and a resume once it
/// takes writes again pays for each task once.
async fn no_call_without_its_intent(state: &str) {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(ITEMS, None));
    let on = |args: &[&str]| Imgpipe::on(&env, args).state(state).retry_base_ms(10);

    // One item paid for, to make the database; then it takes two intents more.
    let o = on(&["run", "p.yaml", "--run-id", "db", "--items", "first:1"])
        .run()
        .await;
    assert_exit_without_panic(&o, 7);
    let first = env.sandbox.ledger().len();
    refuse_rows_after(state, "attempts", first + 2).await;

    let o = on(&["resume", "db", "--concurrency", "2"]).run().await;
    let (recorded, jobs) = attempts(state).await;
    assert_eq!(
        env.sandbox.ledger().len(),
        recorded,
        "every call sent has its intent recorded, and no other was sent: {:?}",
        env.sandbox.ledger()
    );
    assert_eq!(
        billed_once(&env),
        jobs,
        "every call billed is recorded with its job"
    );
    assert_eq!(
        recorded,
        first + 2,
        "the refused intent is not in the record"
    );
    assert_exit_without_panic(&o, 1);
    assert!(
        stderr(&o).contains("the run stopped: cannot record the run: state database:"),
        "{}",
        stderr(&o)
    );

    allow_rows(state, "attempts").await;
    let o = on(&["resume", "db"]).run().await;
    assert_exit_without_panic(&o, 0);
    assert_whole(&env, state).await;
}

#[tokio::test]
async fn no_call_is_sent_without_its_intent_in_a_sqlite_state() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db").display().to_string();
    no_call_without_its_intent(&state).await;
}

#[tokio::test]
async fn no_call_is_sent_without_its_intent_in_a_postgres_state() {
    let Some(url) = postgres_database("intent").await else {
        return;
    };
    no_call_without_its_intent(&url).await;
}

/// A state database that cannot be written when a run starts (a full disk, a database gone
/// read-only): `run` says so and exits 1 having paid for nothing; once it takes writes again
/// the same command runs.
async fn a_state_that_refuses_the_run(state: &str) {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(ITEMS, None));
    let on = |args: &[&str]| Imgpipe::on(&env, args).state(state).retry_base_ms(10);
    // One item paid for, to make the database; then it takes no run more.
    let o = on(&["run", "p.yaml", "--run-id", "a", "--items", "first:1"])
        .run()
        .await;
    assert_exit_without_panic(&o, 7);
    let paid = env.sandbox.ledger().len();
    refuse_rows_after(state, "runs", 1).await;

    let o = on(&["run", "p.yaml", "--run-id", "b"]).run().await;
    assert_exit_without_panic(&o, 1);
    let said = stderr(&o);
    assert!(
        said.contains("state database:")
            && said.contains("hint: check that the state database can be reached and written"),
        "{said}"
    );
    assert_eq!(
        env.sandbox.ledger().len(),
        paid,
        "a call was paid for:\n{said}"
    );
    assert!(
        !dir.join("out/b").exists(),
        "the refused run left {:?}",
        tree(&dir.join("out/b"))
    );

    allow_rows(state, "runs").await;
    let o = on(&["run", "p.yaml", "--run-id", "b"]).run().await;
    assert_exit_without_panic(&o, 0);
}

#[tokio::test]
async fn a_sqlite_state_that_refuses_the_run_is_exit_1_and_nothing_is_paid() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.db").display().to_string();
    a_state_that_refuses_the_run(&state).await;
}

#[tokio::test]
async fn a_postgres_state_that_refuses_the_run_is_exit_1_and_nothing_is_paid() {
    let Some(url) = postgres_database("refuse_run").await else {
        return;
    };
    a_state_that_refuses_the_run(&url).await;
}

/// A state database that cannot be made where `--state` points (its directory cannot be
/// created: here a file stands in its way, which even root cannot write through) is exit 1,
/// naming the directory and what to do, before anything is paid for.
#[tokio::test]
async fn a_state_that_cannot_be_made_is_exit_1_and_nothing_is_paid() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    std::fs::write(dir.join("afile"), b"not a directory").unwrap();
    let o = Imgpipe::on(&env, &["run", "p.yaml"])
        .state("afile/sub/state.db")
        .retry_base_ms(10)
        .run()
        .await;
    assert_exit_without_panic(&o, 1);
    let said = stderr(&o);
    assert!(
        said.contains("cannot create the state directory afile/sub") && said.contains("hint:"),
        "{said}"
    );
    assert_nothing_billed(&env);
    assert!(!dir.join("out").exists(), "{:?}", tree(&dir.join("out")));
}
