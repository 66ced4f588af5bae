//! Dataset files in object storage (`path = "s3://bucket/key.jsonl.zst"`): fetched once into
//! `data_dir/inputs/<dataset>/` at the start of a run, through `output::bucket` (the one
//! door to object storage), and read from there by `input` like any local file (the run's
//! plan names the copy: `JobPlan::inputs`; the config keeps the URL).
//!
//! Invariant: the local copy is the object's bytes — streamed to a temporary name, synced
//! and renamed — and is fetched again only when the object's size or ETag changed, in which
//! case intake's prefix check sees the change like a changed local file. The bytes are read
//! with `If-Match` on the ETag the look saw, so an object replaced between the look and the
//! read is refused rather than stamped with the other version's ETag.

use crate::config::Config;
use crate::output::bucket::{is_url, Bucket};
use std::collections::HashMap;
use std::path::PathBuf;

/// Why a dataset's object could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("dataset `{dataset}`: {url}: {source}")]
    Bucket {
        dataset: String,
        url: String,
        source: crate::output::bucket::BucketError,
    },
    #[error("dataset `{dataset}`: {url}: no such object")]
    Missing { dataset: String, url: String },
    #[error("dataset `{dataset}`: {url}: not an object URL (s3://bucket/key)")]
    NotAnObject { dataset: String, url: String },
    #[error("dataset `{dataset}`: {path}: {source}")]
    Io {
        dataset: String,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The local copy of every object-store dataset, by dataset name, fetching what is missing
/// or changed (the plan's [`crate::run::plan::JobPlan::inputs`]).
pub async fn fetch_inputs(cfg: &Config) -> Result<HashMap<String, PathBuf>, FetchError> {
    let mut copies = HashMap::new();
    for d in &cfg.datasets {
        let url = d.path.to_string_lossy().into_owned();
        if !is_url(&url) {
            continue;
        }
        let Some((parent, name)) = url
            .rsplit_once('/')
            .filter(|(p, n)| !n.is_empty() && p.matches('/').count() >= 2 && !p.ends_with('/'))
        else {
            return Err(FetchError::NotAnObject {
                dataset: d.name.clone(),
                url,
            });
        };
        let bucket_err = |source| FetchError::Bucket {
            dataset: d.name.clone(),
            url: url.clone(),
            source,
        };
        let bucket = Bucket::open(parent, &cfg.storage).map_err(bucket_err)?;
        let Some((size, etag)) = bucket.head(name).await.map_err(bucket_err)? else {
            return Err(FetchError::Missing {
                dataset: d.name.clone(),
                url,
            });
        };
        let dir = cfg.data_dir.join("inputs").join(&d.name);
        let local = dir.join(name);
        let stamp_path = dir.join(format!(".{name}.source"));
        let stamp = format!("{url}\n{size}\n{}\n", etag.clone().unwrap_or_default());
        let io = |path: &PathBuf, source| FetchError::Io {
            dataset: d.name.clone(),
            path: path.clone(),
            source,
        };
        let fresh =
            local.is_file() && std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp);
        if !fresh {
            std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
            let t = std::time::Instant::now();
            let bytes = bucket
                .download_if(name, &local, etag.as_deref())
                .await
                .map_err(bucket_err)?;
            std::fs::write(&stamp_path, &stamp).map_err(|e| io(&stamp_path, e))?;
            tracing::info!(dataset = %d.name, url = %url, bytes,
                seconds = format!("{:.1}", t.elapsed().as_secs_f64()), "input fetched");
        }
        copies.insert(d.name.clone(), local);
    }
    Ok(copies)
}
