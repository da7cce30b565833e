//! `imgpipe spend`: what the runs of the state database cost, per day, week, month, pipeline,
//! step or run, without any network call. The ledger is folded in [`crate::money::ledger`].

use chrono::{DateTime, NaiveDate};
use clap::{Args, ValueEnum};

use crate::cli::GlobalArgs;
use crate::cli::args::StateArgs;
use crate::cli::stdio;
use crate::cli::view::print_json;
use crate::error::Error;
use crate::money::ledger::Window;
use crate::money::ledger::{By, Figures, Ledger, Line, ledger};
use crate::runner::state::{NO_DATABASE_HINT, close};

#[derive(Debug, Args)]
pub struct SpendArgs {
    #[command(flatten)]
    pub state: StateArgs,
    /// Look in the database of runs made with --sandbox
    #[arg(long)]
    pub sandbox: bool,
    /// From this UTC day (YYYY-MM-DD) or instant (RFC 3339), included
    #[arg(long, value_name = "DATE", value_parser = since)]
    pub since: Option<i64>,
    /// Up to this UTC day (YYYY-MM-DD), included, or instant (RFC 3339), excluded
    #[arg(long, value_name = "DATE", value_parser = until)]
    pub until: Option<i64>,
    /// One line per UTC day, ISO week, month, pipeline, pipeline step or run
    #[arg(long, value_enum, default_value = "day")]
    pub by: ByArg,
    /// Print CSV with a header row, the totals last
    #[arg(long)]
    pub csv: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ByArg {
    Day,
    Week,
    Month,
    Pipeline,
    Step,
    Run,
}

impl From<ByArg> for By {
    fn from(by: ByArg) -> By {
        match by {
            ByArg::Day => By::Day,
            ByArg::Week => By::Week,
            ByArg::Month => By::Month,
            ByArg::Pipeline => By::Pipeline,
            ByArg::Step => By::Step,
            ByArg::Run => By::Run,
        }
    }
}

/// `--since`: the start of a UTC day, or an instant.
fn since(s: &str) -> Result<i64, String> {
    instant(s, 0)
}

/// `--until`: the end of a UTC day (the next one's start), or an instant.
fn until(s: &str) -> Result<i64, String> {
    instant(s, 1)
}

/// Unix milliseconds of `YYYY-MM-DD` plus `days_after` days, or of an RFC 3339 time.
fn instant(s: &str, days_after: i64) -> Result<i64, String> {
    if let Ok(day) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        let start = day.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc();
        return Ok(start.timestamp_millis() + days_after * 86_400_000);
    }
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.timestamp_millis())
        .map_err(|_| {
            "expected a day as YYYY-MM-DD or a time as RFC 3339 (2026-11-25T06:00:00Z)".into()
        })
}

pub(super) async fn run(args: &SpendArgs, global: &GlobalArgs) -> Result<(), Error> {
    if global.json && args.csv {
        return Err(Error::usage("--json and --csv cannot both be given", None));
    }
    let window = Window {
        since: args.since,
        until: args.until,
    };
    if window.since.zip(window.until).is_some_and(|(s, u)| s >= u) {
        return Err(Error::usage(
            "--since must come before --until",
            Some(
                "--until YYYY-MM-DD includes that whole day: --since 2026-11-01 --until 2026-11-30 is November",
            ),
        ));
    }
    let location = args.state.location(args.sandbox)?;
    if !location.exists() {
        let msg = format!(
            "no runs yet: there is no state database at {}",
            location.location()
        );
        if global.json || args.csv {
            stdio::note(format_args!("{msg}\nhint: {NO_DATABASE_HINT}"));
        } else {
            return stdio::line(format_args!("{msg}\nhint: {NO_DATABASE_HINT}"));
        }
        let empty = crate::money::ledger::empty(args.by.into(), window);
        return render(&empty, global.json, args.csv);
    }
    let store = location.open_existing().await?;
    let read = ledger(&store, args.by.into(), window).await;
    let ledger = close(store, read.map_err(Error::from)).await?;
    render(&ledger, global.json, args.csv)
}

