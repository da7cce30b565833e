//! The task graph: a checked pipeline unrolled into one task per paid call, each knowing the
//! outputs it reads and the tasks that read its own, and priced by the plan's costs (the one
//! place a task's price is computed), so the executor runs exactly what was planned.
//!
//! Every item repeats the same chain of tasks, so the graph holds that chain once (the
//! *shape*), with the batch's `once` tasks beside it, and computes any task from its number:
//! a batch of 100,000 items costs no more memory than one of ten. A task's call, with its
//! templates filled in from its item, is made only when it is asked for ([`Graph::work`]).
//! Tasks are numbered the batch's first, then item by item in file order, each item's in step
//! order: the number order is the order of the chain's keys (instance, step, index).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::api::types::{Size, ToolParams};
use crate::pipeline::items::Items;
use crate::pipeline::template::Template;
use crate::pipeline::{Input, Operation, Pipeline, Reference, StepRef, ToolOp};
use crate::place::layout;
use crate::plan::Costs;
use crate::task_key::TaskKey;

/// Whose chain a task belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Instance {
    /// A `once` step: one chain for the whole batch.
    Batch,
    /// The item at this index of the items list.
    Item(usize),
}

/// One image a task reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Output `k` of another task.
    Output { task: usize, k: u32 },
    /// A URL the pipeline wrote.
    Url(String),
}

/// The call a task makes, with every template filled in; only upstream URLs are left to
/// resolve at dispatch, since they change on every refresh.
#[derive(Clone, Debug)]
pub enum Work {
    Generate {
        prompt: String,
        n: u8,
        size: Size,
        references: Vec<Source>,
    },
    Tool {
        input: Source,
        preserve_alpha: Option<bool>,
        params: ToolParams,
    },
}

impl Work {
    pub fn sources(&self) -> Vec<&Source> {
        match self {
            Work::Generate { references, .. } => references.iter().collect(),
            Work::Tool { input, .. } => vec![input],
        }
    }
}

/// What identifies a task and prices it; the call itself is [`Graph::work`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Task {
    pub instance: Instance,
    pub step: StepRef,
    /// The task's number within its step and instance.
    pub idx: u32,
    /// Credits the plan prices it at.
    pub planned: u64,
}

/// Which chain a slot belongs to: the batch's, or the one every item repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Batch,
    Item,
}

/// An image a slot reads, before its item is known.
#[derive(Clone, Debug)]
enum SlotSource {
    Output { part: Part, slot: usize, k: u32 },
    Url(Template),
}

/// One task of a chain, for any item.
#[derive(Clone, Debug)]
struct Slot {
    step: StepRef,
    idx: u32,
    planned: u64,
    outputs: u32,
    sources: Vec<SlotSource>,
    /// Slots it reads, each once, in order.
    deps: Vec<(Part, usize)>,
    /// Slots of its own chain that read it.
    children: Vec<usize>,
    /// The longest chain of calls from it to the end of its chain, itself included.
    reach: u32,
}

pub struct Graph {
    items: Arc<Items>,
    steps: Vec<crate::pipeline::Step>,
    /// Step ids, by [`StepRef`].
    pub step_ids: Vec<String>,
    /// Whether a step makes more than one image per instance, so file names need an index.
    indexed: Vec<bool>,
    batch: Vec<Slot>,
    shape: Vec<Slot>,
    /// For each batch slot, the item slots that read it (in every item).
    batch_readers: Vec<Vec<usize>>,
    /// Each item chain's slot by step and index.
    slot_index: HashMap<(StepRef, u32), usize>,
}

