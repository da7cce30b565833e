//! Items files: JSONL read a line at a time, CSV with its header; every problem by line.

use std::collections::HashMap;
use std::path::Path;

use super::{Builder, RawItem};
use crate::pipeline::diag::{Diagnostic, Report};
use crate::pipeline::yaml::Mark;

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
    use crate::pipeline::items::Items;

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
    fn csv_lines_count_crlf_once_and_empty_cells_are_missing() {
        let mut report = Report::default();
        let csv = b"id,url, subject\r\na,https://x/a.png,\r\n\r\nb,https://x/b.png,mug,extra\r\n";
        let rows = read(read_csv, csv, "i.csv", &mut report);
        let names: Vec<&str> = rows.field_names().collect();
        assert_eq!(names, ["url", "subject"]);
        let first = rows.get(0).unwrap();
        assert_eq!(first.mark.line, 2);
        assert_eq!(rows.value(&first, "subject"), None);
        assert_eq!(report.errors[0].line, 4, "{:?}", report.errors);
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
        let ids: Vec<String> = rows.iter().map(|i| i.id).collect();
        assert_eq!(ids, ["a", "b"], "the reading stops at the bad line");
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        assert_eq!(report.errors[0].line, 3);
        assert!(report.errors[0].message.contains("not UTF-8"));
    }
}
