//! Steps as written to drafts: ids, one operation, one input, references resolved.

use super::*;
use crate::pipeline::spec::InputSpec;

impl Checker<'_> {
    pub(super) fn steps<'n>(
        &mut self,
        specs: &[StepSpec],
        nodes: &[&'n Node],
        raw_ids: &HashSet<&str>,
    ) -> Vec<Draft<'n>> {
        let mut index: HashMap<String, (usize, usize)> = HashMap::new();
        for (i, (spec, node)) in specs.iter().zip(nodes).enumerate() {
            let mark = mark_of(node.get("id"), node);
            if let Err(why) = check_step_id(&spec.id) {
                self.error(mark, format!("step id {}: {why}", shown(&spec.id)));
            }
            match index.get(&spec.id.to_lowercase()) {
                Some((first, line)) => {
                    let first = &specs[*first].id;
                    let what = if *first == spec.id {
                        "is used twice".to_owned()
                    } else {
                        format!(
                            "differs from {} only in case, and both would name the same files on case-insensitive file systems",
                            shown(first)
                        )
                    };
                    self.error(
                        mark,
                        format!("step id {} {what} (first at line {line})", shown(&spec.id)),
                    );
                }
                None => {
                    index.insert(spec.id.to_lowercase(), (i, mark.line));
                }
            }
        }
        let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
        for (spec, node) in specs.iter().zip(nodes) {
            let Some((stem, index)) = spec.id.rsplit_once('-') else {
                continue;
            };
            if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) && ids.contains(&stem)
            {
                let mark = mark_of(node.get("id"), node);
                self.error(mark, format!(
                    "step id {} reads as output {index} of step {}, whose files are named {stem}-<index>; choose another id",
                    shown(&spec.id),
                    shown(stem)
                ));
            }
        }
        let mut known: Vec<&str> = raw_ids.iter().copied().collect();
        known.sort_unstable();
        let mut resolve = |checker: &mut Self, name: &str, at: &Node| -> Option<StepRef> {
            if let Some((i, _)) = index
                .get(&name.to_lowercase())
                .filter(|(i, _)| ids[*i] == name)
            {
                return Some(StepRef(*i));
            }
            if !raw_ids.contains(name) {
                let d = checker.error(at.mark, format!("unknown step {}", shown(name)));
                if let Some(best) = closest(name, known.iter().copied()) {
                    d.message.push_str(&format!("; did you mean `{best}`?"));
                }
            }
            None
        };
        specs
            .iter()
            .zip(nodes)
            .map(|(spec, node)| self.draft(spec, node, &mut resolve))
            .collect()
    }

    fn draft<'n>(
        &mut self,
        spec: &StepSpec,
        node: &'n Node,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Draft<'n> {
        let mut draft = Draft {
            id: spec.id.clone(),
            once: spec.once == Some(true),
            node,
            op: None,
            refs: Vec::new(),
            texts: Vec::new(),
            checks: None,
        };
        let Some((op_name, op_node)) = self.operation(spec, node) else {
            return draft;
        };
        draft.op = if let Some(g) = &spec.generate {
            self.generate(g, op_node, &mut draft, resolve)
        } else {
            self.tool(spec, op_name, op_node, &mut draft, resolve)
        };
        draft
    }

    /// The one operation a step names and the node of its fields; `None` (reported) when it
    /// names none, two, or one left empty.
    fn operation<'n>(
        &mut self,
        spec: &StepSpec,
        node: &'n Node,
    ) -> Option<(&'static str, &'n Node)> {
        let given: Vec<&'static str> = OPERATIONS
            .iter()
            .copied()
            .filter(|op| node.get(op).is_some())
            .collect();
        match given.as_slice() {
            // A misspelt operation is already reported as an unknown key.
            [] if has_typo_of(node, &OPERATIONS) => return None,
            [] => {
                self.error(
                    node.mark,
                    format!("step {} has no operation", shown(&spec.id)),
                )
                .hint = Some(format!(
                    "give exactly one of {}",
                    OPERATIONS.map(|o| format!("`{o}`")).join(", ")
                ));
                return None;
            }
            [_] => {}
            [first, second, ..] => {
                let mark = mark_of(node.key(second), node);
                self.error(mark, format!(
                    "step {} has both `{first}` and `{second}`; a step does exactly one operation",
                    shown(&spec.id)
                ));
                return None;
            }
        }
        let op_name = given[0];
        let op_node = node.get(op_name).unwrap_or(node);
        if op_node.is_null() {
            let mark = mark_of(node.key(op_name), node);
            self.error(mark, format!("`{op_name}` is empty; it needs its fields"))
                .hint = Some(format!(
                "see the `{op_name}` row of the reference in pipelines/README.md"
            ));
            return None;
        }
        Some((op_name, op_node))
    }

    /// An edit of one image: its parameters, then its one input.
    fn tool<'n>(
        &mut self,
        spec: &StepSpec,
        op_name: &str,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Option<Operation> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        let (input, params) = match (
            &spec.erase,
            &spec.expand,
            &spec.upscale,
            &spec.remove_background,
        ) {
            (Some(e), ..) => (
                e.input(),
                self.erase(&e.object_name, field("object_name"), draft),
            ),
            (_, Some(e), ..) => (
                e.input(),
                self.expand(
                    e.aspect_ratio.as_deref(),
                    e.prompt.as_deref(),
                    op_node,
                    draft,
                ),
            ),
            (.., Some(u), _) => (
                u.input(),
                self.upscale(u.desired_increase, field("desired_increase")),
            ),
            (.., Some(r)) => (r.input(), Some(ToolOp::RemoveBackground)),
            _ => return None,
        };
        let preserve_alpha = input.preserve_alpha;
        let input = self.tool_input(op_name, &input, op_node, draft, resolve);
        match (input, params) {
            (Some(input), Some(params)) => Some(Operation::Tool(Tool {
                input,
                preserve_alpha,
                params,
            })),
            _ => None,
        }
    }

    /// A tool's one input: another step's images (`from`) or a URL template (`image_url`).
    fn tool_input<'n>(
        &mut self,
        op_name: &str,
        input: &InputSpec<'_>,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Option<Input> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        match (input.from, input.image_url) {
            (Some(_), Some(_)) => {
                let mark = mark_of(op_node.key("image_url"), op_node);
                self.error(
                    mark,
                    format!(
                        "`{op_name}` takes one input: give either `from` or `image_url`, not both"
                    ),
                );
                None
            }
            (None, None) => {
                self.error(op_node.mark, format!("`{op_name}` needs an input"))
                    .hint = Some(
                    "add `from: <step>` to edit another step's images, or `image_url: <url>`"
                        .into(),
                );
                None
            }
            (Some(from), None) => {
                let at = field("from");
                resolve(self, from, at).map(|r| {
                    draft.refs.push((r, at));
                    Input::Step(r)
                })
            }
            (None, Some(url)) => self
                .template(url, field("image_url"), Rule::ToolUrl, draft)
                .map(Input::Url),
        }
    }

    fn generate<'n>(
        &mut self,
        g: &crate::pipeline::spec::GenerateSpec,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
        resolve: &mut impl FnMut(&mut Self, &str, &Node) -> Option<StepRef>,
    ) -> Option<Operation> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        let prompt = self.template(&g.prompt, field("prompt"), Rule::Prompt, draft);
        let n = g.n.unwrap_or(1);
        if let Err(e) = rules::check_n(n) {
            self.error(field("n").mark, format!("n {}", e.message));
        }
        let size = match g.size {
            None | Some(SizeSpec::TwoK) => Size::TwoK,
            Some(SizeSpec::FourK) => Size::FourK,
        };
        let ref_nodes: Vec<&Node> = kept(op_node.get("image_urls"), self.skipped);
        let mut references = Vec::new();
        let mut complete = true;
        for (r, node) in g.image_urls.iter().zip(ref_nodes) {
            match r {
                crate::pipeline::spec::ReferenceSpec::Url(url) => {
                    match self.template(url, node, Rule::ReferenceUrl, draft) {
                        Some(t) => references.push(Reference::Url(t)),
                        None => complete = false,
                    }
                }
                crate::pipeline::spec::ReferenceSpec::From(f) => {
                    let at = node.get("from").unwrap_or(node);
                    match resolve(self, &f.from, at) {
                        Some(step) => {
                            draft.refs.push((step, at));
                            references.push(Reference::Step(step));
                        }
                        None => complete = false,
                    }
                }
            }
        }
        let n = u8::try_from(n)
            .ok()
            .filter(|n| rules::check_n(i64::from(*n)).is_ok())?;
        (complete && prompt.is_some()).then(|| {
            Operation::Generate(Generate {
                prompt: prompt.expect("checked"),
                n,
                size,
                references,
            })
        })
    }

    fn erase<'n>(&mut self, object: &str, at: &'n Node, draft: &mut Draft<'n>) -> Option<ToolOp> {
        let object_name = self.template(object, at, Rule::ObjectName, draft)?;
        Some(ToolOp::Erase { object_name })
    }

    fn expand<'n>(
        &mut self,
        ratio: Option<&str>,
        prompt: Option<&str>,
        op_node: &'n Node,
        draft: &mut Draft<'n>,
    ) -> Option<ToolOp> {
        let field = |name: &str| op_node.get(name).unwrap_or(op_node);
        let aspect_ratio = match ratio.map(str::parse::<AspectRatio>) {
            Some(Err(e)) => {
                self.error(
                    field("aspect_ratio").mark,
                    format!("aspect_ratio {}", e.message),
                );
                return None;
            }
            Some(Ok(r)) => Some(r),
            None => None,
        };
        let prompt = match prompt {
            Some(p) => Some(self.template(p, field("prompt"), Rule::ExpandPrompt, draft)?),
            None => None,
        };
        Some(ToolOp::Expand {
            aspect_ratio,
            prompt,
        })
    }

    fn upscale(&mut self, factor: i64, at: &Node) -> Option<ToolOp> {
        match Increase::from_factor(factor) {
            Ok(i) => Some(ToolOp::Upscale(i)),
            Err(e) => {
                self.error(at.mark, format!("desired_increase {}", e.message));
                None
            }
        }
    }

    /// Parses a template field and queues its values for checking against `rule`.
    fn template<'n>(
        &mut self,
        source: &str,
        at: &'n Node,
        rule: Rule,
        draft: &mut Draft<'n>,
    ) -> Option<Template> {
        match Template::parse(source) {
            Ok(t) => {
                draft.texts.push((t.clone(), at, rule));
                Some(t)
            }
            Err(e) => {
                let mut mark = at.mark;
                if matches!(&at.value, Value::Scalar { plain: true, .. }) {
                    mark.col += source[..e.offset].chars().count();
                }
                self.error(mark, e.message);
                None
            }
        }
    }
}

/// Step ids name output files: letters, digits, `_` and `-`, starting with a letter or digit.
pub fn check_step_id(id: &str) -> Result<(), String> {
    let mut chars = id.chars();
    match chars.next() {
        None => return Err("is empty".into()),
        Some(c) if !c.is_ascii_alphanumeric() => {
            return Err("must start with a letter or digit".into());
        }
        Some(_) => {}
    }
    if let Some(bad) = chars.find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))) {
        return Err(format!(
            "contains {bad:?}; step ids use letters, digits, `_` and `-`"
        ));
    }
    if id.chars().count() > MAX_STEP_ID_CHARS {
        return Err(format!("is longer than {MAX_STEP_ID_CHARS} characters"));
    }
    if items::is_device_name(id) {
        return Err("is a reserved device name on Windows".into());
    }
    Ok(())
}
