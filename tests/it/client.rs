//! The real client against the in-process sandbox: every endpoint, every rule the client
//! enforces before sending, and every way a call can fail, classified by what it means for
//! billing.

use std::time::Duration;

use image::{DynamicImage, GenericImageView};
use imgpipe::api::download::DownloadError;
use imgpipe::api::job_id::JobId;
use imgpipe::api::rules::InvalidField;
use imgpipe::api::types::{AspectRatio, Increase};
use imgpipe::api::{
    ApiError, ApiKey, Billing, Client, ClientConfig, ErrorKind, GenerationRequest, Size, ToolName,
    ToolParams, ToolRequest,
};
use imgpipe::sandbox::{Config, Faults, RateScope, SAMPLE_HOST};

use crate::common::*;

/// The sandbox's documented default generation price, per 2K image.
const PRICE: u64 = 4;
const SIDE: u32 = 256;
/// A rate limit of one request an hour: the first request takes the hour's one place and every
/// other one made within the hour is refused, so a test of the limit does not depend on how
/// fast the machine makes its calls.
const ONE_AN_HOUR: f64 = 1.0 / 3600.0;

async fn download(env: &Env, url: &str, stem: &str) -> DynamicImage {
    let got = env
        .downloader
        .fetch(url, env.dir.path(), stem)
        .await
        .unwrap_or_else(|e| panic!("download of {url} failed: {e}"));
    assert_eq!(got.path, env.dir.path().join(format!("{stem}.png")));
    assert_eq!(got.bytes, std::fs::metadata(&got.path).unwrap().len());
    decode(&got.path)
}

/// Generates one 2K image and returns its URL.
async fn generated_url(env: &Env, prompt: &str) -> String {
    let job = env
        .client
        .generate(&GenerationRequest::new(prompt))
        .await
        .expect("generation succeeds");
    assert_eq!(job.images.len(), 1);
    job.images[0].url.clone()
}

fn expect_invalid(result: Result<impl std::fmt::Debug, ApiError>, field: &str) -> InvalidField {
    match result {
        Err(ApiError::Invalid(invalid)) => {
            assert_eq!(invalid.field, field, "{invalid}");
            assert!(!invalid.message.is_empty());
            invalid
        }
        other => panic!("expected a client-side rejection naming {field}, got {other:?}"),
    }
}

fn expect_answered(err: &ApiError, status: u16, kind: ErrorKind) {
    match err {
        ApiError::Answered {
            status: got,
            kind: got_kind,
            ..
        } => {
            assert_eq!((*got, *got_kind), (status, kind), "{err}");
        }
        other => panic!("expected HTTP {status} ({kind:?}), got {other:?}"),
    }
    assert_eq!(err.billing(), Billing::Answered);
    assert_eq!(err.kind(), Some(kind));
}

// ---------------------------------------------------------------------------------------------
// Endpoints
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn generate_bills_the_price_per_image_and_twice_for_4k() {
    let env = start_default().await;
    let mut req = GenerationRequest::new("a red mug on a table");
    req.n = 3;
    let job = env.client.generate(&req).await.unwrap();
    assert!(job.id.starts_with("job_"), "{}", job.id);
    assert_eq!(job.status, "succeeded");
    assert_eq!(job.model.as_deref(), Some("sandbox-image-1"));
    assert_eq!(job.credits_used, 3 * PRICE);
    let after_first = START_BALANCE - 3 * PRICE as i64;
    assert_eq!(job.credits_remaining, Some(after_first));
    assert_eq!(env.sandbox.balance(), after_first);
    assert_eq!(job.images.len(), 3);
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0].job_id, job.id);
    assert_eq!(ledger[0].operation, "generate");
    assert_eq!(ledger[0].credits, 3 * PRICE);
    assert!(ledger[0].delivered);

    let mut pixels = Vec::new();
    for (i, image) in job.images.iter().enumerate() {
        assert!(image.url.starts_with(env.sandbox.base_url().as_str()));
        let img = download(&env, &image.url, &format!("gen{i}")).await;
        assert_eq!(img.dimensions(), (SIDE, SIDE));
        pixels.push(img.into_bytes());
    }
    assert_ne!(pixels[0], pixels[1], "n images must be distinct images");
    assert_ne!(pixels[1], pixels[2]);

    let mut big = GenerationRequest::new("a red mug on a table");
    big.size = Size::FourK;
    let job4k = env.client.generate(&big).await.unwrap();
    assert_eq!(job4k.credits_used, 2 * PRICE);
    let after_second = after_first - 2 * PRICE as i64;
    assert_eq!(job4k.credits_remaining, Some(after_second));
    assert_eq!(env.sandbox.balance(), after_second);
    let img = download(&env, &job4k.images[0].url, "gen4k").await;
    assert_eq!(img.dimensions(), (2 * SIDE, 2 * SIDE));
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 2);
    assert_eq!(
        (ledger[1].job_id.as_str(), ledger[1].credits),
        (job4k.id.as_str(), 2 * PRICE)
    );
}

