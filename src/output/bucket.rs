//! Object storage: the one door to it (`Bucket`), over Apache Arrow's `object_store` — S3
//! and S3-compatible stores, a local folder (`file://`), memory (`memory://`, tests).
//!
//! Invariants: an uploaded object is visible whole or not at all (a single PUT, or a
//! multipart upload completed only after every part; aborted on failure); a write to a
//! `file://` store is fsynced (the file, then its folder) before it returns, so a record
//! never outlives the bytes it names across a power cut; a conditional create whose
//! answer was lost and that finds its own bytes in place reports them as its own, never
//! as someone else's, and one refused for a conflict in progress (S3's 409
//! `ConditionalRequestConflict`) with nothing in place is tried again; credentials come from the environment or the store's
//! own chain and are never in a `Debug`, an error or a log (only the URL as given is): the
//! store's error text (which may echo the request: S3's `SignatureDoesNotMatch` carries the
//! key id and the canonical request with the session token) is redacted
//! ([`crate::secrets`]) before it becomes a [`BucketError`]; an object is read into memory
//! only up to a stated size ([`Bucket::get_capped`]); a download never writes through a
//! name someone else planted (created exclusively, without following a symlink, 0600).

pub use crate::config::BucketOptions;
use bytes::Bytes;
use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Parts of a multipart upload, and the size under which one PUT is used instead.
const PART_BYTES: usize = 8 << 20;
/// Parts in flight per upload.
const PARTS_IN_FLIGHT: usize = 4;
/// Tries of a conditional create whose request failed in transit (the store's own retries
/// do not repeat a request that is not idempotent).
const CREATE_TRIES: u32 = 8;

/// Failures of object storage; each names the URL or the key.
#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("{url}: {detail}")]
    Url { url: String, detail: String },
    /// The store's error, as text with every credential redacted (not the error itself:
    /// its chain would print what the store echoed).
    #[error("{url}: {op} {key}: {detail}")]
    Store {
        url: String,
        op: &'static str,
        key: String,
        detail: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{url}: {key}: more than {limit} bytes, more than spool ever writes there; not read")]
    TooLarge {
        url: String,
        key: String,
        limit: u64,
    },
}

/// A credential's value shorter than this is not looked for in the store's text (it would
/// mangle ordinary words); AWS's key ids (20), secrets (40) and session tokens are longer,
/// and credential-shaped fields are redacted whatever their length.
const MIN_SECRET_CHARS: usize = 8;

/// The values among the `AWS_*` settings that are credentials.
fn store_secrets(env: &[(String, String)]) -> crate::secrets::Secrets {
    crate::secrets::Secrets::new(
        env.iter()
            .filter(|(k, v)| {
                k.starts_with("AWS_")
                    && (k.contains("KEY") || k.contains("SECRET") || k.contains("TOKEN"))
                    && !k.ends_with("_FILE")
                    && v.chars().count() >= MIN_SECRET_CHARS
            })
            .map(|(_, v)| v),
    )
}

/// An object-store error's text and its causes, redacted.
fn redacted(secrets: &crate::secrets::Secrets, e: &object_store::Error) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(c) = cur {
        let c_text = c.to_string();
        if !s.contains(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        cur = c.source();
    }
    secrets.redact(&s)
}

/// The hex sha256 of a file: what an upload reports and a manifest records.
pub fn sha256_file(path: &Path) -> Result<String, BucketError> {
    let io = |source| BucketError::Io {
        path: path.into(),
        source,
    };
    let mut h = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path).map_err(io)?, &mut h).map_err(io)?;
    Ok(crate::config::hex(&h.finalize()))
}

/// Whether a configured location is an object-store URL rather than a path.
pub fn is_url(s: &str) -> bool {
    s.starts_with("s3://") || s.starts_with("file://") || s.starts_with("memory://")
}

/// An upload's size and checksum, computed while streaming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    pub bytes: u64,
    pub sha256: String,
}

/// The outcome of [`Bucket::create`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    /// The object holds the bytes given: created now, or by an earlier try of this call.
    Mine,
    /// Someone else's object was there first; its bytes.
    Theirs(Bytes),
}

/// Requests made through one [`Bucket`], by kind (a listing counts a request per 1,000
/// keys, as S3 pages them; the store's own retries are not counted).
#[derive(Debug, Default)]
struct Counts {
    get: AtomicU64,
    put: AtomicU64,
    list: AtomicU64,
    head: AtomicU64,
    copy: AtomicU64,
    delete: AtomicU64,
}

