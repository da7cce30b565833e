//! The ledger: what was billed across runs (`imgpipe spend`), folded from the store's
//! [`crate::store::ledger`]: credits billed, possibly billed and planned, calls and failures, per day, ISO week, month, pipeline, step or run.
//!
//! A day is a UTC calendar day. A call counts on the day it was sent (its attempt's start);
//! a run's planned credits count on the day the run started, since that is when it planned
//! them. Per run and per pipeline, every figure is the one `runs` shows, so with no window the
//! totals are the sums of `runs --json`. Per step, planned credits are split as `status`
//! splits them (the recorded tasks, plus the plan's for tasks not recorded yet).

use crate::run_id::RunId;
use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Datelike, Utc};
use serde::Serialize;

use crate::money::planned::unrecorded;
pub use crate::store::ledger::Window;
use crate::store::ledger::{Calls, RunPlanned};
use crate::store::{Store, StoreError};

/// What a ledger's lines are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    Day,
    /// An ISO 8601 week, Monday to Sunday, named like `2026-W48`.
    Week,
    Month,
    Pipeline,
    /// A pipeline's step: steps of the same name in two pipelines are two lines.
    Step,
    Run,
}

impl By {
    pub fn as_str(self) -> &'static str {
        match self {
            By::Day => "day",
            By::Week => "week",
            By::Month => "month",
            By::Pipeline => "pipeline",
            By::Step => "step",
            By::Run => "run",
        }
    }
}

/// The figures of a group, or of the whole ledger. Field names are those of `runs --json`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Figures {
    pub credits_planned: u64,
    pub credits_billed: u64,
    pub possibly_billed: u64,
    pub calls: u64,
    pub failures: u64,
    pub possibly_billed_calls: u64,
}

impl Figures {
    fn add_calls(&mut self, c: &Calls) {
        self.credits_billed += c.billed_credits;
        self.possibly_billed += c.possibly_billed_credits;
        self.calls += c.calls;
        self.failures += c.failures;
        self.possibly_billed_calls += c.possibly_billed_calls;
    }

    fn add(&mut self, f: &Figures) {
        self.credits_planned += f.credits_planned;
        self.add_calls(&Calls {
            calls: f.calls,
            failures: f.failures,
            billed_credits: f.credits_billed,
            possibly_billed_calls: f.possibly_billed_calls,
            possibly_billed_credits: f.possibly_billed,
        });
    }
}

/// One line of the ledger.
#[derive(Clone, Debug, Serialize)]
pub struct Line {
    /// The day (`2026-11-25`), week (`2026-W48`), month (`2026-11`), pipeline, step or run.
    pub group: String,
    /// The pipeline of a step or a run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    #[serde(flatten)]
    pub figures: Figures,
}

/// The ledger: its lines in order (time, or name; runs by start), and their sum.
#[derive(Clone, Debug, Serialize)]
pub struct Ledger {
    pub by: &'static str,
    pub time_zone: &'static str,
    /// The window, RFC 3339: from `since` (inclusive) to `until` (exclusive).
    pub since: Option<String>,
    pub until: Option<String>,
    pub groups: Vec<Line>,
    pub totals: Figures,
}

/// A line's place: runs sort by their start, everything else by its name.
type Key = (i64, String, Option<String>);

/// Reads and folds the ledger of `window` by `by`.
pub async fn ledger(store: &Store, by: By, window: Window) -> Result<Ledger, StoreError> {
    let runs: HashMap<RunId, RunPlanned> = store
        .ledger()
        .runs_planned()
        .await?
        .into_iter()
        .map(|r| (r.run_id.clone(), r))
        .collect();
    let mut lines: BTreeMap<Key, Figures> = BTreeMap::new();
    add_planned(store, by, window, &runs, &mut lines).await?;
    match by {
        By::Day | By::Week | By::Month => {
            for q in store.ledger().calls_by_quarter(window).await? {
                let key = (0, period(by, q.quarter), None);
                lines.entry(key).or_default().add_calls(&q.calls);
            }
        }
        By::Pipeline | By::Step | By::Run => {
            for c in store.ledger().calls_by_run(window, by == By::Step).await? {
                let run = runs.get(&c.run_id);
                let key = run_key(by, run, &c.run_id, c.step);
                lines.entry(key).or_default().add_calls(&c.calls);
            }
        }
    }
    Ok(finish(by, window, lines))
}

