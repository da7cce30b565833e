//! A YAML document as a tree whose every node knows its line and column.
//!
//! serde_yaml reports a position only for the first error it meets and forgets positions once
//! a value is parsed, while `validate` must point at the line of every problem it finds, many
//! of which (a dangling `from`, a prompt too long for one item) only show after parsing. So the
//! file is read once into this tree, typed through [`super::de`], and checked against it.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// A position in the file, both 1-based.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mark {
    pub line: usize,
    pub col: usize,
}

impl From<Marker> for Mark {
    fn from(m: Marker) -> Self {
        // The scanner counts lines from 1 and columns from 0.
        Mark {
            line: m.line(),
            col: m.col() + 1,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    pub mark: Mark,
    pub value: Value,
}

#[derive(Clone, Debug)]
pub enum Value {
    /// `plain` is false for quoted and block scalars, which are always strings.
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

/// A document that is not well-formed YAML, or that YAML allows but a pipeline file cannot be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    pub mark: Mark,
    pub message: String,
}

/// Aliases are expanded by copy; this bounds what a small file can expand into ("billion
/// laughs"), far above any real pipeline.
const MAX_NODES: usize = 5_000_000;

impl Node {
    /// The value under `key` when this node is a mapping that has it.
    pub fn get(&self, key: &str) -> Option<&Node> {
        self.entries()?
            .iter()
            .find(|(k, _)| k.scalar() == Some(key))
            .map(|(_, v)| v)
    }

    /// The key node of `key`, for errors about the key itself.
    pub fn key(&self, key: &str) -> Option<&Node> {
        self.entries()?
            .iter()
            .find(|(k, _)| k.scalar() == Some(key))
            .map(|(k, _)| k)
    }

    pub fn entries(&self) -> Option<&[(Node, Node)]> {
        match &self.value {
            Value::Map(entries) => Some(entries),
            _ => None,
        }
    }

    pub fn elements(&self) -> Option<&[Node]> {
        match &self.value {
            Value::Seq(items) => Some(items),
            _ => None,
        }
    }

    pub fn scalar(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }

    /// YAML's null: `~`, `null` or nothing at all, unquoted.
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar { text, plain: true } if is_null(text))
    }

    /// What this node is, for messages.
    pub fn describe(&self) -> &'static str {
        match &self.value {
            Value::Scalar { .. } if self.is_null() => "nothing (null)",
            Value::Scalar { .. } => "a scalar",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

pub fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

/// Parses a single YAML document.
pub fn parse(text: &str) -> Result<Node, SyntaxError> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    let mut documents = 0;
    loop {
        let (event, marker) = parser
            .next_token()
            .map_err(|e| syntax_error(text, (*e.marker()).into(), e.info()))?;
        let mark = Mark::from(marker);
        match event {
            Event::StreamEnd => break,
            Event::DocumentStart => {
                documents += 1;
                if documents > 1 {
                    return Err(SyntaxError {
                        mark,
                        message: "a pipeline file holds one YAML document; remove the second `---`"
                            .into(),
                    });
                }
            }
            event => builder.event(event, mark)?,
        }
    }
    builder.root.ok_or(SyntaxError {
        mark: Mark { line: 1, col: 1 },
        message: "the file is empty".into(),
    })
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    anchors: HashMap<usize, Node>,
    root: Option<Node>,
    nodes: usize,
}

enum Frame {
    Seq(Mark, usize, Vec<Node>),
    Map(Mark, usize, Vec<(Node, Node)>, Option<Node>),
}

impl Builder {
    fn event(&mut self, event: Event, mark: Mark) -> Result<(), SyntaxError> {
        match event {
            Event::Scalar(text, style, anchor, tag) => {
                let quoted = !matches!(style, TScalarStyle::Plain);
                // An explicit `!!str` tag makes a plain scalar a string, as YAML has it.
                let tagged_str = tag.is_some_and(|t| {
                    matches!(t.handle.as_str(), "!!" | "tag:yaml.org,2002:") && t.suffix == "str"
                });
                let node = Node {
                    mark,
                    value: Value::Scalar {
                        text,
                        plain: !quoted && !tagged_str,
                    },
                };
                self.finish(node, anchor)
            }
            Event::SequenceStart(anchor, _) => {
                self.stack.push(Frame::Seq(mark, anchor, Vec::new()));
                Ok(())
            }
            Event::MappingStart(anchor, _) => {
                self.stack.push(Frame::Map(mark, anchor, Vec::new(), None));
                Ok(())
            }
            Event::SequenceEnd => match self.stack.pop() {
                Some(Frame::Seq(mark, anchor, items)) => self.finish(
                    Node {
                        mark,
                        value: Value::Seq(items),
                    },
                    anchor,
                ),
                _ => Err(internal(mark)),
            },
            Event::MappingEnd => match self.stack.pop() {
                Some(Frame::Map(mark, anchor, entries, None)) => self.finish(
                    Node {
                        // A block mapping's start event is marked after its first key.
                        mark: entries.first().map_or(mark, |(k, _)| mark.min(k.mark)),
                        value: Value::Map(entries),
                    },
                    anchor,
                ),
                _ => Err(internal(mark)),
            },
            Event::Alias(id) => {
                let node = self.anchors.get(&id).cloned().ok_or(SyntaxError {
                    mark,
                    message: "alias to an unknown anchor".into(),
                })?;
                self.nodes += count(&node);
                if self.nodes > MAX_NODES {
                    return Err(SyntaxError {
                        mark,
                        message: format!("aliases expand this document past {MAX_NODES} values"),
                    });
                }
                self.finish(node, 0)
            }
            Event::Nothing | Event::StreamStart | Event::DocumentEnd => Ok(()),
            Event::StreamEnd | Event::DocumentStart => Ok(()),
        }
    }

