//! A continuation refused for money (what is left costs more than its budget or the balance
//! allow) keeps what was already paid for before it says no. Result URLs expire within the
//! hour: a refusal that left a paid output unfetched until the money came would lose it. The
//! lost answers are read back first ([`crate::resume::Prepared::read_back`], before the run is
//! reviewed again); then, here, the outputs recorded without a file are fetched from their
//! jobs and stored, no call is paid for, and the run records why it stopped.

use std::sync::Arc;

use crate::error::Error;
use crate::exec::{self, manifest};
use crate::plan::scope::Scope;
use crate::resume::{Prepared, Refusal, refusal::Kept};
use crate::runner::discover::Quiet;
use crate::runner::{Connection, Runner, record};
use crate::store::{RunStatus, Store};

impl Runner<'_> {
    /// The refusal of a continuation over its limit, once it kept what was paid for: `answers`
    /// lost answers read back, and the outputs without a file fetched and stored. The run
    /// records the refusal as why it is stopped when the record changed, or said `running`
    /// (its process gone) or `interrupted`; a finished run (a reroll refused) is left as it
    /// is, and so is a run that already says why it stopped or failed.
    pub(super) async fn refused(
        &self,
        conn: &Connection,
        store: &Store,
        prepared: &Prepared,
        refusal: Refusal,
        answers: usize,
    ) -> Result<(), Error> {
        let row = &prepared.row;
        if crate::resume::finished(row.status, false) {
            return Err(refusal.into());
        }
        let fetched = self.fetch_paid(conn, store, prepared).await?;
        let kept = Kept {
            answers,
            outputs: fetched.unwrap_or(0),
        };
        let refusal = refusal.keeping(kept);
        // `running` (its process gone) and `interrupted` name a resume as what comes next: the
        // refusal is why it cannot come.
        let waiting = matches!(row.status, RunStatus::Running | RunStatus::Interrupted);
        let touched = fetched.is_some() || kept.any() || waiting;
        if touched {
            let why = refusal.message();
            let runs = store.runs();
            runs.set_status(&row.id, RunStatus::Stopped, Some(&why), None)
                .await?;
        }
        Err(refusal.into())
    }

    /// Fetches and stores the outputs the run paid for and has no file of, paying for
    /// nothing: the executor, given no task to pay for and nothing to spend, only restores
    /// them. Gives how many were stored; `None` when there were none to fetch (the run was not
    /// reopened). The temporary files a killed process left are removed first.
    async fn fetch_paid(
        &self,
        conn: &Connection,
        store: &Store,
        prepared: &Prepared,
    ) -> Result<Option<usize>, Error> {
        let id = &prepared.row.id;
        let before = store.outputs().unstored(id).await?.len();
        if before == 0 {
            return Ok(None);
        }
        let run = record::reopen(store, &prepared.row, 0).await?;
        // A process killed inside a download left its temporary file, as a resume's check
        // would remove it before paying.
        let dir = run.dir.clone();
        let _ = tokio::task::spawn_blocking(move || dir.remove_leftovers()).await;
        let mut config = self.exec_config(&run, &prepared.pipeline.name);
        config.scope = Scope::tasks(Vec::new(), "the outputs already paid for".into());
        config.limit = Some(0);
        let links = exec::Links {
            store: store.clone(),
            client: conn.client.clone(),
            downloader: conn.downloader.clone(),
        };
        let graph = Arc::clone(&prepared.graph);
        let shutdown = self.shutdown.clone();
        let outcome = exec::run(graph, links, config, Arc::new(Quiet), shutdown, None).await?;
        if let Err(e) = manifest::write(store, id, &run.dir).await {
            tracing::error!("{e}");
        }
        let after = store.outputs().unstored(id).await?.len();
        let stored = before.saturating_sub(after);
        tracing::info!(
            "refused over its limit, run {id} kept {stored} of {before} output(s) already paid for; nothing was spent"
        );
        if outcome.interrupted {
            let runs = store.runs();
            runs.set_status(id, RunStatus::Interrupted, None, None)
                .await?;
            return Err(Error::Interrupted { detail: None });
        }
        Ok(Some(stored))
    }
}
