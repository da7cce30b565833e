//! Continuing a recorded run (`resume`, or `run --run-id` of a run that exists): a finished
//! run is only summarised; an unfinished one is reviewed, so that nothing is paid for twice,
//! and its pipeline compared with the file as it is now.

use std::path::Path;
use std::sync::Arc;

use crate::error::Error;
use crate::pipeline::{self, Pipeline};
use crate::plan::document::PlanDocument;
use crate::plan::graph::Graph;
use crate::plan::{Costs, GenerationPrice};
use crate::resume;
use crate::runner::{Connection, Reviewed, Runner, admit, checked, execute, record, state};
use crate::store::{RecordedPlan, Run, RunStatus, Store};

impl Runner<'_> {
    /// Continues the recorded run `row`; `pipeline` is the file as given now, else the one
    /// the run recorded is read again (or its own copy, when the file is gone).
    pub(super) async fn continued(
        &self,
        store: &Store,
        row: Run,
        pipeline: Option<Pipeline>,
        dry_run: bool,
    ) -> Result<(), Error> {
        self.continued_with(store, row, pipeline, dry_run, None)
            .await
    }

    /// [`Runner::continued`], or with `reroll` the run's chosen tasks paid for again (a
    /// finished run too), and what is downstream of them.
    pub(super) async fn continued_with(
        &self,
        store: &Store,
        row: Run,
        pipeline: Option<Pipeline>,
        dry_run: bool,
        reroll: Option<&[resume::Target]>,
    ) -> Result<(), Error> {
        if row.status == RunStatus::Succeeded && reroll.is_none() {
            return self.finished(store, &row.id, dry_run).await;
        }
        let pipeline = match pipeline {
            Some(p) => p,
            None => self.current_pipeline(&row)?,
        };
        let mut scope = self.scope(&pipeline)?;
        if reroll.is_some() && !scope.is_all() {
            return Err(Error::usage(
                "a reroll pays for the tasks it names and what is downstream of them: --items and --until do not apply",
                None,
            ));
        }
        if self.service.sandbox && store.runs().totals(&row.id).await?.succeeded > 0 {
            return Err(Error::usage(
                format!(
                    "run {} cannot be resumed on a new embedded sandbox: the jobs and URLs of its finished tasks ended with the sandbox that made them",
                    row.id
                ),
                Some(
                    "for runs you mean to interrupt and resume, start `imgpipe sandbox` once and point IMGPIPE_BASE_URL at it; or start again with a new --run-id",
                ),
            ));
        }
        let _lock = if dry_run {
            None
        } else {
            let (name, wait) = (&row.pipeline_name, self.settings.wait);
            Some(state::lock(store, name, &row.id, wait, &self.shutdown).await?)
        };
        // While this process waited for the lock, the holder may have finished the run.
        let row = store.runs().get(&row.id).await?.unwrap_or(row);
        if row.status == RunStatus::Succeeded && reroll.is_none() {
            return self.finished(store, &row.id, dry_run).await;
        }
        let started = std::time::Instant::now();
        let conn = Connection::open(self.service).await?;
        let (balance, generation) = conn.ask(&pipeline).await?;
        let doc = crate::plan::make(&pipeline, generation, balance, self.settings.max_credits);
        let doc = crate::plan::narrow(doc, &pipeline, &scope);
        // A price the service no longer states is the one the run was planned with.
        let price = priced_at(&doc, &row);
        let graph = Arc::new(Graph::build(&pipeline, &Costs::of(&pipeline, &price))?);
        let changed =
            pipeline.text_sha256 != row.pipeline_sha256 || doc.items.sha256 != row.items_sha256;
        let old = if changed {
            Some(self.recorded_pipeline(&row).map_err(|_| {
                Error::usage(
                    format!(
                        "run {} kept a copy of its pipeline file that no longer reads",
                        row.id
                    ),
                    Some("resume it with the file it started from, or start a new run"),
                )
            })?)
        } else {
            None
        };
        let previous = old
            .as_ref()
            .map(|p| Graph::build(p, &Costs::of(p, &price)))
            .transpose()?;
        let reuse = self.settings.reuse || pipeline.reuse;
        let on_ambiguous = self.settings.on_ambiguous;
        let mut review = resume::review(
            store,
            &row.id,
            &graph,
            previous.as_ref(),
            on_ambiguous,
            reuse,
        )
        .await?;
        if let Some(old) = &old
            && !self.settings.allow_changes
        {
            return Err(Error::Refused {
                message: format!(
                    "the pipeline changed since run {} started: {}",
                    row.id,
                    resume::describe_changes(old, &pipeline, &graph, &review)
                ),
                hint: Some(
                    "resume with --allow-changes to keep the unchanged tasks' results and run the rest again, or give the new work another --run-id"
                        .into(),
                ),
            });
        }
        let rerolling = match reroll {
            Some(targets) => {
                let (rerolled, said) = rerolled(store, &row, &graph, &mut review, targets).await?;
                scope = rerolled;
                Some(said)
            }
            None => {
                review.narrow(&graph, &scope);
                None
            }
        };
        tracing::debug!("reviewed run {} in {:.2?}", row.id, started.elapsed());
        let spent = admit::spent(store, &row.id).await?;
        let cap = admit::cap_of(&doc, spent);
        if dry_run {
            review.refetch = resume::check(store, &row.id, &review).await?;
            let (graph, review) = (&graph, &review);
            self.view.review(&Reviewed {
                row: &row,
                graph,
                review,
                cap,
            })?;
            return admit::over_cap(&row, review, cap, &doc);
        }
        admit::over_cap(&row, &review, cap, &doc)?;
        let run = record::reopen(store, &row, spent).await?;
        tracing::debug!("run reopened after {:.2?}", started.elapsed());
        let applied = resume::apply(
            store,
            &conn.client,
            &row.id,
            &run.dir,
            &graph,
            &review,
            |t| crate::exec::new_task(&graph, t),
        )
        .await?;
        tracing::info!(
            "resuming run {}: {} task(s) to pay for ({} credits), {} kept (their files checked beside the run), {} recovered by job id, {} reused",
            row.id,
            review.to_pay(),
            review.credits(),
            review.kept.len(),
            applied.recovered,
            applied.reused,
        );
        let kept = std::mem::take(&mut review.kept);
        let (refetch, _checking) =
            resume::beside(store.clone(), row.id.clone(), run.dir.clone(), kept);
        if !changed && asked_before(&row) != doc.scope {
            // The part asked for changed (a sample, then every item): so does the plan.
            store
                .runs()
                .set_plan(&row.id, &RecordedPlan::of(&doc)?, doc.costs.known_credits)
                .await?;
        }
        if changed {
            let text = std::fs::read_to_string(&pipeline.file).unwrap_or(row.pipeline_text.clone());
            store
                .runs()
                .adopt_source(
                    &row.id,
                    &text,
                    &pipeline.text_sha256,
                    &doc.items.sha256,
                    &RecordedPlan::of(&doc)?,
                    doc.costs.known_credits,
                )
                .await?;
        }
        let start = execute::Start {
            run,
            graph,
            doc,
            discover: false,
            refetch: Some(refetch),
            scope,
        };
        let result = self.execute(&conn, store, &pipeline, start).await;
        if let Some(said) = rerolling
            && matches!(result, Ok(()) | Err(Error::PartDone { .. }))
        {
            store.finish_reroll(&row.id, &said).await?;
        }
        result
    }

    /// A finished run: its summary (and its report when asked), and nothing spent.
    async fn finished(&self, store: &Store, run_id: &str, dry_run: bool) -> Result<(), Error> {
        if dry_run {
            return self.view.finished(run_id);
        }
        tracing::info!("run {run_id} is already finished; nothing to do");
        self.view
            .summary(&crate::report::summary::summary_of(store, run_id).await?)?;
        if self.settings.report {
            execute::write_report(store, run_id).await;
        }
        Ok(())
    }

    /// The run's pipeline file as it is now; the run's own copy when the file is gone.
    fn current_pipeline(&self, row: &Run) -> Result<Pipeline, Error> {
        let path = Path::new(&row.pipeline_file);
        if path.exists() {
            return checked(self.view, path, pipeline::load(path));
        }
        tracing::warn!(
            "{} is gone; resuming from the run's own copy of it",
            row.pipeline_file
        );
        self.recorded_pipeline(row)
    }

    /// The pipeline file as the run recorded it (when it started, or last adopted a change).
    fn recorded_pipeline(&self, row: &Run) -> Result<Pipeline, Error> {
        let path = Path::new(&row.pipeline_file);
        let loaded = pipeline::load_str(
            &row.pipeline_file,
            pipeline::dir_of(path),
            &row.pipeline_text,
        );
        checked(self.view, path, loaded)
    }
}

