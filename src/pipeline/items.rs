//! The batch's items: inline in the pipeline file, or from a JSONL or CSV file.
//!
//! Item ids become directory names under the output directory, so they are checked to be safe
//! names on every common file system; when an item has none, one is derived from its content so
//! that reordering or extending an items file does not rename the items already done.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::layout;
use crate::pipeline::diag::{Diagnostic, Report};
use crate::pipeline::yaml::Mark;

/// Longest item id: a directory name with room to spare on every file system.
pub const MAX_ID_CHARS: usize = 64;

#[derive(Clone, Debug, Default)]
pub struct Items {
    /// Field names, in the order first seen.
    fields: Vec<String>,
    index: HashMap<String, usize>,
    rows: Vec<Item>,
    /// The file the items were read from, as the user named it (the pipeline file when inline).
    pub file: String,
}

#[derive(Clone, Debug)]
pub struct Item {
    pub id: String,
    values: Box<[Option<Box<str>>]>,
    /// Where the item is written.
    pub mark: Mark,
}

/// One item as read, before ids are settled.
pub struct RawItem {
    pub fields: Vec<(String, String)>,
    pub mark: Mark,
    /// Where its `id` value is, when it has one.
    pub id_mark: Option<Mark>,
}

impl Items {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Item> {
        self.rows.iter()
    }

    pub fn get(&self, i: usize) -> Option<&Item> {
        self.rows.get(i)
    }

    pub fn field_names(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(String::as_str)
    }

    pub fn has_field(&self, name: &str) -> bool {
        name == "id" || self.index.contains_key(name)
    }

    /// The value of `field` for `item`; `id` is always there, derived or not.
    pub fn value<'a>(&self, item: &'a Item, field: &str) -> Option<&'a str> {
        if field == "id" {
            return Some(&item.id);
        }
        let i = *self.index.get(field)?;
        item.values.get(i)?.as_deref()
    }

    /// A digest of every item's id and fields, independent of how they were written, so a
    /// saved plan can tell whether the items changed.
    pub fn sha256(&self) -> String {
        let mut order: Vec<usize> = (0..self.fields.len()).collect();
        order.sort_by(|a, b| self.fields[*a].cmp(&self.fields[*b]));
        // Every string is length-prefixed, so no value can pass for a field name or an id.
        let mut hasher = Sha256::new();
        let mut put = |s: &str| {
            hasher.update((s.len() as u64).to_le_bytes());
            hasher.update(s.as_bytes());
        };
        for item in &self.rows {
            put(&item.id);
            for &i in &order {
                if let Some(Some(v)) = item.values.get(i) {
                    put(&self.fields[i]);
                    put(v);
                }
            }
            put("");
        }
        hex::encode(hasher.finalize())
    }

    /// Settles ids (checked or derived) and builds the table; problems go to `report`.
    /// `declared` are field names known even without items (a CSV header), so a template's
    /// typo shows before the first night the file has rows.
    pub fn build(file: &str, declared: &[String], raw: Vec<RawItem>, report: &mut Report) -> Items {
        let mut builder = Builder::new(file);
        builder.declare(declared);
        for item in raw {
            builder.push(item);
        }
        builder.finish(report)
    }
}

/// Builds [`Items`] one item at a time as a file is read, so a large file is never held as
/// raw items and as the table at once: its peak is about the table's size.
pub struct Builder {
    items: Items,
    derived_seen: HashMap<String, usize>,
    /// Each id, lowercased, to the row that first had it.
    taken: HashMap<Box<str>, usize>,
    /// Problems, reported at the end after the reader's own.
    problems: Vec<Diagnostic>,
}

impl Builder {
    pub fn new(file: &str) -> Builder {
        Builder {
            items: Items {
                file: file.to_owned(),
                ..Items::default()
            },
            derived_seen: HashMap::new(),
            taken: HashMap::new(),
            problems: Vec::new(),
        }
    }

    /// Field names known even without items (a CSV header).
    pub fn declare(&mut self, names: &[String]) {
        for name in names.iter().filter(|n| *n != "id") {
            self.field(name);
        }
    }

