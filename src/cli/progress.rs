//! Progress of a run on stderr: live bars per step on a terminal; on anything else (cron, a
//! pipe) a plain log line now and then, free of control characters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::exec::Observer;
use crate::store::StepCounts;

/// How often the plain display writes a line.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// How often the plain display looks whether a line is due, finished tasks or not.
const TICK: Duration = Duration::from_secs(1);

pub(super) struct Progress {
    steps: Vec<Step>,
    planned: u64,
    spent: AtomicU64,
    done: AtomicU64,
    total: u64,
    bars: Option<Bars>,
    last_line: Mutex<Instant>,
    started: Instant,
    ended: AtomicBool,
}

struct Step {
    name: String,
    done: AtomicU64,
}

struct Bars {
    multi: MultiProgress,
    steps: Vec<ProgressBar>,
    credits: ProgressBar,
}

impl Progress {
    /// `steps`: each step's name and task count; `live`: draw bars (stderr is a terminal).
    pub(super) fn new(steps: &[(String, u64)], planned: u64, live: bool) -> Progress {
        let total = steps.iter().map(|s| s.1).sum();
        let bars = live.then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let style =
                ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} tasks  {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            let width = steps.iter().map(|s| s.0.len()).max().unwrap_or(4);
            let step_bars = steps
                .iter()
                .map(|(name, n)| {
                    let bar = multi.add(ProgressBar::new(*n).with_style(style.clone()));
                    bar.set_prefix(format!("{name:>width$}"));
                    bar
                })
                .collect();
            let credits = multi.add(
                ProgressBar::new(planned.max(1)).with_style(
                    ProgressStyle::with_template(
                        "{prefix:>16} [{bar:30}] {pos}/{len} credits  eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
                ),
            );
            credits.set_prefix("spent");
            Bars {
                multi,
                steps: step_bars,
                credits,
            }
        });
        Progress {
            steps: steps
                .iter()
                .map(|(name, _)| Step {
                    name: name.clone(),
                    done: AtomicU64::new(0),
                })
                .collect(),
            planned,
            spent: AtomicU64::new(0),
            done: AtomicU64::new(0),
            total,
            bars,
            last_line: Mutex::new(Instant::now()),
            started: Instant::now(),
            ended: AtomicBool::new(false),
        }
    }

    /// Writes the plain line every [`LOG_EVERY`] until the run ends, even while no task
    /// finishes: a run waiting on the service still tells cron's log that it is alive and
    /// where it stands. Without a tokio runtime only finished tasks write it.
    pub(super) fn log_while_running(progress: &Arc<Progress>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let progress = Arc::downgrade(progress);
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(TICK);
            loop {
                ticks.tick().await;
                match progress.upgrade() {
                    Some(p) if !p.ended.load(Ordering::Relaxed) => p.plain_line(),
                    _ => return,
                }
            }
        });
    }

    /// Counts the tasks an earlier attempt at this run already finished.
    pub(super) fn resume_from(&self, steps: &[StepCounts]) {
        for s in steps {
            let Some(i) = self.steps.iter().position(|p| p.name == s.step) else {
                continue;
            };
            self.done.fetch_add(s.succeeded, Ordering::Relaxed);
            self.spent.fetch_add(s.billed_credits, Ordering::Relaxed);
            self.steps[i].done.fetch_add(s.succeeded, Ordering::Relaxed);
            if let Some(bars) = &self.bars {
                bars.steps[i].inc(s.succeeded);
                bars.credits.inc(s.billed_credits);
            }
        }
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Relaxed);
        if let Some(bars) = &self.bars {
            for bar in &bars.steps {
                bar.abandon();
            }
            bars.credits.abandon();
        }
    }

    fn plain_line(&self) {
        let mut last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < LOG_EVERY {
            return;
        }
        *last = Instant::now();
        let done = self.done.load(Ordering::Relaxed);
        let per_step: Vec<String> = self
            .steps
            .iter()
            .map(|s| format!("{} {}", s.name, s.done.load(Ordering::Relaxed)))
            .collect();
        tracing::info!(
            "progress: {done}/{} tasks, {}/{} credits, {:.0}s elapsed ({})",
            self.total,
            self.spent.load(Ordering::Relaxed),
            self.planned,
            self.started.elapsed().as_secs_f64(),
            per_step.join(", ")
        );
    }
}

impl Observer for Progress {
    fn finish(&self) {
        self.end();
    }

    fn task_succeeded(&self, step: usize, credits: u64) {
        self.done.fetch_add(1, Ordering::Relaxed);
        self.spent.fetch_add(credits, Ordering::Relaxed);
        if let Some(s) = self.steps.get(step) {
            s.done.fetch_add(1, Ordering::Relaxed);
        }
        match &self.bars {
            Some(bars) => {
                if let Some(bar) = bars.steps.get(step) {
                    bar.inc(1);
                }
                bars.credits.inc(credits);
            }
            None => self.plain_line(),
        }
    }

    fn task_failed(&self, step: usize, item: &str, reason: &str) {
        let name = self.steps.get(step).map_or("?", |s| s.name.as_str());
        let line = format!("task {item}/{name} failed: {reason}");
        match &self.bars {
            Some(bars) => bars.multi.suspend(|| tracing::warn!("{line}")),
            None => tracing::warn!("{line}"),
        }
    }
}
