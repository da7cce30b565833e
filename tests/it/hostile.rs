//! What the sandbox cannot produce: a tiny fake service on 127.0.0.1 that answers with canned,
//! sometimes hostile responses, against the real client, the real downloader and the real
//! binary.
//!
//! Each test builds its own fake with only the routes it needs; the fake records every request
//! (method, path, whether it carried `X-API-Key`) so a test can count what was asked.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use imgpipe::api::download::{DEFAULT_MAX_BYTES, DownloadError};
use imgpipe::api::job_id::JobId;
use imgpipe::api::retry::MAX_RETRY_AFTER;
use imgpipe::api::{
    ApiError, Billing, Downloader, ErrorKind, GenerationRequest, ToolParams, ToolRequest,
};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::process::Command;

use crate::common::{
    FAKE_KEY, Fake, Imgpipe, assert_exit_without_panic, entries, finish, generation, json_stdout,
    leftovers, sample_png, sha256_hex, stderr, stdout, tree,
};

const GENERATIONS: &str = "/v1/images/generations";

// ---------------------------------------------------------------------------------------------
// The fake service
// ---------------------------------------------------------------------------------------------

/// A canned JSON answer with the given status.
fn json_reply(status: u16, body: Value) -> Response {
    (StatusCode::from_u16(status).unwrap(), axum::Json(body)).into_response()
}

/// POST answered with `status` and `body`, every time.
fn post_json(status: u16, body: Value) -> MethodRouter {
    post(move || async move { json_reply(status, body) })
}

/// GET answered with `status` and `body`, every time.
fn get_json(status: u16, body: Value) -> MethodRouter {
    get(move || async move { json_reply(status, body) })
}

/// GET answered with these bytes as a PNG, with a Content-Length.
fn get_png(bytes: Vec<u8>) -> MethodRouter {
    get(move || async move { ([(CONTENT_TYPE, "image/png")], bytes).into_response() })
}

/// GET answered with these bytes as a PNG in one chunk of a stream: no Content-Length, so
/// nothing but the bytes themselves can say whether the image is whole.
fn get_png_streamed(bytes: Vec<u8>) -> MethodRouter {
    get(move || async move {
        let chunks = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from(bytes))]);
        Response::builder()
            .header(CONTENT_TYPE, "image/png")
            .body(Body::from_stream(chunks))
            .unwrap()
    })
}

/// The downloader runs use, with short timeouts.
fn downloader() -> Downloader {
    Downloader::new(
        Duration::from_secs(5),
        Duration::from_secs(10),
        DEFAULT_MAX_BYTES,
    )
}

// ---------------------------------------------------------------------------------------------
// Helpers for the binary and the file system
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// 1. A job id that is a path
// ---------------------------------------------------------------------------------------------

