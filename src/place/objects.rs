//! A prefix in an S3-compatible bucket, through `object_store`: outputs written create-only
//! with their sha256 as object metadata, run files (manifest, report, thumbnails) replaced
//! whole, and every error scrubbed of anything that could be a credential.

use std::collections::HashMap;
use std::path::Path as FsPath;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::client::{
    ClientOptions, HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpService, ReqwestConnector,
};
use object_store::path::Path as Key;
use object_store::{
    Attribute, Attributes, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutMultipartOptions,
    PutOptions, PutPayload, RetryConfig, WriteMultipart,
};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use super::ObjectUrl;
use crate::sha256::Sha256Sum;

/// The metadata an output's sha256 is kept under (`x-amz-meta-sha256` on S3), so resuming
/// checks an object with a HEAD rather than reading it whole.
const SHA256_META: &str = "sha256";

/// Parts of a large upload: S3's minimum is 5 MiB; 8 MiB keeps a few parts in flight cheap.
const PART_BYTES: usize = 8 * 1024 * 1024;
/// Parts of one upload in flight at once.
const PARTS_IN_FLIGHT: usize = 2;
/// Bytes read from the file at a time, and handed to the upload (which gathers a part).
const READ_BYTES: usize = 256 * 1024;
/// Large uploads at once in this process, whatever the run's concurrency. Each holds up to
/// `1 + PARTS_IN_FLIGHT` parts in memory (24 MiB): eight at once held 249 MiB in a run of
/// 100 MB outputs at concurrency 8 (`cargo bench --bench bytes`), where two hold about 50 MiB
/// and still keep four parts on the wire. The others wait their turn, their files on disk.
const LARGE_UPLOADS_AT_ONCE: usize = 2;
static LARGE_UPLOADS: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(LARGE_UPLOADS_AT_ONCE);

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The URL or the environment cannot make a store.
    #[error("{0}")]
    Config(String),
    /// An object already there holds other bytes: it is never replaced.
    #[error("refusing to overwrite {url}: it holds other bytes than this download")]
    Exists { url: String },
    #[error("{what} {url}: {reason}")]
    Request {
        what: &'static str,
        url: String,
        reason: String,
        /// Whether the store itself failed rather than this request (see
        /// [`ObjectError::is_store_failure`]).
        store_failed: bool,
    },
}

impl ObjectError {
    /// Whether the store takes no request now, rather than this one failed: it refused the
    /// credentials or the write (401, 403), answered an error status its retries did not cure
    /// (a 5xx, 507 Insufficient Storage), or could not be connected to at all. A request cut on
    /// its way, or a conflict at one key, is that request's alone.
    pub fn is_store_failure(&self) -> bool {
        matches!(
            self,
            ObjectError::Request {
                store_failed: true,
                ..
            }
        )
    }
}

/// See [`ObjectError::is_store_failure`].
fn store_failed(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => true,
        // A request that got no answer fails with an HTTP error in its chain; without one,
        // the store answered, with an error status.
        object_store::Error::Generic { source, .. } => {
            let mut next: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
            while let Some(e) = next {
                if let Some(http) = e.downcast_ref::<HttpError>() {
                    return matches!(http.kind(), HttpErrorKind::Connect);
                }
                next = e.source();
            }
            true
        }
        _ => false,
    }
}

/// What is at a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub bytes: u64,
    /// The sha256 recorded in the object's metadata, when it has one (in either case). Text
    /// there that is no sha256 counts as none: the object's bytes then decide.
    pub sha256: Option<Sha256Sum>,
    /// The store's ETag of the object, when it gave one.
    pub etag: Option<String>,
}

/// An object as a listing gives it: its key, size and ETag, no metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub bytes: u64,
    pub etag: Option<String>,
}

/// A prefix in a bucket. Cheap to clone: the store is shared by every prefix of its bucket.
#[derive(Clone)]
pub struct Objects {
    store: Arc<dyn ObjectStore>,
    bucket: String,
    prefix: Key,
}

impl std::fmt::Debug for Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Objects({})", self.url())
    }
}

