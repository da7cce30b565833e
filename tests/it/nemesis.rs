//! The fault campaign's short run (issue 43): a few seeded trials of each backend, through the
//! campaign of `cargo bench --bench nemesis` (benches/nemesis/, compiled in here), against this
//! build's binary. Every invariant is checked after each trial; a violation fails the test with
//! the trial's seed, its scenario and the evidence (its replay: `cargo bench --bench nemesis --
//! --seed S --trials 1`). The long run's figures are in benches/README.md.

#[path = "../../benches/nemesis/mod.rs"]
#[allow(dead_code)]
mod campaign;

use campaign::scenario::Backend;

/// Trials of each backend in CI: a few, so that the whole stays within 3 minutes on 2 cores.
const TRIALS: u64 = 3;

fn short_campaign(backend: Backend, seed: u64, postgres: Option<&str>) {
    let mut failures = Vec::new();
    for i in 0..TRIALS {
        let seed = campaign::rng::trial_seed(seed, i);
        let r = campaign::trial(
            env!("CARGO_BIN_EXE_imgpipe"),
            seed,
            &[backend],
            None,
            postgres,
            false,
        );
        for v in &r.violations {
            failures.push(format!(
                "seed {seed} ({backend:?}): {}: {}\n  scenario: {}\n  kept: {}",
                v.invariant,
                v.evidence,
                serde_json::to_string(&r.scenario).unwrap_or_default(),
                r.dir.display()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_short_fault_campaign_on_sqlite_breaks_no_invariant() {
    short_campaign(Backend::Sqlite, 43, None);
}

#[test]
fn a_short_fault_campaign_on_postgresql_breaks_no_invariant() {
    let Some(admin) = std::env::var("IMGPIPE_TEST_POSTGRES")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        crate::common::skip_unless_ci(
            "PostgreSQL",
            "IMGPIPE_TEST_POSTGRES is unset",
            "`bash .ci/run` starts a server and sets it",
        );
        return;
    };
    short_campaign(Backend::Postgres, 4343, Some(&admin));
}

#[test]
fn every_mutation_is_listed_and_named_by_the_failpoints() {
    assert_eq!(
        imgpipe::failpoint::MUTATIONS,
        &[
            "run-lock-skipped",
            "intent-after-call",
            "revision-ignored",
            "budget-ignored"
        ]
    );
}
