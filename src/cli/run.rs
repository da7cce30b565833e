//! `imgpipe run FILE`: plan, refuse what cannot be paid for, then execute with every step
//! recorded in the state database and every output downloaded.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::cli::GlobalArgs;
use crate::cli::connect::{Connection, seconds};
use crate::cli::progress::Progress;
use crate::cli::{plan, preflight, resume, summary, validate};
use crate::error::Error;
use crate::exec::{self, OnAmbiguous};
use crate::pipeline::{self, Pipeline};
use crate::plan::document::{PlanDocument, ReuseEstimate};
use crate::plan::graph::Graph;
use crate::store::{self, Store};

/// When neither flag, pipeline nor account says how many calls may be in flight.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// Downloads in flight: they cost nothing and take no API rate, but each holds a connection.
pub const DEFAULT_DOWNLOADS: usize = 8;
/// Retries of a call after server errors or connection failures.
const MAX_RETRIES: u32 = 5;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pipeline file (optional with --plan, which names it)
    #[arg(required_unless_present = "plan")]
    pub file: Option<PathBuf>,
    /// Run exactly this saved plan (from `imgpipe plan --save`); refuse if anything changed
    #[arg(long, value_name = "PLAN.json")]
    pub plan: Option<PathBuf>,
    /// Print the plan (or, for a run that exists, what resuming it would pay for) and stop
    #[arg(long)]
    pub dry_run: bool,
    /// The run's id: names its directory under the output directory. An unfinished run of
    /// that id is resumed; a finished one is only summarised [default: the time and a random
    /// suffix]
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Output directory, instead of the pipeline's output_dir
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// When the generation price is unknown, run one generation first and price the plan
    /// with what it billed
    #[arg(long)]
    pub discover_price: bool,
    #[command(flatten)]
    pub opts: RunOptions,
}

/// Options of every command that runs tasks: `run` and `resume`.
#[derive(Debug, Args)]
pub struct RunOptions {
    /// Resume a run even though its pipeline file (or items) changed: tasks whose request and
    /// input images are unchanged keep their results; the others run again
    #[arg(long)]
    pub allow_changes: bool,
    /// Take the results of tasks that succeeded in earlier runs (same request, same input
    /// images) instead of paying for them again; also `reuse: true` in the pipeline file
    #[arg(long)]
    pub reuse: bool,
    /// When another run of this pipeline holds the lock, wait for it instead of exiting 5
    #[arg(long)]
    pub wait: bool,
    /// Paid calls in flight at once [default: pipeline, else the account's limit, else 4]
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// Paid calls per second, minute or hour, e.g. 5/s or 120/min [default: pipeline, else
    /// the account's limit, else none until the service answers 429]
    #[arg(long, value_name = "SPEC")]
    pub rate: Option<String>,
    /// Most credits the run may spend; the smaller of this and budget.max_credits applies
    #[arg(long, value_name = "CREDITS")]
    pub max_credits: Option<u64>,
    /// A call sent without a complete answer may have been billed: call again, or fail the
    /// task (also for calls in flight when an earlier process died)
    #[arg(long, value_enum, default_value = "retry")]
    pub on_ambiguous: OnAmbiguous,
    /// The state database [default: $XDG_STATE_HOME/imgpipe/state.db]
    #[arg(long, env = "IMGPIPE_STATE", value_name = "PATH")]
    pub state: Option<PathBuf>,
    /// Lifetime of result URLs in seconds (the spec says one hour)
    #[arg(long, default_value_t = 3600.0, value_name = "SECS")]
    pub url_ttl: f64,
    /// Refresh an input URL this many seconds before it expires
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub url_margin: f64,
    /// Downloads in flight at once
    #[arg(long, default_value_t = DEFAULT_DOWNLOADS, value_name = "N")]
    pub download_concurrency: usize,
    /// Seconds calls in flight may take to finish after SIGINT/SIGTERM
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub grace: f64,
    /// Write the run's HTML report (report.html, next to the manifest) when it ends
    #[arg(long)]
    pub report: bool,
    /// First retry delay in milliseconds (tests set it low)
    #[arg(long, default_value_t = 500, hide = true)]
    pub retry_base_ms: u64,
}

