//! State in PostgreSQL (`--state postgres://…`), against the server `.ci/run` starts: a run and
//! its resume, status and report; the run lock shared by "hosts" (processes with working
//! directories of their own, as pods have); a host killed mid-run and another taking over.
//! The crash suite's SIGKILL run has its PostgreSQL twin in `crash.rs`.
//!
//! Each test gets a database of its own. Without `IMGPIPE_TEST_POSTGRES` they are skipped,
//! except under `CI=true`, where that fails them.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use imgpipe::sandbox;
use sqlx::Connection;

use crate::common::{
    Env, assert_exit_without_panic, command, finish, postgres_database, start, state_connection,
    stderr, stdout,
};
use crate::run::{config, edit_chain, write};

/// `imgpipe ARGS --state URL` in `dir` against `env`'s sandbox.
fn on(env: &Env, dir: &Path, url: &str, args: &[&str]) -> tokio::process::Command {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--state", url]);
    let mut cmd = command(&all, dir);
    cmd.env("IMGPIPE_BASE_URL", env.sandbox.base_url().as_str())
        .env("IMGPIPE_API_KEY", env.sandbox.key())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

async fn run_on(env: &Env, dir: &Path, url: &str, args: &[&str]) -> Output {
    finish(on(env, dir, url, args)).await
}

/// One number from the state.
async fn count(url: &str, sql: &'static str) -> i64 {
    try_count(url, sql).await.unwrap()
}

async fn try_count(url: &str, sql: &'static str) -> Result<i64, sqlx::Error> {
    let mut conn = state_connection(url).await;
    let n: Option<(i64,)> = sqlx::query_as(sql).fetch_optional(&mut conn).await?;
    conn.close().await?;
    Ok(n.map_or(0, |(n,)| n))
}

/// Waits until `sql` counts at least one row (its tables may not be made yet).
async fn wait_for(url: &str, sql: &'static str, what: &str) {
    let started = Instant::now();
    while try_count(url, sql).await.unwrap_or(0) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{what} did not happen"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// No task was paid for twice: each has at most one answered call, and the service billed no
/// more calls than the `tasks` plus those possibly billed without an answer (in flight when a
/// host died, or cut).
async fn assert_paid_once(url: &str, env: &Env, tasks: i64) {
    assert_eq!(
        count(
            url,
            "SELECT COUNT(*) FROM (SELECT task_id FROM attempts WHERE outcome = 'succeeded'
             GROUP BY task_id HAVING COUNT(*) > 1) AS twice"
        )
        .await,
        0,
        "a task paid twice"
    );
    let possibly = count(
        url,
        "SELECT COUNT(*) FROM attempts WHERE outcome IS NULL OR outcome = 'ambiguous'",
    )
    .await;
    let paid = i64::try_from(env.sandbox.ledger().len()).unwrap();
    assert!(
        paid <= tasks + possibly,
        "{paid} calls billed for {tasks} tasks, {possibly} possibly billed"
    );
}

/// A host's working directory: its own disk, as a pod has.
fn host(pipeline: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.yaml", pipeline);
    dir
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .count()
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_on_postgres_records_every_step_and_status_report_and_resume_read_it() {
    let Some(url) = postgres_database("run").await else {
        return;
    };
    let env = start(config()).await;
    let a = host(&edit_chain(3, None));
    let o = run_on(&env, a.path(), &url, &["run", "p.yaml", "--run-id", "pg1"]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger().len(), 9);
    assert_eq!(
        count(
            &url,
            "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'"
        )
        .await,
        9
    );
    assert_eq!(
        count(
            &url,
            "SELECT CAST(SUM(credits_billed) AS BIGINT) FROM attempts"
        )
        .await,
        i64::try_from(env.sandbox.ledger().iter().map(|e| e.credits).sum::<u64>()).unwrap()
    );
    assert_eq!(
        count(
            &url,
            "SELECT COUNT(*) FROM outputs WHERE sha256 IS NOT NULL"
        )
        .await,
        9
    );
    assert_eq!(
        count(&url, "SELECT COUNT(*) FROM runs WHERE status = 'succeeded'").await,
        1
    );

    let status = run_on(&env, a.path(), &url, &["status", "pg1"]).await;
    assert_exit_without_panic(&status, 0);
    assert!(
        stdout(&status).contains("9 of 9 succeeded"),
        "{}",
        stdout(&status)
    );
    let report = run_on(&env, a.path(), &url, &["report", "pg1"]).await;
    assert_exit_without_panic(&report, 0);
    assert!(a.path().join("out/pg1/report.html").is_file());

    // Another host, its disk empty, resumes the finished run: nothing to pay.
    let b = host(&edit_chain(3, None));
    let again = run_on(&env, b.path(), &url, &["resume", "pg1"]).await;
    assert_exit_without_panic(&again, 0);
    assert_eq!(env.sandbox.ledger().len(), 9, "nothing was paid twice");

    // A command that only reads never gives a database imgpipe's tables.
    let Some(empty) = postgres_database("empty").await else {
        return;
    };
    let runs = run_on(&env, b.path(), &empty, &["runs"]).await;
    assert_exit_without_panic(&runs, 2);
    assert!(
        stderr(&runs).contains("no imgpipe state"),
        "{}",
        stderr(&runs)
    );
    assert_eq!(
        count(
            &empty,
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
        .await,
        0
    );
}

/// Two hosts started by the same cron line: one runs, the other exits 5 naming it; with
/// `--wait` it waits, then finds the run finished and pays nothing.
#[tokio::test(flavor = "multi_thread")]
async fn two_hosts_on_one_postgres_state_one_runs_the_other_exits_5_or_waits_and_pays_nothing() {
    let Some(url) = postgres_database("lock").await else {
        return;
    };
    let env = start(sandbox::Config {
        latency: Duration::from_millis(150),
        ..config()
    })
    .await;
    let (a, b) = (host(&edit_chain(3, None)), host(&edit_chain(3, None)));
    let first = on(
        &env,
        a.path(),
        &url,
        &["run", "p.yaml", "--run-id", "nightly"],
    )
    .spawn()
    .unwrap();
    let first_pid = first.id().unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM run_locks",
        "the first host taking the lock",
    )
    .await;

    let refused = run_on(
        &env,
        b.path(),
        &url,
        &["run", "p.yaml", "--run-id", "nightly"],
    )
    .await;
    assert_exit_without_panic(&refused, 5);
    let text = stderr(&refused);
    assert!(
        text.contains(&format!("run nightly by pid {first_pid}")),
        "names the holder: {text}"
    );
    assert!(text.contains("--wait"), "{text}");

    let waited = run_on(
        &env,
        b.path(),
        &url,
        &["run", "p.yaml", "--run-id", "nightly", "--wait"],
    )
    .await;
    assert_exit_without_panic(&waited, 0);
    let first = first.wait_with_output().await.unwrap();
    assert_exit_without_panic(&first, 0);
    assert!(
        stderr(&waited).contains("run nightly is already finished"),
        "{}",
        stderr(&waited)
    );
    assert_eq!(env.sandbox.ledger().len(), 9, "the run was paid for once");
}

/// A host killed mid-run (SIGKILL: no clean-up at all) lets go of the lock with its session;
/// another host continues the run after the first one's disk is gone with it (as a pod's is):
/// it pays only for what was not done, and fetches the done outputs again from their jobs
/// instead of paying for them. The run's output directory is recorded as an absolute path, the
/// same on every pod of a CronJob, so both hosts name the same place here.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_killed_mid_run_is_taken_over_by_another_without_paying_twice() {
    let Some(url) = postgres_database("takeover").await else {
        return;
    };
    let env = start(sandbox::Config {
        latency: Duration::from_millis(200),
        ..config()
    })
    .await;
    let (a, b) = (host(&edit_chain(4, None)), host(&edit_chain(4, None)));
    let mut first = on(
        &env,
        a.path(),
        &url,
        &["run", "p.yaml", "--run-id", "night", "--concurrency", "2"],
    )
    .spawn()
    .unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL HAVING COUNT(*) >= 3",
        "three outputs downloaded",
    )
    .await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let out = a.path().join("out/night");
    let lost = ["i00", "i01", "i02", "i03"]
        .iter()
        .map(|i| files_in(&out.join(i)))
        .sum::<usize>();
    assert!(lost >= 3, "the first host downloaded what it did: {lost}");
    std::fs::remove_dir_all(a.path().join("out")).unwrap();
    let done: i64 = count(
        &url,
        "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'",
    )
    .await;
    let attempts_then = count(&url, "SELECT COUNT(*) FROM attempts").await;
    let possibly = count(
        &url,
        "SELECT COUNT(*) FROM attempts WHERE outcome IS NULL OR outcome = 'ambiguous'",
    )
    .await;

    let second = run_on(
        &env,
        b.path(),
        &url,
        &["run", "p.yaml", "--run-id", "night"],
    )
    .await;
    assert_exit_without_panic(&second, 0);
    assert_eq!(
        count(
            &url,
            "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'"
        )
        .await,
        12
    );
    let new_attempts = count(&url, "SELECT COUNT(*) FROM attempts").await - attempts_then;
    assert!(
        new_attempts <= 12 - done + possibly,
        "{new_attempts} new calls for {} tasks left ({possibly} possibly billed)",
        12 - done
    );
    assert_paid_once(&url, &env, 12).await;
    // Every output is on disk again: the done ones fetched again from their jobs.
    let outputs: usize = ["i00", "i01", "i02", "i03"]
        .iter()
        .map(|i| files_in(&out.join(i)))
        .sum();
    assert_eq!(outputs, 12, "every output is on the second host");
    assert_eq!(
        count(
            &url,
            "SELECT COUNT(*) FROM outputs WHERE sha256 IS NULL OR path IS NULL"
        )
        .await,
        0
    );
}

