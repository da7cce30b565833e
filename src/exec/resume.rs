//! Resuming a run: what is still to pay for and why, what is kept, and what only needs its
//! file fetched again (never a new paid call).
//!
//! [`review`] only reads, so `resume --dry-run` can show it; [`apply`] then makes the record
//! and the output directory agree with it before the scheduler starts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::api::download::{copy_checked, file_sha256};
use crate::api::types::STATUS_SUCCEEDED;
use crate::api::{ApiError, Client, JobRecord, RetryPolicy};
use crate::exec::OnAmbiguous;
use crate::exec::identity::{from_record, identity};
use crate::layout::RunDir;
use crate::place::is_object_url;
use crate::plan::graph::{Graph, Instance, Source};
use crate::store::{
    AttemptOutcome, NewTask, OutputRow, Reusable, SetAside, Settled, Store, StoreError, TaskRow,
    TaskStatus,
};

/// Why a task will be paid for (again).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Its last call failed.
    Failed,
    /// `--allow-changes`: the pipeline now asks something else of it, or it is new.
    Changed,
    /// Its last call was sent without a complete answer: it may have been billed already.
    Ambiguous,
    /// No call of it was ever answered.
    NeverStarted,
    /// An input failed, so it never ran.
    Blocked,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Failed => "failed",
            Reason::Changed => "changed",
            Reason::Ambiguous => "ambiguous",
            Reason::NeverStarted => "never started",
            Reason::Blocked => "blocked",
        }
    }
}

/// A task the resumed run will call.
#[derive(Clone, Debug)]
pub struct Redo {
    pub task: usize,
    pub reason: Reason,
    pub credits: u64,
    /// The recorded error, when there is one.
    pub detail: Option<String>,
}

/// An output of a kept task whose file is to be fetched again from its job.
#[derive(Clone, Debug)]
pub struct Refetch {
    pub output: OutputRow,
    /// The file's actual sha256 when it is there but differs from the record.
    pub modified: Option<String>,
}

/// The answer of a lost call whose job is known: read it back, free, before paying again.
#[derive(Clone, Debug)]
pub struct Recover {
    pub task: usize,
    pub attempt_id: i64,
    pub job_id: String,
}

#[derive(Default)]
pub struct Review {
    /// Recorded tasks to pay for, and under `--reuse` every task without a reusable result.
    pub redo: Vec<Redo>,
    /// Items the run never recorded (it records an item's tasks as it comes near them): all
    /// their tasks are to pay for, and are counted rather than listed.
    pub unrecorded: Unrecorded,
    /// Ambiguous tasks left failed, per `--on-ambiguous fail`.
    pub left_failed: Vec<Redo>,
    pub recover: Vec<Recover>,
    pub refetch: Vec<Refetch>,
    /// Tasks taken from an earlier run's succeeded task of the same identity (`--reuse`).
    pub reuse: Vec<(usize, String, Reusable)>,
    /// Recorded tasks the (changed) pipeline no longer has.
    pub removed: Vec<TaskRow>,
    /// Whether the pipeline changed since the tasks were recorded (`--allow-changes`).
    pub changes: bool,
    /// Tasks kept as they are (succeeded), by row id, sorted.
    pub kept: Vec<i64>,
}

/// The tasks of items with no recorded task.
#[derive(Default)]
pub struct Unrecorded {
    pub instances: Vec<Instance>,
    pub tasks: usize,
    pub credits: u64,
}

impl Review {
    /// Tasks to pay for.
    pub fn to_pay(&self) -> usize {
        self.redo.len() + self.unrecorded.tasks
    }

    pub fn credits(&self) -> u64 {
        self.redo.iter().map(|r| r.credits).sum::<u64>() + self.unrecorded.credits
    }

    /// Every task to pay for: the recorded ones, then those of unrecorded items.
    pub fn each_redo<'a>(&'a self, graph: &'a Graph) -> impl Iterator<Item = Redo> + 'a {
        let unrecorded = self.unrecorded.instances.iter().flat_map(move |i| {
            graph.instance_tasks(*i).map(move |t| Redo {
                task: t,
                reason: Reason::NeverStarted,
                credits: graph.task(t).planned,
                detail: None,
            })
        });
        self.redo.iter().cloned().chain(unrecorded)
    }

