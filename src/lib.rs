//! imgpipe runs batches of image work against a paid image API without wasting a credit.
//!
//! Money's words, each with one meaning: a run's **budget** (`--max-credits`); the account's
//! **balance**; the **caps**, limits over calendar windows shared by the runs of a state
//! database; the **limit**, the most a run may spend now, the least of its budget left and the
//! balance (the caps lend within theirs by leases); **reservations** of credits for calls in
//! flight and **leases** from the caps; the **ledger**, what was billed (`imgpipe spend`). A
//! "cap" is only ever a calendar cap. Every rule about them is in [`money`].
//!
//! # Layout
//! A run's data flows from the command line through the runner: the pipeline file is read and
//! checked (`pipeline`), priced and unrolled into tasks (`plan`), paid for by the executor
//! (`exec`, calling the service through `api`), recorded in the state database (`store`), and
//! told (`events` while it runs, `report` after). The list below is that code in layers, from
//! the top down: each module uses only modules listed after it.
//!
//! - [`cli`]: parses the command line, calls the library, renders what it returns.
//! - [`desk`]: the review desk (`imgpipe review`): the runs served live on loopback behind a
//!   token, with the JSON API its page and scripts use.
//! - [`runner`]: a run's lifecycle: state, lock, fresh or continued, admission, execution.
//! - [`report`]: what the record says of a run: its summary and status, and its HTML page
//!   ([`report::page`]: templates, thumbnails, object-storage staging).
//! - [`error`]: the top-level error and the stable exit codes; the lower modules' own errors
//!   are mapped into it here, once.
//! - [`events`]: what a run tells the world outside it while it goes: alerts posted to a
//!   webhook, and a metrics file for Prometheus, both watching the executor off its hot path.
//! - [`resume`]: resuming a run, in one place: the review (a pure core: records in, what is
//!   kept, read back, fetched again and paid again out) and its crash-safe application; a
//!   reroll is a review that pays again for chosen tasks.
//! - [`exec`]: the executor: the scheduler orchestrating readiness, the calls in flight, the
//!   downloads and the run's purse; rate limiter, attempts, manifest.
//! - [`plan`]: every task priced (the one place), totals against budget and balance, the graph,
//!   and the part of a run asked for now (`--items`, `--until`, a reroll's tasks).
//! - [`checks`]: what judges a stored output: the built-in checks over its pixels, and a
//!   command the user names, run without a shell; each gives a verdict.
//! - [`aside`]: outputs set aside under `_superseded/` (a task paid for again, a file found
//!   modified): where each goes, and the moves of their files or objects, journaled with the
//!   change and made after its commit, for the resume and the executor alike.
//! - [`pipeline`]: pipeline files: YAML with positions, typed and checked, items, templates.
//! - [`money`]: every rule about money in one home, in the words above: the budget, the balance
//!   and the limit; whether a plan may start; the purse a run spends from (reservations,
//!   commitments, the caps' leases); the caps, leased in blocks from the state database so runs
//!   on every host that shares it never spend past them together; the ledger (`imgpipe
//!   spend`); and the gate a spend passes, under the run's lock, against what was confirmed.
//! - [`store`]: the state database, SQLite or PostgreSQL (migrations in `migrations/`), and the
//!   run lock.
//! - [`task_key`]: a task's name, `item/step[index]`, written and read back in one place.
//! - [`place`]: where a run directory is (an address: a local path or an `s3://` prefix, parsed
//!   once) and how its files are named and written: downloads kept, never over other bytes,
//!   through temporary files a resume recognises.
//! - [`run_id`]: a run's id, made from text once where it comes in, then passed as a type.
//! - [`sandbox`]: the local emulator of the service, for tests, benchmarks and `--sandbox`.
//! - [`api`]: the service: wire types and rules, client, billing-aware errors, retries, and
//!   downloads checked whole, then handed to a destination the caller gives.
//! - [`webhook`]: a webhook's URL, checked the one way the pipeline file, the command line and
//!   the alerts take it.
//! - [`shell`]: words of the commands imgpipe prints for pasting, quoted as a shell reads them.
//! - [`pixels`]: images read a row at a time, in memory that grows with their width and not
//!   their area: thumbnails, and what a check reads of an image.
//! - [`time`]: times as RFC 3339, the same in plans, locks, logs and reports.
//! - [`sha256`]: a sha256 as a type, made by hashing or a strict parse where text comes in.
//! - [`failpoint`]: test-only faults: crash points that kill a process at a chosen step, and a
//!   disk that fills.

// The library needs no unsafe code; the test and bench harnesses call libc themselves.
#![forbid(unsafe_code)]

pub mod api;
pub mod aside;
pub mod checks;
pub mod cli;
pub mod desk;
pub mod error;
pub mod events;
pub mod exec;
pub mod failpoint;
pub mod money;
pub mod pipeline;
pub mod pixels;
pub mod place;
pub mod plan;
pub mod report;
pub mod resume;
pub mod run_id;
pub mod runner;
pub mod sandbox;
pub mod sha256;
pub mod shell;
pub mod store;
pub mod task_key;
pub mod time;
pub mod webhook;

pub use error::{Error, exit};

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    /// The modules as the map above lists them, from the top down.
    fn map() -> Vec<String> {
        include_str!("lib.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! - [`")?.split_once('`'))
            .map(|(m, _)| m.to_owned())
            .collect()
    }

    fn sources(dir: &Path, into: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, into);
            } else if path.extension().is_some_and(|e| e == "rs") {
                into.push(path);
            }
        }
    }

    /// The top-level modules a file's code (its tests left out) names with a `crate::` path,
    /// grouped imports (`use crate::{a, b}`) included.
    fn named(text: &str) -> BTreeSet<String> {
        let code = text.split("\n#[cfg(test)]\nmod ").next().unwrap_or(text);
        let word = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let mut found = BTreeSet::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            match rest.strip_prefix('{') {
                Some(group) => {
                    let group = group.split('}').next().unwrap_or_default();
                    found.extend(group.split(',').map(|p| word(p.trim())));
                }
                None => {
                    found.insert(word(rest));
                }
            }
        }
        found
    }

    /// The map is the layers: a module's code names only modules listed after it, so no two
    /// top-level modules need each other. A failure names the file and the upward use: move
    /// the piece both need further down, or, if the layers truly changed, the map's lines.
    #[test]
    fn each_module_uses_only_those_the_map_lists_below_it() {
        let map = map();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let declared: BTreeSet<String> = include_str!("lib.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
            .map(str::to_owned)
            .collect();
        assert_eq!(
            declared,
            map.iter().cloned().collect::<BTreeSet<_>>(),
            "the map lists every module once"
        );
        let mut files = Vec::new();
        sources(&src, &mut files);
        let mut upward = Vec::new();
        for file in files {
            let rel = file.strip_prefix(&src).unwrap();
            let first = rel
                .iter()
                .next()
                .and_then(|c| c.to_str())
                .unwrap_or_default();
            let top = first.strip_suffix(".rs").unwrap_or(first);
            let Some(pos) = map.iter().position(|m| m == top) else {
                continue;
            };
            if rel.ends_with("tests.rs") || rel.ends_with("test_postgres.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for used in named(&text) {
                if let Some(at) = map.iter().position(|m| *m == used)
                    && at < pos
                {
                    upward.push(format!("{} uses {used}", rel.display()));
                }
            }
        }
        assert!(upward.is_empty(), "upward uses: {upward:#?}");
    }
}
