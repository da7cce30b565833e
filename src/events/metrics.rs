//! Metrics for node_exporter's textfile collector: the Prometheus text format, written whole to
//! a temporary file beside `--metrics-file` and renamed over it, at the start of the run, every
//! [`EVERY`] and at its end. The collector reads `*.prom` files only, so the temporary file (a
//! hidden name without that ending) is never read half written, and a killed run leaves the
//! last whole file.
//!
//! The figures are read from the state database, the same record `status` and the summary
//! read, so they agree with them; nothing is counted on the hot path. The format is a dozen
//! lines of `# HELP`, `# TYPE` and samples: written here rather than through a crate, since a
//! registry of live metric objects would only be filled from these same reads.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::run_id::RunId;
use crate::store::{CallOutcome, CheckCounts, RunGauges, Store, Totals};

/// How often the file is written while the run goes on.
pub const EVERY: Duration = Duration::from_secs(10);

/// A test-only setting: a file holding the seconds the writer takes to have passed since the
/// run's start, read again every few milliseconds in place of its clock, so a test moves the
/// [`EVERY`] cadence on without waiting it out. Each new reading is said on stderr once the
/// writer has acted on it (`metrics: test clock at N s`), so the test knows it was seen.
pub const TEST_CLOCK_FILE_ENV: &str = "IMGPIPE_TEST_METRICS_CLOCK_FILE";

/// What one writing of the file shows.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub pipeline: String,
    pub run_id: RunId,
    pub totals: Totals,
    pub gauges: RunGauges,
    /// Room left under each spending cap that covers the run, by cap name. Empty until caps
    /// exist; the family is left out when it is.
    pub caps: Vec<(String, u64)>,
    /// What the checks did; their families are left out until a check judged something.
    pub checks: CheckCounts,
    /// When the snapshot was read, unix ms.
    pub now_ms: i64,
}

/// The Prometheus text exposition format of a snapshot: one family of samples after another.
pub fn render(s: &Snapshot) -> String {
    let p = format!("pipeline=\"{}\"", escape(&s.pipeline));
    let (t, g) = (&s.totals, &s.gauges);
    let mut out = String::new();
    family(
        &mut out,
        "imgpipe_run_info",
        "gauge",
        "The run this file describes (always 1).",
        &[(format!("{p},run_id=\"{}\"", escape(&s.run_id)), 1)],
    );
    family(
        &mut out,
        "imgpipe_credits_billed_total",
        "counter",
        "Credits the service billed the run.",
        &[(p.clone(), t.billed_credits)],
    );
    family(
        &mut out,
        "imgpipe_credits_planned",
        "gauge",
        "Credits the plan priced the run's tasks at.",
        &[(p.clone(), t.planned_credits)],
    );
    family(
        &mut out,
        "imgpipe_credits_possibly_billed",
        "gauge",
        "Credits of calls sent without a complete answer, at their planned price.",
        &[(p.clone(), t.possibly_billed_credits)],
    );
    family(
        &mut out,
        "imgpipe_calls_total",
        "counter",
        "Paid calls that ended, by outcome.",
        &calls_by_outcome(&p, g),
    );
    family(
        &mut out,
        "imgpipe_calls_in_flight",
        "gauge",
        "Paid calls sent and not answered yet.",
        &[(p.clone(), g.in_flight)],
    );
    family(
        &mut out,
        "imgpipe_rate_limited_calls_total",
        "counter",
        "Calls the service answered 429 (too many requests).",
        &[(p.clone(), g.rate_limited)],
    );
    family(
        &mut out,
        "imgpipe_tasks",
        "gauge",
        "The run's tasks by status.",
        &tasks_by_status(&p, t),
    );
    if !s.caps.is_empty() {
        family(
            &mut out,
            "imgpipe_cap_remaining_credits",
            "gauge",
            "Credits a spending cap covering the run has left in its window.",
            &caps_left(&p, &s.caps),
        );
    }
    if s.checks.any() {
        checks(&mut out, &p, &s.checks);
    }
    let age_ms = g
        .oldest_undownloaded_ms
        .map_or(0, |made| s.now_ms.saturating_sub(made).max(0));
    family(
        &mut out,
        "imgpipe_oldest_undownloaded_output_age_seconds",
        "gauge",
        "Age of the oldest output made and not downloaded yet (0 when none).",
        &[(p.clone(), seconds(age_ms))],
    );
    if let Some(last) = g.last_success_ms {
        family(
            &mut out,
            "imgpipe_last_success_timestamp_seconds",
            "gauge",
            "When a run of the pipeline last succeeded, in unix seconds.",
            &[(p.clone(), seconds(last))],
        );
    }
    out
}

