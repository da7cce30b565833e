//! The sandbox's books: balance, jobs, stored images, the billing ledger and counters.
//!
//! Billing is a single locked step that checks the balance and records the charge together,
//! so concurrent calls can never overdraw the account and every charge is in the ledger.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};
use url::Url;

use crate::api::job_id::JobId;
use crate::api::rules::{InvalidField, is_service_url};
use crate::api::types::ToolName;
use crate::sandbox::Config;
use crate::sandbox::faults::Dice;
use crate::sandbox::images;
use crate::sandbox::signing::{Refusal, Signer, now_ms};
use crate::sha256::Sha256Sum;

/// The model the sandbox reports for every generation.
pub(super) const MODEL_ID: &str = "sandbox-image-1";
/// Host of the sample images that every sandbox resolves without any network, whatever its
/// port: `.invalid` can never resolve (RFC 2606), so pipelines can name samples portably.
pub const SAMPLE_HOST: &str = "sandbox.invalid";
pub const SAMPLE_NAMES: &[&str] = &["mug", "lamp", "chair", "plant"];

/// One charge, as the tests and benchmarks read it back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LedgerEntry {
    pub job_id: JobId,
    /// `generate` or the tool's name.
    pub operation: String,
    /// What was paid for: the sha256 (hex) of the operation and its request body, with keys
    /// sorted and every result URL replaced by the image it names (a refreshed URL is the same
    /// input). Job ids are new with every bill, so only this tells the same request paid twice.
    pub request: Sha256Sum,
    pub credits: u64,
    /// False when the connection was dropped after billing: the caller never saw the answer.
    pub delivered: bool,
    /// The answer was cut after its start had named the job (`delivered` is then false): the
    /// caller can read the job back instead of paying again.
    pub partial: bool,
    /// When the call reached the sandbox, in microseconds since the sandbox started (a
    /// monotonic clock), for checking how a client paces its calls.
    pub received_us: u64,
}

/// Counters of what the sandbox saw and answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Requests to `/v1/...`, whatever their outcome.
    pub api_requests: u64,
    pub paid_requests: u64,
    pub billed: u64,
    pub unauthorized: u64,
    pub invalid: u64,
    pub insufficient_credits: u64,
    pub not_found: u64,
    pub rate_limited: u64,
    /// `GET /v1/account` requests received (with the right key), 429s included: the read a
    /// run starts with, and the balance it ends with.
    pub account_reads: u64,
    /// `GET /v1/models` requests received (with the right key), 429s included.
    pub models_reads: u64,
    /// Account and models reads answered 429 as armed by [`State::rate_limit_reads`] (also
    /// counted in `rate_limited`).
    pub reads_rate_limited: u64,
    /// `GET /v1/jobs/{id}` requests received (with the right key), 429s included: the read
    /// that recovers a lost answer by its job.
    pub job_reads: u64,
    /// Job reads answered 429 as armed by [`State::rate_limit_job_reads`] (also counted in
    /// `rate_limited`).
    pub job_reads_rate_limited: u64,
    pub server_errors: u64,
    pub dropped_after_billing: u64,
    /// Billed calls answered 504 by the gateway fault.
    pub gateway_timeouts: u64,
    /// Billed calls whose answer was cut after naming the job.
    pub partial_answers: u64,
    /// Billed calls whose caller hung up before the answer (a client timeout, say).
    pub abandoned: u64,
    pub downloads: u64,
    pub refused_downloads: u64,
    pub truncated_downloads: u64,
    pub peak_in_flight: usize,
    /// The most result images billed and not yet downloaded at once: how far a client's
    /// downloads fell behind its calls.
    pub peak_undownloaded: usize,
    /// Paid calls answered with a picture drawn before (`--remember-drawings`).
    pub recalled_drawings: u64,
}

#[derive(Clone, Debug)]
pub enum JobKind {
    Generation,
    Tool(ToolName),
}

