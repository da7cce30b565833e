//! Group commit: the writes of the hot path (a call's intent, its result, a download's
//! record) go to one writer, which runs every write waiting at that instant in one
//! transaction and answers each only once the transaction is committed. Concurrent calls then
//! share one fsync instead of paying one each, and a write still returns only when it is on
//! disk: a paid call is sent only after its intent is durable, and a task counts as done only
//! once its result is.
//!
//! Every statement is a round trip to SQLite's worker thread, so a group spends none on
//! isolating its writes from each other: a write that fails rolls the whole group back, and
//! the group is then written again one write per transaction, so that only the failing write
//! fails. That is why a write may run more than once and is `Fn`, not `FnOnce`.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use sqlx::{Acquire, AnyConnection, AnyPool};
use tokio::sync::{mpsc, oneshot};

use crate::store::{AttemptId, OutputId, StoreError};

/// The most writes one transaction carries: a bound on the time the first one waits.
const MOST_PER_COMMIT: usize = 256;

/// What a write gives back.
pub(crate) enum Written {
    Done,
    /// An attempt recorded.
    Attempt(AttemptId),
    /// A call's outputs recorded, in output order.
    Outputs(Vec<OutputId>),
}

/// One write: its statements, run inside the group's transaction. It may be run again (see
/// the module's comment), so it clones what it moves into its future.
pub(crate) type Write = Box<
    dyn for<'c> Fn(&'c mut AnyConnection) -> BoxFuture<'c, Result<Written, sqlx::Error>>
        + Send
        + Sync,
>;

struct Job {
    write: Write,
    reply: oneshot::Sender<Result<Written, StoreError>>,
}

/// The holder of a run's lock, as `run_locks` names it on PostgreSQL: who may write a run's
/// records. A host whose lock session is lost (a network cut, a server restart) may be told so
/// only seconds after the server let another host take the lock; meanwhile its calls still
/// answer. So every group first reads its holder's row `FOR SHARE`: a host taking the lock
/// rewrites that row before it reads the state, so it waits for a group under way to commit,
/// and every later group of the old holder finds the row changed and records nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    pub lock_key: i64,
    pub pid: i64,
    pub host: String,
    pub since: String,
}

/// What a fenced writer answers: the run is another host's now.
pub(crate) const FENCED: &str = "this host no longer holds the run's lock (another host took it over): it records nothing more; the calls it sent are on record, and a resume reads their answers back";

/// The handle the store's clones share; the writer ends when the last one is dropped.
#[derive(Clone, Debug)]
pub(crate) struct Writer {
    jobs: mpsc::UnboundedSender<Job>,
    fence: Arc<Mutex<Option<Fence>>>,
}

impl Writer {
    pub(crate) fn start(pool: AnyPool) -> Writer {
        let (jobs, rx) = mpsc::unbounded_channel();
        let fence = Arc::new(Mutex::new(None));
        tokio::spawn(run(pool, rx, Arc::clone(&fence)));
        Writer { jobs, fence }
    }

    /// From now on every group checks that `fence` still holds the run's lock.
    pub(crate) fn fence(&self, fence: Fence) {
        *self.fence.lock().unwrap_or_else(|e| e.into_inner()) = Some(fence);
    }

    /// The fence every write of this store checks, if a lock set one.
    pub(crate) fn fenced_by(&self) -> Option<Fence> {
        self.fence.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs `write` in the next group and waits until it is committed.
    pub(crate) async fn write(&self, write: Write) -> Result<Written, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job { write, reply })
            .map_err(|_| StoreError::Write("its writer has stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Write("its writer stopped before answering".into()))?
    }
}

async fn run(
    pool: AnyPool,
    mut rx: mpsc::UnboundedReceiver<Job>,
    fence: Arc<Mutex<Option<Fence>>>,
) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        while jobs.len() < MOST_PER_COMMIT {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(e) => {
                fail_all(jobs, &e.to_string());
                continue;
            }
        };
        let fence = fence.lock().unwrap_or_else(|e| e.into_inner()).clone();
        commit_group(&mut conn, jobs, fence.as_ref()).await;
    }
}

/// One transaction for `jobs`; when one of them fails, one transaction for each.
async fn commit_group(conn: &mut AnyConnection, mut jobs: Vec<Job>, fence: Option<&Fence>) {
    if jobs.len() == 1 {
        let job = jobs.remove(0);
        return commit_alone(conn, job, fence).await;
    }
    match transaction(conn, &jobs, fence).await {
        Ok(answers) => {
            for (job, written) in jobs.into_iter().zip(answers) {
                let _ = job.reply.send(Ok(written));
            }
        }
        // Which write failed, and whether the others are sound, is found by writing each alone.
        Err(Failed::Write(_)) => {
            for job in jobs {
                commit_alone(conn, job, fence).await;
            }
        }
        Err(Failed::Transaction(message)) => fail_all(jobs, &message),
    }
}

/// `job` in a transaction of its own, answered with its own result.
async fn commit_alone(conn: &mut AnyConnection, job: Job, fence: Option<&Fence>) {
    let answer = match transaction(conn, std::slice::from_ref(&job), fence).await {
        Ok(mut answers) => Ok(answers.remove(0)),
        Err(Failed::Write(e)) => Err(StoreError::from(e)),
        Err(Failed::Transaction(message)) => Err(StoreError::Write(message)),
    };
    let _ = job.reply.send(answer);
}

