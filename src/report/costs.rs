//! The page's cost and problem sections: where every credit went, and what needs a look.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write;

use crate::report::chart::{self, Marks};
use crate::report::html::{Page, esc, label, output_label};
use crate::report::model::{Model, Shared, StepCost};
use crate::store::{AmbiguousAttempt, TaskStatus};
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
        let run = &self.shared.run;
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
        let m = self.shared;
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

    /// The problems section, its long lists copied in from the files they were gathered in.
    pub(super) fn problems(
        &mut self,
        problems: &mut Problems,
        out: &mut impl Write,
    ) -> std::io::Result<()> {
        let m = self.shared;
        self.w("<section id=\"problems\"><h2>Problems</h2>");
        if problems.count(m) == 0 {
            self.w("<p>None: no failed task, no call that may have been billed without a result, every output downloaded.</p></section>\n");
            return Ok(());
        }
        if problems.failed.rows > 0 {
            self.w("<h3>Failed and blocked tasks</h3><table id=\"failures\"><thead><tr><th>Task</th><th>Status</th><th>Reason</th></tr></thead><tbody>");
            out.write_all(self.take().as_bytes())?;
            problems.failed.copy_to(out)?;
            self.w("</tbody></table>");
        }
        let unanswered: Vec<&AmbiguousAttempt> =
            m.ambiguous.iter().filter(|a| !m.in_flight(a)).collect();
        if !unanswered.is_empty() {
            self.w("<h3>Calls that may have been billed</h3><p>Each was sent and got no complete answer: the service may have billed it.</p>\
                    <table id=\"possibly-billed\"><thead><tr><th>Task</th><th>Sent</th><th>Endpoint</th><th>Job</th><th class=\"n\">Credits</th><th>What then</th></tr></thead><tbody>");
            for a in unanswered {
                let seen = problems.asked.get(&a.task_id).copied();
                let then = match seen.map(|(status, _)| status) {
                    Some(TaskStatus::Succeeded) => {
                        "the task succeeded with another call: it may have been paid twice"
                    }
                    Some(TaskStatus::Running | TaskStatus::Pending) => "not settled yet",
                    _ => "the task has no result: it may have been paid for nothing",
                };
                let link = self.link(seen.map_or(1, |(_, page)| page), &format!("t{}", a.task_id));
                let _ = write_str(
                    &mut self.out,
                    format_args!(
                        "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td><td class=\"n risk\">{}</td><td>{then}{}</td></tr>",
                        esc(&link),
                        esc(&a.task),
                        time(a.started_at),
                        esc(&a.endpoint),
                        esc(a.job_id.as_deref().unwrap_or("none")),
                        a.credits_at_risk,
                        a.error
                            .as_deref()
                            .map(|e| format!("<br><span class=\"why\">{}</span>", esc(e)))
                            .unwrap_or_default()
                    ),
                );
            }
            self.w("</tbody></table>");
        }
        if problems.downloads.rows > 0 {
            self.w("<h3>Downloads that failed</h3><p>These jobs are paid for: <code>imgpipe resume</code> fetches them again without a new call.</p>\
                    <table id=\"failed-downloads\"><thead><tr><th>Output</th><th>Job</th><th>Error</th></tr></thead><tbody>");
            out.write_all(self.take().as_bytes())?;
            problems.downloads.copy_to(out)?;
            self.w("</tbody></table>");
        }
        self.w("</section>\n");
        Ok(())
    }

    /// Adds this page's failed tasks and downloads to `problems`, linked to where they are.
    pub(super) fn gather(&self, m: &Model, problems: &mut Problems) -> std::io::Result<()> {
        let link = |fragment: String| esc(&self.link(m.page, &fragment));
        for (i, t) in m.tasks.iter().enumerate().skip(m.borrowed) {
            if problems.asked.contains_key(&t.id) {
                problems.asked.insert(t.id, (t.status, m.page));
            }
            if !t.removed && matches!(t.status, TaskStatus::Failed | TaskStatus::Blocked) {
                problems.failed.row(format_args!(
                    "<tr><td><a href=\"{}\">{}</a></td><td><span class=\"badge b-{2}\">{2}</span></td><td>{3}</td></tr>",
                    link(format!("t{}", t.id)),
                    esc(&label(t)),
                    t.status.as_str(),
                    esc(&m.reason(t))
                ))?;
            }
            for s in m.outputs.get(&i).map_or(&[][..], Vec::as_slice) {
                if s.row.path.is_none() && s.row.download_error.is_some() {
                    problems.downloads.row(format_args!(
                        "<tr><td><a href=\"{}\">{}</a></td><td><code>{}</code></td><td>{}</td></tr>",
                        link(format!("o{}-{}", t.id, s.row.k)),
                        esc(&output_label(t, s.row.k)),
                        esc(&s.row.job_id),
                        esc(s.row.download_error.as_deref().unwrap_or(""))
                    ))?;
                }
            }
        }
        Ok(())
    }
}

fn write_str(out: &mut String, args: std::fmt::Arguments) -> std::fmt::Result {
    std::fmt::Write::write_fmt(out, args)
}

/// Rows of one problem table, kept in an unnamed temporary file while the pages are written:
/// a run where everything failed has as many rows as tasks.
pub(super) struct Rows {
    file: std::io::BufWriter<std::fs::File>,
    pub rows: usize,
}

impl Rows {
    fn new() -> std::io::Result<Rows> {
        Ok(Rows {
            file: std::io::BufWriter::new(tempfile::tempfile()?),
            rows: 0,
        })
    }

    fn row(&mut self, args: std::fmt::Arguments) -> std::io::Result<()> {
        self.rows += 1;
        self.file.write_fmt(args)
    }

    fn copy_to(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        use std::io::Seek;
        self.file.flush()?;
        let file = self.file.get_mut();
        file.seek(std::io::SeekFrom::Start(0))?;
        std::io::copy(file, out)?;
        Ok(())
    }
}

/// What needs a look, gathered page by page for the first page's section and header count.
pub(super) struct Problems {
    /// Failed and blocked tasks, in page order.
    failed: Rows,
    /// Outputs whose download failed, in page order.
    downloads: Rows,
    /// The status and page of each task with a call that may have been billed.
    asked: HashMap<i64, (TaskStatus, usize)>,
}

impl Problems {
    pub(super) fn new(m: &Shared) -> std::io::Result<Problems> {
        Ok(Problems {
            failed: Rows::new()?,
            downloads: Rows::new()?,
            asked: m
                .ambiguous
                .iter()
                .filter(|a| !m.in_flight(a))
                .map(|a| (a.task_id, (TaskStatus::Pending, 1)))
                .collect(),
        })
    }

    /// Calls without an answer are counted one per call, like the rows of their table.
    pub(super) fn count(&self, m: &Shared) -> usize {
        let unanswered = m.ambiguous.iter().filter(|a| !m.in_flight(a)).count();
        self.failed.rows + unanswered + self.downloads.rows
    }
}
