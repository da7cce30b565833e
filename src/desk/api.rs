//! The desk's JSON API: the documents the command line prints, for the page and for scripts
//! (`docs/reference/review-api.md`).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::Desk;
use super::view::Kept;
use crate::error::Error;
use crate::resume::Target;
use crate::run_id::RunId;
use crate::runner::Runner;
use crate::store::lock::Probe;

/// An error as the API answers it: a status and `{"error": …, "hint": …}`.
struct Failed(StatusCode, String);

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        let (message, hint) = match self.1.split_once("\nhint: ") {
            Some((m, h)) => (m.to_owned(), Some(h.to_owned())),
            None => (self.1, None),
        };
        (self.0, Json(json!({ "error": message, "hint": hint }))).into_response()
    }
}

impl From<Error> for Failed {
    fn from(e: Error) -> Failed {
        let status = match e.exit_code() {
            crate::error::exit::INVALID => StatusCode::BAD_REQUEST,
            crate::error::exit::LOCKED => StatusCode::CONFLICT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failed(status, e.to_string())
    }
}

/// `GET /api/runs`: the runs, as `imgpipe runs --json` prints them.
pub async fn runs(State(desk): State<Arc<Desk>>) -> Response {
    let lines = crate::report::runs::lines(&desk.store, |id| (desk.resume)(id)).await;
    match lines {
        Ok(lines) => Json(lines).into_response(),
        Err(e) => Failed::from(Error::from(e)).into_response(),
    }
}

/// `GET /api/runs/{run}`: the run, as `imgpipe status RUN --json` prints it.
pub async fn run(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    match status(&desk, &RunId::from(run.as_str())).await {
        Ok(status) => Json(status).into_response(),
        Err(e) => Failed::from(e).into_response(),
    }
}

async fn status(desk: &Desk, run_id: &RunId) -> Result<crate::report::summary::Status, Error> {
    let store = &desk.store;
    let Some(run) = store.runs().get(run_id).await? else {
        return Err(crate::runner::state::no_such_run(store, run_id));
    };
    let (run, process) = crate::report::live::observe(store, run).await?;
    let continue_with = run.status.unfinished().then(|| (desk.resume)(&run.id));
    let mut status = crate::report::summary::status_of(store, run).await?;
    status.summary.process = process;
    status.summary.continue_with = continue_with;
    Ok(status)
}

/// What a `POST` asks: the tasks of a reroll, a dry run or the price confirmed.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    #[serde(default)]
    tasks: Vec<String>,
    #[serde(default)]
    dry_run: bool,
    credits: Option<u64>,
}

/// What a `POST` pays for: chosen tasks again, or the rest of a stopped run.
#[derive(Clone)]
enum Work {
    Reroll(Vec<Target>),
    Continue,
}

/// `POST /api/runs/{run}/reroll`: `{"tasks": [...], "dry_run": true}` prices the reroll as
/// `imgpipe reroll RUN TASK... --dry-run` does; `{"tasks": [...], "credits": N}` starts it
/// (202) when N is its price now.
pub async fn reroll(
    State(desk): State<Arc<Desk>>,
    Path(run): Path<String>,
    body: Bytes,
) -> Response {
    let answer = async {
        let asked = asked(&body)?;
        if asked.tasks.is_empty() {
            return Err(bad(
                "tasks: name at least one task (item, item/step or item/step[index])",
            ));
        }
        let mut targets = Vec::with_capacity(asked.tasks.len());
        for (i, t) in asked.tasks.iter().enumerate() {
            targets.push(
                t.parse::<Target>()
                    .map_err(|e| bad(&format!("tasks[{i}]: {e}")))?,
            );
        }
        decide(
            &desk,
            RunId::from(run.as_str()),
            Work::Reroll(targets),
            &asked,
        )
        .await
    };
    answer.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /api/runs/{run}/continue`: the same for the rest of a stopped run, as
/// `imgpipe resume RUN` pays for it.
pub async fn continue_run(
    State(desk): State<Arc<Desk>>,
    Path(run): Path<String>,
    body: Bytes,
) -> Response {
    let answer = async {
        let asked = asked(&body)?;
        if !asked.tasks.is_empty() {
            return Err(bad(
                "tasks: a continuation pays for the rest of the run; name none",
            ));
        }
        decide(&desk, RunId::from(run.as_str()), Work::Continue, &asked).await
    };
    answer.await.unwrap_or_else(IntoResponse::into_response)
}

fn asked(body: &[u8]) -> Result<Asked, Failed> {
    serde_json::from_slice(body).map_err(|e| bad(&format!("the body: {e}")))
}

fn bad(message: &str) -> Failed {
    Failed(StatusCode::BAD_REQUEST, message.to_owned())
}

/// The price now, then: a dry run's answer, or the work started when the price confirmed is
/// the price now and no other process holds the run.
async fn decide(
    desk: &Arc<Desk>,
    id: RunId,
    work: Work,
    asked: &Asked,
) -> Result<Response, Failed> {
    let priced = price(desk, &id, &work).await?;
    if asked.dry_run {
        return Ok(Json(priced).into_response());
    }
    let Some(confirmed) = asked.credits else {
        return Err(bad(
            "credits: give the price you confirm (the dry run's `credits`), or `\"dry_run\": true`",
        ));
    };
    let now = priced["credits"].as_u64().unwrap_or(0);
    if now != confirmed {
        let body = json!({
            "error": format!("the price is now {now} credits, not {confirmed}: nothing was spent"),
            "hint": "look at the new price, and confirm it if it is right",
            "credits": now,
        });
        return Ok((StatusCode::CONFLICT, Json(body)).into_response());
    }
    if let Some(refused) = priced["refused"].as_str() {
        return Err(Failed(StatusCode::PAYMENT_REQUIRED, refused.to_owned()));
    }
    if let Some(holder) = holder(desk, &id).await? {
        return Err(Failed(
            StatusCode::CONFLICT,
            format!(
                "run {id} is held by another process ({holder}): nothing was spent\nhint: wait for it to end, then confirm again"
            ),
        ));
    }
    start(Arc::clone(desk), id, work, now);
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "started": true, "credits": now })),
    )
        .into_response())
}

