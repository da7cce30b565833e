//! Templated values checked against every item they will be filled with.

use super::*;

/// What a text field's value must be, once templated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rule {
    Prompt,
    ExpandPrompt,
    ObjectName,
    ToolUrl,
    ReferenceUrl,
}

impl Rule {
    pub(super) fn check(self, value: &str) -> Result<(), String> {
        let result = match self {
            Rule::Prompt => rules::check_prompt("prompt", value),
            Rule::ExpandPrompt if value.trim().is_empty() => {
                return Err("prompt is empty; leave it out instead".into());
            }
            Rule::ExpandPrompt => Ok(()),
            Rule::ObjectName if value.trim().is_empty() => {
                return Err("object_name is empty; say what to erase".into());
            }
            Rule::ObjectName => Ok(()),
            Rule::ToolUrl => rules::parse_absolute("image_url", value).map(|_| ()),
            Rule::ReferenceUrl => rules::parse_absolute("image_urls", value).and_then(|u| {
                if u.scheme() == "https" {
                    Ok(())
                } else {
                    Err(rules::InvalidField::new(
                        "image_urls",
                        format!("must be a public https URL, got {value:?}"),
                    ))
                }
            }),
        };
        result.map_err(|e| format!("{} {}", e.field, e.message))
    }
}

impl Checker<'_> {
    /// Checks every template against every item it will be filled with.
    pub(super) fn templates(&mut self, drafts: &[Draft<'_>], items: &Items) {
        for d in drafts {
            for (template, at, rule) in &d.texts {
                self.template_values(d, template, at, *rule, items);
            }
        }
    }

    fn template_values(
        &mut self,
        d: &Draft<'_>,
        t: &Template,
        at: &Node,
        rule: Rule,
        items: &Items,
    ) {
        if t.is_literal() {
            let value = t.render(|_| None).unwrap_or_default();
            if let Err(why) = rule.check(&value) {
                self.error(at.mark, why);
            }
            return;
        }
        let fields: Vec<&str> = t.fields().collect();
        if d.once {
            self.error(at.mark, format!(
                "step {} runs once for the whole batch, without an item, so it cannot use `{{{{ item.{} }}}}`",
                shown(&d.id),
                fields[0]
            ));
            return;
        }
        let mut complete = true;
        for field in &fields {
            if !items.is_empty() && !items.has_field(field) {
                complete = false;
                let names: Vec<&str> = std::iter::once("id").chain(items.field_names()).collect();
                let mut message = format!("no item has a field `{field}`");
                if let Some(best) = closest(field, names.iter().copied()) {
                    message.push_str(&format!("; did you mean `{best}`?"));
                }
                self.error(at.mark, message).hint = Some(format!(
                    "item fields: {}",
                    names
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        if !complete {
            return;
        }
        let mut shown_count = 0;
        let mut more = 0;
        for item in items.iter() {
            let problem = match t.render(|f| items.value(&item, f)) {
                Err(missing) => Some(format!("has no field `{missing}`, which `{t}` uses")),
                Ok(value) => rule.check(&value).err(),
            };
            let Some(problem) = problem else { continue };
            if shown_count == SHOWN_PER_RULE {
                more += 1;
                continue;
            }
            shown_count += 1;
            let d = Diagnostic::new(
                self.file,
                at.mark,
                format!(
                    "{problem} (item written at {}:{})",
                    items.file, item.mark.line
                ),
            )
            .for_item(&item.id);
            self.report.error(d);
        }
        if more > 0 {
            self.error(
                at.mark,
                format!("…and {more} more items break the same rule here"),
            );
        }
    }
}
