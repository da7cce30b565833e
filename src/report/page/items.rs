//! The page's items: each item's lineage as rows of thumbnails in pipeline order, a task after
//! the output it reads, with its placeholder when it has no image to show.

use maud::{Markup, html};

use crate::place::layout;
use crate::report::page::html::{EAGER, Page, output_label};
use crate::report::page::lineage::Input;
use crate::report::page::model::{Model, Shown};
use crate::store::TaskStatus;

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
                        @if chain.id != layout::BATCH {
                            label.pick.whole title="Pick the whole item for imgpipe reroll: every task of it is made again" {
                                input.pick type="checkbox" value=(chain.id);
                                "reroll the whole item"
                            }
                        }
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
        let earlier = m.earlier.get(&t).map_or(&[][..], Vec::as_slice);
        let mut slots: Vec<(Markup, Vec<Markup>)> = Vec::new();
        if shown.is_empty() {
            let kids = self.kids(m, m.lineage.children(t, None));
            slots.push((self.placeholder(task, &others, earlier), kids));
        }
        for s in shown {
            let verdicts = m.verdicts.get(&s.row.id).map_or(&[][..], Vec::as_slice);
            let figure = self.figure(task, (s, verdicts), shown.len(), &others, earlier);
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
