//! A step's `checks:`, `on_fail` and `max_rerolls`, and the file's `rerolls:`: each check fits
//! what its step's operation promises, its settings are in range, and a step that pays again
//! for a failed output has a budget for it.

use super::*;
use crate::pipeline::checks::{
    Check, CommandCheck, DEFAULT_COMMAND_TIMEOUT, DEFAULT_MIN_DISTANCE, DEFAULT_MIN_STDDEV,
    DEFAULT_TRANSPARENT, FILE_PLACEHOLDER, MAX_COMMAND_TIMEOUT_SECS, MAX_REROLLS, OnFail,
    StepChecks,
};
use crate::pipeline::spec::{CheckSpec, CommandSpec};

impl Checker<'_> {
    /// Fills each draft's checks, and checks `rerolls:` against the steps that reroll.
    pub(super) fn step_checks(&mut self, spec: &PipelineSpec, drafts: &mut [Draft<'_>]) {
        let budgeted = spec.rerolls.is_some();
        let images: Vec<Option<u64>> = (0..drafts.len())
            .map(|i| images_per_instance(drafts, i, drafts.len()))
            .collect();
        for ((step, draft), images) in spec.steps.iter().zip(drafts.iter_mut()).zip(images) {
            draft.checks = self.checks_of(step, draft, budgeted, images);
        }
        if spec.rerolls.as_ref().is_some_and(|r| r.max_credits == 0) {
            let mark = self.at(&["rerolls", "max_credits"]);
            self.error(
                mark,
                "rerolls.max_credits must be at least 1; to pay for no rerolls, give the checks `on_fail: flag`",
            );
        }
    }

    fn checks_of(
        &mut self,
        step: &StepSpec,
        draft: &Draft<'_>,
        budgeted: bool,
        images: Option<u64>,
    ) -> Option<StepChecks> {
        let node = draft.node;
        let Some(list) = &step.checks else {
            for key in ["on_fail", "max_rerolls"] {
                if let Some(k) = node.key(key) {
                    self.error(
                        k.mark,
                        format!(
                            "`{key}` says what a failed check does, but step {} has no `checks`",
                            shown(&step.id)
                        ),
                    );
                }
            }
            return None;
        };
        let checks_node = node.get("checks");
        if checks_node
            .and_then(Node::elements)
            .is_some_and(<[Node]>::is_empty)
        {
            self.error(
                mark_of(node.key("checks"), node),
                "checks is empty; list at least one check, or leave it out",
            );
        }
        let elements = kept(checks_node, self.skipped);
        let checks: Vec<Check> = list
            .iter()
            .zip(elements)
            .filter_map(|(c, at)| self.check(c, at, draft.op.as_ref(), images))
            .collect();
        let on_fail = step.on_fail.unwrap_or_default();
        let max_rerolls = self.max_rerolls(step, node, on_fail);
        if on_fail == OnFail::Reroll && !budgeted {
            let mark = mark_of(node.get("on_fail").or(node.key("checks")), node);
            let default = if step.on_fail.is_none() {
                " (the default)"
            } else {
                ""
            };
            self.error(mark, format!(
                "step {} pays again for outputs that fail a check (on_fail: reroll{default}), but the file sets no `rerolls: {{ max_credits: N }}`",
                shown(&step.id)
            ))
            .hint = Some("add `rerolls: { max_credits: N }` at the top of the file, or give the step `on_fail: flag` to keep and mark what fails".into());
        }
        Some(StepChecks {
            checks,
            on_fail,
            max_rerolls,
        })
    }

    fn max_rerolls(&mut self, step: &StepSpec, node: &Node, on_fail: OnFail) -> u32 {
        let Some(n) = step.max_rerolls else {
            return 1;
        };
        let mark = mark_of(node.get("max_rerolls"), node);
        if on_fail != OnFail::Reroll {
            self.error(
                mark,
                format!(
                    "max_rerolls counts the times a task is paid again, but on_fail is `{}`",
                    on_fail.as_str()
                ),
            );
        } else if !(1..=MAX_REROLLS).contains(&n) {
            self.error(
                mark,
                format!("max_rerolls must be between 1 and {MAX_REROLLS}, got {n}"),
            );
        }
        n
    }

    /// One check, its settings in range and fitting `op` (when it could be built).
    /// `images` is what the step makes per item (or per batch), when known.
    fn check(
        &mut self,
        spec: &CheckSpec,
        at: &Node,
        op: Option<&Operation>,
        images: Option<u64>,
    ) -> Option<Check> {
        let setting = |name: &str, key: &str| {
            at.get(name)
                .and_then(|v| v.get(key))
                .map_or(at.mark, |n| n.mark)
        };
        let check = match spec {
            CheckSpec::NotBlank(s) => {
                let min_stddev = s.min_stddev.unwrap_or(DEFAULT_MIN_STDDEV);
                if !(0.0..=255.0).contains(&min_stddev) {
                    self.error(setting("not_blank", "min_stddev"), format!(
                        "not_blank.min_stddev is a standard deviation of luma, 0 to 255, got {min_stddev}"
                    ));
                    return None;
                }
                Check::NotBlank { min_stddev }
            }
            CheckSpec::Size => Check::Size,
            CheckSpec::Transparent(s) => {
                let min = s.min.unwrap_or(DEFAULT_TRANSPARENT.0);
                let max = s.max.unwrap_or(DEFAULT_TRANSPARENT.1);
                for (key, v) in [("min", min), ("max", max)] {
                    if !(0.0..=1.0).contains(&v) {
                        self.error(
                            setting("transparent", key),
                            format!("transparent.{key} is a share of the pixels, 0 to 1, got {v}"),
                        );
                        return None;
                    }
                }
                if min > max {
                    self.error(
                        setting("transparent", "max"),
                        format!("transparent.max ({max}) is below transparent.min ({min})"),
                    );
                    return None;
                }
                Check::Transparent { min, max }
            }
            CheckSpec::Distinct(s) => {
                let min_distance = s.min_distance.unwrap_or(DEFAULT_MIN_DISTANCE);
                if !(1..=64).contains(&min_distance) {
                    self.error(setting("distinct", "min_distance"), format!(
                        "distinct.min_distance counts the bits of a 64-bit hash, 1 to 64, got {min_distance}"
                    ));
                    return None;
                }
                Check::Distinct { min_distance }
            }
            CheckSpec::Command(c) => {
                Check::Command(self.command(c, at.get("command").unwrap_or(at))?)
            }
        };
        if let Some(op) = op
            && let Err(why) = fits(&check, op, images)
        {
            self.error(at.mark, why);
            return None;
        }
        Some(check)
    }

    /// A command's argv: a program, and `{file}` in one of its arguments.
    fn command(&mut self, spec: &CommandSpec, at: &Node) -> Option<CommandCheck> {
        let argv = spec.argv();
        let argv_node = at.get("argv").unwrap_or(at);
        if argv.first().is_none_or(|p| p.trim().is_empty()) {
            self.error(
                argv_node.mark,
                "command needs a program to run, then its arguments",
            );
            return None;
        }
        if !argv.iter().skip(1).any(|a| a.contains(FILE_PLACEHOLDER)) {
            self.error(argv_node.mark, format!(
                "command never names the image: put `{FILE_PLACEHOLDER}` in one of its arguments, where the output's path goes"
            ))
            .hint = Some(format!("e.g. `command: [\"python3\", \"score.py\", \"{FILE_PLACEHOLDER}\"]`; the command runs without a shell"));
            return None;
        }
        let timeout =
            match spec.timeout() {
                None => DEFAULT_COMMAND_TIMEOUT,
                Some(secs) if (1..=MAX_COMMAND_TIMEOUT_SECS).contains(&secs) => {
                    std::time::Duration::from_secs(secs)
                }
                Some(secs) => {
                    let mark = mark_of(at.get("timeout"), at);
                    self.error(mark, format!(
                    "command.timeout is in seconds, 1 to {MAX_COMMAND_TIMEOUT_SECS}, got {secs}"
                ));
                    return None;
                }
            };
        Some(CommandCheck {
            argv: argv.to_vec(),
            timeout,
        })
    }
}

