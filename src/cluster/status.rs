//! `spool status` and `spool retry` of a cluster job, from the object store alone.
//!
//! Every partition is read at once, up to [`PARTITIONS_IN_FLIGHT`] (its log from its
//! checkpoints, its done marker and its worker's status). A worker whose heartbeat is
//! older than `heartbeat::STALE_S` while it says it runs shows as stale: dead, or cut off
//! from the store. `retry` sends a partition's items that failed for good back through the
//! store (a `retry` record, its done marker withdrawn, the manifest withdrawn if the job
//! was published), so the partition's next worker — on its volume or a new one — takes
//! them in again.

use crate::cluster::budget::BudgetLog;
use crate::cluster::commits::{self, CommitLog, LoadOptions, Record, Retry};
use crate::cluster::heartbeat;
use crate::cluster::manifest::MANIFEST;
use crate::cluster::partition::Partition;
use crate::error::Error;
use crate::output::bucket::Bucket;
use futures_util::StreamExt;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Partitions read at once by `finalize`, `status`, `verify` and `retry`.
pub const PARTITIONS_IN_FLIGHT: usize = 16;

/// What one partition has committed, for `finalize` and `status`.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionState {
    pub partition: u32,
    /// Shard records.
    pub commits: u64,
    /// Records of every kind.
    pub records: u64,
    pub done: bool,
    /// Its log ends with `finalize`'s seal.
    pub sealed: bool,
    /// Per dataset: (rows, items, completion tokens) committed.
    pub datasets: BTreeMap<String, (u64, u64, u64)>,
    /// Per dataset: items failed for good (and not sent back).
    pub failed: BTreeMap<String, u64>,
    /// Per dataset: items pending, from the worker's live status (written every 15 s
    /// while it runs with its metrics endpoint on) or from when it last stopped; empty
    /// when unknown.
    pub pending: BTreeMap<String, u64>,
    /// Whether `pending` is a running worker's (else its last stop's).
    pub live: bool,
    /// Seconds since its worker's last heartbeat (none: no worker status).
    pub heartbeat_age_s: Option<u64>,
    /// Its worker says it runs, but its heartbeat is older than `heartbeat::STALE_S`: dead
    /// (SIGKILLed, its node lost) or cut off from the store.
    pub stale: bool,
}

/// Reads every partition's log, done marker and worker status, at once; a record or
/// marker no worker of this job could have written is an error naming it (a status object
/// that is not a worker's is left out, said once).
pub async fn partitions(
    bucket: &Arc<Bucket>,
    count: u32,
    opts: LoadOptions,
) -> Result<Vec<(PartitionState, CommitLog)>, Error> {
    futures_util::stream::iter(0..count)
        .map(|index| read_partition(bucket, Partition { index, count }, opts))
        .buffered(PARTITIONS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

async fn read_partition(
    bucket: &Arc<Bucket>,
    p: Partition,
    opts: LoadOptions,
) -> Result<(PartitionState, CommitLog), Error> {
    let log = CommitLog::load(bucket.clone(), p, opts).await?;
    let done = commits::read_done(bucket, p).await?.is_some();
    let mut pending = BTreeMap::new();
    let (mut live, mut stale, mut heartbeat_age_s) = (false, false, None);
    // Shown only: a status object that is not a worker's is left out, said once.
    match heartbeat::read(bucket, p).await {
        Ok(Some(s)) => {
            let age = crate::cluster::job::now_unix().saturating_sub(s.heartbeat_unix);
            heartbeat_age_s = Some(age);
            live = s.running && !done;
            stale = live && age > heartbeat::STALE_S;
            for d in s.report.into_iter().flat_map(|r| r.datasets) {
                pending.insert(d.name, d.pending);
            }
        }
        Ok(None) => {}
        Err(commits::CommitError::Bucket(e))
            if !matches!(e, crate::output::bucket::BucketError::TooLarge { .. }) =>
        {
            return Err(e.into())
        }
        Err(e) => tracing::warn!(error = %e, "its worker's status is not shown"),
    }
    let mut datasets: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for c in log.commits() {
        let e = datasets.entry(c.dataset.clone()).or_default();
        e.0 += c.rows;
        e.1 += c.ids.len() as u64;
        e.2 += c.completion_tokens;
    }
    let failed = log
        .datasets()
        .filter(|(_, d)| !d.failed.is_empty())
        .map(|(n, d)| (n.clone(), d.failed.len() as u64))
        .collect();
    Ok((
        PartitionState {
            partition: p.index,
            commits: log.commits().len() as u64,
            records: log.len(),
            done,
            sealed: log.sealed().is_some(),
            datasets,
            failed,
            pending,
            live,
            heartbeat_age_s,
            stale,
        },
        log,
    ))
}

/// `spool status` of a cluster job, from the object store alone: what every partition has
/// committed and whether it is done, each dataset's tokens against its budget.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    pub output: String,
    /// The job record's version (none: no worker has started).
    pub job_version: Option<u64>,
    pub partitions: Vec<PartitionState>,
    pub datasets: Vec<DatasetTotals>,
    /// `_manifest.json` exists: `spool finalize` has published the output.
    pub finalized: bool,
    /// Partitions the manifest names as published unfinished (`--partial`).
    pub incomplete: Vec<u32>,
}

/// One dataset summed over the partitions.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetTotals {
    pub name: String,
    pub rows: u64,
    pub items: u64,
    pub completion_tokens: u64,
    /// Items failed for good, not sent back.
    pub failed: u64,
    pub budget: Option<u64>,
    /// Tokens of the budget the partitions hold (tickets less returns).
    pub budget_taken: Option<u64>,
}