/// The lock lives with its session: when the session is cut while the run goes on (here the
/// server ends it, as a restart would), the run stops at once rather than go on unlocked while
/// another host may take over, and resuming it later pays nothing twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_lock_session_is_cut_stops_and_its_resume_pays_nothing_twice() {
    let Some(url) = postgres_database("cut").await else {
        return;
    };
    let env = start(sandbox::Config {
        latency: Duration::from_millis(200),
        ..config()
    })
    .await;
    let a = host(&edit_chain(8, None));
    let run = on(
        &env,
        a.path(),
        &url,
        &["run", "p.yaml", "--run-id", "cut", "--concurrency", "2"],
    )
    .spawn()
    .unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'",
        "a task done",
    )
    .await;
    let cut = count(
        &url,
        "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_locks
         WHERE locktype = 'advisory' AND granted
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
         AS cut",
    )
    .await;
    assert_eq!(cut, 1, "one session held the lock");
    let started = Instant::now();
    let stopped = run.wait_with_output().await.unwrap();
    assert_exit_without_panic(&stopped, 130);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "stopped {:?} after the cut",
        started.elapsed()
    );
    assert!(
        stderr(&stopped).contains("lost the run lock's session"),
        "{}",
        stderr(&stopped)
    );
    let again = run_on(&env, a.path(), &url, &["resume", "cut"]).await;
    assert_exit_without_panic(&again, 0);
    assert_eq!(
        count(
            &url,
            "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'"
        )
        .await,
        24
    );
    assert_paid_once(&url, &env, 24).await;
}

