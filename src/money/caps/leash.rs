//! A run's hold on the caps that cover it: credits leased in blocks, so the executor commits a
//! chain from what it holds and asks the database only when that runs out; a heartbeat, so a
//! process that died gives its unused credits back; and the close, at the end of the process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::money::caps::{Cap, now_ms, shown};
use crate::run_id::RunId;
use crate::store::{CapWindow, Lessee, Store, StoreError};

/// How often a holder says it is alive.
const BEAT_EVERY: Duration = Duration::from_secs(10);

/// A holder silent for this long is taken for dead, and its leases closed by the next run
/// that leases: six beats missed, never a process merely slowed by a loaded machine.
const STALE_AFTER_MS: i64 = 60_000;

/// A holder that has not beaten for this long beats before it commits anything more: a process
/// frozen (SIGSTOP, a suspended machine) past [`STALE_AFTER_MS`] may have had its leases closed,
/// and must learn it before it spends them.
const FRESH_FOR: Duration = Duration::from_secs(20);
const FRESH_FOR_MS: i64 = 20_000;

/// A block is this share of the smallest cap: runs sharing a cap lease often enough to share
/// it, rarely enough that the database is not on the hot path.
const BLOCKS_PER_CAP: u64 = 20;

/// Shares of a cap's window that, once leased, are announced (`cap.crossed`), in percent.
const MARKS: [u8; 3] = [50, 80, 100];

/// A lease that took a cap's window past one of [`MARKS`]: leases are taken one at a time, so
/// exactly one run announces each mark of a window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Crossing {
    pub cap: String,
    pub percent: u8,
    /// What the window had spent (leased, billed, possibly billed) after the lease.
    pub spent: u64,
    pub credits: u64,
    /// When the window ends, as people read it.
    pub window_end: String,
}

/// What a lease brought.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grant {
    /// The credits asked for, or more; the marks of the caps' windows the lease passed.
    Leased(Vec<Crossing>),
    /// A cap's window has too little left: the run stops committing until it reopens.
    Spent(Spent),
}

/// A cap whose window has too little left for the next chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spent {
    pub cap: String,
    pub credits: u64,
    pub per: &'static str,
    pub left: u64,
    pub needed: u64,
    /// When its window ends, as people read it.
    pub reopens: String,
}

/// A run's leases on the caps that cover it. Clones share them.
#[derive(Clone)]
pub struct Leash {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    caps: Vec<Cap>,
    holder: String,
    run_id: RunId,
    block: u64,
    /// Credits leased by this process, from every cap alike.
    leased: AtomicU64,
    /// Lease rows this process holds open.
    rows: AtomicU64,
    /// What this process's executors spent, told at their end.
    spent: AtomicU64,
    /// Another run found this holder silent and closed its leases.
    lost: AtomicBool,
    /// When the holder last beat, on both clocks: the monotonic one stops while a machine is
    /// suspended, the wall clock does not.
    /// (The wall clock as the caps read it, in unix ms: a test can move it, see
    /// `TEST_CLOCK_FILE_ENV`.)
    beaten: std::sync::Mutex<(std::time::Instant, i64)>,
    beating: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for Leash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leash")
            .field("caps", &self.inner.caps.len())
            .field("leased", &self.leased())
            .finish_non_exhaustive()
    }
}

impl Leash {
    /// The leash of run `run_id` of `pipeline` on `caps` (those that cover it); `None` when
    /// none does. Leases of the run left by a process that is gone (this one holds the run's
    /// lock) are closed first, with what that process spent.
    pub async fn open(
        store: &Store,
        caps: Vec<Cap>,
        pipeline: &str,
        run_id: &RunId,
    ) -> Result<Option<Leash>, StoreError> {
        let caps: Vec<Cap> = caps.into_iter().filter(|c| c.covers(pipeline)).collect();
        if caps.is_empty() {
            return Ok(None);
        }
        let holder = format!(
            "{}:{}:{}",
            crate::store::lock::hostname(),
            std::process::id(),
            crate::place::layout::own_mark()
        );
        store.caps().close_of(run_id, &holder).await?;
        let block = caps
            .iter()
            .map(|c| (c.credits / BLOCKS_PER_CAP).max(1))
            .min()
            .unwrap_or(1);
        let inner = Arc::new(Inner {
            store: store.clone(),
            caps,
            holder,
            run_id: run_id.to_owned(),
            block,
            leased: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            spent: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            beaten: std::sync::Mutex::new(now()),
            beating: std::sync::Mutex::new(None),
        });
        let beating = tokio::spawn(beat(Arc::downgrade(&inner)));
        if let Ok(mut slot) = inner.beating.lock() {
            *slot = Some(beating);
        }
        Ok(Some(Leash { inner }))
    }

    pub fn caps(&self) -> &[Cap] {
        &self.inner.caps
    }

    /// Credits leased so far by this process, from every cap alike.
    pub fn leased(&self) -> u64 {
        self.inner.leased.load(Relaxed)
    }

