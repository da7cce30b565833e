//! Job ids as the service hands them out: checked before one becomes a URL path or a file name,
//! and shown so that a hostile one cannot reach the terminal raw. A leaf: the client and the
//! reading of partial answers both use it.

/// Whether `id` looks like a job id: short, and safe in a URL path and as a file name, since
/// ids become both. An id from a response that fails this is never used as a path.
pub fn is_job_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && !id.starts_with('-')
}

/// A job id as it may be shown: as is when it is plainly an id, quoted and escaped otherwise,
/// so a hostile id cannot smuggle control sequences onto the terminal.
pub fn shown_id(job_id: &str) -> String {
    if is_job_id(job_id) {
        job_id.to_owned()
    } else {
        format!("{job_id:?}")
    }
}

/// A job's id as the service gave it and the record keeps it: taken as it is (a hostile one
/// is recorded too, so that what was paid for is never lost), checked with [`is_job_id`]
/// before it becomes a URL path or a file name, and [`JobId::shown`] safely. `Display` writes
/// it as it was given.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct JobId(String);

impl JobId {
    pub fn new(id: impl Into<String>) -> JobId {
        JobId(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as it may be shown on a terminal ([`shown_id`]).
    pub fn shown(&self) -> String {
        shown_id(&self.0)
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Read as text where text is wanted: a request's path, a message, a statement's parameter.
impl std::ops::Deref for JobId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for JobId {
    fn from(id: &str) -> JobId {
        JobId::new(id)
    }
}

impl From<String> for JobId {
    fn from(id: String) -> JobId {
        JobId(id)
    }
}

impl PartialEq<str> for JobId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}
