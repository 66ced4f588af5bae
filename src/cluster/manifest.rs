//! `spool finalize` and what it leaves for readers: the published shards and `_manifest.json`.
//!
//! Workers write only under `_spool/` (see `commits`). `finalize`, run once every partition
//! has marked itself done, copies each committed shard to `<dataset>/part-<partition>-<seq>.parquet`
//! (a server-side copy) and then writes `_manifest.json`, listing every published shard with
//! its rows, tokens and sha256, and each partition's rejected rows as
//! `<dataset>/_rejected-<partition>.jsonl`. The reader's contract: once `_manifest.json` exists,
//! `<prefix>/<dataset>/*.parquet` is exactly the dataset, each item once.
//!
//! Invariants: `_manifest.json` is written last, so a reader that sees it sees every shard
//! it lists; finalize publishes only committed shards, and committed shards hold disjoint
//! items (`commits`), so the published folder holds every committed item exactly once;
//! finalize is idempotent (the names are fixed by the log), so a failed one is run again.

use crate::cluster::commits::{self, CommitLog, Done};
use crate::cluster::partition::Partition;
use crate::error::{Context, Error};
use crate::output::bucket::Bucket;
use crate::output::reader;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// The manifest's key under the output prefix.
pub const MANIFEST: &str = "_manifest.json";

/// The manifest's format.
pub const FORMAT: u32 = 1;

/// `_manifest.json`: the published output, for readers and `verify`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub spool_version: String,
    pub partitions: u32,
    pub datasets: BTreeMap<String, ManifestDataset>,
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

/// What one partition has committed, for `finalize` and `status`.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionState {
    pub partition: u32,
    pub commits: u64,
    pub done: bool,
    /// Per dataset: (rows, items, completion tokens) committed.
    pub datasets: BTreeMap<String, (u64, u64, u64)>,
    /// Per dataset: items pending, from the worker's live status (copied every 15 s while
    /// it runs with its metrics endpoint on) or from when it last stopped; empty when unknown.
    pub pending: BTreeMap<String, u64>,
    /// Whether `pending` is a running worker's (else its last stop's).
    pub live: bool,
}

/// Reads every partition's log and done marker.
pub async fn partitions(
    bucket: &Arc<Bucket>,
    count: u32,
) -> Result<Vec<(PartitionState, CommitLog)>, Error> {
    let mut out = Vec::new();
    for index in 0..count {
        let log = CommitLog::load(bucket.clone(), Partition { index, count }).await?;
        let done = match bucket.get(&commits::done_key(index)).await? {
            Some(body) => serde_json::from_slice::<Done>(&body).is_ok(),
            None => false,
        };
        let mut pending = BTreeMap::new();
        let mut live = false;
        if let Some(body) = bucket.get(&commits::status_key(index)).await? {
            if let Ok(r) = serde_json::from_slice::<crate::observe::status::StatusReport>(&body) {
                live = r.running && !done;
                for d in r.datasets {
                    pending.insert(d.name, d.pending);
                }
            }
        }
        let mut datasets: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for c in log.commits() {
            let e = datasets.entry(c.dataset.clone()).or_default();
            e.0 += c.rows;
            e.1 += c.ids.len() as u64;
            e.2 += c.completion_tokens;
        }
        out.push((
            PartitionState {
                partition: index,
                commits: log.commits().len() as u64,
                done,
                datasets,
                pending,
                live,
            },
            log,
        ));
    }
    Ok(out)
}

