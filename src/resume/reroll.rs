//! A reroll: chosen tasks of a run paid for again, with everything downstream of them that
//! ran, their earlier outputs set aside under `_superseded/` (never overwritten).
//!
//! A reroll is recorded in the same transaction that resets its tasks ([`crate::store::Revisions::apply`]
//! with [`crate::store::Changes::reroll`]), with the row ids it reset. Until it ends with all
//! of them done, the same command continues it rather than starting another: a reroll killed
//! half way and given again pays for what is left of it, and nothing twice. One that could not
//! be done (nothing of it billed, none of its tasks done) is undone from the copy of the rows
//! recorded with it ([`super::undo_reroll`]): the person keeps what they had.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use crate::place::layout::BATCH;
use crate::plan::graph::{Graph, Instance};
use crate::plan::scope::Scope;
use crate::store::TaskId;
use crate::task_key::TaskKey;

use super::{Reason, Redo, Review};

/// What a reroll names: a whole item, one of its steps, one step for every item, or one task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `mug`: every task of the item.
    Item(String),
    /// `mug/clean`: every task of the step for the item.
    Step { item: String, step: String },
    /// `*/clean`: every task of the step that ran, whatever its item. One word for a step
    /// across the batch, so that asking for it costs the same at 10 items as at 100,000
    /// (`*` is no item's id: ids are letters, digits, `.`, `_` and `-`).
    EveryItem { step: String },
    /// `mug/clean[0]`.
    Task(TaskKey),
}

impl FromStr for Target {
    type Err = String;

    fn from_str(s: &str) -> Result<Target, String> {
        let plain = |p: &str| !p.is_empty() && !p.contains(['/', '[', ']', '*']);
        let names_none = || {
            format!(
                "`{s}` names no task: write item, item/step, */step or item/step[index], e.g. mug/clean[0]"
            )
        };
        if s.ends_with(']') {
            let key = s.parse::<TaskKey>().map_err(|e| e.to_string())?;
            // `*` is a step of every item, never one task's item.
            if key.item.contains('*') || key.step.contains('*') {
                return Err(names_none());
            }
            return Ok(Target::Task(key));
        }
        match s.split_once('/') {
            Some(("*", step)) if plain(step) => Ok(Target::EveryItem {
                step: step.to_owned(),
            }),
            Some((item, step)) if plain(item) && plain(step) => Ok(Target::Step {
                item: item.to_owned(),
                step: step.to_owned(),
            }),
            None if plain(s) => Ok(Target::Item(s.to_owned())),
            _ => Err(names_none()),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Item(item) => write!(f, "{item}"),
            Target::Step { item, step } => write!(f, "{item}/{step}"),
            Target::EveryItem { step } => write!(f, "*/{step}"),
            Target::Task(key) => write!(f, "{key}"),
        }
    }
}

/// The targets as one text, the same whatever their order: how a reroll is recognised again.
pub(super) fn said(targets: &[Target]) -> String {
    let mut words: Vec<String> = targets.iter().map(ToString::to_string).collect();
    words.sort_unstable();
    words.dedup();
    words.join(" ")
}

/// The graph's tasks that `targets` name, and of them those named only through a step of
/// every item (`*/clean`): those are paid for again only if they ran, as a task downstream
/// is. An item, step or index the run does not have is an error naming it.
pub(super) fn resolve(
    graph: &Graph,
    targets: &[Target],
) -> Result<(Vec<usize>, HashSet<usize>), String> {
    let index = graph.index();
    let instance = |item: &str| -> Result<Instance, String> {
        if item == BATCH {
            return Ok(Instance::Batch);
        }
        index
            .instance(item)
            .ok_or_else(|| format!("the run has no item `{item}`"))
    };
    let step_of = |step: &str| -> Result<usize, String> {
        graph
            .step_ids
            .iter()
            .position(|s| s == step)
            .ok_or_else(|| {
                format!(
                    "the pipeline has no step `{step}` (its steps: {})",
                    graph.step_ids.join(", ")
                )
            })
    };
    let mut chosen = Vec::new();
    let mut loose = HashSet::new();
    for target in targets {
        let found: Vec<usize> = match target {
            Target::EveryItem { step } => {
                let s = step_of(step)?;
                let every: Vec<usize> = (0..graph.len())
                    .filter(|t| graph.task(*t).step.0 == s)
                    .collect();
                loose.extend(every.iter().copied());
                every
            }
            Target::Item(item) => graph.instance_tasks(instance(item)?).collect(),
            Target::Step { item, step } => {
                let s = step_of(step)?;
                graph
                    .instance_tasks(instance(item)?)
                    .filter(|t| graph.task(*t).step.0 == s)
                    .collect()
            }
            Target::Task(key) => {
                instance(&key.item)?;
                step_of(&key.step)?;
                let t = index.get(&key.item, &key.step, key.index).ok_or_else(|| {
                    format!("`{key}`: the step has no task of that index for this item")
                })?;
                vec![t]
            }
        };
        if found.is_empty() {
            return Err(format!("`{target}` names no task of the run"));
        }
        chosen.extend(found);
    }
    chosen.sort_unstable();
    chosen.dedup();
    Ok((chosen, loose))
}

