//! Each item's lineage as a tree: a task hangs under the output it reads, so a chain reads left
//! to right, fan-out (n > 1, or a tool run on each of several outputs) splits into rows, and
//! a task reading several outputs (references) sits under the first and names the others.

use std::collections::HashMap;

use crate::task_key::TaskKey;

use crate::place::layout;
use crate::store::ReportTask;

/// What one input of a task is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Input {
    /// Output `k` of the task at this index.
    Output { task: usize, k: u32 },
    /// A URL the pipeline wrote.
    Url(String),
    /// A reference to an output no task of the run makes (a removed step).
    Unknown(String),
}

/// One chain of the run: an item, or the batch's `once` steps.
#[derive(Debug)]
pub(super) struct Chain {
    pub id: String,
    /// Tasks that read no other task of the same chain, in record order.
    pub roots: Vec<usize>,
    /// Every task of the chain, in record order.
    pub tasks: Vec<usize>,
}

pub(super) struct Lineage {
    pub chains: Vec<Chain>,
    inputs: Vec<Vec<Input>>,
    /// The tasks under each task, with the output `k` each reads.
    children: HashMap<usize, Vec<(u32, usize)>>,
}

impl Lineage {
    /// The lineage of `tasks`, leaving out removed ones.
    pub(super) fn build(tasks: &[ReportTask]) -> Lineage {
        let mut by_step: HashMap<(&str, &str), Vec<(u32, usize)>> = HashMap::new();
        for (i, t) in tasks.iter().enumerate().filter(|(_, t)| !t.removed) {
            by_step
                .entry((&t.item, &t.step))
                .or_default()
                .push((t.idx, i));
        }
        for list in by_step.values_mut() {
            list.sort_unstable();
        }
        let inputs: Vec<Vec<Input>> = tasks
            .iter()
            .map(|t| t.inputs.iter().map(|s| resolve(&by_step, s)).collect())
            .collect();
        let mut chains: Vec<Chain> = Vec::new();
        let mut chain_of: HashMap<&str, usize> = HashMap::new();
        let mut members: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut children: HashMap<usize, Vec<(u32, usize)>> = HashMap::new();
        for (i, t) in tasks.iter().enumerate().filter(|(_, t)| !t.removed) {
            members.entry(&t.item).or_default().push(i);
            let parent = inputs[i].iter().find_map(|input| match input {
                Input::Output { task, k } if tasks[*task].item == t.item => Some((*task, *k)),
                _ => None,
            });
            match parent {
                Some((task, k)) => children.entry(task).or_default().push((k, i)),
                None => match chain_of.get(t.item.as_str()) {
                    Some(&c) => chains[c].roots.push(i),
                    None => {
                        chain_of.insert(&t.item, chains.len());
                        chains.push(Chain {
                            id: t.item.clone(),
                            roots: vec![i],
                            tasks: Vec::new(),
                        });
                    }
                },
            }
        }
        for chain in &mut chains {
            chain.tasks = members.remove(chain.id.as_str()).unwrap_or_default();
        }
        // The batch's chain first: items read it.
        chains.sort_by_key(|c| c.id != layout::BATCH);
        Lineage {
            chains,
            inputs,
            children,
        }
    }

    /// Which step reads which among `tasks` (those the lineage was built from).
    pub(super) fn reads<'a>(
        &'a self,
        tasks: &'a [ReportTask],
    ) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        step_reads(tasks, &self.inputs)
    }

    /// The tasks under output `k` of `task`, or under any of its outputs.
    pub(super) fn children(&self, task: usize, k: Option<u32>) -> Vec<usize> {
        self.children.get(&task).map_or_else(Vec::new, |list| {
            list.iter()
                .filter(|(kk, _)| k.is_none_or(|k| k == *kk))
                .map(|(_, child)| *child)
                .collect()
        })
    }

    /// The inputs of `task` other than the output it hangs under.
    pub(super) fn other_inputs(&self, task: usize, tasks: &[ReportTask]) -> Vec<&Input> {
        let mut skipped = false;
        self.inputs[task]
            .iter()
            .filter(|input| match input {
                Input::Output { task: p, .. } if !skipped && tasks[*p].item == tasks[task].item => {
                    skipped = true;
                    false
                }
                _ => true,
            })
            .collect()
    }
}

/// `item/step[index]` to the task making that output: the one of that step with the highest
/// first index not above it (a generate task makes indexes idx..idx+n).
fn resolve(by_step: &HashMap<(&str, &str), Vec<(u32, usize)>>, s: &str) -> Input {
    if s.contains("://") {
        return Input::Url(s.to_owned());
    }
    let Ok(TaskKey { item, step, index }) = s.parse::<TaskKey>() else {
        return Input::Unknown(s.to_owned());
    };
    by_step
        .get(&(item.as_str(), step.as_str()))
        .and_then(|list| list.iter().rev().find(|(idx, _)| *idx <= index))
        .map_or_else(
            || Input::Unknown(s.to_owned()),
            |&(idx, task)| Input::Output {
                task,
                k: index - idx,
            },
        )
}