    fn finish(&mut self, node: Node, anchor: usize) -> Result<(), SyntaxError> {
        self.nodes += 1;
        if anchor > 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.root = Some(node),
            Some(Frame::Seq(_, _, items)) => items.push(node),
            Some(Frame::Map(_, _, entries, pending)) => match pending.take() {
                None => {
                    let Some(text) = node.scalar() else {
                        return Err(SyntaxError {
                            mark: node.mark,
                            message: "a mapping key must be a plain name, not a list or mapping"
                                .into(),
                        });
                    };
                    if let Some((first, _)) = entries.iter().find(|(k, _)| k.scalar() == Some(text))
                    {
                        return Err(SyntaxError {
                            mark: node.mark,
                            message: format!(
                                "duplicate key `{text}` (first written at line {})",
                                first.mark.line
                            ),
                        });
                    }
                    *pending = Some(node);
                }
                Some(key) => {
                    // The scanner marks an empty value where it next finds something, which may
                    // be lines below; the key is where the user looks.
                    let mut node = node;
                    if matches!(&node.value, Value::Scalar { text, plain: true } if text.is_empty())
                    {
                        node.mark = key.mark;
                    }
                    entries.push((key, node));
                }
            },
        }
        Ok(())
    }
}

/// The scanner reports where it noticed a problem, which for two common mistakes is lines
/// away from it: an unclosed `{`/`[` and a tab in the indentation. Point at those instead. A
/// problem noticed at the end of the file (after its last line end, a line no editor shows)
/// is put at the end of its last line.
fn syntax_error(text: &str, at: Mark, info: &str) -> SyntaxError {
    if info.contains("tab") {
        let tabbed = lines(text).position(|l| {
            l.chars()
                .take_while(|c| c.is_whitespace())
                .any(|c| c == '\t')
        });
        if let Some(i) = tabbed {
            return SyntaxError {
                mark: Mark {
                    line: i + 1,
                    col: 1,
                },
                message: "a tab in the indentation; YAML indents with spaces only".into(),
            };
        }
    }
    let end = end_of(text);
    if (info.contains("flow") || at >= end)
        && let Some(open) = unclosed_bracket(text, at)
    {
        return SyntaxError {
            mark: open,
            message: format!("this bracket is never closed ({info})"),
        };
    }
    SyntaxError {
        mark: at.min(end),
        message: info.to_owned(),
    }
}

/// The position just after the last character of `text`, on its last line; line ends are
/// `\n`, `\r\n` or a lone `\r`, as the scanner counts them.
fn end_of(text: &str) -> Mark {
    let body = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix(['\n', '\r']))
        .unwrap_or(text);
    let (line, last) = match body.rfind(['\n', '\r']) {
        Some(at) => {
            let before = &body[..=at];
            let breaks = before.matches('\n').count() + before.matches('\r').count()
                - before.matches("\r\n").count();
            (breaks + 1, &body[at + 1..])
        }
        None => (1, body),
    };
    Mark {
        line,
        col: last.chars().count() + 1,
    }
}

/// The lines of `text` as the scanner numbers them: ended by `\n`, `\r\n` or a lone `\r`
/// (`str::lines` would count `a\rb` as one line where the scanner's marks count two).
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let t = rest?;
        let Some(at) = t.find(['\n', '\r']) else {
            rest = None;
            return Some(t);
        };
        let next = if t[at..].starts_with("\r\n") {
            at + 2
        } else {
            at + 1
        };
        rest = Some(&t[next..]);
        Some(&t[..at])
    })
}