#[tokio::test]
async fn upscale_doubles_or_quadruples_and_bills_2_or_4() {
    let env = start_default().await;
    let url = generated_url(&env, "a lamp").await;
    let mut balance = START_BALANCE - PRICE as i64;
    for (increase, credits) in [(Increase::X2, 2u64), (Increase::X4, 4)] {
        let req = ToolRequest::new(
            &url,
            ToolParams::Upscale {
                desired_increase: increase,
            },
        );
        let job = env.client.tool(&req).await.unwrap();
        assert_eq!(job.status, "succeeded");
        assert_eq!(job.tool, "upscale");
        assert_eq!(job.credits_used, credits);
        balance -= credits as i64;
        assert_eq!(env.sandbox.balance(), balance);
        let entry = env.sandbox.ledger().pop().unwrap();
        assert_eq!(
            (
                entry.job_id.as_str(),
                entry.operation.as_str(),
                entry.credits
            ),
            (job.id.as_str(), "upscale", credits)
        );
        let img = download(&env, &job.data.url, &format!("up{}", increase.factor())).await;
        let side = SIDE * increase.factor();
        assert_eq!(img.dimensions(), (side, side));
    }
    assert_eq!(env.sandbox.ledger().len(), 3);
}

#[tokio::test]
async fn expand_to_16_9_widens_the_canvas_and_bills_5() {
    let env = start_default().await;
    let url = generated_url(&env, "a chair").await;
    let req = ToolRequest::new(
        &url,
        ToolParams::Expand {
            aspect_ratio: Some("16:9".parse().unwrap()),
            prompt: Some("a sunny beach".into()),
        },
    );
    let job = env.client.tool(&req).await.unwrap();
    assert_eq!((job.tool.as_str(), job.credits_used), ("expand", 5));
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64 - 5);
    assert_eq!(env.sandbox.ledger().last().unwrap().operation, "expand");
    let img = download(&env, &job.data.url, "wide").await;
    let (w, h) = img.dimensions();
    assert!(w >= SIDE && h >= SIDE, "{w}x{h}");
    let ratio = f64::from(w) / f64::from(h);
    assert!((ratio - 16.0 / 9.0).abs() < 0.01, "{w}x{h} is not 16:9");
}

#[tokio::test]
async fn remove_background_makes_corners_transparent_and_preserve_alpha_false_drops_alpha() {
    let env = start_default().await;
    let url = generated_url(&env, "a plant").await;
    let job = env
        .client
        .tool(&ToolRequest::new(&url, ToolParams::RemoveBackground))
        .await
        .unwrap();
    assert_eq!(
        (job.tool.as_str(), job.credits_used),
        ("remove_background", 5)
    );
    let mut balance = START_BALANCE - PRICE as i64 - 5;
    assert_eq!(env.sandbox.balance(), balance);
    let cut = download(&env, &job.data.url, "cut").await;
    assert!(cut.color().has_alpha(), "{:?}", cut.color());
    assert_eq!(cut.dimensions(), (SIDE, SIDE));
    let last = SIDE - 1;
    for (x, y) in [(0, 0), (last, 0), (0, last), (last, last)] {
        assert_eq!(
            cut.get_pixel(x, y)[3],
            0,
            "corner {x},{y} is not transparent"
        );
    }
    assert_eq!(
        cut.get_pixel(SIDE / 2, SIDE / 2)[3],
        255,
        "centre is not opaque"
    );

    // Upscaling keeps the alpha by default and drops it when asked.
    let upscale = |keep: Option<bool>| {
        let mut req = ToolRequest::new(
            &job.data.url,
            ToolParams::Upscale {
                desired_increase: Increase::X2,
            },
        );
        req.preserve_alpha = keep;
        req
    };
    let kept = env.client.tool(&upscale(None)).await.unwrap();
    let kept = download(&env, &kept.data.url, "kept").await;
    assert!(kept.color().has_alpha());
    assert_eq!(kept.get_pixel(0, 0)[3], 0);
    let flat = env.client.tool(&upscale(Some(false))).await.unwrap();
    assert_eq!(flat.credits_used, 2);
    balance -= 4;
    assert_eq!(env.sandbox.balance(), balance);
    let flat = download(&env, &flat.data.url, "flat").await;
    assert!(!flat.color().has_alpha(), "{:?}", flat.color());
    assert_eq!(flat.dimensions(), (2 * SIDE, 2 * SIDE));
}

