//! Attempts: one row per paid call, its intent written before the call is sent and its
//! result right after, each in its own (group) commit. A part of the store
//! ([`Store::attempts`]).

use crate::api::job_id::JobId;
use crate::run_id::RunId;
use crate::store::group::Written;
use crate::store::to_i64;
use crate::store::{AttemptId, Backend, OutputId, Store, StoreError, TaskId, now_ms};

/// How a paid call ended, as its attempt records it (`attempts.outcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallOutcome {
    Succeeded,
    /// The service answered an error: nothing billed.
    AnsweredError,
    /// Never reached the service.
    NotSent,
    /// Sent, no complete answer: possibly billed.
    Ambiguous,
}

impl CallOutcome {
    /// Every outcome, in the order the metrics list them.
    pub const ALL: [CallOutcome; 4] = [
        CallOutcome::Succeeded,
        CallOutcome::AnsweredError,
        CallOutcome::NotSent,
        CallOutcome::Ambiguous,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Succeeded => "succeeded",
            CallOutcome::AnsweredError => "answered_error",
            CallOutcome::NotSent => "not_sent",
            CallOutcome::Ambiguous => "ambiguous",
        }
    }

    /// The outcome a record names; an unknown word is read as ambiguous, the outcome that
    /// assumes the least (the call may have been billed).
    pub(crate) fn parse(s: &str) -> CallOutcome {
        match s {
            "succeeded" => CallOutcome::Succeeded,
            "answered_error" => CallOutcome::AnsweredError,
            "not_sent" => CallOutcome::NotSent,
            _ => CallOutcome::Ambiguous,
        }
    }
}

impl std::fmt::Display for CallOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A paid call that came back with its job.
pub struct Settled<'a> {
    pub job_id: &'a JobId,
    pub credits_used: u64,
    pub credits_remaining: Option<i64>,
    /// The result URLs, in output order.
    pub urls: &'a [String],
    /// The job whose output was this call's input, for the lineage.
    pub parent_job_id: Option<&'a JobId>,
    /// A note kept with the attempt, e.g. that the answer was recovered by job id.
    pub note: Option<&'a str>,
}

impl AttemptOutcome<'_> {
    /// The outcome this result records.
    pub fn outcome(&self) -> CallOutcome {
        match self {
            AttemptOutcome::Succeeded(_) => CallOutcome::Succeeded,
            AttemptOutcome::Answered { .. } => CallOutcome::AnsweredError,
            AttemptOutcome::NotSent { .. } => CallOutcome::NotSent,
            AttemptOutcome::Ambiguous { .. } => CallOutcome::Ambiguous,
        }
    }
}

pub enum AttemptOutcome<'a> {
    Succeeded(Settled<'a>),
    /// The service answered an error: nothing billed.
    Answered {
        status: u16,
        error: &'a str,
    },
    /// Never reached the service.
    NotSent {
        error: &'a str,
    },
    /// Sent, no complete answer: possibly billed. The job id when the partial answer named one.
    Ambiguous {
        error: &'a str,
        job_id: Option<&'a str>,
    },
}

/// The statements that record an attempt's outcome and, for a success, settle its task and
/// record its `outputs` (returning each one's `k` and id). A task that runs again (its first job
/// fell short) replaces its outputs' records whole: the old job's file facts must not stick to
/// the new job.
///
/// Parameters: $1 now, $2 outcome, $3 HTTP status, $4 credits, $5 credits remaining, $6 job id,
/// $7 error, $8 attempt id; with a success, $9 task id, $10 run id, $11 parent job id, and one
/// URL each from $12. SQLite runs the statements as one batch; PostgreSQL takes one statement
/// per round trip, so there the updates are data-modifying parts of the insert.
fn settle_sql(backend: Backend, succeeded: bool, outputs: usize) -> String {
    let attempt = "UPDATE attempts SET finished_at = $1, outcome = $2, http_status = $3,
             credits_billed = $4, credits_remaining = $5, job_id = $6, error = $7
         WHERE id = $8";
    if !succeeded {
        return attempt.to_owned();
    }
    let task = "UPDATE tasks SET status = 'succeeded', job_id = $6, error = NULL,
             credits_billed = credits_billed + $4, updated_at = $1
         WHERE id = $9";
    let values: Vec<String> = (0..outputs)
        .map(|k| format!("($9, $10, {k}, $6, $11, ${}, $1)", 12 + k))
        .collect();
    let insert = format!(
        "INSERT INTO outputs (task_id, run_id, k, job_id, parent_job_id, url, url_issued_at)
         VALUES {}
         ON CONFLICT (task_id, k) DO UPDATE SET job_id = excluded.job_id,
             parent_job_id = excluded.parent_job_id, url = excluded.url,
             url_issued_at = excluded.url_issued_at, path = NULL,
             sha256 = NULL, bytes = NULL, downloaded_at = NULL,
             download_error = NULL
         RETURNING k, id",
        values.join(", ")
    );
    match (backend, outputs) {
        (Backend::Sqlite, 0) => format!("{attempt}; {task}"),
        (Backend::Sqlite, _) => format!("{attempt}; {task}; {insert}"),
        (Backend::Postgres, 0) => format!("WITH a AS ({attempt}) {task}"),
        (Backend::Postgres, _) => format!("WITH a AS ({attempt}), t AS ({task}) {insert}"),
    }
}

