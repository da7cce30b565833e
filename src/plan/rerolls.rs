//! What paying again for outputs that fail a check may cost, priced before the night like
//! everything else: the worst case (every checked task failing `max_rerolls` times, capped at
//! `rerolls.max_credits`) and, when earlier runs judged the same checks, the expected case
//! from how often they failed. A reroll pays for its task alone: checks run before any
//! downstream task uses an output, so nothing downstream of a failed output is ever paid.

use serde::{Deserialize, Serialize};

use crate::pipeline::checks::OnFail;
use crate::pipeline::{Pipeline, StepRef};
use crate::plan::Costs;
use crate::store::{PassRate, Store, StoreError};

/// The rerolls' figures of a plan, beside its total (`plan --json`'s `rerolls`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RerollCosts {
    pub worst_case_credits: u64,
    /// `None` until the state database has judged every rerolling step's checks before.
    pub expected_credits: Option<u64>,
}

/// The steps that pay again for failed outputs, with their `max_rerolls`.
fn rerolling(pipeline: &Pipeline) -> impl Iterator<Item = (StepRef, u32)> + '_ {
    pipeline.step_refs().filter_map(|r| {
        let checks = pipeline.step(r).checks.as_ref()?;
        (checks.on_fail == OnFail::Reroll).then_some((r, checks.max_rerolls))
    })
}

/// The rerolls' figures; `None` when no step rerolls. `fail_share(step)` is the share of
/// the step's tasks' judgements that failed its checks in earlier runs, when there were any.
pub fn costs(
    pipeline: &Pipeline,
    costs: &Costs,
    fail_share: impl Fn(StepRef) -> Option<f64>,
) -> Option<RerollCosts> {
    let cap = pipeline.rerolls?.max_credits;
    let steps: Vec<(StepRef, u32)> = rerolling(pipeline).collect();
    if steps.is_empty() {
        return None;
    }
    // A step without a known price could cost anything: the cap is its worst case.
    let subtotal = |r: StepRef| costs.steps.get(r.0).and_then(|s| s.subtotal);
    let worst = steps.iter().try_fold(0u64, |sum, &(r, max)| {
        Some(sum.saturating_add(subtotal(r)?.saturating_mul(u64::from(max))))
    });
    let expected = steps.iter().try_fold(0.0f64, |sum, &(r, max)| {
        Some(sum + subtotal(r)? as f64 * expected_rerolls(fail_share(r)?, max))
    });
    Some(RerollCosts {
        worst_case_credits: worst.map_or(cap, |w| w.min(cap)),
        expected_credits: expected.map(|e| (e.round() as u64).min(cap)),
    })
}

/// The rerolls' figures with the expected case read from the state database: how often the
/// tasks of each rerolling step failed its checks in earlier runs, found under the key the
/// checks' verdicts are recorded by ([`crate::pipeline::checks::StepChecks::key`]), so that
/// changing a check's settings starts afresh.
pub async fn expected(
    store: &Store,
    pipeline: &Pipeline,
    priced: &Costs,
) -> Result<Option<RerollCosts>, StoreError> {
    let mut shares = vec![None; pipeline.step_refs().count()];
    for (r, _) in rerolling(pipeline) {
        let step = pipeline.step(r);
        let Some(checks) = &step.checks else {
            continue;
        };
        let key = checks.key(&pipeline.name, &step.id);
        shares[r.0] = store.verdicts().pass_rate(&key).await?.map(fail_share);
    }
    Ok(costs(pipeline, priced, |r| {
        shares.get(r.0).copied().flatten()
    }))
}

/// The share of a task's judgements that failed: each is a reroll when one is left.
fn fail_share(rate: PassRate) -> f64 {
    rate.failed as f64 / rate.judged.max(1) as f64
}

/// Rerolls a task is expected to take when a share `f` of outputs fail and it may be paid
/// again `max` times: it is rerolled once when its output fails, again when that one fails
/// too, and so on, `f + f² + … + f^max`.
fn expected_rerolls(f: f64, max: u32) -> f64 {
    let f = f.clamp(0.0, 1.0);
    (1..=max).map(|k| f.powi(k as i32)).sum()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::plan::GenerationPrice;

    fn pipeline(text: &str) -> Pipeline {
        let head = "version: 1\nname: r\npricing: { generation: 4 }\nitems:\n  - { id: a }\n  - { id: b }\n";
        let loaded = crate::pipeline::load_str("p.yaml", Path::new("."), &format!("{head}{text}"));
        loaded
            .pipeline
            .unwrap_or_else(|| panic!("{:?}", loaded.report.errors))
    }

    fn priced(p: &Pipeline) -> Costs {
        let generation =
            GenerationPrice::resolve(p, crate::plan::ModelsAnswer::NotAsked("offline"));
        Costs::of(p, &generation)
    }

    const CHAIN: &str = concat!(
        "steps:\n",
        "  - id: shot\n",
        "    generate: { prompt: a mug, n: 2 }\n",
        "    checks: [not_blank]\n",
        "    max_rerolls: 2\n",
        "  - id: cutout\n",
        "    remove_background: { from: shot }\n",
        "    checks: [transparent]\n",
        "  - id: big\n",
        "    upscale: { from: cutout, desired_increase: 2 }\n",
        "    checks: [size]\n",
        "    on_fail: flag\n",
    );

    #[test]
    fn the_worst_case_is_every_checked_task_failing_each_time_up_to_the_cap() {
        // shot: 2 tasks × 8 credits × 2 rerolls = 32; cutout: 4 tasks × 5 × 1 = 20; big flags.
        let p = pipeline(&format!("rerolls: {{ max_credits: 100 }}\n{CHAIN}"));
        let r = costs(&p, &priced(&p), |_| None).unwrap();
        assert_eq!(
            r,
            RerollCosts {
                worst_case_credits: 52,
                expected_credits: None
            }
        );
        let p = pipeline(&format!("rerolls: {{ max_credits: 40 }}\n{CHAIN}"));
        assert_eq!(
            costs(&p, &priced(&p), |_| None).unwrap().worst_case_credits,
            40
        );
    }

    #[test]
    fn the_expected_case_follows_the_recorded_failures() {
        let p = pipeline(&format!("rerolls: {{ max_credits: 100 }}\n{CHAIN}"));
        // shot: 16 × (0.5 + 0.25) = 12; cutout: 20 × 0.1 = 2.
        let share = |r: StepRef| Some(if r.0 == 0 { 0.5 } else { 0.1 });
        assert_eq!(
            costs(&p, &priced(&p), share).unwrap().expected_credits,
            Some(14)
        );
        let only_shot = |r: StepRef| (r.0 == 0).then_some(0.5);
        assert_eq!(
            costs(&p, &priced(&p), only_shot).unwrap().expected_credits,
            None
        );
    }

    #[test]
    fn a_pipeline_that_never_rerolls_has_no_figures() {
        let p = pipeline("steps:\n  - id: shot\n    generate: { prompt: a mug }\n");
        assert_eq!(costs(&p, &priced(&p), |_| Some(1.0)), None);
        let flagged = "steps:\n  - id: shot\n    generate: { prompt: a mug }\n    checks: [not_blank]\n    on_fail: flag\n";
        let p = pipeline(&format!("rerolls: {{ max_credits: 9 }}\n{flagged}"));
        assert_eq!(costs(&p, &priced(&p), |_| Some(1.0)), None);
    }
}
