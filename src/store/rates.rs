//! The rate limits of accounts, shared by every process that spends through this database
//! (see the `shared_rate` migration). A process draws a block of calls with ONE statement that
//! moves the account's theoretical arrival time (GCRA) forward and returns it: no read then
//! write, so two processes (two hosts) can never be handed the same stretch of time. On
//! PostgreSQL the statement reads the server's clock, so hosts never disagree about "now"; on
//! SQLite (one machine) it runs in an immediate transaction with the process's clock.

use sqlx::Row;

use crate::run_id::RunId;
use crate::store::{Backend, Store, StoreError, now_ms, to_i64, to_u64};

/// The server's clock, in unix microseconds (PostgreSQL).
const PG_NOW_US: &str = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)";

/// A block of calls drawn from an account's limit, on the clock of the statement that drew it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drawn {
    /// The block's calls may go from here, one every interval (unix microseconds).
    pub start_us: i64,
    /// The account's theoretical arrival time after the draw: the block's end.
    pub end_us: i64,
    /// "Now" as the statement read it.
    pub now_us: i64,
    /// The processes drawing from the account, seen since the time the draw was given.
    pub drawers: u64,
}

/// A process that draws from an account's limit, as it registers itself.
#[derive(Clone, Debug)]
pub struct NewDrawer<'a> {
    pub holder: &'a str,
    pub account: &'a str,
    pub run_id: &'a RunId,
    pub host: &'a str,
    pub pid: u32,
}

/// A process drawing from an account's limit, as `status` and `runs` show it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Drawer {
    /// The first 12 hexadecimal digits of the account's digest: enough to tell accounts apart.
    pub account: String,
    pub run_id: String,
    pub host: String,
    pub pid: u64,
    /// The account's limit, in calls per second.
    pub per_second: f64,
    /// Unix milliseconds.
    pub started_at: i64,
    pub last_seen: i64,
    /// Calls drawn so far.
    pub drawn: u64,
}

/// The accounts' shared rate limits and the processes drawing from them.
#[derive(Clone, Copy, Debug)]
pub struct Rates<'a> {
    pub(super) store: &'a Store,
}

