//! How the command line shows what the runner gives it: data on stdout (text, or JSON with
//! `--json`), diagnostics and progress on stderr.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::Arc;

use serde::Serialize;

use crate::error::Error;
use crate::exec::Observer;
use crate::pipeline::Report;
use crate::plan::document::PlanDocument;
use crate::plan::render;
use crate::report::summary::Summary;
use crate::runner::{Reviewed, View};
use crate::store::StepCounts;

use super::progress::Progress;
use crate::cli::stdio;

/// Problems printed on stderr before the rest are only counted.
const SHOWN_ERRORS: usize = 200;
/// Failures named in the summary; the rest are counted.
const SHOWN_FAILURES: usize = 10;
/// Tasks listed one by one by `resume --dry-run` before the rest are only counted.
const SHOWN_TASKS: usize = 50;

/// The terminal (or the pipe cron reads).
pub(super) struct Terminal {
    pub json: bool,
    pub quiet: bool,
    /// `imgpipe …` up to the run id, and the flags after it.
    /// The command that continues a run: with `true`, only the part it was asked for
    /// (`--items`, `--until`); with `false`, all of it.
    pub continue_with: ContinueWith,
}

/// Given a run id and whether only the part asked for is continued, the command to paste.
pub(super) type ContinueWith = Box<dyn Fn(&str, bool) -> String + Send + Sync>;

impl Terminal {
    /// For commands that never continue a run.
    pub(super) fn plain(json: bool) -> Terminal {
        Terminal {
            json,
            quiet: false,
            continue_with: Box::new(|id, _| format!("imgpipe resume {id}")),
        }
    }
}

impl View for Terminal {
    fn diagnostics(&self, report: &Report) {
        print_report(report);
    }

    fn plan(&self, doc: &PlanDocument) -> Result<(), Error> {
        if self.json {
            return print_json(doc);
        }
        stdio::print(&render::text(doc))?;
        Ok(())
    }

    fn review(&self, reviewed: &Reviewed<'_>) -> Result<(), Error> {
        print_review(reviewed, self.json)
    }

    fn finished(&self, run_id: &crate::run_id::RunId) -> Result<(), Error> {
        stdio::line(format_args!("run {run_id} is finished: nothing to pay for"))?;
        Ok(())
    }

    fn summary(&self, summary: &Summary) -> Result<(), Error> {
        if self.json {
            return print_json(summary);
        }
        stdio::print(&render_summary(summary))?;
        Ok(())
    }

    fn progress(
        &self,
        steps: &[(String, u64)],
        done: &[StepCounts],
        planned: u64,
    ) -> Arc<dyn Observer> {
        let live = std::io::stderr().is_terminal() && !self.quiet && !self.json;
        let progress = Arc::new(Progress::new(steps, planned, live));
        progress.resume_from(done);
        if !live {
            Progress::log_while_running(&progress);
        }
        progress
    }

    fn continue_command(&self, run_id: &crate::run_id::RunId) -> String {
        (self.continue_with)(run_id, true)
    }

    fn continue_rest(&self, run_id: &crate::run_id::RunId) -> String {
        (self.continue_with)(run_id, false)
    }
}

/// Prints a pipeline file's problems on stderr.
pub(super) fn print_report(report: &Report) {
    for d in report.errors.iter().take(SHOWN_ERRORS) {
        stdio::note(format_args!("error: {d}"));
    }
    if report.errors.len() > SHOWN_ERRORS {
        stdio::note(format_args!(
            "…and {} more errors (--json lists them all)",
            report.errors.len() - SHOWN_ERRORS
        ));
    }
    for d in &report.warnings {
        stdio::note(format_args!("warning: {d}"));
    }
}

pub(super) fn print_json(value: &impl Serialize) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::Other(anyhow::anyhow!("cannot print JSON: {e}")))?;
    stdio::line(&text)?;
    Ok(())
}

