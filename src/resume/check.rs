//! The kept outputs compared with what is there now: a file (its sha256 read) or an object
//! (see [`super::objects`]). What differs is fetched again from its job, never paid again.

use crate::place::{Address, file_sha256};
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
    let (mut files, mut objects) = (Vec::new(), Vec::new());
    store
        .each_output(run_id, false, |o| {
            if review.is_kept(o.task_id)
                && let (Some(address), Some(sha)) = (o.address(), &o.sha256)
            {
                let sha = sha.clone();
                match address {
                    Address::Local(path) => files.push((o, path, sha)),
                    Address::Object(url) => objects.push((o, url, sha)),
                }
            }
            Ok(())
        })
        .await?;
    let checked_objects = super::objects::check_all(objects).await;
    let mut checked = tokio::task::spawn_blocking(move || {
        files
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