#[tokio::test]
async fn erase_keeps_the_size_changes_pixels_and_bills_2() {
    let env = start_default().await;
    let url = generated_url(&env, "a person with a hat").await;
    let original = download(&env, &url, "original").await;
    let req = ToolRequest::new(
        &url,
        ToolParams::Erase {
            object_name: "hat".into(),
        },
    );
    let job = env.client.tool(&req).await.unwrap();
    assert_eq!((job.tool.as_str(), job.credits_used), ("erase", 2));
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64 - 2);
    let entry = env.sandbox.ledger().pop().unwrap();
    assert_eq!((entry.operation.as_str(), entry.credits), ("erase", 2));
    let erased = download(&env, &job.data.url, "erased").await;
    assert_eq!(erased.dimensions(), original.dimensions());
    assert_eq!(erased.color(), original.color());
    let changed = original
        .pixels()
        .zip(erased.pixels())
        .filter(|(a, b)| a.2 != b.2)
        .count();
    assert!(changed > 0, "erase changed no pixel");
    assert!(
        changed < (SIDE * SIDE) as usize,
        "erase changed every pixel"
    );
}

#[tokio::test]
async fn tools_work_on_sample_images_by_both_addresses() {
    let env = start_default().await;
    let samples = [
        format!("https://{SAMPLE_HOST}/assets/mug.png"),
        format!("{}assets/mug.png", env.sandbox.base_url()),
    ];
    for (i, url) in samples.iter().enumerate() {
        let job = env
            .client
            .tool(&ToolRequest::new(url, ToolParams::RemoveBackground))
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let img = download(&env, &job.data.url, &format!("mug{i}")).await;
        assert!(img.color().has_alpha());
    }
    assert_eq!(env.sandbox.balance(), START_BALANCE - 10);
}

#[tokio::test]
async fn job_returns_fresh_urls_that_download_and_bills_nothing() {
    let env = start_default().await;
    let mut req = GenerationRequest::new("two mugs");
    req.n = 2;
    let generation = env.client.generate(&req).await.unwrap();
    let tool = env
        .client
        .tool(&ToolRequest::new(
            &generation.images[0].url,
            ToolParams::Erase {
                object_name: "mug".into(),
            },
        ))
        .await
        .unwrap();
    let balance = env.sandbox.balance();
    // URLs are signed with a millisecond expiry: make sure the fresh ones are signed later.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let record = env.client.job(&generation.id).await.unwrap();
    assert_eq!(record.id(), Some(generation.id.as_str()));
    assert_eq!(record.status(), Some("succeeded"));
    assert_eq!(record.credits_used(), Some(2 * PRICE));
    let fresh = record.image_urls();
    assert_eq!(fresh.len(), 2);
    for (i, (url, old)) in fresh.iter().zip(&generation.images).enumerate() {
        assert_ne!(url, &old.url, "the job's URL is not freshly signed");
        let again = download(&env, url, &format!("fresh{i}")).await;
        let first = download(&env, &old.url, &format!("first{i}")).await;
        assert_eq!(again, first, "the fresh URL leads to another image");
    }

    let record = env.client.job(&tool.id).await.unwrap();
    assert_eq!(record.id(), Some(tool.id.as_str()));
    assert_eq!(record.credits_used(), Some(2));
    let urls = record.image_urls();
    assert_eq!(urls.len(), 1);
    assert_ne!(urls[0], tool.data.url);
    download(&env, &urls[0], "tool_fresh").await;

    assert_eq!(env.sandbox.balance(), balance, "GET /v1/jobs must not bill");
    assert_eq!(env.sandbox.ledger().len(), 2);
}

