//! A partition's log in the object store: which shard objects count, which items failed
//! for good, the budget the partition holds, and whether the job was published.
//!
//! Layout under the output prefix (`_`-prefixed, so pyarrow and DuckDB directory scans skip
//! it): `_spool/pNNNN/shards/<writer>/<dataset>/part-<local index>-<sha8>.parquet`, the
//! uploaded shards; `_spool/pNNNN/commits/<seq>.json`, the records; and
//! `_spool/pNNNN/checkpoints/<first>.json.zst`, each packing records `first..first+99`
//! so a reader makes one request for a hundred. A record is created with a conditional
//! write (`If-None-Match: *`): exactly one writer gets each sequence number, and a writer
//! tries `seq` only after reading records `0..seq`. Records are of kinds:
//!
//! - `shard` (no `kind` field, as format 1 wrote them): a shard that counts ([`Commit`]);
//! - `failed`: items of a dataset that failed for good, with their reasons;
//! - `retry`: failed items sent back (`spool retry`); it also reopens a sealed log;
//! - `claim` / `release`: budget tickets taken from the job's pool, and unused budget
//!   given back (`cluster::budget`); the partition's allowance is claims less releases;
//! - `seal`: written by `spool finalize`; no record but `retry` may follow it.
//!
//! Invariant: the item ids of any two shard records of a partition are disjoint — a writer
//! leaves out of its shard every item a record before `seq` holds (whoever wrote it), and
//! if another writer takes `seq` first it reads that record and checks again at `seq + 1`.
//! Invariant: a shard record names an object that was wholly uploaded before the record
//! existed. Invariant: after a seal nothing is committed, since a writer reads the seal
//! before it could take the next number. Invariant: nothing read from the store is
//! trusted. A record is used only if it is one a worker of this job could have written
//! ([`check`]): filed under its own partition and sequence number, of this job's
//! partition count, a dataset name that is a safe folder name, its items owned by its
//! partition and (shards) held by no earlier record, a shard exactly at [`shard_key`] of
//! its writer, dataset, index and sha256 when it has items and none when it has none, a
//! release within what the partition holds, nothing but a retry after a seal. A
//! checkpoint is used only if it packs exactly the records of its name, each passing the
//! same checks. Anything else, and any other object among the records or checkpoints, is
//! [`CommitError::Untrusted`], naming the object: never a path, a skipped item or a copy.

use crate::cluster::partition::{self, Partition};
use crate::output::bucket::{Bucket, BucketError, Created};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::sync::Arc;

/// The newest record format this spool reads and the one it writes; format 1 (shard
/// records of earlier spools) is read as it is. A reader refuses a newer one.
pub const FORMAT: u32 = 2;

/// The most bytes a commit record, done marker or status object is read into memory: far
/// above what a worker writes (a record lists one shard's item ids), far below harm.
pub const RECORD_BYTES: u64 = 64 << 20;

/// Records per checkpoint.
pub const CHECKPOINT_EVERY: u64 = 100;

/// The most bytes of a checkpoint read, compressed and unpacked.
pub const CHECKPOINT_BYTES: u64 = 256 << 20;
const CHECKPOINT_RAW_BYTES: u64 = 1 << 30;

/// Records and checkpoints read at once while loading a log.
const READS_IN_FLIGHT: usize = 32;

/// The longest failure reason kept in a record (a server's error, cut).
pub const REASON_CHARS: usize = 1000;

/// Names under the output prefix that are spool's own, so no dataset may have them.
pub const RESERVED: [&str; 2] = ["_spool", "_manifest.json"];

/// Whether `name` can be a dataset's folder under the output prefix: a config dataset
/// name (`config::valid_name`) other than spool's own names.
pub fn is_dataset_name(name: &str) -> bool {
    crate::config::valid_name(name) && !RESERVED.contains(&name)
}

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
    /// An object no worker of this job could have written where a record or marker
    /// belongs: forged, edited by hand, or another job's.
    #[error("{key}: not a record this job's workers wrote: {detail}; nothing was published from it (move it out of the prefix once you know where it came from)")]
    Untrusted { key: String, detail: String },
    /// The log ends with `spool finalize`'s seal: the job is published.
    /// A record that must go in whatever others appended no longer fits the log.
    #[error(
        "partition {partition}: a record no longer fits the log ({detail}); nothing was written"
    )]
    Outdated { partition: u32, detail: String },
    #[error("partition {partition} is sealed ({key}): `spool finalize` published this job{partial}, so nothing more is committed to it; new work goes to a new output prefix, and `spool retry` reopens it for failed items")]
    Sealed {
        partition: u32,
        key: String,
        partial: &'static str,
    },
}

impl CommitError {
    /// The object at fault, when the error is about one (not about reaching the store or
    /// about a sealed log).
    pub fn key(&self) -> Option<&str> {
        match self {
            CommitError::Bucket(_) | CommitError::Sealed { .. } | CommitError::Outdated { .. } => {
                None
            }
            CommitError::Malformed { key, .. }
            | CommitError::Newer { key, .. }
            | CommitError::Gap { key, .. }
            | CommitError::Untrusted { key, .. } => Some(key),
        }
    }
}