    fn field(&mut self, name: &str) -> usize {
        let items = &mut self.items;
        if let Some(i) = items.index.get(name) {
            return *i;
        }
        items.fields.push(name.to_owned());
        items.index.insert(name.to_owned(), items.fields.len() - 1);
        items.fields.len() - 1
    }

    pub fn push(&mut self, raw_item: RawItem) {
        let id = match raw_item.fields.iter().find(|(k, _)| k == "id") {
            Some((_, id)) => {
                let at = raw_item.id_mark.unwrap_or(raw_item.mark);
                if is_derived_form(id) {
                    self.problems.push(Diagnostic::new(
                        &self.items.file,
                        at,
                        format!("item id {}: ids of the form item-<12 hex digits> are kept for items written without an id", shown(id)),
                    ));
                } else if let Err(why) = check_id(id) {
                    self.problems.push(
                        Diagnostic::new(&self.items.file, at, format!("item id {}: {why}", shown(id)))
                            .hint("ids name output directories: letters, digits, `.`, `_` and `-`, starting with a letter or digit"),
                    );
                }
                id.clone()
            }
            None => {
                let base = derive_id(&raw_item.fields);
                let n = self.derived_seen.entry(base.clone()).or_insert(0);
                *n += 1;
                match *n {
                    1 => base,
                    n => format!("{base}-{n}"),
                }
            }
        };
        let mut values: Vec<Option<Box<str>>> = vec![None; self.items.fields.len()];
        for (name, value) in raw_item.fields {
            if name == "id" {
                continue;
            }
            let i = self.field(&name);
            if values.len() <= i {
                values.resize(i + 1, None);
            }
            values[i] = Some(value.into_boxed_str());
        }
        let row = self.items.rows.len();
        let lower: Box<str> = id.to_lowercase().into();
        match self.taken.get(&lower) {
            Some(&first) => {
                let first = &self.items.rows[first];
                let what = if first.id == id {
                    "is used twice".to_owned()
                } else {
                    format!(
                        "differs from {} only in case, and both would share one directory on case-insensitive file systems",
                        shown(&first.id)
                    )
                };
                let line = first.mark.line;
                self.problems.push(Diagnostic::new(
                    &self.items.file,
                    raw_item.id_mark.unwrap_or(raw_item.mark),
                    format!("item id {} {what} (first at line {line})", shown(&id)),
                ));
            }
            None => {
                self.taken.insert(lower, row);
            }
        }
        self.items.rows.push(Item {
            id,
            values: values.into_boxed_slice(),
            mark: raw_item.mark,
        });
    }

    /// The table, its problems added to `report`.
    pub fn finish(self, report: &mut Report) -> Items {
        for d in self.problems {
            report.error(d);
        }
        let mut items = self.items;
        items.rows.shrink_to_fit();
        items
    }
}

/// `item-` and 12 lowercase hex digits, optionally `-N`: the shape of a derived id.
fn is_derived_form(id: &str) -> bool {
    let Some(rest) = id.strip_prefix("item-") else {
        return false;
    };
    let (hex, suffix) = rest.split_at(rest.len().min(12));
    hex.len() == 12
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && (suffix.is_empty()
            || suffix
                .strip_prefix('-')
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
}

/// Windows device names, which no file or directory may be called, with any extension.
pub fn is_device_name(name: &str) -> bool {
    let stem = name.split('.').next().unwrap_or(name).to_ascii_uppercase();
    matches!(stem.as_str(), "CON" | "PRN" | "AUX" | "NUL")
        || (stem.len() == 4
            && (stem.starts_with("COM") || stem.starts_with("LPT"))
            && stem.as_bytes()[3].is_ascii_digit())
}

/// Whether `id` is safe as a directory name everywhere imgpipe may run.
pub fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("is empty".into());
    }
    if id.chars().count() > MAX_ID_CHARS {
        return Err(format!("is longer than {MAX_ID_CHARS} characters"));
    }
    let first = id.chars().next().unwrap_or('.');
    if !first.is_ascii_alphanumeric() {
        return Err("must start with a letter or digit".into());
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "contains {bad:?}; only letters, digits, `.`, `_` and `-` are allowed"
        ));
    }
    if id.ends_with('.') {
        return Err("must not end with `.`".into());
    }
    if is_device_name(id) {
        return Err("is a reserved device name on Windows".into());
    }
    if layout::RUN_FILES.iter().any(|f| f.eq_ignore_ascii_case(id)) {
        return Err("is the name of a file imgpipe writes in each run's directory".into());
    }
    Ok(())
}

