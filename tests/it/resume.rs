//! `imgpipe resume`, `runs` and `status` end to end: runs interrupted by SIGINT, SIGKILL or a
//! balance running out, then continued, against the in-process sandbox. After each step the
//! files on disk, the manifest, the state database and the sandbox's ledger are held against
//! each other: the ledger is the truth about money, and nothing may be paid for twice.
//!
//! Every command passes `--state DIR/state.db`; those that run tasks pass `--retry-base-ms 20`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use image::GenericImageView;
use imgpipe::sandbox::{self, LedgerEntry};
use serde_json::Value;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

use crate::common::*;
use crate::run::{CHAIN_CREDITS, both, config, edit_chain, manifest, state_path, write};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

type Command = tokio::process::Command;

/// Starts `cmd` with the sandbox held, lets its paid calls through the gate one at a time
/// until `cond` holds of the sandbox while a call is still held there, sends SIGINT, waits
/// until the run says it sends no new calls, lets the held calls finish, and returns what the
/// process printed. Nothing races the sandbox's latency: the run is stopped with a call held
/// in flight, whatever the machine's speed.
pub(crate) async fn interrupt_when(env: &Env, cmd: Command, cond: impl Fn(&Env) -> bool) -> Output {
    let hold = env.sandbox.hold();
    let mut run = Watched::start(cmd);
    step_until(env, &mut run, cond).await;
    send_signal(run.id(), libc::SIGINT);
    run.wait_for_line("interrupted: no new calls").await;
    drop(hold);
    run.finish().await
}

/// Runs `p.yaml` in the sandbox's directory as run `r`, one call at a time, and interrupts it
/// (exit 130) once `calls` calls were billed.
async fn interrupt_run_r(env: &Env, calls: usize) -> Output {
    let cmd = Imgpipe::on(
        env,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "1"],
    )
    .sqlite_in(env.dir.path())
    .retry_base_ms(20)
    .command();
    let o = interrupt_when(env, cmd, |env| env.sandbox.ledger().len() >= calls).await;
    assert_exit_without_panic(&o, 130);
    o
}

/// A port on 127.0.0.1 that nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

pub(crate) fn sandbox_with_latency(ms: u64) -> sandbox::Config {
    sandbox::Config {
        latency: Duration::from_millis(ms),
        ..config()
    }
}

pub(crate) async fn connect(dir: &Path) -> sqlx::SqliteConnection {
    let path = state_path(dir);
    SqliteConnectOptions::new()
        .filename(&path)
        .read_only(true)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
}

/// The live task `item/step` of `run`.
#[track_caller]
fn task_in<'d>(db: &'d Db, run: &str, item: &str, step: &str) -> &'d TaskRow {
    db.live()
        .find(|t| t.run_id == run && t.item == item && t.step == step)
        .unwrap_or_else(|| panic!("no task {item}/{step} in run {run}"))
}

/// What must not move when nothing is to be spent: the record, the files, the ledger, the
/// paid requests the sandbox saw.
struct Still {
    db: BTreeMap<String, Vec<String>>,
    files: BTreeMap<String, String>,
    ledger: Vec<LedgerEntry>,
    paid_requests: u64,
}

async fn still(env: &Env, dir: &Path) -> Still {
    Still {
        db: dump(&state_path(dir)).await,
        files: file_digests(&dir.join("out")),
        ledger: env.sandbox.ledger(),
        paid_requests: env.sandbox.stats().paid_requests,
    }
}

async fn assert_still(env: &Env, dir: &Path, before: &Still, what: &str) {
    let after = still(env, dir).await;
    assert_eq!(after.ledger, before.ledger, "{what}: the ledger moved");
    assert_eq!(
        after.paid_requests, before.paid_requests,
        "{what}: a paid request was sent"
    );
    for (table, rows) in &before.db {
        assert_eq!(&after.db[table], rows, "{what}: table {table} changed");
    }
    assert_eq!(after.files, before.files, "{what}: files changed");
}

fn ledger_by_job(env: &Env) -> HashMap<String, LedgerEntry> {
    env.sandbox
        .ledger()
        .into_iter()
        .map(|e| (e.job_id.to_string(), e))
        .collect()
}

/// The ledger against the record of every run in the database: the balance moved by the
/// ledger's total; each bill whose answer named its job (whole, or cut after the job id) is
/// exactly one succeeded attempt with its credits, a cut one read back by its id; each other
/// undelivered bill is one attempt possibly billed; every task that succeeded by paying names
/// such a bill, and every reused task names the job of the task it reused.
#[track_caller]
fn assert_ledger_agrees(env: &Env, db: &Db) {
    let total: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    assert_eq!(
        START_BALANCE - env.sandbox.balance(),
        total as i64,
        "balance against the ledger"
    );
    assert_record_agrees_with_ledger(env, db);
}

/// [`assert_ledger_agrees`] but for the balance, for a sandbox whose balance was set by hand.
#[track_caller]
fn assert_record_agrees_with_ledger(env: &Env, db: &Db) {
    let ledger = env.sandbox.ledger();
    let named = |e: &&LedgerEntry| e.delivered || e.partial;
    for entry in ledger.iter().filter(named) {
        let attempts: Vec<_> = db
            .attempts
            .iter()
            .filter(|a| a.job_id.as_deref() == Some(entry.job_id.as_str()))
            .collect();
        assert_eq!(attempts.len(), 1, "{entry:?}: {attempts:#?}");
        assert_eq!(
            attempts[0].outcome.as_deref(),
            Some("succeeded"),
            "{entry:?}"
        );
        assert_eq!(attempts[0].billed, entry.credits, "{entry:?}");
        let note = attempts[0].error.as_deref().unwrap_or_default();
        assert_eq!(
            note.contains(&format!("from GET /v1/jobs/{}", entry.job_id)),
            entry.partial,
            "{entry:?}: {note}"
        );
    }
    let undelivered = ledger.iter().filter(|e| !named(e)).count();
    let possibly = db
        .attempts
        .iter()
        .filter(|a| a.outcome.as_deref().is_none_or(|o| o == "ambiguous"))
        .count();
    assert_eq!(
        possibly, undelivered,
        "possibly billed attempts: {ledger:#?}"
    );
    let delivered: u64 = ledger.iter().filter(named).map(|e| e.credits).sum();
    assert_eq!(
        db.attempts.iter().map(|a| a.billed).sum::<u64>(),
        delivered,
        "credits of succeeded attempts against delivered bills"
    );
    let by_job = ledger_by_job(env);
    for t in db.live().filter(|t| t.status == "succeeded") {
        let job = t.job_id.as_deref().unwrap_or_else(|| panic!("{t:?}"));
        match t.reused_from {
            None => {
                let entry = by_job
                    .get(job)
                    .unwrap_or_else(|| panic!("{t:?} never billed"));
                assert!(named(&entry), "{t:?}");
                assert!(t.billed >= entry.credits, "{t:?} against {entry:?}");
            }
            Some(from) => {
                assert_eq!(db.task(from).job_id.as_deref(), Some(job), "{t:?}");
                assert_eq!(t.billed, 0, "a reused task pays nothing: {t:?}");
            }
        }
    }
}