pub(super) fn render_summary(s: &Summary) -> String {
    let t = &s.totals;
    let mut out = format!("run {}: {}\n", s.run_id, s.status);
    if let Some(process) = &s.process {
        out += &format!("  process   {}\n", process.describe());
    }
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
    if let Some(report) = &s.report {
        out += &format!("  report    {report}\n");
    }
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
    if let Some(command) = &s.continue_with {
        out += &format!("  continue  {command}\n");
    }
    out
}

/// `resume --dry-run`: each task to pay for with its reason and credits, then the totals.
fn print_review(shown: &Reviewed<'_>, json: bool) -> Result<(), Error> {
    let by_reason = shown.by_reason(crate::resume::Reason::as_str);
    if json {
        return print_json(&shown.to_json());
    }
    print_to_pay(shown, &by_reason)?;
    print_free(shown)
}

/// The heading, then each task to pay for (the first [`SHOWN_TASKS`]), then the sums by
/// reason.
fn print_to_pay(
    shown: &Reviewed<'_>,
    by_reason: &BTreeMap<&str, (usize, u64)>,
) -> Result<(), Error> {
    let Reviewed {
        row, graph, review, ..
    } = shown;
    let name = |t: usize| graph.key(t).to_string();
    stdio::line(format_args!(
        "run {} ({}): {} task(s) to pay for, {}{}",
        row.id,
        row.status.as_str(),
        review.to_pay(),
        crate::money::credits(review.credits()),
        at_most(shown)
    ))?;
    for r in review.each_redo(graph).take(SHOWN_TASKS) {
        let detail = r
            .detail
            .as_deref()
            .map(|d| format!("  {d}"))
            .unwrap_or_default();
        stdio::line(format_args!(
            "  {:<40} {:<14} {:>14}{detail}",
            name(r.task),
            r.reason.as_str(),
            crate::money::credits(r.credits)
        ))?;
    }
    if review.to_pay() > SHOWN_TASKS {
        stdio::line(format_args!(
            "  ...and {} more (--json lists all)",
            review.to_pay() - SHOWN_TASKS
        ))?;
    }
    for (reason, (n, c)) in by_reason {
        stdio::line(format_args!(
            "  {reason}: {n} task(s), {}",
            crate::money::credits(*c)
        ))?;
    }
    Ok(())
}

/// The most that may be spent now, said after the price: the limit (the budget left and the
/// balance), or a cap covering the run when it has less left in its window.
fn at_most(shown: &Reviewed<'_>) -> String {
    let tightest = shown.caps.iter().min_by_key(|c| c.left);
    match (shown.limit, tightest) {
        (limit, Some(cap)) if limit.is_none_or(|l| cap.left < l) => format!(
            " (at most {} may be spent: cap {} has {} left until {})",
            cap.left, cap.name, cap.left, cap.window_end
        ),
        (Some(limit), _) => format!(" (at most {limit} may be spent)"),
        (None, _) => String::new(),
    }
}

/// What is kept, what comes free, and what is not paid for again.
fn print_free(shown: &Reviewed<'_>) -> Result<(), Error> {
    let Reviewed { graph, review, .. } = shown;
    let name = |t: usize| graph.key(t).to_string();
    stdio::line(format_args!(
        "kept: {} task(s) already done",
        review.kept.len()
    ))?;
    let free = [
        (
            review.recover.len(),
            "lost answer(s) to read back by job id",
        ),
        (
            review.refetch.len(),
            "file(s) missing or modified, to fetch again from their job",
        ),
        (review.reuse.len(), "task(s) reused from earlier runs"),
        (
            review.removed.len(),
            "recorded task(s) no longer in the pipeline",
        ),
    ];
    for (n, what) in free.iter().filter(|(n, _)| *n > 0) {
        stdio::line(format_args!("free: {n} {what}"))?;
    }
    for r in &review.left_failed {
        stdio::line(format_args!(
            "not paid again ({}): {} ({})",
            r.left_because(),
            name(r.task),
            crate::money::credits(r.credits)
        ))?;
    }
    Ok(())
}
