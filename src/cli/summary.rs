//! The end of a run: the manifest written, the run's status recorded, and a summary that
//! reconciles planned, billed and possibly billed credits with the balance the account shows.

use serde::Serialize;

use crate::cli::GlobalArgs;
use crate::cli::connect::Connection;
use crate::cli::preflight::OpenRun;
use crate::error::Error;
use crate::exec::{self, Outcome, Stop, manifest};
use crate::store::{RunStatus, Store, TaskStatus, Totals};

/// Failures named in the summary; the rest are counted.
const SHOWN_FAILURES: usize = 10;

#[derive(Serialize)]
pub struct Summary {
    run_id: String,
    pipeline: String,
    status: &'static str,
    pub output_dir: String,
    manifest: String,
    #[serde(flatten)]
    totals: Totals,
    balance_before: Option<i64>,
    balance_after: Option<i64>,
    failures: Vec<Failure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped: Option<String>,
}

#[derive(Serialize)]
pub struct Failure {
    task: String,
    reason: String,
}

/// What follows the end of a run.
pub struct After<'a> {
    /// The command that continues the run.
    pub resume: &'a str,
    /// Write the HTML report.
    pub report: bool,
}

/// Records how the run ended, prints the summary, writes the report when asked, and returns
/// the error its exit code needs.
pub async fn conclude(
    conn: &Connection,
    store: &Store,
    run: &OpenRun,
    config: &exec::Config,
    after: After<'_>,
    outcome: Outcome,
    global: &GlobalArgs,
) -> Result<(), Error> {
    let resume = after.resume;
    if let Err(e) = manifest::write(store, &run.id, &config.run_dir).await {
        tracing::error!("{e}");
    }
    let balance_after = match conn.client.account().await {
        Ok(account) => account
            .balance(global.balance_field.as_deref())
            .ok()
            .map(|f| f.value),
        Err(_) => None,
    }
    .or(outcome.last_balance);
    let totals = store.totals(&run.id).await?;
    let troubled = totals.failed > 0 || totals.download_failures > 0;
    let status = if outcome.interrupted {
        RunStatus::Interrupted
    } else if outcome.stop.is_some() {
        RunStatus::Stopped
    } else if troubled || totals.pending > 0 || totals.blocked > 0 {
        RunStatus::Failed
    } else {
        RunStatus::Succeeded
    };
    let stop_reason = outcome.stop.as_ref().map(Stop::describe);
    store
        .set_run_status(&run.id, status, stop_reason.as_deref(), balance_after)
        .await?;
    print_summary(store, &run.id, global).await?;
    if after.report {
        write_report(store, &run.id).await;
    }
    if outcome.interrupted {
        return Err(Error::Interrupted {
            detail: Some(format!(
                "everything done so far is recorded; continue with: {resume}"
            )),
        });
    }
    match outcome.stop {
        Some(Stop::Fatal(reason)) => Err(Error::Other(anyhow::anyhow!(
            "the run stopped: {reason}\nhint: continue with: {resume}"
        ))),
        Some(stop) => Err(Error::Refused {
            message: format!("the run stopped: {}", stop.describe()),
            hint: Some(format!(
                "raise the budget or top up the account, then continue with: {resume}"
            )),
        }),
        None if troubled || totals.blocked > 0 => Err(Error::TasksFailed {
            message: format!(
                "{} task(s) failed, {} blocked by them, {} download(s) failed; see the summary above\nhint: `{resume} --dry-run` lists what resuming would pay for again; `{resume}` does it",
                totals.failed, totals.blocked, totals.download_failures
            ),
        }),
        None => Ok(()),
    }
}

/// For a run that is already finished: its summary (and its report when asked), and nothing
/// spent.
pub async fn print_finished(
    store: &Store,
    run_id: &str,
    report: bool,
    global: &GlobalArgs,
) -> Result<(), Error> {
    tracing::info!("run {run_id} is already finished; nothing to do");
    print_summary(store, run_id, global).await?;
    if report {
        write_report(store, run_id).await;
    }
    Ok(())
}