/// Publishes every committed shard and writes the manifest; refuses while a partition has
/// not marked itself done (its worker may still commit), unless `partial`.
pub async fn finalize(
    bucket: &Arc<Bucket>,
    count: u32,
    budgets: &HashMap<String, u64>,
    partial: bool,
) -> Result<Manifest, Error> {
    let parts = partitions(bucket, count).await?;
    let missing: Vec<u32> = parts
        .iter()
        .filter(|(s, _)| !s.done)
        .map(|(s, _)| s.partition)
        .collect();
    if !missing.is_empty() && !partial {
        let keys: Vec<String> = missing.iter().map(|&p| commits::done_key(p)).collect();
        return Err(Error::msg(format!(
            "partitions {missing:?} of {count} have not finished (no {}); run finalize after every partition's worker exits 0 (or pass --partial)",
            keys.join(", ")
        )));
    }
    let mut manifest = Manifest {
        format: FORMAT,
        spool_version: env!("CARGO_PKG_VERSION").to_string(),
        partitions: count,
        datasets: BTreeMap::new(),
    };
    for (state, log) in &parts {
        for c in log.commits() {
            let d = manifest.datasets.entry(c.dataset.clone()).or_default();
            let Some(key) = &c.key else {
                continue;
            };
            let dest = published_key(&c.dataset, state.partition, c.seq);
            bucket
                .copy(key, &dest)
                .await
                .with_context(|| format!("cannot publish {key} as {dest}"))?;
            d.rows += c.rows;
            d.items += c.ids.len() as u64;
            d.completion_tokens += c.completion_tokens;
            d.shards.push(ManifestShard {
                path: dest,
                rows: c.rows,
                completion_tokens: c.completion_tokens,
                bytes: c.bytes,
                sha256: c.sha256.clone(),
                partition: state.partition,
                commit: c.seq,
            });
        }
    }
    for (state, _) in &parts {
        for (key, _) in bucket
            .list(&format!(
                "{}/rejected/",
                commits::partition_prefix(state.partition)
            ))
            .await?
        {
            let Some(dataset) = key
                .rsplit('/')
                .next()
                .and_then(|n| n.strip_suffix(".jsonl"))
            else {
                continue;
            };
            let dest = format!("{dataset}/_rejected-{:04}.jsonl", state.partition);
            bucket
                .copy(&key, &dest)
                .await
                .with_context(|| format!("cannot publish {key} as {dest}"))?;
            manifest
                .datasets
                .entry(dataset.to_string())
                .or_default()
                .rejected
                .push(dest);
        }
    }
    for (name, d) in manifest.datasets.iter_mut() {
        d.budget = budgets.get(name).copied();
    }
    let body = serde_json::to_vec_pretty(&manifest)?;
    bucket.put(MANIFEST, body.into()).await?;
    Ok(manifest)
}

/// What `verify` found wrong with the published output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishedProblem {
    pub path: String,
    pub detail: String,
}

impl std::fmt::Display for PublishedProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.detail)
    }
}

