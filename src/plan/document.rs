//! The plan as a JSON document: what `plan --json` prints and `plan --save` writes, with the
//! hashes that let `run --plan` check, hours later, that nothing it was made from has changed.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::money::Revision;
use crate::money::admit::{Claim, Verdict};
use crate::money::limit::{Balance, Budget, Limit};
use crate::pipeline::Pipeline;
use crate::place::temp;
use crate::plan::rerolls::RerollCosts;
use crate::plan::{Costs, GenerationPrice, tool_prices};
use crate::sha256::Sha256Sum;
use crate::time::rfc3339;

/// Marks a file as a saved plan, so `--save` never overwrites anything else.
pub const KIND: &str = "imgpipe-plan";
pub const FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanDocument {
    pub kind: String,
    pub format: u32,
    pub imgpipe_version: String,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub pipeline: PipelineRef,
    pub items: ItemsRef,
    pub prices: Prices,
    pub costs: Costs,
    /// What paying again for outputs that fail a check may add to the total; absent when no
    /// step rerolls. The verdict holds the total and the worst case together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerolls: Option<RerollCosts>,
    pub budget: Option<Budget>,
    pub balance: Balance,
    pub verdict: Verdict,
    /// With `--reuse`: what earlier runs' results would save.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse: Option<ReuseEstimate>,
    /// The spending caps that cover the pipeline, where each stands now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caps: Vec<CapFit>,
    /// `--items` / `--until`: the costs above are those of the tasks asked for now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<ScopePlan>,
}

/// What `--items` and `--until` asked for, and what the whole file would cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopePlan {
    /// As asked, a sample's seed included: `--items sample:5:42 --until shot`.
    pub asked: String,
    /// Items taken, of how many.
    pub items: usize,
    pub of_items: usize,
    /// The whole file: its tasks, and its credits when every price is known.
    pub whole_tasks: u64,
    pub whole_credits: Option<u64>,
}

/// A spending cap that covers the pipeline, and whether the run fits what its window has
/// left. One that does not fit does not refuse the run: it does the whole chains that fit,
/// and stops with exit 6 until the window reopens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapFit {
    pub name: String,
    pub credits: u64,
    /// `day`, `week` or `month`.
    pub per: String,
    pub spent: u64,
    pub left: u64,
    /// When the window ends, and the next begins.
    pub window_end: String,
    /// Whether the run's total fits what is left (false when the total is unknown).
    pub fits: bool,
}

