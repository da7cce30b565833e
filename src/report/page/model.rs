//! What the pages show, read from the state database (and the run's files) alone: a report
//! needs neither the pipeline file nor the network, and works while the run goes on.
//!
//! [`Shared`] is what every page knows of the run (its row, the costs summed by the database,
//! the calls that may have been billed); [`Model`] is one page's items: their tasks, outputs
//! and lineage. Only one page's items are ever held at once.

use std::collections::HashMap;
use std::path::Path;

use crate::money::planned::PlanFigures;
use crate::report::live::Observed;
use crate::report::page::commands::Commands;
use crate::report::page::lineage::Lineage;
use crate::report::page::pages::Pages;
use crate::report::page::thumbs::Preview;
use crate::store::{AmbiguousAttempt, CheckCounts, EarlierOutput, OutputId, ReportOutput};
use crate::store::{ReportTask, Run, ShownVerdict, Spend};
use crate::store::{RunStatus, StepTotals, TaskStatus};
use crate::store::{Store, StoreError};

/// Points of the spend chart: finer than its width in pixels, and a fixed number whatever the
/// run's calls.
const SPEND_BUCKETS: i64 = 1024;

/// One output with its preview.
pub(super) struct Shown {
    pub row: ReportOutput,
    pub preview: Preview,
}

/// An earlier version of an output (set aside under `_superseded/`), with its preview.
pub(super) struct Earlier {
    pub row: EarlierOutput,
    pub preview: Preview,
}

/// What every page of the report knows of the run.
pub(super) struct Shared {
    pub run: Run,
    pub generated_at: i64,
    pub ambiguous: Vec<AmbiguousAttempt>,
    pub spend: Vec<Spend>,
    pub last_balance: Option<i64>,
    pub superseded: u64,
    /// What the run's checks did (all zero for a pipeline without checks).
    pub checks: CheckCounts,
    pub budget: Option<u64>,
    /// Per step, in the order first recorded, removed tasks apart.
    pub step_totals: Vec<StepTotals>,
    /// Items shown (the batch's `once` steps count as one).
    pub items: u64,
    pub pages: Pages,
    /// The run's process and how to continue the run, beyond what the record says: an
    /// unfinished run always has a command that continues it.
    pub observed: Observed,
    /// How the page's commands find this run again.
    pub commands: Commands,
}

/// One page: its items' tasks (after those of the batch it may link to), outputs and lineage.
pub(super) struct Model<'a> {
    pub shared: &'a Shared,
    /// 1-based.
    pub page: usize,
    /// `tasks[..borrowed]` are the batch's, drawn on the first page: only linked from here.
    pub borrowed: usize,
    pub tasks: Vec<ReportTask>,
    /// Outputs by task index, in `k` order.
    pub outputs: HashMap<usize, Vec<Shown>>,
    /// Earlier versions of the outputs by task index, in `k` order, the oldest first.
    pub earlier: HashMap<usize, Vec<Earlier>>,
    /// The checks' verdicts on the page's outputs (none when the run judged nothing).
    pub verdicts: HashMap<OutputId, Vec<ShownVerdict>>,
    pub lineage: Lineage,
}

/// One line of the cost table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct StepCost {
    pub step: String,
    pub tasks: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    pub pending: u64,
    pub reused: u64,
    pub planned: u64,
    pub billed: u64,
    /// What calls sent without a complete answer may have cost.
    pub at_risk: u64,
}

impl StepCost {
    fn add(&mut self, other: &StepTotals) {
        self.tasks += other.tasks;
        self.succeeded += other.succeeded;
        self.failed += other.failed;
        self.blocked += other.blocked;
        self.pending += other.pending;
        self.reused += other.reused;
        self.planned += other.planned;
        self.billed += other.billed;
        self.at_risk += other.at_risk;
    }

    fn named(step: &str) -> StepCost {
        StepCost {
            step: step.to_owned(),
            ..StepCost::default()
        }
    }
}

