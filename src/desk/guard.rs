//! What every request to the desk passes before any handler, and what every response carries.
//!
//! A local server that can spend is an attack surface: any web page the person opens can send
//! requests to loopback (a form post, a `fetch` without CORS, DNS rebinding). So:
//! - `Host` must be the desk's own address (`127.0.0.1:PORT` or `localhost:PORT`): a rebound
//!   name is refused;
//! - every request carries the token: the `Authorization: Bearer` header, the `token` query
//!   parameter of the URL the desk printed (which sets a same-site, script-proof cookie for
//!   the page's images and scripts), or that cookie;
//! - a request that changes anything is a `POST` with a JSON body, the token in the
//!   `Authorization` header (never the cookie alone: a browser attaches cookies for other
//!   pages' requests, never headers) and an `Origin` that is the desk's;
//! - every response forbids loading anything from elsewhere (`Content-Security-Policy`).

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use super::Desk;

/// The cookie the token's URL sets.
pub const COOKIE: &str = "imgpipe_desk";

/// What every response says of what the page may load: nothing from elsewhere.
pub const CSP: &str = "default-src 'self'; img-src 'self' data:; script-src 'self'; \
     style-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; \
     form-action 'none'";

/// Why a request is refused: its status and words.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub why: String,
}

impl Refused {
    fn new(status: StatusCode, why: impl Into<String>) -> Refused {
        Refused {
            status,
            why: why.into(),
        }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.why });
        (self.status, axum::Json(body)).into_response()
    }
}

/// What a request that passed is: whether it brought the token in its URL (then the
/// response sets the cookie).
#[derive(Debug, PartialEq, Eq)]
pub struct Passed {
    pub from_url: bool,
}

/// The middleware: [`check`], then the handler, then the headers every response carries.
pub async fn guard(State(desk): State<Arc<Desk>>, request: Request, next: Next) -> Response {
    let checked = check(
        &desk,
        request.method(),
        request.headers(),
        request.uri().query(),
    );
    let mut response = match checked {
        Ok(passed) => {
            let mut response = next.run(request).await;
            if passed.from_url {
                let cookie = format!(
                    "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
                    desk.token.reveal()
                );
                if let Ok(value) = HeaderValue::from_str(&cookie) {
                    response.headers_mut().insert(header::SET_COOKIE, value);
                }
            }
            response
        }
        Err(refused) => refused.into_response(),
    };
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
    let from_cookie = text(headers, header::COOKIE).and_then(token_in_cookies);
    let given = bearer.or(from_url.as_deref()).or(from_cookie);
    if !given.is_some_and(|t| desk.token.matches(t)) {
        return Err(Refused::new(StatusCode::UNAUTHORIZED, NO_TOKEN));
    }
    if *method == Method::GET || *method == Method::HEAD {
        return Ok(Passed {
            from_url: from_url.is_some(),
        });
    }
    change(desk, method, headers, bearer)?;
    Ok(Passed { from_url: false })
}

/// What the 401 says: how to get the URL with the token again.
pub const NO_TOKEN: &str = "this desk needs its token: open the URL `imgpipe review` printed on \
     its first line (http://127.0.0.1:PORT/?token=…); run `imgpipe review` again for a new one";

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

fn token_in_cookies(cookies: &str) -> Option<&str> {
    cookies
        .split(';')
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v)
}
