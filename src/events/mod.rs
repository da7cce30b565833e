//! What a run tells the world outside it while it goes on and when it ends: alerts posted to a
//! webhook ([`notify`], the events in [`event`]) and a metrics file for Prometheus
//! ([`metrics`]). The runner opens a [`Session`] around the execution, and closes it with how
//! the run ended.
//!
//! Neither part is on the hot path, and neither decides anything: the executor's observer only
//! compares counts and hands an event to a channel; posting and writing happen in tasks of
//! their own; a webhook that is down or slow and a file that cannot be written are warned
//! about, and the run's outcome and exit code stay what they were.

pub mod event;
pub mod metrics;
pub mod notify;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

pub use event::Event;

use crate::events::event::{
    BudgetCrossed, CallBilledAbovePlan, CapCrossed, Credits, Failure, RateFallback, RunFinished,
};
use crate::events::metrics::MetricsFile;
use crate::events::notify::{DELIVERY_BOUND, Notifier};
use crate::exec::Observer;
use crate::run_id::RunId;
use crate::store::Store;

/// Shares of the run's budget that raise `budget.crossed`, in percent.
pub const BUDGET_MARKS: [u8; 3] = [50, 80, 100];

/// What the command line, the environment and the pipeline file asked for.
#[derive(Clone, Default)]
pub struct Config {
    /// Checked with [`crate::webhook::check_url`].
    pub notify_url: Option<url::Url>,
    /// Signs the events' bodies.
    pub notify_secret: Option<notify::Secret>,
    pub metrics_file: Option<PathBuf>,
}

impl std::fmt::Debug for Config {
    /// The webhook's host only: its path is often its credential.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field(
                "notify_host",
                &self.notify_url.as_ref().map(|u| u.host_str()),
            )
            .field("notify_secret", &self.notify_secret)
            .field("metrics_file", &self.metrics_file)
            .finish()
    }
}

/// A run's events and metrics while it executes.
pub struct Session {
    run_id: RunId,
    pipeline: String,
    started: Instant,
    notifier: Option<Notifier>,
    metrics: Option<MetricsFile>,
}

/// How the run ended, for `run.finished`.
pub struct Ending<'a> {
    pub store: &'a Store,
    pub exit_code: u8,
    /// This process's failed tasks (`item/step[i]`) and why, as the executor gave them.
    pub failures: &'a [(String, String)],
    /// The run's directory.
    pub output: String,
    /// The report, when one was written.
    pub report: Option<String>,
}

impl Session {
    /// Starts the sender and writes the metrics file a first time.
    pub async fn start(config: &Config, store: &Store, run_id: &RunId, pipeline: &str) -> Session {
        let target = config.notify_url.clone().map(|url| notify::Target {
            url,
            secret: config.notify_secret.clone(),
        });
        let notifier = target.and_then(|target| match Notifier::start(target) {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!("notify: cannot start: {}; no events will be sent", e);
                None
            }
        });
        let metrics = match &config.metrics_file {
            Some(path) => {
                Some(MetricsFile::start(path.clone(), store.clone(), run_id, pipeline).await)
            }
            None => None,
        };
        Session {
            run_id: run_id.to_owned(),
            pipeline: pipeline.to_owned(),
            started: Instant::now(),
            notifier,
            metrics,
        }
    }

    /// `inner` with the budget marks and prices above plan watched, when events are sent.
    /// `billed_before`: what the run was billed before this process; marks it passed then
    /// were announced then.
    pub fn observer(
        &self,
        inner: Arc<dyn Observer>,
        max_credits: Option<u64>,
        billed_before: u64,
    ) -> Arc<dyn Observer> {
        let Some(notifier) = &self.notifier else {
            return inner;
        };
        Arc::new(Watch {
            inner,
            sender: notifier.sender(),
            run_id: self.run_id.clone(),
            pipeline: self.pipeline.clone(),
            max_credits,
            billed: AtomicU64::new(billed_before),
            marks_passed: AtomicUsize::new(marks_passed(billed_before, max_credits)),
        })
    }

    /// Writes the metrics a last time, sends `run.finished` and waits for the events still
    /// being delivered, at most [`DELIVERY_BOUND`].
    pub async fn finish(self, end: Ending<'_>) {
        if let Some(metrics) = self.metrics {
            metrics.finish().await;
        }
        let Some(notifier) = self.notifier else {
            return;
        };
        let totals = end
            .store
            .runs()
            .totals(&self.run_id)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!("notify: cannot read the run's totals: {e}");
                Default::default()
            });
        let checks = match end.store.verdicts().counts(&self.run_id).await {
            Ok(counts) => counts.any().then_some(counts),
            Err(e) => {
                tracing::warn!("notify: cannot read the run's checks: {e}");
                None
            }
        };
        let status = match end.store.runs().get(&self.run_id).await {
            Ok(Some(row)) => Some(row.status),
            _ => None,
        };
        let finished = RunFinished {
            run_id: self.run_id,
            pipeline: self.pipeline,
            status,
            exit_code: end.exit_code,
            credits: Credits {
                planned: totals.planned_credits,
                billed: totals.billed_credits,
                possibly_billed: totals.possibly_billed_credits,
            },
            tasks: event::Tasks {
                total: totals.tasks,
                succeeded: totals.succeeded,
                failed: totals.failed,
                blocked: totals.blocked,
                pending: totals.pending,
            },
            download_failures: totals.download_failures,
            checks,
            failures: end
                .failures
                .iter()
                .take(event::FAILURES_SHOWN)
                .map(|(task, reason)| Failure {
                    task: task.clone(),
                    reason: reason.clone(),
                })
                .collect(),
            duration_seconds: self.started.elapsed().as_secs_f64(),
            output: end.output,
            report: end.report,
        };
        notifier
            .close(Event::RunFinished(finished), DELIVERY_BOUND)
            .await;
    }
}

