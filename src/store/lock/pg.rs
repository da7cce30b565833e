//! The run lock of state kept in PostgreSQL: `pg_try_advisory_lock` on a connection the lock
//! owns. Every host that names the same database contends for the same key, and the server
//! lets go of it when the holding session ends: a process killed, a pod evicted, a host lost
//! (once the server notices the connection is gone).

use crate::run_id::RunId;
use sqlx::{Connection, PgConnection};

use crate::store::lock::{Holder, LockError, Probe, RunLock, describe};
use crate::store::{PgUrl, Store, StoreError};

/// How often a waiting run asks again. The server does not queue `try` callers, so a waiter
/// polls; it is cancelled by dropping it (its connection goes with it).
const POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// How long a refused host waits for the holder to write who it is, so that the refusal names
/// it: the lock is taken first and its holder's details written right after, and a host
/// started at the same instant would otherwise say only that the lock says nothing more yet.
const NAMED_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// How often the refused host looks again meanwhile.
const NAMED_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// The advisory lock key of `pipeline`: 64 bits of a hash of its name, so any name is a key
/// and another application's keys are unlikely to meet imgpipe's.
pub fn key(pipeline: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("imgpipe run lock\0{pipeline}").as_bytes());
    i64::from_be_bytes(digest[..8].try_into().unwrap_or_default())
}

