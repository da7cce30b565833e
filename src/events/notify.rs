//! Alerts: events posted as JSON to a webhook, signed, from a task of their own.
//!
//! The executor hands an event to a bounded channel and goes on; a sender task posts each
//! event on its own (a slow receiver holding one event does not hold the next), retrying with
//! backoff. When the run ends, [`Notifier::close`] waits for what is still being delivered for
//! at most [`DELIVERY_BOUND`] and then gives up on it: an alert never holds the process's exit
//! longer than that, and never changes its exit code.
//!
//! The body is signed with HMAC-SHA256 under `IMGPIPE_NOTIFY_SECRET`:
//! `X-Imgpipe-Signature: sha256=<hex of HMAC(secret, body)>`.

use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::events::Event;

/// The most a run's exit waits for its events still being delivered.
pub const DELIVERY_BOUND: Duration = Duration::from_secs(5);
/// Tries of one event: the first and three retries.
const TRIES: u32 = 4;
/// The wait before the first retry; each later one doubles it.
const FIRST_RETRY: Duration = Duration::from_millis(250);
/// How long one try may take. Longer than [`DELIVERY_BOUND`] on purpose: a webhook slow to
/// answer is still given its chance during the run, and only the exit is bounded.
const TRY_TIMEOUT: Duration = Duration::from_secs(10);
/// A test-only setting: the milliseconds one try may take, in place of [`TRY_TIMEOUT`], so a
/// test sees a receiver that never answers given up on after its four tries without waiting
/// out four times 10 s.
pub const TEST_TRY_TIMEOUT_ENV: &str = "IMGPIPE_TEST_NOTIFY_TRY_TIMEOUT_MS";
/// Events waiting for the sender. A run sends a handful (three budget marks, a price above
/// plan that stops it, its end); a full queue drops the event with a warning, never blocks.
const QUEUE: usize = 64;

/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "X-Imgpipe-Signature";

/// Where events go and the key that signs them.
#[derive(Clone)]
pub struct Target {
    pub url: Url,
    pub secret: Option<Secret>,
}

/// The signing secret: never shown, not even in debug output.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Secret> {
        let bytes = bytes.into();
        (!bytes.is_empty()).then_some(Secret(bytes))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl std::fmt::Debug for Target {
    /// The host only: a webhook's path often is its credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("host", &self.url.host_str())
            .field("secret", &self.secret)
            .finish()
    }
}

/// `sha256=<hex>`: HMAC-SHA256 of the body under the secret.
pub fn signature(secret: &Secret, body: &[u8]) -> String {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(&secret.0).expect("HMAC accepts keys of any length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// Hands events to the sender task; cheap to clone, never waits.
#[derive(Clone)]
pub struct Sender(mpsc::Sender<Event>);

impl Sender {
    pub fn send(&self, event: Event) {
        if let Err(e) = self.0.try_send(event) {
            tracing::warn!("notify: an event was dropped: {e}");
        }
    }
}

/// The sender task and the way to stop it.
pub struct Notifier {
    sender: Sender,
    closing: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Notifier {
    pub fn start(target: Target) -> Result<Notifier, reqwest::Error> {
        let client = reqwest::Client::builder()
            // A redirect could lead a signed body to plain http elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(try_timeout())
            .build()?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let closing = CancellationToken::new();
        let task = tokio::spawn(send_all(client, target, rx, closing.clone()));
        Ok(Notifier {
            sender: Sender(tx),
            closing,
            task,
        })
    }

    pub fn sender(&self) -> Sender {
        self.sender.clone()
    }

    /// Sends `last`, then waits for every event still being delivered, at most `bound`.
    pub async fn close(self, last: Event, bound: Duration) {
        self.sender.send(last);
        self.closing.cancel();
        let mut task = self.task;
        if tokio::time::timeout(bound, &mut task).await.is_err() {
            task.abort();
            tracing::warn!(
                "notify: gave up on events not delivered within {}s of the run's end",
                bound.as_secs()
            );
        }
    }
}

/// [`TRY_TIMEOUT`], or the test's (see [`TEST_TRY_TIMEOUT_ENV`]).
fn try_timeout() -> Duration {
    std::env::var(TEST_TRY_TIMEOUT_ENV)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(TRY_TIMEOUT, Duration::from_millis)
}

/// Posts every event received, each in a task of its own, until told to close; then posts
/// what is queued and waits for all.
async fn send_all(
    client: reqwest::Client,
    target: Target,
    mut rx: mpsc::Receiver<Event>,
    closing: CancellationToken,
) {
    let mut posts = JoinSet::new();
    loop {
        let event = tokio::select! {
            biased;
            Some(event) = rx.recv() => event,
            () = closing.cancelled() => break,
        };
        posts.spawn(deliver(client.clone(), target.clone(), event));
    }
    while let Ok(event) = rx.try_recv() {
        posts.spawn(deliver(client.clone(), target.clone(), event));
    }
    while posts.join_next().await.is_some() {}
}

/// One event, tried [`TRIES`] times: again after a connection failure, a timeout, a 429 or a
/// 5xx; not after another answer, which the next try would get too.
async fn deliver(client: reqwest::Client, target: Target, event: Event) {
    let body = event.body(&crate::time::rfc3339(std::time::SystemTime::now()));
    let signature = target.secret.as_ref().map(|s| signature(s, &body));
    let mut why = String::new();
    for attempt in 0..TRIES {
        if attempt > 0 {
            tokio::time::sleep(FIRST_RETRY * 2u32.pow(attempt - 1)).await;
        }
        let mut request = client
            .post(target.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("X-Imgpipe-Event", event.kind())
            .body(body.clone());
        if let Some(s) = &signature {
            request = request.header(SIGNATURE_HEADER, s);
        }
        match request.send().await {
            Ok(r) if r.status().is_success() => return,
            Ok(r) if r.status().is_server_error() || r.status().as_u16() == 429 => {
                why = format!("the receiver answered {}", r.status());
            }
            Ok(r) => {
                why = format!("the receiver answered {}", r.status());
                break;
            }
            // Without the URL: a webhook's path is often its credential.
            Err(e) => why = chain(&e.without_url()),
        }
    }
    tracing::warn!("notify: {} not delivered: {why}", event.kind());
}

/// An error and its causes, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text += &format!(": {c}");
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_the_body_in_hex() {
        // RFC 4231, test case 2.
        let secret = Secret::new(*b"Jefe").unwrap();
        assert_eq!(
            signature(&secret, b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
