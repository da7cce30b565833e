//! The page's cost and problem sections: where every credit went, and what needs a look.

use std::fmt::Write;

use crate::report::chart::{self, Marks};
use crate::report::html::{Page, esc, label, output_label};
use crate::report::model::{Model, Shown, StepCost};
use crate::store::{AmbiguousAttempt, ReportTask, TaskStatus};
use crate::time::rfc3339_ms as time;

impl Page<'_> {
    pub(super) fn costs(
        &mut self,
        steps: &[StepCost],
        total: &StepCost,
        removed: Option<&StepCost>,
    ) {
        self.w(
            "<section id=\"costs\"><h2>Where the credits went</h2><table class=\"costs\"><thead><tr>\
             <th>Step</th><th class=\"n\">Tasks</th><th class=\"n\">Succeeded</th><th class=\"n\">Failed</th>\
             <th class=\"n\">Blocked</th><th class=\"n\">Pending</th><th class=\"n\">Reused</th>\
             <th class=\"n\">Planned</th><th class=\"n\">Billed</th><th class=\"n\">Possibly billed</th>\
             </tr></thead><tbody>",
        );
        for s in steps.iter().chain(removed) {
            self.cost_row(s, "");
        }
        self.cost_row(total, "total");
        self.w("</tbody></table>");
        if removed.is_some() {
            self.w(
                "<p>Tasks removed from the pipeline by a resume with <code>--allow-changes</code> \
                 are on a line of their own: what they were billed counts in the total, their \
                 planned credits no longer do.</p>",
            );
        }
        let run = &self.model.run;
        if run.credits_planned != total.planned {
            let _ = write!(
                self.out,
                "<p>Planned when the run started: {} credits; the plan changed since (a resume with \
                 <code>--allow-changes</code>, or a price discovered).</p>",
                run.credits_planned
            );
        }
        if let (Some(before), Some(after)) = (run.balance_before, run.balance_after) {
            let moved = before - after;
            if moved != i64::try_from(total.billed).unwrap_or(i64::MAX) {
                let _ = write!(
                    self.out,
                    "<p class=\"note\">The balance moved by {moved} credits while this run was \
                     billed {}: other use of the account, or top-ups, fall in between.</p>",
                    total.billed
                );
            }
        }
        let m = self.model;
        let end = run.finished_at.unwrap_or(m.generated_at);
        let svg = chart::spend_svg(
            &m.spend,
            run.created_at,
            end,
            &Marks {
                planned: total.planned,
                budget: m.budget,
            },
        );
        let _ = writeln!(
            self.out,
            "<h3>Spend over time</h3>{svg}<p>Credits billed as the answers arrived{}.</p></section>",
            m.budget
                .map(|b| format!("; the budget is {b}"))
                .unwrap_or_default()
        );
    }

    fn cost_row(&mut self, s: &StepCost, id: &str) {
        let cell = |name: &str, v: u64, class: &str| {
            let ident = if id.is_empty() {
                String::new()
            } else {
                format!(" id=\"{id}-{name}\"")
            };
            format!("<td class=\"n{class}\"{ident}>{v}</td>")
        };
        let over = if s.billed > s.planned { " over" } else { "" };
        let risk = if s.at_risk > 0 { " risk" } else { "" };
        let _ = write!(
            self.out,
            "<tr class=\"{id}\" data-step=\"{}\"><td>{}</td>{}{}{}{}{}{}{}{}{}</tr>",
            esc(&s.step),
            esc(&s.step),
            cell("tasks", s.tasks, ""),
            cell("succeeded", s.succeeded, ""),
            cell("failed", s.failed, ""),
            cell("blocked", s.blocked, ""),
            cell("pending", s.pending, ""),
            cell("reused", s.reused, ""),
            cell("planned", s.planned, ""),
            cell("billed", s.billed, over),
            cell("at-risk", s.at_risk, risk),
        );
    }

    pub(super) fn problems(&mut self, problems: &Problems) {
        let m = self.model;
        self.w("<section id=\"problems\"><h2>Problems</h2>");
        if problems.count() == 0 {
            self.w("<p>None: no failed task, no call that may have been billed without a result, every output downloaded.</p></section>\n");
            return;
        }
        let Problems {
            failed,
            unanswered,
            downloads,
        } = problems;
        if !failed.is_empty() {
            self.w("<h3>Failed and blocked tasks</h3><table id=\"failures\"><thead><tr><th>Task</th><th>Status</th><th>Reason</th></tr></thead><tbody>");
            for t in failed.iter().copied() {
                let _ = write!(
                    self.out,
                    "<tr><td><a href=\"#t{}\">{}</a></td><td><span class=\"badge b-{2}\">{2}</span></td><td>{3}</td></tr>",
                    t.id,
                    esc(&label(t)),
                    t.status.as_str(),
                    esc(&m.reason(t))
                );
            }
            self.w("</tbody></table>");
        }
        if !unanswered.is_empty() {
            self.w("<h3>Calls that may have been billed</h3><p>Each was sent and got no complete answer: the service may have billed it.</p>\
                    <table id=\"possibly-billed\"><thead><tr><th>Task</th><th>Sent</th><th>Endpoint</th><th>Job</th><th class=\"n\">Credits</th><th>What then</th></tr></thead><tbody>");
            for a in unanswered.iter().copied() {
                let task = m.task(a.task_id);
                let then = match task.map(|t| t.status) {
                    Some(TaskStatus::Succeeded) => {
                        "the task succeeded with another call: it may have been paid twice"
                    }
                    Some(TaskStatus::Running | TaskStatus::Pending) => "not settled yet",
                    _ => "the task has no result: it may have been paid for nothing",
                };
                let _ = write!(
                    self.out,
                    "<tr><td><a href=\"#t{}\">{}</a></td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td><td class=\"n risk\">{}</td><td>{then}{}</td></tr>",
                    a.task_id,
                    esc(&a.task),
                    time(a.started_at),
                    esc(&a.endpoint),
                    esc(a.job_id.as_deref().unwrap_or("none")),
                    a.credits_at_risk,
                    a.error
                        .as_deref()
                        .map(|e| format!("<br><span class=\"why\">{}</span>", esc(e)))
                        .unwrap_or_default()
                );
            }
            self.w("</tbody></table>");
        }
        if !downloads.is_empty() {
            self.w("<h3>Downloads that failed</h3><p>These jobs are paid for: <code>imgpipe resume</code> fetches them again without a new call.</p>\
                    <table id=\"failed-downloads\"><thead><tr><th>Output</th><th>Job</th><th>Error</th></tr></thead><tbody>");
            for &(t, s) in downloads {
                let _ = write!(
                    self.out,
                    "<tr><td><a href=\"#o{}-{}\">{}</a></td><td><code>{}</code></td><td>{}</td></tr>",
                    t.id,
                    s.row.k,
                    esc(&output_label(t, s.row.k)),
                    esc(&s.row.job_id),
                    esc(s.row.download_error.as_deref().unwrap_or(""))
                );
            }
            self.w("</tbody></table>");
        }
        self.w("</section>\n");
    }
}

