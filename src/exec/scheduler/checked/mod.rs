//! Checks in the run. A task of a checked step, once paid for, waits in `Judging` until its
//! outputs are downloaded and judged; nothing reads them before. Its verdicts then keep it
//! (its readers become ready), flag it (kept, marked for a person), fail it, or set its
//! outputs aside and pay for it again: within its step's `max_rerolls`, the pipeline's
//! `rerolls.max_credits`, and the purse (the budget, the balance and the caps) that every
//! other call passes. When none of those allows a reroll, the output is flagged.
//!
//! The verdicts and what was done about them are written in one transaction
//! ([`crate::store::Revisions::checked`]): a process killed before it judges again, after it
//! never acts twice. Judging runs beside the calls (decoding is on blocking threads, command
//! checks a bounded number at a time), never on the scheduler's loop ([`judging`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinError, JoinSet};

use crate::checks::command::Commands;
use crate::checks::judge::{
    Decision, Judged, RerollRoom, decide_task, failure_reason, first_failure, set_aside_reason,
};
use crate::checks::{Outcome, Verdict};
use crate::exec::Fatal;
use crate::exec::scheduler::Scheduler;
use crate::exec::state::State;
use crate::pipeline::Operation;
use crate::pipeline::checks::{CheckName, StepChecks};
use crate::plan::graph::{Graph, Instance, Source, Work};
use crate::run_id::RunId;
use crate::store::{
    Action, Checked, RecordedOutput, SetAside, Store, StoreError, TaskId, TaskRerolls, VerdictRow,
};

mod judging;

use judging::{Around, Inherited, Judgement, judge};

/// The checks' part of a run: judgements under way and the rerolls they asked for.
#[derive(Default)]
pub(super) struct Checking {
    judges: JoinSet<Judgement>,
    commands: Commands,
    /// Tasks in `Judging`, by what their call was billed (0 for those a resume found).
    waiting: HashMap<usize, u64>,
    /// Tasks whose judgement is under way.
    judging: HashSet<usize>,
    /// Times each task was paid again for a failed check, in this run by any process.
    rerolled: HashMap<usize, u32>,
    /// What those rerolls were planned at, in all.
    reroll_credits: u64,
    /// The perceptual hashes of the outputs kept so far, by instance and step, for the
    /// `distinct` checks of steps after a generation: each task there has one output, judged
    /// against its siblings' (8 bytes an output of such a step).
    kept_hashes: HashMap<(Instance, usize), Vec<u64>>,
    /// The tasks whose kept outputs' hashes are in `kept_hashes`: a sibling an earlier process
    /// kept is not, until a judgement reads its files.
    hashed: HashSet<usize>,
}

impl Checking {
    /// The rerolls a run's record holds, for a resume: counted against `max_rerolls` and
    /// `rerolls.max_credits` as this process's own.
    pub(super) fn new(earlier: impl IntoIterator<Item = (usize, TaskRerolls)>) -> Checking {
        let mut checking = Checking::default();
        for (t, r) in earlier {
            checking.rerolled.insert(t, r.count);
            checking.reroll_credits = checking.reroll_credits.saturating_add(r.credits);
        }
        checking
    }

    /// A task a killed process paid for and did not judge: it waits for its verdicts.
    pub(super) fn unjudged(&mut self, t: usize) {
        self.waiting.insert(t, 0);
    }

    /// The tasks waiting for their verdicts.
    pub(super) fn waiting_tasks(&self) -> Vec<usize> {
        self.waiting.keys().copied().collect()
    }

