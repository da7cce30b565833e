//! Outputs in object storage: runs with `--out s3://bucket/prefix` against an S3-compatible
//! server in the test process (s3s-fs on 127.0.0.1, buckets as directories), with the
//! credentials in the environment as a user would set them. The server can cut the uploads
//! to one key halfway through their bodies, as a network failing mid-request would, and keeps
//! a log of every request it answered (its S3 operation, `If-None-Match` and status), so a
//! test sees what the store was asked, not only what it holds.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{Attribute, GetOptions, ObjectStore, ObjectStoreExt};

use crate::common::*;
use crate::run::{config, state_path, write};

const ACCESS_KEY: &str = "AKIAIMGPIPETEST";
const SECRET_KEY: &str = "imgpipe-test-secret-never-shown";
pub(crate) const BUCKET: &str = "shots";

/// Three items, one generated image each.
const PIPELINE: &str = "version: 1
name: objects
pricing: { generation: 4 }
items:
  - { id: a }
  - { id: b }
  - { id: c }
steps:
  - id: shot
    generate: { prompt: \"a mug\", n: 1, size: 2K }
";

/// A request the server answered.
#[derive(Clone, Debug)]
pub(crate) struct Request {
    method: http::Method,
    /// The path, `/<bucket>/<key>` (path-style addressing).
    path: String,
    query: String,
    /// Its `If-None-Match` header: `*` makes a write create-only.
    if_none_match: Option<String>,
    /// The status answered; `None` when the connection was dropped without an answer.
    status: Option<u16>,
    /// For a request cut (see [`S3::cut_uploads_to`]): the bytes of its body the store
    /// received before the connection dropped, and the whole body's length.
    cut: Option<(usize, usize)>,
}

impl Request {
    /// LIST (a GET with `list-type`), GET, HEAD, PUT, POST or DELETE.
    fn kind(&self) -> &str {
        if self.method == http::Method::GET && self.has_param("list-type") {
            "LIST"
        } else {
            self.method.as_str()
        }
    }

    /// The S3 operation of a write (`PutObject`, `CreateMultipartUpload`, `UploadPart`,
    /// `CompleteMultipartUpload`, `AbortMultipartUpload`); [`Request::kind`] for the others.
    fn op(&self) -> &str {
        match self.method {
            http::Method::POST if self.has_param("uploads") => "CreateMultipartUpload",
            http::Method::POST if self.has_param("uploadId") => "CompleteMultipartUpload",
            http::Method::PUT if self.has_param("uploadId") => "UploadPart",
            http::Method::PUT => "PutObject",
            http::Method::DELETE if self.has_param("uploadId") => "AbortMultipartUpload",
            _ => self.kind(),
        }
    }

    fn has_param(&self, name: &str) -> bool {
        self.query
            .split('&')
            .any(|p| p.split('=').next() == Some(name))
    }

    /// The object's key, for a request about one object.
    fn key(&self) -> &str {
        let bucket = format!("/{BUCKET}/");
        self.path.strip_prefix(bucket.as_str()).unwrap_or_default()
    }
}

type RequestLog = Arc<Mutex<Vec<Request>>>;

/// An S3-compatible server on loopback, stopped when dropped.
pub(crate) struct S3 {
    port: u16,
    root: tempfile::TempDir,
    /// See [`S3::cut_uploads_to`].
    cut: Arc<Mutex<Option<String>>>,
    /// See [`S3::refuse_writes_after`].
    refuse: Refusal,
    /// Every request the server answered.
    requests: RequestLog,
    /// LISTs, held while a test needs a slow listing.
    lists: Arc<Gate>,
    /// The parts of multipart uploads, held while a test needs slow uploads.
    parts: Arc<Gate>,
    /// See [`S3::deny_list_bucket`].
    unlisted: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// Holds requests of one kind (LISTs, the parts of multipart uploads) until the test lets them
/// through: a listing or an upload as slow as a test needs it, without racing the clock.
struct Gate {
    /// Whether LISTs pass.
    open: tokio::sync::watch::Sender<bool>,
    /// LISTs waiting at the gate now.
    held: std::sync::atomic::AtomicUsize,
}

impl Gate {
    /// Holds every request of its kind from now on, until [`Gate::let_through`].
    fn hold(&self) {
        self.open.send_replace(false);
    }

    /// Lets the requests held, and every later one, through.
    fn let_through(&self) {
        self.open.send_replace(true);
    }

    /// Requests waiting at the gate now.
    fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits while the gate is closed, counted as held.
    async fn pass(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let mut open = self.open.subscribe();
        if *open.borrow() {
            return;
        }
        self.held.fetch_add(1, SeqCst);
        // A gate dropped with its server ends the wait too.
        let _ = open.wait_for(|o| *o).await;
        self.held.fetch_sub(1, SeqCst);
    }
}

/// Writes still allowed before the bucket refuses every one with this status; none refused
/// while `None`.
type Refusal = Arc<Mutex<Option<(usize, http::StatusCode)>>>;

impl Drop for S3 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// s3s-fs's service, with uploads to a chosen key cut and every request logged.
#[derive(Clone)]
struct Cutting {
    inner: s3s::service::S3Service,
    cut: Arc<Mutex<Option<String>>>,
    refuse: Refusal,
    requests: RequestLog,
    lists: Arc<Gate>,
    parts: Arc<Gate>,
    unlisted: Arc<std::sync::atomic::AtomicBool>,
}

type Answer = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<s3s::HttpResponse, s3s::HttpError>> + Send>,
>;

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Cutting {
    type Response = s3s::HttpResponse;
    type Error = s3s::HttpError;
    type Future = Answer;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Answer {
        let mut seen = Request {
            method: req.method().clone(),
            path: req.uri().path().to_owned(),
            query: req.uri().query().unwrap_or_default().to_owned(),
            if_none_match: req
                .headers()
                .get(http::header::IF_NONE_MATCH)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            status: None,
            cut: None,
        };
        let mut refusal = None;
        if matches!(*req.method(), http::Method::PUT | http::Method::POST)
            && let Some((allowed, status)) = self.refuse.lock().unwrap().as_mut()
        {
            if *allowed == 0 {
                refusal = Some(*status);
            } else {
                *allowed -= 1;
            }
        }
        let cut = self.cut.lock().unwrap().clone();
        let cut = req.method() == http::Method::PUT
            && cut.is_some_and(|c| req.uri().path().contains(c.as_str()));
        let (inner, requests) = (self.inner.clone(), Arc::clone(&self.requests));
        let gate = match seen.op() {
            "LIST" => Some(Arc::clone(&self.lists)),
            "UploadPart" => Some(Arc::clone(&self.parts)),
            _ => None,
        };
        // Credentials without s3:ListBucket: S3 refuses a listing, and answers 403 where the
        // key is missing rather than say it is (404).
        let unlisted = self.unlisted.load(std::sync::atomic::Ordering::SeqCst);
        if unlisted && seen.kind() == "LIST" {
            refusal = Some(http::StatusCode::FORBIDDEN);
        }
        Box::pin(async move {
            if let Some(gate) = gate {
                gate.pass().await;
            }
            let mut answer = match refusal {
                Some(status) => refused(status).await,
                None if cut => {
                    let (answer, received) = cut_halfway(&inner, req).await;
                    seen.cut = Some(received);
                    answer
                }
                None => inner.call(req.map(s3s::Body::from)).await,
            };
            if unlisted
                && answer
                    .as_ref()
                    .is_ok_and(|a| a.status() == http::StatusCode::NOT_FOUND)
            {
                answer = refused(http::StatusCode::FORBIDDEN).await;
            }
            seen.status = answer.as_ref().ok().map(|a| a.status().as_u16());
            requests.lock().unwrap().push(seen);
            answer
        })
    }
}

/// Hands the store the first half of `req`'s body, then drops the connection without an
/// answer, as a network failing in the middle of an upload would: the store has begun to
/// receive the object (or the part), and its writer fails when the body breaks off.
/// Returns the bytes the store received, and the body's length.
async fn cut_halfway(
    inner: &s3s::service::S3Service,
    req: http::Request<hyper::body::Incoming>,
) -> (Result<s3s::HttpResponse, s3s::HttpError>, (usize, usize)) {
    let length: usize = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or_default();
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let req = req.map(|body| {
        let halfway: s3s::stream::DynByteStream = Box::pin(Halfway {
            body: s3s::Body::from(body),
            left: length / 2,
            received: Arc::clone(&received),
        });
        s3s::Body::from(halfway)
    });
    let _ = inner.call(req).await;
    let cut = s3s::HttpError::new(Box::new(std::io::Error::other(
        "upload cut halfway by the test",
    )));
    let received = received.load(std::sync::atomic::Ordering::SeqCst);
    (Err(cut), (received, length))
}

/// A request body that breaks off with an error after `left` bytes.
struct Halfway {
    body: s3s::Body,
    left: usize,
    /// The bytes handed on so far.
    received: Arc<std::sync::atomic::AtomicUsize>,
}

impl futures::Stream for Halfway {
    type Item = Result<bytes::Bytes, Box<dyn std::error::Error + Send + Sync>>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use futures::StreamExt;
        if self.left == 0 {
            return std::task::Poll::Ready(Some(Err("connection dropped by the test".into())));
        }
        let next = std::task::ready!(self.body.poll_next_unpin(cx));
        std::task::Poll::Ready(next.map(|chunk| {
            chunk.map(|mut chunk| {
                chunk.truncate(self.left);
                self.left -= chunk.len();
                self.received
                    .fetch_add(chunk.len(), std::sync::atomic::Ordering::SeqCst);
                chunk
            })
        }))
    }
}

impl s3s::stream::ByteStream for Halfway {
    fn remaining_length(&self) -> s3s::stream::RemainingLength {
        self.body.remaining_length()
    }
}

/// What S3 answers a write it refuses: its error document with `status`.
async fn refused(status: http::StatusCode) -> Result<s3s::HttpResponse, s3s::HttpError> {
    let code = match status {
        http::StatusCode::FORBIDDEN => "AccessDenied",
        _ => "InsufficientStorage",
    };
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>refused by the test</Message></Error>"
    );
    Ok(http::Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/xml")
        .body(s3s::Body::from(body))
        .unwrap())
}

