//! Wire types of the service, shared by the client and the sandbox so the two cannot drift apart.
//!
//! Requests are typed so that the spec's closed sets (sizes, tools, upscale factors) cannot hold
//! anything else; the open rules (prompt length, URL count, ...) live in the rules module beside
//! this one, which answers with an [`InvalidField`].
//! Responses are typed only for the documented fields and ignore anything extra.

use std::fmt;
use std::str::FromStr;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::api::job_id::JobId;

/// A request field that breaks a rule of the spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidField {
    pub field: String,
    pub message: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidField {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for InvalidField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for InvalidField {}

/// Output size of a generation. A 4K request bills twice a 2K one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Size {
    #[default]
    #[serde(rename = "2K")]
    TwoK,
    #[serde(rename = "4K")]
    FourK,
}

impl Size {
    /// How many times the 2K price this size bills.
    pub fn price_multiplier(self) -> u64 {
        match self {
            Size::TwoK => 1,
            Size::FourK => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Size::TwoK => "2K",
            Size::FourK => "4K",
        }
    }
}

impl FromStr for Size {
    type Err = InvalidField;
    fn from_str(s: &str) -> Result<Self, InvalidField> {
        match s {
            "2K" => Ok(Size::TwoK),
            "4K" => Ok(Size::FourK),
            other => Err(InvalidField::new(
                "size",
                format!("must be 2K or 4K, got {other:?}"),
            )),
        }
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The four editing tools, each at a fixed price.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolName {
    RemoveBackground,
    Upscale,
    Expand,
    Erase,
}

impl ToolName {
    pub const ALL: [ToolName; 4] = [
        ToolName::RemoveBackground,
        ToolName::Upscale,
        ToolName::Expand,
        ToolName::Erase,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ToolName::RemoveBackground => "remove_background",
            ToolName::Upscale => "upscale",
            ToolName::Expand => "expand",
            ToolName::Erase => "erase",
        }
    }
}

impl FromStr for ToolName {
    type Err = InvalidField;
    fn from_str(s: &str) -> Result<Self, InvalidField> {
        ToolName::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| {
                InvalidField::new(
                    "tool",
                    format!(
                        "unknown tool {s:?}; expected remove_background, upscale, expand or erase"
                    ),
                )
            })
    }
}

impl fmt::Display for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Upscale factor: the spec allows exactly 2 and 4, priced 2 and 4 credits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Increase {
    X2,
    X4,
}

impl Increase {
    pub fn factor(self) -> u32 {
        match self {
            Increase::X2 => 2,
            Increase::X4 => 4,
        }
    }

    pub fn from_factor(factor: i64) -> Result<Self, InvalidField> {
        match factor {
            2 => Ok(Increase::X2),
            4 => Ok(Increase::X4),
            other => Err(InvalidField::new(
                "desired_increase",
                format!("must be 2 or 4, got {other}"),
            )),
        }
    }
}

impl FromStr for Increase {
    type Err = InvalidField;
    fn from_str(s: &str) -> Result<Self, InvalidField> {
        let n = s.trim().parse::<i64>().map_err(|_| {
            InvalidField::new("desired_increase", format!("must be 2 or 4, got {s:?}"))
        })?;
        Increase::from_factor(n)
    }
}

/// An aspect ratio written `<width>:<height>`, both positive integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AspectRatio {
    width: u32,
    height: u32,
}

impl AspectRatio {
    pub fn width(self) -> u32 {
        self.width
    }
    pub fn height(self) -> u32 {
        self.height
    }
}

impl FromStr for AspectRatio {
    type Err = InvalidField;
    fn from_str(s: &str) -> Result<Self, InvalidField> {
        let bad = || {
            InvalidField::new(
                "aspect_ratio",
                format!(
                    "must be written <width>:<height> with positive integers, e.g. 16:9, got {s:?}"
                ),
            )
        };
        let (w, h) = s.split_once(':').ok_or_else(bad)?;
        let parse = |part: &str| {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            part.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(bad)
        };
        Ok(AspectRatio {
            width: parse(w)?,
            height: parse(h)?,
        })
    }
}

