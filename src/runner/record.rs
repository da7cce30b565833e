//! Recording a run in the state database: a new run with every task, or a recorded one
//! marked running again. Directories and files are recorded as absolute paths, so a resume
//! from another working directory (cron) finds the same files.

use crate::api::download::DownloadError;
use crate::error::Error;
use crate::exec;
use crate::money::limit::Balance;
use crate::pipeline::Pipeline;
use crate::pipeline::items::check_id;
use crate::place::{Address, ObjectError, Place, RunDir};
use crate::plan::document::PlanDocument;
use crate::plan::graph::{Graph, Instance};
use crate::run_id::RunId;
use crate::store::{NewRun, NewTask, RecordedPlan, Run, RunStatus, Store};

/// The run to execute: newly recorded, or found to continue.
pub struct OpenRun {
    pub id: RunId,
    pub dir: RunDir,
    /// `dir` opened: a local directory or a prefix in object storage.
    pub place: Place,
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

/// `<UTC date>-<time>-<4 hex>`: sorts by start time, and two runs in one second still differ.
pub fn new_run_id() -> RunId {
    let stamp = crate::time::rfc3339(std::time::SystemTime::now());
    let digits: String = stamp.chars().filter(char::is_ascii_digit).collect();
    let mut nonce = [0u8; 2];
    let _ = getrandom::fill(&mut nonce);
    RunId::from(format!(
        "{}-{}-{}",
        &digits[..8],
        &digits[8..14],
        hex::encode(nonce)
    ))
}

/// Records a new run and the batch's tasks, in one transaction; each item's tasks are
/// recorded by the executor as it comes near them.
pub async fn create(
    store: &Store,
    id: &RunId,
    pipeline: &Pipeline,
    doc: &PlanDocument,
    graph: &Graph,
    out_dir: &Address,
) -> Result<OpenRun, Error> {
    check_run_id(id)?;
    let out_dir = out_dir.absolute().map_err(|e| {
        Error::usage(
            format!("cannot resolve the output directory {out_dir}: {e}"),
            None,
        )
    })?;
    let dir = RunDir::new(&out_dir, id);
    let place = open_place(dir.root()).await?;
    let file = std::path::absolute(&pipeline.file)
        .map_or_else(|_| pipeline.file.clone(), |p| p.display().to_string());
    let text = std::fs::read(&pipeline.file)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let plan = RecordedPlan::of(doc)?;
    let balance_before = match &doc.balance {
        Balance::Known { credits, .. } => Some(*credits),
        _ => None,
    };
    store
        .runs()
        .create(
            &NewRun {
                id,
                pipeline_name: &pipeline.name,
                pipeline_file: &file,
                pipeline_text: &text,
                pipeline_sha256: &pipeline.text_sha256,
                items_sha256: &doc.items.sha256,
                plan: &plan,
                output_dir: &out_dir.to_string(),
                credits_planned: doc.costs.known_credits,
                balance_before,
            },
            &batch_tasks(graph),
        )
        .await?;
    Ok(OpenRun {
        dir,
        place,
        id: id.clone(),
        billed: 0,
    })
}

/// The run directory opened and asked, before anything is recorded or paid for: an object
/// store the environment cannot reach the way it is set is said now, not after the first bill.
async fn open_place(dir: &Address) -> Result<Place, Error> {
    let refused = |e: ObjectError| {
        Error::usage(
            e.to_string(),
            Some(
                "the store is set by AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION and AWS_ENDPOINT in the environment; a run needs s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on its prefix",
            ),
        )
    };
    let place = Place::open(dir).map_err(refused)?;
    place.check().await.map_err(refused)?;
    place.probe().await.map_err(|e| unwritable(dir, &e))?;
    Ok(place)
}

/// A local run directory that takes no file: a full disk, a lost permission (exit 1), or a
/// path that cannot be a directory (exit 2). Nothing was paid for.
fn unwritable(dir: &Address, e: &DownloadError) -> Error {
    let message = format!("outputs cannot be written to {dir}: {e}; nothing was paid for");
    if e.is_storage_failure() {
        Error::StorageFailed {
            message,
            hint: "free space there (or restore the permission, or give another --out), then run the same command again".into(),
        }
    } else {
        Error::usage(
            message,
            Some("give --out (or output_dir) a directory imgpipe can write"),
        )
    }
}

/// A recorded run, marked running again; `billed` is what it spent so far ([`crate::runner::admit::spent`]).
pub async fn reopen(store: &Store, row: &Run, billed: u64) -> Result<OpenRun, Error> {
    let dir = row.dir();
    let place = open_place(dir.root()).await?;
    store
        .runs()
        .set_status(&row.id, RunStatus::Running, None, None)
        .await?;
    Ok(OpenRun {
        place,
        dir,
        id: row.id.clone(),
        billed,
    })
}

/// Records the planned price of every task after the price was discovered.
/// Only recorded tasks are updated: the others are recorded at their new price, and counted
/// from the plan, which is recorded anew.
pub async fn reprice(
    store: &Store,
    run_id: &RunId,
    graph: &Graph,
    doc: &PlanDocument,
) -> Result<(), Error> {
    store
        .runs()
        .set_plan(run_id, &RecordedPlan::of(doc)?, doc.costs.known_credits)
        .await?;
    let mut recorded = Vec::new();
    let index = graph.index();
    store
        .tasks()
        .each(run_id, None, |r| {
            if let Some(t) = index.of(&r.key) {
                recorded.push((r.id, graph.task(t).planned));
            }
        })
        .await?;
    Ok(store.tasks().set_planned(&recorded).await?)
}

fn batch_tasks(graph: &Graph) -> Vec<NewTask> {
    let batch = graph.instance_tasks(Instance::Batch);
    batch.map(|t| exec::new_task(graph, t)).collect()
}
