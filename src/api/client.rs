//! The HTTP client: one method per endpoint of the service.
//!
//! Every request is checked against the spec's rules before it is sent, carries the key in
//! `X-API-Key` (marked sensitive, never logged), and fails with an [`ApiError`] that says what
//! the failure means for billing.

use std::time::Duration;

use reqwest::header::{HeaderValue, RETRY_AFTER};
use reqwest::{Method, redirect};
use serde::de::DeserializeOwned;
use serde_json::Value;
use url::Url;

use crate::api::error::{ApiError, ErrorKind, excerpt};
use crate::api::job_id::{JobId, is_job_id};
use crate::api::key::ApiKey;
use crate::api::partial::job_id_in;
use crate::api::records::{Account, JobRecord, Models};
use crate::api::retry::parse_retry_after;
use crate::api::rules::{self, InvalidField};
use crate::api::types::{GenerationJob, GenerationRequest, ToolJob, ToolRequest};

/// Generous by default: image calls are synchronous and a 4K generation can take a while.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the service is and how to talk to it.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub base_url: Url,
    pub key: ApiKey,
    pub connect_timeout: Duration,
    pub timeout: Duration,
}

impl ClientConfig {
    /// Checks the base URL: http(s) only, and plain http only to a loopback host, since the key
    /// would otherwise cross the network in clear text.
    pub fn new(base_url: &str, key: ApiKey) -> Result<Self, InvalidField> {
        let mut url = rules::parse_absolute("base_url", base_url)?;
        if url.scheme() == "http" && !is_loopback(&url) {
            return Err(InvalidField::new(
                "base_url",
                format!(
                    "{base_url} is plain http to a non-loopback host; the API key would travel unencrypted, use https"
                ),
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(InvalidField::new(
                "base_url",
                "must not carry a query or fragment",
            ));
        }
        if !url.path().ends_with('/') {
            let path = format!("{}/", url.path());
            url.set_path(&path);
        }
        Ok(ClientConfig {
            base_url: url,
            key,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            timeout: DEFAULT_TIMEOUT,
        })
    }
}

pub(crate) fn is_loopback(url: &Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost",
        None => false,
    }
}

#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    key: ApiKey,
}

impl Client {
    pub fn new(config: ClientConfig) -> Result<Self, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("imgpipe/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(config.connect_timeout)
            .timeout(config.timeout)
            // A redirect would carry X-API-Key to wherever it points: never follow one.
            .redirect(redirect::Policy::none());
        if is_loopback(&config.base_url) {
            // A proxy from the environment must not see a local sandbox's traffic or key.
            builder = builder.no_proxy();
        }
        let http = builder.build()?;
        Ok(Client {
            http,
            base: config.base_url,
            key: config.key,
        })
    }

    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The account the client spends on, as the state database names it (never the key).
    pub fn account_digest(&self) -> String {
        self.key.account_digest(self.base.as_str())
    }

    /// Scrubs the key from text about to be shown: records may echo what they were sent.
    pub fn redact(&self, text: &str) -> String {
        self.key.redact(text)
    }

    /// Generates images. The request is checked first; an invalid one is never sent.
    pub async fn generate(&self, req: &GenerationRequest) -> Result<GenerationJob, ApiError> {
        rules::check_generation(req, &self.base)?;
        let value = self
            .call(Method::POST, "v1/images/generations", Some(&req.to_body()))
            .await?;
        self.typed(value, "POST /v1/images/generations")
    }

    /// Edits an image with one of the four tools.
    pub async fn tool(&self, req: &ToolRequest) -> Result<ToolJob, ApiError> {
        rules::check_tool(req)?;
        let path = format!("v1/images/tools/{}", req.tool());
        let value = self.call(Method::POST, &path, Some(&req.to_body())).await?;
        self.typed(value, &format!("POST /{path}"))
    }

    /// A past job, with freshly signed result URLs.
    pub async fn job(&self, id: &JobId) -> Result<JobRecord, ApiError> {
        if !is_job_id(id) {
            return Err(InvalidField::new(
                "job id",
                format!(
                    "{:?} is not a job id (expected something like job_abc123)",
                    id.as_str()
                ),
            )
            .into());
        }
        let value = self
            .call(Method::GET, &format!("v1/jobs/{id}"), None)
            .await?;
        Ok(JobRecord::new(value))
    }

    pub async fn account(&self) -> Result<Account, ApiError> {
        Ok(Account::new(
            self.call(Method::GET, "v1/account", None).await?,
        ))
    }