impl Graph {
    /// Unrolls `pipeline`, each task priced at its step's price in `costs` (0 while unknown,
    /// for a run that discovers it). Every item's templates are checked here, so that
    /// [`Graph::work`] cannot fail later for a checked pipeline.
    pub fn build(pipeline: &Pipeline, costs: &Costs) -> Result<Graph, GraphError> {
        let mut batch: Vec<Slot> = Vec::new();
        let mut shape: Vec<Slot> = Vec::new();
        // The (part, slot, k) of every image of each step, in output order.
        let mut outputs: Vec<Vec<(Part, usize, u32)>> = vec![Vec::new(); pipeline.steps.len()];
        for r in pipeline.step_refs() {
            let step = pipeline.step(r);
            let part = if step.once { Part::Batch } else { Part::Item };
            let planned = costs
                .steps
                .get(r.0)
                .and_then(|s| s.credits_per_task)
                .unwrap_or(0);
            // The batch's chain cannot read an item's images.
            let of = |from: StepRef| -> Vec<SlotSource> {
                if part == Part::Batch && !pipeline.step(from).once {
                    return Vec::new();
                }
                outputs[from.0]
                    .iter()
                    .map(|&(part, slot, k)| SlotSource::Output { part, slot, k })
                    .collect()
            };
            let made: Vec<(Vec<SlotSource>, u32)> = match &step.op {
                Operation::Generate(g) => {
                    let mut sources = Vec::new();
                    for reference in &g.references {
                        match reference {
                            Reference::Url(t) => sources.push(SlotSource::Url(t.clone())),
                            Reference::Step(from) => sources.extend(of(*from)),
                        }
                    }
                    vec![(sources, u32::from(g.n))]
                }
                Operation::Tool(t) => match &t.input {
                    Input::Url(u) => vec![(vec![SlotSource::Url(u.clone())], 1)],
                    Input::Step(from) => of(*from).into_iter().map(|s| (vec![s], 1)).collect(),
                },
            };
            let chain = match part {
                Part::Batch => &mut batch,
                Part::Item => &mut shape,
            };
            let mut made_outputs = Vec::new();
            for (idx, (sources, n)) in made.into_iter().enumerate() {
                made_outputs.extend((0..n).map(|k| (part, chain.len(), k)));
                chain.push(Slot {
                    step: r,
                    idx: idx as u32,
                    planned,
                    outputs: n,
                    sources,
                    deps: Vec::new(),
                    children: Vec::new(),
                    reach: 1,
                });
            }
            outputs[r.0] = made_outputs;
        }
        let mut graph = Graph {
            items: Arc::clone(&pipeline.items),
            steps: pipeline.steps.clone(),
            step_ids: pipeline.steps.iter().map(|s| s.id.clone()).collect(),
            indexed: pipeline
                .step_refs()
                .map(|r| pipeline.outputs_per_instance(r) > 1)
                .collect(),
            batch_readers: vec![Vec::new(); batch.len()],
            slot_index: HashMap::new(),
            batch,
            shape,
        };
        graph.link();
        graph.check_items()?;
        Ok(graph)
    }

    /// The graph of a pipeline file's text, a 2K generated image at 4 credits: for tests of
    /// what reads graphs.
    #[cfg(test)]
    pub(crate) fn of_text(text: &str) -> Graph {
        let loaded = crate::pipeline::load_str("p.yaml", std::path::Path::new("."), text);
        let pipeline = loaded
            .pipeline
            .unwrap_or_else(|| panic!("{:?}", loaded.report));
        let price = crate::plan::GenerationPrice {
            credits: Some(4),
            source: crate::plan::PriceSource::Pipeline,
            notes: Vec::new(),
        };
        Graph::build(&pipeline, &Costs::of(&pipeline, &price)).expect("checked pipelines unroll")
    }

    fn link(&mut self) {
        for part in [Part::Batch, Part::Item] {
            let n = self.chain(part).len();
            for s in 0..n {
                let mut deps: Vec<(Part, usize)> = self.chain(part)[s]
                    .sources
                    .iter()
                    .filter_map(|src| match src {
                        SlotSource::Output { part, slot, .. } => Some((*part, *slot)),
                        SlotSource::Url(_) => None,
                    })
                    .collect();
                deps.sort_unstable_by_key(|(p, s)| (*p == Part::Item, *s));
                deps.dedup();
                for &(p, d) in &deps {
                    match (p, part) {
                        (Part::Batch, Part::Item) => self.batch_readers[d].push(s),
                        _ => self.chain_mut(p)[d].children.push(s),
                    }
                }
                self.chain_mut(part)[s].deps = deps;
            }
        }
        // Readers come after what they read: one pass from the end sees them first.
        for s in (0..self.shape.len()).rev() {
            let longest = self.shape[s].children.iter().map(|c| self.shape[*c].reach);
            self.shape[s].reach = longest.max().unwrap_or(0) + 1;
        }
        for s in (0..self.batch.len()).rev() {
            let own = self.batch[s].children.iter().map(|c| self.batch[*c].reach);
            let items = self.batch_readers[s].iter().map(|c| self.shape[*c].reach);
            self.batch[s].reach = own.chain(items).max().unwrap_or(0) + 1;
        }
        let slots = self
            .batch
            .iter()
            .enumerate()
            .chain(self.shape.iter().enumerate());
        self.slot_index = slots.map(|(s, slot)| ((slot.step, slot.idx), s)).collect();
    }