pub(crate) fn untrusted(key: &str, detail: impl Into<String>) -> CommitError {
    CommitError::Untrusted {
        key: key.into(),
        detail: detail.into(),
    }
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
    /// taken the partition past its allowance.
    pub dropped: u64,
    /// Items left out for the allowance (part of `dropped`'s items).
    #[serde(default)]
    pub over_share: u64,
    /// The items (ids) the shard holds.
    pub ids: Vec<String>,
    pub spool_version: String,
}

/// The fields every record but a shard record has first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Head {
    pub format: u32,
    pub kind: String,
    pub partition: u32,
    pub partitions: u32,
    pub seq: u64,
    pub writer: String,
    pub spool_version: String,
}

impl Head {
    /// A head of `kind` for partition `p` by `writer` (its `seq` is set when appended).
    pub fn new(kind: &str, p: Partition, writer: &str) -> Head {
        Head {
            format: FORMAT,
            kind: kind.into(),
            partition: p.index,
            partitions: p.count,
            seq: 0,
            writer: writer.into(),
            spool_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// `spool finalize` published the job: nothing more is committed to this log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Seal {
    #[serde(flatten)]
    pub head: Head,
    /// When (seconds since the Unix epoch).
    pub sealed_unix: u64,
    /// Published with `--partial`, this partition maybe unfinished.
    pub partial: bool,
}

/// One item that failed for good, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedItem {
    pub id: String,
    pub reason: String,
}

/// Items of a dataset that failed for good (every attempt used up).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failed {
    #[serde(flatten)]
    pub head: Head,
    pub dataset: String,
    pub items: Vec<FailedItem>,
}

/// Failed items sent back to be generated again (`spool retry`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Retry {
    #[serde(flatten)]
    pub head: Head,
    pub dataset: String,
    pub ids: Vec<String>,
}

/// A budget ticket of the job's pool taken by this partition (`cluster::budget`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    #[serde(flatten)]
    pub head: Head,
    pub dataset: String,
    /// The ticket's sequence number in the dataset's budget log.
    pub ticket: u64,
    pub tokens: u64,
}

/// Budget this partition gives back to the job's pool (unused when its worker stopped, or
/// taken back from a partition whose worker is gone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Release {
    #[serde(flatten)]
    pub head: Head,
    pub dataset: String,
    pub tokens: u64,
}

/// One record of a partition's log.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Shard(Commit),
    Seal(Seal),
    Failed(Failed),
    Retry(Retry),
    Claim(Claim),
    Release(Release),
}

impl Record {
    fn head_fields(&self) -> (u32, u32, u64, &str) {
        match self {
            Record::Shard(c) => (c.partition, c.partitions, c.seq, &c.writer),
            Record::Seal(Seal { head, .. })
            | Record::Failed(Failed { head, .. })
            | Record::Retry(Retry { head, .. })
            | Record::Claim(Claim { head, .. })
            | Record::Release(Release { head, .. }) => {
                (head.partition, head.partitions, head.seq, &head.writer)
            }
        }
    }

    /// Its sequence number.
    pub fn seq(&self) -> u64 {
        self.head_fields().2
    }

    fn set_seq(&mut self, seq: u64) {
        match self {
            Record::Shard(c) => c.seq = seq,
            Record::Seal(Seal { head, .. })
            | Record::Failed(Failed { head, .. })
            | Record::Retry(Retry { head, .. })
            | Record::Claim(Claim { head, .. })
            | Record::Release(Release { head, .. }) => head.seq = seq,
        }
    }

    /// The record as stored.
    pub fn to_value(&self) -> serde_json::Value {
        let v = match self {
            Record::Shard(c) => serde_json::to_value(c),
            Record::Seal(r) => serde_json::to_value(r),
            Record::Failed(r) => serde_json::to_value(r),
            Record::Retry(r) => serde_json::to_value(r),
            Record::Claim(r) => serde_json::to_value(r),
            Record::Release(r) => serde_json::to_value(r),
        };
        // Plain structs of strings and numbers always serialize.
        v.unwrap_or_default()
    }
}

/// The key of a partition's folder under `_spool/`.
pub fn partition_prefix(p: u32) -> String {
    format!("_spool/p{p:04}")
}

/// The key of commit `seq` of partition `p`.
pub fn commit_key(p: u32, seq: u64) -> String {
    format!("{}/commits/{seq:010}.json", partition_prefix(p))
}

