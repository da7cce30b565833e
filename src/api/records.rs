//! Records whose shape the spec does not show: the account, the models list and a past job.
//!
//! They are kept as JSON. Accessors look where a plausible field would hold a value, say where
//! they found it, accept an exact JSON pointer from the user when it is elsewhere, and when it
//! cannot be found say so and list what was received. They never invent a value.

use std::fmt;

use serde_json::Value;

/// A value read from an undocumented record, with the JSON pointer it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Found<T> {
    pub value: T,
    pub pointer: String,
}

/// A value that is not where it was looked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct NotFound {
    pub record: &'static str,
    pub what: &'static str,
    /// The pointer the user named, when one was.
    pub pointer: Option<String>,
    pub detail: Option<String>,
    pub keys: Vec<String>,
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.pointer {
            Some(p) => write!(f, "the {} record has no {} at {p}", self.record, self.what)?,
            None => write!(
                f,
                "cannot find the {} in the {} record",
                self.what, self.record
            )?,
        }
        if let Some(detail) = &self.detail {
            write!(f, " ({detail})")?;
        }
        write!(f, "; top-level keys received: [{}]", self.keys.join(", "))
    }
}

const BALANCE_POINTERS: &[&str] = &[
    "/credits_remaining",
    "/credit_balance",
    "/credits_balance",
    "/balance",
    "/credits",
    "/remaining_credits",
    "/available_credits",
    "/credits/balance",
    "/credits/remaining",
    "/credits/available",
    "/balance/credits",
    "/account/credits_remaining",
    "/account/credits",
    "/account/balance",
    "/data/credits_remaining",
    "/data/credits",
    "/data/balance",
];
const PLAN_POINTERS: &[&str] = &[
    "/plan",
    "/plan/name",
    "/plan/id",
    "/account/plan",
    "/data/plan",
];
const LIMITS_POINTERS: &[&str] = &["/limits", "/rate_limits", "/account/limits", "/data/limits"];
/// Only keys that say "per image": a bare `price` or `credits` may be per call, or a tool's.
const PRICE_KEYS: &[&str] = &["credits_per_image", "price_per_image"];
const CONCURRENCY_KEYS: &[&str] = &[
    "max_concurrency",
    "concurrency",
    "concurrent_requests",
    "max_concurrent_requests",
    "max_in_flight",
];
/// Rate keys with the number of seconds their value is counted over.
const RATE_KEYS: &[(&str, f64)] = &[
    ("requests_per_second", 1.0),
    ("rate_per_second", 1.0),
    ("requests_per_minute", 60.0),
    ("rpm", 60.0),
    ("requests_per_hour", 3600.0),
];

/// `GET /v1/account`: plan, balance and limits, in a shape the spec does not show.
#[derive(Clone, Debug, PartialEq)]
pub struct Account {
    raw: Value,
}

impl Account {
    pub fn new(raw: Value) -> Self {
        Account { raw }
    }

    pub fn raw(&self) -> &Value {
        &self.raw
    }

    /// Finds a value at `pointer` when the user named one, else at the first plausible place
    /// where `read` accepts what it finds.
    fn locate<'a, T>(
        &'a self,
        what: &'static str,
        pointer: Option<&str>,
        candidates: &[&str],
        expected: &str,
        read: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Found<T>, NotFound> {
        let not_found = |pointer: Option<&str>, detail: Option<String>| NotFound {
            record: "account",
            what,
            pointer: pointer.map(str::to_owned),
            detail,
            keys: top_level_keys(&self.raw),
        };
        if let Some(p) = pointer {
            let value = self
                .raw
                .pointer(p)
                .ok_or_else(|| not_found(Some(p), None))?;
            return read(value)
                .map(|value| Found {
                    value,
                    pointer: p.to_owned(),
                })
                .ok_or_else(|| not_found(Some(p), Some(format!("found {value}, not {expected}"))));
        }
        candidates
            .iter()
            .find_map(|p| {
                let value = read(self.raw.pointer(p)?)?;
                Some(Found {
                    value,
                    pointer: (*p).to_owned(),
                })
            })
            .ok_or_else(|| not_found(None, None))
    }

    /// The credit balance, at `pointer` when the user named one, else at a plausible field.
    pub fn balance(&self, pointer: Option<&str>) -> Result<Found<i64>, NotFound> {
        self.locate(
            "credit balance",
            pointer,
            BALANCE_POINTERS,
            "a whole number",
            as_integer,
        )
    }

