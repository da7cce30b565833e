//! The task graph: a checked pipeline unrolled into one task per paid call, each knowing the
//! outputs it reads and the tasks that read its own, and priced by the plan's costs (the one
//! place a task's price is computed), so the executor runs exactly what was planned.

use crate::api::types::{Size, ToolParams};
use crate::layout;
use crate::pipeline::template::Template;
use crate::pipeline::{Input, Operation, Pipeline, Reference, StepRef, ToolOp};
use crate::plan::Costs;

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

#[derive(Clone, Debug)]
pub struct Task {
    pub instance: Instance,
    pub step: StepRef,
    /// The task's number within its step and instance.
    pub idx: u32,
    pub work: Work,
    /// Credits the plan prices it at.
    pub planned: u64,
    /// Tasks whose outputs it reads.
    pub deps: Vec<usize>,
    pub children: Vec<usize>,
}

impl Task {
    pub fn sources(&self) -> Vec<&Source> {
        match &self.work {
            Work::Generate { references, .. } => references.iter().collect(),
            Work::Tool { input, .. } => vec![input],
        }
    }

    pub fn outputs(&self) -> u32 {
        match &self.work {
            Work::Generate { n, .. } => u32::from(*n),
            Work::Tool { .. } => 1,
        }
    }
}

pub struct Graph {
    pub tasks: Vec<Task>,
    /// Directory names of the instances: item ids, and [`layout::BATCH`].
    item_ids: Vec<String>,
    /// Step ids, by [`StepRef`].
    pub step_ids: Vec<String>,
    /// Whether a step makes more than one image per instance, so file names need an index.
    indexed: Vec<bool>,
}

impl Graph {
    /// Unrolls `pipeline`, each task priced at its step's price in `costs` (0 while unknown,
    /// for a run that discovers it).
    pub fn build(pipeline: &Pipeline, costs: &Costs) -> Result<Graph, GraphError> {
        let mut graph = Graph {
            tasks: Vec::new(),
            item_ids: pipeline.items.iter().map(|i| i.id.clone()).collect(),
            step_ids: pipeline.steps.iter().map(|s| s.id.clone()).collect(),
            indexed: pipeline
                .step_refs()
                .map(|r| pipeline.outputs_per_instance(r) > 1)
                .collect(),
        };
        // outputs[(instance, step)]: the (task, k) of every image, in output order.
        let mut outputs =
            std::collections::HashMap::<(Instance, StepRef), Vec<(usize, u32)>>::new();
        let instances: Vec<Instance> = (0..pipeline.items.len()).map(Instance::Item).collect();
        for r in pipeline.step_refs() {
            let step = pipeline.step(r);
            let mine: &[Instance] = if step.once {
                &[Instance::Batch]
            } else {
                &instances
            };
            let planned = costs
                .steps
                .get(r.0)
                .and_then(|s| s.credits_per_task)
                .unwrap_or(0);
            for &instance in mine {
                let of = |from: StepRef| {
                    let inst = if pipeline.step(from).once {
                        Instance::Batch
                    } else {
                        instance
                    };
                    outputs.get(&(inst, from)).cloned().unwrap_or_default()
                };
                let render = |t: &Template| render(pipeline, instance, t);
                let made = match &step.op {
                    Operation::Generate(g) => {
                        let mut references = Vec::new();
                        for reference in &g.references {
                            match reference {
                                Reference::Url(t) => references.push(Source::Url(render(t)?)),
                                Reference::Step(from) => references.extend(
                                    of(*from)
                                        .into_iter()
                                        .map(|(task, k)| Source::Output { task, k }),
                                ),
                            }
                        }
                        vec![(
                            Work::Generate {
                                prompt: render(&g.prompt)?,
                                n: g.n,
                                size: g.size,
                                references,
                            },
                            planned,
                        )]
                    }
                    Operation::Tool(t) => {
                        let params = tool_params(&t.params, &render)?;
                        let inputs: Vec<Source> = match &t.input {
                            Input::Url(u) => vec![Source::Url(render(u)?)],
                            Input::Step(from) => of(*from)
                                .into_iter()
                                .map(|(task, k)| Source::Output { task, k })
                                .collect(),
                        };
                        inputs
                            .into_iter()
                            .map(|input| {
                                let work = Work::Tool {
                                    input,
                                    preserve_alpha: t.preserve_alpha,
                                    params: params.clone(),
                                };
                                (work, planned)
                            })
                            .collect()
                    }
                };
                let mut made_outputs = Vec::new();
                for (idx, (work, planned)) in made.into_iter().enumerate() {
                    let id = graph.tasks.len();
                    let task = Task {
                        instance,
                        step: r,
                        idx: idx as u32,
                        work,
                        planned,
                        deps: Vec::new(),
                        children: Vec::new(),
                    };
                    made_outputs.extend((0..task.outputs()).map(|k| (id, k)));
                    graph.tasks.push(task);
                }
                outputs.insert((instance, r), made_outputs);
            }
        }
        graph.link();
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
        for id in 0..self.tasks.len() {
            let mut deps: Vec<usize> = self.tasks[id]
                .sources()
                .into_iter()
                .filter_map(|s| match s {
                    Source::Output { task, .. } => Some(*task),
                    Source::Url(_) => None,
                })
                .collect();
            deps.sort_unstable();
            deps.dedup();
            for &d in &deps {
                self.tasks[d].children.push(id);
            }
            self.tasks[id].deps = deps;
        }
    }

