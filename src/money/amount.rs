//! A number of credits as a sentence says it: `1 credit`, `27 credits`. Every message that
//! states an amount of credits writes it through [`credits`], so a single credit is never
//! "1 credits".

use std::fmt;

/// An amount of credits, displayed with its unit in the right number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Amount(i128);

/// `n` credits, for a message: `format!("costs {}", credits(n))`.
pub fn credits(n: impl Into<i128>) -> Amount {
    Amount(n.into())
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so a column's width and alignment apply to the whole amount.
        match self.0 {
            1 => f.pad("1 credit"),
            n => f.pad(&format!("{n} credits")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::credits;

    #[test]
    fn one_credit_is_singular_and_every_other_amount_plural() {
        assert_eq!(credits(1u64).to_string(), "1 credit");
        assert_eq!(credits(0u64).to_string(), "0 credits");
        assert_eq!(credits(27i64).to_string(), "27 credits");
        assert_eq!(credits(-1i64).to_string(), "-1 credits");
        assert_eq!(format!("{:>10}", credits(1u64)), "  1 credit");
    }
}
