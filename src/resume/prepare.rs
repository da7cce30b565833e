//! The first stage of continuing a run: from its record, the pipeline as it is now and a plan
//! made now, what resuming it pays for ([`Prepared`]), or why it is refused. Nothing is
//! written here: a dry run stops after this stage, and shows it.

use std::sync::Arc;

use crate::exec::OnAmbiguous;
use crate::money::{Priced, Revision};
use crate::pipeline::Pipeline;
use crate::plan::document::{PlanDocument, ScopePlan};
use crate::plan::graph::Graph;
use crate::plan::scope::Scope;
use crate::plan::{Costs, GenerationPrice};
use crate::run_id::RunId;
use crate::store::{Run, RunStatus, Store};

use super::refusal::{self, Refusal};
use super::{ResumeError, Review, Target, changes, reroll};

/// What the runner gives a continuation once it holds the run's lock: the run as recorded
/// (read again under the lock), the pipeline file as it is now and the plan made from it.
pub struct Given {
    pub row: Run,
    pub pipeline: Pipeline,
    /// The pipeline as the run recorded it, when it changed since ([`changed`]).
    pub recorded: Option<Pipeline>,
    pub doc: PlanDocument,
    /// `--items`, `--until`: the part asked for now.
    pub scope: Scope,
}

/// What the user asked of the continuation.
#[derive(Clone, Copy, Debug)]
pub struct Choices {
    pub allow_changes: bool,
    /// `--reuse` (or the pipeline's `reuse: true`).
    pub reuse: bool,
    pub on_ambiguous: OnAmbiguous,
}

/// A run reviewed for continuing: what it keeps, reads back and pays for, admitted or not yet.
pub struct Prepared {
    pub row: Run,
    pub pipeline: Pipeline,
    pub doc: PlanDocument,
    pub graph: Arc<Graph>,
    pub review: Review,
    /// The tasks to pay for now: the part asked for, or what a reroll names.
    pub scope: Scope,
    /// The pipeline as the run recorded it, when it changed since (`--allow-changes`).
    pub recorded: Option<Pipeline>,
    /// What a reroll names, as it is recorded; `None` for a resume.
    pub reroll: Option<String>,
}

/// Whether a recorded run is finished: then it is only summarised, unless rerolled.
pub fn finished(status: RunStatus, rerolling: bool) -> bool {
    status == RunStatus::Succeeded && !rerolling
}

/// Whether the pipeline file or its items changed since the run recorded them.
pub fn changed(pipeline: &Pipeline, doc: &PlanDocument, row: &Run) -> bool {
    pipeline.text_sha256 != row.pipeline_sha256 || doc.items.sha256 != row.items_sha256
}

/// Reviews the run given: the graph priced, the changes refused unless allowed, the reroll's
/// targets chosen (or the part asked for kept).
pub async fn prepare(
    store: &Store,
    given: Given,
    choices: Choices,
    reroll: Option<&[Target]>,
) -> Result<Prepared, ResumeError> {
    let Given {
        row,
        pipeline,
        recorded,
        doc,
        mut scope,
    } = given;
    // A price the service no longer states is the one the run was planned with.
    let price = priced_at(&doc, recorded_plan(&row));
    let graph = Arc::new(Graph::build(&pipeline, &Costs::of(&pipeline, &price))?);
    let previous = recorded
        .as_ref()
        .map(|p| Graph::build(p, &Costs::of(p, &price)))
        .transpose()?;
    let reuse = choices.reuse || pipeline.reuse;
    let (id, on_ambiguous) = (&row.id, choices.on_ambiguous);
    let mut review = super::review(
        store,
        Some(id),
        &graph,
        previous.as_ref(),
        on_ambiguous,
        reuse,
    )
    .await?;
    refusal::changes(id, recorded.is_some(), choices.allow_changes, || {
        let old = recorded
            .as_ref()
            .expect("a changed pipeline's recorded copy");
        changes::describe_changes(old, &pipeline, &graph, &review)
    })?;
    let reroll = match reroll {
        Some(targets) => {
            let (rerolled, said) = rerolled(store, id, &graph, &mut review, targets).await?;
            if let Some(reroll) = review.reroll.as_mut() {
                // As found, before the run is reopened: what an undone reroll gives back.
                reroll.before = Some(crate::store::RunBefore {
                    status: row.status,
                    stop_reason: row.stop_reason.clone(),
                    finished_at: row.finished_at,
                });
            }
            scope = rerolled;
            Some(said)
        }
        None => {
            review.narrow(&graph, &scope);
            None
        }
    };
    Ok(Prepared {
        recorded,
        row,
        pipeline,
        doc,
        graph,
        review,
        scope,
        reroll,
    })
}

impl Prepared {
    /// What was given, to prepare again once the record changed under the lock (lost answers
    /// read back). A reroll is never given a part ([`refusal::before_lock`]): its scope was all.
    pub fn into_given(self) -> Given {
        let scope = match self.reroll {
            Some(_) => Scope::all(),
            None => self.scope,
        };
        Given {
            row: self.row,
            pipeline: self.pipeline,
            recorded: self.recorded,
            doc: self.doc,
            scope,
        }
    }

