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
//! Invariant: nothing read from the store is trusted. A record is used only if it is one
//! a worker of this job could have written ([`check`]): filed under its own partition and
//! sequence number, of this job's partition count, a dataset name that is a safe folder
//! name, its items owned by its partition and held by no earlier record, a shard exactly
//! at [`shard_key`] of its writer, dataset, index and sha256 when it has items, and none
//! when it has none. Anything else, and any other object among the records, is
//! [`CommitError::Untrusted`], naming the object: never a path, a skipped item or a copy.

use crate::cluster::partition::{self, Partition};
use crate::output::bucket::{Bucket, BucketError, Created};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The record's format; a reader refuses a newer one rather than misread it.
pub const FORMAT: u32 = 1;

/// The most bytes a commit record, done marker or status object is read into memory: far
/// above what a worker writes (a record lists one shard's item ids), far below harm.
pub const RECORD_BYTES: u64 = 64 << 20;

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
}

impl CommitError {
    /// The object at fault, when the error is about one (not about reaching the store).
    pub fn key(&self) -> Option<&str> {
        match self {
            CommitError::Bucket(_) => None,
            CommitError::Malformed { key, .. }
            | CommitError::Newer { key, .. }
            | CommitError::Gap { key, .. }
            | CommitError::Untrusted { key, .. } => Some(key),
        }
    }
}

