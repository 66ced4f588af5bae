//! The commit log of one partition as read so far: loading it (checkpoints where there
//! are some, records one by one otherwise), what it says of each dataset, and appending
//! a record with a conditional create.
//!
//! Invariant: a record joins the log only in sequence order and after [`check`] and the
//! log's own rules (no item in two shard records, no release past the allowance, no
//! record but a retry or a seal after a seal); an append that loses its number takes in
//! the winner's record before the caller tries again.

use super::checkpoint::{read_checkpoint, Checkpoint};
use super::keys::{checkpoint_first, record_seq};
use super::record::{parse_value, record_of};
use super::{
    check, checkpoint_key, commit_key, partition_prefix, untrusted, Commit, CommitError, Record,
    Seal, CHECKPOINT_EVERY, FORMAT, RECORD_BYTES,
};
use crate::cluster::partition::Partition;
use crate::output::bucket::{Bucket, Created};
use futures_util::StreamExt;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// Records and checkpoints read at once while loading a log.
const READS_IN_FLIGHT: usize = 32;

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