/// The key of the checkpoint of partition `p` packing records `first..first+99`.
pub fn checkpoint_key(p: u32, first: u64) -> String {
    format!("{}/checkpoints/{first:010}.json.zst", partition_prefix(p))
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

/// The dataset of `key` when it is partition `p`'s rejected rows of a dataset
/// ([`rejected_key`] of a dataset name).
pub fn rejected_dataset(p: u32, key: &str) -> Option<&str> {
    let name = key
        .strip_prefix(&format!("{}/rejected/", partition_prefix(p)))?
        .strip_suffix(".jsonl")?;
    is_dataset_name(name).then_some(name)
}

/// The key of the status (`spool status --json`'s form, with a heartbeat) a worker keeps.
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
    /// Records in the log when the worker finished.
    pub commits: u64,
    /// Items recorded as failed for good (done with failures).
    #[serde(default)]
    pub failed: u64,
    pub spool_version: String,
}

/// The outcome of [`CommitLog::append`].
#[derive(Debug, Clone, PartialEq)]
pub enum Appended {
    /// The record is in the log at this sequence number.
    Committed(u64),
    /// Another writer took the sequence number first; its record is now in the log, and
    /// the caller must check again (its shard, its release) before the next try.
    Lost(u64),
    /// Nothing was written: the log moved on since the caller made the record (a twin
    /// committed one of its items or gave back budget), so it no longer fits; the caller
    /// makes it again from the log as it is now.
    Outdated(String),
}

/// What the log says of one dataset.
#[derive(Debug, Default, Clone)]
pub struct DatasetLog {
    /// Items in shard records.
    pub committed: HashSet<String>,
    /// Completion tokens of the shard records.
    pub tokens: u64,
    /// The same per writer.
    pub by_writer: HashMap<String, u64>,
    /// Items failed for good and not sent back or committed since: id → reason.
    pub failed: BTreeMap<String, String>,
    /// Items sent back by `spool retry` and not committed or failed again since.
    pub retried: HashSet<String>,
    /// Budget tickets taken: ticket → tokens.
    pub claims: BTreeMap<u64, u64>,
    /// Budget given back: (seq of the release record, tokens).
    pub releases: Vec<(u64, u64)>,
}

impl DatasetLog {
    /// The budget the partition holds: its tickets less what it gave back.
    pub fn allowance(&self) -> u64 {
        let claimed: u64 = self.claims.values().sum();
        let released: u64 = self.releases.iter().map(|(_, t)| t).sum();
        claimed.saturating_sub(released)
    }
}

/// The commit log of one partition, as read so far.
pub struct CommitLog {
    bucket: Arc<Bucket>,
    partition: Partition,
    /// Records read (the next sequence number).
    len: u64,
    commits: Vec<Commit>,
    datasets: HashMap<String, DatasetLog>,
    /// (writer, dataset, local index) of every shard record.
    shards: HashSet<(String, String, u64)>,
    /// The seal the log ends with (no retry after it), and its key.
    sealed: Option<(String, Seal)>,
    /// Records since the last checkpoint's range, as stored: the next checkpoint.
    block: Vec<serde_json::Value>,
    /// Whether this reader writes the checkpoints it finds missing (workers do).
    writes_checkpoints: bool,
}

/// How a log is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Read checkpoints where there are some (else every record, one request each).
    pub checkpoints: bool,
    /// Write a checkpoint for each full range of records that has none.
    pub write_checkpoints: bool,
}

impl LoadOptions {
    /// A worker: reads checkpoints and writes the missing ones.
    pub const WORKER: LoadOptions = LoadOptions {
        checkpoints: true,
        write_checkpoints: true,
    };
    /// `finalize` and `status`: read checkpoints, write nothing.
    pub const READER: LoadOptions = LoadOptions {
        checkpoints: true,
        write_checkpoints: false,
    };
    /// `verify`: every record, one by one.
    pub const RECORDS: LoadOptions = LoadOptions {
        checkpoints: false,
        write_checkpoints: false,
    };
}

/// A checkpoint as stored: records `first..=last` of a partition, each as stored.
#[derive(Debug, Serialize, Deserialize)]
struct Checkpoint {
    format: u32,
    partition: u32,
    partitions: u32,
    first: u64,
    last: u64,
    records: Vec<serde_json::Value>,
}