#[tokio::test]
async fn account_reports_the_sandbox_balance() {
    let env = start_default().await;
    let account = env.client.account().await.unwrap();
    let found = account.balance(None).unwrap();
    assert_eq!(found.pointer, "/credits/balance");
    assert_eq!(found.value, env.sandbox.balance());
    assert_eq!(found.value, START_BALANCE);
    assert_eq!(account.plan(None).unwrap().value, "sandbox");

    env.client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap();
    env.sandbox.set_balance(321);
    let found = env.client.account().await.unwrap().balance(None).unwrap();
    assert_eq!(found.value, 321);
    assert_eq!(env.sandbox.balance(), 321);
}

#[tokio::test]
async fn models_lists_the_model_and_the_four_tools() {
    let env = start_default().await;
    let models = env.client.models().await.unwrap();
    assert_eq!(models.model_ids(), ["sandbox-image-1"]);
    let mut tools = models.tool_names();
    tools.sort();
    let mut expected: Vec<String> = ToolName::ALL.iter().map(|t| t.to_string()).collect();
    expected.sort();
    assert_eq!(tools, expected);
    // The default sandbox, like the spec, states no generation price.
    assert!(models.generation_price().is_none());
    assert_nothing_billed(&env);
}

// ---------------------------------------------------------------------------------------------
// Rules checked on the client: the request is never sent
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn invalid_generations_are_refused_before_sending() {
    let env = start_default().await;
    let base = GenerationRequest::new("a mug");
    let with = |f: &dyn Fn(&mut GenerationRequest)| {
        let mut req = base.clone();
        f(&mut req);
        req
    };
    let cases = [
        (with(&|r| r.prompt = String::new()), "prompt"),
        (with(&|r| r.prompt = "   \n".into()), "prompt"),
        (with(&|r| r.prompt = "a".repeat(4001)), "prompt"),
        (with(&|r| r.prompt = "é".repeat(4001)), "prompt"),
        (with(&|r| r.n = 0), "n"),
        (with(&|r| r.n = 5), "n"),
        (
            with(&|r| r.image_urls = vec!["https://example.com/a.png".into(); 7]),
            "image_urls",
        ),
        (
            with(&|r| r.image_urls = vec!["http://example.com/a.png".into()]),
            "image_urls[0]",
        ),
        (
            with(&|r| {
                r.image_urls = vec![
                    "https://example.com/a.png".into(),
                    "ftp://example.com/b.png".into(),
                ]
            }),
            "image_urls[1]",
        ),
        (
            with(&|r| r.image_urls = vec!["/assets/mug.png".into()]),
            "image_urls[0]",
        ),
    ];
    for (req, field) in cases {
        let result = env.client.generate(&req).await;
        let err = result.as_ref().unwrap_err();
        assert_eq!(err.billing(), Billing::NotSent);
        assert!(
            !err.is_transient(),
            "an invalid request never succeeds later"
        );
        expect_invalid(result, field);
    }
    assert_eq!(env.sandbox.stats().api_requests, 0, "a request was sent");
    assert_nothing_billed(&env);
}

#[tokio::test]
async fn a_prompt_of_4000_multibyte_characters_is_accepted() {
    let env = start_default().await;
    let prompt = "é".repeat(4000);
    assert!(prompt.len() > 4000);
    let job = env
        .client
        .generate(&GenerationRequest::new(prompt))
        .await
        .unwrap();
    assert_eq!(job.credits_used, PRICE);
    assert_eq!(env.sandbox.stats().api_requests, 1);
}