    pub async fn models(&self) -> Result<Models, ApiError> {
        Ok(Models::new(
            self.call(Method::GET, "v1/models", None).await?,
        ))
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let endpoint = format!("{method} /{path}");
        let paid = method == Method::POST;
        let url = self.base.join(path).map_err(|e| ApiError::NotSent {
            endpoint: endpoint.clone(),
            reason: format!("cannot build the URL: {e}"),
        })?;
        let mut key = HeaderValue::from_str(self.key.expose()).map_err(|_| ApiError::NotSent {
            endpoint: endpoint.clone(),
            reason: "the API key cannot be sent as a header".into(),
        })?;
        key.set_sensitive(true);
        let mut request = self.http.request(method, url).header("X-API-Key", key);
        if let Some(body) = body {
            request = request.json(body);
        }
        tracing::debug!(%endpoint, "request");
        let response = request
            .send()
            .await
            .map_err(|e| self.transport_error(&endpoint, e))?;
        self.answer(endpoint, paid, response).await
    }

    /// Reads a response: an error status is an answered error (a gateway's on a paid call is
    /// ambiguous instead), a success must carry JSON.
    async fn answer(
        &self,
        endpoint: String,
        paid: bool,
        response: reqwest::Response,
    ) -> Result<Value, ApiError> {
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let bytes = read_body(response).await;
        tracing::debug!(%endpoint, status = status.as_u16(), "response");
        if paid && matches!(status.as_u16(), 502 | 504) {
            return Err(ApiError::Ambiguous {
                endpoint,
                reason: format!(
                    "HTTP {status} from a gateway, which gave up waiting; the service behind it may still have done the work"
                ),
                job_id: None,
            });
        }
        let text = |bytes: &[u8]| excerpt(&self.key.redact(&String::from_utf8_lossy(bytes)));
        if !status.is_success() {
            return Err(ApiError::Answered {
                endpoint,
                status: status.as_u16(),
                kind: ErrorKind::from_status(status.as_u16()),
                retry_after,
                body: bytes.map_or_else(
                    |_| "(the error body could not be read)".into(),
                    |b| text(&b),
                ),
            });
        }
        let bytes = bytes.map_err(|(start, e)| self.cut_answer(&endpoint, &start, e))?;
        serde_json::from_slice(&bytes).map_err(|e| ApiError::Ambiguous {
            endpoint,
            reason: format!(
                "HTTP {status} with a body that is not JSON ({e}): {}",
                text(&bytes)
            ),
            // A body cut short on a connection closed in good order looks whole.
            job_id: job_id_in(&bytes),
        })
    }

    /// A success body missing documented fields: the call went through and may have been
    /// billed. The job id, when there is one, is kept so the images can still be fetched.
    fn typed<T: DeserializeOwned>(&self, value: Value, endpoint: &str) -> Result<T, ApiError> {
        let job_id = value
            .get("id")
            .and_then(Value::as_str)
            .filter(|id| is_job_id(id))
            .map(JobId::from);
        serde_json::from_value(value).map_err(|e| ApiError::Ambiguous {
            endpoint: endpoint.to_owned(),
            reason: self
                .key
                .redact(&format!("the answer lacks documented fields ({e})")),
            job_id,
        })
    }

    /// A success whose body stopped short: ambiguous, naming the job when its start did.
    fn cut_answer(&self, endpoint: &str, start: &[u8], e: reqwest::Error) -> ApiError {
        match self.transport_error(endpoint, e) {
            ApiError::Ambiguous {
                endpoint, reason, ..
            } => ApiError::Ambiguous {
                endpoint,
                reason: format!("the answer was cut after {} bytes: {reason}", start.len()),
                job_id: job_id_in(start),
            },
            other => other,
        }
    }

    /// A connect failure never reached the server; anything later may have been processed.
    fn transport_error(&self, endpoint: &str, e: reqwest::Error) -> ApiError {
        let not_sent = e.is_connect() || e.is_builder();
        let reason = self.key.redact(&error_chain(&e.without_url()));
        if not_sent {
            ApiError::NotSent {
                endpoint: endpoint.to_owned(),
                reason,
            }
        } else {
            ApiError::Ambiguous {
                endpoint: endpoint.to_owned(),
                reason,
                job_id: None,
            }
        }
    }
}

/// The whole body, or what arrived of it and why the rest did not: the start of a cut answer
/// may still name the job.
async fn read_body(mut response: reqwest::Response) -> Result<Vec<u8>, (Vec<u8>, reqwest::Error)> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) => return Ok(body),
            Err(e) => return Err((body, e)),
        }
    }
}

/// The error and its causes on one line: reqwest's top-level message alone rarely says why.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_is_checked_and_normalised() {
        let key = ApiKey::new("k").unwrap();
        let cfg = ClientConfig::new("https://api.example.com/prefix", key.clone()).unwrap();
        assert_eq!(cfg.base_url.as_str(), "https://api.example.com/prefix/");
        assert!(ClientConfig::new("http://127.0.0.1:8080", key.clone()).is_ok());
        let err = ClientConfig::new("http://api.example.com", key.clone()).unwrap_err();
        assert!(err.message.contains("unencrypted"));
        assert!(ClientConfig::new("api.example.com", key).is_err());
    }
}
