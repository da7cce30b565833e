//! The page: one HTML file with its style and its one small script inline, and links to the
//! run's thumbnails and full-size files by relative paths.

use std::fmt::Write;
use std::path::Path;

use crate::place::layout;
use crate::report::lineage::Input;
use crate::report::links::href;
use crate::report::live::{GONE, Process};
use crate::report::model::{Model, Shared, Shown, StepCost};
use crate::store::{ReportTask, TaskStatus};
use crate::task_key::TaskKey;
use crate::time::rfc3339_ms as time;

/// Marks a file as an imgpipe report: only such a file is ever overwritten by another.
pub const MARKER: &str = "<!-- imgpipe run report -->";

/// Items per page file: a page stays light in the browser and in memory while it is made.
pub(super) const PER_PAGE: usize = 100;

/// Up to this many pages the pager links every one; beyond, the first, the last and the
/// neighbours of the page shown.
const PAGER_ALL: usize = 12;

/// Thumbnails the page loads by itself; the script loads the others as they come near the
/// screen. Chromium does not lazy-load images of `file:` pages, so `loading="lazy"` alone would
/// load every thumbnail of the run at once.
pub(super) const EAGER: usize = 60;

/// Builds a page's markup; the caller writes it out in pieces, so the first page's problem
/// lists (gathered while the later pages were written) are copied in from their files.
pub(super) struct Page<'a> {
    pub(super) shared: &'a Shared,
    /// The directory the page is written into: links are relative to it.
    pub(super) dir: &'a Path,
    /// 1-based.
    pub(super) page: usize,
    /// Thumbnails still to be given a plain `src`.
    eager: usize,
    pub(super) out: String,
}

/// Escapes text for HTML content and quoted attributes.
pub(super) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn duration(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s / 60 % 60),
    }
}