    /// Every item has every field its chain's templates name.
    fn check_items(&self) -> Result<(), GraphError> {
        let mut templates: Vec<&Template> = Vec::new();
        for slot in &self.shape {
            for src in &slot.sources {
                if let SlotSource::Url(t) = src {
                    templates.push(t);
                }
            }
            match &self.steps[slot.step.0].op {
                Operation::Generate(g) => templates.push(&g.prompt),
                Operation::Tool(t) => match &t.params {
                    ToolOp::Expand {
                        prompt: Some(p), ..
                    } => templates.push(p),
                    ToolOp::Erase { object_name } => templates.push(object_name),
                    _ => {}
                },
            }
        }
        templates.dedup_by(|a, b| std::ptr::eq(*a, *b));
        for item in self.items.iter().take(self.instances()) {
            for t in &templates {
                if let Some(field) = t.fields().find(|f| self.items.value(&item, f).is_none()) {
                    return Err(GraphError {
                        template: t.to_string(),
                        field: field.to_owned(),
                        item: item.id.clone(),
                    });
                }
            }
        }
        for slot in &self.batch {
            self.render_work(Instance::Batch, slot)?;
        }
        Ok(())
    }

    fn chain(&self, part: Part) -> &[Slot] {
        match part {
            Part::Batch => &self.batch,
            Part::Item => &self.shape,
        }
    }

    fn chain_mut(&mut self, part: Part) -> &mut Vec<Slot> {
        match part {
            Part::Batch => &mut self.batch,
            Part::Item => &mut self.shape,
        }
    }

    /// Items with a chain: none when every step runs once.
    pub fn instances(&self) -> usize {
        if self.shape.is_empty() {
            0
        } else {
            self.items.len()
        }
    }

