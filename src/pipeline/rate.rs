//! Rate limits written `N/s`, `N/min` or `N/h`.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub count: NonZeroU32,
    pub per: Per,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Per {
    Second,
    Minute,
    Hour,
}

impl Per {
    pub fn duration(self) -> Duration {
        Duration::from_secs(match self {
            Per::Second => 1,
            Per::Minute => 60,
            Per::Hour => 3600,
        })
    }

    fn unit(self) -> &'static str {
        match self {
            Per::Second => "s",
            Per::Minute => "min",
            Per::Hour => "h",
        }
    }
}

impl Rate {
    pub fn per_second(self) -> f64 {
        f64::from(self.count.get()) / self.per.duration().as_secs_f64()
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Rate, String> {
        let bad = || {
            format!(
                "{s:?} is not a rate; write N/s, N/min or N/h with N a whole number above 0, e.g. 30/min"
            )
        };
        let (count, unit) = s.split_once('/').ok_or_else(bad)?;
        let count = count.trim();
        if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let count = count
            .parse::<u32>()
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(bad)?;
        let per = match unit.trim() {
            "s" => Per::Second,
            "min" => Per::Minute,
            "h" => Per::Hour,
            _ => return Err(bad()),
        };
        Ok(Rate { count, per })
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.per.unit())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_and_print_back() {
        let r: Rate = "30/min".parse().unwrap();
        assert_eq!(r.to_string(), "30/min");
        assert!((r.per_second() - 0.5).abs() < 1e-9);
        assert_eq!(" 2 / s ".parse::<Rate>().unwrap().to_string(), "2/s");
        for bad in [
            "0/s", "30", "30/day", "-1/s", "1.5/s", "/min", "abc/h", "3/minute",
        ] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }
}
