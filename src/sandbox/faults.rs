//! Injected faults: each a probability drawn from one seeded generator, so a failing test can
//! be replayed with the same seed.

use std::sync::Mutex;
use std::time::Duration;

/// Probabilities (0.0 to 1.0) of each fault, per paid call or per download.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults {
    /// A 500 or 503 before anything is billed.
    pub server_error: f64,
    /// An extra 429 before anything is billed.
    pub rate_limit: f64,
    /// The call is billed, then the connection drops before the answer: the ambiguous case.
    pub drop_after_billing: f64,
    /// The call is billed, then a gateway in front answers 504: also ambiguous.
    pub gateway_timeout: f64,
    /// The call is billed and its answer starts, naming the job, then the connection is cut:
    /// ambiguous, but the job can be read back for free.
    pub partial_answer: f64,
    /// A download stops half way.
    pub truncate_download: f64,
    pub seed: u64,
}

impl Faults {
    pub fn any(&self) -> bool {
        self.server_error > 0.0
            || self.rate_limit > 0.0
            || self.drop_after_billing > 0.0
            || self.gateway_timeout > 0.0
            || self.partial_answer > 0.0
            || self.truncate_download > 0.0
    }
}

/// SplitMix64: tiny, fast and reproducible, which is all fault injection needs.
pub struct Dice {
    state: Mutex<u64>,
    /// Set by [`Dice::quiet`]: no fault strikes from then on.
    quiet: std::sync::atomic::AtomicBool,
}

impl Dice {
    pub fn new(seed: u64) -> Self {
        Dice {
            state: Mutex::new(seed),
            quiet: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn next_u64(&self) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    pub fn chance(&self, p: f64) -> bool {
        p > 0.0
            && !self.quiet.load(std::sync::atomic::Ordering::Relaxed)
            && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// No chance comes true from now on: the faults stop (a campaign's last, quiet resume).
    pub fn quiet(&self) {
        self.quiet.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// A duration drawn uniformly from `0..=max`.
    pub fn jitter(&self, max: Duration) -> Duration {
        if max.is_zero() {
            return Duration::ZERO;
        }
        let nanos = max.as_nanos().min(u128::from(u64::MAX)) as u64;
        Duration::from_nanos(self.next_u64() % (nanos + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_faults() {
        let (a, b) = (Dice::new(42), Dice::new(42));
        let draws = |d: &Dice| (0..100).map(|_| d.chance(0.3)).collect::<Vec<_>>();
        let first = draws(&a);
        assert_eq!(first, draws(&b));
        let hits = first.iter().filter(|h| **h).count();
        assert!((10..=50).contains(&hits), "{hits}");
        assert!(!Dice::new(1).chance(0.0));
        assert!(Dice::new(1).chance(1.0));
    }
}