#[path = "../../benches/support/s3_etags.rs"]
mod s3_etags;
use s3_etags::ListingETags;

impl S3 {
    pub(crate) async fn start() -> S3 {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join(BUCKET)).unwrap();
        let mut builder =
            s3s::service::S3ServiceBuilder::new(ListingETags::new(root.path()).unwrap());
        builder.set_auth(s3s::auth::SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
        let cut = Arc::new(Mutex::new(None));
        let refuse = Arc::new(Mutex::new(None));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let gate = || {
            Arc::new(Gate {
                open: tokio::sync::watch::Sender::new(true),
                held: std::sync::atomic::AtomicUsize::new(0),
            })
        };
        let (lists, parts) = (gate(), gate());
        let unlisted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let service = Cutting {
            inner: builder.build(),
            cut: Arc::clone(&cut),
            refuse: Arc::clone(&refuse),
            requests: Arc::clone(&requests),
            lists: Arc::clone(&lists),
            parts: Arc::clone(&parts),
            unlisted: Arc::clone(&unlisted),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = service.clone();
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                });
            }
        });
        S3 {
            port,
            root,
            cut,
            refuse,
            requests,
            lists,
            parts,
            unlisted,
            task,
        }
    }

    /// Answers from now on as S3 does to credentials without `s3:ListBucket`: a LIST is
    /// refused (403), and so is a GET or HEAD of a key that is not there (403, not 404).
    fn deny_list_bucket(&self) {
        self.unlisted
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many requests of this operation ([`Request::op`]) were answered so far.
    fn answered(&self, op: &str) -> usize {
        let log = self.requests.lock().unwrap();
        log.iter().filter(|r| r.op() == op).count()
    }

    /// The requests answered since the last call, and the log emptied.
    pub(crate) fn take_requests(&self) -> Vec<Request> {
        std::mem::take(&mut *self.requests.lock().unwrap())
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment a user sets for an S3-compatible store: set, or (`None`) removed.
    pub(crate) fn vars(&self) -> [(&'static str, Option<String>); 7] {
        [
            ("AWS_ACCESS_KEY_ID", Some(ACCESS_KEY.to_owned())),
            ("AWS_SECRET_ACCESS_KEY", Some(SECRET_KEY.to_owned())),
            ("AWS_REGION", Some("us-east-1".to_owned())),
            ("AWS_ENDPOINT", Some(self.endpoint())),
            ("AWS_ALLOW_HTTP", Some("true".to_owned())),
            ("AWS_SESSION_TOKEN", None),
            ("AWS_PROFILE", None),
        ]
    }

    /// The test's own client of the bucket.
    fn store(&self) -> Arc<dyn ObjectStore> {
        Arc::new(
            AmazonS3Builder::new()
                .with_endpoint(self.endpoint())
                .with_allow_http(true)
                .with_region("us-east-1")
                .with_bucket_name(BUCKET)
                .with_access_key_id(ACCESS_KEY)
                .with_secret_access_key(SECRET_KEY)
                .build()
                .unwrap(),
        )
    }

    /// An object's file on the server's disk.
    pub(crate) fn file(&self, key: &str) -> PathBuf {
        self.root.path().join(BUCKET).join(key)
    }

    /// Lets `allowed` more writes (PUTs, and POSTs of multipart uploads) through, then answers
    /// every one with `status`, as a bucket whose policy or quota changed would; `None` lifts
    /// the refusal.
    pub(crate) fn refuse_writes_after(&self, refusal: Option<(usize, http::StatusCode)>) {
        *self.refuse.lock().unwrap() = refusal;
    }

    /// Cuts every PUT (a whole object's, or a part's) whose path holds `key` halfway through
    /// its body, the connection dropped without an answer (see [`cut_halfway`]); `None` lets
    /// them through again.
    fn cut_uploads_to(&self, key: Option<&str>) {
        *self.cut.lock().unwrap() = key.map(str::to_owned);
    }
}

/// The outputs recorded in the state database: item, path, sha256, bytes, ETag, download
/// error.
#[derive(Debug, Clone)]
struct Recorded {
    item: String,
    path: Option<String>,
    sha256: Option<String>,
    bytes: Option<i64>,
    etag: Option<String>,
    error: Option<String>,
}

/// The test's state database, opened to read.
async fn read_state(dir: &Path) -> sqlx::SqliteConnection {
    use sqlx::ConnectOptions;
    sqlx::sqlite::SqliteConnectOptions::new()
        .filename(state_path(dir))
        .read_only(true)
        .connect()
        .await
        .unwrap()
}

async fn outputs(dir: &Path) -> Vec<Recorded> {
    use sqlx::{Connection, Row};
    let mut conn = read_state(dir).await;
    let rows = sqlx::query(
        "SELECT t.item, o.path, o.sha256, o.bytes, o.etag, o.download_error FROM outputs o
         JOIN tasks t ON t.id = o.task_id ORDER BY t.item",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    rows.iter()
        .map(|r| Recorded {
            item: r.get(0),
            path: r.get(1),
            sha256: r.get(2),
            bytes: r.get(3),
            etag: r.get(4),
            error: r.get(5),
        })
        .collect()
}

/// The names of the thumbnails the state database records.
async fn thumbnail_names(dir: &Path) -> Vec<String> {
    use sqlx::Connection;
    let mut conn = read_state(dir).await;
    let names: Vec<(String,)> = sqlx::query_as("SELECT name FROM thumbnails ORDER BY name")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    names.into_iter().map(|(n,)| n).collect()
}

/// The key of a recorded `s3://shots/…` URL.
fn key_of(url: &str) -> Key {
    Key::from(url.strip_prefix("s3://shots/").expect("an object URL"))
}

/// Every recorded output is an object of the recorded bytes and sha256, which its metadata
/// says too.
async fn assert_objects_agree(s3: &S3, recorded: &[Recorded], prefix: &str) {
    assert_objects_agree_as(s3, recorded, prefix, false).await;
}

/// [`assert_objects_agree`]; with `killed`, an object may lack its metadata: s3s-fs puts an
/// object's file in place before its metadata, so a PUT whose client was killed in between
/// leaves the bytes alone (an S3 PUT is all or nothing). The resume then finds the same bytes
/// there by reading them, and keeps them.
async fn assert_objects_agree_as(s3: &S3, recorded: &[Recorded], prefix: &str, killed: bool) {
    let store = s3.store();
    for o in recorded {
        let url = o.path.as_deref().unwrap_or_else(|| panic!("{o:?}"));
        assert!(url.starts_with(prefix), "{url}");
        let found = store
            .get_opts(&key_of(url), GetOptions::default())
            .await
            .unwrap();
        let meta = found
            .attributes
            .get(&Attribute::Metadata("sha256".into()))
            .map(|v| v.to_string());
        let body = found.bytes().await.unwrap();
        assert_eq!(Some(sha256_hex(&body)), o.sha256, "{url}");
        if !(killed && meta.is_none()) {
            assert_eq!(meta, o.sha256, "{url}");
        }
        assert_eq!(Some(body.len() as i64), o.bytes, "{url}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_into_a_bucket_writes_every_output_with_its_sha256_and_the_manifest() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", PIPELINE);
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r",
            "--out",
            "s3://shots/runs/",
            "--report",
        ],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 0);
    // The report read each image whole once, to make its thumbnail.
    let log = s3.take_requests();
    // Each output, smaller than 256 KiB, went up in one create-only PUT.
    for item in ["a", "b", "c"] {
        let key = format!("runs/r/{item}/shot.png");
        assert_eq!(
            writes_to(&log, &key),
            [("PutObject", Some("*"), Some(200))],
            "{key}"
        );
    }
    for item in ["a", "b", "c"] {
        let key = format!("runs/r/{item}/shot.png");
        let reads = of_kind(&log, "GET").iter().filter(|k| **k == key).count();
        assert_eq!(reads, 1, "{key}: {log:#?}");
    }
    let recorded = outputs(dir).await;
    assert_eq!(recorded.len(), 3, "{recorded:?}");
    assert_objects_agree(&s3, &recorded, "s3://shots/runs/r/").await;
    assert_eq!(
        recorded[0].path.as_deref(),
        Some("s3://shots/runs/r/a/shot.png")
    );
    let manifest = std::fs::read_to_string(s3.file("runs/r/manifest.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = manifest
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{manifest}");
    assert_eq!(lines[0]["path"], "a/shot.png", "{manifest}");
    // The report sits under the run's prefix, its links relative to it, the thumbnails
    // beside the outputs.
    let page = std::fs::read_to_string(s3.file("runs/r/report.html")).unwrap();
    assert!(page.contains("href=\"a/shot.png\""), "{page}");
    assert!(page.contains("s3://shots/runs/r"), "{page}");
    assert!(!page.contains(&dir.display().to_string()));
    assert!(!page.contains("size unknown"), "{page}");
    let thumbs = std::fs::read_dir(s3.file("runs/r/_thumbs"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "png")
        })
        .count();
    // What each thumbnail shows is recorded beside the run, one row a thumbnail put.
    let recorded_thumbs = thumbnail_names(dir).await;
    assert_eq!(recorded_thumbs.len(), thumbs, "{recorded_thumbs:?}");
    for name in &recorded_thumbs {
        assert!(
            s3.file(&format!("runs/r/_thumbs/{name}.png")).is_file(),
            "{name}"
        );
    }
    let images: std::collections::BTreeSet<_> = recorded.iter().map(|o| &o.sha256).collect();
    assert_eq!(
        thumbs,
        images.len(),
        "a thumbnail per image, named by its sha256"
    );
    let (local, log, _) = report_again(&env, &s3, "page.html").await;
    assert!(local.contains("href=\"a/shot.png\""), "{local}");
    // The thumbnails are made and carry their image's size: no image is read again, a
    // listing of the prefix says they are there, and the page still gives every image's size.
    assert!(!local.contains("size unknown"), "{local}");
    assert!(images_read(&log).is_empty(), "{log:#?}");
    assert!(of_kind(&log, "LIST").len() <= 2, "{log:#?}");
    // Nor any thumbnail: the state database says what each shows.
    let thumbs_read: Vec<&str> = of_kind(&log, "GET")
        .into_iter()
        .filter(|k| k.contains("_thumbs/") && k.ends_with(".png"))
        .collect();
    assert!(thumbs_read.is_empty(), "{log:#?}");
    // An object removed from the bucket, and one replaced by other bytes, are said so on the
    // next page: the listing tells, and only the changed one is read again.
    let store = s3.store();
    store.delete(&Key::from("runs/r/b/shot.png")).await.unwrap();
    store
        .put(
            &Key::from("runs/r/c/shot.png"),
            b"other bytes".to_vec().into(),
        )
        .await
        .unwrap();
    let (again, log, o) = report_again(&env, &s3, "again.html").await;
    assert!(again.contains("no longer on disk"), "{again}");
    assert!(
        again.contains("changed on disk since it was downloaded"),
        "{again}"
    );
    assert_eq!(images_read(&log), ["runs/r/c/shot.png"], "{log:#?}");
    // A thumbnail removed from the bucket is forgotten, and made again from its image: read
    // once more, that image alone, and the thumbnail put back.
    let a_thumb = recorded
        .iter()
        .find(|o| o.item == "a")
        .and_then(|o| o.sha256.as_deref())
        .map(|sha| format!("runs/r/_thumbs/{}.png", &sha[..32]))
        .unwrap();
    store.delete(&Key::from(a_thumb.as_str())).await.unwrap();
    let (_, log, _) = report_again(&env, &s3, "third.html").await;
    assert_eq!(
        images_read(&log),
        ["runs/r/a/shot.png", "runs/r/c/shot.png"],
        "{log:#?}"
    );
    assert!(s3.file(&a_thumb).is_file(), "{a_thumb}");
    assert_eq!(thumbnail_names(dir).await.len(), thumbs);
    // Nothing was made locally under a name that looks like the URL.
    assert!(!dir.join("s3:").exists());
    let said = both(&o);
    assert!(!said.contains(SECRET_KEY), "{said}");
    // The status shows where the outputs are.
    let o = Imgpipe::on(&env, &["status", "r", "--json"])
        .s3(&s3)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(json_stdout(&o)["output_dir"], "s3://shots/runs/r");
}

/// Makes run `r`'s report again into `out` (in the test's directory): the page, the requests
/// to the store while it was made, and the process's output.
async fn report_again(env: &Env, s3: &S3, out: &str) -> (String, Vec<Request>, Output) {
    let dir = env.dir.path();
    s3.take_requests();
    let o = Imgpipe::on(env, &["report", "r", "--out", out])
        .s3(s3)
        .sqlite_in(dir)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let page = std::fs::read_to_string(dir.join(out)).unwrap();
    (page, s3.take_requests(), o.output)
}

/// The outputs (`…/shot.png`) the store was asked for, by key, sorted.
fn images_read(log: &[Request]) -> Vec<&str> {
    let mut read: Vec<&str> = log
        .iter()
        .filter(|r| r.path.ends_with("shot.png"))
        .map(Request::key)
        .collect();
    read.sort_unstable();
    read
}

fn both(o: &Output) -> String {
    format!("{}\n{}", stdout(o), stderr(o))
}

/// The writes of `log` to `key`: each one's operation, `If-None-Match` and status.
fn writes_to<'a>(log: &'a [Request], key: &str) -> Vec<(&'a str, Option<&'a str>, Option<u16>)> {
    log.iter()
        .filter(|r| r.key() == key && !matches!(r.kind(), "GET" | "HEAD" | "LIST"))
        .map(|r| (r.op(), r.if_none_match.as_deref(), r.status))
        .collect()
}

/// An object at `key` as the test's own client sees it: its bytes, ETag and sha256 metadata.
async fn object_at(s3: &S3, key: &str) -> (Vec<u8>, Option<String>, Option<String>) {
    let found = s3
        .store()
        .get_opts(&Key::from(key), GetOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
    let etag = found.meta.e_tag.clone();
    let meta = found
        .attributes
        .get(&Attribute::Metadata("sha256".into()))
        .map(|v| v.to_string());
    (found.bytes().await.unwrap().to_vec(), etag, meta)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upload_finished_but_unrecorded_is_done_and_other_bytes_at_the_key_are_never_replaced() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    // One item, so that nothing else is in flight when the process aborts.
    write(
        dir,
        "one.yaml",
        &PIPELINE.replace("  - { id: b }\n  - { id: c }\n", ""),
    );
    let mut cmd = Imgpipe::on(
        &env,
        &[
            "run",
            "one.yaml",
            "--run-id",
            "r1",
            "--out",
            "s3://shots/runs",
        ],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command();
    cmd.env(imgpipe::failpoint::ENV, "object-written-unrecorded");
    let o = finish(cmd).await;
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGABRT),
        "the run was to abort once its object was written: {}",
        both(&o)
    );
    // The object is whole in the bucket, its output recorded without it.
    let key = "runs/r1/a/shot.png";
    let (bytes, etag, meta) = object_at(&s3, key).await;
    assert_eq!(meta, Some(sha256_hex(&bytes)), "{key}");
    let recorded = outputs(dir).await;
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].path, None, "{recorded:?}");
    assert_eq!(env.sandbox.ledger().len(), 1);
    s3.take_requests();

    let o = Imgpipe::on(&env, &["resume", "r1"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger().len(), 1, "nothing paid again");
    // The resume fetched the output from its job and tried its create-only PUT, which the
    // store refused: the object there is the one the aborted run wrote, taken as done.
    assert_eq!(
        writes_to(&s3.take_requests(), key),
        [("PutObject", Some("*"), Some(412))]
    );
    let recorded = outputs(dir).await;
    assert_eq!(
        recorded[0].path.as_deref(),
        Some("s3://shots/runs/r1/a/shot.png")
    );
    assert_eq!(recorded[0].etag, etag, "{recorded:?}");
    assert_eq!(recorded[0].error, None, "{recorded:?}");
    assert_eq!(object_at(&s3, key).await, (bytes.clone(), etag, meta));
    assert_objects_agree(&s3, &recorded, "s3://shots/runs/r1/").await;

    // Before a second run, the same bytes are put at one output's key by someone else (no
    // sha256 metadata: compared by their bytes) and other bytes at another's.
    write(dir, "p.yaml", PIPELINE);
    let (same, foreign) = ("runs/r2/a/shot.png", "runs/r2/b/shot.png");
    let users = b"someone else's object".to_vec();
    let store = s3.store();
    store
        .put(&Key::from(same), bytes.clone().into())
        .await
        .unwrap();
    store
        .put(&Key::from(foreign), users.clone().into())
        .await
        .unwrap();
    let (_, same_etag, _) = object_at(&s3, same).await;
    let billed = env.sandbox.ledger().len();
    s3.take_requests();
    let o = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r2",
            "--out",
            "s3://shots/runs",
        ],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 4);
    let said = both(&o);
    assert!(
        said.contains("refusing to overwrite s3://shots/runs/r2/b/shot.png"),
        "{said}"
    );
    assert!(!said.contains("r2/a/shot.png"), "{said}");
    assert_eq!(
        env.sandbox.ledger().len(),
        billed + 3,
        "each item paid once"
    );
    let log = s3.take_requests();
    for k in [same, foreign] {
        assert_eq!(
            writes_to(&log, k),
            [("PutObject", Some("*"), Some(412))],
            "{k}"
        );
    }
    // Neither object is replaced: the same bytes are kept as they were (no metadata added),
    // and recorded; the other bytes stay, the output's download failed naming the key.
    assert_eq!(object_at(&s3, same).await, (bytes, same_etag.clone(), None));
    assert_eq!(std::fs::read(s3.file(foreign)).unwrap(), users);
    let r2: Vec<Recorded> = outputs(dir)
        .await
        .into_iter()
        .filter(|o| o.path.as_deref().is_none_or(|p| p.contains("/r2/")))
        .collect();
    assert_eq!(r2.len(), 3, "{r2:?}");
    let a = r2.iter().find(|o| o.item == "a").unwrap();
    assert_eq!(a.path.as_deref(), Some("s3://shots/runs/r2/a/shot.png"));
    assert_eq!(a.etag, same_etag, "{a:?}");
    let b = r2.iter().find(|o| o.item == "b").unwrap();
    assert_eq!(b.path, None, "{b:?}");
    assert!(
        b.error
            .as_deref()
            .is_some_and(|e| e.contains("refusing to overwrite s3://shots/runs/r2/b/shot.png")),
        "{b:?}"
    );

    // A resume fetches that output again from its job, for free, and still never replaces
    // the object.
    let o = Imgpipe::on(&env, &["resume", "r2"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 4);
    assert!(
        both(&o).contains("s3://shots/runs/r2/b/shot.png"),
        "{}",
        both(&o)
    );
    assert_eq!(env.sandbox.ledger().len(), billed + 3, "nothing paid again");
    assert_eq!(std::fs::read(s3.file(foreign)).unwrap(), users);
    let log = s3.take_requests();
    assert!(
        writes_to(&log, foreign)
            .iter()
            .all(|(_, condition, status)| *condition == Some("*") && *status == Some(412)),
        "{log:#?}"
    );
}

