//! One partition's worker: the ordinary run against a local staging folder (the plan's
//! `output_dir`, with the partition's budgets and settled work: `run::plan`), plus the
//! publisher that uploads each sealed shard and commits it to the partition's log, and the
//! budget agent that takes the partition's part of each budget from the job's pool.
//!
//! Start-up order: the store must refuse a second conditional create of one key (else the
//! worker does not run) → the job record: created, matched or (`--reshape`) changed, and
//! nothing is written before it matches → the partition's log (a sealed log: nothing to
//! do, or an error saying the job is published) → the done marker withdrawn and a
//! heartbeat written → failed items sent back by `spool retry` put back in the local queue
//! → each budget's tickets reconciled with the log → the run, with intake skipping items
//! another partition owns, someone committed or that failed for good → publish sealed
//! shards while running and once more after the run → record items that failed for good
//! → give back unused budget → the partition marked done (with failures, if any).
//!
//! Invariants: a shard is acknowledged to the cluster only by its commit record, which is
//! created after the object is wholly uploaded; the local queue and shards (the
//! single-machine guarantees) are untouched by publishing, so a worker killed at any
//! instant and restarted on the same `data_dir` publishes exactly the shards not yet
//! committed; on an empty `data_dir` it takes in only the items not yet settled. Under
//! `budget_policy = "cancel"` no commit takes the partition's tokens past its allowance.

use crate::cluster::budget::{self, Agent, BudgetLog};
use crate::cluster::commits::{self, CommitLog, Failed, FailedItem, LoadOptions, Record};
use crate::cluster::heartbeat;
use crate::cluster::job::{self, Established, JobError};
use crate::cluster::partition::Partition;
use crate::cluster::publisher::Publisher;
use crate::config::Config;
use crate::error::{Context, Error};
use crate::knobs::Knobs;
use crate::observe::status::StatusReport;
use crate::output::bucket::Bucket;
use crate::run::allowance::Allowance;
use crate::run::job::RunSummary;
use crate::run::plan::JobPlan;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// Failed items per `failed` record.
const FAILED_PER_RECORD: usize = 10_000;

/// Whether `cfg` runs as a cluster worker: its output is an object-store URL, or the job
/// is partitioned (`plan`).
pub fn is_cluster(cfg: &Config, plan: &JobPlan) -> bool {
    plan.partition.is_some() || crate::output::bucket::is_url(&cfg.output_dir.to_string_lossy())
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

/// Refuses a store that does not honour conditional creates (one key created twice with
/// different bytes must keep the first): the commit protocol rests on it.
pub async fn probe(bucket: &Bucket, who: &str) -> Result<(), Error> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let key = format!("_spool/probe/{who}-{nanos}.json");
    if bucket.honours_conditional_creates(&key).await? {
        Ok(())
    } else {
        Err(JobError::NoConditionalCreates {
            url: bucket.url().to_string(),
        }
        .into())
    }
}

/// The exit code of a cluster worker's run: items that failed for good are recorded in
/// the partition's log and listed by `finalize`, so they do not fail the worker (its
/// partition is done with failures, and the job goes on to `finalize`).
pub fn exit_code(summary: &RunSummary) -> u8 {
    match summary.ending() {
        Some(crate::error::Kind::ItemsFailed) => crate::error::exit::OK,
        _ => summary.exit_code(),
    }
}

