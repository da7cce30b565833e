//! A review as `resume --dry-run` and `reroll --dry-run` show it, and as the review desk's
//! API answers it: one document, made here for both.

use std::collections::BTreeMap;

use serde_json::json;

use crate::resume::Reason;
use crate::runner::Reviewed;
use crate::task_key::TaskKey;

impl Reviewed<'_> {
    /// Tasks to pay for and their credits, summed by reason, each named by `name` (the
    /// text's words, [`Reason::as_str`], or JSON's, [`Reason::key`]).
    pub fn by_reason(
        &self,
        name: fn(Reason) -> &'static str,
    ) -> BTreeMap<&'static str, (usize, u64)> {
        let Reviewed { graph, review, .. } = self;
        let mut by_reason: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
        for r in review.each_redo(graph) {
            let e = by_reason.entry(name(r.reason)).or_default();
            e.0 += 1;
            e.1 += r.credits;
        }
        by_reason
    }

    /// The review whole, for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        let by_reason = self.by_reason(Reason::key);
        let Reviewed {
            row,
            graph,
            review,
            limit,
            caps,
            ..
        } = self;
        let name = |t: usize| graph.key(t).to_string();
        let caps: Vec<_> = caps
            .iter()
            .map(|c| json!({"name": c.name, "left": c.left, "window_end": c.window_end}))
            .collect();
        let tasks: Vec<_> = review
            .each_redo(graph)
            .map(|r| {
                let TaskKey { item, step, index } = graph.key(r.task);
                json!({"item": item, "step": step, "index": index, "reason": r.reason,
                   "credits": r.credits, "detail": r.detail})
            })
            .collect();
        let left: Vec<_> = review
            .left_failed
            .iter()
            .map(|r| {
                json!({"task": name(r.task), "credits": r.credits, "detail": r.detail,
                "why": r.left_because()})
            })
            .collect();
        json!({
            "run_id": row.id,
            "status": row.status.as_str(),
            "tasks": tasks,
            "credits": review.credits(),
            "revision": self.priced.revision,
            "by_reason": by_reason.iter().map(|(k, (n, c))| (k.to_string(), json!({"tasks": n, "credits": c}))).collect::<serde_json::Map<_, _>>(),
            "limit": limit,
            "caps": caps,
            "kept": review.kept.len(),
            "recover_by_job_id": review.recover.len(),
            "refetch": review.refetch.iter().map(|r| json!({"path": r.output.path, "modified": r.modified.is_some()})).collect::<Vec<_>>(),
            "reused": review.reuse.len(),
            "saved_by_reuse": review.saved_by_reuse(graph),
            "left_failed": left,
            "removed": review.removed.len(),
        })
    }
}
