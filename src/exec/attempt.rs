//! One attempt at one task: resolve its input URLs, wait for the limiter, record the intent,
//! make the paid call, record the result. Whether to try again is the scheduler's decision.

use std::sync::Arc;
use std::time::Duration;

use crate::api::job_id::JobId;
use crate::api::types::{GenerationRequest, STATUS_SUCCEEDED, ToolRequest};
use crate::api::{ApiError, JobRecord};
use crate::exec::shared::{OutputUrl, Shared};
use crate::plan::graph::{Source, Work};
use crate::store::{AttemptId, AttemptOutcome, OutputId, Settled, StoreError, TaskId, now_ms};

pub(super) struct Attempted {
    pub task: usize,
    pub result: Result<Success, Failure>,
}

pub(super) struct Success {
    pub job_id: JobId,
    pub credits: u64,
    pub credits_remaining: Option<i64>,
    pub outputs: Vec<OutputUrl>,
}

pub(super) enum Failure {
    /// The call failed; what that means for billing is in the error.
    Api(ApiError),
    /// An input URL could not be refreshed; nothing was sent.
    Input(String),
    /// The answer came back but the job did not succeed; it may have been billed.
    Status(String),
    /// The run was stopping when the call's turn came: nothing was sent.
    Cancelled,
    /// The record could not be written: the run must stop.
    Store(StoreError),
}

/// Runs one attempt of `task` after `delay` and the limiter; `force_refresh` fetches fresh
/// input URLs first. URLs are resolved after the wait, so a long pause cannot stale them.
pub(super) async fn attempt(
    shared: Arc<Shared>,
    task: usize,
    row: TaskId,
    delay: Duration,
    force_refresh: bool,
) -> Attempted {
    // Waiting (a retry's delay, the limiter's pause) ends early when the run stops: a call
    // not yet sent is simply not sent.
    let ready = async {
        tokio::time::sleep(delay).await;
        shared.limiter.acquire().await;
    };
    let result = tokio::select! {
        () = ready => run(&shared, task, row, force_refresh).await,
        () = shared.stopped() => Err(Failure::Cancelled),
    };
    Attempted { task, result }
}

/// The attempt's steps: the call made ready, its intent recorded, the call sent (a lost
/// answer read back by its job), its answer judged and the result recorded.
async fn run(
    shared: &Shared,
    task: usize,
    task_id: TaskId,
    force_refresh: bool,
) -> Result<Success, Failure> {
    // `task_id` is the task's row: the scheduler admits no task without one.
    let (call, parent) = prepare(shared, task, force_refresh).await?;
    let early = if crate::failpoint::mutated(crate::failpoint::INTENT_AFTER_CALL) {
        Some(call.send(shared).await)
    } else {
        None
    };
    let attempt_id = shared
        .store
        .attempts()
        .begin(&shared.run_id, task_id, &call.endpoint())
        .await
        .map_err(Failure::Store)?;
    let recorded = Recorded {
        task_id,
        attempt_id,
    };
    let answer = match early {
        Some(answer) => answer,
        None => send(shared, task, recorded, &call).await?,
    };
    let answered = judge(shared, recorded, answer).await?;
    settle(shared, recorded, answered, parent).await
}

/// The rows an attempt's result is recorded in.
#[derive(Clone, Copy)]
struct Recorded {
    task_id: TaskId,
    attempt_id: AttemptId,
}

/// The call `task` makes with fresh input URLs, and the job of its first input (the lineage);
/// nothing is sent, nor recorded, when the run is stopping.
async fn prepare(
    shared: &Shared,
    task: usize,
    force_refresh: bool,
) -> Result<(Call, Option<JobId>), Failure> {
    let work = shared
        .graph
        .work(task)
        .map_err(|e| Failure::Input(e.to_string()))?;
    let (urls, parent) = inputs(shared, &work, force_refresh).await?;
    let call = Call::of(work, urls);
    if shared.is_stopping() {
        return Err(Failure::Cancelled);
    }
    Ok((call, parent))
}

/// Sends the call. An answer lost after the service named its job is read back by the job,
/// once the job is on record: a process killed in between leaves a call that `resume` reads
/// back for free instead of paying again.
async fn send(
    shared: &Shared,
    task: usize,
    at: Recorded,
    call: &Call,
) -> Result<Result<Answered, ApiError>, Failure> {
    let (endpoint, reason, id) = match call.send(shared).await {
        Err(ApiError::Ambiguous {
            endpoint,
            reason,
            job_id: Some(id),
        }) => (endpoint, reason, id),
        answer => return Ok(answer),
    };
    let e = ApiError::Ambiguous {
        endpoint,
        reason,
        job_id: Some(id.clone()),
    };
    let error = shared.client.redact(&e.to_string());
    let named = AttemptOutcome::Ambiguous {
        error: &error,
        job_id: Some(&id),
    };
    record(shared, at, named).await?;
    Ok(match recover(shared, &id).await {
        Some(job) => Ok(Answered::recovered(
            id,
            &job,
            shared.graph.task(task).planned,
        )),
        None => Err(e),
    })
}