impl CommitLog {
    /// Reads every record of the partition, in order, as `opts` says.
    pub async fn load(
        bucket: Arc<Bucket>,
        partition: Partition,
        opts: LoadOptions,
    ) -> Result<Self, CommitError> {
        let mut log = Self {
            bucket,
            partition,
            len: 0,
            commits: Vec::new(),
            datasets: HashMap::new(),
            shards: HashSet::new(),
            sealed: None,
            block: Vec::new(),
            writes_checkpoints: opts.write_checkpoints,
        };
        let p = partition.index;
        let listed = log
            .bucket
            .list(&format!("{}/commits/", partition_prefix(p)))
            .await?;
        let mut seqs = Vec::with_capacity(listed.len());
        for (key, _) in &listed {
            match record_seq(p, key) {
                Some(seq) => seqs.push(seq),
                None => {
                    return Err(untrusted(
                        key,
                        "not a commit record (they are named commits/NNNNNNNNNN.json)",
                    ))
                }
            }
        }
        let n = seqs.len() as u64;
        // Listed sorted: a gap shows as a number past the count.
        if let Some(&last) = seqs.last() {
            if last >= n {
                let missing = (0..n).find(|s| seqs.binary_search(s).is_err()).unwrap_or(0);
                return Err(CommitError::Gap {
                    partition: p,
                    seq: missing,
                    key: commit_key(p, last),
                });
            }
        }
        let mut packed: HashSet<u64> = HashSet::new();
        if opts.checkpoints {
            for (key, _) in log
                .bucket
                .list(&format!("{}/checkpoints/", partition_prefix(p)))
                .await?
            {
                match checkpoint_first(p, &key) {
                    Some(first) => {
                        packed.insert(first);
                    }
                    None => {
                        return Err(untrusted(
                            &key,
                            "not a checkpoint (they are named checkpoints/NNNNNNNNNN.json.zst, a multiple of 100)",
                        ))
                    }
                }
            }
        }
        // Whole ranges from their checkpoint where there is one, the rest record by record;
        // read many at once, pushed in order.
        enum Read {
            Pack(u64),
            One(u64),
        }
        let mut reads = Vec::new();
        let mut missing_packs = Vec::new();
        let mut seq = 0;
        while seq < n {
            let full = seq + CHECKPOINT_EVERY <= n;
            if full && packed.contains(&seq) {
                reads.push(Read::Pack(seq));
                seq += CHECKPOINT_EVERY;
            } else {
                if full && seq.is_multiple_of(CHECKPOINT_EVERY) {
                    missing_packs.push(seq);
                }
                reads.push(Read::One(seq));
                seq += 1;
            }
        }
        let bucket = log.bucket.clone();
        let mut stream = futures_util::stream::iter(reads)
            .map(|r| {
                let bucket = bucket.clone();
                async move {
                    match r {
                        Read::Pack(first) => read_checkpoint(&bucket, partition, first).await,
                        Read::One(seq) => {
                            let key = commit_key(p, seq);
                            match bucket.get_capped(&key, RECORD_BYTES).await? {
                                Some(body) => Ok(vec![(key.clone(), parse_value(&key, &body)?)]),
                                None => Err(CommitError::Gap {
                                    partition: p,
                                    seq,
                                    key,
                                }),
                            }
                        }
                    }
                }
            })
            .buffered(READS_IN_FLIGHT);
        while let Some(batch) = stream.next().await {
            for (key, value) in batch? {
                let seq = log.len;
                let record = record_of(&key, value.clone())?;
                log.push(&key, seq, record, value)?;
            }
        }
        drop(stream);
        if log.writes_checkpoints {
            for first in missing_packs {
                log.write_checkpoint_from_store(first).await;
            }
        }
        // Records created between the listing and now.
        log.catch_up().await?;
        Ok(log)
    }

    /// Reads records past the last one known, if any were created since.
    pub async fn catch_up(&mut self) -> Result<(), CommitError> {
        loop {
            let seq = self.len;
            let key = commit_key(self.partition.index, seq);
            match self.bucket.get_capped(&key, RECORD_BYTES).await? {
                Some(body) => {
                    let value = parse_value(&key, &body)?;
                    let record = record_of(&key, value.clone())?;
                    self.push(&key, seq, record, value)?;
                    self.after_push().await;
                }
                None => return Ok(()),
            }
        }
    }

    /// Adds record `seq` (read from `key`) once it is one this job could have written and
    /// agrees with the records before it.
    fn push(
        &mut self,
        key: &str,
        seq: u64,
        record: Record,
        stored: serde_json::Value,
    ) -> Result<(), CommitError> {
        check(key, &record, self.partition, seq)?;
        if let Some((seal_key, _)) = &self.sealed {
            if !matches!(record, Record::Retry(_) | Record::Seal(_)) {
                return Err(untrusted(
                    key,
                    format!(
                        "it comes after the seal {seal_key}, and no worker commits to a sealed log"
                    ),
                ));
            }
        }
        match record {
            Record::Shard(c) => {
                let d = self.datasets.entry(c.dataset.clone()).or_default();
                if let Some(id) = c.ids.iter().find(|id| d.committed.contains(*id)) {
                    return Err(untrusted(
                        key,
                        format!(
                            "it holds item {id:?} of dataset `{}`, which an earlier record of partition {} holds",
                            c.dataset, self.partition.index
                        ),
                    ));
                }
                for id in &c.ids {
                    d.failed.remove(id);
                    d.retried.remove(id);
                    d.committed.insert(id.clone());
                }
                d.tokens += c.completion_tokens;
                *d.by_writer.entry(c.writer.clone()).or_default() += c.completion_tokens;
                self.shards
                    .insert((c.writer.clone(), c.dataset.clone(), c.local_index));
                self.commits.push(c);
            }
            Record::Failed(f) => {
                let d = self.datasets.entry(f.dataset.clone()).or_default();
                for item in f.items {
                    if !d.committed.contains(&item.id) {
                        d.retried.remove(&item.id);
                        d.failed.insert(item.id, item.reason);
                    }
                }
            }
            Record::Retry(r) => {
                let d = self.datasets.entry(r.dataset.clone()).or_default();
                for id in r.ids {
                    d.failed.remove(&id);
                    if !d.committed.contains(&id) {
                        d.retried.insert(id);
                    }
                }
                self.sealed = None;
            }
            Record::Claim(c) => {
                let d = self.datasets.entry(c.dataset.clone()).or_default();
                match d.claims.get(&c.ticket) {
                    Some(&t) if t != c.tokens => {
                        return Err(untrusted(
                            key,
                            format!(
                            "it claims ticket {} of `{}` as {} tokens, an earlier record as {t}",
                            c.ticket, c.dataset, c.tokens
                        ),
                        ))
                    }
                    // Twins may both record a ticket one of them took: counted once.
                    Some(_) => {}
                    None => {
                        d.claims.insert(c.ticket, c.tokens);
                    }
                }
            }
            Record::Release(r) => {
                let d = self.datasets.entry(r.dataset.clone()).or_default();
                if r.tokens > d.allowance() {
                    return Err(untrusted(
                        key,
                        format!(
                            "it gives back {} tokens of `{}`, but the partition holds {}",
                            r.tokens,
                            r.dataset,
                            d.allowance()
                        ),
                    ));
                }
                d.releases.push((seq, r.tokens));
            }
            Record::Seal(s) => {
                if self.sealed.is_none() {
                    self.sealed = Some((key.to_string(), s));
                }
            }
        }
        self.len = seq + 1;
        if seq.is_multiple_of(CHECKPOINT_EVERY) {
            self.block.clear();
        }
        self.block.push(stored);
        Ok(())
    }