/// The review a dry run makes, through the same runner as the command line's `--dry-run`,
/// with `fits` and, when it does not, why (`refused`).
async fn price(desk: &Arc<Desk>, id: &RunId, work: &Work) -> Result<serde_json::Value, Failed> {
    let ran = through_runner(Arc::clone(desk), id.clone(), work.clone(), true);
    let (review, result) = ran.await.map_err(|_| {
        Failed(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the dry run was lost".into(),
        )
    })?;
    match (review, result) {
        (Some(mut review), result) => {
            review["fits"] = json!(result.is_ok());
            if let Err(e) = result {
                review["refused"] = json!(e.to_string());
            }
            review["caps"] = json!(caps_of(desk, id).await?);
            Ok(review)
        }
        // A finished run: nothing to pay for.
        (None, Ok(())) => Ok(json!({ "run_id": id, "tasks": [], "credits": 0, "fits": true })),
        (None, Err(e)) => Err(e.into()),
    }
}

/// Where the caps that bind run `id` stand (those of its pipeline and those of all), as
/// `imgpipe cap list` computes them.
async fn caps_of(desk: &Desk, id: &RunId) -> Result<Vec<crate::caps::Standing>, Failed> {
    let Some(run) = desk.store.runs().get(id).await.map_err(Error::from)? else {
        return Err(crate::runner::state::no_such_run(&desk.store, id).into());
    };
    let caps = crate::caps::recorded(&desk.store)
        .await
        .map_err(Error::from)?
        .into_iter()
        .filter(|c| c.pipeline.as_ref().is_none_or(|p| *p == run.pipeline_name))
        .collect::<Vec<_>>();
    Ok(crate::caps::standings(&desk.store, &caps)
        .await
        .map_err(Error::from)?)
}

/// What a runner did: the review it showed, and how it ended.
type Ran = (Option<serde_json::Value>, Result<(), Error>);

/// Runs `work` through the runner as the command line does (the same engine, lock and
/// record), on a thread and runtime of its own: the runner's futures are not `Send`, and a
/// run started here goes on beside the server. It opens the state database itself.
fn through_runner(
    desk: Arc<Desk>,
    id: RunId,
    work: Work,
    dry_run: bool,
) -> tokio::sync::oneshot::Receiver<Ran> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("imgpipe-desk-runner".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build();
            let ran = match runtime {
                Ok(runtime) => runtime.block_on(run_work(&desk, &id, &work, dry_run)),
                Err(e) => (None, Err(Error::Other(e.into()))),
            };
            let _ = tx.send(ran);
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the desk's runner: {e}");
    }
    rx
}

async fn run_work(desk: &Desk, id: &RunId, work: &Work, dry_run: bool) -> Ran {
    let view = Kept::default();
    let runner = Runner {
        settings: &desk.settings,
        service: &desk.service,
        view: &view,
        shutdown: desk.shutdown.child_token(),
    };
    let result = match work {
        Work::Reroll(targets) => runner.reroll(id, targets, dry_run).await,
        Work::Continue => runner.resume(id, dry_run).await,
    };
    (view.review(), result)
}

/// The process holding run `id`'s lock, described, when one does.
async fn holder(desk: &Desk, id: &RunId) -> Result<Option<String>, Failed> {
    let Some(run) = desk.store.runs().get(id).await.map_err(Error::from)? else {
        return Err(crate::runner::state::no_such_run(&desk.store, id).into());
    };
    let probe = crate::store::lock::probe_store(&desk.store, &run.pipeline_name).await;
    held_by(id, probe)
}