fn untrusted(key: &str, detail: impl Into<String>) -> CommitError {
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

/// The dataset of `key` when it is partition `p`'s rejected rows of a dataset
/// ([`rejected_key`] of a dataset name).
pub fn rejected_dataset(p: u32, key: &str) -> Option<&str> {
    let name = key
        .strip_prefix(&format!("{}/rejected/", partition_prefix(p)))?
        .strip_suffix(".jsonl")?;
    is_dataset_name(name).then_some(name)
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
        for (key, _) in &listed {
            if record_seq(partition.index, key).is_none() {
                return Err(untrusted(
                    key,
                    "not a commit record (they are named commits/NNNNNNNNNN.json)",
                ));
            }
        }
        let n = listed.len() as u64;
        for seq in 0..n {
            let key = commit_key(partition.index, seq);
            let Some(body) = log.bucket.get_capped(&key, RECORD_BYTES).await? else {
                return Err(CommitError::Gap {
                    partition: partition.index,
                    seq,
                    key,
                });
            };
            let c = parse(&key, &body)?;
            log.push(&key, seq, c)?;
        }
        // Records created between the listing and now.
        log.catch_up().await?;
        Ok(log)
    }

    /// Reads records past the last one known, if any were created since.
    pub async fn catch_up(&mut self) -> Result<(), CommitError> {
        loop {
            let seq = self.commits.len() as u64;
            let key = commit_key(self.partition.index, seq);
            match self.bucket.get_capped(&key, RECORD_BYTES).await? {
                Some(body) => {
                    let c = parse(&key, &body)?;
                    self.push(&key, seq, c)?;
                }
                None => return Ok(()),
            }
        }
    }

    /// Adds record `seq` (read from `key`) once it is one this job could have written and
    /// holds no item an earlier record holds.
    fn push(&mut self, key: &str, seq: u64, c: Commit) -> Result<(), CommitError> {
        check(key, &c, self.partition, seq)?;
        if let Some(held) = self.ids.get(&c.dataset) {
            if let Some(id) = c.ids.iter().find(|id| held.contains(*id)) {
                return Err(untrusted(
                    key,
                    format!(
                        "it holds item {id:?} of dataset `{}`, which an earlier record of partition {} holds",
                        c.dataset, self.partition.index
                    ),
                ));
            }
        }
        let set = self.ids.entry(c.dataset.clone()).or_default();
        Arc::make_mut(set).extend(c.ids.iter().cloned());
        self.commits.push(c);
        Ok(())
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
                self.push(&key, seq, c)?;
                Ok(Appended::Committed(seq))
            }
            Created::Theirs(existing) => {
                let theirs = parse(&key, &existing)?;
                self.push(&key, seq, theirs)?;
                Ok(Appended::Lost(seq))
            }
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

/// Whether `s` is a hex sha256 as spool writes them (64 lower-case digits).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Refuses record `c`, read from `key` as commit `seq` of partition `p`, unless a worker
/// of this job could have written it (module invariants).
pub fn check(key: &str, c: &Commit, p: Partition, seq: u64) -> Result<(), CommitError> {
    let no = |detail: String| Err(untrusted(key, detail));
    if c.partition != p.index {
        return no(format!(
            "it says partition {}, but is filed under partition {}",
            c.partition, p.index
        ));
    }
    if c.partitions != p.count {
        return no(format!(
            "it says partitions = {}, but this job has {}",
            c.partitions, p.count
        ));
    }
    if c.seq != seq {
        return no(format!(
            "it says seq {}, but is filed as commit {seq}",
            c.seq
        ));
    }
    if !is_dataset_name(&c.dataset) {
        return no(format!(
            "dataset {:?} is not a dataset name ([A-Za-z0-9_.-]+, not `.`, `..`, `_spool` or `_manifest.json`)",
            c.dataset
        ));
    }
    if !crate::config::valid_name(&c.writer) {
        return no(format!("writer {:?} is not a writer id", c.writer));
    }
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
    let mut seen = HashSet::with_capacity(c.ids.len());
    for id in &c.ids {
        if !seen.insert(id.as_str()) {
            return no(format!("it lists item {id:?} twice"));
        }
        let owner = partition::owner(&c.dataset, id, p.count);
        if owner != p.index {
            return no(format!(
                "item {id:?} of `{}` belongs to partition {owner}",
                c.dataset
            ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::bucket::BucketOptions;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Ids of `dataset` that partition `index` of `count` owns.
    fn owned(dataset: &str, index: u32, count: u32, n: usize) -> Vec<String> {
        (0..)
            .map(|i| format!("id{i}"))
            .filter(|id| partition::owner(dataset, id, count) == index)
            .take(n)
            .collect()
    }

    fn record(p: Partition, seq: u64, ids: Vec<String>) -> Commit {
        let sha = "ab".repeat(32);
        Commit {
            format: FORMAT,
            partition: p.index,
            partitions: p.count,
            seq,
            writer: "0123456789abcdef".into(),
            dataset: "d".into(),
            local_index: seq,
            key: Some(shard_key(p.index, "0123456789abcdef", "d", seq, &sha)),
            rows: ids.len() as u64 * 2,
            completion_tokens: 10,
            bytes: 100,
            sha256: sha,
            dropped: 0,
            over_share: 0,
            ids,
            spool_version: "0".into(),
        }
    }

    /// A record as a worker writes it passes; each way a record can be one no worker of
    /// this job wrote is refused by name — partition, count, sequence number, dataset name,
    /// writer, items without a shard, a shard at another key or with a bad checksum, too
    /// few rows, an item twice, an item of another partition.
    #[test]
    fn only_records_a_worker_could_write_pass() {
        let p = Partition { index: 1, count: 2 };
        let good = record(p, 3, owned("d", 1, 2, 4));
        let key = commit_key(1, 3);
        check(&key, &good, p, 3).unwrap();
        let foreign = owned("d", 0, 2, 1);
        type Edit = Box<dyn Fn(&mut Commit)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("partition", Box::new(|c| c.partition = 0)),
            ("partitions", Box::new(|c| c.partitions = 3)),
            ("seq", Box::new(|c| c.seq = 4)),
            ("dataset", Box::new(|c| c.dataset = "../x".into())),
            ("dataset", Box::new(|c| c.dataset = "_spool".into())),
            ("dataset", Box::new(|c| c.dataset = "/abs".into())),
            ("writer", Box::new(|c| c.writer = "a/b".into())),
            ("no shard", Box::new(|c| c.key = None)),
            (
                "shard key",
                Box::new(|c| c.key = Some("_manifest.json".into())),
            ),
            ("sha256", Box::new(|c| c.sha256 = "AB".repeat(32))),
            ("cannot hold", Box::new(|c| c.rows = 1)),
            ("twice", Box::new(|c| c.ids.push(c.ids[0].clone()))),
            ("belongs to partition 0", {
                let f = foreign.clone();
                Box::new(move |c| c.ids.push(f[0].clone()))
            }),
        ];
        for (word, edit) in cases {
            let mut c = good.clone();
            edit(&mut c);
            let e = check(&key, &c, p, 3).unwrap_err();
            let said = e.to_string();
            assert!(
                matches!(e, CommitError::Untrusted { .. })
                    && said.contains(&key)
                    && said.contains(word),
                "{word}: {said}"
            );
        }
        // A record of no items and no shard is what a worker writes when others had them all.
        let mut none = good.clone();
        none.key = None;
        none.ids.clear();
        none.rows = 0;
        none.completion_tokens = 0;
        check(&key, &none, p, 3).unwrap();
    }

    /// The log refuses, by name, a record holding an item an earlier one holds, any object
    /// among the records that is not a record, and a record larger than any spool writes;
    /// a done marker of another partition is refused.
    #[test]
    fn the_log_refuses_overlaps_strays_and_giants() {
        rt().block_on(async {
            let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
            let p = Partition { index: 0, count: 1 };
            let ids = owned("d", 0, 1, 3);
            let put = |seq: u64, c: &Commit| {
                let b = b.clone();
                let body = serde_json::to_vec(c).unwrap();
                async move { b.put(&commit_key(0, seq), body.into()).await.unwrap() }
            };
            put(0, &record(p, 0, ids.clone())).await;
            put(1, &record(p, 1, vec![ids[1].clone()])).await;
            let e = CommitLog::load(b.clone(), p).await.err().unwrap();
            assert_eq!(e.key(), Some(commit_key(0, 1).as_str()), "{e}");
            assert!(e.to_string().contains("earlier record"), "{e}");

            b.delete(&commit_key(0, 1)).await.unwrap();
            b.put("_spool/p0000/commits/x.json", "{}".into())
                .await
                .unwrap();
            let e = CommitLog::load(b.clone(), p).await.err().unwrap();
            assert_eq!(e.key(), Some("_spool/p0000/commits/x.json"), "{e}");
            b.delete("_spool/p0000/commits/x.json").await.unwrap();

            let giant = vec![b' '; RECORD_BYTES as usize + 1];
            b.put(&commit_key(0, 1), giant.into()).await.unwrap();
            let e = CommitLog::load(b.clone(), p).await.err().unwrap();
            assert!(e.to_string().contains("more than"), "{e}");
            b.delete(&commit_key(0, 1)).await.unwrap();
            assert_eq!(
                CommitLog::load(b.clone(), p).await.unwrap().commits().len(),
                1
            );

            let done = Done {
                partition: 2,
                partitions: 1,
                writer: "w".into(),
                commits: 1,
                spool_version: "0".into(),
            };
            b.put(&done_key(0), serde_json::to_vec(&done).unwrap().into())
                .await
                .unwrap();
            let e = read_done(&b, p).await.unwrap_err();
            assert!(matches!(e, CommitError::Untrusted { .. }), "{e}");
            assert_eq!(
                rejected_dataset(0, "_spool/p0000/rejected/a.b-c.jsonl"),
                Some("a.b-c")
            );
            assert_eq!(
                rejected_dataset(0, "_spool/p0000/rejected/x/../y.jsonl"),
                None
            );
            assert_eq!(
                rejected_dataset(0, "_spool/p0000/rejected/_spool.jsonl"),
                None
            );
        });
    }
}
