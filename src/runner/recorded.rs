//! A recorded run continued (`resume`, `reroll`, `run --run-id` of a run that exists): what
//! it shares with a fresh run is here (the pipeline read, the lock, the plan made now, the
//! execution); what is a continuation's own, from the review to the hand-off, and the order
//! of it all once the lock is held, is [`crate::resume`]'s: the runner calls it once and does
//! its own part through the hooks it asks for.

use std::path::Path;

use crate::error::Error;
use crate::money::{Expected, Priced};
use crate::pipeline::{self, Pipeline};
use crate::plan::scope::Scope;
use crate::resume;
use crate::resume::Prepared;
use crate::runner::{Connection, Reviewed, Runner, admit, checked, execute, record, state};
use crate::store::{Run, Store};

impl Runner<'_> {
    /// Continues the recorded run `row`: `resume`, `reroll` (`reroll`: the run's chosen tasks
    /// paid for again, a finished run's too, and what is downstream of them), or `run
    /// --run-id` of a run that exists. `pipeline` is the file as given now, else the one the
    /// run recorded is read again (or its own copy, when the file is gone). A finished run is
    /// only summarised. The lock and a plan made now are the runner's; the stages after them,
    /// in their order, are [`crate::resume`]'s.
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
        let (conn, given) = self.plan_again(row, pipeline, scope).await?;
        let life = Continuing {
            runner: self,
            conn: &conn,
            store,
        };
        resume::continue_locked(&life, store, &conn.client, given, dry_run, reroll).await
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

/// The runner's part of a continuation, called by [`resume::continue_locked`] in its order.
struct Continuing<'a> {
    runner: &'a Runner<'a>,
    conn: &'a Connection,
    store: &'a Store,
}

impl resume::Lifecycle for Continuing<'_> {
    type Error = Error;
    type Opened = record::OpenRun;

    fn choices(&self) -> resume::Choices {
        let settings = &self.runner.settings;
        resume::Choices {
            allow_changes: settings.allow_changes,
            reuse: settings.reuse,
            on_ambiguous: settings.on_ambiguous,
        }
    }

    fn expected(&self) -> &Expected {
        &self.runner.settings.expect
    }

    async fn spent(&self, prepared: &Prepared) -> Result<u64, Error> {
        admit::spent(self.store, &prepared.row.id).await
    }

    async fn show(&self, prepared: &Prepared, priced: &Priced, spent: u64) -> Result<(), Error> {
        let limit = prepared.doc.limit(spent);
        let caps = crate::money::caps::covering(self.store, &prepared.pipeline.name).await?;
        self.runner.view.review(&Reviewed {
            row: &prepared.row,
            graph: &prepared.graph,
            review: &prepared.review,
            limit: limit.credits(),
            budget_left: limit.budget_left(),
            balance: limit.balance.credits(),
            priced,
            caps: &caps,
        })
    }

    fn admitted(&self, priced: &Priced) {
        self.runner.view.admitted(priced);
    }

    async fn refused(
        &self,
        prepared: &Prepared,
        refusal: resume::Refusal,
        answers: usize,
    ) -> Result<(), Error> {
        let (conn, store) = (self.conn, self.store);
        self.runner
            .refused(conn, store, prepared, refusal, answers)
            .await
    }

    async fn reopen(&self, prepared: &Prepared, spent: u64) -> Result<record::OpenRun, Error> {
        record::reopen(self.store, &prepared.row, spent).await
    }

    async fn execute(&self, run: record::OpenRun, applied: resume::Applied) -> Result<(), Error> {
        let start = execute::Start {
            run,
            graph: applied.graph,
            doc: applied.doc,
            discover: false,
            handoff: Some(applied.handoff),
            scope: applied.scope,
            reroll: applied.reroll,
        };
        let (conn, store) = (self.conn, self.store);
        self.runner
            .execute(conn, store, &applied.pipeline, start)
            .await
    }

    fn done(result: &Result<(), Error>) -> bool {
        matches!(result, Ok(()) | Err(Error::PartDone { .. }))
    }
}
