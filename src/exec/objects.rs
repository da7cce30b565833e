//! Resuming a run whose outputs are in object storage: what [`super::resume`] does with files,
//! done with objects. An object is checked by a HEAD (its size and the sha256 kept in its
//! metadata), read whole only when those do not agree with the record; a modified object is
//! copied, create-only, to its `_superseded/` key before it is removed, so the user's bytes
//! are never lost.

use std::path::PathBuf;

use futures::StreamExt;
use sha2::{Digest, Sha256};

use crate::exec::resume::Refetch;
use crate::store::OutputRow;

use crate::place::{Objects, Stat};

/// What the object of a recorded output is now.
enum Checked {
    /// As recorded.
    Same,
    Missing,
    /// Other bytes, of this sha256.
    Modified(String),
}

/// Compares the object at `url` with the recorded sha256 and size. A store that cannot be
/// reached says nothing for sure: the output is then fetched again, which is free and, the
/// object being create-only, harmless.
async fn check(url: &str, sha256: &str, bytes: Option<u64>) -> Checked {
    let found = async {
        let (objects, key) = Objects::at_url(url)?;
        let stat = objects.stat(&key).await?;
        let Some(Stat {
            bytes: size,
            sha256: meta,
            ..
        }) = stat
        else {
            return Ok(Checked::Missing);
        };
        let meta_agrees = meta.is_some_and(|m| m.eq_ignore_ascii_case(sha256));
        if meta_agrees && bytes.is_none_or(|b| b == size) {
            return Ok(Checked::Same);
        }
        // Metadata can be copied along with other bytes, or lost: the bytes decide.
        Ok(match objects.read(&key).await? {
            None => Checked::Missing,
            Some(body) => {
                let actual = hex::encode(Sha256::digest(&body));
                if actual == sha256 {
                    Checked::Same
                } else {
                    Checked::Modified(actual)
                }
            }
        })
    };
    match found.await {
        Ok(checked) => checked,
        Err(e) => {
            let e: crate::place::ObjectError = e;
            tracing::warn!("cannot check {url}: {e}; it is fetched again");
            Checked::Missing
        }
    }
}

/// HEADs at once when a resume checks a run's objects: one at a time, a run of 100,000
/// outputs would wait minutes on round trips alone.
const CHECKS_IN_FLIGHT: usize = 16;

/// The outputs, of those given with their URL and recorded sha256, whose object is missing or
/// modified.
pub(super) async fn check_all(outputs: Vec<(OutputRow, PathBuf, String)>) -> Vec<Refetch> {
    futures::stream::iter(outputs)
        .map(|(o, url, sha)| async move {
            match check(&url.to_string_lossy(), &sha, o.bytes).await {
                Checked::Same => None,
                Checked::Missing => Some(Refetch {
                    output: o,
                    modified: None,
                }),
                Checked::Modified(actual) => Some(Refetch {
                    output: o,
                    modified: Some(actual),
                }),
            }
        })
        .buffered(CHECKS_IN_FLIGHT)
        .filter_map(std::future::ready)
        .collect()
        .await
}

/// Copies the object at `from` to `to` (create-only) and removes it from `from`; returns the
/// size moved, `None` when there was nothing at `from` or it could not be kept (then it is
/// left where it is, and said).
pub(super) async fn set_aside(from: &str, to: &str) -> Option<u64> {
    let moved = async {
        let (objects, key) = Objects::at_url(from)?;
        let (_, to_key) = Objects::at_url(to)?;
        let Some(body) = objects.read(&key).await? else {
            return Ok(None);
        };
        let sha = hex::encode(Sha256::digest(&body));
        let size = body.len() as u64;
        objects.put_new(&to_key, body.into(), &sha).await?;
        objects.delete(&key).await?;
        Ok(Some(size))
    };
    match moved.await {
        Ok(size) => size,
        Err(e) => {
            let e: crate::place::ObjectError = e;
            tracing::warn!("cannot move {from} aside: {e}");
            None
        }
    }
}