/// Runs this worker's partition to the end (or the signal) and publishes its shards;
/// `reshape` lets it change the job record where that is safe (`job`). `plan` holds what
/// the caller worked out (the partition, fetched inputs); the worker adds its staging
/// folder, budgets and settled work.
pub async fn run(
    cfg: Arc<Config>,
    mut plan: JobPlan,
    knobs: Knobs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    reshape: bool,
) -> Result<RunSummary, Error> {
    let partition = plan.partition.unwrap_or(Partition::WHOLE);
    plan.partition = Some(partition);
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
    crate::run::job::check(&cfg)?;
    let bucket = open_bucket(&cfg)?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create data_dir {}", cfg.data_dir.display()))?;
    let writer = writer_id(&cfg.data_dir)?;
    persevere(
        "check that the store honours conditional creates",
        async || probe(&bucket, &writer).await,
    )
    .await?;
    let inputs = {
        let files: Vec<_> = cfg
            .datasets
            .iter()
            .map(|d| (d.name.clone(), plan.input_path(d).to_path_buf()))
            .collect();
        let cache = cfg.data_dir.join("input-fingerprints.json");
        tokio::task::spawn_blocking(move || -> Result<BTreeMap<String, (String, u64)>, Error> {
            let mut out = BTreeMap::new();
            for (name, path) in files {
                out.insert(name, job::fingerprint(&path, &cache)?);
            }
            Ok(out)
        })
        .await
        .map_err(Error::runtime)??
    };
    let here = job::shape_of(&cfg, partition.count, &inputs, &writer);
    // Nothing else is read or written before the shape is the job's.
    persevere("read the job record", async || {
        Ok(job::precheck(&bucket, &here, reshape).await?)
    })
    .await?;
    let log = persevere("read the partition's commit log", async || {
        Ok(CommitLog::load(bucket.clone(), partition, LoadOptions::WORKER).await?)
    })
    .await?;
    if let Some((_, seal)) = log.sealed() {
        // Published: nothing is written, whatever happens next.
        if let Some(r) = job::read_latest(&bucket).await? {
            job::refuse_differences(
                &r,
                &here,
                true,
                "the job is published; new work goes to a new output prefix",
            )?;
        }
        if !reshape && !seal.partial && commits::read_done(&bucket, partition).await?.is_some() {
            tracing::info!(partition = partition.index, output = %bucket.url(),
                "this partition is published (sealed by spool finalize) and was done: nothing to do");
            return Ok(RunSummary {
                interrupted: false,
                limited: Vec::new(),
                report: StatusReport::default(),
            });
        }
        log.refuse_sealed()?;
    }
    let established = persevere("write the job record", async || {
        Ok(job::establish(&bucket, &here, reshape).await?)
    })
    .await?;
    match established {
        Established::Created(r) => {
            tracing::info!(key = %job::job_key(r.version), partitions = r.partitions,
            "job record created: this job's shape is fixed")
        }
        Established::Reshaped(r, diffs) => {
            for d in &diffs {
                tracing::warn!(key = %job::job_key(r.version), change = %d, "job reshaped (--reshape)");
            }
        }
        Established::Matched(_) => {}
    }
    // From here on this partition is running: status and finalize must not see it done.
    persevere("withdraw the done marker", async || {
        Ok(bucket.delete(&commits::done_key(partition.index)).await?)
    })
    .await?;
    let started_unix = crate::cluster::job::now_unix();
    if let Err(e) = heartbeat::write(&bucket, partition, &writer, true, None).await {
        tracing::warn!(error = %e, "cannot write the partition's status yet");
    }
    tracing::info!(partition = partition.index, partitions = partition.count, writer = %writer,
        commits = log.len(), output = %bucket.url(), startup_requests = bucket.requests(),
        "cluster worker starting");
    let retried: Vec<String> = cfg
        .datasets
        .iter()
        .filter(|d| !log.dataset(&d.name).retried.is_empty())
        .map(|d| d.name.clone())
        .collect();
    retry_locally(&cfg.data_dir, &knobs, &retried)?;
    let shared = Arc::new(Mutex::new(log));
    let mut lanes = Vec::new();
    for d in &cfg.datasets {
        let Some(total) = d.token_budget else {
            continue;
        };
        let mut ledger = persevere("read the budget log", async || {
            Ok(BudgetLog::load(bucket.clone(), &d.name, partition.count).await?)
        })
        .await?;
        // Running again: this partition may take and give back budget.
        bucket
            .delete(&budget::waiting_key(&d.name, partition.index))
            .await?;
        let mut log = shared.lock().await;
        budget::reconcile(&mut log, &mut ledger, &d.name, &writer).await?;
        let allowance = Arc::new(Allowance::new(0));
        let granted = Agent::granted(&log, &d.name, &writer, &allowance);
        allowance.set(granted, false);
        tracing::info!(dataset = %d.name, budget = total, allowance = log.dataset(&d.name).allowance(),
            committed = log.committed_tokens(&d.name), pool = ledger.pool(total),
            "partition's budget: tickets from the job's pool as needed");
        plan.allowances.insert(d.name.clone(), allowance.clone());
        lanes.push(budget::Lane::new(&d.name, total, ledger, allowance));
    }
    {
        let log = shared.lock().await;
        for d in &cfg.datasets {
            plan.committed
                .insert(d.name.clone(), Arc::new(log.settled(&d.name)));
        }
    }
    let data_dir = cfg.data_dir.clone();
    let staging = cfg.data_dir.join("out");
    plan.output_dir = Some(staging.clone());
    let cancel_cap = cfg.run.budget_policy == crate::config::BudgetPolicy::Cancel;
    let publisher = Publisher {
        bucket: bucket.clone(),
        log: shared.clone(),
        writer: writer.clone(),
        partition,
        staging,
        scratch: cfg.data_dir.join("publish"),
        datasets: cfg.datasets.iter().map(|d| d.name.clone()).collect(),
        compression_level: cfg.shards.compression_level,
        cancel_cap,
        allowances: lanes
            .iter()
            .map(|l| (l.dataset.clone(), l.allowance.clone()))
            .collect(),
        publish_pause: knobs.faults.publish_pause,
        data_dir: cfg.data_dir.clone(),
    };
    let agent = Agent {
        log: shared.clone(),
        lanes,
        writer: writer.clone(),
        partition,
        bucket: bucket.clone(),
        stale_after: knobs.faults.stale_after.unwrap_or(budget::STALE_AFTER),
    };
    let stop = CancellationToken::new();
    // Beats until this worker writes that it stopped, whatever the sweeps are doing.
    let beats_end = CancellationToken::new();
    let beating = tokio::spawn(publisher.heartbeat().run(beats_end.clone()));
    let _beats_on_error = beats_end.clone().drop_guard();
    let sweeping = tokio::spawn(publisher.run(stop.clone()));
    let granting = tokio::spawn(agent.run(stop.clone()));
    let summary = crate::run::job::run_planned(cfg, plan, knobs.clone(), shutdown).await;
    stop.cancel();
    let publisher = sweeping
        .await
        .map_err(Error::runtime)
        .context("the publisher panicked")?;
    let mut agent = granting
        .await
        .map_err(Error::runtime)
        .context("the budget agent panicked")?;
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
    let failed = persevere("record the items that failed for good", async || {
        record_failures(&data_dir, &knobs, &shared, &writer).await
    })
    .await?;
    // A beat landing after the presence below would say this worker still runs.
    beats_end.cancel();
    beating
        .await
        .map_err(Error::runtime)
        .context("the heartbeat panicked")?;
    // This worker has stopped: a twin settling the budget sees it gone. Where the
    // partition stood goes to its status for `spool status` (below), unless a twin still
    // runs it.
    persevere("write this worker's presence", async || {
        Ok(heartbeat::write_presence(&bucket, partition, &writer, false).await?)
    })
    .await?;
    let twins = persevere("look for a twin of this partition", async || {
        Ok(heartbeat::live_twins(&bucket, partition, &writer, started_unix, TWIN_PATIENCE).await?)
    })
    .await?;
    let made_all: std::collections::HashSet<String> = summary
        .report
        .datasets
        .iter()
        .filter(|d| d.pending == 0 && d.inflight == 0)
        .map(|d| d.name.clone())
        .collect();
    let twin_settles = persevere("give back unused budget", async || {
        Ok(agent.settle(&twins, &made_all).await?)
    })
    .await?;
    // After the settling: until its budget is back in the pool (and its marker says it
    // stopped), the others see this partition running and wait for it.
    if twins.is_empty() {
        let report = summary.report.clone();
        persevere("write the partition's status", async || {
            Ok(heartbeat::write(&bucket, partition, &writer, false, Some(report.clone())).await?)
        })
        .await?;
    }
    if matches!(
        summary.ending(),
        None | Some(crate::error::Kind::ItemsFailed)
    ) {
        persevere("mark the partition done", async || {
            publisher.mark_done(failed, twin_settles).await
        })
        .await?;
        if failed > 0 {
            tracing::warn!(partition = partition.index, failed,
                "partition done with items failed for good: recorded in its log, listed by `spool finalize`; `spool retry` sends them back");
        }
    }
    Ok(summary)
}

