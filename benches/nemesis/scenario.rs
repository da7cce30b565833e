//! A trial's scenario, drawn whole from its seed before anything runs: the pipeline, the
//! backend, the sandbox's faults, the hosts and what each does, and when each is stopped. Every
//! instant is a point in the run's progress (calls billed, downloads served), never a wall time.

use serde::Serialize;

use super::rng::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Backend {
    /// SQLite state, outputs in a local directory.
    Sqlite,
    /// PostgreSQL state (through the campaign's proxy), outputs in a local directory.
    Postgres,
}

#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub id: String,
    /// `generate` or a tool.
    pub op: &'static str,
    /// The step it reads (none for a generation).
    pub from: Option<String>,
    /// Images a generation makes.
    pub n: u64,
    /// A generation made once for the batch (`once: true`), which every item's next step joins.
    pub once: bool,
    pub credits_each: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Faults {
    pub server_error: f64,
    pub rate_limit: f64,
    pub drop: f64,
    pub gateway: f64,
    pub partial: f64,
    pub truncate: f64,
    pub latency_ms: u64,
    pub jitter_ms: u64,
    /// The account's own limit (the sandbox's 429s beyond it), calls per second.
    pub account_rate: Option<u64>,
    /// Result URLs expire (all at once) when this many calls are billed.
    pub expire_urls_at: Option<u64>,
}

/// How a process is stopped, at a point of the run's progress.
#[derive(Clone, Copy, Debug, Serialize)]
pub enum Fate {
    Ends,
    /// `kill -9` once this many calls (counted from the process's start) are billed.
    KillAtBilled(u64),
    /// `kill -9` once this many downloads are served (counted from the process's start).
    KillAtDownload(u64),
    /// SIGTERM once this many calls are billed.
    TermAtBilled(u64),
    /// SIGTERM the database's proxy cut (PostgreSQL trials): once this many calls are billed.
    DatabaseCutAtBilled(u64),
}

#[derive(Clone, Copy, Debug, Serialize)]
pub enum Command {
    Run,
    Resume { wait: bool },
}

#[derive(Clone, Debug, Serialize)]
pub struct Host {
    pub command: Command,
    /// Started once this many calls are billed (0: at once).
    pub start_at_billed: u64,
    pub fate: Fate,
}

#[derive(Clone, Debug, Serialize)]
pub struct Confirms {
    /// Reroll what (`item/step`).
    pub target: String,
    /// Confirms of one dry run sent at once on the desk.
    pub at_once: u64,
    /// A command-line reroll confirming the same dry run at the same time.
    pub cli_too: bool,
    /// One more confirm of it once the others are done (refused: the run changed).
    pub late: bool,
    /// The desk killed once this many of the reroll's calls are billed.
    pub kill_desk_at: Option<u64>,
}

