//! A checkpoint: a hundred records of a partition packed in one zstd object, so a reader
//! makes one request for them.
//!
//! Invariant: a checkpoint is used only if it packs exactly the records its name says, of
//! this partition and job; each record is then checked as if read from its own key. It
//! is read into memory only up to [`CHECKPOINT_BYTES`] packed and a fixed size unpacked.

use super::{checkpoint_key, untrusted, CommitError, CHECKPOINT_BYTES, CHECKPOINT_EVERY, FORMAT};
use crate::cluster::partition::Partition;
use crate::output::bucket::Bucket;
use serde::{Deserialize, Serialize};
use std::io::Read;

const CHECKPOINT_RAW_BYTES: u64 = 1 << 30;

/// A checkpoint as stored: records `first..=last` of a partition, each as stored.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Checkpoint {
    pub(super) format: u32,
    pub(super) partition: u32,
    pub(super) partitions: u32,
    pub(super) first: u64,
    pub(super) last: u64,
    pub(super) records: Vec<serde_json::Value>,
}

/// Reads checkpoint `first` of partition `p`: its records as stored, each named by the
/// key it stands for. One whose fields, range or records are not what its name says is
/// [`CommitError::Untrusted`], naming it.
pub(super) async fn read_checkpoint(
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
