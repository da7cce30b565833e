//! One task on the page: each output's picture (or the task's placeholder), its caption with
//! the request the task sent, the box that picks it for `imgpipe reroll`, and the earlier
//! versions of the output that a reroll or a resume set aside.

use crate::run_id::RunId;
use maud::{Markup, html};

use crate::report::page::html::{Page, label, label_in_item, output_label, output_label_in_item};
use crate::report::page::links::{file_of, href};
use crate::report::page::model::{Earlier, Shown};
use crate::store::{Action, Outcome, ReportTask, ShownVerdict, TaskRequest};
use crate::time::rfc3339_ms as time;

impl Page<'_> {
    pub(super) fn placeholder(
        &self,
        task: &ReportTask,
        others: &Markup,
        earlier: &[Earlier],
    ) -> Markup {
        let status = task.status.as_str();
        html! {
            figure {
                div.thumb.none {
                    span.badge.(format!("b-{status}")) { (status) }
                    span.why { (self.shared.reason(task)) }
                }
                figcaption {
                    b { (label_in_item(task)) } " · " (task.operation) br;
                    "planned " (task.planned_credits) " cr"
                    @if task.credits_billed > 0 { ", billed " (task.credits_billed) }
                    @if let Some(job) = &task.job_id { code title={ "job " (job) } { (job) } }
                    (others)
                    @if let Some(request) = &task.request { (asked(request)) }
                }
                (self.earlier(task, earlier))
            }
        }
    }

    /// One output's figure: its picture, its caption with its checks' verdicts, and its
    /// earlier versions.
    pub(super) fn figure(
        &mut self,
        task: &ReportTask,
        (s, verdicts): (&Shown, &[ShownVerdict]),
        outputs: usize,
        others: &Markup,
        earlier: &[Earlier],
    ) -> Markup {
        let row = &s.row;
        let p = &s.preview;
        let picture = self.picture(task, s);
        let size = size_text(p.size);
        let credits = credits_text(task, outputs);
        let mine: Vec<&Earlier> = earlier.iter().filter(|e| e.row.k == row.k).collect();
        html! {
            figure id={ "o" (task.id) "-" (row.k) } {
                (picture)
                figcaption {
                    (pick(task))
                    b { (output_label_in_item(task, row.k)) } " · " (task.operation) br;
                    (size) " · " (credits)
                    @if task.attempts > 1 { " · " (task.attempts) " calls" }
                    br;
                    code title={ "job " (row.job_id) } { (row.job_id) }
                    @if let (Some(note), Some(_)) = (&p.note, &p.thumb) { br; span.note { (note) } }
                    (others)
                    @if let Some(request) = &task.request { (asked(request)) }
                    (checked(verdicts))
                }
                (self.earlier(task, mine))
            }
        }
    }

    /// An output's picture: its thumbnail linked to the full-size file, the file alone when
    /// it has no thumbnail, or why there is no file.
    fn picture(&mut self, task: &ReportTask, s: &Shown) -> Markup {
        let row = &s.row;
        let p = &s.preview;
        let full = row.place.as_ref().map(|f| href(self.dir, &file_of(f)));
        match (&p.thumb, &full) {
            (Some(thumb), Some(full)) => {
                let (tw, th) = p.thumb_size.unwrap_or((160, 160));
                // The first few load with the page (not `loading="lazy"`: Chromium would hold
                // back those below the fold); the script gives the others theirs.
                let eager = self.eager > 0;
                self.eager = self.eager.saturating_sub(1);
                let thumb = href(self.dir, thumb);
                let alt = output_label(task, row.k);
                html! {
                    a class={ "thumb" @if p.alpha { " alpha" } } href=(full) target="_blank" title="open the full-size image" {
                        @if eager {
                            img src=(thumb) width=(tw) height=(th) decoding="async" alt=(alt)
                                onerror="this.parentNode.classList.add('gone')";
                        } @else {
                            img loading="lazy" data-src=(thumb) width=(tw) height=(th) decoding="async" alt=(alt)
                                onerror="this.parentNode.classList.add('gone')";
                        }
                    }
                }
            }
            (None, Some(full)) => html! {
                a.thumb.none href=(full) { span.why { (p.note.as_deref().unwrap_or("no preview")) } }
            },
            (_, None) => {
                let Missing { class, badge, why } = missing(
                    row.download_error.as_deref(),
                    self.shared.in_progress(),
                    &self.shared.run.id,
                );
                html! {
                    div.thumb.none { span.badge.(format!("b-{class}")) { (badge) } span.why { (why) } }
                }
            }
        }
    }

    /// The earlier versions of an output, oldest first, each with its thumbnail (made like
    /// the outputs') linked to its file under `_superseded/`.
    fn earlier<'e>(
        &self,
        task: &ReportTask,
        earlier: impl IntoIterator<Item = &'e Earlier>,
    ) -> Markup {
        let earlier: Vec<&Earlier> = earlier.into_iter().collect();
        if earlier.is_empty() {
            return html! {};
        }
        html! {
            details.earlier {
                summary { (earlier.len()) " earlier version" @if earlier.len() > 1 { "s" } }
                @for e in earlier {
                    @let full = e.row.place.as_ref().map(|f| href(self.dir, &file_of(f)));
                    div.was {
                        @match (&e.preview.thumb, &full) {
                            (Some(thumb), Some(full)) => {
                                @let (tw, th) = e.preview.thumb_size.unwrap_or((160, 160));
                                a.thumb.small.alpha[e.preview.alpha] href=(full) target="_blank" {
                                    img src=(href(self.dir, thumb)) loading="lazy" width=(tw) height=(th)
                                        alt={ "earlier " (output_label(task, e.row.k)) };
                                }
                            }
                            (None, Some(full)) => a href=(full) target="_blank" { "the file" },
                            (_, None) => {
                                @if let Some(place) = &e.row.place { code { (place) } } @else { "file not kept" }
                            }
                        }
                        br;
                        (e.row.reason) " · " (time(e.row.superseded_at)) br;
                        code title={ "job " (e.row.job_id) } { (e.row.job_id) }
                    }
                }
            }
        }
    }
}

