//! The review desk's reads of a run: its items a page at a time, in the order of their ids,
//! each page found by keyset (the last item of the page before) and filtered by the database,
//! and the items that changed since a moment. A page costs its own rows and the index entries
//! walked to find them, never the run: 100,000 items open as fast as 10.

use std::collections::HashMap;

use sqlx::Row;

use crate::run_id::RunId;
use crate::store::report::{Report, place, report_task};
use crate::store::tasks::TaskStatus;
use crate::store::{
    EarlierOutput, OutputId, ReportOutput, ReportTask, ShownVerdict, StoreError, to_u64,
};

/// Which items a page shows: those with a live task that matches every condition given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ItemFilter {
    pub status: Option<TaskStatus>,
    pub step: Option<String>,
    /// A task failed or blocked, or an output whose download failed.
    pub failed: bool,
    /// A call sent without a complete answer: it may have been billed.
    pub possibly_billed: bool,
    /// A task done again, its earlier outputs set aside.
    pub rerolled: bool,
    /// An output a check failed or could not judge, kept and flagged for a person.
    pub flagged: bool,
    /// Words in the item's id or the task's request (its prompt), whatever their case.
    pub text: Option<String>,
}

/// One task of a page, with its outputs and their earlier versions.
#[derive(Clone, Debug)]
pub struct PageTask {
    pub task: ReportTask,
    pub outputs: Vec<ReportOutput>,
    pub earlier: Vec<EarlierOutput>,
    /// Its calls sent without a complete answer (with `unanswered`, those still without one).
    pub possibly_billed: u64,
    /// The checks' verdicts on its outputs, by output.
    pub checks: HashMap<OutputId, Vec<ShownVerdict>>,
}

/// One item of a page: its tasks in the order they were recorded (the pipeline's steps).
#[derive(Clone, Debug)]
pub struct PageItem {
    pub item: String,
    pub tasks: Vec<PageTask>,
}

/// A page of items, and the cursor of the next one when there is more.
#[derive(Clone, Debug)]
pub struct ItemPage {
    pub items: Vec<PageItem>,
    pub next: Option<String>,
}

/// A value bound to a statement built here.
enum Bind {
    Text(String),
    Int(i64),
    Bool(bool),
}

/// A statement's text and values, its placeholders numbered in the order they appear (SQLite
/// numbers `$N` by first appearance).
#[derive(Default)]
struct Sql {
    text: String,
    binds: Vec<Bind>,
}

impl Sql {
    fn push(&mut self, text: &str) -> &mut Sql {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder for `value`.
    fn bind(&mut self, value: Bind) -> &mut Sql {
        self.binds.push(value);
        let n = self.binds.len();
        self.text.push_str(&format!("${n}"));
        self
    }

    /// Appends a placeholder for each of `texts`, separated by commas (an `IN (…)` list).
    fn bind_texts(&mut self, texts: &[String]) -> &mut Sql {
        for (i, text) in texts.iter().enumerate() {
            if i > 0 {
                self.push(", ");
            }
            self.bind(Bind::Text(text.clone()));
        }
        self
    }

    /// The placeholder of the value bound last, again.
    fn again(&mut self) -> &mut Sql {
        let n = self.binds.len();
        self.text.push_str(&format!("${n}"));
        self
    }

    fn query(&self) -> sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments> {
        // Built from fixed pieces and numbered placeholders: no value is ever part of the text.
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.text.clone()));
        for b in &self.binds {
            q = match b {
                Bind::Text(s) => q.bind(s.clone()),
                Bind::Int(n) => q.bind(*n),
                Bind::Bool(b) => q.bind(*b),
            };
        }
        q
    }
}

/// `text` as a `LIKE` pattern that matches it anywhere, its own `%`, `_` and `\` taken
/// literally.
fn contains_pattern(text: &str) -> String {
    let mut p = String::from("%");
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('%');
    p
}

