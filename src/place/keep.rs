//! A run's downloads kept in its place: in a local directory as [`super::local`] writes files,
//! or in a prefix of object storage, create-only.

use tempfile::NamedTempFile;

use crate::api::download::{Body, Checked, Destination, DownloadError};
use crate::sha256::Sha256Sum;

use super::{Address, ObjectError, Objects, Place, local};

/// A run's output, kept whole in its place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Downloaded {
    pub address: Address,
    pub bytes: u64,
    pub sha256: Sha256Sum,
    /// The ETag the store gave the object (`None` from a store that gives none), or a local
    /// file's [`local::stamp`]: what says, without reading it, that it is still the one kept.
    pub etag: Option<String>,
}

impl Destination for Place {
    type Kept = Downloaded;

    async fn spill(&self, stem: &str) -> Result<NamedTempFile, DownloadError> {
        match self {
            Place::Local(dir) => local::spill_in(dir, stem).await,
            // An upload's body waits in the system's temporary directory, and goes with it.
            Place::Objects(_) => local::spill_in(&std::env::temp_dir(), stem).await,
        }
    }

    async fn keep(&self, stem: &str, body: Checked) -> Result<Downloaded, DownloadError> {
        match self {
            Place::Local(dir) => {
                let file = dir.as_path().keep(stem, body).await?;
                Ok(Downloaded {
                    address: Address::Local(file.path),
                    bytes: file.bytes,
                    sha256: file.sha256,
                    etag: file.stamp,
                })
            }
            Place::Objects(objects) => keep_object(objects, stem, body).await,
        }
    }
}

/// Puts a checked body under `<stem>.<ext>`: in one create-only PUT when it was small enough to
/// hold, else from its temporary file in parts; either way nothing is visible under the final
/// key before the whole body is.
async fn keep_object(
    dir: &Objects,
    stem: &str,
    checked: Checked,
) -> Result<Downloaded, DownloadError> {
    let key = dir.key(&format!("{stem}.{}", checked.ext));
    let sha256 = checked.sha256;
    let written = match checked.body {
        Body::Held(chunks) => {
            dir.put_new(&key, chunks.into_iter().collect(), &sha256)
                .await
        }
        Body::Spilled(part) => dir.put_new_file(&key, part.path(), &sha256).await,
    };
    let etag = written.map_err(|e| match e {
        ObjectError::Exists { url } => DownloadError::Exists { at: url },
        other => DownloadError::Store {
            store_failed: other.is_store_failure(),
            reason: other.to_string(),
        },
    })?;
    // A crash here leaves an object no record names: the output is fetched again from its
    // job, and its create-only write finds the same sha256 there, a finished upload.
    crate::failpoint::hit("object-written-unrecorded");
    Ok(Downloaded {
        address: Address::Object(dir.url_of(&key)),
        bytes: checked.bytes,
        sha256,
        etag,
    })
}
