//! Alerts and metrics end to end: the real binary against the sandbox, posting its events to a
//! receiver on 127.0.0.1 in the test and writing its metrics file, both held against the
//! sandbox's ledger and the state database.
//!
//! A receiver that is down or holds every request must change neither the exit code nor, past
//! the documented bound, when the process exits: checked against a ceiling far below what the
//! unbounded retries would take, never against a measured time.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::Value;
use sha2::Sha256;
use sqlx::Row;

use crate::common::*;
use crate::run::{config, edit_chain, state_path, write};

const SECRET: &str = "s3cret-for-the-receiver";
/// erase 2 + upscale 2× 2 + remove_background 5 credits, three items.
const ITEMS: usize = 3;
const PLANNED: u64 = 27;
/// Far below what a held webhook would keep an unbounded sender (four tries of 10 s each), far
/// above the documented 5 s bound plus a run of a few tasks.
const CEILING: Duration = Duration::from_secs(25);
/// How long a test waits for an event that should come.
const EVENT_WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// A receiver on loopback
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
pub(crate) struct Got {
    event: Option<String>,
    signature: Option<String>,
    body: Bytes,
}

impl Got {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

type Log = Arc<Mutex<Vec<Got>>>;

/// A webhook receiver: records every request; answers 204 or, `holding`, never answers.
pub(crate) struct Receiver {
    pub(crate) url: String,
    got: Log,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub(crate) async fn receiver(holding: bool) -> Receiver {
    async fn hook(
        State((got, holding)): State<(Log, bool)>,
        headers: HeaderMap,
        body: Bytes,
    ) -> StatusCode {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        got.lock().unwrap().push(Got {
            event: header("x-imgpipe-event"),
            signature: header("x-imgpipe-signature"),
            body,
        });
        if holding {
            std::future::pending::<()>().await;
        }
        StatusCode::NO_CONTENT
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got = Log::default();
    let app = axum::Router::new()
        .route("/hook", post(hook))
        .with_state((Arc::clone(&got), holding));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Receiver {
        url: format!("http://{addr}/hook"),
        got,
        server,
    }
}

impl Receiver {
    fn all(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    fn of_kind(&self, kind: &str) -> Vec<Got> {
        self.all()
            .into_iter()
            .filter(|g| g.event.as_deref() == Some(kind))
            .collect()
    }

    /// Waits for a `kind` event, failing with what came instead.
    pub(crate) async fn wait_for(&self, kind: &str) -> Got {
        let deadline = tokio::time::Instant::now() + EVENT_WAIT;
        loop {
            if let Some(g) = self.of_kind(kind).pop() {
                return g;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {kind} event within {EVENT_WAIT:?}; got {:?}",
                self.all()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A loopback port nothing listens on: connections are refused.
async fn closed_port_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}/hook")
}

fn assert_signed(got: &Got) {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(&got.body);
    let expected = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    assert_eq!(got.signature.as_deref(), Some(expected.as_str()), "{got:?}");
}

/// No key, secret or password in any body the receiver got.
fn assert_no_secret(env: &Env, receiver: &Receiver) {
    for got in receiver.all() {
        let body = String::from_utf8_lossy(&got.body);
        for secret in [env.sandbox.key(), SECRET] {
            assert!(!body.contains(secret), "a secret in {body}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running the binary
// ---------------------------------------------------------------------------------------------

fn ledger_total(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

/// The run's id, status, task count and planned credits, as the state database has them.
async fn recorded(dir: &Path) -> (String, String, i64, i64) {
    let mut db = state_connection(&state_path(dir).to_string_lossy()).await;
    let run = sqlx::query("SELECT id, status FROM runs")
        .fetch_one(&mut db)
        .await
        .unwrap();
    let tasks = sqlx::query(
        "SELECT COUNT(*) AS n, CAST(SUM(planned_credits) AS BIGINT) AS planned FROM tasks",
    )
    .fetch_one(&mut db)
    .await
    .unwrap();
    (
        run.get("id"),
        run.get("status"),
        tasks.get("n"),
        tasks.get("planned"),
    )
}

// ---------------------------------------------------------------------------------------------
// Alerts
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn run_finished_arrives_signed_with_the_figures_of_the_ledger_and_the_record() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(ITEMS, None));
    let hook = receiver(false).await;
    let o = Imgpipe::on(
        &env,
        &["run", "chain.yaml", "--report", "--notify", &hook.url],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .limit(CEILING)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);

    let got = hook.wait_for("run.finished").await;
    assert_signed(&got);
    let body = got.json();
    let (run_id, status, tasks, planned) = recorded(dir).await;
    assert_eq!(body["event"], "run.finished");
    assert_eq!(body["run_id"], run_id.as_str());
    assert_eq!(body["pipeline"], "chain");
    assert_eq!(body["status"], status.as_str());
    assert_eq!(body["status"], "succeeded");
    assert_eq!(body["exit_code"], 0);
    assert_eq!(body["credits"]["billed"], ledger_total(&env));
    assert_eq!(body["credits"]["billed"], PLANNED);
    assert_eq!(body["credits"]["planned"], planned);
    assert_eq!(body["credits"]["possibly_billed"], 0);
    assert_eq!(body["tasks"]["total"], tasks);
    assert_eq!(body["tasks"]["succeeded"], tasks);
    assert_eq!(body["tasks"]["failed"], 0);
    assert_eq!(body["failures"], serde_json::json!([]));
    assert!(body["duration_seconds"].as_f64().unwrap() > 0.0, "{body}");
    assert!(
        body["output"].as_str().unwrap().ends_with(&run_id),
        "{body}"
    );
    assert!(
        body["report"].as_str().unwrap().ends_with("report.html"),
        "{body}"
    );
    let text = body["text"].as_str().unwrap();
    assert!(
        text.contains(&run_id) && text.contains("succeeded"),
        "{text}"
    );
    assert!(
        text.contains(&format!("{PLANNED} of {PLANNED} credits billed")),
        "{text}"
    );
    // No budget: no mark to cross; every bill as planned.
    assert_eq!(hook.all().len(), 1, "{:?}", hook.all());
    assert_no_secret(&env, &hook);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tight_budget_is_announced_at_50_80_and_100_percent_each_once() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(2, None));
    let hook = receiver(false).await;
    let budget = 18.to_string();
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--max-credits",
            &budget,
            "--notify",
            &hook.url,
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .limit(CEILING)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    hook.wait_for("run.finished").await;
    let mut marks: Vec<u64> = hook
        .of_kind("budget.crossed")
        .iter()
        .map(|g| {
            assert_signed(g);
            let body = g.json();
            assert_eq!(body["max_credits"], 18);
            let percent = body["percent"].as_u64().unwrap();
            let billed = body["credits_billed"].as_u64().unwrap();
            assert!(billed * 100 >= percent * 18, "{body}");
            percent
        })
        .collect();
    marks.sort_unstable();
    assert_eq!(marks, [50, 80, 100], "{:?}", hook.all());
    assert_eq!(ledger_total(&env), 18);
    assert_no_secret(&env, &hook);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_billed_above_the_plan_is_announced_and_the_exit_code_stays_3() {
    let env = start(config()).await;
    let dir = env.dir.path();
    // The sandbox bills 4 credits a generation; the file says 2.
    write(
        dir,
        "gens.yaml",
        "version: 1\nname: gens\npricing: { generation: 2 }\nitems: [{ id: a }, { id: b }]\nsteps:\n  - id: shot\n    generate: { prompt: \"a {{ item.id }}\" }\n",
    );
    let hook = receiver(false).await;
    let o = Imgpipe::on(&env, &["run", "gens.yaml", "--notify", &hook.url])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .env("IMGPIPE_NOTIFY_SECRET", SECRET)
        .limit(CEILING)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let above = hook.wait_for("call.billed_above_plan").await;
    assert_signed(&above);
    let body = above.json();
    assert_eq!(
        (body["planned"].as_u64(), body["billed"].as_u64()),
        (Some(2), Some(4))
    );
    assert!(
        body["task"].as_str().unwrap().ends_with("/shot[0]"),
        "{body}"
    );
    let finished = hook.wait_for("run.finished").await.json();
    assert_eq!(finished["exit_code"], 3);
    assert_eq!(finished["status"], "stopped");
    assert_eq!(finished["credits"]["billed"], ledger_total(&env));
    assert_no_secret(&env, &hook);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_receiver_that_is_down_changes_neither_the_exit_code_nor_the_exit() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(1, None));
    let url = closed_port_url().await;
    let o = Imgpipe::on(&env, &["run", "chain.yaml", "--notify", &url])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .env("IMGPIPE_NOTIFY_SECRET", SECRET)
        .limit(CEILING)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stderr(&o).contains("notify: run.finished not delivered"),
        "{}",
        stderr(&o)
    );
    assert!(
        !stderr(&o).contains(&url),
        "the webhook's URL is not logged"
    );
}

/// A receiver that takes the event and never answers: the run's exit waits for it for the
/// documented 5 s, no less (a lower bound, whatever the machine's speed), then gives up on it
/// and says so; [`CEILING`] only catches a sender that waits for its four tries of 10 s.
#[tokio::test(flavor = "multi_thread")]
async fn a_receiver_that_never_answers_is_waited_for_5s_at_exit_then_given_up_on() {
    const BOUND: Duration = Duration::from_secs(5);
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(1, None));
    let hook = receiver(true).await;
    let started = std::time::Instant::now();
    let o = Imgpipe::on(&env, &["run", "chain.yaml", "--notify", &hook.url])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .env("IMGPIPE_NOTIFY_SECRET", SECRET)
        .limit(CEILING)
        .run()
        .await;
    let took = started.elapsed();
    assert_exit_without_panic(&o, 0);
    assert!(
        took >= BOUND,
        "the exit did not wait the {BOUND:?} bound for the receiver: the run took {took:?}"
    );
    // It was tried, held, and given up on, in that order, before the process ended.
    assert_eq!(hook.of_kind("run.finished").len(), 1, "{:?}", hook.all());
    assert!(
        stderr(&o).contains("notify: gave up on events not delivered within 5s"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_http_to_another_host_is_refused_before_anything_is_sent() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(1, None));
    let o = Imgpipe::on(
        &env,
        &["run", "chain.yaml", "--notify", "http://example.com/hook"],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .limit(CEILING)
    .run()
    .await;
    assert_exit_without_panic(&o, 2);
    assert_nothing_billed(&env);
    write(
        dir,
        "notify.yaml",
        &edit_chain(1, None).replace(
            "output_dir: out\n",
            "output_dir: out\nnotify: http://example.com/x\n",
        ),
    );
    let o = Imgpipe::on(&env, &["run", "notify.yaml"])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .env("IMGPIPE_NOTIFY_SECRET", SECRET)
        .limit(CEILING)
        .run()
        .await;
    assert_exit_without_panic(&o, 2);
    assert!(stderr(&o).contains("notify"), "{}", stderr(&o));
    assert_nothing_billed(&env);
}

#[tokio::test(flavor = "multi_thread")]
async fn notify_in_the_pipeline_file_is_used_without_a_flag() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let hook = receiver(false).await;
    write(
        dir,
        "notify.yaml",
        &edit_chain(1, None).replace(
            "output_dir: out\n",
            &format!("output_dir: out\nnotify: {}\n", hook.url),
        ),
    );
    let o = Imgpipe::on(&env, &["run", "notify.yaml"])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .env("IMGPIPE_NOTIFY_SECRET", SECRET)
        .limit(CEILING)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let body = hook.wait_for("run.finished").await.json();
    assert_eq!(body["credits"]["billed"], ledger_total(&env));
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// The families every metrics file has.
const FAMILIES: [&str; 9] = [
    "imgpipe_run_info",
    "imgpipe_credits_billed_total",
    "imgpipe_credits_planned",
    "imgpipe_credits_possibly_billed",
    "imgpipe_calls_total",
    "imgpipe_calls_in_flight",
    "imgpipe_rate_limited_calls_total",
    "imgpipe_tasks",
    "imgpipe_oldest_undownloaded_output_age_seconds",
];

/// A metrics file parsed as the text exposition format: samples by `name{labels}`. Fails on a
/// line that is not a comment, a blank or a sample, a sample of a family with no `# TYPE`
/// before it, a value that is not a number, a file not ended by a newline, or a missing family.
pub(crate) fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    assert!(text.ends_with('\n'), "not ended by a newline:\n{text}");
    let mut typed = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(["counter", "gauge"].contains(&kind), "{line}");
            assert!(
                typed.insert(name.to_owned(), kind.to_owned()).is_none(),
                "{line}"
            );
            continue;
        }
        if line.starts_with("# HELP ") || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let name = series.split('{').next().unwrap();
        assert!(typed.contains_key(name), "{name} sampled before its # TYPE");
        if typed[name] == "counter" {
            assert!(name.ends_with("_total"), "counter {name}");
        }
        if series.contains('{') {
            assert!(series.ends_with('}'), "{line}");
        }
        let value: f64 = value.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
        samples.insert(series.to_owned(), value);
    }
    for family in FAMILIES {
        assert!(typed.contains_key(family), "no {family} in:\n{text}");
    }
    samples
}

/// `promtool check metrics` on the file when promtool is on PATH; under CI it must be.
pub(crate) fn promtool_accepts(text: &str) {
    if !crate::common::on_path("promtool") {
        crate::common::skip_unless_ci(
            "promtool",
            "promtool is not on PATH",
            "`bash .ci/run` provides it",
        );
        return;
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    let mut cmd = std::process::Command::new("promtool");
    cmd.args(["check", "metrics"])
        .stdin(std::fs::File::open(file.path()).unwrap());
    let out = finish_blocking(cmd, Duration::from_secs(30), "promtool check metrics");
    assert!(
        out.status.success(),
        "promtool check metrics refused the file:\n{}{}\n--- file\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_file_parses_and_its_credits_agree_with_the_ledger() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(ITEMS, None));
    let file = dir.join("imgpipe.prom");
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--metrics-file",
            &file.to_string_lossy(),
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .limit(CEILING)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let text = std::fs::read_to_string(&file).unwrap();
    let m = parse_metrics(&text);
    promtool_accepts(&text);
    let (run_id, _, tasks, planned) = recorded(dir).await;
    let p = "pipeline=\"chain\"";
    assert_eq!(
        m[&format!("imgpipe_run_info{{{p},run_id=\"{run_id}\"}}")],
        1.0
    );
    assert_eq!(
        m[&format!("imgpipe_credits_billed_total{{{p}}}")],
        ledger_total(&env) as f64
    );
    assert_eq!(
        m[&format!("imgpipe_credits_planned{{{p}}}")],
        planned as f64
    );
    assert_eq!(m[&format!("imgpipe_credits_possibly_billed{{{p}}}")], 0.0);
    assert_eq!(
        m[&format!("imgpipe_calls_total{{{p},outcome=\"succeeded\"}}")],
        env.sandbox.ledger().len() as f64
    );
    assert_eq!(
        m[&format!("imgpipe_tasks{{{p},status=\"succeeded\"}}")],
        tasks as f64
    );
    assert_eq!(m[&format!("imgpipe_tasks{{{p},status=\"pending\"}}")], 0.0);
    assert_eq!(
        m[&format!("imgpipe_oldest_undownloaded_output_age_seconds{{{p}}}")],
        0.0
    );
    // The run itself succeeded: the pipeline's last success is its end.
    assert!(m.contains_key(&format!("imgpipe_last_success_timestamp_seconds{{{p}}}")));
    // Only the file: no temporary file left beside it.
    let beside: Vec<_> = entries(dir)
        .into_iter()
        .filter(|e| {
            e.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".imgpipe-metrics")
        })
        .collect();
    assert!(beside.is_empty(), "{beside:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_while_writing_the_metrics_leaves_the_last_whole_file() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(ITEMS, None));
    let file = dir.join("imgpipe.prom");
    // Aborts, as a kill -9 would, with half of the run's last metrics written.
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--metrics-file",
            &file.to_string_lossy(),
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .env(imgpipe::failpoint::ENV, "metrics-file-half-written")
    .limit(CEILING)
    .run()
    .await;
    assert_eq!(o.status.code(), None, "killed by a signal: {o:?}");
    let text = std::fs::read_to_string(&file).unwrap();
    let m = parse_metrics(&text);
    promtool_accepts(&text);
    // The file of the run's start, whole: nothing billed yet then, all of it by the kill.
    assert_eq!(m["imgpipe_credits_billed_total{pipeline=\"chain\"}"], 0.0);
    assert_eq!(ledger_total(&env), PLANNED);
    // The half-written last file is where it was cut: a hidden temporary file, which the
    // collector (reading `*.prom` only) never reads.
    let half: Vec<_> = entries(dir)
        .into_iter()
        .filter(|e| {
            e.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".imgpipe-metrics")
        })
        .collect();
    assert_eq!(half.len(), 1, "{half:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_with_sigkill_mid_run_leaves_a_whole_metrics_file() {
    // One call let through and the next held at the sandbox's gate: the run is still paying
    // when it is killed, however fast or slow the machine.
    let env = start(config()).await;
    let hold = env.sandbox.hold();
    env.sandbox.let_through(1);
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(ITEMS, None));
    let file = dir.join("imgpipe.prom");
    let mut cmd = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--concurrency",
            "1",
            "--metrics-file",
            &file.to_string_lossy(),
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .command();
    let mut child = cmd.stderr(std::process::Stdio::null()).spawn().unwrap();
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    while !file.exists() || env.sandbox.ledger().is_empty() || env.sandbox.held_calls() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no metrics file, first bill and second call held within {EVENT_WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The child is not reaped before `wait` below, so its pid cannot have been reused.
    let pid = libc::pid_t::try_from(child.id().unwrap()).unwrap();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let status = tokio::time::timeout(CEILING, child.wait())
        .await
        .expect("the killed process is reaped")
        .unwrap();
    assert_eq!(status.code(), None, "killed mid-run: {status:?}");
    release_after_kill(&env, hold).await;
    assert!(ledger_total(&env) < PLANNED, "killed before the run's end");
    let text = std::fs::read_to_string(&file).unwrap();
    parse_metrics(&text);
    promtool_accepts(&text);
}

/// A spending cap's window is announced at 50, 80 and 100% as the run's leases pass them,
/// each once, and the metrics file says what the cap has left, as `cap list` does.
#[tokio::test(flavor = "multi_thread")]
async fn a_cap_crossed_is_announced_and_its_room_is_in_the_metrics() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(4, None));
    let state = state_path(dir).to_string_lossy().into_owned();
    // Two chains of 9 fit a cap of 20: the leases pass 50 and 80%, never 100.
    let set = [
        "cap",
        "set",
        "nightly",
        "--credits",
        "20",
        "--per",
        "day",
        "--state",
        &state,
    ];
    assert_exit_without_panic(&Imgpipe::new(&set).cwd(dir).run().await, 0);
    let hook = receiver(false).await;
    let file = dir.join("imgpipe.prom");
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--notify",
            &hook.url,
            "--metrics-file",
            &file.to_string_lossy(),
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(10)
    .env("IMGPIPE_NOTIFY_SECRET", SECRET)
    .limit(CEILING)
    .run()
    .await;
    assert_exit_without_panic(&o, 6);
    hook.wait_for("run.finished").await;
    let mut marks: Vec<u64> = hook
        .of_kind("cap.crossed")
        .iter()
        .map(|g| {
            assert_signed(g);
            let body = g.json();
            assert_eq!(body["cap"], "nightly", "{body}");
            assert_eq!(body["credits"], 20, "{body}");
            let percent = body["percent"].as_u64().unwrap();
            let spent = body["credits_spent"].as_u64().unwrap();
            assert!(spent * 100 >= percent * 20 && spent <= 20, "{body}");
            percent
        })
        .collect();
    marks.sort_unstable();
    assert_eq!(marks, [50, 80], "{:?}", hook.all());
    assert_eq!(ledger_total(&env), 18);
    let m = parse_metrics(&std::fs::read_to_string(&file).unwrap());
    let left = m[r#"imgpipe_cap_remaining_credits{pipeline="chain",cap="nightly"}"#];
    assert_eq!(left, 2.0, "20 less the 18 the run spent, its leases closed");
    assert_no_secret(&env, &hook);
}

// ---------------------------------------------------------------------------------------------
// Delivery: tries, backoff, redirects, where the URL comes from
// ---------------------------------------------------------------------------------------------

/// One request a [`Scripted`] receiver got: its path, event kind, and when.
#[derive(Clone, Debug)]
struct Try {
    path: String,
    event: Option<String>,
    at: std::time::Instant,
}

/// A receiver that answers the statuses it is given, in order, then 204 to everything; a 307
/// it answers points to its `/elsewhere`, which it records too.
struct Scripted {
    base: String,
    tries: Arc<Mutex<Vec<Try>>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.server.abort();
    }
}

type Script = (Arc<Mutex<Vec<Try>>>, Arc<Mutex<Vec<u16>>>, String);

async fn scripted(statuses: &[u16]) -> Scripted {
    async fn answer(
        State((tries, script, base)): State<Script>,
        uri: axum::http::Uri,
        headers: HeaderMap,
    ) -> axum::response::Response {
        use axum::response::IntoResponse as _;
        tries.lock().unwrap().push(Try {
            path: uri.path().to_owned(),
            event: headers
                .get("x-imgpipe-event")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            at: std::time::Instant::now(),
        });
        let next = {
            let mut script = script.lock().unwrap();
            (!script.is_empty()).then(|| script.remove(0))
        };
        let status = StatusCode::from_u16(next.unwrap_or(204)).unwrap();
        if status == StatusCode::TEMPORARY_REDIRECT {
            let to = format!("{base}/elsewhere");
            return (status, [(axum::http::header::LOCATION, to)]).into_response();
        }
        status.into_response()
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let tries = Arc::new(Mutex::new(Vec::new()));
    let script = Arc::new(Mutex::new(statuses.to_vec()));
    let app = axum::Router::new()
        .route("/hook", post(answer))
        .route("/elsewhere", post(answer))
        .with_state((Arc::clone(&tries), script, base.clone()));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Scripted {
        base,
        tries,
        server,
    }
}

impl Scripted {
    fn url(&self) -> String {
        format!("{}/hook", self.base)
    }

    /// The tries of events of `kind`.
    fn tries_of(&self, kind: &str) -> Vec<Try> {
        let tries = self.tries.lock().unwrap();
        tries
            .iter()
            .filter(|t| t.event.as_deref() == Some(kind))
            .cloned()
            .collect()
    }
}

/// `imgpipe run chain.yaml ARGS` of one item, to its end.
async fn one_item_run(env: &Env, args: &[&str]) -> crate::binary::Ran {
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(1, None));
    Imgpipe::on(env, &["run", "chain.yaml"])
        .args(args)
        .sqlite_in(dir)
        .retry_base_ms(10)
        .limit(CEILING)
        .run()
        .await
}

/// An event answered 503, 429 and 500 is tried again after each, 0.25, 0.5 and 1 s apart at
/// least (the backoff doubles), and delivered at the fourth try.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_answered_5xx_or_429_is_tried_4_times_with_a_doubling_backoff() {
    let env = start(config()).await;
    let hook = scripted(&[503, 429, 500]).await;
    let o = one_item_run(&env, &["--notify", &hook.url()]).await;
    assert_exit_without_panic(&o, 0);
    let tries = hook.tries_of("run.finished");
    assert_eq!(tries.len(), 4, "{tries:?}");
    for (gap, least) in tries.windows(2).zip([250, 500, 1_000]) {
        let waited = gap[1].at - gap[0].at;
        assert!(
            waited >= Duration::from_millis(least),
            "{waited:?} between tries, at least {least} ms expected: {tries:?}"
        );
    }
    assert!(
        !stderr(&o).contains("not delivered"),
        "delivered at the fourth try: {}",
        stderr(&o)
    );
}

/// Four tries and no more: a receiver that answers 503 to each is given up on, said on stderr,
/// the exit code unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_failing_4_times_is_given_up_on_without_a_fifth_try() {
    let env = start(config()).await;
    let hook = scripted(&[503, 503, 503, 503, 503, 503]).await;
    let o = one_item_run(&env, &["--notify", &hook.url()]).await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(hook.tries_of("run.finished").len(), 4);
    assert!(
        stderr(&o).contains("notify: run.finished not delivered: the receiver answered 503"),
        "{}",
        stderr(&o)
    );
}

/// A redirect is not followed (it could lead a signed body elsewhere, over plain http), nor
/// tried again: one try, nothing at the address it points to.
#[tokio::test(flavor = "multi_thread")]
async fn a_redirect_is_not_followed() {
    let env = start(config()).await;
    let hook = scripted(&[307, 307, 307, 307]).await;
    let o = one_item_run(&env, &["--notify", &hook.url()]).await;
    assert_exit_without_panic(&o, 0);
    let tries = hook.tries_of("run.finished");
    assert_eq!(tries.len(), 1, "{tries:?}");
    assert!(tries.iter().all(|t| t.path == "/hook"), "{tries:?}");
    assert!(stderr(&o).contains("answered 307"), "{}", stderr(&o));
}

/// `IMGPIPE_NOTIFY_URL` is used without a flag and over the pipeline file's `notify:`;
/// `--notify` wins over both.
#[tokio::test(flavor = "multi_thread")]
async fn imgpipe_notify_url_is_used_and_the_flag_wins_over_it() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let (file, var, flag) = (
        scripted(&[]).await,
        scripted(&[]).await,
        scripted(&[]).await,
    );
    write(
        dir,
        "chain.yaml",
        &edit_chain(1, None).replace(
            "output_dir: out\n",
            &format!("output_dir: out\nnotify: {}\n", file.url()),
        ),
    );
    let run = |run_id: &str, args: &[&str]| {
        Imgpipe::on(&env, &["run", "chain.yaml", "--run-id", run_id])
            .args(args)
            .sqlite_in(dir)
            .env("IMGPIPE_NOTIFY_URL", var.url())
            .limit(CEILING)
            .run()
    };
    assert_exit_without_panic(&run("by-var", &[]).await, 0);
    assert_eq!(var.tries_of("run.finished").len(), 1, "the variable");
    assert_eq!(file.tries_of("run.finished").len(), 0, "not the file");
    let flagged = flag.url();
    assert_exit_without_panic(&run("by-flag", &["--notify", &flagged]).await, 0);
    assert_eq!(flag.tries_of("run.finished").len(), 1, "the flag");
    assert_eq!(
        var.tries_of("run.finished").len(),
        1,
        "not the variable again"
    );
    assert_eq!(file.tries_of("run.finished").len(), 0, "nor the file");
}

/// A run refused before it starts (over budget: exit 3, nothing billed) posts nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_plan_posts_nothing() {
    let env = start(config()).await;
    let hook = scripted(&[]).await;
    let o = one_item_run(&env, &["--notify", &hook.url(), "--max-credits", "1"]).await;
    assert_exit_without_panic(&o, 3);
    assert_nothing_billed(&env);
    let tries = hook.tries.lock().unwrap().clone();
    assert!(tries.is_empty(), "{tries:?}");
}

/// A resume does not announce a budget mark its run already announced: interrupted once 50%
/// was crossed (and announced), the resume announces 80 and 100 only, each once.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_does_not_announce_a_mark_again() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(2, Some(18)));
    let hook = receiver(false).await;
    let hold = env.sandbox.hold();
    // The first item's chain (2 + 2 + 5 = 9 credits, half of 18) through the gate, the next
    // call held.
    env.sandbox.let_through(3);
    let mut run = Imgpipe::on(
        &env,
        &[
            "run",
            "chain.yaml",
            "--run-id",
            "marks",
            "--concurrency",
            "1",
            "--notify",
            &hook.url,
        ],
    )
    .sqlite_in(dir)
    .watched();
    wait_until("the first chain billed and the next call held", || {
        env.sandbox.ledger().len() == 3 && env.sandbox.held_calls() >= 1
    })
    .await;
    send_signal(run.id(), libc::SIGINT);
    run.wait_for_line("interrupted: no new calls").await;
    drop(hold);
    assert_exit_without_panic(&run.finish().await, 130);
    hook.wait_for("run.finished").await;
    let marks = |hook: &Receiver| {
        let mut marks: Vec<u64> = hook
            .of_kind("budget.crossed")
            .iter()
            .map(|g| g.json()["percent"].as_u64().unwrap())
            .collect();
        marks.sort_unstable();
        marks
    };
    assert_eq!(marks(&hook), [50], "{:?}", hook.all());
    let resumed = Imgpipe::on(&env, &["resume", "marks", "--notify", &hook.url])
        .sqlite_in(dir)
        .retry_base_ms(10)
        .limit(CEILING)
        .run()
        .await;
    assert_exit_without_panic(&resumed, 0);
    assert_eq!(ledger_total(&env), 18);
    let deadline = tokio::time::Instant::now() + EVENT_WAIT;
    while hook.of_kind("run.finished").len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no second run.finished within {EVENT_WAIT:?}: {:?}",
            hook.all()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(marks(&hook), [50, 80, 100], "{:?}", hook.all());
}

