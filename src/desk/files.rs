//! A run's images, served from its place (a local directory or an `s3://` prefix) at
//! `/runs/{run}/files/{path}`: only images, only under the run's own directory.
//!
//! The path is checked part by part before anything is opened (no `..`, `.`, empty part,
//! backslash or NUL), and a local file is opened only when its real path, links followed, is
//! still under the run's real directory: nothing else on the machine is reachable through the
//! desk. Only images are served, each with its own type (and `nosniff`): a file in the run's
//! directory can never become a script or a page of the desk's origin.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use tokio_util::io::ReaderStream;

use super::Desk;
use crate::place::{Address, Place};
use crate::run_id::RunId;

/// The types served, by extension: the images a run keeps.
const TYPES: [(&str, &str); 5] = [
    ("png", "image/png"),
    ("jpg", "image/jpeg"),
    ("jpeg", "image/jpeg"),
    ("webp", "image/webp"),
    ("gif", "image/gif"),
];

pub(super) fn refused(status: StatusCode, why: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({ "error": why, "hint": null })),
    )
        .into_response()
}

/// Why `rel` may not be served, when it may not: a path that leaves the run's directory, or
/// a file that is not an image. Otherwise its content type.
pub fn check(rel: &str) -> Result<&'static str, &'static str> {
    let parts_fine = rel
        .split('/')
        .all(|p| !p.is_empty() && p != "." && p != ".." && !p.contains('\\') && !p.contains('\0'));
    if !parts_fine || rel.starts_with('/') {
        return Err("refused: a file of the run is named by a path inside its directory");
    }
    let ext = rel
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    TYPES
        .iter()
        .find(|(e, _)| *e == ext)
        .map(|(_, t)| *t)
        .ok_or("refused: the desk serves a run's images only")
}

/// `GET /runs/{run}/files/{*path}`: the image, its bytes passed on as they are read (an
/// output may weigh 100 MB: none is held whole).
pub async fn file(
    State(desk): State<Arc<Desk>>,
    Path((run, rel)): Path<(String, String)>,
) -> Response {
    let kind = match check(&rel) {
        Ok(kind) => kind,
        Err(why) => return refused(StatusCode::BAD_REQUEST, why),
    };
    let root = match run_root(&desk, &run).await {
        Ok(root) => root,
        Err(answer) => return answer,
    };
    let read = match &root {
        Address::Local(root) => local(root, &rel).await,
        address @ Address::Object(_) => object(address, &rel).await,
    };
    match read {
        Ok(Some(body)) => ([(header::CONTENT_TYPE, kind)], body).into_response(),
        Ok(None) => refused(StatusCode::NOT_FOUND, "no such file in the run's directory"),
        Err(e) => refused(StatusCode::INTERNAL_SERVER_ERROR, &e),
    }
}

/// The run's directory (its place), or the answer that it has none.
pub(super) async fn run_root(desk: &Desk, run: &str) -> Result<Address, Response> {
    match desk.store.runs().get(&RunId::from(run)).await {
        Ok(Some(run)) => Ok(run.dir().root().clone()),
        Ok(None) => Err(refused(StatusCode::NOT_FOUND, "no such run")),
        Err(e) => Err(refused(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())),
    }
}

/// The file `rel` under `root`, when its real path is under `root`'s.
async fn local(root: &std::path::Path, rel: &str) -> Result<Option<Body>, String> {
    let Some(path) = inside(root, rel).await else {
        return Ok(None);
    };
    match tokio::fs::File::open(&path).await {
        Ok(file) => Ok(Some(Body::from_stream(ReaderStream::new(file)))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {rel}: {e}")),
    }
}

/// `root`/`rel`, links followed, when it is still under `root`'s real path.
pub(super) async fn inside(root: &std::path::Path, rel: &str) -> Option<std::path::PathBuf> {
    let (Ok(root), Ok(path)) = (
        tokio::fs::canonicalize(root).await,
        tokio::fs::canonicalize(root.join(rel)).await,
    ) else {
        return None;
    };
    path.starts_with(&root).then_some(path)
}

/// The object `rel` under the run's prefix, read through the store's usual credentials.
pub(super) async fn object(root: &Address, rel: &str) -> Result<Option<Body>, String> {
    let Ok(Place::Objects(objects)) = Place::open(root) else {
        return Err("the run's store cannot be opened here".to_owned());
    };
    let stream = objects.stream(&objects.key(rel)).await;
    stream
        .map(|s| s.map(Body::from_stream))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn only_images_inside_the_run_are_served() {
        assert_eq!(check("mug/shot_0.png"), Ok("image/png"));
        assert_eq!(check("_superseded/mug/a.JPG"), Ok("image/jpeg"));
        for bad in [
            "../x.png",
            "mug/../../x.png",
            "./a.png",
            "/etc/a.png",
            "a//b.png",
            "a\\..\\b.png",
            "mug/manifest.json",
            "report.html",
        ] {
            assert!(check(bad).is_err(), "{bad} served");
        }
    }
}
