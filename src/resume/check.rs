//! The kept outputs compared with what is there now: a file (its sha256 read) or an object
//! (see [`super::objects`]). What differs is fetched again from its job, never paid again.

use std::path::PathBuf;

use crate::place::file_sha256;
use crate::place::is_object_url;
use crate::store::{OutputRow, Store, StoreError};

use super::{Refetch, Review};

/// What is at an output's recorded place now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Missing,
    /// Bytes of this sha256.
    Bytes(String),
}

/// An output whose place holds `found`, against the recorded `sha256`: `None` when it is as
/// recorded, else what the resume does about it.
pub(super) fn refetch(output: OutputRow, sha256: &str, found: Found) -> Option<Refetch> {
    match found {
        Found::Bytes(actual) if actual == sha256 => None,
        Found::Bytes(actual) => Some(Refetch {
            output,
            modified: Some(actual),
        }),
        Found::Missing => Some(Refetch {
            output,
            modified: None,
        }),
    }
}

/// The outputs of kept tasks whose file or object is missing or differs from the record.
pub(super) async fn outputs(
    store: &Store,
    run_id: &str,
    review: &Review,
) -> Result<Vec<Refetch>, StoreError> {
    let mut candidates = Vec::new();
    store
        .each_output(run_id, false, |o| {
            if review.is_kept(o.task_id)
                && let (Some(path), Some(sha)) = (&o.path, &o.sha256)
            {
                candidates.push((o.clone(), PathBuf::from(path), sha.clone()));
            }
            Ok(())
        })
        .await?;
    let in_store = |(_, path, _): &(OutputRow, PathBuf, String)| is_object_url(path);
    // Split only when some are objects: a second list as long as a large run's outputs was
    // a few MiB more for every local resume.
    let (objects, candidates): (Vec<_>, Vec<_>) = if candidates.iter().any(in_store) {
        candidates.into_iter().partition(in_store)
    } else {
        (Vec::new(), candidates)
    };
    let checked_objects = super::objects::check_all(objects).await;
    let mut checked = tokio::task::spawn_blocking(move || {
        candidates
            .into_iter()
            .filter_map(|(o, path, sha)| {
                let found = file_sha256(&path).map_or(Found::Missing, Found::Bytes);
                refetch(o, &sha, found)
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| StoreError::Inconsistent(e.to_string()))?;
    checked.extend(checked_objects);
    Ok(checked)
}
