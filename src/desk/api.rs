//! The desk's JSON API: the documents the command line prints, for the page and for scripts
//! (`docs/reference/review-api.md`).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::Desk;
use crate::error::Error;
use crate::run_id::RunId;

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
            crate::error::exit::INVALID => StatusCode::NOT_FOUND,
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

/// `POST /api/runs/{run}/reroll`: not served yet.
pub async fn reroll(Path(_run): Path<String>) -> Response {
    not_yet("rerolls")
}

/// `POST /api/runs/{run}/continue`: not served yet.
pub async fn continue_run(Path(_run): Path<String>) -> Response {
    not_yet("continuing a run")
}

fn not_yet(what: &str) -> Response {
    Failed(
        StatusCode::NOT_IMPLEMENTED,
        format!("the desk does not do {what} yet\nhint: use `imgpipe reroll` or `imgpipe resume`"),
    )
    .into_response()
}

pub async fn not_found() -> Response {
    Failed(StatusCode::NOT_FOUND, "no such page of the desk".to_owned()).into_response()
}
