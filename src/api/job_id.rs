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
