//! What every request to the desk passes before any handler, and what every response carries.
//!
//! A local server that can spend is an attack surface: any web page the person opens can send
//! requests to loopback (a form post, a `fetch` without CORS, DNS rebinding). So:
//! - `Host` must be the desk's own address (`127.0.0.1:PORT` or `localhost:PORT`): a rebound
//!   name is refused;
//! - every request carries the token (the `Authorization: Bearer` header, or the `token` query
//!   parameter of the URL the desk printed) or a session's cookie: the token's URL is answered
//!   with a redirect to itself without the token, setting the cookie of a new session
//!   ([`session`](super::session): its own secret, never the token, named for the port);
//! - a request that changes anything is a `POST` with a JSON body, the token in the
//!   `Authorization` header (never the cookie alone: a browser attaches cookies for other
//!   pages' requests, never headers) and an `Origin` that is the desk's;
//! - every response forbids loading anything from elsewhere (`Content-Security-Policy`), and
//!   every error is `{"error": …, "hint": …}`, whoever made it.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use super::{Desk, session};

/// What every response says of what the page may load: nothing from elsewhere.
pub const CSP: &str = "default-src 'self'; img-src 'self' data:; script-src 'self'; \
     style-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; \
     form-action 'none'";

/// Why a request is refused: its status, words and what to do.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub why: String,
    pub hint: Option<&'static str>,
}

impl Refused {
    fn new(status: StatusCode, why: impl Into<String>) -> Refused {
        Refused {
            status,
            why: why.into(),
            hint: None,
        }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.why, "hint": self.hint });
        (self.status, axum::Json(body)).into_response()
    }
}

/// How a request that passed brought its credential.
#[derive(Debug, PartialEq, Eq)]
pub enum Passed {
    /// The `Authorization: Bearer` header, or a session's cookie.
    Held,
    /// The token in the URL (a `GET`): answered with the cookie of a new session and a
    /// redirect to the URL without it, the handler not run.
    FromUrl,
}

/// The middleware: [`check`], then the handler (or the redirect that opens a session), then
/// the headers every response carries, and any error made JSON.
pub async fn guard(State(desk): State<Arc<Desk>>, request: Request, next: Next) -> Response {
    let checked = check(
        &desk,
        request.method(),
        request.headers(),
        request.uri().query(),
    );
    let response = match checked {
        Ok(Passed::Held) => as_json(next.run(request).await).await,
        Ok(Passed::FromUrl) => open_session(&desk, &request),
        Err(refused) => refused.into_response(),
    };
    fixed_headers(response)
}

/// The answer to the token's URL: a new session's cookie, and a redirect (303) to the same
/// URL without the token (other parameters kept as they were written), at the `Host` asked
/// (the desk's own, checked): the token leaves the address bar, the history and the page.
fn open_session(desk: &Desk, request: &Request) -> Response {
    let secret = match desk.sessions.open() {
        Ok(secret) => secret,
        Err(e) => {
            return Refused::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot make a session's secret: {e}"),
            )
            .into_response();
        }
    };
    let host = text(request.headers(), header::HOST).unwrap_or_default();
    let rest = request.uri().query().map(without_token).unwrap_or_default();
    let mut location = format!("http://{host}{}", request.uri().path());
    if !rest.is_empty() {
        location.push('?');
        location.push_str(&rest);
    }
    let cookie = session::set_cookie(desk.port, &secret);
    let headers = [(header::LOCATION, location), (header::SET_COOKIE, cookie)];
    let mut response = (StatusCode::SEE_OTHER, Body::empty()).into_response();
    for (name, value) in headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// `query` without its `token` parameters, the others as written.
fn without_token(query: &str) -> String {
    query
        .split('&')
        .filter(|pair| !pair.is_empty() && !is_token(pair))
        .collect::<Vec<_>>()
        .join("&")
}

fn is_token(pair: &str) -> bool {
    url::form_urlencoded::parse(pair.as_bytes())
        .next()
        .is_some_and(|(k, _)| k == "token")
}

