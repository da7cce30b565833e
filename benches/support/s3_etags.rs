//! s3s-fs with listings that give each object's ETag, as S3's do: shared by the tests'
//! S3 server (`tests/it/objects.rs`) and the benches' (`benches/support`), so that a resume's
//! check by listing meets what it would on S3 (s3s-fs's own listings give no ETag, and every
//! object would fall back to a HEAD), and a page costs what it holds, as on S3 (s3s-fs's own
//! listing walks the whole bucket for every page).

/// Delegates the S3 operations the tests use to s3s-fs, except the listing (below).
macro_rules! delegate_to_fs {
    ($($op:ident: $input:ident => $output:ident),* $(,)?) => {
        #[async_trait::async_trait]
        impl s3s::S3 for ListingETags {
            $(async fn $op(
                &self,
                req: s3s::S3Request<s3s::dto::$input>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::$output>> {
                self.fs.$op(req).await
            })*

            async fn list_objects_v2(
                &self,
                req: s3s::S3Request<s3s::dto::ListObjectsV2Input>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::ListObjectsV2Output>> {
                self.list_with_etags(req).await
            }

            async fn put_object(
                &self,
                req: s3s::S3Request<s3s::dto::PutObjectInput>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::PutObjectOutput>> {
                let name = (req.input.bucket.clone(), req.input.key.clone());
                let put = self.fs.put_object(req).await?;
                self.remember(name, put.output.e_tag.clone());
                Ok(put)
            }

            async fn complete_multipart_upload(
                &self,
                req: s3s::S3Request<s3s::dto::CompleteMultipartUploadInput>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::CompleteMultipartUploadOutput>> {
                let name = (req.input.bucket.clone(), req.input.key.clone());
                let put = self.fs.complete_multipart_upload(req).await?;
                self.remember(name, put.output.e_tag.clone());
                Ok(put)
            }
        }
    };
}

/// s3s-fs, whose listings give each object's ETag as S3's do (s3s-fs's own give none): the
/// ETag its HEAD gives, the MD5 of a single PUT's bytes or the multipart form `<md5>-<parts>`.
pub struct ListingETags {
    fs: s3s_fs::FileSystem,
    /// The directory s3s-fs serves, for the listings walked here.
    root: std::path::PathBuf,
    /// The ETags already looked up, by bucket and key, with the size and time of the file they
    /// were looked up for (see [`ListingETags::remembering`]).
    known: Option<std::sync::Mutex<std::collections::HashMap<String, Remembered>>>,
}

/// An object's ETag, and the size and modification time of its file when it was read.
#[derive(Clone)]
struct Remembered {
    size: u64,
    modified: std::time::SystemTime,
    e_tag: Option<s3s::dto::ETag>,
}

delegate_to_fs! {
    abort_multipart_upload: AbortMultipartUploadInput => AbortMultipartUploadOutput,
    copy_object: CopyObjectInput => CopyObjectOutput,
    create_multipart_upload: CreateMultipartUploadInput => CreateMultipartUploadOutput,
    delete_object: DeleteObjectInput => DeleteObjectOutput,
    delete_objects: DeleteObjectsInput => DeleteObjectsOutput,
    get_object: GetObjectInput => GetObjectOutput,
    head_bucket: HeadBucketInput => HeadBucketOutput,
    head_object: HeadObjectInput => HeadObjectOutput,
    list_parts: ListPartsInput => ListPartsOutput,
    upload_part: UploadPartInput => UploadPartOutput,
}

impl ListingETags {
    /// s3s-fs over the directory `root` (its buckets are the directories in it).
    pub fn new(root: &std::path::Path) -> std::io::Result<ListingETags> {
        let fs =
            s3s_fs::FileSystem::new(root).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
        Ok(ListingETags {
            fs,
            root: root.to_path_buf(),
            known: None,
        })
    }

    /// The same server, remembering each object's ETag while its file keeps its size and time,
    /// as S3 keeps an object's ETag: without it, every listing reads a metadata file per key
    /// (s3s-fs keeps the ETag there), which is this server's cost, not a store's. For the
    /// benches only: the tests change objects behind the server's back.
    #[allow(dead_code)]
    pub fn remembering(mut self) -> ListingETags {
        self.known = Some(Default::default());
        self
    }

    /// Remembers the ETag an object was just written with, as S3 keeps it (when remembering).
    fn remember(&self, (bucket, key): (String, String), e_tag: Option<s3s::dto::ETag>) {
        let Some(known) = &self.known else { return };
        let Ok(meta) = std::fs::metadata(self.root.join(&bucket).join(&key)) else {
            return;
        };
        let Ok(modified) = meta.modified() else {
            return;
        };
        let r = Remembered {
            size: meta.len(),
            modified,
            e_tag,
        };
        known
            .lock()
            .expect("the ETags")
            .insert(format!("{bucket}/{key}"), r);
    }

    /// The ETag of `bucket/key`, whose file has `size` and `modified`, by a HEAD unless
    /// remembered.
    async fn e_tag(
        &self,
        head: s3s::S3Request<s3s::dto::HeadObjectInput>,
        size: u64,
        modified: std::time::SystemTime,
    ) -> s3s::S3Result<(Option<s3s::dto::ETag>, Option<s3s::dto::Timestamp>)> {
        use s3s::S3;
        let name = format!("{}/{}", head.input.bucket, head.input.key);
        let remembered = self.known.as_ref().and_then(|known| {
            let known = known.lock().expect("the ETags");
            known
                .get(&name)
                .filter(|r| r.size == size && r.modified == modified)
                .cloned()
        });
        if let Some(r) = remembered {
            return Ok((r.e_tag, Some(s3s::dto::Timestamp::from(modified))));
        }
        let head = self.fs.head_object(head).await?.output;
        if let Some(known) = &self.known {
            let e_tag = head.e_tag.clone();
            let r = Remembered {
                size,
                modified,
                e_tag,
            };
            known.lock().expect("the ETags").insert(name, r);
        }
        Ok((head.e_tag, head.last_modified))
    }

    /// A page of a listing without a delimiter, walked in key order from where the page
    /// starts (s3s-fs walks the whole bucket for every page, which made a listing of a large
    /// run the bench's bottleneck rather than imgpipe's), each object with the ETag its HEAD
    /// gives. Listings with a delimiter are s3s-fs's own.
    async fn list_with_etags(
        &self,
        req: s3s::S3Request<s3s::dto::ListObjectsV2Input>,
    ) -> s3s::S3Result<s3s::S3Response<s3s::dto::ListObjectsV2Output>> {
        use s3s::S3;
        if req.input.delimiter.is_some() {
            return self.fs.list_objects_v2(req).await;
        }
        let input = req.input.clone();
        let bucket_root = self.root.join(&input.bucket);
        if !bucket_root.is_dir() {
            return Err(s3s::s3_error!(NoSuchBucket));
        }
        let prefix = input.prefix.clone().unwrap_or_default();
        let after = match (&input.continuation_token, &input.start_after) {
            (Some(t), Some(s)) => t.max(s).clone(),
            (Some(t), None) => t.clone(),
            (None, Some(s)) => s.clone(),
            (None, None) => String::new(),
        };
        let max_keys = usize::try_from(input.max_keys.unwrap_or(1000)).unwrap_or(1000);
        let page = Page {
            prefix: &prefix,
            after: &after,
            want: max_keys + 1,
        };
        let mut found = Vec::new();
        page.walk(&bucket_root, "", &mut found)
            .map_err(|e| s3s::s3_error!(InternalError, "cannot list: {e}"))?;
        let truncated = found.len() > max_keys;
        found.truncate(max_keys);
        let mut contents = Vec::with_capacity(found.len());
        for (key, size, modified) in found {
            let head = s3s::S3Request {
                input: s3s::dto::HeadObjectInput {
                    bucket: input.bucket.clone(),
                    key: key.clone(),
                    ..Default::default()
                },
                method: http::Method::HEAD,
                uri: req.uri.clone(),
                headers: Default::default(),
                extensions: Default::default(),
                credentials: req.credentials.clone(),
                region: None,
                service: None,
                trailing_headers: None,
            };
            let (e_tag, last_modified) = self.e_tag(head, size, modified).await?;
            contents.push(s3s::dto::Object {
                key: Some(key),
                size: Some(i64::try_from(size).unwrap_or(i64::MAX)),
                e_tag,
                last_modified,
                ..Default::default()
            });
        }
        let output = s3s::dto::ListObjectsV2Output {
            name: Some(input.bucket),
            prefix: input.prefix,
            start_after: input.start_after,
            continuation_token: input.continuation_token,
            max_keys: input.max_keys,
            key_count: Some(i32::try_from(contents.len()).unwrap_or(i32::MAX)),
            is_truncated: Some(truncated),
            next_continuation_token: truncated
                .then(|| contents.last().and_then(|o| o.key.clone()))
                .flatten(),
            contents: Some(contents),
            ..Default::default()
        };
        Ok(s3s::S3Response::new(output))
    }
}

/// Which keys a page of a listing wants: under `prefix`, after `after`, `want` at most.
struct Page<'a> {
    prefix: &'a str,
    after: &'a str,
    want: usize,
}

impl Page<'_> {
    /// Adds the keys under `dir` (whose keys start with `dir_key`) to `found`, in S3's order
    /// (by bytes): a directory's children sorted as their keys sort, a subdirectory as its
    /// name and `/`, and a subtree skipped whole when none of its keys can be on the page.
    fn walk(
        &self,
        dir: &std::path::Path,
        dir_key: &str,
        found: &mut Vec<(String, u64, std::time::SystemTime)>,
    ) -> std::io::Result<()> {
        let mut children = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let kind = entry.file_type()?;
            let key = if kind.is_dir() {
                format!("{dir_key}{name}/")
            } else {
                format!("{dir_key}{name}")
            };
            children.push((key, entry.path(), kind.is_dir()));
        }
        children.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        for (key, path, is_dir) in children {
            if found.len() >= self.want {
                return Ok(());
            }
            if is_dir {
                let after_all = key.as_str() < self.after && !self.after.starts_with(&key);
                let on_prefix = key.starts_with(self.prefix) || self.prefix.starts_with(&key);
                if !after_all && on_prefix {
                    self.walk(&path, &key, found)?;
                }
            } else if key.as_str() > self.after && key.starts_with(self.prefix) {
                let meta = std::fs::metadata(&path)?;
                found.push((key, meta.len(), meta.modified()?));
            }
        }
        Ok(())
    }
}
