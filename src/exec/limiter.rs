//! The one limiter every paid call passes: a governor rate limiter at the configured rate, a
//! shared pause when the service answers 429, and a lowered rate that recovers gradually.
//!
//! With an account's shared limit ([`AccountRate`]), each call also takes its turn from the
//! limit every process on the account draws from, and a 429 pauses them all.
//!
//! A 429 pauses all dispatch for its `Retry-After`, not only the call that got it, so the calls
//! queued behind it do not stampede the service the moment the pause ends.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio::time::Instant;

use crate::api::retry::honoured;
use crate::exec::account_rate::AccountRate;

/// Each 429 divides the rate by this, down to [`MIN_FACTOR`] of the configured rate.
const BACKOFF_DIVISOR: f64 = 2.0;
const MIN_FACTOR: f64 = 1.0 / 32.0;
/// Without a 429 for this long, the rate climbs back by [`RECOVERY_STEP`] of the configured one.
const RECOVERY_INTERVAL: Duration = Duration::from_secs(2);
const RECOVERY_STEP: f64 = 0.1;
/// Growth per recovery interval of a rate inferred from a 429 rather than configured.
const LEARNED_GROWTH: f64 = 1.25;
/// When the service gives no `Retry-After`.
const DEFAULT_PAUSE: Duration = Duration::from_secs(1);
/// 429s this close together count as one signal, so one burst does not collapse the rate.
const SAME_SIGNAL: Duration = Duration::from_millis(500);

pub struct PaidLimiter {
    inner: Mutex<Inner>,
    /// The account's limit shared with every process that spends on it, when known.
    shared: Option<AccountRate>,
}

struct Inner {
    /// The configured rate; `None` until known. Without one, the first 429 sets it from the
    /// rate that was being dispatched.
    base: Option<f64>,
    /// Whether `base` was only inferred from one moment's pace: it may be far below what the
    /// service allows (a 429 early in a run, after a handful of calls), so it is no ceiling.
    learned: bool,
    factor: f64,
    limiter: Option<Arc<DefaultDirectRateLimiter>>,
    paused_until: Option<Instant>,
    last_signal: Option<Instant>,
    last_change: Instant,
    recent: VecDeque<Instant>,
}

impl PaidLimiter {
    /// `rate` in requests per second; `None` for no limit until the service says otherwise.
    pub fn new(rate: Option<f64>) -> PaidLimiter {
        let rate = rate.filter(|r| r.is_finite() && *r > 0.0);
        PaidLimiter {
            inner: Mutex::new(Inner {
                base: rate,
                learned: false,
                factor: 1.0,
                limiter: rate.and_then(governor_for),
                paused_until: None,
                last_signal: None,
                last_change: Instant::now(),
                recent: VecDeque::new(),
            }),
            shared: None,
        }
    }

    /// The same, each call also taking its turn from the account's shared limit.
    pub fn sharing(mut self, shared: Option<AccountRate>) -> PaidLimiter {
        self.shared = shared;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until one paid call may be sent.
    pub async fn acquire(&self) {
        loop {
            let (pause, limiter) = {
                let mut inner = self.lock();
                inner.recover();
                (inner.paused_until, inner.limiter.clone())
            };
            if let Some(until) = pause.filter(|u| *u > Instant::now()) {
                tokio::time::sleep_until(until).await;
                continue;
            }
            if let Some(limiter) = limiter {
                limiter.until_ready().await;
            }
            if let Some(shared) = &self.shared {
                shared.take().await;
            }
            let mut inner = self.lock();
            // A 429 may have come in while this call waited for its turn.
            if inner.paused_until.is_some_and(|u| u > Instant::now()) {
                continue;
            }
            let now = Instant::now();
            inner.recent.push_back(now);
            while inner
                .recent
                .front()
                .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(1))
            {
                inner.recent.pop_front();
            }
            return;
        }
    }