    /// Refuses what is left when it costs more than may be spent: the limit of a run that
    /// spent `spent` (its budget less that, and the balance).
    pub fn admit(&self, spent: u64) -> Result<(), Refusal> {
        let limit = self.doc.limit(spent);
        let review = &self.review;
        let (id, reroll) = (&self.row.id, self.reroll.as_deref());
        refusal::over_limit(id, reroll, review.to_pay(), review.credits(), limit)
    }

    /// What this continuation would pay now, and its revision: the run's id, status and
    /// recorded spending, what a reroll names, and each task to pay for with its reason and
    /// credits (see [`crate::money::gate`]). A confirm made against another state of the run
    /// carries another revision.
    pub async fn priced(&self, store: &Store) -> Result<Priced, ResumeError> {
        let totals = store.runs().totals(&self.row.id).await?;
        let mut digest = Revision::builder()
            .part(self.row.id.as_ref())
            .part(self.row.status.as_str())
            .part(self.reroll.as_deref().unwrap_or_default());
        for n in [
            totals.tasks,
            totals.succeeded,
            totals.failed,
            totals.blocked,
            totals.billed_credits,
            totals.ambiguous_attempts,
            totals.possibly_billed_credits,
            totals.outputs,
        ] {
            digest = digest.number(n);
        }
        let digest = self
            .review
            .digest(digest.part(self.doc.revision().as_str()));
        Ok(Priced {
            credits: self.review.credits(),
            revision: digest.finish(),
        })
    }

    /// For a dry run to show: the kept outputs whose file or object is missing or modified
    /// (a resume checks them beside the run instead).
    pub async fn check_kept(&mut self, store: &Store) -> Result<(), ResumeError> {
        self.review.refetch = super::check(store, &self.row.id, &self.review).await?;
        Ok(())
    }
}

/// Makes `review` the reroll of `targets`, or the continuation of an unfinished reroll of the
/// same targets; gives the scope to run and what the reroll names.
async fn rerolled(
    store: &Store,
    run_id: &RunId,
    graph: &Graph,
    review: &mut Review,
    targets: &[Target],
) -> Result<(Scope, String), ResumeError> {
    let (chosen, loose) = reroll::resolve(graph, targets).map_err(|message| Refusal::Targets {
        run_id: run_id.clone(),
        message,
    })?;
    let said = reroll::said(targets);
    let open = store.revisions().open_reroll(run_id, &said).await?;
    if open.is_some() {
        tracing::info!(
            "continuing the unfinished reroll of {said}: what it already paid for is kept"
        );
    }
    let ids = open.as_ref().map(|o| o.task_ids.as_slice());
    let scope = review
        .reroll(graph, &chosen, &loose, ids, said.clone())
        .map_err(|message| Refusal::Reroll { message })?;
    Ok((scope, said))
}

/// The plan the run recorded, when it still reads.
pub(super) fn recorded_plan(row: &Run) -> Option<PlanDocument> {
    row.plan.read::<PlanDocument>()
}

/// The generation price now, else the one the run was planned (or discovered) with.
fn priced_at(doc: &PlanDocument, recorded: Option<PlanDocument>) -> GenerationPrice {
    if doc.prices.generation.credits.is_some() {
        return doc.prices.generation.clone();
    }
    recorded
        .map(|d| d.prices.generation)
        .filter(|g| g.credits.is_some())
        .unwrap_or_else(|| doc.prices.generation.clone())
}

/// How the run's record of its source and plan is brought up to date when it continues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rewrite {
    /// Nothing changed that the record holds.
    Nothing,
    /// The part asked for changed (a sample, then every item): so does the plan.
    Plan,
    /// The pipeline changed (`--allow-changes`): its text, hashes and plan are the new ones.
    Source,
}

/// What [`Rewrite`] a continuation makes, from whether the pipeline changed and the part of
/// the run the recorded plan and the new one were made for.
pub(super) fn rewrite(
    changed: bool,
    before: Option<&ScopePlan>,
    now: Option<&ScopePlan>,
) -> Rewrite {
    if changed {
        Rewrite::Source
    } else if before != now {
        Rewrite::Plan
    } else {
        Rewrite::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(asked: &str) -> ScopePlan {
        ScopePlan {
            asked: asked.to_owned(),
            items: 1,
            of_items: 2,
            whole_tasks: 4,
            whole_credits: Some(8),
        }
    }

    #[test]
    fn a_continuation_rewrites_the_source_when_changed_else_the_plan_when_its_part_did() {
        let (a, b) = (part("--items a"), part("--items b"));
        let table = [
            (true, None, None, Rewrite::Source),
            (true, Some(&a), Some(&b), Rewrite::Source),
            (false, None, None, Rewrite::Nothing),
            (false, Some(&a), Some(&a), Rewrite::Nothing),
            (false, Some(&a), Some(&b), Rewrite::Plan),
            (false, Some(&a), None, Rewrite::Plan),
            (false, None, Some(&a), Rewrite::Plan),
        ];
        for (changed, before, now, want) in table {
            assert_eq!(
                rewrite(changed, before, now),
                want,
                "{changed} {before:?} {now:?}"
            );
        }
    }

    #[test]
    fn only_a_succeeded_run_not_rerolled_is_finished() {
        assert!(finished(RunStatus::Succeeded, false));
        assert!(!finished(RunStatus::Succeeded, true));
        for status in [
            RunStatus::Failed,
            RunStatus::Interrupted,
            RunStatus::Stopped,
        ] {
            assert!(!finished(status, false) && !finished(status, true));
        }
    }
}
