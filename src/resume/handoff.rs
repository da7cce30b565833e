//! The second stage of continuing a run, and the hand-off: the review of a [`Prepared`] run
//! applied (the crash-safe application, the kept outputs' check started beside the run, the
//! record's source and plan brought up to date), then what the executor is given
//! ([`Applied`]), and what is left to do once it is done ([`After::finish`]).

use std::sync::Arc;

use crate::api::Client;
use crate::pipeline::Pipeline;
use crate::place::RunDir;
use crate::plan::document::PlanDocument;
use crate::plan::graph::Graph;
use crate::plan::scope::Scope;
use crate::run_id::RunId;
use crate::store::{RecordedPlan, Run, Store, StoreError};

use super::prepare::{Prepared, Rewrite, recorded_plan, rewrite};
use super::{Beside, Review};

/// A continued run ready for the executor.
pub struct Applied {
    pub pipeline: Pipeline,
    pub graph: Arc<Graph>,
    pub doc: PlanDocument,
    /// The tasks to pay for now; the others are left pending.
    pub scope: Scope,
    /// The kept outputs to fetch again, as the check beside the run finds them, and the row
    /// ids the review read, for the executor not to read them again.
    pub handoff: crate::exec::Handoff,
    /// What a reroll names, as it is recorded; `None` for a resume.
    pub reroll: Option<String>,
}

/// What a continuation holds while the executor runs, and does once it is done.
pub struct After {
    /// The kept outputs' check: stopped when this is dropped, as the run ends.
    _checking: Beside,
    run_id: RunId,
    reroll: Option<String>,
}

impl Prepared {
    /// Applies the review to the record and the run's files in `run_dir` (the run reopened),
    /// starts the kept outputs' check beside the run, and brings the run's record of its
    /// source and plan up to date. Gives what the executor is given, and what to hold while
    /// it runs and finish after.
    pub async fn apply(
        self,
        store: &Store,
        client: &Client,
        run_dir: RunDir,
    ) -> Result<(Applied, After), StoreError> {
        let Prepared {
            row,
            pipeline,
            doc,
            graph,
            mut review,
            scope,
            recorded,
            reroll,
        } = self;
        let describe = |t| crate::exec::new_task(&graph, t);
        let tally = super::apply(store, client, &row.id, &run_dir, &graph, &review, describe);
        let tally = tally.await?;
        tracing::info!(
            "resuming run {}: {} task(s) to pay for ({}), {} kept (their files checked beside the run), {} recovered by job id, {} reused",
            row.id,
            review.to_pay(),
            crate::money::credits(review.credits()),
            review.kept.len(),
            tally.recovered,
            tally.reused,
        );
        let (place_proven, proven) = tokio::sync::oneshot::channel();
        let (refetch, checking) = check_beside(store, &row, run_dir, &mut review, proven);
        // The review's row ids are every row of the run unless the application recorded some.
        let rows = review.rows.take().filter(|_| tally.new_rows == 0);
        let handoff = crate::exec::Handoff {
            refetch,
            rows,
            place_proven,
        };
        let before = recorded_plan(&row).and_then(|d| d.scope);
        match rewrite(recorded.is_some(), before.as_ref(), doc.scope.as_ref()) {
            Rewrite::Nothing => {}
            Rewrite::Plan => {
                store
                    .runs()
                    .set_plan(&row.id, &RecordedPlan::of(&doc)?, doc.costs.known_credits)
                    .await?;
            }
            Rewrite::Source => adopt_source(store, &row, &pipeline, &doc).await?,
        }
        let after = After {
            _checking: checking,
            run_id: row.id,
            reroll: reroll.clone(),
        };
        let applied = Applied {
            pipeline,
            graph,
            doc,
            scope,
            handoff,
            reroll,
        };
        Ok((applied, after))
    }
}

impl After {
    /// Once the executor is done: a reroll that did what it was asked (`done`: the run, or
    /// the part asked for, finished) is recorded finished, so the same command starts anew.
    pub async fn finish(self, store: &Store, done: bool) -> Result<(), StoreError> {
        match &self.reroll {
            Some(said) if done => store.revisions().finish_reroll(&self.run_id, said).await,
            _ => Ok(()),
        }
    }
}

/// Starts the kept outputs' check beside the run ([`super::beside`]), handing it the review's
/// kept tasks; its listings wait for `proven`.
fn check_beside(
    store: &Store,
    row: &Run,
    run_dir: RunDir,
    review: &mut Review,
    proven: tokio::sync::oneshot::Receiver<()>,
) -> (crate::exec::Refetch, Beside) {
    let kept = std::mem::take(&mut review.kept);
    super::beside(store.clone(), row.id.clone(), run_dir, kept, proven)
}

/// Records the changed pipeline as the run's own (`--allow-changes`): its text (the run's
/// earlier copy when the file cannot be read), hashes and plan.
async fn adopt_source(
    store: &Store,
    row: &Run,
    pipeline: &Pipeline,
    doc: &PlanDocument,
) -> Result<(), StoreError> {
    let text = std::fs::read_to_string(&pipeline.file).unwrap_or(row.pipeline_text.clone());
    store
        .runs()
        .adopt_source(
            &row.id,
            &text,
            &pipeline.text_sha256,
            &doc.items.sha256,
            &RecordedPlan::of(doc)?,
            doc.costs.known_credits,
        )
        .await
}