impl Objects {
    /// The prefix `url` names, its bucket's store opened once per process (opening reads the
    /// environment and makes no request).
    pub fn open(url: &ObjectUrl) -> Result<Objects, ObjectError> {
        // A URL read back from the database was checked when it was first given.
        url.check(&url.to_string()).map_err(ObjectError::Config)?;
        static STORES: OnceLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> = OnceLock::new();
        let mut stores = STORES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let store = match stores.get(&url.bucket) {
            Some(store) => Arc::clone(store),
            None => {
                let store: Arc<dyn ObjectStore> = Arc::new(
                    AmazonS3Builder::from_env()
                        .with_bucket_name(&url.bucket)
                        .with_http_connector(CreateOnlyConnector)
                        .with_retry(RetryConfig {
                            max_retries: 3,
                            retry_timeout: Duration::from_secs(60),
                            ..RetryConfig::default()
                        })
                        .build()
                        .map_err(|e| {
                            ObjectError::Config(format!(
                                "cannot use s3://{}: {}; set AWS_REGION (and AWS_ENDPOINT for an S3-compatible store) in the environment",
                                url.bucket,
                                scrub(&e.to_string())
                            ))
                        })?,
                );
                stores.insert(url.bucket.clone(), Arc::clone(&store));
                store
            }
        };
        Ok(Objects {
            store,
            bucket: url.bucket.clone(),
            prefix: Key::from(url.key.as_str()),
        })
    }

    /// The store of an object's bucket, and the object's key in it.
    pub fn at(url: &ObjectUrl) -> Result<(Objects, Key), ObjectError> {
        url.check(&url.to_string()).map_err(ObjectError::Config)?;
        let root = ObjectUrl {
            bucket: url.bucket.clone(),
            key: String::new(),
        };
        Ok((Objects::open(&root)?, Key::from(url.key.as_str())))
    }

    /// This prefix's URL.
    pub fn url(&self) -> ObjectUrl {
        self.url_of(&self.prefix)
    }

    /// The URL of the object at `key`.
    pub fn url_of(&self, key: &Key) -> ObjectUrl {
        ObjectUrl {
            bucket: self.bucket.clone(),
            key: key.to_string(),
        }
    }

    /// The URL of the object at `key`, as a message shows it.
    pub fn key_url(&self, key: &Key) -> String {
        self.url_of(key).to_string()
    }

    pub fn child(&self, name: &str) -> Objects {
        Objects {
            prefix: self.key(name),
            ..self.clone()
        }
    }

    /// The key of `name` under this prefix (`name` may have `/` between segments).
    pub fn key(&self, name: &str) -> Key {
        name.split('/')
            .filter(|s| !s.is_empty())
            .fold(self.prefix.clone(), |key, seg| key.clone().join(seg))
    }

    /// The key of this prefix itself.
    pub fn prefix(&self) -> &Key {
        &self.prefix
    }

    fn error(&self, what: &'static str, key: &Key, e: &object_store::Error) -> ObjectError {
        let hint = match e {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => {
                "; check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT, AWS_REGION)"
            }
            _ => "",
        };
        ObjectError::Request {
            what,
            url: self.key_url(key),
            reason: format!("{}{hint}", scrub(&e.to_string())),
            store_failed: store_failed(e),
        }
    }

    /// Writes `body` at `key` only if nothing is there yet (a PUT with `If-None-Match: *`),
    /// its sha256 kept as metadata; returns the object's ETag when the store gave one. An
    /// object already there with the very same sha256 is an upload done before (a crash
    /// between the upload and the record): not an error.
    pub async fn put_new(
        &self,
        key: &Key,
        body: PutPayload,
        sha256: &Sha256Sum,
    ) -> Result<Option<String>, ObjectError> {
        let opts = PutOptions {
            mode: PutMode::Create,
            attributes: sha_attributes(sha256),
            ..PutOptions::default()
        };
        match self.store.put_opts(key, body, opts).await {
            Ok(put) => Ok(put.e_tag),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => self.same_or_foreign(key, sha256).await,
            Err(e) => Err(self.error("cannot write", key, &e)),
        }
    }

