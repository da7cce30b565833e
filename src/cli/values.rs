//! The values of the flags that name one of the library's choices. The library's enums know
//! nothing of clap; these mirror them for the command line (the same names, and the same help
//! per value, which `--help` lists) and turn into them.

use clap::ValueEnum;

/// `--on-ambiguous`: what to do with a call that was sent and got no complete answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum OnAmbiguous {
    /// Record it as possibly billed and call again.
    #[default]
    Retry,
    /// Record it as possibly billed and fail the task.
    Fail,
}

impl From<OnAmbiguous> for crate::exec::OnAmbiguous {
    fn from(v: OnAmbiguous) -> Self {
        match v {
            OnAmbiguous::Retry => Self::Retry,
            OnAmbiguous::Fail => Self::Fail,
        }
    }
}

/// `cap set --per`: the length of a cap's windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Per {
    Day,
    Week,
    Month,
}

impl From<Per> for crate::money::caps::Per {
    fn from(v: Per) -> Self {
        match v {
            Per::Day => Self::Day,
            Per::Week => Self::Week,
            Per::Month => Self::Month,
        }
    }
}

/// `sandbox --rate-limit-scope`: which calls the sandbox's rate limit counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum RateScope {
    /// Every `/v1/...` call.
    #[default]
    All,
    /// Only the paid `POST` calls.
    Paid,
}

impl From<RateScope> for crate::sandbox::RateScope {
    fn from(v: RateScope) -> Self {
        match v {
            RateScope::All => Self::All,
            RateScope::Paid => Self::Paid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command line offers every choice the library has, under the same name.
    #[test]
    fn every_value_turns_into_the_library_choice_of_its_name() {
        for v in OnAmbiguous::value_variants() {
            let name = v.to_possible_value().unwrap().get_name().to_owned();
            let lib: crate::exec::OnAmbiguous = (*v).into();
            assert_eq!(format!("{lib:?}").to_lowercase(), name);
        }
        for v in Per::value_variants() {
            let name = v.to_possible_value().unwrap().get_name().to_owned();
            assert_eq!(crate::money::caps::Per::from(*v).as_str(), name);
        }
        for v in RateScope::value_variants() {
            let name = v.to_possible_value().unwrap().get_name().to_owned();
            let lib: crate::sandbox::RateScope = (*v).into();
            assert_eq!(format!("{lib:?}").to_lowercase(), name);
        }
    }
}