    pub fn len(&self) -> usize {
        self.batch.len() + self.shape.len() * self.instances()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tasks of one instance, numbered consecutively.
    pub fn instance_tasks(&self, instance: Instance) -> Range<usize> {
        match instance {
            Instance::Batch => 0..self.batch.len(),
            Instance::Item(i) => {
                let start = self.batch.len() + i * self.shape.len();
                start..start + self.shape.len()
            }
        }
    }

    fn locate(&self, t: usize) -> (Instance, &Slot) {
        let nb = self.batch.len();
        if t < nb {
            (Instance::Batch, &self.batch[t])
        } else {
            let r = t - nb;
            let ns = self.shape.len();
            (Instance::Item(r / ns), &self.shape[r % ns])
        }
    }

    /// The number of `slot` of `part` in the chain of `instance`.
    fn id(&self, instance: Instance, part: Part, slot: usize) -> usize {
        match (part, instance) {
            (Part::Item, Instance::Item(i)) => self.batch.len() + i * self.shape.len() + slot,
            // The batch's tasks are the same for every item; the batch's chain reads no item's.
            _ => slot,
        }
    }

    pub fn task(&self, t: usize) -> Task {
        let (instance, slot) = self.locate(t);
        Task {
            instance,
            step: slot.step,
            idx: slot.idx,
            planned: slot.planned,
        }
    }

    /// The step task `t` is of, as the pipeline writes it.
    pub fn step_of(&self, t: usize) -> &crate::pipeline::Step {
        &self.steps[self.task(t).step.0]
    }

    /// The ids of the steps whose outputs are checked.
    pub fn checked_steps(&self) -> Vec<&str> {
        self.steps
            .iter()
            .filter(|s| s.checks.is_some())
            .map(|s| s.id.as_str())
            .collect()
    }

    /// Images the task makes.
    pub fn outputs(&self, t: usize) -> u32 {
        self.locate(t).1.outputs
    }

    /// Tasks whose outputs it reads, each once.
    pub fn deps(&self, t: usize) -> Vec<usize> {
        let (instance, slot) = self.locate(t);
        let deps = slot.deps.iter();
        deps.map(|&(part, s)| self.id(instance, part, s)).collect()
    }

    /// Tasks that read its outputs: for a batch task, in every item.
    pub fn children(&self, t: usize) -> Vec<usize> {
        let (instance, slot) = self.locate(t);
        match instance {
            Instance::Item(_) => {
                let own = slot.children.iter();
                own.map(|&c| self.id(instance, Part::Item, c)).collect()
            }
            Instance::Batch => {
                let mut out = slot.children.clone();
                for i in 0..self.instances() {
                    let readers = self.batch_readers[t].iter();
                    out.extend(readers.map(|&c| self.id(Instance::Item(i), Part::Item, c)));
                }
                out
            }
        }
    }

    /// The longest chain of calls from the task to the end of its item, itself included.
    pub fn reach(&self, t: usize) -> u32 {
        self.locate(t).1.reach
    }

    /// The longest chain of all.
    pub fn depth(&self) -> u32 {
        let items = if self.instances() > 0 {
            &self.shape[..]
        } else {
            &[]
        };
        let reach = self.batch.iter().chain(items).map(|s| s.reach);
        reach.max().unwrap_or(0)
    }

    /// Whether the task reads another task's images (whose URLs may expire), not only URLs.
    pub fn reads_outputs(&self, t: usize) -> bool {
        !self.locate(t).1.deps.is_empty()
    }

    /// The call task `t` makes, its templates filled in from its item.
    pub fn work(&self, t: usize) -> Result<Work, GraphError> {
        let (instance, slot) = self.locate(t);
        self.render_work(instance, slot)
    }

    fn render_work(&self, instance: Instance, slot: &Slot) -> Result<Work, GraphError> {
        let render = |t: &Template| self.render(instance, t);
        let mut sources = Vec::with_capacity(slot.sources.len());
        for src in &slot.sources {
            sources.push(match src {
                SlotSource::Output { part, slot, k } => Source::Output {
                    task: self.id(instance, *part, *slot),
                    k: *k,
                },
                SlotSource::Url(t) => Source::Url(render(t)?),
            });
        }
        Ok(match &self.steps[slot.step.0].op {
            Operation::Generate(g) => Work::Generate {
                prompt: render(&g.prompt)?,
                n: g.n,
                size: g.size,
                references: sources,
            },
            Operation::Tool(t) => Work::Tool {
                // [`Graph::build`] gives a tool's slot its one input, always.
                input: sources.pop().expect("a tool's slot has its one input"),
                preserve_alpha: t.preserve_alpha,
                params: tool_params(&t.params, &render)?,
            },
        })
    }

    fn render(&self, instance: Instance, t: &Template) -> Result<String, GraphError> {
        let item = match instance {
            Instance::Item(i) => self.items.get(i),
            Instance::Batch => None,
        };
        t.render(|field| item.as_ref().and_then(|item| self.items.value(item, field)))
            .map_err(|field| GraphError {
                template: t.to_string(),
                field,
                item: item.map_or_else(|| layout::BATCH.to_owned(), |i| i.id),
            })
    }

    /// The instance's directory: its item's id, read back from where the items are kept.
    pub fn item_dir(&self, instance: Instance) -> Cow<'static, str> {
        match instance {
            Instance::Batch => Cow::Borrowed(layout::BATCH),
            Instance::Item(i) => Cow::Owned(self.items.id(i).unwrap_or_default()),
        }
    }

    pub fn step_id(&self, task: usize) -> &str {
        &self.step_ids[self.locate(task).1.step.0]
    }

    /// The output's index within its step and instance, as file names and the manifest show it.
    pub fn output_index(&self, task: usize, k: u32) -> u32 {
        self.locate(task).1.idx + k
    }

    /// Output `k` of `task` by its own key: its task's, numbered by the output (`mug/shot[1]`
    /// is the second image of `mug/shot[0]`).
    pub fn output_key(&self, task: usize, k: u32) -> TaskKey {
        let (item, step, _) = self.key_ref(task);
        TaskKey::new(item, step, self.output_index(task, k))
    }

    /// `<step>` or `<step>-<index>`: the file name without its extension.
    pub fn file_stem(&self, task: usize, k: u32) -> String {
        if self.indexed[self.locate(task).1.step.0] {
            format!("{}-{}", self.step_id(task), self.output_index(task, k))
        } else {
            self.step_id(task).to_owned()
        }
    }