    /// Uploads a file too large to hold in parts; the upload becomes visible under `key` only
    /// when complete, and its completion is create-only (see [`CreateOnlyConnector`]).
    /// Returns the object's ETag, as [`Objects::put_new`].
    pub async fn put_new_file(
        &self,
        key: &Key,
        file: &FsPath,
        sha256: &Sha256Sum,
    ) -> Result<Option<String>, ObjectError> {
        let _turn = LARGE_UPLOADS
            .acquire()
            .await
            .map_err(|e| ObjectError::Request {
                what: "cannot start uploading",
                url: self.key_url(key),
                reason: e.to_string(),
                store_failed: false,
            })?;
        let opts = PutMultipartOptions {
            attributes: sha_attributes(sha256),
            ..PutMultipartOptions::default()
        };
        let upload = self
            .store
            .put_multipart_opts(key, opts)
            .await
            .map_err(|e| self.error("cannot start uploading", key, &e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let io = |e: std::io::Error| ObjectError::Request {
            what: "cannot read the download for",
            url: self.key_url(key),
            reason: e.to_string(),
            store_failed: false,
        };
        let mut source = tokio::fs::File::open(file).await.map_err(io)?;
        let mut buf = vec![0u8; READ_BYTES];
        loop {
            if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                let error = self.error("cannot write", key, &e);
                let _ = writer.abort().await;
                return Err(error);
            }
            let n = match source.read(&mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = writer.abort().await;
                    return Err(io(e));
                }
            };
            if n == 0 {
                break;
            }
            writer.write(&buf[..n]);
        }
        match writer.finish().await {
            Ok(put) => Ok(put.e_tag),
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => self.same_or_foreign(key, sha256).await,
            Err(e) => Err(self.error("cannot write", key, &e)),
        }
    }

    /// After a create-only write was refused: the object there is ours (same sha256, by its
    /// metadata or, without it, by its bytes), and its ETag is returned, or someone else's.
    async fn same_or_foreign(
        &self,
        key: &Key,
        sha256: &Sha256Sum,
    ) -> Result<Option<String>, ObjectError> {
        let stat = self.stat(key).await?;
        let same = match &stat {
            Some(Stat {
                sha256: Some(theirs),
                ..
            }) => theirs == sha256,
            Some(_) => self
                .read(key)
                .await?
                .is_some_and(|b| Sha256Sum::of_bytes(&b) == *sha256),
            None => false,
        };
        if same {
            Ok(stat.and_then(|s| s.etag))
        } else {
            Err(ObjectError::Exists {
                url: self.key_url(key),
            })
        }
    }

    /// A HEAD of the manifest's key: an answer, even "not found", says the endpoint, the
    /// bucket and the credentials work; a refusal or no answer is said before a run pays.
    pub async fn check(&self) -> Result<(), ObjectError> {
        self.stat(&self.key(super::layout::MANIFEST))
            .await
            .map(|_| ())
    }

    /// The size and recorded sha256 of the object at `key`; `None` when there is none.
    pub async fn stat(&self, key: &Key) -> Result<Option<Stat>, ObjectError> {
        let opts = GetOptions {
            head: true,
            ..GetOptions::default()
        };
        match self.store.get_opts(key, opts).await {
            Ok(found) => Ok(Some(Stat {
                bytes: found.meta.size,
                etag: found.meta.e_tag.clone(),
                sha256: found
                    .attributes
                    .get(&Attribute::Metadata(SHA256_META.into()))
                    .and_then(|v| Sha256Sum::parse(&v.to_ascii_lowercase()).ok()),
            })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("cannot look at", key, &e)),
        }
    }

