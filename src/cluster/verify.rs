//! `spool verify` of a cluster job: the published output against the manifest and the
//! partitions' logs, each problem naming the object it is about.
//!
//! Invariant: verify trusts nothing it checks — every record is read one by one (not from
//! its checkpoint) and a checkpoint that packs other records than those is a problem;
//! every listed shard is downloaded (into a private scratch folder) and read.

use crate::cluster::commits::{self, CommitError, CommitLog, LoadOptions};
use crate::cluster::manifest::{published_key, read_manifest, Manifest, MANIFEST};
use crate::cluster::partition::Partition;
use crate::cluster::status::PARTITIONS_IN_FLIGHT;
use crate::error::Error;
use crate::output::bucket::Bucket;
use crate::output::reader;
use futures_util::StreamExt;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

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

/// A partition's log as far as it can be trusted, and the problems found reading it.
async fn read_logs(
    bucket: &Arc<Bucket>,
    p: Partition,
) -> Result<(Option<CommitLog>, Vec<PublishedProblem>), Error> {
    let mut problems = Vec::new();
    let refused = |e: CommitError| -> Result<PublishedProblem, Error> {
        match e.key() {
            Some(key) => Ok(PublishedProblem {
                path: key.to_string(),
                detail: e.to_string().replacen(&format!("{key}: "), "", 1),
            }),
            None => Err(e.into()),
        }
    };
    let log = match CommitLog::load(bucket.clone(), p, LoadOptions::RECORDS).await {
        Ok(log) => Some(log),
        Err(e) => {
            problems.push(refused(e)?);
            None
        }
    };
    if let Some(log) = &log {
        // The checkpoints must pack exactly the records.
        match CommitLog::load(bucket.clone(), p, LoadOptions::READER).await {
            Ok(packed) if packed.commits() == log.commits() && packed.len() == log.len() => {}
            Ok(_) => problems.push(PublishedProblem {
                path: format!("{}/checkpoints/", commits::partition_prefix(p.index)),
                detail: "the checkpoints do not pack the partition's records (readers that use them would see another log)".into(),
            }),
            Err(e) => problems.push(refused(e)?),
        }
    }
    if let Err(e) = commits::read_done(bucket, p).await {
        problems.push(refused(e)?);
    }
    Ok((log, problems))
}

/// Checks the published output against the manifest and the commit logs: every record
/// and done marker is one this job's workers wrote (each refused one is a problem naming
/// it), and the checkpoints pack the records; the manifest is one spool writes; every
/// listed shard is there with its size, checksum and rows, and is the one its commit
/// record names; each (id, sample, turn) appears once per dataset; no `.parquet` object
/// in a dataset folder is unlisted; every committed shard is listed; every log is sealed.
/// Shards are downloaded one at a time into `scratch`.
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
    type Read = Result<(Option<CommitLog>, Vec<PublishedProblem>), Error>;
    let read: Vec<Read> = futures_util::stream::iter(0..count)
        .map(|index| read_logs(bucket, Partition { index, count }))
        .buffered(PARTITIONS_IN_FLIGHT)
        .collect()
        .await;
    let mut logs: Vec<(u32, CommitLog)> = Vec::new();
    for (index, r) in read.into_iter().enumerate() {
        let (log, found) = r?;
        problems.extend(found);
        if let Some(log) = log {
            logs.push((index as u32, log));
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
    for (index, log) in &logs {
        if log.sealed().is_none() {
            problems.push(problem(
                &commits::partition_prefix(*index),
                "its log is not sealed: it was reopened (`spool retry`) or written to after `spool finalize`; run its worker, then `spool finalize` again".into(),
            ));
        }
    }
    let record_of = |partition: u32, seq: u64| {
        logs.iter()
            .find(|(i, _)| *i == partition)
            .and_then(|(_, l)| {
                let c = l.commits();
                c.binary_search_by_key(&seq, |c| c.seq).ok().map(|i| &c[i])
            })
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
