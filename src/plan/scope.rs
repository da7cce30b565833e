//! What a run is asked to pay for now, when it is not everything: some items (`--items`), the
//! steps up to one (`--until`), or chosen tasks and what they feed (`reroll`). The run records
//! its whole pipeline as always; a task outside the scope is left pending, for a later
//! `resume` (or the same `run --run-id`) to pay for. The plan prices the scope, and says what
//! the whole file would cost.

use std::collections::BinaryHeap;
use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::pipeline::items::Items;
use crate::pipeline::{Input, Operation, Pipeline, Reference, StepRef};
use crate::plan::graph::{Graph, Instance};

/// `--items`: which items a run takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ItemSelector {
    /// Ids and shell-style globs (`mug`, `lamp-*`, `sku-10?`), comma separated.
    Named(Vec<String>),
    /// The first N items, in the file's order.
    First(usize),
    /// N items picked by a seed: the same seed picks the same items, whatever their order in
    /// the file. `None` until [`ItemSelector::seeded`] draws one.
    Sample { n: usize, seed: Option<u64> },
}

/// Why an `--items` or `--until` cannot be taken.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ScopeError {
    pub message: String,
    pub hint: Option<String>,
}

impl ScopeError {
    fn new(message: String, hint: Option<String>) -> ScopeError {
        ScopeError { message, hint }
    }
}

impl FromStr for ItemSelector {
    type Err = String;

    fn from_str(s: &str) -> Result<ItemSelector, String> {
        let count = |n: &str, what: &str| -> Result<usize, String> {
            match n.parse::<usize>() {
                Ok(0) | Err(_) => Err(format!(
                    "`{s}`: {what} needs a count of at least 1, e.g. {what}:5"
                )),
                Ok(n) => Ok(n),
            }
        };
        if let Some(n) = s.strip_prefix("first:") {
            return Ok(ItemSelector::First(count(n, "first")?));
        }
        if let Some(rest) = s.strip_prefix("sample:") {
            let (n, seed) = match rest.split_once(':') {
                Some((n, seed)) => {
                    let seed = seed.parse::<u64>().map_err(|_| {
                        format!(
                            "`{s}`: the seed after sample:N: is a whole number, e.g. sample:5:1234"
                        )
                    })?;
                    (n, Some(seed))
                }
                None => (rest, None),
            };
            return Ok(ItemSelector::Sample {
                n: count(n, "sample")?,
                seed,
            });
        }
        let names: Vec<String> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        if names.is_empty() {
            return Err(
                "name items by id or glob (mug,lamp-*), or write first:N or sample:N".to_owned(),
            );
        }
        for n in &names {
            if is_glob(n) {
                glob::Pattern::new(n).map_err(|e| format!("`{n}` is not a glob: {e}"))?;
            }
        }
        Ok(ItemSelector::Named(names))
    }
}

impl fmt::Display for ItemSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ItemSelector::Named(names) => write!(f, "{}", names.join(",")),
            ItemSelector::First(n) => write!(f, "first:{n}"),
            ItemSelector::Sample { n, seed: None } => write!(f, "sample:{n}"),
            ItemSelector::Sample { n, seed: Some(s) } => write!(f, "sample:{n}:{s}"),
        }
    }
}

fn is_glob(name: &str) -> bool {
    name.contains(['*', '?', '['])
}

impl ItemSelector {
    /// The selector with a seed drawn for a sample that has none, so that it can be printed
    /// and given again to pick the same items.
    pub fn seeded(self) -> ItemSelector {
        match self {
            ItemSelector::Sample { n, seed: None } => {
                let mut bytes = [0u8; 8];
                // A seed only needs to differ between runs; a failed draw falls back to the clock.
                let seed = match getrandom::fill(&mut bytes) {
                    Ok(()) => u64::from_le_bytes(bytes) % 1_000_000_000,
                    Err(_) => {
                        let now =
                            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                        now.map_or(0, |d| u64::from(d.subsec_nanos())) % 1_000_000_000
                    }
                };
                ItemSelector::Sample {
                    n,
                    seed: Some(seed),
                }
            }
            other => other,
        }
    }

