//! One partition's worker: the ordinary run against a local staging folder, plus the
//! publisher that uploads each sealed shard and commits it to the partition's log.
//!
//! Start-up order: read the partition's commit log → work out the budget share (the
//! dataset's budget split over the partitions by item counts, less what other writers of
//! this partition already committed) → run with intake skipping items another partition
//! owns or someone already committed → publish sealed shards while running and once more
//! after the run has sealed its last one → mark the partition done when it finished.
//!
//! Invariants: a shard is acknowledged to the cluster only by its commit record, which is
//! created after the object is wholly uploaded; the local queue and shards (the
//! single-machine guarantees) are untouched by publishing, so a worker killed at any
//! instant and restarted on the same `data_dir` publishes exactly the shards not yet
//! committed; on an empty `data_dir` it takes in only the items not yet committed.

use crate::cluster::commits::{self, Appended, Commit, CommitLog, Done};
use crate::cluster::partition::{self, Partition};
use crate::config::Config;
use crate::error::{Context, Error};
use crate::knobs::Knobs;
use crate::output::bucket::Bucket;
use crate::output::reader;
use crate::output::shard::{self, ShardLimits};
use crate::output::writer::ShardWriter;
use crate::run::job::RunSummary;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the publisher looks for newly sealed shards during a run.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// How often a running worker copies its live `/status` to the store, for `spool status`.
const STATUS_EVERY: u32 = 15;

/// Whether `cfg` runs as a cluster worker: its output is an object-store URL, or the job
/// is partitioned.
pub fn is_cluster(cfg: &Config) -> bool {
    cfg.partition.is_some() || crate::output::bucket::is_url(&cfg.output_dir.to_string_lossy())
}

/// The object-store location of the output: the URL as given, or a local folder as
/// `file://` (a partitioned job on a shared file system).
pub fn output_url(cfg: &Config) -> String {
    let s = cfg.output_dir.to_string_lossy();
    if crate::output::bucket::is_url(&s) {
        s.into_owned()
    } else {
        format!("file://{s}")
    }
}

/// Opens the output's store with the config's `[storage]` settings.
pub fn open_bucket(cfg: &Config) -> Result<Arc<Bucket>, Error> {
    let url = output_url(cfg);
    Ok(Arc::new(
        Bucket::open(&url, &cfg.storage).with_context(|| format!("output_dir {url}"))?,
    ))
}

