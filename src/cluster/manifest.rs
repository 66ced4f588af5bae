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
//! Nothing read from the store is trusted: finalize publishes nothing until every record,
//! done marker and rejected-rows object of every partition has passed `commits::check`
//! (one that fails is an error naming it), and a published shard stays only if its bytes
//! have the size and sha256 its record names; `verify` reports each refused object;
//! a manifest is used only once its dataset names are dataset names and its shard paths
//! the published names ([`check_manifest`]), so `export` never writes outside its scratch.

use crate::cluster::commits::{self, CommitError, CommitLog};
use crate::cluster::partition::Partition;
use crate::error::{Context, Error};
use crate::output::bucket::Bucket;
use crate::output::reader;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// The manifest's key under the output prefix.
pub const MANIFEST: &str = "_manifest.json";

/// The manifest's format.
pub const FORMAT: u32 = 1;

/// The most bytes of `_manifest.json` read into memory (a manifest lists every shard: a few
/// hundred bytes each).
pub const MANIFEST_BYTES: u64 = 512 << 20;

/// Shards copied and checked at once by `finalize`.
const PUBLISH_IN_FLIGHT: usize = 4;

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

/// Reads every partition's log and done marker; a record or marker no worker of this
/// job could have written is an error naming it.
pub async fn partitions(
    bucket: &Arc<Bucket>,
    count: u32,
) -> Result<Vec<(PartitionState, CommitLog)>, Error> {
    let mut out = Vec::new();
    for index in 0..count {
        let p = Partition { index, count };
        let log = CommitLog::load(bucket.clone(), p).await?;
        let done = commits::read_done(bucket, p).await?.is_some();
        let mut pending = BTreeMap::new();
        let mut live = false;
        let key = commits::status_key(index);
        // Shown only: a status object that is not a worker's is left out, said once.
        match bucket.get_capped(&key, commits::RECORD_BYTES).await {
            Ok(Some(body)) => {
                match serde_json::from_slice::<crate::observe::status::StatusReport>(&body) {
                    Ok(r) if r.datasets.iter().all(|d| commits::is_dataset_name(&d.name)) => {
                        live = r.running && !done;
                        for d in r.datasets {
                            pending.insert(d.name, d.pending);
                        }
                    }
                    Ok(_) => tracing::warn!(key = %key,
                        "a status object whose dataset names are not dataset names; its pending counts are not shown"),
                    Err(e) => tracing::warn!(key = %key, error = %e,
                        "not a status report; its pending counts are not shown"),
                }
            }
            Ok(None) => {}
            Err(e @ crate::output::bucket::BucketError::TooLarge { .. }) => {
                tracing::warn!(error = %e, "its pending counts are not shown")
            }
            Err(e) => return Err(e.into()),
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
    // Every rejected-rows object is checked before anything is published.
    let mut rejected = Vec::new();
    for (state, _) in &parts {
        let prefix = format!("{}/rejected/", commits::partition_prefix(state.partition));
        for (key, _) in bucket.list(&prefix).await? {
            let Some(dataset) = commits::rejected_dataset(state.partition, &key) else {
                return Err(CommitError::Untrusted {
                    key,
                    detail: "not a partition's rejected rows (`rejected/<dataset>.jsonl`, a dataset name)"
                        .into(),
                }
                .into());
            };
            let dest = format!("{dataset}/_rejected-{:04}.jsonl", state.partition);
            rejected.push((dataset.to_string(), key.clone(), dest));
        }
    }
    let mut manifest = Manifest {
        format: FORMAT,
        spool_version: env!("CARGO_PKG_VERSION").to_string(),
        partitions: count,
        datasets: BTreeMap::new(),
    };
    let mut copies = Vec::new();
    for (state, log) in &parts {
        for c in log.commits() {
            let d = manifest.datasets.entry(c.dataset.clone()).or_default();
            let Some(key) = &c.key else {
                continue;
            };
            let dest = published_key(&c.dataset, state.partition, c.seq);
            d.rows += c.rows;
            d.items += c.ids.len() as u64;
            d.completion_tokens += c.completion_tokens;
            d.shards.push(ManifestShard {
                path: dest.clone(),
                rows: c.rows,
                completion_tokens: c.completion_tokens,
                bytes: c.bytes,
                sha256: c.sha256.clone(),
                partition: state.partition,
                commit: c.seq,
            });
            copies.push((commits::commit_key(state.partition, c.seq), key, dest, c));
        }
    }
    let published: Vec<Result<(), Error>> = futures_util::stream::iter(copies)
        .map(|(record, key, dest, c)| publish(bucket, record, key, dest, c))
        .buffer_unordered(PUBLISH_IN_FLIGHT)
        .collect()
        .await;
    published.into_iter().collect::<Result<Vec<()>, Error>>()?;
    for (dataset, key, dest) in rejected {
        bucket
            .copy(&key, &dest)
            .await
            .with_context(|| format!("cannot publish {key} as {dest}"))?;
        manifest
            .datasets
            .entry(dataset)
            .or_default()
            .rejected
            .push(dest);
    }
    for (name, d) in manifest.datasets.iter_mut() {
        d.budget = budgets.get(name).copied();
    }
    let body = serde_json::to_vec_pretty(&manifest)?;
    bucket.put(MANIFEST, body.into()).await?;
    Ok(manifest)
}

/// Copies committed shard `key` (of `record`) to `dest` and checks the copy's size and
/// sha256 against the record; a copy that differs is deleted and the error names both.
async fn publish(
    bucket: &Arc<Bucket>,
    record: String,
    key: &str,
    dest: String,
    c: &commits::Commit,
) -> Result<(), Error> {
    bucket
        .copy(key, &dest)
        .await
        .with_context(|| format!("cannot publish {key} as {dest}"))?;
    let got = bucket.checksum(&dest).await?;
    match got {
        Some(u) if u.sha256 == c.sha256 && u.bytes == c.bytes => Ok(()),
        got => {
            bucket.delete(&dest).await?;
            let (bytes, sha) = got.map_or((0, "(none)".to_string()), |u| (u.bytes, u.sha256));
            Err(Error::msg(format!(
                "{record}: its shard {key} is {bytes} bytes of sha256 {sha}, but the record says {} bytes of sha256 {}; not published (the object changed after it was committed)",
                c.bytes, c.sha256
            )))
        }
    }
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
async fn read_manifest(bucket: &Bucket) -> Result<Option<Result<Manifest, String>>, Error> {
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

/// Checks the published output against the manifest and the commit logs: every record
/// and done marker is one this job's workers wrote (each refused one is a problem naming
/// it); the manifest is one spool writes; every listed shard is there with its size,
/// checksum and rows, and is the one its commit record names; each (id, sample, turn)
/// appears once per dataset; no `.parquet` object in a dataset folder is unlisted; every
/// committed shard is listed. Shards are downloaded one at a time into `scratch`.
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
    let refused = |e: CommitError| -> Result<PublishedProblem, Error> {
        match e.key() {
            Some(key) => Ok(PublishedProblem {
                path: key.to_string(),
                detail: e.to_string().replacen(&format!("{key}: "), "", 1),
            }),
            None => Err(e.into()),
        }
    };
    // The logs, each read as far as it can be trusted.
    let mut logs: Vec<(u32, CommitLog)> = Vec::new();
    for index in 0..count {
        let p = Partition { index, count };
        match CommitLog::load(bucket.clone(), p).await {
            Ok(log) => logs.push((index, log)),
            Err(e) => problems.push(refused(e)?),
        }
        if let Err(e) = commits::read_done(bucket, p).await {
            problems.push(refused(e)?);
        }
    }
    let manifest = match read_manifest(bucket).await? {
        None => {
            problems.push(problem(
                MANIFEST,
                "missing: `spool finalize` has not run (readers must wait for it)".into(),
            ));
            return Ok((None, problems));
        }
        Some(Err(detail)) => {
            problems.push(problem(MANIFEST, detail));
            return Ok((None, problems));
        }
        Some(Ok(m)) => m,
    };
    if manifest.partitions != count {
        problems.push(problem(
            MANIFEST,
            format!(
                "a job of {} partitions, but this config's has {count}",
                manifest.partitions
            ),
        ));
    }
    let record_of = |partition: u32, seq: u64| {
        logs.iter()
            .find(|(i, _)| *i == partition)
            .and_then(|(_, l)| l.commits().get(seq as usize))
    };
    let mut listed: HashSet<String> = HashSet::new();
    for (name, d) in &manifest.datasets {
        let mut seen: HashMap<(String, u32, u32), String> = HashMap::new();
        let (mut rows, mut tokens) = (0u64, 0u64);
        for s in &d.shards {
            listed.insert(s.path.clone());
            let record = commits::commit_key(s.partition, s.commit);
            match record_of(s.partition, s.commit) {
                Some(c) if c.key.is_some() && c.dataset == *name && c.sha256 == s.sha256 => {}
                Some(_) => problems.push(problem(
                    &s.path,
                    format!("listed in the manifest, but {record} commits another shard"),
                )),
                None => problems.push(problem(
                    &s.path,
                    format!("listed in the manifest, but there is no usable record {record}"),
                )),
            }
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
                        format!("row of dataset {:?} (id {:?}) in `{name}`", r.dataset, r.id),
                    ));
                }
                let key = (r.id, r.sample, r.turn);
                if let Some(first) = seen.get(&key) {
                    problems.push(problem(
                        &s.path,
                        format!(
                            "id {:?} sample {} turn {} is also in {first}",
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
    for (partition, log) in &logs {
        for c in log.commits().iter().filter(|c| c.key.is_some()) {
            let key = published_key(&c.dataset, *partition, c.seq);
            if !listed.contains(&key) {
                problems.push(problem(
                    &commits::commit_key(*partition, c.seq),
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