impl fmt::Display for AspectRatio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.width, self.height)
    }
}

/// Body of `POST /v1/images/generations`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationRequest {
    pub prompt: String,
    pub n: u8,
    pub size: Size,
    /// Reference images: user-written https URLs or URLs the service issued.
    pub image_urls: Vec<String>,
}

impl GenerationRequest {
    pub fn new(prompt: impl Into<String>) -> Self {
        GenerationRequest {
            prompt: prompt.into(),
            n: 1,
            size: Size::TwoK,
            image_urls: Vec::new(),
        }
    }

    pub fn to_body(&self) -> Value {
        let mut body = self.params();
        if !self.image_urls.is_empty() {
            body.insert("image_urls".into(), self.image_urls.clone().into());
        }
        Value::Object(body)
    }

    /// The body without its image URLs: what the task asks, whatever its inputs' URLs are.
    pub fn params(&self) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("prompt".into(), self.prompt.clone().into());
        body.insert("n".into(), self.n.into());
        body.insert("size".into(), self.size.as_str().into());
        body
    }
}

/// The spec's fixed price of a tool call, in credits; `increase` matters only to upscale.
pub fn tool_price(tool: ToolName, increase: Increase) -> u64 {
    match tool {
        ToolName::RemoveBackground | ToolName::Expand => 5,
        ToolName::Upscale => u64::from(increase.factor()),
        ToolName::Erase => 2,
    }
}

/// Parameters that differ per tool; the common fields live in [`ToolRequest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolParams {
    RemoveBackground,
    Upscale {
        desired_increase: Increase,
    },
    Expand {
        aspect_ratio: Option<AspectRatio>,
        prompt: Option<String>,
    },
    Erase {
        object_name: String,
    },
}

impl ToolParams {
    pub fn tool(&self) -> ToolName {
        match self {
            ToolParams::RemoveBackground => ToolName::RemoveBackground,
            ToolParams::Upscale { .. } => ToolName::Upscale,
            ToolParams::Expand { .. } => ToolName::Expand,
            ToolParams::Erase { .. } => ToolName::Erase,
        }
    }

    /// The spec's fixed price of this call, in credits.
    pub fn credits(&self) -> u64 {
        match self {
            ToolParams::Upscale { desired_increase } => tool_price(self.tool(), *desired_increase),
            _ => tool_price(self.tool(), Increase::X2),
        }
    }
}

/// Body of `POST /v1/images/tools/{tool}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolRequest {
    pub image_url: String,
    /// `None` leaves the service's default (true) in force.
    pub preserve_alpha: Option<bool>,
    pub params: ToolParams,
}

impl ToolRequest {
    pub fn new(image_url: impl Into<String>, params: ToolParams) -> Self {
        ToolRequest {
            image_url: image_url.into(),
            preserve_alpha: None,
            params,
        }
    }

    pub fn tool(&self) -> ToolName {
        self.params.tool()
    }

    pub fn to_body(&self) -> Value {
        let mut body = self.params();
        body.insert("image_url".into(), self.image_url.clone().into());
        Value::Object(body)
    }

    /// The body without its image URL: what the task asks, whatever its input's URL is.
    pub fn params(&self) -> Map<String, Value> {
        let mut body = Map::new();
        if let Some(keep) = self.preserve_alpha {
            body.insert("preserve_alpha".into(), keep.into());
        }
        match &self.params {
            ToolParams::RemoveBackground => {}
            ToolParams::Upscale { desired_increase } => {
                body.insert("desired_increase".into(), desired_increase.factor().into());
            }
            ToolParams::Expand {
                aspect_ratio,
                prompt,
            } => {
                if let Some(ratio) = aspect_ratio {
                    body.insert("aspect_ratio".into(), ratio.to_string().into());
                }
                if let Some(prompt) = prompt {
                    body.insert("prompt".into(), prompt.clone().into());
                }
            }
            ToolParams::Erase { object_name } => {
                body.insert("object_name".into(), object_name.clone().into());
            }
        }
        body
    }
}

