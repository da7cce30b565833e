//! The gate every spend passes: a price shown is a price kept.
//!
//! A dry run answers its credits and a [`Revision`] of what it priced: a digest of the tasks
//! it would pay for with their credits, and of the run's state (what it has spent and the
//! calls it has recorded). A confirm carries them back as what is [`Expected`]. The runner,
//! once it holds the run's lock and has planned again, passes its new [`Priced`] through
//! [`check`]: a price or a revision that differs is refused with the new figures, before
//! anything is spent. Since the run's state is part of the revision, a change that was done
//! (it recorded a call, or spent) no longer matches what was confirmed: a second confirm of
//! it is refused, never paid twice.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A digest of what a price was given for, as 16 hex digits.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Revision(String);

/// How many hex digits a revision has: 64 bits tell two states of one run apart.
const DIGITS: usize = 16;

impl Revision {
    /// Starts a revision's digest.
    pub fn builder() -> Builder {
        Builder(Sha256::new())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Revision {
    type Err = String;

    fn from_str(s: &str) -> Result<Revision, String> {
        if s.len() == DIGITS && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            Ok(Revision(s.to_ascii_lowercase()))
        } else {
            Err(format!(
                "`{s}` is not a revision: {DIGITS} hex digits, as a dry run prints it"
            ))
        }
    }
}

impl TryFrom<String> for Revision {
    type Error = String;
    fn try_from(s: String) -> Result<Revision, String> {
        s.parse()
    }
}

impl From<Revision> for String {
    fn from(r: Revision) -> String {
        r.0
    }
}

/// A revision's digest, fed the parts of what was priced in a fixed order.
pub struct Builder(Sha256);

impl Builder {
    /// Adds one part; parts are separated, so `("ab", "c")` and `("a", "bc")` differ.
    pub fn part(mut self, part: impl AsRef<[u8]>) -> Builder {
        let part = part.as_ref();
        self.0.update((part.len() as u64).to_le_bytes());
        self.0.update(part);
        self
    }

    /// Adds a number.
    pub fn number(self, n: u64) -> Builder {
        self.part(n.to_le_bytes())
    }

    pub fn finish(self) -> Revision {
        let digest = self.0.finalize();
        let hex: String = digest
            .iter()
            .take(DIGITS / 2)
            .map(|b| format!("{b:02x}"))
            .collect();
        Revision(hex)
    }
}

/// What a spend is priced at now, under the run's lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Priced {
    pub credits: u64,
    pub revision: Revision,
}

/// What a confirm agreed to pay: the credits (`--expect-credits`, the desk's `credits`) and,
/// when it has one, the revision the dry run printed. Nothing expected: no confirm is bound.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    pub credits: Option<u64>,
    pub revision: Option<Revision>,
}

impl Expected {
    pub fn is_bound(&self) -> bool {
        self.credits.is_some() || self.revision.is_some()
    }
}

/// A confirm that no longer holds: what it expected, and the price now. Nothing was spent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.message())]
pub struct Stale {
    pub expected: Expected,
    pub now: Priced,
}

impl Stale {
    fn message(&self) -> String {
        let Stale { expected, now } = self;
        match expected.credits {
            Some(c) if c != now.credits => format!(
                "the price is now {}, not {c}: nothing was spent",
                super::credits(now.credits)
            ),
            _ => format!(
                "the run changed since it was priced (revision {} now, {} confirmed): nothing was spent",
                now.revision,
                expected
                    .revision
                    .as_ref()
                    .map_or_else(|| "none".to_owned(), Revision::to_string)
            ),
        }
    }

    /// What to do about it.
    pub fn hint(&self) -> &'static str {
        "price it again (--dry-run), look at what it pays for now, and confirm that"
    }
}

/// What a fresh run confirms: the command line's `--expect-credits`, and a saved plan's
/// revision (`run --plan`): the same confirm, made earlier and kept in a file. `Err` when both
/// name a revision.
pub fn with_saved(flags: &Expected, saved: Option<Revision>) -> Result<Expected, Twice> {
    let Some(saved) = saved else {
        return Ok(flags.clone());
    };
    if flags.revision.is_some() {
        return Err(Twice);
    }
    Ok(Expected {
        credits: flags.credits,
        revision: Some(saved),
    })
}

