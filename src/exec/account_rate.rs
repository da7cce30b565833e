//! An account's rate limit shared by every process that spends on it through one state
//! database: calls are drawn from it in small blocks (one statement each, see
//! [`Rates::draw`](crate::store::Rates::draw)), and each block's calls are spent one interval
//! apart from the moment the database gave it. A block not spent in its time is lost, never
//! lent again: a process that dies holding one delays no one past the block's end.
//!
//! When the database does not answer within [`ANSWER_WITHIN`], the process keeps to its share
//! of the limit (the limit divided by the drawers it last saw), says so once, and goes back to
//! the shared limit as soon as the database answers again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use governor::DefaultDirectRateLimiter;
use tokio::time::Instant;

use crate::run_id::RunId;
use crate::store::{Drawn, NewDrawer, Store, StoreError};

/// A test-only setting: the state database the shared rate is drawn from, when it is to be
/// another connection than the run's records (a test cuts it alone, through a proxy, while
/// the run's records go on).
pub const TEST_RATE_STATE_ENV: &str = "IMGPIPE_TEST_RATE_STATE";

/// How long a draw may take before the process falls back to its share.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// How often the database is asked again while the process keeps to its share.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// How often a drawer says it is alive, and learns how many draw beside it.
const BEAT_EVERY: Duration = Duration::from_secs(5);

/// Calls the account's limit lets go at once after a quiet spell, as the local limiter does: a
/// run that starts (or a resume right after its run) sends its first call at once, and a call
/// that woke late does not cost the next its turn.
const BURST: u32 = 2;

/// A drawer silent this long is no longer counted (six beats missed), nor shown.
pub const STALE_AFTER_MS: i64 = 30_000;

/// Draws a second, at most, that a process aims for at high rates: a block holds about
/// rate ÷ this many calls, and one call at low rates.
const DRAWS_PER_SECOND: f64 = 8.0;

/// The calls of a block: enough that the database is asked about [`DRAWS_PER_SECOND`] times
/// a second, one at low rates.
pub fn block_for(rate: f64) -> u32 {
    (rate / DRAWS_PER_SECOND).ceil().clamp(1.0, 256.0) as u32
}

/// A process's hold on its account's shared limit. Clones share it.
#[derive(Clone)]
pub struct AccountRate {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AccountRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccountRate")
            .field("per_second", &self.inner.rate)
            .field("block", &self.inner.block)
            .finish_non_exhaustive()
    }
}

struct Inner {
    store: Store,
    /// Digest of the service's address and the key (never the key).
    account: String,
    holder: String,
    run_id: RunId,
    host: String,
    rate: f64,
    interval: Duration,
    block: u32,
    /// The block being spent; one caller at a time takes its next call (or draws the next).
    spending: tokio::sync::Mutex<Block>,
    drawn: AtomicU64,
    /// Drawers of the account at the last beat, this one included.
    seen: AtomicU64,
    /// Set while the database does not answer: the process keeps to its share.
    fallback: Mutex<Option<Arc<DefaultDirectRateLimiter>>>,
    said_fallback: AtomicBool,
    /// Bumped by each 429: blocks drawn before it are dropped.
    pauses: AtomicU64,
    /// Who hears that the process fell back to its share (the run's events).
    observer: Mutex<Option<Arc<dyn super::Observer>>>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// The calls left of the block in hand: the next at `next`, one every interval.
#[derive(Clone, Copy, Debug)]
struct Block {
    next: Instant,
    /// When the block came: its calls whose time had passed (the burst after a quiet spell)
    /// may go from then.
    came: Instant,
    left: u32,
    pauses: u64,
}

impl AccountRate {
    /// Enrols this process as a drawer of `account` at `rate` calls a second; `Err` when the
    /// database cannot say (then the run goes without a shared limit, as before).
    pub async fn open(
        store: &Store,
        account: String,
        rate: f64,
        run_id: &RunId,
    ) -> Result<AccountRate, StoreError> {
        let host = crate::store::lock::hostname();
        let holder = format!(
            "{host}:{}:{}",
            std::process::id(),
            crate::place::layout::own_mark()
        );
        let interval = Duration::from_secs_f64(1.0 / rate);
        let inner = Arc::new(Inner {
            store: store.clone(),
            account,
            holder,
            run_id: run_id.to_owned(),
            host,
            rate,
            interval,
            block: block_for(rate),
            spending: tokio::sync::Mutex::new(Block {
                next: Instant::now(),
                came: Instant::now(),
                left: 0,
                pauses: 0,
            }),
            drawn: AtomicU64::new(0),
            seen: AtomicU64::new(1),
            fallback: Mutex::new(None),
            said_fallback: AtomicBool::new(false),
            pauses: AtomicU64::new(0),
            observer: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
        });
        let interval_us = u64::try_from(interval.as_micros()).unwrap_or(u64::MAX);
        store
            .rates()
            .enrol(&inner.drawer(), interval_us, BURST)
            .await?;
        inner.beat().await?;
        let beating = tokio::spawn(beat(Arc::downgrade(&inner)));
        inner.keep(beating);
        Ok(AccountRate { inner })
    }

