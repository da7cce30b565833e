//! The sandbox raw over HTTP, bypassing the client: status codes, error bodies, signed URLs,
//! downloads and injected faults, as any other caller would see them.

use std::path::Path;
use std::time::Duration;

use image::GenericImageView;
use imgpipe::api::download::DownloadError;
use imgpipe::checks::image::{SizePromise, Stats, not_blank, size, transparent};
use imgpipe::checks::{self, Outcome, Verdict};
use imgpipe::pipeline::checks::{DEFAULT_MIN_DISTANCE, DEFAULT_MIN_STDDEV};
use imgpipe::sandbox::{BadImages, Config, Faults, SAMPLE_HOST};
use reqwest::header::{CONTENT_TYPE, RETRY_AFTER};
use serde_json::{Value, json};

use crate::common::*;

const GENERATIONS: &str = "v1/images/generations";

/// GET on the sandbox with an optional key; the status and the JSON body (Null if none).
async fn raw_get(env: &Env, path: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = http().get(env.sandbox.base_url().join(path).unwrap());
    if let Some(key) = key {
        req = req.header("X-API-Key", key);
    }
    let response = req.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// A plain GET of a full URL, with no key: status, content type and bytes.
async fn fetch_raw(url: &str) -> (u16, String, Vec<u8>) {
    let response = http().get(url).send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (
        status,
        content_type,
        response.bytes().await.unwrap().to_vec(),
    )
}

/// Asserts the sandbox's error shape and returns the message.
fn error_of(body: &Value, code: &str) -> String {
    let error = body
        .get("error")
        .unwrap_or_else(|| panic!("no error object in {body}"));
    assert_eq!(error["code"], code, "{body}");
    let message = error["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message in {body}"));
    assert!(!message.is_empty());
    message.to_owned()
}

fn assert_invalid(status: u16, body: &Value, field: &str) -> String {
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], field, "{body}");
    error_of(body, "invalid_request")
}

