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
use crate::money::{Expected, Priced, Revision};
use crate::resume::Target;
use crate::run_id::RunId;
use crate::runner::Runner;

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

/// What a `POST` asks: the tasks of a reroll, a dry run, or the price and revision confirmed.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    #[serde(default)]
    tasks: Vec<String>,
    #[serde(default)]
    dry_run: bool,
    credits: Option<u64>,
    revision: Option<String>,
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

/// A dry run's answer, or a confirm passed to the gate: the work starts (202) only once it
/// holds the run's lock and, planned again under it, costs the credits and has the revision
/// confirmed; otherwise the answer says why at once (409 with the holder, or with the price
/// and revision now; 402 when it does not fit), and nothing is spent.
async fn decide(
    desk: &Arc<Desk>,
    id: RunId,
    work: Work,
    asked: &Asked,
) -> Result<Response, Failed> {
    if asked.dry_run {
        return Ok(Json(price(desk, &id, &work).await?).into_response());
    }
    let expect = confirmed(asked)?;
    let (tell, admitted) = tokio::sync::oneshot::channel();
    let ran = through_runner(
        Arc::clone(desk),
        id.clone(),
        work.clone(),
        Run::Confirmed(expect, tell),
    );
    match admitted.await {
        Ok(priced) => {
            follow(Arc::clone(desk), id, &work, priced.credits, ran);
            let body =
                json!({ "started": true, "credits": priced.credits, "revision": priced.revision });
            Ok((StatusCode::ACCEPTED, Json(body)).into_response())
        }
        // The runner ended without passing the gate: its error says why.
        Err(_) => match ran.await {
            Ok((_, Ok(()))) => Ok(Json(json!({ "started": false, "credits": 0 })).into_response()),
            Ok((_, Err(e))) => Ok(refused(&id, e)),
            Err(_) => Err(Failed(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the confirm was lost: nothing was spent".into(),
            )),
        },
    }
}

/// The price and revision a confirm carries: both, as the dry run answered them.
fn confirmed(asked: &Asked) -> Result<Expected, Failed> {
    let Some(credits) = asked.credits else {
        return Err(bad(
            "credits: give the price you confirm (the dry run's `credits`), or `\"dry_run\": true`",
        ));
    };
    let Some(revision) = &asked.revision else {
        return Err(bad(
            "revision: give the dry run's `revision` with its credits: a confirm pays for what was priced, once",
        ));
    };
    let revision = revision
        .parse::<Revision>()
        .map_err(|e| bad(&format!("revision: {e}")))?;
    Ok(Expected {
        credits: Some(credits),
        revision: Some(revision),
    })
}

/// Why the gate refused a confirm, as the API answers it: nothing was spent.
fn refused(id: &RunId, e: Error) -> Response {
    match e {
        Error::Stale(stale) => {
            let body = json!({
                "error": stale.to_string(),
                "hint": "look at what it pays for now, and confirm that if it is right",
                "credits": stale.now.credits,
                "revision": stale.now.revision,
            });
            (StatusCode::CONFLICT, Json(body)).into_response()
        }
        Error::Locked { message, .. } => Failed(
            StatusCode::CONFLICT,
            format!("run {id}: {message}: nothing was spent\nhint: wait for it to end, then confirm again"),
        )
        .into_response(),
        e if e.exit_code() == crate::error::exit::CREDITS => {
            Failed(StatusCode::PAYMENT_REQUIRED, e.to_string()).into_response()
        }
        e => Failed::from(e).into_response(),
    }
}

/// The review a dry run makes, through the same runner as the command line's `--dry-run`,
/// with `fits` and, when it does not, why (`refused`).
async fn price(desk: &Arc<Desk>, id: &RunId, work: &Work) -> Result<serde_json::Value, Failed> {
    let ran = through_runner(Arc::clone(desk), id.clone(), work.clone(), Run::Dry);
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
async fn caps_of(desk: &Desk, id: &RunId) -> Result<Vec<crate::money::caps::Standing>, Failed> {
    let Some(run) = desk.store.runs().get(id).await.map_err(Error::from)? else {
        return Err(crate::runner::state::no_such_run(&desk.store, id).into());
    };
    let caps = crate::money::caps::recorded(&desk.store)
        .await
        .map_err(Error::from)?
        .into_iter()
        .filter(|c| c.pipeline.as_ref().is_none_or(|p| *p == run.pipeline_name))
        .collect::<Vec<_>>();
    Ok(crate::money::caps::standings(&desk.store, &caps)
        .await
        .map_err(Error::from)?)
}

/// What a runner did: the review it showed, and how it ended.
type Ran = (Option<serde_json::Value>, Result<(), Error>);

/// How the desk runs a work: a dry run, or a confirm with what it expects, told when the
/// gate lets it through.
enum Run {
    Dry,
    Confirmed(Expected, tokio::sync::oneshot::Sender<Priced>),
}

/// Runs `work` through the runner as the command line does (the same engine, lock, gate and
/// record), on a thread and runtime of its own: the runner's futures are not `Send`, and a
/// run started here goes on beside the server. It opens the state database itself.
fn through_runner(
    desk: Arc<Desk>,
    id: RunId,
    work: Work,
    run: Run,
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
                Ok(runtime) => runtime.block_on(run_work(&desk, &id, &work, run)),
                Err(e) => (None, Err(Error::Other(e.into()))),
            };
            let _ = tx.send(ran);
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the desk's runner: {e}");
    }
    rx
}

/// A confirm never waits for the lock (`--wait` or not): work that cannot hold it now is
/// refused at once, naming the holder, never queued behind it.
async fn run_work(desk: &Desk, id: &RunId, work: &Work, run: Run) -> Ran {
    let mut settings = desk.settings.clone();
    let (dry_run, view) = match run {
        Run::Dry => (true, Kept::default()),
        Run::Confirmed(expect, admitted) => {
            settings.wait = false;
            settings.expect = expect;
            (false, Kept::admitting(admitted))
        }
    };
    let runner = Runner {
        settings: &settings,
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

/// Follows work the gate let through, beside the server, with the desk's
/// [`Works`](super::work::Works): its end is logged and kept for the page.
fn follow(
    desk: Arc<Desk>,
    id: RunId,
    work: &Work,
    credits: u64,
    ran: tokio::sync::oneshot::Receiver<Ran>,
) {
    let kind = match work {
        Work::Reroll(_) => "reroll",
        Work::Continue => "continue",
    };
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