/// Appends, when `f` asks for something rare (a problem: a failure, a call possibly billed, a
/// task done again, a status other than pending or succeeded), the condition that the task is
/// one of the few that have it, found from their own index: the page is then made from those
/// few, not from a walk of every item looking for them. `$1` is the run's id.
fn driver(sql: &mut Sql, f: &ItemFilter, unanswered: bool) {
    if f.flagged {
        sql.push(
            " AND t.id IN (SELECT task_id FROM check_verdicts WHERE run_id = $1
                 AND acted = 'flagged')",
        );
    } else if f.rerolled {
        sql.push(" AND t.id IN (SELECT task_id FROM superseded_outputs WHERE run_id = $1)");
    } else if f.failed {
        sql.push(
            " AND t.id IN (SELECT id FROM tasks WHERE run_id = $1
                 AND status IN ('failed', 'blocked')
               UNION SELECT task_id FROM outputs WHERE run_id = $1
                 AND path IS NULL AND download_error IS NOT NULL)",
        );
    } else if f.possibly_billed {
        sql.push(
            " AND t.id IN (SELECT task_id FROM attempts WHERE run_id = $1
                 AND (outcome = 'ambiguous' OR (outcome IS NULL AND ",
        )
        .bind(Bind::Bool(unanswered))
        .push(")))");
    } else if let Some(status) = f
        .status
        .filter(|s| !matches!(s, TaskStatus::Pending | TaskStatus::Succeeded))
    {
        sql.push(" AND t.id IN (SELECT id FROM tasks WHERE run_id = $1 AND status = ")
            .bind(Bind::Text(status.as_str().to_owned()))
            .push(")");
    }
}

/// How many tasks a page of a filter that walks the run ([`walks`]) looks at, at most: about
/// 5,500 items of the five-step chain, some 50 ms of SQLite's or PostgreSQL's time on a busy
/// machine (a quarter of a page's goal, `benches/README.md`).
const WINDOW: u32 = 50_000;

/// Whether `f` is found by walking the run's items and testing each (the text of prompts, a
/// step, a common status), rather than from an index of the few tasks it asks for
/// ([`driver`]) or with no condition at all (every item matches).
fn walks(f: &ItemFilter) -> bool {
    let driven = f.flagged
        || f.rerolled
        || f.failed
        || f.possibly_billed
        || f.status
            .is_some_and(|s| !matches!(s, TaskStatus::Pending | TaskStatus::Succeeded));
    !driven && *f != ItemFilter::default()
}

/// Appends the conditions of `f` on task `t` (`unanswered`: calls without an answer count
/// as possibly billed, the run's process being gone); `like` is the backend's
/// case-insensitive `LIKE`.
fn conditions(sql: &mut Sql, f: &ItemFilter, unanswered: bool, like: &str) {
    if let Some(status) = f.status {
        sql.push(" AND t.status = ")
            .bind(Bind::Text(status.as_str().to_owned()));
    }
    if let Some(step) = &f.step {
        sql.push(" AND t.step = ").bind(Bind::Text(step.clone()));
    }
    if f.failed {
        sql.push(
            " AND (t.status IN ('failed', 'blocked') OR EXISTS (SELECT 1 FROM outputs fo
               WHERE fo.task_id = t.id AND fo.path IS NULL AND fo.download_error IS NOT NULL))",
        );
    }
    if f.possibly_billed {
        sql.push(
            " AND EXISTS (SELECT 1 FROM attempts pa WHERE pa.task_id = t.id
               AND (pa.outcome = 'ambiguous' OR (pa.outcome IS NULL AND ",
        )
        .bind(Bind::Bool(unanswered))
        .push(")))");
    }
    if f.rerolled {
        sql.push(" AND EXISTS (SELECT 1 FROM superseded_outputs so WHERE so.task_id = t.id)");
    }
    if f.flagged {
        sql.push(
            " AND EXISTS (SELECT 1 FROM check_verdicts cv WHERE cv.run_id = t.run_id
               AND cv.task_id = t.id AND cv.acted = 'flagged')",
        );
    }
    if let Some(text) = f.text.as_deref().filter(|t| !t.trim().is_empty()) {
        sql.push(&format!(" AND (t.item {like} "))
            .bind(Bind::Text(contains_pattern(text.trim())))
            .push(&format!(" ESCAPE '\\' OR t.request {like} "))
            .again()
            .push(" ESCAPE '\\')");
    }
}