/// How long after its last beat a stopping worker watches a presence that says running
/// but has not beaten since this worker started: two of a twin's periods (a worker killed
/// longer ago is not waited for).
const TWIN_PATIENCE: Duration = Duration::from_secs(2 * heartbeat::EVERY.as_secs());

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
            // An object refused as untrusted stays so, and so does a sealed log or a
            // mismatched job: no use trying again.
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

/// Whether `e` is final: about an object in the store that is not what spool writes, a
/// sealed log, or the user's to fix (rather than about reaching the store).
fn refused(e: &Error) -> bool {
    e.kind() == crate::error::Kind::Usage
        || e.chain().any(|c| {
            c.downcast_ref::<commits::CommitError>()
                .is_some_and(|c| c.key().is_some())
        })
}

/// Puts the items `spool retry` sent back (failed in this `data_dir`'s queue) back to
/// pending, for `datasets`. A new volume has no queue: intake takes them in.
fn retry_locally(data_dir: &Path, knobs: &Knobs, datasets: &[String]) -> Result<(), Error> {
    if datasets.is_empty() || !data_dir.join("spool.lock").exists() {
        return Ok(());
    }
    let queue = crate::store::queue::Queue::open_with(data_dir, &knobs.faults)?;
    for s in queue.states() {
        if datasets.contains(&s.name) {
            let n = queue.retry_failed(s.index)?;
            tracing::info!(dataset = %s.name, items = n, "failed items sent back by `spool retry` are pending again");
        }
    }
    Ok(())
}