/// Checks the published output against the manifest and the commit logs: every listed
/// shard is there with its size, checksum and rows; each (id, sample, turn) appears once
/// per dataset; no `.parquet` object in a dataset folder is unlisted; every committed
/// shard is listed. Shards are downloaded one at a time into `scratch`.
pub async fn verify(
    bucket: &Arc<Bucket>,
    count: u32,
    scratch: &std::path::Path,
) -> Result<(Option<Manifest>, Vec<PublishedProblem>), Error> {
    let mut problems = Vec::new();
    let problem = |path: &str, detail: String| PublishedProblem {
        path: path.to_string(),
        detail,
    };
    let Some(body) = bucket.get(MANIFEST).await? else {
        problems.push(problem(
            MANIFEST,
            "missing: `spool finalize` has not run (readers must wait for it)".into(),
        ));
        return Ok((None, problems));
    };
    let manifest: Manifest = match serde_json::from_slice(&body) {
        Ok(m) => m,
        Err(e) => {
            problems.push(problem(MANIFEST, format!("not a manifest: {e}")));
            return Ok((None, problems));
        }
    };
    std::fs::create_dir_all(scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))?;
    let mut listed: HashSet<String> = HashSet::new();
    for (name, d) in &manifest.datasets {
        let mut seen: HashMap<(String, u32, u32), String> = HashMap::new();
        let (mut rows, mut tokens) = (0u64, 0u64);
        for s in &d.shards {
            listed.insert(s.path.clone());
            let local = scratch.join("shard.parquet");
            match bucket.head(&s.path).await? {
                None => {
                    problems.push(problem(
                        &s.path,
                        "listed in the manifest but missing".into(),
                    ));
                    continue;
                }
                Some((size, _)) if size != s.bytes => problems.push(problem(
                    &s.path,
                    format!("{size} bytes, the manifest says {}", s.bytes),
                )),
                Some(_) => {}
            }
            bucket.download(&s.path, &local).await?;
            let sha = crate::output::bucket::sha256_file(&local)?;
            if sha != s.sha256 {
                problems.push(problem(
                    &s.path,
                    format!("sha256 {sha}, the manifest says {}", s.sha256),
                ));
            }
            let shard_rows = match reader::read_rows(&local) {
                Ok(r) => r,
                Err(e) => {
                    problems.push(problem(&s.path, format!("unreadable: {e}")));
                    continue;
                }
            };
            if shard_rows.len() as u64 != s.rows {
                problems.push(problem(
                    &s.path,
                    format!("{} rows, the manifest says {}", shard_rows.len(), s.rows),
                ));
            }
            let mut shard_tokens = 0u64;
            for r in shard_rows {
                shard_tokens += u64::from(r.completion_tokens);
                if r.dataset != *name {
                    problems.push(problem(
                        &s.path,
                        format!("row of dataset `{}` (id `{}`) in `{name}`", r.dataset, r.id),
                    ));
                }
                let key = (r.id, r.sample, r.turn);
                if let Some(first) = seen.get(&key) {
                    problems.push(problem(
                        &s.path,
                        format!(
                            "id `{}` sample {} turn {} is also in {first}",
                            key.0, key.1, key.2
                        ),
                    ));
                } else {
                    seen.insert(key, s.path.clone());
                }
            }
            if shard_tokens != s.completion_tokens {
                problems.push(problem(
                    &s.path,
                    format!(
                        "{shard_tokens} completion tokens, the manifest says {}",
                        s.completion_tokens
                    ),
                ));
            }
            rows += s.rows;
            tokens += s.completion_tokens;
        }
        if rows != d.rows || tokens != d.completion_tokens {
            problems.push(problem(
                name,
                format!(
                    "the shards add up to {rows} rows and {tokens} tokens, the manifest says {} and {}",
                    d.rows, d.completion_tokens
                ),
            ));
        }
        for (key, _) in bucket.list(&format!("{name}/")).await? {
            if key.ends_with(".parquet") && !listed.contains(&key) {
                problems.push(problem(
                    &key,
                    "a shard the manifest does not list: readers of the folder would read it"
                        .into(),
                ));
            }
        }
    }
    let _ = std::fs::remove_file(scratch.join("shard.parquet"));
    for (state, log) in partitions(bucket, count.max(manifest.partitions)).await? {
        for c in log.commits().iter().filter(|c| c.key.is_some()) {
            let key = published_key(&c.dataset, state.partition, c.seq);
            if !listed.contains(&key) {
                problems.push(problem(
                    &commits::commit_key(state.partition, c.seq),
                    format!(
                        "committed ({} rows) but not published: run `spool finalize` again",
                        c.rows
                    ),
                ));
            }
        }
    }
    Ok((Some(manifest), problems))
}

/// `spool status` of a cluster job, from the object store alone: what every partition has
/// committed and whether it is done, each dataset's tokens against its budget.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    pub output: String,
    pub partitions: Vec<PartitionState>,
    pub datasets: Vec<DatasetTotals>,
    /// `_manifest.json` exists: `spool finalize` has published the output.
    pub finalized: bool,
}

/// One dataset summed over the partitions.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetTotals {
    pub name: String,
    pub rows: u64,
    pub items: u64,
    pub completion_tokens: u64,
    pub budget: Option<u64>,
}