#[derive(Clone, Debug)]
pub struct Job {
    pub id: JobId,
    pub kind: JobKind,
    pub credits_used: u64,
    pub credits_remaining: i64,
    pub image_ids: Vec<String>,
    pub created_ms: u64,
}

/// Where an image URL given to the sandbox leads.
pub enum Source {
    /// A stored result image, by id.
    Result(String),
    /// A built-in sample, by name.
    Sample(&'static str),
    /// Somewhere else; the sandbox never fetches it.
    Elsewhere(Url),
}

struct Books {
    balance: i64,
    jobs: HashMap<JobId, Job>,
    images: HashMap<String, Bytes>,
    /// Result images never downloaded yet.
    undownloaded: std::collections::HashSet<String>,
    ledger: Vec<LedgerEntry>,
    stats: Stats,
    next_id: u64,
    /// When each 429 was answered, on the clock of the ledger's `received_us`.
    rate_limited_us: Vec<u64>,
    /// A 429 the next paid call gets, with this `Retry-After` ([`State::rate_limit_next`]).
    armed_rate_limit: Option<Duration>,
    /// Paid calls still to be answered 400 ([`State::refuse_next`]).
    armed_refusals: usize,
    /// Reads of the account, and of the models list, still to be answered 429, and with which
    /// `Retry-After` ([`State::rate_limit_reads`]).
    armed_read_limits: ArmedReads,
    /// Reads of a job still to be answered 429 ([`State::rate_limit_job_reads`]).
    armed_job_read_limits: Armed,
}

/// 429s armed for the reads a run starts with ([`State::rate_limit_reads`]).
#[derive(Default)]
struct ArmedReads {
    account: Armed,
    models: Armed,
}

/// 429s armed for the next calls of one kind: how many are left, and their `Retry-After`.
#[derive(Clone, Copy, Default)]
struct Armed {
    left: usize,
    retry_after: Duration,
}

impl Armed {
    /// The `Retry-After` of the next armed 429, spending it; `None` once they are spent.
    fn take(&mut self) -> Option<Duration> {
        self.left = self.left.checked_sub(1)?;
        Some(self.retry_after)
    }
}

/// A free read that a test may arm 429s for, counted in [`Stats`] whether it meets one or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// `GET /v1/account`.
    Account,
    /// `GET /v1/models`.
    Models,
    /// `GET /v1/jobs/{id}`.
    Job,
}

pub struct State {
    pub config: Config,
    pub key: String,
    pub base: Url,
    pub dice: Dice,
    signer: Signer,
    id_salt: u64,
    books: Mutex<Books>,
    in_flight: AtomicUsize,
    /// The origin of the ledger's `received_us`.
    started: Instant,
    /// Where paid calls wait, unbilled, while the sandbox is held.
    pub(crate) gate: crate::sandbox::hold::Gate,
    /// Paid requests per second, when the sandbox is told to limit them.
    pub limiter: Option<governor::DefaultDirectRateLimiter>,
    samples: HashMap<&'static str, Bytes>,
    /// The pictures drawn so far, when the sandbox remembers them (`--remember-drawings`).
    pub(super) drawings: Option<Arc<crate::sandbox::drawings::Drawings>>,
}

