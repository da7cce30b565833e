//! The invariants, held after every trial against the sandbox's ledger, its counters, the
//! state database and the files. Each broken one is named with its evidence.

use std::collections::{BTreeMap, HashMap, HashSet};

use imgpipe::sandbox::{LedgerEntry, Sandbox, Stats};

use super::db::Db;
use super::scenario::Scenario;
use super::trial::Outcome;

/// The invariants, by name, in the order they are checked.
pub const INVARIANTS: &[&str] = &[
    "billed_recorded",
    "paid_once",
    "confirmed_price",
    "budget",
    "rate_429",
    "outputs_stored",
    "no_overwrite",
    "checks",
    "run_end",
    "process_bound",
];

#[derive(Debug)]
pub struct Violation {
    pub invariant: &'static str,
    pub evidence: String,
}

struct Found(Vec<Violation>);

impl Found {
    fn check(&mut self, invariant: &'static str, ok: bool, evidence: impl FnOnce() -> String) {
        if !ok {
            self.0.push(Violation {
                invariant,
                evidence: evidence(),
            });
        }
    }
}

/// The image id a result URL names (`…/files/{id}.png?…`).
fn image_id(url: &str) -> Option<&str> {
    let path = url.split('?').next()?;
    path.rsplit('/').next()?.strip_suffix(".png")
}