/// The CronJob of README's "Beyond one machine": the state in PostgreSQL, the outputs in a
/// bucket, no disk that outlives a pod. A pod killed mid-run is taken over by the next one,
/// which pays for no task twice and leaves every output in the bucket, whole and as recorded.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_killed_with_state_in_postgres_and_outputs_in_a_bucket_is_taken_over() {
    use crate::objects::{BUCKET, S3};
    let Some(url) = postgres_database("cronjob").await else {
        return;
    };
    let s3 = S3::start().await;
    let env = start(sandbox::Config {
        latency: Duration::from_millis(200),
        ..config()
    })
    .await;
    let out = format!("s3://{BUCKET}/nightly");
    let args = [
        "run",
        "p.yaml",
        "--run-id",
        "night",
        "--out",
        out.as_str(),
        "--concurrency",
        "2",
    ];
    let (a, b) = (host(&edit_chain(4, None)), host(&edit_chain(4, None)));
    let mut cmd = on(&env, a.path(), &url, &args);
    s3.env(&mut cmd);
    let mut first = cmd.spawn().unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL HAVING COUNT(*) >= 3",
        "three outputs stored",
    )
    .await;
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    drop(a);

    let mut cmd = on(&env, b.path(), &url, &args);
    s3.env(&mut cmd);
    let second = finish(cmd).await;
    assert_exit_without_panic(&second, 0);
    assert_paid_once(&url, &env, 12).await;

    let mut conn = state_connection(&url).await;
    let rows: Vec<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT path, sha256 FROM outputs ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    conn.close().await.unwrap();
    assert_eq!(rows.len(), 12);
    let prefix = format!("s3://{BUCKET}/");
    for (path, sha256) in rows {
        let path = path.expect("every output stored");
        let key = path
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{path}"));
        let bytes = std::fs::read(s3.file(key)).unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(Some(crate::common::sha256_hex(&bytes)), sha256, "{key}");
    }
    assert!(s3.file("nightly/night/manifest.jsonl").is_file());
    assert!(
        !b.path().join("s3:").exists(),
        "nothing local stands for the bucket"
    );
}

/// Two hosts started at the very same instant on a database imgpipe has never used: both make
/// (or find) its tables, one runs and the other exits 5; started again together with `--wait`,
/// both end 0 and the run is paid for once.
#[tokio::test(flavor = "multi_thread")]
async fn two_hosts_started_at_the_same_instant_on_a_new_database_pay_once() {
    let Some(url) = postgres_database("together").await else {
        return;
    };
    let env = start(sandbox::Config {
        latency: Duration::from_millis(100),
        ..config()
    })
    .await;
    let (a, b) = (host(&edit_chain(3, None)), host(&edit_chain(3, None)));
    let args = ["run", "p.yaml", "--run-id", "same"];
    let (one, two) = tokio::join!(
        run_on(&env, a.path(), &url, &args),
        run_on(&env, b.path(), &url, &args)
    );
    let mut codes = [one.status.code(), two.status.code()];
    codes.sort_unstable();
    assert_eq!(
        codes,
        [Some(0), Some(5)],
        "one runs, the other is refused:\n{}\n{}",
        stderr(&one),
        stderr(&two)
    );
    assert_eq!(env.sandbox.ledger().len(), 9);

    let waiting = ["run", "p.yaml", "--run-id", "again", "--wait"];
    let (one, two) = tokio::join!(
        run_on(&env, a.path(), &url, &waiting),
        run_on(&env, b.path(), &url, &waiting)
    );
    assert_exit_without_panic(&one, 0);
    assert_exit_without_panic(&two, 0);
    assert_eq!(
        env.sandbox.ledger().len(),
        18,
        "the second run of the night was paid for once"
    );
}