impl Report<'_> {
    /// The backend's `LIKE` that ignores case: SQLite's own (for ASCII), PostgreSQL's `ILIKE`.
    fn like(&self) -> &'static str {
        match self.store.backend() {
            crate::store::Backend::Sqlite => "LIKE",
            crate::store::Backend::Postgres => "ILIKE",
        }
    }

    /// Up to `limit` items of run `run_id` after item `after` (by id), with a live task
    /// matching `filter`, each with all its live tasks; and the cursor of the next page.
    ///
    /// The items are found walking the `(run_id, item, step, idx)` index from `after`, and
    /// stop at `limit`: a page reads its own rows, whatever the run's size. A filter for
    /// something rare starts from the few tasks that have it instead ([`driver`]). Any other
    /// filter (the text of the prompts, a step, a common status) looks at no more than
    /// [`WINDOW`] tasks: when it finds fewer than `limit` items among them, the page is short
    /// (even empty) and its cursor is the last item it looked at, so a match far down the run
    /// costs a few bounded pages rather than one that reads the whole run.
    pub async fn item_page(
        &self,
        run_id: &RunId,
        after: Option<&str>,
        limit: u32,
        filter: &ItemFilter,
        unanswered: bool,
    ) -> Result<ItemPage, StoreError> {
        self.item_page_within(run_id, after, limit, filter, unanswered, WINDOW)
            .await
    }

    /// [`Report::item_page`], a walk looking at no more than `window` tasks.
    async fn item_page_within(
        &self,
        run_id: &RunId,
        after: Option<&str>,
        limit: u32,
        filter: &ItemFilter,
        unanswered: bool,
        window: u32,
    ) -> Result<ItemPage, StoreError> {
        let bound = if walks(filter) {
            self.window_end(run_id, after, window).await?
        } else {
            None
        };
        let mut sql = Sql::default();
        sql.push("SELECT DISTINCT t.item FROM tasks t WHERE t.run_id = ")
            .bind(Bind::Text(run_id.to_string()))
            .push(" AND t.removed_at IS NULL");
        if let Some(after) = after {
            sql.push(" AND t.item > ")
                .bind(Bind::Text(after.to_owned()));
        }
        if let Some(bound) = &bound {
            sql.push(" AND t.item <= ").bind(Bind::Text(bound.clone()));
        }
        driver(&mut sql, filter, unanswered);
        conditions(&mut sql, filter, unanswered, self.like());
        sql.push(" ORDER BY t.item LIMIT ")
            .bind(Bind::Int(i64::from(limit) + 1));
        let mut names: Vec<String> = sql
            .query()
            .fetch_all(self.store.pool())
            .await?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<_, _>>()?;
        let more = names.len() > limit as usize;
        names.truncate(limit as usize);
        // Every item up to the window's end was looked at: the next page starts after it.
        let next = if more { names.last().cloned() } else { bound };
        let items = self.items_named(run_id, &names, unanswered).await?;
        Ok(ItemPage { items, next })
    }

    /// The item of the task `window` places after item `after` in the run's index (live or
    /// not), or `None` when the run ends before: where a walk stops looking. Read from the
    /// index alone.
    async fn window_end(
        &self,
        run_id: &RunId,
        after: Option<&str>,
        window: u32,
    ) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT item FROM tasks WHERE run_id = $1 AND item > $2
             ORDER BY item LIMIT 1 OFFSET $3",
        )
        .bind(run_id)
        .bind(after.unwrap_or(""))
        .bind(i64::from(window))
        .fetch_optional(self.store.pool())
        .await?;
        Ok(row.map(|(item,)| item))
    }

    /// The items named (all their live tasks, outputs and earlier outputs), in that order.
    pub async fn items_named(
        &self,
        run_id: &RunId,
        names: &[String],
        unanswered: bool,
    ) -> Result<Vec<PageItem>, StoreError> {
        let mut items: Vec<PageItem> = names
            .iter()
            .map(|n| PageItem {
                item: n.clone(),
                tasks: Vec::new(),
            })
            .collect();
        let mut task_ids = Vec::new();
        for chunk in names.chunks(200) {
            for task in self.tasks_of(run_id, chunk, unanswered).await? {
                if let Some(item) = items.iter_mut().find(|i| i.item == task.task.item) {
                    task_ids.push(task.task.id);
                    item.tasks.push(task);
                }
            }
        }
        let output_ids: Vec<OutputId> = items
            .iter()
            .flat_map(|i| i.tasks.iter().flat_map(|t| t.outputs.iter().map(|o| o.id)))
            .collect();
        let mut checks = self.store.verdicts().of_outputs(&output_ids).await?;
        for task in items.iter_mut().flat_map(|i| i.tasks.iter_mut()) {
            for o in &task.outputs {
                if let Some(verdicts) = checks.remove(&o.id) {
                    task.checks.insert(o.id, verdicts);
                }
            }
        }
        let earlier = self.earlier_outputs(run_id, &task_ids).await?;
        for e in earlier {
            let task = items
                .iter_mut()
                .flat_map(|i| i.tasks.iter_mut())
                .find(|t| t.task.id == e.task_id);
            if let Some(task) = task {
                task.earlier.push(e);
            }
        }
        Ok(items)
    }

    /// The live tasks of the items `names`, by item then as recorded, each with its outputs.
    async fn tasks_of(
        &self,
        run_id: &RunId,
        names: &[String],
        unanswered: bool,
    ) -> Result<Vec<PageTask>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut sql = Sql::default();
        sql.push(
            "SELECT t.id, t.item, t.step, t.idx, t.operation, t.inputs, t.status,
                    t.planned_credits, t.credits_billed, t.job_id, t.error, t.request,
                    0 AS removed, r.run_id AS reused_run,
                    (SELECT COUNT(*) FROM attempts a WHERE a.task_id = t.id) AS attempts,
                    (SELECT COUNT(*) FROM attempts a WHERE a.task_id = t.id
                       AND (a.outcome = 'ambiguous' OR (a.outcome IS NULL AND ",
        )
        .bind(Bind::Bool(unanswered))
        .push(
            "))) AS possibly_billed,
                    o.id AS o_id, o.k, o.job_id AS o_job, o.path, o.sha256, o.download_error
             FROM tasks t
             LEFT JOIN tasks r ON r.id = t.reused_from
             LEFT JOIN outputs o ON o.task_id = t.id
             WHERE t.run_id = ",
        )
        .bind(Bind::Text(run_id.to_string()))
        .push(" AND t.removed_at IS NULL AND t.item IN (");
        sql.bind_texts(names);
        sql.push(") ORDER BY t.item, t.id, o.k");
        let rows = sql.query().fetch_all(self.store.pool()).await?;
        let mut tasks: Vec<PageTask> = Vec::new();
        for r in &rows {
            let id: crate::store::TaskId = r.try_get("id")?;
            if tasks.last().is_none_or(|t| t.task.id != id) {
                tasks.push(PageTask {
                    task: report_task(r)?,
                    outputs: Vec::new(),
                    earlier: Vec::new(),
                    possibly_billed: to_u64(r.try_get("possibly_billed")?),
                    checks: HashMap::new(),
                });
            }
            if let (Some(k), Some(task)) = (r.try_get::<Option<i64>, _>("k")?, tasks.last_mut()) {
                task.outputs.push(ReportOutput {
                    id: r.try_get("o_id")?,
                    k: u32::try_from(k).unwrap_or(0),
                    job_id: r.try_get("o_job")?,
                    place: place(r)?,
                    sha256: r.try_get("sha256")?,
                    download_error: r.try_get("download_error")?,
                });
            }
        }
        Ok(tasks)
    }

    /// The latest moment the run's record changed at, as its writers' clocks said it: a
    /// task's state or an output's download. Read from two indexes.
    pub async fn stamp(&self, run_id: &RunId) -> Result<i64, StoreError> {
        let (stamp,): (Option<i64>,) = sqlx::query_as(
            "SELECT MAX(s) FROM (
                 SELECT MAX(updated_at) AS s FROM tasks WHERE run_id = $1
                 UNION ALL
                 SELECT MAX(downloaded_at) AS s FROM outputs WHERE run_id = $1) AS both_stamps",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
        .await?;
        Ok(stamp.unwrap_or(0))
    }

    /// Up to `limit` items (by id) of run `run_id` with a task whose state changed, or an
    /// output downloaded, at `since` or after: what a page that follows the run asks again.
    /// Read from the `(run_id, updated_at)` and `(run_id, downloaded_at)` indexes.
    pub async fn changed_items(
        &self,
        run_id: &RunId,
        since: i64,
        limit: u32,
    ) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as(
            "SELECT item FROM (
                 SELECT t.item FROM tasks t WHERE t.run_id = $1 AND t.updated_at >= $2
                 UNION
                 SELECT t.item FROM outputs o JOIN tasks t ON t.id = o.task_id
                 WHERE o.run_id = $1 AND o.downloaded_at >= $2) AS changed
             ORDER BY item LIMIT $3",
        )
        .bind(run_id)
        .bind(since)
        .bind(i64::from(limit))
        .fetch_all(self.store.pool())
        .await?;
        Ok(rows.into_iter().map(|(i,)| i).collect())
    }

    /// Which of the items `names` have a live task matching `filter`.
    pub async fn matching(
        &self,
        run_id: &RunId,
        names: &[String],
        filter: &ItemFilter,
        unanswered: bool,
    ) -> Result<Vec<String>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut sql = Sql::default();
        sql.push("SELECT DISTINCT t.item FROM tasks t WHERE t.run_id = ")
            .bind(Bind::Text(run_id.to_string()))
            .push(" AND t.removed_at IS NULL AND t.item IN (");
        sql.bind_texts(names);
        sql.push(")");
        conditions(&mut sql, filter, unanswered, self.like());
        let rows = sql.query().fetch_all(self.store.pool()).await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>(0).map_err(StoreError::from))
            .collect()
    }

    /// How many of the run's outputs have a file or object: the count the store keeps
    /// (`run_totals.downloaded`), one row, never a count of the outputs.
    pub async fn images(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let n: Option<(i64,)> =
            sqlx::query_as("SELECT downloaded FROM run_totals WHERE run_id = $1")
                .bind(run_id)
                .fetch_optional(self.store.pool())
                .await?;
        Ok(n.map_or(0, |(n,)| to_u64(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_is_matched_anywhere_and_literally() {
        assert_eq!(contains_pattern("Mug"), "%Mug%");
        assert_eq!(contains_pattern("50%_a\\b"), "%50\\%\\_a\\\\b%");
    }
}