    /// After a record pushed: a full range of records gets its checkpoint (best effort: a
    /// missing one costs the next reader a hundred requests, and it writes it then).
    async fn after_push(&mut self) {
        if self.writes_checkpoints
            && self.len.is_multiple_of(CHECKPOINT_EVERY)
            && self.block.len() as u64 == CHECKPOINT_EVERY
        {
            let first = self.len - CHECKPOINT_EVERY;
            let records = std::mem::take(&mut self.block);
            self.write_checkpoint(first, records).await;
        }
    }

    async fn write_checkpoint(&self, first: u64, records: Vec<serde_json::Value>) {
        let p = self.partition;
        let c = Checkpoint {
            format: FORMAT,
            partition: p.index,
            partitions: p.count,
            first,
            last: first + records.len() as u64 - 1,
            records,
        };
        let key = checkpoint_key(p.index, first);
        let body = match serde_json::to_vec(&c)
            .map_err(std::io::Error::other)
            .and_then(|b| zstd::encode_all(&b[..], 3))
        {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "cannot pack a checkpoint");
                return;
            }
        };
        match self.bucket.put(&key, body.into()).await {
            Ok(()) => tracing::debug!(key = %key, "checkpoint written"),
            Err(e) => {
                tracing::warn!(key = %key, error = %e, "cannot write a checkpoint; the next reader reads the records")
            }
        }
    }

    /// Writes the checkpoint of records `first..first+99`, read again from the store.
    async fn write_checkpoint_from_store(&self, first: u64) {
        let mut records = Vec::new();
        for seq in first..first + CHECKPOINT_EVERY {
            let key = commit_key(self.partition.index, seq);
            match self.bucket.get_capped(&key, RECORD_BYTES).await {
                Ok(Some(body)) => match serde_json::from_slice(&body) {
                    Ok(v) => records.push(v),
                    Err(_) => return,
                },
                _ => return,
            }
        }
        self.write_checkpoint(first, records).await;
    }

    /// The partition this log is of.
    pub fn partition(&self) -> Partition {
        self.partition
    }

    /// Records read (the next sequence number).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no record exists.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every shard record read, in sequence order.
    pub fn commits(&self) -> &[Commit] {
        &self.commits
    }

    /// What the log says of `dataset` (empty when nothing).
    pub fn dataset(&self, dataset: &str) -> std::borrow::Cow<'_, DatasetLog> {
        match self.datasets.get(dataset) {
            Some(d) => std::borrow::Cow::Borrowed(d),
            None => std::borrow::Cow::Owned(DatasetLog::default()),
        }
    }

    /// Every dataset the log names.
    pub fn datasets(&self) -> impl Iterator<Item = (&String, &DatasetLog)> {
        self.datasets.iter()
    }

    /// Whether item `id` of `dataset` is in a shard record.
    pub fn is_committed(&self, dataset: &str, id: &str) -> bool {
        self.datasets
            .get(dataset)
            .is_some_and(|d| d.committed.contains(id))
    }

    /// The items of `dataset` a worker no longer takes in: committed, or failed for good
    /// and not sent back. A copy, made once at start for intake.
    pub fn settled(&self, dataset: &str) -> HashSet<String> {
        let Some(d) = self.datasets.get(dataset) else {
            return HashSet::new();
        };
        let mut out = d.committed.clone();
        out.extend(d.failed.keys().cloned());
        out
    }

    /// The seal the log ends with, and its key.
    pub fn sealed(&self) -> Option<&(String, Seal)> {
        self.sealed.as_ref()
    }

    fn sealed_error(&self) -> Option<CommitError> {
        self.sealed.as_ref().map(|(key, s)| CommitError::Sealed {
            partition: self.partition.index,
            key: key.clone(),
            partial: if s.partial { " (--partial)" } else { "" },
        })
    }

    /// Whether `writer` has committed its local shard `local_index` of `dataset`.
    pub fn has(&self, writer: &str, dataset: &str, local_index: u64) -> bool {
        self.shards
            .contains(&(writer.to_string(), dataset.to_string(), local_index))
    }

    /// Completion tokens of `dataset` committed by every writer.
    pub fn committed_tokens(&self, dataset: &str) -> u64 {
        self.datasets.get(dataset).map_or(0, |d| d.tokens)
    }

    /// Completion tokens of `dataset` committed by writers other than `writer`: on a fresh
    /// `data_dir` they are spent already but in no local queue.
    pub fn tokens_by_others(&self, writer: &str, dataset: &str) -> u64 {
        self.datasets.get(dataset).map_or(0, |d| {
            d.tokens - d.by_writer.get(writer).copied().unwrap_or(0)
        })
    }

    /// Tries to add `record` at the next sequence number (its `seq` is set here); a sealed
    /// log takes nothing but a retry or a seal ([`CommitError::Sealed`]).
    pub async fn append(&mut self, mut record: Record) -> Result<Appended, CommitError> {
        if !matches!(record, Record::Retry(_) | Record::Seal(_)) {
            if let Some(e) = self.sealed_error() {
                return Err(e);
            }
        }
        // Checked before the write: once created, a record that contradicts the log would
        // make every reader refuse the partition.
        if let Some(why) = self.conflict(&record) {
            return Ok(Appended::Outdated(why));
        }
        let seq = self.len;
        record.set_seq(seq);
        let key = commit_key(self.partition.index, seq);
        let value = record.to_value();
        let body = serde_json::to_vec_pretty(&value).map_err(|e| CommitError::Malformed {
            key: key.clone(),
            detail: e.to_string(),
        })?;
        match self.bucket.create(&key, body.into()).await? {
            Created::Mine => {
                self.push(&key, seq, record, value)?;
                self.after_push().await;
                Ok(Appended::Committed(seq))
            }
            Created::Theirs(existing) => {
                let value = parse_value(&key, &existing)?;
                let theirs = record_of(&key, value.clone())?;
                self.push(&key, seq, theirs, value)?;
                self.after_push().await;
                Ok(Appended::Lost(seq))
            }
        }
    }

    /// Appends `record`, trying the next number after each lost race (the record must be
    /// valid whatever others appended: a failure, a retry, a claim, a seal).
    pub async fn append_anyway(&mut self, record: Record) -> Result<u64, CommitError> {
        loop {
            match self.append(record.clone()).await? {
                Appended::Committed(seq) => return Ok(seq),
                Appended::Lost(_) => {}
                Appended::Outdated(detail) => {
                    return Err(CommitError::Outdated {
                        partition: self.partition.index,
                        detail,
                    })
                }
            }
            if !matches!(record, Record::Retry(_) | Record::Seal(_)) {
                if let Some(e) = self.sealed_error() {
                    return Err(e);
                }
            }
        }
    }

    /// Why `record` would contradict the log as read so far (what [`Self::push`] refuses
    /// in a stored record), if it would.
    fn conflict(&self, record: &Record) -> Option<String> {
        match record {
            Record::Shard(c) => {
                let d = self.datasets.get(&c.dataset)?;
                c.ids
                    .iter()
                    .find(|id| d.committed.contains(*id))
                    .map(|id| format!("item {id:?} of `{}` is committed already", c.dataset))
            }
            Record::Release(r) => {
                let held = self.dataset(&r.dataset).allowance();
                (r.tokens > held).then(|| {
                    format!(
                        "it gives back {} tokens of `{}`, the partition holds {held}",
                        r.tokens, r.dataset
                    )
                })
            }
            Record::Claim(c) => {
                let d = self.datasets.get(&c.dataset)?;
                d.claims
                    .get(&c.ticket)
                    .filter(|&&t| t != c.tokens)
                    .map(|t| {
                        format!(
                            "ticket {} of `{}` is recorded as {t} tokens",
                            c.ticket, c.dataset
                        )
                    })
            }
            Record::Failed(_) | Record::Retry(_) | Record::Seal(_) => None,
        }
    }

    /// Stops with [`CommitError::Sealed`] when the log ends with a seal.
    pub fn refuse_sealed(&self) -> Result<(), CommitError> {
        match self.sealed_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The sequence number of `key` when it is the name of a record of partition `p`.
fn record_seq(p: u32, key: &str) -> Option<u64> {
    let name = key.strip_prefix(&format!("{}/commits/", partition_prefix(p)))?;
    let digits = name.strip_suffix(".json")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The first record of `key` when it is the name of a checkpoint of partition `p`.
fn checkpoint_first(p: u32, key: &str) -> Option<u64> {
    let name = key.strip_prefix(&format!("{}/checkpoints/", partition_prefix(p)))?;
    let digits = name.strip_suffix(".json.zst")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse::<u64>().ok())
        .flatten()
        .filter(|first| first.is_multiple_of(CHECKPOINT_EVERY))
}

/// Reads checkpoint `first` of partition `p`: its records as stored, each named by the
/// key it stands for. One whose fields, range or records are not what its name says is
/// [`CommitError::Untrusted`], naming it.
async fn read_checkpoint(
    bucket: &Bucket,
    p: Partition,
    first: u64,
) -> Result<Vec<(String, serde_json::Value)>, CommitError> {
    let key = checkpoint_key(p.index, first);
    let Some(body) = bucket.get_capped(&key, CHECKPOINT_BYTES).await? else {
        return Err(untrusted(&key, "listed, then gone"));
    };
    let mut raw = Vec::new();
    zstd::stream::read::Decoder::new(&body[..])
        .and_then(|d| d.take(CHECKPOINT_RAW_BYTES + 1).read_to_end(&mut raw))
        .map_err(|e| untrusted(&key, format!("not zstd-packed records: {e}")))?;
    if raw.len() as u64 > CHECKPOINT_RAW_BYTES {
        return Err(untrusted(
            &key,
            format!("more than {CHECKPOINT_RAW_BYTES} bytes unpacked"),
        ));
    }
    let c: Checkpoint = serde_json::from_slice(&raw)
        .map_err(|e| untrusted(&key, format!("not a checkpoint: {e}")))?;
    if c.format > FORMAT {
        return Err(CommitError::Newer {
            key,
            format: c.format,
        });
    }
    if c.partition != p.index
        || c.partitions != p.count
        || c.first != first
        || c.last != first + CHECKPOINT_EVERY - 1
        || c.records.len() as u64 != CHECKPOINT_EVERY
    {
        return Err(untrusted(
            &key,
            format!(
                "it says partition {} of {}, records {}..={} ({} of them), but is filed as partition {} of {}, records {first}..={}",
                c.partition,
                c.partitions,
                c.first,
                c.last,
                c.records.len(),
                p.index,
                p.count,
                first + CHECKPOINT_EVERY - 1
            ),
        ));
    }
    // Each record is then checked as if read from its own key, and a failure names both.
    Ok(c.records
        .into_iter()
        .enumerate()
        .map(|(i, v)| (format!("{key} (record {})", first + i as u64), v))
        .collect())
}

/// Whether `s` is a hex sha256 as spool writes them (64 lower-case digits).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Refuses `record`, read from `key` as record `seq` of partition `p`, unless a worker of
/// this job could have written it (module invariants).
pub fn check(key: &str, record: &Record, p: Partition, seq: u64) -> Result<(), CommitError> {
    let no = |detail: String| Err(untrusted(key, detail));
    let (partition, partitions, rseq, writer) = record.head_fields();
    if partition != p.index {
        return no(format!(
            "it says partition {partition}, but is filed under partition {}",
            p.index
        ));
    }
    if partitions != p.count {
        return no(format!(
            "it says partitions = {partitions}, but this job has {}",
            p.count
        ));
    }
    if rseq != seq {
        return no(format!("it says seq {rseq}, but is filed as commit {seq}"));
    }
    if !crate::config::valid_name(writer) {
        return no(format!("writer {writer:?} is not a writer id"));
    }
    let dataset_ok = |dataset: &str| -> Result<(), CommitError> {
        if is_dataset_name(dataset) {
            Ok(())
        } else {
            no(format!(
                "dataset {dataset:?} is not a dataset name ([A-Za-z0-9_.-]+, not `.`, `..`, `_spool` or `_manifest.json`)"
            ))
        }
    };
    let owned =
        |dataset: &str, ids: &mut dyn Iterator<Item = &String>| -> Result<(), CommitError> {
            let mut seen = HashSet::new();
            for id in ids {
                if !seen.insert(id.as_str()) {
                    return no(format!("it lists item {id:?} twice"));
                }
                let owner = partition::owner(dataset, id, p.count);
                if owner != p.index {
                    return no(format!(
                        "item {id:?} of `{dataset}` belongs to partition {owner}"
                    ));
                }
            }
            Ok(())
        };
    match record {
        Record::Shard(c) => {
            dataset_ok(&c.dataset)?;
            check_shard(key, c, p)?;
            owned(&c.dataset, &mut c.ids.iter())
        }
        Record::Failed(f) => {
            dataset_ok(&f.dataset)?;
            if f.items.is_empty() {
                return no("it lists no failed item".into());
            }
            if let Some(i) = f
                .items
                .iter()
                .find(|i| i.reason.chars().count() > REASON_CHARS)
            {
                return no(format!(
                    "the reason of item {:?} is longer than {REASON_CHARS} characters",
                    i.id
                ));
            }
            owned(&f.dataset, &mut f.items.iter().map(|i| &i.id))
        }
        Record::Retry(r) => {
            dataset_ok(&r.dataset)?;
            owned(&r.dataset, &mut r.ids.iter())
        }
        Record::Claim(c) => {
            dataset_ok(&c.dataset)?;
            if c.tokens == 0 {
                return no("a claim of 0 tokens".into());
            }
            Ok(())
        }
        Record::Release(r) => {
            dataset_ok(&r.dataset)?;
            if r.tokens == 0 {
                return no("a release of 0 tokens".into());
            }
            Ok(())
        }
        Record::Seal(_) => Ok(()),
    }
}

/// The shard record's own rules: its object at its writer's upload key, rows to hold its
/// items, no items without a shard.
fn check_shard(key: &str, c: &Commit, p: Partition) -> Result<(), CommitError> {
    let no = |detail: String| Err(untrusted(key, detail));
    match &c.key {
        None => {
            if !c.ids.is_empty() || c.rows > 0 || c.completion_tokens > 0 {
                return no(format!(
                    "it lists {} items ({} rows) but no shard: they would count as committed and never be published",
                    c.ids.len(),
                    c.rows
                ));
            }
        }
        Some(k) => {
            if !is_sha256(&c.sha256) {
                return no(format!("sha256 {:?} is not a sha256", c.sha256));
            }
            let expected = shard_key(p.index, &c.writer, &c.dataset, c.local_index, &c.sha256);
            if *k != expected {
                return no(format!(
                    "its shard key {k:?} is not where its writer uploads that shard ({expected})"
                ));
            }
            if c.ids.is_empty() || c.rows < c.ids.len() as u64 || c.bytes == 0 {
                return no(format!(
                    "a shard of {} rows and {} bytes cannot hold {} items",
                    c.rows,
                    c.bytes,
                    c.ids.len()
                ));
            }
        }
    }
    Ok(())
}

/// Reads partition `p`'s done marker (`None` when it has none), refusing one that is not
/// this partition's.
pub async fn read_done(bucket: &Bucket, p: Partition) -> Result<Option<Done>, CommitError> {
    let key = done_key(p.index);
    let Some(body) = bucket.get_capped(&key, RECORD_BYTES).await? else {
        return Ok(None);
    };
    let d: Done = serde_json::from_slice(&body).map_err(|e| CommitError::Malformed {
        key: key.clone(),
        detail: e.to_string(),
    })?;
    if d.partition != p.index || d.partitions != p.count {
        return Err(untrusted(
            &key,
            format!(
                "it says partition {} of {}, but is filed under partition {} of {}",
                d.partition, d.partitions, p.index, p.count
            ),
        ));
    }
    if !crate::config::valid_name(&d.writer) {
        return Err(untrusted(
            &key,
            format!("writer {:?} is not a writer id", d.writer),
        ));
    }
    Ok(Some(d))
}

/// A record's JSON, refusing a newer format's.
fn parse_value(key: &str, body: &[u8]) -> Result<serde_json::Value, CommitError> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| CommitError::Malformed {
            key: key.into(),
            detail: e.to_string(),
        })?;
    Ok(v)
}