#[tokio::test]
async fn references_issued_by_the_sandbox_are_accepted_but_user_http_urls_are_not() {
    let env = start_default().await;
    let result_url = generated_url(&env, "a mug").await;
    assert!(result_url.starts_with("http://127.0.0.1:"), "{result_url}");
    let mut req = GenerationRequest::new("the same mug, in blue");
    req.image_urls = vec![
        result_url.clone(),
        format!("{}assets/mug.png", env.sandbox.base_url()),
        format!("https://{SAMPLE_HOST}/assets/lamp.png"),
        "https://example.com/ref.png".into(),
    ];
    let job = env.client.generate(&req).await.unwrap();
    assert_eq!(job.credits_used, PRICE);
    assert_eq!(env.sandbox.stats().api_requests, 2);
    assert_eq!(env.sandbox.ledger().len(), 2);

    // The same path on another loopback port was not issued by this sandbox.
    let port = env.sandbox.base_url().port().unwrap();
    let other = result_url.replace(&format!(":{port}/"), &format!(":{}/", port ^ 1));
    req.image_urls = vec![result_url, other];
    expect_invalid(env.client.generate(&req).await, "image_urls[1]");
    assert_eq!(env.sandbox.stats().api_requests, 2, "a request was sent");
}

#[tokio::test]
async fn invalid_tool_calls_and_job_ids_are_refused_before_sending() {
    let env = start_default().await;
    let mug = format!("https://{SAMPLE_HOST}/assets/mug.png");
    let erase = |name: &str| {
        ToolRequest::new(
            &mug,
            ToolParams::Erase {
                object_name: name.into(),
            },
        )
    };
    expect_invalid(env.client.tool(&erase("")).await, "object_name");
    expect_invalid(env.client.tool(&erase("  ")).await, "object_name");
    for relative in ["assets/mug.png", "/files/img_1.png", "mug.png", ""] {
        let req = ToolRequest::new(relative, ToolParams::RemoveBackground);
        expect_invalid(env.client.tool(&req).await, "image_url");
    }
    let blank_prompt = ToolRequest::new(
        &mug,
        ToolParams::Expand {
            aspect_ratio: None,
            prompt: Some(" ".into()),
        },
    );
    expect_invalid(env.client.tool(&blank_prompt).await, "prompt");
    for bad in ["../x", "", "job_1/../../v1/account", "job 1", "job_1?x=1"] {
        let err = expect_invalid(env.client.job(&JobId::from(bad)).await, "job id");
        assert!(err.message.contains("job id"), "{err}");
    }
    assert_eq!(env.sandbox.stats().api_requests, 0, "a request was sent");
    assert_nothing_billed(&env);
}

#[test]
fn parsing_names_the_field() {
    let size = "3K".parse::<Size>().unwrap_err();
    assert_eq!(size.field, "size");
    assert!(size.message.contains("3K"), "{size}");
    assert_eq!("4K".parse::<Size>().unwrap(), Size::FourK);
    let inc = "3".parse::<Increase>().unwrap_err();
    assert_eq!(inc.field, "desired_increase");
    assert_eq!("4".parse::<Increase>().unwrap(), Increase::X4);
    let ratio = "16x9".parse::<AspectRatio>().unwrap_err();
    assert_eq!(ratio.field, "aspect_ratio");
    let ok = "16:9".parse::<AspectRatio>().unwrap();
    assert_eq!((ok.width(), ok.height()), (16, 9));
    assert_eq!("blur".parse::<ToolName>().unwrap_err().field, "tool");
}

// ---------------------------------------------------------------------------------------------
// Errors, by billing
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_wrong_key_is_an_auth_error_that_never_shows_the_key() {
    let env = start_default().await;
    let wrong = "sbx_wrong_key_0123456789abcdef";
    let client = client_for(&env.sandbox, wrong);
    let err = client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    expect_answered(&err, 401, ErrorKind::Auth);
    assert!(!err.is_transient());
    let err_account = client.account().await.unwrap_err();
    expect_answered(&err_account, 401, ErrorKind::Auth);
    for err in [&err, &err_account] {
        let text = format!("{err} {err:?} {err:#?}");
        assert!(!text.contains(wrong), "the key leaked: {text}");
        assert!(!text.contains(env.sandbox.key()), "the key leaked: {text}");
        assert!(text.contains("(HTTP 401)"), "{text}");
    }
    assert_eq!(env.sandbox.stats().unauthorized, 2);
    assert_nothing_billed(&env);
}