/// What needs a look, gathered once for the header's count and the section.
pub(super) struct Problems<'a> {
    /// Failed and blocked tasks.
    failed: Vec<&'a ReportTask>,
    /// Calls sent without a complete answer (not those still in flight).
    unanswered: Vec<&'a AmbiguousAttempt>,
    downloads: Vec<(&'a ReportTask, &'a Shown)>,
}

impl<'a> Problems<'a> {
    pub(super) fn of(m: &'a Model) -> Problems<'a> {
        Problems {
            failed: m
                .tasks
                .iter()
                .filter(|t| {
                    !t.removed && matches!(t.status, TaskStatus::Failed | TaskStatus::Blocked)
                })
                .collect(),
            unanswered: m.ambiguous.iter().filter(|a| !m.in_flight(a)).collect(),
            downloads: failed_downloads(m),
        }
    }

    pub(super) fn count(&self) -> usize {
        self.failed.len() + self.unanswered.len() + self.downloads.len()
    }
}

/// Outputs whose download failed, in task order.
fn failed_downloads(m: &Model) -> Vec<(&ReportTask, &Shown)> {
    let mut out: Vec<(&ReportTask, &Shown)> = m
        .outputs
        .iter()
        .flat_map(|(t, shown)| shown.iter().map(move |s| (&m.tasks[*t], s)))
        .filter(|(_, s)| s.row.path.is_none() && s.row.download_error.is_some())
        .collect();
    out.sort_by_key(|(t, s)| (t.id, s.row.k));
    out
}
