//! Where each task of the graph stands in this process: what the scheduler tracks, and what
//! the recorded rows set it to when a run is taken over ([`crate::exec::rows`]). A leaf, so
//! the scheduler and the rows read it without importing each other.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Waiting,
    Ready,
    Running,
    Done,
    /// Paid for, its outputs being downloaded and judged by its step's checks: what reads
    /// them waits for their verdicts.
    Judging,
    Failed,
    Blocked,
    /// Outside the scope asked for: left pending for a later resume.
    Held,
}
