//! The thumbnails the desk's grid shows, so a page of 50 items × 9 outputs weighs what its
//! thumbnails weigh (a few KiB each), not what the images weigh (megabytes each at the
//! service's sizes); the full image is fetched only when a card is opened or compared.
//!
//! A thumbnail is the report's own (`_thumbs/` beside the outputs, named by the image's
//! sha256, at most [`EDGE`](crate::report::page::thumbs::EDGE) pixels a side, read a row at a
//! time): made once, on demand when missing, [`AT_ONCE`] at a time. For a run in object
//! storage, one a report put there is served as it is; otherwise the image is copied to a
//! file of the desk's own (never held whole) and its thumbnail kept in the desk's cache
//! until the desk stops.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use tokio::sync::Semaphore;

use super::Desk;
use super::files::{check, inside, object, refused, run_root};
use crate::place::layout::THUMBS;
use crate::place::{Address, Place};
use crate::report::page::thumbs::{Known, preview, thumb_name, thumb_path};
use crate::sha256::Sha256Sum;

/// Thumbnails made at once: each reads a whole image, which is CPU and a file's worth of
/// reading; more would only queue behind the machine's cores.
pub const AT_ONCE: usize = 2;

/// The desk's making of thumbnails: how many at once, and its cache for runs in object
/// storage (removed when the desk stops).
pub struct Thumbs {
    making: Semaphore,
    cache: tempfile::TempDir,
}

impl Thumbs {
    pub fn new() -> std::io::Result<Thumbs> {
        Ok(Thumbs {
            making: Semaphore::new(AT_ONCE),
            cache: tempfile::Builder::new().prefix("imgpipe-desk-").tempdir()?,
        })
    }

    /// A turn to make a thumbnail, waited for.
    async fn turn(&self) -> Result<tokio::sync::SemaphorePermit<'_>, String> {
        self.making.acquire().await.map_err(|e| e.to_string())
    }
}

/// What a thumbnail's URL says of the image: its recorded sha256, which names it.
#[derive(serde::Deserialize)]
pub struct Asked {
    sha: String,
}

/// `GET /runs/{run}/thumbs/{*path}?sha=SHA256`: the image's thumbnail, as a PNG. An image
/// that has none (not a PNG) is redirected to itself.
pub async fn thumb(
    State(desk): State<Arc<Desk>>,
    Path((run, rel)): Path<(String, String)>,
    Query(asked): Query<Asked>,
) -> Response {
    if let Err(why) = check(&rel) {
        return refused(StatusCode::BAD_REQUEST, why);
    }
    let Ok(sha) = Sha256Sum::parse(&asked.sha.to_ascii_lowercase()) else {
        return refused(
            StatusCode::BAD_REQUEST,
            "sha: the image's sha256, 64 hex digits",
        );
    };
    let root = match run_root(&desk, &run).await {
        Ok(root) => root,
        Err(answer) => return answer,
    };
    let made = match &root {
        Address::Local(dir) => local(&desk, dir, &rel, &sha).await,
        Address::Object(_) => in_objects(&desk, &root, &rel, &sha).await,
    };
    match made {
        Ok(Made::Body(body)) => (
            [
                (header::CONTENT_TYPE, "image/png"),
                (header::CACHE_CONTROL, "private, max-age=3600"),
            ],
            body,
        )
            .into_response(),
        Ok(Made::None) => {
            let full = format!("/runs/{run}/files/{rel}");
            Redirect::to(&full).into_response()
        }
        Ok(Made::Missing) => refused(StatusCode::NOT_FOUND, "no such file in the run's directory"),
        Err(e) => refused(StatusCode::INTERNAL_SERVER_ERROR, &e),
    }
}

enum Made {
    Body(Body),
    /// The image has no thumbnail (it is not a PNG): the image itself stands for it.
    None,
    Missing,
}

/// A local run's thumbnail, in its `_thumbs/` as the report makes it.
async fn local(desk: &Desk, dir: &FsPath, rel: &str, sha: &Sha256Sum) -> Result<Made, String> {
    let Some(image) = inside(dir, rel).await else {
        return Ok(Made::Missing);
    };
    made(desk, dir.join(THUMBS), image, sha).await
}

/// A run in object storage: the thumbnail a report put beside its outputs, else one made
/// here from a copy of the image.
async fn in_objects(
    desk: &Desk,
    root: &Address,
    rel: &str,
    sha: &Sha256Sum,
) -> Result<Made, String> {
    let Ok(Place::Objects(objects)) = Place::open(root) else {
        return Err("the run's store cannot be opened here".to_owned());
    };
    let put = format!("{THUMBS}/{}.png", thumb_name(sha));
    if let Some(body) = object(root, &put).await? {
        return Ok(Made::Body(body));
    }
    let cache = desk.thumbs.cache.path().to_owned();
    let cached = thumb_path(&cache, sha);
    if cached.is_file() {
        return serve(&cached).await;
    }
    let _turn = desk.thumbs.turn().await?;
    let copy = tempfile::NamedTempFile::new_in(&cache).map_err(|e| e.to_string())?;
    let read = objects.read_to_file(&objects.key(rel), copy.path()).await;
    if read.map_err(|e| e.to_string())?.is_none() {
        return Ok(Made::Missing);
    }
    make(copy.path().to_owned(), cache, sha).await
}

/// The thumbnail of `image` in `dir`, made there when missing, a few at a time.
async fn made(desk: &Desk, dir: PathBuf, image: PathBuf, sha: &Sha256Sum) -> Result<Made, String> {
    let ready = thumb_path(&dir, sha);
    if ready.is_file() {
        return serve(&ready).await;
    }
    let _turn = desk.thumbs.turn().await?;
    make(image, dir, sha).await
}

/// Makes the thumbnail of `image` in `dir` (off the server's threads) and serves it; the
/// caller holds its turn.
async fn make(image: PathBuf, dir: PathBuf, sha: &Sha256Sum) -> Result<Made, String> {
    let sha = sha.clone();
    let shown =
        tokio::task::spawn_blocking(move || preview(&dir, &image, Some(&sha), &Known::default()));
    let shown = shown.await.map_err(|e| e.to_string())?;
    match shown.thumb {
        Some(thumb) => serve(&thumb).await,
        None => Ok(Made::None),
    }
}

async fn serve(thumb: &FsPath) -> Result<Made, String> {
    match tokio::fs::read(thumb).await {
        Ok(bytes) => Ok(Made::Body(Body::from(bytes))),
        Err(e) => Err(format!("cannot read the thumbnail: {e}")),
    }
}
