//! The DAG: cycles, the `once` rule, the reference-image limit, the order inputs-first.

use super::*;

/// Images per instance of step `i`, memoised in `memo`; `None` through a cycle or a broken step.
fn outputs_of(
    i: usize,
    drafts: &[Draft<'_>],
    memo: &mut [Option<u64>],
    visiting: &mut [bool],
) -> Option<u64> {
    if memo[i].is_some() || visiting[i] {
        return memo[i];
    }
    visiting[i] = true;
    let n = match &drafts[i].op {
        Some(Operation::Generate(g)) => Some(u64::from(g.n)),
        Some(Operation::Tool(Tool {
            input: Input::Step(s),
            ..
        })) => outputs_of(s.0, drafts, memo, visiting),
        Some(Operation::Tool(_)) => Some(1),
        None => None,
    };
    visiting[i] = false;
    memo[i] = n;
    n
}

impl Checker<'_> {
    /// Cycles, the `once` rule and the reference-image limit; the order inputs-first when the
    /// graph is sound. Each check runs on whatever could be resolved, so one problem does not
    /// hide another.
    pub(super) fn graph(&mut self, drafts: &[Draft<'_>]) -> Option<Vec<usize>> {
        let (order, acyclic) = self.topological(drafts);
        for d in drafts {
            for (r, at) in &d.refs {
                let from = &drafts[r.0];
                if d.once && !from.once {
                    self.error(
                        at.mark,
                        format!(
                            "step {} runs once for the whole batch (`once: true`) but reads per-item step {}",
                            shown(&d.id),
                            shown(&from.id)
                        ),
                    );
                }
            }
        }
        // Images per instance, where they can be known (not through a cycle or a broken step).
        let mut outputs: Vec<Option<u64>> = vec![None; drafts.len()];
        let mut visiting = vec![false; drafts.len()];
        for i in 0..drafts.len() {
            outputs_of(i, drafts, &mut outputs, &mut visiting);
        }
        for d in drafts {
            if let Some(Operation::Generate(g)) = &d.op {
                self.reference_limit(d, g, drafts, &outputs);
            }
        }
        let sound = acyclic && drafts.iter().all(|d| d.op.is_some());
        (sound && self.report.is_ok()).then_some(order)
    }

    fn reference_limit(
        &mut self,
        d: &Draft<'_>,
        g: &Generate,
        drafts: &[Draft<'_>],
        outputs: &[Option<u64>],
    ) {
        let mut total = 0;
        let mut parts = Vec::new();
        for r in &g.references {
            match r {
                Reference::Url(_) => total += 1,
                Reference::Step(s) => {
                    let Some(n) = outputs[s.0] else { return };
                    total += n;
                    parts.push(format!("{n} from {}", shown(&drafts[s.0].id)));
                }
            }
        }
        if total <= MAX_REFERENCE_IMAGES as u64 {
            return;
        }
        let op = d.node.get("generate").unwrap_or(d.node);
        let mark = mark_of(op.key("image_urls"), op);
        let listed = g
            .references
            .iter()
            .filter(|r| matches!(r, Reference::Url(_)))
            .count();
        parts.insert(0, format!("{listed} listed"));
        self.error(
            mark,
            format!(
                "image_urls adds up to {total} reference images ({}); the limit is {MAX_REFERENCE_IMAGES}",
                parts.join(", ")
            ),
        );
    }

    /// Depth-first order with inputs first; each cycle is reported with its path.
    fn topological(&mut self, drafts: &[Draft<'_>]) -> (Vec<usize>, bool) {
        #[derive(Clone, Copy, PartialEq)]
        enum State {
            New,
            Open,
            Done,
        }
        let mut state = vec![State::New; drafts.len()];
        let mut order = Vec::with_capacity(drafts.len());
        let mut cycles: Vec<Vec<usize>> = Vec::new();
        for start in 0..drafts.len() {
            if state[start] != State::New {
                continue;
            }
            // (step, next input to visit)
            let mut stack = vec![(start, 0usize)];
            state[start] = State::Open;
            while let Some((node, next)) = stack.last().copied() {
                let inputs = &drafts[node].refs;
                if next < inputs.len() {
                    stack.last_mut().expect("non-empty").1 += 1;
                    let child = inputs[next].0.0;
                    match state[child] {
                        State::New => {
                            state[child] = State::Open;
                            stack.push((child, 0));
                        }
                        State::Open => {
                            let from = stack.iter().position(|(s, _)| *s == child).unwrap_or(0);
                            cycles.push(stack[from..].iter().map(|(s, _)| *s).collect());
                        }
                        State::Done => {}
                    }
                } else {
                    state[node] = State::Done;
                    order.push(node);
                    stack.pop();
                }
            }
        }
        let mut seen = HashSet::new();
        for cycle in cycles {
            let mut key = cycle.clone();
            key.sort_unstable();
            if !seen.insert(key) {
                continue;
            }
            // Written in the direction data flows: input → step that reads it.
            let mut names: Vec<String> = cycle
                .iter()
                .rev()
                .map(|i| format!("`{}`", drafts[*i].id))
                .collect();
            names.push(names[0].clone());
            let first = &drafts[*cycle.iter().min().unwrap_or(&0)];
            let mark = mark_of(first.node.get("id"), first.node);
            self.error(mark, format!("steps form a cycle: {}", names.join(" → ")))
                .hint = Some("a step cannot read, directly or not, its own output".into());
        }
        (order, seen.is_empty())
    }

    /// Warns of a per-item edit that uses nothing from its item: every item would pay for the
    /// very same call.
    pub(super) fn repeated_work(&mut self, drafts: &[Draft<'_>]) {
        for d in drafts.iter().filter(|d| !d.once) {
            let Some(Operation::Tool(tool)) = &d.op else {
                continue;
            };
            let shared_input = match &tool.input {
                Input::Url(t) => t.is_literal(),
                Input::Step(s) => drafts[s.0].once,
            };
            if shared_input && d.texts.iter().all(|(t, _, _)| t.is_literal()) {
                let mark = mark_of(d.node.get("id"), d.node);
                self.report.warn(
                    Diagnostic::new(self.file, mark, format!(
                        "step {} runs once per item but uses nothing from the item, so every item pays for the same edit",
                        shown(&d.id)
                    ))
                    .hint("mark it `once: true` to run it a single time"),
                );
            }
        }
    }
}

/// The steps in `order`, with references renumbered to match.
pub(super) fn reorder(drafts: Vec<Draft<'_>>, order: &[usize]) -> Vec<Step> {
    let mut new_index = vec![0; drafts.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    let remap = |r: StepRef| StepRef(new_index[r.0]);
    let mut slots: Vec<Option<Step>> = drafts
        .into_iter()
        .map(|d| {
            let line = d.node.mark.line;
            let op = match d.op.expect("a sound graph has every operation") {
                Operation::Generate(mut g) => {
                    for r in &mut g.references {
                        if let Reference::Step(s) = r {
                            *s = remap(*s);
                        }
                    }
                    Operation::Generate(g)
                }
                Operation::Tool(mut t) => {
                    if let Input::Step(s) = &mut t.input {
                        *s = remap(*s);
                    }
                    Operation::Tool(t)
                }
            };
            Some(Step {
                id: d.id,
                once: d.once,
                op,
                line,
                checks: d.checks,
            })
        })
        .collect();
    order.iter().filter_map(|&old| slots[old].take()).collect()
}
