//! The pipeline file as written (format version 1): serde types that parse it and give its JSON
//! Schema, so the schema editors check against cannot drift from what imgpipe reads.
//!
//! These types hold what the user wrote, checked only for shape. [`super::check`] turns them
//! into a [`super::Pipeline`], where every reference, limit and template has been checked.

use std::borrow::Cow;
use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer};

use crate::pipeline::checks::OnFail;

mod checks;

pub use checks::{
    CheckSpec, CommandFullSpec, CommandSpec, DistinctSpec, NotBlankSpec, TransparentSpec,
};

/// A batch of image work: steps forming a DAG, applied to every item.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "imgpipe pipeline file, version 1")]
pub struct PipelineSpec {
    /// Format version; this imgpipe reads version 1.
    #[schemars(range(min = 1, max = 1))]
    pub version: u32,
    /// Name of the pipeline, shown in plans and reports.
    pub name: String,
    /// Where outputs go, relative to the pipeline file. Default: `out`.
    #[serde(default)]
    pub output_dir: Option<String>,
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
    #[serde(default)]
    pub pricing: Option<PricingSpec>,
    /// What automatic rerolls of outputs that failed a check may spend, inside the budget.
    /// Required when a step's checks reroll.
    #[serde(default)]
    pub rerolls: Option<RerollsSpec>,
    /// Paid calls in flight at once.
    #[serde(default)]
    #[schemars(range(min = 1, max = 256))]
    pub concurrency: Option<u32>,
    /// Paid calls per second, minute or hour: `N/s`, `N/min` or `N/h`.
    #[serde(default)]
    #[schemars(regex(pattern = r"^\s*[0-9]+\s*/\s*(s|min|h)\s*$"))]
    pub rate_limit: Option<String>,
    /// Take the outputs of a task that succeeded in an earlier run (same request, same input
    /// images) instead of paying for it again, as `--reuse` does.
    #[serde(default)]
    pub reuse: Option<bool>,
    /// Where the run posts its events (run finished, budget crossed, a call billed above the
    /// plan): an https URL, or http to 127.0.0.1. `--notify` and `IMGPIPE_NOTIFY_URL` win.
    #[serde(default)]
    pub notify: Option<String>,
    /// The items, inline. Each is a mapping of fields that templates use as `{{ item.<field> }}`;
    /// `id` (optional) names the item's output directory.
    #[serde(default)]
    pub items: Option<Vec<BTreeMap<String, ItemValue>>>,
    /// The items from a file, relative to the pipeline file: `.jsonl` (one JSON object per
    /// line) or `.csv` (a header row, then one item per row).
    #[serde(default)]
    pub items_from: Option<String>,
    #[schemars(length(min = 1))]
    pub steps: Vec<StepSpec>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    /// The most credits a run may spend.
    pub max_credits: u64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RerollsSpec {
    /// The most credits a run may spend paying again for outputs that failed a check.
    pub max_credits: u64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PricingSpec {
    /// Credits per 2K generated image (4K bills twice). The service does not publish it.
    pub generation: u64,
}

/// One step: an `id` and exactly one operation.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("oneOf" = [
    {"required": ["generate"]},
    {"required": ["erase"]},
    {"required": ["expand"]},
    {"required": ["upscale"]},
    {"required": ["remove_background"]}
]))]
pub struct StepSpec {
    /// Unique name of the step; also the stem of its output files.
    pub id: String,
    /// Run a single time for the whole batch instead of once per item.
    #[serde(default)]
    pub once: Option<bool>,
    #[serde(default)]
    pub generate: Option<GenerateSpec>,
    #[serde(default)]
    pub erase: Option<EraseSpec>,
    #[serde(default)]
    pub expand: Option<ExpandSpec>,
    #[serde(default)]
    pub upscale: Option<UpscaleSpec>,
    #[serde(default)]
    pub remove_background: Option<RemoveBackgroundSpec>,
    /// Checks of each stored output, run before any later step uses it.
    #[serde(default)]
    pub checks: Option<Vec<CheckSpec>>,
    /// What an output that fails a check does: `reroll` (the default), `flag` or `fail`.
    #[serde(default)]
    pub on_fail: Option<OnFail>,
    /// Times a task may be paid again after its output failed a check. Default 1.
    #[serde(default)]
    #[schemars(range(min = 1, max = 10))]
    pub max_rerolls: Option<u32>,
}