    /// Whether a task still waits for its verdicts.
    pub(super) fn busy(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The next judgement to end; never, with none under way.
    pub(super) async fn next(&mut self) -> Result<Judgement, JoinError> {
        match self.judges.join_next().await {
            Some(joined) => joined,
            None => std::future::pending().await,
        }
    }

    /// Cuts off the judgements under way: nothing of them was recorded, so the next resume
    /// judges those tasks again.
    pub(super) async fn abort(&mut self) {
        self.judges.abort_all();
        while self.judges.join_next().await.is_some() {}
    }
}

/// The checks' part of a run as its record holds it, for a resume: the rerolls already
/// asked for count, and tasks a killed process paid for and did not judge wait for their
/// verdicts. Nothing is read when no step is checked.
pub(super) async fn recorded(
    store: &Store,
    graph: &Graph,
    run_id: &RunId,
    mut state: Vec<State>,
) -> Result<(Vec<State>, Checking), StoreError> {
    let steps = graph.checked_steps();
    if steps.is_empty() {
        return Ok((state, Checking::default()));
    }
    let index = graph.index();
    let mut earlier = store.verdicts().rerolls(run_id).await?;
    if crate::failpoint::mutated(crate::failpoint::REROLLS_FORGOTTEN) {
        earlier.clear();
    }
    let mut checking = Checking::new(
        earlier
            .into_iter()
            .filter_map(|r| Some((index.of(&r.task)?, r))),
    );
    for (_, key) in store.verdicts().unjudged(run_id, &steps).await? {
        if let Some(t) = index.of(&key)
            && state[t] == State::Done
        {
            state[t] = State::Judging;
            checking.unjudged(t);
        }
    }
    Ok((state, checking))
}

impl Scheduler {
    /// Whether task `t`'s outputs are judged before anything reads them.
    pub(super) fn checked(&self, t: usize) -> bool {
        self.graph.step_of(t).checks.is_some()
    }

    /// Task `t` was paid for (`billed`): its readers wait for its outputs' verdicts.
    pub(super) fn await_verdicts(&mut self, t: usize, billed: u64) {
        self.state[t] = State::Judging;
        self.checking.waiting.insert(t, billed);
        self.judge_if_kept(t);
    }

    /// Starts judging `t` once none of its downloads is under way, nor its input's (a `size`
    /// check reads the input's dimensions from its file). A download that failed leaves an
    /// output no check can judge, which is flagged.
    pub(super) fn judge_if_kept(&mut self, t: usize) {
        let stopping = self.halt.is_some() || self.outcome.interrupted;
        if self.state[t] != State::Judging
            || self.downloads.downloading(t)
            || self.checking.judging.contains(&t)
            || stopping
        {
            return;
        }
        let Some(task_id) = self.rows.ids.get(t) else {
            return;
        };
        let input = match self.graph.work(t) {
            Ok(Work::Tool {
                input: Source::Output { task, k },
                ..
            }) => Some((task, k)),
            _ => None,
        };
        if input.is_some_and(|(task, _)| self.downloads.downloading(task)) {
            return;
        }
        // `distinct` judges an output against what its siblings kept: one sibling at a time,
        // each after the verdicts of the one before are acted on.
        let distinct = self.judges_distinct(t);
        if distinct && self.siblings(t).any(|s| self.checking.judging.contains(&s)) {
            return;
        }
        let input = input.and_then(|(task, k)| Some((task, self.rows.ids.get(task)?, k)));
        self.checking.judging.insert(t);
        let task = self.graph.task(t);
        let (earlier, unhashed) = match &self.graph.step_of(t).op {
            Operation::Tool(_) if distinct => {
                let known = self.checking.kept_hashes.get(&(task.instance, task.step.0));
                (known.cloned().unwrap_or_default(), self.kept_unhashed(t))
            }
            _ => (Vec::new(), Vec::new()),
        };
        let judge = judge(
            Arc::clone(&self.shared),
            self.checking.commands.clone(),
            (t, task_id),
            Around {
                input,
                earlier,
                unhashed,
            },
        );
        self.checking.judges.spawn(judge);
    }