    /// The whole object at `key`; `None` when there is none.
    pub async fn read(&self, key: &Key) -> Result<Option<Bytes>, ObjectError> {
        let found = match self.store.get(key).await {
            Ok(found) => found,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.error("cannot read", key, &e)),
        };
        found
            .bytes()
            .await
            .map(Some)
            .map_err(|e| self.error("cannot read", key, &e))
    }

    /// The object at `key` handed to `sink` a chunk at a time as it arrives, never whole (an
    /// output may weigh 100 MB); its size, or `None` when there is none. An error of `sink`
    /// stops the read.
    pub async fn read_each(
        &self,
        key: &Key,
        mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<Option<u64>, ObjectError> {
        use futures::StreamExt;
        let found = match self.store.get(key).await {
            Ok(found) => found,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.error("cannot read", key, &e)),
        };
        let mut chunks = found.into_stream();
        let mut size = 0u64;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| self.error("cannot read", key, &e))?;
            sink(&chunk).map_err(|e| ObjectError::Request {
                what: "cannot keep what was read of",
                url: self.key_url(key),
                reason: e.to_string(),
                store_failed: false,
            })?;
            size += chunk.len() as u64;
        }
        Ok(Some(size))
    }

    /// The object at `key` as a stream of its bytes, for a server to pass on as they come;
    /// `None` when there is none.
    pub async fn stream(
        &self,
        key: &Key,
    ) -> Result<Option<futures::stream::BoxStream<'static, std::io::Result<Bytes>>>, ObjectError>
    {
        use futures::StreamExt;
        match self.store.get(key).await {
            Ok(found) => Ok(Some(
                found
                    .into_stream()
                    .map(|chunk| chunk.map_err(std::io::Error::other))
                    .boxed(),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("cannot read", key, &e)),
        }
    }

    /// The sha256 of the object at `key` and its size, read as a stream; `None` when there is
    /// none.
    pub async fn sha256(&self, key: &Key) -> Result<Option<(Sha256Sum, u64)>, ObjectError> {
        let mut hasher = Sha256::new();
        let size = self
            .read_each(key, |chunk| {
                hasher.update(chunk);
                Ok(())
            })
            .await?;
        Ok(size.map(|size| (Sha256Sum::of_digest(hasher.finalize()), size)))
    }

    /// The object at `key` written to `file` as it arrives (created or truncated); its sha256
    /// and size, or `None` when there is none.
    pub async fn read_to_file(
        &self,
        key: &Key,
        file: &FsPath,
    ) -> Result<Option<(Sha256Sum, u64)>, ObjectError> {
        use std::io::Write;
        let io = |e: std::io::Error| ObjectError::Request {
            what: "cannot write a copy of",
            url: self.key_url(key),
            reason: e.to_string(),
            store_failed: false,
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(file).map_err(io)?);
        let mut hasher = Sha256::new();
        let size = self
            .read_each(key, |chunk| {
                hasher.update(chunk);
                out.write_all(chunk)
            })
            .await?;
        out.flush().map_err(io)?;
        Ok(size.map(|size| (Sha256Sum::of_digest(hasher.finalize()), size)))
    }

    /// The first `len` bytes of the object at `key` (all of it when it is shorter); `None` when
    /// there is none.
    pub async fn read_head(&self, key: &Key, len: u64) -> Result<Option<Bytes>, ObjectError> {
        match self.store.get_range(key, 0..len).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("cannot read", key, &e)),
        }
    }

    /// Writes a run file (manifest, report page, thumbnail) whole, replacing the one before:
    /// a single PUT, so a reader sees the old file or the new one, never half of one. Returns
    /// the object's ETag when the store gave one.
    pub async fn replace(
        &self,
        key: &Key,
        body: impl Into<PutPayload>,
    ) -> Result<Option<String>, ObjectError> {
        self.store
            .put(key, body.into())
            .await
            .map(|put| put.e_tag)
            .map_err(|e| self.error("cannot write", key, &e))
    }

    pub async fn delete(&self, key: &Key) -> Result<(), ObjectError> {
        match self.store.delete(key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("cannot remove", key, &e)),
        }
    }

    /// The objects under `dir` (every level below it; the bucket's root when `None`) whose keys
    /// sort after `after`, in the store's order (S3: by the keys' UTF-8 bytes), fetched a page
    /// at a time as the stream is read (S3 pages hold 1,000 keys): the caller holds one page,
    /// never the whole listing, and stops asking when it has seen what it wanted. `after` is
    /// only where to start: one the store's keys cannot be is ignored (the listing starts at
    /// `dir`'s first key).
    pub fn list_after(
        &self,
        dir: Option<&str>,
        after: Option<&str>,
    ) -> impl futures::Stream<Item = Result<Listed, ObjectError>> + use<> {
        use futures::StreamExt;
        let dir = dir.map(Key::from);
        let at = dir.clone().unwrap_or_default();
        let after = after.and_then(|a| Key::parse(a).ok());
        let listing = match &after {
            Some(after) => self.store.list_with_offset(dir.as_ref(), after),
            None => self.store.list(dir.as_ref()),
        };
        let this = self.clone();
        listing.map(move |found| match found {
            Ok(meta) => Ok(Listed {
                key: meta.location.into(),
                bytes: meta.size,
                etag: meta.e_tag,
            }),
            Err(e) => Err(this.error("cannot list", &at, &e)),
        })
    }

    /// The names of the objects directly under `dir` (a prefix of this one). Listed without a
    /// delimiter, as every listing here is (a request per 1,000 keys either way): a store
    /// answers that listing from its index in key order, with nothing to fold.
    pub async fn names(&self, dir: &Key) -> Result<Vec<String>, ObjectError> {
        use futures::TryStreamExt;
        let listing = self.list_after(Some(dir.as_ref()), None);
        let at = format!("{}/", dir.as_ref());
        listing
            .try_filter_map(|found| {
                let name = found
                    .key
                    .strip_prefix(at.as_str())
                    .filter(|n| !n.contains('/'));
                futures::future::ok(name.map(str::to_owned))
            })
            .try_collect()
            .await
    }
}

