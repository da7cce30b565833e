//! The lifecycle of a run, as explicit stages in the order they happen:
//!
//! 1. **load** the pipeline file (or the run's own copy of it);
//! 2. **open** the state database and find whether the run id is recorded;
//! 3. **plan** against the service: the balance and the generation price ([`service`]);
//! 4. **lock** the pipeline in the state database ([`state`]);
//! 5. **record** a fresh run ([`record`]), or continue a recorded one ([`recorded`]: locked,
//!    read again and planned again here, then the stages of [`crate::resume`]: prepare, the
//!    review and its refusals, and apply, which hands the executor its work);
//! 6. **admit** what is to be paid for against the budget and the balance ([`admit`]); a
//!    continuation refused for money keeps what was already paid for first ([`refused`]);
//! 7. **discover** the generation price by one call, when asked ([`discover`]);
//! 8. **execute** the tasks and **conclude**: status, manifest, summary, report ([`execute`]).
//!
//! `run`, `resume` and `plan --reuse` all come through here; the command line only parses
//! its arguments and renders what a [`View`] is given.

pub mod admit;
mod conclude;
mod discover;
mod execute;
pub mod record;
mod recorded;
mod refused;
mod reviewed;
pub mod service;
pub mod state;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::exec::{self, Observer, OnAmbiguous};
use crate::money;
use crate::pipeline::{self, Loaded, Pipeline, Report};
use crate::plan::document::{PlanDocument, ReuseEstimate};
use crate::plan::graph::Graph;
use crate::plan::scope::Scope;
use crate::report::summary::Summary;
use crate::resume::Review;
use crate::run_id::RunId;
use crate::store::{Run, StepCounts};

pub use service::{AccountFields, Connection, ServiceSettings};
pub use state::StateLocation;

/// When neither flag, pipeline nor account says how many calls may be in flight.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// Downloads in flight: they cost nothing and take no API rate, but each holds a connection.
pub const DEFAULT_DOWNLOADS: usize = 8;
/// Retries of a call after server errors or connection failures.
const MAX_RETRIES: u32 = 5;

/// How to run, resolved and checked from the command line.
#[derive(Clone, Debug)]
pub struct Settings {
    pub state: StateLocation,
    pub allow_changes: bool,
    pub reuse: bool,
    pub wait: bool,
    /// `--items`: the items to pay for now (a sample's seed drawn).
    pub items: Option<crate::plan::scope::ItemSelector>,
    /// `--until`: the step to stop after.
    pub until: Option<String>,
    /// Paid calls in flight; else the pipeline's, the account's, or [`DEFAULT_CONCURRENCY`].
    pub concurrency: Option<usize>,
    /// Paid calls per second; else the pipeline's, or the account's.
    pub rate: Option<f64>,
    pub max_credits: Option<u64>,
    pub on_ambiguous: OnAmbiguous,
    pub url_ttl: Duration,
    pub url_margin: Duration,
    pub download_concurrency: usize,
    pub grace: Duration,
    pub report: bool,
    pub retry_base: Duration,
    /// Alerts and metrics (`--notify`, `--metrics-file`).
    pub events: crate::events::Config,
    /// The price a confirm agreed to (`--expect-credits`, `--expect-revision`, a saved plan,
    /// the desk's confirm): the gate refuses any other, under the run's lock.
    pub expect: crate::money::Expected,
}

/// What `imgpipe run` was asked.
#[derive(Clone, Debug, Default)]
pub struct RunRequest {
    /// The pipeline file; with only `saved_plan`, the file the plan names.
    pub file: Option<PathBuf>,
    pub saved_plan: Option<PathBuf>,
    pub run_id: Option<RunId>,
    pub out: Option<crate::place::Address>,
    pub discover_price: bool,
    pub dry_run: bool,
}

/// A recorded run reviewed for resuming: what `resume --dry-run` shows.
pub struct Reviewed<'a> {
    pub row: &'a Run,
    pub graph: &'a Graph,
    pub review: &'a Review,
    /// The most that may be spent now: the limit.
    pub limit: Option<u64>,
    /// What the budget has left, and the balance, of which `limit` is the least.
    pub budget_left: Option<u64>,
    pub balance: Option<u64>,
    /// What it would pay, and the revision a confirm carries back.
    pub priced: &'a crate::money::Priced,
    /// Where each cap covering the run's pipeline stands: it may leave less than `limit`.
    pub caps: &'a [crate::money::caps::Standing],
}