    /// Every task that reads, directly or not, an output of `task`.
    pub fn descendants(&self, task: usize) -> Vec<usize> {
        let (instance, slot) = self.locate(task);
        match instance {
            Instance::Item(_) => {
                let base = self.id(instance, Part::Item, 0);
                shape_below(&self.shape, slot.children.iter().copied())
                    .into_iter()
                    .map(|s| base + s)
                    .collect()
            }
            Instance::Batch => {
                let own = shape_below(&self.batch, slot.children.iter().copied());
                let mut readers: Vec<usize> = own
                    .iter()
                    .chain(std::iter::once(&task))
                    .flat_map(|b| self.batch_readers[*b].iter().copied())
                    .collect();
                readers.sort_unstable();
                readers.dedup();
                let mut below = shape_below(&self.shape, readers.iter().copied());
                below.sort_unstable();
                let mut out = own;
                for i in 0..self.instances() {
                    let base = self.id(Instance::Item(i), Part::Item, 0);
                    out.extend(below.iter().map(|s| base + s));
                }
                out
            }
        }
    }

    /// How the task is recorded: item directory, step id, index.
    pub fn key(&self, task: usize) -> TaskKey {
        let (item, step, idx) = self.key_ref(task);
        TaskKey::new(item, step, idx)
    }

    /// [`Graph::key`] with the step's id borrowed from the graph.
    pub fn key_ref(&self, task: usize) -> (Cow<'static, str>, &str, u32) {
        let (instance, slot) = self.locate(task);
        (
            self.item_dir(instance),
            &self.step_ids[slot.step.0],
            slot.idx,
        )
    }

    /// Finds tasks by their recorded key, holding one entry per item rather than per task.
    pub fn index(&self) -> KeyIndex<'_> {
        KeyIndex {
            graph: self,
            last: RefCell::new(None),
            steps: self
                .step_ids
                .iter()
                .enumerate()
                .map(|(i, s)| (s.as_str(), StepRef(i)))
                .collect(),
        }
    }

    /// A task's inputs as the database records them: other tasks' outputs or URLs.
    pub fn describe_inputs(&self, task: usize) -> String {
        let (instance, slot) = self.locate(task);
        let parts: Vec<String> = slot
            .sources
            .iter()
            .map(|s| match s {
                SlotSource::Output { part, slot, k } => self
                    .output_key(self.id(instance, *part, *slot), *k)
                    .to_string(),
                SlotSource::Url(t) => self.render(instance, t).unwrap_or_default(),
            })
            .collect();
        serde_json::to_string(&parts).unwrap_or_default()
    }
}

/// Slots of `chain` below `from` (included), each once.
fn shape_below(chain: &[Slot], from: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut seen = vec![false; chain.len()];
    let mut stack: Vec<usize> = from.collect();
    let mut out = Vec::new();
    while let Some(s) = stack.pop() {
        if !std::mem::replace(&mut seen[s], true) {
            out.push(s);
            stack.extend(chain[s].children.iter().copied());
        }
    }
    out
}

/// A graph's tasks by recorded key (item directory, step id, index).
pub struct KeyIndex<'g> {
    graph: &'g Graph,
    /// The last item found: rows come item by item, so most lookups are the one before.
    last: RefCell<Option<(String, usize)>>,
    steps: HashMap<&'g str, StepRef>,
}

impl KeyIndex<'_> {
    fn item(&self, id: &str) -> Option<usize> {
        let mut last = self.last.borrow_mut();
        if let Some((last_id, i)) = last.as_ref()
            && last_id == id
        {
            return Some(*i);
        }
        let i = self.graph.items.position(id)?;
        if i >= self.graph.instances() {
            return None;
        }
        *last = Some((id.to_owned(), i));
        Some(i)
    }

    /// The item of this id, when the graph has it.
    pub fn instance(&self, item: &str) -> Option<Instance> {
        self.item(item).map(Instance::Item)
    }

    /// The task named `key`, when the graph has it.
    pub fn of(&self, key: &TaskKey) -> Option<usize> {
        self.get(&key.item, &key.step, key.index)
    }

    pub fn get(&self, item: &str, step: &str, idx: u32) -> Option<usize> {
        let step = *self.steps.get(step)?;
        let slot = *self.graph.slot_index.get(&(step, idx))?;
        let once = self.graph.steps[step.0].once;
        match (once, item == layout::BATCH) {
            (true, true) => Some(slot),
            (false, false) => {
                let i = self.item(item)?;
                Some(self.graph.id(Instance::Item(i), Part::Item, slot))
            }
            _ => None,
        }
    }
}