/// A sandbox whose images go up as multipart uploads (photo weight at 512 px: about 330 KiB,
/// more than a download holds in memory, 256 KiB), and a bucket.
async fn large_outputs() -> (Env, S3) {
    let env = start(imgpipe::sandbox::Config {
        image_side: 512,
        weight: imgpipe::sandbox::Weight::Photo,
        ..config()
    })
    .await;
    (env, S3::start().await)
}

/// Large uploads go two at a time in a process, whatever the run's concurrency: each holds up
/// to three 8 MiB parts in memory, and eight at once held 249 MiB in the bytes bench. With every
/// part held at the bucket, a run of six large outputs at concurrency 6 downloads all six and
/// starts two uploads; the others wait their turn, their files on disk. Let through, all six
/// are stored, each uploaded once.
#[tokio::test(flavor = "multi_thread")]
async fn large_uploads_go_two_at_a_time_whatever_the_run_s_concurrency() {
    let (env, s3) = large_outputs().await;
    let dir = env.dir.path();
    let items: String = (0..6).map(|i| format!("  - {{ id: i{i} }}\n")).collect();
    let yaml = PIPELINE
        .replace("  - { id: a }\n  - { id: b }\n  - { id: c }\n", &items)
        .replace("items:", "concurrency: 6\nitems:");
    write(dir, "p.yaml", &yaml);
    s3.parts.hold();
    let run = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--out", "s3://shots/runs"],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run();
    let watch = async {
        wait_until("six images downloaded and two uploads at the gate", || {
            env.sandbox.stats().downloads >= 6 && s3.parts.held() >= 2
        })
        .await;
        // Were the limit gone, the four other uploads would start as soon as their downloads
        // end, before this; with it, they start only once the gate opens, however long this.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let started = s3.answered("CreateMultipartUpload");
        s3.parts.let_through();
        started
    };
    let (o, started_at_the_gate) = tokio::join!(run, watch);
    assert_exit(&o, 0);
    assert_eq!(
        started_at_the_gate, 2,
        "uploads started while two held their parts"
    );
    let log = s3.take_requests();
    let images = |op: &str| {
        let of = log
            .iter()
            .filter(|r| r.op() == op && r.key().ends_with(".png"));
        of.count()
    };
    assert_eq!(images("CreateMultipartUpload"), 6, "each uploaded once");
    assert_eq!(images("CompleteMultipartUpload"), 6);
    assert_eq!(images("PutObject"), 0, "{log:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upload_cut_in_the_middle_of_a_part_leaves_no_object_and_the_resume_uploads_it_unpaid() {
    let (env, s3) = large_outputs().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", PIPELINE);
    let key = "runs/r/c/shot.png";
    s3.cut_uploads_to(Some(key));
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--out", "s3://shots/runs"],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 4);
    // The upload was started and its part cut halfway (each try of it: the store had begun
    // to write it), never completed.
    let log = s3.take_requests();
    let cut: Vec<_> = log
        .iter()
        .filter(|r| r.key() == key && r.op() == "UploadPart")
        .map(|r| r.cut)
        .collect();
    assert!(
        !cut.is_empty()
            && cut.iter().all(|c| c.is_some_and(|(received, length)| {
                received > 0 && received == length / 2 && length > 256 * 1024
            })),
        "{cut:?}"
    );
    let writes = writes_to(&log, key);
    assert_eq!(
        writes.first(),
        Some(&("CreateMultipartUpload", None, Some(200))),
        "{writes:?}"
    );
    let parts: Vec<_> = writes.iter().filter(|w| w.0 == "UploadPart").collect();
    assert!(
        !parts.is_empty() && parts.iter().all(|w| w.2.is_none()),
        "{writes:?}"
    );
    assert!(
        !writes.iter().any(|w| w.0 == "CompleteMultipartUpload"),
        "{writes:?}"
    );
    // Nothing is under the key: not a file of the store, not in a listing, not to a HEAD.
    assert!(!s3.file(key).exists());
    let store = s3.store();
    assert!(matches!(
        store.head(&Key::from(key)).await,
        Err(object_store::Error::NotFound { .. })
    ));
    let listed: Vec<String> = {
        use futures::TryStreamExt;
        let listing = store.list(Some(&Key::from("runs/r")));
        let metas: Vec<_> = listing.try_collect().await.unwrap();
        metas.into_iter().map(|m| m.location.to_string()).collect()
    };
    assert!(
        listed.iter().all(|k| !k.starts_with("runs/r/c/")),
        "{listed:?}"
    );
    // The run records the output without an object, its error naming the key; the job was
    // paid for once, and the others' objects are whole.
    let recorded = outputs(dir).await;
    let c = recorded.iter().find(|o| o.item == "c").unwrap();
    assert_eq!(c.path, None, "{c:?}");
    assert!(
        c.error
            .as_deref()
            .is_some_and(|e| e.contains("s3://shots/runs/r/c/shot.png")),
        "{c:?}"
    );
    let others: Vec<Recorded> = recorded.into_iter().filter(|o| o.item != "c").collect();
    assert_objects_agree(&s3, &others, "s3://shots/runs/r/").await;
    let said = both(&o);
    assert!(said.contains("s3://shots/runs/r/c/shot.png"), "{said}");
    assert!(!said.contains(SECRET_KEY), "{said}");
    let billed = env.sandbox.ledger().len();
    assert_eq!(billed, 3);

    s3.cut_uploads_to(None);
    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_eq!(env.sandbox.ledger().len(), billed, "nothing paid again");
    assert_objects_agree(&s3, &outputs(dir).await, "s3://shots/runs/r/").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_then_resumed_a_deleted_object_is_fetched_again_and_a_modified_one_kept_aside() {
    let env = start(crate::resume::sandbox_with_latency(150)).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    let items: String = (0..8).map(|i| format!("  - {{ id: i{i} }}\n")).collect();
    write(
        dir,
        "p.yaml",
        &PIPELINE.replace("  - { id: a }\n  - { id: b }\n  - { id: c }\n", &items),
    );
    // Three calls let through the sandbox's gate, the fourth held in flight: the run cannot
    // end before it is killed, however fast the machine.
    let hold = env.sandbox.hold();
    env.sandbox.let_through(3);
    let mut child = Imgpipe::on(
        &env,
        &[
            "run",
            "p.yaml",
            "--run-id",
            "r",
            "--out",
            "s3://shots/runs",
            "--concurrency",
            "1",
        ],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .command()
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_until_async(
        "three calls billed, two outputs in the bucket, the fourth call held",
        || async {
            env.sandbox.ledger().len() == 3
                && env.sandbox.held_calls() == 1
                && outputs(dir)
                    .await
                    .iter()
                    .filter(|o| o.path.is_some())
                    .count()
                    >= 2
        },
    )
    .await;
    kill_child(&mut child, "the run").await;
    crate::common::release_after_kill(&env, hold).await;
    // A call in flight at the kill finishes on the server's side, billed: the baseline is
    // taken once the service has settled every call it received.
    wait_until(
        "the service settled the calls in flight at the kill",
        || env.sandbox.in_flight() == 0,
    )
    .await;
    let before = env.sandbox.ledger().len();
    let done: Vec<Recorded> = outputs(dir)
        .await
        .into_iter()
        .filter(|o| o.path.is_some())
        .collect();
    let (deleted, modified) = (&done[0], &done[1]);
    let store = s3.store();
    store
        .delete(&key_of(deleted.path.as_deref().unwrap()))
        .await
        .unwrap();
    let users = b"the user's own edit".to_vec();
    let modified_key = key_of(modified.path.as_deref().unwrap());
    store
        .put(&modified_key, users.clone().into())
        .await
        .unwrap();

    // The dry run finds both (missing from the listing, or another size and ETag there, then
    // looked at) and touches nothing.
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stdout(&o).contains("free: 2 file(s) missing or modified"),
        "{}",
        stdout(&o)
    );
    assert_eq!(
        std::fs::read(s3.file(modified_key.as_ref())).unwrap(),
        users
    );

    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let recorded = outputs(dir).await;
    assert_eq!(recorded.len(), 8, "{recorded:?}");
    assert_objects_agree_as(&s3, &recorded, "s3://shots/runs/r/", true).await;
    // Each task is billed once: the resume paid only for what the record did not hold.
    let ledger = env.sandbox.ledger();
    let jobs: std::collections::BTreeSet<&str> = ledger.iter().map(|e| e.job_id.as_str()).collect();
    assert_eq!(jobs.len(), ledger.len());
    assert!(ledger.len() - before <= 8 - done.len(), "{ledger:#?}");
    // The user's edit is kept under _superseded/.
    let aside = std::fs::read_dir(s3.file(&format!("runs/r/_superseded/{}", modified.item)))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect::<Vec<_>>();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read(&aside[0]).unwrap(), users);
    assert!(
        aside[0].to_string_lossy().ends_with(".modified.png"),
        "{aside:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn other_schemes_exit_2_and_file_urls_are_paths() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", PIPELINE);
    for out in ["ftp://host/out", "gs://bucket/out", "s3://Bad_Bucket/x"] {
        let o = Imgpipe::on(&env, &["run", "p.yaml", "--out", out])
            .s3(&s3)
            .sqlite_in(dir)
            .retry_base_ms(20)
            .run()
            .await;
        assert_exit_without_panic(&o, 2);
        let said = stderr(&o);
        assert!(said.contains("the output place"), "{out}: {said}");
        if !out.starts_with("s3") {
            assert!(said.contains("s3://bucket/prefix"), "{out}: {said}");
        }
    }
    assert!(env.sandbox.ledger().is_empty());
    let out = format!("file://{}", dir.join("local").display());
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r", "--out", &out])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(dir.join("local/r/a/shot.png").is_file());
    assert!(dir.join("local/r/manifest.jsonl").is_file());
}

#[tokio::test(flavor = "multi_thread")]
async fn large_outputs_go_up_in_parts_and_their_completion_never_replaces_an_object() {
    // Photo-weight images of this side (about 330 KiB) are larger than what a download holds
    // in memory (256 KiB), so they go up as multipart uploads.
    let env = start(imgpipe::sandbox::Config {
        image_side: 512,
        weight: imgpipe::sandbox::Weight::Photo,
        ..config()
    })
    .await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(
        dir,
        "p.yaml",
        &PIPELINE.replace(
            "name: objects\n",
            "name: objects\noutput_dir: s3://shots/big\n",
        ),
    );
    let foreign = b"someone else's object".to_vec();
    s3.store()
        .put(&Key::from("big/r/c/shot.png"), foreign.clone().into())
        .await
        .unwrap();
    s3.take_requests();
    let o = Imgpipe::on(&env, &["run", "p.yaml", "--run-id", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    // What the store received: each output started as a multipart upload, its part put
    // (one: a part holds 8 MiB), and a completion carrying `If-None-Match: *`, which the
    // store refused where an object was already; that upload was then aborted.
    let log = s3.take_requests();
    for (item, completed) in [("a", 200), ("b", 200), ("c", 412)] {
        let key = format!("big/r/{item}/shot.png");
        let mut expected = vec![
            ("CreateMultipartUpload", None, Some(200)),
            ("UploadPart", None, Some(200)),
            ("CompleteMultipartUpload", Some("*"), Some(completed)),
        ];
        if completed == 412 {
            expected.push(("AbortMultipartUpload", None, Some(204)));
        }
        assert_eq!(writes_to(&log, &key), expected, "{key}");
    }
    assert_exit_without_panic(&o, 4);
    assert!(
        both(&o).contains("refusing to overwrite s3://shots/big/r/c/shot.png"),
        "{}",
        both(&o)
    );
    assert_eq!(std::fs::read(s3.file("big/r/c/shot.png")).unwrap(), foreign);
    let recorded = outputs(dir).await;
    let done: Vec<Recorded> = recorded.into_iter().filter(|o| o.item != "c").collect();
    assert!(
        done.iter().all(|o| o.bytes.unwrap() > 256 * 1024),
        "{done:?}"
    );
    assert_objects_agree(&s3, &done, "s3://shots/big/r/").await;
}

/// A store that cannot be used is said, with the environment variables to check, before
/// anything is recorded or paid for: one that refuses the key, one whose port is closed, and
/// one that takes the connection and never answers (bounded by the client's own request
/// timeout, `AWS_TIMEOUT`, here 1 s: the verdict is the error, not how long it took).
#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_refuses_the_key_whose_port_is_closed_or_that_never_answers_is_said_before_anything_is_paid()
 {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", PIPELINE);
    let wrong_secret = "a-wrong-secret-of-the-user";
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port())
    };
    let silent = SilentStore::start().await;
    let manifest = "s3://shots/runs/r/manifest.jsonl";
    let cases = [
        (
            "a store that never answers",
            vec![
                ("AWS_ENDPOINT", silent.url.clone()),
                ("AWS_TIMEOUT", "1s".to_owned()),
            ],
            manifest,
        ),
        (
            "a refused key",
            vec![("AWS_SECRET_ACCESS_KEY", wrong_secret.to_owned())],
            "check AWS_ACCESS_KEY_ID",
        ),
        ("a closed port", vec![("AWS_ENDPOINT", closed)], manifest),
    ];
    for (case, vars, said_what) in cases {
        let mut cmd = Imgpipe::on(
            &env,
            &["run", "p.yaml", "--run-id", "r", "--out", "s3://shots/runs"],
        )
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .command();
        cmd.envs(vars).env("IMGPIPE_LOG", "debug");
        let o = finish(cmd).await;
        assert_exit_without_panic(&o, 2);
        let said = both(&o);
        assert!(said.contains(said_what), "{case}: {said}");
        assert!(said.contains("hint: the store is set by"), "{case}: {said}");
        for secret in [wrong_secret, SECRET_KEY, ACCESS_KEY] {
            assert!(!said.contains(secret), "{secret} in:\n{said}");
        }
        assert_nothing_billed(&env);
    }
    assert!(silent.accepted() > 0, "the silent store was asked");
    let db = std::fs::read(state_path(dir)).unwrap_or_default();
    let db = String::from_utf8_lossy(&db);
    assert!(!db.contains(wrong_secret) && !db.contains(SECRET_KEY));
}

/// Credentials allowed to read and write objects but not to list the bucket are said before
/// anything is paid: without `s3:ListBucket`, S3 answers 403 for the missing manifest, the run's
/// check of the store refuses it (exit 2), and the hint names the permissions a run needs.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_whose_credentials_may_not_list_the_bucket_is_refused_before_anything_is_paid() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    write(dir, "p.yaml", PIPELINE);
    s3.deny_list_bucket();
    let ran = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--out", "s3://shots/runs"],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&ran.output, 2);
    let said = both(&ran.output);
    assert!(
        said.contains("s3://shots/runs/r/manifest.jsonl"),
        "the refused key is named: {said}"
    );
    assert!(
        said.contains("s3:ListBucket"),
        "the hint names the permission: {said}"
    );
    assert_nothing_billed(&env);
    let asked = s3.take_requests();
    assert!(
        asked
            .iter()
            .all(|r| r.kind() != "PUT" && r.kind() != "POST"),
        "nothing written to the store: {asked:?}"
    );
}