    pub fn is_kept(&self, row_id: i64) -> bool {
        self.kept.binary_search(&row_id).is_ok()
    }

    pub fn saved_by_reuse(&self, graph: &Graph) -> u64 {
        self.reuse
            .iter()
            .map(|(t, ..)| graph.task(*t).planned)
            .sum()
    }
}

/// The run's rows matched to the graph, read one at a time: a row id per task, and the whole
/// row only for those not succeeded (few: what failed, and what is under way).
struct Recorded {
    ids: Vec<i64>,
    open: HashMap<usize, TaskRow>,
    /// Succeeded rows' recorded identities, when asked for.
    identities: HashMap<usize, String>,
    removed: Vec<TaskRow>,
    /// Whether each item has a recorded task (the batch, at the end).
    has_rows: Vec<bool>,
}

impl Recorded {
    async fn load(
        store: &Store,
        run_id: &str,
        graph: &Graph,
        identities: bool,
    ) -> Result<Recorded, StoreError> {
        let mut r = Recorded {
            ids: vec![0; graph.len()],
            open: HashMap::new(),
            identities: HashMap::new(),
            removed: Vec::new(),
            has_rows: vec![false; graph.instances() + 1],
        };
        let index = graph.index();
        let batch = graph.instances();
        store
            .each_task(run_id, None, |row| {
                let Some(t) = index.get(&row.item, &row.step, row.idx) else {
                    r.removed.push(row);
                    return;
                };
                r.ids[t] = row.id;
                let i = match graph.task(t).instance {
                    Instance::Item(i) => i,
                    Instance::Batch => batch,
                };
                r.has_rows[i] = true;
                if row.status != TaskStatus::Succeeded {
                    r.open.insert(t, row);
                } else if identities && let Some(id) = row.identity {
                    r.identities.insert(t, id);
                }
            })
            .await?;
        Ok(r)
    }

    fn has_rows(&self, instance: Instance) -> bool {
        match instance {
            Instance::Item(i) => self.has_rows[i],
            Instance::Batch => self.has_rows[self.has_rows.len() - 1],
        }
    }
}