    /// The service answered 429: pause everyone for its `Retry-After` (as far as the retry
    /// policy honours one) and slow down.
    pub fn throttled(&self, retry_after: Option<Duration>) {
        let pause = honoured(retry_after).unwrap_or(DEFAULT_PAUSE);
        let mut inner = self.lock();
        let now = Instant::now();
        let until = now + pause;
        inner.paused_until = Some(inner.paused_until.map_or(until, |u| u.max(until)));
        if inner
            .last_signal
            .is_some_and(|t| now.duration_since(t) < SAME_SIGNAL)
        {
            return;
        }
        inner.last_signal = Some(now);
        if let Some(shared) = &self.shared {
            shared.throttled(pause);
        }
        if inner.base.is_none() {
            inner.base = Some((inner.recent.len() as f64).max(1.0));
            inner.learned = true;
            inner.factor = 1.0;
        }
        inner.factor = (inner.factor / BACKOFF_DIVISOR).max(MIN_FACTOR);
        inner.last_change = now;
        inner.rebuild();
        tracing::info!(
            "rate limited by the service; pausing {:.1}s and slowing to {:.2} calls/s",
            pause.as_secs_f64(),
            inner.rate().unwrap_or(0.0)
        );
    }

    /// The rate in force now, in calls per second; `None` when unlimited.
    pub fn rate(&self) -> Option<f64> {
        self.lock().rate()
    }
}

impl Inner {
    fn rate(&self) -> Option<f64> {
        self.base.map(|b| b * self.factor)
    }

    fn recover(&mut self) {
        if (self.factor >= 1.0 && !self.learned) || self.last_change.elapsed() < RECOVERY_INTERVAL {
            return;
        }
        self.factor = if self.learned {
            // Probing upwards until the service says no again.
            self.factor * LEARNED_GROWTH
        } else {
            (self.factor + RECOVERY_STEP).min(1.0)
        };
        self.last_change = Instant::now();
        self.rebuild();
    }

    fn rebuild(&mut self) {
        self.limiter = self.rate().and_then(governor_for);
    }
}

/// A governor limiter pacing calls evenly at `rate` per second. A burst of two lets a call
/// that woke late be made up by the next, so timer lateness does not erode the rate; never
/// more, since a burst is exactly what a service's own limiter refuses.
pub(super) fn governor_for(rate: f64) -> Option<Arc<DefaultDirectRateLimiter>> {
    let period = Duration::try_from_secs_f64(1.0 / rate).ok()?;
    let burst = NonZeroU32::new(if rate >= 2.0 { 2 } else { 1 }).unwrap_or(NonZeroU32::MIN);
    let quota = Quota::with_period(period.max(Duration::from_nanos(1)))?.allow_burst(burst);
    Some(Arc::new(RateLimiter::direct(quota)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_429_halves_the_rate_once_per_burst_and_it_recovers() {
        let limiter = PaidLimiter::new(Some(10.0));
        limiter.throttled(Some(Duration::ZERO));
        limiter.throttled(Some(Duration::ZERO));
        assert_eq!(limiter.rate(), Some(5.0));
        limiter.lock().last_change = Instant::now() - RECOVERY_INTERVAL;
        limiter.acquire().await;
        assert_eq!(limiter.rate(), Some(6.0));
    }

    #[tokio::test]
    async fn without_a_known_rate_the_first_429_sets_one() {
        let limiter = PaidLimiter::new(None);
        assert_eq!(limiter.rate(), None);
        for _ in 0..8 {
            limiter.acquire().await;
        }
        limiter.throttled(Some(Duration::ZERO));
        assert_eq!(limiter.rate(), Some(4.0));
        // An inferred rate is no ceiling: without further 429s it climbs past it.
        for _ in 0..4 {
            limiter.lock().last_change = Instant::now() - RECOVERY_INTERVAL;
            limiter.acquire().await;
        }
        assert!(limiter.rate().unwrap() > 8.0, "{:?}", limiter.rate());
    }
}
