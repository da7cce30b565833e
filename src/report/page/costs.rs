//! The page's cost and problem sections: where every credit went, and what needs a look.

use std::collections::HashMap;
use std::io::Write;

use maud::{Markup, html};

use crate::report::page::chart::{self, Marks};
use crate::report::page::html::{Page, label, output_label};
use crate::report::page::model::{Model, Shared, StepCost};
use crate::store::{AmbiguousAttempt, TaskId, TaskStatus};
use crate::time::rfc3339_ms as time;

impl Page<'_> {
    pub(super) fn costs(
        &mut self,
        steps: &[StepCost],
        total: &StepCost,
        removed: Option<&StepCost>,
    ) {
        let run = &self.shared.run;
        let m = self.shared;
        let end = run.finished_at.unwrap_or(m.generated_at);
        let moved = match (run.balance_before, run.balance_after) {
            (Some(before), Some(after))
                if before - after != i64::try_from(total.billed).unwrap_or(i64::MAX) =>
            {
                Some(before - after)
            }
            _ => None,
        };
        let marks = Marks {
            planned: total.planned,
            budget: m.budget,
        };
        let section = html! {
            section #costs {
                h2 { "Where the credits went" }
                table.costs {
                    thead {
                        tr {
                            th { "Step" }
                            @for name in ["Tasks", "Succeeded", "Failed", "Blocked", "Pending", "Reused", "Planned", "Billed", "Possibly billed"] {
                                th.n { (name) }
                            }
                        }
                    }
                    tbody {
                        @for s in steps.iter().chain(removed) { (cost_row(s, "")) }
                        (cost_row(total, "total"))
                    }
                }
                @if removed.is_some() {
                    p {
                        "Tasks removed from the pipeline by a resume with " code { "--allow-changes" }
                        " are on a line of their own: what they were billed counts in the total, \
                         their planned credits no longer do."
                    }
                }
                @if planned_at_start(run) != total.planned {
                    p {
                        "Planned when the run started: " (planned_at_start(run)) " credits; the plan \
                         changed since (a resume with " code { "--allow-changes" } ", or a price discovered)."
                    }
                }
                @if let Some(moved) = moved {
                    p.note {
                        "The balance moved by " (moved) " credits while this run was billed "
                        (total.billed) ": other use of the account, or top-ups, fall in between."
                    }
                }
                h3 { "Spend over time" }
                (chart::spend_svg(&m.spend, run.created_at, end, &marks))
                p {
                    "Credits billed as the answers arrived"
                    @if let Some(b) = m.budget { "; the budget is " (b) }
                    "."
                }
            }
            "\n"
        };
        self.put(section);
    }

    /// The problems section, its long lists copied in from the files they were gathered in.
    pub(super) fn problems(
        &mut self,
        problems: &mut Problems,
        out: &mut impl Write,
    ) -> std::io::Result<()> {
        let m = self.shared;
        self.raw("<section id=\"problems\">");
        self.put(html! { h2 { "Problems" } });
        if problems.count(m) == 0 {
            self.put(html! {
                p { "None: no failed task, no call that may have been billed without a result, every output downloaded." }
            });
            self.raw("</section>\n");
            return Ok(());
        }
        if problems.failed.rows > 0 {
            self.put(html! { h3 { "Failed and blocked tasks" } });
            self.raw("<table id=\"failures\"><thead><tr><th>Task</th><th>Status</th><th>Reason</th></tr></thead><tbody>");
            out.write_all(self.take().as_bytes())?;
            problems.failed.copy_to(out)?;
            self.raw("</tbody></table>");
        }
        let unanswered: Vec<&AmbiguousAttempt> =
            m.ambiguous.iter().filter(|a| !m.in_flight(a)).collect();
        if !unanswered.is_empty() {
            let rows: Vec<Markup> = unanswered
                .iter()
                .map(|a| self.unanswered(a, problems))
                .collect();
            self.put(html! {
                h3 { "Calls that may have been billed" }
                p { "Each was sent and got no complete answer: the service may have billed it." }
                table #possibly-billed {
                    thead { tr {
                        th { "Task" } th { "Sent" } th { "Endpoint" } th { "Job" } th.n { "Credits" } th { "What then" }
                    } }
                    tbody { @for row in rows { (row) } }
                }
            });
        }
        if problems.downloads.rows > 0 {
            self.put(html! {
                h3 { "Downloads that failed" }
                p { "These jobs are paid for: " code { "imgpipe resume" } " fetches them again without a new call." }
            });
            self.raw("<table id=\"failed-downloads\"><thead><tr><th>Output</th><th>Job</th><th>Error</th></tr></thead><tbody>");
            out.write_all(self.take().as_bytes())?;
            problems.downloads.copy_to(out)?;
            self.raw("</tbody></table>");
        }
        self.raw("</section>\n");
        Ok(())
    }

    /// A row of the table of calls that may have been billed.
    fn unanswered(&self, a: &AmbiguousAttempt, problems: &Problems) -> Markup {
        let seen = problems.asked.get(&a.task_id).copied();
        let then = match seen.map(|(status, _)| status) {
            Some(TaskStatus::Succeeded) => {
                "the task succeeded with another call: it may have been paid twice"
            }
            Some(TaskStatus::Running | TaskStatus::Pending) => "not settled yet",
            _ => "the task has no result: it may have been paid for nothing",
        };
        let link = self.link(seen.map_or(1, |(_, page)| page), &format!("t{}", a.task_id));
        html! {
            tr {
                td { a href=(link) { (a.task) } }
                td { (time(a.started_at)) }
                td { code { (a.endpoint) } }
                td { code { (a.job_id.as_deref().unwrap_or("none")) } }
                td.n.risk { (a.credits_at_risk) }
                td { (then) @if let Some(e) = &a.error { br; span.why { (e) } } }
            }
        }
    }

    /// Adds this page's failed tasks and downloads to `problems`, linked to where they are.
    pub(super) fn gather(&self, m: &Model, problems: &mut Problems) -> std::io::Result<()> {
        let link = |fragment: String| self.link(m.page, &fragment);
        for (i, t) in m.tasks.iter().enumerate().skip(m.borrowed) {
            if problems.asked.contains_key(&t.id) {
                problems.asked.insert(t.id, (t.status, m.page));
            }
            if !t.removed && matches!(t.status, TaskStatus::Failed | TaskStatus::Blocked) {
                let status = t.status.as_str();
                problems.failed.row(html! {
                    tr {
                        td { a href=(link(format!("t{}", t.id))) { (label(t)) } }
                        td { span.badge.(format!("b-{status}")) { (status) } }
                        td { (m.reason(t)) }
                    }
                })?;
            }
            for s in m.outputs.get(&i).map_or(&[][..], Vec::as_slice) {
                if s.row.place.is_none() && s.row.download_error.is_some() {
                    problems.downloads.row(html! {
                        tr {
                            td { a href=(link(format!("o{}-{}", t.id, s.row.k))) { (output_label(t, s.row.k)) } }
                            td { code { (s.row.job_id) } }
                            td { (s.row.download_error.as_deref().unwrap_or("")) }
                        }
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// One line of the cost table; the total's cells have ids (`total-billed`, …).
fn cost_row(s: &StepCost, id: &str) -> Markup {
    let cells = [
        ("tasks", s.tasks, ""),
        ("succeeded", s.succeeded, ""),
        ("failed", s.failed, ""),
        ("blocked", s.blocked, ""),
        ("pending", s.pending, ""),
        ("reused", s.reused, ""),
        ("planned", s.planned, ""),
        (
            "billed",
            s.billed,
            if s.billed > s.planned { " over" } else { "" },
        ),
        (
            "at-risk",
            s.at_risk,
            if s.at_risk > 0 { " risk" } else { "" },
        ),
    ];
    html! {
        tr class=(id) data-step=(s.step) {
            td { (s.step) }
            @for (name, v, class) in cells {
                td class={ "n" (class) } id=[(!id.is_empty()).then(|| format!("{id}-{name}"))] { (v) }
            }
        }
    }
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

    fn row(&mut self, row: Markup) -> std::io::Result<()> {
        self.rows += 1;
        self.file.write_all(row.into_string().as_bytes())
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
    asked: HashMap<TaskId, (TaskStatus, usize)>,
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

/// What the run's plan priced when it started, for the whole file: a run asked for a part
/// (`--items`, `--until`) records the part's price, and its plan what the whole costs.
fn planned_at_start(run: &crate::store::Run) -> u64 {
    crate::money::planned::PlanFigures::of(&run.plan)
        .and_then(|p| p.whole_credits())
        .unwrap_or(run.credits_planned)
}