/// A succeeded job's answer; any other answer is recorded as what it says of billing, and
/// ends the attempt.
async fn judge(
    shared: &Shared,
    at: Recorded,
    answer: Result<Answered, ApiError>,
) -> Result<Answered, Failure> {
    match answer {
        Ok(a) if a.status == JobStatus::Succeeded => Ok(a),
        Ok(a) => {
            let id = &a.job_id;
            let error = shared.client.redact(&format!(
                "job {id} came back with status {}, not succeeded; `imgpipe job {id}` shows it",
                a.status
            ));
            let outcome = AttemptOutcome::Ambiguous {
                error: &error,
                job_id: Some(id),
            };
            record(shared, at, outcome).await?;
            Err(Failure::Status(error))
        }
        Err(e) => {
            let error = shared.client.redact(&e.to_string());
            record(shared, at, failed(&e, &error)).await?;
            Err(Failure::Api(e))
        }
    }
}

/// How long a success's record may wait before its job is named in the log: past it the state
/// database is slow or silent, and should the run end before the record, the job id is the
/// user's way to the images paid for without paying again.
const RECORD_NAMED_AFTER: Duration = Duration::from_secs(5);

/// Records the success (the task settled, its outputs' URLs) and gives its outputs.
async fn settle(
    shared: &Shared,
    at: Recorded,
    answered: Answered,
    parent: Option<JobId>,
) -> Result<Success, Failure> {
    let recording = record(
        shared,
        at,
        AttemptOutcome::Succeeded(Settled {
            job_id: &answered.job_id,
            credits_used: answered.credits,
            credits_remaining: answered.credits_remaining,
            urls: &answered.urls,
            parent_job_id: parent.as_ref(),
            note: answered.note.as_deref(),
        }),
    );
    let ids = named_if_slow(recording, &answered.job_id, answered.credits).await?;
    let issued_ms = now_ms();
    let Answered {
        job_id,
        credits,
        credits_remaining,
        urls,
        ..
    } = answered;
    let outputs = ids
        .into_iter()
        .zip(urls)
        .map(|(output_id, url)| OutputUrl {
            output_id,
            job_id: job_id.clone(),
            url,
            issued_ms,
        })
        .collect();
    Ok(Success {
        job_id,
        credits,
        credits_remaining,
        outputs,
    })
}

/// Awaits a success's record, naming its job in the log when the record fails or is still not
/// made after [`RECORD_NAMED_AFTER`].
async fn named_if_slow<T>(
    recording: impl std::future::Future<Output = Result<T, Failure>>,
    job_id: &JobId,
    credits: u64,
) -> Result<T, Failure> {
    let name = || {
        tracing::warn!(
            "job {job_id} ({}) was answered but the state database has not recorded it; if this run ends first, `imgpipe job {job_id} --out DIR` fetches its images without paying again",
            crate::money::credits(credits)
        );
    };
    tokio::pin!(recording);
    let recorded = tokio::select! {
        recorded = &mut recording => recorded,
        () = tokio::time::sleep(RECORD_NAMED_AFTER) => {
            name();
            return recording.await;
        }
    };
    if recorded.is_err() {
        name();
    }
    recorded
}

/// The task's input URLs, each output of another task's refreshed when it is near its expiry
/// (or always, with `force_refresh`), and the job of the first such output (the lineage).
async fn inputs(
    shared: &Shared,
    work: &Work,
    force_refresh: bool,
) -> Result<(Vec<String>, Option<JobId>), Failure> {
    let mut parent = None;
    let mut urls = Vec::new();
    for source in work.sources() {
        match source {
            Source::Url(u) => urls.push(u.clone()),
            Source::Output { task: from, k } => {
                let fresh = shared
                    .fresh_url(*from, *k, force_refresh)
                    .await
                    .map_err(Failure::Input)?;
                parent.get_or_insert_with(|| fresh.job_id.clone());
                urls.push(fresh.url);
            }
        }
    }
    Ok((urls, parent))
}