    pub fn plan(&self, pointer: Option<&str>) -> Result<Found<String>, NotFound> {
        self.locate("plan", pointer, PLAN_POINTERS, "a string", |v| {
            v.as_str().map(str::to_owned)
        })
    }

    pub fn limits(&self, pointer: Option<&str>) -> Result<Found<&Value>, NotFound> {
        self.locate("limits", pointer, LIMITS_POINTERS, "an object", |v| {
            v.is_object().then_some(v)
        })
    }

    /// Requests in flight the account allows, when its limits say so.
    pub fn max_concurrency(&self, limits: Option<&str>) -> Option<Found<u64>> {
        let limits = self.limits(limits).ok()?;
        CONCURRENCY_KEYS.iter().find_map(|k| {
            let value = limits.value.get(*k)?.as_u64().filter(|n| *n > 0)?;
            Some(Found {
                value,
                pointer: format!("{}/{k}", limits.pointer),
            })
        })
    }

    /// Requests per second the account allows, when its limits say so.
    pub fn requests_per_second(&self, limits: Option<&str>) -> Option<Found<f64>> {
        let limits = self.limits(limits).ok()?;
        RATE_KEYS.iter().find_map(|(k, per)| {
            let n = limits.value.get(*k)?.as_f64().filter(|n| *n > 0.0)?;
            Some(Found {
                value: n / per,
                pointer: format!("{}/{k}", limits.pointer),
            })
        })
    }
}

/// `GET /v1/models`: models and tools, in a shape the spec does not show.
#[derive(Clone, Debug, PartialEq)]
pub struct Models {
    raw: Value,
}

impl Models {
    pub fn new(raw: Value) -> Self {
        Models { raw }
    }

    pub fn raw(&self) -> &Value {
        &self.raw
    }

    fn entries(&self, names: &[&str]) -> Option<(&'static str, &Vec<Value>)> {
        ["/models", "/data", "/tools"]
            .into_iter()
            .filter(|p| names.contains(p))
            .find_map(|p| Some((p, self.raw.pointer(p)?.as_array()?)))
    }

    pub fn model_ids(&self) -> Vec<String> {
        let Some((_, items)) = self.entries(&["/models", "/data"]) else {
            return Vec::new();
        };
        items
            .iter()
            .filter_map(|v| entry_name(v, &["id", "name"]))
            .collect()
    }

    pub fn tool_names(&self) -> Vec<String> {
        let Some((_, items)) = self.entries(&["/tools"]) else {
            return Vec::new();
        };
        items
            .iter()
            .filter_map(|v| entry_name(v, &["name", "id"]))
            .collect()
    }

    /// Every per-image generation price that a model entry states (tool entries excluded).
    pub fn generation_prices(&self) -> Vec<Found<u64>> {
        let Some((base, items)) = self.entries(&["/models", "/data"]) else {
            return Vec::new();
        };
        let is_tool = |item: &Value| {
            entry_name(item, &["id", "name"]).is_some_and(|n| {
                crate::api::types::ToolName::ALL
                    .iter()
                    .any(|t| t.as_str() == n)
            })
        };
        items
            .iter()
            .enumerate()
            .filter(|(_, item)| !is_tool(item))
            .filter_map(|(i, item)| {
                PRICE_KEYS.iter().find_map(|k| {
                    let value = item.get(*k)?.as_u64()?;
                    Some(Found {
                        value,
                        pointer: format!("{base}/{i}/{k}"),
                    })
                })
            })
            .collect()
    }

    /// The generation price per 2K image, when the models that state one all agree on it.
    pub fn generation_price(&self) -> Option<Found<u64>> {
        let prices = self.generation_prices();
        let first = prices.first()?;
        prices
            .iter()
            .all(|p| p.value == first.value)
            .then(|| first.clone())
    }
}

/// `GET /v1/jobs/{id}`: a past job, in a shape the spec does not show. The sandbox answers with
/// the shape of the original call; image URLs are looked for in both documented shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    raw: Value,
}

impl JobRecord {
    pub fn new(raw: Value) -> Self {
        JobRecord { raw }
    }

    pub fn raw(&self) -> &Value {
        &self.raw
    }

    pub fn id(&self) -> Option<&str> {
        self.raw.get("id")?.as_str()
    }