/// The columns an attempt's result fills in (`attempts`), decided from the outcome alone.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AttemptResult {
    outcome: CallOutcome,
    http_status: Option<i64>,
    credits: i64,
    remaining: Option<i64>,
    job_id: Option<JobId>,
    error: Option<String>,
}

impl AttemptResult {
    fn of(outcome: &AttemptOutcome<'_>) -> AttemptResult {
        let owned = |v: Option<&str>| v.map(str::to_owned);
        let failed = |error: &str| AttemptResult {
            outcome: outcome.outcome(),
            http_status: None,
            credits: 0,
            remaining: None,
            job_id: None,
            error: Some(error.to_owned()),
        };
        match outcome {
            AttemptOutcome::Succeeded(s) => AttemptResult {
                outcome: CallOutcome::Succeeded,
                http_status: None,
                credits: to_i64(s.credits_used),
                remaining: s.credits_remaining,
                job_id: Some(s.job_id.clone()),
                error: owned(s.note),
            },
            AttemptOutcome::Answered { status, error } => AttemptResult {
                http_status: Some(i64::from(*status)),
                ..failed(error)
            },
            AttemptOutcome::NotSent { error } => failed(error),
            AttemptOutcome::Ambiguous { error, job_id } => AttemptResult {
                job_id: job_id.map(JobId::from),
                ..failed(error)
            },
        }
    }
}

/// What a successful attempt settles beside itself: its task, and the outputs' URLs.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settlement {
    task_id: TaskId,
    run_id: RunId,
    parent_job_id: Option<JobId>,
    urls: Vec<String>,
}

impl Settlement {
    fn of(outcome: &AttemptOutcome<'_>, task_id: TaskId, run_id: &RunId) -> Option<Settlement> {
        match outcome {
            AttemptOutcome::Succeeded(s) => Some(Settlement {
                task_id,
                run_id: run_id.to_owned(),
                parent_job_id: s.parent_job_id.cloned(),
                urls: s.urls.to_vec(),
            }),
            _ => None,
        }
    }
}

/// Writes an attempt's result and, for a success, its settlement, in one round trip
/// ([`settle_sql`]); gives the outputs' ids in output order.
async fn settle(
    conn: &mut sqlx::AnyConnection,
    backend: Backend,
    attempt_id: AttemptId,
    result: AttemptResult,
    settled: Option<Settlement>,
) -> Result<Vec<OutputId>, sqlx::Error> {
    let outputs = settled.as_ref().map_or(0, |s| s.urls.len());
    let sql = sqlx::AssertSqlSafe(settle_sql(backend, settled.is_some(), outputs));
    let mut query = sqlx::query_as::<_, (i64, OutputId)>(sql)
        .bind(now_ms())
        .bind(result.outcome.as_str())
        .bind(result.http_status)
        .bind(result.credits)
        .bind(result.remaining)
        .bind(result.job_id)
        .bind(result.error)
        .bind(attempt_id);
    if let Some(s) = settled {
        query = query.bind(s.task_id);
        if !s.urls.is_empty() {
            query = query.bind(s.run_id).bind(s.parent_job_id);
        }
        for url in s.urls {
            query = query.bind(url);
        }
    }
    let mut ids = query.fetch_all(&mut *conn).await?;
    ids.sort_unstable();
    Ok(ids.into_iter().map(|(_, id)| id).collect())
}

/// The intent's statements: the task is running, and its attempt is recorded (its id
/// returned). Parameters: $1 now, $2 task id, $3 run id, $4 endpoint.
fn intent_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => {
            "UPDATE tasks SET status = 'running', updated_at = $1 WHERE id = $2;
             INSERT INTO attempts (task_id, run_id, endpoint, started_at)
             VALUES ($2, $3, $4, $1) RETURNING id"
        }
        Backend::Postgres => {
            "WITH t AS (UPDATE tasks SET status = 'running', updated_at = $1 WHERE id = $2)
             INSERT INTO attempts (task_id, run_id, endpoint, started_at)
             VALUES ($2, $3, $4, $1) RETURNING id"
        }
    }
}

/// The run's paid calls: their intent and their result.
#[derive(Clone, Copy, Debug)]
pub struct Attempts<'a> {
    pub(super) store: &'a Store,
}

