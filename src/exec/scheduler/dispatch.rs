//! What is sent next: a ready task of a chain under way, or a new chain admitted, within the
//! slots, the downloads' backlog and the purse.

use std::sync::Arc;

use crate::exec::scheduler::Scheduler;
use crate::exec::state::State;
use crate::exec::{Fatal, Stop};
use crate::store::StoreError;

impl Scheduler {
    /// Sends what may go now: ready tasks of admitted chains first (depth-first, or the
    /// longest chain near the end), admitting new chains as slots and the purse allow.
    pub(super) fn dispatch(&mut self) {
        if let Some(error) = self.shared.storage_failure() {
            let error = error.to_owned();
            self.storage_failed(error);
        }
        while self.halt.is_none()
            && !self.downloads.proving()
            && self.calls.len() < self.config.concurrency
            && !self.downloads.backlogged()
        {
            let next = if self.in_tail() {
                self.longest_ready()
            } else {
                self.ready.admitted().find(|t| self.may_send(*t))
            };
            // A chain is admitted once its tasks are recorded (see `record_ahead`).
            let fresh = self.ready.first_new().filter(|t| {
                self.closed.is_none()
                    && !self.purse.waiting()
                    && self.may_send(*t)
                    && self.rows.is_recorded(self.graph.task(*t).instance)
            });
            // Near the end a new chain goes first when it is longer than any under way:
            // otherwise the last chains to start would end the run alone, slots idle.
            let longer = |new: usize, old: usize| self.graph.reach(new) > self.graph.reach(old);
            let t = match (next, fresh) {
                (Some(old), Some(new)) if self.in_tail() && longer(new, old) => {
                    self.admit(self.graph.task(new).instance);
                    continue;
                }
                (Some(t), _) => t,
                (None, Some(new)) => {
                    self.admit(self.graph.task(new).instance);
                    continue;
                }
                (None, None) => return,
            };
            let (planned, step) = (self.graph.task(t).planned, self.graph.task(t).step.0);
            if !self.purse.reserve(planned) {
                if self.calls.is_empty() {
                    self.halt = Some(Stop::Limit {
                        needed: planned,
                        left: self.purse.left(),
                    });
                }
                return;
            }
            self.ready.sent(t);
            self.state[t] = State::Running;
            // Admitted, so recorded: an item's tasks are recorded before any is admitted.
            let Some(row) = self.rows.ids.get(t) else {
                let name = self.name(t);
                let missing = StoreError::Inconsistent(format!("task {name} is not recorded"));
                self.fatal(Fatal::Store(Arc::new(missing)));
                return;
            };
            self.calls.send(&self.shared, t, step, row);
        }
    }

    /// Whether the work left is within a few rounds of the slots: from then on, the
    /// longest chain left goes first (critical path), so none ends the run alone. Before, a
    /// chain under way goes first (depth-first), so each item finishes while its URLs are
    /// fresh; that order costs no time while there is more work than slots.
    fn in_tail(&self) -> bool {
        self.unfinished <= self.config.concurrency.saturating_mul(self.depth as usize)
    }

    /// The ready task of an admitted chain with the longest chain still ahead of it; the
    /// depth-first order breaks ties.
    fn longest_ready(&self) -> Option<usize> {
        let mut best: Option<usize> = None;
        for t in self.ready.admitted().filter(|t| self.may_send(*t)) {
            if best.is_none_or(|b| self.graph.reach(t) > self.graph.reach(b)) {
                best = Some(t);
            }
        }
        best
    }

    /// Until a bill has confirmed a step's price, one call of that step at a time.
    fn may_send(&self, t: usize) -> bool {
        self.calls.may_send(self.graph.task(t).step.0)
    }
}
