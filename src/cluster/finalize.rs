//! `spool finalize`: seals the job and publishes it.
//!
//! Workers write only under `_spool/` (see `commits`). `finalize` checks every partition
//! (its log, done marker, rejected rows, and its budget claims against the budget logs),
//! refuses while a partition has not finished (unless `--partial`), then appends a seal
//! to every partition's log: a conditional create at the next number, so a late commit
//! either lands before it (and is published) or finds it and stops. It then copies each
//! committed shard to `<dataset>/part-<partition>-<seq>.parquet` (a server-side copy),
//! checked against its record, and writes `_manifest.json` last. Each partition's
//! published shards are recorded in `_spool/pNNNN/published.json` with the copy's ETag,
//! so a rerun skips a copy still in place (one HEAD, not a copy and a full read). `--gc`
//! then deletes the uploads under `_spool/pNNNN/shards/` (orphans of killed or superseded
//! uploads, and the published shards' originals).
//!
//! Invariants: `_manifest.json` is written last, so a reader that sees it sees every shard
//! it lists; finalize publishes only shard records before the seal, and they hold
//! disjoint items (`commits`), so the published folder holds every committed item exactly
//! once; finalize is idempotent (names are fixed by the log, a partition already sealed
//! keeps its seal), so a failed one is run again. Nothing read from the store is trusted:
//! nothing is written until every record, done marker, rejected-rows object and claim has
//! passed its check (one that fails is an error naming it), a published shard stays only
//! if its bytes have the size and sha256 its record names, and a progress object is used
//! only if it names this partition's published keys.

use crate::cluster::budget::{self, BudgetLog};
use crate::cluster::commits::{self, untrusted, CommitError, CommitLog, LoadOptions, Record, Seal};
use crate::cluster::job::JobRecord;
use crate::cluster::manifest::{
    published_key, Manifest, ManifestFailure, ManifestShard, FORMAT, MANIFEST,
};
use crate::cluster::status::{partitions, PartitionState, PARTITIONS_IN_FLIGHT};
use crate::error::{Context, Error};
use crate::output::bucket::Bucket;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Shards copied and checked at once.
const PUBLISH_IN_FLIGHT: usize = 32;

/// What `finalize` is asked to do beyond publishing.
#[derive(Debug, Clone, Copy, Default)]
pub struct FinalizeOptions {
    /// Publish what is committed even if some partitions have not finished.
    pub partial: bool,
    /// Delete the uploads under `_spool/*/shards/` once published.
    pub gc: bool,
}

/// What `finalize` did, beyond the manifest.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Finalized {
    pub manifest: Option<Manifest>,
    /// Shards copied now, and shards already published by an earlier run.
    pub copied: u64,
    pub skipped: u64,
    /// Objects `--gc` deleted.
    pub collected: u64,
}

/// The key of partition `p`'s record of its published shards.
pub fn progress_key(p: u32) -> String {
    format!("{}/published.json", commits::partition_prefix(p))
}

/// A partition's published shards: what a rerun of `finalize` need not copy again.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Progress {
    format: u32,
    partition: u32,
    partitions: u32,
    shards: Vec<PublishedShard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PublishedShard {
    dataset: String,
    seq: u64,
    bytes: u64,
    sha256: String,
    /// The published copy's ETag when it was checked.
    etag: String,
}

/// Partition `part`'s published shards as an earlier run recorded them (none when none);
/// one that is not this partition's, or names a shard that is not a published one, is
/// an error naming it.
async fn read_progress(
    bucket: &Bucket,
    part: u32,
    count: u32,
) -> Result<Vec<PublishedShard>, Error> {
    let key = progress_key(part);
    let Some(body) = bucket.get_capped(&key, commits::RECORD_BYTES).await? else {
        return Ok(Vec::new());
    };
    let pr: Progress = serde_json::from_slice(&body)
        .map_err(|e| untrusted(&key, format!("not a record of published shards: {e}")))?;
    if pr.partition != part || pr.partitions != count {
        return Err(untrusted(
            &key,
            format!(
                "it says partition {} of {}, but is filed under partition {part} of {count}",
                pr.partition, pr.partitions
            ),
        )
        .into());
    }
    if let Some(s) = pr
        .shards
        .iter()
        .find(|s| !commits::is_dataset_name(&s.dataset) || !commits::is_sha256(&s.sha256))
    {
        return Err(untrusted(
            &key,
            format!(
                "shard {} of {:?} is not a published shard",
                s.seq, s.dataset
            ),
        )
        .into());
    }
    Ok(pr.shards)
}

