//! Where a file or directory of a run is, as a value: a local path or an object's URL, parsed
//! once from what the user wrote (`--out`, `output_dir`) or the state database holds
//! (`runs.output_dir`, `outputs.path`), and written back as the very text the database keeps.
//! Code that must tell the two apart matches on the enum; nothing asks a string's scheme.

use std::fmt;
use std::path::{Path, PathBuf};

/// What a place for outputs may be, for messages that refuse another.
pub const SUPPORTED: &str = "a local path, file:///absolute/path, or s3://bucket/prefix";

/// A file or directory: on this machine, or in object storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Local(PathBuf),
    Object(ObjectUrl),
}

impl Address {
    /// `--out` of a run or a report, and a pipeline's `output_dir`: a local path (`file:///abs`
    /// is that path) or an `s3://bucket/prefix` URL, kept as its normal form; any other URL is
    /// refused, saying what is supported. `what` names the option or field in the message.
    pub fn parse(text: &str, what: &str) -> Result<Address, String> {
        match ObjectUrl::parse(text) {
            Some(Ok(url)) => Ok(Address::Object(url)),
            Some(Err(why)) => Err(format!("{what} {why}")),
            None => match url_scheme(text) {
                Some(scheme) if !scheme.eq_ignore_ascii_case("file") => Err(format!(
                    "{what} `{text}` is a {scheme}:// URL, which imgpipe cannot write to; give {SUPPORTED}"
                )),
                _ => local_path(text, what).map(Address::Local),
            },
        }
    }

    /// An address as the state database holds it: the text [`Address`]'s `Display` wrote
    /// (checked when it was first parsed, so it is taken as it is).
    pub fn recorded(text: &str) -> Address {
        match ObjectUrl::recorded(text) {
            Some(url) => Address::Object(url),
            None => Address::Local(PathBuf::from(text)),
        }
    }

    /// The file or directory `name` inside this directory (`name` may have `/` between parts).
    pub fn join(&self, name: &str) -> Address {
        match self {
            Address::Local(dir) => Address::Local(dir.join(name)),
            Address::Object(url) => Address::Object(url.join(name)),
        }
    }

    /// The directory this is in; `None` at a bucket's root or a path's.
    pub fn parent(&self) -> Option<Address> {
        match self {
            Address::Local(path) => path.parent().map(|p| Address::Local(p.to_path_buf())),
            Address::Object(url) => url.parent().map(Address::Object),
        }
    }

    /// The last part of the name.
    pub fn file_name(&self) -> Option<String> {
        match self {
            Address::Local(path) => path.file_name().map(|n| n.to_string_lossy().into_owned()),
            Address::Object(url) => url.key.rsplit('/').next().map(str::to_owned),
        }
        .filter(|n| !n.is_empty())
    }

    /// This address relative to `dir`, when it lies under it (`s3://b/r/a.png` under
    /// `s3://b/r`, not under `s3://b/r2`).
    pub fn relative_to(&self, dir: &Address) -> Option<String> {
        match (self, dir) {
            (Address::Local(path), Address::Local(dir)) => path
                .strip_prefix(dir)
                .ok()
                .map(|rel| rel.to_string_lossy().into_owned()),
            (Address::Object(url), Address::Object(dir)) => url.under(dir).map(str::to_owned),
            _ => None,
        }
    }

    /// A relative local path made absolute against the working directory, so a resume from
    /// elsewhere (cron) finds the same files; an object's URL is absolute already.
    pub fn absolute(&self) -> std::io::Result<Address> {
        match self {
            Address::Local(path) => std::path::absolute(path).map(Address::Local),
            Address::Object(_) => Ok(self.clone()),
        }
    }

    pub fn as_local(&self) -> Option<&Path> {
        match self {
            Address::Local(path) => Some(path),
            Address::Object(_) => None,
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Local(path) => path.display().fmt(f),
            Address::Object(url) => url.fmt(f),
        }
    }
}