    /// Tells `observer` (the run's events) when the process falls back to its share.
    pub fn tell(&self, observer: Arc<dyn super::Observer>) {
        if let Ok(mut slot) = self.inner.observer.lock() {
            *slot = Some(observer);
        }
    }

    /// The calls a block holds.
    pub fn block(&self) -> u32 {
        self.inner.block
    }

    /// Waits until this process may send one call on the account's shared limit (or its share
    /// of it while the database does not answer).
    pub async fn take(&self) {
        loop {
            let fallback = self.inner.fallback_limiter();
            if let Some(limiter) = fallback {
                limiter.until_ready().await;
                return;
            }
            let mut block = self.inner.spending.lock().await;
            if let Some(at) = self.inner.next_call(&mut block) {
                tokio::time::sleep_until(at).await;
                return;
            }
            if !self.inner.draw_into(&mut block).await {
                drop(block);
                self.inner.fall_back();
            }
        }
    }

    /// The service answered 429 on this account: every drawer pauses for `pause`.
    pub fn throttled(&self, pause: Duration) {
        self.inner.pauses.fetch_add(1, Relaxed);
        let inner = Arc::clone(&self.inner);
        let pause_us = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX);
        let recording = tokio::spawn(async move {
            let rates = inner.store.rates();
            let told = rates.pause(&inner.account, pause_us);
            match tokio::time::timeout(ANSWER_WITHIN, told).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("cannot record the 429 for other processes: {e}"),
                Err(_) => tracing::warn!(
                    "cannot record the 429 for other processes: the state database did not answer within {}s",
                    ANSWER_WITHIN.as_secs()
                ),
            }
        });
        self.inner.keep(recording);
    }

    /// Stops drawing: the drawer leaves the account's list.
    pub async fn close(&self) {
        if let Ok(mut tasks) = self.inner.tasks.lock() {
            for task in tasks.drain(..) {
                task.abort();
            }
        }
        let rates = self.inner.store.rates();
        let leave = rates.leave(&self.inner.holder);
        if let Ok(Err(e)) = tokio::time::timeout(ANSWER_WITHIN, leave).await {
            tracing::debug!("cannot remove this process from the rate's drawers: {e}");
        }
    }
}