    /// By item, whether the selector takes it. A named id that no item has, or a glob that
    /// matches none, is an error naming it: a typo must not quietly run less.
    pub fn choose(&self, items: &Items) -> Result<Vec<bool>, ScopeError> {
        let mut chosen = vec![false; items.len()];
        match self {
            ItemSelector::First(n) => chosen.iter_mut().take(*n).for_each(|c| *c = true),
            ItemSelector::Sample { n, seed } => {
                // The n items of smallest sha256(seed, id): a function of the ids alone.
                let seed = seed.unwrap_or(0).to_le_bytes();
                let mut smallest: BinaryHeap<([u8; 8], usize)> = BinaryHeap::new();
                for (i, item) in items.iter().enumerate() {
                    let digest = Sha256::new()
                        .chain_update(seed)
                        .chain_update(item.id.as_bytes())
                        .finalize();
                    let mut rank = [0u8; 8];
                    rank.copy_from_slice(&digest[..8]);
                    smallest.push((rank, i));
                    if smallest.len() > *n {
                        smallest.pop();
                    }
                }
                for (_, i) in smallest {
                    chosen[i] = true;
                }
            }
            ItemSelector::Named(names) => {
                for name in names {
                    let found = if is_glob(name) {
                        select_glob(items, name, &mut chosen)
                    } else {
                        items.position(name).map(|i| chosen[i] = true).is_some()
                    };
                    if !found {
                        return Err(no_such_item(items, name));
                    }
                }
            }
        }
        Ok(chosen)
    }
}

/// Marks the items whose id `pattern` matches; whether any did.
fn select_glob(items: &Items, pattern: &str, chosen: &mut [bool]) -> bool {
    let Ok(glob) = glob::Pattern::new(pattern) else {
        return false;
    };
    let mut any = false;
    for (i, item) in items.iter().enumerate() {
        if glob.matches(&item.id) {
            chosen[i] = true;
            any = true;
        }
    }
    any
}

fn no_such_item(items: &Items, name: &str) -> ScopeError {
    let what = if is_glob(name) {
        format!("--items: the glob `{name}` matches no item's id")
    } else {
        format!("--items: no item has the id `{name}`")
    };
    let near = items
        .iter()
        .map(|i| i.id)
        .filter(|id| strsim::levenshtein(id, name) <= 2)
        .take(3)
        .collect::<Vec<_>>();
    let hint = if near.is_empty() {
        format!("the items are in {}", items.file)
    } else {
        format!("did you mean {}?", near.join(", "))
    };
    ScopeError::new(what, Some(hint))
}

/// The tasks a run pays for now: those of the chosen items and steps, or chosen tasks.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// By item: whether it is taken; `None` for every item.
    items: Option<Vec<bool>>,
    /// By step: whether it runs; `None` for every step.
    steps: Option<Vec<bool>>,
    /// Task numbers of the graph, sorted; `None` for every task.
    tasks: Option<Vec<usize>>,
    /// How it was asked, for messages and the plan: `--items sample:5:42 --until shot`.
    pub said: String,
    /// Items taken, when `--items` chose some ([`Scope::items_chosen`]).
    chosen_items: usize,
}

impl Scope {
    /// Every task.
    pub fn all() -> Scope {
        Scope::default()
    }

    /// The scope of `--items` and `--until` over `pipeline`; every task when neither is given.
    pub fn of(
        pipeline: &Pipeline,
        items: Option<&ItemSelector>,
        until: Option<&str>,
    ) -> Result<Scope, ScopeError> {
        let mut scope = Scope::all();
        let mut said = Vec::new();
        if let Some(selector) = items {
            let chosen = selector.choose(&pipeline.items)?;
            scope.chosen_items = chosen.iter().filter(|c| **c).count();
            scope.items = Some(chosen);
            said.push(format!("--items {selector}"));
        }
        if let Some(step) = until {
            scope.steps = Some(up_to(pipeline, step)?);
            said.push(format!("--until {step}"));
        }
        scope.said = said.join(" ");
        Ok(scope)
    }