enum Failed {
    /// A write's own statement failed; the transaction was rolled back.
    Write(sqlx::Error),
    /// The transaction could not begin or commit.
    Transaction(String),
}

/// Runs every job's write in one transaction: all committed, or none.
async fn transaction(
    conn: &mut AnyConnection,
    jobs: &[Job],
    fence: Option<&Fence>,
) -> Result<Vec<Written>, Failed> {
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Failed::Transaction(e.to_string()))?;
    if let Some(fence) = fence
        && let Err(e) = check(&mut tx, fence).await
    {
        let _ = tx.rollback().await;
        return Err(Failed::Transaction(e.to_string()));
    }
    let mut answers = Vec::with_capacity(jobs.len());
    for job in jobs {
        match (job.write)(&mut tx).await {
            Ok(written) => answers.push(written),
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(Failed::Write(e));
            }
        }
    }
    tx.commit()
        .await
        .map_err(|e| Failed::Transaction(format!("the transaction was not committed: {e}")))?;
    Ok(answers)
}

/// Whether `fence` still holds the run's lock, its row kept `FOR SHARE` until the
/// transaction ends (see [`Fence`]).
pub(crate) async fn check(conn: &mut AnyConnection, fence: &Fence) -> Result<(), StoreError> {
    let held: Option<(i64,)> = sqlx::query_as(
        "SELECT pid FROM run_locks
         WHERE lock_key = $1 AND pid = $2 AND host = $3 AND since = $4 FOR SHARE",
    )
    .bind(fence.lock_key)
    .bind(fence.pid)
    .bind(&fence.host)
    .bind(&fence.since)
    .fetch_optional(&mut *conn)
    .await?;
    held.map(|_| ())
        .ok_or_else(|| StoreError::Write(FENCED.into()))
}

fn fail_all(jobs: Vec<Job>, message: &str) {
    for job in jobs {
        let _ = job.reply.send(Err(StoreError::Write(message.to_owned())));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use sqlx::any::AnyPoolOptions;

    fn insert(x: i64) -> Write {
        Box::new(move |conn| {
            Box::pin(async move {
                sqlx::query("INSERT INTO t (x) VALUES ($1)")
                    .bind(x)
                    .execute(&mut *conn)
                    .await?;
                Ok(Written::Done)
            })
        })
    }

    #[tokio::test]
    async fn a_failing_write_fails_alone_and_the_rest_of_its_group_is_committed() {
        crate::store::install_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER UNIQUE)")
            .execute(&pool)
            .await
            .unwrap();
        let writer = Writer::start(pool.clone());
        // Sent before the writer runs (one thread), so the three make one group; the second
        // breaks the table's rule once the first is in.
        let (a, b, c) = tokio::join!(
            writer.write(insert(1)),
            writer.write(insert(1)),
            writer.write(insert(3))
        );
        assert!(a.is_ok());
        assert!(b.is_err(), "the duplicate fails");
        assert!(c.is_ok());
        let rows: Vec<i64> = sqlx::query_scalar("SELECT x FROM t ORDER BY x")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(rows, [1, 3]);
    }

    /// A write that inserts `x`, first noting how many rows `observer` (another connection)
    /// sees committed: writes sharing a transaction see none of each other's rows.
    fn insert_seeing(x: i64, observer: AnyPool, seen: Arc<Mutex<Vec<i64>>>) -> Write {
        Box::new(move |conn| {
            let (observer, seen) = (observer.clone(), Arc::clone(&seen));
            Box::pin(async move {
                let committed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM t")
                    .fetch_one(&observer)
                    .await?;
                seen.lock().unwrap().push(committed);
                sqlx::query("INSERT INTO t (x) VALUES ($1)")
                    .bind(x)
                    .execute(&mut *conn)
                    .await?;
                Ok(Written::Done)
            })
        })
    }

    #[tokio::test]
    async fn writes_waiting_at_the_same_instant_share_one_commit() {
        crate::store::install_drivers();
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("db").display());
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        sqlx::query("PRAGMA journal_mode = WAL")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&pool)
            .await
            .unwrap();
        let observer = AnyPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        let writer = Writer::start(pool.clone());
        // The writer's only connection is taken: the writes queue behind it until it is free.
        let busy = pool.acquire().await.unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let writes =
            (0..5).map(|x| writer.write(insert_seeing(x, observer.clone(), Arc::clone(&seen))));
        // `join` polls the writes first: each is sent to the writer before the connection
        // is given back.
        let (written, ()) = futures::future::join(futures::future::join_all(writes), async {
            drop(busy);
        })
        .await;
        assert!(written.iter().all(Result::is_ok));
        let seen = seen.lock().unwrap().clone();
        // The writer may take the first write alone before it waits for the connection; the
        // others waited together and form one transaction: each saw at most that one row.
        assert!(
            seen.iter().all(|committed| *committed <= 1),
            "the writes were committed one by one: each saw {seen:?} rows committed before it"
        );
    }
}
