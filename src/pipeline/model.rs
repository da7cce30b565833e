//! A checked pipeline: what `plan` prices and `run` executes. Every reference points at a step
//! that exists, the steps are in an order where inputs come first, and every limit of the spec
//! holds for every item.

use std::num::NonZeroU32;

use crate::api::types::{AspectRatio, Increase, Size, ToolName, tool_price};
use crate::pipeline::checks::{Rerolls, StepChecks};
use crate::pipeline::items::Items;
use crate::pipeline::rate::Rate;
use crate::pipeline::template::Template;
use crate::place::Address;
use crate::sha256::Sha256Sum;

#[derive(Clone, Debug)]
pub struct Pipeline {
    pub name: String,
    /// The pipeline file as the user named it.
    pub file: String,
    /// sha256 of the file's bytes.
    pub text_sha256: Sha256Sum,
    /// Resolved against the pipeline file's directory.
    pub output_dir: Address,
    pub max_credits: Option<u64>,
    /// `pricing.generation`: credits per 2K image, when the file sets it.
    pub generation_price: Option<u64>,
    /// `rerolls:`, what paying again for outputs that failed a check may spend.
    pub rerolls: Option<Rerolls>,
    pub concurrency: Option<NonZeroU32>,
    pub rate_limit: Option<Rate>,
    /// `reuse: true`: earlier runs' results of the same tasks are taken, not paid for again.
    pub reuse: bool,
    /// `notify:`, the webhook the run's events go to unless the command line names one.
    pub notify: Option<url::Url>,
    /// Shared: a task graph renders its templates from them, and a batch holds them once.
    pub items: std::sync::Arc<Items>,
    /// In an order where every step comes after its inputs.
    pub steps: Vec<Step>,
}

/// Index of a step in [`Pipeline::steps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StepRef(pub usize);

#[derive(Clone, Debug)]
pub struct Step {
    pub id: String,
    /// Runs a single time for the batch rather than once per item.
    pub once: bool,
    pub op: Operation,
    /// Line of the step in the pipeline file.
    pub line: usize,
    /// What judges each stored output, and what a failure does; `None` when nothing does.
    pub checks: Option<StepChecks>,
}

#[derive(Clone, Debug)]
pub enum Operation {
    Generate(Generate),
    Tool(Tool),
}

#[derive(Clone, Debug)]
pub struct Generate {
    pub prompt: Template,
    pub n: u8,
    pub size: Size,
    pub references: Vec<Reference>,
}

#[derive(Clone, Debug)]
pub enum Reference {
    Url(Template),
    /// Every output image of the step.
    Step(StepRef),
}

#[derive(Clone, Debug)]
pub struct Tool {
    pub input: Input,
    pub preserve_alpha: Option<bool>,
    pub params: ToolOp,
}

#[derive(Clone, Debug)]
pub enum Input {
    /// One task per output image of the step.
    Step(StepRef),
    Url(Template),
}

#[derive(Clone, Debug)]
pub enum ToolOp {
    RemoveBackground,
    Upscale(Increase),
    Expand {
        aspect_ratio: Option<AspectRatio>,
        prompt: Option<Template>,
    },
    Erase {
        object_name: Template,
    },
}

impl ToolOp {
    pub fn tool(&self) -> ToolName {
        match self {
            ToolOp::RemoveBackground => ToolName::RemoveBackground,
            ToolOp::Upscale(_) => ToolName::Upscale,
            ToolOp::Expand { .. } => ToolName::Expand,
            ToolOp::Erase { .. } => ToolName::Erase,
        }
    }

    pub fn credits(&self) -> u64 {
        match self {
            ToolOp::Upscale(increase) => tool_price(ToolName::Upscale, *increase),
            other => tool_price(other.tool(), Increase::X2),
        }
    }
}

impl Step {
    /// The operation's name as the file writes it.
    pub fn operation(&self) -> &'static str {
        match &self.op {
            Operation::Generate(_) => "generate",
            Operation::Tool(t) => t.params.tool().as_str(),
        }
    }
}

impl Pipeline {
    pub fn step(&self, r: StepRef) -> &Step {
        &self.steps[r.0]
    }

    /// How many times the step's chain is instantiated: once, or once per item.
    pub fn instances(&self, r: StepRef) -> u64 {
        if self.step(r).once {
            1
        } else {
            self.items.len() as u64
        }
    }

    /// Calls the step makes per instance: one per image of its input step for a tool reading
    /// a step, else one.
    pub fn tasks_per_instance(&self, r: StepRef) -> u64 {
        match &self.step(r).op {
            Operation::Tool(Tool {
                input: Input::Step(from),
                ..
            }) => self.outputs_per_instance(*from),
            _ => 1,
        }
    }

    /// Images the step produces per instance: `n` for a generation; one per call for a tool.
    pub fn outputs_per_instance(&self, r: StepRef) -> u64 {
        match &self.step(r).op {
            Operation::Generate(g) => u64::from(g.n),
            Operation::Tool(_) => self.tasks_per_instance(r),
        }
    }

    pub fn tasks(&self, r: StepRef) -> u64 {
        self.instances(r) * self.tasks_per_instance(r)
    }

    pub fn step_refs(&self) -> impl Iterator<Item = StepRef> {
        (0..self.steps.len()).map(StepRef)
    }

    pub fn has_generation(&self) -> bool {
        self.steps
            .iter()
            .any(|s| matches!(s.op, Operation::Generate(_)))
    }
}
