//! Problems found in a pipeline file or its items, each with the place it is about.

use std::fmt;

use serde::Serialize;

use crate::pipeline::yaml::Mark;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// The file as the user named it (the pipeline file or its items file).
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub message: String,
    /// The item whose values produced the problem, when templating did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl Diagnostic {
    pub fn new(file: &str, mark: Mark, message: impl Into<String>) -> Self {
        Diagnostic {
            file: file.to_owned(),
            line: mark.line,
            column: mark.col,
            message: message.into(),
            item: None,
            hint: None,
        }
    }

    pub fn for_item(mut self, id: &str) -> Self {
        self.item = Some(id.to_owned());
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    fn sort_key(&self) -> (&str, usize, usize) {
        (&self.file, self.line, self.column)
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        if let Some(item) = &self.item {
            write!(f, "item {}: ", shown(item))?;
        }
        f.write_str(&self.message)?;
        if let Some(hint) = &self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}

/// Everything found wrong, plus warnings that do not stop a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub errors: Vec<Diagnostic>,
    pub warnings: Vec<Diagnostic>,
}

impl Report {
    pub fn error(&mut self, d: Diagnostic) {
        self.errors.push(d);
    }

    pub fn warn(&mut self, d: Diagnostic) {
        self.warnings.push(d);
    }

    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }

    /// Sorted by file and position, exact duplicates removed.
    pub fn sort(&mut self) {
        for list in [&mut self.errors, &mut self.warnings] {
            list.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
            list.dedup();
        }
    }
}

/// An id as printed in messages: quoted, with anything unprintable escaped.
pub fn shown(id: &str) -> impl fmt::Display + '_ {
    struct Shown<'a>(&'a str);
    impl fmt::Display for Shown<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let short: String = self.0.chars().take(80).collect();
            write!(f, "{short:?}")?;
            if short.len() < self.0.len() {
                f.write_str("…")?;
            }
            Ok(())
        }
    }
    Shown(id)
}