pub fn all(
    s: &Scenario,
    out: &Outcome,
    db: &Db,
    sandbox: &Sandbox,
    ledger: &[LedgerEntry],
    stats: &Stats,
) -> Vec<Violation> {
    let mut f = Found(Vec::new());
    let total: u64 = ledger.iter().map(|e| e.credits).sum();
    let by_job: HashMap<&str, &LedgerEntry> =
        ledger.iter().map(|e| (e.job_id.as_str(), e)).collect();
    let mut named: HashMap<&str, Vec<&super::db::Attempt>> = HashMap::new();
    for a in &db.attempts {
        if let Some(j) = &a.job_id {
            named.entry(j.as_str()).or_default().push(a);
        }
    }
    let task_of: HashMap<i64, &super::db::Task> = db.tasks.iter().map(|t| (t.id, t)).collect();

    // billed_recorded: each billed job is recorded, as billed by the attempt that names it or
    // as possibly billed by an attempt without an answer; nothing is recorded that was not billed.
    for (job, attempts) in &named {
        match by_job.get(job) {
            None => f.check("billed_recorded", false, || {
                format!("attempts {:?} name job {job}, never billed", ids(attempts))
            }),
            Some(e) => {
                for a in attempts.iter().filter(|a| a.billed > 0) {
                    f.check("billed_recorded", a.billed == e.credits, || {
                        format!(
                            "attempt {} records {} credits for job {job}, the ledger {}",
                            a.id, a.billed, e.credits
                        )
                    });
                }
            }
        }
    }
    let recorded: u64 = db.attempts.iter().map(|a| a.billed).sum();
    let unnamed: Vec<&LedgerEntry> = ledger
        .iter()
        .filter(|e| !named.contains_key(e.job_id.as_str()))
        .collect();
    let unnamed_credits: u64 = unnamed.iter().map(|e| e.credits).sum();
    let possibly: Vec<&super::db::Attempt> = db
        .attempts
        .iter()
        .filter(|a| a.job_id.is_none() && a.outcome.as_deref() != Some("not_sent"))
        .filter(|a| a.outcome.is_none() || a.outcome.as_deref() == Some("ambiguous"))
        .collect();
    let possibly_credits: u64 = possibly
        .iter()
        .map(|a| task_of.get(&a.task_id).map_or(0, |t| t.planned))
        .sum();
    f.check(
        "billed_recorded",
        unnamed.len() <= possibly.len() && unnamed_credits <= possibly_credits,
        || {
            format!(
                "the sandbox billed {} job(s) for {unnamed_credits} credits that no attempt names ({}), but the state holds only {} attempt(s) possibly billed for {possibly_credits} credits; ledger {total}, recorded billed {recorded}",
                unnamed.len(),
                unnamed.iter().take(5).map(|e| format!("{} {} {}cr", e.job_id, e.operation, e.credits)).collect::<Vec<_>>().join(", "),
                possibly.len()
            )
        },
    );
    // Per operation too: a job of one operation is never excused by an attempt of another.
    let mut by_op: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for e in &unnamed {
        by_op.entry(e.operation.as_str()).or_default().0 += 1;
    }
    for a in &possibly {
        if let Some(t) = task_of.get(&a.task_id) {
            by_op.entry(t.operation.as_str()).or_default().1 += 1;
        }
    }
    for (op, (billed, can)) in &by_op {
        f.check("billed_recorded", billed <= can, || {
            format!(
                "{billed} {op} job(s) billed and never named, {can} {op} attempt(s) possibly billed"
            )
        });
    }

    // paid_once: a task succeeds once, plus once per reroll that named it and once per reroll
    // a check asked for.
    let mut rerolled: HashMap<i64, usize> = HashMap::new();
    for r in &db.rerolls {
        for t in r {
            *rerolled.entry(*t).or_default() += 1;
        }
    }
    for r in &db.check_rerolls {
        *rerolled.entry(r.task_id).or_default() += 1;
    }
    let mut won: HashMap<i64, Vec<i64>> = HashMap::new();
    for a in db
        .attempts
        .iter()
        .filter(|a| a.outcome.as_deref() == Some("succeeded"))
    {
        won.entry(a.task_id).or_default().push(a.id);
    }
    for (task, wins) in &won {
        let allowed = 1 + rerolled.get(task).copied().unwrap_or(0);
        f.check("paid_once", wins.len() <= allowed, || {
            format!(
                "task {} succeeded {} times (attempts {wins:?}), {} reroll(s) name it",
                task_of.get(task).map_or("?".into(), |t| t.name.clone()),
                wins.len(),
                allowed - 1
            )
        });
    }
    for (job, attempts) in &named {
        f.check("paid_once", attempts.len() == 1, || {
            format!("job {job} is named by attempts {:?}", ids(attempts))
        });
    }

    // confirmed_price: what the run spent is its plan, the changes confirmed (each revision
    // once, whatever the number of confirms of it) and the calls billed without a success (lost
    // answers, a billed failure), as the ledger has them: no slack from a call recorded as
    // possibly billed that the sandbox never billed.
    if let Some(before) = out.planned_before_confirms {
        let mut distinct: BTreeMap<&str, u64> = BTreeMap::new();
        for (rev, credits) in &out.accepted {
            distinct.insert(rev, *credits);
        }
        let confirmed: u64 = distinct.values().sum();
        let won: HashSet<&str> = db
            .attempts
            .iter()
            .filter(|a| a.outcome.as_deref() == Some("succeeded"))
            .filter_map(|a| a.job_id.as_deref())
            .collect();
        let wasted: u64 = ledger
            .iter()
            .filter(|e| !won.contains(e.job_id.as_str()))
            .map(|e| e.credits)
            .sum();
        let checks: u64 = db.check_rerolls.iter().map(|r| r.credits).sum();
        let bound = before + confirmed + wasted + checks;
        f.check("confirmed_price", total <= bound, || {
            format!(
                "billed {total} credits: more than the plan ({before}), the changes confirmed ({confirmed}, {} confirm(s) accepted of {} revision(s)), the calls billed without a success ({wasted}) and the checks' rerolls ({checks})",
                out.accepted.len(),
                distinct.len()
            )
        });
    }

    // budget
    if let Some(b) = s.budget {
        f.check("budget", total <= b, || {
            format!("billed {total} credits against a budget of {b}")
        });
    }

    // rate_429: beyond the injected ones, the account's 429s stay within a tolerance: three a
    // process (its first second, before it reads the limit) and 2% of the paid calls.
    if s.faults.account_rate.is_some() && s.faults.rate_limit == 0.0 {
        let processes = out.log.iter().filter(|l| l.starts_with("started")).count() as u64;
        let tolerance = 3 * processes + stats.paid_requests / 50;
        f.check("rate_429", stats.rate_limited <= tolerance, || {
            format!(
                "{} 429s from the sandbox for {} paid requests of {processes} process(es): tolerance {tolerance}",
                stats.rate_limited, stats.paid_requests
            )
        });
    }

    // outputs_stored
    if db.runs.is_empty() {
        f.check("run_end", false, || "no run was recorded".into());
        return f.0;
    }
    let final_files = out.snapshots.last().cloned().unwrap_or_default();
    let mut outputs_of: HashMap<i64, Vec<&super::db::Output>> = HashMap::new();
    for o in &db.outputs {
        outputs_of.entry(o.task_id).or_default().push(o);
    }
    for t in db
        .tasks
        .iter()
        .filter(|t| !t.removed && t.status == "succeeded")
    {
        let outs = outputs_of.get(&t.id).cloned().unwrap_or_default();
        f.check("outputs_stored", !outs.is_empty(), || {
            format!("task {} succeeded with no output recorded", t.name)
        });
        for o in outs {
            let served = image_id(&o.url)
                .and_then(|id| sandbox.stored_image(id))
                .map(|b| super::sha256_hex(&b));
            let on_disk = o.path.as_deref().and_then(|p| final_files.get(p));
            f.check(
                "outputs_stored",
                served.is_some() && o.sha256 == served && on_disk == served.as_ref(),
                || {
                    format!(
                        "task {} output {} (job {}): recorded {:?} at {:?}, on disk {:?}, the sandbox served {:?}",
                        t.name, o.k, o.job_id, o.sha256, o.path, on_disk, served
                    )
                },
            );
        }
    }

    // no_overwrite: every file a phase left is still there, or was set aside on record.
    let set_aside: HashSet<&str> = db
        .superseded
        .iter()
        .filter_map(|s| s.sha256.as_deref())
        .collect();
    let kept: HashSet<&String> = final_files.values().collect();
    for (i, snap) in out.snapshots.iter().enumerate() {
        for (path, sha) in snap {
            if temporary(path) {
                continue;
            }
            f.check(
                "no_overwrite",
                kept.contains(sha) || set_aside.contains(sha.as_str()),
                || {
                    format!(
                        "{path} (sha256 {sha}) after phase {i} is gone: now {:?}, not set aside",
                        final_files.get(path)
                    )
                },
            );
        }
    }

    checks(&mut f, s, out, db);

    // run_end: what `imgpipe status` tells, as a user reads it.
    f.check(
        "run_end",
        out.told.as_ref().is_ok_and(documented_end),
        || match &out.told {
            Ok(told) => format!(
                "imgpipe status tells the run {} (stopped: {}, failures: {}, process: {})",
                told["status"], told["stopped"], told["failures"], told["process"]
            ),
            Err(e) => e.clone(),
        },
    );

    f.0.extend(overdue(out));
    f.0
}

