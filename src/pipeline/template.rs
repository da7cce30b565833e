//! `{{ item.<field> }}` templates in a step's text fields.
//!
//! The language is deliberately this one form: no filters, no defaults, no conditionals. A
//! field an item lacks is an error, never an empty string, because an empty object name or a
//! prompt with a hole in it would still be billed.

use std::fmt;

/// A parsed template: text with item fields in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(String),
}

/// What opens a placeholder: a text holding it is read as a template.
pub const OPEN: &str = "{{";

/// A template that cannot be read; `offset` is the byte offset of the problem in the source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateError {
    pub offset: usize,
    pub message: String,
}

impl Template {
    pub fn parse(source: &str) -> Result<Template, TemplateError> {
        let mut parts = Vec::new();
        let mut rest = source;
        let mut offset = 0;
        while let Some(open) = rest.find("{{") {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let inner_start = open + 2;
            let Some(close) = rest[inner_start..].find("}}") else {
                return Err(TemplateError {
                    offset: offset + open,
                    message: "`{{` is not closed by `}}`".into(),
                });
            };
            let inner = rest[inner_start..inner_start + close].trim();
            let field = inner.strip_prefix("item.").filter(|f| is_field_name(f)).ok_or_else(|| {
                TemplateError {
                    offset: offset + open,
                    message: format!(
                        "`{{{{ {inner} }}}}` is not a template this format knows; write `{{{{ item.<field> }}}}`"
                    ),
                }
            })?;
            parts.push(Part::Field(field.to_owned()));
            let consumed = inner_start + close + 2;
            rest = &rest[consumed..];
            offset += consumed;
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(Template { parts })
    }

    /// The item fields this template reads, in order.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Field(f) => Some(f.as_str()),
            Part::Text(_) => None,
        })
    }

    pub fn is_literal(&self) -> bool {
        self.fields().next().is_none()
    }

    /// Fills in the fields with `lookup`; the first field it does not know is the error.
    pub fn render<'a>(
        &self,
        mut lookup: impl FnMut(&str) -> Option<&'a str>,
    ) -> Result<String, String> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(f) => out.push_str(lookup(f).ok_or_else(|| f.clone())?),
            }
        }
        Ok(out)
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in &self.parts {
            match part {
                Part::Text(t) => f.write_str(t)?,
                Part::Field(name) => write!(f, "{{{{ item.{name} }}}}")?,
            }
        }
        Ok(())
    }
}

/// Item field names: what a template can name, and what an items file may use as a column.
pub fn is_field_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_filled_and_unknown_ones_are_errors() {
        let t = Template::parse("Photo of {{ item.subject }} on {{item.surface}}.").unwrap();
        assert_eq!(t.fields().collect::<Vec<_>>(), ["subject", "surface"]);
        let out = t
            .render(|f| match f {
                "subject" => Some("a mug"),
                "surface" => Some("oak"),
                _ => None,
            })
            .unwrap();
        assert_eq!(out, "Photo of a mug on oak.");
        assert_eq!(
            t.render(|f| (f == "subject").then_some("x")).unwrap_err(),
            "surface"
        );
        assert_eq!(
            t.to_string(),
            "Photo of {{ item.subject }} on {{ item.surface }}."
        );
    }

    #[test]
    fn malformed_templates_say_where() {
        let err = Template::parse("a {{ item.x").unwrap_err();
        assert_eq!(err.offset, 2);
        let err = Template::parse("ab {{ subject }}").unwrap_err();
        assert_eq!(err.offset, 3);
        assert!(
            err.message.contains("{{ item.<field> }}"),
            "{}",
            err.message
        );
        assert!(Template::parse("no fields").unwrap().is_literal());
    }
}
