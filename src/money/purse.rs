//! The purse: a run's credits while it executes. What it spent, what it reserved for calls in
//! flight, what it committed to the chains already started, the limit it keeps under (the
//! least of its budget left and the balance), and what the calendar caps leased it.
//!
//! An item is admitted only when its whole remaining chain fits, so money is never stranded in
//! half-finished chains; and no call is dispatched unless spending plus every reservation in
//! flight plus its own price stays within the limit, however many calls are in flight.

use crate::money::caps::{Grant, Leash};
use crate::store::StoreError;

/// The run's credit accounts. All figures are credits.
#[derive(Debug)]
pub struct Purse {
    /// The most the run may spend: the least of the budget left and the balance; `None` when
    /// neither is known.
    limit: Option<u64>,
    /// Billed, plus the price of every ambiguous attempt (it may have been billed).
    spent: u64,
    /// Reservations: the planned prices of calls in flight.
    in_flight: u64,
    /// `spent` plus the planned price of every unfinished task of admitted chains.
    committed: u64,
    /// What the caps that cover the run leased to it: what may be committed, besides the
    /// limit; `None` when no cap covers the run.
    leased: Option<u64>,
    /// The run's hold on the caps that cover it.
    leash: Option<Leash>,
    /// What earlier executors of this process spent of the caps' leases: this one commits
    /// only what was leased beyond it.
    lease_base: u64,
    /// The cost of a chain waiting for the caps to lease enough to commit it.
    waiting: Option<u64>,
}

/// What admitting a chain came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    Admitted,
    /// It fits the limit, not yet what the caps leased: lease more, then admit it.
    Waiting,
    /// It does not fit the limit, which leaves `left` beyond what is committed.
    Over {
        left: u64,
    },
}

impl Purse {
    /// A purse kept under `limit` and, when a cap covers the run, what its `leash` leases.
    pub fn new(limit: Option<u64>, leash: Option<Leash>) -> Purse {
        let lease_base = leash.as_ref().map_or(0, Leash::spent_so_far);
        let mut purse = Purse {
            limit,
            spent: 0,
            in_flight: 0,
            committed: 0,
            leased: None,
            leash: None,
            lease_base,
            waiting: None,
        };
        if let Some(leash) = &leash {
            purse.lease(leash.leased().saturating_sub(lease_base));
        }
        purse.leash = leash;
        purse
    }

    /// The caps leased this much to the run, all told: commitments stay within it.
    fn lease(&mut self, leased: u64) {
        self.leased = Some(leased);
    }

    /// What the caps' leases leave to commit; `None` when no cap covers the run.
    fn unleased(&self) -> Option<u64> {
        self.leased.map(|l| l.saturating_sub(self.committed))
    }

    /// Whether a cap covers the run.
    pub fn leashed(&self) -> bool {
        self.leash.is_some()
    }

    pub fn spent(&self) -> u64 {
        self.spent
    }

    /// What the limit leaves beyond what was spent.
    pub fn left(&self) -> u64 {
        self.limit.unwrap_or(0).saturating_sub(self.spent)
    }

    fn fits(&self, total: u64) -> bool {
        if crate::failpoint::mutated(crate::failpoint::BUDGET_IGNORED) {
            return true;
        }
        self.limit.is_none_or(|limit| total <= limit)
    }

    /// Whether a commitment of `total` is within the caps' leases.
    fn leased_for(&self, total: u64) -> bool {
        self.leased.is_none_or(|leased| total <= leased)
    }

    /// Admits a chain whose unfinished tasks are planned at `cost`, when it fits the limit
    /// and the caps' leases.
    fn admit(&mut self, cost: u64) -> bool {
        let total = self.committed.saturating_add(cost);
        if self.fits(total) && self.leased_for(total) {
            self.committed = total;
            true
        } else {
            false
        }
    }

    /// Admits a chain whose unfinished tasks are planned at `cost`; one within the limit but
    /// not yet within the caps' leases waits for them to lease it ([`Purse::lease_waiting`]).
    pub fn admit_chain(&mut self, cost: u64) -> Admission {
        let within_limit = self.uncommitted().is_none_or(|left| cost <= left);
        if within_limit && self.unleased().is_some_and(|left| left < cost) {
            self.waiting = Some(cost);
            return Admission::Waiting;
        }
        if self.admit(cost) {
            Admission::Admitted
        } else {
            Admission::Over {
                left: self.uncommitted().unwrap_or(0),
            }
        }
    }

    /// A task already paid for is to be paid for again (a check failed its outputs): commits
    /// its `planned` price once more when that fits the limit and the caps' leases.
    pub fn recommit(&mut self, planned: u64) -> bool {
        self.admit(planned)
    }

    /// Whether a chain waits for the caps to lease what it needs.
    pub fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// The cost of the chain waiting for a lease, no longer waiting.
    pub fn take_waiting(&mut self) -> Option<u64> {
        self.waiting.take()
    }

