//! What a cut answer still says: the job id at the start of a JSON body whose end never came.
//!
//! A paid call whose answer is cut after its first bytes may have been billed; when those bytes
//! name the job, its images can be read back with `GET /v1/jobs/{id}` instead of paying again.

use crate::api::job_id::{JobId, is_job_id};

/// The top-level `"id"` of the JSON object `prefix` begins, when its value arrived whole and is
/// plainly a job id. Anything else (no object, the key not reached, a value cut short, an id
/// that is not a plain id) names nothing.
pub fn job_id_in(prefix: &[u8]) -> Option<JobId> {
    let text = match std::str::from_utf8(prefix) {
        Ok(text) => text,
        Err(e) => std::str::from_utf8(&prefix[..e.valid_up_to()]).ok()?,
    };
    let mut rest = text.trim_start().strip_prefix('{')?;
    loop {
        rest = rest.trim_start();
        let key_end = string_end(rest)?;
        let key: String = serde_json::from_str(&rest[..key_end]).ok()?;
        rest = rest[key_end..].trim_start().strip_prefix(':')?.trim_start();
        if key == "id" {
            let value_end = string_end(rest)?;
            let id: String = serde_json::from_str(&rest[..value_end]).ok()?;
            return is_job_id(&id).then(|| JobId::new(id));
        }
        rest = skip_value(rest)?.trim_start();
        rest = rest.strip_prefix(',')?;
    }
}

/// The length of the JSON string `text` starts with, quotes included; `None` when it does not
/// start with one or the string is cut.
fn string_end(text: &str) -> Option<usize> {
    let body = text.strip_prefix('"')?;
    let mut escaped = false;
    for (i, b) in body.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' => escaped = true,
            b'"' => return Some(i + 2),
            _ => {}
        }
    }
    None
}

/// What follows the JSON value `text` starts with; `None` when the value is cut.
fn skip_value(text: &str) -> Option<&str> {
    if text.starts_with('"') {
        return Some(&text[string_end(text)?..]);
    }
    let mut depth = 0usize;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += string_end(&text[i..])?;
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' if depth == 0 => return Some(&text[i..]),
            b'}' | b']' => depth -= 1,
            b',' if depth == 0 => return Some(&text[i..]),
            _ => {}
        }
        i += 1;
        if depth == 0 && matches!(bytes[i - 1], b'}' | b']') {
            return Some(&text[i..]);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_answer_names_its_job_only_when_the_id_arrived_whole() {
        let named = [
            r#"{"id":"job_1","status":"succ"#,
            r#" { "status": "succeeded", "images": [{"url": "x,}"}], "id" : "job_2" , "#,
            r#"{"a":{"id":"nested"},"b":[1,[2]],"c":-1.5e3,"d":null,"id":"job_3"}"#,
            r#"{"note":"say \"id\":\"job_x\"","id":"job_4""#,
        ];
        let ids: Vec<_> = named.iter().map(|t| job_id_in(t.as_bytes())).collect();
        assert_eq!(
            ids,
            [Some("job_1"), Some("job_2"), Some("job_3"), Some("job_4")]
                .map(|i| i.map(JobId::from))
        );
        let nothing = [
            "",
            r#"{"id":"job_1"#,
            r#"{"id":"#,
            r#"{"status":"succeeded","#,
            r#"{"a":{"id":"job_1","#,
            r#"{"id":"../etc"}"#,
            r#"{"id":12}"#,
            r#"["id","job_1"]"#,
            "not json",
        ];
        for text in nothing {
            assert_eq!(job_id_in(text.as_bytes()), None, "{text}");
        }
        // A multi-byte character cut in two does not hide what came before it.
        let mut cut = br#"{"id":"job_5","note":""#.to_vec();
        cut.extend_from_slice(&"é".as_bytes()[..1]);
        assert_eq!(job_id_in(&cut).as_deref(), Some("job_5"));
    }
}