pub async fn run(args: &RunArgs, global: &GlobalArgs) -> Result<(), Error> {
    let saved = args
        .plan
        .as_ref()
        .map(|p| preflight::read_plan(p))
        .transpose()?;
    let file = match (&args.file, &saved) {
        (Some(f), _) => f.clone(),
        (None, Some(doc)) => PathBuf::from(&doc.pipeline.file),
        (None, None) => return Err(Error::usage("name a pipeline file or --plan", None)),
    };
    let pipeline = validate::checked(&file, pipeline::load(&file))?;
    if let Some(id) = &args.run_id {
        preflight::check_run_id(id)?;
        let store = open_store(args.opts.state.as_ref(), global.sandbox).await?;
        if let Some(row) = store.run(id).await? {
            let result =
                resume::existing(&store, row, pipeline, &args.opts, args.dry_run, global).await;
            return close(store, result).await;
        }
    }
    let conn = Connection::open(global).await?;
    let (balance, generation) = plan::ask_service(&conn, &pipeline, global).await?;
    // A saved plan's budget holds unless the command line lowers it.
    let saved_budget = saved
        .as_ref()
        .and_then(|d| d.budget.as_ref())
        .map(|b| b.max_credits);
    let max_credits = crate::plan::tighter(args.opts.max_credits, saved_budget);
    let doc = plan::document(&pipeline, generation, balance, max_credits);
    if let Some(saved) = &saved {
        preflight::same_as_saved(saved, &doc)?;
    }
    let reuse = args.opts.reuse || pipeline.reuse;
    if args.dry_run && !reuse {
        plan::print(&doc, global)?;
        return plan::refusal(&doc);
    }
    let store = open_store(args.opts.state.as_ref(), global.sandbox).await?;
    let result = fresh(args, global, &conn, &store, &pipeline, doc, reuse).await;
    close(store, result).await
}

/// Everything is committed already; closing only tidies the WAL, and must not hang an exit.
pub async fn close<T>(store: Store, result: Result<T, Error>) -> Result<T, Error> {
    let _ = tokio::time::timeout(Duration::from_secs(5), store.close()).await;
    result
}

/// A new run: refused unless it fits (after what earlier runs' results save), then recorded
/// and executed.
async fn fresh(
    args: &RunArgs,
    global: &GlobalArgs,
    conn: &Connection,
    store: &Store,
    pipeline: &Pipeline,
    doc: PlanDocument,
    reuse: bool,
) -> Result<(), Error> {
    let run_id = args.run_id.clone().unwrap_or_else(preflight::new_run_id);
    preflight::check_run_id(&run_id)?;
    let graph = build_graph(pipeline, &doc.costs)?;
    let review = if reuse {
        Some(
            exec::resume::review(store, &run_id, &graph, None, args.opts.on_ambiguous, true)
                .await?,
        )
    } else {
        None
    };
    let mut doc = doc;
    if let Some(r) = &review {
        doc.reuse = Some(estimate(&doc, r, &graph));
    }
    if args.dry_run {
        plan::print(&doc, global)?;
        return refusal_after_reuse(&doc);
    }
    let held = lock(store, &pipeline.name, &run_id, args.opts.wait).await?;
    // Another process may have started this id while we waited for the lock: resume it
    // (which takes the lock again itself).
    if let Some(row) = store.run(&run_id).await? {
        drop(held);
        return resume::existing(store, row, pipeline.clone(), &args.opts, false, global).await;
    }
    let _lock = held;
    let discover = preflight::needs_discovery(&doc, args.discover_price)?;
    if !discover && let Err(refused) = refusal_after_reuse(&doc) {
        plan::print(&doc, global)?;
        return Err(refused);
    }
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| pipeline.output_dir.clone());
    let run = preflight::create_run(store, &run_id, pipeline, &doc, &graph, &out_dir).await?;
    if let Some(review) = &review {
        let applied = exec::resume::apply(
            store,
            &conn.client,
            &run.id,
            &run.dir,
            &graph,
            review,
            |t| preflight::new_task(&graph, t),
        )
        .await?;
        if applied.reused > 0 {
            tracing::info!(
                "{} task(s) reused from earlier runs, saving {} credits",
                applied.reused,
                review.saved_by_reuse(&graph)
            );
        }
    }
    let start = Start {
        run,
        graph,
        doc,
        discover,
        resume: format!(
            "imgpipe run {} --run-id {}",
            file_for_resume(args, pipeline),
            run_id
        ),
    };
    execute(&args.opts, global, conn, store, pipeline, start).await
}