/// The service names the job `/../../escape` (or `../../escape`): used as a file name, the
/// image would land at `/escape-0.png` or two levels above the output directory. It must land
/// inside `--out`, under a name derived from a digest of the id.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_id_that_is_a_path_never_leaves_the_output_directory() {
    let png = sample_png();
    let absolute_target = Path::new("/escape-0.png");
    let existed_before = absolute_target.exists();
    for id in ["/../../escape", "../../escape", "\u{1b}[31m/../../escape"] {
        let root = tempfile::tempdir().unwrap();
        // Two levels of room, so a relative climb would still land inside the temp tree
        // where the check below sees it.
        let cwd = root.path().join("work").join("run");
        std::fs::create_dir_all(&cwd).unwrap();
        let served = png.clone();
        let fake = Fake::start(|base| {
            Router::new()
                .route(
                    GENERATIONS,
                    post_json(200, generation(id, &format!("{base}img/0.png"))),
                )
                .route("/img/0.png", get_png(served))
        })
        .await;

        let o = fake
            .run(&["generate", "--prompt", "x", "--out", "out"], &cwd)
            .await;
        let leaked = absolute_target.exists() && !existed_before;
        if leaked {
            let _ = std::fs::remove_file(absolute_target);
        }
        assert!(!leaked, "{id:?}: the image was written to /escape-0.png");
        assert_exit_without_panic(&o, 0);
        assert!(
            !stdout(&o).contains('\u{1b}') && !stderr(&o).contains('\u{1b}'),
            "{id:?}: a control sequence from the service reached the terminal"
        );

        let name = format!("job-{}-0.png", &sha256_hex(id.as_bytes())[..16]);
        let expected: Vec<PathBuf> = [
            "work",
            "work/run",
            "work/run/out",
            &format!("work/run/out/{name}"),
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(
            tree(root.path()),
            expected,
            "{id:?}: one file, inside out/, nothing else anywhere"
        );
        let written = cwd.join("out").join(&name);
        assert_eq!(std::fs::read(&written).unwrap(), png, "{id:?}");
        assert!(
            stdout(&o).contains(&format!("saved out/{name}")),
            "{id:?}: {}",
            stdout(&o)
        );
        assert!(
            stderr(&o).contains("not safe as a file name"),
            "{}",
            stderr(&o)
        );
        assert_eq!(fake.count("POST", GENERATIONS), 1);
        assert_eq!(fake.count("GET", "/img/0.png"), 1);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Absurd Retry-After values
// ---------------------------------------------------------------------------------------------

fn rate_limited(retry_after: &'static str) -> MethodRouter {
    axum::routing::any(move || async move {
        let mut response = json_reply(429, json!({"error": {"message": "slow down"}}));
        response
            .headers_mut()
            .insert(RETRY_AFTER, retry_after.parse().unwrap());
        response
    })
}

#[tokio::test]
async fn an_absurd_retry_after_is_capped_and_never_panics() {
    let cases = [
        ("2", Duration::from_secs(2)),
        ("1e30", MAX_RETRY_AFTER),
        ("1e400", MAX_RETRY_AFTER),
        ("inf", MAX_RETRY_AFTER),
        ("99999999999999999999999", MAX_RETRY_AFTER),
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_AFTER),
    ];
    for (header, expected) in cases {
        let fake = Fake::start(|_| {
            Router::new()
                .route(GENERATIONS, rate_limited(header))
                .route("/v1/account", rate_limited(header))
        })
        .await;
        let client = fake.client();
        let paid = client
            .generate(&GenerationRequest::new("x"))
            .await
            .unwrap_err();
        let read = client.account().await.unwrap_err();
        for err in [&paid, &read] {
            match err {
                ApiError::Answered {
                    status: 429,
                    kind: ErrorKind::RateLimited,
                    ..
                } => {}
                other => panic!("Retry-After {header:?}: expected a 429, got {other:?}"),
            }
            assert_eq!(err.billing(), Billing::Answered);
            assert!(err.is_transient());
            assert_eq!(err.retry_after(), Some(expected), "Retry-After {header:?}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("retry after {:.1}s", expected.as_secs_f64())),
                "{text}"
            );
        }
        assert_eq!(fake.total(), 2);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_reports_an_absurd_retry_after_without_waiting_or_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::start(|_| Router::new().route("/v1/account", rate_limited("1e30"))).await;
    let started = Instant::now();
    let o = fake.run(&["account"], dir.path()).await;
    assert_exit_without_panic(&o, 1);
    // A ceiling far below the day asked for, and far above a loaded machine's start-up.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "waited {:?} on a Retry-After of 1e30",
        started.elapsed()
    );
    let err = stderr(&o);
    assert!(err.contains("rate limited (HTTP 429)"), "{err}");
    assert!(err.contains("retry after 86400.0s"), "{err}");
    assert_eq!(fake.count("GET", "/v1/account"), 1);
}

// ---------------------------------------------------------------------------------------------
// 3. Spellings of a paid answer
// ---------------------------------------------------------------------------------------------

async fn generate_against(body: Value) -> Result<imgpipe::api::GenerationJob, ApiError> {
    let fake = Fake::start(|_| Router::new().route(GENERATIONS, post_json(200, body))).await;
    let result = fake.client().generate(&GenerationRequest::new("x")).await;
    assert_eq!(fake.count("POST", GENERATIONS), 1);
    result
}

#[track_caller]
fn expect_ambiguous(result: Result<impl std::fmt::Debug, ApiError>, job: Option<&str>) -> String {
    let err = result.expect_err("a success body without documented fields is not a success");
    match &err {
        ApiError::Ambiguous { job_id, .. } => assert_eq!(job_id.as_deref(), job, "{err}"),
        other => panic!("expected an ambiguous answer, got {other:?}"),
    }
    assert_eq!(err.billing(), Billing::Ambiguous);
    assert!(!err.is_transient(), "retrying may pay twice");
    let text = err.to_string();
    assert!(text.contains("may have been billed"), "{text}");
    text
}

#[tokio::test]
async fn credits_written_as_a_whole_float_are_accepted() {
    let mut body = generation("job_f1", "http://127.0.0.1:1/img.png");
    body["credits_used"] = json!(4.0);
    body["credits_remaining"] = json!(996.0);
    let job = generate_against(body).await.unwrap();
    assert_eq!(job.id.as_str(), "job_f1");
    assert_eq!(job.credits_used, 4);
    assert_eq!(job.credits_remaining, Some(996));
    assert_eq!(job.images.len(), 1);
}

#[tokio::test]
async fn a_paid_answer_lacking_fields_is_ambiguous_and_names_a_safe_job_id() {
    let mut missing = generation("job_x1", "http://127.0.0.1:1/img.png");
    missing.as_object_mut().unwrap().remove("credits_used");
    let text = expect_ambiguous(generate_against(missing.clone()).await, Some("job_x1"));
    assert!(text.contains("imgpipe job job_x1"), "{text}");
    assert!(
        text.contains("credits_used"),
        "says what is missing: {text}"
    );

    // Credits that are not whole are not documented either.
    let mut fractional = generation("job_x2", "http://127.0.0.1:1/img.png");
    fractional["credits_used"] = json!(4.5);
    let text = expect_ambiguous(generate_against(fractional).await, Some("job_x2"));
    assert!(text.contains("imgpipe job job_x2"), "{text}");

    // An id that is not a plain id is never offered as something to run.
    for hostile in ["../x1", "job x1", "-rf", ""] {
        let mut body = missing.clone();
        body["id"] = json!(hostile);
        let text = expect_ambiguous(generate_against(body).await, None);
        assert!(!text.contains("imgpipe job"), "{hostile:?}: {text}");
    }
    let mut numeric = missing;
    numeric["id"] = json!(12345);
    expect_ambiguous(generate_against(numeric).await, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_names_the_recovery_command_when_a_paid_answer_lacks_fields() {
    let dir = tempfile::tempdir().unwrap();
    let mut body = generation("job_x1", "http://127.0.0.1:1/img.png");
    body.as_object_mut().unwrap().remove("credits_used");
    let fake = Fake::start(|_| Router::new().route(GENERATIONS, post_json(200, body))).await;
    let o = fake
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("may have been billed"), "{err}");
    assert!(err.contains("imgpipe job job_x1 --out DIR"), "{err}");
    assert!(!dir.path().join("out").exists());
    assert_eq!(fake.total(), 1, "no second paid call, no download");
}

// ---------------------------------------------------------------------------------------------
// 4. Gateway errors, by billing
// ---------------------------------------------------------------------------------------------

async fn fake_answering(status: u16) -> Fake {
    let body = json!({"error": {"message": "upstream trouble"}});
    Fake::start(|_| {
        Router::new()
            .route(GENERATIONS, post_json(status, body.clone()))
            .route("/v1/images/tools/{tool}", post_json(status, body.clone()))
            .route("/v1/account", get_json(status, body.clone()))
            .route("/v1/jobs/{id}", get_json(status, body))
    })
    .await
}

#[track_caller]
fn expect_answered(err: &ApiError, status: u16) {
    match err {
        ApiError::Answered {
            status: got,
            kind: ErrorKind::Server,
            ..
        } => assert_eq!(*got, status, "{err}"),
        other => panic!("expected an answered HTTP {status}, got {other:?}"),
    }
    assert_eq!(err.billing(), Billing::Answered);
    assert!(err.is_transient(), "{err}");
    assert!(!err.to_string().contains("billed"), "{err}");
}

#[tokio::test]
async fn a_gateway_error_on_a_paid_call_is_ambiguous_but_not_on_a_read() {
    let tool = ToolRequest::new("https://example.com/a.png", ToolParams::RemoveBackground);
    for status in [502, 504] {
        let fake = fake_answering(status).await;
        let client = fake.client();
        let paid = [
            client
                .generate(&GenerationRequest::new("x"))
                .await
                .unwrap_err(),
            client.tool(&tool).await.unwrap_err(),
        ];
        for err in &paid {
            assert!(
                matches!(err, ApiError::Ambiguous { job_id: None, .. }),
                "HTTP {status} on a POST: {err:?}"
            );
            assert_eq!(err.billing(), Billing::Ambiguous);
            assert!(!err.is_transient(), "retrying may pay twice");
            assert_eq!(err.kind(), None);
            let text = err.to_string();
            assert!(text.contains(&status.to_string()), "{text}");
            assert!(text.contains("may have been billed"), "{text}");
        }
        // Reads are not billed: a gateway error there is an ordinary, retryable answer.
        expect_answered(&client.account().await.unwrap_err(), status);
        expect_answered(
            &client.job(&JobId::from("job_1")).await.unwrap_err(),
            status,
        );
        assert_eq!(fake.count("POST", GENERATIONS), 1);
        assert_eq!(fake.count("POST", "/v1/images/tools/remove_background"), 1);
        assert_eq!(fake.total(), 4);
    }

    // A 503 is the service saying no: answered, nothing billed, worth retrying.
    let fake = fake_answering(503).await;
    let client = fake.client();
    let err = client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    expect_answered(&err, 503);
    expect_answered(&client.tool(&tool).await.unwrap_err(), 503);
    expect_answered(&client.account().await.unwrap_err(), 503);
}

// ---------------------------------------------------------------------------------------------
// 5. A refused result URL
// ---------------------------------------------------------------------------------------------

/// A generation `job_r1` whose URL `/stale.png` answers 403; `GET /v1/jobs/job_r1` names
/// `fresh_path` instead, and `/fresh.png` serves the PNG.
async fn fake_with_stale_url(fresh_path: &'static str, png: Vec<u8>) -> Fake {
    Fake::start(|base| {
        let mut record = generation("job_r1", &format!("{base}{}", &fresh_path[1..]));
        record["created_at"] = json!(1_700_000_000);
        Router::new()
            .route(
                GENERATIONS,
                post_json(200, generation("job_r1", &format!("{base}stale.png"))),
            )
            .route("/v1/jobs/job_r1", get_json(200, record))
            .route(
                "/stale.png",
                get_json(403, json!({"error": {"message": "expired"}})),
            )
            .route("/fresh.png", get_png(png))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_result_url_is_replaced_by_a_fresh_one_from_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let png = sample_png();
    let fake = fake_with_stale_url("/fresh.png", png.clone()).await;
    let o = fake
        .run(
            &["generate", "--json", "--prompt", "x", "--out", "out"],
            dir.path(),
        )
        .await;
    assert_exit_without_panic(&o, 0);
    let path = dir.path().join("out").join("job_r1-0.png");
    assert_eq!(entries(&dir.path().join("out")), vec![path.clone()]);
    assert_eq!(std::fs::read(&path).unwrap(), png);
    let out = json_stdout(&o);
    assert_eq!(out["job"]["id"], "job_r1");
    assert_eq!(out["error"], Value::Null);
    assert_eq!(out["files"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(out["files"][0]["sha256"], sha256_hex(&png));

    assert_eq!(fake.count("POST", GENERATIONS), 1, "never paid twice");
    let jobs = fake.hits("GET", "/v1/jobs/job_r1");
    assert_eq!(jobs.len(), 1, "one jobs call");
    assert!(jobs[0].with_key, "the jobs call is authenticated");
    for file in ["/stale.png", "/fresh.png"] {
        let hits = fake.hits("GET", file);
        assert_eq!(hits.len(), 1, "{file}");
        assert!(
            !hits[0].with_key,
            "{file}: a download never carries the key"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fresh_url_that_is_refused_too_is_given_up_after_one_refresh() {
    let dir = tempfile::tempdir().unwrap();
    let fake = fake_with_stale_url("/stale.png", sample_png()).await;
    let o = fake
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    assert_exit_without_panic(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("refused (HTTP 403)"), "{err}");
    assert!(err.contains("imgpipe job job_r1 --out out"), "{err}");
    assert_eq!(fake.count("GET", "/v1/jobs/job_r1"), 1, "refreshed once");
    assert_eq!(fake.count("GET", "/stale.png"), 2);
    assert_eq!(fake.count("POST", GENERATIONS), 1);
}

// ---------------------------------------------------------------------------------------------
// 6. A PNG cut short without a Content-Length to betray it
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_png_cut_short_without_content_length_is_unfinished_and_leaves_nothing() {
    let png = sample_png();
    let half = png[..png.len() / 2].to_vec();
    let fake = Fake::start(|_| {
        Router::new()
            .route("/half.png", get_png_streamed(half.clone()))
            .route("/whole.png", get_png_streamed(png.clone()))
    })
    .await;
    // The premise: the body really comes without a length.
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(fake.url("/half.png"))
        .send()
        .await
        .unwrap();
    assert!(response.headers().get(CONTENT_LENGTH).is_none());
    assert_eq!(response.bytes().await.unwrap().len(), half.len());

    let downloader = downloader();
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("d");
    let err = downloader
        .fetch(&fake.url("/half.png"), target.as_path(), "img")
        .await
        .unwrap_err();
    match &err {
        DownloadError::Unfinished { got, format } => {
            assert_eq!((*got, *format), (half.len() as u64, "png"));
        }
        other => panic!("expected an unfinished download, got {other:?}"),
    }
    assert!(err.is_transient(), "worth trying again");
    assert!(!err.needs_fresh_url());
    assert_eq!(
        leftovers(&target),
        Vec::<PathBuf>::new(),
        "no file, no .part"
    );

    // The same delivery of a whole PNG is fine: the check reads the image, not the headers.
    let got = downloader
        .fetch(&fake.url("/whole.png"), target.as_path(), "img")
        .await
        .unwrap();
    assert_eq!(got.path, target.join("img.png"));
    assert_eq!(std::fs::read(&got.path).unwrap(), png);
    assert_eq!(got.sha256.as_str(), sha256_hex(&png));
    assert_eq!(entries(&target), vec![got.path]);
}

/// A body larger than the downloader holds in memory (256 KiB) goes through a temporary file:
/// whole, it lands with its every byte; cut short, it leaves neither file nor `.part`.
#[tokio::test]
async fn a_large_png_streams_through_a_temporary_file_and_a_cut_one_leaves_nothing() {
    let png = sample_png();
    // The downloader checks the magic bytes and the IEND chunk: padding between them makes a
    // body of any size that it takes for a whole PNG.
    let (body, end) = png.split_at(png.len() - 12);
    let mut large = body.to_vec();
    large.extend((0..700_000u32).map(|i| (i % 251) as u8));
    large.extend_from_slice(end);
    let cut = large[..large.len() / 2].to_vec();
    let in_chunks = |bytes: Vec<u8>| {
        get(move || {
            let bytes = bytes.clone();
            async move {
                let chunks: Vec<Result<Bytes, std::io::Error>> = bytes
                    .chunks(64 * 1024)
                    .map(|c| Ok(Bytes::copy_from_slice(c)))
                    .collect();
                Response::builder()
                    .header(CONTENT_TYPE, "image/png")
                    .body(Body::from_stream(futures::stream::iter(chunks)))
                    .unwrap()
            }
        })
    };
    let fake = Fake::start(|_| {
        Router::new()
            .route("/large.png", in_chunks(large.clone()))
            .route("/cut.png", in_chunks(cut.clone()))
    })
    .await;
    let downloader = downloader();
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("d");

    let err = downloader
        .fetch(&fake.url("/cut.png"), target.as_path(), "img")
        .await
        .unwrap_err();
    assert!(
        matches!(err, DownloadError::Unfinished { got, .. } if got == cut.len() as u64),
        "{err:?}"
    );
    assert_eq!(entries(&target), Vec::<PathBuf>::new(), "no file, no .part");

    let got = downloader
        .fetch(&fake.url("/large.png"), target.as_path(), "img")
        .await
        .unwrap();
    assert_eq!(got.path, target.join("img.png"));
    assert_eq!(got.bytes, large.len() as u64);
    assert_eq!(std::fs::read(&got.path).unwrap(), large);
    assert_eq!(got.sha256.as_str(), sha256_hex(&large));
    assert_eq!(entries(&target), vec![got.path]);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_retries_an_unfinished_png_four_times_then_fails() {
    let dir = tempfile::tempdir().unwrap();
    let png = sample_png();
    let half = png[..png.len() / 2].to_vec();
    let fake = Fake::start(|base| {
        Router::new()
            .route(
                GENERATIONS,
                post_json(200, generation("job_h1", &format!("{base}half.png"))),
            )
            .route("/half.png", get_png_streamed(half))
    })
    .await;
    let o = fake
        .run(&["generate", "--prompt", "x", "--out", "out"], dir.path())
        .await;
    assert_exit_without_panic(&o, 1);
    assert_eq!(fake.count("GET", "/half.png"), 4, "four tries");
    assert_eq!(fake.count("POST", GENERATIONS), 1, "never paid twice");
    assert_eq!(
        fake.count("GET", "/v1/jobs/job_h1"),
        0,
        "the URL was not refused"
    );
    let err = stderr(&o);
    assert!(
        err.contains("stopped before the end of the png image"),
        "{err}"
    );
    assert!(err.contains("retrying"), "{err}");
    assert!(err.contains("imgpipe job job_h1 --out out"), "{err}");
    assert_eq!(
        leftovers(&dir.path().join("out")),
        Vec::<PathBuf>::new(),
        "no partial file"
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Proxies from the environment never see loopback traffic
// ---------------------------------------------------------------------------------------------

const PROXY_VARS: [&str; 6] = [
    "http_proxy",
    "HTTP_PROXY",
    "https_proxy",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "all_proxy",
];

fn with_proxy(mut cmd: Command, proxy: &str) -> Command {
    for var in PROXY_VARS {
        cmd.env(var, proxy);
    }
    cmd.env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .env_remove("REQUEST_METHOD");
    cmd
}

/// A listener standing in for a proxy: counts connections and keeps what each sent first.
async fn proxy_trap() -> (String, Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = vec![0u8; 256];
            let n = tokio::time::timeout(Duration::from_secs(2), socket.read(&mut buf))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or(0);
            log.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            // Dropping the socket refuses to proxy anything.
        }
    });
    (url, seen, task)
}

#[tokio::test(flavor = "multi_thread")]
async fn proxies_from_the_environment_never_see_loopback_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let generate = [
        "generate",
        "--sandbox",
        "--prompt",
        "x",
        "--n",
        "2",
        "--out",
    ];

    // A closed port as the proxy: anything sent through it would fail.
    let mut args = generate.to_vec();
    args.push("closed");
    let o = finish(with_proxy(
        Imgpipe::new(&args).cwd(dir.path()).command(),
        "http://127.0.0.1:9",
    ))
    .await;
    assert_exit_without_panic(&o, 0);
    let files = entries(&dir.path().join("closed"));
    assert_eq!(files.len(), 2, "{files:?}");
    for file in &files {
        assert!(std::fs::read(file).unwrap().starts_with(b"\x89PNG"));
    }

    // A listening "proxy": it must not even be contacted.
    let (proxy, seen, trap) = proxy_trap().await;
    let mut args = generate.to_vec();
    args.push("trapped");
    let o = finish(with_proxy(
        Imgpipe::new(&args).cwd(dir.path()).command(),
        &proxy,
    ))
    .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(entries(&dir.path().join("trapped")).len(), 2);
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );

    // The control: these variables do reach the binary's HTTP stack, for a remote service.
    let mut cmd = with_proxy(
        Imgpipe::new(&[
            "account",
            "--base-url",
            "https://api.example.invalid/",
            "--connect-timeout",
            "3",
        ])
        .cwd(dir.path())
        .command(),
        &proxy,
    );
    cmd.env("IMGPIPE_API_KEY", FAKE_KEY);
    let o = finish(cmd).await;
    assert_exit_without_panic(&o, 1);
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|s| s.starts_with("CONNECT api.example.invalid:443")),
        "the remote call went to the proxy: {seen:?}"
    );
    trap.abort();
}

// ---------------------------------------------------------------------------------------------
// Account fields where no default looks
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn account_fields_are_read_where_the_user_points() {
    let dir = tempfile::tempdir().unwrap();
    let record = json!({
        "subscription": {"tier": "pro"},
        "quota": {"rpm": 60},
        "wallet": {"credits": 17},
    });
    let fake = Fake::start(|_| Router::new().route("/v1/account", get_json(200, record))).await;

    let o = fake.run(&["account"], dir.path()).await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(text.contains("plan     unknown"), "{text}");
    assert!(text.contains("limits   unknown"), "{text}");
    assert!(stderr(&o).contains("--plan-field"), "{}", stderr(&o));
    assert!(stderr(&o).contains("--limits-field"), "{}", stderr(&o));

    let o = fake
        .run(
            &[
                "account",
                "--plan-field",
                "/subscription/tier",
                "--limits-field",
                "/quota",
                "--balance-field",
                "/wallet/credits",
            ],
            dir.path(),
        )
        .await;
    assert_exit_without_panic(&o, 0);
    let text = stdout(&o);
    assert!(
        text.contains("plan     pro  (from /subscription/tier)"),
        "{text}"
    );
    assert!(
        text.contains("balance  17 credits  (from /wallet/credits)"),
        "{text}"
    );
    assert!(text.contains("{\"rpm\":60}  (from /quota)"), "{text}");

    for (flag, pointer) in [
        ("--plan-field", "/quota"),
        ("--plan-field", "/nope"),
        ("--limits-field", "/subscription/tier"),
        ("--limits-field", "/nope"),
    ] {
        let o = fake.run(&["account", flag, pointer], dir.path()).await;
        assert_exit_without_panic(&o, 2);
        assert!(
            stderr(&o).contains(pointer),
            "{flag} {pointer}: {}",
            stderr(&o)
        );
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    }
}
