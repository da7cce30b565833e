//! Executing a recorded run and concluding it: the executor's configuration from the
//! settings, the pipeline and the account; a discovered price when asked; then the run's
//! status, manifest, summary and report, and the error its exit code needs.

use std::sync::Arc;

use crate::error::{Error, exit};
use crate::events::{self, Ending, Session};
use crate::exec::{self, Outcome, Stop, manifest};
use crate::money;
use crate::pipeline::Pipeline;
use crate::plan::PriceSource;
use crate::plan::document::PlanDocument;
use crate::plan::graph::Graph;
use crate::plan::scope::Scope;
use crate::run_id::RunId;
use crate::runner::conclude::{self, Exit};
use crate::runner::record::{self, OpenRun};
use crate::runner::{Connection, DEFAULT_CONCURRENCY, Runner, admit, discover};
use crate::store::{RunStatus, Store};

/// A recorded run ready to execute.
pub(super) struct Start {
    pub run: OpenRun,
    pub graph: Arc<Graph>,
    pub doc: PlanDocument,
    /// Run one generation first to learn its price.
    pub discover: bool,
    /// A resume's earlier outputs to fetch again, found beside the run, and the row ids its
    /// review read.
    pub handoff: Option<exec::Handoff>,
    /// The tasks to pay for now; the others are left pending.
    pub scope: Scope,
    /// What a reroll names, as recorded: undone at the end when it could not be done.
    pub reroll: Option<String>,
}

/// Where a run tells how it goes and how it ended: its events session, and what its end
/// gives `run.finished`.
struct Told<'a> {
    session: &'a Session,
    concluded: &'a mut Concluded,
}

/// What the run's end gives its `run.finished` event besides the record.
#[derive(Default)]
struct Concluded {
    failures: Vec<(String, String)>,
    report: Option<String>,
}

