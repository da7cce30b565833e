//! A step's `checks:` as written: each entry a check's name (`- not_blank`) or a mapping of one
//! name to its settings (`- transparent: { min: 0.05 }`). Read by hand, like references, so an
//! unknown check is reported as one, with the closest name.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::{self, Error as _, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::pipeline::checks::CHECK_NAMES;
use crate::pipeline::de::suggestion;

/// One entry of `checks:`.
#[derive(Debug)]
pub enum CheckSpec {
    NotBlank(NotBlankSpec),
    Size,
    Transparent(TransparentSpec),
    Distinct(DistinctSpec),
    Command(CommandSpec),
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NotBlankSpec {
    /// The least standard deviation of luma (0 to 255) an image must have. Default 2.
    #[serde(default)]
    pub min_stddev: Option<f64>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TransparentSpec {
    /// The least share (0 to 1) of pixels with alpha below 255. Default 0.01.
    #[serde(default)]
    pub min: Option<f64>,
    /// The largest share (0 to 1) of pixels with alpha below 255. Default 0.99.
    #[serde(default)]
    pub max: Option<f64>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DistinctSpec {
    /// The least number of bits (1 to 64) two images' perceptual hashes differ by. Default 2.
    #[serde(default)]
    pub min_distance: Option<u32>,
}

/// `size` takes no settings; `size: {}` and `size:` are the bare name.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NoSettings {}

/// A command check: its argv, or a mapping with the argv and a timeout.
#[derive(Debug, JsonSchema)]
#[serde(untagged)]
pub enum CommandSpec {
    /// The program and its arguments, one of them holding `{file}`.
    Argv(Vec<String>),
    Full(CommandFullSpec),
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandFullSpec {
    /// The program and its arguments, one of them holding `{file}`.
    pub argv: Vec<String>,
    /// Seconds to wait for a verdict (1 to 3600). Default 60.
    #[serde(default)]
    pub timeout: Option<u64>,
}

impl CommandSpec {
    pub fn argv(&self) -> &[String] {
        match self {
            CommandSpec::Argv(argv) | CommandSpec::Full(CommandFullSpec { argv, .. }) => argv,
        }
    }

    pub fn timeout(&self) -> Option<u64> {
        match self {
            CommandSpec::Argv(_) => None,
            CommandSpec::Full(full) => full.timeout,
        }
    }
}

fn unknown_check(name: &str) -> String {
    format!("unknown check `{name}`{}", suggestion(name, &CHECK_NAMES))
}

impl<'de> Deserialize<'de> for CheckSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CheckSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a check's name, or a mapping of one check's name to its settings")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<CheckSpec, E> {
                match name {
                    "not_blank" => Ok(CheckSpec::NotBlank(NotBlankSpec::default())),
                    "size" => Ok(CheckSpec::Size),
                    "transparent" => Ok(CheckSpec::Transparent(TransparentSpec::default())),
                    "distinct" => Ok(CheckSpec::Distinct(DistinctSpec::default())),
                    "command" => Err(E::custom(
                        "`command` needs its program and arguments, e.g. `command: [\"python3\", \"score.py\", \"{file}\"]`",
                    )),
                    other => Err(E::custom(unknown_check(other))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<CheckSpec, A::Error> {
                let Some(name) = map.next_key::<String>()? else {
                    return Err(A::Error::custom(
                        "an empty mapping is no check; write a check's name",
                    ));
                };
                let check = match name.as_str() {
                    "not_blank" => CheckSpec::NotBlank(settings(&mut map)?),
                    "size" => settings::<_, NoSettings>(&mut map).map(|_| CheckSpec::Size)?,
                    "transparent" => CheckSpec::Transparent(settings(&mut map)?),
                    "distinct" => CheckSpec::Distinct(settings(&mut map)?),
                    "command" => CheckSpec::Command(map.next_value()?),
                    other => return Err(A::Error::custom(unknown_check(other))),
                };
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(A::Error::custom(format!(
                        "one check per entry: `{extra}` follows `{name}`; give it its own `- {extra}` line"
                    )));
                }
                Ok(check)
            }
        }
        d.deserialize_any(V)
    }
}

/// A check's settings, or its defaults when the value is empty.
fn settings<'de, A: MapAccess<'de>, T: Deserialize<'de> + Default>(
    map: &mut A,
) -> Result<T, A::Error> {
    Ok(map.next_value::<Option<T>>()?.unwrap_or_default())
}

impl<'de> Deserialize<'de> for CommandSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CommandSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of the program and its arguments, or `{ argv: [...], timeout: <seconds> }`")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<CommandSpec, A::Error> {
                let de = de::value::SeqAccessDeserializer::new(seq);
                Vec::<String>::deserialize(de).map(CommandSpec::Argv)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<CommandSpec, A::Error> {
                let de = de::value::MapAccessDeserializer::new(map);
                CommandFullSpec::deserialize(de).map(CommandSpec::Full)
            }
        }
        d.deserialize_any(V)
    }
}

impl JsonSchema for CheckSpec {
    fn schema_name() -> Cow<'static, str> {
        "CheckSpec".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let not_blank = generator.subschema_for::<Option<NotBlankSpec>>();
        let size = generator.subschema_for::<Option<NoSettings>>();
        let transparent = generator.subschema_for::<Option<TransparentSpec>>();
        let distinct = generator.subschema_for::<Option<DistinctSpec>>();
        let command = generator.subschema_for::<CommandSpec>();
        json_schema!({
            "description": "A check of each stored output: its name, or one name mapped to its settings.",
            "oneOf": [
                { "enum": ["not_blank", "size", "transparent", "distinct"] },
                {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 1,
                    "additionalProperties": false,
                    "properties": {
                        "not_blank": not_blank,
                        "size": size,
                        "transparent": transparent,
                        "distinct": distinct,
                        "command": command
                    }
                }
            ]
        })
    }
}
