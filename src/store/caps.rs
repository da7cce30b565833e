//! Spending caps and the leases runs take against them (see the `caps` migration). Every
//! change to a cap's leases happens in one transaction that first takes the caps' rows for
//! writing (an `UPDATE` of them: a row lock on PostgreSQL, the write lock on SQLite), so runs in
//! several processes or on several hosts lease one after the other and together never lease
//! more than a window's room.

use sqlx::Row;

use crate::run_id::RunId;
use crate::store::to_u64;
use crate::store::{Store, StoreError, now_ms, rows};

/// A spending cap as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapSetting {
    pub name: String,
    pub credits: u64,
    /// `day`, `week` or `month`.
    pub per: String,
    /// The pipeline it covers; `None` for every pipeline.
    pub pipeline: Option<String>,
    /// The IANA time zone its windows are counted in.
    pub tz: String,
    pub created_at: i64,
}

/// A cap's current window, as a lease asks for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapWindow {
    pub cap: String,
    /// Unix milliseconds.
    pub start: i64,
    pub credits: u64,
}

/// Who leases: the holder's name and its run.
#[derive(Clone, Copy, Debug)]
pub struct Lessee<'a> {
    pub holder: &'a str,
    pub run_id: &'a RunId,
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn cap_row(r: &sqlx::any::AnyRow) -> Result<CapSetting, StoreError> {
    Ok(CapSetting {
        name: r.try_get("name")?,
        credits: to_u64(r.try_get("credits")?),
        per: r.try_get("per")?,
        pipeline: r.try_get("pipeline")?,
        tz: r.try_get("tz")?,
        created_at: r.try_get("created_at")?,
    })
}

type Tx<'c> = sqlx::Transaction<'c, sqlx::Any>;

/// The spending caps and the leases runs take against them.
#[derive(Clone, Copy, Debug)]
pub struct Caps<'a> {
    pub(super) store: &'a Store,
}

