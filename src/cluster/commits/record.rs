//! The records of a partition's log as stored: one type per kind, the done marker, and
//! the reading of a stored JSON value into a [`Record`].
//!
//! Invariant: a record of a newer format than [`FORMAT`] is refused before its fields are
//! read; a shard record is the one without a `kind` (format 1 wrote it so).

use super::{CommitError, FORMAT};
use crate::cluster::partition::Partition;
use serde::{Deserialize, Serialize};

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
    pub(super) fn head_fields(&self) -> (u32, u32, u64, &str) {
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

    pub(super) fn set_seq(&mut self, seq: u64) {
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
    /// Its worker left the partition's unused budget to a twin still running: a dead
    /// partition's budget is taken back even though it is done.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub twin_settles: bool,
    pub spool_version: String,
}

/// A record's JSON, refusing a newer format's.
pub(super) fn parse_value(key: &str, body: &[u8]) -> Result<serde_json::Value, CommitError> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| CommitError::Malformed {
            key: key.into(),
            detail: e.to_string(),
        })?;
    Ok(v)
}

/// The record a stored JSON value is: its `kind` (none: a shard record), refusing a newer
/// format's.
pub(super) fn record_of(key: &str, v: serde_json::Value) -> Result<Record, CommitError> {
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
