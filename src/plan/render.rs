//! The plan as a table for people.

use std::fmt::Write;

use crate::money::limit::Balance;
use crate::plan::PriceSource;
use crate::plan::document::PlanDocument;

/// The plan as people read it: a heading, a table of the steps, then one line per figure
/// (total, balance, budget, caps) and the verdict.
pub fn text(doc: &PlanDocument) -> String {
    let mut out = String::new();
    heading(&mut out, doc);
    steps_table(&mut out, doc);
    out.push('\n');
    totals(&mut out, doc);
    notes(&mut out, doc);
    reuse(&mut out, doc);
    caps(&mut out, doc);
    verdict(&mut out, doc);
    out
}

/// What is planned: the pipeline, and how many items, steps and tasks.
fn heading(out: &mut String, doc: &PlanDocument) {
    let _ = writeln!(
        out,
        "Plan for {} ({}): {}, {}, {}\n",
        doc.pipeline.name,
        doc.pipeline.file,
        count(doc.items.count as u64, "item"),
        count(doc.costs.steps.len() as u64, "step"),
        count(doc.costs.tasks, "task")
    );
}

/// `n` of a thing as a sentence says it: `1 step`, `3 steps` (never "1 steps").
pub fn count(n: u64, one: &str) -> String {
    match n {
        1 => format!("1 {one}"),
        n => format!("{n} {one}s"),
    }
}

/// One row per step, columns aligned; the numbers to the right.
fn steps_table(out: &mut String, doc: &PlanDocument) {
    let header = [
        "STEP",
        "OPERATION",
        "RUNS",
        "TASKS",
        "CREDITS/TASK",
        "SUBTOTAL",
        "PRICE FROM",
    ];
    let mut rows: Vec<[String; 7]> = vec![header.map(str::to_owned)];
    for s in &doc.costs.steps {
        rows.push([
            s.step.clone(),
            format!("{} {}", s.operation, s.detail)
                .trim_end()
                .to_owned(),
            if s.once { "once" } else { "per item" }.to_owned(),
            s.tasks.to_string(),
            s.credits_per_task.map_or("?".into(), |c| c.to_string()),
            s.subtotal.map_or("?".into(), |c| c.to_string()),
            s.price_source.describe(),
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            let numeric = (3..=5).contains(&i);
            if numeric {
                let _ = write!(line, "{cell:>w$}  ", w = widths[i]);
            } else if i == 6 {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ", w = widths[i]);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// The total, the part asked for now, the balance and the budget.
fn totals(out: &mut String, doc: &PlanDocument) {
    let total = match doc.costs.total_credits {
        Some(t) => crate::money::credits(t).to_string(),
        None => format!(
            "unknown: at least {}; no price for {}",
            crate::money::credits(doc.costs.known_credits),
            doc.costs.unpriced_steps.join(", ")
        ),
    };
    let _ = writeln!(out, "total    {total}");
    rerolls(out, doc);
    if let Some(scope) = &doc.scope {
        let whole = scope.whole_credits.map_or_else(
            || "credits unknown".to_owned(),
            |c| crate::money::credits(c).to_string(),
        );
        let _ = writeln!(
            out,
            "asked    {}: {} of {} items; the whole file is {} tasks, {whole}",
            scope.asked, scope.items, scope.of_items, scope.whole_tasks
        );
    }
    let balance = match &doc.balance {
        Balance::Known { credits, field } => {
            format!(
                "{} (GET /v1/account {field})",
                crate::money::credits(*credits)
            )
        }
        Balance::Unknown { reason } => format!("unknown: {reason}"),
        Balance::NotChecked => "not checked (--offline)".into(),
    };
    let _ = writeln!(out, "balance  {balance}");
    let budget = doc.budget.as_ref().map_or("none set".into(), |b| {
        format!("{} ({})", crate::money::credits(b.max_credits), b.source)
    });
    let _ = writeln!(out, "budget   {budget}");
}

/// What rerolls may add to the total: the worst case the verdict counts, and what earlier
/// runs' checks lead to expect.
fn rerolls(out: &mut String, doc: &PlanDocument) {
    let Some(r) = doc.rerolls else {
        return;
    };
    let worst = crate::money::credits(r.worst_case_credits);
    let in_all = doc
        .costs
        .total_credits
        .map(|t| {
            let at_worst = t.saturating_add(r.worst_case_credits);
            format!(", {} at worst", crate::money::credits(at_worst))
        })
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "rerolls  up to {worst} more{in_all} (each checked task failing max_rerolls times, within rerolls.max_credits)"
    );
    let expected = r.expected_credits.map_or_else(
        || "unknown: no earlier run's verdicts of these checks were read".to_owned(),
        |e| {
            format!(
                "{} of rerolls, from how often these checks failed before",
                crate::money::credits(e)
            )
        },
    );
    let _ = writeln!(out, "expected {expected}");
}

/// Why the generation price is unknown, and what was noted or warned of while pricing.
fn notes(out: &mut String, doc: &PlanDocument) {
    if let PriceSource::Unknown { reason } = &doc.prices.generation.source
        && doc.costs.total_credits.is_none()
    {
        let _ = writeln!(out, "\ngeneration price unknown: {reason}");
    }
    for note in &doc.prices.generation.notes {
        let _ = writeln!(out, "note: {note}");
    }
    for warning in &doc.verdict.warnings {
        let _ = writeln!(out, "warning: {warning}");
    }
}

/// What earlier runs save this one.
fn reuse(out: &mut String, doc: &PlanDocument) {
    if let Some(r) = &doc.reuse {
        let _ = writeln!(
            out,
            "\nreuse: {} task(s) from earlier runs, saving {}{}",
            r.tasks,
            crate::money::credits(r.credits_saved),
            r.credits_to_pay
                .map(|c| format!("; {} to pay", crate::money::credits(c)))
                .unwrap_or_default()
        );
    }
}

/// Where each spending cap that covers the run stands.
fn caps(out: &mut String, doc: &PlanDocument) {
    for cap in &doc.caps {
        let fits = if cap.fits {
            "the run fits".to_owned()
        } else {
            format!(
                "the run does what fits and stops (exit 6) until {}",
                cap.window_end
            )
        };
        let _ = writeln!(
            out,
            "cap      {}: {} a {}, {} spent, {} left in this window; {fits}",
            cap.name,
            crate::money::credits(cap.credits),
            cap.per,
            cap.spent,
            cap.left
        );
    }
}

/// Whether the run may start, and if not, why.
fn verdict(out: &mut String, doc: &PlanDocument) {
    if doc.verdict.fits {
        let _ = writeln!(out, "\nverdict  fits: the run may start");
    } else {
        let _ = writeln!(out, "\nverdict  does not fit:");
        for reason in &doc.verdict.reasons {
            let _ = writeln!(out, "  - {reason}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1, "step"), "1 step");
        assert_eq!(count(0, "item"), "0 items");
        assert_eq!(count(900_000, "task"), "900000 tasks");
    }
}
