//! The trust checks of what a partition's log holds: a record is used only if a worker of
//! this job could have written it, and a done marker only if it is this partition's.
//!
//! Invariant: every check names the object it refuses ([`CommitError::Untrusted`]); no
//! record read from the store is used before [`check`] passes it.

use super::record::{Commit, Done, Record};
use super::{
    done_key, is_dataset_name, shard_key, untrusted, CommitError, REASON_CHARS, RECORD_BYTES,
};
use crate::cluster::partition::{self, Partition};
use crate::output::bucket::Bucket;
use std::collections::HashSet;

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