    /// Reserves `price` for a call about to be sent, when spending cannot pass the limit.
    pub fn reserve(&mut self, price: u64) -> bool {
        let total = self
            .spent
            .saturating_add(self.in_flight)
            .saturating_add(price);
        if self.fits(total) {
            self.in_flight += price;
            true
        } else {
            false
        }
    }

    /// A call came back with its bill.
    pub fn settle(&mut self, planned: u64, billed: u64) {
        self.in_flight = self.in_flight.saturating_sub(planned);
        self.spent = self.spent.saturating_add(billed);
        self.committed = self
            .committed
            .saturating_add(billed)
            .saturating_sub(planned);
    }

    /// A call failed without billing: its reservation returns, its commitment stays for the
    /// retry.
    pub fn release(&mut self, planned: u64) {
        self.in_flight = self.in_flight.saturating_sub(planned);
    }

    /// A call may have been billed without an answer. It counts as spent, and a retry needs
    /// `planned` more: `false` when that no longer fits, and the task must not be retried.
    pub fn ambiguous(&mut self, planned: u64) -> bool {
        self.in_flight = self.in_flight.saturating_sub(planned);
        self.spent = self.spent.saturating_add(planned);
        let total = self.committed.saturating_add(planned);
        if self.fits(total) && self.leased_for(total) {
            self.committed = total;
            true
        } else {
            false
        }
    }

    /// Tasks that will not run: their commitment is freed.
    pub fn abandon(&mut self, planned: u64) {
        self.committed = self.committed.saturating_sub(planned);
    }

    /// What the limit leaves beyond what is committed.
    pub fn uncommitted(&self) -> Option<u64> {
        self.limit.map(|c| c.saturating_sub(self.committed))
    }

    /// Whether the caps' leases were closed by another run that took this process for dead
    /// (frozen past the caps' silence limit): they went back to their windows.
    pub async fn lease_lost(&self) -> Result<bool, StoreError> {
        match &self.leash {
            Some(leash) => leash.ensure_fresh().await,
            None => Ok(false),
        }
    }

    /// Leases from the caps what `cost` needs beyond what they leased. `None`: nothing to
    /// lease (no cap covers the run, the leases suffice, or they were lost); else the caps'
    /// grant: leased (with the windows it took past a mark), or a window with too little left.
    pub async fn lease_more(&mut self, cost: u64) -> Result<Option<Grant>, StoreError> {
        let Some(leash) = self.leash.clone() else {
            return Ok(None);
        };
        let short = cost.saturating_sub(self.unleased().unwrap_or(u64::MAX));
        if short == 0 || leash.lost() {
            return Ok(None);
        }
        let grant = leash.grow(short).await?;
        if let Grant::Leased(_) = &grant {
            self.lease(leash.leased().saturating_sub(self.lease_base));
        }
        Ok(Some(grant))
    }

    /// The executor ended: what it spent counts against the caps' leases of the executors
    /// that follow it in this process.
    pub fn close(&self) {
        if let Some(leash) = &self.leash {
            leash.spent(self.spent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_admitted_whole_and_calls_never_pass_the_limit() {
        let mut b = Purse::new(Some(20), None);
        assert!(b.admit(12));
        assert!(!b.admit(12), "a second chain of 12 would strand money");
        assert!(b.admit(8));
        assert!(b.reserve(10) && b.reserve(10));
        assert!(!b.reserve(1), "in flight already reaches the limit");
        b.settle(10, 10);
        b.release(10);
        assert!(b.reserve(10));
        assert_eq!(b.spent(), 10);
    }

    #[test]
    fn an_ambiguous_attempt_counts_as_spent_and_a_retry_must_fit() {
        let mut b = Purse::new(Some(10), None);
        assert!(b.admit(6));
        assert!(b.reserve(6));
        assert!(!b.ambiguous(6), "a retry would make 12 possible");
        assert_eq!(b.spent(), 6);
        let mut open = Purse::new(None, None);
        assert!(open.admit(u64::MAX) && open.reserve(5) && open.ambiguous(5));
    }

    #[test]
    fn commitments_stay_within_what_the_caps_leased() {
        let mut b = Purse::new(Some(100), None);
        b.lease(10);
        assert!(b.admit(6));
        assert!(!b.admit(6), "the lease leaves 4");
        assert_eq!(b.unleased(), Some(4));
        b.lease(16);
        assert!(b.admit(6));
        assert!(b.reserve(6));
        assert!(!b.ambiguous(6), "a retry would pass the lease");
    }

    #[test]
    fn a_bill_above_the_plan_grows_the_commitment() {
        let mut b = Purse::new(Some(10), None);
        assert!(b.admit(4));
        assert!(b.reserve(4));
        b.settle(4, 6);
        assert_eq!(b.uncommitted(), Some(4));
    }
}
