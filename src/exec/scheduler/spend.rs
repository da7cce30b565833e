//! The scheduler's money: chains admitted from the purse, and the caps' leases grown ahead of
//! the next chain. The figures are the purse's ([`crate::money::purse`]); this part says what
//! its answers stop.

use std::sync::Arc;

use crate::exec::scheduler::Scheduler;
use crate::exec::state::State;
use crate::exec::{Fatal, Stop};
use crate::money::caps::Grant;
use crate::money::purse::Admission;
use crate::plan::graph::Instance;

impl Scheduler {
    /// What is left of `instance`'s chain to pay for.
    pub(super) fn chain_cost(&self, instance: Instance) -> u64 {
        self.graph
            .instance_tasks(instance)
            .filter(|t| matches!(self.state[*t], State::Waiting | State::Ready))
            .map(|t| self.graph.task(t).planned)
            .sum()
    }

    /// Admits `instance` when what is left of its chain fits; else closes admission, or waits
    /// for the caps to lease what it needs.
    pub(super) fn admit(&mut self, instance: Instance) {
        let cost = self.chain_cost(instance);
        match self.purse.admit_chain(cost) {
            Admission::Admitted => {
                let tasks = self.graph.instance_tasks(instance);
                self.ready.admit(instance, tasks);
            }
            Admission::Waiting => {}
            Admission::Over { left } => {
                self.closed = Some(Stop::Limit { needed: cost, left });
            }
        }
    }

    /// Halts the run when its cap leases were closed by another run that took this process
    /// for dead (frozen past the caps' silence limit): they were given back to their windows,
    /// so nothing more is sent, not even for chains already committed.
    pub(super) async fn check_lease(&mut self) {
        match self.purse.lease_lost().await {
            Ok(true) => self.halt = Some(Stop::LeaseLost),
            Ok(false) => {}
            Err(e) => self.fatal(Fatal::Store(Arc::new(e))),
        }
    }

    /// Leases from the caps what the next chain needs beyond what they leased, when a cap
    /// covers the run; closes admission when a cap's window has too little left.
    pub(super) async fn lease_ahead(&mut self) {
        if !self.purse.leashed() {
            return;
        }
        let cost = match self.purse.take_waiting() {
            Some(cost) => cost,
            None => match self.ready.first_new() {
                Some(next) => self.chain_cost(self.graph.task(next).instance),
                None => return,
            },
        };
        self.lease_more(cost).await;
    }

    /// Leases from the caps what `cost` needs beyond what they leased; closes admission when
    /// a cap's window has too little left.
    pub(super) async fn lease_more(&mut self, cost: u64) {
        match self.purse.lease_more(cost).await {
            Ok(None) => {}
            Ok(Some(Grant::Leased(crossed))) => {
                for crossing in &crossed {
                    self.observer.cap_crossed(crossing);
                }
            }
            Ok(Some(Grant::Spent(spent))) => {
                if self.closed.is_none() {
                    self.closed = Some(Stop::Cap(spent));
                }
            }
            Err(e) => self.fatal(Fatal::Store(Arc::new(e))),
        }
    }
}
