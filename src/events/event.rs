//! The events a run posts, as the receiver reads them: one JSON object with `event` (its kind),
//! `text` (one line a chat webhook shows as is), `at` (RFC 3339) and the kind's own fields.
//!
//! Only figures and names the run chose are ever put here: no key, no password, no URL of the
//! state database or of the webhook. A new kind is a new variant; `cap.crossed` (spending caps,
//! built apart) goes where the comment in [`Event`] says.

use serde::Serialize;

use crate::run_id::RunId;
use crate::store::RunStatus;

/// What happened, for whoever listens.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event")]
pub enum Event {
    /// The run ended, in any way, with the exit code the process gives.
    #[serde(rename = "run.finished")]
    RunFinished(RunFinished),
    /// The credits billed reached 50, 80 or 100% of the run's budget (each once per run).
    #[serde(rename = "budget.crossed")]
    BudgetCrossed(BudgetCrossed),
    /// A call was billed more than the plan priced it at (the run stops sending after it).
    #[serde(rename = "call.billed_above_plan")]
    CallBilledAbovePlan(CallBilledAbovePlan),
    /// A lease of this run took a spending cap's window past 50, 80 or 100% (each mark of a
    /// window announced once, by the run whose lease passed it).
    #[serde(rename = "cap.crossed")]
    CapCrossed(CapCrossed),
    /// The state database did not answer a draw from the account's shared rate in time: the
    /// process keeps to its share of the limit until it answers (said once each time).
    #[serde(rename = "rate.fallback")]
    RateFallback(RateFallback),
}

#[derive(Clone, Debug, Serialize)]
pub struct RateFallback {
    pub run_id: RunId,
    pub pipeline: String,
    /// What this process keeps to now, in calls per second.
    pub per_second: f64,
    /// The account's limit.
    pub limit_per_second: f64,
    /// The processes it last saw drawing from the limit, itself included.
    pub drawers: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CapCrossed {
    pub run_id: RunId,
    pub pipeline: String,
    pub cap: String,
    /// 50, 80 or 100.
    pub percent: u8,
    /// What the window has spent: leased to runs under way, billed and possibly billed.
    pub credits_spent: u64,
    pub credits: u64,
    /// When the window ends.
    pub window_end: String,
}

/// The run's figures as recorded when it ended.
#[derive(Clone, Debug, Serialize)]
pub struct RunFinished {
    pub run_id: RunId,
    pub pipeline: String,
    /// `succeeded`, `failed`, `stopped` or `interrupted`, as `imgpipe status` says; `unknown`
    /// when the record could not be read.
    #[serde(serialize_with = "status_word")]
    pub status: Option<RunStatus>,
    pub exit_code: u8,
    pub credits: Credits,
    pub tasks: Tasks,
    /// Downloads that failed after their calls were billed.
    pub download_failures: u64,
    /// What the checks did: verdicts by what they said, outputs flagged, rerolls and their
    /// credits; absent when the run judged nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checks: Option<crate::store::CheckCounts>,
    /// The first failed tasks of this process (`item/step[i]`) and why, at most
    /// [`FAILURES_SHOWN`].
    pub failures: Vec<Failure>,
    /// This process's part of the run, in seconds.
    pub duration_seconds: f64,
    /// The run's directory: a local path or an `s3://` prefix.
    pub output: String,
    /// The HTML report, when `--report` wrote one.
    pub report: Option<String>,
}

/// Failed tasks listed in a `run.finished` event; `tasks.failed` counts them all.
pub const FAILURES_SHOWN: usize = 10;

#[derive(Clone, Debug, Serialize)]
pub struct Credits {
    pub planned: u64,
    pub billed: u64,
    /// Calls sent without a complete answer, at their planned price.
    pub possibly_billed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Tasks {
    pub total: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    pub pending: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    pub task: String,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct BudgetCrossed {
    pub run_id: RunId,
    pub pipeline: String,
    /// 50, 80 or 100.
    pub percent: u8,
    pub credits_billed: u64,
    pub max_credits: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CallBilledAbovePlan {
    pub run_id: RunId,
    pub pipeline: String,
    pub task: String,
    pub planned: u64,
    pub billed: u64,
}

impl Event {
    /// The `event` field, also sent as the `X-Imgpipe-Event` header.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::RunFinished(_) => "run.finished",
            Event::BudgetCrossed(_) => "budget.crossed",
            Event::CallBilledAbovePlan(_) => "call.billed_above_plan",
            Event::CapCrossed(_) => "cap.crossed",
            Event::RateFallback(_) => "rate.fallback",
        }
    }

    /// One line for people.
    pub fn text(&self) -> String {
        match self {
            Event::RunFinished(r) => format!(
                "imgpipe: run {} of {} {} (exit {}) in {:.1}s: {}/{} tasks succeeded, {} failed; {} of {} credits billed{}",
                r.run_id,
                r.pipeline,
                r.status.map_or("unknown", RunStatus::as_str),
                r.exit_code,
                r.duration_seconds,
                r.tasks.succeeded,
                r.tasks.total,
                r.tasks.failed,
                r.credits.billed,
                r.credits.planned,
                match r.credits.possibly_billed {
                    0 => String::new(),
                    n => format!(", {n} possibly billed"),
                }
            ),
            Event::BudgetCrossed(b) => format!(
                "imgpipe: run {} of {} has spent {}% of its budget ({} of {} credits)",
                b.run_id, b.pipeline, b.percent, b.credits_billed, b.max_credits
            ),
            Event::CallBilledAbovePlan(c) => format!(
                "imgpipe: run {} of {}: {} was billed {} where the plan said {}",
                c.run_id,
                c.pipeline,
                c.task,
                crate::money::credits(c.billed),
                c.planned
            ),
            Event::CapCrossed(c) => format!(
                "imgpipe: cap {} is {}% spent ({} of {} credits, until {}), run {} of {}",
                c.cap, c.percent, c.credits_spent, c.credits, c.window_end, c.run_id, c.pipeline
            ),
            Event::RateFallback(r) => format!(
                "imgpipe: run {} of {}: the state database does not answer; keeping to {:.2} calls/s, its share of the account's {} a second with {} process(es)",
                r.run_id, r.pipeline, r.per_second, r.limit_per_second, r.drawers
            ),
        }
    }

    /// The JSON body as sent: the event's fields, `text` and `at`.
    pub fn body(&self, at: &str) -> Vec<u8> {
        let mut value = serde_json::to_value(self).unwrap_or_default();
        if let Some(object) = value.as_object_mut() {
            object.insert("text".into(), self.text().into());
            object.insert("at".into(), at.into());
        }
        serde_json::to_vec(&value).unwrap_or_default()
    }
}

/// A run's status as its word, `unknown` for none.
fn status_word<S: serde::Serializer>(
    status: &Option<RunStatus>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(status.map_or("unknown", RunStatus::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_carries_the_kind_a_text_line_and_the_fields() {
        let event = Event::BudgetCrossed(BudgetCrossed {
            run_id: "r1".into(),
            pipeline: "nightly".into(),
            percent: 80,
            credits_billed: 16,
            max_credits: 20,
        });
        let body: serde_json::Value =
            serde_json::from_slice(&event.body("2026-11-25T06:00:00Z")).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "event": "budget.crossed",
                "text": "imgpipe: run r1 of nightly has spent 80% of its budget (16 of 20 credits)",
                "at": "2026-11-25T06:00:00Z",
                "run_id": "r1",
                "pipeline": "nightly",
                "percent": 80,
                "credits_billed": 16,
                "max_credits": 20
            })
        );
    }
}