/// The checks' families: verdicts by what they said, and the rerolls they paid for.
fn checks(out: &mut String, p: &str, c: &CheckCounts) {
    let verdicts: Vec<(String, u64)> = [
        ("passed", c.passed),
        ("failed", c.failed),
        ("not_checked", c.not_checked),
    ]
    .iter()
    .map(|(verdict, n)| (format!("{p},verdict=\"{verdict}\""), *n))
    .collect();
    family(
        out,
        "imgpipe_checks_total",
        "counter",
        "Checks' verdicts on stored outputs (one per check and output), by verdict.",
        &verdicts,
    );
    family(
        out,
        "imgpipe_check_rerolls_total",
        "counter",
        "Tasks paid for again because a check failed their outputs.",
        &[(p.to_owned(), c.rerolls)],
    );
    family(
        out,
        "imgpipe_check_reroll_credits_total",
        "counter",
        "Credits those rerolls were planned at.",
        &[(p.to_owned(), c.reroll_credits)],
    );
}

/// One family: its help, its type, then each sample with its labels.
fn family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: &[(String, impl std::fmt::Display)],
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// Paid calls that ended, one sample per outcome, every outcome shown (0 when none).
fn calls_by_outcome(p: &str, g: &RunGauges) -> Vec<(String, u64)> {
    CallOutcome::ALL
        .iter()
        .map(|outcome| {
            let n = g
                .calls
                .iter()
                .filter(|(o, _)| o == outcome)
                .map(|c| c.1)
                .sum::<u64>();
            (format!("{p},outcome=\"{outcome}\""), n)
        })
        .collect()
}

/// The run's tasks, one sample per status.
fn tasks_by_status(p: &str, t: &Totals) -> Vec<(String, u64)> {
    [
        ("succeeded", t.succeeded),
        ("failed", t.failed),
        ("blocked", t.blocked),
        ("pending", t.pending),
    ]
    .iter()
    .map(|(status, n)| (format!("{p},status=\"{status}\""), *n))
    .collect()
}

/// Room left under each cap, one sample per cap.
fn caps_left(p: &str, caps: &[(String, u64)]) -> Vec<(String, u64)> {
    caps.iter()
        .map(|(cap, left)| (format!("{p},cap=\"{}\"", escape(cap)), *left))
        .collect()
}

/// Milliseconds as seconds with three decimals, the format's float.
fn seconds(ms: i64) -> String {
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// A label value as the format quotes it: backslash, double quote and newline escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// Reads the snapshot of `run_id` now.
async fn snapshot(store: &Store, run_id: &RunId, pipeline: &str) -> Result<Snapshot, String> {
    let totals = store
        .runs()
        .totals(run_id)
        .await
        .map_err(|e| e.to_string())?;
    let gauges = store
        .gauges()
        .of_run(run_id, pipeline)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Snapshot {
        pipeline: pipeline.to_owned(),
        run_id: run_id.clone(),
        totals,
        gauges,
        caps: cap_room(store, pipeline).await,
        checks: store
            .verdicts()
            .counts(run_id)
            .await
            .map_err(|e| e.to_string())?,
        now_ms: crate::store::now_ms(),
    })
}

/// The credits each spending cap covering `pipeline` has left in its window; none when they
/// cannot be read (the metrics go on without them).
async fn cap_room(store: &Store, pipeline: &str) -> Vec<(String, u64)> {
    let Ok(caps) = crate::money::caps::recorded(store).await else {
        return Vec::new();
    };
    let mut room = Vec::new();
    for cap in caps.iter().filter(|c| c.covers(pipeline)) {
        if let Ok(standing) = crate::money::caps::Standing::of(store, cap).await {
            room.push((standing.name, standing.left));
        }
    }
    room
}

/// Writes `text` to `path` whole: a temporary file in its directory, synced, then renamed
/// over it. `later`: not the first writing, where the test crash point may cut it halfway.
fn write_whole(path: &Path, text: &str, later: bool) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut file = tempfile::Builder::new()
        .prefix(".imgpipe-metrics")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    let bytes = text.as_bytes();
    let half = bytes.len() / 2;
    file.write_all(&bytes[..half])?;
    if later {
        file.flush()?;
        crate::failpoint::hit("metrics-file-half-written");
    }
    file.write_all(&bytes[half..])?;
    file.as_file().sync_all()?;
    // The collector runs as another user: the file is readable by all, as a metric is.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// The file kept up to date while a run goes on.
