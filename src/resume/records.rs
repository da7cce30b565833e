//! The edge of the review that reads the record: the run's rows matched to the graph, in one
//! pass over the tasks, and what identities need (hashes, the previous pipeline's identities).

use std::collections::HashMap;

use crate::exec::identity::from_record;
use crate::exec::read_rows;
use crate::plan::graph::{Graph, Instance};
use crate::plan::rows::RowIds;
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::{RecordedTask, Store, StoreError, TaskId, TaskStatus};

use super::decide::Records;

/// Reads the run's records for [`super::decide::decide`]: a row id per task and the whole row
/// only for those not succeeded. `previous` is the graph the tasks were recorded from when
/// the pipeline changed since; `identities` asks for the outputs' hashes (`--reuse`).
/// Without either, no identity is computed and no hash read: a large run's records hold a
/// few bytes per task.
pub(super) async fn load(
    store: &Store,
    run_id: &RunId,
    graph: &Graph,
    previous: Option<&Graph>,
    identities: bool,
) -> Result<Records, StoreError> {
    let mut r = Records::empty(graph);
    // Under a changed pipeline the previous identities need every row, kept whole.
    let mut all: Vec<RecordedTask> = Vec::new();
    if previous.is_some() {
        let index = graph.index();
        store
            .tasks()
            .each(run_id, None, |row| {
                all.push(row.clone());
                let Some(t) = index.of(&row.key) else {
                    r.removed.push(row);
                    return;
                };
                r.ids.set(t, row.id);
                if row.status != TaskStatus::Succeeded {
                    r.open.insert(t, row);
                }
            })
            .await?;
    } else {
        let (mut removed, mut open) = (Vec::new(), HashMap::new());
        r.ids = read_rows(store, graph, run_id, |t, row| match t {
            None => removed.push(row),
            Some(t) => {
                open.insert(t, row);
            }
        })
        .await?;
        removed.sort_unstable_by_key(|row: &RecordedTask| row.id);
        (r.removed, r.open) = (removed, open);
    }
    let batch = graph.instances();
    for i in 0..batch {
        r.has_rows[i] = r.ids.any_of(graph, Instance::Item(i));
    }
    r.has_rows[batch] = r.ids.any_of(graph, Instance::Batch);
    if identities || previous.is_some() {
        r.hashes = store.identities().output_hashes(run_id).await?;
    }
    if let Some(old) = previous {
        r.previous = Some(identities_of(old, &all, &r.hashes));
    }
    if !graph.checked_steps().is_empty() {
        r.failed_by_checks = store
            .verdicts()
            .failed_tasks(run_id)
            .await?
            .into_iter()
            .collect();
    }
    Ok(r)
}

/// The database id of each task of `graph` that is recorded, read row by row.
pub(super) async fn row_ids(
    store: &Store,
    run_id: &RunId,
    graph: &Graph,
) -> Result<RowIds, StoreError> {
    let index = graph.index();
    let mut ids = RowIds::new(graph);
    store
        .tasks()
        .each(run_id, None, |r| {
            if let Some(t) = index.of(&r.key) {
                ids.set(t, r.id);
            }
        })
        .await?;
    Ok(ids)
}

/// The identity of each recorded task, as recorded or as computed from `graph` (the one the
/// tasks were made from) and the bytes of their inputs.
fn identities_of(
    graph: &Graph,
    rows: &[RecordedTask],
    hashes: &HashMap<(TaskId, u32), Sha256Sum>,
) -> HashMap<TaskId, Option<String>> {
    let by_key: HashMap<(&str, &str, u32), usize> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| ((r.key.item.as_str(), r.key.step.as_str(), r.key.index), i))
        .collect();
    let row_of: Vec<Option<&RecordedTask>> = (0..graph.len())
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