/// One generated image as the service lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageUrl {
    pub url: String,
}

/// Response of `POST /v1/images/generations` (spec 2.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationJob {
    pub id: JobId,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(deserialize_with = "whole_credits")]
    pub credits_used: u64,
    #[serde(
        default,
        deserialize_with = "whole_balance",
        skip_serializing_if = "Option::is_none"
    )]
    pub credits_remaining: Option<i64>,
    pub images: Vec<ImageUrl>,
}

/// Response of `POST /v1/images/tools/{tool}` (spec 2.2). The spec documents no
/// `credits_remaining` here; it is read when a service sends it anyway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolJob {
    pub id: JobId,
    pub status: String,
    pub tool: String,
    #[serde(deserialize_with = "whole_credits")]
    pub credits_used: u64,
    #[serde(
        default,
        deserialize_with = "whole_balance",
        skip_serializing_if = "Option::is_none"
    )]
    pub credits_remaining: Option<i64>,
    pub data: ImageUrl,
}

/// Credits written as an integer or as a whole float (`4.0`): JSON encoders differ, and a
/// paid answer must not be lost over the spelling of a number.
fn whole_credits<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let n = serde_json::Number::deserialize(d)?;
    n.as_u64()
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && (0.0..9.0e15).contains(f))
                .map(|f| f as u64)
        })
        .ok_or_else(|| D::Error::custom(format!("expected a whole number of credits, got {n}")))
}

fn whole_balance<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    n.as_i64()
        .or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                .map(|f| f as i64)
        })
        .map(Some)
        .ok_or_else(|| D::Error::custom(format!("expected a whole number of credits, got {n}")))
}

/// The only status the spec shows; anything else is reported, never assumed to be success.
pub const STATUS_SUCCEEDED: &str = "succeeded";

/// Error body the sandbox sends. The real service's error shape is not shown, so the client
/// only ever reads it opportunistically.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aspect_ratio_accepts_only_positive_integers() {
        assert_eq!("16:9".parse::<AspectRatio>().unwrap().to_string(), "16:9");
        for bad in [
            "16x9", "0:1", "1:0", "-1:2", "1.5:1", ":", "16:", "a:b", " 1:1", "1:1:1",
        ] {
            let err = bad.parse::<AspectRatio>().unwrap_err();
            assert_eq!(err.field, "aspect_ratio", "{bad}");
        }
    }

    #[test]
    fn credits_may_be_written_as_whole_floats_but_not_fractions() {
        let job: GenerationJob = serde_json::from_value(serde_json::json!({
            "id": "job_1", "status": "succeeded", "credits_used": 4.0,
            "credits_remaining": 96.0, "images": [], "extra": true
        }))
        .unwrap();
        assert_eq!((job.credits_used, job.credits_remaining), (4, Some(96)));
        let bad = serde_json::from_value::<ToolJob>(serde_json::json!({
            "id": "job_1", "status": "succeeded", "tool": "erase", "credits_used": 2.5,
            "data": {"url": "u"}
        }));
        assert!(bad.unwrap_err().to_string().contains("whole number"));
    }

    #[test]
    fn tool_body_carries_only_its_fields() {
        let req = ToolRequest::new(
            "https://x/y.png",
            ToolParams::Upscale {
                desired_increase: Increase::X4,
            },
        );
        assert_eq!(
            req.to_body(),
            serde_json::json!({"image_url": "https://x/y.png", "desired_increase": 4})
        );
        assert_eq!(req.params.credits(), 4);
    }
}
