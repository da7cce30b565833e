//! The run's lifecycle through the library (`imgpipe::runner`), without the binary: each
//! stage's outcome against the in-process sandbox, with a [`View`] that records what it was
//! given instead of printing it. The effects are read where they land: the state database,
//! the files on disk and the sandbox's ledger.
//!
//! Interruptions are exact, not timed: the recording view's progress observer cancels the
//! runner's token (or tells the test to drain the balance) when a task succeeds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use imgpipe::Error;
use imgpipe::exec::{Observer, OnAmbiguous};
use imgpipe::money::limit::Balance;
use imgpipe::pipeline::Report;
use imgpipe::plan::document::PlanDocument;
use imgpipe::report::summary::Summary;
use imgpipe::resume::Reason;
use imgpipe::run_id::RunId;
use imgpipe::runner::{
    Reviewed, RunRequest, Runner, ServiceSettings, Settings, StateLocation, View,
};
use imgpipe::sandbox;
use imgpipe::store::{Location, StepCounts};
use serde_json::Value;

use tokio_util::sync::CancellationToken;

use crate::common::*;
use crate::resume::sandbox_with_latency;
use crate::run::{CHAIN_CREDITS, config, edit_chain, manifest, state_path, write};

// ---------------------------------------------------------------------------------------------
// A view that records
// ---------------------------------------------------------------------------------------------

/// Called on every task that succeeds: the step's id and how many tasks succeeded so far.
type Hook = Box<dyn Fn(&str, usize) + Send + Sync>;

/// What `View::review` was given, kept past its borrow.
#[derive(Debug)]
struct SeenReview {
    run_id: String,
    /// (item, step, reason, credits) of each task resuming would pay for.
    redo: Vec<(String, String, Reason, u64)>,
    kept: usize,
    limit: Option<u64>,
}

/// What `View::progress` was given: the steps with their task counts, the tasks earlier
/// attempts already finished, and the planned credits.
#[derive(Debug)]
struct SeenProgress {
    steps: Vec<(String, u64)>,
    done: u64,
    planned: u64,
}

#[derive(Default)]
struct Seen {
    diagnostics: Vec<usize>,
    plans: Vec<PlanDocument>,
    reviews: Vec<SeenReview>,
    summaries: Vec<Value>,
    finished: Vec<String>,
    progress: Vec<SeenProgress>,
    continue_asked: Vec<String>,
    /// The step of each task that succeeded, in order.
    succeeded: Vec<String>,
}

struct Recorder {
    seen: Arc<Mutex<Seen>>,
    hook: Arc<Option<Hook>>,
}

impl Recorder {
    fn new() -> Recorder {
        Recorder {
            seen: Arc::default(),
            hook: Arc::new(None),
        }
    }

    fn with_hook(hook: impl Fn(&str, usize) + Send + Sync + 'static) -> Recorder {
        Recorder {
            seen: Arc::default(),
            hook: Arc::new(Some(Box::new(hook))),
        }
    }

    /// Cancels `token` once a task of `step` has succeeded.
    fn cancelling_after(step: &'static str, token: &CancellationToken) -> Recorder {
        let token = token.clone();
        Recorder::with_hook(move |s, _| {
            if s == step {
                token.cancel();
            }
        })
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }
}

/// What [`Recorder::continue_command`] answers: a text no real command line has.
fn continue_command(run_id: &str) -> String {
    format!("continue-by-test --run {run_id}")
}

impl View for Recorder {
    fn diagnostics(&self, report: &Report) {
        self.seen().diagnostics.push(report.errors.len());
    }

    fn plan(&self, doc: &PlanDocument) -> Result<(), Error> {
        self.seen().plans.push(doc.clone());
        Ok(())
    }

    fn review(&self, reviewed: &Reviewed<'_>) -> Result<(), Error> {
        let graph = reviewed.graph;
        let redo = reviewed
            .review
            .each_redo(graph)
            .map(|r| {
                (
                    graph.item_dir(graph.task(r.task).instance).into_owned(),
                    graph.step_id(r.task).to_owned(),
                    r.reason,
                    r.credits,
                )
            })
            .collect();
        self.seen().reviews.push(SeenReview {
            run_id: reviewed.row.id.to_string(),
            redo,
            kept: reviewed.review.kept.len(),
            limit: reviewed.limit,
        });
        Ok(())
    }