/// A snapshot of [`Counts`], for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RequestCounts {
    pub get: u64,
    pub put: u64,
    pub list: u64,
    pub head: u64,
    pub copy: u64,
    pub delete: u64,
}

impl RequestCounts {
    /// Every request.
    pub fn total(&self) -> u64 {
        self.get + self.put + self.list + self.head + self.copy + self.delete
    }
}

impl std::fmt::Display for RequestCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests (get {}, put {}, list {}, head {}, copy {}, delete {})",
            self.total(),
            self.get,
            self.put,
            self.list,
            self.head,
            self.copy,
            self.delete
        )
    }
}

/// An object-store location: a store and a root prefix; keys are relative to the root.
pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    root: String,
    url: String,
    /// The credentials from the environment, redacted from every error.
    secrets: crate::secrets::Secrets,
    counts: Counts,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket").field("url", &self.url).finish()
    }
}

impl Bucket {
    /// Opens `s3://bucket/prefix` (settings from `AWS_*` then `opts`), `file:///dir` (created
    /// if missing) or `memory://`.
    pub fn open(url: &str, opts: &BucketOptions) -> Result<Bucket, BucketError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::open_with_env(url, opts, &env)
    }

    /// As [`Bucket::open`], with the `AWS_*` settings taken from `env` rather than the
    /// process environment (tests each talk to their own endpoint).
    pub fn open_with_env(
        url: &str,
        opts: &BucketOptions,
        env: &[(String, String)],
    ) -> Result<Bucket, BucketError> {
        let bad = |detail: &str| BucketError::Url {
            url: url.into(),
            detail: detail.into(),
        };
        let secrets = store_secrets(env);
        let store_err = |source: object_store::Error| BucketError::Store {
            url: url.into(),
            op: "open",
            key: String::new(),
            detail: redacted(&secrets, &source),
        };
        let trimmed = url.trim_end_matches('/');
        if let Some(rest) = trimmed.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("no bucket name (s3://bucket/prefix)"));
            }
            // The store's HTTP client is reqwest over rustls with no provider of its own.
            crate::crypto::install_provider();
            let mut b = object_store::aws::AmazonS3Builder::new();
            for (k, v) in env.iter().filter(|(k, _)| k.starts_with("AWS_")) {
                if let Ok(key) = k.to_ascii_lowercase().parse() {
                    b = b.with_config(key, v);
                }
            }
            let mut b = b.with_bucket_name(bucket);
            if let Some(e) = &opts.endpoint {
                b = b.with_endpoint(e);
            }
            if let Some(r) = &opts.region {
                b = b.with_region(r);
            }
            let var = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            let endpoint = opts
                .endpoint
                .clone()
                .or_else(|| var("AWS_ENDPOINT_URL"))
                .or_else(|| var("AWS_ENDPOINT"));
            let http = endpoint.is_some_and(|e| e.starts_with("http://"));
            let retry = object_store::RetryConfig {
                max_retries: opts.max_retries.unwrap_or(10),
                retry_timeout: Duration::from_secs_f64(opts.retry_timeout_s.unwrap_or(180.0)),
                backoff: Default::default(),
            };
            // allow_http is a client option: set here, as the options replace the builder's.
            let client = object_store::ClientOptions::new()
                .with_allow_http(opts.allow_http.unwrap_or(http))
                .with_timeout(Duration::from_secs_f64(opts.timeout_s.unwrap_or(60.0)))
                .with_connect_timeout(Duration::from_secs(10));
            let store = b
                .with_retry(retry)
                .with_client_options(client)
                .build()
                .map_err(store_err)?;
            Ok(Bucket {
                store: Arc::new(store),
                root: prefix.trim_matches('/').to_string(),
                url: url.into(),
                secrets,
                counts: Counts::default(),
            })
        } else if let Some(dir) = trimmed.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(bad("a file:// URL needs an absolute path (file:///dir)"));
            }
            std::fs::create_dir_all(dir).map_err(|source| BucketError::Io {
                path: dir.into(),
                source,
            })?;
            // Durable before a write returns: object_store's local store does not sync by
            // default, and a commit record must never outlive its shard's bytes.
            let store = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(store_err)?
                .with_fsync(true);
            Ok(Bucket {
                store: Arc::new(store),
                root: String::new(),
                url: url.into(),
                secrets,
                counts: Counts::default(),
            })
        } else if url.starts_with("memory://") {
            Ok(Bucket {
                store: Arc::new(object_store::memory::InMemory::new()),
                root: String::new(),
                url: url.into(),
                secrets,
                counts: Counts::default(),
            })
        } else {
            Err(bad("not an object-store URL (s3://, file:// or memory://)"))
        }
    }

    /// The URL as given (no credentials are ever part of it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Requests made so far, by kind.
    pub fn request_counts(&self) -> RequestCounts {
        let c = &self.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RequestCounts {
            get: n(&c.get),
            put: n(&c.put),
            list: n(&c.list),
            head: n(&c.head),
            copy: n(&c.copy),
            delete: n(&c.delete),
        }
    }

    /// Requests made so far.
    pub fn requests(&self) -> u64 {
        self.request_counts().total()
    }

    fn count(&self, a: &AtomicU64) {
        a.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the store honours conditional creates: a second create of one key with
    /// other bytes must be refused. A store that overwrites instead (an S3-compatible
    /// store or proxy that ignores `If-None-Match`) would let two writers take one
    /// sequence number; `key` is removed afterwards.
    pub async fn honours_conditional_creates(&self, key: &str) -> Result<bool, BucketError> {
        let first = Bytes::from(format!("spool probe {key} first"));
        let second = Bytes::from(format!("spool probe {key} second"));
        let a = self.create(key, first).await?;
        let b = self.create(key, second).await?;
        let _ = self.delete(key).await;
        Ok(a == Created::Mine && matches!(b, Created::Theirs(_)))
    }

    fn path(&self, key: &str) -> ObjPath {
        let key = key.trim_start_matches('/');
        if self.root.is_empty() {
            ObjPath::from(key)
        } else {
            ObjPath::from(format!("{}/{key}", self.root))
        }
    }

    fn err<'a>(
        &'a self,
        op: &'static str,
        key: &'a str,
    ) -> impl FnOnce(object_store::Error) -> BucketError + 'a {
        move |source| BucketError::Store {
            url: self.url.clone(),
            op,
            key: key.into(),
            detail: redacted(&self.secrets, &source),
        }
    }

    /// Uploads a local file to `key`, streamed (multipart above one part); the object
    /// appears only once whole. Returns its size and sha256.
    pub async fn upload(&self, key: &str, local: &Path) -> Result<Uploaded, BucketError> {
        let io = |source| BucketError::Io {
            path: local.into(),
            source,
        };
        let mut file = std::fs::File::open(local).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut hash = Sha256::new();
        self.count(&self.counts.put);
        if len <= PART_BYTES as u64 {
            let mut data = Vec::with_capacity(len as usize);
            file.read_to_end(&mut data).map_err(io)?;
            hash.update(&data);
            let n = data.len() as u64;
            self.store
                .put(&self.path(key), PutPayload::from(data))
                .await
                .map_err(self.err("upload", key))?;
            return Ok(Uploaded {
                bytes: n,
                sha256: crate::config::hex(&hash.finalize()),
            });
        }
        let upload = self
            .store
            .put_multipart(&self.path(key))
            .await
            .map_err(self.err("upload", key))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        let result: Result<(), BucketError> = async {
            loop {
                let got = file.read(&mut buf).map_err(io)?;
                if got == 0 {
                    return Ok(());
                }
                hash.update(&buf[..got]);
                n += got as u64;
                w.wait_for_capacity(PARTS_IN_FLIGHT)
                    .await
                    .map_err(self.err("upload", key))?;
                w.write(&buf[..got]);
            }
        }
        .await;
        match result {
            Ok(()) => {
                w.finish().await.map_err(self.err("upload", key))?;
            }
            Err(e) => {
                let _ = w.abort().await;
                return Err(e);
            }
        }
        Ok(Uploaded {
            bytes: n,
            sha256: crate::config::hex(&hash.finalize()),
        })
    }

    /// Creates `key` with `body` only if it does not exist (`If-None-Match: *`).
    pub async fn create(&self, key: &str, body: Bytes) -> Result<Created, BucketError> {
        let mut tries = 0;
        loop {
            tries += 1;
            let opts = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            self.count(&self.counts.put);
            match self
                .store
                .put_opts(&self.path(key), PutPayload::from(body.clone()), opts)
                .await
            {
                Ok(_) => return Ok(Created::Mine),
                // object_store reports S3's 409 (a conflicting conditional write in
                // progress) as AlreadyExists: whether someone's object is there decides.
                Err(
                    e @ (object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. }),
                ) => match self.get(key).await? {
                    Some(existing) if existing == body => return Ok(Created::Mine),
                    Some(existing) => return Ok(Created::Theirs(existing)),
                    None if tries >= CREATE_TRIES => return Err(self.err("create", key)(e)),
                    None => {
                        tracing::debug!(url = %self.url, key, tries, error = %redacted(&self.secrets, &e),
                            "conditional create refused for a conflict in progress; trying again");
                        tokio::time::sleep(Duration::from_millis(50 << tries.min(6))).await;
                    }
                },
                Err(e @ object_store::Error::NotImplemented { .. }) => {
                    return Err(self.err("create", key)(e))
                }
                Err(e) if tries >= CREATE_TRIES => return Err(self.err("create", key)(e)),
                Err(e) => {
                    // The request may or may not have landed: try again; finding our
                    // own bytes there then means it did.
                    tracing::warn!(url = %self.url, key, tries, error = %redacted(&self.secrets, &e),
                        "conditional create failed in transit; trying again");
                    tokio::time::sleep(Duration::from_millis(100 << tries.min(6))).await;
                }
            }
        }
    }

    /// Writes `key` whole, replacing what is there.
    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), BucketError> {
        self.count(&self.counts.put);
        self.store
            .put(&self.path(key), PutPayload::from(body))
            .await
            .map_err(self.err("put", key))?;
        Ok(())
    }

    /// The object's bytes, or `None` when there is none.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, BucketError> {
        self.count(&self.counts.get);
        match self.store.get(&self.path(key)).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(self.err("get", key))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("get", key)(e)),
        }
    }

    /// The object's bytes, or `None` when there is none; an object larger than `limit` is
    /// [`BucketError::TooLarge`], refused before (or while) it is read, never held whole.
    pub async fn get_capped(&self, key: &str, limit: u64) -> Result<Option<Bytes>, BucketError> {
        self.count(&self.counts.get);
        let r = match self.store.get(&self.path(key)).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.err("get", key)(e)),
        };
        let too_large = || BucketError::TooLarge {
            url: self.url.clone(),
            key: key.into(),
            limit,
        };
        if r.meta.size > limit {
            return Err(too_large());
        }
        let mut out = Vec::with_capacity(r.meta.size as usize);
        let mut stream = r.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.err("get", key))?;
            if (out.len() + chunk.len()) as u64 > limit {
                return Err(too_large());
            }
            out.extend_from_slice(&chunk);
        }
        Ok(Some(Bytes::from(out)))
    }

    /// The size and sha256 of the object's bytes as the store serves them (streamed, not
    /// held), or `None` when there is none.
    pub async fn checksum(&self, key: &str) -> Result<Option<Uploaded>, BucketError> {
        self.count(&self.counts.get);
        let r = match self.store.get(&self.path(key)).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.err("checksum", key)(e)),
        };
        let mut hash = Sha256::new();
        let mut n = 0u64;
        let mut stream = r.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.err("checksum", key))?;
            hash.update(&chunk);
            n += chunk.len() as u64;
        }
        Ok(Some(Uploaded {
            bytes: n,
            sha256: crate::config::hex(&hash.finalize()),
        }))
    }

    /// The object's size and ETag, or `None` when there is none.
    pub async fn head(&self, key: &str) -> Result<Option<(u64, Option<String>)>, BucketError> {
        self.count(&self.counts.head);
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some((m.size, m.e_tag))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", key)(e)),
        }
    }

    /// Every object under `prefix` (recursively), keys relative to the root, sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, BucketError> {
        let p = self.path(prefix.trim_end_matches('/'));
        let mut stream = self.store.list(Some(&p));
        let mut out = Vec::new();
        let strip = if self.root.is_empty() {
            String::new()
        } else {
            format!("{}/", self.root)
        };
        while let Some(m) = stream.next().await {
            let m = m.map_err(self.err("list", prefix))?;
            let key = m.location.to_string();
            out.push((key.strip_prefix(&strip).unwrap_or(&key).to_string(), m.size));
        }
        for _ in 0..out.len().div_ceil(1000).max(1) {
            self.count(&self.counts.list);
        }
        out.sort();
        Ok(out)
    }

    /// A copy made by the store (no bytes through this process on S3).
    pub async fn copy(&self, from: &str, to: &str) -> Result<(), BucketError> {
        self.count(&self.counts.copy);
        self.store
            .copy(&self.path(from), &self.path(to))
            .await
            .map_err(self.err("copy", from))
    }

    /// Streams `key` into `local` (a temporary name beside it, synced, then renamed). The
    /// temporary file is private (0600) and made exclusively: a name planted there, a
    /// symlink included, is removed rather than written through.
    pub async fn download(&self, key: &str, local: &Path) -> Result<u64, BucketError> {
        self.download_if(key, local, None).await
    }

    /// As [`Bucket::download`], of the object only while its ETag is `etag` (`If-Match`):
    /// an object replaced between a look and the read is refused, never mixed.
    pub async fn download_if(
        &self,
        key: &str,
        local: &Path,
        etag: Option<&str>,
    ) -> Result<u64, BucketError> {
        self.count(&self.counts.get);
        let name = local
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = local.with_file_name(format!(".{name}.part"));
        let io = |source| BucketError::Io {
            path: tmp.clone(),
            source,
        };
        let opts = object_store::GetOptions {
            if_match: etag.map(str::to_string),
            ..Default::default()
        };
        let r = self
            .store
            .get_opts(&self.path(key), opts)
            .await
            .map_err(self.err("download", key))?;
        let mut stream = r.into_stream();
        let mut file = crate::output::files::replace(&tmp, crate::output::files::PRIVATE_FILE_MODE)
            .map_err(io)?;
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.err("download", key))?;
            file.write_all(&chunk).map_err(io)?;
            n += chunk.len() as u64;
        }
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&tmp, local).map_err(|source| BucketError::Io {
            path: local.into(),
            source,
        })?;
        Ok(n)
    }

    /// Deletes `key` (absent is fine). A delete is idempotent, so one that failed in
    /// transit is tried again (S3's is a POST, which the store's own retries leave alone).
    pub async fn delete(&self, key: &str) -> Result<(), BucketError> {
        let mut tries = 0;
        loop {
            tries += 1;
            self.count(&self.counts.delete);
            match self.store.delete(&self.path(key)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => return Ok(()),
                Err(e) if tries >= CREATE_TRIES => return Err(self.err("delete", key)(e)),
                Err(e) => {
                    tracing::debug!(url = %self.url, key, tries, error = %redacted(&self.secrets, &e),
                        "delete failed in transit; trying again");
                    tokio::time::sleep(Duration::from_millis(100 << tries.min(6))).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A create finds its own bytes as its own and another's as theirs.
    #[test]
    fn create_tells_mine_from_theirs() {
        rt().block_on(async {
            let b = Bucket::open("memory://", &BucketOptions::default()).unwrap();
            assert_eq!(
                b.create("k", Bytes::from("a")).await.unwrap(),
                Created::Mine
            );
            assert_eq!(
                b.create("k", Bytes::from("a")).await.unwrap(),
                Created::Mine
            );
            assert_eq!(
                b.create("k", Bytes::from("b")).await.unwrap(),
                Created::Theirs(Bytes::from("a"))
            );
        });
    }

    /// A store error that echoes the request (S3's `SignatureDoesNotMatch`: the key id,
    /// the signature, the canonical request with the session token) reaches the error and
    /// its log line redacted; short settings are left alone.
    #[test]
    fn store_errors_are_redacted() {
        let env: Vec<(String, String)> = [
            ("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY123456"),
            (
                "AWS_SECRET_ACCESS_KEY",
                "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            ),
            ("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEJr//////////wEaDToken"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let secrets = store_secrets(&env);
        let echo = object_store::Error::Generic {
            store: "S3",
            source: "<AWSAccessKeyId>AKIAEXAMPLEKEY123456</AWSAccessKeyId><CanonicalRequest>x-amz-security-token:FwoGZXIvYXdzEJr//////////wEaDToken\nx-amz-date:1</CanonicalRequest> secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY us-east-1"
                .into(),
        };
        let shown = redacted(&secrets, &echo);
        for gone in ["AKIAEXAMPLE", "FwoGZXIv", "wJalrXUtn"] {
            assert!(!shown.contains(gone), "{gone} in {shown}");
        }
        assert!(shown.contains("us-east-1"), "{shown}");
    }

    /// `get_capped` refuses an object larger than asked without holding it.
    #[test]
    fn capped_reads_refuse_large_objects() {
        rt().block_on(async {
            let b = Bucket::open("memory://", &BucketOptions::default()).unwrap();
            b.put("k", Bytes::from(vec![1u8; 1000])).await.unwrap();
            assert_eq!(b.get_capped("k", 1000).await.unwrap().unwrap().len(), 1000);
            assert!(matches!(
                b.get_capped("k", 999).await,
                Err(BucketError::TooLarge { .. })
            ));
            assert_eq!(b.get_capped("none", 1).await.unwrap(), None);
            let sum = b.checksum("k").await.unwrap().unwrap();
            assert_eq!(sum.bytes, 1000);
            assert_eq!(sum.sha256, crate::config::hex(&Sha256::digest([1u8; 1000])));
        });
    }

    /// A download does not write through a symlink planted at its temporary name: the
    /// victim keeps its bytes, the download lands, and the file is the owner's alone.
    #[test]
    fn a_download_does_not_follow_a_planted_symlink() {
        use std::os::unix::fs::PermissionsExt;
        rt().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let b = Bucket::open("memory://", &BucketOptions::default()).unwrap();
            b.put("k", Bytes::from("shard bytes")).await.unwrap();
            let victim = dir.path().join("victim");
            std::fs::write(&victim, b"precious").unwrap();
            std::os::unix::fs::symlink(&victim, dir.path().join(".shard.parquet.part")).unwrap();
            let local = dir.path().join("shard.parquet");
            b.download("k", &local).await.unwrap();
            assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
            assert_eq!(std::fs::read(&local).unwrap(), b"shard bytes");
            let m = std::fs::symlink_metadata(&local).unwrap();
            assert!(m.is_file() && m.permissions().mode() & 0o077 == 0);
        });
    }

    /// A download pinned to the ETag seen (`If-Match`) reads the object while it is that
    /// version and is refused once it was replaced, leaving no local file.
    #[test]
    fn a_download_pinned_to_an_etag_refuses_another_version() {
        rt().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("file://{}/store", dir.path().display());
            let b = Bucket::open(&url, &BucketOptions::default()).unwrap();
            b.put("in.jsonl", Bytes::from("first\n")).await.unwrap();
            let (_, etag) = b.head("in.jsonl").await.unwrap().unwrap();
            let etag = etag.expect("an ETag");
            let local = dir.path().join("in.jsonl");
            b.download_if("in.jsonl", &local, Some(&etag))
                .await
                .unwrap();
            assert_eq!(std::fs::read(&local).unwrap(), b"first\n");
            std::fs::remove_file(&local).unwrap();
            // Replaced between the look and the read (another size: another ETag).
            b.put("in.jsonl", Bytes::from("second, longer\n"))
                .await
                .unwrap();
            assert!(b
                .download_if("in.jsonl", &local, Some(&etag))
                .await
                .is_err());
            assert!(!local.exists());
        });
    }

    /// A file of several parts uploads whole, with its checksum, and downloads the same;
    /// listing gives keys relative to the root, sorted.
    #[test]
    fn uploads_in_parts_and_lists_relative_keys() {
        rt().block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("file://{}/store", dir.path().display());
            let b = Bucket::open(&url, &BucketOptions::default()).unwrap();
            let src = dir.path().join("big.bin");
            let data: Vec<u8> = (0..(PART_BYTES * 2 + 12345))
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            std::fs::write(&src, &data).unwrap();
            let up = b.upload("x/big.bin", &src).await.unwrap();
            assert_eq!(up.bytes, data.len() as u64);
            assert_eq!(up.sha256, crate::config::hex(&Sha256::digest(&data)));
            b.put("x/a.json", Bytes::from("{}")).await.unwrap();
            let keys: Vec<String> = b
                .list("x/")
                .await
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            assert_eq!(keys, ["x/a.json", "x/big.bin"]);
            let back = dir.path().join("back.bin");
            assert_eq!(
                b.download("x/big.bin", &back).await.unwrap(),
                data.len() as u64
            );
            assert_eq!(std::fs::read(&back).unwrap(), data);
            assert!(!dir.path().join(".back.bin.part").exists());
            assert_eq!(b.get("nothing").await.unwrap(), None);
            assert!(Bucket::open("s3://", &BucketOptions::default()).is_err());
            assert!(Bucket::open("file://relative", &BucketOptions::default()).is_err());
        });
    }
}
