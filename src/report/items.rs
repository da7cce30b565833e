//! The page's items: each item's lineage as rows of thumbnails in pipeline order, a task after
//! the output it reads, with its placeholder when it has no image to show.

use std::path::Path;

use maud::{Markup, html};

use crate::place::layout;
use crate::report::html::{EAGER, Page, label_in_item, output_label, output_label_in_item};
use crate::report::lineage::Input;
use crate::report::links::href;
use crate::report::model::{Model, Shown};
use crate::store::{ReportTask, TaskStatus};

impl Page<'_> {
    /// The page's items, with the pager above and below them.
    pub(super) fn items(&mut self, m: &Model) {
        let previews = m.images().filter(|s| s.preview.thumb.is_some()).count();
        self.raw("<section id=\"items\">");
        let top = html! {
            h2 { "Items" }
            p {
                "Each item's images from step to step: click one for the full-size file. \
                 A checkerboard shows through transparent parts."
            }
            @if previews > EAGER {
                noscript {
                    p.banner {
                        "Thumbnails after the first " (EAGER) " load with JavaScript on; \
                         each one's link to the full-size file works either way."
                    }
                }
            }
            (self.pager("pages"))
        };
        self.put(top);
        for chain in &m.lineage.chains {
            let tasks = &chain.tasks;
            // The batch's chain is drawn on the first page; later ones only link to it.
            if tasks.iter().all(|&t| t < m.borrowed) {
                continue;
            }
            let count = |s: TaskStatus| tasks.iter().filter(|&&t| m.tasks[t].status == s).count();
            let billed: u64 = tasks.iter().map(|&t| m.tasks[t].credits_billed).sum();
            let roots: Vec<Markup> = chain.roots.iter().map(|&r| self.task(m, r)).collect();
            let item = html! {
                section.item id={ "item-" (chain.id) } {
                    h3 {
                        @if chain.id == layout::BATCH {
                            "Batch steps (run once for all items)"
                        } @else {
                            (chain.id)
                        }
                        " " span.badge { (billed) " cr" }
                        @for status in [TaskStatus::Failed, TaskStatus::Blocked, TaskStatus::Running, TaskStatus::Pending] {
                            @let n = count(status);
                            @if n > 0 {
                                span.badge.(format!("b-{}", status.as_str())) { (n) " " (status.as_str()) }
                            }
                        }
                    }
                    div.lineage { @for root in roots { (root) } }
                }
                "\n"
            };
            self.put(item);
        }
        let end = html! { (self.pager("pages-end")) };
        self.put(end);
        self.raw("</section>\n");
    }

    fn task(&mut self, m: &Model, t: usize) -> Markup {
        let task = &m.tasks[t];
        let shown: &[Shown] = m.outputs.get(&t).map_or(&[], Vec::as_slice);
        let others = self.other_inputs(m, t);
        let mut slots: Vec<(Markup, Vec<Markup>)> = Vec::new();
        if shown.is_empty() {
            let kids = self.kids(m, m.lineage.children(t, None));
            slots.push((self.placeholder(task, &others), kids));
        }
        for s in shown {
            let figure = self.figure(task, s, shown.len(), &others);
            let kids = self.kids(m, m.lineage.children(t, Some(s.row.k)));
            slots.push((figure, kids));
        }
        html! {
            div class={ "task st-" (task.status.as_str()) @if shown.len() > 1 { " fan" } } id={ "t" (task.id) } {
                @for (figure, kids) in slots {
                    div.slot {
                        (figure)
                        @if !kids.is_empty() {
                            span.arrow { "→" }
                            div.kids { @for kid in kids { (kid) } }
                        }
                    }
                }
            }
        }
    }

    fn kids(&mut self, m: &Model, kids: Vec<usize>) -> Vec<Markup> {
        kids.into_iter().map(|kid| self.task(m, kid)).collect()
    }

    fn placeholder(&self, task: &ReportTask, others: &Markup) -> Markup {
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
                }
            }
        }
    }

    fn figure(&mut self, task: &ReportTask, s: &Shown, outputs: usize, others: &Markup) -> Markup {
        let row = &s.row;
        let p = &s.preview;
        let full = row.path.as_deref().map(|f| href(self.dir, Path::new(f)));
        let picture = match (&p.thumb, &full) {
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
                let (class, badge, why) = match &row.download_error {
                    Some(e) => ("failed", "not downloaded", e.clone()),
                    None if self.shared.in_progress() => (
                        "pending",
                        "downloading",
                        "the job succeeded; its file is on its way".to_owned(),
                    ),
                    None => (
                        "failed",
                        "not downloaded",
                        format!(
                            "the run ended before its download; `imgpipe resume {}` fetches it without a new call",
                            self.shared.run.id
                        ),
                    ),
                };
                html! {
                    div.thumb.none { span.badge.(format!("b-{class}")) { (badge) } span.why { (why) } }
                }
            }
        };
        let size = p
            .size
            .map_or_else(|| "size unknown".to_owned(), |(w, h)| format!("{w}×{h}"));
        let credits = if let Some(from) = &task.reused_from_run {
            format!("0 cr, reused from run {from}")
        } else if outputs > 1 {
            format!("{} cr for {outputs}", task.credits_billed)
        } else {
            format!("{} cr", task.credits_billed)
        };
        html! {
            figure id={ "o" (task.id) "-" (row.k) } {
                (picture)
                figcaption {
                    b { (output_label_in_item(task, row.k)) } " · " (task.operation) br;
                    (size) " · " (credits)
                    @if task.attempts > 1 { " · " (task.attempts) " calls" }
                    br;
                    code title={ "job " (row.job_id) } { (row.job_id) }
                    @if let (Some(note), Some(_)) = (&p.note, &p.thumb) { br; span.note { (note) } }
                    (others)
                }
            }
        }
    }

    /// The inputs a task reads besides the output it is drawn after.
    fn other_inputs(&self, m: &Model, t: usize) -> Markup {
        let inputs = m.lineage.other_inputs(t, &m.tasks);
        if inputs.is_empty() {
            return html! {};
        }
        // A task drawn after none of its inputs (the first of its chain) lists them all.
        let root = inputs.len() == m.tasks[t].inputs.len();
        html! {
            br;
            @if root { "reads " } @else { "also reads " }
            @for (i, input) in inputs.into_iter().enumerate() {
                @if i > 0 { ", " }
                @match input {
                    Input::Output { task, k } => {
                        @let from = &m.tasks[*task];
                        // A borrowed task (the batch's) is drawn on the first page.
                        @let page = if *task < m.borrowed { 1 } else { self.page };
                        a href=(self.link(page, &format!("o{}-{k}", from.id))) { (output_label(from, *k)) }
                    }
                    Input::Url(u) | Input::Unknown(u) => code { (u) },
                }
            }
        }
    }
}