/// Why an output has no file, as its badge says it.
#[derive(Debug, PartialEq, Eq)]
struct Missing {
    class: &'static str,
    badge: &'static str,
    why: String,
}

/// Why an output of run `run_id` has no file: its download failed (`download_error`), is on
/// its way (the run is `in_progress`), or never happened before the run ended.
fn missing(download_error: Option<&str>, in_progress: bool, run_id: &RunId) -> Missing {
    let (class, badge, why) = match download_error {
        Some(e) => ("failed", "not downloaded", e.to_owned()),
        None if in_progress => (
            "pending",
            "downloading",
            "the job succeeded; its file is on its way".to_owned(),
        ),
        None => (
            "failed",
            "not downloaded",
            format!(
                "the run ended before its download; `imgpipe resume {run_id}` fetches it without a new call"
            ),
        ),
    };
    Missing { class, badge, why }
}

/// An image's size as the caption says it.
fn size_text(size: Option<(u32, u32)>) -> String {
    size.map_or_else(|| "size unknown".to_owned(), |(w, h)| format!("{w}×{h}"))
}

/// What a task's outputs cost, as each one's caption says it: a task reused from another run
/// cost nothing, and the credits of a task of several outputs are for them all.
fn credits_text(task: &ReportTask, outputs: usize) -> String {
    if let Some(from) = &task.reused_from_run {
        format!("0 cr, reused from run {from}")
    } else if outputs > 1 {
        format!("{} cr for {outputs}", task.credits_billed)
    } else {
        format!("{} cr", task.credits_billed)
    }
}

/// The box that picks an output's task for the reroll command: every output of a task (a
/// generation's several images) carries the same task.
fn pick(task: &ReportTask) -> Markup {
    html! {
        label.pick title="Pick this task for imgpipe reroll: it and everything downstream of it are made again" {
            input.pick type="checkbox" value=(label(task));
            "reroll"
        }
    }
}

/// What an output's checks said: one badge when all passed; else a badge and the reason for
/// each check that failed it or could not judge it.
fn checked(verdicts: &[ShownVerdict]) -> Markup {
    if verdicts.is_empty() {
        return html! {};
    }
    let troubles: Vec<&ShownVerdict> = verdicts
        .iter()
        .filter(|v| v.verdict != Outcome::Passed)
        .collect();
    html! {
        div.checks {
            @if troubles.is_empty() {
                span.badge.b-succeeded title="every check passed" { "checks passed" }
            }
            @for v in troubles {
                @let (class, badge) = verdict_badge(v);
                span.badge.(class) { (badge) } " "
                span.why { (v.check) ": " (v.reason) }
                br;
            }
        }
    }
}

/// A verdict's badge: its class and its word.
fn verdict_badge(v: &ShownVerdict) -> (&'static str, &'static str) {
    match (v.verdict, v.acted) {
        (Outcome::NotChecked, _) => ("b-pending", "not checked"),
        (_, Some(Action::Failed)) => ("b-failed", "check failed"),
        (_, Some(Action::Rerolled)) => ("b-failed", "rerolled"),
        _ => ("b-failed", "flagged"),
    }
}

/// What the task asked of the service, as recorded: each field it has.
fn asked(r: &TaskRequest) -> Markup {
    html! {
        dl.req {
            @for (name, value) in r.shown() {
                div { dt { (name) } dd title=(value) { (value) } }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TaskStatus;

    fn task(billed: u64, reused_from_run: Option<&str>) -> ReportTask {
        ReportTask {
            id: crate::store::TaskId::new(1).unwrap(),
            item: "a".to_owned(),
            step: "s".to_owned(),
            idx: 0,
            operation: "generate".to_owned(),
            inputs: Vec::new(),
            status: TaskStatus::Succeeded,
            planned_credits: billed,
            credits_billed: billed,
            job_id: None,
            error: None,
            removed: false,
            reused_from_run: reused_from_run.map(str::to_owned),
            attempts: 1,
            request: None,
        }
    }

    #[test]
    fn credits_say_reuse_first_then_how_many_outputs_share_them() {
        assert_eq!(credits_text(&task(4, None), 1), "4 cr");
        assert_eq!(credits_text(&task(4, None), 3), "4 cr for 3");
        assert_eq!(
            credits_text(&task(4, Some("r0")), 3),
            "0 cr, reused from run r0"
        );
    }

    #[test]
    fn size_is_width_by_height_or_unknown() {
        assert_eq!(size_text(Some((640, 480))), "640×480");
        assert_eq!(size_text(None), "size unknown");
    }

    #[test]
    fn a_missing_file_is_a_failed_download_then_one_on_its_way_then_one_never_made() {
        let failed = missing(Some("disk full"), true, &crate::run_id::RunId::from("r1"));
        assert_eq!(
            (failed.class, failed.badge, failed.why.as_str()),
            ("failed", "not downloaded", "disk full")
        );
        let going = missing(None, true, &crate::run_id::RunId::from("r1"));
        assert_eq!((going.class, going.badge), ("pending", "downloading"));
        let ended = missing(None, false, &crate::run_id::RunId::from("r1"));
        assert_eq!(ended.class, "failed");
        assert!(ended.why.contains("`imgpipe resume r1` fetches it"));
    }
}
