//! A partition's publisher: uploads each sealed local shard of a worker's staging folder
//! and commits it to the partition's log, and publishes the rejected rows and the done
//! marker when the worker finishes; beside it, the worker's heartbeat.
//!
//! Invariants: a shard is acknowledged to the cluster only by its commit record, created
//! after the object is wholly uploaded; a shard leaves out the items an earlier record
//! holds (rewritten into a scratch folder, the local shard untouched); under
//! `budget_policy = "cancel"` no commit takes the partition's tokens past its allowance.

use crate::cluster::budget::Agent;
use crate::cluster::commits::{self, Appended, Commit, CommitLog, Done, Record};
use crate::cluster::heartbeat;
use crate::cluster::partition::Partition;
use crate::error::{Context, Error};
use crate::observe::status::StatusReport;
use crate::output::bucket::Bucket;
use crate::output::reader;
use crate::output::shard::{self, ShardLimits};
use crate::output::writer::ShardWriter;
use crate::run::allowance::Allowance;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// How often the publisher looks for newly sealed local shards (a local listing: the
/// store is asked only when there is one).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A worker's heartbeat: its partition's status and its presence, written every
/// [`heartbeat::EVERY`] from a second after start until the worker stops, and what
/// others appended read into the allowances.
pub(super) struct Heartbeat {
    bucket: Arc<Bucket>,
    log: Arc<Mutex<CommitLog>>,
    writer: String,
    partition: Partition,
    allowances: Vec<(String, Arc<Allowance>)>,
    data_dir: PathBuf,
}

impl Heartbeat {
    /// Beats until `stop`; the caller writes the last status once this has returned.
    pub(super) async fn run(self, stop: CancellationToken) {
        // The first beat a second in, once the run's endpoint is up.
        let mut wait = SWEEP_EVERY;
        let mut last = None;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            self.beat(&mut last).await;
            wait = heartbeat::EVERY;
        }
    }

    /// Writes the heartbeat (with the run's live `/status` when its metrics endpoint is
    /// on), then reads records others appended (a twin's commits, a release written for
    /// this partition) into the allowances. Best effort: the run does not depend on it.
    async fn beat(&self, last: &mut Option<StatusReport>) {
        let report =
            match std::fs::read_to_string(self.data_dir.join(crate::run::job::ENDPOINT_FILE)) {
                Ok(addr) => crate::observe::status::fetch(
                    &format!("http://{}", addr.trim()),
                    Duration::from_secs(2),
                )
                .await
                .ok(),
                Err(_) => None,
            };
        // Once the run has ended (its endpoint gone), the last report it gave stands.
        if report.is_some() {
            *last = report;
        }
        if let Err(e) = heartbeat::write(
            &self.bucket,
            self.partition,
            &self.writer,
            true,
            last.clone(),
        )
        .await
        {
            tracing::debug!(error = %e, "cannot write the heartbeat");
        }
        let mut log = self.log.lock().await;
        if log.catch_up().await.is_ok() {
            for (dataset, a) in &self.allowances {
                a.set(Agent::granted(&log, dataset, &self.writer, a), a.is_last());
            }
        }
    }
}

/// Uploads sealed local shards and commits them, in local index order per dataset.
pub(super) struct Publisher {
    pub(super) bucket: Arc<Bucket>,
    pub(super) log: Arc<Mutex<CommitLog>>,
    pub(super) writer: String,
    pub(super) partition: Partition,
    pub(super) staging: PathBuf,
    /// Where a shard is rewritten without rows someone else committed first.
    pub(super) scratch: PathBuf,
    pub(super) datasets: Vec<String>,
    pub(super) compression_level: i32,
    /// Under `budget_policy = "cancel"`: a commit never takes the partition's committed
    /// tokens of a dataset past its allowance, even when two workers run it at once.
    pub(super) cancel_cap: bool,
    /// Each budgeted dataset's allowance, kept in step with the log.
    pub(super) allowances: Vec<(String, Arc<Allowance>)>,
    /// The fault point between upload and commit (tests: a kill lands there).
    pub(super) publish_pause: Option<Duration>,
    /// Where the run writes the address of its metrics endpoint.
    pub(super) data_dir: PathBuf,
}