pub fn build_graph(pipeline: &Pipeline, costs: &crate::plan::Costs) -> Result<Arc<Graph>, Error> {
    Graph::build(pipeline, costs)
        .map(Arc::new)
        .map_err(|e| Error::Other(anyhow::anyhow!(e)))
}

/// The plan's verdict, except that credits saved by reuse count: a run whose reused tasks
/// bring it within the budget and the balance may start.
pub fn refusal_after_reuse(doc: &PlanDocument) -> Result<(), Error> {
    let saved = doc.reuse.as_ref().map_or(0, |r| r.credits_saved);
    if doc.verdict.fits || saved == 0 {
        return plan::refusal(doc);
    }
    let Some(total) = doc.costs.total_credits else {
        return plan::refusal(doc);
    };
    let needed = total.saturating_sub(saved);
    match preflight::cap_of(doc, 0) {
        Some(cap) if needed > cap => plan::refusal(doc),
        _ => Ok(()),
    }
}

pub fn estimate(doc: &PlanDocument, review: &exec::resume::Review, graph: &Graph) -> ReuseEstimate {
    let saved = review.saved_by_reuse(graph);
    ReuseEstimate {
        tasks: review.reuse.len(),
        credits_saved: saved,
        credits_to_pay: doc.costs.total_credits.map(|t| t.saturating_sub(saved)),
    }
}

/// `plan --reuse`: what the earlier runs in the state database would save, without creating
/// the database when there is none.
pub async fn reuse_estimate(
    state: Option<&PathBuf>,
    sandbox: bool,
    pipeline: &Pipeline,
    doc: &PlanDocument,
) -> Result<Option<ReuseEstimate>, Error> {
    let path = state_path(state, sandbox);
    if !path.as_ref().is_some_and(|p| p.exists()) {
        return Ok(Some(ReuseEstimate {
            tasks: 0,
            credits_saved: 0,
            credits_to_pay: doc.costs.total_credits,
        }));
    }
    let store = open_store(path.as_ref(), sandbox).await?;
    let graph = build_graph(pipeline, &doc.costs)?;
    // A run id no run has: every task looks new, and any earlier run may supply it.
    let review = exec::resume::review(&store, "", &graph, None, OnAmbiguous::Retry, true).await;
    store.close().await;
    Ok(Some(estimate(doc, &review?, &graph)))
}

fn state_path(flag: Option<&PathBuf>, sandbox: bool) -> Option<PathBuf> {
    let default = || {
        store::default_path().map(|p| {
            if sandbox {
                p.with_file_name(store::SANDBOX_FILE)
            } else {
                p
            }
        })
    };
    flag.cloned().or_else(default)
}

/// The state database. Runs on the embedded sandbox get their own by default: its jobs vanish
/// with it, so they must never mix with, or be reused by, runs against the real service.
pub async fn open_store(flag: Option<&PathBuf>, sandbox: bool) -> Result<Store, Error> {
    open_at(&store_path(flag, sandbox)?).await
}