pub struct MetricsFile {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Writer>,
}

struct Writer {
    path: PathBuf,
    store: Store,
    run_id: RunId,
    pipeline: String,
    written: usize,
}

impl Writer {
    /// One writing; a failure is said and the run goes on.
    async fn write(&mut self) {
        let text = match snapshot(&self.store, &self.run_id, &self.pipeline).await {
            Ok(s) => render(&s),
            Err(e) => {
                tracing::warn!("metrics: cannot read the run's figures: {e}");
                return;
            }
        };
        let path = self.path.clone();
        let later = self.written > 0;
        let written = tokio::task::spawn_blocking(move || write_whole(&path, &text, later)).await;
        match written {
            Ok(Ok(())) => self.written += 1,
            Ok(Err(e)) => tracing::warn!("metrics: cannot write {}: {e}", self.path.display()),
            Err(e) => tracing::warn!("metrics: the writer failed: {e}"),
        }
    }

    /// Writes every [`EVERY`] of `clock` until stopped.
    async fn every(mut self, mut clock: Clock, stopped: CancellationToken) -> Writer {
        let mut next = EVERY;
        loop {
            tokio::select! {
                () = stopped.cancelled() => return self,
                now = clock.reach(next) => {
                    self.write().await;
                    next = now + EVERY;
                    clock.acted_on(now);
                }
            }
        }
    }
}

/// The writer's clock: time since the run's start.
enum Clock {
    Real(tokio::time::Instant),
    /// The test's, in a file (see [`TEST_CLOCK_FILE_ENV`]); the last reading said.
    File(PathBuf, Option<Duration>),
}

impl Clock {
    fn start() -> Clock {
        match std::env::var_os(TEST_CLOCK_FILE_ENV) {
            Some(path) => Clock::File(PathBuf::from(path), None),
            None => Clock::Real(tokio::time::Instant::now()),
        }
    }

    /// Waits until the clock reads `at` or later, and returns what it reads.
    async fn reach(&mut self, at: Duration) -> Duration {
        match self {
            Clock::Real(start) => {
                tokio::time::sleep_until(*start + at).await;
                start.elapsed()
            }
            Clock::File(path, said) => loop {
                let read = std::fs::read_to_string(&*path)
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                match read {
                    Some(now) if now >= at => return now,
                    Some(now) if *said != Some(now) => {
                        *said = Some(now);
                        tracing::info!("metrics: test clock at {} s", now.as_secs());
                    }
                    _ => {}
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            },
        }
    }

    /// Says a reading of the test's clock once the writer has acted on it.
    fn acted_on(&mut self, now: Duration) {
        if let Clock::File(_, said) = self {
            *said = Some(now);
            tracing::info!("metrics: test clock at {} s", now.as_secs());
        }
    }
}

impl MetricsFile {
    /// Writes the file once, then every [`EVERY`] until [`MetricsFile::finish`].
    pub async fn start(path: PathBuf, store: Store, run_id: &RunId, pipeline: &str) -> MetricsFile {
        let mut writer = Writer {
            path,
            store,
            run_id: run_id.to_owned(),
            pipeline: pipeline.to_owned(),
            written: 0,
        };
        writer.write().await;
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(writer.every(Clock::start(), stopped));
        MetricsFile { stop, task }
    }

    /// The last writing, with the run's figures as it ended.
    pub async fn finish(self) {
        self.stop.cancel();
        match self.task.await {
            Ok(mut writer) => writer.write().await,
            Err(e) => tracing::warn!("metrics: the writer failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_family_without_caps_is_left_out_and_ages_are_seconds() {
        let snapshot = Snapshot {
            pipeline: "night\"ly".into(),
            run_id: "r1".into(),
            gauges: RunGauges {
                oldest_undownloaded_ms: Some(1_000),
                ..RunGauges::default()
            },
            now_ms: 3_500,
            totals: Totals::default(),
            caps: Vec::new(),
            checks: CheckCounts::default(),
        };
        let text = render(&snapshot);
        assert!(!text.contains("imgpipe_cap_remaining_credits"), "{text}");
        assert!(!text.contains("imgpipe_checks_total"), "{text}");
        assert!(!text.contains("imgpipe_last_success"), "{text}");
        assert!(
            text.contains(
                "imgpipe_oldest_undownloaded_output_age_seconds{pipeline=\"night\\\"ly\"} 2.500\n"
            ),
            "{text}"
        );
    }
}
