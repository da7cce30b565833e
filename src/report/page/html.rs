//! The page: one HTML file with its style and its one small script inline, and links to the
//! run's thumbnails and full-size files by relative paths.
//!
//! Markup is made with `maud`, which escapes every value it is given: text from the record
//! (an item's id, a prompt, an error) can never become markup. A page is written in pieces (its
//! items stream in a page at a time, the first page's problem lists are copied in from files),
//! so the few tags left open across pieces are written by [`Page::raw`], which takes only
//! `&'static str`: nothing read at run time can reach the page unescaped.

use std::path::Path;

use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::report::live::{GONE, Process};
use crate::report::page::links::href;
use crate::report::page::model::{Shared, StepCost};
use crate::report::page::pages::per_page;
use crate::store::{ReportTask, RunStatus};
use crate::task_key::TaskKey;
use crate::time::rfc3339_ms as time;

/// Marks a file as an imgpipe report: only such a file is ever overwritten by another.
pub const MARKER: &str = "<!-- imgpipe run report -->";

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
    pub(super) eager: usize,
    /// Served by the desk, which follows the run: a running run's banner says so, where a
    /// written page says when it was made and how to make it again.
    pub(super) live: bool,
    out: String,
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
            live: false,
            out: String::with_capacity(64 * 1024),
        }
    }

    /// Markup made by a template: every value in it was escaped.
    pub(super) fn put(&mut self, markup: Markup) {
        self.out.push_str(&markup.into_string());
    }

    /// Fixed markup, such as a tag that stays open across pieces of the page.
    pub(super) fn raw(&mut self, markup: &'static str) {
        self.out.push_str(markup);
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

    /// From the doctype to the opening of `<body>`.
    pub(super) fn open(&mut self) {
        let run = &self.shared.run;
        let pages = self.shared.pages.count();
        let head = html! {
            (DOCTYPE) "\n" (PreEscaped(MARKER)) "\n"
            (PreEscaped("<html lang=\"en\">"))
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="generator" content={ "imgpipe " (env!("CARGO_PKG_VERSION")) };
                title {
                    (run.pipeline_name) " · run " (run.id)
                    @if self.page > 1 { " · page " (self.page) " of " (pages) }
                }
                style { (PreEscaped(include_str!("page.css"))) }
            }
            "\n"
        };
        self.put(head);
        self.raw("<body>\n");
    }

    /// From the end of `<main>` to the end of the document: the reroll command's bar, then
    /// the script.
    pub(super) fn close(&mut self) {
        self.raw("</main>\n");
        let run = &self.shared.run;
        let commands = &self.shared.commands;
        let end = html! {
            // Shown by the script, which fills it: without the script there is nothing to tick.
            div #reroll .reroll hidden data-run=(run.id) data-command=(commands.reroll) data-flags=(commands.flags) {
                label for="reroll-command" {
                    "Make the ticked outputs again, and everything downstream of them:"
                }
                div.line {
                    textarea #reroll-command readonly rows="2" spellcheck="false" {}
                    button #reroll-copy type="button" { "Copy" }
                    button #reroll-clear type="button" { "Clear" }
                }
                p #reroll-said {}
                p.note {
                    code { "imgpipe reroll" } " pays again for those tasks; their earlier outputs \
                     are set aside under " code { "_superseded/" } ". Ticks on the run's other \
                     pages add up in this tab."
                    @if commands.unnamed_state {
                        " Add " code { "--state" } " naming the SQLite file this run is recorded \
                         in, on the host that has it."
                    }
                    @if commands.flags != " --sandbox" {
                        " A run made with " code { "--sandbox" } " or " code { "--base-url" }
                        " needs that flag too, as for " code { "imgpipe resume" } "."
                    }
                }
            }
            script { (PreEscaped(include_str!("page.js"))) }
            "\n"
        };
        self.put(end);
        self.raw("</body></html>\n");
    }

    /// The run's name and status, at the top of every page.
    fn title(&self) -> Markup {
        let run = &self.shared.run;
        let status = run.status.as_str();
        html! {
            h1 { (run.pipeline_name) span.run { "run " (run.id) } }
            span.badge.(format!("b-{status}")) #run-status { (status) }
        }
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
        let process = m.observed.process.as_ref();
        let end = run.finished_at.unwrap_or(m.generated_at);
        let took = if run.finished_at.is_some() {
            "Took"
        } else {
            "Running for"
        };
        let mut facts = vec![
            ("Started", time(run.created_at)),
            (took, duration(end - run.created_at)),
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
        let c = &m.checks;
        if c.any() {
            facts.push((
                "Checks",
                format!(
                    "{} passed, {} failed, {} not checked",
                    c.passed, c.failed, c.not_checked
                ),
            ));
            facts.push((
                "Rerolled",
                format!("{} for {} cr", c.rerolls, c.reroll_credits),
            ));
            facts.push(("Flagged", format!("{} output(s)", c.flagged)));
        }
        let header = html! {
            header {
                (self.title())
                @if let Some(why) = &run.stop_reason { " " span.why { (why) } }
                @if m.in_progress() {
                    p.banner #run-process {
                        @if self.live {
                            "This run is going on (seen at " (time(m.generated_at))
                            @if let Some(holder) = process.and_then(Process::holder) { ", by " (holder) }
                            "). Pending tasks show where they are; this page follows the run as it goes."
                        } @else {
                            "This run was still going when this page was made, at " (time(m.generated_at))
                            @if let Some(holder) = process.and_then(Process::holder) { ", by " (holder) }
                            ". Pending tasks show where they are; "
                            code { "imgpipe report " (run.id) } " makes the page again."
                        }
                    }
                } @else if process.is_some_and(|p| !p.alive) {
                    p.gone #run-process {
                        "The run is recorded as running, but its process is gone: " (GONE)
                        ". Calls it had in flight may have been billed."
                    }
                }
                @if let Some(command) = &m.observed.continue_with {
                    p.continue {
                        @if let Some(why) = run.stop_reason.as_ref().filter(|_| run.status == RunStatus::Stopped) {
                            "The run stopped: " (why) ". "
                        }
                        "Continue it with " code #continue-with { (command) }
                        ": it pays only for what is not done."
                    }
                }
                dl.facts {
                    @for (k, v) in &facts { div { dt { (k) } dd { (v) } } }
                }
                p {
                    "Files in " code { (run.dir().root().to_string()) } " · page made " (time(m.generated_at))
                    @if m.superseded > 0 {
                        " · " (m.superseded) " earlier file(s) set aside under " code { "_superseded/" }
                    }
                }
                nav.jump {
                    a href="#costs" { "Costs" }
                    a href="#problems" { "Problems (" (problems) ")" }
                    a href="#items" { "Items (" (items) ")" }
                }
            }
        };
        self.put(header);
    }

    /// A later page's header: which items it holds, and the way back to the costs.
    pub(super) fn later_header(&mut self) {
        let m = self.shared;
        let (from, to) = self.item_range(self.page);
        let first = href(self.dir, &m.pages.path(1));
        let header = html! {
            header {
                (self.title())
                p {
                    "Items " (from) "–" (to) " of " (m.items) ", page " (self.page) " of "
                    (m.pages.count()) " · page made " (time(m.generated_at))
                }
                nav.jump {
                    a href={ (first) "#costs" } { "Costs" }
                    a href={ (first) "#problems" } { "Problems" }
                    a href="#items" { "Items (" (m.items) ")" }
                }
            }
        };
        self.put(header);
    }

    /// The 1-based numbers of the first and last items of page `page`.
    fn item_range(&self, page: usize) -> (u64, u64) {
        let per = per_page() as u64;
        let page = page as u64;
        ((page - 1) * per + 1, (page * per).min(self.shared.items))
    }

    /// Links to the other pages: all of them when few, else the first, the last and those
    /// near this one, so a page's weight does not grow with the run.
    pub(super) fn pager(&self, id: &str) -> Markup {
        let count = self.shared.pages.count();
        if count <= 1 {
            return html! {};
        }
        // Each page shown, or `None` for a gap in the run of pages.
        let mut shown: Vec<Option<usize>> = Vec::new();
        for p in 1..=count {
            if count <= PAGER_ALL || p == 1 || p == count || p.abs_diff(self.page) <= 2 {
                shown.push(Some(p));
            } else if shown.last() != Some(&None) {
                shown.push(None);
            }
        }
        html! {
            nav.pages id=(id) {
                @if self.page > 1 {
                    a rel="prev" href=(self.link(self.page - 1, "items")) { "‹ previous" }
                }
                @for p in shown {
                    @match p {
                        None => span.gap { "…" },
                        Some(p) => {
                            @let (from, to) = self.item_range(p);
                            @if p == self.page {
                                b.on { (from) "–" (to) }
                            } @else {
                                a href=(self.link(p, "items")) { (from) "–" (to) }
                            }
                        }
                    }
                }
                @if self.page < count {
                    a rel="next" href=(self.link(self.page + 1, "items")) { "next ›" }
                }
            }
            "\n"
        }
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
}

/// `item/step[idx]`.
pub(super) fn label(t: &ReportTask) -> String {
    TaskKey::new(t.item.as_str(), t.step.as_str(), t.idx).to_string()
}

pub(super) fn label_in_item(t: &ReportTask) -> String {
    format!("{}[{}]", t.step, t.idx)
}

pub(super) fn output_label(t: &ReportTask, k: u32) -> String {
    TaskKey::new(t.item.as_str(), t.step.as_str(), t.idx + k).to_string()
}

pub(super) fn output_label_in_item(t: &ReportTask, k: u32) -> String {
    format!("{}[{}]", t.step, t.idx + k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(59_999), "59 s");
        assert_eq!(duration(61_000), "1 min 1 s");
        assert_eq!(duration(3_720_000), "1 h 2 min");
    }
}