impl<'a> Page<'a> {
    pub(super) fn new(shared: &'a Shared, dir: &'a Path, page: usize) -> Page<'a> {
        Page {
            shared,
            dir,
            page,
            eager: EAGER,
            out: String::with_capacity(64 * 1024),
        }
    }

    pub(super) fn w(&mut self, s: &str) {
        self.out.push_str(s);
    }

    /// The markup so far, leaving the page empty for what follows.
    pub(super) fn take(&mut self) -> String {
        std::mem::take(&mut self.out)
    }

    /// The link to `fragment` on page `page`: bare on this page, the file's name on another.
    pub(super) fn link(&self, page: usize, fragment: &str) -> String {
        if page == self.page {
            format!("#{fragment}")
        } else {
            format!(
                "{}#{fragment}",
                href(self.dir, &self.shared.pages.path(page))
            )
        }
    }

    /// From the doctype to the opening of `<main>`.
    pub(super) fn open(&mut self) {
        let run = &self.shared.run;
        let pages = self.shared.pages.count();
        let part = if self.page > 1 {
            format!(" · page {} of {pages}", self.page)
        } else {
            String::new()
        };
        let _ = write!(
            self.out,
            "<!DOCTYPE html>\n{MARKER}\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
             <meta name=\"generator\" content=\"imgpipe {}\">\
             <title>{} · run {}{part}</title><style>{}</style></head>\n<body data-page=\"{}\" data-pages=\"{pages}\">\n",
            env!("CARGO_PKG_VERSION"),
            esc(&run.pipeline_name),
            esc(&run.id),
            include_str!("page.css"),
            self.page,
        );
    }

    /// From the end of `<main>` to the end of the document.
    pub(super) fn close(&mut self) {
        self.w("</main>\n<script>");
        self.w(include_str!("page.js"));
        self.w("</script>\n</body></html>\n");
    }

    /// The first page's header: the run at a glance.
    pub(super) fn header(
        &mut self,
        total: &StepCost,
        problems: usize,
        images: usize,
        items: usize,
    ) {
        let m = self.shared;
        let run = &m.run;
        let status = run.status.as_str();
        let _ = write!(
            self.out,
            "<header><h1>{}<span class=\"run\">run {}</span></h1>\
             <span class=\"badge b-{status}\" id=\"run-status\">{status}</span>",
            esc(&run.pipeline_name),
            esc(&run.id)
        );
        if let Some(why) = &run.stop_reason {
            let _ = write!(self.out, " <span class=\"why\">{}</span>", esc(why));
        }
        let process = m.observed.process.as_ref();
        if m.in_progress() {
            let who = process
                .and_then(Process::holder)
                .map(|h| format!(", by {h}"))
                .unwrap_or_default();
            let _ = write!(
                self.out,
                "<p class=\"banner\" id=\"run-process\">This run was still going when this page was made, at {}{}. \
                 Pending tasks show where they are; <code>imgpipe report {}</code> makes the page again.</p>",
                time(m.generated_at),
                esc(&who),
                esc(&run.id)
            );
        } else if process.is_some_and(|p| !p.alive) {
            let _ = write!(
                self.out,
                "<p class=\"gone\" id=\"run-process\">The run is recorded as running, but its process is gone: \
                 {}. Calls it had in flight may have been billed.</p>",
                esc(GONE)
            );
        }
        if let Some(command) = &m.observed.continue_with {
            let _ = write!(
                self.out,
                "<p class=\"continue\">Continue it with <code id=\"continue-with\">{}</code></p>",
                esc(command)
            );
        }
        let end = run.finished_at.unwrap_or(m.generated_at);
        let mut facts = vec![
            ("Started", time(run.created_at)),
            (
                if run.finished_at.is_some() {
                    "Took"
                } else {
                    "Running for"
                },
                duration(end - run.created_at),
            ),
            (
                "Tasks done",
                format!("{} of {}", total.succeeded, total.tasks),
            ),
            ("Images on disk", images.to_string()),
            (
                "Credits billed",
                format!("{} of {} planned", total.billed, total.planned),
            ),
            ("Balance", self.balance_text()),
        ];
        if total.at_risk > 0 {
            facts.push(("Possibly billed", format!("{} more", total.at_risk)));
        }
        self.w("<dl class=\"facts\">");
        for (k, v) in facts {
            let _ = write!(self.out, "<div><dt>{k}</dt><dd>{}</dd></div>", esc(&v));
        }
        let _ = write!(
            self.out,
            "</dl><p>Files in <code>{}</code> · page made {}{}</p>",
            esc(&run.dir().root().to_string()),
            time(m.generated_at),
            if m.superseded > 0 {
                format!(
                    " · {} earlier file(s) set aside under <code>_superseded/</code>",
                    m.superseded
                )
            } else {
                String::new()
            }
        );
        let _ = write!(
            self.out,
            "<nav class=\"jump\"><a href=\"#costs\">Costs</a><a href=\"#problems\">Problems ({problems})</a>\
             <a href=\"#items\">Items ({items})</a></nav></header>"
        );
    }

    /// A later page's header: which items it holds, and the way back to the costs.
    pub(super) fn later_header(&mut self) {
        let m = self.shared;
        let run = &m.run;
        let status = run.status.as_str();
        let (from, to) = self.item_range(self.page);
        let _ = write!(
            self.out,
            "<header><h1>{}<span class=\"run\">run {}</span></h1>\
             <span class=\"badge b-{status}\" id=\"run-status\">{status}</span>\
             <p>Items {from}–{to} of {}, page {} of {} · page made {}</p>\
             <nav class=\"jump\"><a href=\"{first}#costs\">Costs</a><a href=\"{first}#problems\">Problems</a>\
             <a href=\"#items\">Items ({})</a></nav></header>",
            esc(&run.pipeline_name),
            esc(&run.id),
            m.items,
            self.page,
            m.pages.count(),
            time(m.generated_at),
            m.items,
            first = href(self.dir, &m.pages.path(1)),
        );
    }

    /// The 1-based numbers of the first and last items of page `page`.
    fn item_range(&self, page: usize) -> (u64, u64) {
        let per = PER_PAGE as u64;
        let page = page as u64;
        ((page - 1) * per + 1, (page * per).min(self.shared.items))
    }

    /// Links to the other pages: all of them when few, else the first, the last and those
    /// near this one, so a page's weight does not grow with the run.
    fn pager(&mut self, id: &str) {
        let count = self.shared.pages.count();
        if count <= 1 {
            return;
        }
        let _ = write!(self.out, "<nav class=\"pages\" id=\"{id}\">");
        if self.page > 1 {
            let prev = self.link(self.page - 1, "items");
            let _ = write!(
                self.out,
                "<a rel=\"prev\" href=\"{}\">‹ previous</a>",
                esc(&prev)
            );
        }
        let mut gap = false;
        for p in 1..=count {
            let shown = count <= PAGER_ALL || p == 1 || p == count || p.abs_diff(self.page) <= 2;
            if !shown {
                if !gap {
                    self.w("<span class=\"gap\">…</span>");
                }
                gap = true;
                continue;
            }
            gap = false;
            let (from, to) = self.item_range(p);
            if p == self.page {
                let _ = write!(self.out, "<b class=\"on\">{from}–{to}</b>");
            } else {
                let to_page = self.link(p, "items");
                let _ = write!(self.out, "<a href=\"{}\">{from}–{to}</a>", esc(&to_page));
            }
        }
        if self.page < count {
            let next = self.link(self.page + 1, "items");
            let _ = write!(
                self.out,
                "<a rel=\"next\" href=\"{}\">next ›</a>",
                esc(&next)
            );
        }
        self.w("</nav>\n");
    }

    fn balance_text(&self) -> String {
        let run = &self.shared.run;
        let show = |b: Option<i64>| b.map_or_else(|| "not known".to_owned(), |b| b.to_string());
        match (run.balance_after, self.shared.in_progress()) {
            (Some(after), _) => format!("{} before, {after} after", show(run.balance_before)),
            (None, true) => format!(
                "{} before, {} at the last answer",
                show(run.balance_before),
                show(self.shared.last_balance)
            ),
            (None, false) => format!(
                "{} before, {} after",
                show(run.balance_before),
                show(self.shared.last_balance)
            ),
        }
    }

    /// The page's items, with the pager above and below them.
    pub(super) fn items(&mut self, m: &Model) {
        self.w(
            "<section id=\"items\"><h2>Items</h2><p>Each item's images from step to step: \
             click one for the full-size file. A checkerboard shows through transparent parts.</p>",
        );
        if m.images().filter(|s| s.preview.thumb.is_some()).count() > EAGER {
            let _ = write!(
                self.out,
                "<noscript><p class=\"banner\">Thumbnails after the first {EAGER} load with \
                 JavaScript on; each one's link to the full-size file works either way.</p></noscript>"
            );
        }
        self.pager("pages");
        for chain in &m.lineage.chains {
            let tasks = &chain.tasks;
            // The batch's chain is drawn on the first page; later ones only link to it.
            if tasks.iter().all(|&t| t < m.borrowed) {
                continue;
            }
            let count = |s: TaskStatus| tasks.iter().filter(|&&t| m.tasks[t].status == s).count();
            let billed: u64 = tasks.iter().map(|&t| m.tasks[t].credits_billed).sum();
            let title = if chain.id == layout::BATCH {
                "Batch steps (run once for all items)".to_owned()
            } else {
                esc(&chain.id)
            };
            let _ = write!(
                self.out,
                "<section class=\"item\" id=\"item-{}\"><h3>{title} <span class=\"badge\">{billed} cr</span>",
                esc(&chain.id)
            );
            for status in [
                TaskStatus::Failed,
                TaskStatus::Blocked,
                TaskStatus::Running,
                TaskStatus::Pending,
            ] {
                let n = count(status);
                if n > 0 {
                    let _ = write!(
                        self.out,
                        "<span class=\"badge b-{0}\">{n} {0}</span>",
                        status.as_str()
                    );
                }
            }
            self.w("</h3><div class=\"lineage\">");
            for &root in &chain.roots {
                self.task(m, root);
            }
            self.w("</div></section>\n");
        }
        self.pager("pages-end");
        self.w("</section>\n");
    }

    fn task(&mut self, m: &Model, t: usize) {
        let task = &m.tasks[t];
        let shown: &[Shown] = m.outputs.get(&t).map_or(&[], Vec::as_slice);
        let fan = if shown.len() > 1 { " fan" } else { "" };
        let _ = write!(
            self.out,
            "<div class=\"task st-{}{fan}\" id=\"t{}\">",
            task.status.as_str(),
            task.id
        );
        let others = self.other_inputs(m, t);
        if shown.is_empty() {
            self.placeholder(task, &others);
            self.kids(m, m.lineage.children(t, None));
        }
        for s in shown {
            self.w("<div class=\"slot\">");
            self.figure(task, s, shown.len(), &others);
            self.kids(m, m.lineage.children(t, Some(s.row.k)));
            self.w("</div>");
        }
        if shown.is_empty() {
            self.w("</div>");
        }
        self.w("</div>");
    }

    fn kids(&mut self, m: &Model, kids: Vec<usize>) {
        if kids.is_empty() {
            return;
        }
        self.w("<span class=\"arrow\">&rarr;</span><div class=\"kids\">");
        for kid in kids {
            self.task(m, kid);
        }
        self.w("</div>");
    }

    fn placeholder(&mut self, task: &ReportTask, others: &str) {
        let status = task.status.as_str();
        let _ = write!(
            self.out,
            "<div class=\"slot\"><figure><div class=\"thumb none\"><span class=\"badge b-{status}\">{status}</span>\
             <span class=\"why\">{}</span></div><figcaption><b>{}</b> · {}<br>planned {} cr{}{}{}</figcaption></figure>",
            esc(&self.shared.reason(task)),
            esc(&label_in_item(task)),
            esc(&task.operation),
            task.planned_credits,
            if task.credits_billed > 0 {
                format!(", billed {}", task.credits_billed)
            } else {
                String::new()
            },
            task.job_id
                .as_deref()
                .map(|j| format!("<code title=\"job {0}\">{0}</code>", esc(j)))
                .unwrap_or_default(),
            others
        );
    }

    fn figure(&mut self, task: &ReportTask, s: &Shown, outputs: usize, others: &str) {
        let row = &s.row;
        let p = &s.preview;
        let full = row.path.as_deref().map(|f| href(self.dir, Path::new(f)));
        let _ = write!(self.out, "<figure id=\"o{}-{}\">", task.id, row.k);
        match (&p.thumb, &full) {
            (Some(thumb), Some(full)) => {
                let (tw, th) = p.thumb_size.unwrap_or((160, 160));
                // The first few load with the page (not `loading="lazy"`: Chromium would hold
                // back those below the fold); the script gives the others theirs.
                let src = if self.eager > 0 {
                    self.eager -= 1;
                    "src"
                } else {
                    "loading=\"lazy\" data-src"
                };
                let _ = write!(
                    self.out,
                    "<a class=\"thumb{}\" href=\"{}\" target=\"_blank\" title=\"open the full-size image\">\
                     <img {src}=\"{}\" width=\"{tw}\" height=\"{th}\" decoding=\"async\" alt=\"{}\" \
                     onerror=\"this.parentNode.classList.add('gone')\"></a>",
                    if p.alpha { " alpha" } else { "" },
                    esc(full),
                    esc(&href(self.dir, thumb)),
                    esc(&output_label(task, row.k)),
                );
            }
            (None, Some(full)) => {
                let _ = write!(
                    self.out,
                    "<a class=\"thumb none\" href=\"{}\"><span class=\"why\">{}</span></a>",
                    esc(full),
                    esc(p.note.as_deref().unwrap_or("no preview"))
                );
            }
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
                let _ = write!(
                    self.out,
                    "<div class=\"thumb none\"><span class=\"badge b-{class}\">{badge}</span><span class=\"why\">{}</span></div>",
                    esc(&why)
                );
            }
        }
        let size = p
            .size
            .map_or_else(|| "size unknown".to_owned(), |(w, h)| format!("{w}×{h}"));
        let credits = if let Some(from) = &task.reused_from_run {
            format!("0 cr, reused from run {}", esc(from))
        } else if outputs > 1 {
            format!("{} cr for {outputs}", task.credits_billed)
        } else {
            format!("{} cr", task.credits_billed)
        };
        let calls = if task.attempts > 1 {
            format!(" · {} calls", task.attempts)
        } else {
            String::new()
        };
        let note = match (&p.note, &p.thumb) {
            (Some(n), Some(_)) => format!("<br><span class=\"note\">{}</span>", esc(n)),
            _ => String::new(),
        };
        let _ = write!(
            self.out,
            "<figcaption><b>{}</b> · {}<br>{size} · {credits}{calls}<br><code title=\"job {2}\">{2}</code>{note}{others}</figcaption></figure>",
            esc(&output_label_in_item(task, row.k)),
            esc(&task.operation),
            esc(&row.job_id),
        );
    }

    /// The inputs a task reads besides the output it is drawn after.
    fn other_inputs(&self, m: &Model, t: usize) -> String {
        let parts: Vec<String> = m
            .lineage
            .other_inputs(t, &m.tasks)
            .into_iter()
            .map(|input| match input {
                Input::Output { task, k } => {
                    let from = &m.tasks[*task];
                    // A borrowed task (the batch's) is drawn on the first page.
                    let page = if *task < m.borrowed { 1 } else { self.page };
                    format!(
                        "<a href=\"{}\">{}</a>",
                        esc(&self.link(page, &format!("o{}-{k}", from.id))),
                        esc(&output_label(from, *k))
                    )
                }
                Input::Url(u) | Input::Unknown(u) => format!("<code>{}</code>", esc(u)),
            })
            .collect();
        // A task drawn after none of its inputs (the first of its chain) lists them all.
        let root = parts.len() == m.tasks[t].inputs.len();
        if parts.is_empty() {
            String::new()
        } else {
            let verb = if root { "reads" } else { "also reads" };
            format!("<br>{verb} {}", parts.join(", "))
        }
    }
}

/// `item/step[idx]`.
pub(super) fn label(t: &ReportTask) -> String {
    TaskKey::new(t.item.as_str(), t.step.as_str(), t.idx).to_string()
}

fn label_in_item(t: &ReportTask) -> String {
    format!("{}[{}]", t.step, t.idx)
}

pub(super) fn output_label(t: &ReportTask, k: u32) -> String {
    TaskKey::new(t.item.as_str(), t.step.as_str(), t.idx + k).to_string()
}

fn output_label_in_item(t: &ReportTask, k: u32) -> String {
    format!("{}[{}]", t.step, t.idx + k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(59_999), "59 s");
        assert_eq!(duration(61_000), "1 min 1 s");
        assert_eq!(duration(3_720_000), "1 h 2 min");
    }
}
