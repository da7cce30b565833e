//! The hold: a gate every paid call passes after its work and before it is billed. While the
//! sandbox is held, calls that reach the gate wait there, in flight and unbilled, until it is
//! released; then each is billed and answered as usual (a caller that hung up meanwhile is
//! billed all the same, as ever).
//!
//! It lets a test or a demonstration stop a run mid-call for as long as it needs (to start a
//! second process against the same state, to send a signal, to read what was recorded) and
//! then let it go, instead of guessing with latencies how long a call takes; or let the calls
//! through one at a time. In process: [`Sandbox::hold`](crate::sandbox::Sandbox::hold) (a
//! guard), or [`Sandbox::hold_calls`](crate::sandbox::Sandbox::hold_calls) with
//! `let_through(n)` and `release_calls()`; standalone: `POST /_sandbox/hold` and
//! `POST /_sandbox/release`, and `POST /_sandbox/let-through?calls=N`, with the number of calls
//! waiting in `/_sandbox/stats` (`held`) and the passes not used yet (`passes`).

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

/// Holds taken and not released, passes granted and not used, and calls waiting at the gate.
pub(crate) struct Gate {
    state: watch::Sender<Held>,
    waiting: AtomicUsize,
    /// Calls waiting at the gate whose caller hung up meanwhile.
    hung_up: AtomicUsize,
}

#[derive(Clone, Copy, Default)]
struct Held {
    holds: usize,
    /// Calls that may pass a held gate, one each ([`Gate::let_through`]).
    passes: usize,
}

impl Gate {
    pub(crate) fn new() -> Gate {
        Gate {
            state: watch::Sender::new(Held::default()),
            waiting: AtomicUsize::new(0),
            hung_up: AtomicUsize::new(0),
        }
    }

    /// One more hold: calls wait at the gate until every hold is released.
    pub(crate) fn hold(&self) {
        self.state.send_modify(|s| s.holds += 1);
    }

    /// One hold fewer; the last one opens the gate. Returns whether any was taken.
    pub(crate) fn release(&self) -> bool {
        let mut released = false;
        self.state.send_if_modified(|s| {
            released = s.holds > 0;
            s.holds = s.holds.saturating_sub(1);
            if s.holds == 0 {
                s.passes = 0;
            }
            released
        });
        released
    }

    /// Every hold released, and the passes left unused forgotten.
    pub(crate) fn release_all(&self) {
        self.state.send_replace(Held::default());
    }

    /// Lets `n` more calls pass the held gate, now or when they come.
    pub(crate) fn let_through(&self, n: usize) {
        self.state.send_modify(|s| s.passes += n);
    }

    /// Passes granted by [`Gate::let_through`] and not used yet.
    pub(crate) fn passes(&self) -> usize {
        self.state.borrow().passes
    }

    /// One more (`1`) or one fewer (`-1`) call waiting whose caller hung up.
    pub(crate) fn hung_up(&self, by: isize) {
        if by >= 0 {
            self.hung_up.fetch_add(by.unsigned_abs(), Ordering::SeqCst);
        } else {
            self.hung_up.fetch_sub(by.unsigned_abs(), Ordering::SeqCst);
        }
    }

    /// Calls waiting at the gate now whose caller hung up.
    pub(crate) fn waiting_hung_up(&self) -> usize {
        self.hung_up.load(Ordering::SeqCst)
    }

    /// Calls waiting at the gate now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Returns at once while nothing holds the gate, else when the last hold is released or
    /// a pass is granted to this call.
    pub(crate) async fn pass(&self) {
        if self.take_pass() {
            return;
        }
        let mut state = self.state.subscribe();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        loop {
            // The sender lives as long as the state that owns it, and so does this call.
            let _ = state.wait_for(|s| s.holds == 0 || s.passes > 0).await;
            if self.take_pass() {
                break;
            }
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether the gate lets this call pass now: it is open, or a pass is left (taken).
    fn take_pass(&self) -> bool {
        let mut pass = false;
        self.state.send_if_modified(|s| {
            if s.holds == 0 {
                pass = true;
                false
            } else if s.passes > 0 {
                s.passes -= 1;
                pass = true;
                true
            } else {
                false
            }
        });
        pass
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_call_waits_at_a_held_gate_until_the_last_hold_is_released() {
        let gate = Gate::new();
        gate.pass().await;
        assert_eq!(gate.waiting(), 0);
        gate.hold();
        gate.hold();
        let call = gate.pass();
        tokio::pin!(call);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut call)
                .await
                .is_err(),
            "passed a held gate"
        );
        assert_eq!(gate.waiting(), 1);
        assert!(gate.release());
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut call)
                .await
                .is_err(),
            "passed while one hold remained"
        );
        assert!(gate.release());
        call.await;
        assert_eq!(gate.waiting(), 0);
        assert!(!gate.release(), "nothing left to release");
        gate.pass().await;
    }
}