/// `item-` and 12 hex digits of the item's content: stable when the file is reordered.
fn derive_id(fields: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = fields.iter().collect();
    sorted.sort();
    let mut hasher = Sha256::new();
    for (k, v) in sorted {
        hasher.update(k.as_bytes());
        hasher.update([0x1f]);
        hasher.update(v.as_bytes());
        hasher.update([0x1e]);
    }
    let digest = hex::encode(hasher.finalize());
    format!("item-{}", &digest[..12])
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

/// Reads an items file, `.jsonl` or `.csv`, into `into`. Problems inside it go to `report`
/// against `shown_path`; a file that cannot be read at all is the error.
pub fn read_file(
    path: &Path,
    shown_path: &str,
    report: &mut Report,
    into: &mut Builder,
) -> Result<(), String> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("jsonl") | Some("ndjson") => {
            // Read a line at a time: a large file is never held whole.
            let file = std::fs::File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
            read_jsonl(std::io::BufReader::new(file), shown_path, report, into);
            return Ok(());
        }
        Some("csv") => {}
        _ => {
            return Err(
                "an items file must be .jsonl (one JSON object per line) or .csv (a header row, then one item per row)".into(),
            );
        }
    };
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    read_csv(&bytes, shown_path, report, into);
    Ok(())
}

fn read_jsonl(
    mut reader: impl std::io::BufRead,
    file: &str,
    report: &mut Report,
    into: &mut Builder,
) {
    let mut buf = Vec::new();
    for i in 0.. {
        buf.clear();
        let mark = Mark {
            line: i + 1,
            col: 1,
        };
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) => {
                report.error(Diagnostic::new(file, mark, format!("cannot read it: {e}")));
                return;
            }
        }
        let mut bytes = buf.strip_suffix(b"\n").unwrap_or(&buf);
        bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        if i == 0 {
            bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
        }
        let Ok(line) = std::str::from_utf8(bytes) else {
            report.error(Diagnostic::new(file, mark, "is not UTF-8 text"));
            return;
        };
        if line.trim().is_empty() {
            continue;
        }
        let object: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(line) {
            Ok(o) => o,
            Err(e) => {
                report.error(Diagnostic::new(
                    file,
                    Mark {
                        line: i + 1,
                        col: char_column(line, e.column()),
                    },
                    format!("not a JSON object: {}", without_position(&e)),
                ));
                continue;
            }
        };
        let mut fields = Vec::with_capacity(object.len());
        for (key, value) in object {
            let text = match value {
                serde_json::Value::String(s) => s,
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                serde_json::Value::Null => continue,
                other => {
                    let kind = if other.is_array() {
                        "a list"
                    } else {
                        "an object"
                    };
                    report.error(Diagnostic::new(
                        file,
                        mark,
                        format!(
                            "field `{key}` is {kind}; item fields are strings, numbers or booleans"
                        ),
                    ));
                    continue;
                }
            };
            fields.push((key, text));
        }
        let id_mark = fields.iter().any(|(k, _)| k == "id").then_some(mark);
        into.push(RawItem {
            fields,
            mark,
            id_mark,
        });
    }
}

/// serde_json's 1-based column, which counts bytes, as the characters a reader counts: those
/// that start before it.
fn char_column(line: &str, byte_column: usize) -> usize {
    line.char_indices()
        .take_while(|(at, _)| *at < byte_column)
        .count()
        .max(1)
}

/// serde_json's message without its " at line 1 column N": the line is the file's, given apart.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

