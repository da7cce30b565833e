//! What changed in a pipeline since its run was recorded, in a sentence: what
//! `--allow-changes` would run again and what it costs.

use std::collections::{BTreeMap, BTreeSet};

use crate::pipeline::Pipeline;
use crate::plan::graph::Graph;

use super::{Reason, Review};

/// A short account of what changed: steps and items added, removed or changed, and what
/// that costs.
pub(super) fn describe_changes(
    old: &Pipeline,
    new: &Pipeline,
    graph: &Graph,
    review: &Review,
) -> String {
    let ids = |p: &Pipeline| -> BTreeSet<String> { p.steps.iter().map(|s| s.id.clone()).collect() };
    let (before, after) = (ids(old), ids(new));
    let mut parts = Vec::new();
    let list = |set: Vec<&String>| {
        set.iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let added: Vec<&String> = after.difference(&before).collect();
    if !added.is_empty() {
        parts.push(format!("step(s) {} added", list(added)));
    }
    let removed: Vec<&String> = before.difference(&after).collect();
    if !removed.is_empty() {
        parts.push(format!("step(s) {} removed", list(removed)));
    }
    let mut by_step: BTreeMap<&str, usize> = BTreeMap::new();
    for r in review.redo.iter().filter(|r| r.reason == Reason::Changed) {
        let step = graph.step_id(r.task);
        if before.contains(step) {
            *by_step.entry(step).or_default() += 1;
        }
    }
    for (step, n) in by_step {
        parts.push(format!("step `{step}` asks something else of {n} task(s)"));
    }
    let items =
        |p: &Pipeline| -> BTreeSet<String> { p.items.iter().map(|i| i.id.clone()).collect() };
    let (was, is) = (items(old), items(new));
    let (gained, lost) = (is.difference(&was).count(), was.difference(&is).count());
    if gained + lost > 0 {
        parts.push(format!("{gained} item(s) added, {lost} removed"));
    }
    if parts.is_empty() {
        parts.push("the file's text differs, but no task changed".into());
    }
    format!(
        "{}; {} task(s) would run again for {}, {} keep their results, {} recorded task(s) would be dropped",
        parts.join("; "),
        review.to_pay(),
        crate::money::credits(review.credits()),
        review.kept.len(),
        review.removed.len()
    )
}
