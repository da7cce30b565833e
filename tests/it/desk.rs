//! A reroll that could not be done changes nothing the person had (issue 36): the calls it
//! sent refused before billing (an injected 400, a drained balance), it is undone: the run's
//! status, its tasks' and outputs' rows and its files are as they were, and the exit code and
//! message say why. A reroll that pays still sets the old files aside.

use std::path::PathBuf;
use std::process::Stdio;

use crate::binary::{Imgpipe, Ran};
use crate::common::*;

const PIPELINE: &str = include_str!("../../pipelines/product-shots.yaml");
/// What an item's chain costs (see `review_loop.rs`).
const ITEM: u64 = 8 + 2 * (2 + 5 + 4 + 5);
/// `mug/clean[0]` and what is downstream of it: erase, expand, upscale, cut-out.
const CLEAN0: u64 = 2 + 5 + 4 + 5;

/// The sample pipeline in `env`'s directory, and the state it uses (SQLite there, or `pg`).
struct Catalogue<'e> {
    env: &'e Env,
    dir: PathBuf,
    state: String,
}

impl<'e> Catalogue<'e> {
    fn new(env: &'e Env, pg: Option<String>) -> Catalogue<'e> {
        let dir = env.dir.path().join("work");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("shots.yaml"), PIPELINE).unwrap();
        let state = pg.unwrap_or_else(|| dir.join("state.db").to_string_lossy().into_owned());
        Catalogue { env, dir, state }
    }

    fn imgpipe(&self, args: &[&str]) -> Imgpipe<'e> {
        Imgpipe::on(self.env, args)
            .cwd(&self.dir)
            .state(&self.state)
            .args(&["--retry-base-ms", "1"])
    }

    /// The whole catalogue, run to its end as run `r`.
    async fn done(&self) {
        let ran = self
            .imgpipe(&["run", "shots.yaml", "--run-id", "r"])
            .run()
            .await;
        assert_exit(&ran, 0);
        assert_eq!(billed(self.env), 3 * ITEM);
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("out/r")
    }

    /// What the person has: the run's files, and its record (status, tasks, outputs, outputs
    /// set aside), as text to compare whole.
    async fn had(&self) -> (std::collections::BTreeMap<String, String>, String) {
        let db = Db::read(&self.state).await;
        let runs: Vec<String> = db
            .runs
            .iter()
            .map(|r| format!("{} {}", r.id, r.status))
            .collect();
        let tasks: Vec<String> = db
            .tasks
            .iter()
            .map(|t| format!("{} {} {:?} {:?}", t.name(), t.status, t.job_id, t.error))
            .collect();
        let outputs: Vec<String> = db
            .outputs
            .iter()
            .map(|o| {
                format!(
                    "{} {} {} {:?} {:?}",
                    o.id, o.task_id, o.job_id, o.path, o.sha256
                )
            })
            .collect();
        let record = format!(
            "runs {runs:#?}\ntasks {tasks:#?}\noutputs {outputs:#?}\nset aside {}",
            db.superseded.len()
        );
        (file_digests(&self.run_dir()), record)
    }
}

fn billed(env: &Env) -> u64 {
    env.sandbox.ledger().iter().map(|e| e.credits).sum()
}

/// The reroll refused said why, and that nothing changed.
fn says_nothing_changed(ran: &Ran, why: &str) {
    let err = ran.stderr();
    assert!(
        has_phrase(&err, "the reroll of mug/clean[0] could not be done"),
        "{err}"
    );
    assert!(
        err.contains(why),
        "the refusal's cause `{why}` is said: {err}"
    );
    assert!(
        has_phrase(
            &err,
            "nothing was billed and nothing changed: run r is succeeded as before"
        ),
        "{err}"
    );
}

/// The paid reroll after a refused one: it bills its chain once and sets the old files aside.
async fn reroll_pays_and_sets_aside(c: &Catalogue<'_>) {
    let (files, _) = c.had().await;
    let ran = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).run().await;
    assert_exit(&ran, 0);
    assert_eq!(billed(c.env), 3 * ITEM + CLEAN0, "the chain billed once");
    let after = file_digests(&c.run_dir());
    let old = files
        .iter()
        .find(|(p, _)| p.starts_with("mug/") && p.contains("clean") && p.contains('0'))
        .map(|(_, sha)| sha.clone())
        .expect("mug/clean[0] had a file");
    assert!(
        after
            .iter()
            .any(|(p, s)| p.starts_with("_superseded/mug/") && *s == old),
        "the earlier mug/clean[0] is under _superseded/: {after:#?}"
    );
}

async fn a_reroll_the_service_refuses_changes_nothing(pg: Option<String>) {
    let env = start_default().await;
    let c = Catalogue::new(&env, pg);
    c.done().await;
    let before = c.had().await;
    let calls = env.sandbox.ledger().len();

    // Every call refused: a tool's 400 may be an input's URL expired, which the client asks
    // again once before it gives up.
    env.sandbox.refuse_next(usize::MAX);
    let ran = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).run().await;
    env.sandbox.refuse_next(0);
    assert_exit(&ran, 2);
    says_nothing_changed(&ran, "refused as invalid");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    let after = c.had().await;
    assert_eq!(after.1, before.1, "the record is as it was");
    assert_eq!(after.0, before.0, "the files are as they were");

    reroll_pays_and_sets_aside(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_the_service_refuses_as_invalid_changes_nothing_and_says_why() {
    a_reroll_the_service_refuses_changes_nothing(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_reroll_refused_changes_nothing() {
    let Some(pg) = postgres_database("desk_undo").await else {
        return;
    };
    a_reroll_the_service_refuses_changes_nothing(Some(pg)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reroll_refused_for_the_balance_changes_nothing_and_says_why() {
    let env = start_default().await;
    let c = Catalogue::new(&env, None);
    c.done().await;
    let before = c.had().await;
    let calls = env.sandbox.ledger().len();

    // The balance is drained while the reroll's first call waits at the gate, after the
    // reroll was priced against it and set its files aside.
    env.sandbox.hold_calls();
    let mut cmd = c.imgpipe(&["reroll", "r", "mug/clean[0]"]).command();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    wait_until("the reroll's first call held", || {
        env.sandbox.held_calls() == 1
    })
    .await;
    env.sandbox.set_balance(0);
    env.sandbox.release_calls();
    let out = finish_child(child, "the reroll refused for the balance").await;
    let ran = Ran {
        output: out,
        ledger: None,
    };
    assert_exit(&ran, 3);
    says_nothing_changed(&ran, "balance");
    assert_eq!(env.sandbox.ledger().len(), calls, "nothing billed");
    let after = c.had().await;
    assert_eq!(after.1, before.1, "the record is as it was");
    assert_eq!(after.0, before.0, "the files are as they were");

    env.sandbox.set_balance(1000);
    reroll_pays_and_sets_aside(&c).await;
}
