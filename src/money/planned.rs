//! What money reads of a run's recorded plan: its budget and each step's planned tasks and
//! price, and from them the credits planned for tasks the run has not recorded yet. The
//! ledger, the summary and the report count them alike.

use serde::Deserialize;

use crate::store::{RecordedPlan, StepCounts};

/// What the report, the desk and the spend ledger read of a run's recorded plan: its budget,
/// its items, and each step's planned tasks and price. Every field may be missing, so the plan
/// of a run recorded by any imgpipe reads, whatever else its document held then. Read from the
/// record in one place, [`PlanFigures::of`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct PlanFigures {
    #[serde(default)]
    budget: Option<BudgetFigure>,
    #[serde(default)]
    items: Option<ItemsFigure>,
    #[serde(default)]
    costs: CostFigures,
    /// `--items` / `--until`: the part the costs are of, and what the whole file costs.
    #[serde(default)]
    scope: Option<ScopeFigure>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
struct ScopeFigure {
    #[serde(default)]
    whole_credits: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
struct ItemsFigure {
    count: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
struct BudgetFigure {
    #[serde(default)]
    max_credits: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
struct CostFigures {
    #[serde(default)]
    steps: Vec<StepFigure>,
}

/// A step as the plan priced it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct StepFigure {
    pub step: String,
    pub tasks: u64,
    /// `None` when the price was unknown.
    #[serde(default)]
    pub credits_per_task: Option<u64>,
}

impl PlanFigures {
    /// The figures of a run's recorded plan; `None` when the record does not read.
    pub fn of(plan: &RecordedPlan) -> Option<PlanFigures> {
        plan.read()
    }

    /// How many items the plan read.
    pub fn item_count(&self) -> Option<usize> {
        self.items.as_ref().map(|i| i.count)
    }

    /// The budget the run was planned under.
    pub fn max_credits(&self) -> Option<u64> {
        self.budget.as_ref().and_then(|b| b.max_credits)
    }

    /// What the whole pipeline file cost when only a part of it was asked for (`--items`,
    /// `--until`); `None` when the plan priced it all, or a price was unknown.
    pub fn whole_credits(&self) -> Option<u64> {
        self.scope.as_ref().and_then(|s| s.whole_credits)
    }

    /// Each step the plan priced, in the plan's order.
    pub fn steps(&self) -> &[StepFigure] {
        &self.costs.steps
    }
}

/// The tasks the run has not recorded yet, per step: a run records an item's tasks only as
/// it comes near the item, so those of items it has not reached are counted from its plan.
/// They are all pending. `recorded(step)`: the step's tasks the run has recorded.
pub fn unrecorded(plan: &RecordedPlan, recorded: impl Fn(&str) -> u64) -> Vec<StepCounts> {
    let Some(plan) = PlanFigures::of(plan) else {
        return Vec::new();
    };
    plan.steps()
        .iter()
        .filter_map(|s| {
            let missing = s.tasks.checked_sub(recorded(&s.step)).filter(|m| *m > 0)?;
            let price = s.credits_per_task.unwrap_or(0);
            Some(StepCounts {
                step: s.step.clone(),
                tasks: missing,
                succeeded: 0,
                failed: 0,
                blocked: 0,
                pending: missing,
                planned_credits: missing * price,
                billed_credits: 0,
            })
        })
        .collect()
}