/// Writes the report next to the manifest. The run's own exit code stands either way: a
/// report that cannot be written is said on stderr, with the command that tries again.
async fn write_report(store: &Store, run_id: &str) {
    match crate::cli::report::write(store, run_id, None).await {
        Ok(w) => tracing::info!(
            "report written to {} ({} images, {} new thumbnails)",
            w.path.display(),
            w.images,
            w.thumbnails_made
        ),
        Err(e) => tracing::error!(
            "cannot write the report: {e}\nhint: `imgpipe report {run_id}` tries again"
        ),
    }
}

async fn print_summary(store: &Store, run_id: &str, global: &GlobalArgs) -> Result<(), Error> {
    let summary = summary_of(store, run_id).await?;
    if global.json {
        let text = serde_json::to_string_pretty(&summary)
            .map_err(|e| Error::Other(anyhow::anyhow!("cannot print the summary: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render(&summary));
    }
    Ok(())
}

/// A run's summary, from the record alone.
pub async fn summary_of(store: &Store, run_id: &str) -> Result<Summary, Error> {
    let run = store
        .run(run_id)
        .await?
        .ok_or_else(|| Error::usage(format!("no run {run_id}"), None))?;
    let totals = store.totals(run_id).await?;
    let mut failures: Vec<Failure> = store
        .tasks_where(run_id, Some(TaskStatus::Failed))
        .await?
        .into_iter()
        .map(|t| Failure {
            task: format!("{}/{}[{}]", t.item, t.step, t.idx),
            reason: t.error.unwrap_or_default(),
        })
        .collect();
    store
        .each_output(run_id, true, |o| {
            failures.push(Failure {
                task: format!("{}/{}[{}] download", o.item, o.step, o.idx + o.k),
                reason: o.download_error.unwrap_or_default(),
            });
            Ok(())
        })
        .await?;
    let dir = run.dir();
    let summary = Summary {
        run_id: run_id.to_owned(),
        pipeline: run.pipeline_name,
        status: run.status.as_str(),
        manifest: dir.join(manifest::FILE).display().to_string(),
        output_dir: dir.display().to_string(),
        totals,
        balance_before: run.balance_before,
        balance_after: run.balance_after,
        failures,
        stopped: run.stop_reason,
    };
    Ok(summary)
}

pub fn render(s: &Summary) -> String {
    let t = &s.totals;
    let mut out = format!("run {}: {}\n", s.run_id, s.status);
    out += &format!(
        "  tasks     {} of {} succeeded, {} failed, {} blocked, {} pending\n",
        t.succeeded, t.tasks, t.failed, t.blocked, t.pending
    );
    out += &format!(
        "  credits   {} billed of {} planned; {} attempt(s) possibly billed without a result\n",
        t.billed_credits, t.planned_credits, t.ambiguous_attempts
    );
    let show = |b: Option<i64>| b.map_or_else(|| "unknown".to_owned(), |b| b.to_string());
    out += &format!(
        "  balance   {} before, {} after",
        show(s.balance_before),
        show(s.balance_after)
    );
    if let (Some(before), Some(after)) = (s.balance_before, s.balance_after) {
        out += &format!(" ({} spent as the account sees it)", before - after);
    }
    out += "\n";
    out += &format!(
        "  outputs   {} of {} downloaded to {}\n  manifest  {}\n",
        t.downloaded, t.outputs, s.output_dir, s.manifest
    );
    if let Some(reason) = &s.stopped {
        out += &format!("  stopped   {reason}\n");
    }
    for f in s.failures.iter().take(SHOWN_FAILURES) {
        out += &format!("  failed    {}: {}\n", f.task, f.reason);
    }
    if s.failures.len() > SHOWN_FAILURES {
        out += &format!(
            "  ...and {} more failures (imgpipe run --json shows all)\n",
            s.failures.len() - SHOWN_FAILURES
        );
    }
    out
}