    pub fn status(&self) -> Option<&str> {
        self.raw.get("status")?.as_str()
    }

    pub fn credits_used(&self) -> Option<u64> {
        as_integer(self.raw.get("credits_used")?).and_then(|n| u64::try_from(n).ok())
    }

    /// Result URLs in output order, whichever documented shape holds them.
    pub fn image_urls(&self) -> Vec<String> {
        let url_of = |v: &Value| v.get("url")?.as_str().map(str::to_owned);
        if let Some(images) = self.raw.get("images").and_then(Value::as_array) {
            return images.iter().filter_map(url_of).collect();
        }
        match self.raw.get("data") {
            Some(Value::Array(items)) => items.iter().filter_map(url_of).collect(),
            Some(data) => url_of(data).into_iter().collect(),
            None => url_of(&self.raw).into_iter().collect(),
        }
    }
}

fn as_integer(v: &Value) -> Option<i64> {
    v.as_i64()
        .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
}

fn entry_name(v: &Value, keys: &[&str]) -> Option<String> {
    if let Some(s) = v.as_str() {
        return Some(s.to_owned());
    }
    keys.iter()
        .find_map(|k| v.get(*k)?.as_str().map(str::to_owned))
}

fn top_level_keys(v: &Value) -> Vec<String> {
    match v {
        Value::Object(map) => map.keys().cloned().collect(),
        other => vec![format!("(not an object: {other})")],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn balance_is_found_in_plausible_places_or_where_named() {
        let flat = Account::new(json!({"credits_remaining": 120}));
        assert_eq!(flat.balance(None).unwrap().value, 120);
        let nested = Account::new(json!({"credits": {"balance": 7.0}}));
        let found = nested.balance(None).unwrap();
        assert_eq!(
            (found.value, found.pointer.as_str()),
            (7, "/credits/balance")
        );
        let odd = Account::new(json!({"wallet": {"units": 42}, "plan": "pro"}));
        let err = odd.balance(None).unwrap_err();
        assert!(
            err.to_string().contains("[wallet, plan]")
                || err.to_string().contains("[plan, wallet]")
        );
        assert_eq!(odd.balance(Some("/wallet/units")).unwrap().value, 42);
        let err = odd.balance(Some("/plan")).unwrap_err().to_string();
        assert!(err.contains("not a whole number"), "{err}");
        assert_eq!(odd.plan(None).unwrap().value, "pro");
        let tier = Account::new(json!({"subscription": {"tier": "pro"}, "quota": {"rpm": 60}}));
        assert!(
            tier.plan(None)
                .unwrap_err()
                .to_string()
                .contains("[quota, subscription]")
        );
        assert_eq!(tier.plan(Some("/subscription/tier")).unwrap().value, "pro");
        assert_eq!(tier.requests_per_second(Some("/quota")).unwrap().value, 1.0);
    }

    #[test]
    fn limits_are_read_when_present() {
        let acct =
            Account::new(json!({"limits": {"requests_per_minute": 120, "max_concurrency": 8}}));
        assert_eq!(acct.requests_per_second(None).unwrap().value, 2.0);
        assert_eq!(acct.max_concurrency(None).unwrap().value, 8);
        assert!(Account::new(json!({})).requests_per_second(None).is_none());
    }

    #[test]
    fn models_and_job_records_are_read_tolerantly() {
        let models = Models::new(
            json!({"data": [{"id": "m1", "credits_per_image": 3}], "tools": ["erase"]}),
        );
        assert_eq!(models.model_ids(), ["m1"]);
        assert_eq!(models.tool_names(), ["erase"]);
        assert_eq!(
            models.generation_price().unwrap().pointer,
            "/data/0/credits_per_image"
        );
        let gen_job =
            JobRecord::new(json!({"id": "job_1", "images": [{"url": "u1"}, {"url": "u2"}]}));
        assert_eq!(gen_job.image_urls(), ["u1", "u2"]);
        let tool_job =
            JobRecord::new(json!({"id": "job_2", "data": {"url": "u3"}, "credits_used": 4.0}));
        assert_eq!(tool_job.image_urls(), ["u3"]);
        assert_eq!(tool_job.credits_used(), Some(4));
        assert_eq!(
            JobRecord::new(json!({"credits_used": -1})).credits_used(),
            None
        );
    }
}