/// Reads a CSV items file. Header names are trimmed; an empty cell is a missing field, as a
/// JSON `null` is, so a template never fills a hole with nothing.
fn read_csv(bytes: &[u8], file: &str, report: &mut Report, into: &mut Builder) {
    let mut lines = LineCounter::new(bytes);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(bytes);
    let headers: Vec<String> = match reader.headers() {
        Ok(h) => h.iter().map(|n| n.trim().to_owned()).collect(),
        Err(e) => {
            report.error(csv_error(file, &e, &mut lines));
            return;
        }
    };
    let mut seen = HashMap::new();
    for (col, name) in headers.iter().enumerate() {
        let mark = Mark {
            line: 1,
            col: col + 1,
        };
        if name.is_empty() {
            report.error(Diagnostic::new(
                file,
                mark,
                format!("column {} has no name in the header row", col + 1),
            ));
        } else if let Some(first) = seen.insert(name.clone(), col) {
            report.error(Diagnostic::new(
                file,
                mark,
                format!(
                    "column `{name}` appears twice in the header row (columns {} and {})",
                    first + 1,
                    col + 1
                ),
            ));
        }
    }
    into.declare(&headers);
    for record in reader.records() {
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                report.error(csv_error(file, &e, &mut lines));
                continue;
            }
        };
        let line = record
            .position()
            .map_or(1, |p| lines.line_at(p.byte() as usize));
        let mark = Mark { line, col: 1 };
        if record.iter().all(|v| v.trim().is_empty()) {
            continue;
        }
        let fields: Vec<(String, String)> = headers
            .iter()
            .zip(record.iter())
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.clone(), v.to_owned()))
            .collect();
        let id_mark = fields.iter().any(|(k, _)| k == "id").then_some(mark);
        into.push(RawItem {
            fields,
            mark,
            id_mark,
        });
    }
}

/// Line numbers from byte offsets, counting `\n` only: the csv crate counts a `\r\n` twice.
struct LineCounter<'a> {
    bytes: &'a [u8],
    at: usize,
    line: usize,
}

impl<'a> LineCounter<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        LineCounter {
            bytes,
            at: 0,
            line: 1,
        }
    }

    /// The 1-based line of byte `offset`; offsets are asked in increasing order.
    fn line_at(&mut self, offset: usize) -> usize {
        let mut offset = offset.min(self.bytes.len());
        // After a `\r`, csv positions a record at the `\n` that ends the line before it; blank
        // lines before a record are skipped too.
        while self
            .bytes
            .get(offset)
            .is_some_and(|b| matches!(b, b'\r' | b'\n'))
        {
            offset += 1;
        }
        if offset < self.at {
            self.at = 0;
            self.line = 1;
        }
        self.line += self.bytes[self.at..offset]
            .iter()
            .filter(|b| **b == b'\n')
            .count();
        self.at = offset;
        self.line
    }
}