impl Runner<'_> {
    /// Executes and concludes the run inside its events session: alerts and metrics while it
    /// goes on, and `run.finished` with the exit code however it ends.
    pub(super) async fn execute(
        &self,
        conn: &Connection,
        store: &Store,
        pipeline: &Pipeline,
        start: Start,
    ) -> Result<(), Error> {
        let config = self.events_config(pipeline);
        let session = Session::start(&config, store, &start.run.id, &pipeline.name).await;
        let output = start.run.dir.root().to_string();
        let mut concluded = Concluded::default();
        let result = self
            .execute_in(
                conn,
                store,
                pipeline,
                start,
                Told {
                    session: &session,
                    concluded: &mut concluded,
                },
            )
            .await;
        let ending = Ending {
            store,
            exit_code: result
                .as_ref()
                .err()
                .map_or(exit::SUCCESS, Error::exit_code),
            failures: &concluded.failures,
            output,
            report: concluded.report,
        };
        session.finish(ending).await;
        result
    }

    /// The settings' webhook and metrics file; the pipeline file's webhook when no flag or
    /// environment variable names one.
    fn events_config(&self, pipeline: &Pipeline) -> events::Config {
        let mut config = self.settings.events.clone();
        if config.notify_url.is_none() {
            config.notify_url = pipeline.notify.clone();
        }
        config
    }

    /// [`Runner::execute`] inside the events session: the run holds its caps' leash while
    /// it goes, and gives back what it did not spend however it ends.
    async fn execute_in(
        &self,
        conn: &Connection,
        store: &Store,
        pipeline: &Pipeline,
        start: Start,
        told: Told<'_>,
    ) -> Result<(), Error> {
        let mut config = self.config(conn, pipeline, &start.doc, &start.run).await;

        config.known_prices = known_prices(store, &start.doc).await?;
        config.leash = leash(store, pipeline, &start.run.id).await?;
        let leash = config.leash.clone();
        config.account_rate = account_rate(store, conn, config.rate, &start.run.id).await;
        let shared_rate = config.account_rate.clone();
        let ran = self
            .execute_leashed(conn, store, pipeline, start, config, told)
            .await;
        if let Some(rate) = shared_rate {
            rate.close().await;
        }
        if let Some(leash) = leash
            && let Err(e) = leash.close().await
        {
            tracing::warn!(
                "cannot close this run's cap leases: {e}; they count whole until another run finds this one gone"
            );
        }
        ran
    }

    /// [`Runner::execute_in`] once the run holds its caps' leash (in `config`).
    async fn execute_leashed(
        &self,
        conn: &Connection,
        store: &Store,
        pipeline: &Pipeline,
        start: Start,
        mut config: exec::Config,
        told: Told<'_>,
    ) -> Result<(), Error> {
        let Start {
            run,
            mut graph,
            mut doc,
            discover,
            mut handoff,
            scope,
            reroll,
        } = start;
        config.scope = scope.clone();
        if discover {
            (graph, doc) = self
                .discovered(conn, store, pipeline, &graph, doc, &mut config)
                .await?;
            // Row ids are of the graph they were read for, and the discovery recorded rows.
            if let Some(h) = &mut handoff {
                h.rows = None;
            }
        }
        let progress = self.view.progress(
            &steps_of(&doc),
            &store.runs().step_counts(&run.id).await?,
            doc.costs.total_credits.unwrap_or(doc.costs.known_credits),
        );
        tracing::info!(
            "run {} started: {} tasks, {} planned, output in {}",
            run.id,
            doc.costs.tasks,
            crate::money::credits(doc.costs.known_credits),
            config.run_dir.root()
        );
        let Told { session, concluded } = told;
        let budget = doc.budget.as_ref().map(|b| b.max_credits);
        let observer = session.observer(Arc::clone(&progress), budget, run.billed);
        let links = exec::Links {
            store: store.clone(),
            client: conn.client.clone(),
            downloader: conn.downloader.clone(),
        };
        let shutdown = self.shutdown.clone();
        let outcome = exec::run(graph, links, config, observer, shutdown, handoff).await?;
        progress.finish();
        concluded.failures = outcome.failures.clone();
        if let Some(said) = &reroll
            && let Some(undone) = crate::resume::undo_reroll(store, &run.id, said).await?
        {
            return self.undone(store, &run, &outcome, said, &undone).await;
        }
        self.conclude(conn, store, &run, outcome, &scope, &mut concluded.report)
            .await
    }

    /// The generation price discovered by one call: the plan made again with it and the
    /// run's recorded tasks repriced; the run stopped and refused when the plan no longer
    /// fits; else what may be spent bounded by the balance after the call.
    async fn discovered(
        &self,
        conn: &Connection,
        store: &Store,
        pipeline: &Pipeline,
        graph: &Arc<Graph>,
        doc: PlanDocument,
        config: &mut exec::Config,
    ) -> Result<(Arc<Graph>, PlanDocument), Error> {
        let found = discover::price(conn, store, graph, config, &doc.balance, &self.shutdown);
        let found = found.await?;
        let budget = doc.budget.as_ref().map(|b| b.max_credits);
        let doc = crate::plan::make(pipeline, found, doc.balance.clone(), budget);
        let doc = crate::plan::narrow(doc, pipeline, &config.scope);
        let graph = Arc::new(Graph::build(pipeline, &doc.costs)?);
        let run_id = config.run_id.clone();
        record::reprice(store, &run_id, &graph, &doc).await?;
        config.known_prices = known_prices(store, &doc).await?;
        if !doc.verdict.fits {
            self.view.plan(&doc)?;
            let why = Some("the discovered price does not fit");
            store
                .runs()
                .set_status(&run_id, RunStatus::Stopped, why, None)
                .await?;
            // A plan that does not fit is always refused.
            money::admit::refusal(&doc.claim())?;
        }
        // The plan was judged against the balance before the discovering call; what may be
        // spent now is bounded by the balance after it.
        let limit = doc.limit(admit::spent(store, &run_id).await?).credits();
        let fresh = conn
            .balance_now()
            .await
            .map(|b| u64::try_from(b).unwrap_or(0));
        config.limit = money::limit::least(limit, fresh);
        Ok((graph, doc))
    }

    /// What the run may do: the settings first, then the pipeline, then the account's word.
    async fn config(
        &self,
        conn: &Connection,
        pipeline: &Pipeline,
        doc: &PlanDocument,
        run: &OpenRun,
    ) -> exec::Config {
        let mut config = self.exec_config(run, &pipeline.name);
        let limits = conn.fields.limits.as_deref();
        // The account's word is asked only where neither the settings nor the pipeline speak.
        let told_concurrency = self
            .settings
            .concurrency
            .or(pipeline.concurrency.map(|n| n.get() as usize));
        let told_rate = self
            .settings
            .rate
            .or(pipeline.rate_limit.map(|rate| rate.per_second()));
        let account = match (told_concurrency, told_rate) {
            (Some(_), Some(_)) => None,
            _ => conn.account().await,
        };
        let accounts_concurrency = account.as_ref().and_then(|a| a.max_concurrency(limits));
        let accounts_rate = account.as_ref().and_then(|a| a.requests_per_second(limits));
        config.concurrency = told_concurrency.unwrap_or_else(|| {
            accounts_concurrency
                .as_ref()
                .map_or(DEFAULT_CONCURRENCY, |f| f.value.min(256) as usize)
        });
        config.rate = told_rate.or_else(|| accounts_rate.as_ref().map(|f| f.value));
        config.limit = doc.limit(run.billed).credits();
        config.reroll_credits = pipeline.rerolls.map_or(0, |r| r.max_credits);
        // Said once, so that a run's pace is never a guess: where each figure came from.
        let whose = |flag: bool, file: bool, account: bool| match (flag, file, account) {
            (true, ..) => "the command line",
            (_, true, _) => "the pipeline file",
            (_, _, true) => "the account's limits",
            _ => "the default",
        };
        let concurrency_from = whose(
            self.settings.concurrency.is_some(),
            pipeline.concurrency.is_some(),
            accounts_concurrency.is_some(),
        );
        let pace = match config.rate {
            Some(rate) => format!(
                "at most {rate} a second ({})",
                whose(
                    self.settings.rate.is_some(),
                    pipeline.rate_limit.is_some(),
                    true,
                )
            ),
            None => "no rate set until the service answers 429".to_owned(),
        };
        tracing::info!(
            "paid calls: up to {} at once ({concurrency_from}), {pace}",
            config.concurrency
        );
        config
    }

    /// A finished run: its summary (and its report when asked), and nothing spent.
    pub(super) async fn finished(
        &self,
        store: &Store,
        run_id: &RunId,
        dry_run: bool,
    ) -> Result<(), Error> {
        if dry_run {
            return self.view.finished(run_id);
        }
        tracing::info!("run {run_id} is already finished; nothing to do");
        self.view
            .summary(&crate::report::summary::summary_of(store, run_id).await?)?;
        if self.settings.report {
            write_report(store, run_id).await;
        }
        Ok(())
    }

    /// A reroll that could not be done, undone: the record and the files are as they were;
    /// the manifest is written again from them, the summary shown, and why it could not be
    /// done is the error.
    async fn undone(
        &self,
        store: &Store,
        run: &OpenRun,
        outcome: &Outcome,
        said: &str,
        undone: &crate::store::Undone,
    ) -> Result<(), Error> {
        tracing::info!("the reroll of {said} could not be done and is undone; nothing changed");
        if let Err(e) = manifest::write(store, &run.id, &run.dir).await {
            tracing::error!("{e}");
        }
        self.view
            .summary(&crate::report::summary::summary_of(store, &run.id).await?)?;
        Err(conclude::undone(said, &run.id, undone, outcome))
    }

    /// Records how the run ended, shows the summary, writes the report when asked, and
    /// returns the error its exit code needs.
    async fn conclude(
        &self,
        conn: &Connection,
        store: &Store,
        run: &OpenRun,
        outcome: Outcome,
        scope: &Scope,
        report: &mut Option<String>,
    ) -> Result<(), Error> {
        if let Err(e) = manifest::write(store, &run.id, &run.dir).await {
            tracing::error!("{e}");
        }
        let balance_after = conn.balance_now().await.or(outcome.last_balance);
        let totals = store.runs().totals(&run.id).await?;
        let verdict = conclude::verdict(conclude::Ended::of(&outcome, &totals));
        let part_done = verdict.exit == Exit::PartDone;
        let asked = part_done.then(|| conclude::done_as_asked(&scope.said, outcome.held));
        let stop_reason = outcome.stop.as_ref().map(Stop::describe).or(asked);
        store
            .runs()
            .set_status(
                &run.id,
                verdict.status,
                stop_reason.as_deref(),
                balance_after,
            )
            .await?;
        // A part done as asked is there to be looked at: its report is written unasked, before
        // the summary, which names it.
        if self.settings.report || part_done {
            *report = write_report(store, &run.id).await;
        }
        let mut summary = crate::report::summary::summary_of(store, &run.id).await?;
        summary.report.clone_from(report);
        self.view.summary(&summary)?;
        let (resume, rest) = (
            self.view.continue_command(&run.id),
            self.view.continue_rest(&run.id),
        );
        let words = conclude::Words {
            resume: &resume,
            rest: &rest,
            report: report.as_deref(),
            said: &scope.said,
            held: outcome.held,
            totals: &totals,
        };
        verdict.exit.into_result(outcome.stop, &words)
    }
}