impl Caps<'_> {
    /// Sets a cap, replacing one of the same name; returns whether one was replaced.
    pub async fn set(&self, cap: &CapSetting) -> Result<bool, StoreError> {
        let mut tx = self.store.begin_write().await?;
        let replaced = sqlx::query("DELETE FROM caps WHERE name = $1")
            .bind(&cap.name)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            > 0;
        sqlx::query(
            "INSERT INTO caps (name, credits, per, pipeline, tz, created_at)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&cap.name)
        .bind(i64_of(cap.credits))
        .bind(&cap.per)
        .bind(cap.pipeline.as_deref())
        .bind(&cap.tz)
        .bind(cap.created_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(replaced)
    }

    /// Every cap, by name.
    pub async fn list(&self) -> Result<Vec<CapSetting>, StoreError> {
        sqlx::query("SELECT name, credits, per, pipeline, tz, created_at FROM caps ORDER BY name")
            .fetch_all(self.store.pool())
            .await?
            .iter()
            .map(cap_row)
            .collect()
    }

    /// Removes a cap (its windows' leases stay, as history); returns whether there was one.
    pub async fn remove(&self, name: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM caps WHERE name = $1")
            .bind(name)
            .execute(self.store.pool())
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// What a cap's window has spent: its open leases whole, and what its closed ones used.
    pub async fn spent(&self, cap: &str, window_start: i64) -> Result<u64, StoreError> {
        let mut conn = self.store.pool().acquire().await?;
        spent_in(&mut conn, cap, window_start).await
    }

    /// Leases up to `want` credits from the windows of `caps`, the same from each, all or none,
    /// and none unless at least `least` fits every one: returns what was leased, and what each
    /// window had spent before (in the order of `caps`). Leases whose
    /// holder has not beaten since `stale_before` are closed first (see
    /// [`Caps::close_of`]). Heartbeats are times of the caller's clock (`beat_at` here, the
    /// first), which `stale_before` is read on.
    pub async fn lease(
        &self,
        caps: &[CapWindow],
        lessee: Lessee<'_>,
        want: u64,
        least: u64,
        (stale_before, beat_at): (i64, i64),
    ) -> Result<(u64, Vec<u64>), StoreError> {
        let mut tx = self.store.begin_write().await?;
        hold_caps(&mut tx, self.store, caps).await?;
        for stale in stale_holders(&mut tx, self.store, caps, stale_before).await? {
            close_dead(&mut tx, &stale.0, &stale.1).await?;
        }
        let mut room = want;
        let mut before = Vec::with_capacity(caps.len());
        for cap in caps {
            let spent = spent_in(&mut tx, &cap.cap, cap.start).await?;
            room = room.min(cap.credits.saturating_sub(spent));
            before.push(spent);
        }
        if room < least.max(1) {
            tx.commit().await?;
            return Ok((0, before));
        }
        let now = now_ms();
        for cap in caps {
            sqlx::query(
                "INSERT INTO cap_leases (cap, window_start, run_id, holder, credits, used, open,
                     opened_at, heartbeat_at)
                 VALUES ($1, $2, $3, $4, $5, 0, 1, $6, $7)",
            )
            .bind(&cap.cap)
            .bind(cap.start)
            .bind(lessee.run_id)
            .bind(lessee.holder)
            .bind(i64_of(room))
            .bind(now)
            .bind(beat_at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok((room, before))
    }

    /// Says the holder is alive at `at` (on the caller's clock, as [`Caps::lease`]'s); returns
    /// how many of its leases are still open (fewer than it took: another run found it dead
    /// and closed them).
    pub async fn beat(&self, holder: &str, at: i64) -> Result<u64, StoreError> {
        let done =
            sqlx::query("UPDATE cap_leases SET heartbeat_at = $1 WHERE holder = $2 AND open = 1")
                .bind(at)
                .bind(holder)
                .execute(self.store.pool())
                .await?;
        Ok(done.rows_affected())
    }

    /// Closes the holder's leases, having spent `spent` credits: each cap's leases, oldest
    /// first, are used up to their credits, and what is left of them returns to their windows.
    pub async fn close(&self, holder: &str, spent: u64) -> Result<(), StoreError> {
        let mut tx = self.store.begin_write().await?;
        close_with(&mut tx, holder, spent).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Closes every open lease of `run_id` held by another than `holder`: a resume holds the
    /// run's lock, so whoever held them is gone. Each is used by what its run was billed, or
    /// possibly billed, since it opened.
    pub async fn close_of(&self, run_id: &RunId, holder: &str) -> Result<(), StoreError> {
        let mut tx = self.store.begin_write().await?;
        let holders: Vec<(String,)> = sqlx::query_as(
            "SELECT DISTINCT holder FROM cap_leases WHERE run_id = $1 AND open = 1 AND holder <> $2",
        )
        .bind(run_id)
        .bind(holder)
        .fetch_all(&mut *tx)
        .await?;
        for (dead,) in holders {
            close_dead(&mut tx, &dead, run_id).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// Takes the caps' rows for writing, so leases of these caps happen one at a time.
async fn hold_caps(tx: &mut Tx<'_>, store: &Store, caps: &[CapWindow]) -> Result<(), StoreError> {
    let marks = rows(store.backend(), caps.len(), 1, |p| p[0].clone());
    let sql = format!("UPDATE caps SET credits = credits WHERE name IN ({marks})");
    // Built from a fixed placeholder list: no value is ever part of the text.
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for cap in caps {
        query = query.bind(&cap.cap);
    }
    query.execute(&mut **tx).await?;
    Ok(())
}

/// The holders (and their runs) of open leases of `caps` that stopped beating.
async fn stale_holders(
    tx: &mut Tx<'_>,
    store: &Store,
    caps: &[CapWindow],
    before: i64,
) -> Result<Vec<(String, RunId)>, StoreError> {
    // The time is bound first, then the names.
    let marks = rows(store.backend(), caps.len() + 1, 1, |p| p[0].clone());
    let (time, names) = marks.split_once(", ").unwrap_or((&marks, ""));
    let sql = format!(
        "SELECT DISTINCT holder, run_id FROM cap_leases
         WHERE open = 1 AND heartbeat_at < {time} AND cap IN ({names})"
    );
    // Built from a fixed placeholder list: no value is ever part of the text.
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(before);
    for cap in caps {
        query = query.bind(&cap.cap);
    }
    let found = query.fetch_all(&mut **tx).await?;
    found
        .iter()
        .map(|r| {
            Ok((
                r.try_get("holder")?,
                RunId::from(r.try_get::<String, _>("run_id")?),
            ))
        })
        .collect()
}

/// What the window of `cap` starting at `start` has spent.
async fn spent_in(
    conn: &mut sqlx::AnyConnection,
    cap: &str,
    start: i64,
) -> Result<u64, StoreError> {
    let (spent,): (Option<i64>,) = sqlx::query_as(
        "SELECT CAST(SUM(CASE WHEN open = 1 THEN credits ELSE used END) AS BIGINT) FROM cap_leases
         WHERE cap = $1 AND window_start = $2",
    )
    .bind(cap)
    .bind(start)
    .fetch_one(conn)
    .await?;
    Ok(spent.map_or(0, to_u64))
}

/// Closes the leases of a holder that is gone, used by what its run was billed or possibly
/// billed (an attempt without an answer, at its task's planned price) since the first of them
/// opened.
async fn close_dead(tx: &mut Tx<'_>, holder: &str, run_id: &RunId) -> Result<(), StoreError> {
    let (since,): (Option<i64>,) =
        sqlx::query_as("SELECT MIN(opened_at) FROM cap_leases WHERE holder = $1 AND open = 1")
            .bind(holder)
            .fetch_one(&mut **tx)
            .await?;
    let Some(since) = since else {
        return Ok(());
    };
    let (spent,): (Option<i64>,) = sqlx::query_as(
        "SELECT CAST(SUM(CASE WHEN a.outcome IS NULL OR a.outcome = 'ambiguous'
                              THEN t.planned_credits ELSE a.credits_billed END) AS BIGINT)
         FROM attempts a JOIN tasks t ON t.id = a.task_id
         WHERE a.run_id = $1 AND a.started_at >= $2",
    )
    .bind(run_id)
    .bind(since)
    .fetch_one(&mut **tx)
    .await?;
    tracing::debug!("closing the cap leases of {holder}, gone, with {spent:?} credits spent");
    close_with(tx, holder, spent.map_or(0, to_u64)).await
}

/// Closes the holder's open leases having spent `spent`: each cap's, oldest first, used up
/// to their credits.
async fn close_with(tx: &mut Tx<'_>, holder: &str, spent: u64) -> Result<(), StoreError> {
    let open = sqlx::query(
        "SELECT id, cap, credits FROM cap_leases WHERE holder = $1 AND open = 1 ORDER BY cap, id",
    )
    .bind(holder)
    .fetch_all(&mut **tx)
    .await?;
    let mut left = 0;
    let mut cap: Option<String> = None;
    for r in open {
        let (id, this, credits): (i64, String, i64) =
            (r.try_get("id")?, r.try_get("cap")?, r.try_get("credits")?);
        if cap.as_deref() != Some(this.as_str()) {
            left = spent;
            cap = Some(this);
        }
        let used = left.min(to_u64(credits));
        left -= used;
        sqlx::query("UPDATE cap_leases SET open = 0, used = $1 WHERE id = $2")
            .bind(i64_of(used))
            .bind(id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}