/// What the lock's probe says of run `id`'s holder. A lock that cannot be read is not free:
/// the confirm is refused (503), nothing spent.
fn held_by(id: &RunId, probe: Result<Probe, String>) -> Result<Option<String>, Failed> {
    match probe {
        Ok(Probe::Held(Some(h))) => Ok(Some(format!(
            "pid {} on {} since {}, running {}",
            h.pid, h.host, h.since, h.run_id
        ))),
        Ok(Probe::Held(None)) => Ok(Some("a process that holds the run lock".to_owned())),
        Ok(Probe::Free) => Ok(None),
        Err(e) => Err(Failed(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the run lock of run {id} could not be read ({e}): nothing was spent\nhint: whether another process holds the run is unknown; confirm again once the state database's lock can be read"
            ),
        )),
    }
}

/// Starts `work` beside the server, followed by the desk's [`Works`](super::work::Works):
/// its end is logged and kept for the page.
fn start(desk: Arc<Desk>, id: RunId, work: Work, credits: u64) {
    let kind = match work {
        Work::Reroll(_) => "reroll",
        Work::Continue => "continue",
    };
    let ran = through_runner(Arc::clone(&desk), id.clone(), work, false);
    let logged = id.clone();
    let ended = async move {
        let ended = ran.await.ok().map(|(_, result)| result.or_else(part_done));
        match &ended {
            Some(Ok(())) => tracing::info!("the desk's {kind} of run {logged} is done"),
            Some(Err(e)) => tracing::warn!("the desk's {kind} of run {logged}: {e}"),
            None => tracing::warn!("the desk's {kind} of run {logged} was lost"),
        }
        ended
    };
    desk.works.follow(id, kind, credits, ended);
}

/// A reroll of a stopped run (a sample, `--until`) ends "stopped" (exit 7) once what it was
/// asked is done: for the desk that work is done, the rest is the gate's to price.
fn part_done(e: Error) -> Result<(), Error> {
    match e.exit_code() {
        crate::error::exit::PART_DONE => Ok(()),
        _ => Err(e),
    }
}

/// `GET /api/runs/{run}/work`: the latest work the desk started on the run (`kind`,
/// `credits`, `state`: `going`, `done` or `failed` with `error` and `hint`), or `{"state":
/// "none"}`.
pub async fn work(State(desk): State<Arc<Desk>>, Path(run): Path<String>) -> Response {
    match desk.works.latest(&RunId::from(run.as_str())) {
        Some(started) => Json(started).into_response(),
        None => Json(json!({ "state": "none" })).into_response(),
    }
}

pub async fn not_found() -> Response {
    Failed(StatusCode::NOT_FOUND, "no such page of the desk".to_owned()).into_response()
}

/// A path the desk has, asked with a method it does not take there.
pub async fn method_not_allowed(method: axum::http::Method) -> Response {
    Failed(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("refused: this address of the desk does not take {method}\nhint: a change is a POST to /api/runs/RUN/reroll or /api/runs/RUN/continue; everything else is a GET"),
    )
    .into_response()
}

/// Before every route that names a run: 404 when the state database does not have it (the
/// handler is not run), 500 when it cannot be read.
pub async fn known_run(
    State(desk): State<Arc<Desk>>,
    Path(params): Path<std::collections::HashMap<String, String>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(run) = params.get("run") else {
        return next.run(request).await;
    };
    let id = RunId::from(run.as_str());
    match desk.store.runs().get(&id).await {
        Ok(Some(_)) => next.run(request).await,
        Ok(None) => {
            let e = crate::runner::state::no_such_run(&desk.store, &id);
            Failed(StatusCode::NOT_FOUND, e.to_string()).into_response()
        }
        Err(e) => Failed::from(Error::from(e)).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::lock::Holder;

    async fn answer(probe: Result<Probe, String>) -> (StatusCode, serde_json::Value) {
        let failed = held_by(&RunId::from("r"), probe).expect_err("refused");
        let response = failed.into_response();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await;
        (status, serde_json::from_slice(&body.unwrap()).unwrap())
    }

    #[tokio::test]
    async fn a_run_lock_that_cannot_be_read_refuses_the_confirm_never_free() {
        let (status, body) = answer(Err("Permission denied (os error 13)".into())).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let error = body["error"].as_str().unwrap();
        assert!(error.contains("could not be read"), "{body}");
        assert!(error.contains("Permission denied"), "{body}");
        assert!(error.contains("nothing was spent"), "{body}");
        assert!(body["hint"].as_str().is_some(), "{body}");

        assert_eq!(held_by(&RunId::from("r"), Ok(Probe::Free)).ok(), Some(None));
        let holder = Holder {
            pid: 7,
            host: "h".into(),
            since: "2026-01-01T00:00:00Z".into(),
            run_id: RunId::from("r"),
        };
        let held = held_by(&RunId::from("r"), Ok(Probe::Held(Some(holder))));
        assert!(
            held.ok()
                .flatten()
                .is_some_and(|h| h.contains("pid 7 on h"))
        );
    }
}
