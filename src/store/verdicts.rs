//! Checks' verdicts on stored outputs: one row per check and output, written once, with what
//! was done about it. A resume reads them and never checks an output again; `acted` tells it
//! a failure was already paid for again (or flagged, or failed its task), so it never acts on
//! one twice. The plan reads the pass rates of the same checks in earlier runs. A part of the
//! store ([`Store::verdicts`]).

use serde::Serialize;
use sqlx::Row;

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use crate::store::tasks::key_of;
use crate::store::{OutputId, Store, StoreError, TaskId, now_ms, rows, to_i64, to_u64};
use crate::task_key::TaskKey;

/// What a check said of one output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Passed,
    Failed,
    /// The check could not judge (a command that crashed, timed out or gave no verdict, an
    /// image that could not be read): not the image's fault, so nothing is paid again.
    NotChecked,
}

/// What was done about a failed (or unjudged) output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Set aside and its task paid for again.
    Rerolled,
    /// Kept and marked for a person to look at.
    Flagged,
    /// Its task failed.
    Failed,
}

macro_rules! column_words {
    ($ty:ident { $($variant:ident => $word:literal,)* }) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $word,)*
                }
            }

            pub fn parse(text: &str) -> Option<$ty> {
                match text {
                    $($word => Some($ty::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

column_words!(Outcome {
    Passed => "passed",
    Failed => "failed",
    NotChecked => "not_checked",
});

column_words!(Action {
    Rerolled => "rerolled",
    Flagged => "flagged",
    Failed => "failed",
});

/// One check's verdict on one output, as recorded.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VerdictRow {
    pub output_id: OutputId,
    /// The job that made the output: with its id, what names one output for good (SQLite
    /// gives a new output the id of one deleted).
    pub job_id: JobId,
    pub task_id: TaskId,
    /// The check's place in its step's `checks:` list.
    pub position: u32,
    /// The step and its checks as written: what pass rates are read by.
    pub checks_key: String,
    /// The check's name as the pipeline file writes it.
    pub check: String,
    pub outcome: Outcome,
    pub score: Option<f64>,
    pub reason: String,
    /// What was done about it; `None` before anything was, and for a pass.
    pub acted: Option<Action>,
}

/// The rerolls checks asked for of one task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRerolls {
    pub task: TaskKey,
    pub count: u32,
    /// What they were planned at, in all.
    pub credits: u64,
}

/// How often tasks passed the same checks before: judgements of a task (every output one job
/// of it made), and those in which an output failed. A reroll pays for the whole task, so a
/// generation of two images fails as one when either does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassRate {
    pub judged: u64,
    pub failed: u64,
}

const COLUMNS: &str =
    "output_id, job_id, task_id, position, checks_key, check_name, verdict, score, reason, acted";

/// Rows a statement writes (12 values a row: under SQLite's and PostgreSQL's limits).
const PER_STATEMENT: usize = 200;

impl Store {
    /// Checks' verdicts on the run's outputs.
    pub fn verdicts(&self) -> Verdicts<'_> {
        Verdicts { store: self }
    }
}

/// Checks' verdicts on stored outputs.
#[derive(Clone, Copy, Debug)]
pub struct Verdicts<'a> {
    pub(super) store: &'a Store,
}

fn verdict_row(r: &sqlx::any::AnyRow) -> Result<VerdictRow, StoreError> {
    let word = |c: &str| -> Result<String, StoreError> { Ok(r.try_get::<String, _>(c)?) };
    let verdict = word("verdict")?;
    let outcome = Outcome::parse(&verdict)
        .ok_or_else(|| StoreError::Inconsistent(format!("a check's verdict is {verdict:?}")))?;
    let acted =
        match r.try_get::<Option<String>, _>("acted")? {
            None => None,
            Some(a) => Some(Action::parse(&a).ok_or_else(|| {
                StoreError::Inconsistent(format!("a verdict was acted on as {a:?}"))
            })?),
        };
    Ok(VerdictRow {
        output_id: r.try_get("output_id")?,
        job_id: JobId::from(word("job_id")?),
        task_id: r.try_get("task_id")?,
        position: u32::try_from(to_u64(r.try_get("position")?)).unwrap_or(u32::MAX),
        checks_key: word("checks_key")?,
        check: word("check_name")?,
        outcome,
        score: r.try_get("score")?,
        reason: word("reason")?,
        acted,
    })
}