/// `--expect-revision` given with a saved plan, which carries its own.
#[derive(Debug, thiserror::Error)]
#[error("--expect-revision and --plan both name what is confirmed")]
pub struct Twice;

/// Why a fresh run's plan does not pass the gate.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Stale(#[from] Stale),
    /// A price confirmed while the plan's is unknown: nothing can be held to it.
    #[error("the run's price is not known, so no price can be confirmed: nothing was spent")]
    Unpriced,
}

/// The gate of a fresh run: its plan's credits to pay (`None` while a price is unknown) and
/// revision, against what was confirmed.
pub fn check_plan(
    expect: &Expected,
    credits: Option<u64>,
    revision: Revision,
) -> Result<(), Refusal> {
    if !expect.is_bound() {
        return Ok(());
    }
    let credits = match (credits, expect.credits) {
        (Some(c), _) => c,
        // Only the revision binds: it digests the unknown price too.
        (None, None) => 0,
        (None, Some(_)) => return Err(Refusal::Unpriced),
    };
    Ok(check(expect, &Priced { credits, revision })?)
}

/// Whether the price now is the one expected: the credits, and the revision when one was
/// given. A confirm that holds no expectation passes.
pub fn check(expected: &Expected, now: &Priced) -> Result<(), Stale> {
    let credits_hold = expected.credits.is_none_or(|c| c == now.credits);
    let revision_holds = expected
        .revision
        .as_ref()
        .is_none_or(|r| *r == now.revision)
        || crate::failpoint::mutated(crate::failpoint::REVISION_IGNORED);
    if credits_hold && revision_holds {
        Ok(())
    } else {
        Err(Stale {
            expected: expected.clone(),
            now: now.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn priced(credits: u64, rev: &str) -> Priced {
        Priced {
            credits,
            revision: Revision::builder().part(rev).finish(),
        }
    }

    #[test]
    fn a_confirm_holds_only_for_the_price_and_revision_it_was_shown() {
        let now = priced(40, "a");
        let same = Expected {
            credits: Some(40),
            revision: Some(now.revision.clone()),
        };
        assert_eq!(check(&same, &now), Ok(()));
        assert_eq!(check(&Expected::default(), &now), Ok(()));
        let cheaper = Expected {
            credits: Some(8),
            revision: None,
        };
        let e = check(&cheaper, &now).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the price is now 40 credits, not 8: nothing was spent"
        );
        let moved = Expected {
            credits: Some(40),
            revision: Some(priced(40, "b").revision),
        };
        assert!(check(&moved, &now).is_err(), "same price, another state");
    }

    #[test]
    fn a_fresh_runs_plan_is_held_to_what_was_confirmed_even_unpriced() {
        let rev = Revision::builder().part("plan").finish();
        let credits = Expected {
            credits: Some(40),
            revision: None,
        };
        assert!(matches!(
            check_plan(&credits, None, rev.clone()),
            Err(Refusal::Unpriced)
        ));
        assert!(check_plan(&credits, Some(40), rev.clone()).is_ok());
        let saved = with_saved(&Expected::default(), Some(rev.clone())).unwrap();
        assert!(
            check_plan(&saved, None, rev.clone()).is_ok(),
            "the revision alone binds"
        );
        let other = Revision::builder().part("changed").finish();
        assert!(matches!(
            check_plan(&saved, None, other),
            Err(Refusal::Stale(_))
        ));
        assert!(with_saved(&saved, Some(rev)).is_err(), "two revisions");
        assert!(check_plan(&Expected::default(), None, Revision::builder().finish()).is_ok());
    }

    #[test]
    fn parts_are_kept_apart_and_a_revision_reads_back() {
        let ab_c = Revision::builder().part("ab").part("c").finish();
        let a_bc = Revision::builder().part("a").part("bc").finish();
        assert_ne!(ab_c, a_bc);
        assert_eq!(ab_c.as_str().parse::<Revision>(), Ok(ab_c.clone()));
        assert!("xyz".parse::<Revision>().is_err());
    }
}