/// Records in the partition's log the items of the local queue that failed for good and
/// are not recorded yet; returns how many failed items the log holds.
async fn record_failures(
    data_dir: &Path,
    knobs: &Knobs,
    shared: &Arc<Mutex<CommitLog>>,
    writer: &str,
) -> Result<u64, Error> {
    let mut log = shared.lock().await;
    if data_dir.join("spool.lock").exists() {
        let (dir, faults) = (data_dir.to_path_buf(), knobs.faults);
        let local = tokio::task::spawn_blocking(
            move || -> Result<Vec<(String, Vec<FailedItem>)>, Error> {
                let queue = crate::store::queue::Queue::open_with(&dir, &faults)?;
                let mut out = Vec::new();
                for s in queue.states() {
                    let mut items = Vec::new();
                    for (row, f) in queue.failures(s.index, usize::MAX)? {
                        if let Some(id) = queue.item_id(s.index, row)? {
                            let reason: String =
                                f.reason.chars().take(commits::REASON_CHARS).collect();
                            items.push(FailedItem { id, reason });
                        }
                    }
                    out.push((s.name.clone(), items));
                }
                Ok(out)
            },
        )
        .await
        .map_err(Error::runtime)??;
        for (dataset, items) in local {
            let d = log.dataset(&dataset);
            let new: Vec<FailedItem> = items
                .into_iter()
                .filter(|i| !d.failed.contains_key(&i.id) && !d.committed.contains(&i.id))
                .collect();
            drop(d);
            let p = log.partition();
            for chunk in new.chunks(FAILED_PER_RECORD) {
                log.append_anyway(Record::Failed(Failed {
                    head: commits::Head::new("failed", p, writer),
                    dataset: dataset.clone(),
                    items: chunk.to_vec(),
                }))
                .await?;
            }
        }
    }
    Ok(log.datasets().map(|(_, d)| d.failed.len() as u64).sum())
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
