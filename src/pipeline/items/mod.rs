//! The batch's items: inline in the pipeline file, or from a JSONL or CSV file.
//!
//! Item ids become directory names under the output directory, so they are checked to be safe
//! names on every common file system; when an item has none, one is derived from its content so
//! that reordering or extending an items file does not rename the items already done.
//!
//! Items are read once, as a stream, and kept encoded (see [`store`]): what a batch costs in
//! memory is an offset and an index entry per item, not its strings.

mod ids;
mod read;
mod store;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use sha2::{Digest, Sha256};

use crate::pipeline::diag::{Diagnostic, Report, shown};
use crate::pipeline::yaml::Mark;
use crate::place::layout;
use crate::sha256::Sha256Sum;

use ids::IdIndex;
pub use read::read_file;
use store::Store;

/// Longest item id: a directory name with room to spare on every file system.
pub const MAX_ID_CHARS: usize = 64;

#[derive(Clone, Debug, Default)]
pub struct Items {
    /// Field names, in the order first seen.
    fields: Vec<String>,
    index: HashMap<String, usize>,
    rows: Arc<Store>,
    /// Built on the first lookup by id (see [`ids`]).
    ids: Arc<OnceLock<IdIndex>>,
    /// See [`Items::sha256`]; `None` for no items.
    sha256: Option<Sha256Sum>,
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
        self.rows.len() == 0
    }

    /// Every item in order, each decoded as it comes.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Item> + '_ {
        self.rows.iter_from(0)
    }

    pub fn get(&self, i: usize) -> Option<Item> {
        self.rows.get(i)
    }

    /// Item `i`'s id, without decoding its fields.
    pub fn id(&self, i: usize) -> Option<String> {
        self.rows.id(i)
    }

    /// The item whose id is `id`, exactly.
    pub fn position(&self, id: &str) -> Option<usize> {
        let index = self.ids.get_or_init(|| IdIndex::of(&self.rows));
        let row = index.find(id, &self.rows)?;
        (self.rows.id(row)? == id).then_some(row)
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
    pub fn sha256(&self) -> Sha256Sum {
        self.sha256
            .clone()
            .unwrap_or_else(|| Sha256Sum::of_bytes(b""))
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
/// raw items, nor as strings once read.
pub struct Builder {
    fields: Vec<String>,
    index: HashMap<String, usize>,
    file: String,
    rows: Store,
    ids: ids::Seen,
    /// How many items so far derived each base id, by the base's 48 bits.
    derived_seen: HashMap<u64, usize>,
    hasher: Sha256,
    /// Problems, reported at the end after the reader's own.
    problems: Vec<Diagnostic>,
}

impl Builder {
    pub fn new(file: &str) -> Builder {
        Builder {
            fields: Vec::new(),
            index: HashMap::new(),
            file: file.to_owned(),
            rows: Store::default(),
            ids: ids::Seen::default(),
            derived_seen: HashMap::new(),
            hasher: Sha256::new(),
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
        if let Some(i) = self.index.get(name) {
            return *i;
        }
        self.fields.push(name.to_owned());
        self.index.insert(name.to_owned(), self.fields.len() - 1);
        self.fields.len() - 1
    }

    pub fn push(&mut self, raw_item: RawItem) {
        let id = match raw_item.fields.iter().find(|(k, _)| k == "id") {
            Some((_, id)) => {
                let at = raw_item.id_mark.unwrap_or(raw_item.mark);
                if is_derived_form(id) {
                    self.problems.push(Diagnostic::new(
                        &self.file,
                        at,
                        format!("item id {}: ids of the form item-<12 hex digits> are kept for items written without an id", shown(id)),
                    ));
                } else if let Err(why) = check_id(id) {
                    self.problems.push(
                        Diagnostic::new(&self.file, at, format!("item id {}: {why}", shown(id)))
                            .hint("ids name output directories: letters, digits, `.`, `_` and `-`, starting with a letter or digit"),
                    );
                }
                id.clone()
            }
            None => {
                let (base, bits) = derive_id(&raw_item.fields);
                let n = self.derived_seen.entry(bits).or_insert(0);
                *n += 1;
                match *n {
                    1 => base,
                    n => format!("{base}-{n}"),
                }
            }
        };
        let mut values: Vec<Option<Box<str>>> = vec![None; self.fields.len()];
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
        if u32::try_from(self.rows.len()).is_err() {
            self.problems.push(Diagnostic::new(
                &self.file,
                raw_item.mark,
                format!("more than {} items: split the batch", u32::MAX),
            ));
            return;
        }
        self.ids
            .push(&id, raw_item.id_mark.filter(|m| *m != raw_item.mark));
        self.digest(&id, &values);
        let item = Item {
            id,
            values: values.into_boxed_slice(),
            mark: raw_item.mark,
        };
        if let Err(e) = self.rows.push(&item) {
            self.cannot_store(item.mark, &e);
        }
    }

    /// Adds an item to [`Items::sha256`]: its id, then its fields by name, each string
    /// length-prefixed so that no value can pass for a field name or an id.
    fn digest(&mut self, id: &str, values: &[Option<Box<str>>]) {
        let mut present: Vec<(&str, &str)> = values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| Some((self.fields[i].as_str(), v.as_deref()?)))
            .collect();
        present.sort_unstable();
        let hasher = &mut self.hasher;
        let mut put = |s: &str| {
            hasher.update((s.len() as u64).to_le_bytes());
            hasher.update(s.as_bytes());
        };
        put(id);
        for (name, value) in present {
            put(name);
            put(value);
        }
        put("");
    }

    /// Says which items reuse an id an earlier item has, where their ids are written.
    fn report_duplicates(&mut self, seen: ids::Seen) {
        let duplicates = seen.duplicates(&self.rows);
        for d in duplicates {
            let (Some(item), Some(first)) = (self.rows.get(d.row), self.rows.get(d.first)) else {
                continue;
            };
            let what = if first.id == item.id {
                "is used twice".to_owned()
            } else {
                format!(
                    "differs from {} only in case, and both would share one directory on case-insensitive file systems",
                    shown(&first.id)
                )
            };
            let at = d.id_mark.unwrap_or(item.mark);
            self.problems.push(Diagnostic::new(
                &self.file,
                at,
                format!(
                    "item id {} {what} (first at line {})",
                    shown(&item.id),
                    first.mark.line
                ),
            ));
        }
    }

    fn cannot_store(&mut self, at: Mark, e: &std::io::Error) {
        if self
            .problems
            .iter()
            .all(|d| !d.message.starts_with("cannot hold"))
        {
            self.problems.push(
                Diagnostic::new(
                    &self.file,
                    at,
                    format!("cannot hold the items in a temporary file: {e}"),
                )
                .hint("a large batch's items wait in an unnamed file in $TMPDIR (else /tmp): give it room, or point TMPDIR elsewhere"),
            );
        }
    }

    /// The table, its problems added to `report`.
    pub fn finish(mut self, report: &mut Report) -> Items {
        if let Err(e) = self.rows.finish() {
            self.cannot_store(Mark { line: 1, col: 1 }, &e);
        }
        let seen = std::mem::take(&mut self.ids);
        self.report_duplicates(seen);
        for d in self.problems {
            report.error(d);
        }
        let empty = self.rows.len() == 0;
        Items {
            fields: self.fields,
            index: self.index,
            rows: Arc::new(self.rows),
            ids: Arc::default(),
            sha256: (!empty).then(|| Sha256Sum::of_digest(self.hasher.finalize())),
            file: self.file,
        }
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

/// `item-` and 12 hex digits of the item's content (stable when the file is reordered), with
/// those digits' 48 bits.
fn derive_id(fields: &[(String, String)]) -> (String, u64) {
    let mut sorted: Vec<&(String, String)> = fields.iter().collect();
    sorted.sort();
    let mut hasher = Sha256::new();
    for (k, v) in sorted {
        hasher.update(k.as_bytes());
        hasher.update([0x1f]);
        hasher.update(v.as_bytes());
        hasher.update([0x1e]);
    }
    let digest = hasher.finalize();
    let bits = digest[..6].iter().fold(0u64, |n, b| n << 8 | u64::from(*b));
    (format!("item-{}", &hex::encode(digest)[..12]), bits)
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
        let ids: Vec<String> = items.iter().map(|i| i.id).collect();
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
    fn derived_forms_are_told_apart() {
        assert!(is_derived_form("item-0123456789ab") && is_derived_form("item-0123456789ab-2"));
        assert!(!is_derived_form("item-0123456789ab-") && !is_derived_form("item-mug"));
    }

    /// The digest as it was computed when items were held whole: over every item, fields in
    /// the order of their names. Saved plans and recorded runs compare against it.
    fn digest_as_before(items: &Items) -> String {
        let mut order: Vec<usize> = (0..items.fields.len()).collect();
        order.sort_by(|a, b| items.fields[*a].cmp(&items.fields[*b]));
        let mut hasher = Sha256::new();
        let mut put = |s: &str| {
            hasher.update((s.len() as u64).to_le_bytes());
            hasher.update(s.as_bytes());
        };
        for item in items.iter() {
            put(&item.id);
            for &i in &order {
                if let Some(Some(v)) = item.values.get(i) {
                    put(&items.fields[i]);
                    put(v);
                }
            }
            put("");
        }
        hex::encode(hasher.finalize())
    }

    #[test]
    fn a_large_batch_is_kept_out_of_memory_and_found_by_id() {
        let mut report = Report::default();
        let n = 30_000;
        let mut raw_items: Vec<RawItem> = (0..n)
            .map(|i| {
                let subject = format!("product number {i} in a long description");
                if i % 3 == 0 {
                    raw(&[("subject", &subject)], i + 1)
                } else {
                    raw(
                        &[
                            ("id", &format!("Sku-{i}")),
                            ("subject", &subject),
                            ("z", "1"),
                        ],
                        i + 1,
                    )
                }
            })
            .collect();
        raw_items.push(raw(&[("id", "sku-1")], n + 1));
        let items = Items::build("big.jsonl", &[], raw_items, &mut report);
        assert_eq!(items.len(), n + 1);
        assert!(items.rows.spilled(), "the items went to the temporary file");
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        assert_eq!(report.errors[0].line, n + 1);
        assert!(
            report.errors[0]
                .message
                .contains("differs from \"Sku-1\" only in case")
        );
        assert_eq!(items.position("Sku-29999"), Some(29_999));
        assert_eq!(items.position("sku-29999"), None, "ids are found exactly");
        assert_eq!(items.position("Sku-30000"), None);
        let derived = items.get(3).unwrap().id;
        assert_eq!(items.position(&derived), Some(3));
        let it = items.get(29_999).unwrap();
        assert_eq!(
            items.value(&it, "subject"),
            Some("product number 29999 in a long description")
        );
        assert_eq!(items.value(&it, "z"), Some("1"));
        assert_eq!(items.sha256().as_str(), digest_as_before(&items));
        assert_eq!(
            Items::default().sha256().as_str(),
            digest_as_before(&Items::default())
        );
    }
}