impl Attempts<'_> {
    /// The intent: written and committed before the paid call is sent.
    pub async fn begin(
        &self,
        run_id: &RunId,
        task_id: TaskId,
        endpoint: &str,
    ) -> Result<AttemptId, StoreError> {
        let (run_id, endpoint) = (run_id.to_owned(), endpoint.to_owned());
        let backend = self.store.backend();
        let written = self
            .store
            .writer
            .write(Box::new(move |conn| {
                let (run_id, endpoint) = (run_id.clone(), endpoint.clone());
                Box::pin(async move {
                    // One round trip: the attempt's row id is what the batch returns.
                    // Every row read: sqlx's `Any` driver takes SQLite's first answer for the
                    // one a single-row fetch waits for, and here that is the update's.
                    let ids: Vec<AttemptId> = sqlx::query_scalar(intent_sql(backend))
                        .bind(now_ms())
                        .bind(task_id)
                        .bind(&run_id)
                        .bind(&endpoint)
                        .fetch_all(&mut *conn)
                        .await?;
                    let id = ids.last().copied().ok_or(sqlx::Error::RowNotFound)?;
                    Ok(Written::Attempt(id))
                })
            }))
            .await?;
        match written {
            Written::Attempt(id) => Ok(id),
            _ => Err(StoreError::Inconsistent(
                "recording an attempt gave no attempt id".into(),
            )),
        }
    }

    /// The result, written right after the call returns. A success also settles the task and
    /// records its outputs' URLs; the returned ids are the outputs', in order.
    pub async fn finish(
        &self,
        run_id: &RunId,
        task_id: TaskId,
        attempt_id: AttemptId,
        outcome: &AttemptOutcome<'_>,
    ) -> Result<Vec<OutputId>, StoreError> {
        let result = AttemptResult::of(outcome);
        let settled = Settlement::of(outcome, task_id, run_id);
        let backend = self.store.backend();
        let written = self
            .store
            .writer
            .write(Box::new(move |conn| {
                let (result, settled) = (result.clone(), settled.clone());
                Box::pin(async move {
                    let ids = settle(conn, backend, attempt_id, result, settled).await?;
                    Ok(Written::Outputs(ids))
                })
            }))
            .await?;
        match written {
            Written::Outputs(ids) => Ok(ids),
            _ => Err(StoreError::Inconsistent(
                "recording a result gave no output ids".into(),
            )),
        }
    }

    /// Attempts announced and never settled: calls in flight when a process died.
    pub async fn settle_orphaned(&self, run_id: &RunId) -> Result<u64, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let done = sqlx::query(
            "UPDATE attempts SET outcome = 'ambiguous', finished_at = $1,
                 error = 'in flight when the run stopped; it may have been billed'
             WHERE run_id = $2 AND outcome IS NULL",
        )
        .bind(now_ms())
        .bind(run_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query("UPDATE tasks SET status = 'pending' WHERE run_id = $1 AND status = 'running'")
            .bind(run_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_is_recorded_as_its_own_word_and_reads_back() {
        for outcome in CallOutcome::ALL {
            assert_eq!(CallOutcome::parse(outcome.as_str()), outcome);
        }
        // A word no imgpipe wrote is taken as the outcome that assumes the least.
        assert_eq!(CallOutcome::parse("lost"), CallOutcome::Ambiguous);
    }

    #[test]
    fn a_result_records_what_its_outcome_says_of_billing() {
        let urls = ["u0".to_owned(), "u1".to_owned()];
        let seven = TaskId::new(7).unwrap();
        let (job, parent) = (JobId::from("job_1"), JobId::from("job_0"));
        let succeeded = AttemptOutcome::Succeeded(Settled {
            job_id: &job,
            credits_used: 4,
            credits_remaining: Some(96),
            urls: &urls,
            parent_job_id: Some(&parent),
            note: Some("recovered"),
        });
        assert_eq!(
            AttemptResult::of(&succeeded),
            AttemptResult {
                outcome: CallOutcome::Succeeded,
                http_status: None,
                credits: 4,
                remaining: Some(96),
                job_id: Some("job_1".into()),
                error: Some("recovered".into()),
            }
        );
        assert_eq!(
            Settlement::of(&succeeded, seven, &RunId::from("r")),
            Some(Settlement {
                task_id: seven,
                run_id: "r".into(),
                parent_job_id: Some("job_0".into()),
                urls: urls.to_vec(),
            })
        );
        let answered = AttemptOutcome::Answered {
            status: 429,
            error: "slow down",
        };
        let r = AttemptResult::of(&answered);
        assert_eq!(
            (r.outcome, r.http_status, r.credits, r.job_id, r.error),
            (
                CallOutcome::AnsweredError,
                Some(429),
                0,
                None,
                Some("slow down".into())
            )
        );
        assert_eq!(Settlement::of(&answered, seven, &RunId::from("r")), None);
        let ambiguous = AttemptOutcome::Ambiguous {
            error: "cut",
            job_id: Some("job_2"),
        };
        let r = AttemptResult::of(&ambiguous);
        assert_eq!(
            (r.outcome, r.credits, r.job_id),
            (CallOutcome::Ambiguous, 0, Some("job_2".into()))
        );
        let r = AttemptResult::of(&AttemptOutcome::NotSent { error: "refused" });
        assert_eq!((r.outcome, r.job_id), (CallOutcome::NotSent, None));
    }
}
