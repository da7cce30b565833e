//! What a finished attempt means: a success makes its readers ready, a failure is retried,
//! failed or put back, and every answer settles the call's reservation in the purse.

use std::sync::Arc;
use std::time::Duration;

use crate::api::{ApiError, ErrorKind};
use crate::exec::attempt::{Attempted, Failure, Success};
use crate::exec::calls::MAX_THROTTLED;
use crate::exec::scheduler::Scheduler;
use crate::exec::state::State;
use crate::exec::{Fatal, OnAmbiguous, Stop};
use crate::store::{TaskId, TaskStatus};

impl Scheduler {
    pub(super) async fn settle(&mut self, attempted: Attempted) {
        let t = attempted.task;
        let planned = self.graph.task(t).planned;
        self.calls.answered(self.graph.task(t).step.0);
        match attempted.result {
            Ok(success) => self.succeeded(t, planned, success).await,
            Err(Failure::Store(e)) => {
                self.purse.ambiguous(planned);
                self.state[t] = State::Ready;
                self.fatal(Fatal::Store(Arc::new(e)));
            }
            Err(Failure::Cancelled) => {
                self.purse.release(planned);
                self.put_back(t).await;
            }
            Err(Failure::Input(reason)) => {
                self.purse.release(planned);
                self.retry_or_fail(t, None, &reason).await;
            }
            Err(Failure::Status(reason)) => {
                let committed = self.purse.ambiguous(planned);
                self.fail(t, &reason, committed).await;
            }
            Err(Failure::Api(e)) => self.api_failure(t, planned, e).await,
        }
    }

    async fn succeeded(&mut self, t: usize, planned: u64, success: Success) {
        self.purse.settle(planned, success.credits);
        self.observer.call_billed(
            self.graph.task(t).step.0,
            &self.name(t),
            planned,
            success.credits,
        );
        if success.credits <= planned {
            self.calls.confirm(self.graph.task(t).step.0);
        }
        if success.credits_remaining.is_some() {
            self.outcome.last_balance = success.credits_remaining;
        }
        if success.credits > planned && self.halt.is_none() && self.config.only.is_none() {
            self.halt = Some(Stop::PriceAbovePlan {
                task: self.name(t),
                planned,
                billed: success.credits,
            });
        }
        let expected = self.graph.outputs(t);
        let got = success.outputs.len() as u32;
        for (k, out) in success.outputs.into_iter().enumerate() {
            self.shared.set_url(t, k as u32, out);
            self.downloads.spawn(&self.shared, t, k as u32);
        }
        if got < expected {
            let reason = format!(
                "job {} returned {got} image(s) where {expected} were asked for",
                success.job_id
            );
            // The bill settled the task's commitment: nothing is left to free.
            self.fail(t, &reason, false).await;
            return;
        }
        if self.checked(t) {
            return self.await_verdicts(t, success.credits);
        }
        self.done(t, success.credits);
    }

    /// Task `t`, billed `credits`, is done: what reads it may go.
    pub(super) fn done(&mut self, t: usize, credits: u64) {
        self.state[t] = State::Done;
        crate::failpoint::hit("exec-task-succeeded");
        self.calls.forget(t);
        self.succeeded.push(t);
        self.unfinished = self.unfinished.saturating_sub(1);
        self.observer
            .task_succeeded(self.graph.task(t).step.0, credits);
        self.release_inputs(t);
        for c in self.graph.children(t) {
            if self.inputs_made(c) {
                self.push_ready(c);
            }
        }
    }

    async fn api_failure(&mut self, t: usize, planned: u64, e: ApiError) {
        let reason = self.shared.client.redact(&e.to_string());
        let Some(kind) = e.kind() else {
            if let ApiError::Ambiguous {
                job_id: Some(id), ..
            } = &e
            {
                // The job exists but could not be read yet: paying again would buy it twice.
                let committed = self.purse.ambiguous(planned);
                let reason = format!(
                    "{reason} (not called again: the job exists; `imgpipe job {id} --out DIR` fetches it)"
                );
                return self.fail(t, &reason, committed).await;
            }
            if matches!(e, ApiError::Ambiguous { .. }) {
                return self.ambiguous(t, planned, &reason).await;
            }
            self.purse.release(planned);
            return match e {
                ApiError::NotSent { .. } => self.retry_or_fail(t, None, &reason).await,
                _ => self.fail(t, &reason, true).await,
            };
        };
        self.purse.release(planned);
        match kind {
            ErrorKind::RateLimited => {
                self.shared.limiter.throttled(e.retry_after());
                self.calls.tries(t).throttled += 1;
                if self.calls.tries(t).throttled <= MAX_THROTTLED {
                    self.requeue(t, Duration::ZERO, false);
                } else {
                    self.fail(t, &reason, true).await;
                }
            }
            ErrorKind::Server => self.retry_or_fail(t, e.retry_after(), &reason).await,
            ErrorKind::Credits => {
                self.put_back(t).await;
                self.halt.get_or_insert(Stop::Balance(reason));
            }
            ErrorKind::Auth => {
                self.put_back(t).await;
                self.fatal(Fatal::Refused(reason));
            }
            ErrorKind::InvalidRequest
                if self.graph.reads_outputs(t) && !self.calls.tries(t).refreshed =>
            {
                // An upstream URL may have expired on the way: nothing was billed, so try
                // once more with fresh ones.
                self.calls.tries(t).refreshed = true;
                self.requeue(t, Duration::ZERO, true);
            }
            _ => self.fail(t, &reason, true).await,
        }
    }

