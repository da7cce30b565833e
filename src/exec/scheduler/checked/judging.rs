//! A task's judgement, off the scheduler's loop: its outputs' record read, their files judged
//! by the step's checks, and what else a verdict needs (its input's size and verdicts, its
//! siblings' hashes), read beside it. The scheduler acts on what it gives ([`Judgement`]).

use std::sync::Arc;

use crate::checks::Outcome;
use crate::checks::command::Commands;
use crate::checks::file;
use crate::checks::image::SizePromise;
use crate::checks::judge::{Judged, judge_task, passed_on};
use crate::exec::shared::Shared;
use crate::pipeline::Operation;
use crate::pipeline::checks::CheckName;
use crate::store::{RecordedOutput, Store, StoreError, TaskId};

/// A task's outputs as judged.
pub(in crate::exec::scheduler) struct Judgement {
    pub(super) task: usize,
    pub(super) outputs: Vec<RecordedOutput>,
    pub(super) judged: Result<Vec<Judged>, StoreError>,
    /// A check the task's outputs failed that its input failed too, kept flagged, whose
    /// failure is passed on: the call made again from the same input would not mend it.
    pub(super) inherited: Option<Inherited>,
    /// The hashes of siblings an earlier process kept, read for `distinct`, by task.
    pub(super) siblings: Vec<(usize, Vec<u64>)>,
}

/// What a judgement reads besides the task's own outputs.
pub(super) struct Around {
    /// A tool's input: output `k` of task `from`, row `id`, as `(from, id, k)`.
    pub(super) input: Option<(usize, TaskId, u32)>,
    /// The hashes of what its siblings kept, as this process knows them.
    pub(super) earlier: Vec<u64>,
    /// Siblings an earlier process kept, whose hashes are read from their files.
    pub(super) unhashed: Vec<(usize, TaskId)>,
}

/// A failure a tool's output shares with its input.
#[derive(Clone, Copy, Debug)]
pub(super) struct Inherited {
    pub(super) check: CheckName,
    /// The input: output `k` of task `task`.
    pub(super) from: (usize, u32),
}

/// Judges task `t` (row `task_id`): reads its outputs' record, the size of its input (output
/// `k` of task `from`, row `id`) when a `size` check needs it, and each output's file;
/// `distinct` after the `earlier` hashes of what its siblings kept, and those of the
/// `unhashed` siblings an earlier process kept, read from their files. An output that fails
/// is held against its input's verdicts: what they share is [`Inherited`].
pub(super) async fn judge(
    shared: Arc<Shared>,
    commands: Commands,
    (t, task_id): (usize, TaskId),
    around: Around,
) -> Judgement {
    let judged = judge_outputs(&shared, &commands, (t, task_id), around).await;
    judged.unwrap_or_else(|e| Judgement {
        task: t,
        outputs: Vec::new(),
        judged: Err(e),
        inherited: None,
        siblings: Vec::new(),
    })
}

/// [`judge`], its reads of the state database failing as one error.
async fn judge_outputs(
    shared: &Shared,
    commands: &Commands,
    (t, task_id): (usize, TaskId),
    around: Around,
) -> Result<Judgement, StoreError> {
    let Around {
        input,
        mut earlier,
        unhashed,
    } = around;
    let step = shared.graph.step_of(t);
    let checks = step.checks.as_ref().map_or(&[][..], |c| &c.checks[..]);
    let store = shared.store.kept();
    let outputs = store.of_tasks(&[task_id]).await?;
    let promise = match (&step.op, input) {
        (Operation::Tool(tool), Some((_, id, k))) => {
            let read = store.of_tasks(&[id]).await;
            let address = read
                .ok()
                .and_then(|o| o.into_iter().find(|o| o.k == k))
                .and_then(|o| o.path);
            let size = match &address {
                Some(address) => file::dimensions(address).await,
                None => None,
            };
            Some(SizePromise::of(&tool.params, size))
        }
        (Operation::Tool(tool), None) => Some(SizePromise::of(&tool.params, None)),
        (Operation::Generate(_), _) => None,
    };
    let siblings = sibling_hashes(&store, unhashed).await?;
    earlier.extend(siblings.iter().flat_map(|(_, h)| h));
    let addresses: Vec<_> = outputs.iter().map(|o| o.path.clone()).collect();
    let judged = judge_task(checks, &addresses, promise, commands, &earlier).await;
    let inherited = match input {
        Some((from, id, k)) => inherited(&shared.store, &judged, (from, id, k)).await?,
        None => None,
    };
    Ok(Judgement {
        task: t,
        outputs,
        judged: Ok(judged),
        inherited,
        siblings,
    })
}

/// The hashes of the kept outputs of `tasks` (siblings an earlier process kept), by task, read
/// from their files; an output that cannot be read has none.
async fn sibling_hashes(
    store: &crate::store::Kept<'_>,
    tasks: Vec<(usize, TaskId)>,
) -> Result<Vec<(usize, Vec<u64>)>, StoreError> {
    if tasks.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<TaskId> = tasks.iter().map(|(_, id)| *id).collect();
    let outputs = store.of_tasks(&ids).await?;
    let mut hashes = Vec::with_capacity(tasks.len());
    for (t, id) in tasks {
        let mut of_task = Vec::new();
        for output in outputs.iter().filter(|o| o.task_id == id) {
            if let Some(hash) = crate::checks::judge::hash_of(output.path.as_ref()).await {
                of_task.push(hash);
            }
        }
        hashes.push((t, of_task));
    }
    Ok(hashes)
}

/// The first check `judged` failed that the input (output `k` of task `from`, row `id`)
/// failed too, as it was kept, among those whose failure is passed on ([`passed_on`]).
async fn inherited(
    store: &Store,
    judged: &[Judged],
    (from, id, k): (usize, TaskId, u32),
) -> Result<Option<Inherited>, StoreError> {
    let failed: Vec<CheckName> = judged
        .iter()
        .flat_map(|o| &o.verdicts)
        .filter(|(_, v)| v.outcome == Outcome::Failed && passed_on(v.check))
        .map(|(_, v)| v.check)
        .collect();
    if failed.is_empty() {
        return Ok(None);
    }
    let theirs = store.verdicts().failed_on(id, k).await?;
    let shared = failed
        .into_iter()
        .find(|c| theirs.iter().any(|t| t == c.as_str()));
    Ok(shared.map(|check| Inherited {
        check,
        from: (from, k),
    }))
}