    /// Acts on a task's verdicts.
    pub(super) async fn judged(&mut self, joined: Result<Judgement, JoinError>) {
        let j = match joined {
            Ok(j) => j,
            Err(e) => {
                return self.fatal(Fatal::Crashed(format!(
                    "a check's task ended abnormally: {e}"
                )));
            }
        };
        let t = j.task;
        self.checking.judging.remove(&t);
        for (sibling, hashes) in j.siblings {
            self.keep_hashes(sibling, hashes);
        }
        let mut judged = match j.judged {
            Ok(judged) => judged,
            Err(e) => return self.fatal(Fatal::Store(Arc::new(e))),
        };
        let Some(checks) = self.graph.step_of(t).checks.clone() else {
            return;
        };
        let verdicts: Vec<Vec<Verdict>> = judged
            .iter()
            .map(|o| o.verdicts.iter().map(|(_, v)| v.clone()).collect())
            .collect();
        let planned = self.graph.task(t).planned;
        let room = self.reroll_room(t, &checks);
        let mut decision = decide_task(verdicts.iter().map(Vec::as_slice), checks.on_fail, room);
        let failed = first_failure(verdicts.iter().flatten()).cloned();
        if decision == Decision::Reroll
            && let Some(inherited) = j.inherited
        {
            self.flag_inherited(t, inherited, &failed, &mut judged);
            decision = Decision::Flag;
        }
        if decision == Decision::Reroll {
            if self.halt.is_some() || self.outcome.interrupted {
                // Judged again by the next resume, which may still pay for it.
                return;
            }
            if !self.may_reroll(planned).await {
                tracing::warn!(
                    "{}: {}; not paid for again: the budget, the balance or a spending cap has no room",
                    self.name(t),
                    failure_reason(&failed).unwrap_or_default()
                );
                decision = Decision::Flag;
            }
        }
        crate::failpoint::hit("exec-checked-judged");
        let rows = self.verdict_rows(t, &checks, &j.outputs, &judged, decision);
        if matches!(decision, Decision::Keep | Decision::Flag) {
            self.keep_hashes(t, judged.iter().filter_map(|o| o.hash).collect());
        }
        self.act(t, j.outputs, rows, decision, failed).await;
        if self.judges_distinct(t) {
            let waiting: Vec<usize> = self
                .siblings(t)
                .filter(|s| self.state[*s] == State::Judging)
                .collect();
            for s in waiting {
                self.judge_if_kept(s);
            }
        }
    }

    /// What paying for `t` again may still spend: its step's `max_rerolls` less its rerolls,
    /// and what `rerolls.max_credits` has left.
    fn reroll_room(&self, t: usize, checks: &StepChecks) -> RerollRoom {
        let spent = self.checking.reroll_credits;
        RerollRoom {
            rerolled: self.checking.rerolled.get(&t).copied().unwrap_or(0),
            max_rerolls: checks.max_rerolls,
            price: self.graph.task(t).planned,
            credits_left: self.config.reroll_credits.saturating_sub(spent),
        }
    }

    /// `t`'s outputs failed a check its input was kept flagged for: it is not paid for again,
    /// and says why, in the log and in the failed verdicts' reasons (which status, the report
    /// and the desk show).
    fn flag_inherited(
        &self,
        t: usize,
        Inherited { check, from }: Inherited,
        failed: &Option<Verdict>,
        judged: &mut [Judged],
    ) {
        let input = self.graph.output_key(from.0, from.1);
        let why = format!(
            "not paid for again: its input {input} failed {} too",
            check.as_str()
        );
        tracing::warn!(
            "{}: {}; {why}, and a call made again from it would not mend that",
            self.name(t),
            failure_reason(failed).unwrap_or_default()
        );
        let failing = judged.iter_mut().flat_map(|o| &mut o.verdicts);
        for (_, v) in failing.filter(|(_, v)| v.outcome == Outcome::Failed && v.check == check) {
            v.reason = format!("{}; {why}", v.reason);
        }
    }

    /// Whether `t`'s step judges its outputs by `distinct`.
    fn judges_distinct(&self, t: usize) -> bool {
        let checks = self.graph.step_of(t).checks.as_ref();
        checks.is_some_and(|c| c.checks.iter().any(|c| c.name() == CheckName::Distinct))
    }

    /// The siblings of `t` (its step's other tasks in its instance) kept before this process
    /// judged anything of them: a resume's, whose hashes `distinct` must still compare with.
    fn kept_unhashed(&self, t: usize) -> Vec<(usize, TaskId)> {
        self.siblings(t)
            .filter(|s| self.state[*s] == State::Done && !self.checking.hashed.contains(s))
            .filter_map(|s| Some((s, self.rows.ids.get(s)?)))
            .collect()
    }

    /// The other tasks of `t`'s step in its instance.
    fn siblings(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        let task = self.graph.task(t);
        self.graph
            .instance_tasks(task.instance)
            .filter(move |&s| s != t && self.graph.task(s).step == task.step)
    }