/// What the command line renders; the runner decides when.
pub trait View: Send + Sync {
    /// The problems of a pipeline file, each with its line.
    fn diagnostics(&self, report: &Report);
    /// The plan: a dry run, or a run refused before it started.
    fn plan(&self, doc: &PlanDocument) -> Result<(), Error>;
    /// What resuming a run would pay for (`--dry-run`).
    fn review(&self, reviewed: &Reviewed<'_>) -> Result<(), Error>;
    /// A dry run of a run that is finished: nothing to pay for.
    fn finished(&self, run_id: &RunId) -> Result<(), Error>;
    /// The gate let a confirmed spend through: the run's lock is held, the price and revision
    /// confirmed are those now, and it fits. What follows is paid for.
    fn admitted(&self, _priced: &crate::money::Priced) {}
    /// The run's summary when it ends, or when it was already finished.
    fn summary(&self, summary: &Summary) -> Result<(), Error>;
    /// Live progress of the execution: each step's name and task count, in pipeline order,
    /// and what earlier attempts at the run already did.
    fn progress(
        &self,
        steps: &[(String, u64)],
        done: &[StepCounts],
        planned: u64,
    ) -> Arc<dyn Observer>;
    /// The command that continues run `run_id`, as it can be pasted: the part it was asked
    /// for (`--items`, `--until`) when it was asked for one.
    fn continue_command(&self, run_id: &RunId) -> String;
    /// The command that continues all of run `run_id`, beyond the part it was asked for.
    fn continue_rest(&self, run_id: &RunId) -> String;
}

/// One command's run of the lifecycle.
pub struct Runner<'a> {
    pub settings: &'a Settings,
    pub service: &'a ServiceSettings,
    pub view: &'a dyn View,
    /// Cancelled on SIGINT/SIGTERM.
    pub shutdown: CancellationToken,
}

impl Runner<'_> {
    /// `imgpipe run`: a fresh run, or the recorded run of that id continued.
    pub async fn run(&self, request: &RunRequest) -> Result<(), Error> {
        let saved = request
            .saved_plan
            .as_deref()
            .map(admit::read_plan)
            .transpose()?;
        let file = match (&request.file, &saved) {
            (Some(f), _) => f.clone(),
            (None, Some(doc)) => PathBuf::from(&doc.pipeline.file),
            (None, None) => return Err(Error::usage("name a pipeline file or --plan", None)),
        };
        let pipeline = checked(self.view, &file, pipeline::load(&file))?;
        let scope = self.scope(&pipeline)?;
        if let Some(id) = &request.run_id {
            record::check_run_id(id)?;
            let store = self.settings.state.open().await?;
            if let Some(row) = store.runs().get(id).await? {
                let result = self
                    .continued(&store, row, Some(pipeline), request.dry_run, None)
                    .await;
                return state::close(store, result).await;
            }
            state::close(store, Ok(())).await?;
        }
        let conn = Connection::open(self.service).await?;
        let (balance, generation) = conn.ask(&pipeline).await?;
        // A saved plan's budget holds unless the command line lowers it.
        let saved_budget = saved
            .as_ref()
            .and_then(|d| d.budget.as_ref())
            .map(|b| b.max_credits);
        let max_credits = crate::money::limit::least(self.settings.max_credits, saved_budget);
        let doc = crate::plan::make(&pipeline, generation, balance, max_credits);
        let mut doc = crate::plan::narrow(doc, &pipeline, &scope);
        let expect = admit::expected(&self.settings.expect, saved.as_ref())?;
        if saved.is_some() {
            // A saved plan that no longer holds is said before anything else, dry run or not.
            admit::gate(&doc, &expect, saved.as_ref())?;
        }
        doc.caps = cap_fits(&self.settings.state, &pipeline, &doc).await;
        let reuse = self.settings.reuse || pipeline.reuse;
        if request.dry_run && !reuse {
            self.view.plan(&doc)?;
            return Ok(money::admit::refusal(&doc.claim())?);
        }
        let store = self.settings.state.open().await?;
        let fresh = Fresh {
            request,
            conn: &conn,
            store: &store,
            pipeline: &pipeline,
            reuse,
            scope,
            expect,
            saved: saved.as_ref(),
        };
        let result = self.fresh(fresh, doc).await;
        state::close(store, result).await
    }

    /// `imgpipe reroll RUN_ID TASK...`: the named tasks of a run and what is downstream of
    /// them paid for again, their earlier outputs set aside.
    pub async fn reroll(
        &self,
        run_id: &RunId,
        targets: &[crate::resume::Target],
        dry_run: bool,
    ) -> Result<(), Error> {
        let store = self.settings.state.open_existing().await?;
        let result = match store.runs().get(run_id).await {
            Err(e) => Err(e.into()),
            Ok(None) => Err(state::no_such_run(&store, run_id)),
            Ok(Some(row)) => {
                self.continued(&store, row, None, dry_run, Some(targets))
                    .await
            }
        };
        state::close(store, result).await
    }

    /// `imgpipe resume RUN_ID`.
    pub async fn resume(&self, run_id: &RunId, dry_run: bool) -> Result<(), Error> {
        let store = self.settings.state.open_existing().await?;
        let result = match store.runs().get(run_id).await {
            Err(e) => Err(e.into()),
            Ok(None) => Err(state::no_such_run(&store, run_id)),
            Ok(Some(row)) => self.continued(&store, row, None, dry_run, None).await,
        };
        state::close(store, result).await
    }
}

