//! Everything the page shows, read from the state database (and the run's files) alone: a
//! report needs neither the pipeline file nor the network, and works while the run goes on.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::report::lineage::Lineage;
use crate::report::thumbs::{self, Preview};
use crate::store::{AmbiguousAttempt, OutputRow, ReportTask, RunRow, Spend, Store, StoreError};
use crate::store::{RunStatus, TaskStatus};

/// One output with its preview.
pub(super) struct Shown {
    pub row: OutputRow,
    pub preview: Preview,
}

pub(super) struct Model {
    pub run: RunRow,
    pub generated_at: i64,
    /// Every task, removed ones included (they only count in the costs).
    pub tasks: Vec<ReportTask>,
    /// Index in `tasks` by task id.
    by_id: HashMap<i64, usize>,
    /// Outputs by task index, in `k` order.
    pub outputs: HashMap<usize, Vec<Shown>>,
    pub lineage: Lineage,
    pub ambiguous: Vec<AmbiguousAttempt>,
    pub spend: Vec<Spend>,
    pub last_balance: Option<i64>,
    pub superseded: u64,
    pub budget: Option<u64>,
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
    fn add(&mut self, other: &StepCost) {
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
}

impl Model {
    /// Reads the run and makes the thumbnails it lacks under `thumbs`.
    pub(super) async fn load(
        store: &Store,
        run: RunRow,
        thumbs: &Path,
    ) -> Result<Model, StoreError> {
        let tasks = store.report_tasks(&run.id).await?;
        let by_id: HashMap<i64, usize> = tasks.iter().enumerate().map(|(i, t)| (t.id, i)).collect();
        let rows = store.outputs(&run.id).await?;
        // Previews of the downloaded files, in the order of their rows.
        let files: Vec<(PathBuf, Option<String>)> = rows
            .iter()
            .filter_map(|o| Some((PathBuf::from(o.path.as_deref()?), o.sha256.clone())))
            .collect();
        let mut made = thumbs::previews(thumbs, files).await.into_iter();
        let mut outputs: HashMap<usize, Vec<Shown>> = HashMap::new();
        for row in rows {
            let preview = if row.path.is_some() {
                made.next().unwrap_or_default()
            } else {
                Preview::default()
            };
            if let Some(&t) = by_id.get(&row.task_id) {
                outputs.entry(t).or_default().push(Shown { row, preview });
            }
        }
        let budget = serde_json::from_str::<serde_json::Value>(&run.plan_json)
            .ok()
            .and_then(|v| v.pointer("/budget/max_credits").and_then(|b| b.as_u64()));
        Ok(Model {
            lineage: Lineage::build(&tasks),
            ambiguous: store.ambiguous_attempts(&run.id).await?,
            spend: store.spend(&run.id).await?,
            last_balance: store.last_reported_balance(&run.id).await?,
            superseded: store.superseded_count(&run.id).await?,
            generated_at: crate::store::now_ms(),
            budget,
            outputs,
            tasks,
            by_id,
            run,
        })
    }

    /// The task with id `id`.
    pub(super) fn task(&self, id: i64) -> Option<&ReportTask> {
        self.by_id.get(&id).map(|&i| &self.tasks[i])
    }

    pub(super) fn in_progress(&self) -> bool {
        self.run.status == RunStatus::Running
    }

    /// A call without an answer yet, of a run still going: not (yet) a possibly billed call.
    /// A run that died still reads `running`; its calls are counted once it is resumed.
    pub(super) fn in_flight(&self, a: &AmbiguousAttempt) -> bool {
        a.in_flight && self.in_progress()
    }

    /// Thumbnails made for this report (not found already made).
    pub(super) fn thumbnails_made(&self) -> usize {
        self.images().filter(|s| s.preview.made).count()
    }

    pub(super) fn images(&self) -> impl Iterator<Item = &Shown> {
        self.outputs.values().flatten()
    }

    /// Outputs whose file is where the record says.
    pub(super) fn images_on_disk(&self) -> usize {
        self.images().filter(|s| s.preview.on_disk).count()
    }

    /// The cost of each step in lineage order, then the total. Removed tasks only count in
    /// a line of their own (returned apart), since the pipeline no longer has their step.
    pub(super) fn costs(&self) -> (Vec<StepCost>, StepCost, Option<StepCost>) {
        let mut at_risk: HashMap<i64, u64> = HashMap::new();
        for a in self.ambiguous.iter().filter(|a| !self.in_flight(a)) {
            *at_risk.entry(a.task_id).or_default() += a.credits_at_risk;
        }
        let mut steps: Vec<StepCost> = self
            .lineage
            .steps
            .iter()
            .map(|s| StepCost {
                step: s.clone(),
                ..StepCost::default()
            })
            .collect();
        let mut removed = StepCost {
            step: "removed from the pipeline".into(),
            ..StepCost::default()
        };
        for t in &self.tasks {
            let line = if t.removed {
                &mut removed
            } else {
                match steps.iter_mut().find(|s| s.step == t.step) {
                    Some(line) => line,
                    None => continue,
                }
            };
            line.tasks += 1;
            match t.status {
                TaskStatus::Succeeded => line.succeeded += 1,
                TaskStatus::Failed => line.failed += 1,
                TaskStatus::Blocked => line.blocked += 1,
                TaskStatus::Pending | TaskStatus::Running => line.pending += 1,
            }
            line.reused += u64::from(t.reused_from_run.is_some());
            line.planned += t.planned_credits;
            line.billed += t.credits_billed;
            line.at_risk += at_risk.get(&t.id).copied().unwrap_or(0);
        }
        // Items the run has not reached have no rows yet: their tasks are pending, per the plan.
        let recorded: Vec<crate::store::StepCounts> = steps
            .iter()
            .map(|s| crate::store::StepCounts {
                step: s.step.clone(),
                tasks: s.tasks,
                ..Default::default()
            })
            .collect();
        for extra in super::summary::unrecorded(&self.run.plan_json, &recorded) {
            if let Some(line) = steps.iter_mut().find(|s| s.step == extra.step) {
                line.tasks += extra.tasks;
                line.pending += extra.pending;
                line.planned += extra.planned_credits;
            }
        }
        let mut total = StepCost {
            step: "total".into(),
            ..StepCost::default()
        };
        for s in &steps {
            total.add(s);
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
