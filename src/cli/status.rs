//! `imgpipe status RUN_ID`: one run as the state database knows it, without any network call.

use crate::run_id::RunId;
use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::args::StateArgs;
use crate::cli::stdio;
use crate::cli::view::{print_json, render_summary};
use crate::error::Error;
use crate::report::summary::{Checks, Status, status_of};
use crate::runner::state::close;
use crate::store::{Outcome, Store};
use crate::time::rfc3339_ms as time;

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The run (`imgpipe runs` lists them)
    pub run_id: RunId,
    #[command(flatten)]
    pub state: StateArgs,
    /// Look in the database of runs made with --sandbox
    #[arg(long)]
    pub sandbox: bool,
}

pub(super) async fn run(args: &StatusArgs, global: &GlobalArgs) -> Result<(), Error> {
    let store = args.state.location(args.sandbox)?.open_existing().await?;
    let result = read(&store, args).await;
    let status = close(store, result).await?;
    if global.json {
        return print_json(&status);
    }
    stdio::print(&render_summary(&status.summary))?;
    stdio::line(format_args!(
        "  {:<24} {:>6} {:>9} {:>6} {:>7} {:>7} {:>8} {:>7}",
        "step", "tasks", "succeeded", "failed", "blocked", "pending", "planned", "billed"
    ))?;
    for s in &status.steps {
        stdio::line(format_args!(
            "  {:<24} {:>6} {:>9} {:>6} {:>7} {:>7} {:>8} {:>7}",
            s.step,
            s.tasks,
            s.succeeded,
            s.failed,
            s.blocked,
            s.pending,
            s.planned_credits,
            s.billed_credits
        ))?;
    }
    for a in &status.ambiguous {
        stdio::line(format_args!(
            "  possibly billed: {} {} at {}{}: {}",
            a.task,
            a.endpoint,
            time(a.started_at),
            a.job_id
                .as_deref()
                .map(|j| format!(" (job {j})"))
                .unwrap_or_default(),
            a.error.as_deref().unwrap_or("no answer")
        ))?;
    }
    for d in &status.rate_drawers {
        stdio::line(format_args!(
            "  rate: {} on {} (pid {}) draws from account {}'s {} a second, {} calls so far, seen {}",
            d.run_id,
            d.host,
            d.pid,
            d.account,
            d.per_second,
            d.drawn,
            time(d.last_seen)
        ))?;
    }
    if let Some(checks) = &status.checks {
        print_checks(checks)?;
    }
    if status.superseded_files > 0 {
        stdio::line(format_args!(
            "  {} earlier file(s) kept under {}/{}",
            status.superseded_files,
            status.summary.output_dir,
            crate::place::layout::SUPERSEDED
        ))?;
    }
    Ok(())
}

/// The checks' counts, then each listed flagged output with what its checks said.
fn print_checks(checks: &Checks) -> Result<(), Error> {
    let c = &checks.counts;
    stdio::line(format_args!(
        "  checks: {} passed, {} failed, {} not checked; {} reroll(s) for {} credits; {} output(s) flagged",
        c.passed, c.failed, c.not_checked, c.rerolls, c.reroll_credits, c.flagged
    ))?;
    for o in &checks.flagged_outputs {
        for v in o.checks.iter().filter(|v| v.verdict != Outcome::Passed) {
            let said = match v.verdict {
                Outcome::NotChecked => "not checked",
                _ => "failed",
            };
            stdio::line(format_args!(
                "  flagged: {} output {}: {} {said}: {}",
                o.task, o.output, v.check, v.reason
            ))?;
        }
    }
    if checks.more_flagged > 0 {
        stdio::line(format_args!(
            "  and {} more flagged output(s): the desk's \"failed a check\" filter lists them all",
            checks.more_flagged
        ))?;
    }
    Ok(())
}

async fn read(store: &Store, args: &StatusArgs) -> Result<Status, Error> {
    let (run, observed) = args
        .state
        .observed_run(store, &args.run_id, args.sandbox)
        .await?;
    let mut status = status_of(store, run).await?;
    status.summary.process = observed.process;
    status.summary.continue_with = observed.continue_with;
    Ok(status)
}