/// Makes `review` the reroll of `targets`, or the continuation of an unfinished reroll of the
/// same targets; gives the scope to run and what the reroll names (`said`).
async fn rerolled(
    store: &Store,
    row: &Run,
    graph: &Graph,
    review: &mut resume::Review,
    targets: &[resume::Target],
) -> Result<(crate::plan::scope::Scope, String), Error> {
    let hint = format!("`imgpipe status {}` lists the run's tasks", row.id);
    let chosen =
        resume::resolve_targets(graph, targets).map_err(|e| Error::usage(e, Some(&hint)))?;
    let said = resume::targets_said(targets);
    let open = store.open_reroll(&row.id, &said).await?;
    if open.is_some() {
        tracing::info!(
            "continuing the unfinished reroll of {said}: what it already paid for is kept"
        );
    }
    let ids = open.as_ref().map(|o| o.task_ids.as_slice());
    let scope = review
        .reroll(graph, &chosen, ids, said.clone())
        .map_err(|e| Error::usage(e, None))?;
    Ok((scope, said))
}

/// The part of the run its recorded plan was made for (`--items`, `--until`), if not all.
fn asked_before(row: &Run) -> Option<crate::plan::document::ScopePlan> {
    row.plan.read::<PlanDocument>().and_then(|d| d.scope)
}

/// The generation price now, else the one the run was planned (or discovered) with.
fn priced_at(doc: &PlanDocument, row: &Run) -> GenerationPrice {
    if doc.prices.generation.credits.is_some() {
        return doc.prices.generation.clone();
    }
    row.plan
        .read::<PlanDocument>()
        .map(|d| d.prices.generation)
        .filter(|g| g.credits.is_some())
        .unwrap_or_else(|| doc.prices.generation.clone())
}