/// The state database of a command that reads what runs recorded: never created, so a
/// mistyped path is said, not left behind as an empty database.
pub async fn open_existing_store(flag: Option<&PathBuf>, sandbox: bool) -> Result<Store, Error> {
    let path = store_path(flag, sandbox)?;
    if !path.exists() {
        return Err(Error::usage(
            format!("there is no state database at {}", path.display()),
            Some(NO_DATABASE_HINT),
        ));
    }
    open_at(&path).await
}

pub const NO_DATABASE_HINT: &str = "--state (or IMGPIPE_STATE) names the database the run used; runs made with --sandbox are in sandbox.db beside the default one: add --sandbox";

pub fn store_path(flag: Option<&PathBuf>, sandbox: bool) -> Result<PathBuf, Error> {
    state_path(flag, sandbox).ok_or_else(|| {
        Error::usage(
            "no place for the state database: HOME and XDG_STATE_HOME are unset",
            Some("pass --state PATH or set IMGPIPE_STATE"),
        )
    })
}

async fn open_at(path: &std::path::Path) -> Result<Store, Error> {
    Store::open(path).await.map_err(|e| Error::Usage {
        hint: e.hint().map(str::to_owned),
        message: e.to_string(),
    })
}

/// One run of a pipeline at a time per state database: exit 5 naming the holder, or wait.
pub async fn lock(
    store: &Store,
    pipeline: &str,
    run_id: &str,
    wait: bool,
) -> Result<store::lock::RunLock, Error> {
    let (db, name, id) = (
        store.path().to_path_buf(),
        pipeline.to_owned(),
        run_id.to_owned(),
    );
    let taking = tokio::task::spawn_blocking(move || store::lock::acquire(&db, &name, &id, wait));
    let taken = tokio::select! {
        taken = taking => taken.map_err(|e| Error::Other(e.into()))?,
        () = crate::cli::shutdown_signal() => {
            return Err(Error::Interrupted { detail: Some("nothing was started".into()) });
        }
    };
    taken.map_err(|e| match e {
        store::lock::LockError::Held { .. } => Error::Locked {
            message: e.to_string(),
            hint: "wait for it with --wait; a lock left by a process that died never blocks".into(),
        },
        other => Error::Other(other.into()),
    })
}

/// A run ready to execute.
pub struct Start {
    pub run: preflight::OpenRun,
    pub graph: Arc<Graph>,
    pub doc: PlanDocument,
    pub discover: bool,
    /// The command that continues the run, when it is interrupted.
    pub resume: String,
}

pub async fn execute(
    opts: &RunOptions,
    global: &GlobalArgs,
    conn: &Connection,
    store: &Store,
    pipeline: &Pipeline,
    start: Start,
) -> Result<(), Error> {
    let Start {
        run,
        mut graph,
        mut doc,
        discover,
        resume,
    } = start;
    let mut config = config(opts, global, conn, pipeline, &doc, &run).await?;
    if discover {
        let found = preflight::discover(conn, store, &graph, &config, &doc.balance).await?;
        let budget = doc.budget.as_ref().map(|b| b.max_credits);
        doc = plan::document(pipeline, found, doc.balance.clone(), budget);
        graph = build_graph(pipeline, &doc.costs)?;
        preflight::reprice(store, &run.id, &graph).await?;
        if !doc.verdict.fits {
            plan::print(&doc, global)?;
            store
                .set_run_status(
                    &run.id,
                    store::RunStatus::Stopped,
                    Some("the discovered price does not fit"),
                    None,
                )
                .await?;
            return plan::refusal(&doc);
        }
        // The plan was judged against the balance before the discovering call; what may be
        // spent now is bounded by the balance after it.
        let budget_cap = preflight::cap(store, &run.id, &doc).await?;
        let fresh = conn
            .client
            .account()
            .await
            .ok()
            .and_then(|a| a.balance(global.balance_field.as_deref()).ok())
            .map(|f| u64::try_from(f.value).unwrap_or(0));
        config.cap = crate::plan::tighter(budget_cap, fresh);
    }
    let steps: Vec<(String, u64)> = doc
        .costs
        .steps
        .iter()
        .map(|s| (s.step.clone(), s.tasks))
        .collect();
    let live = std::io::stderr().is_terminal() && !global.quiet && !global.json;
    let progress = Arc::new(Progress::new(
        &steps,
        doc.costs.total_credits.unwrap_or(doc.costs.known_credits),
        live,
    ));
    let tasks = store.tasks(&run.id).await?;
    progress.resume_from(&tasks);
    tracing::info!(
        "run {} started: {} tasks, {} credits planned, output in {}",
        run.id,
        doc.costs.tasks,
        doc.costs.known_credits,
        config.run_dir.display()
    );
    let outcome = exec::run(
        Arc::clone(&graph),
        store.clone(),
        conn.client.clone(),
        conn.downloader.clone(),
        config.clone(),
        progress.clone(),
        crate::cli::shutdown_signal(),
    )
    .await?;
    progress.finish();
    let after = summary::After {
        resume: &resume,
        report: opts.report,
    };
    summary::conclude(conn, store, &run, &config, after, outcome, global).await
}

