//! From the file as written ([`PipelineSpec`]) to a checked [`Pipeline`]: every check that needs
//! no network, each problem reported at its line, all of them in one pass.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::path::Path;

use crate::api::rules::{self, MAX_REFERENCE_IMAGES};
use crate::api::types::{AspectRatio, Increase, Size};
use crate::pipeline::checks::{Rerolls, StepChecks};
use crate::pipeline::de::{Typed, closest};
use crate::pipeline::diag::{Diagnostic, Report, shown};
use crate::pipeline::items::{self, Items, RawItem};
use crate::pipeline::model::{
    Generate, Input, Operation, Pipeline, Reference, Step, StepRef, Tool, ToolOp,
};
use crate::pipeline::spec::{PipelineSpec, SizeSpec, StepSpec};
use crate::pipeline::template::{self, Template};
use crate::pipeline::yaml::{Mark, Node, Value};
use crate::place::Address;
use crate::sha256::Sha256Sum;

mod checks;
mod graph;
mod steps;
mod values;

use graph::reorder;
pub use steps::check_step_id;
use values::Rule;

/// Problems listed per template before the rest are summed up in one line.
const SHOWN_PER_RULE: usize = 20;
/// Longest step id; step ids are file names.
const MAX_STEP_ID_CHARS: usize = 64;

pub struct Source<'a> {
    /// The pipeline file as the user named it.
    pub file: &'a str,
    /// Its directory, against which relative paths resolve.
    pub dir: &'a Path,
    pub text_sha256: Sha256Sum,
}

/// Checks a typed pipeline file; `None` when anything is wrong (all of it is in `report`).
pub fn check(
    src: &Source<'_>,
    root: &Node,
    typed: Typed<PipelineSpec>,
    report: &mut Report,
) -> Option<Pipeline> {
    let skipped = |n: &Node| typed.was_skipped(n);
    let step_nodes: Vec<&Node> = kept(root.get("steps"), &skipped);
    let item_nodes: Vec<&Node> = kept(root.get("items"), &skipped);
    let raw_step_ids: HashSet<&str> = root
        .get("steps")
        .and_then(Node::elements)
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s.get("id")?.scalar())
        .collect();
    let spec = typed.value.as_ref()?;
    let mut c = Checker {
        file: src.file,
        root,
        report,
        skipped: &skipped,
    };
    c.top_level(spec);
    let items = c.items(src, spec, &item_nodes);
    let mut drafts = c.steps(&spec.steps, &step_nodes, &raw_step_ids);
    c.step_checks(spec, &mut drafts);
    let order = c.graph(&drafts);
    c.templates(&drafts, &items);
    c.repeated_work(&drafts);
    if !c.report.is_ok() {
        return None;
    }
    let order = order?;
    let steps = reorder(drafts, &order);
    let pipeline = Pipeline {
        name: spec.name.trim().to_owned(),
        file: src.file.to_owned(),
        text_sha256: src.text_sha256.clone(),
        // A local path is relative to the file's directory; an object URL is kept whole.
        output_dir: match spec.output_dir.as_deref() {
            None => Address::Local(src.dir.join("out")),
            Some(d) => match Address::parse(d, "output_dir") {
                Ok(Address::Local(dir)) => Address::Local(src.dir.join(dir)),
                Ok(object) => object,
                // Reported by the checks above: no pipeline is made of it.
                Err(_) => Address::Local(src.dir.join(d)),
            },
        },
        max_credits: spec.budget.as_ref().map(|b| b.max_credits),
        generation_price: spec.pricing.as_ref().map(|p| p.generation),
        rerolls: spec.rerolls.as_ref().map(|r| Rerolls {
            max_credits: r.max_credits,
        }),
        concurrency: spec.concurrency.and_then(NonZeroU32::new),
        rate_limit: spec.rate_limit.as_deref().and_then(|r| r.parse().ok()),
        reuse: spec.reuse.unwrap_or(false),
        notify: spec
            .notify
            .as_deref()
            .and_then(|u| crate::webhook::check_url(u).ok()),
        items: std::sync::Arc::new(items),
        steps,
    };
    if pipeline.items.is_empty() && pipeline.steps.iter().any(|s| !s.once) {
        c.report.warn(Diagnostic::new(
            src.file,
            mark_of(root.key("items").or(root.key("items_from")), root),
            "there are no items: the per-item steps have nothing to do",
        ));
    }
    Some(pipeline)
}

fn kept<'n>(list: Option<&'n Node>, skipped: &dyn Fn(&Node) -> bool) -> Vec<&'n Node> {
    list.and_then(Node::elements)
        .unwrap_or_default()
        .iter()
        .filter(|n| !skipped(n))
        .collect()
}

fn mark_of(node: Option<&Node>, fallback: &Node) -> Mark {
    node.unwrap_or(fallback).mark
}

struct Checker<'a> {
    file: &'a str,
    root: &'a Node,
    report: &'a mut Report,
    /// Nodes left out of the typed value because of an error already reported.
    skipped: &'a dyn Fn(&Node) -> bool,
}