    /// Exactly `tasks` (task numbers of a graph), as a reroll chooses them.
    pub fn tasks(mut tasks: Vec<usize>, said: String) -> Scope {
        tasks.sort_unstable();
        tasks.dedup();
        Scope {
            tasks: Some(tasks),
            said,
            ..Scope::default()
        }
    }

    pub fn is_all(&self) -> bool {
        self.items.is_none() && self.steps.is_none() && self.tasks.is_none()
    }

    /// Whether task `t` of `graph` is to be paid for now.
    pub fn contains(&self, graph: &Graph, t: usize) -> bool {
        let task = graph.task(t);
        let item = match (&self.items, task.instance) {
            (Some(items), Instance::Item(i)) => items.get(i).copied().unwrap_or(false),
            _ => true,
        };
        let step = self
            .steps
            .as_ref()
            .is_none_or(|s| s.get(task.step.0).copied().unwrap_or(false));
        let task = self
            .tasks
            .as_ref()
            .is_none_or(|ts| ts.binary_search(&t).is_ok());
        item && step && task
    }

    /// Whether step `r` runs at all in this scope (before the items are looked at).
    pub fn has_step(&self, r: StepRef) -> bool {
        self.steps
            .as_ref()
            .is_none_or(|s| s.get(r.0).copied().unwrap_or(false))
    }

    /// Whether item `i` is taken (before the steps are looked at).
    pub fn has_item(&self, i: usize) -> bool {
        self.items
            .as_ref()
            .is_none_or(|s| s.get(i).copied().unwrap_or(false))
    }

    /// Items taken, when `--items` chose some.
    pub fn items_chosen(&self) -> Option<usize> {
        self.items.as_ref().map(|_| self.chosen_items)
    }
}

/// By step, whether it is `step` or one of the steps it needs.
fn up_to(pipeline: &Pipeline, step: &str) -> Result<Vec<bool>, ScopeError> {
    let Some(last) = pipeline.steps.iter().position(|s| s.id == step) else {
        let ids: Vec<&str> = pipeline.steps.iter().map(|s| s.id.as_str()).collect();
        return Err(ScopeError::new(
            format!("--until: the pipeline has no step `{step}`"),
            Some(format!("its steps are {}", ids.join(", "))),
        ));
    };
    let mut needed = vec![false; pipeline.steps.len()];
    needed[last] = true;
    // Steps come after their inputs: one pass backwards marks every step needed.
    for r in (0..=last).rev() {
        if !needed[r] {
            continue;
        }
        for from in reads(pipeline, StepRef(r)) {
            needed[from.0] = true;
        }
    }
    Ok(needed)
}

/// The steps whose images step `r` reads.
fn reads(pipeline: &Pipeline, r: StepRef) -> Vec<StepRef> {
    match &pipeline.step(r).op {
        Operation::Tool(t) => match t.input {
            Input::Step(from) => vec![from],
            Input::Url(_) => Vec::new(),
        },
        Operation::Generate(g) => g
            .references
            .iter()
            .filter_map(|r| match r {
                Reference::Step(from) => Some(*from),
                Reference::Url(_) => None,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_read_back_as_written() {
        for text in ["first:3", "sample:5:42", "mug,lamp-*", "sample:2"] {
            assert_eq!(text.parse::<ItemSelector>().unwrap().to_string(), text);
        }
        for bad in ["first:0", "first:x", "sample:", "sample:3:x", ",", "a[b"] {
            assert!(bad.parse::<ItemSelector>().is_err(), "{bad} was taken");
        }
        let seeded = "sample:4".parse::<ItemSelector>().unwrap().seeded();
        assert!(matches!(
            seeded,
            ItemSelector::Sample {
                n: 4,
                seed: Some(_)
            }
        ));
    }
}