    /// Adds task `t`'s kept outputs' hashes to its step's in its instance, once.
    fn keep_hashes(&mut self, t: usize, hashes: Vec<u64>) {
        if !self.checking.hashed.insert(t) {
            return;
        }
        let task = self.graph.task(t);
        let key = (task.instance, task.step.0);
        self.checking
            .kept_hashes
            .entry(key)
            .or_default()
            .extend(hashes);
    }

    /// Whether paying for `planned` once more fits: the caps lease it first, then the purse
    /// commits it as any other call's price.
    async fn may_reroll(&mut self, planned: u64) -> bool {
        self.lease_more(planned).await;
        self.purse.recommit(planned)
    }

    /// Records `rows` and does what `decision` says, in that order and in one transaction;
    /// `failed` is the first failed verdict, which says why.
    async fn act(
        &mut self,
        t: usize,
        outputs: Vec<RecordedOutput>,
        rows: Vec<VerdictRow>,
        decision: Decision,
        failed: Option<Verdict>,
    ) {
        let Some(task_id) = self.rows.ids.get(t) else {
            return;
        };
        let reason = failure_reason(&failed).unwrap_or_default();
        let planned = self.graph.task(t).planned;
        let job = outputs.first().map(|o| o.job_id.clone());
        let action = match (decision, &job) {
            (Decision::Reroll, Some(job_id)) => Checked::Rerolled {
                aside: self.set_aside(&outputs, set_aside_reason(&failed).unwrap_or_default()),
                job_id,
                credits: planned,
            },
            (Decision::Fail, _) => Checked::Failed(&reason),
            _ => Checked::Kept,
        };
        let run_id = &self.config.run_id;
        let store = self.shared.store.clone();
        let moves = match store
            .revisions()
            .checked(run_id, task_id, &rows, action)
            .await
        {
            Ok(moves) => moves,
            Err(e) => return self.fatal(Fatal::Store(Arc::new(e))),
        };
        crate::failpoint::hit("exec-checked-recorded");
        let billed = self.checking.waiting.remove(&t).unwrap_or(0);
        match decision {
            Decision::Reroll if job.is_some() => {
                if let Err(e) = crate::aside::make_moves(&store, moves).await {
                    return self.fatal(Fatal::Store(Arc::new(e)));
                }
                *self.checking.rerolled.entry(t).or_default() += 1;
                self.checking.reroll_credits = self.checking.reroll_credits.saturating_add(planned);
                tracing::info!("{}: {reason}; paid for again", self.name(t));
                self.shared.forget(t, self.graph.outputs(t));
                self.requeue(t, Duration::ZERO, false);
            }
            Decision::Fail => self.fail(t, &reason, false).await,
            _ => self.done(t, billed),
        }
    }

    /// The task's outputs set aside, each with why.
    fn set_aside(&self, outputs: &[RecordedOutput], why: String) -> Vec<SetAside> {
        outputs
            .iter()
            .map(|o| SetAside {
                output_id: o.id,
                from: o.path.as_ref().map(ToString::to_string),
                to: crate::aside::aside_path(&self.config.run_dir, o, None),
                sha256: None,
                reason: why.clone(),
                refetch: false,
            })
            .collect()
    }

    /// The rows that record a task's verdicts, each non-pass with what `decision` did.
    fn verdict_rows(
        &self,
        t: usize,
        checks: &StepChecks,
        outputs: &[RecordedOutput],
        judged: &[Judged],
        decision: Decision,
    ) -> Vec<VerdictRow> {
        let acted = match decision {
            Decision::Keep | Decision::Flag => Action::Flagged,
            Decision::Reroll => Action::Rerolled,
            Decision::Fail => Action::Failed,
        };
        let key = checks.key(&self.config.pipeline_name, self.graph.step_id(t));
        let mut rows = Vec::new();
        for (output, judged) in outputs.iter().zip(judged) {
            for (position, v) in &judged.verdicts {
                rows.push(VerdictRow {
                    output_id: output.id,
                    job_id: output.job_id.clone(),
                    task_id: output.task_id,
                    position: u32::try_from(*position).unwrap_or(u32::MAX),
                    checks_key: key.clone(),
                    check: v.check.to_string(),
                    outcome: v.outcome,
                    score: v.score,
                    reason: v.reason.clone(),
                    acted: (v.outcome != Outcome::Passed).then_some(acted),
                });
            }
        }
        rows
    }
}
