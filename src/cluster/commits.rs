//! A partition's commit log in the object store: which shard objects count.
//!
//! Layout under the output prefix (`_`-prefixed, so pyarrow and DuckDB directory scans skip
//! it): `_spool/pNNNN/shards/<writer>/<dataset>/part-<local index>-<sha8>.parquet`, the
//! uploaded shards, and `_spool/pNNNN/commits/<seq>.json`, one record per shard that counts.
//! A record is created with a conditional write (`If-None-Match: *`, `PutMode::Create`):
//! exactly one writer gets each sequence number, and a writer tries `seq` only after reading
//! records `0..seq`.
//!
//! Invariant: the item ids of any two records of a partition are disjoint — a writer leaves
//! out of its shard every item a record before `seq` holds (whoever wrote it), and if
//! another writer takes `seq` first it reads that record and checks again at `seq + 1`.
//! Invariant: a record names an object that was wholly uploaded before the record existed.

use crate::cluster::partition::Partition;
use crate::output::bucket::{Bucket, BucketError, Created};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The record's format; a reader refuses a newer one rather than misread it.
pub const FORMAT: u32 = 1;

/// Failures of the commit log: the store's, or a record that is not what spool writes.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    Bucket(#[from] BucketError),
    #[error("{key}: not a spool commit record: {detail}")]
    Malformed { key: String, detail: String },
    #[error(
        "{key}: commit record format {format}, newer than this spool's {FORMAT}; use a newer spool"
    )]
    Newer { key: String, format: u32 },
    #[error("partition {partition}: commit {seq} is missing but later ones exist ({key}); the log was edited by hand")]
    Gap {
        partition: u32,
        seq: u64,
        key: String,
    },
}

/// One shard that counts: what a reader, `finalize` and `verify` need to know of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Commit {
    pub format: u32,
    pub partition: u32,
    pub partitions: u32,
    pub seq: u64,
    /// The writer (one per `data_dir`) that made the shard.
    pub writer: String,
    pub dataset: String,
    /// The shard's index in the writer's local output.
    pub local_index: u64,
    /// The shard object, relative to the output prefix; `None` when every row of the
    /// local shard was already committed by someone else.
    pub key: Option<String>,
    pub rows: u64,
    pub completion_tokens: u64,
    pub bytes: u64,
    pub sha256: String,
    /// Rows of the local shard left out: their items were committed first, or would have
    /// taken the partition past its budget share.
    pub dropped: u64,
    /// Items left out for the budget share (part of `dropped`'s items).
    #[serde(default)]
    pub over_share: u64,
    /// The items (ids) the shard holds.
    pub ids: Vec<String>,
    pub spool_version: String,
}

/// The key of a partition's folder under `_spool/`.
pub fn partition_prefix(p: u32) -> String {
    format!("_spool/p{p:04}")
}

/// The key of commit `seq` of partition `p`.
pub fn commit_key(p: u32, seq: u64) -> String {
    format!("{}/commits/{seq:010}.json", partition_prefix(p))
}

/// The key a writer uploads a shard to: unique per writer, shard and content.
pub fn shard_key(p: u32, writer: &str, dataset: &str, local_index: u64, sha256: &str) -> String {
    let short = &sha256[..sha256.len().min(12)];
    format!(
        "{}/shards/{writer}/{dataset}/part-{local_index:06}-{short}.parquet",
        partition_prefix(p)
    )
}

/// The key of a partition's rejected rows of `dataset`.
pub fn rejected_key(p: u32, dataset: &str) -> String {
    format!("{}/rejected/{dataset}.jsonl", partition_prefix(p))
}

/// The key of the status (`spool status --json`'s form) a worker leaves when it stops.
pub fn status_key(p: u32) -> String {
    format!("{}/status.json", partition_prefix(p))
}

/// The key of the marker a worker writes when its partition is wholly done.
pub fn done_key(p: u32) -> String {
    format!("{}/done.json", partition_prefix(p))
}

/// What a partition's worker wrote when it finished: `finalize` waits for every one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Done {
    pub partition: u32,
    pub partitions: u32,
    pub writer: String,
    /// Commits in the log when the worker finished.
    pub commits: u64,
    pub spool_version: String,
}

/// The outcome of [`CommitLog::append`].
#[derive(Debug, Clone, PartialEq)]
pub enum Appended {
    /// The record is in the log at this sequence number.
    Committed(u64),
    /// Another writer took the sequence number first; its record is now in the log, and
    /// the caller must check its shard against it again before the next try.
    Lost(u64),
}

