//! The cost plan: every task of a checked pipeline priced, totalled, and held against the
//! budget and the balance.
//!
//! Tool prices are the spec's. The generation price is not published, so it comes from the
//! pipeline's `pricing`, else from a price the models list states; otherwise it is unknown,
//! and the plan says which steps that leaves unpriced instead of guessing.

pub mod document;
pub mod graph;
pub mod render;
pub mod rerolls;
pub mod rows;
pub mod scope;

use serde::{Deserialize, Serialize};

use crate::api::job_id::JobId;
use crate::api::records::Models;
use crate::api::types::{Increase, ToolName, tool_price};
use crate::money::limit::{Balance, Budget};
use crate::pipeline::{Operation, Pipeline, StepRef};

/// Where a price came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PriceSource {
    /// The spec's fixed tool prices.
    Spec,
    /// The pipeline file's `pricing.generation`.
    Pipeline,
    /// A field of `GET /v1/models`, at this JSON pointer.
    Models { pointer: String },
    /// What a generation billed (`run --discover-price`).
    Discovered {
        /// `None` only for a task recorded succeeded without its job.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job_id: Option<JobId>,
    },
    /// Nowhere: the plan cannot total this step.
    Unknown { reason: String },
}

impl PriceSource {
    pub fn describe(&self) -> String {
        match self {
            PriceSource::Spec => "spec".into(),
            PriceSource::Pipeline => "pipeline pricing.generation".into(),
            PriceSource::Models { pointer } => format!("GET /v1/models {pointer}"),
            PriceSource::Discovered {
                job_id: Some(job_id),
            } => format!("billed by job {job_id}"),
            PriceSource::Discovered { job_id: None } => "billed by a job".to_owned(),
            PriceSource::Unknown { .. } => "unknown".into(),
        }
    }
}

/// The price of a 2K generated image, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationPrice {
    pub credits: Option<u64>,
    pub source: PriceSource,
    /// Disagreements between sources, for the user to look at.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// What was learned of the models list, if it was asked.
pub enum ModelsAnswer<'a> {
    Fetched(&'a Models),
    /// Not asked, and why.
    NotAsked(&'static str),
    /// Asked, and the call failed.
    Failed(String),
}

impl GenerationPrice {
    /// The pipeline's price first, then one the models list states; never a guess.
    pub fn resolve(pipeline: &Pipeline, models: ModelsAnswer<'_>) -> GenerationPrice {
        let mut price = Self::pick(pipeline, models);
        if price.credits == Some(0) {
            price
                .notes
                .push("a generated image is priced at 0 credits; check that this is right".into());
        }
        price
    }

    fn pick(pipeline: &Pipeline, models: ModelsAnswer<'_>) -> GenerationPrice {
        let advertised = match &models {
            ModelsAnswer::Fetched(m) => m.generation_price(),
            ModelsAnswer::NotAsked(_) | ModelsAnswer::Failed(_) => None,
        };
        let mut notes = Vec::new();
        if let Some(credits) = pipeline.generation_price {
            if let Some(found) = advertised.filter(|f| f.value != credits) {
                notes.push(format!(
                    "the pipeline prices a generated image at {} but GET /v1/models says {} (at {}); the plan uses the pipeline's",
                    crate::money::credits(credits),
                    found.value, found.pointer
                ));
            }
            return GenerationPrice {
                credits: Some(credits),
                source: PriceSource::Pipeline,
                notes,
            };
        }
        if let Some(found) = advertised {
            return GenerationPrice {
                credits: Some(found.value),
                source: PriceSource::Models {
                    pointer: found.pointer,
                },
                notes,
            };
        }
        let models_said = match models {
            ModelsAnswer::Fetched(m) if m.generation_prices().len() > 1 => {
                let stated: Vec<String> = m
                    .generation_prices()
                    .iter()
                    .map(|f| format!("{} at {}", f.value, f.pointer))
                    .collect();
                format!(
                    "the models in GET /v1/models state different prices ({}), and imgpipe does not pick one",
                    stated.join(", ")
                )
            }
            ModelsAnswer::Fetched(_) => "GET /v1/models states no per-image price".to_owned(),
            ModelsAnswer::NotAsked(why) => format!("GET /v1/models was not asked ({why})"),
            ModelsAnswer::Failed(why) => format!("GET /v1/models failed ({why})"),
        };
        GenerationPrice {
            credits: None,
            source: PriceSource::Unknown {
                reason: format!(
                    "the service does not publish it, the pipeline sets no `pricing.generation`, and {models_said}"
                ),
            },
            notes,
        }
    }
}

/// One step's line of the plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCost {
    pub step: String,
    /// As the file names it: `generate`, `erase`, `expand`, `upscale`, `remove_background`.
    pub operation: String,
    /// What sets the price: `2K ×2` for a generation, `4x` for an upscale, else empty.
    #[serde(default)]
    pub detail: String,
    pub once: bool,
    pub tasks: u64,
    /// `None` when the price is unknown.
    pub credits_per_task: Option<u64>,
    pub subtotal: Option<u64>,
    pub price_source: PriceSource,
}

