//! Money: every rule about what may be spent, in one place.
//!
//! The words, as `lib.rs` states them: a run's **budget** (`--max-credits`,
//! `budget.max_credits`); the account's **balance**; the **caps**, limits over calendar
//! windows shared by every run of a state database; the **limit**, the most a run may spend
//! now, the least of its budget left and the balance (the caps lend within theirs by leases);
//! **reservations** (a call's price held while it is in flight) and **leases** (credits a cap
//! lent a run); the **ledger**, what was billed. The [`gate`] is where a spend is admitted:
//! under the run's lock, against what was priced and confirmed.
//!
//! Its parts: [`limit`], the budget, the balance and the limit they make; [`admit`], whether
//! a plan may start within them; [`purse`], a run's credits while it executes (reservations,
//! commitments, the caps' leases); [`caps`], the calendar caps and their [`caps::Leash`];
//! [`ledger`], what was billed across runs, the only reader of the store's ledger outside the
//! store; [`planned`], what they read of a recorded plan; [`gate`], a confirmed price checked;
//! [`amount`], an amount of credits as messages write it.

pub mod admit;
pub mod amount;
pub mod caps;
pub mod gate;
pub mod ledger;
pub mod limit;
pub mod planned;
pub mod purse;

pub use amount::credits;
pub use gate::{Expected, Priced, Revision, Stale};
