//! The paid calls in flight, and what each task's tries so far were: how many retries,
//! 429s and ambiguous answers it met, and the delay its next try waits out. Until a bill has
//! confirmed a step's price, one call of that step at a time (a probe): a plan priced too low
//! must not overspend by a whole round of concurrent calls.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinError, JoinSet};

use crate::exec::attempt::{Attempted, attempt};
use crate::exec::shared::Shared;

/// 429s one task may meet before it fails: the limiter slows down long before this.
pub(super) const MAX_THROTTLED: u32 = 30;

/// A task's tries, while it has been tried and not settled.
#[derive(Default, Clone, Copy)]
pub(super) struct Tries {
    pub retries: u32,
    pub throttled: u32,
    pub ambiguous: u32,
    /// Whether it was tried again with fresh upstream URLs.
    pub refreshed: bool,
    /// What the next try waits first.
    delay: Duration,
    /// Whether the next try fetches fresh upstream URLs first.
    force_refresh: bool,
}

pub(super) struct Calls {
    set: JoinSet<Attempted>,
    /// Only tasks that have been tried and not settled.
    tries: HashMap<usize, Tries>,
    /// By step: whether a bill confirmed its planned price, and whether a call is testing it.
    confirmed: Vec<bool>,
    probing: Vec<bool>,
}

impl Calls {
    /// `known_prices`, by step: whether its price is known to be what the service bills.
    pub(super) fn new(steps: usize, known_prices: &[bool]) -> Calls {
        Calls {
            set: JoinSet::new(),
            tries: HashMap::new(),
            confirmed: (0..steps)
                .map(|s| known_prices.get(s).copied().unwrap_or(false))
                .collect(),
            probing: vec![false; steps],
        }
    }

    pub(super) fn len(&self) -> usize {
        self.set.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Whether a call of `step` may go now: its price is confirmed, or no call tests it.
    pub(super) fn may_send(&self, step: usize) -> bool {
        self.confirmed[step] || !self.probing[step]
    }

    /// Sends task `t` (recorded as `row`) of step `step`, after the delay its tries left.
    pub(super) fn send(
        &mut self,
        shared: &Arc<Shared>,
        t: usize,
        step: usize,
        row: crate::store::TaskId,
    ) {
        let (delay, force) = self.tries.get_mut(&t).map_or((Duration::ZERO, false), |x| {
            let once = (x.delay, x.force_refresh);
            (x.delay, x.force_refresh) = (Duration::ZERO, false);
            once
        });
        // A retry sleeping out its delay is no probe: a sibling may test the price.
        self.probing[step] |= !self.confirmed[step] && delay.is_zero();
        self.set
            .spawn(attempt(Arc::clone(shared), t, row, delay, force));
    }

    /// The next call to end.
    pub(super) async fn next(&mut self) -> Option<Result<Attempted, JoinError>> {
        self.set.join_next().await
    }

    /// Cuts off every call in flight, and waits until they are gone.
    pub(super) async fn abort(&mut self) {
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
    }

    /// A call of `step` ended: it tests the price no more.
    pub(super) fn answered(&mut self, step: usize) {
        self.probing[step] = false;
    }

    /// A bill of `step` was within its plan: its calls need no probe any more.
    pub(super) fn confirm(&mut self, step: usize) {
        self.confirmed[step] = true;
    }

    /// Task `t`'s tries so far.
    pub(super) fn tries(&mut self, t: usize) -> &mut Tries {
        self.tries.entry(t).or_default()
    }

    /// Task `t` is tried again after `delay`, with fresh upstream URLs when `force_refresh`.
    pub(super) fn again(&mut self, t: usize, delay: Duration, force_refresh: bool) {
        let tries = self.tries(t);
        tries.delay = delay;
        tries.force_refresh |= force_refresh;
    }

    /// Task `t` settled: its tries are forgotten.
    pub(super) fn forget(&mut self, t: usize) {
        self.tries.remove(&t);
    }
}