/// `checks`: a failed verdict is acted on once, in the transaction that records it; what a
/// reroll set aside is no longer an output, and every reroll is a row `check_rerolls` has once,
/// within `rerolls.max_credits`; a run that ended succeeded judged every output of a checked
/// step before it ended.
fn checks(f: &mut Found, s: &Scenario, out: &Outcome, db: &Db) {
    let current: HashSet<(i64, &str)> = db
        .outputs
        .iter()
        .map(|o| (o.task_id, o.job_id.as_str()))
        .collect();
    let mut rows: HashMap<(i64, &str), usize> = HashMap::new();
    for r in &db.check_rerolls {
        *rows.entry((r.task_id, r.job_id.as_str())).or_default() += 1;
    }
    for ((task, job), n) in &rows {
        f.check("checks", *n == 1, || {
            format!("task {task}'s job {job} was paid for again {n} times for its verdicts")
        });
        f.check("checks", !current.contains(&(*task, *job)), || {
            format!("task {task}'s job {job} was paid for again, yet its outputs are still kept")
        });
    }
    for v in &db.verdicts {
        let at = (v.task_id, v.job_id.as_str());
        let ok = match (v.verdict.as_str(), v.acted.as_deref()) {
            ("failed", Some("rerolled")) => rows.contains_key(&at) && !current.contains(&at),
            ("failed", Some(_)) => true,
            ("failed", None) => false,
            _ => true,
        };
        f.check("checks", ok, || {
            format!(
                "task {} job {}: verdict {} acted {:?}; a check_rerolls row: {}; kept: {}",
                v.task_id,
                v.job_id,
                v.verdict,
                v.acted,
                rows.contains_key(&at),
                current.contains(&at)
            )
        });
    }
    let Some(c) = &s.checks else {
        f.check("checks", db.verdicts.is_empty(), || {
            format!("{} verdicts in a run without checks", db.verdicts.len())
        });
        return;
    };
    let spent: u64 = db.check_rerolls.iter().map(|r| r.credits).sum();
    let most = c.max_credits.unwrap_or(0);
    f.check("checks", spent <= most, || {
        format!("rerolls planned at {spent} credits, past rerolls.max_credits {most}")
    });
    let ended = out.told.as_ref().is_ok_and(|t| t["status"] == "succeeded");
    if !ended {
        return;
    }
    let judged_steps: HashSet<&str> = c
        .steps
        .iter()
        .map(|(i, _)| s.steps[*i].id.as_str())
        .collect();
    let judged: HashSet<(i64, &str)> = db
        .verdicts
        .iter()
        .map(|v| (v.task_id, v.job_id.as_str()))
        .collect();
    let step_of = |name: &str| {
        let rest = name.split_once('/').map_or(name, |(_, r)| r);
        rest.split_once('[').map_or(rest, |(s, _)| s).to_owned()
    };
    let steps_of: HashMap<i64, String> =
        db.tasks.iter().map(|t| (t.id, step_of(&t.name))).collect();
    for o in &db.outputs {
        let Some(step) = steps_of.get(&o.task_id) else {
            continue;
        };
        if judged_steps.contains(step.as_str()) {
            f.check("checks", judged.contains(&(o.task_id, o.job_id.as_str())), || {
                format!(
                    "task {} output {} (job {}) of checked step {step} was never judged, and the run ended succeeded",
                    o.task_id, o.k, o.job_id
                )
            });
        }
    }
}