/// A template that names an item field the item lacks. Checked pipelines never get here; the
/// type keeps the case honest rather than panicking.
#[derive(Debug, thiserror::Error)]
#[error("template {template} names item field {field:?}, which item {item:?} does not have")]
pub struct GraphError {
    pub template: String,
    pub field: String,
    pub item: String,
}

fn tool_params(
    op: &ToolOp,
    render: &impl Fn(&Template) -> Result<String, GraphError>,
) -> Result<ToolParams, GraphError> {
    Ok(match op {
        ToolOp::RemoveBackground => ToolParams::RemoveBackground,
        ToolOp::Upscale(i) => ToolParams::Upscale {
            desired_increase: *i,
        },
        ToolOp::Expand {
            aspect_ratio,
            prompt,
        } => ToolParams::Expand {
            aspect_ratio: *aspect_ratio,
            prompt: prompt.as_ref().map(render).transpose()?,
        },
        ToolOp::Erase { object_name } => ToolParams::Erase {
            object_name: render(object_name)?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(text: &str) -> Graph {
        Graph::of_text(text)
    }

    const CHAIN: &str = r#"
version: 1
name: t
items: [{ id: a }, { id: b }]
steps:
  - id: style
    once: true
    generate: { prompt: a style, size: 4K }
  - id: shot
    generate: { prompt: "shot {{ item.id }}", n: 2, image_urls: [{ from: style }] }
  - id: big
    upscale: { from: shot, desired_increase: 4 }
"#;

    #[test]
    fn a_chain_unrolls_per_image_with_the_batch_step_shared() {
        let g = graph(CHAIN);
        // 1 style + 2 shots + 2×2 upscales.
        assert_eq!(g.len(), 7);
        let style = g.task(0);
        assert_eq!((style.instance, style.planned), (Instance::Batch, 8));
        assert_eq!(g.children(0).len(), 2, "both items' shots read the style");
        let shot_b = (0..7)
            .find(|t| g.step_id(*t) == "shot" && g.task(*t).instance == Instance::Item(1))
            .unwrap();
        assert_eq!(g.task(shot_b).planned, 8);
        assert_eq!(g.deps(shot_b), vec![0]);
        let ups = g.children(shot_b);
        assert_eq!(ups.len(), 2);
        let stems: Vec<String> = ups.iter().map(|t| g.file_stem(*t, 0)).collect();
        assert_eq!(stems, ["big-0", "big-1"]);
        assert_eq!(g.item_dir(g.task(ups[0]).instance), "b");
        assert_eq!(g.item_dir(Instance::Batch), layout::BATCH);
        assert_eq!(g.file_stem(0, 0), "style");
        assert_eq!(g.descendants(0).len(), 6);
        assert_eq!(g.descendants(shot_b).len(), 2);
        assert_eq!(g.describe_inputs(ups[1]), r#"["b/shot[1]"]"#);
        let Ok(Work::Generate {
            prompt, references, ..
        }) = g.work(shot_b)
        else {
            panic!("a generation");
        };
        assert_eq!(prompt, "shot b");
        assert_eq!(references, [Source::Output { task: 0, k: 0 }]);
    }

    #[test]
    fn tasks_are_numbered_in_key_order_and_found_by_key() {
        let g = graph(CHAIN);
        let keys: Vec<TaskKey> = (0..g.len()).map(|t| g.key(t)).collect();
        let mut sorted = keys.clone();
        sorted.sort_by_key(|k| k.item != layout::BATCH);
        assert_eq!(keys, sorted, "the batch first, then items in order");
        let index = g.index();
        for t in 0..g.len() {
            let (item, step, idx) = g.key_ref(t);
            assert_eq!(index.get(&item, step, idx), Some(t));
        }
        assert_eq!(index.get("a", "style", 0), None);
        assert_eq!(index.get("c", "shot", 0), None);
        assert_eq!(g.instance_tasks(Instance::Item(1)), 4..7);
    }
}