impl State {
    pub fn new(config: Config, key: String, base: Url, secret: [u8; 32]) -> Self {
        let samples = SAMPLE_NAMES
            .iter()
            .map(|name| {
                let png = images::sample_png(name, config.image_side, config.weight);
                (*name, Bytes::from(png))
            })
            .collect();
        State {
            dice: Dice::new(config.faults.seed),
            books: Mutex::new(Books {
                balance: config.balance,
                jobs: HashMap::new(),
                images: HashMap::new(),
                undownloaded: std::collections::HashSet::new(),
                ledger: Vec::new(),
                stats: Stats::default(),
                next_id: 0,
                rate_limited_us: Vec::new(),
                armed_rate_limit: None,
                armed_refusals: 0,
                armed_read_limits: ArmedReads::default(),
                armed_job_read_limits: Armed::default(),
            }),
            signer: Signer::new(secret),
            id_salt: u64::from_le_bytes([
                secret[0], secret[1], secret[2], secret[3], secret[4], secret[5], secret[6],
                secret[7],
            ]),
            in_flight: AtomicUsize::new(0),
            started: Instant::now(),
            gate: crate::sandbox::hold::Gate::new(),
            limiter: config
                .rate_limit
                .and_then(|rate| limiter(rate, config.rate_burst)),
            samples,
            drawings: config.remember_drawings.then(Default::default),
            config,
            key,
            base,
        }
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // A panic while holding the lock cannot leave the books half-written: every update
        // is a few field assignments. Keep serving.
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn count(&self, update: impl FnOnce(&mut Stats)) {
        update(&mut self.books().stats);
    }

    pub fn stats(&self) -> Stats {
        let mut stats = self.books().stats.clone();
        stats.recalled_drawings = self.drawings.as_ref().map_or(0, |d| d.recalled());
        stats
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.books().ledger.clone()
    }

    pub fn balance(&self) -> i64 {
        self.books().balance
    }

    pub fn set_balance(&self, balance: i64) {
        self.books().balance = balance;
    }

    /// Expires every result URL issued so far, as if its lifetime had passed; the jobs give
    /// fresh ones.
    pub fn expire_urls(&self) {
        self.signer.expire_all(self.config.url_ttl);
    }

    /// Counts a 429 answered now, and notes when.
    pub fn rate_limited(&self) {
        let now = self.since_start_us();
        let mut books = self.books();
        books.stats.rate_limited += 1;
        books.rate_limited_us.push(now);
    }

    /// When each 429 so far was answered, in microseconds on the ledger's clock.
    pub fn rate_limits(&self) -> Vec<u64> {
        self.books().rate_limited_us.clone()
    }

    /// The next paid call to arrive gets a 429 with `retry_after`, before anything is billed.
    pub fn rate_limit_next(&self, retry_after: Duration) {
        self.books().armed_rate_limit = Some(retry_after);
    }

    /// The next `calls` paid calls are answered 400, before any work or billing.
    pub fn refuse_next(&self, calls: usize) {
        self.books().armed_refusals = calls;
    }

    /// Whether the call asking is one to answer 400 ([`State::refuse_next`]).
    pub fn take_armed_refusal(&self) -> bool {
        let mut books = self.books();
        let armed = books.armed_refusals > 0;
        books.armed_refusals = books.armed_refusals.saturating_sub(1);
        armed
    }

    /// The next `reads` reads of the account, and the next `reads` of the models list, are
    /// answered 429 with `retry_after`, whatever the rate limit says: counted, not timed.
    pub fn rate_limit_reads(&self, reads: usize, retry_after: Duration) {
        let armed = Armed {
            left: reads,
            retry_after,
        };
        self.books().armed_read_limits = ArmedReads {
            account: armed,
            models: armed,
        };
    }

    /// The next `reads` reads of a job (`GET /v1/jobs/{id}`, whichever job) are answered 429
    /// with `retry_after`, whatever the rate limit says: counted, not timed.
    pub fn rate_limit_job_reads(&self, reads: usize, retry_after: Duration) {
        self.books().armed_job_read_limits = Armed {
            left: reads,
            retry_after,
        };
    }

    /// Counts a free read of kind `read` and, when a 429 is still armed for it
    /// ([`State::rate_limit_reads`], [`State::rate_limit_job_reads`]), takes its
    /// `Retry-After`.
    pub fn take_armed_read_limit(&self, read: Read) -> Option<Duration> {
        let books = &mut *self.books();
        let stats = &mut books.stats;
        let (reads, limited, armed) = match read {
            Read::Account => (
                &mut stats.account_reads,
                &mut stats.reads_rate_limited,
                &mut books.armed_read_limits.account,
            ),
            Read::Models => (
                &mut stats.models_reads,
                &mut stats.reads_rate_limited,
                &mut books.armed_read_limits.models,
            ),
            Read::Job => (
                &mut stats.job_reads,
                &mut stats.job_reads_rate_limited,
                &mut books.armed_job_read_limits,
            ),
        };
        *reads += 1;
        let wait = armed.take()?;
        *limited += 1;
        Some(wait)
    }

    /// The armed 429's `Retry-After`, once: the call asking gets it.
    pub fn take_armed_rate_limit(&self) -> Option<Duration> {
        self.books().armed_rate_limit.take()
    }

    fn since_start_us(&self) -> u64 {
        self.started.elapsed().as_micros().min(u128::from(u64::MAX)) as u64
    }

    /// Paid calls received and not yet done (billed or refused) now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Takes a slot among the paid calls in flight; `None` when the configured limit is full.
    pub fn enter(self: &Arc<Self>) -> Option<InFlight> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        if self.config.max_in_flight.is_some_and(|max| now > max) {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        self.count(|s| s.peak_in_flight = s.peak_in_flight.max(now));
        let received_us = self.since_start_us();
        Some(InFlight {
            state: Arc::clone(self),
            received_us,
        })
    }

    /// A fresh id, allocated under the lock the caller already holds.
    fn new_id(&self, books: &mut Books, prefix: &str) -> String {
        books.next_id += 1;
        let n = books.next_id;
        // Mix the counter so ids look opaque, as the service's do, yet stay unique.
        let mixed = Dice::new(n ^ self.id_salt).next_u64();
        format!("{prefix}_{n:06}{:08x}", mixed as u32)
    }

    /// A freshly signed URL for a stored image, valid for the configured TTL.
    pub fn result_url(&self, image_id: &str) -> String {
        let expires = self.signer.expires_after(self.config.url_ttl);
        format!(
            "{}files/{image_id}.png?{}",
            self.base,
            self.signer.sign(image_id, expires)
        )
    }

    /// Checks a result URL's signature and expiry; used by downloads and tool inputs alike.
    pub fn check_signed(&self, image_id: &str, query: Option<&str>) -> Result<(), Refusal> {
        let mut expires = None;
        let mut sig = None;
        for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match k.as_ref() {
                "expires" => expires = v.parse::<u64>().ok(),
                "sig" => sig = Some(v.into_owned()),
                _ => {}
            }
        }
        match (expires, sig) {
            (Some(expires), Some(sig)) => self.signer.verify(image_id, expires, &sig),
            _ => Err(Refusal::Forged),
        }
    }

