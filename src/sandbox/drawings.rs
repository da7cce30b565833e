//! `--remember-drawings`: each distinct picture drawn once. The sandbox's pictures are the same
//! for the same request (a generation's prompt, references and size; an edit's input image and
//! parameters), so answering a request drawn before with the PNG it drew then changes nothing a
//! client can see but the time. A bench of imgpipe's own storing runs a night twice: the first
//! draws every picture, the second finds each one here and the run waits on its downloads,
//! hashing and writes, not on the sandbox drawing photos on the same two cores.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::api::rules::InvalidField;

/// The pictures drawn so far, by what was asked. Every one stays in memory: off by default.
#[derive(Default)]
pub(super) struct Drawings {
    drawn: Mutex<HashMap<u64, Vec<Bytes>>>,
    recalled: AtomicU64,
}

/// What a request asked to draw, folded into one number.
pub(super) fn asked(parts: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// What `draw` makes, or, when the sandbox remembers its drawings, what it made before for the
/// same `key` (computed only then: hashing an 8192-px input is not free).
pub(super) fn draw_once(
    drawings: Option<&Drawings>,
    key: impl FnOnce() -> u64,
    draw: impl FnOnce() -> Result<Vec<Vec<u8>>, InvalidField>,
) -> Result<Vec<Vec<u8>>, InvalidField> {
    match drawings {
        Some(d) => d.recall_or(key(), draw),
        None => draw(),
    }
}

impl Drawings {
    /// The pictures `key` named before, or those `draw` makes now, remembered. Two requests
    /// racing for one key may both draw it: the pictures are the same, the last one kept.
    fn recall_or(
        &self,
        key: u64,
        draw: impl FnOnce() -> Result<Vec<Vec<u8>>, InvalidField>,
    ) -> Result<Vec<Vec<u8>>, InvalidField> {
        if let Some(pngs) = self.lock().get(&key) {
            self.recalled.fetch_add(1, Ordering::Relaxed);
            return Ok(pngs.iter().map(|p| p.to_vec()).collect());
        }
        let pngs = draw()?;
        let kept = pngs.iter().map(|p| Bytes::copy_from_slice(p)).collect();
        self.lock().insert(key, kept);
        Ok(pngs)
    }

    /// Calls answered with pictures drawn before.
    pub(super) fn recalled(&self) -> u64 {
        self.recalled.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<Bytes>>> {
        // An insert cannot be left half done: keep serving after a panic elsewhere.
        self.drawn.lock().unwrap_or_else(|e| e.into_inner())
    }
}
