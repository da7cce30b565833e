//! The hold: a gate every paid call passes after its work and before it is billed. While the
//! sandbox is held, calls that reach the gate wait there, in flight and unbilled, until it is
//! released; then each is billed and answered as usual (a caller that hung up meanwhile is
//! billed all the same, as ever).
//!
//! It lets a test or a demonstration stop a run mid-call for as long as it needs (to start a
//! second process against the same state, to send a signal, to read what was recorded) and
//! then let it go, instead of guessing with latencies how long a call takes. In process:
//! [`Sandbox::hold`](crate::sandbox::Sandbox::hold); standalone: `POST /_sandbox/hold` and
//! `POST /_sandbox/release`, with the number of calls waiting in `/_sandbox/stats` (`held`).

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

/// Holds taken and not released, and calls waiting at the gate.
pub(crate) struct Gate {
    holds: watch::Sender<usize>,
    waiting: AtomicUsize,
}

impl Gate {
    pub(crate) fn new() -> Gate {
        Gate {
            holds: watch::Sender::new(0),
            waiting: AtomicUsize::new(0),
        }
    }

    /// One more hold: calls wait at the gate until every hold is released.
    pub(crate) fn hold(&self) {
        self.holds.send_modify(|n| *n += 1);
    }

    /// One hold fewer; the last one opens the gate. Returns whether any was taken.
    pub(crate) fn release(&self) -> bool {
        let mut released = false;
        self.holds.send_if_modified(|n| {
            released = *n > 0;
            *n = n.saturating_sub(1);
            released
        });
        released
    }

    /// Calls waiting at the gate now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Returns at once while nothing holds the gate, else when the last hold is released.
    pub(crate) async fn pass(&self) {
        let mut holds = self.holds.subscribe();
        if *holds.borrow_and_update() == 0 {
            return;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // The sender lives as long as the state that owns it, and so does this call.
        let _ = holds.wait_for(|n| *n == 0).await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
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
