//! The sandbox: a faithful local emulator of the image service, shipped in the binary.
//!
//! It serves every endpoint of the spec on loopback with the same validation, real PNGs and
//! real transformations, real credits, signed URLs that really expire, rate limits and
//! injectable faults. Tests run against it in-process on port 0; `imgpipe sandbox` runs it
//! standalone; `--sandbox` on any command starts one for that command.

pub mod bad;
mod cutout;
mod drawings;
mod edit;
pub mod faults;
mod files;
mod handlers;
mod hold;
pub mod images;
mod reply;
mod rows;
mod signing;
mod state;
mod tools;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;

pub use bad::BadImages;
pub use faults::Faults;
pub use images::Weight;
pub use state::{LedgerEntry, SAMPLE_HOST, SAMPLE_NAMES, Stats};

use state::State;

/// How the sandbox behaves. The defaults follow the spec where it speaks (URL lifetime, tool
/// prices) and are documented choices where it does not (generation price, balance).
#[derive(Clone, Debug)]
pub struct Config {
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// The key clients must send; a random one when `None`.
    pub key: Option<String>,
    pub balance: i64,
    /// Credits per 2K image; 4K bills twice.
    pub generation_price: u64,
    /// Whether `GET /v1/models` states the generation price (the spec does not show one).
    pub advertise_price: bool,
    pub url_ttl: Duration,
    pub latency: Duration,
    pub jitter: Duration,
    /// Added latency per download of a result image: a slow link or a distant CDN.
    pub download_latency: Duration,
    /// Requests per second (see `rate_scope`); unlimited when `None`.
    pub rate_limit: Option<f64>,
    /// Calls the rate limit lets through at once after a quiet spell; one second's worth when
    /// `None`.
    pub rate_burst: Option<u32>,
    /// Which calls the rate limit counts.
    pub rate_scope: RateScope,
    /// Paid requests in flight at once; unlimited when `None`.
    pub max_in_flight: Option<usize>,
    /// Side in pixels of a 2K image (4K doubles it). Small by default to keep tests fast.
    pub image_side: u32,
    /// Flat pictures (fast, tiny files) or a photo's weight (benches of real volumes).
    pub weight: Weight,
    /// Each distinct picture drawn once and kept in memory, so that a second night of the same
    /// requests waits on its downloads rather than on the drawing (the bytes bench).
    pub remember_drawings: bool,
    pub faults: Faults,
    /// Bad images on request, drawn from the faults' seeded dice: for the checks to catch.
    pub bad_images: BadImages,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            port: 0,
            key: None,
            balance: 1000,
            generation_price: 4,
            advertise_price: false,
            url_ttl: Duration::from_secs(3600),
            latency: Duration::ZERO,
            jitter: Duration::ZERO,
            download_latency: Duration::ZERO,
            rate_limit: None,
            rate_burst: None,
            rate_scope: RateScope::All,
            max_in_flight: None,
            image_side: 256,
            weight: Weight::Flat,
            remember_drawings: false,
            faults: Faults::default(),
            bad_images: BadImages::default(),
        }
    }
}

/// The spec shows no rate limits; a real service most likely counts every call, but a test or
/// benchmark may want to limit the paid ones alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RateScope {
    /// Every `/v1/...` call.
    #[default]
    All,
    /// Only the paid `POST` calls.
    Paid,
}