/// What the run would do now. `previous` is the graph the run's tasks were recorded from, when
/// the pipeline changed since (`--allow-changes`); `reuse` looks for earlier runs' results.
/// Without either, no identity is computed and no hash read: a large run's review holds a
/// few bytes per task.
pub async fn review(
    store: &Store,
    run_id: &str,
    graph: &Graph,
    previous: Option<&Graph>,
    on_ambiguous: OnAmbiguous,
    reuse: bool,
) -> Result<Review, StoreError> {
    let identities = previous.is_some() || reuse;
    let rec = Recorded::load(store, run_id, graph, identities).await?;
    let hashes = if identities {
        store.output_hashes(run_id).await?
    } else {
        HashMap::new()
    };
    let recorded = match previous {
        Some(old) => {
            let rows = store.tasks(run_id).await?;
            let by_key: HashMap<(&str, &str, u32), usize> = rows
                .iter()
                .enumerate()
                .map(|(i, r)| ((r.item.as_str(), r.step.as_str(), r.idx), i))
                .collect();
            Some(identities_of(old, &rows, &by_key, &hashes))
        }
        None => None,
    };
    let mut review = Review {
        changes: previous.is_some(),
        ..Review::default()
    };
    // The sha256 of each output known to be final by now, by (task, k).
    let mut known: HashMap<(usize, u32), String> = HashMap::new();
    for t in 0..graph.len() {
        let task = graph.task(t);
        let id = rec.ids[t];
        // The batch's tasks are recorded with the run: one it lacks is new to the pipeline.
        let unreached = task.instance != Instance::Batch && !rec.has_rows(task.instance);
        if id == 0 && !reuse && unreached {
            if t == graph.instance_tasks(task.instance).start {
                review.unrecorded.instances.push(task.instance);
            }
            review.unrecorded.tasks += 1;
            review.unrecorded.credits += task.planned;
            continue;
        }
        let open = rec.open.get(&t);
        let succeeded = id != 0 && open.is_none();
        let mine = if identities {
            identity(graph, t, |u, k| known.get(&(u, k)).cloned())
        } else {
            None
        };
        let keep = match &recorded {
            None => succeeded,
            Some(ids) => succeeded && mine.is_some() && ids.get(&id).cloned().flatten() == mine,
        };
        if keep {
            review.kept.push(id);
            if identities {
                for k in 0..graph.outputs(t) {
                    if let Some(sha) = hashes.get(&(id, k)) {
                        known.insert((t, k), sha.clone());
                    }
                }
            }
            continue;
        }
        if reuse
            && let Some(id) = &mine
            && let Some(found) = store.reusable(id, run_id).await?
        {
            for o in &found.outputs {
                if let Some(sha) = &o.sha256 {
                    known.insert((t, o.k), sha.clone());
                }
            }
            review.reuse.push((t, id.clone(), found));
            continue;
        }
        let credits = task.planned;
        if id == 0 {
            // New to a changed pipeline; or never recorded at all.
            review.redo.push(Redo {
                task: t,
                reason: if previous.is_some() {
                    Reason::Changed
                } else {
                    Reason::NeverStarted
                },
                credits,
                detail: None,
            });
            continue;
        }
        let reason = match open {
            // Succeeded, but the changed pipeline asks something else of it.
            None => Reason::Changed,
            Some(r) => reason_of(r, t, &mut review.recover),
        };
        let redo = Redo {
            task: t,
            reason,
            credits,
            detail: open.and_then(|r| r.error.clone()),
        };
        if reason == Reason::Ambiguous && on_ambiguous == OnAmbiguous::Fail {
            review.left_failed.push(redo);
        } else {
            review.redo.push(redo);
        }
    }
    review.kept.sort_unstable();
    review.removed = rec.removed;
    // Tasks below one left failed are blocked, not paid for.
    if !review.left_failed.is_empty() {
        let mut blocked = vec![false; graph.len()];
        for f in &review.left_failed {
            for d in graph.descendants(f.task) {
                blocked[d] = true;
            }
        }
        review.redo.retain(|r| !blocked[r.task]);
    }
    review.refetch = check_files(store, run_id, &review).await?;
    Ok(review)
}

/// Why a recorded task that did not succeed runs again; a lost answer whose job is known is
/// listed for reading back.
fn reason_of(r: &TaskRow, t: usize, recover: &mut Vec<Recover>) -> Reason {
    let last = r.last_attempt.as_ref();
    if let Some(a) = last.filter(|a| a.possibly_billed()) {
        if let Some(job) = &a.job_id {
            recover.push(Recover {
                task: t,
                attempt_id: a.id,
                job_id: job.clone(),
            });
        }
        return Reason::Ambiguous;
    }
    match r.status {
        TaskStatus::Failed => Reason::Failed,
        TaskStatus::Blocked => Reason::Blocked,
        _ => Reason::NeverStarted,
    }
}

/// The database id of each task of `graph` (0 where it is not recorded), read row by row.
async fn row_ids(store: &Store, run_id: &str, graph: &Graph) -> Result<Vec<i64>, StoreError> {
    let index = graph.index();
    let mut ids = vec![0i64; graph.len()];
    store
        .each_task(run_id, None, |r| {
            if let Some(t) = index.get(&r.item, &r.step, r.idx) {
                ids[t] = r.id;
            }
        })
        .await?;
    Ok(ids)
}

/// The identity of each recorded task, as recorded or as computed from `graph` (the one the
/// tasks were made from) and the bytes of their inputs.
fn identities_of(
    graph: &Graph,
    rows: &[TaskRow],
    by_key: &HashMap<(&str, &str, u32), usize>,
    hashes: &HashMap<(i64, u32), String>,
) -> HashMap<i64, Option<String>> {
    let row_of: Vec<Option<&TaskRow>> = (0..graph.len())
        .map(|t| {
            let (item, step, idx) = graph.key_ref(t);
            by_key.get(&(item.as_ref(), step, idx)).map(|&i| &rows[i])
        })
        .collect();
    row_of
        .iter()
        .enumerate()
        .filter_map(|(t, r)| {
            let r = (*r)?;
            let id = r
                .identity
                .clone()
                .or_else(|| from_record(graph, t, |u| row_of[u].map(|r| r.id), hashes));
            Some((r.id, id))
        })
        .collect()
}

