//! The executor's link to the task rows: what an earlier process settled, each task's row id,
//! and the recording of tasks as the scheduler comes near them.
//!
//! A run is recorded lazily: creating it records the run and the batch's tasks, and each
//! item's tasks are recorded, a chunk of items in one transaction, shortly before the
//! scheduler admits the first of them. So a batch of 100,000 items makes its first call at
//! once, and the database holds only the items a run reached. An item with no rows is simply
//! pending: a crash at any instant loses nothing, since nothing of an unrecorded item was
//! sent (a paid call is sent only after its attempt, on its task's row, is durable).

use std::collections::{HashMap, HashSet};

use crate::exec::attempt::request_params;
use crate::exec::state::State;
use crate::exec::{Config, OnAmbiguous};
use crate::place::layout::BATCH;
use crate::plan::graph::{Graph, Instance, Work};
use crate::plan::rows::RowIds;
use crate::run_id::RunId;
use crate::sha256::Sha256Sum;
use crate::store::{NewTask, RecordedTask, Store, StoreError, TaskBlock, TaskId, TaskStatus};
use crate::task_key::TaskKey;

/// Items recorded in one transaction: a few hundred milliseconds' work at most.
const CHUNK_ITEMS: usize = 1024;

/// A test-only setting: items recorded in one transaction in place of [`CHUNK_ITEMS`], so
/// that a test can see a run of a few dozen items recorded chunk by chunk (killed between two
/// chunks) without running a thousand items to the end.
const TEST_CHUNK_ITEMS_ENV: &str = "IMGPIPE_TEST_CHUNK_ITEMS";

