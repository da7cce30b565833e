//! Group commit: the writes of the hot path (a call's intent, its result, a download's
//! record) go to one writer, which runs every write waiting at that instant in one
//! transaction, each in a savepoint of its own, and answers each only once the transaction
//! is committed. Concurrent calls then share one fsync instead of paying one each, and a
//! write still returns only when it is on disk: a paid call is sent only after its intent is
//! durable, and a task counts as done only once its result is.

use futures::future::BoxFuture;
use sqlx::{Acquire, SqliteConnection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use crate::store::StoreError;

/// The most writes one transaction carries: a bound on the time the first one waits.
const MOST_PER_COMMIT: usize = 256;

/// What a write gives back.
pub(crate) enum Written {
    Done,
    Id(i64),
    Ids(Vec<i64>),
}

type Write = Box<
    dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<Written, sqlx::Error>>
        + Send,
>;

struct Job {
    write: Write,
    reply: oneshot::Sender<Result<Written, StoreError>>,
}

/// The handle the store's clones share; the writer ends when the last one is dropped.
#[derive(Clone, Debug)]
pub(crate) struct Writer {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Writer {
    pub(crate) fn start(pool: SqlitePool) -> Writer {
        let (jobs, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(pool, rx));
        Writer { jobs }
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

async fn run(pool: SqlitePool, mut rx: mpsc::UnboundedReceiver<Job>) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        while jobs.len() < MOST_PER_COMMIT {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        commit_group(&pool, jobs).await;
    }
}

/// One transaction for `jobs`; each job's own failure rolls back only its savepoint.
async fn commit_group(pool: &SqlitePool, jobs: Vec<Job>) {
    let mut conn = match pool.acquire().await {
        Ok(conn) => conn,
        Err(e) => return fail_all(jobs, &e),
    };
    let mut tx = match conn.begin().await {
        Ok(tx) => tx,
        Err(e) => return fail_all(jobs, &e),
    };
    let mut answers = Vec::with_capacity(jobs.len());
    for job in jobs {
        let result = match tx.begin().await {
            Ok(mut savepoint) => match (job.write)(&mut savepoint).await {
                Ok(written) => savepoint.commit().await.map(|()| written),
                Err(e) => {
                    let _ = savepoint.rollback().await;
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        answers.push((job.reply, result.map_err(StoreError::from)));
    }
    match tx.commit().await {
        Ok(()) => {
            for (reply, result) in answers {
                let _ = reply.send(result);
            }
        }
        Err(e) => {
            let message = e.to_string();
            for (reply, _) in answers {
                let _ = reply.send(Err(StoreError::Write(format!(
                    "the transaction was not committed: {message}"
                ))));
            }
        }
    }
}

fn fail_all(jobs: Vec<Job>, e: &sqlx::Error) {
    let message = e.to_string();
    for job in jobs {
        let _ = job.reply.send(Err(StoreError::Write(message.clone())));
    }
}
