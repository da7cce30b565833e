//! A run's task rows read as compactly as the database allows, for the start of a takeover.
//!
//! A row crossing from the database costs microseconds (sqlx hands rows one at a time from its
//! worker, each converted to the `Any` driver's row), so reading a night's 900,000 task rows
//! before the first paid call took seconds. But a run records an item's tasks in one statement,
//! in the graph's order: their ids are consecutive. The database sums each item up in one row
//! ([`ItemOutline`]): its smallest and largest `id - offset`, where a task's offset is its
//! place in the item's chain; when the two are equal and every task of the chain is there,
//! each task's id is that base plus its offset. The rows that are not so summed up (those not
//! succeeded, and every row of an item that breaks the pattern) are read whole.

use futures::TryStreamExt;
use sqlx::Row;

use crate::run_id::RunId;
use crate::store::tasks::Tasks;
use crate::store::{RecordedTask, StoreError, TaskId};

/// One item's recorded tasks, summed up by the database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemOutline {
    pub item: String,
    /// The id of the item's first task when every task of the chain is recorded and the ids
    /// are that base plus each task's offset; `None` when its rows are to be read whole.
    pub base: Option<TaskId>,
    /// Its tasks not succeeded (read whole with [`Tasks::each_open`]).
    pub open: u32,
}

/// A chunk of items whose tasks were recorded whole in one statement, in the graph's order:
/// task `k` of the chunk (counting from the first task of its first item) has row id
/// `first_id + k`. Written by the executor once the chunk is committed and its ids seen to
/// be so; read back only while the run's pipeline and items are the ones it was recorded from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskBlock {
    /// The chunk's first item, by its place in the items file.
    pub first_item: u64,
    pub items: u64,
    pub first_id: TaskId,
    pub tasks: u64,
}

/// Columns of a task row read whole, with its last attempt (as [`Tasks::each`]).
const TASK_COLUMNS: &str = "t.id, t.item, t.step, t.idx, t.status, t.planned_credits,
    t.credits_billed, t.job_id, t.error, t.identity, t.reused_from, t.removed_at,
    a.id AS a_id, a.outcome AS a_outcome, a.job_id AS a_job
    FROM tasks t
    LEFT JOIN attempts a ON a.id = (SELECT MAX(id) FROM attempts WHERE task_id = t.id)";

/// Items bound in one statement reading rows whole.
const ITEMS_PER_STATEMENT: usize = 500;

/// A test-only setting: items a statement reads whole in place of [`ITEMS_PER_STATEMENT`], so
/// that a test can cross a statement's boundary with a few dozen items, not hundreds.
const TEST_ITEMS_PER_STATEMENT_ENV: &str = "IMGPIPE_TEST_ITEMS_PER_STATEMENT";