    pub fn item_dir(&self, instance: Instance) -> &str {
        match instance {
            Instance::Batch => layout::BATCH,
            Instance::Item(i) => &self.item_ids[i],
        }
    }

    pub fn step_id(&self, task: usize) -> &str {
        &self.step_ids[self.tasks[task].step.0]
    }

    /// The output's index within its step and instance, as file names and the manifest show it.
    pub fn output_index(&self, task: usize, k: u32) -> u32 {
        self.tasks[task].idx + k
    }

    /// `<step>` or `<step>-<index>`: the file name without its extension.
    pub fn file_stem(&self, task: usize, k: u32) -> String {
        let t = &self.tasks[task];
        if self.indexed[t.step.0] {
            format!("{}-{}", self.step_id(task), self.output_index(task, k))
        } else {
            self.step_id(task).to_owned()
        }
    }

    /// Every task that reads, directly or not, an output of `task`.
    pub fn descendants(&self, task: usize) -> Vec<usize> {
        let mut seen = vec![false; self.tasks.len()];
        let mut stack = self.tasks[task].children.clone();
        let mut out = Vec::new();
        while let Some(t) = stack.pop() {
            if !std::mem::replace(&mut seen[t], true) {
                out.push(t);
                stack.extend(self.tasks[t].children.iter().copied());
            }
        }
        out
    }

    /// How the task is recorded: item directory, step id, index.
    pub fn key(&self, task: usize) -> (String, String, u32) {
        let t = &self.tasks[task];
        (
            self.item_dir(t.instance).to_owned(),
            self.step_id(task).to_owned(),
            t.idx,
        )
    }

    /// [`Graph::key`] borrowed from the graph: an index of every task by it costs no strings.
    pub fn key_ref(&self, task: usize) -> (&str, &str, u32) {
        let t = &self.tasks[task];
        (self.item_dir(t.instance), self.step_id(task), t.idx)
    }

    /// A task's inputs as the database records them: other tasks' outputs or URLs.
    pub fn describe_inputs(&self, task: usize) -> String {
        let parts: Vec<String> = self.tasks[task]
            .sources()
            .into_iter()
            .map(|s| match s {
                Source::Output { task: t, k } => format!(
                    "{}/{}[{}]",
                    self.item_dir(self.tasks[*t].instance),
                    self.step_id(*t),
                    self.output_index(*t, *k)
                ),
                Source::Url(u) => u.clone(),
            })
            .collect();
        serde_json::to_string(&parts).unwrap_or_default()
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

fn render(pipeline: &Pipeline, instance: Instance, t: &Template) -> Result<String, GraphError> {
    let item = match instance {
        Instance::Item(i) => pipeline.items.get(i),
        Instance::Batch => None,
    };
    t.render(|field| item.and_then(|item| pipeline.items.value(item, field)))
        .map_err(|field| GraphError {
            template: t.to_string(),
            field: field.to_string(),
            item: item.map_or_else(|| layout::BATCH.to_owned(), |i| i.id.clone()),
        })
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

    #[test]
    fn a_chain_unrolls_per_image_with_the_batch_step_shared() {
        let g = graph(
            r#"
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
"#,
        );
        // 1 style + 2 shots + 2×2 upscales.
        assert_eq!(g.tasks.len(), 7);
        let style = &g.tasks[0];
        assert_eq!((style.instance, style.planned), (Instance::Batch, 8));
        assert_eq!(style.children.len(), 2, "both items' shots read the style");
        let shot_b = (0..7)
            .find(|t| g.step_id(*t) == "shot" && g.tasks[*t].instance == Instance::Item(1))
            .unwrap();
        assert_eq!(g.tasks[shot_b].planned, 8);
        assert_eq!(g.tasks[shot_b].deps, vec![0]);
        let ups: Vec<usize> = g.tasks[shot_b].children.clone();
        assert_eq!(ups.len(), 2);
        let stems: Vec<String> = ups.iter().map(|t| g.file_stem(*t, 0)).collect();
        assert_eq!(stems, ["big-0", "big-1"]);
        assert_eq!(g.item_dir(g.tasks[ups[0]].instance), "b");
        assert_eq!(g.item_dir(Instance::Batch), layout::BATCH);
        assert_eq!(g.file_stem(0, 0), "style");
        assert_eq!(g.descendants(0).len(), 6);
        assert_eq!(g.describe_inputs(ups[1]), r#"["b/shot[1]"]"#);
    }
}
