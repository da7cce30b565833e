//! The ledger's part of the store (`store.ledger()`): what was billed, read as calls and their
//! credits by when they were sent, by run or by a run's step, and what each run planned.
//! Folding them into days, weeks, months or pipelines is the `ledger` module's (above the store).
//!
//! Credits are counted exactly as [`Runs::totals`](crate::store::Runs::totals) counts them for `runs` and `status`:
//! billed is what the service said each call cost; possibly billed is the planned price of
//! each call sent without a complete answer (`ambiguous`, or no outcome: in flight or its
//! process died). The one index is `attempts_by_start` (`attempts(started_at)`). SQLite's
//! plan for a window (`EXPLAIN QUERY PLAN` of [`Ledger::calls_by_quarter`]):
//!
//! ```text
//! SEARCH a USING INDEX attempts_by_start (started_at>? AND started_at<?)
//! USE TEMP B-TREE FOR GROUP BY
//! CORRELATED SCALAR SUBQUERY 1
//!   SEARCH t USING INTEGER PRIMARY KEY (rowid=?)
//! ```
//!
//! Without a window it is `SCAN a`: every attempt read once, in 0.5 s for 2,000,000. The
//! task's price is looked up only for the rare call that may have been billed.

use crate::run_id::RunId;
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::store::to_u64;
use crate::store::{RecordedPlan, Store, StoreError};

/// Calls are counted per quarter of an hour (unix milliseconds): every time zone's offset is a
/// whole number of them, so the counts fold into any calendar's days exactly, and a year of
/// history is at most 35,040 rows.
pub const QUARTER_MS: i64 = 900_000;

/// A span of time, `[since, until)` in unix milliseconds; an absent end is open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub since: Option<i64>,
    pub until: Option<i64>,
}

impl Window {
    /// `column` within the window, as SQL; the bounds are integers, never text from a user.
    fn sql(self, column: &str) -> String {
        let since = self.since.map(|s| format!(" AND {column} >= {s}"));
        let until = self.until.map(|u| format!(" AND {column} < {u}"));
        format!(
            "1 = 1{}{}",
            since.unwrap_or_default(),
            until.unwrap_or_default()
        )
    }
}

/// What the calls of one group did and cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    /// Attempts recorded: each HTTP try of a paid call, retries included.
    pub calls: u64,
    /// Attempts that brought no result: answered with an error, never sent, or cut.
    pub failures: u64,
    pub billed_credits: u64,
    /// Attempts sent without a complete answer, in flight or cut.
    pub possibly_billed_calls: u64,
    /// Their planned price: what they may have cost.
    pub possibly_billed_credits: u64,
}

impl Calls {
    pub fn add(&mut self, other: &Calls) {
        self.calls += other.calls;
        self.failures += other.failures;
        self.billed_credits += other.billed_credits;
        self.possibly_billed_calls += other.possibly_billed_calls;
        self.possibly_billed_credits += other.possibly_billed_credits;
    }
}

/// The calls sent in one quarter of an hour, which starts at `quarter` (unix milliseconds).
#[derive(Clone, Debug)]
pub struct CallsAt {
    pub quarter: i64,
    pub calls: Calls,
}

/// The calls of one run, or of one step of it.
#[derive(Clone, Debug)]
pub struct CallsOf {
    pub run_id: RunId,
    pub step: Option<String>,
    pub calls: Calls,
}

/// What one run planned, counted the way `runs` counts it.
#[derive(Clone, Debug)]
pub struct RunPlanned {
    pub run_id: RunId,
    pub pipeline: String,
    pub created_at: i64,
    /// The larger of the plan's total and the recorded tasks' (a run records an item's tasks
    /// only as it reaches the item; `--allow-changes` may have added some).
    pub credits_planned: u64,
}

/// One step's recorded tasks of a run (not those `--allow-changes` removed).
#[derive(Clone, Debug)]
pub struct StepPlanned {
    pub run_id: RunId,
    pub step: String,
    pub tasks: u64,
    pub planned_credits: u64,
}

/// The aggregate columns of [`Calls`], over `attempts a`.
const CALL_COLUMNS: &str = "COUNT(*) AS calls,
     COUNT(*) FILTER (WHERE a.outcome <> 'succeeded') AS failures,
     CAST(COALESCE(SUM(a.credits_billed), 0) AS BIGINT) AS billed,
     COUNT(*) FILTER (WHERE a.outcome IS NULL OR a.outcome = 'ambiguous') AS possibly_calls,
     CAST(COALESCE(SUM(CASE WHEN a.outcome IS NULL OR a.outcome = 'ambiguous'
         THEN (SELECT t.planned_credits FROM tasks t WHERE t.id = a.task_id)
         ELSE 0 END), 0) AS BIGINT) AS possibly";

