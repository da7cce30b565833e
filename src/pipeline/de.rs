//! Typing a [`Node`] tree with serde, so that the types which parse a pipeline file (and give
//! its JSON Schema) stay plain derives while every error keeps the position and path of the node
//! it is about.
//!
//! serde stops at the first error. To report them all, [`from_node`] records the error, leaves
//! out the smallest part of the document that holds it (the unknown key, else the list element
//! or top-level key around it) and types the document again, until it succeeds or nothing more
//! can be left out.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};

use crate::pipeline::yaml::{Mark, Node, Value};

/// One typing error, with where it is.
#[derive(Clone, Debug)]
pub struct Error {
    pub message: String,
    pub mark: Option<Mark>,
    /// Where in the document, e.g. `steps[2].erase.from`.
    pub path: String,
    /// Address of the node to leave out to get past this error.
    skip: Option<usize>,
    /// The field a "missing key" error is about.
    missing: Option<&'static str>,
    /// A missing key whose bad value was left out earlier: not news.
    consequence: bool,
    unknown_key: bool,
}

impl Error {
    fn new(message: String) -> Self {
        Error {
            message,
            mark: None,
            path: String::new(),
            skip: None,
            missing: None,
            consequence: false,
            unknown_key: false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error::new(msg.to_string())
    }

    fn invalid_type(unexp: de::Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        let found = match unexp {
            de::Unexpected::Unit => "nothing (the value is empty)".to_owned(),
            de::Unexpected::Seq => "a list".to_owned(),
            de::Unexpected::Map => "a mapping".to_owned(),
            other => other.to_string(),
        };
        Error::new(format!("expected {}, found {found}", plain_expected(exp)))
    }

    fn invalid_value(unexp: de::Unexpected<'_>, exp: &dyn de::Expected) -> Self {
        Error::new(format!("expected {}, found {unexp}", plain_expected(exp)))
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        let mut e = Error::new(format!(
            "unknown key `{field}`{}",
            suggestion(field, expected)
        ));
        e.unknown_key = true;
        e
    }

    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        Error::new(format!(
            "unknown value `{variant}`{}",
            suggestion(variant, expected)
        ))
    }

    fn missing_field(field: &'static str) -> Self {
        let mut e = Error::new(format!("missing required key `{field}`"));
        e.missing = Some(field);
        e
    }
}

/// What serde expected, in the file's words rather than Rust's.
fn plain_expected(exp: &dyn de::Expected) -> String {
    let text = exp.to_string();
    match text.as_str() {
        "i8" | "i16" | "i32" | "i64" => "a whole number".into(),
        "u8" | "u16" | "u32" | "u64" => "a whole number, 0 or more".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "struct StepSpec" => "a step: a mapping with `id` and one operation".into(),
        _ => match text.strip_prefix("struct ") {
            Some(_) => "a mapping of keys".into(),
            None => text,
        },
    }
}

/// "; did you mean `x`?" for a close candidate, then the list of what is allowed.
pub fn suggestion(got: &str, expected: &[&str]) -> String {
    let mut out = String::new();
    if let Some(best) = closest(got, expected.iter().copied()) {
        out.push_str(&format!("; did you mean `{best}`?"));
    }
    if !expected.is_empty() {
        let list: Vec<String> = expected.iter().map(|e| format!("`{e}`")).collect();
        out.push_str(&format!(" (expected one of {})", list.join(", ")));
    }
    out
}