fn file_for_resume(args: &RunArgs, pipeline: &Pipeline) -> String {
    args.file
        .as_ref()
        .map_or_else(|| pipeline.file.clone(), |f| f.display().to_string())
}

async fn config(
    args: &RunOptions,
    global: &GlobalArgs,
    conn: &Connection,
    pipeline: &Pipeline,
    doc: &PlanDocument,
    run: &preflight::OpenRun,
) -> Result<exec::Config, Error> {
    let account = conn.client.account().await.ok();
    let limits = global.limits_field.as_deref();
    let concurrency = match (args.concurrency, pipeline.concurrency) {
        (Some(0), _) => return Err(Error::usage("--concurrency must be at least 1", None)),
        (Some(n), _) => n,
        (None, Some(n)) => n.get() as usize,
        (None, None) => account
            .as_ref()
            .and_then(|a| a.max_concurrency(limits))
            .map_or(DEFAULT_CONCURRENCY, |f| f.value.min(256) as usize),
    };
    let rate = match (&args.rate, pipeline.rate_limit) {
        (Some(spec), _) => Some(
            spec.parse::<crate::pipeline::rate::Rate>()
                .map_err(|e| {
                    Error::usage(
                        format!("--rate: {e}"),
                        Some("write it like 5/s, 120/min or 1000/h"),
                    )
                })?
                .per_second(),
        ),
        (None, Some(rate)) => Some(rate.per_second()),
        (None, None) => account
            .as_ref()
            .and_then(|a| a.requests_per_second(limits))
            .map(|f| f.value),
    };
    if args.download_concurrency == 0 {
        return Err(Error::usage(
            "--download-concurrency must be at least 1",
            None,
        ));
    }
    let url_ttl = seconds("--url-ttl", args.url_ttl)?;
    let url_margin = Duration::try_from_secs_f64(args.url_margin)
        .ok()
        .filter(|m| *m < url_ttl)
        .ok_or_else(|| {
            Error::usage(
                "--url-margin must be 0 or more and shorter than --url-ttl",
                None,
            )
        })?;
    Ok(exec::Config {
        run_id: run.id.clone(),
        run_dir: run.dir.clone(),
        concurrency,
        rate,
        download_concurrency: args.download_concurrency,
        on_ambiguous: args.on_ambiguous,
        url_ttl,
        url_margin,
        retry_base: Duration::from_millis(args.retry_base_ms),
        max_retries: MAX_RETRIES,
        grace: seconds("--grace", args.grace)?,
        cap: preflight::cap_of(doc, run.billed),
        only: None,
    })
}