impl Shared {
    /// Reads what every page needs: sums and short lists, never a row per task. A
    /// `portable` page (of a run in object storage) names no local file.
    pub(super) async fn load(
        store: &Store,
        run: Run,
        first_page: &Path,
        mut observed: Observed,
        portable: bool,
    ) -> Result<Shared, StoreError> {
        let generated_at = crate::store::now_ms();
        let in_progress = run.status == RunStatus::Running;
        let budget = PlanFigures::of(&run.plan).and_then(|p| p.max_credits());
        let end = run.finished_at.unwrap_or(generated_at);
        let items = store.report().items(&run.id).await?;
        let commands = Commands::new(&run.id, store.location(), portable);
        if observed.continue_with.is_none() && run.status.unfinished() {
            observed.continue_with = Some(commands.resume(&run.id));
        }
        Ok(Shared {
            ambiguous: store.runs().ambiguous_attempts(&run.id).await?,
            spend: store
                .report()
                .spend(&run.id, run.created_at, end, SPEND_BUCKETS)
                .await?,
            last_balance: store.report().last_balance(&run.id).await?,
            superseded: store.runs().superseded_count(&run.id).await?,
            checks: store.verdicts().counts(&run.id).await?,
            step_totals: store.report().step_totals(&run.id, !in_progress).await?,
            pages: Pages::new(first_page, items),
            generated_at,
            budget,
            items,
            run,
            observed,
            commands,
        })
    }

    pub(super) fn in_progress(&self) -> bool {
        self.run.status == RunStatus::Running
    }

    /// A call without an answer yet, of a run still going: not (yet) a possibly billed call.
    /// A run whose process is gone reads `interrupted` here ([`crate::report::live`]).
    pub(super) fn in_flight(&self, a: &AmbiguousAttempt) -> bool {
        a.in_flight && self.in_progress()
    }

    /// The cost of each step in `order` (producers first), then the total. Removed tasks only
    /// count in a line of their own (returned apart), since the pipeline no longer has their
    /// step.
    pub(super) fn costs(&self, order: &[String]) -> (Vec<StepCost>, StepCost, Option<StepCost>) {
        let mut steps: Vec<StepCost> = order.iter().map(|s| StepCost::named(s)).collect();
        let mut removed = StepCost::named("removed from the pipeline");
        for t in &self.step_totals {
            if t.removed {
                removed.add(t);
            } else if let Some(line) = steps.iter_mut().find(|s| s.step == t.step) {
                line.add(t);
            }
        }
        // Items the run has not reached have no rows yet: their tasks are pending, per the plan.
        let recorded = |step: &str| steps.iter().find(|s| s.step == step).map_or(0, |s| s.tasks);
        let extras = crate::money::planned::unrecorded(&self.run.plan, recorded);
        for extra in extras {
            if let Some(line) = steps.iter_mut().find(|s| s.step == extra.step) {
                line.tasks += extra.tasks;
                line.pending += extra.pending;
                line.planned += extra.planned_credits;
            }
        }
        let mut total = StepCost::named("total");
        for s in &steps {
            total.tasks += s.tasks;
            total.succeeded += s.succeeded;
            total.failed += s.failed;
            total.blocked += s.blocked;
            total.pending += s.pending;
            total.reused += s.reused;
            total.planned += s.planned;
            total.billed += s.billed;
            total.at_risk += s.at_risk;
        }
        // Removed tasks' planned credits are no longer part of the plan: only what they were
        // billed counts in the total.
        let removed = (removed.tasks > 0).then(|| {
            total.billed += removed.billed;
            total.at_risk += removed.at_risk;
            removed
        });
        (steps, total, removed)
    }

    /// Why a task shows no picture.
    pub(super) fn reason(&self, t: &ReportTask) -> String {
        let recorded = t.error.clone();
        match t.status {
            TaskStatus::Failed => recorded.unwrap_or_else(|| "failed".into()),
            TaskStatus::Blocked => {
                recorded.unwrap_or_else(|| "an input failed, so it was not run".into())
            }
            TaskStatus::Running if self.in_progress() => "a call is in flight".into(),
            TaskStatus::Running => {
                "a call was in flight when the run ended: it may have been billed".into()
            }
            TaskStatus::Pending if self.in_progress() => "waiting its turn".into(),
            TaskStatus::Pending => match &self.run.stop_reason {
                Some(why) => format!("not run: the run stopped ({why})"),
                None => "not run: the run ended before it".into(),
            },
            TaskStatus::Succeeded => "succeeded, but no output is recorded".into(),
        }
    }
}

impl Model<'_> {
    pub(super) fn reason(&self, t: &ReportTask) -> String {
        self.shared.reason(t)
    }

    pub(super) fn images(&self) -> impl Iterator<Item = &Shown> {
        self.outputs.values().flatten()
    }
}