/// [`ITEMS_PER_STATEMENT`], or the positive number [`TEST_ITEMS_PER_STATEMENT_ENV`] sets; read
/// once.
fn items_per_statement() -> usize {
    static ITEMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ITEMS.get_or_init(|| {
        std::env::var(TEST_ITEMS_PER_STATEMENT_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(ITEMS_PER_STATEMENT)
    })
}

impl Tasks<'_> {
    /// Notes a block of tasks recorded whole (see [`TaskBlock`]), stamped with the run's
    /// pipeline and items as they are now. A block already noted is left as it is.
    pub async fn add_block(&self, run_id: &RunId, block: &TaskBlock) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO task_blocks (run_id, first_item, items, first_id, tasks,
                 pipeline_sha256, items_sha256)
             SELECT id, $2, $3, $4, $5, pipeline_sha256, items_sha256 FROM runs WHERE id = $1
             ON CONFLICT (run_id, first_item) DO NOTHING",
        )
        .bind(run_id)
        .bind(to_i64(block.first_item))
        .bind(to_i64(block.items))
        .bind(block.first_id)
        .bind(to_i64(block.tasks))
        .execute(self.store.pool())
        .await?;
        Ok(())
    }

    /// The run's blocks recorded from its pipeline and items as they are now, by first item.
    pub async fn blocks(&self, run_id: &RunId) -> Result<Vec<TaskBlock>, StoreError> {
        let rows: Vec<(i64, i64, TaskId, i64)> = sqlx::query_as(
            "SELECT b.first_item, b.items, b.first_id, b.tasks
             FROM task_blocks b JOIN runs r ON r.id = b.run_id
             WHERE b.run_id = $1 AND b.pipeline_sha256 = r.pipeline_sha256
               AND b.items_sha256 = r.items_sha256
             ORDER BY b.first_item",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?;
        let to_u64 = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(rows
            .into_iter()
            .map(|(first_item, items, first_id, tasks)| TaskBlock {
                first_item: to_u64(first_item),
                items: to_u64(items),
                first_id,
                tasks: to_u64(tasks),
            })
            .collect())
    }

    /// The number of the run's live tasks (not dropped by `--allow-changes`), from the totals
    /// kept as its rows are written: a few rows, whatever the night.
    pub async fn live_count(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(tasks), 0) AS BIGINT) FROM run_step_totals WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The smallest id any task of the run ever had (from the totals kept as its rows are
    /// written); `None` when it has none.
    pub async fn first_id(&self, run_id: &RunId) -> Result<Option<TaskId>, StoreError> {
        let (id,): (Option<TaskId>,) =
            sqlx::query_as("SELECT MIN(first_id) FROM run_step_totals WHERE run_id = $1")
                .bind(run_id)
                .fetch_one(self.store.pool())
                .await?;
        Ok(id)
    }

    /// Every live task row of the run whose id is at least `from` and below `to` (no bound:
    /// `None`), whole, by id: a range of the (run, id) index (`tasks_by_run_id`), only the
    /// run's own rows. On PostgreSQL read with sorts disabled, so that on tables not analysed
    /// an index in id order is walked, not every task of the run sorted.
    pub async fn each_in_ids(
        &self,
        run_id: &RunId,
        from: TaskId,
        to: Option<TaskId>,
        mut f: impl FnMut(RecordedTask),
    ) -> Result<(), StoreError> {
        let sql = format!(
            "SELECT {TASK_COLUMNS}
             WHERE t.id >= $2 AND t.id < $3 AND t.run_id = $1
             ORDER BY t.id"
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .bind(from)
            .bind(to.map_or(i64::MAX, TaskId::get));
        self.store
            .each_unsorted(query, |r| {
                if is_live(&r)? {
                    f(super::tasks::task_row(&r)?);
                }
                Ok(())
            })
            .await
    }

    /// Each item of the run (but `skip`, the batch's own directory) summed up in one row, in
    /// the database's order of item ids (the order [`Tasks::each_of_items`] asks for).
    ///
    /// On PostgreSQL, read with sorts disabled ([`crate::store::Store::each_unsorted`]): on
    /// tables not analysed (a takeover right after a kill) the planner guessed a dozen rows,
    /// read the run's every task through a bitmap scan, sorted them all by item on disk, then
    /// summed: 1.47 s at 816,000 tasks. Walking the unique index (run, item, step, idx) gives
    /// the rows in item order already, summed as they come: 0.74 s, its first items at once.
    /// `chain` is an item's tasks in the graph's order, as (step id, index): a task's offset
    /// is its place in it.
    pub async fn each_item_outline(
        &self,
        run_id: &RunId,
        skip: &str,
        chain: &[(&str, u32)],
        mut f: impl FnMut(ItemOutline),
    ) -> Result<(), StoreError> {
        // The offset of each task of the chain; NULL for a step the chain does not have.
        let mut offset = String::from("CASE");
        for (i, _) in chain.iter().enumerate() {
            let (s, x) = (3 + 2 * i, 4 + 2 * i);
            offset.push_str(&format!(" WHEN step = ${s} AND idx = ${x} THEN {i}"));
        }
        offset.push_str(" END");
        let sql = format!(
            "SELECT item, CAST(MIN(id - off) AS BIGINT) AS low, CAST(MAX(id - off) AS BIGINT) AS high,
                    CAST(COUNT(*) AS BIGINT) AS n, CAST(COUNT(off) AS BIGINT) AS known,
                    CAST(SUM(CASE WHEN status = 'succeeded' THEN 0 ELSE 1 END) AS BIGINT) AS open
             FROM (SELECT item, id, status, {offset} AS off FROM tasks
                   WHERE run_id = $1 AND removed_at IS NULL AND item <> $2) s
             GROUP BY item
             ORDER BY item"
        );
        // Built from a fixed placeholder list: no value is ever part of the text.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .bind(skip);
        for (step, idx) in chain {
            query = query.bind(*step).bind(i64::from(*idx));
        }
        let whole = i64::try_from(chain.len()).unwrap_or(i64::MAX);
        self.store
            .each_unsorted(query, |r| {
                let (low, high): (Option<i64>, Option<i64>) =
                    (r.try_get("low")?, r.try_get("high")?);
                let (n, known): (i64, i64) = (r.try_get("n")?, r.try_get("known")?);
                let regular = n == whole && known == whole && low.is_some() && low == high;
                f(ItemOutline {
                    item: r.try_get("item")?,
                    base: low.filter(|_| regular).and_then(TaskId::new),
                    open: u32::try_from(r.try_get::<i64, _>("open")?).unwrap_or(u32::MAX),
                });
                Ok(())
            })
            .await
    }

    /// Every task row of the run that is not succeeded, whole.
    ///
    /// Found through `tasks_by_run` (run, status), so only the open rows are read, however
    /// long the night. The statement names no `removed_at` on purpose: on tables not analysed
    /// yet (a takeover right after a kill), PostgreSQL takes any index whose predicate a query
    /// implies, here the partial `tasks_in_order`, for nearly free, and read every task of the
    /// run through it. Dropped rows are left out here instead.
    pub async fn each_open(
        &self,
        run_id: &RunId,
        mut f: impl FnMut(RecordedTask),
    ) -> Result<(), StoreError> {
        let sql = format!(
            "SELECT {TASK_COLUMNS}
             WHERE t.run_id = $1 AND t.status IN ('pending', 'running', 'failed', 'blocked')
             ORDER BY t.id"
        );
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch(self.store.pool());
        while let Some(r) = rows.try_next().await? {
            if is_live(&r)? {
                f(super::tasks::task_row(&r)?);
            }
        }
        Ok(())
    }

    /// Every task row of these items of the run, whole, a statement per 500 items. `items`
    /// come in the database's order of item ids, as [`Tasks::each_item_outline`] gives them:
    /// each statement reads the range of the unique index (run, item, …) from its first item
    /// to its last, so the statements together read each task of the run once at most,
    /// whatever the number of items. (An `item IN (…)` list alone, on tables not analysed,
    /// was read through `tasks_in_order`: every task of the run for each 500 items, 191
    /// statements of a second each at 900,000 tasks.) As in [`Tasks::each_open`], no
    /// `removed_at` in the statement: dropped rows are left out here.
    pub async fn each_of_items(
        &self,
        run_id: &RunId,
        items: &[String],
        mut f: impl FnMut(RecordedTask),
    ) -> Result<(), StoreError> {
        for chunk in items.chunks(items_per_statement()) {
            let (Some(first), Some(last)) = (chunk.first(), chunk.last()) else {
                continue;
            };
            let marks: Vec<String> = (0..chunk.len()).map(|i| format!("${}", i + 4)).collect();
            let sql = format!(
                "SELECT {TASK_COLUMNS}
                 WHERE t.run_id = $1 AND t.item >= $2 AND t.item <= $3 AND t.item IN ({})
                 ORDER BY t.item, t.step, t.idx",
                marks.join(", ")
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(run_id)
                .bind(first)
                .bind(last);
            for item in chunk {
                query = query.bind(item);
            }
            let mut rows = query.fetch(self.store.pool());
            while let Some(r) = rows.try_next().await? {
                if is_live(&r)? {
                    f(super::tasks::task_row(&r)?);
                }
            }
        }
        Ok(())
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Whether a row read with [`TASK_COLUMNS`] is a task the pipeline still has (not dropped by
/// `--allow-changes`).
fn is_live(r: &sqlx::any::AnyRow) -> Result<bool, StoreError> {
    Ok(r.try_get::<Option<i64>, _>("removed_at")?.is_none())
}