/// The files of `run` on disk (outside `_superseded/`), its manifest and its outputs in the
/// database name the same files with the same digests; every output is downloaded and every
/// file is a PNG. Returns the manifest's lines.
#[track_caller]
fn assert_files_agree(dir: &Path, db: &Db, run: &str) -> Vec<Value> {
    let run_dir = dir.join("out").join(run);
    let lines = manifest(&run_dir);
    let outputs: Vec<&OutputRow> = db
        .outputs
        .iter()
        .filter(|o| o.run_id == run && db.live().any(|t| t.id == o.task_id))
        .collect();
    assert!(
        outputs.iter().all(|o| o.path.is_some()),
        "outputs not downloaded: {outputs:#?}"
    );
    assert_eq!(lines.len(), outputs.len(), "{lines:#?}");
    let mut expected: BTreeSet<String> = lines
        .iter()
        .map(|l| l["path"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(expected.len(), lines.len(), "two lines name one file");
    expected.insert("manifest.jsonl".into());
    let on_disk: BTreeSet<String> = files_under(&run_dir)
        .into_iter()
        .filter(|f| !f.starts_with("_superseded/"))
        .collect();
    assert_eq!(on_disk, expected, "files on disk against the manifest");
    for line in &lines {
        let file = run_dir.join(line["path"].as_str().unwrap());
        let bytes = std::fs::read(&file).unwrap();
        let digest = sha256_hex(&bytes);
        assert_eq!(line["sha256"], digest.as_str(), "{line}");
        assert_eq!(line["bytes"], bytes.len(), "{line}");
        let row = outputs
            .iter()
            .find(|o| Path::new(o.path.as_deref().unwrap()) == file)
            .unwrap_or_else(|| panic!("no output row for {}", file.display()));
        assert_eq!(row.sha256.as_deref(), Some(digest.as_str()), "{row:?}");
        assert_eq!(row.bytes, Some(bytes.len() as i64), "{row:?}");
        assert_eq!(line["job_id"], row.job_id.as_str(), "{line}");
        let task = db.task(row.task_id);
        assert_eq!(line["item"], task.item.as_str(), "{line}");
        assert_eq!(line["step"], task.step.as_str(), "{line}");
        assert_eq!(
            task.job_id.as_deref(),
            Some(row.job_id.as_str()),
            "{task:?}"
        );
        assert!(decode(&file).width() > 0);
    }
    lines
}

/// The manifest's `credits` of each output paid for in this run is what the sandbox billed
/// for the call that made it (README: "the credits of the call").
#[track_caller]
fn assert_manifest_credits_are_the_calls(env: &Env, lines: &[Value]) {
    let by_job = ledger_by_job(env);
    let wrong: Vec<String> = lines
        .iter()
        .filter_map(|l| {
            let entry = &by_job[l["job_id"].as_str().unwrap()];
            (l["credits"] != entry.credits).then(|| {
                format!(
                    "{}/{}: manifest says {} credits, job {} was billed {}",
                    l["item"], l["step"], l["credits"], entry.job_id, entry.credits
                )
            })
        })
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

fn sha_of(path: &Path) -> String {
    sha256_hex(&std::fs::read(path).unwrap())
}

/// The ledger's entries for one operation.
fn billed_for(env: &Env, operation: &str) -> usize {
    env.sandbox
        .ledger()
        .iter()
        .filter(|e| e.operation == operation)
        .count()
}

// ---------------------------------------------------------------------------------------------
// 1 + 2 + 3. SIGINT, then files deleted and modified, then resume
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_run_resumes_paying_only_for_the_rest_and_fetches_lost_files_again() {
    let env = start(sandbox_with_latency(80)).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(4, None));
    // One call at a time: i00's chain (3 calls), then i01's erase; SIGINT lets the call in
    // flight finish.
    let o = interrupt_run_r(&env, 4).await;
    let err = stderr(&o);
    assert!(err.contains("interrupted"), "{err}");
    assert!(err.contains("continue with"), "{err}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("r"), "interrupted");
    assert!(db.attempts.iter().all(|a| a.outcome.is_some()), "{db:#?}");
    assert_ledger_agrees(&env, &db);
    let done: Vec<TaskRow> = db
        .tasks_of("r")
        .into_iter()
        .filter(|t| t.status == "succeeded")
        .cloned()
        .collect();
    assert!(done.len() >= 4 && done.len() < 12, "{done:#?}");
    let pending = 12 - done.len();
    assert_eq!(db.count_in("r", "pending"), pending);
    let remaining: u64 = db
        .tasks_of("r")
        .iter()
        .filter(|t| t.status != "succeeded")
        .map(|t| t.planned)
        .sum();
    let ledger_before = env.sandbox.ledger();

    // Between the interruption and the resume: one output deleted, one overwritten.
    let run_dir = dir.join("out/r");
    let clean = task_in(&db, "r", "i00", "clean");
    let big = task_in(&db, "r", "i00", "big");
    let clean_sha = db.outputs_of(clean.id)[0].sha256.clone().unwrap();
    let big_out = db.outputs_of(big.id)[0].clone();
    let big_sha = big_out.sha256.clone().unwrap();
    assert_eq!(sha_of(&run_dir.join("i00/clean.png")), clean_sha);
    std::fs::remove_file(run_dir.join("i00/clean.png")).unwrap();
    let junk = b"not the picture that was downloaded".to_vec();
    std::fs::write(run_dir.join("i00/big.png"), &junk).unwrap();

    // `status` reads the record alone.
    let status = status_json(&env, "r").await;
    assert_eq!(status["status"], "interrupted", "{status:#}");
    assert_eq!(status["succeeded"], done.len(), "{status:#}");
    assert_eq!(status["pending"], pending, "{status:#}");
    assert_eq!(
        status["output_dir"],
        run_dir.to_str().unwrap(),
        "{status:#}"
    );
    let steps = status["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["clean", "big", "cutout"], "{status:#}");
    for s in steps {
        assert_eq!(s["tasks"], 4, "{s}");
        let n = |k: &str| s[k].as_u64().unwrap();
        assert_eq!(n("succeeded") + n("pending"), 4, "{s}");
    }
    assert_eq!(status["ambiguous"], serde_json::json!([]), "{status:#}");

    // The dry run says what resuming pays for, and touches nothing: not even the modified file.
    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains(&format!(
            "{pending} task(s) to pay for, {remaining} credits"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "never started: {pending} task(s), {remaining} credits"
        )),
        "{text}"
    );
    assert!(
        text.contains("free: 2 file(s) missing or modified"),
        "{text}"
    );
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["credits"], remaining, "{doc:#}");
    assert_eq!(doc["tasks"].as_array().unwrap().len(), pending, "{doc:#}");
    assert_eq!(
        doc["by_reason"]["never_started"]["tasks"], pending,
        "{doc:#}"
    );
    assert_eq!(doc["by_reason"].as_object().unwrap().len(), 1, "{doc:#}");
    let refetch = doc["refetch"].as_array().unwrap();
    assert_eq!(refetch.len(), 2, "{doc:#}");
    assert_still(&env, dir, &before, "resume --dry-run").await;
    assert_eq!(std::fs::read(run_dir.join("i00/big.png")).unwrap(), junk);

    // The resume: the rest paid once, the lost files fetched again from their jobs for free.
    let o = Imgpipe::on(&env, &["resume", "r", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "succeeded", "{summary:#}");
    assert_eq!(summary["succeeded"], 12, "{summary:#}");
    assert_eq!(summary["billed_credits"], 4 * CHAIN_CREDITS, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(&ledger[..ledger_before.len()], &ledger_before[..]);
    assert_eq!(
        ledger.len(),
        12,
        "each task billed exactly once: {ledger:#?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("r"), "succeeded");
    assert_ledger_agrees(&env, &db);
    for t in &done {
        let now = db.task(t.id);
        assert_eq!(now.job_id, t.job_id, "{} was paid for again", t.name());
        assert_eq!(db.attempts_of(t.id).len(), 1, "{} called again", t.name());
    }
    let lines = assert_files_agree(dir, &db, "r");
    assert_eq!(lines.len(), 12);
    assert_eq!(sha_of(&run_dir.join("i00/clean.png")), clean_sha);
    assert_eq!(sha_of(&run_dir.join("i00/big.png")), big_sha);
    // The modified file is kept, not lost.
    let superseded = files_under(&run_dir.join("_superseded"));
    assert_eq!(superseded.len(), 1, "{superseded:?}");
    let name = superseded.first().unwrap();
    assert!(
        name.starts_with(&format!("i00/big.o{}.", big_out.id)) && name.ends_with(".modified.png"),
        "{name}"
    );
    let aside = run_dir.join("_superseded").join(name);
    assert_eq!(std::fs::read(&aside).unwrap(), junk, "{}", aside.display());
    assert_manifest_credits_are_the_calls(&env, &lines);

    assert_eq!(db.superseded.len(), 2, "{:#?}", db.superseded);
    let missing = db
        .superseded
        .iter()
        .find(|s| s.task_id == clean.id)
        .unwrap();
    assert_eq!(missing.path, None, "{missing:?}");
    assert!(missing.reason.contains("missing"), "{missing:?}");
    assert_eq!(Some(&missing.job_id), clean.job_id.as_ref());
    let modified = db.superseded.iter().find(|s| s.task_id == big.id).unwrap();
    assert_eq!(modified.job_id, big_out.job_id);
    assert!(modified.reason.contains("differed"), "{modified:?}");
    assert_eq!(
        modified.path.as_deref().map(PathBuf::from),
        Some(aside.clone()),
        "{modified:?}"
    );
    // The row describes the file it points at: its digest and its size.
    assert_eq!(
        modified.sha256.as_deref(),
        Some(sha256_hex(&junk).as_str()),
        "{modified:?}"
    );
    assert_eq!(modified.bytes, Some(junk.len() as i64), "{modified:?}");
}

// ---------------------------------------------------------------------------------------------
// 1 + 8. A finished run, an unknown run, and the list of runs
// ---------------------------------------------------------------------------------------------

/// A resume removes the temporary files a killed process left (a download's `.part` in an item's
/// directory, a `.tmp` file in the run's), beside its run. (That it never removes its own, which
/// it may be writing meanwhile, is the unit test of `place::layout`.)
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_removes_the_temporary_files_a_killed_process_left() {
    let env = start(sandbox_with_latency(20)).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    interrupt_run_r(&env, 2).await;
    let run_dir = dir.join("out/r");
    let left = [
        run_dir.join("i00/.clean.a1b2c3.part"),
        run_dir.join("i01/.big.d4e5f6.part"),
        run_dir.join(".tmpX1y2z3"),
    ];
    for path in &left {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"half an image").unwrap();
    }
    let o = Imgpipe::on(&env, &["resume", "r"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    for path in &left {
        assert!(
            !path.exists(),
            "{} was left: {}",
            path.display(),
            stderr(&o)
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_run_is_only_summarised_even_offline_and_an_unknown_id_exits_2() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    let first = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "done"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&first, 0);
    let before = still(&env, dir).await;
    let api_requests = env.sandbox.stats().api_requests;

    // Against the sandbox: not one request of any kind.
    let again = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "done"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&again, 0);
    assert_eq!(stdout(&again), stdout(&first));
    assert_eq!(env.sandbox.stats().api_requests, api_requests);

    // Against a closed port: still exit 0 with the summary, since nothing needs the network.
    let closed = format!("http://127.0.0.1:{}/", closed_port());
    for sub in [
        &["run", "p.yaml", "--run-id", "done"][..],
        &["resume", "done"][..],
    ] {
        let o = Imgpipe::on(&env, sub)
            .service(&closed, env.sandbox.key())
            .sqlite_in(dir)
            .run()
            .await;
        assert_exit_without_panic(&o, 0);
        assert!(
            stdout(&o).starts_with("run done: succeeded"),
            "{sub:?}: {}",
            both(&o)
        );
        assert!(
            stdout(&o).contains(&format!("{} billed of", 2 * CHAIN_CREDITS)),
            "{}",
            stdout(&o)
        );
    }
    let o = Imgpipe::on(&env, &["resume", "done", "--dry-run"])
        .service(&closed, env.sandbox.key())
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(stdout(&o).contains("nothing to pay for"), "{}", both(&o));
    assert_still(&env, dir, &before, "a finished run run again").await;

    // An unknown run: exit 2, and a pointer to the list.
    let o = Imgpipe::on(&env, &["resume", "nope"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("\"nope\""), "{err}");
    assert!(err.contains("imgpipe runs"), "{err}");
    let o = Imgpipe::on(&env, &["status", "nope"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 2);
    assert!(stderr(&o).contains("imgpipe runs"), "{}", stderr(&o));
    assert_still(&env, dir, &before, "an unknown run").await;

    // The list of runs.
    let o = Imgpipe::on(&env, &["runs"]).sqlite_in(dir).run().await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    let header = text.lines().next().unwrap();
    for col in ["ID", "PIPELINE", "STATUS", "PLANNED", "BILLED"] {
        assert!(header.contains(col), "{text}");
    }
    let row: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        row[..5],
        ["done", "chain", "succeeded", "18", "18"],
        "{text}"
    );
    let o = Imgpipe::on(&env, &["runs", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let runs = json_stdout(&o);
    let runs = runs.as_array().unwrap();
    assert_eq!(runs.len(), 1, "{runs:#?}");
    assert_eq!(runs[0]["id"], "done");
    assert_eq!(runs[0]["pipeline"], "chain");
    assert_eq!(runs[0]["status"], "succeeded");
    assert_eq!(runs[0]["credits_planned"], 2 * CHAIN_CREDITS);
    assert_eq!(runs[0]["credits_billed"], 2 * CHAIN_CREDITS);
}

// ---------------------------------------------------------------------------------------------
// 1 + 7. The balance runs out; a resume over the budget is refused; a top-up finishes it
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_run_stopped_by_the_balance_is_refused_over_max_credits_then_finished_after_a_top_up() {
    let items = 6;
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    let cmd = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r",
            "--concurrency",
            "2",
            "--json",
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command();
    // Someone else spends the account down once four calls are billed, the calls after them
    // held in flight: those are refused for lack of credits.
    let hold = env.sandbox.hold();
    let mut child = Watched::start(cmd);
    step_until(&env, &mut child, |env| env.sandbox.ledger().len() >= 4).await;
    env.sandbox.set_balance(1);
    drop(hold);
    let o = child.finish().await;
    assert_exit_without_panic(&o, 3);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "stopped", "{summary:#}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("r"), "stopped");
    assert_record_agrees_with_ledger(&env, &db);
    let spent: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    let total = items as u64 * CHAIN_CREDITS;
    let left = total - spent;
    assert!(left > 0);

    // The list shows it stopped, with what it was billed.
    let o = Imgpipe::on(&env, &["runs", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let runs = json_stdout(&o);
    assert_eq!(runs[0]["status"], "stopped", "{runs:#}");
    assert_eq!(runs[0]["credits_billed"], spent, "{runs:#}");
    assert_eq!(runs[0]["credits_planned"], total, "{runs:#}");

    // Topped up, but the run may now spend only one credit less than it needs: refused whole.
    env.sandbox.set_balance(1000);
    let before = still(&env, dir).await;
    let cap = (spent + left - 1).to_string();
    let o = Imgpipe::on(&env, &["resume", "r", "--max-credits", &cap])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "{left} credits, but only {} may be spent",
            left - 1
        )),
        "{err}"
    );
    assert!(err.contains("--max-credits"), "{err}");
    assert_still(&env, dir, &before, "a resume over --max-credits").await;

    // Exactly enough: it finishes, every task paid once over both processes.
    let cap = total.to_string();
    let o = Imgpipe::on(&env, &["resume", "r", "--max-credits", &cap, "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 3 * items, "{summary:#}");
    assert_eq!(summary["billed_credits"], total, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 3 * items, "{ledger:#?}");
    assert_eq!(ledger.iter().map(|e| e.credits).sum::<u64>(), total);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("r"), "succeeded");
    assert_record_agrees_with_ledger(&env, &db);
    assert_eq!(env.sandbox.balance(), 1000 - (total - spent) as i64);
    assert_files_agree(dir, &db, "r");
}

// ---------------------------------------------------------------------------------------------
// 4. Calls in flight when the process was killed
// ---------------------------------------------------------------------------------------------

/// Three items, two calls at a time, the sandbox held. Until a bill confirms a step's price
/// imgpipe sends one call of that step at a time, so i00's erase goes alone and is let
/// through; once it is billed, i00's upscale and i01's erase go together, and the process is
/// killed (SIGKILL) while both are held in flight. Released, the sandbox bills both anyway,
/// undelivered.
async fn killed_with_two_calls_in_flight(env: &Env) {
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let hold = env.sandbox.hold();
    env.sandbox.let_through(1);
    let mut child = Imgpipe::on(
        env,
        &["run", "p.yaml", "--run-id", "k", "--concurrency", "2"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command()
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_until("the first bill, then two calls held in flight", || {
        env.sandbox.ledger().len() == 1 && env.sandbox.held_calls() == 2
    })
    .await;
    kill_child(&mut child, "the run").await;
    release_after_kill(env, hold).await;
    wait_until("both calls billed", || env.sandbox.stats().abandoned >= 2).await;
    let ledger = env.sandbox.ledger();
    let ops: BTreeSet<(&str, bool)> = ledger
        .iter()
        .map(|e| (e.operation.as_str(), e.delivered))
        .collect();
    assert_eq!(ledger.len(), 3, "{ledger:#?}");
    assert_eq!(
        ops,
        BTreeSet::from([("erase", true), ("upscale", false), ("erase", false)]),
        "{ledger:#?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("k"), "running", "a killed run says nothing");
    let orphans: Vec<_> = db.attempts.iter().filter(|a| a.outcome.is_none()).collect();
    assert_eq!(orphans.len(), 2, "{:#?}", db.attempts);
    assert_eq!(task_in(&db, "k", "i00", "clean").status, "succeeded");
    assert_eq!(task_in(&db, "k", "i00", "big").status, "running");
    assert_eq!(task_in(&db, "k", "i01", "clean").status, "running");
}

/// The two tasks whose calls were in flight at the kill.
const ORPHANS: [(&str, &str); 2] = [("i00", "big"), ("i01", "clean")];

#[tokio::test(flavor = "multi_thread")]
async fn calls_in_flight_when_the_process_was_killed_are_ambiguous_and_called_again_by_default() {
    let env = start(config()).await;
    let dir = env.dir.path();
    killed_with_two_calls_in_flight(&env).await;

    // status and runs show the two calls as possibly billed.
    let status = status_json(&env, "k").await;
    assert_eq!(status["status"], "interrupted", "{status:#}");
    let ambiguous: BTreeSet<(&str, &str)> = status["ambiguous"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["task"].as_str().unwrap(), a["endpoint"].as_str().unwrap()))
        .collect();
    assert_eq!(
        ambiguous,
        BTreeSet::from([
            ("i00/big[0]", "POST /v1/images/tools/upscale"),
            ("i01/clean[0]", "POST /v1/images/tools/erase"),
        ]),
        "{status:#}"
    );
    assert_eq!(status["ambiguous_attempts"], 2, "{status:#}");
    assert_eq!(status["possibly_billed_credits"], 4, "{status:#}");
    let o = Imgpipe::on(&env, &["status", "k"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stdout(&o).contains("possibly billed: i01/clean[0] POST /v1/images/tools/erase"),
        "{}",
        stdout(&o)
    );
    let o = Imgpipe::on(&env, &["runs", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    let runs = json_stdout(&o);
    assert_eq!(runs[0]["status"], "interrupted", "{runs:#}");
    assert_eq!(runs[0]["possibly_billed"], 4, "{runs:#}");

    // The dry run names them ambiguous, and settles nothing.
    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["resume", "k", "--dry-run", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["by_reason"]["ambiguous"]["tasks"], 2, "{doc:#}");
    assert_eq!(doc["by_reason"]["ambiguous"]["credits"], 4, "{doc:#}");
    assert_eq!(doc["by_reason"]["never_started"]["tasks"], 6, "{doc:#}");
    assert_eq!(doc["credits"], 3 * CHAIN_CREDITS - 2, "{doc:#}");
    assert_eq!(doc["kept"], 1, "{doc:#}");
    let o = Imgpipe::on(&env, &["resume", "k", "--dry-run"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("ambiguous: 2 task(s), 4 credits"), "{text}");
    for (item, step) in ORPHANS {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("{item}/{step}[0]")))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains("ambiguous"), "{line}");
    }
    assert_still(&env, dir, &before, "resume --dry-run").await;

    // Resumed with the default --on-ambiguous retry: both are called again.
    let o = Imgpipe::on(&env, &["resume", "k", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 9, "{summary:#}");
    assert_eq!(summary["ambiguous_attempts"], 2, "{summary:#}");
    assert_eq!(summary["billed_credits"], 3 * CHAIN_CREDITS, "{summary:#}");
    assert_eq!(billed_for(&env, "erase"), 4, "one lost, three delivered");
    assert_eq!(billed_for(&env, "upscale"), 4, "one lost, three delivered");
    assert_eq!(env.sandbox.ledger().len(), 11);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("k"), "succeeded");
    assert_ledger_agrees(&env, &db);
    for (item, step) in ORPHANS {
        let t = task_in(&db, "k", item, step);
        let attempts = db.attempts_of(t.id);
        assert_eq!(attempts.len(), 2, "{attempts:#?}");
        assert_eq!(attempts[0].outcome.as_deref(), Some("ambiguous"));
        assert!(
            attempts[0]
                .error
                .as_deref()
                .is_some_and(|e| e.contains("may have been billed")),
            "{attempts:#?}"
        );
        assert_eq!(attempts[1].outcome.as_deref(), Some("succeeded"));
    }
    assert_files_agree(dir, &db, "k");
}

/// Half the answers are cut after their start named the job. Interrupted (SIGINT) mid-run and
/// resumed, the run reads every cut answer back by its id: each task is billed once, and every
/// file is there.
#[tokio::test(flavor = "multi_thread")]
async fn answers_cut_after_naming_their_job_across_an_interruption_are_never_paid_for_twice() {
    let items = 4;
    let env = start(sandbox::Config {
        latency: Duration::from_millis(50),
        faults: sandbox::Faults {
            partial_answer: 0.5,
            seed: 5,
            ..sandbox::Faults::default()
        },
        ..config()
    })
    .await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(items, None));
    let cmd = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--concurrency", "2"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command();
    let o = interrupt_when(&env, cmd, |env| {
        env.sandbox.stats().partial_answers >= 1 && env.sandbox.ledger().len() >= 3
    })
    .await;
    assert_exit_without_panic(&o, 130);
    let o = Imgpipe::on(&env, &["resume", "r", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 3 * items, "{summary:#}");
    assert_eq!(
        summary["billed_credits"],
        items as u64 * CHAIN_CREDITS,
        "{summary:#}"
    );
    assert_eq!(summary["ambiguous_attempts"], 0, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 3 * items, "one bill per task: {ledger:#?}");
    assert!(
        ledger.iter().filter(|e| e.partial).count() >= 3,
        "{ledger:#?}"
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("r"), "succeeded");
    assert_ledger_agrees(&env, &db);
    assert_files_agree(dir, &db, "r");
}

/// The attempts recorded as possibly billed that name their job, by step, once the database
/// exists.
async fn named_lost_calls(dir: &Path) -> Vec<(String, String)> {
    if !state_path(dir).exists() {
        return Vec::new();
    }
    let mut conn = connect(dir).await;
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT t.step, a.job_id FROM attempts a JOIN tasks t ON t.id = a.task_id
         WHERE a.outcome = 'ambiguous' AND a.job_id IS NOT NULL",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    let _ = conn.close().await;
    rows
}

/// Run `k` of one item, every answer cut after naming its job, killed (SIGKILL) while it reads
/// back the upscale's job: the sandbox holds the upscale at its gate until the erase has been
/// read back, then answers every job read 429 with a `Retry-After` of an hour, so the run waits
/// to read the upscale back for as long as the test needs, whatever the machine's speed. Gives
/// the upscale's job, on record as possibly billed: the erase succeeded, the cut-out never ran.
async fn killed_reading_back_the_upscale(env: &Env) -> String {
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(1, None));
    let hold = env.sandbox.hold();
    let mut run = Imgpipe::on(env, &["run", "p.yaml", "--run-id", "k"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .watched();
    // The erase billed, cut and read back (the upscale is made from its image): the upscale
    // waits at the gate.
    step_until(env, &mut run, |env| env.sandbox.ledger().len() == 1).await;
    env.sandbox
        .rate_limit_job_reads(usize::MAX, Duration::from_secs(3600));
    env.sandbox.let_through(1);
    wait_while_running(
        &mut run,
        "the upscale's read-back answered 429 (the run waiting to read it back)",
        || env.sandbox.stats().job_reads_rate_limited >= 1,
    )
    .await;
    send_signal(run.id(), libc::SIGKILL);
    run.finish().await;
    drop(hold);
    env.sandbox.rate_limit_job_reads(0, Duration::ZERO);
    let stats = env.sandbox.stats();
    assert_eq!(
        (stats.job_reads, stats.job_reads_rate_limited),
        (2, 1),
        "the erase read back, the upscale's read-back refused: {stats:?}"
    );
    let lost = named_lost_calls(dir).await;
    assert_eq!(
        lost.iter()
            .map(|(step, _)| step.as_str())
            .collect::<Vec<_>>(),
        ["big"],
        "the upscale on record as possibly billed, the erase read back by the run: {lost:?}"
    );
    let job = lost[0].1.clone();
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2, "{ledger:#?}");
    assert!(ledger.iter().all(|e| e.partial), "{ledger:#?}");
    assert_eq!(ledger[1].job_id.as_str(), job, "{ledger:#?}");
    job
}

/// A sandbox whose every answer is cut after naming its job.
async fn start_cutting_every_answer() -> Env {
    start(sandbox::Config {
        faults: sandbox::Faults {
            partial_answer: 1.0,
            ..sandbox::Faults::default()
        },
        ..config()
    })
    .await
}

/// Every answer is cut after naming its job, and the process is killed while it reads back the
/// upscale's job ([`killed_reading_back_the_upscale`]). The attempt is on record with its job
/// id, and `resume` reads the job back for free instead of calling again, keeping its lineage.
#[tokio::test(flavor = "multi_thread")]
async fn killed_while_reading_back_a_cut_answer_the_resume_reads_it_back_for_free() {
    let env = start_cutting_every_answer().await;
    let dir = env.dir.path();
    let job = killed_reading_back_the_upscale(&env).await;

    let o = Imgpipe::on(&env, &["resume", "k", "--dry-run", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["recover_by_job_id"], 1, "{doc:#}");

    let o = Imgpipe::on(&env, &["resume", "k", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 3, "{summary:#}");
    assert_eq!(summary["billed_credits"], CHAIN_CREDITS, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 3, "one bill per task: {ledger:#?}");
    assert_eq!(
        billed_for(&env, "upscale"),
        1,
        "the cut upscale was not paid for again"
    );
    let db = Db::read_file(&state_path(dir)).await;
    let big = task_in(&db, "k", "i00", "big");
    assert_eq!(big.job_id.as_deref(), Some(job.as_str()));
    // One call was sent and billed, and read back on resume.
    let attempts = db.attempts_of(big.id);
    assert_eq!(attempts.len(), 1, "{attempts:#?}");
    assert_eq!(attempts[0].outcome.as_deref(), Some("succeeded"));
    let note = attempts[0].error.as_deref().unwrap_or_default();
    assert!(
        note.contains(&format!("recovered on resume from GET /v1/jobs/{job}")),
        "{attempts:#?}"
    );
    assert_ledger_agrees(&env, &db);
    let lines = assert_files_agree(dir, &db, "k");
    // The lineage survives the read-back: the upscale was made from the erase's output.
    let clean = task_in(&db, "k", "i00", "clean").job_id.clone().unwrap();
    let line = lines
        .iter()
        .find(|l| l["step"] == "big")
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert_eq!(line["parent_job_id"], clean.as_str(), "{line}");
}

/// What `imgpipe status RUN --json` prints of run `run` in the test's directory.
async fn status_json(env: &Env, run: &str) -> Value {
    let o = Imgpipe::on(env, &["status", run, "--json"])
        .sqlite_in(env.dir.path())
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    json_stdout(&o)
}

/// The outputs of run `k` recorded without a file.
fn unstored(db: &Db) -> usize {
    let outputs = db.outputs.iter().filter(|o| o.run_id == "k");
    outputs.filter(|o| o.path.is_none()).count()
}

/// A resume over its budget still does the free part first: the upscale's lost answer read
/// back by its job id, the outputs paid for and without a file (the upscale's, known once read
/// back) fetched and stored; nothing is paid for, the refusal says what it kept, and the run
/// is recorded stopped with that as its reason, not left `running`. The dry run does none of
/// it. Given the credits, the next resume pays only for the cut-out.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_over_its_budget_keeps_what_was_paid_for_and_records_why_it_stopped() {
    let env = start_cutting_every_answer().await;
    let dir = env.dir.path();
    let job = killed_reading_back_the_upscale(&env).await;
    let spent: u64 = env.sandbox.ledger().iter().map(|e| e.credits).sum();
    let cutout = CHAIN_CREDITS - spent;
    // One credit short of the cut-out, the only task left to pay once the upscale is read back.
    let cap = (CHAIN_CREDITS - 1).to_string();
    let resume = |more: &[&str]| {
        Imgpipe::on(&env, &["resume", "k", "--max-credits", &cap])
            .args(more)
            .sqlite_in(dir)
            .retry_base_ms(20)
    };
    let before = still(&env, dir).await;
    assert_exit_without_panic(&resume(&["--dry-run"]).run().await, 3);
    assert_still(&env, dir, &before, "a dry run over --max-credits").await;
    // The erase's output is stored, unless the kill came first. A download the kill cut
    // leaves its temporary file: one is made here, whatever the kill's moment.
    let unstored_before = unstored(&Db::read_file(&state_path(dir)).await);
    let cut = dir.join("out/k/i00/.clean.0123456789abcdef.part");
    std::fs::create_dir_all(cut.parent().unwrap()).unwrap();
    std::fs::write(&cut, b"half a png").unwrap();

    let o = resume(&[]).run().await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    let said = format!(
        "would pay for 1 task(s), {cutout} credits, but only {} may be spent",
        cutout - 1
    );
    assert!(err.contains(&said), "{err}");
    let kept = format!(
        "read back 1 lost answer(s); kept {} output(s) already paid for; nothing was spent",
        unstored_before + 1
    );
    assert!(err.contains(&kept), "{err}");
    assert_eq!(env.sandbox.ledger().len(), 2, "nothing paid for");
    assert_eq!(env.sandbox.stats().paid_requests, before.paid_requests);
    let db = Db::read_file(&state_path(dir)).await;
    let big = task_in(&db, "k", "i00", "big");
    assert_eq!(big.status, "succeeded", "{big:?}");
    assert_eq!(big.job_id.as_deref(), Some(job.as_str()));
    assert_eq!(unstored(&db), 0, "{:#?}", db.outputs);
    assert_ledger_agrees(&env, &db);
    assert_files_agree(dir, &db, "k");
    // What a user reads: stopped, and why.
    let status = status_json(&env, "k").await;
    assert_eq!(status["status"], "stopped", "{status:#}");
    let why = status["stopped"].as_str().unwrap_or_default();
    assert!(why.contains(&said) && why.contains(&kept), "{status:#}");

    finishes_paying_for_the_cutout_alone(&env).await;
}

/// A run stopped by SIGINT whose resume is refused for its budget is recorded stopped, with the
/// refusal as its reason: not left `interrupted`, which names a resume that cannot go.
#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_run_refused_over_its_budget_is_recorded_stopped_with_why() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    interrupt_run_r(&env, 2).await;
    assert_eq!(status_json(&env, "r").await["status"], "interrupted");
    let ledger = env.sandbox.ledger();
    let o = Imgpipe::on(&env, &["resume", "r", "--max-credits", "1"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    assert_eq!(env.sandbox.ledger(), ledger, "nothing paid for");
    let status = status_json(&env, "r").await;
    assert_eq!(status["status"], "stopped", "{status:#}");
    let why = status["stopped"].as_str().unwrap_or_default();
    assert!(
        why.contains("but only 0 may be spent (budget 1 less what the run spent")
            && why.ends_with("; nothing was spent"),
        "{status:#}"
    );
}

/// Over its budget only while a lost answer counts as to pay for: read back for free, the rest
/// fits, and the resume goes on to finish, paying for the cut-out alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_resume_that_fits_once_its_lost_answer_is_read_back_finishes() {
    let env = start_cutting_every_answer().await;
    killed_reading_back_the_upscale(&env).await;
    finishes_paying_for_the_cutout_alone(&env).await;
}

/// `resume k` with a budget of the whole chain finishes run `k` of
/// [`killed_reading_back_the_upscale`], its upscale read back: the cut-out alone is paid for,
/// each task billed once.
async fn finishes_paying_for_the_cutout_alone(env: &Env) {
    let dir = env.dir.path();
    let o = Imgpipe::on(env, &["resume", "k", "--json"])
        .args(&["--max-credits", &CHAIN_CREDITS.to_string()])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["billed_credits"], CHAIN_CREDITS, "{summary:#}");
    assert_eq!(env.sandbox.ledger().len(), 3, "one bill per task");
    assert_eq!(billed_for(env, "upscale"), 1);
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(db.run_status("k"), "succeeded");
    assert_ledger_agrees(env, &db);
    assert_files_agree(dir, &db, "k");
}

/// A killed run records nothing: its record still says `running`. `status`, `runs` and the
/// report ask the run lock, find that no process holds it, and say `interrupted` (text and
/// JSON), that the process is gone and which command continues the run; the record itself
/// is left as it is, and that command then finishes the run.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_run_reads_interrupted_in_status_runs_and_report_with_the_command_to_resume_it() {
    let env = start(config()).await;
    let dir = env.dir.path();
    killed_with_two_calls_in_flight(&env).await;
    let resume_with = format!("imgpipe resume k --state {}", state_path(dir).display());

    let status = status_json(&env, "k").await;
    assert_eq!(status["status"], "interrupted", "{status:#}");
    assert_eq!(status["process"]["alive"], false, "{status:#}");
    assert_eq!(status["continue_with"], resume_with.as_str(), "{status:#}");
    let o = Imgpipe::on(&env, &["status", "k"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(text.starts_with("run k: interrupted\n"), "{text}");
    assert!(
        text.contains("  process   gone: it ended without recording its end"),
        "{text}"
    );
    assert!(
        text.contains(&format!("  continue  {resume_with}\n")),
        "{text}"
    );

    let o = Imgpipe::on(&env, &["runs", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let runs = json_stdout(&o);
    assert_eq!(runs[0]["status"], "interrupted", "{runs:#}");
    assert_eq!(runs[0]["process"]["alive"], false, "{runs:#}");
    assert_eq!(runs[0]["continue_with"], resume_with.as_str(), "{runs:#}");
    let o = Imgpipe::on(&env, &["runs"]).sqlite_in(dir).run().await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    let line = text.lines().find(|l| l.starts_with("k ")).unwrap();
    assert!(line.contains(" interrupted "), "{text}");
    assert!(
        text.contains(&format!("hint: continue it with: {resume_with}")),
        "{text}"
    );

    let o = Imgpipe::on(&env, &["report", "k", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    assert_eq!(written["status"], "interrupted", "{written:#}");
    assert_eq!(written["process"]["alive"], false, "{written:#}");
    assert_eq!(
        written["continue_with"],
        resume_with.as_str(),
        "{written:#}"
    );
    let page = std::fs::read_to_string(dir.join("out/k/report.html")).unwrap();
    assert!(
        page.contains("id=\"run-status\">interrupted</span>"),
        "the badge"
    );
    assert!(!page.contains("still going"), "no in-progress banner");
    assert!(page.contains("its process is gone"), "the page says why");
    assert!(
        page.contains(&format!("<code id=\"continue-with\">{resume_with}</code>")),
        "the page names the command"
    );
    // The two calls in flight at the kill are possibly billed, not in flight.
    assert!(!page.contains("a call is in flight"));
    assert!(page.contains("a call was in flight when the run ended"));

    // Only said: the record is unchanged, and the command it names finishes the run.
    assert_eq!(
        Db::read_file(&state_path(dir)).await.run_status("k"),
        "running"
    );
    let o = Imgpipe::on(&env, &["resume", "k", "--retry-base-ms", "20"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let status = json_stdout(
        &Imgpipe::on(&env, &["status", "k", "--json"])
            .sqlite_in(dir)
            .run()
            .await,
    );
    assert_eq!(status["status"], "succeeded", "{status:#}");
    assert!(status.get("process").is_none(), "{status:#}");
    assert!(status.get("continue_with").is_none(), "{status:#}");
}

/// A run whose process holds the run lock is going, even frozen (SIGSTOP): `status`, `runs`
/// and the report say `running`, with its pid, and name no command to continue it.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_process_is_alive_reads_running_with_its_pid_even_while_stopped() {
    let env = start(config()).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(3, None));
    let hold = env.sandbox.hold();
    env.sandbox.let_through(2);
    let child = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "g", "--concurrency", "1"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command()
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let pid = child.id().unwrap();
    wait_until("two calls billed and the third held in flight", || {
        env.sandbox.ledger().len() == 2 && env.sandbox.held_calls() == 1
    })
    .await;
    send_signal(pid, libc::SIGSTOP);

    let status = status_json(&env, "g").await;
    assert_eq!(status["status"], "running", "{status:#}");
    assert_eq!(status["process"]["alive"], true, "{status:#}");
    assert_eq!(status["process"]["pid"], pid, "{status:#}");
    assert!(status.get("continue_with").is_none(), "{status:#}");
    let text = stdout(
        &Imgpipe::on(&env, &["status", "g"])
            .sqlite_in(dir)
            .run()
            .await,
    );
    assert!(text.starts_with("run g: running\n"), "{text}");
    assert!(
        text.contains(&format!("  process   going: pid {pid} on ")),
        "{text}"
    );
    assert!(!text.contains("continue"), "{text}");
    let runs = json_stdout(
        &Imgpipe::on(&env, &["runs", "--json"])
            .sqlite_in(dir)
            .run()
            .await,
    );
    assert_eq!(runs[0]["status"], "running", "{runs:#}");
    assert_eq!(runs[0]["process"]["pid"], pid, "{runs:#}");
    let text = stdout(&Imgpipe::on(&env, &["runs"]).sqlite_in(dir).run().await);
    assert!(!text.contains("hint:"), "{text}");
    let o = Imgpipe::on(&env, &["report", "g", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let written = json_stdout(&o);
    assert_eq!(written["status"], "running", "{written:#}");
    assert_eq!(written["process"]["alive"], true, "{written:#}");
    let page = std::fs::read_to_string(dir.join("out/g/report.html")).unwrap();
    assert!(page.contains("still going"), "the in-progress banner");
    assert!(
        page.contains(&format!("pid {pid} on ")),
        "the banner names the process"
    );
    assert!(!page.contains("continue-with"));

    send_signal(pid, libc::SIGCONT);
    drop(hold);
    let o = tokio::time::timeout(RUN_LIMIT, child.wait_with_output())
        .await
        .expect("the run ends in time")
        .unwrap();
    assert_exit_without_panic(&o, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_on_ambiguous_fail_calls_in_flight_at_a_kill_fail_their_task_and_block_its_chain() {
    let env = start(config()).await;
    let dir = env.dir.path();
    killed_with_two_calls_in_flight(&env).await;

    let o = Imgpipe::on(&env, &["resume", "k", "--on-ambiguous", "fail"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 4);
    // Only i02's chain was paid; the two lost calls were not sent again.
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 6, "{ledger:#?}");
    assert_eq!(billed_for(&env, "erase"), 3, "{ledger:#?}");
    assert_eq!(billed_for(&env, "upscale"), 2, "{ledger:#?}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    let text = stdout(&o);
    let blocked = [("i00", "cutout"), ("i01", "big"), ("i01", "cutout")];
    for (item, step) in ORPHANS {
        let t = task_in(&db, "k", item, step);
        assert_eq!(t.status, "failed", "{t:?}");
        assert_eq!(db.attempts_of(t.id).len(), 1, "called again: {t:?}");
        let why = t.error.as_deref().unwrap();
        assert!(why.contains("--on-ambiguous"), "{why}");
        assert!(
            text.contains(&format!("failed    {item}/{step}[0]: ")),
            "{text}"
        );
    }
    for (item, step) in blocked {
        let d = task_in(&db, "k", item, step);
        assert_eq!(d.status, "blocked", "{d:?}");
        assert!(db.attempts_of(d.id).is_empty(), "{d:?}");
        assert!(d.error.as_deref().unwrap().contains("failed"), "{d:?}");
    }
    assert_eq!(db.count_in("k", "succeeded"), 4);
    assert_eq!(db.run_status("k"), "failed");
    assert_files_agree(dir, &db, "k");

    // status names the failures and their reasons.
    let status = status_json(&env, "k").await;
    let failures = status["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 2, "{status:#}");
    assert!(
        failures
            .iter()
            .all(|f| f["reason"].as_str().unwrap().contains("--on-ambiguous")),
        "{status:#}"
    );
    let counts: Vec<(String, u64, u64, u64)> = status["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let n = |k: &str| s[k].as_u64().unwrap();
            (
                s["step"].as_str().unwrap().to_owned(),
                n("succeeded"),
                n("failed"),
                n("blocked"),
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            ("clean".to_owned(), 2, 1, 0),
            ("big".to_owned(), 1, 1, 1),
            ("cutout".to_owned(), 1, 0, 2),
        ],
        "{status:#}"
    );

    // The user decides to pay for them after all: resumed with retry, the run finishes.
    let o = Imgpipe::on(&env, &["resume", "k"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger().len(), 11);
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    assert_eq!(db.count_in("k", "succeeded"), 9);
    assert_files_agree(dir, &db, "k");
}

// ---------------------------------------------------------------------------------------------
// 3. The dry run's reasons for failed and blocked tasks
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn resume_dry_run_lists_failed_and_blocked_tasks_with_their_credits_and_writes_nothing() {
    let env = start(config()).await;
    let dir = env.dir.path();
    // i01's image is no sample of the sandbox: its erase is refused (400, nothing billed).
    let text = edit_chain(3, None).replace("assets/lamp.png", "assets/sofa.png");
    write(dir, "p.yaml", &text);
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 4);
    assert_eq!(env.sandbox.ledger().len(), 6);

    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(
        has_phrase(&text, "3 task(s) to pay for, 9 credits"),
        "{text}"
    );
    assert!(text.contains("failed: 1 task(s), 2 credits"), "{text}");
    assert!(text.contains("blocked: 2 task(s), 7 credits"), "{text}");
    let failed = text.lines().find(|l| l.contains("i01/clean[0]")).unwrap();
    assert!(
        failed.contains("failed") && failed.contains("sofa"),
        "{failed}"
    );
    assert!(text.contains("kept: 6 task(s) already done"), "{text}");
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(doc["credits"], 9, "{doc:#}");
    assert_eq!(doc["by_reason"]["failed"]["tasks"], 1, "{doc:#}");
    assert_eq!(doc["by_reason"]["failed"]["credits"], 2, "{doc:#}");
    assert_eq!(doc["by_reason"]["blocked"]["tasks"], 2, "{doc:#}");
    assert_eq!(doc["by_reason"]["blocked"]["credits"], 7, "{doc:#}");
    let tasks = doc["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3, "{doc:#}");
    assert!(
        tasks
            .iter()
            .all(|t| t["item"] == "i01" && t["credits"].as_u64().unwrap() > 0),
        "{doc:#}"
    );
    assert_still(&env, dir, &before, "resume --dry-run").await;
}

// ---------------------------------------------------------------------------------------------
// 5. A changed pipeline
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_pipeline_is_refused_and_with_allow_changes_only_what_changed_runs_again() {
    let env = start(sandbox_with_latency(60)).await;
    let dir = env.dir.path();
    let original = edit_chain(3, None);
    write(dir, "p.yaml", &original);
    interrupt_run_r(&env, 4).await;
    let db = Db::read_file(&state_path(dir)).await;
    let done: Vec<TaskRow> = db
        .tasks_of("r")
        .into_iter()
        .filter(|t| t.status == "succeeded")
        .cloned()
        .collect();
    let old_sha: HashMap<i64, (i64, String)> = db
        .outputs
        .iter()
        .map(|o| (o.task_id, (o.id, o.sha256.clone().unwrap())))
        .collect();
    let done_of = |step: &str| done.iter().filter(|t| t.step == step).count();
    let (clean_done, big_done, cutout_done) = (done_of("clean"), done_of("big"), done_of("cutout"));
    assert!(big_done >= 1 && cutout_done >= 1, "{done:#?}");
    let paid_before = env.sandbox.ledger().len();

    // upscale 4× instead of 2×: `big` and everything after it asks for something else.
    let changed = original.replace("desired_increase: 2", "desired_increase: 4");
    write(dir, "p.yaml", &changed);
    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["resume", "r"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(err.contains("the pipeline changed"), "{err}");
    assert!(
        err.contains(&format!(
            "step `big` asks something else of {big_done} task(s)"
        )),
        "{err}"
    );
    assert!(err.contains("--allow-changes"), "{err}");
    assert_still(&env, dir, &before, "a refused resume").await;

    let o = Imgpipe::on(
        &env,
        &["resume", "r", "--dry-run", "--allow-changes", "--json"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let doc = json_stdout(&o);
    assert_eq!(
        doc["by_reason"]["changed"]["tasks"],
        big_done + cutout_done,
        "{doc:#}"
    );
    assert_eq!(doc["kept"], clean_done, "{doc:#}");
    assert_still(&env, dir, &before, "resume --dry-run --allow-changes").await;

    let o = Imgpipe::on(&env, &["resume", "r", "--allow-changes", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "succeeded", "{summary:#}");
    assert_eq!(summary["succeeded"], 9, "{summary:#}");
    // Everything but the erases already done was called (again).
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), paid_before + 9 - clean_done, "{ledger:#?}");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    assert_eq!(
        db.run("r").pipeline_text,
        changed,
        "the run keeps the file it now ran"
    );
    let run_dir = dir.join("out/r");
    for t in &done {
        let now = db.task(t.id);
        if t.step == "clean" {
            assert_eq!(now.job_id, t.job_id, "{} paid again", t.name());
            assert_eq!(db.attempts_of(t.id).len(), 1, "{}", t.name());
            continue;
        }
        assert_ne!(now.job_id, t.job_id, "{} not run again", t.name());
        // Its old output was moved aside, whole.
        let (out_id, sha) = &old_sha[&t.id];
        let row = db
            .superseded
            .iter()
            .find(|s| s.task_id == t.id)
            .unwrap_or_else(|| panic!("{:#?}", db.superseded));
        let aside = PathBuf::from(row.path.as_deref().expect("moved aside"));
        let name = aside.file_name().unwrap().to_string_lossy().into_owned();
        let under = run_dir.join(format!("_superseded/{}", t.item));
        assert_eq!(aside.parent(), Some(under.as_path()), "{}", aside.display());
        assert!(
            name.starts_with(&format!("{}.o{out_id}.", t.step)),
            "{name}"
        );
        assert_eq!(&sha_of(&aside), sha, "{}", aside.display());
        assert_eq!(row.sha256.as_ref(), Some(sha));
        assert_eq!(Some(&row.job_id), t.job_id.as_ref());
        assert!(row.reason.contains("runs again"), "{row:?}");
    }
    assert_eq!(db.superseded.len(), big_done + cutout_done);
    assert_eq!(
        files_under(&run_dir.join("_superseded")).len(),
        big_done + cutout_done
    );
    // The final files are the new pipeline's: every big is 4× its clean.
    for item in ["i00", "i01", "i02"] {
        let clean = decode(&run_dir.join(item).join("clean.png")).dimensions();
        let big = decode(&run_dir.join(item).join("big.png")).dimensions();
        assert_eq!(big, (4 * clean.0, 4 * clean.1), "{item}");
    }
    let lines = assert_files_agree(dir, &db, "r");
    assert_eq!(lines.len(), 9);
    assert_manifest_credits_are_the_calls(&env, &lines);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_resumes_from_its_own_copy_of_the_pipeline_when_the_file_is_gone() {
    let env = start(sandbox_with_latency(60)).await;
    let dir = env.dir.path();
    write(dir, "p.yaml", &edit_chain(2, None));
    interrupt_run_r(&env, 2).await;
    let paid = env.sandbox.ledger().len();
    assert!(paid < 6, "{paid}");
    std::fs::remove_file(dir.join("p.yaml")).unwrap();
    // From another directory, as cron would.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let o = Imgpipe::on(&env, &["resume", "r", "--retry-base-ms", "20"])
        .cwd(&elsewhere)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(stderr(&o).contains("is gone"), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("run r: succeeded"), "{}", both(&o));
    assert_eq!(env.sandbox.ledger().len(), 6, "each task paid once");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    assert_eq!(db.count_in("r", "succeeded"), 6);
    assert!(
        files_under(&elsewhere).is_empty(),
        "nothing written in the cwd"
    );
    assert_files_agree(dir, &db, "r");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_item_dropped_by_allow_changes_and_then_put_back_runs_in_the_same_run() {
    let env = start(sandbox_with_latency(60)).await;
    let dir = env.dir.path();
    let original = edit_chain(4, None);
    write(dir, "p.yaml", &original);
    let one_at_a_time = ["r", "--concurrency", "1"];
    interrupt_run_r(&env, 4).await;
    let db = Db::read_file(&state_path(dir)).await;
    assert_eq!(task_in(&db, "r", "i03", "clean").status, "pending");

    // i03 dropped from the file: refused without --allow-changes, dropped with it.
    write(dir, "p.yaml", &edit_chain(3, None));
    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["resume", "r"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 3);
    let err = stderr(&o);
    assert!(has_phrase(&err, "0 item(s) added, 1 removed"), "{err}");
    assert!(
        has_phrase(&err, "3 recorded task(s) would be dropped"),
        "{err}"
    );
    assert_still(&env, dir, &before, "a refused resume").await;
    let o = Imgpipe::on(
        &env,
        &["resume", "r", "--allow-changes", "--dry-run", "--json"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["removed"], 3);
    assert_still(&env, dir, &before, "resume --dry-run").await;
    // Interrupted again once one more call is billed; i02's chain is still to do.
    let paid = env.sandbox.ledger().len();
    let mut args = one_at_a_time.to_vec();
    args.push("--allow-changes");
    let o = interrupt_when(
        &env,
        Imgpipe::on(&env, &["resume"])
            .args(&args)
            .sqlite_in(dir)
            .retry_base_ms(20)
            .command(),
        |env| env.sandbox.ledger().len() > paid,
    )
    .await;
    assert_exit_without_panic(&o, 130);
    let o = Imgpipe::on(&env, &["status", "r", "--json"])
        .sqlite_in(dir)
        .run()
        .await;
    let status = json_stdout(&o);
    assert_eq!(status["tasks"], 9, "{status:#}");
    assert!(
        status["pending"].as_u64().unwrap() > 0,
        "work is left: {status:#}"
    );

    // i03 put back: it is new work again, paid once, and the run finishes.
    write(dir, "p.yaml", &original);
    let o = Imgpipe::on(&env, &["resume", "r", "--allow-changes", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 12, "{summary:#}");
    assert_eq!(env.sandbox.ledger().len(), 12, "each task paid once");
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    assert_files_agree(dir, &db, "r");
}

// ---------------------------------------------------------------------------------------------
// 6. Reuse across runs
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn reuse_takes_earlier_results_for_free_and_pays_only_downstream_of_a_change() {
    let env = start(config()).await;
    let dir = env.dir.path();
    let original = edit_chain(3, None);
    write(dir, "p.yaml", &original);
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "a"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let full = 3 * CHAIN_CREDITS;
    assert_eq!(env.sandbox.ledger().len(), 9);

    // The dry run says what reuse saves, and spends nothing.
    let before = still(&env, dir).await;
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--dry-run", "--reuse"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains(&format!(
            "reuse: 9 task(s) from earlier runs, saving {full} credits"
        )),
        "{text}"
    );
    assert_still(&env, dir, &before, "run --dry-run --reuse").await;

    // A second run of the same pipeline, --reuse: nothing billed, the same files.
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "b", "--reuse", "--json"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["succeeded"], 9, "{summary:#}");
    assert_eq!(summary["billed_credits"], 0, "{summary:#}");
    assert_eq!(env.sandbox.ledger(), before.ledger, "nothing billed");
    assert_eq!(env.sandbox.stats().paid_requests, before.paid_requests);
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    for t in db.tasks_of("b") {
        let from = t
            .reused_from
            .unwrap_or_else(|| panic!("{} not reused", t.name()));
        let original = db.task(from);
        assert_eq!(original.run_id, "a");
        assert_eq!((&original.item, &original.step), (&t.item, &t.step));
        assert_eq!(t.job_id, original.job_id);
        assert!(db.attempts_of(t.id).is_empty());
    }
    assert_eq!(file_digests(&dir.join("out/a")).len(), 10);
    let (a, b) = (
        file_digests(&dir.join("out/a")),
        file_digests(&dir.join("out/b")),
    );
    for (file, sha) in a.iter().filter(|(f, _)| f.ends_with(".png")) {
        assert_eq!(b.get(file), Some(sha), "{file}");
    }
    assert_files_agree(dir, &db, "b");
    // Reused tasks count for nothing against the budget: a run they cover whole fits any.
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "b2",
            "--reuse",
            "--max-credits",
            "1",
        ],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger(), before.ledger, "nothing billed");

    // `reuse: true` in the file does the same.
    write(dir, "p.yaml", &format!("reuse: true\n{original}"));
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "c", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["billed_credits"], 0);
    assert_eq!(env.sandbox.ledger(), before.ledger, "nothing billed");
    let db = Db::read_file(&state_path(dir)).await;
    assert!(db.tasks_of("c").iter().all(|t| t.reused_from.is_some()));
    assert_files_agree(dir, &db, "c");

    // One step changed: what is upstream of it is reused, the rest is paid.
    let changed = original.replace("desired_increase: 2", "desired_increase: 4");
    write(dir, "p.yaml", &changed);
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--dry-run", "--reuse"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stdout(&o).contains("reuse: 3 task(s) from earlier runs, saving 6 credits"),
        "{}",
        stdout(&o)
    );
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "d", "--reuse", "--json"],
    )
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    // 3 × (upscale 4× at 4 + remove_background at 5).
    assert_eq!(summary["billed_credits"], 27, "{summary:#}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 9 + 6, "{ledger:#?}");
    assert!(ledger[9..].iter().all(|e| e.operation != "erase"));
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    for t in db.tasks_of("d") {
        assert_eq!(t.reused_from.is_some(), t.step == "clean", "{t:?}");
    }
    let lines = assert_files_agree(dir, &db, "d");
    let run_dir = dir.join("out/d");
    for item in ["i00", "i01", "i02"] {
        assert_eq!(
            sha_of(&run_dir.join(item).join("clean.png")),
            a[&format!("{item}/clean.png")]
        );
        let clean = decode(&run_dir.join(item).join("clean.png")).dimensions();
        let big = decode(&run_dir.join(item).join("big.png")).dimensions();
        assert_eq!(big, (4 * clean.0, 4 * clean.1), "{item}");
    }
    let paid: Vec<Value> = lines.into_iter().filter(|l| l["step"] != "clean").collect();
    assert_manifest_credits_are_the_calls(&env, &paid);
}

/// A `once` step added to an interrupted run (`--allow-changes`): the batch's new task is
/// recorded and paid for once, and the items' chains finish.
#[tokio::test(flavor = "multi_thread")]
async fn a_once_step_added_under_allow_changes_is_recorded_and_run_once() {
    let env = start(sandbox_with_latency(30)).await;
    let dir = env.dir.path();
    let original = edit_chain(3, None);
    write(dir, "p.yaml", &original);
    interrupt_run_r(&env, 2).await;
    let changed = original.replace(
        "output_dir: out\n",
        "output_dir: out\npricing: { generation: 4 }\n",
    ) + "  - id: style\n    once: true\n    generate: { prompt: a style }\n";
    write(dir, "p.yaml", &changed);
    let o = Imgpipe::on(&env, &["resume", "r", "--allow-changes", "--json"])
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let summary = json_stdout(&o);
    assert_eq!(summary["status"], "succeeded", "{summary:#}");
    assert_eq!(summary["succeeded"], 10, "{summary:#}");
    assert_eq!(
        billed_for(&env, "generate"),
        1,
        "{:#?}",
        env.sandbox.ledger()
    );
    let db = Db::read_file(&state_path(dir)).await;
    assert_ledger_agrees(&env, &db);
    let style: Vec<_> = db
        .tasks_of("r")
        .into_iter()
        .filter(|t| t.step == "style")
        .collect();
    assert_eq!(style.len(), 1, "{style:#?}");
    assert_eq!(style[0].status, "succeeded");
}