/// Images step `i` makes per instance: a generation's `n`, carried down its chain by the
/// tools that edit them; `None` when an operation (or a cycle, reported elsewhere) hides it.
fn images_per_instance(drafts: &[Draft<'_>], i: usize, depth: usize) -> Option<u64> {
    match drafts.get(i)?.op.as_ref()? {
        Operation::Generate(g) => Some(u64::from(g.n)),
        Operation::Tool(Tool {
            input: Input::Url(_),
            ..
        }) => Some(1),
        Operation::Tool(Tool {
            input: Input::Step(r),
            ..
        }) => images_per_instance(drafts, r.0, depth.checked_sub(1)?),
    }
}

/// Whether a check can judge what `op` makes (`images` of them per instance, when known):
/// `Err` says why not.
fn fits(check: &Check, op: &Operation, images: Option<u64>) -> Result<(), String> {
    let name = match op {
        Operation::Generate(_) => "generation",
        Operation::Tool(t) => t.params.tool().as_str(),
    };
    match (check, op) {
        (Check::Transparent { .. }, Operation::Tool(Tool { params: ToolOp::RemoveBackground, .. })) => Ok(()),
        (Check::Transparent { .. }, _) => Err(format!(
            "`transparent` fits only a remove_background step: a {name} promises no transparent pixels"
        )),
        // Upscale promises its factor, expand its ratio; erase and remove_background keep
        // their input's size.
        (Check::Size, Operation::Tool(Tool { params: ToolOp::Expand { aspect_ratio: None, .. }, .. })) => Err(
            "`size` needs dimensions the operation promises: an expand promises them only with an aspect_ratio".into(),
        ),
        (Check::Size, Operation::Generate(_)) => Err(
            "`size` needs dimensions the operation promises, and a generation promises none: it fits upscale, expand with an aspect_ratio, erase and remove_background".into(),
        ),
        // A generation's images, or what the steps after it made of each of them.
        (Check::Distinct { .. }, _) if images.is_none_or(|n| n >= 2) => Ok(()),
        (Check::Distinct { .. }, Operation::Generate(_)) => Err(
            "`distinct` compares the images of one generation, and this one makes a single image (n: 1)".into(),
        ),
        (Check::Distinct { .. }, _) => Err(format!(
            "`distinct` compares the images of one generation, or what later steps made of each; this {name} makes a single image"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use crate::pipeline::checks::{Check, CommandCheck, OnFail, Rerolls};
    use crate::pipeline::load_str;

    const HEAD: &str = "version: 1\nname: checked\nitems:\n  - { id: mug }\n";

    fn load(text: &str) -> crate::pipeline::Loaded {
        load_str("p.yaml", Path::new("."), &format!("{HEAD}{text}"))
    }

    #[test]
    fn checks_are_typed_with_their_defaults_and_settings() {
        let loaded = load(concat!(
            "rerolls: { max_credits: 60 }\n",
            "steps:\n",
            "  - id: shot\n",
            "    generate: { prompt: a mug, n: 2 }\n",
            "    checks: [not_blank, { distinct: { min_distance: 9 } }]\n",
            "  - id: cutout\n",
            "    remove_background: { from: shot }\n",
            "    checks:\n",
            "      - size\n",
            "      - transparent: { min: 0.05 }\n",
            "      - command: { argv: [python3, score.py, \"--image={file}\"], timeout: 5 }\n",
            "    on_fail: reroll\n",
            "    max_rerolls: 2\n",
            "  - id: big\n",
            "    upscale: { from: cutout, desired_increase: 2 }\n",
            "    checks: [size, { not_blank: { min_stddev: 4 } }]\n",
            "    on_fail: flag\n",
        ));
        assert!(loaded.report.is_ok(), "{:?}", loaded.report.errors);
        let p = loaded.pipeline.expect("valid");
        assert_eq!(p.rerolls, Some(Rerolls { max_credits: 60 }));
        let checks = |i: usize| p.steps[i].checks.clone().expect("checks");
        let shot = checks(0);
        assert_eq!(
            shot.checks,
            [
                Check::NotBlank { min_stddev: 2.0 },
                Check::Distinct { min_distance: 9 }
            ]
        );
        assert_eq!((shot.on_fail, shot.max_rerolls), (OnFail::Reroll, 1));
        let cutout = checks(1);
        assert_eq!(
            cutout.checks,
            [
                Check::Size,
                Check::Transparent {
                    min: 0.05,
                    max: 0.99
                },
                Check::Command(CommandCheck {
                    argv: vec!["python3".into(), "score.py".into(), "--image={file}".into()],
                    timeout: Duration::from_secs(5),
                })
            ]
        );
        assert_eq!(cutout.max_rerolls, 2);
        let big = checks(2);
        assert_eq!(big.checks[0], Check::Size);
        assert_eq!(big.on_fail, OnFail::Flag);
        assert_eq!(
            big.key(&p.name, "big"),
            "checked/big: size, not_blank(min_stddev=4)"
        );
        assert_eq!(
            shot.key(&p.name, "shot"),
            "checked/shot: not_blank(min_stddev=2), distinct(min_distance=9)"
        );
    }

    #[test]
    fn a_step_without_checks_has_none_and_needs_no_rerolls() {
        let loaded = load("steps:\n  - id: shot\n    generate: { prompt: a mug }\n");
        assert!(loaded.report.is_ok(), "{:?}", loaded.report.errors);
        let p = loaded.pipeline.expect("valid");
        assert!(p.steps[0].checks.is_none() && p.rerolls.is_none());
        assert!(loaded.report.warnings.is_empty());
    }

    #[test]
    fn one_check_per_entry_and_size_takes_no_settings() {
        let loaded = load(concat!(
            "steps:\n",
            "  - id: shot\n",
            "    generate: { prompt: a mug }\n",
            "  - id: big\n",
            "    upscale: { from: shot, desired_increase: 2 }\n",
            "    on_fail: flag\n",
            "    checks:\n",
            "      - { not_blank: {}, size: {} }\n",
            "      - size: { within: 2 }\n",
        ));
        let messages: Vec<String> = loaded.report.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            messages[0].contains(
                "p.yaml:12:9: steps[1].checks[0]: one check per entry: `size` follows `not_blank`"
            ),
            "{messages:?}"
        );
        assert!(
            messages[1]
                .contains("p.yaml:13:17: steps[1].checks[1].size.within: unknown key `within`"),
            "{messages:?}"
        );
    }
}

#[cfg(test)]
mod the_issues_example {
    use std::path::Path;

    /// The step of issue 46, as the issue spells it: files and tests rely on it validating.
    #[test]
    fn validates_with_a_warning_that_checks_are_not_run_yet() {
        let text = concat!(
            "version: 1\nname: checked\n",
            "rerolls: { max_credits: 60 }\n",
            "items:\n  - { id: mug, subject: a mug }\n",
            "steps:\n",
            "  - id: shot\n    generate: { prompt: \"Photo of {{ item.subject }}\", n: 2 }\n",
            "  - id: big\n    upscale: { from: shot, desired_increase: 2 }\n",
            "  - id: cutout\n",
            "    remove_background: { from: big }\n",
            "    checks:\n",
            "      - not_blank\n",
            "      - size\n",
            "      - transparent: { min: 0.05, max: 0.95 }\n",
            "      - distinct: { min_distance: 6 }\n",
            "      - command: [\"python3\", \"score.py\", \"{file}\"]\n",
            "    on_fail: reroll\n",
            "    max_rerolls: 2\n",
        );
        let loaded = crate::pipeline::load_str("p.yaml", Path::new("."), text);
        let errors: Vec<String> = loaded.report.errors.iter().map(|e| e.to_string()).collect();
        // `distinct` compares the cut-outs made of one generation's two images.
        assert!(errors.is_empty(), "{errors:?}");
        assert!(
            loaded.report.warnings.is_empty(),
            "{:?}",
            loaded.report.warnings
        );
    }
}
