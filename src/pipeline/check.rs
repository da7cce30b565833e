//! From the file as written ([`PipelineSpec`]) to a checked [`Pipeline`]: every check that needs
//! no network, each problem reported at its line, all of them in one pass.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::path::Path;

use crate::api::rules::{self, MAX_REFERENCE_IMAGES};
use crate::api::types::{AspectRatio, Increase, Size};
use crate::pipeline::de::{Typed, closest};
use crate::pipeline::diag::{Diagnostic, Report};
use crate::pipeline::items::{self, Items, RawItem, shown};
use crate::pipeline::model::{
    Generate, Input, Operation, Pipeline, Reference, Step, StepRef, Tool, ToolOp,
};
use crate::pipeline::spec::{PipelineSpec, SizeSpec, StepSpec};
use crate::pipeline::template::Template;
use crate::pipeline::yaml::{Mark, Node, Value};

/// Problems listed per template before the rest are summed up in one line.
const SHOWN_PER_RULE: usize = 20;
/// Longest step id; step ids are file names.
const MAX_STEP_ID_CHARS: usize = 64;

pub struct Source<'a> {
    /// The pipeline file as the user named it.
    pub file: &'a str,
    /// Its directory, against which relative paths resolve.
    pub dir: &'a Path,
    pub text_sha256: String,
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
    let drafts = c.steps(&spec.steps, &step_nodes, &raw_step_ids);
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
        output_dir: src.dir.join(spec.output_dir.as_deref().unwrap_or("out")),
        max_credits: spec.budget.as_ref().map(|b| b.max_credits),
        generation_price: spec.pricing.as_ref().map(|p| p.generation),
        concurrency: spec.concurrency.and_then(NonZeroU32::new),
        rate_limit: spec.rate_limit.as_deref().and_then(|r| r.parse().ok()),
        items,
        steps,
    };
    if !pipeline.items.is_empty() || pipeline.steps.iter().all(|s| s.once) {
        return Some(pipeline);
    }
    c.report.warn(Diagnostic::new(
        src.file,
        mark_of(root.key("items").or(root.key("items_from")), root),
        "there are no items: the per-item steps have nothing to do",
    ));
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

    fn top_level(&mut self, spec: &PipelineSpec) {
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
        if spec.output_dir.as_deref().is_some_and(|d| d.contains("{{")) {
            let mark = self.at(&["output_dir"]);
            self.error(mark, "output_dir is a path, not a template; outputs already go to <output_dir>/<run>/<item>/");
        }
        if spec
            .output_dir
            .as_deref()
            .is_some_and(|d| d.trim().is_empty())
        {
            let mark = self.at(&["output_dir"]);
            self.error(mark, "output_dir must not be empty; leave it out for `out`");
        }
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
                match items::read_file(&src.dir.join(rel), &shown_path, self.report) {
                    Ok((declared, raw)) => {
                        return Items::build(&shown_path, &declared, raw, self.report);
                    }
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

    fn steps<'n>(
        &mut self,
        specs: &[StepSpec],
        nodes: &[&'n Node],
        raw_ids: &HashSet<&str>,
    ) -> Vec<Draft<'n>> {
        let mut index: HashMap<String, (usize, usize)> = HashMap::new();
        for (i, (spec, node)) in specs.iter().zip(nodes).enumerate() {
            let mark = mark_of(node.get("id"), node);
            if let Err(why) = check_step_id(&spec.id) {
                self.error(mark, format!("step id {}: {why}", shown(&spec.id)));
            }
            match index.get(&spec.id.to_lowercase()) {
                Some((first, line)) => {
                    let first = &specs[*first].id;
                    let what = if *first == spec.id {
                        "is used twice".to_owned()
                    } else {
                        format!(
                            "differs from {} only in case, and both would name the same files on case-insensitive file systems",
                            shown(first)
                        )
                    };
                    self.error(
                        mark,
                        format!("step id {} {what} (first at line {line})", shown(&spec.id)),
                    );
                }
                None => {
                    index.insert(spec.id.to_lowercase(), (i, mark.line));
                }
            }
        }
        let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
        for (spec, node) in specs.iter().zip(nodes) {
            let Some((stem, index)) = spec.id.rsplit_once('-') else {
                continue;
            };
            if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) && ids.contains(&stem)
            {
                let mark = mark_of(node.get("id"), node);
                self.error(mark, format!(
                    "step id {} reads as output {index} of step {}, whose files are named {stem}-<index>; choose another id",
                    shown(&spec.id),
                    shown(stem)
                ));
            }
        }
        let mut known: Vec<&str> = raw_ids.iter().copied().collect();
        known.sort_unstable();
        let mut resolve = |checker: &mut Self, name: &str, at: &Node| -> Option<StepRef> {
            if let Some((i, _)) = index
                .get(&name.to_lowercase())
                .filter(|(i, _)| ids[*i] == name)
            {
                return Some(StepRef(*i));
            }
            if !raw_ids.contains(name) {
                let d = checker.error(at.mark, format!("unknown step {}", shown(name)));
                if let Some(best) = closest(name, known.iter().copied()) {
                    d.message.push_str(&format!("; did you mean `{best}`?"));
                }
            }
            None
        };
        specs
            .iter()
            .zip(nodes)
            .map(|(spec, node)| self.draft(spec, node, &mut resolve))
            .collect()
    }

    fn draft<'n>(
        &mut self,
        spec: &StepSpec,
        node: &'n Node,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Draft<'n> {
        let mut draft = Draft {
            id: spec.id.clone(),
            once: spec.once == Some(true),
            node,
            op: None,
            refs: Vec::new(),
            texts: Vec::new(),
        };
        let given: Vec<&str> = OPERATIONS
            .iter()
            .copied()
            .filter(|op| node.get(op).is_some())
            .collect();
        match given.as_slice() {
            // A misspelt operation is already reported as an unknown key.
            [] if has_typo_of(node, &OPERATIONS) => return draft,
            [] => {
                self.error(
                    node.mark,
                    format!("step {} has no operation", shown(&spec.id)),
                )
                .hint = Some(format!(
                    "give exactly one of {}",
                    OPERATIONS.map(|o| format!("`{o}`")).join(", ")
                ));
                return draft;
            }
            [_] => {}
            [first, second, ..] => {
                let mark = mark_of(node.key(second), node);
                self.error(mark, format!(
                    "step {} has both `{first}` and `{second}`; a step does exactly one operation",
                    shown(&spec.id)
                ));
                return draft;
            }
        }
        let op_name = given[0];
        let op_node = node.get(op_name).unwrap_or(node);
        if op_node.is_null() {
            let mark = mark_of(node.key(op_name), node);
            self.error(mark, format!("`{op_name}` is empty; it needs its fields"))
                .hint = Some(format!(
                "see the `{op_name}` row of the reference in pipelines/README.md"
            ));
            return draft;
        }
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        draft.op = if let Some(g) = &spec.generate {
            self.generate(g, op_node, &mut draft, resolve)
        } else {
            let (input, params) = match (
                &spec.erase,
                &spec.expand,
                &spec.upscale,
                &spec.remove_background,
            ) {
                (Some(e), ..) => (
                    e.input(),
                    self.erase(&e.object_name, field("object_name"), &mut draft),
                ),
                (_, Some(e), ..) => (
                    e.input(),
                    self.expand(
                        e.aspect_ratio.as_deref(),
                        e.prompt.as_deref(),
                        op_node,
                        &mut draft,
                    ),
                ),
                (.., Some(u), _) => (
                    u.input(),
                    self.upscale(u.desired_increase, field("desired_increase")),
                ),
                (.., Some(r)) => (r.input(), Some(ToolOp::RemoveBackground)),
                _ => return draft,
            };
            let input = match (input.from, input.image_url) {
                (Some(_), Some(_)) => {
                    let mark = mark_of(op_node.key("image_url"), op_node);
                    self.error(mark, format!("`{op_name}` takes one input: give either `from` or `image_url`, not both"));
                    None
                }
                (None, None) => {
                    self.error(op_node.mark, format!("`{op_name}` needs an input"))
                        .hint = Some(
                        "add `from: <step>` to edit another step's images, or `image_url: <url>`"
                            .into(),
                    );
                    None
                }
                (Some(from), None) => {
                    let at = field("from");
                    resolve(self, from, at).map(|r| {
                        draft.refs.push((r, at));
                        Input::Step(r)
                    })
                }
                (None, Some(url)) => self
                    .template(url, field("image_url"), Rule::ToolUrl, &mut draft)
                    .map(Input::Url),
            };
            match (input, params) {
                (Some(input), Some(params)) => Some(Operation::Tool(Tool {
                    input,
                    preserve_alpha: input_alpha(spec),
                    params,
                })),
                _ => None,
            }
        };
        draft
    }

    fn generate<'n>(
        &mut self,
        g: &crate::pipeline::spec::GenerateSpec,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Option<Operation> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        let prompt = self.template(&g.prompt, field("prompt"), Rule::Prompt, draft);
        let n = g.n.unwrap_or(1);
        if let Err(e) = rules::check_n(n) {
            self.error(field("n").mark, format!("n {}", e.message));
        }
        let size = match g.size {
            None | Some(SizeSpec::TwoK) => Size::TwoK,
            Some(SizeSpec::FourK) => Size::FourK,
        };
        let ref_nodes: Vec<&Node> = kept(op_node.get("image_urls"), self.skipped);
        let mut references = Vec::new();
        let mut complete = true;
        for (r, node) in g.image_urls.iter().zip(ref_nodes) {
            match r {
                crate::pipeline::spec::ReferenceSpec::Url(url) => {
                    match self.template(url, node, Rule::ReferenceUrl, draft) {
                        Some(t) => references.push(Reference::Url(t)),
                        None => complete = false,
                    }
                }
                crate::pipeline::spec::ReferenceSpec::From(f) => {
                    let at = node.get("from").unwrap_or(node);
                    match resolve(self, &f.from, at) {
                        Some(step) => {
                            draft.refs.push((step, at));
                            references.push(Reference::Step(step));
                        }
                        None => complete = false,
                    }
                }
            }
        }
        let n = u8::try_from(n)
            .ok()
            .filter(|n| rules::check_n(i64::from(*n)).is_ok())?;
        (complete && prompt.is_some()).then(|| {
            Operation::Generate(Generate {
                prompt: prompt.expect("checked"),
                n,
                size,
                references,
            })
        })
    }

    fn erase<'n>(&mut self, object: &str, at: &'n Node, draft: &mut Draft<'n>) -> Option<ToolOp> {
        let object_name = self.template(object, at, Rule::ObjectName, draft)?;
        Some(ToolOp::Erase { object_name })
    }

    fn expand<'n>(
        &mut self,
        ratio: Option<&str>,
        prompt: Option<&str>,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
    ) -> Option<ToolOp> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        let aspect_ratio = match ratio.map(str::parse::<AspectRatio>) {
            Some(Err(e)) => {
                self.error(
                    field("aspect_ratio").mark,
                    format!("aspect_ratio {}", e.message),
                );
                return None;
            }
            Some(Ok(r)) => Some(r),
            None => None,
        };
        let prompt = match prompt {
            Some(p) => Some(self.template(p, field("prompt"), Rule::ExpandPrompt, draft)?),
            None => None,
        };
        Some(ToolOp::Expand {
            aspect_ratio,
            prompt,
        })
    }

    fn upscale(&mut self, factor: i64, at: &Node) -> Option<ToolOp> {
        match Increase::from_factor(factor) {
            Ok(i) => Some(ToolOp::Upscale(i)),
            Err(e) => {
                self.error(at.mark, format!("desired_increase {}", e.message));
                None
            }
        }
    }

    /// Parses a template field and queues its values for checking against `rule`.
    fn template<'n>(
        &mut self,
        source: &str,
        at: &'n Node,
        rule: Rule,
        draft: &mut Draft<'n>,
    ) -> Option<Template> {
        match Template::parse(source) {
            Ok(t) => {
                draft.texts.push((t.clone(), at, rule));
                Some(t)
            }
            Err(e) => {
                let mut mark = at.mark;
                if matches!(&at.value, Value::Scalar { plain: true, .. }) {
                    mark.col += source[..e.offset].chars().count();
                }
                self.error(mark, e.message);
                None
            }
        }
    }
}