/// The record a stored JSON value is: its `kind` (none: a shard record), refusing a newer
/// format's.
fn record_of(key: &str, v: serde_json::Value) -> Result<Record, CommitError> {
    let format = v.get("format").and_then(|f| f.as_u64()).unwrap_or(0);
    if format > u64::from(FORMAT) {
        return Err(CommitError::Newer {
            key: key.into(),
            format: format.min(u64::from(u32::MAX)) as u32,
        });
    }
    let malformed = |e: serde_json::Error| CommitError::Malformed {
        key: key.into(),
        detail: e.to_string(),
    };
    let kind = v.get("kind").map(|k| k.as_str().unwrap_or("?").to_string());
    Ok(match kind.as_deref() {
        None => Record::Shard(serde_json::from_value(v).map_err(malformed)?),
        Some("seal") => Record::Seal(serde_json::from_value(v).map_err(malformed)?),
        Some("failed") => Record::Failed(serde_json::from_value(v).map_err(malformed)?),
        Some("retry") => Record::Retry(serde_json::from_value(v).map_err(malformed)?),
        Some("claim") => Record::Claim(serde_json::from_value(v).map_err(malformed)?),
        Some("release") => Record::Release(serde_json::from_value(v).map_err(malformed)?),
        Some(other) => {
            return Err(CommitError::Malformed {
                key: key.into(),
                detail: format!("unknown kind {other:?}"),
            })
        }
    })
}

/// Parses a record as stored, refusing a newer format's.
pub fn parse(key: &str, body: &[u8]) -> Result<Record, CommitError> {
    record_of(key, parse_value(key, body)?)
}

#[cfg(test)]
mod tests;