/// How often a held lock's session is asked whether it is still there.
const WATCH: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the session has to answer: a server that does not answer at all (a network that
/// drops every packet, a host frozen) is as lost as one that closed the connection, and
/// without a bound the run would wait on it for ever.
pub const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Takes the lock of `pipeline` in the database at `url`, or fails at once naming its holder;
/// with `wait`, asks again until the holder is done.
///
/// The lock lives as long as its session. Should the session be lost while the run goes on (the
/// server restarted, the network cut), another host could take the lock and pay for the same
/// tasks, so the session is watched and `lost` is cancelled as soon as it fails: the run then
/// stops as if interrupted.
pub async fn acquire(
    url: &PgUrl,
    pipeline: &str,
    run_id: &RunId,
    wait: bool,
    lost: tokio_util::sync::CancellationToken,
) -> Result<RunLock, LockError> {
    let failed = |e: sqlx::Error| LockError::Database {
        location: url.to_string(),
        reason: crate::store::postgres::describe(&e),
    };
    let connecting = PgConnection::connect(url.secret());
    let mut conn = tokio::time::timeout(crate::store::postgres::CONNECT_WITHIN, connecting)
        .await
        .map_err(|_| LockError::Database {
            location: url.to_string(),
            reason: crate::store::postgres::silent(),
        })?
        .map_err(failed)?;
    let key = key(pipeline);
    let mut told = false;
    let refused_at = std::time::Instant::now();
    loop {
        let (taken,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut conn)
            .await
            .map_err(failed)?;
        if taken {
            break;
        }
        let holder = holder(&mut conn, key).await.map_err(failed)?;
        if !wait && holder.is_none() && refused_at.elapsed() < NAMED_WITHIN {
            // Taken an instant ago: its holder writes who it is right after taking it.
            tokio::time::sleep(NAMED_POLL).await;
            continue;
        }
        if !wait {
            let _ = conn.close().await;
            return Err(LockError::Held {
                pipeline: pipeline.to_owned(),
                holder: holder.map(Box::new),
                path: url.to_string().into(),
            });
        }
        if !told {
            tracing::info!("waiting for {}", describe(holder.as_ref()));
            told = true;
        }
        tokio::time::sleep(POLL).await;
    }
    let me = Holder {
        pid: std::process::id(),
        host: super::hostname(),
        since: crate::time::rfc3339(std::time::SystemTime::now()),
        run_id: run_id.to_owned(),
    };
    sqlx::query(
        "INSERT INTO run_locks (lock_key, pipeline, run_id, host, pid, since)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (lock_key) DO UPDATE SET pipeline = excluded.pipeline,
             run_id = excluded.run_id, host = excluded.host, pid = excluded.pid,
             since = excluded.since",
    )
    .bind(key)
    .bind(pipeline)
    .bind(me.run_id.as_str())
    .bind(&me.host)
    .bind(i64::from(me.pid))
    .bind(&me.since)
    .execute(&mut conn)
    .await
    .map_err(failed)?;
    let fence = crate::store::group::Fence {
        lock_key: key,
        pid: i64::from(me.pid),
        host: me.host,
        since: me.since,
    };
    let watch = tokio::spawn(async move {
        loop {
            tokio::time::sleep(WATCH).await;
            let why = match tokio::time::timeout(ANSWER_WITHIN, conn.ping()).await {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => crate::store::postgres::describe(&e),
                Err(_) => format!("no answer within {}s", ANSWER_WITHIN.as_secs()),
            };
            tracing::error!(
                "lost the run lock's session with PostgreSQL ({why}): stopping, so that no other host pays for the same tasks; resume the run once the database is back"
            );
            lost.cancel();
            return;
        }
    });
    Ok(RunLock::postgres(watch, fence))
}

/// Whether a live session holds the lock of `pipeline`, read from the server's lock table
/// without taking anything.
pub async fn probe(store: &Store, pipeline: &str) -> Result<Probe, StoreError> {
    let key = key(pipeline);
    let bits = key.cast_unsigned();
    // An advisory lock on one bigint shows as classid = its high half, objid = its low half.
    let (held,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 1
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND classid::bigint = $1 AND objid::bigint = $2",
    )
    .bind(i64::from((bits >> 32) as u32))
    .bind(i64::from(bits as u32))
    .fetch_one(store.pool())
    .await?;
    if held == 0 {
        return Ok(Probe::Free);
    }
    let row = sqlx::query_as(HOLDER)
        .bind(key)
        .fetch_optional(store.pool())
        .await?;
    Ok(Probe::Held(row.map(to_holder)))
}

const HOLDER: &str = "SELECT run_id, host, pid, since FROM run_locks WHERE lock_key = $1";

fn to_holder((run_id, host, pid, since): (String, String, i64, String)) -> Holder {
    Holder {
        pid: u32::try_from(pid).unwrap_or_default(),
        host,
        since,
        run_id: RunId::from(run_id),
    }
}

async fn holder(conn: &mut PgConnection, key: i64) -> Result<Option<Holder>, sqlx::Error> {
    let row = sqlx::query_as(HOLDER)
        .bind(key)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(to_holder))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::store::Location;
    use crate::store::test_postgres::{TestDatabase, connect, database};

    /// A ceiling for what the server does at once (a session ended, a lock let go, a session
    /// found gone by the watch); waits stop as soon as it happens.
    const CEILING: Duration = Duration::from_secs(30);

    /// A database with imgpipe's tables, and the store opened on it.
    async fn state(tag: &str) -> Option<(TestDatabase, Store)> {
        let url = database(tag).await?;
        let store = Store::open_at(&Location::Postgres(PgUrl::clone(&url)))
            .await
            .unwrap();
        Some((url, store))
    }

    async fn take(url: &PgUrl, run: RunId, wait: bool) -> Result<RunLock, LockError> {
        acquire(url, "nightly", &run, wait, CancellationToken::new()).await
    }

    /// Waits until the lock is free, as the server lets go of it once its session ends.
    async fn until_free(store: &Store) {
        tokio::time::timeout(CEILING, async {
            while !matches!(probe(store, "nightly").await.unwrap(), Probe::Free) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the server let go of the lock");
    }

    /// The key is the contract between hosts (and versions of imgpipe) sharing a database:
    /// it must not change, and pipelines must not share one.
    #[test]
    fn each_pipeline_has_its_own_key_and_the_keys_never_change() {
        assert_eq!(key("nightly"), key("nightly"));
        assert_ne!(key("nightly"), key("nightly2"));
        assert_ne!(key(""), key("\0"));
        assert_eq!(key("nightly"), PINNED_NIGHTLY);
    }

    /// `key("nightly")` as imgpipe has computed it since its state could be in PostgreSQL.
    const PINNED_NIGHTLY: i64 = 913_671_170_784_111_978;

    #[tokio::test]
    async fn a_second_host_is_refused_naming_the_holder_then_takes_it_once_let_go() {
        let Some((url, store)) = state("lock").await else {
            return;
        };
        assert!(matches!(
            probe(&store, "nightly").await.unwrap(),
            Probe::Free
        ));
        let held = take(&url, RunId::from("first"), false).await.unwrap();
        let Probe::Held(Some(holder)) = probe(&store, "nightly").await.unwrap() else {
            panic!("the lock is not seen held");
        };
        assert_eq!(
            (holder.run_id.as_str(), holder.pid),
            ("first", std::process::id())
        );
        let refused = take(&url, RunId::from("second"), false).await.unwrap_err();
        let LockError::Held {
            pipeline,
            holder: Some(holder),
            ..
        } = &refused
        else {
            panic!("{refused}");
        };
        assert_eq!(
            (pipeline.as_str(), holder.run_id.as_str()),
            ("nightly", "first")
        );
        assert!(
            refused.to_string().contains("run first by pid"),
            "{refused}"
        );
        // Another pipeline's lock is another key.
        drop(
            acquire(
                &url,
                "weekly",
                &RunId::from("w"),
                false,
                CancellationToken::new(),
            )
            .await
            .unwrap(),
        );

        drop(held);
        until_free(&store).await;
        let second = take(&url, RunId::from("second"), false).await.unwrap();
        let Probe::Held(Some(holder)) = probe(&store, "nightly").await.unwrap() else {
            panic!("the lock is not seen held");
        };
        assert_eq!(holder.run_id, "second", "run_locks names the new holder");
        drop(second);
        store.pool().close().await;
    }

    /// A host whose lock passed to another (its session cut, the server letting go before the
    /// host could tell) records nothing more: the run's records (the group writer) and the
    /// run's end (`Runs::set_status`) both check that `run_locks` still names this holder,
    /// which a host taking the lock rewrites first.
    #[tokio::test]
    async fn a_host_whose_lock_passed_to_another_records_nothing_more() {
        use crate::store::{RunStatus, TaskStatus};
        let Some((url, store)) = state("fence").await else {
            return;
        };
        let held = take(&url, RunId::from("first"), false).await.unwrap();
        store.fence(held.fence().expect("a fence on PostgreSQL").clone());
        let (run, status) = (RunId::from("first"), RunStatus::Interrupted);
        store
            .runs()
            .set_status(&run, status, None, None)
            .await
            .unwrap();
        let tasks = store.tasks();
        tasks
            .set_status(&[], TaskStatus::Pending, None)
            .await
            .unwrap();

        // What a host taking the lock does to the row as it takes it.
        sqlx::query("UPDATE run_locks SET pid = pid + 1, since = 'later'")
            .execute(store.pool())
            .await
            .unwrap();
        let ended = store.runs().set_status(&run, status, None, None).await;
        let recorded = tasks.set_status(&[], TaskStatus::Pending, None).await;
        for refused in [ended, recorded] {
            let e = refused.expect_err("a write of a host without the lock");
            assert!(
                e.to_string().contains("no longer holds the run's lock"),
                "{e}"
            );
        }
        drop(held);
        store.pool().close().await;
    }

    /// A host refused in the instant between the holder taking the lock and writing who it is
    /// waits for that line, so its refusal names the holder (two CronJobs started together).
    #[tokio::test]
    async fn a_host_refused_as_the_lock_is_being_taken_still_names_its_holder() {
        let Some((url, store)) = state("named").await else {
            return;
        };
        // The holder's first half: the lock taken, its details not written yet.
        let mut holder = connect(&url).await;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(key("nightly"))
            .execute(&mut holder)
            .await
            .unwrap();
        let refused = tokio::spawn({
            let url = PgUrl::clone(&url);
            async move { take(&url, RunId::from("second"), false).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        sqlx::query(
            "INSERT INTO run_locks (lock_key, pipeline, run_id, host, pid, since)
             VALUES ($1, 'nightly', 'first', 'elsewhere', 4242, '2026-11-27T15:00:00Z')",
        )
        .bind(key("nightly"))
        .execute(&mut holder)
        .await
        .unwrap();
        let refused = tokio::time::timeout(CEILING, refused)
            .await
            .expect("the refused host answers within the ceiling")
            .unwrap()
            .unwrap_err();
        assert!(
            refused.to_string().contains("run first by pid 4242"),
            "{refused}"
        );
        drop(holder);
        store.pool().close().await;
    }

    /// With `wait`, a host asks again until the holder lets go, and only then holds it.
    #[tokio::test]
    async fn a_waiting_host_takes_the_lock_only_after_the_holder_lets_go() {
        let Some((url, store)) = state("wait").await else {
            return;
        };
        let held = take(&url, RunId::from("first"), false).await.unwrap();
        let waiting = take(&url, RunId::from("second"), true);
        tokio::pin!(waiting);
        // Several of its polls while the lock is held: none may take it.
        let polls = POLL * 4;
        if let Ok(taken) = tokio::time::timeout(polls, &mut waiting).await {
            panic!("took a held lock: {taken:?}");
        }
        drop(held);
        let second = tokio::time::timeout(CEILING, waiting)
            .await
            .expect("the waiter takes the lock once it is let go")
            .unwrap();
        let Probe::Held(Some(holder)) = probe(&store, "nightly").await.unwrap() else {
            panic!("the lock is not seen held");
        };
        assert_eq!(holder.run_id, "second");
        drop(second);
        store.pool().close().await;
    }

    /// The server ends the session that holds the lock (a restart would): the run is told at
    /// once, so it stops before another host can take the lock and pay for the same tasks.
    #[tokio::test]
    async fn a_lost_session_cancels_the_run() {
        let Some((url, store)) = state("lost").await else {
            return;
        };
        let lost = CancellationToken::new();
        let held = acquire(&url, "nightly", &RunId::from("r"), false, lost.clone())
            .await
            .unwrap();
        assert!(!lost.is_cancelled());
        let mut admin = connect(&url).await;
        let (ended,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_locks
             WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
             AS ended",
        )
        .fetch_one(&mut admin)
        .await
        .unwrap();
        assert_eq!(ended, 1, "one session held the lock");
        tokio::time::timeout(CEILING, lost.cancelled())
            .await
            .expect("the run is told its lock's session is gone");
        drop(held);
        admin.close().await.unwrap();
        store.pool().close().await;
    }
}