/// Images per instance of step `i`, memoised in `memo`; `None` through a cycle or a broken step.
fn outputs_of(
    i: usize,
    drafts: &[Draft<'_>],
    memo: &mut [Option<u64>],
    visiting: &mut [bool],
) -> Option<u64> {
    if memo[i].is_some() || visiting[i] {
        return memo[i];
    }
    visiting[i] = true;
    let n = match &drafts[i].op {
        Some(Operation::Generate(g)) => Some(u64::from(g.n)),
        Some(Operation::Tool(Tool {
            input: Input::Step(s),
            ..
        })) => outputs_of(s.0, drafts, memo, visiting),
        Some(Operation::Tool(_)) => Some(1),
        None => None,
    };
    visiting[i] = false;
    memo[i] = n;
    n
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

fn input_alpha(spec: &StepSpec) -> Option<bool> {
    spec.erase
        .as_ref()
        .map(|s| s.input())
        .or(spec.expand.as_ref().map(|s| s.input()))
        .or(spec.upscale.as_ref().map(|s| s.input()))
        .or(spec.remove_background.as_ref().map(|s| s.input()))
        .and_then(|i| i.preserve_alpha)
}

/// Step ids name output files: letters, digits, `_` and `-`, starting with a letter or digit.
pub fn check_step_id(id: &str) -> Result<(), String> {
    let mut chars = id.chars();
    match chars.next() {
        None => return Err("is empty".into()),
        Some(c) if !c.is_ascii_alphanumeric() => {
            return Err("must start with a letter or digit".into());
        }
        Some(_) => {}
    }
    if let Some(bad) = chars.find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))) {
        return Err(format!(
            "contains {bad:?}; step ids use letters, digits, `_` and `-`"
        ));
    }
    if id.chars().count() > MAX_STEP_ID_CHARS {
        return Err(format!("is longer than {MAX_STEP_ID_CHARS} characters"));
    }
    if items::is_device_name(id) {
        return Err("is a reserved device name on Windows".into());
    }
    Ok(())
}