    /// Whether another run took this process for dead and closed its leases: nothing more
    /// may be committed.
    pub fn lost(&self) -> bool {
        self.inner.lost.load(Relaxed)
    }

    /// Beats now unless the holder beat within [`FRESH_FOR`]; returns whether its leases were
    /// closed by another run (then nothing more may be sent).
    pub async fn ensure_fresh(&self) -> Result<bool, StoreError> {
        let fresh = self.inner.beaten.lock().is_ok_and(|at| {
            let wall = now_ms() - at.1;
            at.0.elapsed() < FRESH_FOR && (0..FRESH_FOR_MS).contains(&wall)
        });
        if !fresh {
            beat_once(&self.inner).await?;
        }
        Ok(self.lost())
    }

    /// Leases at least `need` more credits (a block when that is more) from every cap, or
    /// says which cap's window has too little left.
    pub async fn grow(&self, need: u64) -> Result<Grant, StoreError> {
        let i = &self.inner;
        let now = now_ms();
        let mut windows = Vec::with_capacity(i.caps.len());
        for cap in &i.caps {
            let window = cap.window(now).map_err(StoreError::Inconsistent)?;
            windows.push(CapWindow {
                cap: cap.name.clone(),
                start: window.start,
                credits: cap.credits,
            });
        }
        let lessee = Lessee {
            holder: &i.holder,
            run_id: &i.run_id,
        };
        // Heartbeats and staleness on the caps' clock, so that a test moves past the 60 s of
        // silence without waiting them out (see `TEST_CLOCK_ENV`); the wall clock outside tests.
        let stale = now_ms() - STALE_AFTER_MS;
        let want = need.max(i.block);
        let (granted, before) = i
            .store
            .caps()
            .lease(&windows, lessee, want, need, (stale, now))
            .await?;
        if granted > 0 {
            i.leased.fetch_add(granted, Relaxed);
            i.rows.fetch_add(windows.len() as u64, Relaxed);
            let mut crossed = Vec::new();
            for (cap, spent) in i.caps.iter().zip(before) {
                let after = spent + granted;
                let end = cap.window(now).map_err(StoreError::Inconsistent)?.end;
                for percent in MARKS {
                    let mark = cap.credits * u64::from(percent);
                    if spent * 100 < mark && mark <= after * 100 {
                        crossed.push(Crossing {
                            cap: cap.name.clone(),
                            percent,
                            spent: after,
                            credits: cap.credits,
                            window_end: shown(cap, end),
                        });
                    }
                }
            }
            return Ok(Grant::Leased(crossed));
        }
        for (cap, window) in i.caps.iter().zip(&windows) {
            let spent = i.store.caps().spent(&cap.name, window.start).await?;
            let left = cap.credits.saturating_sub(spent);
            if left < need.max(1) {
                let end = cap.window(now).map_err(StoreError::Inconsistent)?.end;
                return Ok(Grant::Spent(Spent {
                    cap: cap.name.clone(),
                    credits: cap.credits,
                    per: cap.per.as_str(),
                    left,
                    needed: need,
                    reopens: shown(cap, end),
                }));
            }
        }
        // Another run gave room back between the lease and this look: try again.
        Ok(Grant::Leased(Vec::new()))
    }

    /// What this process's executors that ended spent: an executor that starts after another
    /// (the main run after a discovering call) leases only beyond it.
    pub fn spent_so_far(&self) -> u64 {
        self.inner.spent.load(Relaxed)
    }

    /// An executor of this process ended having spent `credits` (billed, and possibly
    /// billed).
    pub fn spent(&self, credits: u64) {
        self.inner.spent.fetch_add(credits, Relaxed);
    }

    /// Closes this process's leases: what it did not spend returns to the windows.
    pub async fn close(&self) -> Result<(), StoreError> {
        let i = &self.inner;
        if let Ok(mut slot) = i.beating.lock()
            && let Some(beating) = slot.take()
        {
            beating.abort();
        }
        i.store.caps().close(&i.holder, i.spent.load(Relaxed)).await
    }
}

fn now() -> (std::time::Instant, i64) {
    (std::time::Instant::now(), now_ms())
}

/// Says every [`BEAT_EVERY`] that the holder is alive, until its leash is dropped.
async fn beat(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(BEAT_EVERY).await;
        let Some(i) = inner.upgrade() else { return };
        if let Err(e) = beat_once(&i).await {
            tracing::warn!("cannot renew this run's cap leases: {e}");
        }
    }
}

/// One beat; notes when the holder's leases were closed by another run.
async fn beat_once(i: &Inner) -> Result<(), StoreError> {
    let open = i.store.caps().beat(&i.holder, now_ms()).await?;
    if open < i.rows.load(Relaxed) && !i.lost.swap(true, Relaxed) {
        tracing::warn!(
            "this run's cap leases were closed by another run that took it for dead; it sends nothing more"
        );
    }
    if let Ok(mut at) = i.beaten.lock() {
        *at = now();
    }
    Ok(())
}
