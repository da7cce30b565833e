//! s3s-fs with listings that give each object's ETag, as S3's do: shared by the tests'
//! S3 server (`tests/it/objects.rs`) and the benches' (`benches/support`), so that a resume's
//! check by listing meets what it would on S3 (s3s-fs's own listings give no ETag, and every
//! object would fall back to a HEAD).

/// Delegates the S3 operations the tests use to s3s-fs, except the listing (below).
macro_rules! delegate_to_fs {
    ($($op:ident: $input:ident => $output:ident),* $(,)?) => {
        #[async_trait::async_trait]
        impl s3s::S3 for ListingETags {
            $(async fn $op(
                &self,
                req: s3s::S3Request<s3s::dto::$input>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::$output>> {
                self.0.$op(req).await
            })*

            async fn list_objects_v2(
                &self,
                req: s3s::S3Request<s3s::dto::ListObjectsV2Input>,
            ) -> s3s::S3Result<s3s::S3Response<s3s::dto::ListObjectsV2Output>> {
                self.list_with_etags(req).await
            }
        }
    };
}

/// s3s-fs, whose listings give each object's ETag as S3's do (s3s-fs's own give none): the
/// ETag its HEAD gives, the MD5 of a single PUT's bytes or the multipart form `<md5>-<parts>`.
pub struct ListingETags(pub s3s_fs::FileSystem);

delegate_to_fs! {
    abort_multipart_upload: AbortMultipartUploadInput => AbortMultipartUploadOutput,
    complete_multipart_upload: CompleteMultipartUploadInput => CompleteMultipartUploadOutput,
    copy_object: CopyObjectInput => CopyObjectOutput,
    create_multipart_upload: CreateMultipartUploadInput => CreateMultipartUploadOutput,
    delete_object: DeleteObjectInput => DeleteObjectOutput,
    delete_objects: DeleteObjectsInput => DeleteObjectsOutput,
    get_object: GetObjectInput => GetObjectOutput,
    head_bucket: HeadBucketInput => HeadBucketOutput,
    head_object: HeadObjectInput => HeadObjectOutput,
    list_parts: ListPartsInput => ListPartsOutput,
    put_object: PutObjectInput => PutObjectOutput,
    upload_part: UploadPartInput => UploadPartOutput,
}

impl ListingETags {
    async fn list_with_etags(
        &self,
        req: s3s::S3Request<s3s::dto::ListObjectsV2Input>,
    ) -> s3s::S3Result<s3s::S3Response<s3s::dto::ListObjectsV2Output>> {
        use s3s::S3;
        let bucket = req.input.bucket.clone();
        let (uri, credentials) = (req.uri.clone(), req.credentials.clone());
        let mut listed = self.0.list_objects_v2(req).await?;
        for object in listed.output.contents.iter_mut().flatten() {
            let Some(key) = object.key.clone() else {
                continue;
            };
            let head = s3s::S3Request {
                input: s3s::dto::HeadObjectInput {
                    bucket: bucket.clone(),
                    key,
                    ..Default::default()
                },
                method: http::Method::HEAD,
                uri: uri.clone(),
                headers: Default::default(),
                extensions: Default::default(),
                credentials: credentials.clone(),
                region: None,
                service: None,
                trailing_headers: None,
            };
            object.e_tag = self.0.head_object(head).await?.output.e_tag;
        }
        Ok(listed)
    }
}