/// [`CHUNK_ITEMS`], or the positive number [`TEST_CHUNK_ITEMS_ENV`] sets; read once.
fn chunk_items() -> usize {
    static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHUNK.get_or_init(|| {
        std::env::var(TEST_CHUNK_ITEMS_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(CHUNK_ITEMS)
    })
}

/// How task `t` of `graph` is recorded: its key, operation, inputs, price, and its request
/// as the executor will send it (rendered by the same code, its URLs left out).
pub fn new_task(graph: &Graph, t: usize) -> NewTask {
    let task = graph.task(t);
    let work = graph.work(t).ok();
    NewTask {
        key: graph.key(t),
        operation: match &work {
            Some(Work::Tool { params, .. }) => params.tool().as_str(),
            _ => "generate",
        },
        inputs: graph.describe_inputs(t),
        planned_credits: task.planned,
        request: work.map(request_params),
    }
}

/// Reads the run's task rows: each task's row id, and whole only the rows that are not
/// succeeded (or that `graph` does not have), handed to `whole` with their task in `graph`
/// (`None`: a task the graph does not have). The database sums up an item whose tasks are
/// all recorded in order in one row ([`Store::each_item_outline`]), so a takeover reads a
/// row an item, and whole only the items it will work on, not a row a task.
pub async fn read_rows(
    store: &Store,
    graph: &Graph,
    run_id: &RunId,
    mut whole: impl FnMut(Option<usize>, RecordedTask),
) -> Result<RowIds, StoreError> {
    if let Some((ids, open)) = read_by_blocks(store, graph, run_id).await? {
        for (t, row) in open {
            whole(t, row);
        }
        return Ok(ids);
    }
    read_by_items(store, graph, run_id, whole).await
}

/// [`read_rows`] from the blocks the executor noted as it recorded chunks of items whole
/// ([`TaskBlock`]): each block gives its tasks' row ids at once, and only the rows no block
/// holds (the batch's, a chunk recorded in part, a stray row) and the rows not succeeded are
/// read whole. At a night's 900,000 tasks: a hundred block rows and the open rows, where
/// summing every item took the database over a second before the first paid call.
///
/// `None` when the blocks cannot be trusted to tell the whole story: none noted, a block that
/// does not fit the graph, a row that contradicts a block, or the blocks and the rows read not
/// accounting for every live task the run's totals count. Every row outside the blocks is
/// read, so the count is exact: it fails when a block holds a row dropped or missing. The
/// caller then reads item by item.
async fn read_by_blocks(
    store: &Store,
    graph: &Graph,
    run_id: &RunId,
) -> Result<Option<(RowIds, Vec<(Option<usize>, RecordedTask)>)>, StoreError> {
    let tasks = store.tasks();
    let blocks = tasks.blocks(run_id).await?;
    if blocks.is_empty() {
        return Ok(None);
    }
    let Some((mut ids, mut spans)) = block_ids(graph, &blocks) else {
        return Ok(None);
    };
    spans.sort_unstable();
    let index = graph.index();
    let in_block = |id: TaskId| {
        let k = spans.partition_point(|(first, _)| *first <= id);
        k > 0 && id < spans[k - 1].1
    };
    let mut open: Vec<(Option<usize>, RecordedTask)> = Vec::new();
    let mut counted: u64 = blocks.iter().map(|b| b.tasks).sum();
    let mut contradicted = false;
    // Every row of the run outside the blocks, from its first id on (the batch's, recorded
    // with the run; a chunk recorded in part; a stray row): each is a task no block holds.
    let Some(first_id) = tasks.first_id(run_id).await? else {
        return Ok(None);
    };
    let mut stray = |row: RecordedTask| {
        if in_block(row.id) {
            return;
        }
        counted += 1;
        let t = index.of(&row.key);
        if let Some(t) = t {
            contradicted |= ids.has(t);
            ids.set(t, row.id);
        }
        if t.is_none() || row.status != TaskStatus::Succeeded {
            open.push((t, row));
        }
    };
    for (from, to) in gaps(first_id, &spans) {
        tasks.each_in_ids(run_id, from, to, &mut stray).await?;
    }
    // The open rows the blocks hold: each must be the task its block says.
    tasks
        .each_open(run_id, |row| {
            if !in_block(row.id) {
                return;
            }
            let t = index.of(&row.key);
            contradicted |= t.is_none_or(|t| ids.get(t) != Some(row.id));
            open.push((t, row));
        })
        .await?;
    if contradicted || counted != tasks.live_count(run_id).await? {
        tracing::debug!("the run's task blocks do not account for its rows; read item by item");
        return Ok(None);
    }
    Ok(Some((ids, open)))
}

/// The row id of every task the blocks hold, and each block's span of ids (first, end);
/// `None` when a block does not fit the graph (past its items, another number of tasks, or
/// two blocks over the same items).
fn block_ids(graph: &Graph, blocks: &[TaskBlock]) -> Option<(RowIds, Vec<(TaskId, TaskId)>)> {
    let mut ids = RowIds::new(graph);
    let mut spans = Vec::with_capacity(blocks.len());
    let mut next_item = 0;
    for b in blocks {
        let first = usize::try_from(b.first_item).ok()?;
        let end = first.checked_add(usize::try_from(b.items).ok()?)?;
        if first < next_item || end > graph.instances() || first == end {
            return None;
        }
        next_item = end;
        let from = graph.instance_tasks(Instance::Item(first)).start;
        let to = graph.instance_tasks(Instance::Item(end - 1)).end;
        if u64::try_from(to - from).ok()? != b.tasks {
            return None;
        }
        for (t, id) in (from..to).zip(b.first_id.and_after()) {
            ids.set(t, id);
        }
        spans.push((b.first_id, b.first_id.offset(i64::try_from(b.tasks).ok()?)?));
    }
    Some((ids, spans))
}

/// The ranges of ids from `first` to the first of `spans` (sorted), between them and after
/// the last: (from, to), `to` `None` for the last.
fn gaps(first: TaskId, spans: &[(TaskId, TaskId)]) -> Vec<(TaskId, Option<TaskId>)> {
    let mut gaps = Vec::new();
    let mut from = first;
    for (start, end) in spans {
        if from < *start {
            gaps.push((from, Some(*start)));
        }
        from = from.max(*end);
    }
    gaps.push((from, None));
    gaps
}

/// [`read_rows`] from each item's outline ([`Store::each_item_outline`]).
async fn read_by_items(
    store: &Store,
    graph: &Graph,
    run_id: &RunId,
    mut whole: impl FnMut(Option<usize>, RecordedTask),
) -> Result<RowIds, StoreError> {
    let index = graph.index();
    let mut ids = RowIds::new(graph);
    // Items whose rows are read whole: those that break the pattern, in the order the
    // database gave them (each_of_items reads them by ranges of that order), and the batch's.
    let mut irregular: Vec<String> = Vec::new();
    if graph.instances() > 0 {
        let chain: Vec<(&str, u32)> = graph
            .instance_tasks(Instance::Item(0))
            .map(|t| {
                let (_, step, idx) = graph.key_ref(t);
                (step, idx)
            })
            .collect();
        store
            .tasks()
            .each_item_outline(run_id, BATCH, &chain, |o| {
                match (o.base, index.instance(&o.item)) {
                    (Some(base), Some(i)) => {
                        for (t, id) in graph.instance_tasks(i).zip(base.and_after()) {
                            ids.set(t, id);
                        }
                    }
                    _ => irregular.push(o.item),
                }
            })
            .await?;
    }
    let read_whole: HashSet<&str> = irregular
        .iter()
        .map(String::as_str)
        .chain([BATCH])
        .collect();
    store
        .tasks()
        .each_open(run_id, |row| {
            if read_whole.contains(row.key.item.as_str()) {
                return;
            }
            let t = index.of(&row.key);
            whole(t, row);
        })
        .await?;
    let mut each = |row: RecordedTask| {
        let t = index.of(&row.key);
        if let Some(t) = t {
            ids.set(t, row.id);
        }
        if t.is_none() || row.status != TaskStatus::Succeeded {
            whole(t, row);
        }
    };
    let tasks = store.tasks();
    tasks
        .each_of_items(run_id, &[BATCH.to_owned()], &mut each)
        .await?;
    tasks.each_of_items(run_id, &irregular, &mut each).await?;
    Ok(ids)
}

/// The rows of the run not succeeded, handed to `whole` as [`read_rows`] does, with `ids` (every
/// recorded task's row id, as read earlier by [`read_rows`]): an open row's id is taken as
/// read now.
async fn open_rows(
    store: &Store,
    graph: &Graph,
    run_id: &RunId,
    mut ids: RowIds,
    mut whole: impl FnMut(Option<usize>, RecordedTask),
) -> Result<RowIds, StoreError> {
    let index = graph.index();
    store
        .tasks()
        .each_open(run_id, |row| {
            let t = index.of(&row.key);
            if let Some(t) = t {
                ids.set(t, row.id);
            }
            whole(t, row);
        })
        .await?;
    Ok(ids)
}

/// Each task's row id, and how far recording has gone.
pub(super) struct Rows {
    pub ids: RowIds,
    /// Items below this have every task recorded.
    recorded_items: usize,
}

impl Rows {
    /// Reads the run's rows (see [`read_rows`]): each task's row id, and the state an earlier
    /// process left it in (done, failed for good, or still to do: waiting), which becomes the
    /// scheduler's own state vector rather than a copy beside it. `read`: the row ids a
    /// resume's review read, still every row of the run: only the rows not succeeded are read
    /// again (their state now), not every item's outline a second time.
    pub(super) async fn load(
        store: &Store,
        graph: &Graph,
        config: &Config,
        read: Option<RowIds>,
    ) -> Result<(Rows, Vec<State>), StoreError> {
        let mut prior = vec![State::Waiting; graph.len()];
        let mut open = HashSet::new();
        // Failed by a check: paying for it again would act twice on one verdict.
        let by_checks: HashSet<TaskId> = if graph.checked_steps().is_empty() {
            HashSet::new()
        } else {
            let failed = store.verdicts().failed_tasks(&config.run_id).await?;
            failed.into_iter().collect()
        };
        let mut settle = |t: Option<usize>, row: RecordedTask| {
            let Some(t) = t else {
                return;
            };
            open.insert(t);
            prior[t] = match row.status {
                TaskStatus::Succeeded => State::Done,
                TaskStatus::Failed if by_checks.contains(&row.id) => State::Failed,
                // Possibly billed already, and the user asked not to pay twice.
                TaskStatus::Failed
                    if config.on_ambiguous == OnAmbiguous::Fail
                        && row
                            .last_attempt
                            .as_ref()
                            .is_some_and(|a| a.possibly_billed()) =>
                {
                    State::Failed
                }
                _ => State::Waiting,
            };
        };
        let ids = match read {
            Some(ids) => open_rows(store, graph, &config.run_id, ids, &mut settle).await?,
            None => read_rows(store, graph, &config.run_id, &mut settle).await?,
        };
        // The recorded tasks not read whole are the succeeded ones.
        for (t, state) in prior.iter_mut().enumerate() {
            if ids.has(t) && !open.contains(&t) {
                *state = State::Done;
            }
        }
        let mut rows = Rows {
            ids,
            recorded_items: 0,
        };
        // A `once` step that `--allow-changes` added has no row yet.
        let batch = graph.instance_tasks(Instance::Batch);
        let missing: Vec<usize> = batch.filter(|t| !rows.ids.has(*t)).collect();
        if !missing.is_empty() {
            rows.record(store, graph, &config.run_id, &missing).await?;
        }
        Ok((rows, prior))
    }

    pub(super) fn is_recorded(&self, instance: Instance) -> bool {
        match instance {
            Instance::Batch => true,
            Instance::Item(i) => i < self.recorded_items,
        }
    }

    /// Records the tasks not recorded yet of the items up to `ahead` past item `from`, a
    /// chunk of items per transaction: the scheduler may then admit them.
    pub(super) async fn record_ahead(
        &mut self,
        store: &Store,
        graph: &Graph,
        run_id: &RunId,
        from: usize,
        ahead: usize,
    ) -> Result<(), StoreError> {
        let items = graph.instances();
        let want = from.saturating_add(ahead).min(items);
        while self.recorded_items < want {
            let start = self.recorded_items;
            let end = start.saturating_add(chunk_items().max(ahead)).min(items);
            let first = graph.instance_tasks(Instance::Item(start)).start;
            let last = graph.instance_tasks(Instance::Item(end - 1)).end;
            let missing: Vec<usize> = (first..last).filter(|t| !self.ids.has(*t)).collect();
            if !missing.is_empty() {
                self.record(store, graph, run_id, &missing).await?;
            }
            if missing.len() == last - first {
                self.note_block(store, run_id, (start, end), first..last)
                    .await?;
            }
            self.recorded_items = end;
        }
        Ok(())
    }

    /// Notes the chunk of items `items` (first, end), its tasks `tasks` all recorded now, as a
    /// block ([`TaskBlock`]) when their row ids are consecutive in the graph's order, as the
    /// one statement that recorded them gave them: a takeover then reads the block, not its
    /// rows. Ids given otherwise are simply not noted.
    async fn note_block(
        &self,
        store: &Store,
        run_id: &RunId,
        items: (usize, usize),
        tasks: std::ops::Range<usize>,
    ) -> Result<(), StoreError> {
        let Some(first_id) = self.ids.get(tasks.start) else {
            return Ok(());
        };
        if !tasks
            .clone()
            .zip(first_id.and_after())
            .all(|(t, id)| self.ids.get(t) == Some(id))
        {
            return Ok(());
        }
        let block = TaskBlock {
            first_item: items.0 as u64,
            items: (items.1 - items.0) as u64,
            first_id,
            tasks: tasks.len() as u64,
        };
        store.tasks().add_block(run_id, &block).await
    }

    async fn record(
        &mut self,
        store: &Store,
        graph: &Graph,
        run_id: &RunId,
        missing: &[usize],
    ) -> Result<(), StoreError> {
        let tasks: Vec<NewTask> = missing.iter().map(|t| new_task(graph, *t)).collect();
        let chunk: HashMap<&TaskKey, usize> = tasks
            .iter()
            .zip(missing)
            .map(|(n, t)| (&n.key, *t))
            .collect();
        for (id, key) in store.tasks().record(run_id, &tasks).await? {
            if let Some(t) = chunk.get(&key) {
                self.ids.set(*t, id);
            }
        }
        match missing.iter().find(|t| !self.ids.has(**t)) {
            None => Ok(()),
            Some(t) => Err(StoreError::Inconsistent(format!(
                "task {}/{} of run {run_id} was not recorded",
                graph.item_dir(graph.task(*t).instance),
                graph.step_id(*t),
            ))),
        }
    }
}

/// Records the identity of every task that succeeded in this process and whose inputs' bytes
/// are known, so later runs and changed pipelines can tell the same work from new work. A
/// chunk at a time: the hashes held are only those of the chunk's inputs.
pub(super) async fn record_identities(
    store: &Store,
    graph: &Graph,
    rows: &RowIds,
    succeeded: &[usize],
) -> Result<(), StoreError> {
    for chunk in succeeded.chunks(512) {
        let mut inputs: Vec<TaskId> = chunk
            .iter()
            .flat_map(|t| graph.deps(*t))
            .filter_map(|u| rows.get(u))
            .collect();
        inputs.sort_unstable();
        inputs.dedup();
        let hashes: HashMap<(TaskId, u32), Sha256Sum> =
            store.identities().output_hashes_of(&inputs).await?;
        let found: Vec<(TaskId, String)> = chunk
            .iter()
            .filter_map(|&t| {
                let id = crate::exec::identity::from_record(graph, t, |u| rows.get(u), &hashes)?;
                Some((rows.get(t)?, id))
            })
            .collect();
        store.identities().set(&found).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new run `r` of `graph`'s tasks, recorded in the order of `order` (indexes into the
    /// graph), then rows the graph does not have; every task succeeded but `open`.
    async fn recorded(
        store: &Store,
        graph: &Graph,
        order: &[usize],
        extra: &[(&str, &str)],
        open: &[usize],
    ) {
        let run = crate::store::NewRun {
            id: &crate::run_id::RunId::from("r"),
            pipeline_name: "p",
            pipeline_file: "p.yaml",
            pipeline_text: "",
            pipeline_sha256: &crate::sha256::Sha256Sum::of_bytes(b""),
            items_sha256: &crate::sha256::Sha256Sum::of_bytes(b""),
            plan: &crate::store::RecordedPlan::of(&serde_json::json!({})).unwrap(),
            output_dir: "out",
            credits_planned: 0,
            balance_before: None,
        };
        let mut tasks: Vec<NewTask> = order.iter().map(|t| new_task(graph, *t)).collect();
        tasks.extend(extra.iter().map(|(item, step)| NewTask {
            key: TaskKey::new(*item, *step, 0),
            operation: "erase",
            inputs: "[]".to_owned(),
            planned_credits: 2,
            request: None,
        }));
        // One statement a task: the order given is the order of the ids.
        store.runs().create(&run, &[]).await.unwrap();
        for task in &tasks {
            store
                .tasks()
                .record(&"r".into(), std::slice::from_ref(task))
                .await
                .unwrap();
        }
        sqlx::query("UPDATE tasks SET status = 'succeeded'")
            .execute(store.pool())
            .await
            .unwrap();
        for t in open {
            let TaskKey { item, step, index } = graph.key(*t);
            sqlx::query(
                "UPDATE tasks SET status = 'failed' WHERE item = $1 AND step = $2 AND idx = $3",
            )
            .bind(item)
            .bind(step)
            .bind(i64::from(index))
            .execute(store.pool())
            .await
            .unwrap();
        }
    }

    /// A fresh SQLite store (in `dir`), and a fresh PostgreSQL one named `name` when the tests
    /// have a server (its database dropped with the guard returned, once the test passed).
    async fn stores(
        dir: &tempfile::TempDir,
        name: &str,
    ) -> (
        Vec<Store>,
        Option<crate::store::test_postgres::TestDatabase>,
    ) {
        let mut stores = vec![Store::open(&dir.path().join("state.db")).await.unwrap()];
        let database = crate::store::test_postgres::database(name).await;
        if let Some(url) = &database {
            let location = crate::store::Location::Postgres((**url).clone());
            stores.push(Store::open_at(&location).await.unwrap());
        }
        (stores, database)
    }

    #[tokio::test]
    async fn rows_are_read_an_item_at_a_time_where_the_ids_follow_the_chain_and_whole_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let (stores, _database) = stores(&dir, "rows").await;
        for store in stores {
            read_back(&store).await;
            store.close().await;
        }
    }

    /// The rows of a run recorded in every way `read_rows` meets, read back: in order, out of
    /// order, with rows the graph does not have and rows `--allow-changes` dropped (of a
    /// task still in the graph, succeeded and open: never read, never a task's id).
    async fn read_back(store: &Store) {
        let g = Graph::of_text(
            "version: 1\nname: t\nitems: [{ id: a }, { id: b }, { id: c }, { id: d }]\nsteps:\n  - id: logo\n    once: true\n    generate: { prompt: p }\n  - id: shot\n    generate: { prompt: p, n: 2 }\n  - id: big\n    upscale: { from: shot, desired_increase: 2 }\n",
        );
        let item = |i| g.instance_tasks(Instance::Item(i));
        // The batch; item a in order; item b backwards; item c in order with a task failed
        // and a step the pipeline no longer has; item d never recorded; an item it lost.
        let mut order: Vec<usize> = g.instance_tasks(Instance::Batch).collect();
        order.extend(item(0));
        order.extend(item(1).rev());
        order.extend(item(2));
        let failed = item(2).start + 1;
        recorded(
            store,
            &g,
            &order,
            &[("c", "old"), ("gone", "shot"), ("b", "cut"), ("a", "cut")],
            &[failed],
        )
        .await;
        // Dropped, and left open when dropped: a step of a (summed up: its open rows are read
        // on their own) and of b (read whole: recorded out of order), and a task of b the
        // graph still has.
        let twin = item(1).start + 1;
        let TaskKey { item: b, step, .. } = g.key(twin);
        sqlx::query(
            "UPDATE tasks SET removed_at = 1, status = 'failed'
             WHERE step = 'cut' OR (item = $1 AND step = $2)",
        )
        .bind(&b)
        .bind(&step)
        .execute(store.pool())
        .await
        .unwrap();

        let mut whole: Vec<(Option<usize>, String, String, TaskStatus)> = Vec::new();
        let ids = read_rows(store, &g, &"r".into(), |t, row| {
            whole.push((t, row.key.item, row.key.step, row.status));
        })
        .await
        .unwrap();
        let index = g.index();
        let rows = store.tasks().all(&"r".into()).await.unwrap();
        for row in &rows {
            if let Some(t) = index.of(&row.key) {
                assert_eq!(ids.get(t), Some(row.id), "{}", row.key);
            }
        }
        assert_eq!(ids.get(twin), None, "a dropped row is no task's row");
        assert!(item(3).all(|t| ids.get(t).is_none()), "item d has no rows");
        assert!(ids.any_of(&g, Instance::Item(2)) && !ids.any_of(&g, Instance::Item(3)));
        whole.sort_by(|x, y| (&x.1, &x.2).cmp(&(&y.1, &y.2)));
        assert_eq!(
            whole,
            [
                (
                    Some(failed),
                    "c".into(),
                    g.key(failed).step,
                    TaskStatus::Failed
                ),
                (None, "c".into(), "old".into(), TaskStatus::Succeeded),
                (None, "gone".into(), "shot".into(), TaskStatus::Succeeded),
            ],
            "read whole: what is not succeeded, and what the graph does not have"
        );
        handed_back(store, &g, ids, &whole).await;
    }

    #[tokio::test]
    async fn blocks_give_the_rows_items_give_and_are_left_unread_when_they_hold_a_row_not_live() {
        let dir = tempfile::tempdir().unwrap();
        let (stores, _database) = stores(&dir, "blocks").await;
        for store in stores {
            by_blocks(&store).await;
            store.close().await;
        }
    }

    /// Every task's id and the rows read whole, by blocks (`None`: not trusted) and by items.
    async fn both_ways(
        store: &Store,
        g: &Graph,
    ) -> (
        Option<(Vec<Option<TaskId>>, Vec<String>)>,
        (Vec<Option<TaskId>>, Vec<String>),
    ) {
        let r: RunId = "r".into();
        let seen = |ids: &RowIds, open: Vec<(Option<usize>, RecordedTask)>| {
            let mut open: Vec<String> = open
                .into_iter()
                .map(|(t, row)| format!("{t:?} {} {} {}", row.id, row.key, row.status.as_str()))
                .collect();
            open.sort();
            ((0..g.len()).map(|t| ids.get(t)).collect(), open)
        };
        let blocks = read_by_blocks(store, g, &r).await.unwrap();
        let blocks = blocks.map(|(ids, open)| seen(&ids, open));
        let mut open = Vec::new();
        let ids = read_by_items(store, g, &r, |t, row| open.push((t, row)))
            .await
            .unwrap();
        (blocks, seen(&ids, open))
    }

    /// A run recorded as the executor records it: the batch, then chunks of items each noted
    /// as a block, the last chunk cut before its block was noted (a kill), an item never
    /// recorded, a row the graph does not have; read by blocks and by items alike, and so with
    /// a block lost. Then blocks that cannot tell the whole story (one holding a task dropped,
    /// the pipeline changed) are not read.
    async fn by_blocks(store: &Store) {
        let g = Graph::of_text(
            "version: 1\nname: t\nitems: [{ id: a }, { id: b }, { id: c }, { id: d }, { id: e }, { id: f }, { id: g }]\nsteps:\n  - id: logo\n    once: true\n    generate: { prompt: p }\n  - id: shot\n    generate: { prompt: p, n: 2 }\n  - id: big\n    upscale: { from: shot, desired_increase: 2 }\n",
        );
        let batch: Vec<usize> = g.instance_tasks(Instance::Batch).collect();
        recorded(store, &g, &batch, &[], &[]).await;
        let r: RunId = "r".into();
        let mut rows = Rows {
            ids: RowIds::new(&g),
            recorded_items: 0,
        };
        let span = |a: usize, b: usize| {
            g.instance_tasks(Instance::Item(a)).start..g.instance_tasks(Instance::Item(b - 1)).end
        };
        for (a, b, noted) in [(0, 2, true), (2, 4, true), (4, 5, false)] {
            let tasks: Vec<usize> = span(a, b).collect();
            rows.record(store, &g, &r, &tasks).await.unwrap();
            if noted {
                rows.note_block(store, &r, (a, b), span(a, b))
                    .await
                    .unwrap();
            }
        }
        // A row the graph does not have, recorded after the blocks.
        let stray = NewTask {
            key: TaskKey::new("gone", "shot", 0),
            operation: "generate",
            inputs: "[]".to_owned(),
            planned_credits: 4,
            request: None,
        };
        store.tasks().record(&r, &[stray]).await.unwrap();
        // Items a, c and e done but one task each; b and d wholly done.
        sqlx::query("UPDATE tasks SET status = 'succeeded' WHERE item <> 'a'")
            .execute(store.pool())
            .await
            .unwrap();
        for i in [0, 2, 4] {
            let TaskKey { item, step, index } =
                g.key(g.instance_tasks(Instance::Item(i)).start + 1);
            sqlx::query(
                "UPDATE tasks SET status = 'failed' WHERE item = $1 AND step = $2 AND idx = $3",
            )
            .bind(item)
            .bind(step)
            .bind(i64::from(index))
            .execute(store.pool())
            .await
            .unwrap();
        }
        sqlx::query("UPDATE tasks SET status = 'succeeded' WHERE item = 'a' AND step = 'big'")
            .execute(store.pool())
            .await
            .unwrap();

        let (blocks, items) = both_ways(store, &g).await;
        assert_eq!(blocks.as_ref(), Some(&items), "blocks read as items are");
        let (ids, open) = items;
        assert!(span(0, 5).all(|t| ids[t].is_some()) && span(5, 7).all(|t| ids[t].is_none()));
        assert_eq!(
            open.len(),
            4,
            "three failed, one the graph does not have: {open:?}"
        );
        assert_eq!(store.tasks().blocks(&r).await.unwrap().len(), 2);

        // The first block lost: its items' rows are read whole like any row outside a block.
        sqlx::query("DELETE FROM task_blocks WHERE first_item = 0")
            .execute(store.pool())
            .await
            .unwrap();
        let (blocks, items) = both_ways(store, &g).await;
        assert_eq!(blocks, Some(items), "a block lost: its rows read whole");
        rows.note_block(store, &r, (0, 2), span(0, 2))
            .await
            .unwrap();
        // A task of a block dropped (`--allow-changes`): the block holds a row no longer live,
        // so the blocks no longer account for the run's live tasks.
        let dropped = "UPDATE tasks SET removed_at = 1 WHERE item = 'b' AND step = 'big'";
        sqlx::query(dropped).execute(store.pool()).await.unwrap();
        assert_eq!(both_ways(store, &g).await.0, None, "a block's task dropped");
        sqlx::query("UPDATE tasks SET removed_at = NULL")
            .execute(store.pool())
            .await
            .unwrap();
        // Another pipeline: no block of the run is read.
        rows.note_block(store, &r, (0, 2), span(0, 2))
            .await
            .unwrap();
        assert!(
            both_ways(store, &g).await.0.is_some(),
            "the block noted again"
        );
        sqlx::query("UPDATE runs SET pipeline_sha256 = 'changed'")
            .execute(store.pool())
            .await
            .unwrap();
        assert!(store.tasks().blocks(&r).await.unwrap().is_empty());
        assert_eq!(both_ways(store, &g).await.0, None, "the pipeline changed");
    }

    /// The executor's start with the ids the review read (`ids`, `whole` as [`read_rows`] gave
    /// them) sees what reading them again sees: the same ids, the same open rows of the graph.
    async fn handed_back(
        store: &Store,
        g: &Graph,
        ids: RowIds,
        whole: &[(Option<usize>, String, String, TaskStatus)],
    ) {
        let before: Vec<Option<TaskId>> = (0..g.len()).map(|t| ids.get(t)).collect();
        let mut open = Vec::new();
        let ids = open_rows(store, g, &"r".into(), ids, |t, row| {
            open.push((t, row.key.item, row.key.step, row.status));
        })
        .await
        .unwrap();
        let after: Vec<Option<TaskId>> = (0..g.len()).map(|t| ids.get(t)).collect();
        assert_eq!(after, before, "the handed ids are the ids read again");
        let of_graph: Vec<_> = whole.iter().filter(|w| w.0.is_some()).cloned().collect();
        assert_eq!(
            open, of_graph,
            "the open rows of the graph's tasks, each once"
        );
    }

    #[test]
    fn each_task_records_its_request_as_sent_without_urls() {
        use crate::store::TaskRequest;
        let g = Graph::of_text(
            r#"version: 1
name: t
items: [{ id: a, thing: "a <b>mug</b>", gone: 'the "tag"' }]
steps:
  - id: shot
    generate: { prompt: "photo of {{ item.thing }}", n: 2, size: 4K }
  - id: clean
    erase: { from: shot, object_name: "{{ item.gone }}" }
  - id: wide
    expand: { from: clean, aspect_ratio: "16:9", prompt: more backdrop }
  - id: big
    upscale: { from: wide, desired_increase: 4, preserve_alpha: false }
  - id: cut
    remove_background: { from: big }
"#,
        );
        let recorded = |step: &str| {
            let t = (0..g.len())
                .find(|t| g.key(*t).step == step && g.key(*t).index == 0)
                .unwrap();
            let text = new_task(&g, t).request.expect("a request");
            assert!(!text.contains("url"), "no URL in {text}");
            serde_json::from_str::<TaskRequest>(&text).unwrap()
        };
        assert_eq!(
            recorded("shot"),
            TaskRequest {
                prompt: Some("photo of a <b>mug</b>".into()),
                n: Some(2),
                size: Some("4K".into()),
                ..TaskRequest::default()
            }
        );
        assert_eq!(
            recorded("clean"),
            TaskRequest {
                object_name: Some(r#"the "tag""#.into()),
                ..TaskRequest::default()
            }
        );
        assert_eq!(
            recorded("wide"),
            TaskRequest {
                aspect_ratio: Some("16:9".into()),
                prompt: Some("more backdrop".into()),
                ..TaskRequest::default()
            }
        );
        assert_eq!(
            recorded("big"),
            TaskRequest {
                desired_increase: Some(4),
                preserve_alpha: Some(false),
                ..TaskRequest::default()
            }
        );
        assert_eq!(recorded("cut"), TaskRequest::default());
    }
}