    async fn ambiguous(&mut self, t: usize, planned: u64, reason: &str) {
        // The call counts as spent and a retry pays again: the caps lease it first.
        self.lease_more(planned).await;
        let fits = self.purse.ambiguous(planned);
        self.calls.tries(t).ambiguous += 1;
        let tries = self.calls.tries(t).ambiguous;
        let why = if self.config.on_ambiguous == OnAmbiguous::Fail {
            "--on-ambiguous fail"
        } else if !fits && self.purse.leashed() {
            "another try would not fit the budget or the spending caps"
        } else if !fits {
            "another try would not fit the budget"
        } else if !self.shared.paid_retry.allows(tries) {
            "too many tries"
        } else {
            tracing::warn!("{}: {reason}; trying again", self.name(t));
            let delay = self.shared.paid_retry.backoff(tries);
            return self.requeue(t, delay, false);
        };
        self.fail(t, &format!("{reason} (not tried again: {why})"), fits)
            .await;
    }

    async fn retry_or_fail(&mut self, t: usize, after: Option<Duration>, reason: &str) {
        self.calls.tries(t).retries += 1;
        let n = self.calls.tries(t).retries;
        if !self.shared.paid_retry.allows(n) {
            return self
                .fail(t, &format!("{reason} (after {} tries)", n), true)
                .await;
        }
        tracing::debug!("{}: {reason}; retry {n}", self.name(t));
        let delay = self.shared.paid_retry.delay(n, after);
        self.requeue(t, delay, false);
    }

    pub(super) fn requeue(&mut self, t: usize, delay: Duration, force_refresh: bool) {
        self.calls.again(t, delay, force_refresh);
        self.push_ready(t);
    }

    /// A task that could not be tried, back to pending for a later run.
    async fn put_back(&mut self, t: usize) {
        self.state[t] = State::Ready;
        let ids: Vec<TaskId> = self.rows.ids.get(t).into_iter().collect();
        if let Err(e) = self
            .shared
            .store
            .tasks()
            .set_status(&ids, TaskStatus::Pending, None)
            .await
        {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
    }

    /// Fails `t` and blocks everything that reads it; the rest of the batch goes on.
    /// `committed`: whether the task still holds a commitment to free (not when its price was
    /// spent, or possibly spent, with no retry left to pay for).
    pub(super) async fn fail(&mut self, t: usize, reason: &str, committed: bool) {
        self.state[t] = State::Failed;
        self.calls.forget(t);
        self.unfinished = self.unfinished.saturating_sub(1);
        let task = self.graph.task(t);
        if committed {
            self.purse.abandon(task.planned);
        }
        let name = self.name(t);
        let item = self.graph.item_dir(task.instance);
        self.observer.task_failed(task.step.0, &item, reason);
        self.outcome
            .failures
            .push((name.clone(), reason.to_owned()));
        let mut blocked = Vec::new();
        for d in self.graph.descendants(t) {
            if matches!(self.state[d], State::Waiting | State::Ready) {
                self.ready.remove(d);
                self.state[d] = State::Blocked;
                self.unfinished = self.unfinished.saturating_sub(1);
                let below = self.graph.task(d);
                // An admitted chain's cost is committed; another's is counted at admission.
                if self.ready.is_admitted(below.instance) {
                    self.purse.abandon(below.planned);
                }
                // A task not recorded yet is recorded pending, and blocked again on resume.
                blocked.extend(self.rows.ids.get(d));
            }
        }
        self.release_inputs(t);
        self.release(t);
        let store = &self.shared.store;
        let recorded = match store
            .tasks()
            .set_status(
                &self.rows.ids.get(t).into_iter().collect::<Vec<_>>(),
                TaskStatus::Failed,
                Some(reason),
            )
            .await
        {
            Ok(()) => {
                let why = format!("its input {name} failed");
                store
                    .tasks()
                    .set_status(&blocked, TaskStatus::Blocked, Some(&why))
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = recorded {
            self.fatal(Fatal::Store(Arc::new(e)));
        }
    }
}
