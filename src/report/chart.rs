//! The spend-over-time chart: an inline SVG, so the page needs no script or font to show it.

use std::fmt::Write;

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

/// Cumulative credits billed from `start` to `end` (unix ms) as a step line.
pub(super) fn spend_svg(spend: &[Spend], start: i64, end: i64, marks: &Marks) -> String {
    let total: u64 = spend.iter().map(|s| s.credits).sum();
    let reach = total.max(marks.planned);
    // A budget far above the spend would flatten the line: it is only drawn when close.
    let budget = marks.budget.filter(|b| *b <= reach.saturating_mul(3) / 2);
    let top = reach.max(budget.unwrap_or(0)).max(1) as f64 * 1.08;
    let end = end.max(spend.last().map_or(start, |s| s.at)).max(start + 1);
    let x = |at: i64| LEFT + (at - start).max(0) as f64 / (end - start) as f64 * (W - LEFT - RIGHT);
    let y = |credits: u64| TOP + (1.0 - credits as f64 / top) * (H - TOP - BOTTOM);
    let mut svg = format!(
        r#"<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-labelledby="chart-title"><title id="chart-title">Credits billed over time: {total} in all</title>"#
    );
    let base = y(0);
    let _ = write!(
        svg,
        r#"<line class="axis" x1="{LEFT}" y1="{base:.1}" x2="{:.1}" y2="{base:.1}"/><line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base:.1}"/>"#,
        W - RIGHT
    );
    for (class, label, value) in [
        ("planned", "planned", Some(marks.planned)),
        ("budget", "budget", budget),
    ] {
        if let Some(v) = value.filter(|v| *v > 0) {
            let _ = write!(
                svg,
                r#"<line class="{class}" x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}"/><text class="{class}" x="{1:.1}" y="{2:.1}" text-anchor="end">{label} {v}</text>"#,
                y(v),
                W - RIGHT,
                y(v) - 3.0
            );
        }
    }
    let mut path = format!("M{LEFT:.1},{base:.1}");
    let mut sum = 0;
    for s in spend {
        sum += s.credits;
        let _ = write!(path, " H{:.1} V{:.1}", x(s.at), y(sum));
    }
    let _ = write!(path, " H{:.1}", x(end));
    let _ = write!(
        svg,
        r#"<path class="spend" d="{path}"/><text x="{0:.1}" y="{1:.1}" text-anchor="end">{total}</text><text x="{0:.1}" y="{base:.1}" text-anchor="end">0</text>"#,
        LEFT - 6.0,
        y(total) + 4.0
    );
    let _ = write!(
        svg,
        r#"<text x="{LEFT}" y="{0:.1}">{1}</text><text x="{2:.1}" y="{0:.1}" text-anchor="end">{3}</text></svg>"#,
        H - 8.0,
        clock(start),
        W - RIGHT,
        clock(end)
    );
    svg
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
        let svg = spend_svg(&spend, 0, 4_000, &marks);
        let far = spend_svg(
            &spend,
            0,
            4_000,
            &Marks {
                budget: Some(400),
                planned: 20,
            },
        );
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
        );
        assert!(svg.contains("0 in all"));
        assert!(!svg.contains("planned"));
    }
}
