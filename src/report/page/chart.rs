//! The spend-over-time chart: an inline SVG, so the page needs no script or font to show it.

use std::fmt::Write;

use maud::{Markup, html};

use crate::store::Spend;

const W: f64 = 640.0;
const H: f64 = 180.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 28.0;

/// Lines drawn across the chart besides the spend.
pub(super) struct Marks {
    pub planned: u64,
    pub budget: Option<u64>,
}

/// A coordinate as the chart writes it.
fn at(v: f64) -> String {
    format!("{v:.1}")
}

/// Cumulative credits billed from `start` to `end` (unix ms) as a step line. SVG elements are
/// written with end tags (`<line …></line>`): inside `<svg>` a start tag alone would hold the
/// elements after it.
pub(super) fn spend_svg(spend: &[Spend], start: i64, end: i64, marks: &Marks) -> Markup {
    let total: u64 = spend.iter().map(|s| s.credits).sum();
    let reach = total.max(marks.planned);
    // A budget far above the spend would flatten the line: it is only drawn when close.
    let budget = marks.budget.filter(|b| *b <= reach.saturating_mul(3) / 2);
    let top = reach.max(budget.unwrap_or(0)).max(1) as f64 * 1.08;
    let end = end.max(spend.last().map_or(start, |s| s.at)).max(start + 1);
    let x = |at: i64| LEFT + (at - start).max(0) as f64 / (end - start) as f64 * (W - LEFT - RIGHT);
    let y = |credits: u64| TOP + (1.0 - credits as f64 / top) * (H - TOP - BOTTOM);
    let base = y(0);
    let lines: Vec<(&str, u64)> = [("planned", Some(marks.planned)), ("budget", budget)]
        .into_iter()
        .filter_map(|(class, v)| Some((class, v.filter(|v| *v > 0)?)))
        .collect();
    let mut path = format!("M{LEFT:.1},{base:.1}");
    let mut sum = 0;
    for s in spend {
        sum += s.credits;
        let _ = write!(path, " H{:.1} V{:.1}", x(s.at), y(sum));
    }
    let _ = write!(path, " H{:.1}", x(end));
    html! {
        svg.chart viewBox={ "0 0 " (W) " " (H) } width=(W) height=(H) role="img" aria-labelledby="chart-title" {
            title #chart-title { "Credits billed over time: " (total) " in all" }
            line.axis x1=(LEFT) y1=(at(base)) x2=(at(W - RIGHT)) y2=(at(base)) {}
            line.axis x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(at(base)) {}
            @for (class, v) in lines {
                line class=(class) x1=(LEFT) y1=(at(y(v))) x2=(at(W - RIGHT)) y2=(at(y(v))) {}
                text class=(class) x=(at(W - RIGHT)) y=(at(y(v) - 3.0)) text-anchor="end" { (class) " " (v) }
            }
            path.spend d=(path) {}
            text x=(at(LEFT - 6.0)) y=(at(y(total) + 4.0)) text-anchor="end" { (total) }
            text x=(at(LEFT - 6.0)) y=(at(base)) text-anchor="end" { "0" }
            text x=(LEFT) y=(at(H - 8.0)) { (clock(start)) }
            text x=(at(W - RIGHT)) y=(at(H - 8.0)) text-anchor="end" { (clock(end)) }
        }
    }
}

/// `HH:MM:SS` UTC.
fn clock(ms: i64) -> String {
    let secs = ms.max(0) / 1000;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_climbs_by_each_bill_and_the_marks_are_drawn() {
        let spend = [
            Spend {
                at: 1_000,
                credits: 8,
            },
            Spend {
                at: 2_000,
                credits: 2,
            },
        ];
        let marks = Marks {
            planned: 30,
            budget: Some(40),
        };
        let svg = spend_svg(&spend, 0, 4_000, &marks).into_string();
        let far = spend_svg(
            &spend,
            0,
            4_000,
            &Marks {
                budget: Some(400),
                planned: 20,
            },
        )
        .into_string();
        assert!(svg.contains("10 in all"));
        assert!(svg.contains("planned 30"));
        assert!(svg.contains("budget 40"));
        assert!(!far.contains("budget"));
        assert_eq!(svg.matches(" V").count(), 2);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    }

    #[test]
    fn an_empty_run_still_draws_axes() {
        let svg = spend_svg(
            &[],
            5,
            5,
            &Marks {
                planned: 0,
                budget: None,
            },
        )
        .into_string();
        assert!(svg.contains("0 in all"));
        assert!(!svg.contains("planned"));
    }
}
