//! Where a run's files go: a local directory, as always, or a prefix in object storage
//! (`s3://bucket/prefix`, and any S3-compatible store the `AWS_*` environment points at).
//!
//! A run directory is named by one string everywhere it is kept (the `runs.output_dir`
//! column, `exec::Config::run_dir`): a local path, or the object URL itself. The outputs'
//! `path` column holds, likewise, the file's path or its object's full URL
//! (`s3://bucket/prefix/<run>/<item>/<name>.<ext>`), so any record of an output says where it is
//! without knowing the run it came from. Inside a prefix the names are the ones
//! [`layout`] gives a local run directory.
//!
//! Credentials come only from the store's usual environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`, …): never from
//! a flag, so they are never in the shell history, the database or a resume command.

mod keep;
pub mod layout;
pub mod local;
mod objects;
pub mod temp;

use std::path::{Path, PathBuf};

pub use keep::Downloaded;
pub use local::{LocalFile, copy_checked, file_sha256};
pub use objects::{Listed, ObjectError, Objects, Stat, same_etag, strong_etag};

use layout::url_scheme;

/// What a place for outputs may be, for messages that refuse another.
pub const SUPPORTED: &str = "a local path, file:///absolute/path, or s3://bucket/prefix";

/// A directory of a run's files: local, or a prefix in a bucket.
#[derive(Clone, Debug)]
pub enum Place {
    Local(PathBuf),
    Objects(Objects),
}

impl Place {
    /// The place a run directory's name (or any directory under it) stands for. Opening a
    /// store makes no request; it fails only when the URL or the environment is unusable.
    pub fn of(dir: &Path) -> Result<Place, ObjectError> {
        match ObjectUrl::parse(&dir.to_string_lossy()) {
            None => Ok(Place::Local(dir.to_path_buf())),
            Some(Err(why)) => Err(ObjectError::Config(why)),
            Some(Ok(url)) => Objects::open(&url).map(Place::Objects),
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
    /// here; a local directory is checked when it is written.
    pub async fn check(&self) -> Result<(), ObjectError> {
        match self {
            Place::Local(_) => Ok(()),
            Place::Objects(o) => o.check().await,
        }
    }
}

/// Whether a recorded path (or a place a user named) is an object's URL rather than a local
/// file's path.
pub fn is_object_url(path: impl AsRef<std::ffi::OsStr>) -> bool {
    url_scheme(&path.as_ref().to_string_lossy()).is_some_and(|s| s.eq_ignore_ascii_case("s3"))
}

/// `s3://bucket/key`, checked: a bucket name, and a key of plain segments (no empty one,
/// no `.` or `..`) that the store would not rewrite.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectUrl {
    pub bucket: String,
    /// Without a leading or trailing `/`; empty for the bucket's root.
    pub key: String,
}

impl ObjectUrl {
    /// `None` when `s` is not an `s3://` URL at all.
    pub fn parse(s: &str) -> Option<Result<ObjectUrl, String>> {
        if !is_object_url(s) {
            return None;
        }
        let rest = &s["s3://".len()..];
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        let key = key.trim_end_matches('/');
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'));
        if !bucket_ok {
            return Some(Err(format!(
                "`{s}`: `{bucket}` is not a bucket name (3 to 63 lowercase letters, digits, `-` and `.`)"
            )));
        }
        if !key.is_empty()
            && key
                .split('/')
                .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return Some(Err(format!(
                "`{s}`: the prefix must be plain names separated by single `/` (no empty, `.` or `..` part)"
            )));
        }
        Some(Ok(ObjectUrl {
            bucket: bucket.to_owned(),
            key: key.to_owned(),
        }))
    }

    pub fn to_url(&self) -> String {
        if self.key.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.key)
        }
    }
}

/// `--out` of a run or a report, and a pipeline's `output_dir`: a local path (`file:///abs`
/// is that path) or an `s3://bucket/prefix` URL, kept as its normal form; any other URL is
/// refused, saying what is supported. `what` names the option or field in the message.
pub fn output_place(place: &str, what: &str) -> Result<PathBuf, String> {
    match ObjectUrl::parse(place) {
        Some(Ok(url)) => Ok(PathBuf::from(url.to_url())),
        Some(Err(why)) => Err(format!("{what} {why}")),
        None => match url_scheme(place) {
            Some(scheme) if !scheme.eq_ignore_ascii_case("file") => Err(format!(
                "{what} `{place}` is a {scheme}:// URL, which imgpipe cannot write to; give {SUPPORTED}"
            )),
            _ => layout::local_path(place, what),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_urls_are_checked_and_normalised() {
        let ok = |s: &str| ObjectUrl::parse(s).unwrap().unwrap();
        assert_eq!(ok("s3://bkt/a/b/").key, "a/b");
        assert_eq!(ok("S3://bkt").to_url(), "s3://bkt");
        assert!(ObjectUrl::parse("/tmp/x").is_none());
        for bad in ["s3://", "s3://B/x", "s3://bkt//x", "s3://bkt/a/../b"] {
            assert!(ObjectUrl::parse(bad).unwrap().is_err(), "{bad}");
        }
        assert_eq!(
            output_place("s3://bkt/p/", "--out").unwrap(),
            Path::new("s3://bkt/p")
        );
        assert_eq!(
            output_place("file:///tmp/o", "--out").unwrap(),
            Path::new("/tmp/o")
        );
        let refused = output_place("gs://b/p", "--out").unwrap_err();
        assert!(refused.contains("s3://bucket/prefix"), "{refused}");
    }
}