/// The candidate a typo most likely meant, if any is close enough.
pub fn closest<'a>(got: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let got_lower = got.to_lowercase();
    candidates
        .into_iter()
        .map(|c| (strsim::osa_distance(&got_lower, &c.to_lowercase()), c))
        .filter(|(d, c)| {
            *d <= (c.chars().count() / 3).max(1) || c.starts_with(got) && got.len() >= 3
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// What typing a document gave: the value when it could be typed, and every error met.
pub struct Typed<T> {
    pub value: Option<T>,
    pub errors: Vec<Error>,
    skipped: HashSet<usize>,
}

impl<T> Typed<T> {
    /// Whether `node` was left out of `value` because of an error in it.
    pub fn was_skipped(&self, node: &Node) -> bool {
        self.skipped.contains(&address(node))
    }
}

/// Types `root` as `T`, collecting up to `max_errors` errors (see the module doc).
pub fn from_node<T: DeserializeOwned>(root: &Node, max_errors: usize) -> Typed<T> {
    let mut skipped = HashSet::new();
    let mut errors: Vec<Error> = Vec::new();
    loop {
        let ctx = Ctx { skip: &skipped };
        let de = De {
            node: root,
            ctx: &ctx,
            path: None,
        };
        match T::deserialize(de) {
            Ok(value) => {
                return Typed {
                    value: Some(value),
                    errors,
                    skipped,
                };
            }
            Err(e) => {
                let (skip, consequence) = (e.skip, e.consequence);
                if !consequence {
                    errors.push(e);
                }
                match skip {
                    Some(addr) if errors.len() < max_errors && skipped.insert(addr) => {}
                    _ => {
                        return Typed {
                            value: None,
                            errors,
                            skipped,
                        };
                    }
                }
            }
        }
    }
}

fn address(node: &Node) -> usize {
    node as *const Node as usize
}

struct Ctx<'s> {
    skip: &'s HashSet<usize>,
}

/// One step of the path from the root to a node.
struct Crumb<'p> {
    parent: Option<&'p Crumb<'p>>,
    seg: Seg<'p>,
    /// The node to leave out when an error is found below this step: the list element for an
    /// index, the key for a key.
    target: usize,
}

enum Seg<'p> {
    Key(&'p str),
    Index(usize),
}

