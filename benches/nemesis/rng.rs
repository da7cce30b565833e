//! The campaign's one source of decisions: SplitMix64 from a trial's seed.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// One of `options`.
    pub fn pick<T: Copy>(&mut self, options: &[T]) -> T {
        options[self.between(0, options.len() as u64 - 1) as usize]
    }
}

/// The seed of trial `i` of a campaign seeded `seed`: each trial replays alone from its own.
pub fn trial_seed(seed: u64, i: u64) -> u64 {
    let mut r = Rng::new(seed ^ i.wrapping_mul(0xA24B_AED4_963E_E407));
    r.next_u64()
}
