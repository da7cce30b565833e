//! Result images behind their signed URLs, and the built-in samples. Both are public, as the
//! service's result URLs are: the signature, not the key, is what grants access.

use std::io;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State as Shared};
use axum::http::StatusCode;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::sandbox::reply::{App, Reply};
use crate::sandbox::signing::Refusal;
use crate::sandbox::state::State;

/// A result image behind its signed URL.
pub(super) async fn result(
    Shared(state): App,
    Path(file): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Reply> {
    state.count(|s| s.downloads += 1);
    let refuse = |state: &State, code: &str, message: &str| {
        state.count(|s| s.refused_downloads += 1);
        Reply::new(StatusCode::FORBIDDEN, code, message)
    };
    let id = file.strip_suffix(".png").unwrap_or(&file);
    match state.check_signed(id, query.as_deref()) {
        Ok(()) => {}
        Err(Refusal::Expired) => {
            return Err(refuse(
                &state,
                "url_expired",
                "this URL has expired; get a fresh one with GET /v1/jobs/{id}",
            ));
        }
        Err(Refusal::Forged) => {
            return Err(refuse(
                &state,
                "invalid_signature",
                "this URL's signature is not valid",
            ));
        }
    }
    tokio::time::sleep(state.config.download_latency).await;
    let bytes = state
        .stored_image(id)
        .ok_or_else(|| Reply::new(StatusCode::NOT_FOUND, "not_found", "no such image"))?;
    state.downloaded(id);
    if state.dice.chance(state.config.faults.truncate_download) {
        state.count(|s| s.truncated_downloads += 1);
        return Ok(truncated(bytes));
    }
    Ok(png(bytes))
}

pub(super) async fn sample(
    Shared(state): App,
    Path(file): Path<String>,
) -> Result<Response, Reply> {
    let name = file.strip_suffix(".png").unwrap_or(&file);
    state.sample(name).map(png).ok_or_else(|| {
        Reply::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no sample {file:?}"),
        )
    })
}

fn png(bytes: Bytes) -> Response {
    ([(CONTENT_TYPE, "image/png")], bytes).into_response()
}

/// Half the image under a header that promises all of it, then a broken connection.
fn truncated(bytes: Bytes) -> Response {
    let full = bytes.len();
    let half = bytes.slice(..full / 2);
    // Yield once before failing, so the headers and the first half are really sent.
    let parts = futures::stream::iter([Ok(half)]).chain(futures::stream::once(async {
        tokio::task::yield_now().await;
        Err(io::Error::other("download cut short (injected fault)"))
    }));
    Response::builder()
        .header(CONTENT_TYPE, "image/png")
        .header(CONTENT_LENGTH, full)
        .body(Body::from_stream(parts))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
