//! What the runner shows, as the desk keeps it: the review a dry run makes (the document
//! `reroll --dry-run --json` prints, with what the budget has left and the balance apart), and
//! nothing on the terminal.

use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::exec::Observer;
use crate::money::Priced;
use crate::pipeline::Report;
use crate::plan::document::PlanDocument;
use crate::report::summary::Summary;
use crate::run_id::RunId;
use crate::runner::{Reviewed, View};
use crate::store::StepCounts;

/// A [`View`] that keeps the review and shows nothing; told when the gate admits a confirm.
#[derive(Default)]
pub(super) struct Kept {
    review: Mutex<Option<serde_json::Value>>,
    admitted: Mutex<Option<tokio::sync::oneshot::Sender<Priced>>>,
}

impl Kept {
    /// A view that tells `admitted` what the gate let through; dropped without it (the run
    /// ended first), the receiver learns that nothing was admitted.
    pub(super) fn admitting(admitted: tokio::sync::oneshot::Sender<Priced>) -> Kept {
        Kept {
            review: Mutex::default(),
            admitted: Mutex::new(Some(admitted)),
        }
    }

    /// The review the runner showed, as JSON.
    pub(super) fn review(&self) -> Option<serde_json::Value> {
        self.review.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

struct Silent;

impl Observer for Silent {
    fn task_succeeded(&self, _: usize, _: u64) {}
    fn task_failed(&self, _: usize, _: &str, _: &str) {}
}

impl View for Kept {
    fn diagnostics(&self, _: &Report) {}

    fn plan(&self, _: &PlanDocument) -> Result<(), Error> {
        Ok(())
    }

    fn review(&self, reviewed: &Reviewed<'_>) -> Result<(), Error> {
        let mut json = reviewed.to_json();
        json["budget_left"] = serde_json::json!(reviewed.budget_left);
        json["balance"] = serde_json::json!(reviewed.balance);
        *self.review.lock().unwrap_or_else(|e| e.into_inner()) = Some(json);
        Ok(())
    }

    fn admitted(&self, priced: &Priced) {
        let tell = self
            .admitted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tell) = tell {
            let _ = tell.send(priced.clone());
        }
    }

    fn finished(&self, _: &RunId) -> Result<(), Error> {
        Ok(())
    }

    fn summary(&self, _: &Summary) -> Result<(), Error> {
        Ok(())
    }

    fn progress(&self, _: &[(String, u64)], _: &[StepCounts], _: u64) -> Arc<dyn Observer> {
        Arc::new(Silent)
    }

    fn continue_command(&self, run_id: &RunId) -> String {
        format!("imgpipe resume {run_id}")
    }

    fn continue_rest(&self, run_id: &RunId) -> String {
        format!("imgpipe resume {run_id}")
    }
}