/// Each step's name and task count, in pipeline order, for the progress shown.
fn steps_of(doc: &PlanDocument) -> Vec<(String, u64)> {
    let steps = doc.costs.steps.iter();
    steps.map(|s| (s.step.clone(), s.tasks)).collect()
}

/// The run's hold on the spending caps that cover its pipeline; `None` when none does.
async fn leash(
    store: &Store,
    pipeline: &Pipeline,
    run_id: &RunId,
) -> Result<Option<crate::money::caps::Leash>, Error> {
    let caps = crate::money::caps::recorded(store).await?;
    Ok(crate::money::caps::Leash::open(store, caps, &pipeline.name, run_id).await?)
}

/// The run's hold on its account's rate limit, shared with every process that spends on the
/// account through this state database; `None` without a known rate (as before: unlimited
/// until a 429), or when the database cannot enrol it (said, and the run paces itself alone).
async fn account_rate(
    store: &Store,
    conn: &Connection,
    rate: Option<f64>,
    run_id: &RunId,
) -> Option<exec::account_rate::AccountRate> {
    let rate = rate.filter(|r| r.is_finite() && *r > 0.0)?;
    let account = conn.client.account_digest();
    let own = match std::env::var(exec::account_rate::TEST_RATE_STATE_ENV) {
        Ok(place) if !place.is_empty() => {
            let location = crate::store::Location::parse(&place, "the rate's state").ok()?;
            Store::open_existing(&location).await.ok()
        }
        _ => None,
    };
    let store = own.as_ref().unwrap_or(store);
    let opened = exec::account_rate::AccountRate::open(store, account, rate, run_id);
    match tokio::time::timeout(exec::account_rate::ANSWER_WITHIN, opened).await {
        Ok(Ok(shared)) => Some(shared),
        Ok(Err(e)) => {
            tracing::warn!(
                "cannot share the account's rate through the state database ({e}): this run keeps to {rate} a second alone"
            );
            None
        }
        Err(_) => {
            tracing::warn!(
                "the state database did not answer in time to share the account's rate: this run keeps to {rate} a second alone"
            );
            None
        }
    }
}