/// Runs this worker's partition to the end (or the signal) and publishes its shards.
pub async fn run(
    mut cfg: Config,
    knobs: Knobs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary, Error> {
    let partition = cfg.partition.unwrap_or(Partition::WHOLE);
    cfg.partition = Some(partition);
    if let Some(d) = cfg
        .datasets
        .iter()
        .find(|d| !commits::is_dataset_name(&d.name))
    {
        return Err(crate::config::ConfigError::Invalid {
            path: cfg.source.clone(),
            key: "dataset.name".into(),
            detail: format!(
                "`{}` is spool's own name under a cluster job's output ({}); rename the dataset",
                d.name,
                commits::RESERVED.join(", ")
            ),
        }
        .into());
    }
    let bucket = open_bucket(&cfg)?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create data_dir {}", cfg.data_dir.display()))?;
    let writer = writer_id(&cfg.data_dir)?;
    let log = persevere("read the partition's commit log", async || {
        Ok(CommitLog::load(bucket.clone(), partition).await?)
    })
    .await?;
    tracing::info!(partition = partition.index, partitions = partition.count, writer = %writer,
        commits = log.commits().len(), output = %bucket.url(), "cluster worker starting");
    let shares = share_budgets(&mut cfg, &log, &writer).await?;
    let caps = if cfg.run.budget_policy == crate::config::BudgetPolicy::Cancel {
        shares
    } else {
        Default::default()
    };
    for d in &cfg.datasets {
        cfg.committed
            .insert(d.name.clone(), log.committed_ids(&d.name));
    }
    cfg.output_dir = cfg.data_dir.join("out");
    let publisher = Publisher {
        bucket: bucket.clone(),
        log,
        writer: writer.clone(),
        partition,
        staging: cfg.output_dir.clone(),
        scratch: cfg.data_dir.join("publish"),
        datasets: cfg.datasets.iter().map(|d| d.name.clone()).collect(),
        compression_level: cfg.shards.compression_level,
        caps,
        publish_pause: knobs.faults.publish_pause,
        data_dir: cfg.data_dir.clone(),
    };
    let stop = CancellationToken::new();
    let sweeping = tokio::spawn(publisher.run(stop.clone()));
    let summary = crate::run::job::run(cfg, knobs, shutdown).await;
    stop.cancel();
    let mut publisher = sweeping
        .await
        .map_err(Error::runtime)
        .context("the publisher panicked")?;
    let summary = summary?;
    // The run has sealed its last shard: this sweep publishes everything it wrote.
    let published = persevere("publish the partition's shards", async || {
        publisher.sweep().await
    })
    .await?;
    tracing::info!(
        partition = partition.index,
        shards = published,
        "final shards published"
    );
    persevere("publish the partition's rejected rows", async || {
        publisher.publish_rejected().await
    })
    .await?;
    // Where the partition stood when its worker stopped: `spool status` shows it.
    let body = bytes::Bytes::from(serde_json::to_vec_pretty(&summary.report)?);
    persevere("write the partition's status", async || {
        Ok(bucket
            .put(&commits::status_key(partition.index), body.clone())
            .await?)
    })
    .await?;
    if summary.ending().is_none() {
        persevere("mark the partition done", async || {
            publisher.mark_done().await
        })
        .await?;
    }
    Ok(summary)
}

/// Tries of a step against the store at the edges of a run.
const STEP_TRIES: u32 = 8;

/// Runs an object-store step until it succeeds, up to [`STEP_TRIES`] times with backoff:
/// the store retries single requests, but a step of many (a sweep) can still meet a cut
/// answer, and a worker whose generation is all done should not exit for one bad minute.
async fn persevere<T>(
    what: &str,
    mut step: impl AsyncFnMut() -> Result<T, Error>,
) -> Result<T, Error> {
    let mut tries = 0;
    loop {
        tries += 1;
        match step().await {
            Ok(v) => return Ok(v),
            // An object refused as untrusted stays so: no use trying again.
            Err(e) if tries >= STEP_TRIES || refused(&e) => {
                return Err(e.context(format!("cannot {what}")))
            }
            Err(e) => {
                tracing::warn!(tries, error = %crate::error::render(&e), "cannot {what} yet; trying again");
                tokio::time::sleep(Duration::from_millis(250 << tries.min(5))).await;
            }
        }
    }
}

/// Whether `e` is about an object in the store that is not what spool writes (rather than
/// about reaching the store).
fn refused(e: &Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<commits::CommitError>()
            .is_some_and(|c| c.key().is_some())
    })
}

/// Sets each budgeted dataset's budget to this partition's share: the split by item
/// counts, less the tokens other writers of this partition committed (spent, but in no
/// local queue when the `data_dir` is new).
async fn share_budgets(
    cfg: &mut Config,
    log: &CommitLog,
    writer: &str,
) -> Result<std::collections::HashMap<String, u64>, Error> {
    let mut shares = std::collections::HashMap::new();
    let Some(partition) = cfg.partition else {
        return Ok(shares);
    };
    if cfg.datasets.iter().all(|d| d.token_budget.is_none()) {
        return Ok(shares);
    }
    let budgeted: Vec<_> = cfg
        .datasets
        .iter()
        .filter(|d| d.token_budget.is_some())
        .cloned()
        .collect();
    let cache = cfg.data_dir.join("partition-counts.json");
    let counts =
        tokio::task::spawn_blocking(move || counted_items(&budgeted, partition.count, &cache))
            .await
            .map_err(Error::runtime)??;
    for d in &mut cfg.datasets {
        let Some(budget) = d.token_budget else {
            continue;
        };
        let items = counts.get(&d.name).cloned().unwrap_or_default();
        let share = partition::split(budget, &items)[partition.index as usize];
        let spent = log.tokens_by_others(writer, &d.name);
        let left = share.saturating_sub(spent);
        tracing::info!(dataset = %d.name, budget, share, committed_by_others = spent,
            items = items[partition.index as usize], "partition's budget share");
        d.token_budget = Some(left);
        shares.insert(d.name.clone(), share);
    }
    Ok(shares)
}