impl Rates<'_> {
    /// Makes sure the account has a row, its limit the one this process was told (the last
    /// told wins: every process charges its own interval per call anyway), and registers the
    /// drawer.
    pub async fn enrol(
        &self,
        drawer: &NewDrawer<'_>,
        interval_us: u64,
        burst: u32,
    ) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        sqlx::query(
            "INSERT INTO rate_accounts (account, interval_us, burst) VALUES ($1, $2, $3)
             ON CONFLICT (account) DO UPDATE SET interval_us = $2, burst = $3",
        )
        .bind(drawer.account)
        .bind(to_i64(interval_us.max(1)))
        .bind(i64::from(burst.max(1)))
        .execute(&mut *tx)
        .await?;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO rate_drawers (holder, account, run_id, host, pid, started_at, last_seen)
             VALUES ($1, $2, $3, $4, $5, $6, $6)
             ON CONFLICT (holder) DO UPDATE SET last_seen = $6",
        )
        .bind(drawer.holder)
        .bind(drawer.account)
        .bind(drawer.run_id)
        .bind(drawer.host)
        .bind(i64::from(drawer.pid))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Draws `calls` calls, charged `interval_us` each, in one statement: the account's TAT
    /// becomes `max(TAT, pause end, now − (burst − 1) × interval) + calls × interval`, and the
    /// block is the stretch it moved over; with it, how many drawers were seen since
    /// `seen_since` (unix ms). `None` when the account has no row (never enrolled).
    pub async fn draw(
        &self,
        account: &str,
        calls: u32,
        interval_us: u64,
        seen_since: i64,
    ) -> Result<Option<Drawn>, StoreError> {
        let interval = to_i64(interval_us.max(1));
        let span = interval.saturating_mul(i64::from(calls.max(1)));
        let row = match self.store.backend() {
            Backend::Postgres => {
                let sql = format!(
                    "WITH c AS (SELECT {PG_NOW_US} AS now_us)
                     UPDATE rate_accounts
                     SET tat_us = GREATEST(tat_us, paused_until_us, c.now_us - (burst - 1) * $1) + $2
                     FROM c WHERE account = $3
                     RETURNING tat_us, c.now_us AS now_us,
                         (SELECT COUNT(*) FROM rate_drawers d
                          WHERE d.account = $3 AND d.last_seen >= $4) AS drawers"
                );
                // Built from a constant: no value is ever part of the text.
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(interval)
                    .bind(span)
                    .bind(account)
                    .bind(seen_since)
                    .fetch_optional(self.store.pool())
                    .await?
                    .map(|r| -> Result<_, StoreError> {
                        Ok((
                            r.try_get("tat_us")?,
                            r.try_get("now_us")?,
                            r.try_get("drawers")?,
                        ))
                    })
                    .transpose()?
            }
            Backend::Sqlite => {
                // One machine, one clock: the process's, read inside the write lock so that
                // draws happen in the order of their "now".
                let mut tx = self.store.pool().begin_with("BEGIN IMMEDIATE").await?;
                let now_us = now_us();
                let row = sqlx::query(
                    "UPDATE rate_accounts
                     SET tat_us = max(tat_us, paused_until_us, $1 - (burst - 1) * $2) + $3
                     WHERE account = $4
                     RETURNING tat_us, $1 AS now_us",
                )
                .bind(now_us)
                .bind(interval)
                .bind(span)
                .bind(account)
                .fetch_optional(&mut *tx)
                .await?;
                let (drawers,): (i64,) = sqlx::query_as(
                    "SELECT COUNT(*) FROM rate_drawers WHERE account = $1 AND last_seen >= $2",
                )
                .bind(account)
                .bind(seen_since)
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                row.map(|r| -> Result<_, StoreError> {
                    Ok((r.try_get("tat_us")?, r.try_get("now_us")?, drawers))
                })
                .transpose()?
            }
        };
        let Some((end_us, now_us, drawers)) = row else {
            return Ok(None);
        };
        let end_us: i64 = end_us;
        Ok(Some(Drawn {
            start_us: end_us - span,
            end_us,
            now_us,
            drawers: to_u64(drawers),
        }))
    }

    /// The service answered 429 on this account: every process that draws after this waits
    /// `pause_us` from now (on the same clock as the draws).
    pub async fn pause(&self, account: &str, pause_us: u64) -> Result<(), StoreError> {
        let pause = to_i64(pause_us);
        match self.store.backend() {
            Backend::Postgres => {
                let sql = format!(
                    "UPDATE rate_accounts SET paused_until_us = GREATEST(paused_until_us, {PG_NOW_US} + $1)
                     WHERE account = $2"
                );
                // Built from a constant: no value is ever part of the text.
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(pause)
                    .bind(account)
                    .execute(self.store.pool())
                    .await?;
            }
            Backend::Sqlite => {
                sqlx::query(
                    "UPDATE rate_accounts SET paused_until_us = max(paused_until_us, $1)
                     WHERE account = $2",
                )
                .bind(now_us().saturating_add(pause))
                .bind(account)
                .execute(self.store.pool())
                .await?;
            }
        }
        Ok(())
    }

    /// Says the drawer is alive (registering it again if another took it for gone), forgets
    /// the drawers of its account silent since `stale_before` (unix ms), and returns how many
    /// draw from the account now, itself included.
    pub async fn beat(
        &self,
        drawer: &NewDrawer<'_>,
        drawn: u64,
        stale_before: i64,
    ) -> Result<u64, StoreError> {
        let mut tx = self.store.pool().begin().await?;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO rate_drawers (holder, account, run_id, host, pid, started_at, last_seen, drawn)
             VALUES ($1, $2, $3, $4, $5, $6, $6, $7)
             ON CONFLICT (holder) DO UPDATE SET last_seen = $6, drawn = $7",
        )
        .bind(drawer.holder)
        .bind(drawer.account)
        .bind(drawer.run_id)
        .bind(drawer.host)
        .bind(i64::from(drawer.pid))
        .bind(now)
        .bind(to_i64(drawn))
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM rate_drawers WHERE account = $1 AND last_seen < $2")
            .bind(drawer.account)
            .bind(stale_before)
            .execute(&mut *tx)
            .await?;
        let (live,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM rate_drawers WHERE account = $1")
                .bind(drawer.account)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(to_u64(live))
    }

    /// The drawer stopped drawing (its run ended).
    pub async fn leave(&self, holder: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM rate_drawers WHERE holder = $1")
            .bind(holder)
            .execute(self.store.pool())
            .await?;
        Ok(())
    }

    /// The processes seen drawing since `seen_since` (unix ms), by account then start.
    pub async fn drawers(&self, seen_since: i64) -> Result<Vec<Drawer>, StoreError> {
        let rows = sqlx::query(
            "SELECT d.account, d.run_id, d.host, d.pid, d.started_at, d.last_seen, d.drawn,
                    a.interval_us
             FROM rate_drawers d JOIN rate_accounts a ON a.account = d.account
             WHERE d.last_seen >= $1
             ORDER BY d.account, d.started_at, d.holder",
        )
        .bind(seen_since)
        .fetch_all(self.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let account: String = r.try_get("account")?;
                let interval: i64 = r.try_get("interval_us")?;
                Ok(Drawer {
                    account: account.chars().take(12).collect(),
                    run_id: r.try_get("run_id")?,
                    host: r.try_get("host")?,
                    pid: to_u64(r.try_get("pid")?),
                    per_second: 1e6 / interval.max(1) as f64,
                    started_at: r.try_get("started_at")?,
                    last_seen: r.try_get("last_seen")?,
                    drawn: to_u64(r.try_get("drawn")?),
                })
            })
            .collect()
    }
}

/// Unix microseconds on this process's clock (SQLite's draws: one machine).
fn now_us() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}