/// The last `{` or `[` before `until` that is still open, skipping quoted text and comments.
fn unclosed_bracket(text: &str, until: Mark) -> Option<Mark> {
    let mut open: Vec<Mark> = Vec::new();
    for (i, line) in lines(text).enumerate().take(until.line) {
        let mut quote: Option<char> = None;
        let mut prev = ' ';
        for (col, c) in line.chars().enumerate() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') if matches!(prev, ' ' | '\t' | '[' | '{' | ',' | ':') => {
                    quote = Some(c);
                }
                (None, '#') if prev.is_whitespace() => break,
                (None, '{' | '[') => open.push(Mark {
                    line: i + 1,
                    col: col + 1,
                }),
                (None, '}' | ']') => {
                    open.pop();
                }
                _ => {}
            }
            prev = c;
        }
    }
    open.pop()
}

fn count(node: &Node) -> usize {
    1 + match &node.value {
        Value::Scalar { .. } => 0,
        Value::Seq(items) => items.iter().map(count).sum(),
        Value::Map(entries) => entries.iter().map(|(k, v)| count(k) + count(v)).sum(),
    }
}

fn internal(mark: Mark) -> SyntaxError {
    SyntaxError {
        mark,
        message: "unbalanced YAML structure".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_know_their_line_and_column() {
        let root = parse("version: 1\nsteps:\n  - id: shot\n    once: true\n").unwrap();
        let step = &root.get("steps").unwrap().elements().unwrap()[0];
        let id = step.get("id").unwrap();
        assert_eq!(id.mark, Mark { line: 3, col: 9 });
        assert_eq!(root.key("steps").unwrap().mark, Mark { line: 2, col: 1 });
        assert_eq!(step.get("once").unwrap().scalar(), Some("true"));
    }

    #[test]
    fn duplicate_keys_and_second_documents_are_errors() {
        let err = parse("a: 1\nb: 2\na: 3\n").unwrap_err();
        assert_eq!(err.mark.line, 3);
        assert!(
            err.message
                .contains("duplicate key `a` (first written at line 1)")
        );
        let err = parse("a: 1\n---\nb: 2\n").unwrap_err();
        assert_eq!(err.mark.line, 2);
        assert_eq!(parse("").unwrap_err().message, "the file is empty");
    }

    #[test]
    fn aliases_copy_their_anchor_and_quoted_scalars_stay_strings() {
        let root = parse("a: &x {k: '1'}\nb: *x\nc: !!str 2\n").unwrap();
        let b = root.get("b").unwrap().get("k").unwrap();
        assert!(matches!(&b.value, Value::Scalar { text, plain: false } if text == "1"));
        assert!(matches!(
            &root.get("c").unwrap().value,
            Value::Scalar { plain: false, .. }
        ));
    }

    #[test]
    fn syntax_errors_have_positions() {
        let err = parse("steps:\n  - id: a\n   bad: [\n").unwrap_err();
        assert!(err.mark.line >= 3, "{err:?}");
    }

    #[test]
    fn a_lone_carriage_return_ends_a_line_for_the_bracket_and_tab_finders_too() {
        let err = parse("a: 1\rb: 2\r\nc: { d: e\r").unwrap_err();
        assert_eq!(err.mark, Mark { line: 3, col: 4 }, "{err:?}");
        let err = parse("a: 1\rb:\r\t- c\n").unwrap_err();
        assert_eq!(err.mark, Mark { line: 3, col: 1 }, "{err:?}");
        assert!(err.message.contains("tab"), "{err:?}");
    }

    #[test]
    fn a_problem_found_at_the_end_of_the_file_is_placed_on_its_last_line() {
        let err = parse("steps:\n  - id: a\n    b: { c: d,\n").unwrap_err();
        assert_eq!(err.mark, Mark { line: 3, col: 8 }, "{err:?}");
        assert!(
            err.message.starts_with("this bracket is never closed"),
            "{err:?}"
        );
        for (text, end) in [
            ("", (1, 1)),
            ("a", (1, 2)),
            ("a\n", (1, 2)),
            ("a\r\nbc\r\n", (2, 3)),
            ("a\rbc\r", (2, 3)),
            ("a\n\nb", (3, 2)),
            ("a\n\n", (2, 1)),
            ("é\n", (1, 2)),
        ] {
            let want = Mark {
                line: end.0,
                col: end.1,
            };
            assert_eq!(end_of(text), want, "{text:?}");
        }
    }
}