    /// Resolves an image URL the caller sent, enforcing signatures and expiry on our own URLs.
    pub fn resolve(&self, field: &str, raw: &str) -> Result<Source, InvalidField> {
        let url =
            Url::parse(raw).map_err(|e| InvalidField::new(field, format!("is not a URL ({e})")))?;
        let ours = is_service_url(&url, &self.base);
        let sample_host = url.scheme() == "https" && url.host_str() == Some(SAMPLE_HOST);
        if !ours && !sample_host {
            return Ok(Source::Elsewhere(url));
        }
        let path = url.path();
        if let Some(name) = path
            .strip_prefix("/assets/")
            .and_then(|f| f.strip_suffix(".png"))
        {
            return SAMPLE_NAMES
                .iter()
                .find(|s| **s == name)
                .map(|s| Source::Sample(s))
                .ok_or_else(|| {
                    InvalidField::new(
                        field,
                        format!(
                            "no sample image named {name:?}; samples: {}",
                            SAMPLE_NAMES.join(", ")
                        ),
                    )
                });
        }
        let id = path
            .strip_prefix("/files/")
            .and_then(|f| f.strip_suffix(".png"))
            .filter(|_| ours)
            .ok_or_else(|| {
                InvalidField::new(field, format!("{raw} is not an image URL of this sandbox"))
            })?;
        match self.check_signed(id, url.query()) {
            Ok(()) if self.books().images.contains_key(id) => Ok(Source::Result(id.to_owned())),
            Ok(()) => Err(InvalidField::new(field, "names no stored image")),
            Err(Refusal::Expired) => Err(InvalidField::new(
                field,
                "the URL has expired; get a fresh one with GET /v1/jobs/{id}",
            )),
            Err(Refusal::Forged) => {
                Err(InvalidField::new(field, "the URL's signature is not valid"))
            }
        }
    }