impl Review {
    /// Makes the review a reroll of `chosen`: each of them, and each task downstream of them
    /// that ran (succeeded, failed or blocked), is paid for again; downstream tasks that never
    /// ran stay as they are. Gives the scope to run; the row ids to reset are recorded with
    /// the reroll ([`Review::reroll`] field) when the review is applied.
    ///
    /// `loose` are those of `chosen` named through a step of every item: like the tasks
    /// downstream, they are paid for again only if they ran.
    /// `said` is what the reroll names ([`said`]), as it is recorded.
    /// `continuing` holds the row ids an unfinished reroll of the same targets reset: then
    /// nothing is reset again, and only those of them not done yet are paid for.
    pub fn reroll(
        &mut self,
        graph: &Graph,
        chosen: &[usize],
        loose: &HashSet<usize>,
        continuing: Option<&[TaskId]>,
        said: String,
    ) -> Result<Scope, String> {
        let named: HashSet<usize> = chosen
            .iter()
            .copied()
            .filter(|t| !loose.contains(t))
            .collect();
        let mut set: Vec<usize> = chosen.to_vec();
        for t in chosen {
            set.extend(graph.descendants(*t));
        }
        set.sort_unstable();
        set.dedup();
        let row = |t: usize| self.rows.as_ref().and_then(|r| r.get(t));
        let open: std::collections::HashMap<usize, Reason> =
            self.redo.iter().map(|r| (r.task, r.reason)).collect();
        let mut scope = Vec::new();
        let mut reset = Vec::new();
        match continuing {
            Some(ids) => {
                let ids: HashSet<TaskId> = ids.iter().copied().collect();
                scope.extend(
                    set.iter().copied().filter(|t| {
                        row(*t).is_some_and(|id| ids.contains(&id) && !self.is_kept(id))
                    }),
                );
            }
            None => {
                for &t in &set {
                    let Some(id) = row(t) else {
                        if named.contains(&t) {
                            return Err(format!(
                                "{} never ran: there is nothing to reroll",
                                graph.key(t)
                            ));
                        }
                        continue;
                    };
                    let ran = match open.get(&t) {
                        None => self.is_kept(id),
                        Some(reason) => *reason != Reason::NeverStarted,
                    };
                    if !(ran || named.contains(&t)) {
                        continue;
                    }
                    if self.is_kept(id) {
                        self.redo.push(Redo {
                            task: t,
                            reason: Reason::Rerolled,
                            credits: graph.task(t).planned,
                            detail: None,
                        });
                    }
                    scope.push(t);
                    reset.push(id);
                }
                if reset.is_empty() {
                    return Err(format!("nothing of {said} ran: there is nothing to reroll"));
                }
                self.inputs_made(graph, &scope, &named, &open)?;
                let rerolled: HashSet<TaskId> = reset.iter().copied().collect();
                self.kept.retain(|id| !rerolled.contains(id));
                self.reroll = Some(crate::store::NewReroll {
                    said: said.clone(),
                    task_ids: reset,
                    before: None,
                });
            }
        }
        self.redo.sort_by_key(|r| r.task);
        let scope = Scope::tasks(scope, format!("reroll {said}"));
        self.narrow(graph, &scope);
        Ok(scope)
    }

    /// Refuses a reroll naming a task that never ran while one of its inputs is neither made
    /// nor made again by the reroll: it would be confirmed, priced and then undone with nothing
    /// paid, when what the task waits for is the run itself (`imgpipe resume`). Tasks only
    /// downstream of those named are not held to it: they wait, as in any run.
    fn inputs_made(
        &self,
        graph: &Graph,
        scope: &[usize],
        named: &HashSet<usize>,
        open: &std::collections::HashMap<usize, Reason>,
    ) -> Result<(), String> {
        let in_scope: HashSet<usize> = scope.iter().copied().collect();
        let made = |d: usize| {
            in_scope.contains(&d)
                || self
                    .rows
                    .as_ref()
                    .and_then(|r| r.get(d))
                    .is_some_and(|id| self.is_kept(id))
        };
        for &t in scope {
            let never_ran = named.contains(&t)
                && matches!(open.get(&t), Some(Reason::NeverStarted | Reason::Blocked));
            if let Some(d) = graph.deps(t).into_iter().find(|d| never_ran && !made(*d)) {
                return Err(format!(
                    "{} never ran: it waits on {}, which has no output yet. There is nothing to \
                     reroll; `imgpipe resume` makes it once its inputs are made",
                    graph.key(t),
                    graph.key(d)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Target;

    #[test]
    fn a_step_of_every_item_reads_back_as_written_and_nothing_else_takes_the_star() {
        let every = "*/clean".parse::<Target>().unwrap();
        assert_eq!(
            every,
            Target::EveryItem {
                step: "clean".into()
            }
        );
        assert_eq!(every.to_string(), "*/clean");
        for bad in [
            "*",
            "*/",
            "*/clean/x",
            "mug*/clean",
            "*/cl*an",
            "*/clean[0]",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad} was taken");
        }
    }
}
