//! The one retry policy: how many tries, how long to wait between them, and how far a server's
//! `Retry-After` is believed.
//!
//! Paid calls, free reads and downloads differ only in their numbers (a [`RetryPolicy`] each);
//! the rule is the same everywhere, so a 429 is honoured the same way whether it answers a
//! generation, a `GET /v1/jobs` or the limiter's shared pause.

use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::api::ApiError;

/// The longest wait a server's `Retry-After` is honoured for: one call, or the whole run's
/// dispatch when the limiter pauses, is never held back for longer.
pub const MAX_RETRY_WAIT: Duration = Duration::from_secs(300);

/// The longest `Retry-After` read from a header (and reported in an error message); absurd
/// values, such as `1e30` or a date in year 9999, are read as this. Only a bound on what is
/// parsed: the wait itself is capped by [`MAX_RETRY_WAIT`].
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The longest backoff between two tries, however many tries there were.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Doublings of the base delay beyond which the backoff stops growing (well past
/// [`MAX_BACKOFF`] for any base worth using, and no overflow).
const MAX_DOUBLINGS: u32 = 10;

/// How often one kind of request is tried and how long it waits in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, the first one included.
    pub tries: u32,
    /// The wait before the first retry, before jitter; each further retry doubles it.
    pub base: Duration,
}

impl RetryPolicy {
    pub const fn new(tries: u32, base: Duration) -> RetryPolicy {
        RetryPolicy { tries, base }
    }

    /// Whether a request that has failed `failures` times may be tried once more.
    pub fn allows(&self, failures: u32) -> bool {
        failures < self.tries
    }

    /// Exponential backoff with jitter before retry number `retry` (1 for the first):
    /// `base × 2^(retry-1)`, scaled by a random factor in 0.5..=1.0 so that the retries of
    /// many calls that failed together spread out, and capped at a minute.
    pub fn backoff(&self, retry: u32) -> Duration {
        self.backoff_scaled(retry, jitter())
    }

    /// The wait before retry number `retry`: the server's `Retry-After` when it gave one (it
    /// knows best when it will have room), capped by [`honoured`]; the backoff otherwise.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        honoured(retry_after).unwrap_or_else(|| self.backoff(retry))
    }

    fn backoff_scaled(&self, retry: u32, factor: f64) -> Duration {
        let doublings = retry.saturating_sub(1).min(MAX_DOUBLINGS);
        // Past twice the cap every factor lands on the cap; stopping there first keeps the
        // float scaling of a huge base from overflowing.
        self.base
            .saturating_mul(1 << doublings)
            .min(MAX_BACKOFF * 2)
            .mul_f64(factor.clamp(0.0, 1.0))
            .min(MAX_BACKOFF)
    }
}

/// The part of a server's `Retry-After` that is honoured: at most [`MAX_RETRY_WAIT`].
/// Runs a free call (a read that bills nothing) until it succeeds, fails for good or `policy`
/// gives up: a passing failure (a 429, a server error, a lost connection) is waited out as the
/// policy says, `Retry-After` included. Never for a paid call, whose retry may bill.
pub async fn free_call<T, F, Fut>(policy: RetryPolicy, call: F) -> Result<T, ApiError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let mut failures = 0;
    loop {
        match call().await {
            Err(e) if e.is_transient() && policy.allows(failures + 1) => {
                failures += 1;
                tokio::time::sleep(policy.delay(failures, e.retry_after())).await;
            }
            answer => return answer,
        }
    }
}

pub fn honoured(retry_after: Option<Duration>) -> Option<Duration> {
    retry_after.map(|wait| wait.min(MAX_RETRY_WAIT))
}

/// Reads `Retry-After` as seconds or as an HTTP date. A server's header must never crash the
/// client: absurd values are read as [`MAX_RETRY_AFTER`], malformed ones ignored.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        if secs.is_nan() || secs < 0.0 {
            return None;
        }
        return Some(
            Duration::try_from_secs_f64(secs).map_or(MAX_RETRY_AFTER, |d| d.min(MAX_RETRY_AFTER)),
        );
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let wait = at
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO);
    Some(wait.min(MAX_RETRY_AFTER))
}

/// A random factor in 0.5..=1.0; a failing random source only loses the spread (0.5).
fn jitter() -> f64 {
    let mut byte = [0u8; 1];
    let _ = getrandom::fill(&mut byte);
    0.5 + f64::from(byte[0]) / 510.0
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_delay_doubles_per_retry_and_stops_at_a_minute() {
        let policy = RetryPolicy::new(5, 100 * MS);
        let full: Vec<_> = (1..=4).map(|n| policy.backoff_scaled(n, 1.0)).collect();
        assert_eq!(full, [100 * MS, 200 * MS, 400 * MS, 800 * MS]);
        assert_eq!(policy.backoff_scaled(0, 1.0), 100 * MS);
        assert_eq!(policy.backoff_scaled(30, 1.0), MAX_BACKOFF);
        assert_eq!(policy.backoff_scaled(u32::MAX, 1.0), MAX_BACKOFF);
        let huge = RetryPolicy::new(5, Duration::MAX);
        assert_eq!(huge.backoff_scaled(3, 0.5), MAX_BACKOFF);
        assert_eq!(huge.backoff_scaled(3, 1.0), MAX_BACKOFF);
    }

    #[test]
    fn jitter_stays_between_half_and_the_whole_delay() {
        let policy = RetryPolicy::new(5, 100 * MS);
        for retry in 1..=5 {
            let full = policy.backoff_scaled(retry, 1.0);
            for _ in 0..200 {
                let wait = policy.backoff(retry);
                assert!(wait >= full / 2 && wait <= full, "retry {retry}: {wait:?}");
            }
        }
        let factors: Vec<f64> = (0..200).map(|_| jitter()).collect();
        assert!(factors.iter().all(|f| (0.5..=1.0).contains(f)));
        assert!(factors.iter().any(|f| *f != factors[0]), "no spread at all");
    }

    #[test]
    fn tries_count_the_first_one() {
        let policy = RetryPolicy::new(4, MS);
        assert!((0..4).all(|failures| policy.allows(failures)));
        assert!(!policy.allows(4));
        assert!(!RetryPolicy::new(0, MS).allows(0));
    }

    #[test]
    fn retry_after_is_honoured_up_to_the_cap() {
        let policy = RetryPolicy::new(5, MS);
        let two = Duration::from_secs(2);
        assert_eq!(policy.delay(3, Some(two)), two, "beats the backoff");
        assert_eq!(policy.delay(1, Some(Duration::ZERO)), Duration::ZERO);
        let day = Duration::from_secs(24 * 3600);
        assert_eq!(policy.delay(1, Some(day)), MAX_RETRY_WAIT);
        assert!(policy.delay(1, None) <= MS, "no header: the backoff");
        assert_eq!(honoured(Some(Duration::MAX)), Some(MAX_RETRY_WAIT));
        assert_eq!(honoured(None), None);
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after(" 0.5 "), Some(500 * MS));
        assert_eq!(parse_retry_after("-1"), None);
        let past = "Wed, 21 Oct 2015 07:28:00 GMT";
        assert_eq!(parse_retry_after(past), Some(Duration::ZERO));
        let far = "Fri, 31 Dec 9999 23:59:59 GMT";
        assert_eq!(parse_retry_after(far), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("NaN"), None);
        assert_eq!(parse_retry_after("3600"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_retry_after("1e30"), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("inf"), Some(MAX_RETRY_AFTER));
    }
}