impl Verdicts<'_> {
    /// Records verdicts; one already recorded for the same output and check is kept as it was
    /// (a verdict is written once).
    pub async fn record(&self, run_id: &RunId, verdicts: &[VerdictRow]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        insert(&mut tx, self.store.backend(), run_id, verdicts).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The verdicts on the run's outputs, by task, output and place.
    pub async fn of_run(&self, run_id: &RunId) -> Result<Vec<VerdictRow>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM check_verdicts WHERE run_id = $1
             ORDER BY task_id, output_id, position"
        );
        // A fixed text: no value is ever part of it.
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .fetch_all(self.store.pool())
            .await?
            .iter()
            .map(verdict_row)
            .collect()
    }

    /// The rerolls the checks asked for in run `run_id`, by task: how many, and what they were
    /// planned at in all. A row per rerolled task: few, whatever the run's size.
    pub async fn rerolls(&self, run_id: &RunId) -> Result<Vec<TaskRerolls>, StoreError> {
        sqlx::query(
            "SELECT t.item AS item, t.step AS step, t.idx AS idx, COUNT(*) AS n,
                    CAST(COALESCE(SUM(r.credits), 0) AS BIGINT) AS credits
             FROM check_rerolls r JOIN tasks t ON t.id = r.task_id
             WHERE r.run_id = $1 GROUP BY t.item, t.step, t.idx",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?
        .iter()
        .map(|r| {
            Ok(TaskRerolls {
                task: key_of(r)?,
                count: u32::try_from(to_u64(r.try_get("n")?)).unwrap_or(u32::MAX),
                credits: to_u64(r.try_get("credits")?),
            })
        })
        .collect()
    }

    /// The tasks of steps `steps` that succeeded with an output no check judged yet (a process
    /// killed between a call's answer and its verdicts): a resume judges them before anything
    /// reads them.
    pub async fn unjudged(
        &self,
        run_id: &RunId,
        steps: &[&str],
    ) -> Result<Vec<(TaskId, TaskKey)>, StoreError> {
        let mut out = Vec::new();
        for step in steps {
            let rows = sqlx::query(
                "SELECT DISTINCT t.id AS id, t.item AS item, t.step AS step, t.idx AS idx
                 FROM tasks t JOIN outputs o ON o.task_id = t.id
                 WHERE t.run_id = $1 AND t.step = $2 AND t.status = 'succeeded'
                   AND t.removed_at IS NULL
                   AND NOT EXISTS (SELECT 1 FROM check_verdicts v
                                   WHERE v.output_id = o.id AND v.job_id = o.job_id)",
            )
            .bind(run_id)
            .bind(*step)
            .fetch_all(self.store.pool())
            .await?;
            for r in &rows {
                out.push((r.try_get("id")?, key_of(r)?));
            }
        }
        Ok(out)
    }

    /// The checks that failed output `k` of task `task` as it is now (the output its current
    /// job made), each named once. Read for a tool whose own output failed: an input kept with
    /// a failure (flagged) passes it on, and a call made again from it would not mend it.
    pub async fn failed_on(&self, task: TaskId, k: u32) -> Result<Vec<String>, StoreError> {
        sqlx::query(
            "SELECT DISTINCT v.check_name AS name FROM outputs o
             JOIN check_verdicts v ON v.output_id = o.id AND v.job_id = o.job_id
             WHERE o.task_id = $1 AND o.k = $2 AND v.verdict = 'failed'",
        )
        .bind(task)
        .bind(i64::from(k))
        .fetch_all(self.store.pool())
        .await?
        .iter()
        .map(|r| Ok(r.try_get("name")?))
        .collect()
    }

    /// The run's tasks a check failed (`on_fail: fail`) and that are still failed: a resume
    /// leaves them so, since paying for them again would act on a verdict twice.
    pub async fn failed_tasks(&self, run_id: &RunId) -> Result<Vec<TaskId>, StoreError> {
        sqlx::query(
            "SELECT DISTINCT v.task_id AS id FROM check_verdicts v JOIN tasks t ON t.id = v.task_id
             WHERE v.run_id = $1 AND v.acted = 'failed' AND t.status = 'failed'
               AND t.job_id = v.job_id",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?
        .iter()
        .map(|r| Ok(r.try_get("id")?))
        .collect()
    }

    /// How often tasks judged by the checks named `checks_key` had an output fail one, over
    /// every run; `None` when nothing was judged by them yet. A judgement with an output that
    /// could not be judged and none failed is left out: it says nothing of how often images
    /// pass.
    pub async fn pass_rate(&self, checks_key: &str) -> Result<Option<PassRate>, StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS judged,
                    COALESCE(SUM(CASE WHEN failed > 0 THEN 1 ELSE 0 END), 0) AS failed
             FROM (SELECT task_id, job_id,
                          SUM(CASE WHEN verdict = 'failed' THEN 1 ELSE 0 END) AS failed,
                          SUM(CASE WHEN verdict = 'not_checked' THEN 1 ELSE 0 END) AS unjudged
                   FROM check_verdicts WHERE checks_key = $1
                   GROUP BY task_id, job_id) AS judgements
             WHERE failed > 0 OR unjudged = 0",
        )
        .bind(checks_key)
        .fetch_one(self.store.pool())
        .await?;
        let judged = to_u64(row.try_get("judged")?);
        let failed = to_u64(row.try_get("failed")?);
        Ok((judged > 0).then_some(PassRate { judged, failed }))
    }
}

