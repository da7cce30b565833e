//! `imgpipe runs` and `imgpipe status RUN_ID`: what the state database knows, without any
//! network call.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use crate::cli::GlobalArgs;
use crate::cli::run::{open_existing_store, store_path};
use crate::cli::summary::{self, Summary};
use crate::error::Error;
use crate::plan::document::rfc3339_ms as time;
use crate::store::{AmbiguousAttempt, StepCounts, Store};

#[derive(Debug, Args)]
pub struct RunsArgs {
    /// The state database [default: $XDG_STATE_HOME/imgpipe/state.db]
    #[arg(long, env = "IMGPIPE_STATE", value_name = "PATH")]
    pub state: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The run (`imgpipe runs` lists them)
    pub run_id: String,
    /// The state database [default: $XDG_STATE_HOME/imgpipe/state.db]
    #[arg(long, env = "IMGPIPE_STATE", value_name = "PATH")]
    pub state: Option<PathBuf>,
}

#[derive(Serialize)]
struct RunLine {
    id: String,
    pipeline: String,
    status: &'static str,
    credits_planned: u64,
    credits_billed: u64,
    possibly_billed: u64,
    started: String,
    finished: Option<String>,
}

pub async fn runs(args: &RunsArgs, global: &GlobalArgs) -> Result<(), Error> {
    let path = store_path(args.state.as_ref(), global.sandbox)?;
    if !path.exists() {
        if global.json {
            return print_json(&Vec::<RunLine>::new());
        }
        println!(
            "no runs yet: there is no state database at {}",
            path.display()
        );
        return Ok(());
    }
    let store = open_existing_store(args.state.as_ref(), global.sandbox).await?;
    let mut lines = Vec::new();
    for run in store.runs().await? {
        let totals = store.totals(&run.id).await?;
        lines.push(RunLine {
            status: run.status.as_str(),
            credits_planned: totals.planned_credits,
            credits_billed: totals.billed_credits,
            possibly_billed: totals.possibly_billed_credits,
            started: time(run.created_at),
            finished: run.finished_at.map(time),
            pipeline: run.pipeline_name,
            id: run.id,
        });
    }
    store.close().await;
    if global.json {
        return print_json(&lines);
    }
    if lines.is_empty() {
        println!("no runs yet in {}", store.path().display());
        return Ok(());
    }
    let width = lines.iter().map(|l| l.id.len()).max().unwrap_or(2).max(2);
    let pwidth = lines
        .iter()
        .map(|l| l.pipeline.len())
        .max()
        .unwrap_or(8)
        .max(8);
    println!(
        "{:<width$}  {:<pwidth$}  {:<11}  {:>8}  {:>8}  {:<20}  FINISHED",
        "ID", "PIPELINE", "STATUS", "PLANNED", "BILLED", "STARTED"
    );
    for l in &lines {
        let billed = if l.possibly_billed > 0 {
            format!("{}+{}?", l.credits_billed, l.possibly_billed)
        } else {
            l.credits_billed.to_string()
        };
        println!(
            "{:<width$}  {:<pwidth$}  {:<11}  {:>8}  {:>8}  {:<20}  {}",
            l.id,
            l.pipeline,
            l.status,
            l.credits_planned,
            billed,
            l.started,
            l.finished.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

#[derive(Serialize)]
struct Status {
    #[serde(flatten)]
    summary: Summary,
    steps: Vec<StepCounts>,
    ambiguous: Vec<AmbiguousAttempt>,
    /// Outputs moved under `_superseded/` (a task ran again, or a file was modified).
    superseded_files: u64,
}

pub async fn status(args: &StatusArgs, global: &GlobalArgs) -> Result<(), Error> {
    let store = open_existing_store(args.state.as_ref(), global.sandbox).await?;
    let result = status_of(&store, &args.run_id).await;
    store.close().await;
    let status = result?;
    if global.json {
        return print_json(&status);
    }
    print!("{}", summary::render(&status.summary));
    println!(
        "  {:<24} {:>6} {:>9} {:>6} {:>7} {:>7} {:>8} {:>7}",
        "step", "tasks", "succeeded", "failed", "blocked", "pending", "planned", "billed"
    );
    for s in &status.steps {
        println!(
            "  {:<24} {:>6} {:>9} {:>6} {:>7} {:>7} {:>8} {:>7}",
            s.step,
            s.tasks,
            s.succeeded,
            s.failed,
            s.blocked,
            s.pending,
            s.planned_credits,
            s.billed_credits
        );
    }
    for a in &status.ambiguous {
        println!(
            "  possibly billed: {} {} at {}{}: {}",
            a.task,
            a.endpoint,
            time(a.started_at),
            a.job_id
                .as_deref()
                .map(|j| format!(" (job {j})"))
                .unwrap_or_default(),
            a.error.as_deref().unwrap_or("no answer")
        );
    }
    if status.superseded_files > 0 {
        println!(
            "  {} earlier file(s) kept under {}/_superseded",
            status.superseded_files, status.summary.output_dir
        );
    }
    Ok(())
}

async fn status_of(store: &Store, run_id: &str) -> Result<Status, Error> {
    if store.run(run_id).await?.is_none() {
        return Err(no_such_run(store, run_id));
    }
    Ok(Status {
        summary: summary::summary_of(store, run_id).await?,
        steps: store.step_counts(run_id).await?,
        ambiguous: store.ambiguous_attempts(run_id).await?,
        superseded_files: store.superseded_count(run_id).await?,
    })
}

pub fn no_such_run(store: &Store, run_id: &str) -> Error {
    Error::usage(
        format!("there is no run {run_id:?} in {}", store.path().display()),
        Some(
            "`imgpipe runs` lists the runs; --state (or IMGPIPE_STATE) picks another database, and --sandbox the one of runs made with --sandbox",
        ),
    )
}

fn print_json(value: &impl Serialize) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::Other(anyhow::anyhow!("cannot print JSON: {e}")))?;
    println!("{text}");
    Ok(())
}