/// Seals every partition, publishes every committed shard and writes the manifest;
/// refuses while a partition has not marked itself done (its worker may still commit),
/// unless `opts.partial`. `job` is the job record (budgets and its version).
pub async fn finalize(
    bucket: &Arc<Bucket>,
    count: u32,
    job: Option<&JobRecord>,
    opts: FinalizeOptions,
) -> Result<Finalized, Error> {
    crate::cluster::worker::probe(bucket, "finalize").await?;
    let parts = partitions(bucket, count, LoadOptions::READER).await?;
    let missing: Vec<u32> = parts
        .iter()
        .filter(|(s, _)| !s.done)
        .map(|(s, _)| s.partition)
        .collect();
    if !missing.is_empty() && !opts.partial {
        let keys: Vec<String> = missing.iter().map(|&p| commits::done_key(p)).collect();
        return Err(Error::msg(format!(
            "partitions {missing:?} of {count} have not finished (no {}); run finalize after every partition's worker exits 0 (or pass --partial)",
            keys.join(", ")
        )));
    }
    // Every claim, and every rejected-rows object, is checked before anything is written.
    let budgets: BTreeMap<String, u64> = job
        .map(|j| {
            j.datasets
                .iter()
                .filter_map(|(n, d)| d.token_budget.map(|b| (n.clone(), b)))
                .collect()
        })
        .unwrap_or_default();
    for name in budgets.keys() {
        let ledger = BudgetLog::load(bucket.clone(), name, count).await?;
        for (_, log) in &parts {
            budget::check_claims(log, name, &ledger)?;
        }
    }
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
    // The seal: from here on nothing is committed; a record that landed first is read.
    let sealed: Vec<Result<(PartitionState, CommitLog), Error>> = futures_util::stream::iter(parts)
        .map(|(state, mut log)| async move {
            if log.sealed().is_none() {
                let partial = !state.done;
                log.append_anyway(Record::Seal(Seal {
                    head: commits::Head::new("seal", log.partition(), "finalize"),
                    sealed_unix: crate::cluster::job::now_unix(),
                    partial,
                }))
                .await?;
            }
            Ok((state, log))
        })
        .buffered(PARTITIONS_IN_FLIGHT)
        .collect()
        .await;
    let parts: Vec<(PartitionState, CommitLog)> = sealed.into_iter().collect::<Result<_, _>>()?;
    let mut manifest = Manifest {
        format: FORMAT,
        spool_version: env!("CARGO_PKG_VERSION").to_string(),
        partitions: count,
        datasets: BTreeMap::new(),
        incomplete: missing,
        job_version: job.map(|j| j.version),
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
            copies.push((state.partition, c, key.clone(), dest));
        }
        for (name, d) in log.datasets() {
            let m = manifest.datasets.entry(name.clone()).or_default();
            m.failed
                .extend(d.failed.iter().map(|(id, reason)| ManifestFailure {
                    partition: state.partition,
                    id: id.clone(),
                    reason: reason.clone(),
                }));
        }
    }
    // What an earlier run published and checked, per partition.
    let mut done_before: HashMap<u32, Vec<PublishedShard>> = HashMap::new();
    for (state, _) in &parts {
        let prior = read_progress(bucket, state.partition, count).await?;
        done_before.insert(state.partition, prior);
    }
    type Copied = (u32, Result<(PublishedShard, bool), Error>);
    let results: Vec<Copied> = futures_util::stream::iter(copies)
        .map(|(partition, c, key, dest)| {
            let prior = done_before.get(&partition).and_then(|v| {
                v.iter()
                    .find(|s| s.seq == c.seq && s.dataset == c.dataset)
                    .cloned()
            });
            async move {
                (
                    partition,
                    publish(bucket, partition, c, &key, &dest, prior).await,
                )
            }
        })
        .buffer_unordered(PUBLISH_IN_FLIGHT)
        .collect()
        .await;
    let mut out = Finalized::default();
    let mut progress: BTreeMap<u32, Vec<PublishedShard>> = BTreeMap::new();
    let mut first_error = None;
    for (partition, r) in results {
        match r {
            Ok((shard, copied)) => {
                if copied {
                    out.copied += 1;
                } else {
                    out.skipped += 1;
                }
                progress.entry(partition).or_default().push(shard);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    // Kept even when a copy failed, so the rerun skips what was published.
    for (partition, mut shards) in progress {
        shards.sort_by_key(|s| s.seq);
        let body = serde_json::to_vec(&Progress {
            format: commits::FORMAT,
            partition,
            partitions: count,
            shards,
        })?;
        bucket.put(&progress_key(partition), body.into()).await?;
    }
    if let Some(e) = first_error {
        return Err(e);
    }
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
    if opts.gc {
        out.collected = collect_garbage(bucket, &parts).await?;
    }
    out.manifest = Some(manifest);
    Ok(out)
}

/// Publishes committed shard `key` (record `c`) as `dest`, unless an earlier run's copy is
/// still there (`prior`, same size and ETag); a copy is checked against the record (size
/// and sha256) and deleted, naming both, when it differs. Returns what was published and
/// whether it was copied now.
async fn publish(
    bucket: &Arc<Bucket>,
    partition: u32,
    c: &commits::Commit,
    key: &str,
    dest: &str,
    prior: Option<PublishedShard>,
) -> Result<(PublishedShard, bool), Error> {
    if let Some(prior) = prior.filter(|p| p.sha256 == c.sha256 && p.bytes == c.bytes) {
        if let Some((size, Some(etag))) = bucket.head(dest).await? {
            if size == c.bytes && etag == prior.etag {
                return Ok((prior, false));
            }
        }
    }
    let record = commits::commit_key(partition, c.seq);
    bucket
        .copy(key, dest)
        .await
        .with_context(|| format!("cannot publish {key} as {dest}"))?;
    let got = bucket.checksum(dest).await?;
    match got {
        Some(u) if u.sha256 == c.sha256 && u.bytes == c.bytes => {
            let etag = bucket
                .head(dest)
                .await?
                .and_then(|(_, e)| e)
                .unwrap_or_default();
            Ok((
                PublishedShard {
                    dataset: c.dataset.clone(),
                    seq: c.seq,
                    bytes: c.bytes,
                    sha256: c.sha256.clone(),
                    etag,
                },
                true,
            ))
        }
        got => {
            bucket.delete(dest).await?;
            let (bytes, sha) = got.map_or((0, "(none)".to_string()), |u| (u.bytes, u.sha256));
            Err(Error::msg(format!(
                "{record}: its shard {key} is {bytes} bytes of sha256 {sha}, but the record says {} bytes of sha256 {}; not published (the object changed after it was committed)",
                c.bytes, c.sha256
            )))
        }
    }
}

/// Deletes every upload under the partitions' `_spool/pNNNN/shards/` (the published
/// shards' originals, and orphans no record names: uploads of killed workers or of
/// shards committed smaller) and leftover probe keys; returns how many.
async fn collect_garbage(
    bucket: &Arc<Bucket>,
    parts: &[(PartitionState, CommitLog)],
) -> Result<u64, Error> {
    let mut keys = Vec::new();
    for (state, log) in parts {
        let named: std::collections::HashSet<&str> = log
            .commits()
            .iter()
            .filter_map(|c| c.key.as_deref())
            .collect();
        let prefix = format!("{}/shards/", commits::partition_prefix(state.partition));
        let listed = bucket.list(&prefix).await?;
        let orphans = listed
            .iter()
            .filter(|(k, _)| !named.contains(k.as_str()))
            .count();
        tracing::info!(
            partition = state.partition,
            uploads = listed.len(),
            orphans,
            "collecting uploads"
        );
        keys.extend(listed.into_iter().map(|(k, _)| k));
    }
    keys.extend(
        bucket
            .list("_spool/probe/")
            .await?
            .into_iter()
            .map(|(k, _)| k),
    );
    let n = keys.len() as u64;
    let deleted: Vec<Result<(), crate::output::bucket::BucketError>> =
        futures_util::stream::iter(keys)
            .map(|k| async move { bucket.delete(&k).await })
            .buffer_unordered(PUBLISH_IN_FLIGHT)
            .collect()
            .await;
    deleted.into_iter().collect::<Result<Vec<()>, _>>()?;
    Ok(n)
}