/// `plan --reuse`: what the earlier runs in the state database would save, without creating
/// the database when there is none.
pub async fn reuse_estimate(
    state: &StateLocation,
    pipeline: &Pipeline,
    doc: &PlanDocument,
    scope: &Scope,
) -> Result<ReuseEstimate, Error> {
    if !state.exists() {
        return Ok(ReuseEstimate {
            tasks: 0,
            credits_saved: 0,
            credits_to_pay: doc.costs.total_credits,
        });
    }
    let store = state.open().await?;
    let graph = Graph::build(pipeline, &doc.costs)?;
    // No run of its own: every task looks new, and any earlier run may supply it.
    let review = crate::resume::review(&store, None, &graph, None, OnAmbiguous::Retry, true).await;
    let mut review = state::close(store, review.map_err(Error::from)).await?;
    review.narrow(&graph, scope);
    Ok(admit::estimate(doc, &review, &graph))
}

/// The spending caps that cover `pipeline`, where each stands now against the plan's total;
/// none when there is no state database yet. A plan needs no state: one that cannot be read
/// (damaged, from a newer imgpipe) is said and left as it is, and the plan goes on.
pub async fn cap_fits(
    state: &StateLocation,
    pipeline: &Pipeline,
    doc: &PlanDocument,
) -> Vec<crate::plan::document::CapFit> {
    if !state.exists() {
        return Vec::new();
    }
    match read_cap_fits(state, pipeline, doc).await {
        Ok(fits) => fits,
        Err(e) => {
            tracing::warn!("the spending caps were not checked: {e}");
            Vec::new()
        }
    }
}

async fn read_cap_fits(
    state: &StateLocation,
    pipeline: &Pipeline,
    doc: &PlanDocument,
) -> Result<Vec<crate::plan::document::CapFit>, Error> {
    let store = state.open_existing().await?;
    let fits = async {
        let mut fits = Vec::new();
        for s in crate::money::caps::covering(&store, &pipeline.name).await? {
            fits.push(crate::plan::document::CapFit {
                fits: doc.costs.total_credits.is_some_and(|t| t <= s.left),
                name: s.name,
                credits: s.credits,
                per: s.per.as_str().to_owned(),
                spent: s.spent,
                left: s.left,
                window_end: s.window_end,
            });
        }
        Ok(fits)
    };
    let fits = fits.await;
    state::close(store, fits).await
}

/// Shows the file's problems and gives the pipeline, or exit 2 when anything is wrong.
pub fn checked(view: &dyn View, file: &Path, loaded: Loaded) -> Result<Pipeline, Error> {
    view.diagnostics(&loaded.report);
    verdict(file, &loaded.report)?;
    loaded
        .pipeline
        .ok_or_else(|| Error::usage(format!("{} could not be read", file.display()), None))
}

/// Exit 2 naming the count of errors, when the file has any.
pub fn verdict(file: &Path, report: &Report) -> Result<(), Error> {
    match report.errors.len() {
        0 => Ok(()),
        n => Err(Error::usage(
            format!(
                "{} has {n} error{}; nothing was sent",
                file.display(),
                if n == 1 { "" } else { "s" }
            ),
            None,
        )),
    }
}

