//! The runs of a state database as one line each: what `imgpipe runs` prints and the review
//! desk's `GET /api/runs` answers, made in one place.

use serde::Serialize;

use crate::report::live::{Process, observe};
use crate::run_id::RunId;
use crate::store::{Store, StoreError};
use crate::time::rfc3339_ms as time;

/// One run, as `imgpipe runs --json` gives it.
#[derive(Clone, Debug, Serialize)]
pub struct RunLine {
    pub id: String,
    pub pipeline: String,
    pub status: &'static str,
    pub credits_planned: u64,
    pub credits_billed: u64,
    pub possibly_billed: u64,
    pub started: String,
    pub finished: Option<String>,
    /// For a run recorded as `running`: whether its process is still going.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<Process>,
    /// The command that continues a run whose process is gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_with: Option<String>,
    /// The run's processes drawing from their account's shared rate limit now.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rate_drawers: Vec<crate::store::Drawer>,
}

/// Every run of `store`, newest last as the store lists them; `resume` gives the command that
/// continues a run, said for one whose process is gone.
pub async fn lines(
    store: &Store,
    resume: impl Fn(&RunId) -> String,
) -> Result<Vec<RunLine>, StoreError> {
    let mut lines = Vec::new();
    let since = crate::store::now_ms() - crate::exec::account_rate::STALE_AFTER_MS;
    let drawers = store.rates().drawers(since).await?;
    for run in store.runs().list().await? {
        let (run, process) = observe(store, run).await?;
        let totals = store.runs().totals(&run.id).await?;
        // Said for a run whose process is gone; other unfinished runs said so when they ended.
        let continue_with = process
            .as_ref()
            .filter(|p| !p.alive)
            .map(|_| resume(&run.id));
        lines.push(RunLine {
            status: run.status.as_str(),
            // A run records an item's tasks only as it reaches the item: the plan has the rest.
            credits_planned: totals.planned_credits.max(run.credits_planned),
            credits_billed: totals.billed_credits,
            possibly_billed: totals.possibly_billed_credits,
            started: time(run.created_at),
            finished: run.finished_at.map(time),
            process,
            continue_with,
            rate_drawers: drawers
                .iter()
                .filter(|d| d.run_id == run.id.as_str())
                .cloned()
                .collect(),
            pipeline: run.pipeline_name,
            id: run.id.to_string(),
        });
    }
    Ok(lines)
}