/// The priced pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Costs {
    pub steps: Vec<StepCost>,
    pub tasks: u64,
    /// Sum of the subtotals whose price is known.
    pub known_credits: u64,
    /// The whole total, when every price is known.
    pub total_credits: Option<u64>,
    /// Steps without a price.
    pub unpriced_steps: Vec<String>,
}

impl Costs {
    pub fn of(pipeline: &Pipeline, generation: &GenerationPrice) -> Costs {
        Costs::scoped(pipeline, generation, &scope::Scope::all())
    }

    /// The tasks of `scope` priced (its items and steps): what `--items` and `--until` pay.
    pub fn scoped(
        pipeline: &Pipeline,
        generation: &GenerationPrice,
        scope: &scope::Scope,
    ) -> Costs {
        let steps: Vec<StepCost> = pipeline
            .step_refs()
            .map(|r| {
                let instances = match (scope.has_step(r), pipeline.step(r).once) {
                    (false, _) => 0,
                    (true, true) => 1,
                    (true, false) => scope
                        .items_chosen()
                        .map_or_else(|| pipeline.instances(r), |n| n as u64),
                };
                let tasks = instances * pipeline.tasks_per_instance(r);
                step_cost(pipeline, r, generation, tasks)
            })
            .collect();
        // Saturating: an absurd price must give a total over any budget, not wrap around.
        let tasks = steps.iter().fold(0u64, |a, s| a.saturating_add(s.tasks));
        let known_credits = steps
            .iter()
            .filter_map(|s| s.subtotal)
            .fold(0u64, u64::saturating_add);
        let unpriced_steps: Vec<String> = steps
            .iter()
            .filter(|s| s.subtotal.is_none())
            .map(|s| s.step.clone())
            .collect();
        Costs {
            total_credits: unpriced_steps.is_empty().then_some(known_credits),
            steps,
            tasks,
            known_credits,
            unpriced_steps,
        }
    }
}

fn step_cost(
    pipeline: &Pipeline,
    r: StepRef,
    generation: &GenerationPrice,
    tasks: u64,
) -> StepCost {
    let step = pipeline.step(r);
    let (detail, per_task, source) = match &step.op {
        Operation::Generate(g) => (
            format!("{} ×{}", g.size, g.n),
            generation
                .credits
                .map(|p| p.saturating_mul(u64::from(g.n) * g.size.price_multiplier())),
            generation.source.clone(),
        ),
        Operation::Tool(t) => {
            let detail = match t.params {
                crate::pipeline::ToolOp::Upscale(i) => format!("{}x", i.factor()),
                _ => String::new(),
            };
            (detail, Some(t.params.credits()), PriceSource::Spec)
        }
    };
    StepCost {
        step: step.id.clone(),
        operation: step.operation().to_owned(),
        detail,
        once: step.once,
        tasks,
        credits_per_task: per_task,
        // A step with no tasks costs nothing, priced or not.
        subtotal: match per_task {
            Some(p) => Some(p.saturating_mul(tasks)),
            None if tasks == 0 => Some(0),
            None => None,
        },
        price_source: source,
    }
}

/// The spec's tool prices, as a plan records them.
pub fn tool_prices() -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for tool in ToolName::ALL {
        if tool == ToolName::Upscale {
            for i in [Increase::X2, Increase::X4] {
                out.push((format!("upscale_{}x", i.factor()), tool_price(tool, i)));
            }
        } else {
            out.push((tool.as_str().to_owned(), tool_price(tool, Increase::X2)));
        }
    }
    out
}

/// The plan of `scope` alone: its tasks priced and judged against the budget and the balance,
/// with what the whole file would cost beside them. `doc` is the plan of the whole file.
pub fn narrow(
    mut doc: document::PlanDocument,
    pipeline: &Pipeline,
    scope: &scope::Scope,
) -> document::PlanDocument {
    if scope.is_all() {
        return doc;
    }
    let narrowed = Costs::scoped(pipeline, &doc.prices.generation, scope);
    let whole = std::mem::replace(&mut doc.costs, narrowed);
    doc.judge(pipeline);
    doc.scope = Some(document::ScopePlan {
        asked: scope.said.clone(),
        items: scope.items_chosen().unwrap_or(pipeline.items.len()),
        of_items: pipeline.items.len(),
        whole_tasks: whole.tasks,
        whole_credits: whole.total_credits,
    });
    doc
}

/// The plan of `pipeline` at the service's word: every step priced, the total and the
/// rerolls' worst case held against the budget (the pipeline's, lowered by `max_credits`) and
/// the balance.
pub fn make(
    pipeline: &Pipeline,
    generation: GenerationPrice,
    balance: Balance,
    max_credits: Option<u64>,
) -> document::PlanDocument {
    let costs = Costs::of(pipeline, &generation);
    let budget = Budget::pick(pipeline.max_credits, max_credits);
    document::PlanDocument::new(
        pipeline,
        document::Prices::new(generation),
        costs,
        budget,
        balance,
    )
}
