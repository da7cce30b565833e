//! The limit: the most a run may still spend now, the least of what its budget has left and
//! the account's balance. The calendar caps are not in it: they lend a run credits by leases
//! ([`crate::money::caps::Leash`]), which the purse holds beside the limit.

use serde::{Deserialize, Serialize};

/// The most a run may spend, and who said so.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub max_credits: u64,
    /// `budget.max_credits` or `--max-credits`.
    pub source: String,
}

impl Budget {
    /// The smaller of the pipeline's budget and the command line's.
    pub fn pick(pipeline: Option<u64>, flag: Option<u64>) -> Option<Budget> {
        let from_file = pipeline.map(|c| Budget {
            max_credits: c,
            source: "budget.max_credits".into(),
        });
        let from_flag = flag.map(|c| Budget {
            max_credits: c,
            source: "--max-credits".into(),
        });
        match (from_file, from_flag) {
            (Some(a), Some(b)) => Some(if b.max_credits < a.max_credits { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// The account's balance as the plan saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Balance {
    Known {
        credits: i64,
        field: String,
    },
    /// The account was read but the balance could not be found in it.
    Unknown {
        reason: String,
    },
    /// `--offline`: the account was not asked.
    NotChecked,
}

impl Balance {
    /// The credits it holds (none below zero); `None` when it was not known.
    pub fn credits(&self) -> Option<u64> {
        match self {
            Balance::Known { credits, .. } => Some(u64::try_from(*credits).unwrap_or(0)),
            _ => None,
        }
    }
}

/// The least of two optional limits; either alone when the other is absent.
pub fn least(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The limit of a run that has spent `spent`, and what it comes from.
#[derive(Clone, Copy, Debug)]
pub struct Limit<'a> {
    pub budget: Option<&'a Budget>,
    pub balance: &'a Balance,
    /// What the run spent so far: billed, and possibly billed.
    pub spent: u64,
}

/// What sets a limit: what has to be raised for more to fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limiting {
    Budget,
    Balance,
    /// The budget left and the balance are the same.
    Both,
}

impl<'a> Limit<'a> {
    pub fn of(budget: Option<&'a Budget>, balance: &'a Balance, spent: u64) -> Limit<'a> {
        Limit {
            budget,
            balance,
            spent,
        }
    }

    /// The most the run may still spend; `None`: neither a budget nor a known balance.
    pub fn credits(&self) -> Option<u64> {
        least(self.budget_left(), self.balance.credits())
    }

    /// What the budget has left once the run's spending is counted; `None` without a budget.
    pub fn budget_left(&self) -> Option<u64> {
        self.budget
            .map(|b| b.max_credits.saturating_sub(self.spent))
    }

    /// What sets the limit; `None` when nothing does.
    pub fn limiting(&self) -> Option<Limiting> {
        match (self.budget_left(), self.balance.credits()) {
            (None, None) => None,
            (Some(_), None) => Some(Limiting::Budget),
            (None, Some(_)) => Some(Limiting::Balance),
            (Some(b), Some(a)) if b < a => Some(Limiting::Budget),
            (Some(b), Some(a)) if a < b => Some(Limiting::Balance),
            (Some(_), Some(_)) => Some(Limiting::Both),
        }
    }

    /// The budget and the balance, as a refusal names them.
    pub fn describe(&self) -> String {
        let budget = self.budget.map_or_else(
            || "no budget".to_owned(),
            |b| format!("budget {} less what the run spent", b.max_credits),
        );
        let balance = match self.balance {
            Balance::Known { credits, .. } => format!("balance {credits}"),
            _ => "balance unknown".to_owned(),
        };
        format!("{budget}, {balance}")
    }
}

impl Limiting {
    /// What to do for more to fit.
    pub fn remedy(self) -> &'static str {
        match self {
            Limiting::Budget => "raise the budget (--max-credits or budget.max_credits)",
            Limiting::Balance => "top up the account",
            Limiting::Both => {
                "raise the budget (--max-credits or budget.max_credits) and top up the account"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_credits: u64) -> Budget {
        Budget {
            max_credits,
            source: "--max-credits".into(),
        }
    }

    fn known(credits: i64) -> Balance {
        Balance::Known {
            credits,
            field: "balance".into(),
        }
    }

    #[test]
    fn the_limit_is_the_least_of_the_budget_left_and_the_balance() {
        let (b, open) = (budget(100), Balance::NotChecked);
        assert_eq!(Limit::of(None, &open, 30).credits(), None);
        assert_eq!(Limit::of(Some(&b), &open, 30).credits(), Some(70));
        assert_eq!(Limit::of(Some(&b), &open, 130).credits(), Some(0));
        let (low, negative) = (known(50), known(-5));
        assert_eq!(Limit::of(Some(&b), &low, 30).credits(), Some(50));
        assert_eq!(Limit::of(Some(&b), &low, 60).credits(), Some(40));
        assert_eq!(Limit::of(None, &negative, 0).credits(), Some(0));
        assert_eq!(least(Some(3), None), Some(3));
        assert_eq!(least(Some(3), Some(2)), Some(2));
    }

    #[test]
    fn what_limits_is_the_lesser_and_both_when_they_are_equal() {
        let (b, open, low) = (budget(100), Balance::NotChecked, known(50));
        assert_eq!(Limit::of(None, &open, 0).limiting(), None);
        assert_eq!(
            Limit::of(Some(&b), &open, 0).limiting(),
            Some(Limiting::Budget)
        );
        assert_eq!(Limit::of(None, &low, 0).limiting(), Some(Limiting::Balance));
        assert_eq!(
            Limit::of(Some(&b), &low, 0).limiting(),
            Some(Limiting::Balance)
        );
        assert_eq!(
            Limit::of(Some(&b), &low, 60).limiting(),
            Some(Limiting::Budget)
        );
        assert_eq!(
            Limit::of(Some(&b), &low, 50).limiting(),
            Some(Limiting::Both)
        );
    }
}