/// A fresh run's inputs, gathered by [`Runner::run`].
struct Fresh<'a> {
    request: &'a RunRequest,
    conn: &'a Connection,
    store: &'a crate::store::Store,
    pipeline: &'a Pipeline,
    reuse: bool,
    scope: Scope,
    /// What the command line or a saved plan confirmed.
    expect: crate::money::Expected,
    saved: Option<&'a PlanDocument>,
}

impl Runner<'_> {
    /// What `--items` and `--until` ask of `pipeline`: exit 2 naming an item or step it
    /// does not have.
    pub(super) fn scope(&self, pipeline: &Pipeline) -> Result<Scope, Error> {
        let (items, until) = (self.settings.items.as_ref(), self.settings.until.as_deref());
        Scope::of(pipeline, items, until).map_err(|e| Error::usage(e.message, e.hint.as_deref()))
    }

    /// A new run: refused unless it fits (after what earlier runs' results save), then
    /// recorded and executed.
    async fn fresh(&self, f: Fresh<'_>, mut doc: PlanDocument) -> Result<(), Error> {
        let run_id = f.request.run_id.clone().unwrap_or_else(record::new_run_id);
        record::check_run_id(&run_id)?;
        let graph = Arc::new(Graph::build(f.pipeline, &doc.costs)?);
        let on_ambiguous = self.settings.on_ambiguous;
        let review = if f.reuse {
            Some(
                crate::resume::review(f.store, Some(&run_id), &graph, None, on_ambiguous, true)
                    .await?,
            )
        } else {
            None
        };
        let review = review.map(|mut r| {
            r.narrow(&graph, &f.scope);
            r
        });
        if let Some(r) = &review {
            doc.reuse = Some(admit::estimate(&doc, r, &graph));
        }
        if f.request.dry_run {
            self.view.plan(&doc)?;
            return Ok(money::admit::refusal_after_reuse(&doc.claim())?);
        }
        let wait = self.settings.wait;
        let held = state::lock(f.store, &f.pipeline.name, &run_id, wait, &self.shutdown).await?;
        // Another process may have started this id while we waited for the lock: continue
        // it (which takes the lock again itself).
        if let Some(row) = f.store.runs().get(&run_id).await? {
            drop(held);
            return self
                .continued(f.store, row, Some(f.pipeline.clone()), false, None)
                .await;
        }
        let _lock = held;
        admit::gate(&doc, &f.expect, f.saved)?;
        let discover = money::admit::needs_discovery(&doc.claim(), f.request.discover_price)?;
        if !discover && let Err(refused) = money::admit::refusal_after_reuse(&doc.claim()) {
            self.view.plan(&doc)?;
            return Err(refused.into());
        }
        let out_dir = f
            .request
            .out
            .clone()
            .unwrap_or_else(|| f.pipeline.output_dir.clone());
        let run = record::create(f.store, &run_id, f.pipeline, &doc, &graph, &out_dir).await?;
        if let Some(review) = &review {
            let applied = crate::resume::apply(
                f.store,
                &f.conn.client,
                &run.id,
                &run.dir,
                &graph,
                review,
                |t| exec::new_task(&graph, t),
            )
            .await?;
            if applied.reused > 0 {
                tracing::info!(
                    "{} task(s) reused from earlier runs, saving {}",
                    applied.reused,
                    crate::money::credits(review.saved_by_reuse(&graph))
                );
            }
        }
        // A new run keeps no output of its own: nothing to check.
        let start = execute::Start {
            run,
            graph,
            doc,
            discover,
            handoff: None,
            scope: f.scope,
            reroll: None,
        };
        self.execute(f.conn, f.store, f.pipeline, start).await
    }

    /// The exec configuration's fixed part, from the settings.
    fn exec_config(&self, run: &record::OpenRun, pipeline_name: &str) -> exec::Config {
        let s = self.settings;
        exec::Config {
            run_id: run.id.clone(),
            run_dir: run.dir.clone(),
            place: run.place.clone(),
            concurrency: s.concurrency.unwrap_or(DEFAULT_CONCURRENCY),
            rate: s.rate,
            download_concurrency: s.download_concurrency,
            on_ambiguous: s.on_ambiguous,
            url_ttl: s.url_ttl,
            url_margin: s.url_margin,
            retry_base: s.retry_base,
            max_retries: MAX_RETRIES,
            grace: s.grace,
            limit: None,
            only: None,
            scope: Scope::all(),
            known_prices: Vec::new(),
            leash: None,
            account_rate: None,
            pipeline_name: pipeline_name.to_owned(),
            reroll_credits: 0,
        }
    }
}
