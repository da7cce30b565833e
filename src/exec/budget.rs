//! Credits during a run: what is spent, what is reserved for calls in flight, and what is
//! committed to the chains already started.
//!
//! An item is admitted only when its whole remaining chain fits, so money is never stranded in
//! half-finished chains; and no call is dispatched unless spending plus every reservation in
//! flight plus its own price stays within the cap, however many calls are in flight.

/// The run's credit accounts. All figures are credits.
#[derive(Debug)]
pub struct Budget {
    /// The most the run may spend: the smaller of the budget and the balance; `None` when
    /// neither is known.
    cap: Option<u64>,
    /// Billed, plus the price of every ambiguous attempt (it may have been billed).
    spent: u64,
    /// Planned prices of calls in flight.
    in_flight: u64,
    /// `spent` plus the planned price of every unfinished task of admitted chains.
    committed: u64,
    /// What the caps that cover the run leased to it (see [`crate::caps::Leash`]): what may
    /// be committed, besides the cap; `None` when no cap covers the run.
    leased: Option<u64>,
}

impl Budget {
    pub fn new(cap: Option<u64>) -> Budget {
        Budget {
            cap,
            spent: 0,
            in_flight: 0,
            committed: 0,
            leased: None,
        }
    }

    /// The caps leased this much to the run, all told: commitments stay within it.
    pub fn lease(&mut self, leased: u64) {
        self.leased = Some(leased);
    }

    /// What the caps' leases leave to commit; `None` when no cap covers the run.
    pub fn unleased(&self) -> Option<u64> {
        self.leased.map(|l| l.saturating_sub(self.committed))
    }

    pub fn cap(&self) -> Option<u64> {
        self.cap
    }

    pub fn spent(&self) -> u64 {
        self.spent
    }

    fn fits(&self, total: u64) -> bool {
        if crate::failpoint::mutated(crate::failpoint::BUDGET_IGNORED) {
            return true;
        }
        self.cap.is_none_or(|cap| total <= cap)
    }

    /// Whether a commitment of `total` is within the caps' leases.
    fn leased_for(&self, total: u64) -> bool {
        self.leased.is_none_or(|leased| total <= leased)
    }

    /// Admits a chain whose unfinished tasks are planned at `cost`, when it fits the budget
    /// and the caps' leases.
    pub fn admit(&mut self, cost: u64) -> bool {
        let total = self.committed.saturating_add(cost);
        if self.fits(total) && self.leased_for(total) {
            self.committed = total;
            true
        } else {
            false
        }
    }

    /// Reserves `price` for a call about to be sent, when spending cannot pass the cap.
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

    /// What the cap leaves beyond what is committed.
    pub fn uncommitted(&self) -> Option<u64> {
        self.cap.map(|c| c.saturating_sub(self.committed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_admitted_whole_and_calls_never_pass_the_cap() {
        let mut b = Budget::new(Some(20));
        assert!(b.admit(12));
        assert!(!b.admit(12), "a second chain of 12 would strand money");
        assert!(b.admit(8));
        assert!(b.reserve(10) && b.reserve(10));
        assert!(!b.reserve(1), "in flight already reaches the cap");
        b.settle(10, 10);
        b.release(10);
        assert!(b.reserve(10));
        assert_eq!(b.spent(), 10);
    }

    #[test]
    fn an_ambiguous_attempt_counts_as_spent_and_a_retry_must_fit() {
        let mut b = Budget::new(Some(10));
        assert!(b.admit(6));
        assert!(b.reserve(6));
        assert!(!b.ambiguous(6), "a retry would make 12 possible");
        assert_eq!(b.spent(), 6);
        let mut open = Budget::new(None);
        assert!(open.admit(u64::MAX) && open.reserve(5) && open.ambiguous(5));
    }

    #[test]
    fn commitments_stay_within_what_the_caps_leased() {
        let mut b = Budget::new(Some(100));
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
        let mut b = Budget::new(Some(10));
        assert!(b.admit(4));
        assert!(b.reserve(4));
        b.settle(4, 6);
        assert_eq!(b.uncommitted(), Some(4));
    }
}