#[tokio::test]
async fn a_balance_too_low_is_a_credits_error_and_bills_nothing() {
    let env = start_default().await;
    env.sandbox.set_balance(3);
    let err = env
        .client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    expect_answered(&err, 402, ErrorKind::Credits);
    assert!(!err.is_transient());
    let mug = format!("https://{SAMPLE_HOST}/assets/mug.png");
    let err = env
        .client
        .tool(&ToolRequest::new(&mug, ToolParams::RemoveBackground))
        .await
        .unwrap_err();
    expect_answered(&err, 402, ErrorKind::Credits);
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.balance(), 3);
    // What the balance can pay still goes through.
    let job = env
        .client
        .tool(&ToolRequest::new(
            &mug,
            ToolParams::Erase {
                object_name: "handle".into(),
            },
        ))
        .await
        .unwrap();
    assert_eq!(job.credits_used, 2);
    assert_eq!(env.sandbox.balance(), 1);
}

#[tokio::test]
async fn an_unknown_job_is_not_found() {
    let env = start_default().await;
    let err = env
        .client
        .job(&JobId::from("job_doesnotexist"))
        .await
        .unwrap_err();
    expect_answered(&err, 404, ErrorKind::NotFound);
    assert!(!err.is_transient());
}

#[tokio::test]
async fn a_closed_port_is_not_sent_and_transient() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let config = ClientConfig::new(
        &format!("http://127.0.0.1:{port}"),
        ApiKey::new("k").unwrap(),
    )
    .unwrap();
    let client = Client::new(config).unwrap();
    let err = client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, ApiError::NotSent { .. }), "{err:?}");
    assert_eq!(err.billing(), Billing::NotSent);
    assert!(err.is_transient());
    assert_eq!(err.kind(), None);
}

#[tokio::test]
async fn an_injected_server_error_is_answered_and_bills_nothing() {
    let env = start_with_faults(Faults {
        server_error: 1.0,
        ..Faults::default()
    })
    .await;
    let err = env
        .client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    let status = match &err {
        ApiError::Answered { status, .. } => *status,
        other => panic!("expected an answer, got {other:?}"),
    };
    assert!(matches!(status, 500 | 503), "{status}");
    expect_answered(&err, status, ErrorKind::Server);
    assert!(err.is_transient());
    assert_eq!(env.sandbox.stats().server_errors, 1);
    assert_nothing_billed(&env);
}

/// A generation under a fault that strikes after billing: the call must come back ambiguous,
/// not retryable, and be in the ledger as billed but undelivered.
async fn billed_but_unanswered(faults: Faults) -> (Env, ApiError) {
    let env = start_with_faults(faults).await;
    let err = env
        .client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap_err();
    assert!(matches!(err, ApiError::Ambiguous { .. }), "{err:?}");
    assert_eq!(err.billing(), Billing::Ambiguous);
    assert!(
        !err.is_transient(),
        "retrying an ambiguous call may pay twice"
    );
    assert!(err.to_string().contains("may have been billed"), "{err}");
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(
        (ledger[0].operation.as_str(), ledger[0].credits),
        ("generate", PRICE)
    );
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64);
    assert_eq!(env.sandbox.stats().billed, 1);
    (env, err)
}

#[tokio::test]
async fn a_connection_dropped_after_billing_is_ambiguous_and_was_billed() {
    let (env, _) = billed_but_unanswered(Faults {
        drop_after_billing: 1.0,
        ..Faults::default()
    })
    .await;
    assert_eq!(env.sandbox.stats().dropped_after_billing, 1);
}

#[tokio::test]
async fn a_connection_dropped_after_billing_names_no_job() {
    let (_, err) = billed_but_unanswered(Faults {
        drop_after_billing: 1.0,
        ..Faults::default()
    })
    .await;
    assert!(
        matches!(err, ApiError::Ambiguous { job_id: None, .. }),
        "{err:?}"
    );
}