impl serde::Serialize for Address {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
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
        let url = ObjectUrl::recorded(s)?;
        Some(url.check(s).map(|()| url))
    }

    /// The bucket and key of an `s3://` URL, unchecked; `None` for anything else.
    fn recorded(s: &str) -> Option<ObjectUrl> {
        let scheme = url_scheme(s).filter(|s| s.eq_ignore_ascii_case("s3"))?;
        let rest = &s[scheme.len() + "://".len()..];
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        Some(ObjectUrl {
            bucket: bucket.to_owned(),
            key: key.trim_end_matches('/').to_owned(),
        })
    }

    /// Whether the store would take this bucket and key as they are; `s` is the URL as the
    /// user wrote it, for the message.
    pub fn check(&self, s: &str) -> Result<(), String> {
        let bucket = &self.bucket;
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'));
        if !bucket_ok {
            return Err(format!(
                "`{s}`: `{bucket}` is not a bucket name (3 to 63 lowercase letters, digits, `-` and `.`)"
            ));
        }
        if !self.key.is_empty()
            && self
                .key
                .split('/')
                .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return Err(format!(
                "`{s}`: the prefix must be plain names separated by single `/` (no empty, `.` or `..` part)"
            ));
        }
        Ok(())
    }

    /// The object or prefix `name` under this one (empty parts of `name` skipped).
    pub fn join(&self, name: &str) -> ObjectUrl {
        let mut key = self.key.clone();
        for part in name.split('/').filter(|p| !p.is_empty()) {
            if !key.is_empty() {
                key.push('/');
            }
            key.push_str(part);
        }
        ObjectUrl {
            bucket: self.bucket.clone(),
            key,
        }
    }

    /// This object's key relative to the prefix `dir`, when it lies under it.
    pub fn under(&self, dir: &ObjectUrl) -> Option<&str> {
        if self.bucket != dir.bucket {
            return None;
        }
        if dir.key.is_empty() {
            return Some(&self.key);
        }
        self.key.strip_prefix(&dir.key)?.strip_prefix('/')
    }

    /// The prefix this is in; `None` at the bucket's root.
    pub fn parent(&self) -> Option<ObjectUrl> {
        if self.key.is_empty() {
            return None;
        }
        let key = self.key.rsplit_once('/').map_or("", |(dir, _)| dir);
        Some(ObjectUrl {
            bucket: self.bucket.clone(),
            key: key.to_owned(),
        })
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.key)
        }
    }
}

/// Where a place the user names for state or outputs is a URL (`scheme://…`): its scheme.
/// A URL must never be taken for a relative path (that would create `./s3:/bucket/` and go on
/// as if nothing were wrong).
pub fn url_scheme(place: &str) -> Option<&str> {
    let (scheme, _) = place.split_once("://")?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some(scheme)
}

/// A local path from what the user wrote: `file:///abs/path` is that path, any other URL is
/// refused with what to do instead; `what` names the option or field in the message.
pub fn local_path(place: &str, what: &str) -> Result<PathBuf, String> {
    match url_scheme(place) {
        None => Ok(PathBuf::from(place)),
        Some(scheme) if scheme.eq_ignore_ascii_case("file") => {
            let path = &place[scheme.len() + 3..];
            if path.starts_with('/') {
                Ok(PathBuf::from(path))
            } else {
                Err(format!(
                    "{what} `{place}`: a file:// URL names an absolute path (file:///…); or give the path itself"
                ))
            }
        }
        Some(scheme) => Err(format!(
            "{what} `{place}` is a {scheme}:// URL, and imgpipe reads and writes only local files: give a local path (a mounted directory works)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_urls_are_checked_and_normalised() {
        let ok = |s: &str| ObjectUrl::parse(s).unwrap().unwrap();
        assert_eq!(ok("s3://bkt/a/b/").key, "a/b");
        assert_eq!(ok("S3://bkt").to_string(), "s3://bkt");
        assert!(ObjectUrl::parse("/tmp/x").is_none());
        for bad in ["s3://", "s3://B/x", "s3://bkt//x", "s3://bkt/a/../b"] {
            assert!(ObjectUrl::parse(bad).unwrap().is_err(), "{bad}");
        }
        assert_eq!(
            Address::parse("s3://bkt/p/", "--out").unwrap().to_string(),
            "s3://bkt/p"
        );
        assert_eq!(
            Address::parse("file:///tmp/o", "--out").unwrap(),
            Address::Local("/tmp/o".into())
        );
        let refused = Address::parse("gs://b/p", "--out").unwrap_err();
        assert!(refused.contains("s3://bucket/prefix"), "{refused}");
    }

    #[test]
    fn recorded_text_reads_back_as_written() {
        for text in [
            "/out/r/a/x.png",
            "out/r",
            "s3://bkt",
            "s3://bkt/p/r/a/x.png",
        ] {
            assert_eq!(Address::recorded(text).to_string(), text);
        }
        let run = Address::recorded("s3://bkt/p/r");
        assert_eq!(run.join("a/x.png").to_string(), "s3://bkt/p/r/a/x.png");
        assert_eq!(run.parent().unwrap().to_string(), "s3://bkt/p");
        assert_eq!(Address::recorded("s3://bkt").parent(), None);
        assert_eq!(run.file_name().as_deref(), Some("r"));
        assert_eq!(
            Address::recorded("s3://bkt/x").join("").to_string(),
            "s3://bkt/x"
        );
    }

    #[test]
    fn an_address_lies_under_a_directory_of_its_kind() {
        let under = |a: &str, dir: &str| Address::recorded(a).relative_to(&Address::recorded(dir));
        assert_eq!(
            under("s3://b/p/r/a/x.png", "s3://b/p/r").as_deref(),
            Some("a/x.png")
        );
        assert_eq!(under("s3://b/p/r2/a/x.png", "s3://b/p/r"), None);
        assert_eq!(under("s3://c/p/r/a/x.png", "s3://b/p/r"), None);
        assert_eq!(
            under("s3://b/a/x.png", "s3://b").as_deref(),
            Some("a/x.png")
        );
        assert_eq!(under("/out/r/a.png", "/out/r").as_deref(), Some("a.png"));
        assert_eq!(under("/out/r/a.png", "/elsewhere"), None);
        assert_eq!(under("s3://b/out/r/a.png", "/out/r"), None);
    }
}
