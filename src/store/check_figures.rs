//! What checks did in a run, as `status`, the report, the desk, the metrics and `run.finished`
//! show it: counts summed by the database, the first few flagged outputs, and the verdicts of
//! the outputs a page shows. Nothing here reads a row per output of the run. A part of the
//! store ([`Store::verdicts`]).

use std::collections::HashMap;

use serde::Serialize;
use sqlx::Row;

use crate::run_id::RunId;
use crate::store::tasks::key_of;
use crate::store::verdicts::{Action, Outcome, Verdicts};
use crate::store::{OutputId, StoreError, to_u64};
use crate::task_key::TaskKey;

/// A run's checks summed up: verdicts (one per check and output) by what they said, the
/// outputs kept flagged for a person, and the rerolls paid for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CheckCounts {
    pub passed: u64,
    pub failed: u64,
    pub not_checked: u64,
    /// Outputs kept and flagged: a check failed them, or could not judge them.
    pub flagged: u64,
    /// Tasks paid for again because a check failed their outputs.
    pub rerolls: u64,
    /// What those rerolls were planned at, in all.
    pub reroll_credits: u64,
}

impl CheckCounts {
    /// Whether the run judged or rerolled anything.
    pub fn any(&self) -> bool {
        self.passed + self.failed + self.not_checked + self.rerolls > 0
    }
}

/// One check's verdict on an output, as shown beside it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShownVerdict {
    pub check: String,
    pub verdict: Outcome,
    pub score: Option<f64>,
    pub reason: String,
    pub acted: Option<Action>,
}

/// A flagged output and its checks' verdicts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlaggedOutput {
    pub task: TaskKey,
    /// The output's place among its task's outputs.
    pub output: u32,
    pub checks: Vec<ShownVerdict>,
}

fn shown(r: &sqlx::any::AnyRow) -> Result<ShownVerdict, StoreError> {
    let verdict: String = r.try_get("verdict")?;
    let acted: Option<String> = r.try_get("acted")?;
    let inconsistent = |what: &str| StoreError::Inconsistent(format!("a check's {what}"));
    Ok(ShownVerdict {
        check: r.try_get("check_name")?,
        verdict: Outcome::parse(&verdict).ok_or_else(|| inconsistent("verdict"))?,
        score: r.try_get("score")?,
        reason: r.try_get("reason")?,
        acted: match acted {
            None => None,
            Some(a) => Some(Action::parse(&a).ok_or_else(|| inconsistent("action"))?),
        },
    })
}

/// Outputs whose verdicts one statement reads (one placeholder each).
const PER_STATEMENT: usize = 500;

impl Verdicts<'_> {
    /// The run's checks summed up by the database: two rows, whatever the run's size.
    pub async fn counts(&self, run_id: &RunId) -> Result<CheckCounts, StoreError> {
        let row = sqlx::query(
            "SELECT COALESCE(SUM(CASE WHEN verdict = 'passed' THEN 1 ELSE 0 END), 0) AS passed,
                    COALESCE(SUM(CASE WHEN verdict = 'failed' THEN 1 ELSE 0 END), 0) AS failed,
                    COALESCE(SUM(CASE WHEN verdict = 'not_checked' THEN 1 ELSE 0 END), 0)
                        AS not_checked,
                    COUNT(DISTINCT CASE WHEN acted = 'flagged'
                        THEN job_id || ':' || CAST(output_id AS TEXT) END) AS flagged
             FROM check_verdicts WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
        .await?;
        let rerolls = sqlx::query(
            "SELECT COUNT(*) AS n, CAST(COALESCE(SUM(credits), 0) AS BIGINT) AS credits
             FROM check_rerolls WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
        .await?;
        let n = |r: &sqlx::any::AnyRow, c: &str| -> Result<u64, StoreError> {
            Ok(to_u64(r.try_get::<i64, _>(c)?))
        };
        Ok(CheckCounts {
            passed: n(&row, "passed")?,
            failed: n(&row, "failed")?,
            not_checked: n(&row, "not_checked")?,
            flagged: n(&row, "flagged")?,
            rerolls: n(&rerolls, "n")?,
            reroll_credits: n(&rerolls, "credits")?,
        })
    }

    /// The run's first `limit` flagged outputs (in the order of their tasks), each with all
    /// its verdicts ([`CheckCounts::flagged`] counts them all): read from the index of what was
    /// done about verdicts, never the run's other outputs.
    pub async fn flagged(
        &self,
        run_id: &RunId,
        limit: u32,
    ) -> Result<Vec<FlaggedOutput>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.item, t.step, t.idx, o.k, v.output_id, v.check_name, v.verdict, v.score,
                    v.reason, v.acted
             FROM check_verdicts v JOIN tasks t ON t.id = v.task_id
               JOIN outputs o ON o.id = v.output_id AND o.job_id = v.job_id
             WHERE v.output_id IN (
                 SELECT output_id FROM (
                     SELECT DISTINCT task_id, output_id FROM check_verdicts
                     WHERE run_id = $1 AND acted = 'flagged'
                     ORDER BY task_id, output_id LIMIT $2) AS first_flagged)
             ORDER BY v.task_id, v.output_id, v.position",
        )
        .bind(run_id)
        .bind(i64::from(limit))
        .fetch_all(self.store.pool())
        .await?;
        let mut outputs: Vec<FlaggedOutput> = Vec::new();
        let mut last: Option<OutputId> = None;
        for r in &rows {
            let id: OutputId = r.try_get("output_id")?;
            if last != Some(id) {
                last = Some(id);
                outputs.push(FlaggedOutput {
                    task: key_of(r)?,
                    output: u32::try_from(to_u64(r.try_get("k")?)).unwrap_or(u32::MAX),
                    checks: Vec::new(),
                });
            }
            if let Some(o) = outputs.last_mut() {
                o.checks.push(shown(r)?);
            }
        }
        Ok(outputs)
    }

    /// The verdicts on outputs `ids` (those a page shows), by output, each in its check's place.
    pub async fn of_outputs(
        &self,
        ids: &[OutputId],
    ) -> Result<HashMap<OutputId, Vec<ShownVerdict>>, StoreError> {
        let mut by_output: HashMap<OutputId, Vec<ShownVerdict>> = HashMap::new();
        for chunk in ids.chunks(PER_STATEMENT) {
            let marks: Vec<String> = (1..=chunk.len()).map(|n| format!("${n}")).collect();
            let sql = format!(
                "SELECT v.output_id, v.check_name, v.verdict, v.score, v.reason, v.acted
                 FROM check_verdicts v JOIN outputs o ON o.id = v.output_id AND o.job_id = v.job_id
                 WHERE v.output_id IN ({}) ORDER BY v.output_id, v.position",
                marks.join(", ")
            );
            // Built from numbered placeholders: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(*id);
            }
            for r in query.fetch_all(self.store.pool()).await? {
                let id: OutputId = r.try_get("output_id")?;
                by_output.entry(id).or_default().push(shown(&r)?);
            }
        }
        Ok(by_output)
    }
}