/// The answer starts, naming the job, and the connection is cut: ambiguous, but the job is
/// named, and reading it back gives its images without paying again.
#[tokio::test]
async fn an_answer_cut_after_naming_its_job_names_the_job_to_read_back() {
    let (env, err) = billed_but_unanswered(Faults {
        partial_answer: 1.0,
        ..Faults::default()
    })
    .await;
    let ledger = env.sandbox.ledger();
    assert!(ledger[0].partial, "{ledger:?}");
    assert_eq!(env.sandbox.stats().partial_answers, 1);
    let job = ledger[0].job_id.as_str();
    match &err {
        ApiError::Ambiguous { job_id, .. } => assert_eq!(job_id.as_deref(), Some(job), "{err}"),
        other => panic!("expected an ambiguous answer, got {other:?}"),
    }
    assert!(
        err.to_string().contains("the answer was cut after"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains(&format!("`imgpipe job {job} --out DIR` fetches its images")),
        "{err}"
    );
    let record = env.client.job(&JobId::from(job)).await.unwrap();
    assert_eq!(record.image_urls().len(), 1);
    assert_eq!(
        env.sandbox.ledger().len(),
        1,
        "reading the job back is free"
    );
}

/// Three calls against a limit of one an hour: the first takes the hour's one place, and the
/// two after it are answered 429 with a `Retry-After` of what is left of the hour, billed
/// nothing, however long the machine takes between them.
#[tokio::test]
async fn the_rate_limit_answers_429_with_retry_after_and_bills_nothing_for_it() {
    let env = start(Config {
        rate_limit: Some(ONE_AN_HOUR),
        ..Config::default()
    })
    .await;
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        match env.client.generate(&GenerationRequest::new("x")).await {
            Ok(_) => outcomes.push("billed"),
            Err(err) => {
                expect_answered(&err, 429, ErrorKind::RateLimited);
                assert!(err.is_transient());
                let wait = err.retry_after().expect("a 429 says when to retry");
                assert!(
                    wait > Duration::from_secs(3000),
                    "the wait is the rest of the hour: {wait:?}"
                );
                assert!(err.to_string().contains("retry after"), "{err}");
                outcomes.push("429");
            }
        }
    }
    assert_eq!(outcomes, ["billed", "429", "429"]);
    assert_eq!(env.sandbox.ledger().len(), 1);
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64);
    assert_eq!(env.sandbox.stats().rate_limited, 2);
}

/// One call held in flight at the sandbox's hold: a second beyond the limit of one is
/// refused with 429 while the first is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_call_in_flight_beyond_the_limit_is_rate_limited() {
    let env = start(Config {
        max_in_flight: Some(1),
        ..Config::default()
    })
    .await;
    let req = GenerationRequest::new("x");
    let hold = env.sandbox.hold();
    let first = env.client.generate(&req);
    tokio::pin!(first);
    let held = wait_until("the first call held", || env.sandbox.held_calls() == 1);
    tokio::select! {
        answered = &mut first => panic!("answered while held: {answered:?}"),
        () = held => {}
    }
    let err = env.client.generate(&req).await.unwrap_err();
    drop(hold);
    let ok = first.await.unwrap();
    expect_answered(&err, 429, ErrorKind::RateLimited);
    assert!(
        err.retry_after()
            .is_some_and(|d| d >= Duration::from_secs(1))
    );
    assert_eq!(env.sandbox.ledger().len(), 1);
    assert_eq!(env.sandbox.ledger()[0].job_id, ok.id);
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64);
    assert_eq!(env.sandbox.stats().peak_in_flight, 1);
}

/// The sandbox holds the call (done, unbilled) past the client's timeout: the client gives up
/// while the call is still held, and says it may be billed; released, the service bills it.
#[tokio::test]
async fn a_client_timeout_is_ambiguous_and_the_call_is_still_billed() {
    let env = start_default().await;
    let mut config = ClientConfig::new(
        env.sandbox.base_url().as_str(),
        ApiKey::new(env.sandbox.key()).unwrap(),
    )
    .unwrap();
    config.timeout = Duration::from_millis(300);
    let client = Client::new(config).unwrap();
    let hold = env.sandbox.hold();
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        client.generate(&GenerationRequest::new("x")),
    )
    .await
    .expect("the client gives up on its own timeout")
    .unwrap_err();
    assert_eq!(env.sandbox.held_calls(), 1, "the call is still held");
    assert!(matches!(err, ApiError::Ambiguous { .. }), "{err:?}");
    assert_eq!(err.billing(), Billing::Ambiguous);
    assert!(!err.is_transient());
    assert!(
        env.sandbox.ledger().is_empty(),
        "billed before the work was done"
    );

    // The service finishes the work the caller gave up on, and bills it.
    drop(hold);
    wait_until("the abandoned call billed", || {
        !env.sandbox.ledger().is_empty()
    })
    .await;
    let ledger = env.sandbox.ledger();
    assert_eq!(ledger.len(), 1, "the abandoned call was never billed");
    assert_eq!(ledger[0].credits, PRICE);
    assert_eq!(env.sandbox.balance(), START_BALANCE - PRICE as i64);
}