    /// PNG bytes of a resolved source; `None` for URLs elsewhere.
    pub fn image_bytes(&self, source: &Source) -> Option<Bytes> {
        match source {
            Source::Result(id) => self.books().images.get(id).cloned(),
            Source::Sample(name) => self.samples.get(name).cloned(),
            Source::Elsewhere(_) => None,
        }
    }

    /// Bills `credits` and stores the job and its images in one step, for the call `slot`
    /// admitted. `Err(balance)` when the balance cannot pay: then nothing is billed.
    pub fn bill(
        &self,
        slot: &InFlight,
        kind: JobKind,
        credits: u64,
        images: Vec<Vec<u8>>,
        request: Sha256Sum,
    ) -> Result<Job, i64> {
        let mut books = self.books();
        let cost = i64::try_from(credits).unwrap_or(i64::MAX);
        if books.balance < cost {
            books.stats.insufficient_credits += 1;
            return Err(books.balance);
        }
        let id = JobId::new(self.new_id(&mut books, "job"));
        let image_ids: Vec<String> = (0..images.len())
            .map(|_| self.new_id(&mut books, "img"))
            .collect();
        books.balance -= cost;
        let operation = match kind {
            JobKind::Generation => "generate".to_owned(),
            JobKind::Tool(tool) => tool.as_str().to_owned(),
        };
        for (image_id, png) in image_ids.iter().zip(images) {
            books.images.insert(image_id.clone(), Bytes::from(png));
            books.undownloaded.insert(image_id.clone());
        }
        books.stats.peak_undownloaded = books.stats.peak_undownloaded.max(books.undownloaded.len());
        let job = Job {
            id: id.clone(),
            kind,
            credits_used: credits,
            credits_remaining: books.balance,
            image_ids,
            created_ms: now_ms(),
        };
        books.jobs.insert(id.clone(), job.clone());
        books.ledger.push(LedgerEntry {
            job_id: id,
            operation,
            request,
            credits,
            delivered: true,
            partial: false,
            received_us: slot.received_us,
        });
        books.stats.billed += 1;
        Ok(job)
    }

    /// Records that the answer for `job_id` never reached the caller whole; `partial` when
    /// its start, naming the job, did.
    pub fn mark_undelivered(&self, job_id: &JobId, partial: bool) {
        let mut books = self.books();
        if let Some(entry) = books.ledger.iter_mut().rev().find(|e| e.job_id == *job_id) {
            entry.delivered = false;
            entry.partial = partial;
        }
    }

    pub fn job(&self, id: &JobId) -> Option<Job> {
        self.books().jobs.get(id).cloned()
    }

    pub fn stored_image(&self, id: &str) -> Option<Bytes> {
        self.books().images.get(id).cloned()
    }

    /// Notes that a result image was downloaded (whole or not).
    pub fn downloaded(&self, id: &str) {
        self.books().undownloaded.remove(id);
    }

    pub fn sample(&self, name: &str) -> Option<Bytes> {
        self.samples.get(name).cloned()
    }

    /// The job as the service reports it, with freshly signed URLs.
    pub fn job_json(&self, job: &Job) -> Value {
        let urls: Vec<String> = job.image_ids.iter().map(|i| self.result_url(i)).collect();
        match job.kind {
            JobKind::Generation => json!({
                "id": job.id,
                "status": "succeeded",
                "model": MODEL_ID,
                "credits_used": job.credits_used,
                "credits_remaining": job.credits_remaining,
                "images": urls.iter().map(|u| json!({"url": u})).collect::<Vec<_>>(),
                "created_at": job.created_ms / 1000,
            }),
            JobKind::Tool(tool) => json!({
                "id": job.id,
                "status": "succeeded",
                "tool": tool.as_str(),
                "credits_used": job.credits_used,
                "data": {"url": urls.first()},
                "created_at": job.created_ms / 1000,
            }),
        }
    }

