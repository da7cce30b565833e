//! What a run's metrics show, read from the record (the same rows `status` and the summary
//! read, so the metrics agree with them): calls by outcome, 429s, downloads still owed and the
//! pipeline's last successful run. A few aggregate statements over the run's own indexes.

use crate::run_id::RunId;
use sqlx::Row;

use crate::store::CallOutcome;
use crate::store::to_u64;
use crate::store::{Store, StoreError};

/// A run's call and download figures beyond [`crate::store::Totals`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunGauges {
    /// Finished calls by outcome.
    pub calls: Vec<(CallOutcome, u64)>,
    /// Calls sent and not answered yet.
    pub in_flight: u64,
    /// Calls the service answered 429.
    pub rate_limited: u64,
    /// When the oldest output not yet downloaded (and not failed) was made, unix ms.
    pub oldest_undownloaded_ms: Option<i64>,
    /// When a run of the pipeline last finished successfully, unix ms.
    pub last_success_ms: Option<i64>,
}

impl Store {
    /// The gauges of a run that the metrics file shows.
    pub fn gauges(&self) -> Gauges<'_> {
        Gauges { store: self }
    }
}

/// The gauges of a run that the metrics file shows.
#[derive(Clone, Copy, Debug)]
pub struct Gauges<'a> {
    store: &'a Store,
}

impl<'a> Gauges<'a> {
    pub async fn of_run(&self, run_id: &RunId, pipeline: &str) -> Result<RunGauges, StoreError> {
        let rows = sqlx::query(
            "SELECT outcome, COUNT(*) AS n,
                    COUNT(*) FILTER (WHERE http_status = 429) AS limited
             FROM attempts WHERE run_id = $1 GROUP BY outcome ORDER BY 1",
        )
        .bind(run_id)
        .fetch_all(self.store.pool())
        .await?;
        let mut gauges = RunGauges::default();
        for r in &rows {
            let outcome: Option<String> = r.try_get("outcome")?;
            let n = to_u64(r.try_get("n")?);
            gauges.rate_limited += to_u64(r.try_get("limited")?);
            match outcome.as_deref().map(CallOutcome::parse) {
                None => gauges.in_flight = n,
                Some(outcome) => gauges.calls.push((outcome, n)),
            }
        }
        gauges.oldest_undownloaded_ms = sqlx::query(
            "SELECT MIN(url_issued_at) AS oldest FROM outputs
             WHERE run_id = $1 AND path IS NULL AND download_error IS NULL",
        )
        .bind(run_id)
        .fetch_one(self.store.pool())
        .await?
        .try_get("oldest")?;
        gauges.last_success_ms = sqlx::query(
            "SELECT MAX(finished_at) AS last FROM runs
             WHERE pipeline_name = $1 AND status = 'succeeded'",
        )
        .bind(pipeline)
        .fetch_one(self.store.pool())
        .await?
        .try_get("last")?;
        Ok(gauges)
    }
}