/// Reads the job's state from the store.
pub async fn status(
    bucket: &Arc<Bucket>,
    count: u32,
    datasets: &[(String, Option<u64>)],
) -> Result<ClusterStatus, Error> {
    let parts: Vec<PartitionState> = partitions(bucket, count)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let totals = datasets
        .iter()
        .map(|(name, budget)| {
            let mut t = DatasetTotals {
                name: name.clone(),
                rows: 0,
                items: 0,
                completion_tokens: 0,
                budget: *budget,
            };
            for p in &parts {
                if let Some(&(rows, items, tokens)) = p.datasets.get(name) {
                    t.rows += rows;
                    t.items += items;
                    t.completion_tokens += tokens;
                }
            }
            t
        })
        .collect();
    Ok(ClusterStatus {
        output: bucket.url().to_string(),
        partitions: parts,
        datasets: totals,
        finalized: bucket.head(MANIFEST).await?.is_some(),
    })
}

impl ClusterStatus {
    /// The table `spool status` prints.
    pub fn render_table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "output {}", self.output);
        let _ = writeln!(
            s,
            "{:<24} {:>10} {:>12} {:>14} {:>14}",
            "dataset", "items", "rows", "tokens", "budget"
        );
        for d in &self.datasets {
            let _ = writeln!(
                s,
                "{:<24} {:>10} {:>12} {:>14} {:>14}",
                d.name,
                d.items,
                d.rows,
                d.completion_tokens,
                d.budget.map_or("-".into(), |b| b.to_string())
            );
        }
        let _ = writeln!(
            s,
            "{:<10} {:>8} {:>6}  committed",
            "partition", "commits", "done"
        );
        for p in &self.partitions {
            let names: std::collections::BTreeSet<&String> =
                p.datasets.keys().chain(p.pending.keys()).collect();
            let per: Vec<String> = names
                .into_iter()
                .map(|n| {
                    let (rows, _, tokens) = p.datasets.get(n).copied().unwrap_or_default();
                    let pending = p.pending.get(n).map_or(String::new(), |x| {
                        if p.live {
                            format!(", {x} pending (running)")
                        } else {
                            format!(", {x} pending at last stop")
                        }
                    });
                    format!("{n}: {rows} rows, {tokens} tokens{pending}")
                })
                .collect();
            let _ = writeln!(
                s,
                "{:<10} {:>8} {:>6}  {}",
                format!("p{:04}", p.partition),
                p.commits,
                if p.done { "yes" } else { "no" },
                per.join("; ")
            );
        }
        let done = self.partitions.iter().filter(|p| p.done).count();
        let _ = writeln!(
            s,
            "{done} of {} partitions done; {}",
            self.partitions.len(),
            if self.finalized {
                "published (_manifest.json)"
            } else {
                "not published yet (spool finalize)"
            }
        );
        s
    }
}

/// Downloads the published shards of `datasets` (all when empty), as `_manifest.json` lists
/// them, into `dir/<dataset>/part-NNNNNN.parquet` (numbered in manifest order), so the local
/// readers (`spool export`) read them as an output folder. Each download is checked
/// against the manifest's sha256.
pub async fn download_published(
    bucket: &Arc<Bucket>,
    dir: &std::path::Path,
    datasets: &[String],
) -> Result<Manifest, Error> {
    let Some(body) = bucket.get(MANIFEST).await? else {
        return Err(Error::msg(format!(
            "{}: no {MANIFEST}: the job is not published yet (run `spool finalize`)",
            bucket.url()
        )));
    };
    let manifest: Manifest = serde_json::from_slice(&body)
        .map_err(|e| Error::msg(format!("{}/{MANIFEST}: {e}", bucket.url())))?;
    for (name, d) in &manifest.datasets {
        if !datasets.is_empty() && !datasets.contains(name) {
            continue;
        }
        let folder = dir.join(name);
        std::fs::create_dir_all(&folder)
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
