//! State in PostgreSQL (`--state postgres://…`), against the server `.ci/run` starts: a run and
//! its resume, status and report; the run lock shared by "hosts" (processes with working
//! directories of their own, as pods have); a host killed mid-run and another taking over.
//! The crash suite's SIGKILL run has its PostgreSQL twin in `crash.rs`. A run of 20,000 items
//! killed and taken over at once is held to a number of statements, counted by a relay.
//!
//! Each test gets a database of its own. Without `IMGPIPE_TEST_POSTGRES` they pass after
//! printing `test NAME ... skipped: no PostgreSQL: …` on stdout, except under CI (`CI=true` or
//! `CI=1`), where that fails them.

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imgpipe::sandbox;
use imgpipe::sha256::Sha256Sum;
use sqlx::Connection;

use crate::common::{
    Env, Imgpipe, Watched, assert_exit_without_panic, finish, json_stdout, kill_child,
    postgres_database, start, state_connection, stderr, stdout, wait_until, within,
};
use crate::run::{config, edit_chain, write};

/// `imgpipe ARGS --state URL` in `dir` against `env`'s sandbox.
fn on(env: &Env, dir: &Path, url: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = Imgpipe::new(args)
        .cwd(dir)
        .state(url)
        .sandbox(env)
        .command();
    cmd.stdout(std::process::Stdio::piped())
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

/// How long [`wait_for`] waits: a ceiling for a run's progress that a loaded 2-core machine
/// stays far below (a 20 s one was met too late once, mid-suite, beside a release build).
const PROGRESS_LIMIT: Duration = Duration::from_secs(120);

/// Waits until `sql` counts at least one row (its tables may not be made yet), failing after
/// [`PROGRESS_LIMIT`].
async fn wait_for(url: &str, sql: &'static str, what: &str) {
    let started = Instant::now();
    while try_count(url, sql).await.unwrap_or(0) == 0 {
        assert!(
            started.elapsed() < PROGRESS_LIMIT,
            "{what} did not happen within {PROGRESS_LIMIT:?}"
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

/// A test run alone without `IMGPIPE_TEST_POSTGRES`: outside CI it passes and its skip shows in
/// the output libtest shows for a passing test, naming it; under CI it fails with the reason.
#[test]
fn without_a_server_a_test_says_skipped_on_stdout_and_under_ci_fails_with_the_reason() {
    const TEST: &str =
        "postgres::a_run_on_postgres_records_every_step_and_status_report_and_resume_read_it";
    let alone = |env: &[(&str, &str)]| {
        let o = crate::common::test_alone(
            TEST,
            &["CI", "IMGPIPE_TEST_POSTGRES"],
            env,
            Duration::from_secs(60),
        );
        let text = format!("{}\n--- stderr\n{}", stdout(&o), stderr(&o));
        (o.status.code(), stdout(&o), text)
    };
    for env in [
        &[][..],
        &[("CI", "false")],
        &[("IMGPIPE_TEST_POSTGRES", "")],
    ] {
        let (code, out, text) = alone(env);
        assert_eq!(code, Some(0), "{env:?}: {text}");
        assert!(
            out.contains(&format!(
                "test {TEST} ... skipped: no PostgreSQL: IMGPIPE_TEST_POSTGRES is unset"
            )),
            "{env:?}: {text}"
        );
        assert!(out.contains("1 passed"), "{env:?}: {text}");
    }
    for ci in ["true", "1", "TRUE"] {
        let (code, _, text) = alone(&[("CI", ci)]);
        assert_eq!(code, Some(101), "CI={ci}: {text}");
        assert!(
            text.contains(&format!(
                "PostgreSQL unavailable, and CI={ci} requires it: IMGPIPE_TEST_POSTGRES is unset"
            )),
            "CI={ci}: {text}"
        );
        assert!(!text.contains("skipped:"), "CI={ci}: {text}");
    }
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

/// Two hosts started by the same cron line: one runs (held mid-call by the sandbox, so it
/// holds the lock), the other exits 5 naming it; with `--wait` it is seen waiting, then finds
/// the run finished and pays nothing.
#[tokio::test(flavor = "multi_thread")]
async fn two_hosts_on_one_postgres_state_one_runs_the_other_exits_5_or_waits_and_pays_nothing() {
    let Some(url) = postgres_database("lock").await else {
        return;
    };
    let env = start(config()).await;
    let (a, b) = (host(&edit_chain(3, None)), host(&edit_chain(3, None)));
    let hold = env.sandbox.hold();
    let first = on(
        &env,
        a.path(),
        &url,
        &["run", "p.yaml", "--run-id", "nightly"],
    );
    let first = Watched::start(first);
    let first_pid = first.id();
    wait_until("the first host's call held mid-flight", || {
        env.sandbox.held_calls() >= 1
    })
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

    let mut waiting = Watched::start(on(
        &env,
        b.path(),
        &url,
        &["run", "p.yaml", "--run-id", "nightly", "--wait"],
    ));
    waiting
        .wait_for_line(&format!("waiting for run nightly by pid {first_pid}"))
        .await;
    drop(hold);
    let waited = waiting.finish().await;
    assert_exit_without_panic(&waited, 0);
    let first = first.finish().await;
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
    let env = start(config()).await;
    let (a, b) = (host(&edit_chain(4, None)), host(&edit_chain(4, None)));
    // Three calls let through the gate, the next held: the first host dies with work left,
    // however fast the machine.
    let hold = env.sandbox.hold();
    env.sandbox.let_through(3);
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
    wait_until("the first host's fourth call held", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    kill_child(&mut first, "the first host's run").await;
    crate::common::release_after_kill(&env, hold).await;
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
    assert!(
        done < 12,
        "the first host left work to take over: {done} of 12 done"
    );
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
    assert!(new_attempts > 0, "the second host took the run over");
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
    let env = start(config()).await;
    let a = host(&edit_chain(8, None));
    // One call let through the gate, the next held until the run has seen its session cut:
    // the run cannot finish first, however fast the machine.
    let hold = env.sandbox.hold();
    env.sandbox.let_through(1);
    let mut run = Watched::start(on(
        &env,
        a.path(),
        &url,
        &["run", "p.yaml", "--run-id", "cut", "--concurrency", "2"],
    ));
    wait_for(
        &url,
        "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'",
        "a task done",
    )
    .await;
    wait_until("the run's next call held", || env.sandbox.held_calls() >= 1).await;
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
    run.wait_for_line("lost the run lock's session").await;
    drop(hold);
    let stopped = run.finish().await;
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
    let env = start(config()).await;
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
    let mut cmd = Imgpipe::new(&args)
        .cwd(a.path())
        .state(&url)
        .sandbox(&env)
        .s3(&s3)
        .command();
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // Three calls let through the gate, the next held: the first pod dies with work left,
    // however fast the machine.
    let hold = env.sandbox.hold();
    env.sandbox.let_through(3);
    let mut first = cmd.spawn().unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL HAVING COUNT(*) >= 3",
        "three outputs stored",
    )
    .await;
    wait_until("the first pod's fourth call held", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    kill_child(&mut first, "the first pod's run").await;
    crate::common::release_after_kill(&env, hold).await;
    drop(a);
    let left = count(
        &url,
        "SELECT COUNT(*) FROM tasks WHERE status <> 'succeeded'",
    )
    .await;
    assert!(left > 0, "the first pod left work to take over");
    let attempts_then = count(&url, "SELECT COUNT(*) FROM attempts").await;

    let second = Imgpipe::new(&args)
        .cwd(b.path())
        .state(&url)
        .sandbox(&env)
        .s3(&s3)
        .run()
        .await;
    assert_exit_without_panic(&second, 0);
    assert!(
        count(&url, "SELECT COUNT(*) FROM attempts").await > attempts_then,
        "the second pod took the run over"
    );
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
    let env = start(config()).await;
    let (a, b) = (host(&edit_chain(3, None)), host(&edit_chain(3, None)));
    let args = ["run", "p.yaml", "--run-id", "same"];
    // Held, the host that takes the lock cannot finish: the other must be refused, whenever
    // it gets there.
    let hold = env.sandbox.hold();
    let mut one = tokio::spawn(finish(on(&env, a.path(), &url, &args)));
    let mut two = tokio::spawn(finish(on(&env, b.path(), &url, &args)));
    let (refused, runs) = tokio::select! {
        done = &mut one => (done.unwrap(), two),
        done = &mut two => (done.unwrap(), one),
    };
    assert_exit_without_panic(&refused, 5);
    assert!(
        stderr(&refused).contains("run same by pid"),
        "{}",
        stderr(&refused)
    );
    drop(hold);
    let ran = runs.await.unwrap();
    assert_exit_without_panic(&ran, 0);
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

/// The statements a client sends a PostgreSQL server, seen by a relay on 127.0.0.1 in front of
/// it: the text of every statement executed (an extended-protocol Execute, by the text of the
/// statement bound, or a simple Query), in the order the relay got them from all the client's
/// connections. The server's own counters cannot say this (`pg_stat_statements` needs a server
/// started with it; `pg_stat_database` counts transactions), and neither can time.
struct Statements {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Statements {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Statements {
    async fn start(url: &str) -> Statements {
        let server = url::Url::parse(url).unwrap();
        let server = format!(
            "{}:{}",
            server.host_str().unwrap(),
            server.port().unwrap_or(5432)
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, server.clone(), Arc::clone(&log)));
            }
        });
        Statements { port, seen, task }
    }

    /// `url` through the relay, without TLS (the relay reads the protocol in the clear).
    fn url(&self, url: &str) -> String {
        let mut url = url::Url::parse(url).unwrap();
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.set_query(Some("sslmode=disable"));
        url.to_string()
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }
}

/// Relays one connection, reading the client's messages (protocol 3.0) as they pass.
async fn relay(
    client: tokio::net::TcpStream,
    server: String,
    seen: Arc<Mutex<Vec<String>>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = tokio::net::TcpStream::connect(&server).await?;
    let (client_in, mut client_out) = client.into_split();
    let (mut server_in, mut server_out) = upstream.into_split();
    tokio::spawn(async move { tokio::io::copy(&mut server_in, &mut client_out).await });
    let mut from = tokio::io::BufReader::new(client_in);
    // Messages without a type byte come first: requests for TLS or GSS encryption (refused by
    // the server, sslmode=disable), then the startup message.
    loop {
        let len = from.read_i32().await?;
        let body = message_body(&mut from, len).await?;
        server_out.write_all(&len.to_be_bytes()).await?;
        server_out.write_all(&body).await?;
        let code = body
            .get(..4)
            .map(|c| i32::from_be_bytes(c.try_into().unwrap()));
        if !matches!(code, Some(80_877_103 | 80_877_104)) {
            break;
        }
    }
    let text = |bytes: &[u8]| -> (String, usize) {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        (String::from_utf8_lossy(&bytes[..end]).into_owned(), end + 1)
    };
    let mut prepared: HashMap<String, String> = HashMap::new();
    let mut bound = String::new();
    loop {
        let kind = from.read_u8().await?;
        let len = from.read_i32().await?;
        let body = message_body(&mut from, len).await?;
        match kind {
            b'P' => {
                let (name, at) = text(&body);
                prepared.insert(name, text(&body[at.min(body.len())..]).0);
            }
            b'B' => {
                let (_portal, at) = text(&body);
                let (statement, _) = text(&body[at.min(body.len())..]);
                bound = prepared.get(&statement).cloned().unwrap_or_default();
            }
            b'E' => seen.lock().unwrap().push(bound.clone()),
            b'Q' => seen.lock().unwrap().push(text(&body).0),
            _ => {}
        }
        let mut message = Vec::with_capacity(body.len() + 5);
        message.push(kind);
        message.extend_from_slice(&len.to_be_bytes());
        message.extend_from_slice(&body);
        server_out.write_all(&message).await?;
    }
}

/// The rest of a message whose length field (itself included) is `len`.
async fn message_body(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    len: i32,
) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut body = vec![0; usize::try_from(len).unwrap_or(4).saturating_sub(4)];
    from.read_exact(&mut body).await?;
    Ok(body)
}

/// Statements a review may send: opening the state and looking at it, the run, its tasks,
/// outputs and totals, each read once or a few times, whatever the number of tasks (19 when
/// written). A query per task (or per output) would be thousands here.
const REVIEW_STATEMENTS: usize = 50;
/// Statements a takeover may send before its first paid call: the review, settling the calls
/// the killed host left in flight (a few each, at most its concurrency), recording the next
/// chunk of items' tasks (100 rows a statement), and starting the scheduler (47 when written).
const TAKEOVER_STATEMENTS: usize = 150;

/// The issue's takeover at the scale of a test: 20,000 items (40,000 tasks) on PostgreSQL,
/// killed with thousands of tasks recorded and the tables never analysed, then reviewed and
/// taken over at once. What is held is the number of statements sent, not the time: a
/// statement per item would show as 20,000, one per task recorded or done (or per output) as
/// a thousand or more, against bounds of 50 and 150; and a plan gone wrong on
/// tables without statistics is what the scale bench measures. (The run was killed after
/// 2,500 outputs before: 1,000 tell a statement per task as well, for 3,000 fewer calls.)
#[tokio::test(flavor = "multi_thread")]
async fn a_run_of_20000_items_killed_on_postgres_is_reviewed_and_taken_over_in_few_statements() {
    let Some(url) = postgres_database("statements").await else {
        return;
    };
    let env = start(sandbox::Config {
        balance: 100_000_000,
        image_side: 16,
        ..sandbox::Config::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut items = String::new();
    for i in 0..20_000 {
        items += &format!("{{\"id\": \"p{i:06}\"}}\n");
    }
    write(dir.path(), "items.jsonl", &items);
    write(
        dir.path(),
        "p.yaml",
        r#"version: 1
name: statements
pricing: { generation: 4 }
items_from: items.jsonl
steps:
  - id: shot
    generate: { prompt: "Studio photo of {{ item.id }}", n: 1 }
  - id: clean
    erase: { from: shot, object_name: the corner }
"#,
    );
    let args = ["run", "p.yaml", "--run-id", "night", "--concurrency", "8"];
    let mut first = on(&env, dir.path(), &url, &args).spawn().unwrap();
    wait_for(
        &url,
        "SELECT COUNT(*) FROM outputs WHERE path IS NOT NULL HAVING COUNT(*) >= 1000",
        "1,000 outputs stored",
    )
    .await;
    kill_child(&mut first, "the run of 20,000 items").await;
    let recorded = count(&url, "SELECT COUNT(*) FROM tasks").await;
    let done = count(
        &url,
        "SELECT COUNT(*) FROM tasks WHERE status = 'succeeded'",
    )
    .await;
    assert!(
        recorded >= 2_000 && done >= 1_000,
        "the run recorded {recorded} tasks, {done} done: too few to tell a statement per task"
    );

    let relay = Statements::start(&url).await;
    let through = relay.url(&url);
    let dry = run_on(
        &env,
        dir.path(),
        &through,
        &["resume", "night", "--dry-run"],
    )
    .await;
    assert_exit_without_panic(&dry, 0);
    let review = relay.seen();
    assert!(
        review.len() <= REVIEW_STATEMENTS,
        "resume --dry-run sent {} statements for {recorded} tasks ({done} done):\n{}",
        review.len(),
        review.join("\n")
    );

    relay.clear();
    let mut second = on(&env, dir.path(), &through, &["resume", "night"])
        .spawn()
        .unwrap();
    let started = Instant::now();
    let first_call = loop {
        let seen = relay.seen();
        if let Some(at) = seen.iter().position(|s| s.contains("INSERT INTO attempts")) {
            break at;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the takeover made no paid call; it sent:\n{}",
            seen.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    kill_child(&mut second, "the takeover").await;
    let seen = relay.seen();
    assert!(
        first_call <= TAKEOVER_STATEMENTS,
        "the takeover sent {first_call} statements before its first paid call, for {recorded} \
         tasks ({done} done):\n{}",
        seen[..first_call].join("\n")
    );
}

/// The store's pricing by row id, which leaves PostgreSQL's planner no index to choose (by key,
/// without statistics, it may read every task of the step for each task priced); on SQLite
/// too, which needs no server.
#[tokio::test(flavor = "multi_thread")]
async fn tasks_are_priced_by_row_id_on_postgres_and_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    priced_by_row_id(&dir.path().join("state.db").to_string_lossy()).await;
    if let Some(url) = postgres_database("planned").await {
        priced_by_row_id(&url).await;
    }
}

/// The state database at `state`, opened as imgpipe opens it.
async fn store_at(state: &str) -> imgpipe::store::Store {
    use imgpipe::store::{Location, Store};
    Store::open_at(&Location::parse(state, "--state").unwrap())
        .await
        .unwrap()
}

/// The plan of [`one_step_run`]: an empty document, as the store records it.
static EMPTY_PLAN: std::sync::LazyLock<imgpipe::store::RecordedPlan> =
    std::sync::LazyLock::new(|| imgpipe::store::RecordedPlan::of(&serde_json::json!({})).unwrap());

/// The id of [`one_step_run`].
static RUN_R: std::sync::LazyLock<imgpipe::run_id::RunId> =
    std::sync::LazyLock::new(|| imgpipe::run_id::RunId::from("r"));

/// The digest [`one_step_run`] records for its pipeline and its items: of nothing.
static NO_TEXT: std::sync::LazyLock<Sha256Sum> =
    std::sync::LazyLock::new(|| Sha256Sum::of_bytes(b""));

/// Run `r` of a one-step pipeline, its outputs under `output_dir`.
fn one_step_run(output_dir: &str) -> imgpipe::store::NewRun<'_> {
    imgpipe::store::NewRun {
        id: &RUN_R,
        pipeline_name: "p",
        pipeline_file: "p.yaml",
        pipeline_text: "",
        pipeline_sha256: &NO_TEXT,
        items_sha256: &NO_TEXT,
        plan: &EMPTY_PLAN,
        output_dir,
        credits_planned: 2,
        balance_before: None,
    }
}

/// An erase of item `item`, planned at a credit.
fn erase_task(item: &str) -> imgpipe::store::NewTask {
    imgpipe::store::NewTask {
        key: imgpipe::task_key::TaskKey::new(item, "s", 0),
        operation: "erase",
        inputs: "[]".to_owned(),
        planned_credits: 1,
        request: Some(r#"{"object_name":"logo"}"#.to_owned()),
    }
}

async fn priced_by_row_id(state: &str) {
    let store = store_at(state).await;
    let run = one_step_run("out");
    let task = erase_task;
    store
        .runs()
        .create(&run, &[task("a"), task("b")])
        .await
        .unwrap();
    let ids: Vec<imgpipe::store::TaskId> = store
        .tasks()
        .all(&"r".into())
        .await
        .unwrap()
        .iter()
        .map(|t| t.id)
        .collect();
    store.tasks().set_planned(&[(ids[1], 7)]).await.unwrap();
    let planned: Vec<u64> = store
        .tasks()
        .all(&"r".into())
        .await
        .unwrap()
        .iter()
        .map(|t| t.planned_credits)
        .collect();
    assert_eq!(planned, [1, 7]);
    store.close().await;
}

/// A resume's check walks the run's outputs against S3's listing, which is in the byte order
/// of the keys: the store gives them in that order whatever the collation (here an ICU
/// locale's on PostgreSQL, which sorts `_t` before `A` and `aB` after `ab`); on SQLite too.
#[tokio::test(flavor = "multi_thread")]
async fn stored_outputs_come_in_the_byte_order_of_their_paths_on_postgres_and_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("state.db");
    let sqlite = url::Url::from_file_path(&file).unwrap();
    in_byte_order(
        &file.to_string_lossy(),
        &format!("sqlite://{}", sqlite.path()),
    )
    .await;
    if let Some(url) = postgres_database("bytes").await {
        in_byte_order(&url, &url).await;
    }
}

async fn in_byte_order(state: &str, writer: &str) {
    let store = store_at(state).await;
    let run = one_step_run("s3://bkt/runs");
    let keys = [
        "a-b", "a/b", "aB", "ab", "ac", "a.b", "A", "_t", "é", "z", "Z", "a b", "a~",
    ];
    // Past the store's page of 1,000 rows twice: pages follow one another without a gap.
    let many: Vec<String> = (0..2_100).map(|i| format!("p{i:05}")).collect();
    let keys: Vec<&str> = keys
        .into_iter()
        .chain(many.iter().map(String::as_str))
        .collect();
    let task = erase_task;
    let tasks: Vec<imgpipe::store::NewTask> = (0..keys.len() + 2)
        .map(|i| task(&format!("i{i}")))
        .collect();
    store.runs().create(&run, &tasks).await.unwrap();
    let ids: Vec<imgpipe::store::TaskId> = store
        .tasks()
        .all(&"r".into())
        .await
        .unwrap()
        .iter()
        .map(|t| t.id)
        .collect();
    sqlx::any::install_default_drivers();
    let mut conn = within(
        &format!("opening {writer}"),
        sqlx::AnyConnection::connect(writer),
    )
    .await
    .unwrap();
    if writer.starts_with("postgres") {
        // A database whose collation is a locale's, as a cluster made with one has (when this
        // server has ICU's, as Debian's does).
        let (icu,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM pg_collation WHERE collname = 'en-US-x-icu'")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        if icu > 0 {
            sqlx::query(r#"ALTER TABLE outputs ALTER COLUMN path TYPE TEXT COLLATE "en-US-x-icu""#)
                .execute(&mut conn)
                .await
                .unwrap();
        } else {
            eprintln!("no ICU collation on this server: the database's own collation is used");
        }
    }
    let paths: Vec<Option<String>> = keys
        .iter()
        .map(|k| Some(format!("s3://bkt/runs/r/{k}/shot.png")))
        // Not stored (its download failed), then stored but not hashed: neither is checked.
        .chain([None, Some("s3://bkt/runs/r/nohash.png".to_owned())])
        .collect();
    let mut conn = conn.begin().await.unwrap();
    for (i, path) in paths.iter().enumerate() {
        let sha = (i < keys.len()).then(|| format!("{i:064}"));
        sqlx::query(
            "INSERT INTO outputs (task_id, run_id, k, job_id, url, url_issued_at, path, sha256,
                 bytes, etag)
             VALUES ($1, 'r', 0, $2, 'https://x', 0, $3, $4, 7, '\"e\"')",
        )
        .bind(ids[i])
        .bind(format!("job{i}"))
        .bind(path.clone())
        .bind(sha)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
    conn.commit().await.unwrap();
    let stored: Vec<imgpipe::store::StoredOutput> =
        futures::TryStreamExt::try_collect(store.kept().stored(&RUN_R))
            .await
            .unwrap();
    let listed: Vec<&str> = stored.iter().map(|o| o.path.as_str()).collect();
    let mut bytes: Vec<&str> = paths[..keys.len()]
        .iter()
        .map(|p| p.as_deref().unwrap())
        .collect();
    bytes.sort_unstable();
    assert_eq!(listed, bytes, "{state}");
    assert!(
        stored
            .iter()
            .all(|o| o.bytes == Some(7) && o.etag.as_deref() == Some("\"e\""))
    );
    // Read back whole by id, in the order of the ids.
    let mut some: Vec<imgpipe::store::OutputId> = stored.iter().take(3).map(|o| o.id).collect();
    some.sort_unstable();
    let rows = store.kept().by_id(&some).await.unwrap();
    let read: Vec<(imgpipe::store::OutputId, &str)> =
        rows.iter().map(|r| (r.id, r.task.item.as_str())).collect();
    let expected: Vec<(imgpipe::store::OutputId, String)> = some
        .iter()
        .map(|id| {
            let o = stored.iter().find(|o| o.id == *id).unwrap();
            let i = ids.iter().position(|t| *t == o.task_id).unwrap();
            (*id, format!("i{i}"))
        })
        .collect();
    assert_eq!(
        read,
        expected
            .iter()
            .map(|(id, item)| (*id, item.as_str()))
            .collect::<Vec<_>>()
    );
    store.close().await;
}

/// A report of a run in object storage lists `_thumbs/` against the recorded thumbnails in
/// the order of their names, a page of the store's at a time, and looks a page's up by name:
/// on both backends the pages follow one another without a gap, a name put again replaces
/// its row, and a forgotten one is gone.
#[tokio::test(flavor = "multi_thread")]
async fn recorded_thumbnails_come_in_name_order_a_page_at_a_time_on_postgres_and_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("state.db");
    thumbnails_recorded(&file.to_string_lossy()).await;
    if let Some(url) = postgres_database("thumbs").await {
        thumbnails_recorded(&url).await;
    }
}

async fn thumbnails_recorded(state: &str) {
    use imgpipe::store::Thumbnail;
    let store = store_at(state).await;
    let run = one_step_run("s3://bkt/runs");
    store.runs().create(&run, &[erase_task("a")]).await.unwrap();
    let row = |i: u32| Thumbnail {
        // Hex, as a sha256's start is, written out of order.
        name: format!("{:032x}", u128::from(i.wrapping_mul(2_654_435_761))),
        size: (2048, 1536 + i),
        thumb_size: (256, 192),
        alpha: i.is_multiple_of(2),
        bytes: 100 + u64::from(i),
        etag: (!i.is_multiple_of(3)).then(|| format!("\"e{i}\"")),
    };
    // Past the store's page of 1,000 rows twice, in statements of a few hundred.
    let rows: Vec<Thumbnail> = (0..2_100).map(row).collect();
    store
        .thumbnails()
        .record(&imgpipe::run_id::RunId::from("r"), &rows)
        .await
        .unwrap();
    let listed: Vec<Thumbnail> =
        futures::TryStreamExt::try_collect(store.thumbnails().list(&RUN_R))
            .await
            .unwrap();
    let mut expected = rows.clone();
    expected.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(listed, expected, "{state}");
    // Put again: the row is replaced, not doubled.
    let again = Thumbnail {
        bytes: 7,
        etag: None,
        ..rows[5].clone()
    };
    store
        .thumbnails()
        .record(
            &imgpipe::run_id::RunId::from("r"),
            std::slice::from_ref(&again),
        )
        .await
        .unwrap();
    let names: Vec<String> = rows[..300]
        .iter()
        .map(|t| t.name.clone())
        .chain(["f".repeat(32)])
        .collect();
    let mut found = store
        .thumbnails()
        .named(&imgpipe::run_id::RunId::from("r"), &names)
        .await
        .unwrap();
    found.sort_unstable_by_key(|t| t.size.1);
    assert_eq!(found.len(), 300, "{state}: a name with none is left out");
    assert_eq!(found[5], again, "{state}");
    assert_eq!(found[6], rows[6], "{state}");
    store
        .thumbnails()
        .forget(&imgpipe::run_id::RunId::from("r"), &names[..250])
        .await
        .unwrap();
    let left = futures::TryStreamExt::try_collect::<Vec<_>>(store.thumbnails().list(&RUN_R))
        .await
        .unwrap();
    assert_eq!(left.len(), 1_850, "{state}");
    assert!(
        store
            .thumbnails()
            .named(&imgpipe::run_id::RunId::from("r"), &names[..250])
            .await
            .unwrap()
            .is_empty()
    );
    store.close().await;
}

/// `.ci/postgres.sh` as `.ci/run` sources it, given server binaries that are not there, or an
/// `initdb` that fails: CI must stop there with the reason rather than go on without the
/// PostgreSQL tests.
#[test]
fn ci_stops_when_it_cannot_have_postgresql() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let broken = tempfile::tempdir().unwrap();
    let initdb = broken.path().join("initdb");
    std::fs::write(
        &initdb,
        "#!/bin/sh\necho 'initdb: no space left' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&initdb, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let broken = broken.path().to_string_lossy().into_owned();
    let missing = "/nonexistent/imgpipe-test/postgresql/bin";
    for (bin, why) in [
        (missing, format!("IMGPIPE_PG_BIN={missing} holds no initdb")),
        (broken.as_str(), "initdb failed, see ".to_owned()),
    ] {
        let mut cmd = std::process::Command::new("bash");
        cmd.args([
            "-c",
            "set -euo pipefail; source .ci/postgres.sh; echo 'went on'",
        ])
        .current_dir(root)
        .env("IMGPIPE_PG_BIN", bin)
        .env_remove("IMGPIPE_TEST_POSTGRES")
        .stdin(std::process::Stdio::null());
        let o =
            crate::common::finish_blocking(cmd, Duration::from_secs(60), "source .ci/postgres.sh");
        let text = format!("{}\n--- stderr\n{}", stdout(&o), stderr(&o));
        assert_ne!(o.status.code(), Some(0), "{bin}: {text}");
        assert!(!stdout(&o).contains("went on"), "{bin}: {text}");
        assert!(
            stderr(&o).contains(&format!("error: PostgreSQL unavailable ({why}")),
            "{bin}: {text}"
        );
        // The cluster's directory, kept for its log: the test's own, so removed.
        if let Some(log) = stderr(&o)
            .split_whitespace()
            .find(|w| w.contains("/initdb.log"))
        {
            let dir = Path::new(log.trim_end_matches([')', ':']))
                .parent()
                .unwrap();
            assert!(dir.starts_with("/tmp"), "{}", dir.display());
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}

/// `IMGPIPE_STATE=postgres://…` without `--state` keeps the run in that database: the run and its
/// attempts are there, one a bill, and `status` reads it back the same way.
#[tokio::test(flavor = "multi_thread")]
async fn imgpipe_state_set_to_a_postgres_url_keeps_the_run_there() {
    let Some(url) = postgres_database("state_env").await else {
        return;
    };
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "by-env"])
        .env("IMGPIPE_STATE", url.as_str())
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(
        count(&url, "SELECT COUNT(*) FROM runs WHERE id = 'by-env'").await,
        1
    );
    assert_eq!(
        count(&url, "SELECT COUNT(*) FROM attempts").await,
        i64::try_from(env.sandbox.ledger().len()).unwrap()
    );
    let status = Imgpipe::on(&env, &["status", "by-env", "--json"])
        .env("IMGPIPE_STATE", url.as_str())
        .run()
        .await;
    assert_exit_without_panic(&status, 0);
    assert_eq!(json_stdout(&status)["status"], "succeeded");
}

/// Items whose task ids do not follow the pipeline's chain are read whole by resume, a range
/// of the unique (run, item, …) index a statement, in the order the database sorts item ids
/// (here, on PostgreSQL, an ICU locale's, which sorts `a0002` between `A0001` and `A0003`, and
/// bytes do not). A run stopped `--until` a step, then resumed with that step dropped
/// (`--allow-changes`) and stopped again, makes every item so: a range that missed one would leave a task without its row id and the run
/// would stop, "was not recorded". Each resume pays for its step once an item and nothing
/// twice; the dropped step's rows stay dropped (left out by the store, not by the statement:
/// the last resume, without `--allow-changes`, would refuse a step dropped).
#[tokio::test(flavor = "multi_thread")]
async fn items_read_whole_in_ranges_of_the_database_order_are_each_resumed_once() {
    if let Some(url) = postgres_database("ranges").await {
        resumed_with_every_item_irregular(&url).await;
    }
}

/// The same on SQLite (bytes order), a test of its own so that the two backends' runs, a
/// minute or more each on a loaded machine, go side by side.
#[tokio::test(flavor = "multi_thread")]
async fn on_sqlite_items_read_whole_in_ranges_are_each_resumed_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("state.db");
    resumed_with_every_item_irregular(&file.to_string_lossy()).await;
}

/// [`run_on`] with a statement reading 50 items whole (`IMGPIPE_TEST_ITEMS_PER_STATEMENT`).
async fn in_ranges(env: &Env, dir: &Path, url: &str, args: &[&str]) -> Output {
    let mut cmd = on(env, dir, url, args);
    cmd.env("IMGPIPE_TEST_ITEMS_PER_STATEMENT", "50");
    finish(cmd).await
}

async fn resumed_with_every_item_irregular(state: &str) {
    // More than the items one statement reads whole (500, `ITEMS_PER_STATEMENT` in
    // src/store/outline.rs, set to 50 here by `IMGPIPE_TEST_ITEMS_PER_STATEMENT`): two ranges,
    // the boundary between them inside the interleaved `a`/`A` ids. (600 items at 500 a
    // statement before: the same two ranges, ten times the calls.)
    const ITEMS: usize = 60;
    let env = start(sandbox::Config {
        balance: 100_000_000,
        image_side: 16,
        ..sandbox::Config::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let items: String = (0..ITEMS)
        .map(|i| {
            format!(
                "{{\"id\": \"{}{i:04}\"}}\n",
                if i % 2 == 0 { 'a' } else { 'A' }
            )
        })
        .collect();
    write(dir.path(), "items.jsonl", &items);
    let pipeline = |last: &str| {
        format!(
            "version: 1\nname: ranges\npricing: {{ generation: 4 }}\nitems_from: items.jsonl\n\
             steps:\n  - id: shot\n    generate: {{ prompt: \"Photo of {{{{ item.id }}}}\", n: 1 }}\n{last}"
        )
    };
    let tag = "  - id: tag\n    erase: { from: shot, object_name: the tag }\n";
    let big = "  - id: big\n    upscale: { from: shot, desired_increase: 2 }\n";
    let cut = "  - id: cut\n    remove_background: { from: shot }\n";
    write(dir.path(), "p.yaml", &pipeline(&format!("{tag}{big}{cut}")));
    let args = [
        "run",
        "p.yaml",
        "--run-id",
        "night",
        "--until",
        "tag",
        "--concurrency",
        "16",
    ];
    let first = in_ranges(&env, dir.path(), state, &args).await;
    assert_exit_without_panic(&first, 7);
    let paid_first = env.sandbox.ledger().len();
    assert_eq!(paid_first, 2 * ITEMS, "the first run: {}", stderr(&first));
    if state.starts_with("postgres") {
        in_locale_order(state).await;
    }

    // `tag` dropped: every item's ids now break the chain (shot, big, cut).
    write(dir.path(), "p.yaml", &pipeline(&format!("{big}{cut}")));
    let args = ["resume", "night", "--allow-changes", "--until", "big"];
    let resumed = in_ranges(&env, dir.path(), state, &args).await;
    assert_exit_without_panic(&resumed, 7);
    let paid = |from: usize, operation: &str| {
        let ledger = env.sandbox.ledger();
        let of = ledger[from..].iter().filter(|e| e.operation == operation);
        (ledger.len() - from, of.count())
    };
    assert_eq!(
        paid(paid_first, "upscale"),
        (ITEMS, ITEMS),
        "the resume pays `big` once an item, nothing else: {}",
        stderr(&resumed)
    );
    // A plain resume: the dropped rows are no change to allow (were they read as the
    // pipeline's, the review would find `tag` dropped again and refuse).
    let paid_second = env.sandbox.ledger().len();
    let last = in_ranges(&env, dir.path(), state, &["resume", "night"]).await;
    assert_exit_without_panic(&last, 0);
    assert_eq!(
        paid(paid_second, "remove_background"),
        (ITEMS, ITEMS),
        "the last resume pays `cut` once an item, nothing else: {}",
        stderr(&last)
    );
    let ledger = env.sandbox.ledger();
    let mut requests: Vec<&str> = ledger.iter().map(|e| e.request.as_str()).collect();
    requests.sort_unstable();
    requests.dedup();
    assert_eq!(requests.len(), ledger.len(), "a request paid twice");
    // Every output of the steps left stored where the state says, and nowhere else.
    let mut conn = state_connection(state).await;
    let paths: Vec<(String,)> = sqlx::query_as(
        "SELECT o.path FROM outputs o JOIN tasks t ON t.id = o.task_id
         WHERE t.removed_at IS NULL AND o.path IS NOT NULL",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert_eq!(paths.len(), 3 * ITEMS);
    let run_dir = dir.path().join("out/night");
    let missing: Vec<&String> = paths
        .iter()
        .map(|(p,)| p)
        .filter(|p| !run_dir.join(p).is_file() && !Path::new(p).is_file())
        .collect();
    assert!(
        missing.is_empty(),
        "outputs not stored: {:?}",
        &missing[..missing.len().min(5)]
    );
    let live = "SELECT COUNT(*) FROM tasks WHERE removed_at IS NULL AND status = 'succeeded'";
    let dropped = "SELECT COUNT(*) FROM tasks WHERE removed_at IS NOT NULL AND step = 'tag'";
    let (live, dropped) = (count(state, live).await, count(state, dropped).await);
    assert_eq!((live, dropped), (3 * ITEMS as i64, ITEMS as i64));
}

/// Gives the state's item ids an ICU locale's collation (as a cluster made with one has), when
/// this server has ICU's.
async fn in_locale_order(url: &str) {
    let mut conn = state_connection(url).await;
    let (icu,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM pg_collation WHERE collname = 'en-US-x-icu'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    if icu > 0 {
        sqlx::query(r#"ALTER TABLE tasks ALTER COLUMN item TYPE TEXT COLLATE "en-US-x-icu""#)
            .execute(&mut conn)
            .await
            .unwrap();
    } else {
        eprintln!("no ICU collation on this server: the database's own collation is used");
    }
    conn.close().await.unwrap();
}