impl Publisher {
    /// Sweeps every [`SWEEP_EVERY`] until `stop` (a failed sweep is logged and tried
    /// again: the shards stay on the local disk, and the final sweep must succeed).
    pub(super) async fn run(self, stop: CancellationToken) -> Self {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return self,
                _ = tokio::time::sleep(SWEEP_EVERY) => {}
            }
            if let Err(e) = self.sweep().await {
                tracing::warn!(partition = self.partition.index, error = %e,
                    "publishing shards failed; trying again");
            }
        }
    }

    /// The worker's heartbeat, kept apart from the sweeps so that a slow upload, or the
    /// publishing after the run, does not make a live worker look dead to a twin.
    pub(super) fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            bucket: self.bucket.clone(),
            log: self.log.clone(),
            writer: self.writer.clone(),
            partition: self.partition,
            allowances: self.allowances.clone(),
            data_dir: self.data_dir.clone(),
        }
    }

    /// Publishes every sealed local shard not yet committed; returns how many.
    pub(super) async fn sweep(&self) -> Result<usize, Error> {
        let mut n = 0;
        for dataset in &self.datasets {
            let dir = self.staging.join(dataset);
            let mut shards: Vec<(u64, PathBuf)> = shard::folder_entries(&dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .into_iter()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    shard::parse_shard_index(&name).map(|i| (i, e.path()))
                })
                .collect();
            shards.sort();
            for (index, path) in shards {
                if self.log.lock().await.has(&self.writer, dataset, index) {
                    continue;
                }
                self.publish(dataset, index, &path).await?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Uploads and commits one local shard, leaving out items committed before it (and,
    /// under "cancel", items past the partition's allowance).
    async fn publish(&self, dataset: &str, index: u64, path: &Path) -> Result<(), Error> {
        let local = path.to_path_buf();
        let (keys, counts) = tokio::task::spawn_blocking(move || {
            Ok::<_, Error>((reader::read_keys(&local)?, reader::read_counts(&local)?))
        })
        .await
        .map_err(Error::runtime)??;
        // The two readers return the shard's rows in the same order.
        let rows: Vec<(String, u64)> = keys
            .into_iter()
            .zip(&counts)
            .map(|((id, _), c)| (id, u64::from(c.completion_tokens)))
            .collect();
        // Items in shard order, with their tokens (an item's rows are all in this shard).
        let mut items: Vec<(String, u64)> = Vec::new();
        let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (id, tokens) in &rows {
            match at.get(id.as_str()) {
                Some(&i) => items[i].1 += tokens,
                None => {
                    at.insert(id, items.len());
                    items.push((id.clone(), *tokens));
                }
            }
        }
        // Under "cancel", a budget-bound dataset commits no more than the partition holds.
        let capped = self.cancel_cap && self.allowances.iter().any(|(n, _)| n == dataset);
        let cap_of = |log: &CommitLog| capped.then(|| log.dataset(dataset).allowance());
        loop {
            let mut left_out: HashSet<&str> = HashSet::new();
            let mut over_share = 0u64;
            let mut duplicate_tokens = 0u64;
            {
                let log = self.log.lock().await;
                log.refuse_sealed()?;
                let d = log.dataset(dataset);
                let cap = cap_of(&log);
                let mut spent = d.tokens;
                for (id, tokens) in &items {
                    if d.committed.contains(id) {
                        left_out.insert(id);
                        duplicate_tokens += tokens;
                    } else if cap.is_some_and(|cap| spent + tokens > cap) {
                        left_out.insert(id);
                        over_share += 1;
                    } else {
                        spent += tokens;
                    }
                }
            }
            let kept: Vec<&(String, u64)> = rows
                .iter()
                .filter(|(id, _)| !left_out.contains(id.as_str()))
                .collect();
            let dropped = (rows.len() - kept.len()) as u64;
            let ids: Vec<String> = items
                .iter()
                .filter(|(id, _)| !left_out.contains(id.as_str()))
                .map(|(id, _)| id.clone())
                .collect();
            let tokens: u64 = kept.iter().map(|(_, t)| t).sum();
            let file = if dropped == 0 {
                path.to_path_buf()
            } else {
                tracing::warn!(dataset, index, dropped, over_share, partition = self.partition.index,
                    "rows of this shard were committed by another worker first, or would pass the partition's allowance; publishing the rest");
                let gone: HashSet<String> = left_out.iter().map(|s| s.to_string()).collect();
                self.rewrite_without(dataset, index, path, Arc::new(gone))
                    .await?
            };
            let mut record = Commit {
                format: commits::FORMAT,
                partition: self.partition.index,
                partitions: self.partition.count,
                seq: 0,
                writer: self.writer.clone(),
                dataset: dataset.to_string(),
                local_index: index,
                key: None,
                rows: kept.len() as u64,
                completion_tokens: tokens,
                bytes: 0,
                sha256: String::new(),
                dropped,
                over_share,
                ids,
                spool_version: env!("CARGO_PKG_VERSION").to_string(),
            };
            if !kept.is_empty() {
                let sha = {
                    let file = file.clone();
                    tokio::task::spawn_blocking(move || crate::output::bucket::sha256_file(&file))
                        .await
                        .map_err(Error::runtime)??
                };
                let key =
                    commits::shard_key(self.partition.index, &self.writer, dataset, index, &sha);
                let up = self.bucket.upload(&key, &file).await?;
                if let Some(pause) = self.publish_pause {
                    tracing::warn!(dataset, index, key = %key, pause_ms = pause.as_millis() as u64,
                        "fault injection: pausing publication at=\"after_upload\"");
                    tokio::time::sleep(pause).await;
                }
                record.key = Some(key);
                record.bytes = up.bytes;
                record.sha256 = up.sha256;
            }
            let appended = {
                let mut log = self.log.lock().await;
                // Twins' commits read while this shard uploaded count against the cap too.
                let spent = log.dataset(dataset).tokens;
                if tokens > 0 && cap_of(&log).is_some_and(|cap| spent + tokens > cap) {
                    Ok(Appended::Outdated(format!(
                        "{tokens} tokens would pass the partition's allowance"
                    )))
                } else {
                    log.append(Record::Shard(record)).await
                }
            };
            match appended {
                Ok(Appended::Committed(seq)) => {
                    if let Some((_, a)) = self.allowances.iter().find(|(n, _)| n == dataset) {
                        a.add_duplicates(duplicate_tokens);
                    }
                    if file != path {
                        // The rewritten copy has served: the local shard stays the record.
                        let _ = std::fs::remove_file(&file);
                    }
                    tracing::info!(
                        dataset,
                        index,
                        seq,
                        rows = kept.len(),
                        tokens,
                        partition = self.partition.index,
                        "shard committed"
                    );
                    return Ok(());
                }
                Ok(Appended::Lost(seq)) => {
                    tracing::info!(
                        dataset,
                        index,
                        seq,
                        partition = self.partition.index,
                        "another worker committed first; checking this shard against its record"
                    );
                }
                Ok(Appended::Outdated(why)) => {
                    tracing::info!(
                        dataset,
                        index,
                        why,
                        partition = self.partition.index,
                        "the log moved on while this shard uploaded; checking it again"
                    );
                }
                Err(e @ commits::CommitError::Sealed { .. }) => {
                    return Err(Error::from(e).context(format!(
                        "local shard {index} of `{dataset}` ({} rows) was not committed",
                        kept.len()
                    )))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A copy of local shard `index` without the rows of `committed` items.
    async fn rewrite_without(
        &self,
        dataset: &str,
        index: u64,
        path: &Path,
        committed: Arc<HashSet<String>>,
    ) -> Result<PathBuf, Error> {
        let dir = self.scratch.join(dataset);
        let (src, level) = (path.to_path_buf(), self.compression_level);
        tokio::task::spawn_blocking(move || -> Result<PathBuf, Error> {
            let rows: Vec<_> = reader::read_rows(&src)?
                .into_iter()
                .filter(|r| !committed.contains(&r.id))
                .collect();
            let metadata: Vec<(String, String)> = reader::read_metadata(&src)?
                .into_iter()
                .filter(|(k, _)| !k.starts_with("ARROW:"))
                .collect();
            let out = dir.join(shard::shard_file_name(index));
            match std::fs::remove_file(&out) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::from(e).context(format!("cannot remove {}", out.display())))
                }
            }
            let limits = ShardLimits {
                max_rows: usize::MAX,
                max_bytes: u64::MAX,
                compression_level: level,
            };
            let mut w = ShardWriter::create(&dir, index, &limits, metadata, &Default::default())?;
            w.append(&rows)?;
            Ok(w.finish()?.path)
        })
        .await
        .map_err(Error::runtime)?
    }

    /// Uploads each dataset's `_rejected.jsonl` of this partition (whole, replacing the
    /// last upload: every writer of a partition rejects the same rows).
    pub(super) async fn publish_rejected(&self) -> Result<(), Error> {
        for dataset in &self.datasets {
            let local = self
                .staging
                .join(dataset)
                .join(crate::output::verify::REJECTED_FILE);
            if !local.is_file() {
                continue;
            }
            self.bucket
                .upload(
                    &commits::rejected_key(self.partition.index, dataset),
                    &local,
                )
                .await?;
        }
        Ok(())
    }

    /// Records that this partition finished (with `failed` items failed for good):
    /// `finalize` waits for every partition's.
    pub(super) async fn mark_done(&self, failed: u64, twin_settles: bool) -> Result<(), Error> {
        let mut log = self.log.lock().await;
        log.catch_up().await?;
        log.refuse_sealed()?;
        let done = Done {
            partition: self.partition.index,
            partitions: self.partition.count,
            writer: self.writer.clone(),
            commits: log.len(),
            failed,
            twin_settles,
            spool_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        drop(log);
        let body = serde_json::to_vec_pretty(&done)?;
        self.bucket
            .put(&commits::done_key(self.partition.index), body.into())
            .await?;
        tracing::info!(
            partition = self.partition.index,
            commits = done.commits,
            failed,
            "partition done"
        );
        Ok(())
    }
}
