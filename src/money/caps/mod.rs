//! Spending caps: "these pipelines never spend more than N credits a day (a week, a month)",
//! held across every run of every host that shares the state database.
//!
//! A cap's window is a calendar day, week (from Monday) or month in the cap's IANA time zone.
//! A run commits credits to a chain only when every cap that covers it has leased them to
//! the run ([`Leash`]): leases are taken from the database in blocks, one transaction at a time
//! across processes and hosts, so what all runs together commit never passes a window's
//! credits, and the hot path asks the database only when a block is used up. A lease counts
//! whole in its window while it is open; closed, it counts what its run spent (billed, and
//! the planned price of each call possibly billed). A run that stops closes its leases at once;
//! one that dies stops beating, and the next run that leases (or the resume of the same run,
//! at once) closes them with what its attempts say it spent.

mod leash;

use jiff::tz::TimeZone;
use jiff::{Span, Timestamp, ZonedDateTime};

pub use leash::{Crossing, Grant, Leash, Spent};

use crate::store::{CapSetting, Store, StoreError};

/// What reading the caps can fail on. The top-level error of a command is made from it once,
/// in the error module, so the caps need nothing above them.
#[derive(Debug, thiserror::Error)]
pub enum CapError {
    /// A recorded cap no longer reads (a time zone this build does not know): bad input.
    #[error("{0}")]
    Unreadable(String),
    /// A cap's window cannot be found for the time asked (a date out of range).
    #[error("{0}")]
    Window(String),
    /// The state database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A test-only setting: seconds added to the clock the caps' windows are read from, so a test
/// can move a run into the next window without waiting for it.
pub const TEST_CLOCK_ENV: &str = "IMGPIPE_TEST_CAP_CLOCK_OFFSET_SECS";

/// A test-only setting: a file holding that offset in seconds, read again each time the caps
/// read the clock (over [`TEST_CLOCK_ENV`]), so a test can move a running process's clock: as
/// if it had been frozen (SIGSTOP, a suspended machine) for that long.
pub const TEST_CLOCK_FILE_ENV: &str = "IMGPIPE_TEST_CAP_CLOCK_FILE";

/// The length of a cap's windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Per {
    Day,
    Week,
    Month,
}

impl Per {
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Day => "day",
            Per::Week => "week",
            Per::Month => "month",
        }
    }

    fn parse(text: &str) -> Option<Per> {
        match text {
            "day" => Some(Per::Day),
            "week" => Some(Per::Week),
            "month" => Some(Per::Month),
            _ => None,
        }
    }
}

/// A cap, read: its time zone found.
#[derive(Clone, Debug)]
pub struct Cap {
    pub name: String,
    pub credits: u64,
    pub per: Per,
    /// The pipeline it covers; `None` for every pipeline.
    pub pipeline: Option<String>,
    pub tz_name: String,
    tz: TimeZone,
}

/// One window of a cap: unix milliseconds, its end excluded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start: i64,
    pub end: i64,
}

/// The time zone of this name, or why there is none.
pub fn time_zone(name: &str) -> Result<TimeZone, String> {
    TimeZone::get(name).map_err(|e| format!("{name} is not an IANA time zone: {e}"))
}

impl Cap {
    /// A cap as set by hand (`imgpipe cap set`), checked.
    pub fn new(
        name: &str,
        credits: u64,
        per: Per,
        pipeline: Option<String>,
        tz_name: &str,
    ) -> Result<Cap, String> {
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid_name {
            return Err(format!(
                "cap name {name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
            ));
        }
        if credits == 0 {
            return Err("--credits must be at least 1".into());
        }
        Ok(Cap {
            name: name.to_owned(),
            credits,
            per,
            pipeline,
            tz_name: tz_name.to_owned(),
            tz: time_zone(tz_name)?,
        })
    }

    /// A recorded cap; one whose record no longer reads (a time zone this build does not know)
    /// is an error naming it.
    pub fn of(row: &CapSetting) -> Result<Cap, String> {
        let per = Per::parse(&row.per)
            .ok_or_else(|| format!("cap {}: unknown window {:?}", row.name, row.per))?;
        let tz = time_zone(&row.tz).map_err(|e| format!("cap {}: {e}", row.name))?;
        Ok(Cap {
            name: row.name.clone(),
            credits: row.credits,
            per,
            pipeline: row.pipeline.clone(),
            tz_name: row.tz.clone(),
            tz,
        })
    }

    pub fn row(&self, created_at: i64) -> CapSetting {
        CapSetting {
            name: self.name.clone(),
            credits: self.credits,
            per: self.per.as_str().to_owned(),
            pipeline: self.pipeline.clone(),
            tz: self.tz_name.clone(),
            created_at,
        }
    }

    /// Whether the cap counts the spending of runs of `pipeline`.
    pub fn covers(&self, pipeline: &str) -> bool {
        self.pipeline.as_deref().is_none_or(|p| p == pipeline)
    }

    /// The window that holds the instant `at` (unix milliseconds).
    pub fn window(&self, at: i64) -> Result<Window, String> {
        let span = |e: jiff::Error| format!("cap {}: {e}", self.name);
        let now = Timestamp::from_millisecond(at)
            .map_err(span)?
            .to_zoned_datetime(self.tz.clone());
        let start = match self.per {
            Per::Day => now.start_of_day(),
            Per::Week => {
                let back = i64::from(now.weekday().to_monday_zero_offset());
                now.checked_sub(Span::new().days(back))
                    .and_then(|d| d.start_of_day())
            }
            Per::Month => now.first_of_month().and_then(|d| d.start_of_day()),
        }
        .map_err(span)?;
        let step = match self.per {
            Per::Day => Span::new().days(1),
            Per::Week => Span::new().weeks(1),
            Per::Month => Span::new().months(1),
        };
        let end = start
            .checked_add(step)
            .and_then(|d| d.start_of_day())
            .map_err(span)?;
        Ok(Window {
            start: millis(&start),
            end: millis(&end),
        })
    }
}