/// A store on 127.0.0.1 that accepts every connection, reads nothing and never answers; its
/// connections are held open until it is dropped.
struct SilentStore {
    url: String,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl SilentStore {
    async fn start() -> SilentStore {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = std::sync::Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(conn);
            }
        });
        SilentStore {
            url,
            accepted,
            task,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SilentStore {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs `sql` on the state database.
async fn alter_state(dir: &Path, sql: &str) {
    use sqlx::{ConnectOptions, Connection};
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(state_path(dir))
        .connect()
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

/// The requests of `log` of this kind (LIST, GET, HEAD, …), and the keys they were about.
pub(crate) fn of_kind<'a>(log: &'a [Request], kind: &str) -> Vec<&'a str> {
    log.iter()
        .filter(|r| r.kind() == kind)
        .map(Request::key)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resume_lists_the_prefix_and_looks_only_at_the_objects_that_disagree() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    const ITEMS: usize = 12;
    let items: String = (0..ITEMS)
        .map(|i| format!("  - {{ id: i{i:02} }}\n"))
        .collect();
    write(
        dir,
        "p.yaml",
        &PIPELINE.replace("  - { id: a }\n  - { id: b }\n  - { id: c }\n", &items),
    );
    // The last item's upload is cut: the run is left unfinished, for a resume to review.
    s3.cut_uploads_to(Some("runs/r/i11/"));
    let o = Imgpipe::on(
        &env,
        &["run", "p.yaml", "--run-id", "r", "--out", "s3://shots/runs"],
    )
    .s3(&s3)
    .sqlite_in(dir)
    .retry_base_ms(20)
    .run()
    .await;
    assert_exit_without_panic(&o, 4);
    s3.cut_uploads_to(None);
    let billed = env.sandbox.ledger().len();
    assert_eq!(billed, ITEMS);
    let recorded = outputs(dir).await;
    let stored: Vec<&Recorded> = recorded.iter().filter(|o| o.path.is_some()).collect();
    assert_eq!(stored.len(), ITEMS - 1, "{recorded:?}");
    assert!(
        stored
            .iter()
            .all(|o| o.etag.as_deref().is_some_and(|e| e.len() > 2)),
        "every object's ETag is recorded: {stored:?}"
    );
    let key = |i: usize| format!("runs/r/i{i:02}/shot.png");
    let store = s3.store();
    // Gone.
    store.delete(&Key::from(key(0))).await.unwrap();
    // Other bytes, under another ETag.
    let users = b"the user's own edit".to_vec();
    store
        .put(&Key::from(key(1)), users.clone().into())
        .await
        .unwrap();
    // The same bytes put again in parts by someone else: another ETag (`<md5>-1`), no
    // sha256 metadata, the bytes unchanged.
    let same_bytes = std::fs::read(s3.file(&key(2))).unwrap();
    let mut upload = store.put_multipart(&Key::from(key(2))).await.unwrap();
    upload.put_part(same_bytes.clone().into()).await.unwrap();
    upload.complete().await.unwrap();
    // The record's ETag is not the object's (as an imgpipe that kept it differently would).
    alter_state(
        dir,
        &format!(
            "UPDATE outputs SET etag = '\"0123\"' WHERE path = 's3://shots/{}'",
            key(3)
        ),
    )
    .await;
    // Recorded by an imgpipe from before ETags were kept: looked at by a HEAD, as then.
    alter_state(
        dir,
        &format!(
            "UPDATE outputs SET etag = NULL WHERE path = 's3://shots/{}'",
            key(5)
        ),
    )
    .await;
    let disagreeing: Vec<String> = [0, 1, 2, 3, 5].map(key).to_vec();
    s3.take_requests();

    // The dry run lists the prefix, looks at the five the listing does not show as recorded,
    // finds the deleted and the modified one, and touches nothing.
    let o = Imgpipe::on(&env, &["resume", "r", "--dry-run"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert!(
        stdout(&o).contains("free: 2 file(s) missing or modified"),
        "{}",
        stdout(&o)
    );
    let log = s3.take_requests();
    let counts = |log: &[Request]| {
        ["LIST", "HEAD", "GET", "PUT", "POST", "DELETE"].map(|k| (k, of_kind(log, k).len()))
    };
    eprintln!("dry run: {:?}", counts(&log));
    let lists = of_kind(&log, "LIST").len();
    assert!(lists <= ITEMS / 1000 + 1, "{lists} listings: {log:#?}");
    // Only the disagreeing objects are looked at one by one (and the manifest's key, which
    // tells whether the store answers before anything is paid).
    let looked: std::collections::BTreeSet<&str> = of_kind(&log, "HEAD")
        .into_iter()
        .chain(of_kind(&log, "GET"))
        .filter(|k| k.ends_with(".png"))
        .collect();
    assert!(
        looked.iter().all(|k| disagreeing.iter().any(|d| d == k)),
        "looked at {looked:?}"
    );
    assert!(
        of_kind(&log, "HEAD").len() <= disagreeing.len() + 1,
        "{log:#?}"
    );
    assert_eq!(
        of_kind(&log, "PUT").len() + of_kind(&log, "DELETE").len(),
        0
    );
    assert_eq!(std::fs::read(s3.file(&key(1))).unwrap(), users);

    // 10,000 other objects (notes of the user's) sort between two items: the listing reads on
    // into them for at most two pages, then starts again at the next output, rather than read
    // all ten pages of them.
    let notes = s3.file("runs/r/i04/notes");
    std::fs::create_dir_all(&notes).unwrap();
    for n in 0..10_000 {
        std::fs::write(notes.join(format!("n{n:04}.txt")), b"note").unwrap();
    }
    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    let log = s3.take_requests();
    eprintln!("resume: {:?}", counts(&log));
    let lists = of_kind(&log, "LIST").len();
    assert!(
        lists <= ITEMS / 1000 + 1 + 2,
        "{lists} listings for 10,000 other keys: {:#?}",
        of_kind(&log, "LIST")
    );
    let looked: std::collections::BTreeSet<&str> = of_kind(&log, "HEAD")
        .into_iter()
        .chain(of_kind(&log, "GET"))
        .filter(|k| k.ends_with("shot.png"))
        .collect();
    assert!(
        looked.iter().all(|k| disagreeing.iter().any(|d| d == k)),
        "looked at {looked:?}"
    );
    // Nothing billed by the resume: the deleted and modified objects came from their jobs,
    // the one whose upload was cut too.
    assert_eq!(env.sandbox.ledger().len(), billed, "nothing paid again");
    let recorded = outputs(dir).await;
    assert_eq!(recorded.len(), ITEMS);
    // The object put again in parts has no sha256 metadata; its bytes are the record's.
    assert_objects_agree_as(&s3, &recorded, "s3://shots/runs/r/", true).await;
    // Every output fetched again has its new object's ETag; a kept one keeps its record.
    let etags: Vec<bool> = recorded.iter().map(|o| o.etag.is_some()).collect();
    assert_eq!(etags, (0..ITEMS).map(|i| i != 5).collect::<Vec<_>>());
    // The same bytes are kept where they are, never replaced: no PUT to their keys.
    for k in [key(2), key(3), key(5)] {
        assert!(
            !log.iter()
                .any(|r| r.key() == k && r.kind() != "HEAD" && r.kind() != "GET"),
            "{k} written: {log:#?}"
        );
    }
    assert_eq!(std::fs::read(s3.file(&key(2))).unwrap(), same_bytes);
    // The user's edit is kept under _superseded/, the deleted object recorded as missing.
    let aside: Vec<PathBuf> = std::fs::read_dir(s3.file("runs/r/_superseded/i01"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read(&aside[0]).unwrap(), users);
    assert!(!s3.file("runs/r/_superseded/i00").exists());
    assert_eq!(
        superseded(dir).await,
        [(0, false), (1, true)].map(|(i, moved)| (format!("i{i:02}"), moved))
    );
}

/// The outputs set aside in the state database: item, and whether a file was moved.
async fn superseded(dir: &Path) -> Vec<(String, bool)> {
    use sqlx::{ConnectOptions, Connection, Row};
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(state_path(dir))
        .read_only(true)
        .connect()
        .await
        .unwrap();
    let rows = sqlx::query(
        "SELECT t.item, s.path IS NOT NULL FROM superseded_outputs s
         JOIN tasks t ON t.id = s.task_id ORDER BY t.item",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// `imgpipe ARGS` against `env`'s sandbox and `s3`, its state in `env`'s directory, to spawn.
fn on_s3(env: &Env, s3: &S3, args: &[&str]) -> tokio::process::Command {
    Imgpipe::on(env, args)
        .s3(s3)
        .sqlite_in(env.dir.path())
        .retry_base_ms(20)
        .command()
}

/// The run's status as recorded.
async fn run_status(dir: &Path) -> String {
    use sqlx::Connection;
    let mut conn = read_state(dir).await;
    let (status,): (String,) = sqlx::query_as("SELECT status FROM runs WHERE id = 'r'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    status
}

/// A run of [`TAKEOVER_ITEMS`] items into the bucket, killed with three calls billed (two of
/// their outputs stored), then one stored object deleted and another one's bytes replaced by
/// the user's: a pod lost, its outputs changed, for another to take over.
struct Lost {
    deleted: Recorded,
    modified: Recorded,
    /// The bytes the user put in the modified one's place.
    users: Vec<u8>,
}

const TAKEOVER_ITEMS: usize = 8;

async fn lost_with_two_objects_changed(env: &Env, s3: &S3) -> Lost {
    let dir = env.dir.path();
    let items: String = (0..TAKEOVER_ITEMS)
        .map(|i| format!("  - {{ id: i{i} }}\n"))
        .collect();
    write(
        dir,
        "p.yaml",
        &PIPELINE.replace("  - { id: a }\n  - { id: b }\n  - { id: c }\n", &items),
    );
    let hold = env.sandbox.hold();
    env.sandbox.let_through(3);
    let args = [
        "run",
        "p.yaml",
        "--run-id",
        "r",
        "--out",
        "s3://shots/runs",
        "--concurrency",
        "1",
    ];
    let mut child = on_s3(env, s3, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stored = || async {
        let recorded = outputs(dir).await;
        recorded.iter().filter(|o| o.path.is_some()).count()
    };
    wait_until_async(
        "three calls billed, two outputs in the bucket, the fourth call held",
        || async {
            env.sandbox.ledger().len() == 3 && env.sandbox.held_calls() == 1 && stored().await >= 2
        },
    )
    .await;
    kill_child(&mut child, "the run").await;
    release_after_kill(env, hold).await;
    wait_until(
        "the service settled the calls in flight at the kill",
        || env.sandbox.in_flight() == 0,
    )
    .await;
    // The call held at the kill was billed for nobody (never delivered): it is paid again.
    assert_eq!(delivered(env), 3);
    let mut done = outputs(dir).await.into_iter().filter(|o| o.path.is_some());
    let (deleted, modified) = (done.next().unwrap(), done.next().unwrap());
    let store = s3.store();
    store
        .delete(&key_of(deleted.path.as_deref().unwrap()))
        .await
        .unwrap();
    let users = b"the user's own edit".to_vec();
    store
        .put(
            &key_of(modified.path.as_deref().unwrap()),
            users.clone().into(),
        )
        .await
        .unwrap();
    Lost {
        deleted,
        modified,
        users,
    }
}

/// The bills the service delivered: a call held at a kill is billed, for nobody.
fn delivered(env: &Env) -> usize {
    env.sandbox.ledger().iter().filter(|e| e.delivered).count()
}

/// The object at a recorded URL, `None` when there is none.
async fn object_bytes(s3: &S3, url: &str) -> Option<Vec<u8>> {
    match s3.store().get(&key_of(url)).await {
        Ok(found) => Some(found.bytes().await.unwrap().to_vec()),
        Err(object_store::Error::NotFound { .. }) => None,
        Err(e) => panic!("{url}: {e}"),
    }
}

/// What a takeover must have done once its check ended: the deleted object fetched again, the
/// modified one's bytes set aside once under `_superseded/` and replaced by the recorded ones,
/// every output stored as recorded, each task billed once (and `kills` calls in flight at a
/// kill billed for nobody).
async fn assert_taken_over(env: &Env, s3: &S3, lost: &Lost, kills: usize) {
    let dir = env.dir.path();
    let recorded = outputs(dir).await;
    assert_eq!(recorded.len(), TAKEOVER_ITEMS, "{recorded:?}");
    assert_objects_agree_as(s3, &recorded, "s3://shots/runs/r/", true).await;
    let aside = std::fs::read_dir(s3.file(&format!("runs/r/_superseded/{}", lost.modified.item)))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect::<Vec<_>>();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read(&aside[0]).unwrap(), lost.users);
    let ledger = env.sandbox.ledger();
    let jobs: std::collections::BTreeSet<&str> = ledger.iter().map(|e| e.job_id.as_str()).collect();
    assert_eq!(jobs.len(), ledger.len());
    assert_eq!(
        delivered(env),
        TAKEOVER_ITEMS,
        "each task billed once: {ledger:#?}"
    );
    assert_eq!(ledger.len(), TAKEOVER_ITEMS + kills, "{ledger:#?}");
    assert_eq!(run_status(dir).await, "succeeded");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_pays_while_its_listing_is_held_and_ends_only_once_its_check_has() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    let lost = lost_with_two_objects_changed(&env, &s3).await;

    // The check's listing is held: the takeover pays for every task left all the same.
    s3.lists.hold();
    let mut child = on_s3(&env, &s3, &["resume", "r"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let paid_for = || async {
        let recorded = outputs(dir).await;
        let stored = recorded.iter().filter(|o| o.path.is_some()).count();
        // Every task paid for and its output stored; the two changed ones are still recorded
        // as they were, the check having found nothing yet.
        recorded.len() == TAKEOVER_ITEMS && stored == TAKEOVER_ITEMS
    };
    wait_until_async(
        "every task left paid for and stored while the listing is held",
        || async { s3.lists.held() >= 1 && delivered(&env) == TAKEOVER_ITEMS && paid_for().await },
    )
    .await;
    // Nothing left to pay for, and yet the run goes on: its check has not answered.
    assert!(s3.lists.held() >= 1);
    assert!(
        child.try_wait().unwrap().is_none(),
        "the takeover ended before its check did"
    );
    assert_eq!(run_status(dir).await, "running");
    assert_eq!(
        object_bytes(&s3, lost.deleted.path.as_deref().unwrap()).await,
        None
    );
    assert_eq!(
        object_bytes(&s3, lost.modified.path.as_deref().unwrap()).await,
        Some(lost.users.clone())
    );

    s3.lists.let_through();
    let status = wait_child(&mut child, WAIT_LIMIT, "the takeover").await;
    let mut log = String::new();
    use tokio::io::AsyncReadExt;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert_taken_over(&env, &s3, &lost, 1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_killed_during_its_check_is_taken_over_again_and_pays_nothing_twice() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    let lost = lost_with_two_objects_changed(&env, &s3).await;

    // The takeover pays for one more task, holds a second call in flight, and is killed while
    // its check waits for the listing.
    s3.lists.hold();
    let hold = env.sandbox.hold();
    env.sandbox.let_through(1);
    let args = ["resume", "r", "--concurrency", "1"];
    let mut child = on_s3(&env, &s3, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(
        "a call paid and another held while the listing is held",
        || s3.lists.held() >= 1 && delivered(&env) == 4 && env.sandbox.held_calls() == 1,
    )
    .await;
    kill_child(&mut child, "the takeover").await;
    release_after_kill(&env, hold).await;
    s3.lists.let_through();
    wait_until(
        "the service settled the calls in flight at the kill",
        || env.sandbox.in_flight() == 0,
    )
    .await;

    // Another takeover: it checks again what the first could not, and pays only for the rest.
    let o = Imgpipe::on(&env, &["resume", "r"])
        .s3(&s3)
        .sqlite_in(dir)
        .retry_base_ms(20)
        .run()
        .await;
    assert_exit_without_panic(&o, 0);
    assert_taken_over(&env, &s3, &lost, 2).await;
}

/// A takeover that must first fetch again an output its killed run paid for and could not
/// keep sends no call before that output is stored (the proof that the place takes writes):
/// the check of the kept outputs, many listings at once, waits for that proof too, so the
/// write the first paid call waits for never queues behind them.
#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_stores_what_its_killed_run_left_unstored_before_its_check_lists_anything() {
    let env = start(config()).await;
    let s3 = S3::start().await;
    let dir = env.dir.path();
    let lost = lost_with_two_objects_changed(&env, &s3).await;
    // A third output as a kill in the middle of its download leaves it: paid, not stored.
    let unstored = outputs(dir)
        .await
        .into_iter()
        .find(|o| o.item != lost.deleted.item && o.item != lost.modified.item)
        .expect("a third output recorded");
    if let Some(path) = &unstored.path {
        s3.store().delete(&key_of(path)).await.unwrap();
    }
    let item = &unstored.item;
    alter_state(
        dir,
        &format!(
            "UPDATE outputs SET path = NULL, sha256 = NULL, bytes = NULL, etag = NULL
             WHERE task_id IN (SELECT id FROM tasks WHERE run_id = 'r' AND item = '{item}')"
        ),
    )
    .await;
    s3.take_requests();

    let o = on_s3(&env, &s3, &["resume", "r"]).output().await.unwrap();
    assert_exit_without_panic(&o, 0);
    let log = s3.take_requests();
    let first_list = log
        .iter()
        .position(|r| r.kind() == "LIST")
        .expect("the check listed the prefix");
    let put = log
        .iter()
        .position(|r| r.kind() == "PUT" && r.key().contains(&format!("/{item}/")))
        .unwrap_or_else(|| panic!("no PUT of {item}'s output: {log:#?}"));
    assert!(
        put < first_list,
        "the check listed (request {first_list}) before the unstored output was stored (request {put}): {log:#?}"
    );
    assert_taken_over(&env, &s3, &lost, 1).await;
}
