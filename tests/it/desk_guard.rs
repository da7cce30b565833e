//! The desk keeps its credential and cannot be held, against a real `imgpipe review` on
//! 127.0.0.1: the token's URL opens a session of its own (a cookie named for the port, never
//! the token, that reads and never spends); a half-sent request is closed after the header
//! timeout and does not keep the desk from stopping; an unknown run is 404 wherever it is
//! named, and every error is `{"error": …, "hint": …}`.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;
use crate::desk::{Catalogue, Served, serve_with};

/// A client that shows redirects rather than following them, and keeps no cookies.
fn plain() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(RUN_LIMIT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The `Set-Cookie` headers of `r`.
fn set_cookies(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

/// The body of an error: JSON with `error` (text) and `hint` (text or null).
async fn error_json(r: reqwest::Response, what: &str) -> serde_json::Value {
    let kind = r
        .headers()
        .get("content-type")
        .map(|c| c.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = r.text().await.unwrap();
    assert!(
        kind.starts_with("application/json"),
        "{what}: {kind} {text}"
    );
    let body: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {e}: {text}"));
    assert!(body["error"].is_string(), "{what}: {body}");
    assert!(
        body["hint"].is_string() || body["hint"].is_null(),
        "{what}: {body}"
    );
    assert_eq!(body.as_object().unwrap().len(), 2, "{what}: {body}");
    body
}

#[tokio::test(flavor = "multi_thread")]
async fn the_token_url_opens_a_session_of_its_own_named_for_the_port_that_reads_and_never_spends() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let calls = env.sandbox.ledger().len();
    let (desk, other) = (serve_with(&c, &[]).await, serve_with(&c, &[]).await);
    let (base, token, port) = (desk.base.clone(), desk.token.clone(), desk.port);
    let http = plain();
    let mut seen = Vec::new();

    // The token's URL: a redirect to itself without the token (other parameters kept), and
    // the cookie of a session.
    let r = http
        .get(format!("{base}/runs/r?view=grid&token={token}&x=a%20b"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers()["location"].to_str().unwrap(),
        format!("http://127.0.0.1:{port}/runs/r?view=grid&x=a%20b")
    );
    seen.extend(set_cookies(&r));
    let set = set_cookies(&r);
    assert_eq!(set.len(), 1, "{set:?}");
    let (pair, attributes) = set[0].split_once(';').unwrap();
    let (name, secret) = pair.split_once('=').unwrap();
    assert_eq!(name, format!("imgpipe_desk_{port}"), "named for the port");
    assert!(secret.len() >= 32, "a secret: {secret}");
    assert_ne!(secret, token, "the cookie is not the token");
    let attributes: Vec<&str> = attributes.split(';').map(str::trim).collect();
    for a in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(attributes.contains(&a), "{a} in {attributes:?}");
    }
    let cookie = pair.to_owned();
    let r = http
        .get(format!("{base}/?token={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers()["location"].to_str().unwrap(),
        format!("http://127.0.0.1:{port}/")
    );
    seen.extend(set_cookies(&r));

    // The cookie alone opens the page (its script still given the token for its POSTs), the
    // items and the images.
    let get = |path: &str, cookie: &str| {
        http.get(format!("{base}{path}"))
            .header("cookie", cookie)
            .send()
    };
    let r = get("/runs/r", &cookie).await.unwrap();
    assert_eq!(r.status(), 200);
    seen.extend(set_cookies(&r));
    let page = r.text().await.unwrap();
    assert!(
        page.contains(&format!(
            r#"<meta name="imgpipe-desk-token" content="{token}">"#
        )),
        "{page}"
    );
    let r = get("/api/runs/r/items", &cookie).await.unwrap();
    assert_eq!(r.status(), 200);
    seen.extend(set_cookies(&r));
    let items: serde_json::Value = r.json().await.unwrap();
    let src = items["items"][0]["tasks"][0]["outputs"][0]["src"]
        .as_str()
        .unwrap_or_else(|| panic!("an output: {items}"))
        .to_owned();
    let r = get(&src, &cookie).await.unwrap();
    assert_eq!(r.status(), 200, "{src}");
    assert_eq!(r.headers()["content-type"], "image/png");
    seen.extend(set_cookies(&r));
    let r = get("/", &cookie).await.unwrap();
    assert_eq!(r.status(), 200, "the home");

    // The cookie alone cannot make a change, even from the desk's own page.
    let r = http
        .post(format!("{base}/api/runs/r/reroll"))
        .header("cookie", &cookie)
        .header("origin", &base)
        .header("content-type", "application/json")
        .body(r#"{"tasks":["mug/clean[0]"],"credits":16}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "the cookie alone does not spend");
    seen.extend(set_cookies(&r));
    error_json(r, "the cookie alone").await;

    // Another desk's cookie is not this desk's: neither as it is, nor under this one's name.
    let r = http
        .get(format!("{}/?token={}", other.base, other.token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    let others = set_cookies(&r);
    seen.extend(others.clone());
    let other_pair = others[0].split(';').next().unwrap().to_owned();
    let (other_name, other_secret) = other_pair.split_once('=').unwrap();
    assert_eq!(other_name, format!("imgpipe_desk_{}", other.port));
    let renamed = format!("imgpipe_desk_{port}={other_secret}");
    for (what, cookie) in [
        ("as it is", &other_pair),
        ("under this desk's name", &renamed),
    ] {
        let r = get("/api/runs", cookie).await.unwrap();
        assert_eq!(r.status(), 401, "another desk's cookie {what}");
        error_json(r, what).await;
    }
    let r = get("/api/runs", &format!("{other_pair}; {cookie}"))
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "beside another desk's, its own cookie holds"
    );

    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");
    for set in &seen {
        assert!(
            !set.contains(&token) && !set.contains(&other.token),
            "a token in a Set-Cookie: {set}"
        );
    }
    let (ended, other_ended) = (desk.stop().await, other.stop().await);
    for err in [&ended, &other_ended] {
        assert!(!err.contains(&token), "the token is never logged: {err}");
        assert!(!err.contains(secret), "nor a session's secret: {err}");
        assert!(!err.contains(other_secret), "nor a session's secret: {err}");
    }
}

/// A connection to the desk that has sent `GET / HTTP/1.1` and its `Host`, and nothing more.
async fn half_sent(desk: &Served) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", desk.port)).await.unwrap();
    let head = format!("GET / HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", desk.port);
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_half_sent_is_closed_by_the_desk_after_its_header_timeout() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let desk = serve_with(&c, &[]).await;

    let mut stream = half_sent(&desk).await;
    // The desk gives a request's head 10 s; without a timeout it would wait for ever.
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the desk still holds a half-sent request open after 30 s"
    );
    desk.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_sigterm_a_request_half_sent_does_not_keep_the_desk_from_exiting() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let mut desk = serve_with(&c, &[]).await;

    // A connection the desk has surely taken (it answered a first request on it), then a
    // second request begun on it and never finished.
    let mut stream = TcpStream::connect(("127.0.0.1", desk.port)).await.unwrap();
    let first = format!(
        "GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\n\r\n",
        desk.port, desk.token
    );
    stream.write_all(first.as_bytes()).await.unwrap();
    let (status, _) = read_answer(&mut stream).await;
    assert_eq!(status, 200);
    let second = format!("GET / HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", desk.port);
    stream.write_all(second.as_bytes()).await.unwrap();
    let mut idle = half_sent(&desk).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let signalled = Instant::now();
    send_signal(desk.child.id().unwrap(), libc::SIGTERM);
    let exited = tokio::time::timeout(Duration::from_secs(8), desk.child.wait()).await;
    let took = signalled.elapsed();
    assert!(
        exited.is_ok(),
        "the desk has not exited 8 s after SIGTERM with a half-sent request open"
    );
    eprintln!("the desk exited {took:?} after SIGTERM, a half-sent request open");
    assert_eq!(exited.unwrap().unwrap().code(), Some(0));
    stream.write_all(b"\r\n").await.ok();
    idle.write_all(b"\r\n").await.ok();
}

/// The status and body of an answer read from `stream` (by its `Content-Length`).
async fn read_answer(stream: &mut TcpStream) -> (u16, String) {
    let mut got = Vec::new();
    let mut chunk = [0u8; 8192];
    let answer = async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |n| n.trim().parse().unwrap());
                if got.len() >= end + 4 + length {
                    let status = head[9..12].parse().unwrap();
                    let body = String::from_utf8_lossy(&got[end + 4..end + 4 + length]);
                    return (status, body.into_owned());
                }
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the desk closed the connection before its answer");
            got.extend_from_slice(&chunk[..n]);
        }
    };
    within("the desk's answer", answer).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_run_is_404_wherever_it_is_named_and_every_error_is_json() {
    let env = start_sample_sized().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let calls = env.sandbox.ledger().len();
    let desk = serve_with(&c, &[]).await;
    let (base, bearer) = (desk.base.clone(), format!("Bearer {}", desk.token));
    let http = plain();
    let post = |path: &str, body: &'static str| {
        http.post(format!("{base}{path}"))
            .header("authorization", &bearer)
            .header("origin", &base)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let gets = [
        "/api/runs/nope",
        "/api/runs/nope/work",
        "/api/runs/nope/items",
        "/api/runs/nope/changes?since=0",
        "/runs/nope",
        "/runs/nope/head",
        "/runs/nope/files/mug/shot-0.png",
    ];
    for path in gets {
        let r = http
            .get(format!("{base}{path}"))
            .header("authorization", &bearer)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "GET {path}");
        let body = error_json(r, path).await;
        assert!(
            has_phrase(body["error"].as_str().unwrap(), "nope"),
            "{body}"
        );
    }
    let posts = [
        (
            "/api/runs/nope/reroll",
            r#"{"tasks":["mug"],"dry_run":true}"#,
        ),
        ("/api/runs/nope/reroll", r#"{"tasks":["mug"],"credits":1}"#),
        ("/api/runs/nope/continue", r#"{"dry_run":true}"#),
        ("/api/runs/nope/continue", r#"{"credits":1}"#),
    ];
    for (path, body) in posts {
        let r = post(path, body).await.unwrap();
        assert_eq!(r.status(), 404, "POST {path} {body}");
        error_json(r, path).await;
    }

    // A method an address does not take.
    let r = post("/api/runs", "{}").await.unwrap();
    assert_eq!(r.status(), 405, "POST /api/runs");
    error_json(r, "POST /api/runs").await;
    let r = http
        .get(format!("{base}/api/runs/r/reroll"))
        .header("authorization", &bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405, "GET of a POST's address");
    error_json(r, "GET /api/runs/r/reroll").await;
    let r = http
        .delete(format!("{base}/api/runs/r"))
        .header("authorization", &bearer)
        .header("origin", &base)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405, "DELETE");
    error_json(r, "DELETE").await;

    // The guard's own refusals, a path the desk does not have.
    let r = http.get(format!("{base}/api/runs")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body = error_json(r, "no token").await;
    assert!(
        body["hint"].as_str().unwrap().contains("imgpipe review"),
        "{body}"
    );
    let r = http
        .get(format!("{base}/nowhere"))
        .header("authorization", &bearer)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    error_json(r, "/nowhere").await;

    // A body a byte over the most the desk takes (2 MiB).
    let r = http
        .post(format!("{base}/api/runs/r/reroll"))
        .header("authorization", &bearer)
        .header("origin", &base)
        .header("content-type", "application/json")
        .body(vec![b' '; 2 * 1024 * 1024 + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let body = error_json(r, "a body too large").await;
    assert!(body["hint"].is_string(), "{body}");

    assert_eq!(env.sandbox.ledger().len(), calls, "nothing spent");
    desk.stop().await;
}
