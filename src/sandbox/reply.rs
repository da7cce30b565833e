//! What every handler of the sandbox shares: the state it is given, and an error answer in the
//! service's JSON shape. Apart from the router, so the handlers of files and of the API both
//! use it without needing each other.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State as Shared;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::api::rules::InvalidField;
use crate::api::types::ErrorBody;
use crate::api::types::ErrorDetail;
use crate::sandbox::state::State;

/// The sandbox's state, as every handler receives it.
pub(super) type App = Shared<Arc<State>>;

/// An error answer in the sandbox's JSON shape.
pub(super) struct Reply {
    status: StatusCode,
    detail: ErrorDetail,
    retry_after: Option<u64>,
}

impl Reply {
    pub(super) fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        Reply {
            status,
            detail: ErrorDetail {
                code: code.into(),
                message: message.into(),
                field: None,
            },
            retry_after: None,
        }
    }

    pub(super) fn rate_limited(message: &str, wait: Duration) -> Self {
        let mut reply = Reply::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message);
        // Retry-After is whole seconds; rounding up never invites an early retry.
        reply.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
        reply
    }
}

impl From<InvalidField> for Reply {
    fn from(e: InvalidField) -> Self {
        let mut reply = Reply::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string());
        reply.detail.field = Some(e.field);
        reply
    }
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let mut response =
            (self.status, axum::Json(ErrorBody { error: self.detail })).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