fn calls(row: &AnyRow) -> Result<Calls, StoreError> {
    let n = |c: &str| -> Result<u64, StoreError> { Ok(to_u64(row.try_get::<i64, _>(c)?)) };
    Ok(Calls {
        calls: n("calls")?,
        failures: n("failures")?,
        billed_credits: n("billed")?,
        possibly_billed_calls: n("possibly_calls")?,
        possibly_billed_credits: n("possibly")?,
    })
}

impl Store {
    /// The ledger: what was billed, and what runs planned.
    pub fn ledger(&self) -> Ledger<'_> {
        Ledger { store: self }
    }
}

/// The store's reads for the ledger: calls, credits and plans, never written here (attempts
/// are written by the executor's parts of the store).
pub struct Ledger<'a> {
    store: &'a Store,
}

impl Ledger<'_> {
    /// The calls sent within `window`, per quarter of an hour.
    pub async fn calls_by_quarter(&self, window: Window) -> Result<Vec<CallsAt>, StoreError> {
        let sql = format!(
            "SELECT a.started_at / {QUARTER_MS} AS quarter, {CALL_COLUMNS}
             FROM attempts a WHERE {} GROUP BY quarter",
            window.sql("a.started_at")
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok(CallsAt {
                    quarter: r.try_get::<i64, _>("quarter")? * QUARTER_MS,
                    calls: calls(r)?,
                })
            })
            .collect()
    }

    /// The calls sent within `window`, per run, or per run and step when `by_step`.
    pub async fn calls_by_run(
        &self,
        window: Window,
        by_step: bool,
    ) -> Result<Vec<CallsOf>, StoreError> {
        let (step, join, group) = if by_step {
            ("t2.step", "JOIN tasks t2 ON t2.id = a.task_id", ", t2.step")
        } else {
            ("CAST(NULL AS TEXT)", "", "")
        };
        let sql = format!(
            "SELECT a.run_id, {step} AS step, {CALL_COLUMNS}
             FROM attempts a {join} WHERE {} GROUP BY a.run_id{group}",
            window.sql("a.started_at")
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok(CallsOf {
                    run_id: RunId::from(r.try_get::<String, _>("run_id")?),
                    step: r.try_get("step")?,
                    calls: calls(r)?,
                })
            })
            .collect()
    }

    /// Every run: its pipeline and start (calls of a window may belong to a run started
    /// before it), and its planned credits.
    pub async fn runs_planned(&self) -> Result<Vec<RunPlanned>, StoreError> {
        let rows = sqlx::query(
            "SELECT r.id, r.pipeline_name, r.created_at, r.credits_planned,
                    CAST(COALESCE((SELECT SUM(t.planned_credits) FROM tasks t
                         WHERE t.run_id = r.id AND t.removed_at IS NULL), 0) AS BIGINT)
                        AS recorded
             FROM runs r",
        )
        .fetch_all(self.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let planned = to_u64(r.try_get("credits_planned")?);
                let recorded = to_u64(r.try_get("recorded")?);
                Ok(RunPlanned {
                    run_id: RunId::from(r.try_get::<String, _>("id")?),
                    pipeline: r.try_get("pipeline_name")?,
                    created_at: r.try_get("created_at")?,
                    credits_planned: planned.max(recorded),
                })
            })
            .collect()
    }

    /// The recorded tasks of the runs started within `window`, per run and step, with each
    /// such run's plan document (for the tasks it has not recorded yet).
    pub async fn steps_planned(
        &self,
        window: Window,
    ) -> Result<(Vec<StepPlanned>, Vec<(RunId, RecordedPlan)>), StoreError> {
        let runs = format!("SELECT id FROM runs WHERE {}", window.sql("created_at"));
        let sql = format!(
            "SELECT t.run_id, t.step, COUNT(*) AS tasks,
                    CAST(COALESCE(SUM(t.planned_credits), 0) AS BIGINT) AS planned
             FROM tasks t WHERE t.removed_at IS NULL AND t.run_id IN ({runs})
             GROUP BY t.run_id, t.step"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await?;
        let steps = rows
            .iter()
            .map(|r| {
                Ok(StepPlanned {
                    run_id: RunId::from(r.try_get::<String, _>("run_id")?),
                    step: r.try_get("step")?,
                    tasks: to_u64(r.try_get("tasks")?),
                    planned_credits: to_u64(r.try_get("planned")?),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let plans = format!(
            "SELECT id, plan_json FROM runs WHERE {}",
            window.sql("created_at")
        );
        let plans: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(plans))
            .fetch_all(self.store.pool())
            .await?;
        let plans = plans
            .into_iter()
            .map(|(id, plan)| (RunId::from(id), RecordedPlan::from_record(plan)))
            .collect();
        Ok((steps, plans))
    }
}