/// Tasks whose results an earlier run in the state database already has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReuseEstimate {
    pub tasks: usize,
    pub credits_saved: u64,
    /// What the run would pay with them reused, when the total is known.
    pub credits_to_pay: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineRef {
    pub name: String,
    pub file: String,
    /// sha256 of the pipeline file's bytes.
    pub sha256: Sha256Sum,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemsRef {
    pub count: usize,
    /// Where the items were read from (the pipeline file when inline).
    pub file: String,
    /// sha256 over every item's id and fields, however the file writes them.
    pub sha256: Sha256Sum,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prices {
    pub generation: GenerationPrice,
    /// The spec's tool prices, in credits.
    pub tools: BTreeMap<String, u64>,
    /// sha256 over the prices above.
    pub sha256: Sha256Sum,
}

impl Prices {
    pub fn new(generation: GenerationPrice) -> Prices {
        let tools: BTreeMap<String, u64> = tool_prices().into_iter().collect();
        let mut hasher = Sha256::new();
        let gen_text = generation
            .credits
            .map_or_else(|| "unknown".to_owned(), |c| c.to_string());
        hasher.update(format!("generation={gen_text}\n"));
        for (tool, credits) in &tools {
            hasher.update(format!("{tool}={credits}\n"));
        }
        Prices {
            generation,
            tools,
            sha256: Sha256Sum::of_digest(hasher.finalize()),
        }
    }
}

impl PlanDocument {
    pub fn new(
        pipeline: &Pipeline,
        prices: Prices,
        costs: Costs,
        budget: Option<Budget>,
        balance: Balance,
    ) -> PlanDocument {
        let mut doc = PlanDocument {
            kind: KIND.into(),
            format: FORMAT,
            imgpipe_version: env!("CARGO_PKG_VERSION").into(),
            created_at: rfc3339(SystemTime::now()),
            pipeline: PipelineRef {
                name: pipeline.name.clone(),
                file: pipeline.file.clone(),
                sha256: pipeline.text_sha256.clone(),
            },
            items: ItemsRef {
                count: pipeline.items.len(),
                file: pipeline.items.file.clone(),
                sha256: pipeline.items.sha256(),
            },
            prices,
            costs,
            rerolls: None,
            budget,
            balance,
            // Judged below, once the rerolls are priced.
            verdict: Verdict {
                fits: false,
                reasons: Vec::new(),
                warnings: Vec::new(),
            },
            reuse: None,
            caps: Vec::new(),
            scope: None,
        };
        doc.judge(pipeline);
        doc
    }

    /// Prices the rerolls of the plan's tasks (their worst case; the expected case needs the
    /// state database, [`crate::plan::rerolls::expected`]) and judges the total with them: the
    /// one verdict that `plan` prints and `run` admits by.
    pub(crate) fn judge(&mut self, pipeline: &Pipeline) {
        self.rerolls = crate::plan::rerolls::costs(pipeline, &self.costs, |_| None);
        self.verdict = Verdict::judge(
            self.costs.known_credits,
            &self.costs.unpriced_steps,
            self.rerolls_worst_case(),
            self.budget.as_ref(),
            &self.balance,
        );
    }

    /// What rerolls may spend beside the total at worst; 0 when no step rerolls.
    pub fn rerolls_worst_case(&self) -> u64 {
        self.rerolls.map_or(0, |r| r.worst_case_credits)
    }

    /// What a fresh run of this plan pays (after what reuse saves); `None` while a price is
    /// unknown.
    pub fn credits_to_pay(&self) -> Option<u64> {
        match &self.reuse {
            Some(reuse) => reuse.credits_to_pay,
            None => self.costs.total_credits,
        }
    }

    /// The revision of what this plan prices (see [`crate::money::gate`]): the pipeline file,
    /// the items, the prices, the part asked for, and the credits to pay. A saved plan's is
    /// the one `run --plan` confirms.
    pub fn revision(&self) -> Revision {
        let asked = self.scope.as_ref().map_or("", |s| s.asked.as_str());
        Revision::builder()
            .part(self.pipeline.sha256.as_str())
            .part(self.items.sha256.as_str())
            .part(self.prices.sha256.as_str())
            .part(asked)
            .number(self.costs.tasks)
            .number(self.credits_to_pay().unwrap_or(u64::MAX))
            .finish()
    }

    /// What admission reads of the plan ([`crate::money::admit`]).
    pub fn claim(&self) -> Claim<'_> {
        Claim {
            verdict: &self.verdict,
            total: self.costs.total_credits,
            rerolls: self.rerolls_worst_case(),
            saved_by_reuse: self.reuse.as_ref().map_or(0, |r| r.credits_saved),
            budget: self.budget.as_ref(),
            balance: &self.balance,
        }
    }

    /// The run's limit once it has spent `spent`: the least of its budget left and the
    /// balance the plan saw.
    pub fn limit(&self, spent: u64) -> Limit<'_> {
        Limit::of(self.budget.as_ref(), &self.balance, spent)
    }

    /// Writes the plan to `path` through a temporary file, replacing only an earlier plan.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        match std::fs::read(path) {
            Ok(existing) => {
                let is_plan = serde_json::from_slice::<serde_json::Value>(&existing)
                    .ok()
                    .is_some_and(|v| v.get("kind").and_then(|k| k.as_str()) == Some(KIND));
                if !is_plan {
                    return Err(format!(
                        "{} exists and is not an imgpipe plan; refusing to overwrite it",
                        path.display()
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(format!(
                    "cannot check what {} holds ({e}); refusing to overwrite it",
                    path.display()
                ));
            }
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut body = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
        body.push(b'\n');
        let write = || -> std::io::Result<()> {
            let mut tmp = temp::readable(dir)?;
            tmp.write_all(&body)?;
            tmp.as_file().sync_all()?;
            tmp.persist(path).map_err(|e| e.error)?;
            Ok(())
        };
        write().map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}