/// The commit log of one partition, as read so far.
pub struct CommitLog {
    bucket: Arc<Bucket>,
    partition: Partition,
    commits: Vec<Commit>,
    ids: HashMap<String, Arc<HashSet<String>>>,
}

impl CommitLog {
    /// Reads every record of the partition, in order.
    pub async fn load(bucket: Arc<Bucket>, partition: Partition) -> Result<Self, CommitError> {
        let mut log = Self {
            bucket,
            partition,
            commits: Vec::new(),
            ids: HashMap::new(),
        };
        let listed = log
            .bucket
            .list(&format!("{}/commits/", partition_prefix(partition.index)))
            .await?;
        let n = listed.len() as u64;
        for seq in 0..n {
            let key = commit_key(partition.index, seq);
            let Some(body) = log.bucket.get(&key).await? else {
                return Err(CommitError::Gap {
                    partition: partition.index,
                    seq,
                    key,
                });
            };
            log.push(parse(&key, &body)?);
        }
        // Records created between the listing and now.
        log.catch_up().await?;
        Ok(log)
    }

    /// Reads records past the last one known, if any were created since.
    pub async fn catch_up(&mut self) -> Result<(), CommitError> {
        loop {
            let key = commit_key(self.partition.index, self.commits.len() as u64);
            match self.bucket.get(&key).await? {
                Some(body) => {
                    let c = parse(&key, &body)?;
                    self.push(c);
                }
                None => return Ok(()),
            }
        }
    }

    fn push(&mut self, c: Commit) {
        let set = self.ids.entry(c.dataset.clone()).or_default();
        Arc::make_mut(set).extend(c.ids.iter().cloned());
        self.commits.push(c);
    }

    /// Every record read, in sequence order.
    pub fn commits(&self) -> &[Commit] {
        &self.commits
    }

    /// The ids of `dataset` committed so far.
    pub fn committed_ids(&self, dataset: &str) -> Arc<HashSet<String>> {
        self.ids.get(dataset).cloned().unwrap_or_default()
    }

    /// Whether `writer` has committed its local shard `local_index` of `dataset`.
    pub fn has(&self, writer: &str, dataset: &str, local_index: u64) -> bool {
        self.commits
            .iter()
            .any(|c| c.writer == writer && c.dataset == dataset && c.local_index == local_index)
    }

    /// Completion tokens of `dataset` committed by every writer.
    pub fn committed_tokens(&self, dataset: &str) -> u64 {
        self.commits
            .iter()
            .filter(|c| c.dataset == dataset)
            .map(|c| c.completion_tokens)
            .sum()
    }

    /// Completion tokens of `dataset` committed by writers other than `writer`: on a fresh
    /// `data_dir` they are spent already but in no local queue.
    pub fn tokens_by_others(&self, writer: &str, dataset: &str) -> u64 {
        self.commits
            .iter()
            .filter(|c| c.writer != writer && c.dataset == dataset)
            .map(|c| c.completion_tokens)
            .sum()
    }

    /// Tries to add `c` at the next sequence number (its `seq` is set here).
    pub async fn append(&mut self, mut c: Commit) -> Result<Appended, CommitError> {
        let seq = self.commits.len() as u64;
        c.seq = seq;
        let key = commit_key(self.partition.index, seq);
        let body = serde_json::to_vec_pretty(&c).map_err(|e| CommitError::Malformed {
            key: key.clone(),
            detail: e.to_string(),
        })?;
        match self.bucket.create(&key, body.into()).await? {
            Created::Mine => {
                self.push(c);
                Ok(Appended::Committed(seq))
            }
            Created::Theirs(existing) => {
                let theirs = parse(&key, &existing)?;
                self.push(theirs);
                Ok(Appended::Lost(seq))
            }
        }
    }
}

/// Parses a record, refusing another partition's or a newer format's.
pub fn parse(key: &str, body: &[u8]) -> Result<Commit, CommitError> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| CommitError::Malformed {
            key: key.into(),
            detail: e.to_string(),
        })?;
    let format = v.get("format").and_then(|f| f.as_u64()).unwrap_or(0) as u32;
    if format > FORMAT {
        return Err(CommitError::Newer {
            key: key.into(),
            format,
        });
    }
    serde_json::from_value(v).map_err(|e| CommitError::Malformed {
        key: key.into(),
        detail: e.to_string(),
    })
}
