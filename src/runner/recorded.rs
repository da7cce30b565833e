//! A recorded run continued (`resume`, `reroll`, `run --run-id` of a run that exists): what
//! it shares with a fresh run is here (the pipeline read, the lock, the plan made now, the
//! execution); what is a continuation's own, from the review to the hand-off, is
//! [`crate::resume`]'s, called in order.

use std::path::Path;

use crate::error::Error;
use crate::pipeline::{self, Pipeline};
use crate::plan::scope::Scope;
use crate::resume;
use crate::runner::{Connection, Reviewed, Runner, admit, checked, execute, record, state};
use crate::store::{Run, Store};

impl Runner<'_> {
    /// Continues the recorded run `row`: `resume`, `reroll` (`reroll`: the run's chosen tasks
    /// paid for again, a finished run's too, and what is downstream of them), or `run
    /// --run-id` of a run that exists. `pipeline` is the file as given now, else the one the
    /// run recorded is read again (or its own copy, when the file is gone). A finished run is
    /// only summarised. The lock and a plan made now are the runner's; the stages between
    /// them and the execution, the review to the hand-off, are [`crate::resume`]'s.
    pub(super) async fn continued(
        &self,
        store: &Store,
        row: Run,
        pipeline: Option<Pipeline>,
        dry_run: bool,
        reroll: Option<&[resume::Target]>,
    ) -> Result<(), Error> {
        let rerolling = reroll.is_some();
        if resume::finished(row.status, rerolling) {
            return self.finished_at_gate(store, &row.id, dry_run).await;
        }
        let pipeline = match pipeline {
            Some(p) => p,
            None => self.current_pipeline(&row)?,
        };
        let scope = self.scope(&pipeline)?;
        let sandbox_with_finished =
            self.service.sandbox && store.runs().totals(&row.id).await?.succeeded > 0;
        resume::refusal::before_lock(resume::refusal::Asked {
            run_id: &row.id,
            rerolling,
            part: !scope.is_all(),
            sandbox_with_finished,
        })?;
        let _lock = if dry_run {
            None
        } else {
            let (name, wait) = (&row.pipeline_name, self.settings.wait);
            Some(state::lock(store, name, &row.id, wait, &self.shutdown).await?)
        };
        // While this process waited for the lock, the holder may have finished the run.
        let row = store.runs().get(&row.id).await?.unwrap_or(row);
        if resume::finished(row.status, rerolling) {
            return self.finished_at_gate(store, &row.id, dry_run).await;
        }
        let given = self.plan_again(row, pipeline, scope).await?;
        self.continue_locked(store, given, dry_run, reroll).await
    }

    /// The plan made now of a run to continue, and the pipeline it recorded when that changed.
    async fn plan_again(
        &self,
        row: Run,
        pipeline: Pipeline,
        scope: Scope,
    ) -> Result<(Connection, resume::Given), Error> {
        let conn = Connection::open(self.service).await?;
        let (balance, generation) = conn.ask(&pipeline).await?;
        let doc = crate::plan::make(&pipeline, generation, balance, self.settings.max_credits);
        let doc = crate::plan::narrow(doc, &pipeline, &scope);
        let recorded = if resume::changed(&pipeline, &doc, &row) {
            let unreadable = |_| resume::Refusal::CopyUnreadable {
                run_id: row.id.clone(),
            };
            Some(self.recorded_pipeline(&row).map_err(unreadable)?)
        } else {
            None
        };
        let given = resume::Given {
            row,
            pipeline,
            recorded,
            doc,
            scope,
        };
        Ok((conn, given))
    }

    /// [`Runner::continued`] once it holds the run's lock and a plan: resume's stages, then
    /// the execution.
    async fn continue_locked(
        &self,
        store: &Store,
        (conn, given): (Connection, resume::Given),
        dry_run: bool,
        reroll: Option<&[resume::Target]>,
    ) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let mut prepared = resume::prepare(store, given, self.choices(), reroll).await?;
        tracing::debug!(
            "reviewed run {} in {:.2?}",
            prepared.row.id,
            started.elapsed()
        );
        let mut spent = admit::spent(store, &prepared.row.id).await?;
        if dry_run {
            let priced = prepared.priced(store).await?;
            prepared.check_kept(store).await?;
            let limit = prepared.doc.limit(spent);
            let caps = crate::money::caps::covering(store, &prepared.pipeline.name).await?;
            self.view.review(&Reviewed {
                row: &prepared.row,
                graph: &prepared.graph,
                review: &prepared.review,
                limit: limit.credits(),
                budget_left: limit.budget_left(),
                balance: limit.balance.credits(),
                priced: &priced,
                caps: &caps,
            })?;
            return Ok(prepared.admit(spent)?);
        }
        // Over its limit, the continuation first reads lost answers back, free: each is a task
        // no longer to pay for, so the run is reviewed again, and may now fit.
        let mut answers = 0;
        if prepared.admit(spent).is_err() && !resume::finished(prepared.row.status, false) {
            answers = prepared.read_back(store, &conn.client).await?;
            if answers > 0 {
                let given = prepared.into_given();
                prepared = resume::prepare(store, given, self.choices(), reroll).await?;
                spent = admit::spent(store, &prepared.row.id).await?;
            }
        }
        // The gate: the lock is held and the work planned again; what a confirm agreed to
        // must be what this pays for now, and it must fit. The revision digests every recorded
        // task to pay and every item never recorded (100,000 on a night's takeover): only a
        // confirm has one to compare.
        let confirmed = match self.settings.expect.is_bound() {
            true => Some(prepared.priced(store).await?),
            false => None,
        };
        if let Some(priced) = &confirmed {
            crate::money::gate::check(&self.settings.expect, priced)?;
        }
        if let Err(refusal) = prepared.admit(spent) {
            return self
                .refused(&conn, store, &prepared, refusal, answers)
                .await;
        }
        if let Some(priced) = &confirmed {
            self.view.admitted(priced);
        }
        let run = record::reopen(store, &prepared.row, spent).await?;
        let reroll = prepared.reroll.clone();
        let applied = prepared.apply(store, &conn.client, run.dir.clone()).await?;
        let resume::Applied {
            pipeline,
            graph,
            doc,
            scope,
            handoff,
            after,
        } = applied;
        let start = execute::Start {
            run,
            graph,
            doc,
            discover: false,
            handoff: Some(handoff),
            scope,
            reroll,
        };
        let result = self.execute(&conn, store, &pipeline, start).await;
        let done = matches!(result, Ok(()) | Err(Error::PartDone { .. }));
        after.finish(store, done).await?;
        result
    }

    /// A finished run: nothing to pay for, which a confirm of a price must have seen (a
    /// reroll confirmed at N credits, say, once the run it named finished otherwise).
    async fn finished_at_gate(
        &self,
        store: &Store,
        id: &crate::run_id::RunId,
        dry_run: bool,
    ) -> Result<(), Error> {
        if !dry_run {
            let now = crate::money::Priced {
                credits: 0,
                revision: crate::money::Revision::builder()
                    .part(id.as_ref())
                    .part("finished")
                    .finish(),
            };
            crate::money::gate::check(&self.settings.expect, &now)?;
        }
        self.finished(store, id, dry_run).await
    }

    /// What the settings ask of a continuation.
    fn choices(&self) -> resume::Choices {
        resume::Choices {
            allow_changes: self.settings.allow_changes,
            reuse: self.settings.reuse,
            on_ambiguous: self.settings.on_ambiguous,
        }
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