fn render(path: Option<&Crumb<'_>>) -> String {
    let mut segs = Vec::new();
    let mut cur = path;
    while let Some(c) = cur {
        segs.push(&c.seg);
        cur = c.parent;
    }
    let mut out = String::new();
    for seg in segs.into_iter().rev() {
        match seg {
            Seg::Key(k) if out.is_empty() => out.push_str(k),
            Seg::Key(k) => {
                out.push('.');
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// The node to leave out for an error found at `path`: the innermost list element, else the
/// top-level key.
fn skip_target(path: Option<&Crumb<'_>>) -> Option<usize> {
    let mut cur = path;
    let mut top = None;
    while let Some(c) = cur {
        if matches!(c.seg, Seg::Index(_)) {
            return Some(c.target);
        }
        top = Some(c.target);
        cur = c.parent;
    }
    top
}

#[derive(Clone, Copy)]
struct De<'de, 'p> {
    node: &'de Node,
    ctx: &'p Ctx<'p>,
    path: Option<&'p Crumb<'p>>,
}

impl De<'_, '_> {
    /// Gives `e` this node's position unless a deeper node already did.
    fn attach(&self, mut e: Error) -> Error {
        if e.mark.is_none() {
            e.mark = Some(self.node.mark);
            e.path = render(self.path);
            // A key reported missing after its bad value, or a misspelling of it, was left
            // out: the user has already been told.
            e.consequence = e.missing.is_some_and(|field| {
                self.node
                    .entries()
                    .unwrap_or_default()
                    .iter()
                    .any(|(k, _)| {
                        self.ctx.skip.contains(&address(k))
                            && k.scalar().is_some_and(|name| {
                                name == field || closest(name, [field]).is_some()
                            })
                    })
            });
            e.skip = if e.unknown_key {
                self.path.map(|c| c.target)
            } else {
                skip_target(self.path)
            };
        }
        e
    }

    fn resolved(&self) -> Option<Plain> {
        match &self.node.value {
            Value::Scalar { text, plain: true } => Some(resolve(text)),
            _ => None,
        }
    }
}

/// A plain scalar read by YAML 1.2's core schema.
enum Plain {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str,
}

fn resolve(text: &str) -> Plain {
    if crate::pipeline::yaml::is_null(text) {
        return Plain::Null;
    }
    match text {
        "true" | "True" | "TRUE" => return Plain::Bool(true),
        "false" | "False" | "FALSE" => return Plain::Bool(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Plain::Float(f64::INFINITY);
        }
        "-.inf" | "-.Inf" | "-.INF" => return Plain::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Plain::Float(f64::NAN),
        _ => {}
    }
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(i) = text.parse::<i64>() {
            return Plain::Int(i);
        }
        if let Ok(u) = text.trim_start_matches('+').parse::<u64>() {
            return Plain::UInt(u);
        }
    }
    if let Some(Ok(u)) = text.strip_prefix("0x").map(|h| u64::from_str_radix(h, 16)) {
        return Plain::UInt(u);
    }
    if let Some(Ok(u)) = text.strip_prefix("0o").map(|o| u64::from_str_radix(o, 8)) {
        return Plain::UInt(u);
    }
    let float_chars = text
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+'));
    if float_chars
        && text.bytes().any(|b| b.is_ascii_digit())
        && let Ok(f) = text.parse::<f64>()
    {
        return Plain::Float(f);
    }
    Plain::Str
}

impl<'de> de::Deserializer<'de> for De<'de, '_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let result = match &self.node.value {
            Value::Scalar { text, .. } => match self.resolved().unwrap_or(Plain::Str) {
                Plain::Null => visitor.visit_unit(),
                Plain::Bool(b) => visitor.visit_bool(b),
                Plain::Int(i) => visitor.visit_i64(i),
                Plain::UInt(u) => visitor.visit_u64(u),
                Plain::Float(f) => visitor.visit_f64(f),
                Plain::Str => visitor.visit_borrowed_str(text),
            },
            Value::Seq(items) => visitor.visit_seq(SeqAccess {
                items: items.iter().enumerate(),
                parent: self,
            }),
            Value::Map(entries) => visitor.visit_map(MapAccess {
                entries: entries.iter(),
                value: None,
                parent: self,
            }),
        };
        result.map_err(|e| self.attach(e))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        if self.node.is_null() {
            visitor.visit_none().map_err(|e| self.attach(e))
        } else {
            visitor.visit_some(self).map_err(|e| self.attach(e))
        }
    }

    /// Any non-null scalar reads as a string (`prompt: 2024` is the text "2024").
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.value {
            Value::Scalar { text, .. } if !self.node.is_null() => {
                visitor.visit_borrowed_str(text).map_err(|e| self.attach(e))
            }
            _ => self.deserialize_any(visitor),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor
            .visit_newtype_struct(self)
            .map_err(|e| self.attach(e))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match &self.node.value {
            Value::Scalar { text, .. } if !self.node.is_null() => {
                let unit: de::value::StrDeserializer<'_, Error> = text.as_str().into_deserializer();
                visitor.visit_enum(unit).map_err(|e| self.attach(e))
            }
            _ => Err(self.attach(Error::new(format!(
                "expected one of the allowed names, found {}",
                self.node.describe()
            )))),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    /// Only a mapping: serde would also fill a struct from a list, by position.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_map(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.value {
            Value::Map(_) => self.deserialize_any(visitor),
            _ => {
                let e = Error::new(format!(
                    "expected {}, found {}",
                    plain_expected(&visitor),
                    self.node.describe()
                ));
                Err(self.attach(e))
            }
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf unit
        unit_struct seq tuple tuple_struct
    }
}

struct SeqAccess<'de, 'p> {
    items: std::iter::Enumerate<std::slice::Iter<'de, Node>>,
    parent: De<'de, 'p>,
}

impl<'de> de::SeqAccess<'de> for SeqAccess<'de, '_> {
    type Error = Error;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        let Some((index, node)) = self
            .items
            .find(|(_, n)| !self.parent.ctx.skip.contains(&address(n)))
        else {
            return Ok(None);
        };
        let crumb = Crumb {
            parent: self.parent.path,
            seg: Seg::Index(index),
            target: address(node),
        };
        let de = De {
            node,
            ctx: self.parent.ctx,
            path: Some(&crumb),
        };
        seed.deserialize(de).map(Some).map_err(|e| de.attach(e))
    }
}

struct MapAccess<'de, 'p> {
    entries: std::slice::Iter<'de, (Node, Node)>,
    value: Option<&'de (Node, Node)>,
    parent: De<'de, 'p>,
}

impl<'de> de::MapAccess<'de> for MapAccess<'de, '_> {
    type Error = Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let skip = self.parent.ctx.skip;
        let Some(entry) = self.entries.find(|(k, _)| !skip.contains(&address(k))) else {
            return Ok(None);
        };
        self.value = Some(entry);
        let key = &entry.0;
        let crumb = Crumb {
            parent: self.parent.path,
            seg: Seg::Key(key.scalar().unwrap_or("?")),
            target: address(key),
        };
        let de = De {
            node: key,
            ctx: self.parent.ctx,
            path: Some(&crumb),
        };
        seed.deserialize(de).map(Some).map_err(|e| de.attach(e))
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let Some((key, value)) = self.value.take() else {
            return Err(Error::new("internal error: a value without its key".into()));
        };
        let crumb = Crumb {
            parent: self.parent.path,
            seg: Seg::Key(key.scalar().unwrap_or("?")),
            target: address(key),
        };
        let de = De {
            node: value,
            ctx: self.parent.ctx,
            path: Some(&crumb),
        };
        seed.deserialize(de).map_err(|e| de.attach(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::yaml::parse;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Doc {
        name: String,
        #[serde(default)]
        count: Option<u32>,
        steps: Vec<Step>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Step {
        id: String,
        #[serde(default)]
        n: Option<i64>,
    }

    #[test]
    fn every_error_is_reported_with_its_line_and_path() {
        let text =
            "name: 2024\nsteps:\n  - id: a\n    nn: 2\n  - id: b\n    n: two\n  - id: c\ncout: 3\n";
        let root = parse(text).unwrap();
        let typed: Typed<Doc> = from_node(&root, 50);
        let found: Vec<(usize, String)> = typed
            .errors
            .iter()
            .map(|e| (e.mark.unwrap().line, e.to_string()))
            .collect();
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found[0].0, 4);
        assert!(
            found[0]
                .1
                .starts_with("steps[0].nn: unknown key `nn`; did you mean `n`?")
        );
        assert_eq!(found[1].0, 6);
        assert!(
            found[1]
                .1
                .contains("steps[1].n: expected a whole number, found string \"two\""),
            "{found:?}"
        );
        assert_eq!(found[2].0, 8);
        assert!(found[2].1.contains("did you mean `count`?"));
        let steps = root.get("steps").unwrap().elements().unwrap();
        assert!(typed.was_skipped(&steps[1]) && !typed.was_skipped(&steps[0]));
        let doc = typed.value.unwrap();
        assert_eq!(doc.name, "2024");
        let ids: Vec<&str> = doc.steps.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(
            ids,
            ["a", "c"],
            "the step with a bad value is left out, the rest kept"
        );
    }

    #[test]
    fn a_bad_required_top_level_value_stops_without_a_spurious_missing_key() {
        let root = parse("name: [1]\nsteps: []\n").unwrap();
        let typed: Typed<Doc> = from_node(&root, 50);
        assert!(typed.value.is_none());
        assert_eq!(typed.errors.len(), 1, "{:?}", typed.errors);
        assert_eq!(typed.errors[0].mark.unwrap().line, 1);
        let root = parse("name: x\n").unwrap();
        let typed: Typed<Doc> = from_node(&root, 50);
        assert_eq!(typed.errors[0].message, "missing required key `steps`");
    }

    #[test]
    fn plain_scalars_follow_the_core_schema() {
        assert!(matches!(resolve("42"), Plain::Int(42)));
        assert!(matches!(resolve("-3"), Plain::Int(-3)));
        assert!(matches!(resolve("1.5"), Plain::Float(_)));
        assert!(matches!(resolve("True"), Plain::Bool(true)));
        assert!(matches!(resolve("~"), Plain::Null));
        for s in ["yes", "16:9", "1.2.3", "2K", "inf", "0x"] {
            assert!(matches!(resolve(s), Plain::Str), "{s}");
        }
    }
}