/// A step with its references resolved to indices in the file's order.
struct Draft<'n> {
    id: String,
    once: bool,
    node: &'n Node,
    /// `None` when the operation could not be built; the reason is reported.
    op: Option<Operation>,
    /// `from` references with the node each is written at, in the file's order of steps.
    refs: Vec<(StepRef, &'n Node)>,
    /// Templates to check, with where they are written and the rule their values follow.
    texts: Vec<(Template, &'n Node, Rule)>,
    /// `checks:` once checked; `None` when the step has none.
    checks: Option<StepChecks>,
}

impl Checker<'_> {
    fn error(&mut self, mark: Mark, message: impl Into<String>) -> &mut Diagnostic {
        self.report.error(Diagnostic::new(self.file, mark, message));
        self.report.errors.last_mut().expect("just pushed")
    }

    fn at(&self, path: &[&str]) -> Mark {
        let mut node = self.root;
        for key in path {
            match node.get(key) {
                Some(n) => node = n,
                None => break,
            }
        }
        node.mark
    }

    /// The settings at the top of the file, in the order they are reported.
    fn top_level(&mut self, spec: &PipelineSpec) {
        self.format_and_name(spec);
        self.output_dir(spec);
        self.notify(spec);
        self.pace(spec);
    }

    /// `version`, a `steps` list that is not empty, and `name`.
    fn format_and_name(&mut self, spec: &PipelineSpec) {
        if spec.version != 1 {
            let mark = self.at(&["version"]);
            self.error(
                mark,
                format!(
                    "version {} is not a format this imgpipe reads; write `version: 1`",
                    spec.version
                ),
            );
        }
        if spec.steps.is_empty()
            && self
                .root
                .get("steps")
                .and_then(Node::elements)
                .is_some_and(|s| s.is_empty())
        {
            let mark = self.at(&["steps"]);
            self.error(mark, "steps must list at least one step");
        }
        if spec.name.trim().is_empty() {
            let mark = self.at(&["name"]);
            self.error(mark, "name must not be empty");
        }
    }

    /// `output_dir`: a path or an object URL, never a template, never empty.
    fn output_dir(&mut self, spec: &PipelineSpec) {
        if spec
            .output_dir
            .as_deref()
            .is_some_and(|d| d.contains(template::OPEN))
        {
            let mark = self.at(&["output_dir"]);
            self.error(mark, "output_dir is a path, not a template; outputs already go to <output_dir>/<run>/<item>/");
        }
        if let Some(dir) = spec.output_dir.as_deref()
            && let Err(why) = Address::parse(dir, "output_dir")
        {
            let mark = self.at(&["output_dir"]);
            self.error(mark, why);
        }
        if spec
            .output_dir
            .as_deref()
            .is_some_and(|d| d.trim().is_empty())
        {
            let mark = self.at(&["output_dir"]);
            self.error(mark, "output_dir must not be empty; leave it out for `out`");
        }
    }

    /// `notify`: a webhook URL the alerts may be posted to.
    fn notify(&mut self, spec: &PipelineSpec) {
        if let Some(url) = spec.notify.as_deref()
            && let Err(why) = crate::webhook::check_url(url)
        {
            let mark = self.at(&["notify"]);
            self.error(mark, why);
        }
    }

    /// `concurrency` and `rate_limit`: how fast the run may call.
    fn pace(&mut self, spec: &PipelineSpec) {
        if let Some(n) = spec.concurrency
            && !(1..=256).contains(&n)
        {
            let mark = self.at(&["concurrency"]);
            self.error(
                mark,
                format!("concurrency must be between 1 and 256, got {n}"),
            );
        }
        if let Some(rate) = &spec.rate_limit
            && let Err(why) = rate.parse::<crate::pipeline::rate::Rate>()
        {
            let mark = self.at(&["rate_limit"]);
            self.error(mark, format!("rate_limit: {why}"));
        }
    }

    fn items(&mut self, src: &Source<'_>, spec: &PipelineSpec, nodes: &[&Node]) -> Items {
        let raw = match (&spec.items, &spec.items_from) {
            (Some(_), Some(_)) => {
                let mark = self.at(&["items_from"]);
                self.error(mark, "give either `items` or `items_from`, not both");
                return Items::default();
            }
            (Some(list), None) => list
                .iter()
                .zip(nodes)
                .map(|(fields, node)| RawItem {
                    fields: fields
                        .iter()
                        .map(|(k, v)| (k.clone(), v.0.clone()))
                        .collect(),
                    mark: node.mark,
                    id_mark: node.get("id").map(|n| n.mark),
                })
                .collect(),
            (None, Some(rel)) => {
                let mark = self.at(&["items_from"]);
                let shown_path = Path::new(src.file)
                    .parent()
                    .unwrap_or(Path::new(""))
                    .join(rel)
                    .display()
                    .to_string();
                let mut into = items::Builder::new(&shown_path);
                match items::read_file(&src.dir.join(rel), &shown_path, self.report, &mut into) {
                    Ok(()) => return into.finish(self.report),
                    Err(why) => {
                        self.error(mark, format!("items_from: {shown_path}: {why}"));
                        return Items::default();
                    }
                }
            }
            (None, None) => {
                if spec.steps.iter().any(|s| s.once != Some(true))
                    && !has_typo_of(self.root, &["items", "items_from"])
                {
                    let mark = self.at(&["steps"]);
                    self.error(mark, "there are per-item steps but no items")
                        .hint = Some(
                        "add `items:` (a list) or `items_from: items.jsonl` / `items.csv`".into(),
                    );
                }
                Vec::new()
            }
        };
        Items::build(self.file, &[], raw, self.report)
    }
}

/// Whether `node` has a key that is a misspelling of one of `names` (reported as unknown).
fn has_typo_of(node: &Node, names: &[&str]) -> bool {
    node.entries().unwrap_or_default().iter().any(|(k, _)| {
        k.scalar()
            .is_some_and(|k| !names.contains(&k) && closest(k, names.iter().copied()).is_some())
    })
}

const OPERATIONS: [&str; 5] = [
    "generate",
    "erase",
    "expand",
    "upscale",
    "remove_background",
];