/// By step, whether its price needs no single call to confirm it: a price the service
/// states, or a discovering call billed, or one an earlier call of the same kind (in any run
/// of the state database) was billed exactly. A price that is only written down, in the
/// pipeline file or in the spec, is tested by one call before the others go.
async fn known_prices(store: &Store, doc: &PlanDocument) -> Result<Vec<bool>, Error> {
    let mut known = Vec::with_capacity(doc.costs.steps.len());
    for step in &doc.costs.steps {
        known.push(match (&step.price_source, step.credits_per_task) {
            (_, None) | (PriceSource::Unknown { .. }, _) => false,
            (PriceSource::Models { .. } | PriceSource::Discovered { .. }, _) => true,
            (PriceSource::Pipeline | PriceSource::Spec, Some(credits)) => {
                store
                    .runs()
                    .billed_as_planned(&step.operation, credits)
                    .await?
            }
        });
    }
    Ok(known)
}

/// Writes the report next to the manifest and gives where it is. The run's own exit code
/// stands either way: a report that cannot be written is said on stderr, with the command
/// that tries again.
pub(super) async fn write_report(store: &Store, run_id: &RunId) -> Option<String> {
    let written = match store.runs().get(run_id).await {
        Ok(Some(row)) => crate::report::write(store, row, None, Default::default()).await,
        Ok(None) => return None,
        Err(e) => Err(e.into()),
    };
    match written {
        Ok(w) => {
            tracing::info!(
                "report written to {} ({} images, {} new thumbnails)",
                w.path,
                w.images,
                w.thumbnails_made
            );
            Some(w.path.to_string())
        }
        Err(e) => {
            tracing::error!(
                "cannot write the report: {e}\nhint: `imgpipe report {run_id}` tries again"
            );
            None
        }
    }
}
