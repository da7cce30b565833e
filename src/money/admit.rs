//! Admission: whether a run may start within its budget and the balance, judged on its plan.
//! Nothing here spends; every "no" is a [`Refused`] with the figures (exit 3).

use serde::{Deserialize, Serialize};

use crate::money::limit::{Balance, Budget, Limit};

/// Whether the run may start, and if not, every reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub fits: bool,
    pub reasons: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl Verdict {
    /// Judges a plan whose priced tasks cost `known_credits`, with `unpriced_steps` the steps
    /// it could not price (then the total is at least that).
    pub fn judge(
        known_credits: u64,
        unpriced_steps: &[String],
        budget: Option<&Budget>,
        balance: &Balance,
    ) -> Verdict {
        let mut reasons = Vec::new();
        let mut warnings = Vec::new();
        let total = known_credits;
        let at_least = if unpriced_steps.is_empty() {
            ""
        } else {
            "at least "
        };
        if !unpriced_steps.is_empty() {
            reasons.push(format!(
                "the generation price is unknown, so the total is not known (steps: {})",
                unpriced_steps.join(", ")
            ));
        }
        if let Some(b) = budget
            && total > b.max_credits
        {
            reasons.push(format!(
                "the plan costs {at_least}{}, over the budget of {} ({})",
                super::credits(total),
                b.max_credits,
                b.source
            ));
        }
        match balance {
            Balance::Known { credits, .. } if i128::from(total) > i128::from(*credits) => {
                reasons.push(format!(
                    "the plan costs {at_least}{}, more than the balance of {credits}",
                    super::credits(total)
                ));
            }
            Balance::Known { .. } => {}
            Balance::Unknown { reason } => {
                warnings.push(format!("the balance was not checked: {reason}"));
            }
            Balance::NotChecked => {
                warnings.push("the balance was not checked (--offline)".into());
            }
        }
        Verdict {
            fits: reasons.is_empty(),
            reasons,
            warnings,
        }
    }
}

/// What admission reads of a plan.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    pub verdict: &'a Verdict,
    /// What the plan costs; `None` when a price is unknown.
    pub total: Option<u64>,
    /// What reusing earlier runs' results saves of it.
    pub saved_by_reuse: u64,
    pub budget: Option<&'a Budget>,
    pub balance: &'a Balance,
}

/// A run refused before anything was paid for (exit 3).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    pub message: String,
    pub hint: String,
}

impl Claim<'_> {
    fn refused(&self, hint: &str) -> Refused {
        Refused {
            message: format!("the run does not fit: {}", self.verdict.reasons.join("; ")),
            hint: hint.to_owned(),
        }
    }
}

/// The plan's verdict as a refusal when it does not fit.
pub fn refusal(claim: &Claim<'_>) -> Result<(), Refused> {
    if claim.verdict.fits {
        return Ok(());
    }
    Err(claim.refused(if claim.total.is_none() {
        "set the price of a 2K generated image in the pipeline file: `pricing: { generation: N }`"
    } else {
        "raise budget.max_credits or --max-credits, top up the account, or plan fewer items"
    }))
}

/// The plan's verdict, except that credits saved by reuse count: a run whose reused tasks
/// bring it within the budget and the balance may start.
pub fn refusal_after_reuse(claim: &Claim<'_>) -> Result<(), Refused> {
    let saved = claim.saved_by_reuse;
    if claim.verdict.fits || saved == 0 {
        return refusal(claim);
    }
    let Some(total) = claim.total else {
        return refusal(claim);
    };
    let needed = total.saturating_sub(saved);
    match Limit::of(claim.budget, claim.balance, 0).credits() {
        Some(limit) if needed > limit => refusal(claim),
        _ => Ok(()),
    }
}

/// Whether to discover the generation price: only when it alone stops the run. `flag`:
/// whether `--discover-price` was given.
pub fn needs_discovery(claim: &Claim<'_>, flag: bool) -> Result<bool, Refused> {
    let unknown = claim.total.is_none();
    if unknown && !flag {
        return Err(claim.refused(
            "set the price of a 2K generated image in the pipeline file (`pricing: { generation: N }`), or pass --discover-price to learn it from one generation",
        ));
    }
    Ok(unknown && claim.verdict.reasons.len() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim<'a>(verdict: &'a Verdict, budget: &'a Budget, balance: &'a Balance) -> Claim<'a> {
        Claim {
            verdict,
            total: Some(120),
            saved_by_reuse: 0,
            budget: Some(budget),
            balance,
        }
    }

    #[test]
    fn a_plan_over_the_budget_is_refused_unless_reuse_brings_it_within() {
        let budget = Budget {
            max_credits: 100,
            source: "--max-credits".into(),
        };
        let balance = Balance::NotChecked;
        let verdict = Verdict::judge(120, &[], Some(&budget), &balance);
        assert!(!verdict.fits);
        let over = claim(&verdict, &budget, &balance);
        let refused = refusal(&over).unwrap_err();
        assert_eq!(
            refused.message,
            "the run does not fit: the plan costs 120 credits, over the budget of 100 (--max-credits)"
        );
        assert_eq!(refusal_after_reuse(&over), Err(refused));
        let reused = Claim {
            saved_by_reuse: 20,
            ..over
        };
        assert_eq!(refusal_after_reuse(&reused), Ok(()));
        let short = Claim {
            saved_by_reuse: 19,
            ..over
        };
        assert!(refusal_after_reuse(&short).is_err());
    }

    #[test]
    fn an_unknown_price_is_discovered_only_when_asked_and_alone_in_the_way() {
        let balance = Balance::NotChecked;
        let unpriced = ["shot".to_owned()];
        let verdict = Verdict::judge(10, &unpriced, None, &balance);
        let unknown = Claim {
            verdict: &verdict,
            total: None,
            saved_by_reuse: 0,
            budget: None,
            balance: &balance,
        };
        assert!(needs_discovery(&unknown, false).is_err());
        assert_eq!(needs_discovery(&unknown, true), Ok(true));
        assert!(refusal(&unknown).unwrap_err().hint.contains("pricing"));
    }
}
