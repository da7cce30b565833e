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
    /// it could not price (then the total is at least that), and whose rerolls may spend up to
    /// `rerolls` more (their worst case, 0 when no step rerolls): the total and the worst
    /// case together must fit, so that a night of bad images cannot outspend the plan.
    pub fn judge(
        known_credits: u64,
        unpriced_steps: &[String],
        rerolls: u64,
        budget: Option<&Budget>,
        balance: &Balance,
    ) -> Verdict {
        let mut reasons = Vec::new();
        let mut warnings = Vec::new();
        let total = known_credits;
        let at_worst = total.saturating_add(rerolls);
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
        let with_rerolls = |over: String, room: u64, or: &str| {
            let lower = match room {
                0 => format!(
                    "no rerolls.max_credits fits beside the total: {or}, or give the checks `on_fail: flag`"
                ),
                room => format!("lower rerolls.max_credits to {room} or {or}"),
            };
            format!(
                "the plan costs {at_least}{} and its rerolls up to {} more, {} at worst, {over}; {lower}",
                super::credits(total),
                super::credits(rerolls),
                super::credits(at_worst),
            )
        };
        if let Some(b) = budget {
            let over = format!("over the budget of {} ({})", b.max_credits, b.source);
            if total > b.max_credits {
                reasons.push(format!(
                    "the plan costs {at_least}{}, {over}",
                    super::credits(total)
                ));
            } else if at_worst > b.max_credits {
                reasons.push(with_rerolls(
                    over,
                    b.max_credits - total,
                    "raise the budget",
                ));
            }
        }
        match balance {
            Balance::Known { credits, .. } if i128::from(total) > i128::from(*credits) => {
                reasons.push(format!(
                    "the plan costs {at_least}{}, more than the balance of {credits}",
                    super::credits(total)
                ));
            }
            Balance::Known { credits, .. } if i128::from(at_worst) > i128::from(*credits) => {
                let room = u64::try_from(*credits).unwrap_or(0).saturating_sub(total);
                let over = format!("more than the balance of {credits}");
                reasons.push(with_rerolls(over, room, "top up the account"));
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
    /// What its rerolls may spend beside the total, at worst (0 when no step rerolls).
    pub rerolls: u64,
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
    } else if claim.rerolls > 0 {
        "raise budget.max_credits or --max-credits, lower rerolls.max_credits, top up the account, or plan fewer items"
    } else {
        "raise budget.max_credits or --max-credits, top up the account, or plan fewer items"
    }))
}

/// The plan's verdict, except that credits saved by reuse count: a run whose reused tasks
/// bring it (with its rerolls' worst case) within the budget and the balance may start.
pub fn refusal_after_reuse(claim: &Claim<'_>) -> Result<(), Refused> {
    let saved = claim.saved_by_reuse;
    if claim.verdict.fits || saved == 0 {
        return refusal(claim);
    }
    let Some(total) = claim.total else {
        return refusal(claim);
    };
    let needed = total.saturating_sub(saved).saturating_add(claim.rerolls);
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
            rerolls: 0,
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
        let verdict = Verdict::judge(120, &[], 0, Some(&budget), &balance);
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
        let verdict = Verdict::judge(10, &unpriced, 0, None, &balance);
        let unknown = Claim {
            verdict: &verdict,
            total: None,
            rerolls: 0,
            saved_by_reuse: 0,
            budget: None,
            balance: &balance,
        };
        assert!(needs_discovery(&unknown, false).is_err());
        assert_eq!(needs_discovery(&unknown, true), Ok(true));
        assert!(refusal(&unknown).unwrap_err().hint.contains("pricing"));
    }

    #[test]
    fn a_total_that_fits_with_rerolls_that_do_not_names_what_to_lower() {
        let budget = Budget {
            max_credits: 100,
            source: "budget.max_credits".into(),
        };
        let balance = Balance::Known {
            credits: 1000,
            field: "/credits".into(),
        };
        assert!(Verdict::judge(80, &[], 20, Some(&budget), &balance).fits);
        let verdict = Verdict::judge(80, &[], 21, Some(&budget), &balance);
        assert_eq!(
            verdict.reasons,
            [
                "the plan costs 80 credits and its rerolls up to 21 credits more, 101 credits at worst, over the budget of 100 (budget.max_credits); lower rerolls.max_credits to 20 or raise the budget"
            ]
        );
        let refused = refusal(&Claim {
            rerolls: 21,
            total: Some(80),
            ..claim(&verdict, &budget, &balance)
        })
        .unwrap_err();
        assert!(
            refused.hint.contains("lower rerolls.max_credits"),
            "{refused:?}"
        );
        let poor = Balance::Known {
            credits: 85,
            field: "/credits".into(),
        };
        let verdict = Verdict::judge(85, &[], 10, None, &poor);
        assert_eq!(
            verdict.reasons,
            [
                "the plan costs 85 credits and its rerolls up to 10 credits more, 95 credits at worst, more than the balance of 85; no rerolls.max_credits fits beside the total: top up the account, or give the checks `on_fail: flag`"
            ]
        );
    }

    #[test]
    fn reuse_admits_a_run_only_when_the_rest_fits_with_its_rerolls() {
        let budget = Budget {
            max_credits: 100,
            source: "--max-credits".into(),
        };
        let balance = Balance::NotChecked;
        let verdict = Verdict::judge(100, &[], 30, Some(&budget), &balance);
        assert!(!verdict.fits);
        let over = Claim {
            total: Some(100),
            rerolls: 30,
            saved_by_reuse: 29,
            ..claim(&verdict, &budget, &balance)
        };
        assert!(refusal_after_reuse(&over).is_err());
        let within = Claim {
            saved_by_reuse: 30,
            ..over
        };
        assert_eq!(refusal_after_reuse(&within), Ok(()));
    }
}
