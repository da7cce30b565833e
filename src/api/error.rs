//! Failures of a call, classified by what they mean for billing.
//!
//! Every paid call ends in one of three ways when it fails: it was never sent (safe to retry),
//! the server answered with an error (nothing billed), or it was sent and no complete answer
//! came back (it may have been billed). Retries, budgets and resumes rest on that distinction,
//! so it is a type, never a string.

use std::time::Duration;

use crate::api::job_id::JobId;
use crate::api::rules::InvalidField;

/// Longest part of an error body kept in a message.
const BODY_EXCERPT_CHARS: usize = 300;

/// What a failed call means for the bill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Billing {
    /// The request never left the machine, or never reached the server.
    NotSent,
    /// The server replied with an error status: nothing was billed.
    Answered,
    /// The request was sent and no complete answer came back: it may have been billed.
    Ambiguous,
}

/// The meaning of an error status. The spec shows no error codes, so this is read from the
/// HTTP status alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 401/403: the key is missing, wrong or not allowed.
    Auth,
    /// 402: the balance cannot pay for the call.
    Credits,
    /// 400/422: the service rejected the request.
    InvalidRequest,
    /// 404: no such job, tool or endpoint.
    NotFound,
    /// 429: too many requests; wait `retry_after`.
    RateLimited,
    /// 5xx: the service failed.
    Server,
    /// Any other status.
    Other,
}

impl ErrorKind {
    pub fn from_status(status: u16) -> Self {
        match status {
            401 | 403 => ErrorKind::Auth,
            402 => ErrorKind::Credits,
            400 | 422 => ErrorKind::InvalidRequest,
            404 => ErrorKind::NotFound,
            429 => ErrorKind::RateLimited,
            500..=599 => ErrorKind::Server,
            _ => ErrorKind::Other,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Credits => "not enough credits",
            ErrorKind::InvalidRequest => "request rejected",
            ErrorKind::NotFound => "not found",
            ErrorKind::RateLimited => "rate limited",
            ErrorKind::Server => "server error",
            ErrorKind::Other => "unexpected status",
        }
    }

    fn hint(self) -> Option<&'static str> {
        match self {
            ErrorKind::Auth => Some("check IMGPIPE_API_KEY or the file given to --api-key-file"),
            ErrorKind::Credits => Some("top up the account or lower the batch; nothing was billed"),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Caught on the client: the request was not sent.
    #[error("invalid request: {0}")]
    Invalid(#[from] InvalidField),

    #[error("{endpoint}: could not reach the service: {reason}")]
    NotSent { endpoint: String, reason: String },

    #[error("{endpoint}: {} (HTTP {status}){}: {body}{}", kind.describe(), retry_suffix(*retry_after), hint_suffix(*kind))]
    Answered {
        endpoint: String,
        status: u16,
        kind: ErrorKind,
        retry_after: Option<Duration>,
        /// A truncated, key-redacted copy of the body.
        body: String,
    },

    #[error(
        "{endpoint}: sent, but no complete answer came back ({reason}){}{}",
        billing_note(endpoint),
        recovery_note(job_id.as_ref())
    )]
    Ambiguous {
        endpoint: String,
        reason: String,
        /// The job id, when the partial answer named one: the way to recover what was paid for.
        job_id: Option<JobId>,
    },
}

fn retry_suffix(retry_after: Option<Duration>) -> String {
    retry_after
        .map(|d| format!(", retry after {:.1}s", d.as_secs_f64()))
        .unwrap_or_default()
}

/// Only the POST endpoints bill; a lost answer to a read costs nothing.
fn is_paid(endpoint: &str) -> bool {
    endpoint.starts_with("POST ")
}

fn billing_note(endpoint: &str) -> &'static str {
    if is_paid(endpoint) {
        "; it may have been billed"
    } else {
        ""
    }
}

fn recovery_note(job_id: Option<&JobId>) -> String {
    job_id
        .map(|id| format!("\nhint: the service named job {id}; `imgpipe job {id} --out DIR` fetches its images without paying again"))
        .unwrap_or_default()
}

fn hint_suffix(kind: ErrorKind) -> String {
    kind.hint()
        .map(|h| format!("\nhint: {h}"))
        .unwrap_or_default()
}

impl ApiError {
    pub fn billing(&self) -> Billing {
        match self {
            ApiError::Invalid(_) | ApiError::NotSent { .. } => Billing::NotSent,
            ApiError::Answered { .. } => Billing::Answered,
            ApiError::Ambiguous { .. } => Billing::Ambiguous,
        }
    }

    /// The kind of an answered error; `None` when the server did not answer.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ApiError::Answered { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Answered { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// Whether the same call may succeed if tried again later without risk of paying twice.
    /// An ambiguous paid call is not transient in that sense: retrying it is a billing decision
    /// the caller makes explicitly. An ambiguous read is safe to retry.
    pub fn is_transient(&self) -> bool {
        match self {
            ApiError::NotSent { .. } => true,
            ApiError::Answered { kind, .. } => {
                matches!(kind, ErrorKind::RateLimited | ErrorKind::Server)
            }
            ApiError::Ambiguous { endpoint, .. } => !is_paid(endpoint),
            ApiError::Invalid(_) => false,
        }
    }
}

/// Keeps the start of an error body, on a character boundary, for a message.
pub fn excerpt(body: &str) -> String {
    let body = body.trim();
    let mut out: String = body.chars().take(BODY_EXCERPT_CHARS).collect();
    if out.len() < body.len() {
        out.push_str("...");
    }
    if out.is_empty() {
        out.push_str("(empty body)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_kinds() {
        let expect = [
            (401, ErrorKind::Auth),
            (403, ErrorKind::Auth),
            (402, ErrorKind::Credits),
            (400, ErrorKind::InvalidRequest),
            (422, ErrorKind::InvalidRequest),
            (404, ErrorKind::NotFound),
            (429, ErrorKind::RateLimited),
            (503, ErrorKind::Server),
            (418, ErrorKind::Other),
        ];
        for (status, kind) in expect {
            assert_eq!(ErrorKind::from_status(status), kind);
        }
    }

    #[test]
    fn a_lost_answer_to_a_read_is_safe_to_retry_but_not_one_to_a_paid_call() {
        let lost = |endpoint: &str| ApiError::Ambiguous {
            endpoint: endpoint.into(),
            reason: "reset".into(),
            job_id: None,
        };
        let paid = lost("POST /v1/images/generations");
        assert!(!paid.is_transient());
        assert!(paid.to_string().ends_with("it may have been billed"));
        let read = lost("GET /v1/account");
        assert!(read.is_transient());
        assert!(!read.to_string().contains("billed"));
        assert_eq!(read.billing(), Billing::Ambiguous);
    }

    #[test]
    fn excerpt_truncates_on_char_boundary() {
        let long = "é".repeat(1000);
        let cut = excerpt(&long);
        assert!(cut.ends_with("...") && cut.chars().count() == BODY_EXCERPT_CHARS + 3);
        assert_eq!(excerpt(""), "(empty body)");
    }
}
