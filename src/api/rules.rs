//! The spec's request rules, written once and applied in two places: by the client before a
//! request leaves the machine (so an invalid call is never sent, let alone billed) and by the
//! sandbox on raw JSON bodies (so it answers 400 exactly where the service would).

use serde_json::Value;
use url::Url;

pub use crate::api::types::InvalidField;
use crate::api::types::{
    AspectRatio, GenerationRequest, Increase, Size, ToolName, ToolParams, ToolRequest,
};

pub const MAX_PROMPT_CHARS: usize = 4000;
pub const MAX_IMAGES_PER_GENERATION: u8 = 4;
pub const MAX_REFERENCE_IMAGES: usize = 6;

/// Whether `url` was issued by the service at `service` (same scheme, host and port). Such URLs
/// are passed on as issued; the https rule applies only to URLs a user writes.
pub fn is_service_url(url: &Url, service: &Url) -> bool {
    url.scheme() == service.scheme()
        && url.host_str() == service.host_str()
        && url.port_or_known_default() == service.port_or_known_default()
}

pub fn check_prompt(field: &str, prompt: &str) -> Result<(), InvalidField> {
    if prompt.trim().is_empty() {
        return Err(InvalidField::new(field, "must not be empty"));
    }
    let chars = prompt.chars().count();
    if chars > MAX_PROMPT_CHARS {
        return Err(InvalidField::new(
            field,
            format!("is {chars} characters long; the limit is {MAX_PROMPT_CHARS}"),
        ));
    }
    Ok(())
}

pub fn check_n(n: i64) -> Result<(), InvalidField> {
    if (1..=i64::from(MAX_IMAGES_PER_GENERATION)).contains(&n) {
        Ok(())
    } else {
        Err(InvalidField::new(
            "n",
            format!("must be between 1 and {MAX_IMAGES_PER_GENERATION}, got {n}"),
        ))
    }
}

/// Reference images: at most six, each an https URL unless the service issued it.
pub fn check_references(urls: &[String], service: &Url) -> Result<(), InvalidField> {
    if urls.len() > MAX_REFERENCE_IMAGES {
        return Err(InvalidField::new(
            "image_urls",
            format!(
                "has {} entries; the limit is {MAX_REFERENCE_IMAGES}",
                urls.len()
            ),
        ));
    }
    for (i, raw) in urls.iter().enumerate() {
        let field = format!("image_urls[{i}]");
        let url = parse_absolute(&field, raw)?;
        if url.scheme() != "https" && !is_service_url(&url, service) {
            return Err(InvalidField::new(
                field,
                format!("must be an https URL, got {raw:?}"),
            ));
        }
    }
    Ok(())
}

/// An absolute http(s) URL: anything else cannot be a public image address.
pub fn parse_absolute(field: &str, raw: &str) -> Result<Url, InvalidField> {
    let url = Url::parse(raw).map_err(|e| {
        InvalidField::new(field, format!("must be an absolute URL ({e}), got {raw:?}"))
    })?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(InvalidField::new(
            field,
            format!("must be an absolute http(s) URL, got {raw:?}"),
        ));
    }
    Ok(url)
}

pub fn check_generation(req: &GenerationRequest, service: &Url) -> Result<(), InvalidField> {
    check_prompt("prompt", &req.prompt)?;
    check_n(i64::from(req.n))?;
    check_references(&req.image_urls, service)
}

pub fn check_tool(req: &ToolRequest) -> Result<(), InvalidField> {
    parse_absolute("image_url", &req.image_url)?;
    match &req.params {
        ToolParams::Erase { object_name } if object_name.trim().is_empty() => Err(
            InvalidField::new("object_name", "is required and must not be empty"),
        ),
        ToolParams::Expand {
            prompt: Some(prompt),
            ..
        } if prompt.trim().is_empty() => Err(InvalidField::new(
            "prompt",
            "must not be empty when given; leave it out instead",
        )),
        _ => Ok(()),
    }
}

/// Reads a generation body as the sandbox receives it, naming the first offending field.
pub fn generation_from_json(
    body: &Value,
    service: &Url,
) -> Result<GenerationRequest, InvalidField> {
    let obj = body
        .as_object()
        .ok_or_else(|| InvalidField::new("body", "must be a JSON object"))?;
    let prompt = match obj.get("prompt") {
        None | Some(Value::Null) => return Err(InvalidField::new("prompt", "is required")),
        Some(v) => string_field("prompt", v)?,
    };
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => integer_field("n", v)?,
    };
    check_n(n)?;
    let size = match obj.get("size") {
        None | Some(Value::Null) => Size::TwoK,
        Some(v) => string_field("size", v)?.parse()?,
    };
    let image_urls = match obj.get("image_urls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| string_field(&format!("image_urls[{i}]"), v))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(InvalidField::new(
                "image_urls",
                "must be an array of strings",
            ));
        }
    };
    let req = GenerationRequest {
        prompt,
        n: u8::try_from(n).map_err(|_| InvalidField::new("n", "out of range"))?,
        size,
        image_urls,
    };
    check_generation(&req, service)?;
    Ok(req)
}