fn millis(at: &ZonedDateTime) -> i64 {
    at.timestamp().as_millisecond()
}

/// Now, in unix milliseconds, as the caps read it (see [`TEST_CLOCK_ENV`]).
pub fn now_ms() -> i64 {
    let from_file = std::env::var_os(TEST_CLOCK_FILE_ENV)
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|s| s.trim().parse::<i64>().ok());
    let offset = from_file
        .or_else(|| {
            std::env::var(TEST_CLOCK_ENV)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
        })
        .unwrap_or(0);
    crate::store::now_ms().saturating_add(offset.saturating_mul(1000))
}

/// Where a cap stands now: its window, and what it has spent and has left.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Standing {
    pub name: String,
    pub credits: u64,
    pub per: Per,
    pub pipeline: Option<String>,
    pub tz: String,
    pub window_start: String,
    /// When the window ends, and the next begins.
    pub window_end: String,
    /// Billed and possibly billed by closed leases, and leased by open ones (a run going, or
    /// one gone whose leases no run has closed yet).
    pub spent: u64,
    pub left: u64,
}

impl Standing {
    pub async fn of(store: &Store, cap: &Cap) -> Result<Standing, CapError> {
        let window = cap.window(now_ms()).map_err(CapError::Window)?;
        let spent = store.caps().spent(&cap.name, window.start).await?;
        Ok(Standing {
            name: cap.name.clone(),
            credits: cap.credits,
            per: cap.per,
            pipeline: cap.pipeline.clone(),
            tz: cap.tz_name.clone(),
            window_start: shown(cap, window.start),
            window_end: shown(cap, window.end),
            spent,
            left: cap.credits.saturating_sub(spent),
        })
    }
}

/// The recorded caps, read; one that no longer reads is an error naming it (exit 2).
pub async fn recorded(store: &Store) -> Result<Vec<Cap>, CapError> {
    store
        .caps()
        .list()
        .await?
        .iter()
        .map(Cap::of)
        .collect::<Result<Vec<_>, String>>()
        .map_err(CapError::Unreadable)
}

/// Where each of `caps` stands now: what `imgpipe cap list` shows, and the desk's home.
pub async fn standings(store: &Store, caps: &[Cap]) -> Result<Vec<Standing>, CapError> {
    let mut standing = Vec::with_capacity(caps.len());
    for cap in caps {
        standing.push(Standing::of(store, cap).await?);
    }
    Ok(standing)
}

/// Where each cap that covers the pipeline named `pipeline` stands now: what a plan and a dry
/// run hold the work against beside the limit.
pub async fn covering(store: &Store, pipeline: &str) -> Result<Vec<Standing>, CapError> {
    let caps: Vec<Cap> = recorded(store).await?;
    let caps: Vec<Cap> = caps.into_iter().filter(|c| c.covers(pipeline)).collect();
    standings(store, &caps).await
}

/// When a window of `cap` ends, as people read it: RFC 3339 in the cap's zone.
pub fn shown(cap: &Cap, at: i64) -> String {
    Timestamp::from_millisecond(at).map_or_else(
        |_| at.to_string(),
        |t| {
            t.to_zoned_datetime(cap.tz.clone())
                .strftime("%Y-%m-%dT%H:%M:%S%:z")
                .to_string()
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> i64 {
        text.parse::<Timestamp>().unwrap().as_millisecond()
    }

    #[test]
    fn windows_are_calendar_days_weeks_and_months_in_the_caps_zone() {
        let day = Cap::new("d", 10, Per::Day, None, "Europe/Paris").unwrap();
        // 23:30 UTC on 24 November is 00:30 on the 25th in Paris.
        let w = day.window(at("2026-11-24T23:30:00Z")).unwrap();
        assert_eq!(w.start, at("2026-11-24T23:00:00Z"));
        assert_eq!(w.end, at("2026-11-25T23:00:00Z"));
        // The day the clocks go forward is 23 hours long.
        let spring = day.window(at("2026-03-29T12:00:00Z")).unwrap();
        assert_eq!(spring.end - spring.start, 23 * 3_600_000);
        let week = Cap::new("w", 10, Per::Week, None, "UTC").unwrap();
        // 25 November 2026 is a Wednesday: the week began on Monday the 23rd.
        let w = week.window(at("2026-11-25T10:00:00Z")).unwrap();
        assert_eq!(w.start, at("2026-11-23T00:00:00Z"));
        assert_eq!(w.end, at("2026-11-30T00:00:00Z"));
        let month = Cap::new("m", 10, Per::Month, None, "America/New_York").unwrap();
        let w = month.window(at("2026-12-01T03:00:00Z")).unwrap();
        assert_eq!(
            w.start,
            at("2026-11-01T04:00:00Z"),
            "still November in New York"
        );
        assert_eq!(w.end, at("2026-12-01T05:00:00Z"));
    }

    #[test]
    fn a_cap_names_what_is_wrong_with_it() {
        assert!(Cap::new("a b", 1, Per::Day, None, "UTC").is_err());
        assert!(Cap::new("a", 0, Per::Day, None, "UTC").is_err());
        let e = Cap::new("a", 1, Per::Day, None, "Mars/Olympus").unwrap_err();
        assert!(e.contains("Mars/Olympus"), "{e}");
        let cap = Cap::new("a", 1, Per::Day, Some("p".into()), "UTC").unwrap();
        assert!(cap.covers("p") && !cap.covers("q"));
    }
}
