//! Money: every rule about what may be spent, in one place.
//!
//! The words, as `lib.rs` states them: a run's **budget** (`--max-credits`,
//! `budget.max_credits`); the account's **balance**; the **caps**, limits over calendar
//! windows shared by every run of a state database; the **limit**, the least of them now;
//! **reservations** (a call's price held while it is in flight) and **leases** (credits a cap
//! lent a run); the **ledger**, what was billed. The [`gate`] is where a spend is admitted:
//! under the run's lock, against what was priced and confirmed.

pub mod gate;

pub use gate::{Expected, Priced, Revision, Stale};
