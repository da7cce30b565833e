//! Rerolls as the record keeps them: written in the transaction that resets their tasks
//! ([`crate::store::Revisions::apply`]), looked up by what they named, ended when all their tasks are done.

use crate::run_id::RunId;
use sqlx::{AnyConnection, AnyPool, Row};

use crate::store::{StoreError, now_ms};

/// A reroll to record with the review that resets its tasks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewReroll {
    /// Its targets, sorted: `lamp mug/clean[0]`.
    pub said: String,
    /// The row ids of the tasks it resets.
    pub task_ids: Vec<i64>,
}

/// A reroll recorded and not ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenReroll {
    pub id: i64,
    pub task_ids: Vec<i64>,
}

pub(super) async fn insert(
    conn: &mut AnyConnection,
    run_id: &RunId,
    reroll: &NewReroll,
) -> Result<(), StoreError> {
    let ids = serde_json::to_string(&reroll.task_ids).unwrap_or_else(|_| "[]".into());
    sqlx::query("INSERT INTO rerolls (run_id, said, task_ids, created_at) VALUES ($1, $2, $3, $4)")
        .bind(run_id)
        .bind(&reroll.said)
        .bind(ids)
        .bind(now_ms())
        .execute(conn)
        .await?;
    Ok(())
}

/// The latest reroll of run `run_id` that named `said` and has not ended.
pub(super) async fn open(
    pool: &AnyPool,
    run_id: &RunId,
    said: &str,
) -> Result<Option<OpenReroll>, StoreError> {
    let row = sqlx::query(
        "SELECT id, task_ids FROM rerolls
             WHERE run_id = $1 AND said = $2 AND finished_at IS NULL
             ORDER BY id DESC LIMIT 1",
    )
    .bind(run_id)
    .bind(said)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let text: String = row.try_get("task_ids")?;
    let task_ids = serde_json::from_str(&text)
        .map_err(|e| StoreError::Inconsistent(format!("reroll's task ids do not read: {e}")))?;
    Ok(Some(OpenReroll {
        id: row.try_get("id")?,
        task_ids,
    }))
}

/// Ends the open rerolls of run `run_id` that named `said`: all their tasks are done.
pub(super) async fn finish(pool: &AnyPool, run_id: &RunId, said: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE rerolls SET finished_at = $1
             WHERE run_id = $2 AND said = $3 AND finished_at IS NULL",
    )
    .bind(now_ms())
    .bind(run_id)
    .bind(said)
    .execute(pool)
    .await?;
    Ok(())
}
