//! Outputs: the URLs of earlier outputs that tasks still to run read, the downloads of those
//! without a file, and what each download's end means for the run.

use std::sync::Arc;

use tokio::time::Instant;

use crate::exec::Fatal;
use crate::exec::download::{Checked, Fetched, News, Unfetched};
use crate::exec::scheduler::{Scheduler, sleep_until};
use crate::exec::shared::OutputUrl;
use crate::exec::state::State;
use crate::store::{RecordedOutput, StoreError, TaskId};

impl Scheduler {
    /// Loads the URLs of earlier outputs that a task still to run reads, and downloads those
    /// not on disk: the others are not read at all.
    pub(super) async fn restore_outputs(&mut self) -> Result<(), StoreError> {
        let store = self.shared.store.clone();
        let mut read: Vec<TaskId> = (0..self.graph.len())
            .filter(|t| matches!(self.state[*t], State::Done | State::Judging))
            .filter(|t| self.still_read(*t))
            .filter_map(|t| self.rows.ids.get(t))
            .collect();
        read.sort_unstable();
        let mut outputs = store.outputs().unstored(&self.config.run_id).await?;
        let stored = store.kept().of_tasks(&read).await?.into_iter();
        outputs.extend(stored.filter(|o| o.path.is_some()));
        self.take_outputs(outputs);
        // Tasks a killed process paid for and did not judge: judged once their files are.
        for t in self.checking.waiting_tasks() {
            self.judge_if_kept(t);
        }
        // Every download so far fetches an output a run paid for and could not keep.
        self.downloads.prove_place();
        Ok(())
    }

    /// Keeps the URLs of earlier outputs that a task still to run reads, and downloads, from
    /// their jobs, those with no file or object.
    fn take_outputs(&mut self, outputs: Vec<RecordedOutput>) {
        let graph = Arc::clone(&self.graph);
        let index = graph.index();
        for o in outputs {
            let Some(t) = index.of(&o.task) else {
                continue;
            };
            let missing = o.path.is_none();
            if !missing && !self.still_read(t) {
                continue;
            }
            let k = o.k;
            self.shared.set_url(t, k, url_of(o));
            if missing {
                self.downloads.spawn(&self.shared, t, k);
            }
        }
    }

    pub(super) fn downloads_news(&mut self, news: News) {
        match news {
            News::Fetched(joined) => self.downloaded(joined),
            News::Checked(found) => self.check_ended(found),
        }
    }

    /// Takes what the check of the kept files beside the run found. A check that failed, or
    /// ended without an answer, stops the run: recorded succeeded, its kept files would never
    /// be checked again; stopped, the next resume checks them.
    fn check_ended(&mut self, found: Checked) {
        match found {
            Ok(Ok(outputs)) => self.take_outputs(outputs),
            Ok(Err(e)) => self.fatal(Fatal::Store(e)),
            Err(_) => self.fatal(Fatal::Crashed(
                "the check of the kept files ended without an answer; the next resume checks them again".to_owned(),
            )),
        }
    }

    /// Waits for the downloads: all of them, or until the grace period ends after an
    /// interruption.
    pub(super) async fn drain_downloads(&mut self, mut deadline: Option<Instant>) {
        let shutdown = self.shutdown.clone();
        while !self.downloads.is_empty() {
            tokio::select! {
                Some(joined) = self.downloads.join_next() => self.downloaded(joined),
                () = shutdown.cancelled(), if deadline.is_none() => {
                    self.outcome.interrupted = true;
                    deadline = Some(Instant::now() + self.config.grace);
                }
                () = sleep_until(deadline) => self.downloads.abort().await,
            }
        }
    }

    fn downloaded(&mut self, joined: Result<Fetched, tokio::task::JoinError>) {
        let fetched = match joined {
            Ok(fetched) => fetched,
            Err(e) => {
                return self.fatal(Fatal::Crashed(format!(
                    "a download's task ended abnormally: {e}"
                )));
            }
        };
        let Fetched { task: t, k, result } = fetched;
        let name = |s: &Self| format!("{} output {k}", s.name(t));
        let kept = result.is_ok();
        match result {
            Ok(_) => {}
            // Recorded with the output; the summary reads it from there.
            Err(Unfetched::Output(reason)) => {
                tracing::error!("download of {} failed: {reason}", name(self));
            }
            Err(Unfetched::Storage(reason)) => {
                tracing::error!("download of {} failed: {reason}", name(self));
                self.storage_failed(reason);
            }
            Err(Unfetched::NotTried) => {
                tracing::debug!("{} is left for the next resume to fetch", name(self));
            }
            Err(Unfetched::Store(e)) => self.fatal(Fatal::Store(Arc::new(e))),
        }
        if self.downloads.ended(t, kept) {
            self.release(t);
            self.judge_if_kept(t);
            // A reader's `size` check waits for its input's file (only a run with a task
            // waiting for its verdicts has one: the others pay nothing here).
            if self.checking.busy() {
                for c in self.graph.children(t) {
                    self.judge_if_kept(c);
                }
            }
        }
    }
}

/// Where an earlier output's URL is, as recorded.
fn url_of(o: RecordedOutput) -> OutputUrl {
    OutputUrl {
        output_id: o.id,
        job_id: o.job_id,
        url: o.url,
        issued_ms: o.url_issued_at,
    }
}
