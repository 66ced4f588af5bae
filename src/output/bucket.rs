//! Object storage (provisional: replaced by the full module).

use bytes::Bytes;
use object_store::{
    path::Path as ObjPath, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("{url}: {detail}")]
    Url { url: String, detail: String },
    #[error("{op} {key}: {source}")]
    Store {
        op: &'static str,
        key: String,
        source: object_store::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

pub fn is_url(s: &str) -> bool {
    s.starts_with("s3://") || s.starts_with("file://") || s.starts_with("memory://")
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketOptions {
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub allow_http: Option<bool>,
    pub max_retries: Option<usize>,
    pub timeout_s: Option<f64>,
    pub retry_timeout_s: Option<f64>,
}

pub struct Uploaded {
    pub bytes: u64,
    pub sha256: String,
}

pub enum Created {
    Mine,
    Theirs(Bytes),
}

pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    root: String,
    url: String,
}

impl Bucket {
    pub fn open(url: &str, _opts: &BucketOptions) -> Result<Bucket, BucketError> {
        let Some(dir) = url.strip_prefix("file://") else {
            return Err(BucketError::Url {
                url: url.into(),
                detail: "only file:// here".into(),
            });
        };
        std::fs::create_dir_all(dir).map_err(|source| BucketError::Io {
            path: dir.into(),
            source,
        })?;
        let store =
            object_store::local::LocalFileSystem::new_with_prefix(dir).map_err(|source| {
                BucketError::Store {
                    op: "open",
                    key: dir.into(),
                    source,
                }
            })?;
        Ok(Bucket {
            store: Arc::new(store),
            root: String::new(),
            url: url.into(),
        })
    }
    pub fn url(&self) -> &str {
        &self.url
    }
    fn path(&self, key: &str) -> ObjPath {
        ObjPath::from(format!("{}{key}", self.root))
    }
    fn err<'a>(
        op: &'static str,
        key: &'a str,
    ) -> impl FnOnce(object_store::Error) -> BucketError + 'a {
        move |source| BucketError::Store {
            op,
            key: key.into(),
            source,
        }
    }
    pub async fn upload(&self, key: &str, local: &Path) -> Result<Uploaded, BucketError> {
        use sha2::Digest;
        let data = std::fs::read(local).map_err(|source| BucketError::Io {
            path: local.into(),
            source,
        })?;
        let sha = crate::config::hex(&sha2::Sha256::digest(&data));
        let n = data.len() as u64;
        self.store
            .put(&self.path(key), PutPayload::from(data))
            .await
            .map_err(Self::err("upload", key))?;
        Ok(Uploaded {
            bytes: n,
            sha256: sha,
        })
    }
    pub async fn create(&self, key: &str, body: Bytes) -> Result<Created, BucketError> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&self.path(key), PutPayload::from(body.clone()), opts)
            .await
        {
            Ok(_) => Ok(Created::Mine),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {
                let existing = self.get(key).await?.unwrap_or_default();
                if existing == body {
                    Ok(Created::Mine)
                } else {
                    Ok(Created::Theirs(existing))
                }
            }
            Err(e) => Err(Self::err("create", key)(e)),
        }
    }
    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), BucketError> {
        self.store
            .put(&self.path(key), PutPayload::from(body))
            .await
            .map_err(Self::err("put", key))?;
        Ok(())
    }
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, BucketError> {
        match self.store.get(&self.path(key)).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(Self::err("get", key))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::err("get", key)(e)),
        }
    }
    pub async fn head(&self, key: &str) -> Result<Option<(u64, Option<String>)>, BucketError> {
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some((m.size, m.e_tag))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::err("head", key)(e)),
        }
    }
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, BucketError> {
        use futures_util::TryStreamExt;
        let p = self.path(prefix.trim_end_matches('/'));
        let mut v: Vec<(String, u64)> = self
            .store
            .list(Some(&p))
            .map_ok(|m| (m.location.to_string(), m.size))
            .try_collect()
            .await
            .map_err(Self::err("list", prefix))?;
        v.sort();
        Ok(v)
    }
    pub async fn copy(&self, from: &str, to: &str) -> Result<(), BucketError> {
        self.store
            .copy(&self.path(from), &self.path(to))
            .await
            .map_err(Self::err("copy", from))
    }
    pub async fn download(&self, key: &str, local: &Path) -> Result<u64, BucketError> {
        let b = self.get(key).await?.unwrap_or_default();
        std::fs::write(local, &b).map_err(|source| BucketError::Io {
            path: local.into(),
            source,
        })?;
        Ok(b.len() as u64)
    }
    pub async fn delete(&self, key: &str) -> Result<(), BucketError> {
        self.store
            .delete(&self.path(key))
            .await
            .map_err(Self::err("delete", key))
    }
}