#[tokio::test]
async fn a_download_error_says_when_a_fresh_url_is_needed() {
    // Covered in depth in sandbox_http; here only the client-facing classification.
    let env = start_default().await;
    let job = env
        .client
        .generate(&GenerationRequest::new("x"))
        .await
        .unwrap();
    env.sandbox.expire_urls();
    let err = env
        .downloader
        .fetch(&job.images[0].url, env.dir.path(), "late")
        .await
        .unwrap_err();
    assert!(
        matches!(err, DownloadError::Expired { status: 403 }),
        "{err:?}"
    );
    assert!(err.needs_fresh_url());
    let fresh = env.client.job(&job.id).await.unwrap().image_urls();
    download(&env, &fresh[0], "fresh").await;
}

#[tokio::test]
async fn a_gateway_timeout_after_billing_is_ambiguous_and_was_billed() {
    let (env, err) = billed_but_unanswered(Faults {
        gateway_timeout: 1.0,
        ..Faults::default()
    })
    .await;
    assert!(has_phrase(&err.to_string(), "HTTP 504"), "{err}");
    let stats = env.sandbox.stats();
    assert_eq!(stats.gateway_timeouts, 1);
    assert_eq!(stats.dropped_after_billing, 0);
    let ledger = env.sandbox.ledger();

    // The job was done and paid for: it can be read back, free.
    let record = env.client.job(&ledger[0].job_id).await.unwrap();
    assert_eq!(record.image_urls().len(), 1);
    assert_eq!(env.sandbox.ledger().len(), 1);
}

/// The real limiter's scope, at a limit of one an hour so that every call lands in the same
/// window however slow the machine: counting every call, the first read takes the hour's
/// place and the reads after it are refused; scoped to paid calls, reads pass freely and
/// leave the place to the first paid call, and the paid calls after it are refused.
#[tokio::test]
async fn the_rate_limit_counts_reads_unless_scoped_to_paid_calls() {
    let env = start(Config {
        rate_limit: Some(ONE_AN_HOUR),
        ..Config::default()
    })
    .await;
    let mut reads = Vec::new();
    for _ in 0..3 {
        match env.client.account().await {
            Ok(_) => reads.push("read"),
            Err(err) => {
                expect_answered(&err, 429, ErrorKind::RateLimited);
                assert!(err.retry_after().is_some());
                reads.push("429");
            }
        }
    }
    assert_eq!(reads, ["read", "429", "429"], "every call counts");
    assert_eq!(env.sandbox.stats().rate_limited, 2);

    let env = start(Config {
        rate_limit: Some(ONE_AN_HOUR),
        rate_scope: RateScope::Paid,
        ..Config::default()
    })
    .await;
    for i in 0..5 {
        env.client
            .account()
            .await
            .unwrap_or_else(|e| panic!("read {i} was limited: {e}"));
    }
    env.client.models().await.unwrap();
    assert_eq!(env.sandbox.stats().rate_limited, 0);
    // The limit is still there for the paid calls, its place left to the first of them.
    let mut paid = Vec::new();
    for _ in 0..3 {
        match env.client.generate(&GenerationRequest::new("x")).await {
            Ok(_) => paid.push("billed"),
            Err(err) => {
                expect_answered(&err, 429, ErrorKind::RateLimited);
                paid.push("429");
            }
        }
    }
    assert_eq!(paid, ["billed", "429", "429"], "only paid calls count");
    assert_eq!(env.sandbox.ledger().len(), 1);
    assert_eq!(env.sandbox.stats().rate_limited, 2);
}

#[tokio::test]
async fn an_absurd_generation_price_never_wraps_into_a_free_call() {
    let env = start(Config {
        generation_price: u64::MAX / 2 + 1,
        ..Config::default()
    })
    .await;
    let mut request = GenerationRequest::new("x");
    request.n = 2;
    let err = env.client.generate(&request).await.unwrap_err();
    assert_eq!(err.kind(), Some(ErrorKind::Credits), "{err}");
    assert!(env.sandbox.ledger().is_empty());
    assert_eq!(env.sandbox.balance(), 1000);
}