/// [`count_items`], kept in `cache` per dataset with its input's size and modification
/// time, so a restarted worker does not parse an unchanged input again.
fn counted_items(
    datasets: &[crate::config::DatasetConfig],
    count: u32,
    cache: &Path,
) -> Result<partition::ItemCounts, Error> {
    type Cached = std::collections::HashMap<String, (String, Vec<u64>)>;
    let mut cached: Cached = std::fs::read(cache)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let stamp = |d: &crate::config::DatasetConfig| -> String {
        let m = std::fs::metadata(&d.path).ok();
        let mtime = m
            .as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        format!(
            "{}|{}|{mtime}|{count}|{:?}",
            d.path.display(),
            m.map_or(0, |m| m.len()),
            d.max_prompts
        )
    };
    let mut out = partition::ItemCounts::new();
    let mut stale = Vec::new();
    for d in datasets {
        match cached.get(&d.name) {
            Some((s, counts)) if *s == stamp(d) => {
                out.insert(d.name.clone(), counts.clone());
            }
            _ => stale.push(d.clone()),
        }
    }
    if !stale.is_empty() {
        for (name, counts) in count_items(&stale, count)? {
            let d = stale
                .iter()
                .find(|d| d.name == name)
                .map(stamp)
                .unwrap_or_default();
            cached.insert(name.clone(), (d, counts.clone()));
            out.insert(name, counts);
        }
        // Only a cache: a failed write costs a parse at the next start.
        let _ = serde_json::to_vec(&cached).map(|b| std::fs::write(cache, b));
    }
    Ok(out)
}

/// Rows per partition of each dataset (ids parsed, prompts not rendered).
pub fn count_items(
    datasets: &[crate::config::DatasetConfig],
    count: u32,
) -> Result<partition::ItemCounts, Error> {
    let mut out = partition::ItemCounts::new();
    for d in datasets {
        let mut counts = vec![0u64; count as usize];
        let mut reader = crate::input::dataset::DatasetReader::open(&d.path, &d.name)?;
        let mut taken = 0u64;
        while let Some(e) = reader.next_entry()? {
            if let crate::input::row::Entry::Row(row) = e {
                if d.max_prompts.is_some_and(|m| taken >= m) {
                    break;
                }
                counts[partition::owner(&d.name, &row.id, count) as usize] += 1;
                taken += 1;
            }
        }
        out.insert(d.name.clone(), counts);
    }
    Ok(out)
}

/// The writer id of a `data_dir`: made once, kept in `data_dir/writer-id`. A new volume is
/// a new writer, so its shards never take an earlier writer's names.
pub fn writer_id(data_dir: &Path) -> Result<String, Error> {
    let path = data_dir.join("writer-id");
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::from(e).context(format!("cannot read {}", path.display()))),
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let seed = format!(
        "{nanos}/{}/{}/{}",
        std::process::id(),
        host.trim(),
        data_dir.display()
    );
    let id = crate::config::hex(&Sha256::digest(seed.as_bytes()))[..16].to_string();
    let tmp = data_dir.join(".writer-id.tmp");
    std::fs::write(&tmp, format!("{id}\n"))
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &path))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(id)
}

/// Uploads sealed local shards and commits them, in local index order per dataset.
struct Publisher {
    bucket: Arc<Bucket>,
    log: CommitLog,
    writer: String,
    partition: Partition,
    staging: PathBuf,
    /// Where a shard is rewritten without rows someone else committed first.
    scratch: PathBuf,
    datasets: Vec<String>,
    compression_level: i32,
    /// Under `budget_policy = "cancel"`, each budgeted dataset's share for this partition:
    /// a commit never takes the partition's committed tokens past it, even when two
    /// workers run the partition at once.
    caps: std::collections::HashMap<String, u64>,
    /// The fault point between upload and commit (tests: a kill lands there).
    publish_pause: Option<Duration>,
    /// Where the run writes the address of its metrics endpoint.
    data_dir: PathBuf,
}