/// What a text field's value must be, once templated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    Prompt,
    ExpandPrompt,
    ObjectName,
    ToolUrl,
    ReferenceUrl,
}

impl Rule {
    fn check(self, value: &str) -> Result<(), String> {
        let result = match self {
            Rule::Prompt => rules::check_prompt("prompt", value),
            Rule::ExpandPrompt if value.trim().is_empty() => {
                return Err("prompt is empty; leave it out instead".into());
            }
            Rule::ExpandPrompt => Ok(()),
            Rule::ObjectName if value.trim().is_empty() => {
                return Err("object_name is empty; say what to erase".into());
            }
            Rule::ObjectName => Ok(()),
            Rule::ToolUrl => rules::parse_absolute("image_url", value).map(|_| ()),
            Rule::ReferenceUrl => rules::parse_absolute("image_urls", value).and_then(|u| {
                if u.scheme() == "https" {
                    Ok(())
                } else {
                    Err(rules::InvalidField::new(
                        "image_urls",
                        format!("must be a public https URL, got {value:?}"),
                    ))
                }
            }),
        };
        result.map_err(|e| format!("{} {}", e.field, e.message))
    }
}

impl Checker<'_> {
    /// Cycles, the `once` rule and the reference-image limit; the order inputs-first when the
    /// graph is sound. Each check runs on whatever could be resolved, so one problem does not
    /// hide another.
    fn graph(&mut self, drafts: &[Draft<'_>]) -> Option<Vec<usize>> {
        let (order, acyclic) = self.topological(drafts);
        for d in drafts {
            for (r, at) in &d.refs {
                let from = &drafts[r.0];
                if d.once && !from.once {
                    self.error(
                        at.mark,
                        format!(
                            "step {} runs once for the whole batch (`once: true`) but reads per-item step {}",
                            shown(&d.id),
                            shown(&from.id)
                        ),
                    );
                }
            }
        }
        // Images per instance, where they can be known (not through a cycle or a broken step).
        let mut outputs: Vec<Option<u64>> = vec![None; drafts.len()];
        let mut visiting = vec![false; drafts.len()];
        for i in 0..drafts.len() {
            outputs_of(i, drafts, &mut outputs, &mut visiting);
        }
        for d in drafts {
            if let Some(Operation::Generate(g)) = &d.op {
                self.reference_limit(d, g, drafts, &outputs);
            }
        }
        let sound = acyclic && drafts.iter().all(|d| d.op.is_some());
        (sound && self.report.is_ok()).then_some(order)
    }

    fn reference_limit(
        &mut self,
        d: &Draft<'_>,
        g: &Generate,
        drafts: &[Draft<'_>],
        outputs: &[Option<u64>],
    ) {
        let mut total = 0;
        let mut parts = Vec::new();
        for r in &g.references {
            match r {
                Reference::Url(_) => total += 1,
                Reference::Step(s) => {
                    let Some(n) = outputs[s.0] else { return };
                    total += n;
                    parts.push(format!("{n} from {}", shown(&drafts[s.0].id)));
                }
            }
        }
        if total <= MAX_REFERENCE_IMAGES as u64 {
            return;
        }
        let op = d.node.get("generate").unwrap_or(d.node);
        let mark = mark_of(op.key("image_urls"), op);
        let listed = g
            .references
            .iter()
            .filter(|r| matches!(r, Reference::Url(_)))
            .count();
        parts.insert(0, format!("{listed} listed"));
        self.error(
            mark,
            format!(
                "image_urls adds up to {total} reference images ({}); the limit is {MAX_REFERENCE_IMAGES}",
                parts.join(", ")
            ),
        );
    }

    /// Depth-first order with inputs first; each cycle is reported with its path.
    fn topological(&mut self, drafts: &[Draft<'_>]) -> (Vec<usize>, bool) {
        #[derive(Clone, Copy, PartialEq)]
        enum State {
            New,
            Open,
            Done,
        }
        let mut state = vec![State::New; drafts.len()];
        let mut order = Vec::with_capacity(drafts.len());
        let mut cycles: Vec<Vec<usize>> = Vec::new();
        for start in 0..drafts.len() {
            if state[start] != State::New {
                continue;
            }
            // (step, next input to visit)
            let mut stack = vec![(start, 0usize)];
            state[start] = State::Open;
            while let Some((node, next)) = stack.last().copied() {
                let inputs = &drafts[node].refs;
                if next < inputs.len() {
                    stack.last_mut().expect("non-empty").1 += 1;
                    let child = inputs[next].0.0;
                    match state[child] {
                        State::New => {
                            state[child] = State::Open;
                            stack.push((child, 0));
                        }
                        State::Open => {
                            let from = stack.iter().position(|(s, _)| *s == child).unwrap_or(0);
                            cycles.push(stack[from..].iter().map(|(s, _)| *s).collect());
                        }
                        State::Done => {}
                    }
                } else {
                    state[node] = State::Done;
                    order.push(node);
                    stack.pop();
                }
            }
        }
        let mut seen = HashSet::new();
        for cycle in cycles {
            let mut key = cycle.clone();
            key.sort_unstable();
            if !seen.insert(key) {
                continue;
            }
            // Written in the direction data flows: input → step that reads it.
            let mut names: Vec<String> = cycle
                .iter()
                .rev()
                .map(|i| format!("`{}`", drafts[*i].id))
                .collect();
            names.push(names[0].clone());
            let first = &drafts[*cycle.iter().min().unwrap_or(&0)];
            let mark = mark_of(first.node.get("id"), first.node);
            self.error(mark, format!("steps form a cycle: {}", names.join(" → ")))
                .hint = Some("a step cannot read, directly or not, its own output".into());
        }
        (order, seen.is_empty())
    }

    /// Warns of a per-item edit that uses nothing from its item: every item would pay for the
    /// very same call.
    fn repeated_work(&mut self, drafts: &[Draft<'_>]) {
        for d in drafts.iter().filter(|d| !d.once) {
            let Some(Operation::Tool(tool)) = &d.op else {
                continue;
            };
            let shared_input = match &tool.input {
                Input::Url(t) => t.is_literal(),
                Input::Step(s) => drafts[s.0].once,
            };
            if shared_input && d.texts.iter().all(|(t, _, _)| t.is_literal()) {
                let mark = mark_of(d.node.get("id"), d.node);
                self.report.warn(
                    Diagnostic::new(self.file, mark, format!(
                        "step {} runs once per item but uses nothing from the item, so every item pays for the same edit",
                        shown(&d.id)
                    ))
                    .hint("mark it `once: true` to run it a single time"),
                );
            }
        }
    }

    /// Checks every template against every item it will be filled with.
    fn templates(&mut self, drafts: &[Draft<'_>], items: &Items) {
        for d in drafts {
            for (template, at, rule) in &d.texts {
                self.template_values(d, template, at, *rule, items);
            }
        }
    }

    fn template_values(
        &mut self,
        d: &Draft<'_>,
        t: &Template,
        at: &Node,
        rule: Rule,
        items: &Items,
    ) {
        if t.is_literal() {
            let value = t.render(|_| None).unwrap_or_default();
            if let Err(why) = rule.check(&value) {
                self.error(at.mark, why);
            }
            return;
        }
        let fields: Vec<&str> = t.fields().collect();
        if d.once {
            self.error(at.mark, format!(
                "step {} runs once for the whole batch, without an item, so it cannot use `{{{{ item.{} }}}}`",
                shown(&d.id),
                fields[0]
            ));
            return;
        }
        let mut complete = true;
        for field in &fields {
            if !items.is_empty() && !items.has_field(field) {
                complete = false;
                let names: Vec<&str> = std::iter::once("id").chain(items.field_names()).collect();
                let mut message = format!("no item has a field `{field}`");
                if let Some(best) = closest(field, names.iter().copied()) {
                    message.push_str(&format!("; did you mean `{best}`?"));
                }
                self.error(at.mark, message).hint = Some(format!(
                    "item fields: {}",
                    names
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        if !complete {
            return;
        }
        let mut shown_count = 0;
        let mut more = 0;
        for item in items.iter() {
            let problem = match t.render(|f| items.value(item, f)) {
                Err(missing) => Some(format!("has no field `{missing}`, which `{t}` uses")),
                Ok(value) => rule.check(&value).err(),
            };
            let Some(problem) = problem else { continue };
            if shown_count == SHOWN_PER_RULE {
                more += 1;
                continue;
            }
            shown_count += 1;
            let d = Diagnostic::new(
                self.file,
                at.mark,
                format!(
                    "{problem} (item written at {}:{})",
                    items.file, item.mark.line
                ),
            )
            .for_item(&item.id);
            self.report.error(d);
        }
        if more > 0 {
            self.error(
                at.mark,
                format!("…and {more} more items break the same rule here"),
            );
        }
    }
}

/// The steps in `order`, with references renumbered to match.
fn reorder(drafts: Vec<Draft<'_>>, order: &[usize]) -> Vec<Step> {
    let mut new_index = vec![0; drafts.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    let remap = |r: StepRef| StepRef(new_index[r.0]);
    let mut slots: Vec<Option<Step>> = drafts
        .into_iter()
        .map(|d| {
            let line = d.node.mark.line;
            let op = match d.op.expect("a sound graph has every operation") {
                Operation::Generate(mut g) => {
                    for r in &mut g.references {
                        if let Reference::Step(s) = r {
                            *s = remap(*s);
                        }
                    }
                    Operation::Generate(g)
                }
                Operation::Tool(mut t) => {
                    if let Input::Step(s) = &mut t.input {
                        *s = remap(*s);
                    }
                    Operation::Tool(t)
                }
            };
            Some(Step {
                id: d.id,
                once: d.once,
                op,
                line,
            })
        })
        .collect();
    order.iter().filter_map(|&old| slots[old].take()).collect()
}
