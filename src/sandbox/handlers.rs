//! The sandbox's HTTP surface: every endpoint of the spec, plus signed result files, sample
//! assets and a stats endpoint for tests and benchmarks.
//!
//! A paid call goes through the same gates in the same order every time: key, rate limit and
//! in-flight limit, injected faults, validation, input resolution, balance, work, billing.
//! Nothing is billed until the work is done and the balance has been checked under the lock.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State as Shared};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::api::job_id::JobId;
use crate::api::rules::{self, InvalidField};
use crate::api::types::ToolName;
use crate::sandbox::bad::Spoil;
use crate::sandbox::reply::{App, Reply};
use crate::sandbox::state::{InFlight, Job, JobKind, MODEL_ID, Read, Source, State};
use crate::sandbox::{RateScope, drawings, edit, files};
use crate::sha256::Sha256Sum;

pub(super) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/images/generations", post(generate))
        .route("/v1/images/tools/{tool}", post(tool))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/account", get(account))
        .route("/v1/models", get(models))
        .route("/files/{file}", get(files::result))
        .route("/assets/{file}", get(files::sample))
        .route("/_sandbox/stats", get(stats))
        .route("/_sandbox/hold", post(hold))
        .route("/_sandbox/release", post(release))
        .route("/_sandbox/let-through", post(let_through))
        .route("/_sandbox/expire-urls", post(expire_urls))
        .route("/_sandbox/rate-limit-reads", post(rate_limit_reads))
        .route("/_sandbox/rate-limit-job-reads", post(rate_limit_job_reads))
        .fallback(|| async { Reply::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

/// Counts API requests, checks the key and applies the rate limit on everything but result
/// files and samples, which are public by design (signed URLs).
async fn authenticate(Shared(state): App, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let api = path.starts_with("/v1/");
    if api || path.starts_with("/_sandbox/") {
        if api {
            state.count(|s| s.api_requests += 1);
        }
        let given = request.headers().get("x-api-key").map(|v| v.as_bytes());
        if given != Some(state.key.as_bytes()) {
            state.count(|s| s.unauthorized += 1);
            let why = if given.is_none() {
                "missing X-API-Key header"
            } else {
                "invalid API key"
            };
            return Reply::new(StatusCode::UNAUTHORIZED, "unauthorized", why).into_response();
        }
        if let Some(reply) = armed_read_limit(&state, &request) {
            return reply.into_response();
        }
        let paid = request.method() == axum::http::Method::POST;
        let scoped = api && (paid || state.config.rate_scope == RateScope::All);
        if scoped && let Err(reply) = check_rate(&state) {
            return reply.into_response();
        }
    }
    next.run(request).await
}

/// A 429 for a read of the account, the models list or a job when the test armed one
/// (`Sandbox::rate_limit_reads`, `Sandbox::rate_limit_job_reads`), before the rate limit is
/// consulted: the read meets it whatever the clock says.
fn armed_read_limit(state: &State, request: &Request) -> Option<Reply> {
    if request.method() != axum::http::Method::GET {
        return None;
    }
    let read = match request.uri().path() {
        "/v1/account" => Read::Account,
        "/v1/models" => Read::Models,
        path if path.starts_with("/v1/jobs/") => Read::Job,
        _ => return None,
    };
    let wait = state.take_armed_read_limit(read)?;
    Some(limited(state, "rate limited (armed by the test)", wait))
}

fn limited(state: &State, message: &str, wait: Duration) -> Reply {
    state.rate_limited();
    Reply::rate_limited(message, wait)
}

fn check_rate(state: &State) -> Result<(), Reply> {
    if let Some(limiter) = &state.limiter
        && let Err(not_until) = limiter.check()
    {
        let now = governor::clock::Clock::now(&governor::clock::DefaultClock::default());
        return Err(limited(
            state,
            "request rate limit exceeded",
            not_until.wait_time_from(now),
        ));
    }
    Ok(())
}

/// The gates every paid call passes before any work, after the rate limit: in-flight slots
/// and injected faults.
fn admit(state: &Arc<State>) -> Result<InFlight, Reply> {
    state.count(|s| s.paid_requests += 1);
    let slot = state
        .enter()
        .ok_or_else(|| limited(state, "too many requests in flight", Duration::from_secs(1)))?;
    if let Some(wait) = state.take_armed_rate_limit() {
        return Err(limited(state, "rate limited (armed by the test)", wait));
    }
    if state.take_armed_refusal() {
        return Err(invalid(
            state,
            InvalidField::new("prompt", "refused as invalid (armed by the test)"),
        ));
    }
    let faults = &state.config.faults;
    if state.dice.chance(faults.rate_limit) {
        return Err(limited(
            state,
            "rate limited (injected fault)",
            Duration::from_secs(1),
        ));
    }
    if state.dice.chance(faults.server_error) {
        state.count(|s| s.server_errors += 1);
        let status = if state.dice.chance(0.5) {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return Err(Reply::new(
            status,
            "server_error",
            "injected server error; nothing was billed",
        ));
    }
    Ok(slot)
}

fn invalid(state: &State, e: InvalidField) -> Reply {
    state.count(|s| s.invalid += 1);
    e.into()
}

fn parse_body(state: &State, body: &Bytes) -> Result<Value, Reply> {
    serde_json::from_slice(body).map_err(|e| {
        invalid(
            state,
            InvalidField::new("body", format!("is not valid JSON ({e})")),
        )
    })
}

/// 402 before any work when the balance already cannot pay.
fn can_pay(state: &State, credits: u64) -> Result<(), Reply> {
    let balance = state.balance();
    if i64::try_from(credits).map_or(true, |c| balance < c) {
        state.count(|s| s.insufficient_credits += 1);
        return Err(insufficient(credits, balance));
    }
    Ok(())
}

fn insufficient(credits: u64, balance: i64) -> Reply {
    Reply::new(
        StatusCode::PAYMENT_REQUIRED,
        "insufficient_credits",
        format!(
            "this call costs {credits} credits and the balance is {balance}; nothing was billed"
        ),
    )
}

async fn generate(Shared(state): App, body: Bytes) -> Result<Response, Reply> {
    let slot = admit(&state)?;
    let body = parse_body(&state, &body)?;
    let paid_for = request_digest(&state, "generate", &body);
    let request =
        rules::generation_from_json(&body, &state.base).map_err(|e| invalid(&state, e))?;
    let mut reference_seed = 0u64;
    for (i, url) in request.image_urls.iter().enumerate() {
        let key = match state
            .resolve(&format!("image_urls[{i}]"), url)
            .map_err(|e| invalid(&state, e))?
        {
            Source::Result(id) => id,
            Source::Sample(name) => name.to_owned(),
            Source::Elsewhere(url) => url.to_string(),
        };
        reference_seed = edit::mix(reference_seed, &key);
    }
    // An absurd configured price must not wrap around into a free call.
    let credits = state
        .config
        .generation_price
        .saturating_mul(u64::from(request.n) * request.size.price_multiplier());
    can_pay(&state, credits)?;
    let side = state.config.image_side * request.size.price_multiplier() as u32;
    let (prompt, n, weight) = (request.prompt.clone(), request.n, state.config.weight);
    let (drawings, spoil) = (state.drawings.clone(), Spoil::generation(&state, n));
    let draw = move || {
        let asked = || drawings::asked(("generate", &prompt, n, reference_seed, side));
        let images = drawings::draw_once(drawings.as_deref(), asked, || {
            Ok(edit::draw_all(&prompt, n, reference_seed, side, weight))
        })?;
        spoil.apply(images, weight).map_err(edit::unreadable)
    };
    let job = finish(&state, slot, (JobKind::Generation, paid_for), credits, draw).await?;
    Ok(deliver(&state, &job))
}

async fn tool(
    Shared(state): App,
    Path(tool): Path<String>,
    body: Bytes,
) -> Result<Response, Reply> {
    let tool: ToolName = tool.parse().map_err(|e: InvalidField| {
        state.count(|s| s.not_found += 1);
        Reply::new(StatusCode::NOT_FOUND, "not_found", e.message)
    })?;
    let slot = admit(&state)?;
    let body = parse_body(&state, &body)?;
    let paid_for = request_digest(&state, tool.as_str(), &body);
    let request = rules::tool_from_json(tool, &body).map_err(|e| invalid(&state, e))?;
    let source = state
        .resolve("image_url", &request.image_url)
        .map_err(|e| invalid(&state, e))?;
    let input = state.image_bytes(&source).ok_or_else(|| {
        invalid(&state, InvalidField::new(
            "image_url",
            format!("the sandbox edits only its own result URLs and its sample images ({}); it never fetches from the network", edit::sample_hint(&state.base)),
        ))
    })?;
    let credits = request.params.credits();
    can_pay(&state, credits)?;
    let params = request.params.clone();
    let keep_alpha = request.preserve_alpha.unwrap_or(true);
    let (weight, drawings) = (state.config.weight, state.drawings.clone());
    let spoil = Spoil::tool(&state, &params);
    let edit = move || {
        let image = if spoil.returns_input() {
            vec![input.to_vec()]
        } else {
            let asked =
                || drawings::asked((tool.as_str(), &input[..], format!("{params:?}"), keep_alpha));
            drawings::draw_once(drawings.as_deref(), asked, || {
                Ok(vec![edit::apply(&input, &params, keep_alpha, weight)?])
            })?
        };
        spoil.apply(image, weight).map_err(edit::unreadable)
    };
    let job = finish(&state, slot, (JobKind::Tool(tool), paid_for), credits, edit).await?;
    Ok(deliver(&state, &job))
}

/// Does a paid call's work and bills it in a task of its own, as a real service would: a caller
/// that hangs up (on its own timeout, say) does not cancel the work, and the call is billed all
/// the same and recorded as undelivered. That is the ambiguous case clients must cope with.
async fn finish(
    state: &Arc<State>,
    slot: InFlight,
    (kind, request): (JobKind, Sha256Sum),
    credits: u64,
    work: impl FnOnce() -> Result<Vec<Vec<u8>>, InvalidField> + Send + 'static,
) -> Result<Job, Reply> {
    let (tx, rx) = oneshot::channel();
    let books = Arc::clone(state);
    let latency = state.latency();
    tokio::spawn(async move {
        let (pngs, ()) = tokio::join!(
            tokio::task::spawn_blocking(work),
            tokio::time::sleep(latency)
        );
        // Held, the call waits here: done, in flight, not billed yet. A caller that hangs up
        // meanwhile is counted as such while it waits, so that a test can release it knowing
        // it will be billed for nobody.
        let mut tx = tx;
        let pass = books.gate.pass();
        tokio::pin!(pass);
        tokio::select! {
            () = &mut pass => {}
            () = tx.closed() => {
                books.gate.hung_up(1);
                pass.await;
                books.gate.hung_up(-1);
            }
        }
        let result = match pngs {
            Err(e) => Err(server_fault(&e)),
            Ok(Err(e)) => Err(invalid(&books, e)),
            Ok(Ok(pngs)) => books
                .bill(&slot, kind, credits, pngs, request)
                .map_err(|balance| insufficient(credits, balance)),
        };
        if let Err(Ok(job)) = tx.send(result) {
            books.mark_undelivered(&job.id, false);
            books.count(|s| s.abandoned += 1);
        }
        drop(slot);
    });
    rx.await.unwrap_or_else(|_| {
        Err(Reply::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the call's work was lost; nothing was billed",
        ))
    })
}

/// The ledger's `request`: what a call paid for, the same however often its input URLs were
/// refreshed, so that a test can tell the same request billed twice from two bills.
fn request_digest(state: &State, operation: &str, body: &Value) -> Sha256Sum {
    let mut text = format!("{operation}\n");
    canonical(state, body, &mut text);
    Sha256Sum::of_bytes(text.as_bytes())
}

/// `value` as JSON with object keys sorted and each result URL of this sandbox written as the
/// image it names.
fn canonical(state: &State, value: &Value, out: &mut String) {
    match value {
        Value::String(s) => match state.resolve("", s) {
            Ok(Source::Result(image)) => {
                out.push_str(&Value::from(format!("result:{image}")).to_string())
            }
            _ => out.push_str(&value.to_string()),
        },
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(state, item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(key.as_str()).to_string());
                out.push(':');
                canonical(state, &map[key], out);
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

fn server_fault(e: &tokio::task::JoinError) -> Reply {
    Reply::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        format!("image work failed: {e}; nothing was billed"),
    )
}

/// Answers a billed call, unless a fault strikes after billing: the connection dies before
/// the answer, a gateway answers 504, or the answer is cut after it named the job. Either way
/// the call stays billed.
fn deliver(state: &State, job: &Job) -> Response {
    let faults = &state.config.faults;
    if state.dice.chance(faults.drop_after_billing) {
        state.mark_undelivered(&job.id, false);
        state.count(|s| s.dropped_after_billing += 1);
        let dead = futures::stream::iter([Err::<Bytes, _>(io::Error::other(
            "connection dropped (injected fault)",
        ))]);
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .body(Body::from_stream(dead))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    if state.dice.chance(faults.gateway_timeout) {
        state.mark_undelivered(&job.id, false);
        state.count(|s| s.gateway_timeouts += 1);
        return Reply::new(
            StatusCode::GATEWAY_TIMEOUT,
            "gateway_timeout",
            "the gateway gave up waiting (injected fault)",
        )
        .into_response();
    }
    if state.dice.chance(faults.partial_answer) {
        state.mark_undelivered(&job.id, true);
        state.count(|s| s.partial_answers += 1);
        return partial(job);
    }
    axum::Json(state.job_json(job)).into_response()
}

/// A 200 whose JSON body starts as the service's would, naming the job, then stops: the
/// connection is cut before the rest. The pause lets the start leave before the cut, as it
/// would over a real network.
fn partial(job: &Job) -> Response {
    let start = format!(
        "{{\"id\":{},\"status\":\"succeeded\",\"credits_used\":{},",
        Value::from(job.id.as_str()),
        job.credits_used
    );
    let cut = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Err::<Bytes, _>(io::Error::other(
            "connection cut mid-answer (injected fault)",
        ))
    };
    let body = futures::stream::iter([Ok(Bytes::from(start))]).chain(futures::stream::once(cut));
    Response::builder()
        .header(CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn job(Shared(state): App, Path(id): Path<String>) -> Result<Response, Reply> {
    let job = state.job(&JobId::new(id.as_str())).ok_or_else(|| {
        state.count(|s| s.not_found += 1);
        Reply::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id:?}"))
    })?;
    Ok(axum::Json(state.job_json(&job)).into_response())
}

async fn account(Shared(state): App) -> axum::Json<Value> {
    let c = &state.config;
    axum::Json(json!({
        "plan": "sandbox",
        "credits": { "balance": state.balance() },
        "limits": {
            "requests_per_second": c.rate_limit,
            "max_concurrency": c.max_in_flight,
            "max_images_per_generation": rules::MAX_IMAGES_PER_GENERATION,
            "max_reference_images": rules::MAX_REFERENCE_IMAGES,
            "max_prompt_chars": rules::MAX_PROMPT_CHARS,
        },
    }))
}

async fn models(Shared(state): App) -> axum::Json<Value> {
    let mut model = json!({ "id": MODEL_ID, "sizes": ["2K", "4K"] });
    if state.config.advertise_price {
        model["credits_per_image"] = state.config.generation_price.into();
    }
    axum::Json(json!({
        "models": [model],
        "tools": [
            { "name": "remove_background", "credits": 5 },
            { "name": "upscale", "credits": { "2": 2, "4": 4 } },
            { "name": "expand", "credits": 5 },
            { "name": "erase", "credits": 2 },
        ],
    }))
}

async fn stats(Shared(state): App) -> axum::Json<Value> {
    axum::Json(json!({
        "balance": state.balance(),
        "stats": state.stats(),
        "ledger": state.ledger(),
        "held": state.gate.waiting(),
        "passes": state.gate.passes(),
        "in_flight": state.in_flight(),
    }))
}

/// Holds paid calls before billing until `/_sandbox/release` (see `hold.rs`).
async fn hold(Shared(state): App) -> StatusCode {
    state.gate.hold();
    StatusCode::NO_CONTENT
}

/// Lets `calls` more paid calls pass a held gate, one each (see `hold.rs`).
async fn let_through(
    Shared(state): App,
    axum::extract::Query(passes): axum::extract::Query<Passes>,
) -> StatusCode {
    state.gate.let_through(passes.calls);
    StatusCode::NO_CONTENT
}

#[derive(serde::Deserialize)]
struct Passes {
    calls: usize,
}

/// Expires every result URL issued so far (see `Sandbox::expire_urls`).
async fn expire_urls(Shared(state): App) -> StatusCode {
    state.expire_urls();
    StatusCode::NO_CONTENT
}

/// Answers the next `reads` reads of the account, and as many of the models list, 429 with a `Retry-After`
/// of `retry_after` seconds (see `Sandbox::rate_limit_reads`).
async fn rate_limit_reads(
    Shared(state): App,
    axum::extract::Query(armed): axum::extract::Query<ArmedReads>,
) -> StatusCode {
    state.rate_limit_reads(armed.reads, Duration::from_secs(armed.retry_after));
    StatusCode::NO_CONTENT
}

/// Answers the next `reads` reads of a job (`GET /v1/jobs/{id}`), 429 with a `Retry-After` of
/// `retry_after` seconds (see `Sandbox::rate_limit_job_reads`).
async fn rate_limit_job_reads(
    Shared(state): App,
    axum::extract::Query(armed): axum::extract::Query<ArmedReads>,
) -> StatusCode {
    state.rate_limit_job_reads(armed.reads, Duration::from_secs(armed.retry_after));
    StatusCode::NO_CONTENT
}

#[derive(serde::Deserialize)]
struct ArmedReads {
    reads: usize,
    /// Seconds; the 429 says at least 1, as every 429 of the sandbox does.
    #[serde(default)]
    retry_after: u64,
}

/// Releases one hold; 409 when none was taken.
async fn release(Shared(state): App) -> Response {
    if state.gate.release() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        Reply::new(StatusCode::CONFLICT, "not_held", "the sandbox is not held").into_response()
    }
}