/// What the record says of a call that failed: answered (nothing billed), never sent, or
/// sent without a complete answer (possibly billed).
fn failed<'a>(e: &'a ApiError, error: &'a str) -> AttemptOutcome<'a> {
    match e {
        ApiError::Answered { status, .. } => AttemptOutcome::Answered {
            status: *status,
            error,
        },
        ApiError::Invalid(_) | ApiError::NotSent { .. } => AttemptOutcome::NotSent { error },
        ApiError::Ambiguous { job_id, .. } => AttemptOutcome::Ambiguous {
            error,
            job_id: job_id.as_deref(),
        },
    }
}

/// The parameters of the call `work` makes, as sent but without its image URLs (the task's
/// inputs, which change on every refresh), as compact JSON: what a task records of its request.
pub(crate) fn request_params(work: Work) -> String {
    let params = match Call::of(work, Vec::new()) {
        Call::Generate(req) => req.params(),
        Call::Tool(req) => req.params(),
    };
    serde_json::Value::Object(params).to_string()
}

/// The paid call a task makes: one of the service's two kinds.
enum Call {
    Generate(GenerationRequest),
    Tool(ToolRequest),
}

impl Call {
    fn of(work: Work, mut urls: Vec<String>) -> Call {
        match work {
            Work::Generate {
                prompt, n, size, ..
            } => {
                let mut req = GenerationRequest::new(prompt);
                req.n = n;
                req.size = size;
                req.image_urls = urls;
                Call::Generate(req)
            }
            Work::Tool {
                preserve_alpha,
                params,
                ..
            } => {
                let mut req = ToolRequest::new(urls.pop().unwrap_or_default(), params);
                req.preserve_alpha = preserve_alpha;
                Call::Tool(req)
            }
        }
    }

    fn endpoint(&self) -> String {
        match self {
            Call::Generate(_) => "POST /v1/images/generations".to_owned(),
            Call::Tool(req) => format!("POST /v1/images/tools/{}", req.tool()),
        }
    }

    async fn send(&self, shared: &Shared) -> Result<Answered, ApiError> {
        match self {
            Call::Generate(req) => shared.client.generate(req).await.map(|j| Answered {
                urls: j.images.into_iter().map(|i| i.url).collect(),
                job_id: j.id,
                status: JobStatus::of(j.status),
                credits: j.credits_used,
                credits_remaining: j.credits_remaining,
                note: None,
            }),
            Call::Tool(req) => shared.client.tool(req).await.map(|j| Answered {
                urls: vec![j.data.url],
                job_id: j.id,
                status: JobStatus::of(j.status),
                credits: j.credits_used,
                credits_remaining: j.credits_remaining,
                note: None,
            }),
        }
    }
}

/// The status a job came back with: success, or any other word, reported as it came.
#[derive(Clone, Debug, PartialEq, Eq)]
enum JobStatus {
    Succeeded,
    Other(String),
}

impl JobStatus {
    fn of(status: String) -> JobStatus {
        if status == STATUS_SUCCEEDED {
            JobStatus::Succeeded
        } else {
            JobStatus::Other(status)
        }
    }
}

impl std::fmt::Display for JobStatus {
    /// As the answer wrote it, quoted (`"failed"`), as the attempt's error has always said.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobStatus::Succeeded => write!(f, "{STATUS_SUCCEEDED:?}"),
            JobStatus::Other(s) => write!(f, "{s:?}"),
        }
    }
}

/// A call's answer, whichever kind of call it was: its job, billing and result URLs.
struct Answered {
    job_id: JobId,
    status: JobStatus,
    credits: u64,
    credits_remaining: Option<i64>,
    urls: Vec<String>,
    /// How the answer was had, when not from the call itself.
    note: Option<String>,
}

impl Answered {
    /// A lost answer read back by its job id; billed as the job says, else as planned.
    fn recovered(job_id: JobId, job: &JobRecord, planned: u64) -> Answered {
        Answered {
            note: Some(format!(
                "the answer was lost; recovered from GET /v1/jobs/{job_id}"
            )),
            status: JobStatus::Succeeded,
            credits: job.credits_used().unwrap_or(planned),
            credits_remaining: None,
            urls: job.image_urls(),
            job_id,
        }
    }
}

async fn record(
    shared: &Shared,
    at: Recorded,
    outcome: AttemptOutcome<'_>,
) -> Result<Vec<OutputId>, Failure> {
    shared
        .store
        .attempts()
        .finish(&shared.run_id, at.task_id, at.attempt_id, &outcome)
        .await
        .map_err(Failure::Store)
}

/// The job of a call whose answer was lost, when the partial answer named it and the job
/// lists its images: what was paid for is then not lost.
async fn recover(shared: &Shared, job_id: &JobId) -> Option<JobRecord> {
    let job = shared.free_call(|| shared.client.job(job_id)).await.ok()?;
    (!job.image_urls().is_empty()).then_some(job)
}
