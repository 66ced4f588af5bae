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
//!
//! `record` is the stored records, `keys` where they live, `check` the trust checks,
//! `checkpoint` the packed ranges, `log` reading and appending.

mod check;
mod checkpoint;
mod keys;
mod log;
mod record;

pub use check::{check, is_sha256, read_done};
pub use keys::{
    checkpoint_key, commit_key, done_key, partition_prefix, rejected_dataset, rejected_key,
    shard_key, status_key,
};
pub use log::{Appended, CommitLog, DatasetLog, LoadOptions};
pub use record::{
    parse, Claim, Commit, Done, Failed, FailedItem, Head, Record, Release, Retry, Seal,
};

use crate::output::bucket::BucketError;

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

#[cfg(test)]
mod tests;