/// `POST /v1/images/generations`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateSpec {
    /// Up to 4000 characters after templating.
    pub prompt: String,
    /// Images per call, 1 to 4. Default 1.
    #[serde(default)]
    #[schemars(range(min = 1, max = 4))]
    pub n: Option<i64>,
    /// `2K` (default) or `4K`, which bills twice.
    #[serde(default)]
    pub size: Option<SizeSpec>,
    /// Up to 6 reference images: https URLs, or `{ from: <step> }` for all images of a step.
    #[serde(default)]
    pub image_urls: Vec<ReferenceSpec>,
}

#[derive(Clone, Copy, Debug, Deserialize, JsonSchema)]
pub enum SizeSpec {
    #[serde(rename = "2K")]
    TwoK,
    #[serde(rename = "4K")]
    FourK,
}

// Read by hand rather than as an untagged enum, so a misspelt `from` is reported as such.
#[derive(Debug, JsonSchema)]
#[serde(untagged)]
pub enum ReferenceSpec {
    /// A literal https URL (a template).
    Url(String),
    /// Every output image of another step.
    From(FromSpec),
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FromSpec {
    pub from: String,
}

impl<'de> Deserialize<'de> for ReferenceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = ReferenceSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an https URL or `{ from: <step> }`")
            }
            fn visit_str<E>(self, v: &str) -> Result<ReferenceSpec, E> {
                Ok(ReferenceSpec::Url(v.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<ReferenceSpec, A::Error> {
                let de = serde::de::value::MapAccessDeserializer::new(map);
                FromSpec::deserialize(de).map(ReferenceSpec::From)
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields every tool step has: its input, exactly one of `from` and `image_url`, and
/// `preserve_alpha`. Written out in each tool (not flattened) so unknown keys stay errors.
macro_rules! tool_spec {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* pub $field:ident : $ty:ty,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Deserialize, JsonSchema)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            /// Another step: this step runs once per output image of it.
            #[serde(default)]
            pub from: Option<String>,
            /// A public image URL (a template, e.g. `{{ item.url }}`).
            #[serde(default)]
            pub image_url: Option<String>,
            /// Keep transparency where the tool supports it. Service default: true.
            #[serde(default)]
            pub preserve_alpha: Option<bool>,
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        impl $name {
            pub fn input(&self) -> InputSpec<'_> {
                InputSpec {
                    from: self.from.as_deref(),
                    image_url: self.image_url.as_deref(),
                    preserve_alpha: self.preserve_alpha,
                }
            }
        }
    };
}

/// The input fields of any tool step.
#[derive(Clone, Copy, Debug)]
pub struct InputSpec<'a> {
    pub from: Option<&'a str>,
    pub image_url: Option<&'a str>,
    pub preserve_alpha: Option<bool>,
}

tool_spec! {
    /// `erase`: 2 credits.
    EraseSpec {
        /// What to erase (a template); must not be empty.
        pub object_name: String,
    }
}

tool_spec! {
    /// `expand`: 5 credits.
    ExpandSpec {
        /// `<width>:<height>`, e.g. `16:9`.
        #[serde(default)]
        pub aspect_ratio: Option<String>,
        /// How to extend the image (a template).
        #[serde(default)]
        pub prompt: Option<String>,
    }
}

tool_spec! {
    /// `upscale`: 2 credits for 2x, 4 for 4x.
    UpscaleSpec {
        /// 2 or 4.
        #[schemars(extend("enum" = [2, 4]))]
        pub desired_increase: i64,
    }
}

tool_spec! {
    /// `remove_background`: 5 credits.
    RemoveBackgroundSpec {}
}

/// A field of an inline item: text, a number or a boolean, used as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemValue(pub String);

impl<'de> Deserialize<'de> for ItemValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ItemValue;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E>(self, v: &str) -> Result<ItemValue, E> {
                Ok(ItemValue(v.to_owned()))
            }
            fn visit_bool<E>(self, v: bool) -> Result<ItemValue, E> {
                Ok(ItemValue(v.to_string()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<ItemValue, E> {
                Ok(ItemValue(v.to_string()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<ItemValue, E> {
                Ok(ItemValue(v.to_string()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<ItemValue, E> {
                Ok(ItemValue(v.to_string()))
            }
        }
        d.deserialize_str(V)
    }
}

impl JsonSchema for ItemValue {
    fn schema_name() -> Cow<'static, str> {
        "ItemValue".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": ["string", "number", "boolean"] })
    }
}

/// The JSON Schema of the format, as `imgpipe schema` prints it.
pub fn json_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(PipelineSpec)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn schema_has_the_operations_and_their_fields() {
        let schema = super::json_schema();
        let text = schema.to_string();
        for needle in [
            "remove_background",
            "desired_increase",
            "items_from",
            "oneOf",
        ] {
            assert!(text.contains(needle), "{needle} missing from {text}");
        }
    }
}