    fn finished(&self, run_id: &RunId) -> Result<(), Error> {
        self.seen().finished.push(run_id.to_string());
        Ok(())
    }

    fn summary(&self, summary: &Summary) -> Result<(), Error> {
        self.seen()
            .summaries
            .push(serde_json::to_value(summary).unwrap());
        Ok(())
    }

    fn progress(
        &self,
        steps: &[(String, u64)],
        done: &[StepCounts],
        planned: u64,
    ) -> Arc<dyn Observer> {
        self.seen().progress.push(SeenProgress {
            steps: steps.to_vec(),
            done: done.iter().map(|c| c.succeeded).sum(),
            planned,
        });
        Arc::new(Watch {
            steps: steps.iter().map(|(s, _)| s.clone()).collect(),
            seen: Arc::clone(&self.seen),
            hook: Arc::clone(&self.hook),
        })
    }

    fn continue_command(&self, run_id: &RunId) -> String {
        self.seen().continue_asked.push(run_id.to_string());
        continue_command(run_id)
    }

    fn continue_rest(&self, run_id: &RunId) -> String {
        continue_command(run_id)
    }
}

/// The progress observer: records each success and calls the hook.
struct Watch {
    steps: Vec<String>,
    seen: Arc<Mutex<Seen>>,
    hook: Arc<Option<Hook>>,
}

impl Observer for Watch {
    fn task_succeeded(&self, step: usize, _credits: u64) {
        let step = &self.steps[step];
        let count = {
            let mut seen = self.seen.lock().unwrap();
            seen.succeeded.push(step.clone());
            seen.succeeded.len()
        };
        if let Some(hook) = self.hook.as_ref() {
            hook(step, count);
        }
    }