impl Inner {
    fn drawer(&self) -> NewDrawer<'_> {
        NewDrawer {
            holder: &self.holder,
            account: &self.account,
            run_id: &self.run_id,
            host: &self.host,
            pid: std::process::id(),
        }
    }

    fn keep(&self, task: tokio::task::JoinHandle<()>) {
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
    }

    fn fallback_limiter(&self) -> Option<Arc<DefaultDirectRateLimiter>> {
        self.fallback.lock().ok().and_then(|f| f.clone())
    }

    /// The time of the block's next call still in its time (a call may go up to an interval
    /// after its time, or after the block came when its time was already past), skipping
    /// (losing) those whose time passed; `None` when the block is spent or dropped by a 429.
    fn next_call(&self, block: &mut Block) -> Option<Instant> {
        if block.pauses != self.pauses.load(Relaxed) {
            block.left = 0;
        }
        let now = Instant::now();
        while block.left > 0 && block.next.max(block.came) + self.interval <= now {
            block.next += self.interval;
            block.left -= 1;
        }
        if block.left == 0 {
            return None;
        }
        let at = block.next;
        block.next += self.interval;
        block.left -= 1;
        Some(at)
    }

    /// Draws the next block into `block`; false when the database did not answer in time.
    async fn draw_into(&self, block: &mut Block) -> bool {
        let pauses = self.pauses.load(Relaxed);
        let interval_us = u64::try_from(self.interval.as_micros()).unwrap_or(u64::MAX);
        match self.draw(interval_us).await {
            Some(drawn) => {
                // The block's start on this process's clock: the statement's "now" is taken
                // as the moment the answer arrived, which can only make the block later.
                let ahead = Duration::from_micros(
                    u64::try_from(drawn.start_us - drawn.now_us).unwrap_or(0),
                );
                let behind = Duration::from_micros(
                    u64::try_from(drawn.now_us - drawn.start_us).unwrap_or(0),
                );
                let now = Instant::now();
                *block = Block {
                    next: (now + ahead).checked_sub(behind).unwrap_or(now),
                    came: now,
                    left: self.block,
                    pauses,
                };
                self.drawn.fetch_add(u64::from(self.block), Relaxed);
                true
            }
            None => false,
        }
    }

    async fn draw(&self, interval_us: u64) -> Option<Drawn> {
        let rates = self.store.rates();
        let seen_since = crate::store::now_ms() - STALE_AFTER_MS;
        let asked = rates.draw(&self.account, self.block, interval_us, seen_since);
        match tokio::time::timeout(ANSWER_WITHIN, asked).await {
            Ok(Ok(Some(drawn))) => {
                self.seen.store(drawn.drawers.max(1), Relaxed);
                Some(drawn)
            }
            Ok(Ok(None)) => {
                // The account's row is gone (removed by hand): enrol again, then draw.
                let enrolled = rates.enrol(&self.drawer(), interval_us, BURST).await;
                if let Err(e) = enrolled {
                    tracing::debug!("cannot enrol in the shared rate: {e}");
                    return None;
                }
                rates
                    .draw(&self.account, self.block, interval_us, seen_since)
                    .await
                    .ok()
                    .flatten()
            }
            Ok(Err(e)) => {
                tracing::debug!("cannot draw from the shared rate: {e}");
                None
            }
            Err(_) => None,
        }
    }

    /// The database did not answer: keep to the share of the limit until it does.
    fn fall_back(self: &Arc<Self>) {
        let seen = self.seen.load(Relaxed).max(1);
        let share = self.rate / seen as f64;
        let Ok(mut slot) = self.fallback.lock() else {
            return;
        };
        if slot.is_some() {
            return;
        }
        *slot = super::limiter::governor_for(share);
        drop(slot);
        if !self.said_fallback.swap(true, Relaxed) {
            tracing::warn!(
                "the state database did not answer within {}s: keeping to this process's share of the account's rate, {share:.2} calls/s ({} a second shared by {seen} processes), until it answers",
                ANSWER_WITHIN.as_secs(),
                self.rate
            );
            let observer = self.observer.lock().ok().and_then(|o| o.clone());
            if let Some(observer) = observer {
                observer.rate_fallback(share, self.rate, seen);
            }
        }
        let probing = tokio::spawn(probe(Arc::downgrade(self)));
        self.keep(probing);
    }

    /// Says the drawer is alive and learns how many draw from the account.
    async fn beat(&self) -> Result<(), StoreError> {
        let stale = crate::store::now_ms() - STALE_AFTER_MS;
        let rates = self.store.rates();
        let drawer = self.drawer();
        let told = rates.beat(&drawer, self.drawn.load(Relaxed), stale);
        let live = tokio::time::timeout(ANSWER_WITHIN, told)
            .await
            .map_err(|_| StoreError::Write("the state database did not answer".into()))??;
        self.seen.store(live.max(1), Relaxed);
        Ok(())
    }
}

/// Beats every [`BEAT_EVERY`] until the hold is dropped.
async fn beat(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(BEAT_EVERY).await;
        let Some(i) = inner.upgrade() else { return };
        if let Err(e) = i.beat().await {
            tracing::debug!("cannot tell the shared rate this process is alive: {e}");
        }
    }
}

/// Asks the database every [`RETRY_EVERY`] while the process keeps to its share; back on the
/// shared limit at the first answer.
async fn probe(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(RETRY_EVERY).await;
        let Some(i) = inner.upgrade() else { return };
        let interval_us = u64::try_from(i.interval.as_micros()).unwrap_or(u64::MAX);
        // A draw, not a ping: the block is lost, which only errs on the slow side.
        if i.draw(interval_us).await.is_some() {
            if let Ok(mut slot) = i.fallback.lock() {
                *slot = None;
            }
            tracing::warn!("the state database answers again: back on the account's shared rate");
            i.said_fallback.store(false, Relaxed);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_keep_the_database_to_a_few_draws_a_second() {
        assert_eq!(block_for(0.5), 1);
        assert_eq!(block_for(5.0), 1);
        assert_eq!(block_for(20.0), 3);
        assert_eq!(block_for(200.0), 25);
    }
}
