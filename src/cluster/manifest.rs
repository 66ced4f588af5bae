//! `_manifest.json`: what `spool finalize` leaves for readers, and how it is read.
//!
//! It lists every published shard (`<dataset>/part-<partition>-<seq>.parquet`) with its
//! rows, tokens and sha256, each partition's rejected rows
//! (`<dataset>/_rejected-<partition>.jsonl`), the items that failed for good with their
//! reasons, the budget, and the partitions published unfinished (`--partial`). The
//! reader's contract: once `_manifest.json` exists, `<prefix>/<dataset>/*.parquet` is
//! exactly the dataset, each generation once.
//!
//! Invariant: a manifest is used only once its dataset names are dataset names, its shard
//! paths the published names and its partitions the job's ([`check_manifest`]), so
//! `export` never writes outside its scratch; it is read up to [`MANIFEST_BYTES`].

use crate::cluster::commits;
use crate::error::{Context, Error};
use crate::output::bucket::Bucket;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The manifest's key under the output prefix.
pub const MANIFEST: &str = "_manifest.json";

/// The manifest's format.
pub const FORMAT: u32 = 1;

/// The most bytes of `_manifest.json` read into memory (a manifest lists every shard: a few
/// hundred bytes each).
pub const MANIFEST_BYTES: u64 = 512 << 20;

/// `_manifest.json`: the published output, for readers and `verify`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub spool_version: String,
    pub partitions: u32,
    pub datasets: BTreeMap<String, ManifestDataset>,
    /// Partitions published before they finished (`finalize --partial`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub incomplete: Vec<u32>,
    /// The version of the job record it was published under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_version: Option<u64>,
}

/// One dataset of the manifest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ManifestDataset {
    /// Rows (generations) in all its shards.
    pub rows: u64,
    /// Items (ids) in all its shards.
    pub items: u64,
    pub completion_tokens: u64,
    /// The configured budget, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    pub shards: Vec<ManifestShard>,
    /// The rejected rows, one JSONL file per partition that had any (`_`-prefixed, so
    /// folder readers skip them).
    #[serde(default)]
    pub rejected: Vec<String>,
    /// Items that failed for good (every attempt used up), with their reasons: not in
    /// any shard; `spool retry` sends them back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<ManifestFailure>,
}

/// One item that failed for good.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestFailure {
    pub partition: u32,
    pub id: String,
    pub reason: String,
}

/// One published shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestShard {
    /// Key relative to the output prefix.
    pub path: String,
    pub rows: u64,
    pub completion_tokens: u64,
    pub bytes: u64,
    pub sha256: String,
    pub partition: u32,
    /// Its commit in the partition's log.
    pub commit: u64,
}

/// The published name of a partition's commit `seq` of `dataset`.
pub fn published_key(dataset: &str, partition: u32, seq: u64) -> String {
    format!("{dataset}/part-{partition:04}-{seq:06}.parquet")
}

/// What is wrong with a manifest as spool writes them: dataset names that are not
/// dataset names, shard paths that are not the published names, checksums that are not
/// sha256s, partitions outside the job. Each problem names what it is about.
pub fn check_manifest(m: &Manifest) -> Vec<String> {
    let mut out = Vec::new();
    if m.format > FORMAT {
        out.push(format!(
            "format {}, newer than this spool's {FORMAT}; use a newer spool",
            m.format
        ));
        return out;
    }
    if m.partitions == 0 {
        out.push("partitions = 0".into());
    }
    if let Some(p) = m.incomplete.iter().find(|&&p| p >= m.partitions) {
        out.push(format!(
            "incomplete partition {p} is outside the job's {}",
            m.partitions
        ));
    }
    for (name, d) in &m.datasets {
        if !commits::is_dataset_name(name) {
            out.push(format!(
                "dataset {name:?} is not a dataset name ([A-Za-z0-9_.-]+, not `.`, `..`, `_spool` or `_manifest.json`)"
            ));
            continue;
        }
        for s in &d.shards {
            let expected = published_key(name, s.partition, s.commit);
            if s.partition >= m.partitions {
                out.push(format!(
                    "shard {:?} of `{name}` is of partition {}, outside the job's {}",
                    s.path, s.partition, m.partitions
                ));
            } else if s.path != expected {
                out.push(format!(
                    "shard path {:?} of `{name}` is not its published name {expected}",
                    s.path
                ));
            } else if !commits::is_sha256(&s.sha256) {
                out.push(format!(
                    "shard {} has sha256 {:?}, not a sha256",
                    s.path, s.sha256
                ));
            }
        }
        if let Some(f) = d.failed.iter().find(|f| f.partition >= m.partitions) {
            out.push(format!(
                "failed item {:?} of `{name}` is of partition {}, outside the job's {}",
                f.id, f.partition, m.partitions
            ));
        }
        for r in &d.rejected {
            let ok = (0..m.partitions).any(|p| *r == format!("{name}/_rejected-{p:04}.jsonl"));
            if !ok {
                out.push(format!(
                    "rejected rows {r:?} of `{name}` are not a published name"
                ));
            }
        }
    }
    out
}

/// Reads and checks `_manifest.json`: `None` when there is none.
pub async fn read_manifest(bucket: &Bucket) -> Result<Option<Result<Manifest, String>>, Error> {
    let Some(body) = bucket.get_capped(MANIFEST, MANIFEST_BYTES).await? else {
        return Ok(None);
    };
    let m: Manifest = match serde_json::from_slice(&body) {
        Ok(m) => m,
        Err(e) => return Ok(Some(Err(format!("not a manifest: {e}")))),
    };
    let problems = check_manifest(&m);
    Ok(Some(if problems.is_empty() {
        Ok(m)
    } else {
        Err(problems.join("; "))
    }))
}

/// Downloads the published shards of `datasets` (all when empty), as `_manifest.json` lists
/// them, into `dir/<dataset>/part-NNNNNN.parquet` (numbered in manifest order), so the local
/// readers (`spool export`) read them as an output folder. A manifest that fails
/// [`check_manifest`] is refused before anything is written; each download is checked
/// against the manifest's sha256; folders made here are private (0700).
pub async fn download_published(
    bucket: &Arc<Bucket>,
    dir: &std::path::Path,
    datasets: &[String],
) -> Result<Manifest, Error> {
    let manifest = match read_manifest(bucket).await? {
        None => {
            return Err(Error::msg(format!(
                "{}: no {MANIFEST}: the job is not published yet (run `spool finalize`)",
                bucket.url()
            )))
        }
        Some(Err(detail)) => {
            return Err(Error::msg(format!(
                "{}/{MANIFEST}: not a manifest spool wrote: {detail}; nothing was exported",
                bucket.url()
            )))
        }
        Some(Ok(m)) => m,
    };
    for (name, d) in &manifest.datasets {
        if !datasets.is_empty() && !datasets.contains(name) {
            continue;
        }
        let folder = dir.join(name);
        crate::output::files::create_dir_all(&folder, crate::output::files::PRIVATE_DIR_MODE)
            .with_context(|| format!("cannot create {}", folder.display()))?;
        for (k, s) in d.shards.iter().enumerate() {
            let local = folder.join(crate::output::shard::shard_file_name(k as u64));
            bucket.download(&s.path, &local).await?;
            let sha = crate::output::bucket::sha256_file(&local)?;
            if sha != s.sha256 {
                return Err(Error::msg(format!(
                    "{}/{}: sha256 {sha}, the manifest says {}",
                    bucket.url(),
                    s.path,
                    s.sha256
                )));
            }
        }
    }
    Ok(manifest)
}