    fn task_failed(&self, _step: usize, item: &str, reason: &str) {
        panic!("no task should fail here: {item}: {reason}");
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// Tasks of [`edit_chain`] for [`ITEMS`] items: three steps each.
const ITEMS: usize = 3;
const TASKS: usize = 3 * ITEMS;
const PLANNED: u64 = ITEMS as u64 * CHAIN_CREDITS;

/// Settings as the command line's defaults would give them, but with one call at a time (so
/// an interruption stops the run part way) and retries without delay.
fn settings(dir: &Path) -> Settings {
    Settings {
        state: StateLocation::resolve(Some(Location::File(state_path(dir))), false).unwrap(),
        allow_changes: false,
        reuse: false,
        wait: false,
        items: None,
        until: None,
        concurrency: Some(1),
        rate: None,
        max_credits: None,
        on_ambiguous: OnAmbiguous::Retry,
        url_ttl: Duration::from_secs(3600),
        url_margin: Duration::from_secs(300),
        download_concurrency: 4,
        grace: Duration::from_secs(20),
        report: false,
        retry_base: Duration::from_millis(1),
        events: Default::default(),
        expect: Default::default(),
    }
}

/// The sandbox's address, and its key in a file: never `IMGPIPE_API_KEY`, which every test
/// thread would share.
fn service(env: &Env) -> ServiceSettings {
    let key = write(env.dir.path(), "api-key", env.sandbox.key());
    ServiceSettings {
        base_url: Some(env.sandbox.base_url().to_string()),
        api_key_file: Some(key),
        sandbox: false,
        timeout: Duration::from_secs(30),
        connect_timeout: None,
        fields: Default::default(),
    }
}

/// The [`edit_chain`] pipeline of [`ITEMS`] items, written as `p.yaml`.
fn chain_file(env: &Env) -> PathBuf {
    write(env.dir.path(), "p.yaml", &edit_chain(ITEMS, None))
}

fn request(file: &Path, run_id: Option<&str>) -> RunRequest {
    RunRequest {
        file: Some(file.to_path_buf()),
        run_id: run_id.map(imgpipe::run_id::RunId::from),
        ..RunRequest::default()
    }
}

/// `Runner::run` with these settings, view and token.
async fn run(
    env: &Env,
    settings: &Settings,
    view: &Recorder,
    shutdown: CancellationToken,
    request: &RunRequest,
) -> Result<(), Error> {
    let service = service(env);
    let runner = Runner {
        settings,
        service: &service,
        view,
        shutdown,
    };
    within("the runner's run", runner.run(request)).await
}

/// `Runner::resume` with these settings and view, never interrupted.
async fn resume(
    env: &Env,
    settings: &Settings,
    view: &Recorder,
    run_id: &str,
    dry_run: bool,
) -> Result<(), Error> {
    let service = service(env);
    let runner = Runner {
        settings,
        service: &service,
        view,
        shutdown: CancellationToken::new(),
    };
    within(
        "the runner's resume",
        runner.resume(&run_id.into(), dry_run),
    )
    .await
}

/// Runs `p.yaml` as run `r` and cancels the token once a task of `step` succeeded; the calls
/// in flight then finish. Asserts the run ended interrupted (exit 130) part way.
async fn interrupted_run(env: &Env, file: &Path, step: &'static str) -> Db {
    let token = CancellationToken::new();
    let view = Recorder::cancelling_after(step, &token);
    let err = run(
        env,
        &settings(env.dir.path()),
        &view,
        token,
        &request(file, Some("r")),
    )
    .await
    .expect_err("the run is interrupted");
    assert!(matches!(err, Error::Interrupted { .. }), "{err:?}");
    assert_eq!(err.exit_code(), 130);
    let db = read_db(env.dir.path()).await;
    assert_eq!(db.run_status("r"), "interrupted");
    let done = db.count_in("r", "succeeded");
    assert!((1..TASKS).contains(&done), "{db:#?}");
    assert_eq!(done, env.sandbox.ledger().len(), "one bill per task done");
    assert_eq!(done, view.seen().succeeded.len());
    db
}

// ---------------------------------------------------------------------------------------------
// Reading the record
// ---------------------------------------------------------------------------------------------

/// The state database, read while no runner is running.
async fn read_db(dir: &Path) -> Db {
    Db::read_file(&state_path(dir)).await
}

/// (item, step) → job of each task of `run` that succeeded.
fn jobs(db: &Db, run: &str) -> BTreeMap<(String, String), String> {
    db.tasks_of(run)
        .into_iter()
        .filter(|t| t.status == "succeeded")
        .map(|t| {
            let job = t.job_id.clone().unwrap_or_else(|| panic!("{t:?}"));
            ((t.item.clone(), t.step.clone()), job)
        })
        .collect()
}

/// Every file under the output directory with its sha256.
fn out_files(env: &Env) -> BTreeMap<String, String> {
    file_digests(&env.dir.path().join("out"))
}

fn ledger_total(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

/// Every task of `run` succeeded, each with its own job billed exactly once at its planned
/// price; every output is on disk with its recorded digest, and the manifest names them.
#[track_caller]
fn assert_run_complete(env: &Env, db: &Db, run: &str) {
    assert_eq!(db.run_status(run), "succeeded");
    let tasks = db.tasks_of(run);
    assert_eq!(tasks.len(), TASKS, "{tasks:#?}");
    assert_eq!(db.count_in(run, "succeeded"), TASKS, "{tasks:#?}");
    let ledger = env.sandbox.ledger();
    assert_no_request_billed_twice(env);
    let jobs: BTreeSet<&str> = ledger.iter().map(|e| e.job_id.as_str()).collect();
    for t in &tasks {
        let job = t.job_id.as_deref().unwrap();
        let entry = ledger.iter().find(|e| e.job_id.as_str() == job).unwrap();
        assert!(entry.delivered, "{entry:?}");
        assert_eq!(
            (t.billed, t.planned),
            (entry.credits, entry.credits),
            "{t:?}"
        );
    }
    let outputs: Vec<&OutputRow> = db.outputs.iter().filter(|o| o.run_id == run).collect();
    assert_eq!(outputs.len(), TASKS, "{outputs:#?}");
    for o in &outputs {
        let path = o.path.as_deref().unwrap_or_else(|| panic!("{o:?}"));
        let digest = sha256_hex(&std::fs::read(path).unwrap());
        assert_eq!(o.sha256.as_deref(), Some(digest.as_str()), "{o:?}");
        assert!(jobs.contains(o.job_id.as_str()), "{o:?}");
    }
    let run_dir = env.dir.path().join("out").join(run);
    let lines = manifest(&run_dir);
    assert_eq!(lines.len(), TASKS, "{lines:#?}");
    for line in &lines {
        assert!(
            run_dir.join(line["path"].as_str().unwrap()).is_file(),
            "{line}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 1. A fresh run
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_fresh_run_pays_its_plan_records_every_task_and_shows_one_summary() {
    let env = start(config()).await;
    let file = chain_file(&env);
    let view = Recorder::new();
    let settings = settings(env.dir.path());
    run(
        &env,
        &settings,
        &view,
        CancellationToken::new(),
        &request(&file, None),
    )
    .await
    .expect("the run succeeds");

    let db = read_db(env.dir.path()).await;
    assert_eq!(db.runs.len(), 1, "{db:#?}");
    let (run_id, planned) = (&db.runs[0].id, db.runs[0].credits_planned);
    assert_eq!(planned, PLANNED);
    assert_run_complete(&env, &db, run_id);
    assert_eq!(ledger_total(&env), PLANNED, "the ledger pays the plan");
    assert_eq!(env.sandbox.balance(), START_BALANCE - PLANNED as i64);

    let seen = view.seen();
    assert_eq!(seen.summaries.len(), 1);
    let summary = &seen.summaries[0];
    assert_eq!(summary["run_id"], run_id.as_str(), "{summary:#}");
    assert_eq!(summary["status"], "succeeded", "{summary:#}");
    assert_eq!(summary["succeeded"], TASKS, "{summary:#}");
    assert_eq!(summary["billed_credits"], PLANNED, "{summary:#}");
    assert!(seen.plans.is_empty(), "a run that fits shows no plan");
    assert!(seen.finished.is_empty() && seen.reviews.is_empty());
    assert_eq!(seen.diagnostics, [0]);
    assert_eq!(seen.progress.len(), 1);
    let progress = &seen.progress[0];
    let steps: Vec<(&str, u64)> = progress
        .steps
        .iter()
        .map(|(s, n)| (s.as_str(), *n))
        .collect();
    assert_eq!(steps, [("clean", 3), ("big", 3), ("cutout", 3)]);
    assert_eq!((progress.done, progress.planned), (0, PLANNED));
    assert_eq!(seen.succeeded.len(), TASKS);
}

// ---------------------------------------------------------------------------------------------
// 2. A continued run
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_run_resumed_finishes_without_paying_any_task_twice() {
    let env = start(sandbox_with_latency(10)).await;
    let file = chain_file(&env);
    let before = interrupted_run(&env, &file, "clean").await;
    let done_before = jobs(&before, "r");

    let view = Recorder::new();
    resume(&env, &settings(env.dir.path()), &view, "r", false)
        .await
        .expect("the resumed run succeeds");

    let db = read_db(env.dir.path()).await;
    assert_run_complete(&env, &db, "r");
    assert_eq!(env.sandbox.ledger().len(), TASKS, "one bill per task");
    assert_eq!(ledger_total(&env), PLANNED);
    let jobs = jobs(&db, "r");
    for (task, job) in &done_before {
        assert_eq!(jobs.get(task), Some(job), "{task:?} was paid for again");
    }
    let seen = view.seen();
    assert_eq!(seen.progress.len(), 1);
    assert_eq!(seen.progress[0].done, done_before.len() as u64);
    assert_eq!(seen.succeeded.len(), TASKS - done_before.len());
    assert_eq!(seen.summaries.len(), 1);
    assert_eq!(seen.summaries[0]["status"], "succeeded");
    assert_eq!(seen.summaries[0]["billed_credits"], PLANNED);
}

// ---------------------------------------------------------------------------------------------
// 3. A finished run
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_run_run_again_is_only_summarised_and_a_dry_run_says_it_is_finished() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let file = chain_file(&env);
    let settings = settings(dir);
    let token = CancellationToken::new;
    run(
        &env,
        &settings,
        &Recorder::new(),
        token(),
        &request(&file, Some("r")),
    )
    .await
    .unwrap();
    let ledger = env.sandbox.ledger();
    let record = dump(&state_path(dir)).await;
    let files = out_files(&env);

    let again = Recorder::new();
    run(&env, &settings, &again, token(), &request(&file, Some("r")))
        .await
        .expect("a finished run is summarised");
    {
        let seen = again.seen();
        assert_eq!(seen.summaries.len(), 1);
        assert_eq!(seen.summaries[0]["run_id"], "r");
        assert_eq!(seen.summaries[0]["status"], "succeeded");
        assert_eq!(seen.summaries[0]["billed_credits"], PLANNED);
        assert!(seen.progress.is_empty(), "nothing executed");
        assert!(seen.finished.is_empty() && seen.plans.is_empty());
    }

    let dry = Recorder::new();
    let dry_request = RunRequest {
        dry_run: true,
        ..request(&file, Some("r"))
    };
    run(&env, &settings, &dry, token(), &dry_request)
        .await
        .expect("a dry run of a finished run succeeds");
    {
        let seen = dry.seen();
        assert_eq!(seen.finished, ["r"]);
        assert!(seen.summaries.is_empty() && seen.plans.is_empty() && seen.reviews.is_empty());
    }

    assert_eq!(env.sandbox.ledger(), ledger, "nothing billed again");
    assert_eq!(env.sandbox.stats().paid_requests, TASKS as u64);
    assert_eq!(
        dump(&state_path(dir)).await,
        record,
        "the record did not move"
    );
    assert_eq!(out_files(&env), files, "the files did not move");
}

// ---------------------------------------------------------------------------------------------
// 4 + 5. Refused before anything is paid for
// ---------------------------------------------------------------------------------------------

/// Runs `p.yaml` as run `r` expecting a refusal: exit 3, the plan shown, nothing billed, no
/// run recorded, no output directory. Returns the refusal's text and the plan shown.
async fn refused(env: &Env, settings: &Settings) -> (String, PlanDocument) {
    let file = chain_file(env);
    let balance = env.sandbox.balance();
    let view = Recorder::new();
    let err = run(
        env,
        settings,
        &view,
        CancellationToken::new(),
        &request(&file, Some("r")),
    )
    .await
    .expect_err("the run is refused");
    assert!(matches!(err, Error::Refused { .. }), "{err:?}");
    assert_eq!(err.exit_code(), 3);
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.stats().paid_requests, 0);
    assert_eq!(env.sandbox.balance(), balance);
    let plan = {
        let seen = view.seen();
        assert!(seen.summaries.is_empty() && seen.progress.is_empty());
        assert_eq!(seen.plans.len(), 1, "the refused plan is shown");
        seen.plans[0].clone()
    };
    let db = read_db(env.dir.path()).await;
    assert!(db.runs.is_empty() && db.tasks.is_empty(), "{db:#?}");
    assert!(!env.dir.path().join("out").exists());
    (err.to_string(), plan)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_over_max_credits_is_refused_with_exit_3_and_nothing_recorded() {
    let env = start(config()).await;
    let settings = Settings {
        max_credits: Some(PLANNED - 1),
        ..settings(env.dir.path())
    };
    let (text, plan) = refused(&env, &settings).await;
    let reason = format!(
        "the plan costs {PLANNED} credits, over the budget of {} (--max-credits)",
        PLANNED - 1
    );
    assert!(text.contains(&reason), "{text}");
    assert_eq!(plan.costs.total_credits, Some(PLANNED));
    assert_eq!(
        plan.budget.as_ref().map(|b| b.max_credits),
        Some(PLANNED - 1)
    );
    assert!(!plan.verdict.fits);
    assert_eq!(plan.verdict.reasons, [reason]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_over_the_balance_is_refused_with_exit_3_and_nothing_recorded() {
    let low = PLANNED as i64 - 2;
    let env = start(sandbox::Config {
        balance: low,
        ..config()
    })
    .await;
    let (text, plan) = refused(&env, &settings(env.dir.path())).await;
    let reason = format!("the plan costs {PLANNED} credits, more than the balance of {low}");
    assert!(text.contains(&reason), "{text}");
    assert!(
        matches!(plan.balance, Balance::Known { credits, .. } if credits == low),
        "{:?}",
        plan.balance
    );
    assert_eq!(plan.verdict.reasons, [reason]);
}

// ---------------------------------------------------------------------------------------------
// 6. A pipeline changed under a run
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_pipeline_is_refused_naming_the_change_and_allow_changes_pays_only_for_it() {
    let env = start(sandbox_with_latency(10)).await;
    let dir = env.dir.path();
    let file = chain_file(&env);
    // Stop once a `cutout` is done, so the change below undoes work already paid for.
    let before = interrupted_run(&env, &file, "cutout").await;
    let done_before = jobs(&before, "r");
    let cutouts_done = done_before.keys().filter(|(_, s)| s == "cutout").count();
    assert!(cutouts_done >= 1, "{done_before:#?}");
    let changed = edit_chain(ITEMS, None).replace(
        "remove_background: { from: big }",
        "expand: { from: big, aspect_ratio: \"16:9\", prompt: extend the backdrop }",
    );
    assert_ne!(changed, edit_chain(ITEMS, None));
    write(dir, "p.yaml", &changed);
    let ledger = env.sandbox.ledger();
    let record = dump(&state_path(dir)).await;

    let view = Recorder::new();
    let err = resume(&env, &settings(dir), &view, "r", false)
        .await
        .expect_err("a changed pipeline is refused");
    assert!(matches!(err, Error::Refused { .. }), "{err:?}");
    assert_eq!(err.exit_code(), 3);
    let text = err.to_string();
    assert!(
        text.contains("the pipeline changed since run r started"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "step `cutout` asks something else of {cutouts_done} task(s)"
        )),
        "{text}"
    );
    assert!(text.contains("--allow-changes"), "{text}");
    assert_eq!(env.sandbox.ledger(), ledger, "nothing billed");
    assert_eq!(dump(&state_path(dir)).await, record, "nothing recorded");
    assert!(view.seen().summaries.is_empty());

    let allowed = Settings {
        allow_changes: true,
        ..settings(dir)
    };
    let view = Recorder::new();
    resume(&env, &allowed, &view, "r", false)
        .await
        .expect("with --allow-changes the run resumes");
    let db = read_db(dir).await;
    assert_eq!(db.run_status("r"), "succeeded");
    assert_eq!(db.count_in("r", "succeeded"), TASKS);
    let jobs = jobs(&db, "r");
    for (task, job) in &done_before {
        if task.1 == "cutout" {
            assert_ne!(
                jobs.get(task),
                Some(job),
                "{task:?} was changed: paid again"
            );
        } else {
            assert_eq!(jobs.get(task), Some(job), "{task:?} was paid for again");
        }
    }
    let kept = done_before.len() - cutouts_done;
    let ledger = env.sandbox.ledger();
    assert_eq!(
        ledger.len(),
        done_before.len() + TASKS - kept,
        "{ledger:#?}"
    );
    let by_operation = |op: &str| ledger.iter().filter(|e| e.operation == op).count();
    assert_eq!(by_operation("expand"), ITEMS);
    assert_eq!(by_operation("remove_background"), cutouts_done);
    assert_no_request_billed_twice(&env);
}

// ---------------------------------------------------------------------------------------------
// 7. What resuming would pay for
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_dry_run_resume_reviews_the_remaining_tasks_and_changes_nothing() {
    let env = start(sandbox_with_latency(10)).await;
    let dir = env.dir.path();
    let file = chain_file(&env);
    let db = interrupted_run(&env, &file, "clean").await;
    let remaining: BTreeSet<(String, String, u64)> = db
        .tasks_of("r")
        .into_iter()
        .filter(|t| t.status != "succeeded")
        .map(|t| (t.item.clone(), t.step.clone(), t.planned))
        .collect();
    assert!(!remaining.is_empty());
    let ledger = env.sandbox.ledger();
    let paid = env.sandbox.stats().paid_requests;
    let record = dump(&state_path(dir)).await;
    let files = out_files(&env);

    let view = Recorder::new();
    resume(&env, &settings(dir), &view, "r", true)
        .await
        .expect("a dry run that fits succeeds");

    assert_eq!(env.sandbox.ledger(), ledger, "nothing billed");
    assert_eq!(env.sandbox.stats().paid_requests, paid, "no paid request");
    assert_eq!(dump(&state_path(dir)).await, record, "a table changed");
    assert_eq!(out_files(&env), files, "files changed");

    let seen = view.seen();
    assert_eq!(seen.reviews.len(), 1);
    let review = &seen.reviews[0];
    assert_eq!(review.run_id, "r");
    let redo: BTreeSet<(String, String, u64)> = review
        .redo
        .iter()
        .map(|(item, step, _, credits)| (item.clone(), step.clone(), *credits))
        .collect();
    assert_eq!(redo, remaining);
    assert_eq!(redo.len(), review.redo.len(), "a task listed twice");
    assert!(
        review
            .redo
            .iter()
            .all(|(.., reason, _)| *reason == Reason::NeverStarted),
        "{review:#?}"
    );
    assert_eq!(review.kept, TASKS - remaining.len());
    assert_eq!(
        review.limit,
        Some(u64::try_from(env.sandbox.balance()).unwrap())
    );
    assert!(seen.summaries.is_empty() && seen.progress.is_empty() && seen.plans.is_empty());
}

// ---------------------------------------------------------------------------------------------
// 8. The command that continues a run
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_or_stopped_run_says_the_views_continue_command() {
    let env = start(sandbox_with_latency(10)).await;
    let dir = env.dir.path();
    let file = chain_file(&env);

    // Interrupted: exit 130, and the error says how to continue.
    let token = CancellationToken::new();
    let view = Recorder::cancelling_after("clean", &token);
    let err = run(
        &env,
        &settings(dir),
        &view,
        token,
        &request(&file, Some("r")),
    )
    .await
    .expect_err("interrupted");
    assert_eq!(err.exit_code(), 130, "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("continue with: {}", continue_command("r"))),
        "{text}"
    );
    assert_eq!(view.seen().continue_asked, ["r"]);
    assert_eq!(view.seen().summaries[0]["status"], "interrupted");

    // Stopped by the balance running out: exit 3, and the hint says how to continue.
    let billed = env.sandbox.ledger().len();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let view = Recorder::with_hook(move |_, _| {
        let _ = tx.send(());
    });
    let s = settings(dir);
    let stopped = request(&file, Some("s"));
    let drain = async {
        rx.recv().await.expect("a task succeeds");
        env.sandbox.set_balance(0);
    };
    let (result, ()) = tokio::join!(
        run(&env, &s, &view, CancellationToken::new(), &stopped),
        within("a task to succeed", drain)
    );
    let err = result.expect_err("the balance runs out");
    assert!(matches!(err, Error::Refused { .. }), "{err:?}");
    assert_eq!(err.exit_code(), 3);
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "top up the account, then continue with: {}",
            continue_command("s")
        )),
        "{text}"
    );
    assert_eq!(view.seen().continue_asked, ["s"]);
    assert_eq!(view.seen().summaries[0]["status"], "stopped");
    assert!(env.sandbox.stats().insufficient_credits > 0);
    let db = read_db(dir).await;
    assert_eq!(db.run_status("s"), "stopped");
    let done = db.count_in("s", "succeeded");
    assert!((1..TASKS).contains(&done), "{db:#?}");
    assert_eq!(env.sandbox.ledger().len(), billed + done);
}