/// The metrics file is written at the run's start, again every 10 s while the run goes on (not
/// before), and at its end, every sample labelled with its pipeline. The writer's clock is the
/// test's (`IMGPIPE_TEST_METRICS_CLOCK_FILE`), moved on while a paid call is held at the
/// sandbox's gate: the run is still going whatever the machine's speed, and no 10 s is waited.
#[tokio::test(flavor = "multi_thread")]
async fn the_metrics_file_is_rewritten_every_10_s_of_the_run_and_every_sample_names_its_pipeline() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(ITEMS, None));
    let file = dir.join("imgpipe.prom");
    let clock = dir.join("metrics-clock");
    std::fs::write(&clock, "0").unwrap();
    let billed =
        |text: &str| parse_metrics(text)["imgpipe_credits_billed_total{pipeline=\"chain\"}"];
    let hold = env.sandbox.hold();
    let metrics = file.to_string_lossy().into_owned();
    let args = [
        "run",
        "chain.yaml",
        "--concurrency",
        "1",
        "--metrics-file",
        &metrics,
    ];
    let mut run = Imgpipe::on(&env, &args)
        .sqlite_in(dir)
        .env("IMGPIPE_TEST_METRICS_CLOCK_FILE", &clock)
        .watched();
    // Written at the start, nothing billed yet; then one call billed, the next held.
    step_until(&env, &mut run, |env| !env.sandbox.ledger().is_empty()).await;
    let at_start = std::fs::read_to_string(&file).expect("the file written at the start");
    assert_eq!(billed(&at_start), 0.0, "{at_start}");
    // 9 s on: the writer has read its clock and left the file as it was.
    std::fs::write(&clock, "9").unwrap();
    run.wait_for_line("metrics: test clock at 9 s").await;
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        at_start,
        "rewritten before 10 s"
    );
    // 10 s on: rewritten with what the run billed since, while it is still held at the gate.
    std::fs::write(&clock, "10").unwrap();
    run.wait_for_line("metrics: test clock at 10 s").await;
    let at_10 = std::fs::read_to_string(&file).unwrap();
    assert_eq!(billed(&at_10), ledger_total(&env) as f64, "{at_10}");
    assert!(billed(&at_10) > 0.0, "{at_10}");
    // 19 s: not again before 20.
    step_until(&env, &mut run, |env| env.sandbox.ledger().len() >= 2).await;
    std::fs::write(&clock, "19").unwrap();
    run.wait_for_line("metrics: test clock at 19 s").await;
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        at_10,
        "rewritten before 20 s"
    );
    drop(hold);
    let o = run.finish().await;
    assert_exit_without_panic(&o, 0);
    let at_end = std::fs::read_to_string(&file).unwrap();
    assert_eq!(billed(&at_end), PLANNED as f64, "{at_end}");
    promtool_accepts(&at_end);
    for text in [&at_start, &at_10, &at_end] {
        for sample in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let labels = sample
                .split_once('{')
                .and_then(|(_, rest)| rest.split_once('}'))
                .map_or("", |(labels, _)| labels);
            assert!(
                labels.split(',').any(|label| label == "pipeline=\"chain\""),
                "a sample without its pipeline: {sample}\n--- file\n{text}"
            );
        }
    }
}