/// Planned credits of the runs started within `window`, on their lines.
async fn add_planned(
    store: &Store,
    by: By,
    window: Window,
    runs: &HashMap<RunId, RunPlanned>,
    lines: &mut BTreeMap<Key, Figures>,
) -> Result<(), StoreError> {
    if by == By::Step {
        let (steps, plans) = store.ledger().steps_planned(window).await?;
        for s in &steps {
            let key = run_key(by, runs.get(&s.run_id), &s.run_id, Some(s.step.clone()));
            lines.entry(key).or_default().credits_planned += s.planned_credits;
        }
        for (run_id, plan) in &plans {
            let recorded = |step: &str| {
                steps
                    .iter()
                    .find(|s| s.run_id == *run_id && s.step == step)
                    .map_or(0, |s| s.tasks)
            };
            for extra in unrecorded(plan, recorded) {
                let key = run_key(by, runs.get(run_id), run_id, Some(extra.step));
                lines.entry(key).or_default().credits_planned += extra.planned_credits;
            }
        }
        return Ok(());
    }
    for run in runs.values().filter(|r| contains(window, r.created_at)) {
        let key = match by {
            By::Day | By::Week | By::Month => (0, period(by, run.created_at), None),
            _ => run_key(by, Some(run), &run.run_id, None),
        };
        lines.entry(key).or_default().credits_planned += run.credits_planned;
    }
    Ok(())
}

fn contains(window: Window, at: i64) -> bool {
    window.since.is_none_or(|s| at >= s) && window.until.is_none_or(|u| at < u)
}

/// The line of a run's figures when grouping by pipeline, step or run.
fn run_key(by: By, run: Option<&RunPlanned>, run_id: &RunId, step: Option<String>) -> Key {
    let pipeline = run.map_or_else(String::new, |r| r.pipeline.clone());
    match (by, step) {
        (By::Step, Some(step)) => (0, pipeline.clone(), Some(step)),
        (By::Run, _) => (
            run.map_or(0, |r| r.created_at),
            run_id.to_string(),
            Some(pipeline),
        ),
        _ => (0, pipeline, None),
    }
}

/// The day, ISO week or month (UTC) of a time in unix milliseconds.
fn period(by: By, ms: i64) -> String {
    let at = DateTime::<Utc>::from_timestamp_millis(ms).unwrap_or_default();
    match by {
        By::Week => {
            let week = at.iso_week();
            format!("{}-W{:02}", week.year(), week.week())
        }
        By::Month => format!("{:04}-{:02}", at.year(), at.month()),
        _ => at.format("%Y-%m-%d").to_string(),
    }
}

/// The ledger of a state database that does not exist yet.
pub fn empty(by: By, window: Window) -> Ledger {
    finish(by, window, BTreeMap::new())
}

/// The lines in order, those with nothing to show left out, and the totals.
fn finish(by: By, window: Window, lines: BTreeMap<Key, Figures>) -> Ledger {
    let mut totals = Figures::default();
    let groups: Vec<Line> = lines
        .into_iter()
        .filter(|(_, f)| *f != Figures::default())
        .map(|((_, name, extra), figures)| {
            totals.add(&figures);
            // By step the key is (pipeline, step): the line is named after the step.
            let (group, pipeline) = match (by, extra) {
                (By::Step, Some(step)) => (step, Some(name)),
                (_, extra) => (name, extra),
            };
            Line {
                group,
                pipeline,
                figures,
            }
        })
        .collect();
    Ledger {
        by: by.as_str(),
        time_zone: "UTC",
        since: window.since.map(crate::time::rfc3339_ms),
        until: window.until.map(crate::time::rfc3339_ms),
        groups,
        totals,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_utc_days_iso_weeks_and_months() {
        // 2026-11-29T23:59:59.999Z, a Sunday, and the next millisecond, a Monday.
        let sunday = 1_795_996_799_999;
        assert_eq!(period(By::Day, sunday), "2026-11-29");
        assert_eq!(period(By::Day, sunday + 1), "2026-11-30");
        assert_eq!(period(By::Week, sunday), "2026-W48");
        assert_eq!(period(By::Week, sunday + 1), "2026-W49");
        assert_eq!(period(By::Month, sunday + 1), "2026-11");
        // ISO week 1 of 2027 starts on 2027-01-04; 2027-01-01 is in 2026's week 53.
        assert_eq!(period(By::Week, 1_798_761_600_000), "2026-W53");
    }
}