/// Whether two ETags of an object (one recorded at upload, one listed or returned since) say
/// it holds the same bytes: equal once unquoted, and neither weak (`W/"…"`, which promises
/// equivalent content, not the same bytes) nor empty.
pub fn same_etag(a: &str, b: &str) -> bool {
    matches!((strong_etag(a), strong_etag(b)), (Some(a), Some(b)) if a == b)
}

/// An ETag as [`same_etag`] compares it: unquoted; `None` for a weak or an empty one.
pub fn strong_etag(etag: &str) -> Option<&str> {
    let etag = etag.trim();
    (!etag.starts_with("W/"))
        .then(|| etag.trim_matches('"'))
        .filter(|e| !e.is_empty())
}

fn sha_attributes(sha256: &Sha256Sum) -> Attributes {
    let mut attributes = Attributes::new();
    attributes.insert(
        Attribute::Metadata(SHA256_META.into()),
        sha256.to_string().into(),
    );
    attributes
}

/// An error's text with what could be a credential taken out: query parameters of signed
/// URLs (`X-Amz-Credential`, `X-Amz-Signature`, `X-Amz-Security-Token`, …), and the keys or
/// session token of the environment, should a message ever quote them (a store's answer to
/// a refused signature may quote the access key id).
pub(crate) fn scrub(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("X-Amz-").or_else(|| rest.find("x-amz-")) {
        out.push_str(&rest[..at]);
        let end = rest[at..]
            .find(|c: char| c == '&' || c == '"' || c == '\'' || c.is_whitespace() || c == ',')
            .map_or(rest.len(), |n| at + n);
        let name = rest[at..end].split('=').next().unwrap_or_default();
        out.push_str(name);
        if rest[at..end].contains('=') {
            out.push_str("=[hidden]");
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    for var in [
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ACCESS_KEY_ID",
    ] {
        if let Ok(secret) = std::env::var(var)
            && secret.len() >= 8
        {
            out = out.replace(&secret, "[hidden]");
        }
    }
    out
}

/// The HTTP client of every store: object_store's own, with `If-None-Match: *` added to
/// each multipart upload's completion (`POST …?uploadId=…`). Without it a completion replaces
/// whatever is under the key; with it the store answers 412 when something is, so a large
/// output is as create-only as a small one's single PUT. The header is not signed, which
/// SigV4 allows.
#[derive(Debug)]
struct CreateOnlyConnector;

impl HttpConnector for CreateOnlyConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(CreateOnlyCompletion(inner)))
    }
}

#[derive(Debug)]
struct CreateOnlyCompletion(HttpClient);

#[async_trait::async_trait]
impl HttpService for CreateOnlyCompletion {
    async fn call(&self, mut req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let completes = req.method() == http::Method::POST
            && req
                .uri()
                .query()
                .is_some_and(|q| q.split('&').any(|p| p.starts_with("uploadId=")));
        if completes {
            req.headers_mut().insert(
                http::header::IF_NONE_MATCH,
                http::HeaderValue::from_static("*"),
            );
        }
        self.0.execute(req).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_query_parameters_never_reach_a_message() {
        let said = scrub(
            "GET http://h/b/k?X-Amz-Credential=AKIA%2F2026&X-Amz-Signature=abc123 failed, retry",
        );
        assert!(!said.contains("AKIA") && !said.contains("abc123"), "{said}");
        assert!(said.contains("X-Amz-Signature=[hidden]") && said.ends_with("failed, retry"));
    }
}
