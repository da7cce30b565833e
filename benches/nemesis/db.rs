//! The state database read whole after a trial, through one read-only connection.

use sqlx::{Connection, Row};

#[derive(Clone, Debug)]
pub struct Run {
    pub id: String,
    pub credits_planned: u64,
    pub output_dir: String,
}

#[derive(Clone, Debug)]
pub struct Task {
    pub id: i64,
    pub run_id: String,
    pub name: String,
    pub operation: String,
    pub status: String,
    pub planned: u64,
    pub removed: bool,
}

#[derive(Clone, Debug)]
pub struct Attempt {
    pub id: i64,
    pub task_id: i64,
    pub run_id: String,
    pub outcome: Option<String>,
    pub billed: u64,
    pub job_id: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Output {
    pub task_id: i64,
    pub k: i64,
    pub job_id: String,
    pub url: String,
    pub path: Option<String>,
    pub sha256: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Superseded {
    pub task_id: i64,
    pub path: Option<String>,
    pub sha256: Option<String>,
}

/// A row of `check_rerolls`: a task paid for again because a check failed its outputs.
#[derive(Clone, Debug)]
pub struct CheckReroll {
    pub task_id: i64,
    pub job_id: String,
    pub credits: u64,
}

/// A row of `check_verdicts`.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub task_id: i64,
    pub job_id: String,
    pub verdict: String,
    pub acted: Option<String>,
}

#[derive(Debug, Default)]
pub struct Db {
    pub runs: Vec<Run>,
    pub tasks: Vec<Task>,
    pub attempts: Vec<Attempt>,
    pub outputs: Vec<Output>,
    pub superseded: Vec<Superseded>,
    /// Task ids each reroll named (one entry per reroll row).
    pub rerolls: Vec<Vec<i64>>,
    pub check_rerolls: Vec<CheckReroll>,
    pub verdicts: Vec<Verdict>,
}

fn unsigned(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A read-only connection to `state` (a SQLite file or a PostgreSQL URL).
pub async fn connect(state: &str) -> Result<sqlx::AnyConnection, String> {
    sqlx::any::install_default_drivers();
    let url = if state.starts_with("postgres") {
        state.to_owned()
    } else {
        if !std::path::Path::new(state).exists() {
            return Err(format!("no state database at {state}"));
        }
        let file = url::Url::from_file_path(state).map_err(|()| state.to_owned())?;
        format!("sqlite://{}?mode=ro", file.path())
    };
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        sqlx::AnyConnection::connect(&url),
    )
    .await
    .map_err(|_| format!("{state}: no answer in 30 s"))?
    .map_err(|e| format!("{state}: {e}"))
}

/// The status of run `run`, when it exists.
pub async fn run_status(state: &str, run: &str) -> Option<String> {
    let mut conn = connect(state).await.ok()?;
    let status = sqlx::query("SELECT status FROM runs WHERE id = $1")
        .bind(run)
        .fetch_optional(&mut conn)
        .await
        .ok()
        .flatten()
        .map(|r| r.get::<String, _>("status"));
    let _ = conn.close().await;
    status
}

pub async fn read(state: &str) -> Result<Db, String> {
    let mut conn = connect(state).await?;
    macro_rules! rows {
        ($sql:expr, |$r:ident| $make:expr) => {
            sqlx::query($sql)
                .fetch_all(&mut conn)
                .await
                .map_err(|e| format!("{}: {e}", $sql))?
                .iter()
                .map(|$r| $make)
                .collect()
        };
    }
    let runs = rows!(
        "SELECT id, credits_planned, output_dir FROM runs ORDER BY id",
        |r| Run {
            id: r.get("id"),
            credits_planned: unsigned(r.get("credits_planned")),
            output_dir: r.get("output_dir"),
        }
    );
    let tasks = rows!(
        "SELECT id, run_id, item, step, idx, operation, status, planned_credits, removed_at
         FROM tasks ORDER BY id",
        |r| Task {
            id: r.get("id"),
            run_id: r.get("run_id"),
            name: format!(
                "{}/{}[{}]",
                r.get::<String, _>("item"),
                r.get::<String, _>("step"),
                r.get::<i64, _>("idx")
            ),
            operation: r.get("operation"),
            status: r.get("status"),
            planned: unsigned(r.get("planned_credits")),
            removed: r.get::<Option<i64>, _>("removed_at").is_some(),
        }
    );
    let attempts = rows!(
        "SELECT id, task_id, run_id, outcome, credits_billed, job_id FROM attempts ORDER BY id",
        |r| Attempt {
            id: r.get("id"),
            task_id: r.get("task_id"),
            run_id: r.get("run_id"),
            outcome: r.get("outcome"),
            billed: unsigned(r.get("credits_billed")),
            job_id: r.get("job_id"),
        }
    );
    let outputs = rows!(
        "SELECT task_id, k, job_id, url, path, sha256 FROM outputs ORDER BY task_id, k",
        |r| Output {
            task_id: r.get("task_id"),
            k: r.get("k"),
            job_id: r.get("job_id"),
            url: r.get("url"),
            path: r.get("path"),
            sha256: r.get("sha256"),
        }
    );
    let superseded = rows!(
        "SELECT task_id, path, sha256 FROM superseded_outputs ORDER BY id",
        |r| Superseded {
            task_id: r.get("task_id"),
            path: r.get("path"),
            sha256: r.get("sha256"),
        }
    );
    let rerolls = rows!("SELECT task_ids FROM rerolls ORDER BY id", |r| {
        serde_json::from_str::<Vec<i64>>(&r.get::<String, _>("task_ids")).unwrap_or_default()
    });
    let check_rerolls = rows!(
        "SELECT task_id, job_id, credits FROM check_rerolls ORDER BY rerolled_at, task_id",
        |r| CheckReroll {
            task_id: r.get("task_id"),
            job_id: r.get("job_id"),
            credits: unsigned(r.get("credits")),
        }
    );
    let verdicts = rows!(
        "SELECT task_id, job_id, verdict, acted FROM check_verdicts ORDER BY checked_at, output_id",
        |r| Verdict {
            task_id: r.get("task_id"),
            job_id: r.get("job_id"),
            verdict: r.get("verdict"),
            acted: r.get("acted"),
        }
    );
    let _ = conn.close().await;
    Ok(Db {
        runs,
        tasks,
        attempts,
        outputs,
        superseded,
        rerolls,
        check_rerolls,
        verdicts,
    })
}