/// Which step reads which: `(from, to)` for every task reading another step's output.
fn step_reads<'a>(
    tasks: &'a [ReportTask],
    inputs: &'a [Vec<Input>],
) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    tasks
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.removed)
        .flat_map(move |(i, t)| {
            inputs[i].iter().filter_map(move |input| match input {
                Input::Output { task, .. } if tasks[*task].step != t.step => {
                    Some((tasks[*task].step.as_str(), t.step.as_str()))
                }
                _ => None,
            })
        })
}

/// `steps` (in the order first recorded) reordered so that each comes after the steps it
/// reads, by the `(from, to)` pairs of `reads`.
pub(super) fn order<'a, S: AsRef<str>>(
    steps: &[S],
    reads_pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<String> {
    let steps: Vec<&str> = steps.iter().map(AsRef::as_ref).collect();
    let pos = |s: &str| steps.iter().position(|x| *x == s);
    let mut reads = vec![Vec::new(); steps.len()];
    for (from, to) in reads_pairs {
        if let (Some(from), Some(to)) = (pos(from), pos(to))
            && from != to
            && !reads[to].contains(&from)
        {
            reads[to].push(from);
        }
    }
    let mut done = vec![false; steps.len()];
    let mut order = Vec::new();
    while order.len() < steps.len() {
        // The first step whose inputs are all placed; a cycle (impossible in a checked
        // pipeline) falls back to record order.
        let next = (0..steps.len())
            .find(|&s| !done[s] && reads[s].iter().all(|&r| done[r]))
            .or_else(|| (0..steps.len()).find(|&s| !done[s]))
            .unwrap_or(0);
        done[next] = true;
        order.push(steps[next].to_owned());
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TaskStatus;

    /// Steps in an order where every step comes after those it reads, ties by first record.
    fn steps(tasks: &[ReportTask]) -> Vec<String> {
        let mut recorded: Vec<&str> = Vec::new();
        for t in tasks.iter().filter(|t| !t.removed) {
            if !recorded.contains(&t.step.as_str()) {
                recorded.push(&t.step);
            }
        }
        order(&recorded, Lineage::build(tasks).reads(tasks))
    }

    fn task(item: &str, step: &str, idx: u32, inputs: &[&str]) -> ReportTask {
        ReportTask {
            id: crate::store::TaskId::new(1).unwrap(),
            item: item.into(),
            step: step.into(),
            idx,
            operation: "erase".into(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            status: TaskStatus::Succeeded,
            planned_credits: 2,
            credits_billed: 2,
            job_id: None,
            error: None,
            removed: false,
            reused_from_run: None,
            attempts: 1,
            request: None,
        }
    }

    #[test]
    fn fan_out_hangs_each_chain_under_its_own_output() {
        let tasks = vec![
            task("mug", "shot", 0, &[]),
            task("mug", "clean", 0, &["mug/shot[0]"]),
            task("mug", "clean", 1, &["mug/shot[1]"]),
            task("mug", "big", 0, &["mug/clean[0]"]),
            task("mug", "big", 1, &["mug/clean[1]"]),
        ];
        let l = Lineage::build(&tasks);
        assert_eq!(l.chains.len(), 1);
        assert_eq!(l.chains[0].roots, vec![0]);
        assert_eq!(l.children(0, Some(0)), vec![1]);
        assert_eq!(l.children(0, Some(1)), vec![2]);
        assert_eq!(l.children(0, None), vec![1, 2]);
        assert_eq!(l.children(2, Some(0)), vec![4]);
        assert_eq!(steps(&tasks), vec!["shot", "clean", "big"]);
    }

    #[test]
    fn references_from_the_batch_and_urls_are_other_inputs() {
        let tasks = vec![
            task("_batch", "style", 0, &[]),
            task("a", "cut", 0, &["https://x.test/a.png"]),
            task(
                "a",
                "join",
                0,
                &["_batch/style[1]", "a/cut[0]", "a/gone[0]"],
            ),
        ];
        let l = Lineage::build(&tasks);
        assert_eq!(
            l.chains.iter().map(|c| &c.id[..]).collect::<Vec<_>>(),
            ["_batch", "a"]
        );
        assert_eq!(l.children(1, Some(0)), vec![2]);
        let others = l.other_inputs(2, &tasks);
        assert_eq!(
            others,
            [
                &Input::Output { task: 0, k: 1 },
                &Input::Unknown("a/gone[0]".into())
            ]
        );
        assert_eq!(
            l.other_inputs(1, &tasks),
            [&Input::Url("https://x.test/a.png".into())]
        );
    }

    #[test]
    fn steps_are_ordered_producers_first_whatever_the_record_order() {
        let tasks = vec![
            task("a", "late", 0, &["a/early[0]"]),
            task("a", "early", 0, &[]),
        ];
        assert_eq!(steps(&tasks), vec!["early", "late"]);
    }
}
