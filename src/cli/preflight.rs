//! What `run` checks and prepares before the first paid call: a saved plan still true, the
//! run recorded (or found, to continue it), the cap on spending, and a discovered price.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cli::connect::Connection;
use crate::error::Error;
use crate::exec::{self, Observer};
use crate::pipeline::Pipeline;
use crate::pipeline::items::check_id;
use crate::plan::document::{FORMAT, KIND, PlanDocument};
use crate::plan::graph::Graph;
use crate::plan::graph::Work;
use crate::plan::{Balance, GenerationPrice, PriceSource};
use crate::store::{self, NewRun, NewTask, RunStatus, Store, TaskStatus};

pub fn read_plan(path: &Path) -> Result<PlanDocument, Error> {
    let text = std::fs::read(path).map_err(|e| {
        Error::usage(
            format!("cannot read the plan {}: {e}", path.display()),
            None,
        )
    })?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| Error::usage(format!("{} is not JSON: {e}", path.display()), None))?;
    if value.get("kind").and_then(|k| k.as_str()) != Some(KIND) {
        return Err(Error::usage(
            format!("{} is not an imgpipe plan", path.display()),
            Some("save one with `imgpipe plan FILE --save PLAN.json`"),
        ));
    }
    if value.get("format").and_then(|f| f.as_u64()) != Some(u64::from(FORMAT)) {
        return Err(Error::usage(
            format!(
                "{} is a plan in a format this imgpipe does not read",
                path.display()
            ),
            Some("make the plan again with this imgpipe"),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| Error::usage(format!("{}: {e}", path.display()), None))
}

/// Refuses a run whose pipeline, items or prices differ from the saved plan's.
pub fn same_as_saved(saved: &PlanDocument, now: &PlanDocument) -> Result<(), Error> {
    let mut changed = Vec::new();
    if saved.pipeline.sha256 != now.pipeline.sha256 {
        changed.push(format!("the pipeline file {} changed", now.pipeline.file));
    }
    if saved.items.sha256 != now.items.sha256 {
        changed.push(format!(
            "the items changed ({} then, {} now)",
            saved.items.count, now.items.count
        ));
    }
    if saved.prices.sha256 != now.prices.sha256 {
        let show = |d: &PlanDocument| {
            d.prices
                .generation
                .credits
                .map_or_else(|| "unknown".to_owned(), |c| c.to_string())
        };
        changed.push(format!(
            "the prices changed (a generated image: {} then, {} now)",
            show(saved),
            show(now)
        ));
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(Error::Refused {
        message: format!(
            "the saved plan (made {}) no longer holds: {}",
            saved.created_at,
            changed.join("; ")
        ),
        hint: Some("plan again with `imgpipe plan FILE --save PLAN.json` and review it".into()),
    })
}

/// Whether to discover the generation price: only when it alone stops the run.
pub fn needs_discovery(doc: &PlanDocument, flag: bool) -> Result<bool, Error> {
    let unknown = doc.costs.total_credits.is_none();
    if unknown && !flag {
        return Err(Error::Refused {
            message: format!("the run does not fit: {}", doc.verdict.reasons.join("; ")),
            hint: Some(
                "set the price of a 2K generated image in the pipeline file (`pricing: { generation: N }`), or pass --discover-price to learn it from one generation"
                    .into(),
            ),
        });
    }
    Ok(unknown && doc.verdict.reasons.len() == 1)
}

/// The run to execute: newly recorded, or found to continue.
pub struct OpenRun {
    pub id: String,
    pub dir: PathBuf,
    /// Credits this run was billed, or may have been, before now.
    pub billed: u64,
}

/// A run id names a directory: it must be a safe file name.
pub fn check_run_id(id: &str) -> Result<(), Error> {
    check_id(id).map_err(|e| {
        Error::usage(
            format!("--run-id {id:?} {e}"),
            Some("a run id names a directory: letters, digits, `.`, `_` and `-`"),
        )
    })
}

/// Records a new run and its tasks. Its directory is absolute, so that resuming it from
/// another working directory (cron) finds the same files.
pub async fn create_run(
    store: &Store,
    id: &str,
    pipeline: &Pipeline,
    doc: &PlanDocument,
    graph: &Graph,
    out_dir: &Path,
) -> Result<OpenRun, Error> {
    check_run_id(id)?;
    let out_dir = std::path::absolute(out_dir).map_err(|e| {
        Error::usage(
            format!(
                "cannot resolve the output directory {}: {e}",
                out_dir.display()
            ),
            None,
        )
    })?;
    let file = std::path::absolute(&pipeline.file)
        .map_or_else(|_| pipeline.file.clone(), |p| p.display().to_string());
    let text = std::fs::read(&pipeline.file)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let plan_json = serde_json::to_string(doc).unwrap_or_default();
    let balance_before = match &doc.balance {
        Balance::Known { credits, .. } => Some(*credits),
        _ => None,
    };
    store
        .create_run(
            &NewRun {
                id,
                pipeline_name: &pipeline.name,
                pipeline_file: &file,
                pipeline_text: &text,
                pipeline_sha256: &pipeline.text_sha256,
                items_sha256: &doc.items.sha256,
                plan_json: &plan_json,
                output_dir: &out_dir.to_string_lossy(),
                credits_planned: doc.costs.known_credits,
                balance_before,
            },
            &new_tasks(graph),
        )
        .await?;
    Ok(OpenRun {
        dir: out_dir.join(id),
        id: id.to_owned(),
        billed: 0,
    })
}

/// A recorded run, to continue.
pub async fn continue_run(store: &Store, row: &store::RunRow) -> Result<OpenRun, Error> {
    let billed = spent(store, &row.id).await?;
    store
        .set_run_status(&row.id, RunStatus::Running, None, None)
        .await?;
    tracing::info!("resuming run {}", row.id);
    Ok(OpenRun {
        dir: row.dir(),
        id: row.id.clone(),
        billed,
    })
}

pub fn new_task(graph: &Graph, t: usize) -> NewTask {
    let task = &graph.tasks[t];
    NewTask {
        item: graph.item_dir(task.instance).to_owned(),
        step: graph.step_id(t).to_owned(),
        idx: task.idx,
        operation: match &task.work {
            Work::Generate { .. } => "generate",
            Work::Tool { params, .. } => params.tool().as_str(),
        },
        inputs: graph.describe_inputs(t),
        planned_credits: task.planned,
    }
}

fn new_tasks(graph: &Graph) -> Vec<NewTask> {
    (0..graph.tasks.len()).map(|t| new_task(graph, t)).collect()
}

/// `<UTC date>-<time>-<4 hex>`: sorts by start time, and two runs in one second still differ.
pub fn new_run_id() -> String {
    let stamp = crate::plan::document::rfc3339(std::time::SystemTime::now());
    let digits: String = stamp.chars().filter(char::is_ascii_digit).collect();
    let mut nonce = [0u8; 2];
    let _ = getrandom::fill(&mut nonce);
    format!("{}-{}-{}", &digits[..8], &digits[8..14], hex::encode(nonce))
}

/// The most the run may still spend: the budget less what it was billed, and the balance.
pub fn cap_of(doc: &PlanDocument, billed: u64) -> Option<u64> {
    let budget = doc
        .budget
        .as_ref()
        .map(|b| b.max_credits.saturating_sub(billed));
    let balance = match &doc.balance {
        Balance::Known { credits, .. } => Some(u64::try_from(*credits).unwrap_or(0)),
        _ => None,
    };
    crate::plan::tighter(budget, balance)
}

pub async fn cap(store: &Store, run_id: &str, doc: &PlanDocument) -> Result<Option<u64>, Error> {
    Ok(cap_of(doc, spent(store, run_id).await?))
}

/// What the run was billed, plus what its unanswered calls may have cost: a budget is never
/// paid twice for them.
pub async fn spent(store: &Store, run_id: &str) -> Result<u64, Error> {
    let totals = store.totals(run_id).await?;
    Ok(totals.billed_credits + totals.possibly_billed_credits)
}

struct Quiet;

impl Observer for Quiet {
    fn task_succeeded(&self, _: usize, _: u64) {}
    fn task_failed(&self, _: usize, _: &str, _: &str) {}
}

/// Runs one generation alone and prices a 2K image from what it billed.
pub async fn discover(
    conn: &Connection,
    store: &Store,
    graph: &Arc<Graph>,
    config: &exec::Config,
    doc_balance: &Balance,
) -> Result<GenerationPrice, Error> {
    let Some(t) = (0..graph.tasks.len()).find(|t| {
        matches!(graph.tasks[*t].work, Work::Generate { .. }) && graph.tasks[*t].deps.is_empty()
    }) else {
        return Err(Error::usage(
            "--discover-price needs a generate step that reads no other step",
            Some("set `pricing: { generation: N }` in the pipeline file"),
        ));
    };
    let Work::Generate { n, size, .. } = &graph.tasks[t].work else {
        unreachable!("chosen as a generation")
    };
    let images = u64::from(*n) * size.price_multiplier();
    tracing::info!("discovering the generation price with one call ({n} image(s) at {size})");
    let mut alone = config.clone();
    alone.only = Some(t);
    // The price is unknown, so only the balance bounds this one call; and it is never paid
    // for twice.
    alone.cap = match &doc_balance {
        Balance::Known { credits, .. } => Some(u64::try_from(*credits).unwrap_or(0)),
        _ => None,
    };
    alone.on_ambiguous = exec::OnAmbiguous::Fail;
    let outcome = exec::run(
        Arc::clone(graph),
        store.clone(),
        conn.client.clone(),
        conn.downloader.clone(),
        alone,
        Arc::new(Quiet),
        crate::cli::shutdown_signal(),
    )
    .await?;
    if outcome.interrupted {
        return Err(Error::Interrupted { detail: None });
    }
    let rows = store.tasks(&config.run_id).await?;
    let step = graph.step_id(t);
    let row = rows.iter().find(|r| {
        r.step == step
            && r.idx == graph.tasks[t].idx
            && r.item == graph.item_dir(graph.tasks[t].instance)
    });
    let Some(row) = row.filter(|r| r.status == TaskStatus::Succeeded) else {
        let why = outcome
            .failures
            .first()
            .map(|f| f.1.clone())
            .or_else(|| outcome.stop.as_ref().map(exec::Stop::describe))
            .unwrap_or_else(|| "it did not succeed".into());
        return Err(Error::TasksFailed {
            message: format!("the generation that was to discover the price failed: {why}"),
        });
    };
    let credits = row.credits_billed.div_ceil(images);
    let mut notes = Vec::new();
    if row.credits_billed % images != 0 {
        notes.push(format!(
            "job billed {} credits for {images} 2K-image equivalents; priced at {credits} each (rounded up)",
            row.credits_billed
        ));
    }
    tracing::info!(
        "a 2K generated image costs {credits} credits (billed by job {})",
        row.job_id.as_deref().unwrap_or("?")
    );
    Ok(GenerationPrice {
        credits: Some(credits),
        source: PriceSource::Discovered {
            job_id: row.job_id.clone().unwrap_or_default(),
        },
        notes,
    })
}

/// Records the planned price of every task after the price was discovered.
pub async fn reprice(store: &Store, run_id: &str, graph: &Graph) -> Result<(), Error> {
    Ok(store.update_planned(run_id, &new_tasks(graph)).await?)
}
