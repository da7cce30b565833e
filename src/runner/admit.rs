//! The checks of a saved plan, what reuse saves of a plan, and what a run spent so far.
//! Whether a run may start within the budget and the balance is [`crate::money::admit`]'s.

use std::path::Path;

use crate::error::Error;
use crate::money::{self, Expected};
use crate::plan::document::{FORMAT, KIND, PlanDocument, ReuseEstimate};
use crate::plan::graph::Graph;
use crate::resume::Review;
use crate::run_id::RunId;
use crate::store::Store;

/// A saved plan (`imgpipe plan --save`), refused unless it is one this imgpipe reads.
pub fn read_plan(path: &Path) -> Result<PlanDocument, Error> {
    let text = std::fs::read(path).map_err(|e| {
        Error::usage(
            format!("cannot read the plan {}: {e}", path.display()),
            None,
        )
    })?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| Error::usage(format!("{} is not JSON: {e}", path.display()), None))?;
    if value.get("kind").and_then(|k| k.as_str()) != Some(KIND) {
        return Err(Error::usage(
            format!("{} is not an imgpipe plan", path.display()),
            Some("save one with `imgpipe plan FILE --save PLAN.json`"),
        ));
    }
    if value.get("format").and_then(|f| f.as_u64()) != Some(u64::from(FORMAT)) {
        return Err(Error::usage(
            format!(
                "{} is a plan in a format this imgpipe does not read",
                path.display()
            ),
            Some("make the plan again with this imgpipe"),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| Error::usage(format!("{}: {e}", path.display()), None))
}

/// Refuses a run whose pipeline, items or prices differ from the saved plan's.
pub fn same_as_saved(saved: &PlanDocument, now: &PlanDocument) -> Result<(), Error> {
    let mut changed = Vec::new();
    if saved.pipeline.sha256 != now.pipeline.sha256 {
        changed.push(format!("the pipeline file {} changed", now.pipeline.file));
    }
    if saved.items.sha256 != now.items.sha256 {
        changed.push(format!(
            "the items changed ({} then, {} now)",
            saved.items.count, now.items.count
        ));
    }
    if saved.prices.sha256 != now.prices.sha256 {
        let show = |d: &PlanDocument| {
            d.prices
                .generation
                .credits
                .map_or_else(|| "unknown".to_owned(), |c| c.to_string())
        };
        changed.push(format!(
            "the prices changed (a generated image: {} then, {} now)",
            show(saved),
            show(now)
        ));
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(Error::Refused {
        message: format!(
            "the saved plan (made {}) no longer holds: {}",
            saved.created_at,
            changed.join("; ")
        ),
        hint: Some("plan again with `imgpipe plan FILE --save PLAN.json` and review it".into()),
    })
}

/// What a fresh run confirms ([`money::gate::with_saved`]).
pub fn expected(flags: &Expected, saved: Option<&PlanDocument>) -> Result<Expected, Error> {
    money::gate::with_saved(flags, saved.map(PlanDocument::revision)).map_err(|e| {
        Error::usage(
            e.to_string(),
            Some("give one: the saved plan carries its own revision"),
        )
    })
}

/// The gate of a fresh run ([`money::gate::check_plan`]), passed once its lock is held (and
/// before, for a saved plan); a saved plan that no longer holds says what changed in it.
pub fn gate(
    doc: &PlanDocument,
    expect: &Expected,
    saved: Option<&PlanDocument>,
) -> Result<(), Error> {
    let checked = money::gate::check_plan(expect, doc.credits_to_pay(), doc.revision());
    match (checked, saved) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(saved)) if same_as_saved(saved, doc).is_err() => same_as_saved(saved, doc),
        (Err(money::gate::Refusal::Stale(stale)), _) => Err(stale.into()),
        (Err(unpriced), _) => Err(Error::Refused {
            message: unpriced.to_string(),
            hint: Some(
                "set the price of a 2K generated image in the pipeline file (`pricing: { generation: N }`)"
                    .into(),
            ),
        }),
    }
}

/// What reusing earlier runs' results saves of the plan.
pub fn estimate(doc: &PlanDocument, review: &Review, graph: &Graph) -> ReuseEstimate {
    let saved = review.saved_by_reuse(graph);
    ReuseEstimate {
        tasks: review.reuse.len(),
        credits_saved: saved,
        credits_to_pay: doc.costs.total_credits.map(|t| t.saturating_sub(saved)),
    }
}

/// What the run was billed, plus what its unanswered calls may have cost: a budget is never
/// paid twice for them.
pub async fn spent(store: &Store, run_id: &RunId) -> Result<u64, Error> {
    Ok(store.runs().spent(run_id).await?)
}