fn render(ledger: &Ledger, json: bool, csv: bool) -> Result<(), Error> {
    if json {
        return print_json(ledger);
    }
    if csv {
        return stdio::print(&csv_text(ledger)?);
    }
    stdio::print(&table(ledger))
}

const HEADER: [&str; 8] = [
    "group",
    "pipeline",
    "credits_planned",
    "credits_billed",
    "possibly_billed",
    "calls",
    "failures",
    "possibly_billed_calls",
];

/// The CSV: a header row, one row per line, and a last row whose group is `total`.
fn csv_text(ledger: &Ledger) -> Result<String, Error> {
    let mut out = csv::Writer::from_writer(Vec::new());
    let row = |group: &str, pipeline: &str, f: &Figures| {
        let numbers = numbers(f).map(|n| n.to_string());
        let mut row = vec![group.to_owned(), pipeline.to_owned()];
        row.extend(numbers);
        row
    };
    let mut rows = vec![HEADER.map(str::to_owned).to_vec()];
    for l in &ledger.groups {
        rows.push(row(
            &l.group,
            l.pipeline.as_deref().unwrap_or(""),
            &l.figures,
        ));
    }
    rows.push(row("total", "", &ledger.totals));
    for r in rows {
        out.write_record(&r).map_err(anyhow::Error::from)?;
    }
    let bytes = out.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn numbers(f: &Figures) -> [u64; 6] {
    [
        f.credits_planned,
        f.credits_billed,
        f.possibly_billed,
        f.calls,
        f.failures,
        f.possibly_billed_calls,
    ]
}

/// The text table: billed shown as `billed+possibly?` when some calls may have been billed,
/// as `runs` shows it.
fn table(ledger: &Ledger) -> String {
    if ledger.groups.is_empty() {
        return format!("nothing spent or planned by {}\n", window_text(ledger));
    }
    let widest = |f: fn(&Line) -> Option<&str>, least: usize| {
        ledger
            .groups
            .iter()
            .filter_map(f)
            .map(str::len)
            .max()
            .unwrap_or(0)
            .max(least)
    };
    let width = widest(|l| Some(&l.group), 5);
    let pwidth = ledger
        .groups
        .iter()
        .any(|l| l.pipeline.is_some())
        .then(|| widest(|l| l.pipeline.as_deref(), 8));
    let row = |group: &str, pipeline: &str, cells: [String; 4]| {
        let pipeline = pwidth.map_or_else(String::new, |w| format!("{pipeline:<w$}  "));
        let [planned, billed, calls, failures] = cells;
        format!(
            "{group:<width$}  {pipeline}{planned:>8}  {billed:>10}  {calls:>6}  {failures:>8}\n"
        )
    };
    let figures = |f: &Figures| {
        let billed = if f.possibly_billed > 0 {
            format!("{}+{}?", f.credits_billed, f.possibly_billed)
        } else {
            f.credits_billed.to_string()
        };
        [
            f.credits_planned.to_string(),
            billed,
            f.calls.to_string(),
            f.failures.to_string(),
        ]
    };
    let header = ["PLANNED", "BILLED", "CALLS", "FAILURES"].map(str::to_owned);
    let mut text = row(&ledger.by.to_uppercase(), "PIPELINE", header);
    for l in &ledger.groups {
        text += &row(
            &l.group,
            l.pipeline.as_deref().unwrap_or(""),
            figures(&l.figures),
        );
    }
    text + &row("total", "", figures(&ledger.totals))
}

fn window_text(ledger: &Ledger) -> String {
    match (&ledger.since, &ledger.until) {
        (None, None) => format!("{} in the state database", ledger.by),
        (s, u) => format!(
            "{} from {} until {}",
            ledger.by,
            s.as_deref().unwrap_or("the first run"),
            u.as_deref().unwrap_or("now")
        ),
    }
}