async fn generate_raw(env: &Env) -> Value {
    let (status, body) = raw_post(env, GENERATIONS, &json!({"prompt": "a mug"})).await;
    assert_eq!(status, 200, "{body}");
    body
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn png_magic(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x89PNG\r\n\x1a\n")
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn invalid_generation_bodies_are_answered_400_naming_the_field() {
    let env = start_default().await;
    let base = env.sandbox.base_url().as_str();
    let cases = [
        (json!({}), "prompt"),
        (json!({"n": 1}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": "a".repeat(4001)}), "prompt"),
        (json!({"prompt": "x", "n": 0}), "n"),
        (json!({"prompt": "x", "n": 5}), "n"),
        (json!({"prompt": "x", "n": "2"}), "n"),
        (json!({"prompt": "x", "size": "8K"}), "size"),
        (
            json!({"prompt": "x", "image_urls": vec!["https://example.com/a.png"; 7]}),
            "image_urls",
        ),
        (
            json!({"prompt": "x", "image_urls": ["http://example.com/a.png"]}),
            "image_urls[0]",
        ),
        (
            json!({"prompt": "x", "image_urls": [format!("{base}assets/nosuch.png")]}),
            "image_urls[0]",
        ),
        (json!(["not", "an", "object"]), "body"),
    ];
    let count = cases.len() as u64;
    for (body, field) in cases {
        let (status, answer) = raw_post(&env, GENERATIONS, &body).await;
        let message = assert_invalid(status, &answer, field);
        assert!(message.starts_with(field), "{message}");
    }
    // A body that is not JSON at all.
    let response = http()
        .post(env.sandbox.base_url().join(GENERATIONS).unwrap())
        .header("X-API-Key", env.sandbox.key())
        .header(CONTENT_TYPE, "application/json")
        .body("{prompt:")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let answer: Value = response.json().await.unwrap();
    assert_invalid(400, &answer, "body");

    assert_eq!(env.sandbox.stats().invalid, count + 1);
    assert_nothing_billed(&env);
}

#[tokio::test]
async fn the_4000_character_limit_counts_characters() {
    let env = start_default().await;
    let (status, body) = raw_post(&env, GENERATIONS, &json!({"prompt": "日".repeat(4000)})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = raw_post(&env, GENERATIONS, &json!({"prompt": "日".repeat(4001)})).await;
    assert_invalid(status, &body, "prompt");
    assert_eq!(env.sandbox.ledger().len(), 1);
}

#[tokio::test]
async fn invalid_tool_bodies_are_answered_400_naming_the_field() {
    let env = start_default().await;
    let mug = format!("https://{SAMPLE_HOST}/assets/mug.png");
    let cases = [
        (
            "upscale",
            json!({"image_url": mug, "desired_increase": 3}),
            "desired_increase",
        ),
        (
            "upscale",
            json!({"image_url": mug, "desired_increase": "2"}),
            "desired_increase",
        ),
        (
            "expand",
            json!({"image_url": mug, "aspect_ratio": "wide"}),
            "aspect_ratio",
        ),
        (
            "expand",
            json!({"image_url": mug, "aspect_ratio": "16x9"}),
            "aspect_ratio",
        ),
        ("erase", json!({"image_url": mug}), "object_name"),
        (
            "erase",
            json!({"image_url": mug, "object_name": ""}),
            "object_name",
        ),
        ("remove_background", json!({}), "image_url"),
        (
            "remove_background",
            json!({"image_url": "assets/mug.png"}),
            "image_url",
        ),
        (
            "remove_background",
            json!({"image_url": mug, "preserve_alpha": "yes"}),
            "preserve_alpha",
        ),
        (
            "remove_background",
            json!({"image_url": format!("{}files/img_000001abcdef.png", env.sandbox.base_url())}),
            "image_url",
        ),
    ];
    for (tool, body, field) in cases {
        let (status, answer) = raw_post(&env, &format!("v1/images/tools/{tool}"), &body).await;
        assert_invalid(status, &answer, field);
    }
    // A well-formed URL elsewhere: the sandbox says it never fetches, rather than failing later.
    for tool in ["remove_background", "upscale", "expand"] {
        let (status, answer) = raw_post(
            &env,
            &format!("v1/images/tools/{tool}"),
            &json!({"image_url": "https://example.com/a.png"}),
        )
        .await;
        let message = assert_invalid(status, &answer, "image_url");
        assert!(message.contains("never fetches"), "{message}");
    }
    assert_nothing_billed(&env);
}

// ---------------------------------------------------------------------------------------------
// Authentication, unknown things, credits
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn requests_without_the_right_key_are_answered_401() {
    let env = start_default().await;
    let url = env.sandbox.base_url().join(GENERATIONS).unwrap();
    let body = json!({"prompt": "x"});
    let without = http().post(url.clone()).json(&body).send().await.unwrap();
    assert_eq!(without.status().as_u16(), 401);
    let answer: Value = without.json().await.unwrap();
    assert!(error_of(&answer, "unauthorized").contains("missing X-API-Key"));

    let wrong = http()
        .post(url)
        .header("X-API-Key", "sbx_not_the_key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let answer: Value = wrong.json().await.unwrap();
    let message = error_of(&answer, "unauthorized");
    assert!(message.contains("invalid API key"), "{message}");
    assert!(!answer.to_string().contains("sbx_not_the_key"), "{answer}");

    for path in ["v1/account", "v1/models", "v1/jobs/job_x", "_sandbox/stats"] {
        let (status, answer) = raw_get(&env, path, None).await;
        assert_eq!(status, 401, "{path}");
        error_of(&answer, "unauthorized");
        let (status, _) = raw_get(&env, path, Some("wrong")).await;
        assert_eq!(status, 401, "{path}");
    }
    assert_eq!(env.sandbox.stats().unauthorized, 10);
    assert_nothing_billed(&env);
}

#[tokio::test]
async fn unknown_jobs_tools_and_endpoints_are_answered_404() {
    let env = start_default().await;
    let key = Some(env.sandbox.key());
    let (status, body) = raw_get(&env, "v1/jobs/job_doesnotexist", key).await;
    assert_eq!(status, 404);
    assert!(error_of(&body, "not_found").contains("job_doesnotexist"));

    let mug = format!("https://{SAMPLE_HOST}/assets/mug.png");
    let (status, body) = raw_post(&env, "v1/images/tools/blur", &json!({"image_url": mug})).await;
    assert_eq!(status, 404, "{body}");
    assert!(error_of(&body, "not_found").contains("blur"));

    let (status, body) = raw_get(&env, "v1/nothing", key).await;
    assert_eq!(status, 404);
    error_of(&body, "not_found");
    let (status, body) = raw_post(&env, "v2/images/generations", &json!({"prompt": "x"})).await;
    assert_eq!(status, 404);
    error_of(&body, "not_found");
    assert_nothing_billed(&env);
}

#[tokio::test]
async fn a_balance_too_low_is_answered_402_and_leaves_the_balance() {
    let env = start_default().await;
    env.sandbox.set_balance(3);
    let (status, body) = raw_post(&env, GENERATIONS, &json!({"prompt": "x"})).await;
    assert_eq!(status, 402, "{body}");
    let message = error_of(&body, "insufficient_credits");
    assert!(message.contains("nothing was billed"), "{message}");
    let mug = format!("https://{SAMPLE_HOST}/assets/mug.png");
    let (status, body) = raw_post(
        &env,
        "v1/images/tools/upscale",
        &json!({"image_url": mug, "desired_increase": 4}),
    )
    .await;
    assert_eq!(status, 402, "{body}");
    error_of(&body, "insufficient_credits");
    assert_eq!(env.sandbox.balance(), 3);
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.stats().insufficient_credits, 2);
    // What the balance can pay still goes through.
    let (status, body) = raw_post(
        &env,
        "v1/images/tools/upscale",
        &json!({"image_url": mug, "desired_increase": 2}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["credits_used"], 2);
    assert_eq!(env.sandbox.balance(), 1);
    assert_eq!(env.sandbox.ledger().len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Result URLs
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn result_urls_download_without_a_key_and_refuse_tampering() {
    let env = start_default().await;
    let job = generate_raw(&env).await;
    let url = job["images"][0]["url"].as_str().unwrap().to_owned();
    let (status, content_type, bytes) = fetch_raw(&url).await;
    assert_eq!(status, 200);
    assert_eq!(content_type, "image/png");
    assert!(png_magic(&bytes));
    let img = image::load_from_memory(&bytes).unwrap();
    assert_eq!(img.dimensions(), (256, 256));

    let (head, sig) = url.rsplit_once("sig=").unwrap();
    let flipped = if sig.ends_with('0') { "1" } else { "0" };
    let tampered = format!("{head}sig={}{flipped}", &sig[..sig.len() - 1]);
    let unsigned = url.split_once('?').unwrap().0.to_owned();
    let (expires_part, _) = url.split_once("&sig=").unwrap();
    let later_expiry = {
        let (pre, exp) = expires_part.rsplit_once("expires=").unwrap();
        let exp: u64 = exp.parse().unwrap();
        format!("{pre}expires={}&sig={sig}", exp + 3_600_000)
    };
    for bad in [tampered, unsigned, later_expiry] {
        let response = http().get(&bad).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 403, "{bad}");
        let body: Value = response.json().await.unwrap();
        error_of(&body, "invalid_signature");
        let err = env
            .downloader
            .fetch(&bad, env.dir.path(), "bad")
            .await
            .unwrap_err();
        assert!(
            matches!(err, DownloadError::Expired { status: 403 }),
            "{err:?}"
        );
    }
    assert!(files_in(env.dir.path()).is_empty());
    assert_eq!(env.sandbox.stats().refused_downloads, 6);

    let got = env
        .downloader
        .fetch(&url, env.dir.path(), "result")
        .await
        .unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), bytes);
    assert_eq!(files_in(env.dir.path()), ["result.png"]);
}

#[tokio::test]
async fn expired_urls_are_refused_and_the_job_gives_fresh_ones() {
    let env = start_default().await;
    let job = generate_raw(&env).await;
    let id = job["id"].as_str().unwrap().to_owned();
    let url = job["images"][0]["url"].as_str().unwrap().to_owned();
    let (status, _, original) = fetch_raw(&url).await;
    assert_eq!(status, 200, "a fresh URL must download");
    // Its lifetime passed, without waiting for the clock (`POST /_sandbox/expire-urls`).
    let (status, _) = raw_post(&env, "_sandbox/expire-urls", &json!({})).await;
    assert_eq!(status, 204);

    let response = http().get(&url).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 403);
    let body: Value = response.json().await.unwrap();
    assert!(error_of(&body, "url_expired").contains("/v1/jobs/"));

    let (status, body) = raw_post(
        &env,
        "v1/images/tools/remove_background",
        &json!({"image_url": url}),
    )
    .await;
    let message = assert_invalid(status, &body, "image_url");
    assert!(message.contains("expired"), "{message}");

    let (status, record) = raw_get(&env, &format!("v1/jobs/{id}"), Some(env.sandbox.key())).await;
    assert_eq!(status, 200, "{record}");
    assert_eq!(record["id"], id.as_str());
    assert_eq!(record["status"], "succeeded");
    assert_eq!(record["credits_used"], 4);
    let fresh = record["images"][0]["url"].as_str().unwrap();
    assert_ne!(fresh, url);
    let (status, _, bytes) = fetch_raw(fresh).await;
    assert_eq!(status, 200);
    assert_eq!(bytes, original, "the fresh URL leads to another image");
    // The fresh URL is also a valid tool input while it lives.
    let (status, body) = raw_post(
        &env,
        "v1/images/tools/erase",
        &json!({"image_url": fresh, "object_name": "mug"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["credits_used"], 2);

    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2, "{ledger:?}");
    assert_eq!(env.sandbox.balance(), START_BALANCE - 6);
}

#[tokio::test]
async fn sample_assets_download_as_png_without_a_key() {
    let env = start_default().await;
    let url = format!("{}assets/mug.png", env.sandbox.base_url());
    let (status, content_type, bytes) = fetch_raw(&url).await;
    assert_eq!((status, content_type.as_str()), (200, "image/png"));
    assert!(png_magic(&bytes));
    assert_eq!(
        image::load_from_memory(&bytes).unwrap().dimensions(),
        (256, 256)
    );
    let got = env
        .downloader
        .fetch(&url, env.dir.path(), "mug")
        .await
        .unwrap();
    assert_eq!(std::fs::read(&got.path).unwrap(), bytes);
    let (status, _, _) = fetch_raw(&format!("{}assets/sofa.png", env.sandbox.base_url())).await;
    assert_eq!(status, 404);
    assert_eq!(env.sandbox.stats().api_requests, 0);
}

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_truncated_download_fails_and_leaves_no_file() {
    let env = start_with_faults(Faults {
        truncate_download: 1.0,
        ..Faults::default()
    })
    .await;
    let job = generate_raw(&env).await;
    let url = job["images"][0]["url"].as_str().unwrap();
    let err = env
        .downloader
        .fetch(url, env.dir.path(), "cut")
        .await
        .unwrap_err();
    match err {
        DownloadError::Truncated { got, expected } => {
            assert!(got < expected, "{got} of {expected}");
        }
        ref other => panic!("expected a truncated download, got {other:?}"),
    }
    assert!(err.is_transient());
    assert_eq!(
        files_in(env.dir.path()),
        Vec::<String>::new(),
        "a partial download was left behind"
    );
    assert_eq!(env.sandbox.stats().truncated_downloads, 1);
}

#[tokio::test]
async fn an_existing_file_is_never_overwritten() {
    let env = start_default().await;
    let job = generate_raw(&env).await;
    let url = job["images"][0]["url"].as_str().unwrap();
    let dest = env.dir.path().join("keep.png");
    std::fs::write(&dest, b"precious bytes").unwrap();
    let err = env
        .downloader
        .fetch(url, env.dir.path(), "keep")
        .await
        .unwrap_err();
    match &err {
        DownloadError::Exists { at } => assert_eq!(at, &dest.display().to_string()),
        other => panic!("expected Exists, got {other:?}"),
    }
    assert!(!err.is_transient());
    assert_eq!(std::fs::read(&dest).unwrap(), b"precious bytes");
    assert_eq!(files_in(env.dir.path()), ["keep.png"]);
}

/// What a raw caller sees of one call: the status, "dropped" when the answer never came, or
/// "cut <start>" when it stopped after its start.
async fn outcome(env: &Env) -> String {
    let response = http()
        .post(env.sandbox.base_url().join(GENERATIONS).unwrap())
        .header("X-API-Key", env.sandbox.key())
        .json(&json!({"prompt": "x"}))
        .send()
        .await;
    match response {
        Err(_) => "dropped".into(),
        Ok(response) => {
            let status = response.status().as_u16();
            let mut response = response;
            let mut start = Vec::new();
            loop {
                match response.chunk().await {
                    Ok(Some(chunk)) => start.extend_from_slice(&chunk),
                    Ok(None) => return status.to_string(),
                    Err(_) if start.is_empty() => return "dropped".into(),
                    Err(_) => return format!("cut {}", String::from_utf8_lossy(&start)),
                }
            }
        }
    }
}

#[tokio::test]
async fn seeded_faults_replay_the_same_outcomes() {
    let faults = |seed| Faults {
        server_error: 0.25,
        rate_limit: 0.15,
        drop_after_billing: 0.2,
        gateway_timeout: 0.1,
        partial_answer: 0.2,
        truncate_download: 0.0,
        seed,
    };
    let mut runs = Vec::new();
    for seed in [42, 42, 43] {
        let env = start_with_faults(faults(seed)).await;
        let mut outcomes = Vec::new();
        for _ in 0..20 {
            outcomes.push(outcome(&env).await);
        }
        let cut: Vec<&str> = outcomes
            .iter()
            .filter_map(|o| o.strip_prefix("cut "))
            .collect();
        let billed = outcomes
            .iter()
            .filter(|o| matches!(o.as_str(), "200" | "dropped" | "504"));
        let dropped = outcomes
            .iter()
            .filter(|o| matches!(o.as_str(), "dropped" | "504"))
            .count();
        let ledger = env.sandbox.ledger();
        assert_eq!(ledger.len(), billed.count() + cut.len(), "{outcomes:?}");
        assert_eq!(
            ledger.iter().filter(|e| !e.delivered && !e.partial).count(),
            dropped
        );
        // A cut answer starts as the service's would, naming its job, and nothing more.
        let partial: Vec<String> = ledger
            .iter()
            .filter(|e| e.partial)
            .map(|e| {
                format!(
                    "{{\"id\":\"{}\",\"status\":\"succeeded\",\"credits_used\":4,",
                    e.job_id
                )
            })
            .collect();
        assert_eq!(cut, partial, "{outcomes:?}");
        // Job ids differ between sandboxes; what happened to each call must not.
        for o in &mut outcomes {
            if o.starts_with("cut ") {
                *o = "cut".into();
            }
        }
        assert_eq!(
            env.sandbox.balance(),
            START_BALANCE - 4 * ledger.len() as i64
        );
        runs.push(outcomes);
    }
    assert_eq!(runs[0], runs[1], "the same seed gave different outcomes");
    let kinds: std::collections::BTreeSet<&String> = runs[0].iter().collect();
    assert!(
        kinds.len() >= 3,
        "too few kinds of outcome to prove anything: {kinds:?}"
    );
    assert!(
        runs[0].iter().any(|o| o == "cut"),
        "no answer was cut: {:?}",
        runs[0]
    );
    assert_ne!(runs[0], runs[2], "the seed makes no difference");
}

/// The rate limit's 429, at one call an hour so that the second call lands in the first one's
/// window however slow the machine: `Retry-After` is what is left of the hour, the body the
/// JSON error, nothing billed; the injected 429 has the same shape.
#[tokio::test]
async fn a_429_carries_retry_after_and_the_json_error() {
    let env = start(Config {
        rate_limit: Some(1.0 / 3600.0),
        ..Config::default()
    })
    .await;
    let url = env.sandbox.base_url().join(GENERATIONS).unwrap();
    let send = || {
        http()
            .post(url.clone())
            .header("X-API-Key", env.sandbox.key())
            .json(&json!({"prompt": "x"}))
            .send()
    };
    assert_eq!(send().await.unwrap().status().as_u16(), 200);
    let limited = send().await.unwrap();
    assert_eq!(limited.status().as_u16(), 429);
    let retry: u64 = limited.headers()[RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (3000..=3600).contains(&retry),
        "Retry-After is the rest of the hour: {retry}"
    );
    let body: Value = limited.json().await.unwrap();
    error_of(&body, "rate_limited");
    assert_eq!(env.sandbox.ledger().len(), 1);
    assert_eq!(env.sandbox.stats().rate_limited, 1);

    // The injected 429 has the same shape.
    let env = start_with_faults(Faults {
        rate_limit: 1.0,
        ..Faults::default()
    })
    .await;
    let response = http()
        .post(env.sandbox.base_url().join(GENERATIONS).unwrap())
        .header("X-API-Key", env.sandbox.key())
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()[RETRY_AFTER], "1");
    let body: Value = response.json().await.unwrap();
    error_of(&body, "rate_limited");
    assert_nothing_billed(&env);
}

/// `POST /_sandbox/hold` keeps a paid call in flight and unbilled at the gate before billing,
/// counted as `held` in the stats, until `POST /_sandbox/release`; then it is billed and
/// answered. A release with no hold is refused.
#[tokio::test]
async fn a_held_sandbox_keeps_paid_calls_unbilled_until_released() {
    let env = start_default().await;
    let (status, body) = raw_post(&env, "_sandbox/release", &json!({})).await;
    assert_eq!(status, 409, "{body}");
    error_of(&body, "not_held");
    let (status, _) = raw_post(&env, "_sandbox/hold", &json!({})).await;
    assert_eq!(status, 204);

    let body = json!({"prompt": "a mug"});
    let call = raw_post(&env, GENERATIONS, &body);
    tokio::pin!(call);
    let held = async {
        loop {
            let (_, stats) = raw_get(&env, "_sandbox/stats", Some(env.sandbox.key())).await;
            if stats["held"] == 1 {
                return stats;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let stats = tokio::select! {
        answered = &mut call => panic!("answered while held: {answered:?}"),
        stats = tokio::time::timeout(Duration::from_secs(15), held) => stats.expect("the call held"),
    };
    assert_eq!(stats["stats"]["billed"], 0, "{stats}");
    assert_eq!(env.sandbox.held_calls(), 1);
    assert!(env.sandbox.ledger().is_empty());

    let (status, _) = raw_post(&env, "_sandbox/release", &json!({})).await;
    assert_eq!(status, 204);
    let (status, body) = tokio::time::timeout(Duration::from_secs(15), call)
        .await
        .expect("answered once released");
    assert_eq!(status, 200, "{body}");
    assert_eq!(env.sandbox.ledger().len(), 1);
    assert_eq!(env.sandbox.held_calls(), 0);
}

/// `POST /_sandbox/rate-limit-reads?reads=N&retry_after=S` answers the next N reads of the
/// account, and the next N of the models list, 429 with that `Retry-After`, whatever the rate
/// limit says; then they are answered again. The stats count every read and the armed 429s.
/// Other calls are untouched.
#[tokio::test]
async fn reads_armed_to_meet_a_429_are_refused_that_many_times_then_answered() {
    let env = start_default().await;
    let key = Some(env.sandbox.key());
    let (status, body) = raw_post(
        &env,
        "_sandbox/rate-limit-reads?reads=2&retry_after=3",
        &json!({}),
    )
    .await;
    assert_eq!(status, 204, "{body}");
    for path in ["v1/account", "v1/models"] {
        for _ in 0..2 {
            let response = http()
                .get(env.sandbox.base_url().join(path).unwrap())
                .header("X-API-Key", env.sandbox.key())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), 429, "{path}");
            assert_eq!(response.headers()[RETRY_AFTER], "3", "{path}");
            let body: Value = response.json().await.unwrap();
            error_of(&body, "rate_limited");
        }
        let (status, body) = raw_get(&env, path, key).await;
        assert_eq!(
            status, 200,
            "{path} answered once its 429s are spent: {body}"
        );
    }
    let (status, body) = raw_post(&env, GENERATIONS, &json!({"prompt": "a mug"})).await;
    assert_eq!(status, 200, "a paid call is not a read: {body}");
    let (_, stats) = raw_get(&env, "_sandbox/stats", key).await;
    let counted = |name: &str| stats["stats"][name].as_u64().unwrap();
    assert_eq!(
        [
            counted("account_reads"),
            counted("models_reads"),
            counted("reads_rate_limited"),
            counted("rate_limited"),
        ],
        [3, 3, 4, 4],
        "{stats}"
    );
}

/// `POST /_sandbox/rate-limit-job-reads?reads=N&retry_after=S` answers the next N reads of a
/// job (`GET /v1/jobs/{id}`, whichever job, a known one or not) 429 with that `Retry-After`,
/// whatever the rate limit says; then the job is answered again. The stats count every job
/// read and the armed 429s. The reads of the account and models, and paid calls, are
/// untouched.
#[tokio::test]
async fn job_reads_armed_to_meet_a_429_are_refused_that_many_times_then_answered() {
    let env = start_default().await;
    let key = Some(env.sandbox.key());
    let job = generate_raw(&env).await["id"].as_str().unwrap().to_owned();
    let (status, body) = raw_post(
        &env,
        "_sandbox/rate-limit-job-reads?reads=2&retry_after=7",
        &json!({}),
    )
    .await;
    assert_eq!(status, 204, "{body}");
    for path in ["v1/account", "v1/models"] {
        let (status, body) = raw_get(&env, path, key).await;
        assert_eq!(status, 200, "{path} is not a job read: {body}");
    }
    for path in [format!("v1/jobs/{job}"), "v1/jobs/job_unknown".to_owned()] {
        let response = http()
            .get(env.sandbox.base_url().join(&path).unwrap())
            .header("X-API-Key", env.sandbox.key())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 429, "{path}");
        assert_eq!(response.headers()[RETRY_AFTER], "7", "{path}");
        let body: Value = response.json().await.unwrap();
        error_of(&body, "rate_limited");
    }
    let (status, body) = raw_get(&env, &format!("v1/jobs/{job}"), key).await;
    assert_eq!(
        status, 200,
        "the job answered once its 429s are spent: {body}"
    );
    assert_eq!(body["id"], job.as_str(), "{body}");
    generate_raw(&env).await;
    let (_, stats) = raw_get(&env, "_sandbox/stats", key).await;
    let counted = |name: &str| stats["stats"][name].as_u64().unwrap();
    assert_eq!(
        [
            counted("job_reads"),
            counted("job_reads_rate_limited"),
            counted("reads_rate_limited"),
            counted("rate_limited"),
            counted("billed"),
        ],
        [3, 2, 0, 2, 2],
        "{stats}"
    );
}

/// `--remember-drawings` changes only the time: each call is billed, and its pictures are the
/// ones a sandbox that draws every time makes, for generations and edits alike.
#[tokio::test]
async fn a_sandbox_that_remembers_its_drawings_answers_the_same_pictures_and_bills_each_call() {
    let remembering = start(Config {
        remember_drawings: true,
        ..Config::default()
    })
    .await;
    let drawing = start_default().await;
    let mut pictures = Vec::new();
    for env in [&remembering, &remembering, &drawing] {
        let mut seen = Vec::new();
        for prompt in ["a mug", "a cup"] {
            let (status, job) = raw_post(env, GENERATIONS, &json!({"prompt": prompt})).await;
            assert_eq!(status, 200, "{job}");
            let url = job["images"][0]["url"].as_str().unwrap().to_owned();
            seen.push(digest(&fetch_raw(&url).await.2));
            let body = json!({"image_url": url, "desired_increase": 2});
            let (status, job) = raw_post(env, "v1/images/tools/upscale", &body).await;
            assert_eq!(status, 200, "{job}");
            seen.push(digest(
                &fetch_raw(job["data"]["url"].as_str().unwrap()).await.2,
            ));
        }
        pictures.push(seen);
    }
    assert_ne!(pictures[0][0], pictures[0][2], "two prompts, one picture");
    assert_eq!(pictures[0], pictures[1], "the remembered pictures changed");
    assert_eq!(pictures[0], pictures[2], "remembering changed the pictures");
    assert_eq!(remembering.sandbox.stats().recalled_drawings, 4);
    assert_eq!(drawing.sandbox.stats().recalled_drawings, 0);
    let billed = |env: &Env| env.sandbox.ledger().iter().map(|e| e.credits).sum::<u64>();
    assert_eq!(billed(&remembering), 2 * billed(&drawing));
    assert_eq!(remembering.sandbox.ledger().len(), 8);
}

fn digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

// ---------------------------------------------------------------------------------------------
// Bad images on request, caught by the checks
// ---------------------------------------------------------------------------------------------

/// The sandbox with only these bad images asked for.
async fn start_with_bad_images(bad_images: BadImages) -> Env {
    start(Config {
        bad_images,
        ..Config::default()
    })
    .await
}

/// One paid call's images, downloaded, with what a check's single pass reads of each.
async fn images_of(env: &Env, path: &str, body: Value) -> Vec<(Vec<u8>, Stats)> {
    let (status, job) = raw_post(env, path, &body).await;
    assert_eq!(status, 200, "{job}");
    // A generation lists its images; a tool's one image is its `data`.
    let urls: Vec<&str> = match job["images"].as_array() {
        Some(images) => images.iter().map(|i| i["url"].as_str().unwrap()).collect(),
        None => vec![job["data"]["url"].as_str().expect("data.url")],
    };
    let mut out = Vec::new();
    for url in urls {
        out.push(downloaded(url).await);
    }
    out
}

async fn downloaded(url: &str) -> (Vec<u8>, Stats) {
    let (status, _, bytes) = fetch_raw(url).await;
    assert_eq!(status, 200, "{url}");
    let stats = checks::image::read(std::io::Cursor::new(&bytes)).expect("a PNG");
    (bytes, stats)
}

/// The size of the sample image the tools below edit.
async fn mug_size(env: &Env) -> (u32, u32) {
    let url = env.sandbox.base_url().join("assets/mug.png").unwrap();
    let (_, stats) = downloaded(url.as_str()).await;
    (stats.width, stats.height)
}

fn outcomes(verdicts: &[Verdict]) -> Vec<Outcome> {
    verdicts.iter().map(|v| v.outcome).collect()
}

async fn generation(env: &Env, n: u8) -> Vec<(Vec<u8>, Stats)> {
    images_of(env, GENERATIONS, json!({"prompt": "a mug", "n": n})).await
}

async fn tool(env: &Env, tool: &str, mut body: Value) -> Stats {
    body["image_url"] = json!(format!("https://{SAMPLE_HOST}/assets/mug.png"));
    let mut images = images_of(env, &format!("v1/images/tools/{tool}"), body).await;
    assert_eq!(images.len(), 1);
    images.remove(0).1
}

#[tokio::test]
async fn without_bad_images_asked_for_every_check_passes() {
    let env = start_default().await;
    let images = generation(&env, 3).await;
    let hashes: Vec<u64> = images.iter().map(|(_, s)| s.hash()).collect();
    assert_eq!(
        outcomes(&checks::image::distinct(&hashes, DEFAULT_MIN_DISTANCE)),
        [Outcome::Passed; 3]
    );
    for (_, stats) in &images {
        assert_eq!(
            not_blank(stats, DEFAULT_MIN_STDDEV).outcome,
            Outcome::Passed
        );
    }
    let mug = mug_size(&env).await;
    let cutout = tool(&env, "remove_background", json!({})).await;
    assert_eq!(transparent(&cutout, 0.05, 0.95).outcome, Outcome::Passed);
    let big = tool(&env, "upscale", json!({"desired_increase": 2})).await;
    let promise = SizePromise::Scaled {
        input: mug,
        factor: 2,
    };
    assert_eq!(size(&big, promise).outcome, Outcome::Passed, "{mug:?}");
}

#[tokio::test]
async fn blank_and_duplicate_generations_are_billed_and_fail_their_checks() {
    let env = start_with_bad_images(BadImages {
        blank: 1.0,
        ..BadImages::default()
    })
    .await;
    for (_, stats) in generation(&env, 2).await {
        let v = not_blank(&stats, DEFAULT_MIN_STDDEV);
        assert_eq!((v.outcome, v.score), (Outcome::Failed, Some(0.0)), "{v:?}");
        assert_eq!(
            (stats.width, stats.height),
            (256, 256),
            "a flat image at its right size"
        );
    }
    let env = start_with_bad_images(BadImages {
        duplicate: 1.0,
        ..BadImages::default()
    })
    .await;
    let images = generation(&env, 3).await;
    assert!(images.iter().all(|(bytes, _)| *bytes == images[0].0));
    let hashes: Vec<u64> = images.iter().map(|(_, s)| s.hash()).collect();
    assert_eq!(
        outcomes(&checks::image::distinct(&hashes, DEFAULT_MIN_DISTANCE)),
        [Outcome::Passed, Outcome::Failed, Outcome::Failed]
    );
    assert_eq!(
        env.sandbox.stats().billed,
        1,
        "a bad image is billed as the service's answer"
    );
}

#[tokio::test]
async fn an_uncut_cutout_and_edits_at_the_input_size_fail_their_checks() {
    let env = start_with_bad_images(BadImages {
        opaque_cutout: 1.0,
        wrong_size: 1.0,
        ..BadImages::default()
    })
    .await;
    let input = mug_size(&env).await;
    let cutout = tool(&env, "remove_background", json!({})).await;
    let v = transparent(&cutout, 0.05, 0.95);
    assert_eq!((v.outcome, v.score), (Outcome::Failed, Some(0.0)), "{v:?}");
    let big = tool(&env, "upscale", json!({"desired_increase": 2})).await;
    let v = size(&big, SizePromise::Scaled { input, factor: 2 });
    assert_eq!(v.outcome, Outcome::Failed, "{v:?}");
    let wide = tool(&env, "expand", json!({"aspect_ratio": "16:9"})).await;
    let v = size(
        &wide,
        SizePromise::Ratio {
            ratio: (16, 9),
            input: Some(input),
        },
    );
    assert_eq!(v.outcome, Outcome::Failed, "{v:?}");
    let erased = tool(&env, "erase", json!({"object_name": "the handle"})).await;
    assert_eq!((erased.width, erased.height), input, "erase is not spoilt");
}

#[tokio::test]
async fn bad_images_replay_with_their_seed() {
    let blanks = |seed| async move {
        let env = start(Config {
            bad_images: BadImages {
                blank: 0.5,
                ..BadImages::default()
            },
            faults: Faults {
                seed,
                ..Faults::default()
            },
            ..Config::default()
        })
        .await;
        let mut flat = Vec::new();
        for _ in 0..4 {
            for (_, stats) in generation(&env, 4).await {
                flat.push(not_blank(&stats, DEFAULT_MIN_STDDEV).outcome == Outcome::Failed);
            }
        }
        flat
    };
    let first = blanks(7).await;
    assert_eq!(first, blanks(7).await);
    let count = first.iter().filter(|f| **f).count();
    assert!((2..=14).contains(&count), "{count} of 16 blank at p = 0.5");
    assert_ne!(first, blanks(8).await, "another seed draws other images");
}