/// A receiver that takes the first try of each `budget.crossed` event (with `every`, each try
/// of one) and holds it at a gate until the test opens it, answering every other request 204
/// at once.
struct Gated {
    url: String,
    tries: Arc<Mutex<Vec<Held>>>,
    open: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

impl Gated {
    /// Answers the tries held and those to come.
    fn open(&self) {
        self.open.send_replace(true);
    }

    /// The tries of `budget.crossed` events so far.
    fn marks(&self) -> Vec<Held> {
        let tries = self.tries.lock().unwrap();
        tries
            .iter()
            .filter(|t| t.event.as_deref() == Some("budget.crossed"))
            .cloned()
            .collect()
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        self.open();
        self.server.abort();
    }
}

/// A try a [`Gated`] receiver got, and when.
#[derive(Clone, Debug)]
struct Held {
    event: Option<String>,
    body: Value,
    at: std::time::Instant,
}

type GateState = (
    Arc<Mutex<Vec<Held>>>,
    tokio::sync::watch::Receiver<bool>,
    bool,
);

async fn gated(every: bool) -> Gated {
    async fn answer(
        State((tries, mut open, every)): State<GateState>,
        headers: HeaderMap,
        body: Bytes,
    ) -> StatusCode {
        let event = headers
            .get("x-imgpipe-event")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let held = {
            let mut tries = tries.lock().unwrap();
            let held = event.as_deref() == Some("budget.crossed")
                && (every || !tries.iter().any(|t| t.event == event));
            tries.push(Held {
                body: serde_json::from_slice(&body).unwrap_or_default(),
                event,
                at: std::time::Instant::now(),
            });
            held
        };
        if held {
            let _ = open.wait_for(|o| *o).await;
        }
        StatusCode::NO_CONTENT
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let tries = Arc::default();
    let (open, opened) = tokio::sync::watch::channel(false);
    let app = axum::Router::new()
        .route("/hook", post(answer))
        .with_state((Arc::clone(&tries), opened, every));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Gated {
        url,
        tries,
        open,
        server,
    }
}

/// A receiver that takes an event and never answers is given up on after the documented 10 s
/// a try, and the event tried again: the 50% mark, its first try held at the receiver's gate,
/// arrives whole at the second, while the run waits at the sandbox's gate; four tries at most.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_whose_try_times_out_is_tried_again_and_delivered() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(2, Some(18)));
    let hook = gated(false).await;
    let hold = env.sandbox.hold();
    // The first item's chain (9 credits, half of 18) through the sandbox's gate, the next held.
    env.sandbox.let_through(3);
    let args = [
        "run",
        "chain.yaml",
        "--concurrency",
        "1",
        "--notify",
        &hook.url,
    ];
    let mut run = Imgpipe::on(&env, &args).sqlite_in(dir).watched();
    let marks = || hook.marks();
    let limit = Duration::from_secs(40);
    let deadline = std::time::Instant::now() + limit;
    while marks().len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the mark not tried again within {limit:?}: {:?}",
            marks()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (first, again) = (&marks()[0], &marks()[1]);
    assert_eq!(first.body, again.body, "the same event tried again");
    assert_eq!(again.body["percent"], 50, "{:?}", again.body);
    assert!(
        again.at - first.at >= Duration::from_secs(10),
        "tried again only once the first try's 10 s were out: {:?}",
        again.at - first.at
    );
    wait_while_running(&mut run, "still held at the sandbox's gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    drop(hold);
    let o = run.finish().await;
    assert_exit_without_panic(&o, 0);
    let fifty: Vec<_> = marks()
        .into_iter()
        .filter(|t| t.body["percent"] == 50)
        .collect();
    assert_eq!(fifty.len(), 2, "delivered at the second try: {fifty:?}");
    assert!(
        marks().len() <= 3 * 4,
        "four tries a mark at most: {:?}",
        marks()
    );
    assert!(
        !stderr(&o).contains("budget.crossed not delivered"),
        "{}",
        stderr(&o)
    );
}

/// A receiver that takes every try of an event and never answers gets four tries and no
/// fifth, each given up on at its timeout (2 s here through `IMGPIPE_TEST_NOTIFY_TRY_TIMEOUT_MS`,
/// a test-only setting, for the documented 10 s); then the event is given up on and said so,
/// while the run, held at the sandbox's gate all along, goes on and ends 0. The count is read
/// when the run says it gave up, after its last try: a fifth could only come before.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_whose_every_try_times_out_is_tried_4_times_and_the_run_goes_on() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "chain.yaml", &edit_chain(2, Some(18)));
    let hook = gated(true).await;
    let hold = env.sandbox.hold();
    // The first item's chain (9 credits, half of 18) through the sandbox's gate, the next held.
    env.sandbox.let_through(3);
    let args = [
        "run",
        "chain.yaml",
        "--concurrency",
        "1",
        "--notify",
        &hook.url,
    ];
    let mut run = Imgpipe::on(&env, &args)
        .sqlite_in(dir)
        .env("IMGPIPE_TEST_NOTIFY_TRY_TIMEOUT_MS", "2000")
        .watched();
    let said = run
        .wait_for_line_within(
            "notify: budget.crossed not delivered",
            Duration::from_secs(60),
        )
        .await;
    let marks = hook.marks();
    assert_eq!(marks.len(), 4, "four tries, no fifth: {marks:?}\n{said}");
    assert!(
        marks
            .iter()
            .all(|t| t.body == marks[0].body && t.body["percent"] == 50),
        "the 50% mark each time: {marks:?}"
    );
    assert!(said.contains("timed out"), "{said}");
    wait_while_running(&mut run, "still held at the sandbox's gate", || {
        env.sandbox.held_calls() >= 1
    })
    .await;
    hook.open();
    drop(hold);
    let o = run.finish().await;
    assert_exit_without_panic(&o, 0);
    let fifty = hook
        .marks()
        .into_iter()
        .filter(|t| t.body["percent"] == 50)
        .count();
    assert_eq!(fifty, 4, "not tried again after it was given up on");
}