    /// From now on, every paid call waits before it is billed until [`State::let_through`]
    /// lets it go.
    pub fn hold_calls(&self) {
        self.gate.hold();
    }

    /// Lets `n` more held calls be billed and answered, now or when they come.
    pub fn let_through(&self, n: usize) {
        self.gate.let_through(n);
    }

    /// Holds no more calls, and lets every waiting one go.
    pub fn release_calls(&self) {
        self.gate.release_all();
    }

    /// Added latency for a paid call: the configured base plus jitter.
    pub fn latency(&self) -> Duration {
        self.config.latency + self.dice.jitter(self.config.jitter)
    }
}

/// A limiter admitting `rate` requests per second with a burst of `burst`, by default one
/// second's worth, so a client pacing itself at the same rate is not refused for network
/// jitter.
fn limiter(rate: f64, burst: Option<u32>) -> Option<governor::DefaultDirectRateLimiter> {
    use std::num::NonZeroU32;
    if !(rate.is_finite() && rate > 0.0) {
        return None;
    }
    let burst = NonZeroU32::new(
        burst.unwrap_or_else(|| rate.ceil().clamp(1.0, f64::from(u32::MAX)) as u32),
    )?;
    let period = Duration::try_from_secs_f64(1.0 / rate).ok()?;
    let quota = governor::Quota::with_period(period)?.allow_burst(burst);
    Some(governor::RateLimiter::direct(quota))
}

/// A paid call in flight; frees its slot when dropped.
pub struct InFlight {
    state: Arc<State>,
    /// When the call was admitted, as the ledger records it.
    received_us: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        let base = Url::parse("http://127.0.0.1:1/").unwrap();
        State::new(Config::default(), "sbx_test".into(), base, [7; 32])
    }

    /// Armed job reads are refused as many times as armed, with their `Retry-After`, then
    /// answered; every read is counted, and the reads of the account and models are left alone.
    #[test]
    fn job_reads_meet_their_armed_429s_that_many_times_and_no_other_read_does() {
        let state = state();
        state.rate_limit_job_reads(2, Duration::from_secs(9));
        assert_eq!(state.take_armed_read_limit(Read::Account), None);
        assert_eq!(state.take_armed_read_limit(Read::Models), None);
        let job_reads: Vec<_> = (0..3)
            .map(|_| state.take_armed_read_limit(Read::Job))
            .collect();
        let nine = Some(Duration::from_secs(9));
        assert_eq!(job_reads, [nine, nine, None]);
        let stats = state.stats();
        assert_eq!(
            (stats.job_reads, stats.job_reads_rate_limited),
            (3, 2),
            "{stats:?}"
        );
        assert_eq!(
            (
                stats.account_reads,
                stats.models_reads,
                stats.reads_rate_limited
            ),
            (1, 1, 0),
            "{stats:?}"
        );
    }

    /// Reads armed for the account and models list leave the job reads alone, and the other
    /// way round: each kind keeps its own count.
    #[test]
    fn reads_armed_for_the_account_and_models_leave_job_reads_alone() {
        let state = state();
        state.rate_limit_reads(1, Duration::from_secs(3));
        assert_eq!(state.take_armed_read_limit(Read::Job), None);
        let three = Some(Duration::from_secs(3));
        assert_eq!(state.take_armed_read_limit(Read::Account), three);
        assert_eq!(state.take_armed_read_limit(Read::Models), three);
        assert_eq!(state.take_armed_read_limit(Read::Account), None);
        let stats = state.stats();
        assert_eq!(
            (stats.reads_rate_limited, stats.job_reads_rate_limited),
            (2, 0)
        );
    }
}