/// How many of [`BUDGET_MARKS`] `billed` has reached.
fn marks_passed(billed: u64, max_credits: Option<u64>) -> usize {
    match max_credits {
        None | Some(0) => 0,
        Some(max) => BUDGET_MARKS
            .iter()
            .filter(|&&m| u128::from(billed) * 100 >= u128::from(m) * u128::from(max))
            .count(),
    }
}

/// The executor's observer with the run's bills watched for events.
struct Watch {
    inner: Arc<dyn Observer>,
    sender: notify::Sender,
    run_id: RunId,
    pipeline: String,
    max_credits: Option<u64>,
    billed: AtomicU64,
    marks_passed: AtomicUsize,
}

impl Observer for Watch {
    fn task_succeeded(&self, step: usize, credits: u64) {
        self.inner.task_succeeded(step, credits);
    }

    fn task_failed(&self, step: usize, item: &str, reason: &str) {
        self.inner.task_failed(step, item, reason);
    }

    fn call_billed(&self, step: usize, task: &str, planned: u64, billed: u64) {
        self.inner.call_billed(step, task, planned, billed);
        if billed > planned {
            self.sender
                .send(Event::CallBilledAbovePlan(CallBilledAbovePlan {
                    run_id: self.run_id.clone(),
                    pipeline: self.pipeline.clone(),
                    task: task.to_owned(),
                    planned,
                    billed,
                }));
        }
        let Some(max) = self.max_credits else { return };
        let total = self.billed.fetch_add(billed, Ordering::Relaxed) + billed;
        let now = marks_passed(total, Some(max));
        // Each mark once: whoever moves the count past it announces it.
        let before = self.marks_passed.fetch_max(now, Ordering::Relaxed);
        for &percent in BUDGET_MARKS.get(before..now).unwrap_or_default() {
            self.sender.send(Event::BudgetCrossed(BudgetCrossed {
                run_id: self.run_id.clone(),
                pipeline: self.pipeline.clone(),
                percent,
                credits_billed: total,
                max_credits: max,
            }));
        }
    }

    fn rate_fallback(&self, share: f64, limit: f64, drawers: u64) {
        self.inner.rate_fallback(share, limit, drawers);
        self.sender.send(Event::RateFallback(RateFallback {
            run_id: self.run_id.clone(),
            pipeline: self.pipeline.clone(),
            per_second: share,
            limit_per_second: limit,
            drawers,
        }));
    }

    fn cap_crossed(&self, c: &crate::money::caps::Crossing) {
        self.inner.cap_crossed(c);
        self.sender.send(Event::CapCrossed(CapCrossed {
            run_id: self.run_id.clone(),
            pipeline: self.pipeline.clone(),
            cap: c.cap.clone(),
            percent: c.percent,
            credits_spent: c.spent,
            credits: c.credits,
            window_end: c.window_end.clone(),
        }));
    }

    fn finish(&self) {
        self.inner.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::marks_passed;

    #[test]
    fn marks_are_reached_at_their_share_of_the_budget() {
        assert_eq!(marks_passed(9, Some(20)), 0);
        assert_eq!(marks_passed(10, Some(20)), 1);
        assert_eq!(marks_passed(16, Some(20)), 2);
        assert_eq!(marks_passed(25, Some(20)), 3);
        assert_eq!(marks_passed(25, None), 0);
    }
}