impl Publisher {
    /// Sweeps every [`SWEEP_EVERY`] until `stop`; a failed sweep is logged and tried again
    /// (the shards stay on the local disk, and the final sweep must succeed).
    async fn run(mut self, stop: CancellationToken) -> Self {
        let mut ticks = 0u32;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return self,
                _ = tokio::time::sleep(SWEEP_EVERY) => {}
            }
            if let Err(e) = self.sweep().await {
                tracing::warn!(partition = self.partition.index, error = %e,
                    "publishing shards failed; trying again");
            }
            ticks += 1;
            if ticks % STATUS_EVERY == 1 {
                self.copy_live_status().await;
            }
        }
    }

    /// Copies the run's own `/status` (when its metrics endpoint is on) to the store, so
    /// `spool status` of the job shows this partition's pending items while it runs. Best
    /// effort: the run does not depend on it.
    async fn copy_live_status(&self) {
        let Ok(addr) = std::fs::read_to_string(self.data_dir.join(crate::run::job::ENDPOINT_FILE))
        else {
            return;
        };
        let Ok(report) = crate::observe::status::fetch(
            &format!("http://{}", addr.trim()),
            Duration::from_secs(2),
        )
        .await
        else {
            return;
        };
        let Ok(body) = serde_json::to_vec_pretty(&report) else {
            return;
        };
        if let Err(e) = self
            .bucket
            .put(&commits::status_key(self.partition.index), body.into())
            .await
        {
            tracing::debug!(error = %e, "cannot copy the live status to the store");
        }
    }

    /// Publishes every sealed local shard not yet committed; returns how many.
    async fn sweep(&mut self) -> Result<usize, Error> {
        self.log.catch_up().await?;
        let mut n = 0;
        for dataset in self.datasets.clone() {
            let dir = self.staging.join(&dataset);
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
                if self.log.has(&self.writer, &dataset, index) {
                    continue;
                }
                self.publish(&dataset, index, &path).await?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Uploads and commits one local shard, leaving out items committed before it.
    async fn publish(&mut self, dataset: &str, index: u64, path: &Path) -> Result<(), Error> {
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
        loop {
            let committed = self.log.committed_ids(dataset);
            let cap = self.caps.get(dataset).copied();
            let mut spent = self.log.committed_tokens(dataset);
            let mut left_out: HashSet<&str> = HashSet::new();
            let mut over_share = 0u64;
            for (id, tokens) in &items {
                if committed.contains(id) {
                    left_out.insert(id);
                } else if cap.is_some_and(|cap| spent + tokens > cap) {
                    left_out.insert(id);
                    over_share += 1;
                } else {
                    spent += tokens;
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
                    "rows of this shard were committed by another worker first, or would pass the partition's budget share; publishing the rest");
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
            match self.log.append(record).await? {
                Appended::Committed(seq) => {
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
                Appended::Lost(seq) => {
                    tracing::info!(
                        dataset,
                        index,
                        seq,
                        partition = self.partition.index,
                        "another worker committed first; checking this shard against its record"
                    );
                }
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
    async fn publish_rejected(&self) -> Result<(), Error> {
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

    /// Records that this partition finished: `finalize` waits for every partition's.
    async fn mark_done(&mut self) -> Result<(), Error> {
        self.log.catch_up().await?;
        let done = Done {
            partition: self.partition.index,
            partitions: self.partition.count,
            writer: self.writer.clone(),
            commits: self.log.commits().len() as u64,
            spool_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let body = serde_json::to_vec_pretty(&done)?;
        self.bucket
            .put(&commits::done_key(self.partition.index), body.into())
            .await?;
        tracing::info!(
            partition = self.partition.index,
            commits = done.commits,
            "partition done"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dataset(path: &Path) -> crate::config::DatasetConfig {
        let text = format!("name = \"d\"\npath = \"{}\"\n", path.display());
        toml::from_str(&text).unwrap()
    }

    /// Item counts per partition are kept with the input's size and time: an unchanged
    /// input is not parsed again, a changed one is.
    #[test]
    fn item_counts_are_cached_until_the_input_changes() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("d.jsonl");
        let rows: String = (0..100)
            .map(|i| format!("{{\"id\": \"r{i}\", \"prompt\": \"p{i}\"}}\n"))
            .collect();
        std::fs::write(&input, &rows).unwrap();
        let cache = dir.path().join("counts.json");
        let d = [dataset(&input)];
        let first = counted_items(&d, 4, &cache).unwrap();
        assert_eq!(first["d"].iter().sum::<u64>(), 100);
        // Doctor the cache: an unchanged input is answered from it.
        let doctored = std::fs::read_to_string(&cache)
            .unwrap()
            .replace(&format!("{:?}", first["d"]).replace(' ', ""), "[1,2,3,4]");
        std::fs::write(&cache, doctored).unwrap();
        assert_eq!(counted_items(&d, 4, &cache).unwrap()["d"], vec![1, 2, 3, 4]);
        // Another partition count is another question.
        assert_eq!(
            counted_items(&d, 2, &cache).unwrap()["d"]
                .iter()
                .sum::<u64>(),
            100
        );
        // A changed input is counted again.
        std::fs::write(
            &input,
            format!("{rows}{{\"id\": \"x\", \"prompt\": \"p\"}}\n"),
        )
        .unwrap();
        assert_eq!(
            counted_items(&d, 4, &cache).unwrap()["d"]
                .iter()
                .sum::<u64>(),
            101
        );
    }
}
