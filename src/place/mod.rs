//! Where a run's files go, and how they are named and written there: a local directory, as
//! always, or a prefix in object storage (`s3://bucket/prefix`, and any S3-compatible store
//! the `AWS_*` environment points at).
//!
//! - [`Address`]: where a file or directory is, as a value parsed once (`--out`, `output_dir`,
//!   the database's text) and written back as the same text. The `runs.output_dir` and
//!   `outputs.path` columns hold that text: a local path, or the object's full URL
//!   (`s3://bucket/prefix/<run>/<item>/<name>.<ext>`), so any record of an output says where
//!   it is without knowing the run it came from.
//! - [`Place`]: an address opened, where downloads are kept (it is the api's download
//!   [`Destination`](crate::api::Destination)): [`local`] files written through a temporary
//!   file and never over other bytes, or [`Objects`] written create-only.
//! - [`layout`]: every name inside a run directory, the same on disk and in a bucket;
//!   [`temp`]: the temporary files, named so that a resume finds what a killed run left.
//!
//! Credentials come only from the store's usual environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`, …): never from
//! a flag, so they are never in the shell history, the database or a resume command.

mod address;
mod keep;
pub mod layout;
pub mod listing;
pub mod local;
mod objects;
pub mod temp;

use std::path::PathBuf;

pub use address::{Address, ObjectUrl, SUPPORTED, local_path, url_scheme};
pub use keep::Downloaded;
pub use layout::RunDir;
pub use local::{LocalFile, copy_checked, file_sha256, stamp};
pub use objects::{Listed, ObjectError, Objects, Stat, same_etag, strong_etag};

/// A directory of a run's files, opened: local, or a prefix in a bucket.
#[derive(Clone, Debug)]
pub enum Place {
    Local(PathBuf),
    Objects(Objects),
}

impl Place {
    /// The place `address` names. Opening a store makes no request; it fails only when the
    /// URL or the environment is unusable.
    pub fn open(address: &Address) -> Result<Place, ObjectError> {
        match address {
            Address::Local(dir) => Ok(Place::Local(dir.clone())),
            Address::Object(url) => Objects::open(url).map(Place::Objects),
        }
    }

    /// The directory (or prefix) `name` inside this one.
    pub fn join(&self, name: &str) -> Place {
        match self {
            Place::Local(dir) => Place::Local(dir.join(name)),
            Place::Objects(o) => Place::Objects(o.child(name)),
        }
    }

    /// Asks the store, before anything is paid for, whether it answers these credentials
    /// here; a local directory is checked by [`Place::probe`].
    pub async fn check(&self) -> Result<(), ObjectError> {
        match self {
            Place::Local(_) => Ok(()),
            Place::Objects(o) => o.check().await,
        }
    }

    /// Whether a local directory takes a file now, before anything is paid for (see
    /// [`local::probe`]). A bucket is not written to try it: its writes are create-only and
    /// the credentials may not remove what a try would leave; a bucket refusing writes stops
    /// the run at its first output.
    pub async fn probe(&self) -> Result<(), crate::api::download::DownloadError> {
        match self {
            Place::Local(dir) => local::probe(dir).await,
            Place::Objects(_) => Ok(()),
        }
    }
}