/// An error answered in anything but JSON (axum's own 405 and 413, a page's text) made the
/// documented `{"error": …, "hint": …}`, its status and other headers kept.
async fn as_json(response: Response) -> Response {
    /// The most of an error's text read to say it again.
    const MOST: usize = 16 * 1024;
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let said = axum::body::to_bytes(body, MOST)
        .await
        .ok()
        .and_then(|b| String::from_utf8(b.to_vec()).ok())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let why = match status {
        StatusCode::METHOD_NOT_ALLOWED => "refused: this address does not take that method",
        StatusCode::PAYLOAD_TOO_LARGE => "refused: the request's body is too large",
        _ => status.canonical_reason().unwrap_or("failed"),
    };
    let why = match (status, said) {
        (StatusCode::METHOD_NOT_ALLOWED | StatusCode::PAYLOAD_TOO_LARGE, _) | (_, None) => {
            why.to_owned()
        }
        (_, Some(said)) => said,
    };
    let hint = match status {
        StatusCode::PAYLOAD_TOO_LARGE => Some(
            "a POST's body is 2 MiB at most: name tasks by item or by step (`mug`, `*/clean`) rather than one by one",
        ),
        _ => None,
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    let mut refused = Refused::new(status, why);
    refused.hint = hint;
    let json = refused.into_response();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, json.into_body())
}

/// The headers every response carries.
fn fixed_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let fixed = [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// The checks, in order: the address, the token, then what a change needs.
pub fn check(
    desk: &Desk,
    method: &Method,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Passed, Refused> {
    let host = text(headers, header::HOST);
    if !desk.is_own_host(host) {
        return Err(Refused::new(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "refused: this desk answers at 127.0.0.1:{} only, not at `{}`",
                desk.port,
                host.unwrap_or("")
            ),
        ));
    }
    let bearer = text(headers, header::AUTHORIZATION).and_then(|a| a.strip_prefix("Bearer "));
    let from_url = query.and_then(token_in_query);
    // The first credential given is the one checked: a wrong token is refused even beside
    // a live session.
    let held = match bearer.or(from_url.as_deref()) {
        Some(given) => desk.token.matches(given),
        None => in_session(desk, headers),
    };
    if !held {
        return Err(Refused {
            status: StatusCode::UNAUTHORIZED,
            why: NO_TOKEN.to_owned(),
            hint: Some(NO_TOKEN_HINT),
        });
    }
    if *method == Method::GET || *method == Method::HEAD {
        return Ok(if bearer.is_none() && from_url.is_some() {
            Passed::FromUrl
        } else {
            Passed::Held
        });
    }
    change(desk, method, headers, bearer)?;
    Ok(Passed::Held)
}

/// Whether the request carries the cookie of one of this desk's live sessions.
fn in_session(desk: &Desk, headers: &HeaderMap) -> bool {
    let name = session::cookie_name(desk.port);
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|h| session::cookies(h, &name).any(|v| desk.sessions.holds(v)))
}

/// What the 401 says, and how to get the URL with the token again.
pub const NO_TOKEN: &str = "this desk needs its token";
pub const NO_TOKEN_HINT: &str = "open the URL `imgpipe review` printed on its first line \
     (http://127.0.0.1:PORT/?token=…); run `imgpipe review` again for a new one";

/// A change: a `POST` with a JSON body, the token in its `Authorization` header, sent by the
/// desk's own page.
fn change(
    desk: &Desk,
    method: &Method,
    headers: &HeaderMap,
    bearer: Option<&str>,
) -> Result<(), Refused> {
    if *method != Method::POST {
        return Err(Refused::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "refused: the desk changes things through POST only",
        ));
    }
    if !bearer.is_some_and(|t| desk.token.matches(t)) {
        return Err(Refused::new(
            StatusCode::UNAUTHORIZED,
            "refused: a POST carries the token in an `Authorization: Bearer` header",
        ));
    }
    let json = text(headers, header::CONTENT_TYPE)
        .and_then(|c| c.split(';').next())
        .is_some_and(|c| c.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(Refused::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "refused: a POST's body is JSON (`Content-Type: application/json`)",
        ));
    }
    let origin = text(headers, header::ORIGIN);
    if !origin.is_some_and(|o| desk.is_own_origin(o)) {
        return Err(Refused::new(
            StatusCode::FORBIDDEN,
            format!(
                "refused: a POST comes from the desk's own page (Origin http://127.0.0.1:{}), not from `{}`",
                desk.port,
                origin.unwrap_or("no origin")
            ),
        ));
    }
    Ok(())
}

fn text(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn token_in_query(query: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.into_owned())
}