/// The outputs of kept tasks whose file is missing or differs from the record.
async fn check_files(
    store: &Store,
    run_id: &str,
    review: &Review,
) -> Result<Vec<Refetch>, StoreError> {
    let mut candidates = Vec::new();
    store
        .each_output(run_id, false, |o| {
            if review.is_kept(o.task_id)
                && let (Some(path), Some(sha)) = (&o.path, &o.sha256)
            {
                candidates.push((o.clone(), PathBuf::from(path), sha.clone()));
            }
            Ok(())
        })
        .await?;
    let in_store = |(_, path, _): &(OutputRow, PathBuf, String)| is_object_url(path);
    // Split only when some are objects: a second list as long as a large run's outputs was
    // a few MiB more for every local resume.
    let (objects, candidates): (Vec<_>, Vec<_>) = if candidates.iter().any(in_store) {
        candidates.into_iter().partition(in_store)
    } else {
        (Vec::new(), candidates)
    };
    let checked_objects = super::objects::check_all(objects).await;
    let mut checked = tokio::task::spawn_blocking(move || {
        candidates
            .into_iter()
            .filter_map(|(o, path, sha)| match file_sha256(&path) {
                Ok(actual) if actual == sha => None,
                Ok(actual) => Some(Refetch {
                    output: o,
                    modified: Some(actual),
                }),
                Err(_) => Some(Refetch {
                    output: o,
                    modified: None,
                }),
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| StoreError::Inconsistent(e.to_string()))?;
    checked.extend(checked_objects);
    Ok(checked)
}

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct Applied {
    pub recovered: usize,
    pub reused: usize,
    pub refetch: usize,
    pub set_aside: usize,
}

/// Makes the record and the output directory agree with `review`: lost answers read back by
/// job id, outputs of tasks to redo (and modified files) moved under [`crate::layout::SUPERSEDED`],
/// changed tasks reset, reused results copied in. Nothing here is a paid call.
pub async fn apply(
    store: &Store,
    client: &Client,
    run_id: &str,
    run_dir: &Path,
    graph: &Graph,
    review: &Review,
    describe: impl Fn(usize) -> NewTask,
) -> Result<Applied, StoreError> {
    let mut applied = Applied::default();
    store.settle_orphaned_attempts(run_id).await?;
    if !is_object_url(run_dir) {
        RunDir::at(run_dir).remove_leftovers();
    }
    let mut rows = row_ids(store, run_id, graph).await?;
    // Tasks the pipeline gained under --allow-changes, and those reused: the others are
    // recorded by the executor as it comes near them.
    let gained = review.redo.iter().filter(|r| r.reason == Reason::Changed);
    let reused = review.reuse.iter().map(|(t, ..)| *t);
    let new: Vec<NewTask> = gained
        .map(|r| r.task)
        .chain(reused)
        .filter(|t| rows[*t] == 0)
        .map(&describe)
        .collect();
    if !new.is_empty() {
        store.insert_tasks(run_id, &new).await?;
        rows = row_ids(store, run_id, graph).await?;
    }
    let row = |t: usize| rows[t];
    let mut recovered = std::collections::HashSet::new();
    for r in &review.recover {
        if recover(store, client, run_id, graph, r, &rows).await? {
            recovered.insert(row(r.task));
        }
    }
    applied.recovered = recovered.len();
    // Outputs of tasks that run again, or that the pipeline dropped, make way for new ones.
    let leaving: std::collections::HashSet<i64> = review
        .redo
        .iter()
        .map(|r| row(r.task))
        .filter(|id| *id != 0 && !recovered.contains(id))
        .chain(review.removed.iter().map(|r| r.id))
        .collect();
    let mut old = Vec::new();
    store
        .each_output(run_id, false, |o| {
            if leaving.contains(&o.task_id) {
                old.push(o);
            }
            Ok(())
        })
        .await?;
    let mut moved: Vec<(i64, Option<String>)> = Vec::with_capacity(old.len());
    for o in &old {
        moved.push((o.id, move_aside(run_dir, o, None).await.map(|(to, _)| to)));
    }
    let aside: Vec<SetAside> = moved
        .iter()
        .map(|(id, to)| SetAside {
            output_id: *id,
            moved_to: to.as_deref(),
            sha256: None,
            bytes: None,
            reason: "the task runs again",
            refetch: false,
        })
        .collect();
    store.set_aside(run_id, &aside).await?;
    applied.set_aside = aside.len();
    refetch(store, run_id, run_dir, &review.refetch).await?;
    applied.refetch = review.refetch.len();
    // Under a changed pipeline every task to do is done as the pipeline now says.
    for r in review
        .redo
        .iter()
        .filter(|r| review.changes || r.reason == Reason::Changed)
        .filter(|r| row(r.task) != 0)
    {
        store.reset_task(row(r.task), &describe(r.task)).await?;
    }
    let removed: Vec<i64> = review.removed.iter().map(|r| r.id).collect();
    store.remove_tasks(&removed).await?;
    for f in &review.left_failed {
        let why = format!(
            "a call was sent without a complete answer and may have been billed; not called again (--on-ambiguous fail){}",
            f.detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        );
        store
            .set_task_status(&[row(f.task)], TaskStatus::Failed, Some(&why))
            .await?;
        let below = graph.descendants(f.task).into_iter().map(row);
        let below: Vec<i64> = below.filter(|id| *id != 0).collect();
        let name = format!("{}/{}", graph.key(f.task).0, graph.key(f.task).1);
        store
            .set_task_status(
                &below,
                TaskStatus::Blocked,
                Some(&format!("its input {name} failed")),
            )
            .await?;
    }
    for (t, id, found) in &review.reuse {
        let paths = copy_reused(run_dir, graph, *t, found);
        store.reuse(run_id, row(*t), id, found, &paths).await?;
        applied.reused += 1;
    }
    Ok(applied)
}

/// Tries at reading back a lost answer's job. The job is paid for and the alternative is to pay
/// again, so a passing failure (a 429, a server error, a lost connection) is waited out.
const READ_BACK: RetryPolicy = RetryPolicy::new(5, Duration::from_millis(500));

async fn read_back(client: &Client, job_id: &str) -> Result<JobRecord, ApiError> {
    crate::api::retry::free_call(READ_BACK, || client.job(job_id)).await
}

/// Reads back a lost call's job; records it as the attempt's answer when it succeeded.
async fn recover(
    store: &Store,
    client: &Client,
    run_id: &str,
    graph: &Graph,
    r: &Recover,
    rows: &[i64],
) -> Result<bool, StoreError> {
    let task_id = rows[r.task];
    let job = match read_back(client, &r.job_id).await {
        Ok(job) => job,
        Err(e) => {
            tracing::warn!(job = %r.job_id, "cannot read back a lost answer: {}", client.redact(&e.to_string()));
            return Ok(false);
        }
    };
    let urls = job.image_urls();
    let expected = graph.outputs(r.task) as usize;
    if job.status() != Some(STATUS_SUCCEEDED) || urls.len() < expected {
        return Ok(false);
    }
    let note = format!(
        "the answer was lost; recovered on resume from GET /v1/jobs/{}",
        r.job_id
    );
    // The lineage, as the call would have recorded it: the job of the output it read.
    let upstream = graph.work(r.task).ok().and_then(|work| {
        work.sources().into_iter().find_map(|s| match s {
            Source::Output { task, .. } => Some(*task),
            Source::Url(_) => None,
        })
    });
    let parent = match upstream.map(|u| rows[u]).filter(|id| *id != 0) {
        Some(id) => store.task_job(id).await?,
        None => None,
    };
    store
        .finish_attempt(
            run_id,
            task_id,
            r.attempt_id,
            &AttemptOutcome::Succeeded(Settled {
                job_id: &r.job_id,
                credits_used: job.credits_used().unwrap_or(graph.task(r.task).planned),
                credits_remaining: None,
                urls: &urls,
                parent_job_id: parent.as_deref(),
                note: Some(&note),
            }),
        )
        .await?;
    tracing::info!(job = %r.job_id, "recovered a lost answer by its job id; not paid for again");
    Ok(true)
}

/// Moves modified files aside and marks every listed output for download again.
async fn refetch(
    store: &Store,
    run_id: &str,
    run_dir: &Path,
    list: &[Refetch],
) -> Result<(), StoreError> {
    let mut moved: Vec<Option<(String, Option<u64>)>> = Vec::with_capacity(list.len());
    for r in list {
        moved.push(match r.modified {
            Some(_) => move_aside(run_dir, &r.output, Some("modified")).await,
            None => None,
        });
    }
    let aside: Vec<SetAside> = list
        .iter()
        .zip(&moved)
        .map(|(r, to)| {
            let reason = if r.modified.is_some() {
                "the file on disk differed from the one downloaded; fetched again"
            } else {
                "the file was missing; fetched again"
            };
            if r.modified.is_some() {
                tracing::warn!(
                    "{} was modified since it was downloaded; moved aside and fetched again",
                    r.output.path.as_deref().unwrap_or("?")
                );
            }
            SetAside {
                output_id: r.output.id,
                moved_to: to.as_ref().map(|(to, _)| to.as_str()),
                sha256: r.modified.as_deref(),
                bytes: to.as_ref().and_then(|(_, bytes)| *bytes),
                reason,
                refetch: true,
            }
        })
        .collect();
    store.set_aside(run_id, &aside).await
}

/// Moves an output's file (or object) to
/// `<run>/_superseded/<item>/<name>.o<output id>[.<tag>].<ext>`; returns its new path (or URL)
/// and, when known, size, or `None` when there was nothing to move.
async fn move_aside(
    run_dir: &Path,
    o: &OutputRow,
    tag: Option<&str>,
) -> Option<(String, Option<u64>)> {
    let from = PathBuf::from(o.path.as_ref()?);
    let dir = RunDir::at(run_dir).superseded(&o.item);
    let stem = from.file_stem()?.to_string_lossy().into_owned();
    let ext = from
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let tag = tag.map(|t| format!(".{t}")).unwrap_or_default();
    let to = dir.join(format!("{stem}.o{}{tag}{ext}", o.id));
    let to_name = to.to_string_lossy().into_owned();
    if is_object_url(&from) {
        let size = super::objects::set_aside(&from.to_string_lossy(), &to_name).await?;
        return Some((to_name, Some(size)));
    }
    let moved = std::fs::create_dir_all(&dir).and_then(|()| std::fs::rename(&from, &to));
    match moved {
        Ok(()) => Some((to_name, std::fs::metadata(&to).ok().map(|m| m.len()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!("cannot move {} aside: {e}", from.display());
            None
        }
    }
}

/// Copies a reused task's files into this run; `None` for each one to fetch from its job
/// instead (gone, or changed since).
fn copy_reused(run_dir: &Path, graph: &Graph, t: usize, found: &Reusable) -> Vec<Option<String>> {
    // Into object storage, each reused output is fetched from its job: free, and create-only.
    if is_object_url(run_dir) {
        return vec![None; found.outputs.len()];
    }
    let dir = RunDir::at(run_dir).item(&graph.item_dir(graph.task(t).instance));
    found
        .outputs
        .iter()
        .map(|o| {
            let from = PathBuf::from(o.path.as_ref()?);
            let ext = from
                .extension()
                .map(|e| format!(".{}", e.to_string_lossy()))
                .unwrap_or_default();
            let to = dir.join(format!("{}{ext}", graph.file_stem(t, o.k)));
            let sha = o.sha256.as_ref()?;
            if file_sha256(&from).ok().as_ref() != Some(sha) {
                return None;
            }
            std::fs::create_dir_all(&dir).ok()?;
            let done = copy_checked(&from, &to, sha).ok()?;
            Some(done.to_string_lossy().into_owned())
        })
        .collect()
}