/// Writes `verdicts` in the transaction of `conn`; one already recorded for the same output
/// and check is kept as it was.
pub(super) async fn insert(
    conn: &mut sqlx::AnyConnection,
    backend: crate::store::Backend,
    run_id: &RunId,
    verdicts: &[VerdictRow],
) -> Result<(), StoreError> {
    let now = now_ms();
    for chunk in verdicts.chunks(PER_STATEMENT) {
        // The score goes as text: sqlx's Any driver binds a missing `f64` as PostgreSQL's
        // `float4`, and the statement then prepared refuses the next score's eight bytes.
        let values = rows(backend, chunk.len(), 12, |p| {
            let mut p = p.to_vec();
            p[9] = format!("CAST({} AS DOUBLE PRECISION)", p[9]);
            format!("({})", p.join(", "))
        });
        let sql = format!(
            "INSERT INTO check_verdicts (run_id, checked_at, {COLUMNS}) VALUES {values}
             ON CONFLICT (output_id, job_id, position) DO NOTHING"
        );
        // Built from a fixed placeholder list: no value is ever part of the text.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for v in chunk {
            query = query
                .bind(run_id)
                .bind(now)
                .bind(v.output_id)
                .bind(&v.job_id)
                .bind(v.task_id)
                .bind(to_i64(u64::from(v.position)))
                .bind(&v.checks_key)
                .bind(&v.check)
                .bind(v.outcome.as_str())
                .bind(v.score.map(|s| s.to_string()))
                .bind(&v.reason)
                .bind(v.acted.map(Action::as_str));
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Location;

    fn verdict(output: i64, position: u32, outcome: Outcome) -> VerdictRow {
        VerdictRow {
            output_id: OutputId::new(output).unwrap(),
            job_id: JobId::from(format!("job-{output}")),
            task_id: TaskId::new(output * 10).unwrap(),
            position,
            checks_key: "shots/cutout:not_blank,transparent".into(),
            check: if position == 0 {
                "not_blank"
            } else {
                "transparent"
            }
            .into(),
            outcome,
            score: (outcome != Outcome::NotChecked).then_some(0.25),
            reason: format!("{} said so", outcome.as_str()),
            acted: None,
        }
    }

    async fn verdicts_are_written_once_with_what_was_done(store: &Store) {
        let run: RunId = "run-a".into();
        let v = store.verdicts();
        let rerolled = VerdictRow {
            acted: Some(Action::Rerolled),
            ..verdict(1, 1, Outcome::Failed)
        };
        let first = [
            verdict(1, 0, Outcome::Passed),
            rerolled,
            verdict(2, 0, Outcome::Passed),
            verdict(2, 1, Outcome::Passed),
            verdict(3, 0, Outcome::NotChecked),
            verdict(3, 1, Outcome::Passed),
        ];
        v.record(&run, &first).await.unwrap();
        // A resume that judged again would not change what was recorded.
        v.record(&run, &[verdict(1, 1, Outcome::Passed)])
            .await
            .unwrap();
        // A new output given a deleted one's id is another output: its verdicts are its own.
        let successor = VerdictRow {
            job_id: JobId::from("job-1-again".to_owned()),
            ..verdict(1, 1, Outcome::Passed)
        };
        v.record(&run, &[successor]).await.unwrap();
        let rows = v.of_run(&run).await.unwrap();
        assert_eq!(rows.len(), 7);
        assert_eq!(
            (rows[1].outcome, rows[1].acted),
            (Outcome::Failed, Some(Action::Rerolled))
        );
        assert_eq!(rows[1].score, Some(0.25));
        assert_eq!(rows[1].reason, "failed said so");
        assert_eq!(rows[0].acted, None, "a pass is not acted on");
        assert_eq!(
            (rows[2].job_id.as_str(), rows[2].outcome),
            ("job-1-again", Outcome::Passed)
        );
        assert_eq!(
            (rows[5].outcome, rows[5].score),
            (Outcome::NotChecked, None)
        );
        let rate = v
            .pass_rate("shots/cutout:not_blank,transparent")
            .await
            .unwrap();
        assert_eq!(
            rate,
            Some(PassRate {
                judged: 3,
                failed: 1
            }),
            "output 3 was not judged"
        );
        assert_eq!(v.pass_rate("other").await.unwrap(), None);
        // A generation of two images, one a copy of the other: the task failed once, and a
        // reroll pays for both images.
        let shot = |output, outcome| VerdictRow {
            job_id: JobId::from("job-shot".to_owned()),
            task_id: TaskId::new(40).unwrap(),
            checks_key: "shots/shot:distinct".into(),
            ..verdict(output, 0, outcome)
        };
        v.record(&run, &[shot(4, Outcome::Passed), shot(5, Outcome::Failed)])
            .await
            .unwrap();
        assert_eq!(
            v.pass_rate("shots/shot:distinct").await.unwrap(),
            Some(PassRate {
                judged: 1,
                failed: 1
            }),
            "one judgement of one task, failed"
        );
        let other: RunId = "run-b".into();
        assert!(v.of_run(&other).await.unwrap().is_empty());
        // One statement of one row without a score, then the same statement with one.
        let third: RunId = "run-c".into();
        v.record(&third, &[verdict(4, 0, Outcome::NotChecked)])
            .await
            .unwrap();
        v.record(&third, &[verdict(5, 0, Outcome::Failed)])
            .await
            .unwrap();
        let scores: Vec<Option<f64>> = v
            .of_run(&third)
            .await
            .unwrap()
            .iter()
            .map(|r| r.score)
            .collect();
        assert_eq!(scores, [None, Some(0.25)]);
    }

    #[tokio::test]
    async fn verdicts_are_written_once_with_what_was_done_on_sqlite_and_postgres() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state.db")).await.unwrap();
        verdicts_are_written_once_with_what_was_done(&store).await;
        store.close().await;
        let Some(url) = crate::store::test_postgres::database("verdicts").await else {
            return;
        };
        let store = Store::open_at(&Location::Postgres((*url).clone()))
            .await
            .unwrap();
        verdicts_are_written_once_with_what_was_done(&store).await;
        store.close().await;
    }
}