/// Reads a tool body as the sandbox receives it. `desired_increase` is not marked required in
/// the spec; when absent the sandbox reads it as 2, the cheaper factor.
pub fn tool_from_json(tool: ToolName, body: &Value) -> Result<ToolRequest, InvalidField> {
    let obj = body
        .as_object()
        .ok_or_else(|| InvalidField::new("body", "must be a JSON object"))?;
    let get = |name: &str| obj.get(name).filter(|v| !v.is_null());
    let image_url = match get("image_url") {
        None => return Err(InvalidField::new("image_url", "is required")),
        Some(v) => string_field("image_url", v)?,
    };
    let preserve_alpha = match get("preserve_alpha") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err(InvalidField::new("preserve_alpha", "must be true or false")),
    };
    let params = match tool {
        ToolName::RemoveBackground => ToolParams::RemoveBackground,
        ToolName::Upscale => ToolParams::Upscale {
            desired_increase: match get("desired_increase") {
                None => Increase::X2,
                Some(v) => Increase::from_factor(integer_field("desired_increase", v)?)?,
            },
        },
        ToolName::Expand => ToolParams::Expand {
            aspect_ratio: get("aspect_ratio")
                .map(|v| string_field("aspect_ratio", v)?.parse::<AspectRatio>())
                .transpose()?,
            prompt: get("prompt")
                .map(|v| string_field("prompt", v))
                .transpose()?,
        },
        ToolName::Erase => ToolParams::Erase {
            object_name: match get("object_name") {
                None => return Err(InvalidField::new("object_name", "is required")),
                Some(v) => string_field("object_name", v)?,
            },
        },
    };
    let req = ToolRequest {
        image_url,
        preserve_alpha,
        params,
    };
    check_tool(&req)?;
    Ok(req)
}

fn string_field(field: &str, v: &Value) -> Result<String, InvalidField> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| InvalidField::new(field, format!("must be a string, got {v}")))
}

fn integer_field(field: &str, v: &Value) -> Result<i64, InvalidField> {
    v.as_i64()
        .ok_or_else(|| InvalidField::new(field, format!("must be an integer, got {v}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service() -> Url {
        Url::parse("http://127.0.0.1:9000/").unwrap()
    }

    #[test]
    fn prompt_limit_counts_characters_not_bytes() {
        let accented = "é".repeat(MAX_PROMPT_CHARS);
        assert!(accented.len() > MAX_PROMPT_CHARS);
        assert!(check_prompt("prompt", &accented).is_ok());
        let err = check_prompt("prompt", &format!("{accented}é")).unwrap_err();
        assert_eq!(err.field, "prompt");
    }

    #[test]
    fn references_must_be_https_unless_issued_by_the_service() {
        let ok = vec![
            "https://example.com/a.png".to_string(),
            "http://127.0.0.1:9000/files/img_1".to_string(),
        ];
        assert!(check_references(&ok, &service()).is_ok());
        let err = check_references(&["http://example.com/a.png".into()], &service()).unwrap_err();
        assert_eq!(err.field, "image_urls[0]");
        let seven = vec!["https://example.com/a.png".to_string(); 7];
        assert_eq!(
            check_references(&seven, &service()).unwrap_err().field,
            "image_urls"
        );
    }

    #[test]
    fn raw_bodies_name_the_offending_field() {
        let cases = [
            (json!({}), "prompt"),
            (json!({"prompt": 3}), "prompt"),
            (json!({"prompt": "x", "n": 5}), "n"),
            (json!({"prompt": "x", "n": "2"}), "n"),
            (json!({"prompt": "x", "size": "8K"}), "size"),
            (
                json!({"prompt": "x", "image_urls": "https://a"}),
                "image_urls",
            ),
            (json!([1]), "body"),
        ];
        for (body, field) in cases {
            assert_eq!(
                generation_from_json(&body, &service()).unwrap_err().field,
                field,
                "{body}"
            );
        }
        let tool_cases = [
            (
                ToolName::Erase,
                json!({"image_url": "https://a/b.png"}),
                "object_name",
            ),
            (
                ToolName::Erase,
                json!({"image_url": "https://a/b.png", "object_name": " "}),
                "object_name",
            ),
            (
                ToolName::Upscale,
                json!({"image_url": "https://a/b.png", "desired_increase": 3}),
                "desired_increase",
            ),
            (
                ToolName::Expand,
                json!({"image_url": "https://a/b.png", "aspect_ratio": "wide"}),
                "aspect_ratio",
            ),
            (
                ToolName::RemoveBackground,
                json!({"image_url": "b.png"}),
                "image_url",
            ),
            (
                ToolName::RemoveBackground,
                json!({"image_url": "https://a/b.png", "preserve_alpha": "yes"}),
                "preserve_alpha",
            ),
        ];
        for (tool, body, field) in tool_cases {
            assert_eq!(
                tool_from_json(tool, &body).unwrap_err().field,
                field,
                "{body}"
            );
        }
    }
}