/// Checks on some steps, and the bad images the sandbox makes for them to catch.
#[derive(Clone, Debug, Serialize)]
pub struct Checks {
    /// The steps judged by `not_blank`, by their index in `steps`, each with its
    /// `max_rerolls`.
    pub steps: Vec<(usize, u64)>,
    /// `rerolls.max_credits`, within the room the budget leaves beside the plan (a run whose
    /// rerolls could cost more than its budget is refused); `None` when it leaves none: the
    /// checks then flag what fails (`on_fail: flag`), paying nothing again.
    pub max_credits: Option<u64>,
    /// The share of every image the sandbox makes a flat frame.
    pub blank: f64,
    /// The judged steps also judged by `distinct`, by their index in `steps`.
    pub distinct: Vec<usize>,
    /// The share of generations of two images the sandbox makes two copies of one.
    pub duplicate: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Scenario {
    pub seed: u64,
    pub backend: Backend,
    pub items: u64,
    pub steps: Vec<Step>,
    pub concurrency: u64,
    /// The budget (`budget.max_credits`), when one is set.
    pub budget: Option<u64>,
    pub planned: u64,
    pub tasks: u64,
    pub faults: Faults,
    pub hosts: Vec<Host>,
    pub confirms: Option<Confirms>,
    /// PostgreSQL trials: the proxy adds this much latency to every packet.
    pub db_delay_ms: u64,
    /// Checks, drawn after everything else so that a seed's other draws stay as they were.
    pub checks: Option<Checks>,
}

const TOOLS: &[(&str, u64)] = &[
    ("erase", 2),
    ("expand", 5),
    ("upscale", 4),
    ("remove_background", 5),
];

impl Scenario {
    /// The scenario of `seed`; `max_items` caps its items (a short campaign), the rest of the
    /// draw unchanged.
    pub fn draw(seed: u64, backends: &[Backend], max_items: Option<u64>) -> Scenario {
        let mut r = Rng::new(seed);
        let backend = r.pick(backends);
        let u = (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let items = (5 + (195.0 * u * u * u) as u64).min(max_items.unwrap_or(u64::MAX).max(5));
        let n_steps = r.between(2, 5);
        let mut steps: Vec<Step> = Vec::new();
        let join = r.chance(0.25);
        if join {
            steps.push(Step {
                id: "style".into(),
                op: "generate",
                from: None,
                n: r.between(1, 2),
                once: true,
                credits_each: 4,
            });
        }
        steps.push(Step {
            id: "s0".into(),
            op: "generate",
            from: None,
            n: r.between(1, 2),
            once: false,
            credits_each: 4,
        });
        while (steps.len() as u64) < n_steps + u64::from(join) {
            let per_item: Vec<String> = steps
                .iter()
                .filter(|s| !s.once)
                .map(|s| s.id.clone())
                .collect();
            // Fan-out: any earlier step may be read again.
            let from = per_item[r.between(0, per_item.len() as u64 - 1) as usize].clone();
            let (op, credits) = r.pick(TOOLS);
            steps.push(Step {
                id: format!("s{}", steps.len()),
                op,
                from: Some(from),
                n: 1,
                once: false,
                credits_each: credits,
            });
        }
        let (tasks, planned) = totals(&steps, items);
        let budget = match r.between(0, 9) {
            0..=1 => None,
            2..=6 => Some(planned),
            _ => Some(planned + r.between(0, planned / 10 + 1)),
        };
        let maybe = |r: &mut Rng, p: f64, most: f64| {
            if r.chance(p) {
                most * (r.between(1, 100) as f64 / 100.0)
            } else {
                0.0
            }
        };
        // A budget of the plan exactly is held against the spending the plan does not foresee:
        // calls billed and their answers lost, paid again.
        let exact = budget == Some(planned);
        let faults = Faults {
            server_error: maybe(&mut r, 0.5, 0.05),
            rate_limit: maybe(&mut r, 0.3, 0.03),
            drop: maybe(&mut r, if exact { 1.0 } else { 0.5 }, 0.04).max(if exact {
                0.01
            } else {
                0.0
            }),
            gateway: maybe(&mut r, 0.3, 0.02),
            partial: maybe(&mut r, 0.4, 0.04),
            truncate: maybe(&mut r, 0.4, 0.04),
            latency_ms: r.between(0, 40),
            jitter_ms: r.between(0, 40),
            account_rate: r.chance(0.3).then(|| r.between(40, 120)),
            expire_urls_at: r.chance(0.2).then(|| r.between(1, tasks)),
        };
        // Under a budget of the plan exactly, a kill's possibly billed calls leave no room for
        // any resume: only a run that goes to its end meets the spending the plan did not foresee.
        let first = match exact && r.chance(0.5) {
            true => Fate::Ends,
            false => fate(&mut r, tasks, backend),
        };
        let mut hosts = vec![Host {
            command: Command::Run,
            start_at_billed: 0,
            fate: first,
        }];
        for _ in 0..r.between(0, 2) {
            hosts.push(Host {
                command: Command::Resume {
                    wait: r.chance(0.5),
                },
                start_at_billed: r.between(0, tasks),
                fate: fate(&mut r, tasks, backend),
            });
        }
        let confirms = r.chance(0.5).then(|| {
            let item = r.between(0, items - 1);
            let per_item: Vec<&Step> = steps.iter().filter(|s| !s.once).collect();
            let step = &per_item[r.between(0, per_item.len() as u64 - 1) as usize].id;
            Confirms {
                target: format!("i{item}/{step}"),
                at_once: r.between(1, 3),
                cli_too: r.chance(0.4),
                late: r.chance(0.6),
                kill_desk_at: r.chance(0.25).then(|| r.between(1, 3)),
            }
        });
        // A confirmed reroll pays for a chain again: the budget leaves room for a few, so that
        // a confirm taken twice (a stale revision let through) is not hidden by the budget
        // refusing the second.
        let budget = match (budget, &confirms) {
            (Some(b), Some(_)) => Some(b + 3 * (planned / items + 8)),
            (b, _) => b,
        };
        let concurrency = r.between(2, 8);
        let db_delay_ms = if backend == Backend::Postgres {
            r.pick(&[0, 0, 2, 10])
        } else {
            0
        };
        let checks = r.chance(0.5).then(|| {
            let mut judged = Vec::new();
            for (i, step) in steps.iter().enumerate() {
                if !step.once && r.chance(0.6) {
                    judged.push((i, r.between(1, 3)));
                }
            }
            if judged.is_empty() {
                judged.push((steps.len() - 1, r.between(1, 3)));
            }
            let most = planned / 4 + 8;
            let max_credits = match budget.map(|b| b.saturating_sub(planned)) {
                Some(0) => None,
                Some(room) => Some(r.between(1, room.min(most))),
                None => Some(r.between(1, most)),
            };
            let blank = r.between(2, 30) as f64 / 100.0;
            // `distinct` compares a generation's images, or what later steps made of each: a
            // step that makes one image an item has nothing to compare it with.
            let distinct: Vec<usize> = judged
                .iter()
                .map(|(i, _)| *i)
                .filter(|&i| r.chance(0.4) && fans_out(&steps, i))
                .collect();
            let duplicate = match distinct.is_empty() {
                true => 0.0,
                false => r.between(5, 30) as f64 / 100.0,
            };
            Checks {
                steps: judged,
                max_credits,
                blank,
                distinct,
                duplicate,
            }
        });
        Scenario {
            seed,
            backend,
            items,
            concurrency,
            steps,
            budget,
            planned,
            tasks,
            faults,
            hosts,
            confirms,
            db_delay_ms,
            checks,
        }
    }

    /// The pipeline file.
    pub fn pipeline_yaml(&self) -> String {
        let mut y = String::from("version: 1\nname: nemesis\n");
        if let Some(b) = self.budget {
            y += &format!("budget: {{ max_credits: {b} }}\n");
        }
        y += "pricing: { generation: 4 }\n";
        y += &format!("concurrency: {}\n", self.concurrency);
        if self.faults.account_rate.is_none() {
            y += "rate_limit: 200/s\n";
        }
        if let Some(most) = self.checks.as_ref().and_then(|c| c.max_credits) {
            y += &format!("rerolls: {{ max_credits: {most} }}\n");
        }
        y += "items:\n";
        for i in 0..self.items {
            y += &format!("  - {{ id: i{i}, subject: thing number {i} }}\n");
        }
        y += "steps:\n";
        let style = self.steps.iter().any(|s| s.once);
        for (i, s) in self.steps.iter().enumerate() {
            y += &format!("  - id: {}\n", s.id);
            let judged = self.checks.iter().flat_map(|c| &c.steps);
            if let Some((_, max)) = judged.into_iter().find(|(at, _)| *at == i) {
                let distinct = self.checks.iter().any(|c| c.distinct.contains(&i));
                y += match distinct {
                    true => "    checks: [not_blank, distinct]\n",
                    false => "    checks: [not_blank]\n",
                };
                match self.checks.as_ref().and_then(|c| c.max_credits) {
                    Some(_) => y += &format!("    max_rerolls: {max}\n"),
                    None => y += "    on_fail: flag\n",
                }
            }
            if s.once {
                y += "    once: true\n";
                y += &format!(
                    "    generate: {{ prompt: \"a palette study\", n: {} }}\n",
                    s.n
                );
                continue;
            }
            match (s.op, &s.from) {
                ("generate", _) => {
                    y += &format!(
                        "    generate:\n      prompt: \"Studio photo of {{{{ item.subject }}}}\"\n      n: {}\n",
                        s.n
                    );
                    if style {
                        y += "      image_urls: [ { from: style } ]\n";
                    }
                }
                ("erase", Some(f)) => {
                    y += &format!("    erase: {{ from: {f}, object_name: the label }}\n");
                }
                ("expand", Some(f)) => {
                    y += &format!("    expand: {{ from: {f}, aspect_ratio: \"16:9\" }}\n");
                }
                ("upscale", Some(f)) => {
                    y += &format!("    upscale: {{ from: {f}, desired_increase: 4 }}\n");
                }
                (_, Some(f)) => {
                    y += &format!("    remove_background: {{ from: {f} }}\n");
                }
                _ => unreachable!("a tool reads a step"),
            }
        }
        y
    }
}

/// Whether step `i` makes more than one image an item from one generation: a generation of
/// two, or a tool reading what came of one.
fn fans_out(steps: &[Step], i: usize) -> bool {
    let step = &steps[i];
    match &step.from {
        None => !step.once && step.n > 1,
        Some(from) => steps
            .iter()
            .position(|s| &s.id == from)
            .is_some_and(|f| fans_out(steps, f)),
    }
}

fn fate(r: &mut Rng, tasks: u64, backend: Backend) -> Fate {
    let at = r.between(1, tasks.max(1));
    match r.between(0, 9) {
        0..=2 => Fate::Ends,
        3..=5 => Fate::KillAtBilled(at),
        6 => Fate::KillAtDownload(at),
        7 if backend == Backend::Postgres => Fate::DatabaseCutAtBilled(at),
        _ => Fate::TermAtBilled(at),
    }
}

/// Tasks and credits of the pipeline over `items` items: each step's images fan out to its
/// readers (a tool makes one call per image it reads).
fn totals(steps: &[Step], items: u64) -> (u64, u64) {
    let mut images: std::collections::HashMap<&str, u64> = Default::default();
    let (mut tasks, mut credits) = (0, 0);
    for s in steps {
        let (calls, made) = match (&s.from, s.once) {
            (_, true) => (1, s.n),
            (None, false) => (items, items * s.n),
            (Some(f), false) => (images[f.as_str()], images[f.as_str()]),
        };
        let each = if s.op == "generate" {
            s.credits_each * s.n
        } else {
            s.credits_each
        };
        tasks += calls;
        credits += calls * each;
        images.insert(s.id.as_str(), made);
    }
    (tasks, credits)
}