fn csv_error(file: &str, e: &csv::Error, lines: &mut LineCounter<'_>) -> Diagnostic {
    let line = e.position().map_or(1, |p| lines.line_at(p.byte() as usize));
    let message = match e.kind() {
        csv::ErrorKind::UnequalLengths {
            expected_len, len, ..
        } => format!("this row has {len} fields but the header row has {expected_len}"),
        csv::ErrorKind::Utf8 { .. } => "is not UTF-8 text".to_owned(),
        _ => e.to_string(),
    };
    Diagnostic::new(file, Mark { line, col: 1 }, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(fields: &[(&str, &str)], line: usize) -> RawItem {
        RawItem {
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            mark: Mark { line, col: 1 },
            id_mark: fields
                .iter()
                .any(|(k, _)| *k == "id")
                .then_some(Mark { line, col: 1 }),
        }
    }

    fn read(
        reader: fn(&[u8], &str, &mut Report, &mut Builder),
        bytes: &[u8],
        file: &str,
        report: &mut Report,
    ) -> Items {
        let mut into = Builder::new(file);
        reader(bytes, file, report, &mut into);
        into.finish(report)
    }

    #[test]
    fn unsafe_ids_are_refused() {
        for bad in [
            "", "../x", "a/b", ".hidden", "x.", "con", "LPT1.txt", "a b", "é",
        ] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
        for good in ["mug", "Lamp-2", "sku_12.v2", "0001"] {
            assert!(check_id(good).is_ok(), "{good}");
        }
        assert!(check_id(&"a".repeat(65)).is_err());
    }

    #[test]
    fn derived_ids_follow_content_and_duplicates_are_numbered() {
        let mut report = Report::default();
        let items = Items::build(
            "f",
            &[],
            vec![
                raw(&[("subject", "mug")], 1),
                raw(&[("subject", "lamp")], 2),
                raw(&[("subject", "mug")], 3),
            ],
            &mut report,
        );
        assert!(report.is_ok());
        let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids[0].len(), "item-".len() + 12);
        assert_eq!(ids[2], format!("{}-2", ids[0]));
        let reordered = Items::build(
            "f",
            &[],
            vec![
                raw(&[("subject", "lamp")], 1),
                raw(&[("subject", "mug")], 2),
            ],
            &mut report,
        );
        assert_eq!(reordered.get(1).unwrap().id, ids[0]);
    }

    #[test]
    fn duplicate_and_case_colliding_ids_are_errors_with_lines() {
        let mut report = Report::default();
        Items::build(
            "items.csv",
            &[],
            vec![
                raw(&[("id", "mug")], 2),
                raw(&[("id", "Mug")], 3),
                raw(&[("id", "mug")], 4),
            ],
            &mut report,
        );
        let lines: Vec<usize> = report.errors.iter().map(|d| d.line).collect();
        assert_eq!(lines, [3, 4]);
        assert!(report.errors[0].message.contains("only in case"));
        assert!(
            report.errors[1]
                .message
                .contains("is used twice (first at line 2)")
        );
    }

    #[test]
    fn csv_lines_count_crlf_once_and_empty_cells_are_missing() {
        let mut report = Report::default();
        let csv = b"id,url, subject\r\na,https://x/a.png,\r\n\r\nb,https://x/b.png,mug,extra\r\n";
        let rows = read(read_csv, csv, "i.csv", &mut report);
        let names: Vec<&str> = rows.field_names().collect();
        assert_eq!(names, ["url", "subject"]);
        let first = rows.get(0).unwrap();
        assert_eq!(first.mark.line, 2);
        assert_eq!(rows.value(first, "subject"), None);
        assert_eq!(report.errors[0].line, 4, "{:?}", report.errors);
        assert!(is_derived_form("item-0123456789ab") && is_derived_form("item-0123456789ab-2"));
        assert!(!is_derived_form("item-0123456789ab-") && !is_derived_form("item-mug"));
    }

    #[test]
    fn csv_and_jsonl_report_bad_rows_by_line() {
        let mut report = Report::default();
        let rows = read(
            read_csv,
            b"id,url\na,https://x/a.png\nb\n",
            "i.csv",
            &mut report,
        );
        assert_eq!(rows.len(), 1);
        assert_eq!(report.errors[0].line, 3, "{:?}", report.errors);
        let mut report = Report::default();
        let text = b"{\"a\": 1}\n\n[1]\n{\"b\": [2]}\n";
        let rows = read(
            |b, f, r, i| read_jsonl(b, f, r, i),
            text,
            "i.jsonl",
            &mut report,
        );
        assert_eq!(rows.len(), 2);
        let lines: Vec<usize> = report.errors.iter().map(|d| d.line).collect();
        assert_eq!(lines, [3, 4]);
    }

    #[test]
    fn jsonl_errors_count_columns_in_characters() {
        let mut report = Report::default();
        // serde_json says column 30, in bytes: the end of the line, 21 characters in.
        let text = "{\"id\": \"日本語\", \"x\": \"🙂\n".as_bytes();
        read(
            |b, f, r, i| read_jsonl(b, f, r, i),
            text,
            "i.jsonl",
            &mut report,
        );
        let at: Vec<(usize, usize)> = report.errors.iter().map(|d| (d.line, d.column)).collect();
        assert_eq!(at, [(1, 21)], "{:?}", report.errors);
    }

    #[test]
    fn jsonl_is_read_a_line_at_a_time_with_bom_crlf_and_bad_bytes_by_line() {
        let mut report = Report::default();
        let text =
            b"\xef\xbb\xbf{\"id\": \"a\"}\r\n{\"id\": \"b\"}\n{\"id\": \"\xff\"}\n{\"id\": \"d\"}";
        let rows = read(
            |b, f, r, i| read_jsonl(b, f, r, i),
            text,
            "i.jsonl",
            &mut report,
        );
        let ids: Vec<&str> = rows.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["a", "b"], "the reading stops at the bad line");
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        assert_eq!(report.errors[0].line, 3);
        assert!(report.errors[0].message.contains("not UTF-8"));
    }
}