/// Reads the job's state from the store.
pub async fn status(
    bucket: &Arc<Bucket>,
    count: u32,
    job_version: Option<u64>,
    datasets: &[(String, Option<u64>)],
) -> Result<ClusterStatus, Error> {
    let parts: Vec<PartitionState> = partitions(bucket, count, LoadOptions::READER)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let mut totals = Vec::new();
    for (name, budget) in datasets {
        let mut t = DatasetTotals {
            name: name.clone(),
            rows: 0,
            items: 0,
            completion_tokens: 0,
            failed: 0,
            budget: *budget,
            budget_taken: None,
        };
        for p in &parts {
            if let Some(&(rows, items, tokens)) = p.datasets.get(name) {
                t.rows += rows;
                t.items += items;
                t.completion_tokens += tokens;
            }
            t.failed += p.failed.get(name).copied().unwrap_or(0);
        }
        if budget.is_some() {
            t.budget_taken = Some(BudgetLog::load(bucket.clone(), name, count).await?.out());
        }
        totals.push(t);
    }
    let manifest = crate::cluster::manifest::read_manifest(bucket).await?;
    let incomplete = match &manifest {
        Some(Ok(m)) => m.incomplete.clone(),
        _ => Vec::new(),
    };
    Ok(ClusterStatus {
        output: bucket.url().to_string(),
        job_version,
        partitions: parts,
        datasets: totals,
        finalized: manifest.is_some(),
        incomplete,
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
            "{:<24} {:>10} {:>12} {:>14} {:>8} {:>14}",
            "dataset", "items", "rows", "tokens", "failed", "budget"
        );
        for d in &self.datasets {
            let _ = writeln!(
                s,
                "{:<24} {:>10} {:>12} {:>14} {:>8} {:>14}",
                d.name,
                d.items,
                d.rows,
                d.completion_tokens,
                d.failed,
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
            let mut per: Vec<String> = names
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
                    let failed = p
                        .failed
                        .get(n)
                        .map_or(String::new(), |f| format!(", {f} failed"));
                    format!("{n}: {rows} rows, {tokens} tokens{pending}{failed}")
                })
                .collect();
            if p.stale {
                per.push(format!(
                    "STALE: no heartbeat for {} s (its worker is dead or cut off)",
                    p.heartbeat_age_s.unwrap_or(0)
                ));
            }
            let done = match (p.done, p.sealed) {
                (_, true) => "sealed",
                (true, false) => "yes",
                (false, false) => "no",
            };
            let _ = writeln!(
                s,
                "{:<10} {:>8} {:>6}  {}",
                format!("p{:04}", p.partition),
                p.commits,
                done,
                per.join("; ")
            );
        }
        let done = self.partitions.iter().filter(|p| p.done).count();
        let published = if !self.finalized {
            "not published yet (spool finalize)".to_string()
        } else if self.incomplete.is_empty() {
            "published (_manifest.json)".to_string()
        } else {
            format!(
                "published with partitions {:?} unfinished (--partial)",
                self.incomplete
            )
        };
        let _ = writeln!(
            s,
            "{done} of {} partitions done; {published}",
            self.partitions.len()
        );
        s
    }
}

/// Sends the items of `datasets` (all when empty) that failed for good back through the
/// store: a `retry` record in each partition that has some (reopening a sealed log), its
/// done marker withdrawn, and `_manifest.json` withdrawn when the job was published (the
/// output changes again: readers wait for the next `finalize`). Returns (partition,
/// dataset, items) sent back.
pub async fn retry(
    bucket: &Arc<Bucket>,
    count: u32,
    datasets: &[String],
) -> Result<Vec<(u32, String, u64)>, Error> {
    crate::cluster::worker::probe(bucket, "retry").await?;
    let parts = partitions(bucket, count, LoadOptions::READER).await?;
    let mut out = Vec::new();
    for (state, mut log) in parts {
        let p = log.partition();
        let mut sent = false;
        let failed: Vec<(String, Vec<String>)> = log
            .datasets()
            .filter(|(n, d)| !d.failed.is_empty() && (datasets.is_empty() || datasets.contains(n)))
            .map(|(n, d)| (n.clone(), d.failed.keys().cloned().collect()))
            .collect();
        for (dataset, ids) in failed {
            for chunk in ids.chunks(10_000) {
                log.append_anyway(Record::Retry(Retry {
                    head: commits::Head::new("retry", p, "retry"),
                    dataset: dataset.clone(),
                    ids: chunk.to_vec(),
                }))
                .await?;
            }
            out.push((state.partition, dataset, ids.len() as u64));
            sent = true;
        }
        if sent {
            bucket.delete(&commits::done_key(p.index)).await?;
        }
    }
    if !out.is_empty() && bucket.head(MANIFEST).await?.is_some() {
        bucket.delete(MANIFEST).await?;
        tracing::warn!(
            "_manifest.json withdrawn: the published output changes when the retried items are committed; run the partitions' workers, then `spool finalize` again"
        );
    }
    Ok(out)
}