/// `process_bound`: every process the trial had to kill, past its bound. Told whether or not
/// the state can be read (a process that hangs may never have made one).
pub fn overdue(out: &Outcome) -> Vec<Violation> {
    let each = out.overdue.iter().map(|o| Violation {
        invariant: "process_bound",
        evidence: o.clone(),
    });
    each.collect()
}

/// Whether a run's status, as `imgpipe status --json` tells it, is an end the docs describe
/// (docs/guides/resuming-and-cron.md): `succeeded`; `stopped` with the reason imgpipe recorded;
/// `failed` with each failure named and its reason. A run told `running` or `interrupted` (its
/// process gone) did not end, whatever its record says.
fn documented_end(told: &serde_json::Value) -> bool {
    let said = |v: &serde_json::Value| v.as_str().is_some_and(|s| !s.trim().is_empty());
    let failures = told["failures"].as_array();
    match told["status"].as_str() {
        Some("succeeded") => true,
        Some("stopped") => said(&told["stopped"]),
        Some("failed") => {
            failures.is_some_and(|f| !f.is_empty() && f.iter().all(|f| said(&f["reason"])))
        }
        _ => false,
    }
}

fn ids(attempts: &[&super::db::Attempt]) -> Vec<i64> {
    attempts.iter().map(|a| a.id).collect()
}

fn temporary(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with('.')
        || name.ends_with(".part")
        || name.ends_with(".tmp")
        || name == "manifest.jsonl"
        || name == "report.html"
        || path.contains("thumbs")
}
