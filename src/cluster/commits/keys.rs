//! Where a partition's objects live under the output prefix, and the reading of a listed
//! key back into the number it names.
//!
//! Invariant: a key is read back only when it is exactly one these functions make (ten
//! digits, the partition's folder), so no listed name is taken on trust.

use super::{is_dataset_name, CHECKPOINT_EVERY};

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

/// The sequence number of `key` when it is the name of a record of partition `p`.
pub(super) fn record_seq(p: u32, key: &str) -> Option<u64> {
    let name = key.strip_prefix(&format!("{}/commits/", partition_prefix(p)))?;
    let digits = name.strip_suffix(".json")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The first record of `key` when it is the name of a checkpoint of partition `p`.
pub(super) fn checkpoint_first(p: u32, key: &str) -> Option<u64> {
    let name = key.strip_prefix(&format!("{}/checkpoints/", partition_prefix(p)))?;
    let digits = name.strip_suffix(".json.zst")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse::<u64>().ok())
        .flatten()
        .filter(|first| first.is_multiple_of(CHECKPOINT_EVERY))
}