/// A running sandbox. Dropping it stops the server.
pub struct Sandbox {
    state: Arc<State>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Sandbox {
    /// Binds 127.0.0.1 (never any other address) and starts serving. The listener is bound
    /// before this returns, so the sandbox accepts connections at once.
    pub async fn start(config: Config) -> std::io::Result<Sandbox> {
        let listener =
            TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, config.port))).await?;
        let state = Arc::new(new_state(config, listener.local_addr()?)?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, Arc::clone(&state), async {
            let _ = stopped.await;
        }));
        Ok(Sandbox {
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub fn base_url(&self) -> &Url {
        &self.state.base
    }

    pub fn key(&self) -> &str {
        &self.state.key
    }

    pub fn stats(&self) -> Stats {
        self.state.stats()
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.state.ledger()
    }

    pub fn balance(&self) -> i64 {
        self.state.balance()
    }

    /// The bytes of a result image (`files/{id}.png`), as its downloads serve them whole.
    pub fn stored_image(&self, id: &str) -> Option<bytes::Bytes> {
        self.state.stored_image(id)
    }

    /// Stops every injected fault from now on (the rate limit and latency stay).
    pub fn quiet_faults(&self) {
        self.state.dice.quiet();
    }

    pub fn set_balance(&self, balance: i64) {
        self.state.set_balance(balance);
    }

    /// Holds every paid call from now on at the gate of [`Sandbox::hold`], received but not
    /// billed, until the test lets it through ([`Sandbox::let_through`]) or releases the calls.
    pub fn hold_calls(&self) {
        self.state.hold_calls();
    }

    /// Lets `n` more held calls be billed and answered.
    pub fn let_through(&self, n: usize) {
        self.state.let_through(n);
    }

    /// Holds no more calls and lets every waiting one go.
    pub fn release_calls(&self) {
        self.state.release_calls();
    }

    /// Holds every paid call, from now until the returned guard is dropped, at the gate after
    /// its work and before its billing (see `hold.rs`): a run stays mid-call, in flight and
    /// unbilled, for as long as a test needs.
    pub fn hold(&self) -> Hold {
        self.state.gate.hold();
        Hold {
            state: Arc::clone(&self.state),
        }
    }

    /// Paid calls received and not yet done (billed or refused) now, held ones included: a
    /// test waits for 0 after killing a client to know the service has settled its calls.
    pub fn in_flight(&self) -> usize {
        self.state.in_flight()
    }

    /// Expires every result URL issued so far, as if its lifetime had passed (downloads get
    /// 403, tools 400), while `GET /v1/jobs/{id}` gives fresh ones: a test of expiry that does
    /// not wait for the clock, nor race it. Standalone: `POST /_sandbox/expire-urls`.
    pub fn expire_urls(&self) {
        self.state.expire_urls();
    }

    /// The next paid call to arrive is answered 429 with this `Retry-After` (whole seconds,
    /// rounded up), before any work or billing: a test aims one 429 at a chosen moment of a
    /// run instead of drawing it by chance (`--fault-rate-limit`). In process only.
    pub fn rate_limit_next(&self, retry_after: Duration) {
        self.state.rate_limit_next(retry_after);
    }

    /// The next `calls` paid calls are answered 400 (invalid request), before any work or
    /// billing: a test of a call the service refuses, aimed at a chosen moment. In process only.
    pub fn refuse_next(&self, calls: usize) {
        self.state.refuse_next(calls);
    }

    /// The next `reads` reads of the account (`GET /v1/account`: the read a run starts with,
    /// and the balance it ends with), and the next `reads` of the models list
    /// (`GET /v1/models`), are each answered 429 with this `Retry-After` (whole seconds, at least 1), whatever the rate
    /// limit says: a test of how those free reads are waited out that counts its 429s instead
    /// of racing the rate limit's window. Counted in [`Stats`] as `reads_rate_limited`.
    /// Standalone: `POST /_sandbox/rate-limit-reads?reads=N&retry_after=S`.
    pub fn rate_limit_reads(&self, reads: usize, retry_after: Duration) {
        self.state.rate_limit_reads(reads, retry_after);
    }

    /// The next `reads` reads of a job (`GET /v1/jobs/{id}`, whichever job: the read that
    /// recovers an answer lost after it named its job) are each answered 429 with this
    /// `Retry-After` (whole seconds, at least 1), whatever the rate limit says: a client stays
    /// waiting to read a job back for as long as a test needs, by count rather than by racing
    /// the rate limit's window. Counted in [`Stats`] as `job_reads` and
    /// `job_reads_rate_limited`. Standalone:
    /// `POST /_sandbox/rate-limit-job-reads?reads=N&retry_after=S`.
    pub fn rate_limit_job_reads(&self, reads: usize, retry_after: Duration) {
        self.state.rate_limit_job_reads(reads, retry_after);
    }

    /// When each 429 was answered, in microseconds on the clock of the ledger's `received_us`,
    /// so a test can order the calls that arrived against it.
    pub fn rate_limits(&self) -> Vec<u64> {
        self.state.rate_limits()
    }

    /// Paid calls waiting at a hold now.
    pub fn held_calls(&self) -> usize {
        self.state.gate.waiting()
    }

    /// Paid calls waiting at a hold now whose caller hung up (a process killed while they were
    /// held): released, they are billed for nobody.
    pub fn held_calls_hung_up(&self) -> usize {
        self.state.gate.waiting_hung_up()
    }

    /// Stops accepting connections and waits for the server to finish.
    pub async fn stop(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.unwrap_or_else(|e| Err(std::io::Error::other(e))),
            None => Ok(()),
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A hold on the sandbox's paid calls ([`Sandbox::hold`]); dropping it releases them.
pub struct Hold {
    state: Arc<State>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.state.gate.release();
    }
}

fn new_state(config: Config, addr: SocketAddr) -> std::io::Result<State> {
    let base = Url::parse(&format!("http://{addr}/")).map_err(std::io::Error::other)?;
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| std::io::Error::other(e.to_string()))?;
    let key = match &config.key {
        Some(key) => key.clone(),
        None => {
            let mut raw = [0u8; 16];
            getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
            format!("sbx_{}", hex::encode(raw))
        }
    };
    Ok(State::new(config, key, base, secret))
}

/// Serves on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, handlers::router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
