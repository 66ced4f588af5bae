//! `spool run`: the application layer wiring intake, scheduler, workers, queue and archive.
//!
//! Tasks: the dispatcher (this function's loop) leases rows into request slots; one
//! worker task per lease talks to a server with retries; the committer applies finished
//! attempts to the queue in group commits (one batch + one fsync for whatever has
//! arrived) and only then tells the scheduler and hands rows to the archive thread, which
//! writes shards off the request path; a monitor task samples rates, updates gauges and
//! logs progress.
//!
//! Start-up order: open the queue → repair it if a failed write left the marker → probe the
//! servers → intake → checkpoint the queue after a big intake (`Queue::checkpoint`, while
//! this function holds its only handle) → recover the output folder → dispatch.
//!
//! Shutdown order (on the `shutdown` future, a fatal error, or when all is done): stop
//! dispatch → wait for requests in flight up to `shutdown_grace_s`, then abort the rest
//! (their items stay pending) → the committer drains → the archive seals open shards →
//! the queue is flushed.

use crate::config::Config;
use crate::input::intake::intake;
use crate::observe::figures::grouped;
use crate::observe::http::Observed;
use crate::observe::metrics::{DatasetMetrics, Metrics};
use crate::observe::monitor::{live_status, monitor_loop, LiveRates};
use crate::observe::status::StatusReport;
use crate::output::archive::{self, Archive, ArchiveDataset};
use crate::output::shard::{ShardLimits, ShardRow};
use crate::prompt::template::{ChatTemplate, PromptBuilder, Tokenizer};
use crate::run::scheduler::{LaneSpec, Next, Scheduler};
use crate::run::servers::Servers;
use crate::run::worker::{work, Ctx, Finished};
use crate::store::queue::{Outcome, Queue};
use crate::upstream::{CountSource, Upstream, UpstreamOptions};
use anyhow::{Context, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Env var (tests only): after a failed commit, the committer waits this many ms before it
/// reports the error, as a descheduled task would; the archive must still not report the
/// consequence (its refused queue write) in place of the cause.
pub const FAULT_COMMIT_FAILED_PAUSE_ENV: &str = "SPOOL_FAULT_COMMIT_FAILED_PAUSE_MS";

/// A fault pause armed by env var `name` (milliseconds; absent or unparsable: none).
fn fault_pause(name: &str) -> Option<Duration> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// Items enqueued by one run past which the queue is checkpointed before dispatch
/// ([`Queue::checkpoint`]): ~1.7 KB of sled log each, so ~170 MB (a fraction of a second to
/// replay) is the most a later start replays of this run's intake.
const CHECKPOINT_AFTER_ITEMS: u64 = 100_000;

/// File in `data_dir` holding the address the running process's endpoint is bound to.
pub const ENDPOINT_FILE: &str = "metrics.addr";

/// How a run ended (the caller maps it to an exit code).
#[derive(Debug)]
pub struct RunSummary {
    /// Stopped by the shutdown signal before finishing.
    pub interrupted: bool,
    /// The final status, from the queue.
    pub report: StatusReport,
}

/// Runs the job until every dataset is finished or `shutdown` resolves.
///
/// The job runs as a task of the runtime, not on the caller's thread (`block_on`): the
/// dispatch loop then spawns each request's task onto its own worker's queue instead of the
/// runtime's shared one, which had to wake a worker thread for nearly every request.
pub async fn run(
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary> {
    match tokio::spawn(run_job(cfg, shutdown)).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(anyhow::anyhow!("the job's task was cancelled: {e}")),
    }
}

async fn run_job(
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary> {
    // Signals are watched from the very start, so one that arrives during a long intake
    // is a clean stop (exit 130) too.
    let stop = CancellationToken::new();
    let hard_stop = CancellationToken::new();
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let (stop, interrupted) = (stop.clone(), interrupted.clone());
        let grace = cfg.run.shutdown_grace_s;
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown => {
                    interrupted.store(true, Ordering::SeqCst);
                    tracing::info!(grace_s = grace, "shutdown requested: no new requests; waiting for those in flight (a second signal exits at once)");
                    stop.cancel();
                }
                _ = stop.cancelled() => {}
            }
        });
    }
    crate::store::blocks::create_dir_durably(&cfg.output_dir)
        .with_context(|| format!("cannot create output_dir {}", cfg.output_dir.display()))?;
    let mut queue = Arc::new(Queue::open(&cfg.data_dir)?);
    let api_key = cfg.api_key()?;

    let (tokenizer, template) = load_prompt_tools(&cfg)?;
    let tokenizer_sha = tokenizer.as_ref().map(|t| t.sha256().to_string());
    let builder = Arc::new(PromptBuilder::new(template, tokenizer));

    // Datasets in config order.
    let mut ds_of = Vec::new();
    let mut names = Vec::new();
    for d in &cfg.datasets {
        let s = queue.open_dataset(&d.name)?;
        ds_of.push(s.index);
        names.push(d.name.clone());
    }
    let name_map: HashMap<u16, String> = ds_of.iter().copied().zip(names.iter().cloned()).collect();

    // Shards first: adopt what a crash left finished, drop what it left half written.
    let limits = ShardLimits {
        max_rows: cfg.shards.max_rows,
        max_bytes: cfg.shards.max_bytes,
        compression_level: cfg.shards.compression_level,
    };
    let mut base_meta = vec![
        (
            "spool.version".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
        ("spool.config_sha256".to_string(), cfg.sha256.clone()),
    ];
    if let Some(sha) = &tokenizer_sha {
        base_meta.push(("spool.tokenizer_sha256".into(), sha.clone()));
    }
    let arch_datasets: HashMap<u16, ArchiveDataset> = cfg
        .datasets
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut metadata = base_meta.clone();
            let sampling = serde_json::to_string(&cfg.sampling_of(d)).unwrap_or_default();
            metadata.push(("spool.sampling".into(), sampling));
            (
                ds_of[i],
                ArchiveDataset {
                    name: d.name.clone(),
                    metadata,
                },
            )
        })
        .collect();
    if queue.needs_repair() {
        tracing::warn!(
            "the last run stopped on a failed queue write; repairing the queue from its records and the shard files"
        );
        let repaired = archive::repair_queue(&queue, &cfg.output_dir).with_context(|| {
            format!(
                "cannot repair the queue in {} (left by a failed write, marker `{}`); \
                 `spool verify` lists what is inconsistent",
                cfg.data_dir.display(),
                crate::store::queue::REPAIR_MARKER
            )
        })?;
        for (name, r) in repaired {
            tracing::warn!(dataset = %name, changed = r.changed(), back_to_pending = r.back_to_pending,
                marked_sharded = r.marked_sharded, extra_states_removed = r.extra_states_removed,
                unscanned_removed = r.unscanned_removed, sharded_without_file = r.sharded_without_file,
                done_before = r.before.done, done_after = r.after.done,
                completion_tokens_before = r.before.completion_tokens,
                completion_tokens_after = r.after.completion_tokens, "queue repaired");
        }
    }
    let upstream = Upstream::with_roots(
        UpstreamOptions {
            api: cfg.server.api,
            model: cfg.server.model.clone(),
            api_key,
            stream: cfg.server.stream,
            request_timeout: Duration::from_secs_f64(cfg.server.request_timeout_s),
            max_response_bytes: cfg.server.max_response_bytes,
            pool_size: cfg.run.concurrency,
        },
        &cfg.trust_roots()?,
    )?;
    // A certificate refused now would be refused all run: stop before queuing any work.
    upstream
        .check_tls(&cfg.server.urls, cfg.server.ca_cert.is_some())
        .await
        .map_err(|e| cfg.invalid("server.urls", e.to_string()))?;
    // Issue 6: the servers' context length (and a self-check, logged once), before intake.
    let probe_ids = builder
        .tokenizer()
        .and_then(|t| t.encode("Hello", false).ok());
    let context_length =
        crate::run::probe::probe(&cfg, &upstream, probe_ids, builder.has_tokenizer()).await;
    let upstream =
        upstream.with_max_tokens_clamp(context_length.filter(|_| cfg.server.clamp_max_tokens));

    // Intake, then the resume line of each dataset.
    let metrics = Arc::new(Metrics::new());
    let mut dmetrics = Vec::new();
    let mut added_this_run = 0u64;
    for (i, d) in cfg.datasets.iter().enumerate() {
        let ds = ds_of[i];
        let (q, d2, b, out) = (
            queue.clone(),
            d.clone(),
            builder.clone(),
            cfg.output_dir.clone(),
        );
        let opts = crate::input::intake::IntakeOptions {
            server_templates: cfg.server.api == crate::config::Api::Chat,
            context_length,
            max_tokens: cfg.sampling_of(d).max_tokens,
            threads: 0,
        };
        let o = opts.clone();
        let rep = tokio::task::spawn_blocking(move || intake(&q, ds, &d2, &b, &out, &o))
            .await
            .context("intake task panicked")??;
        added_this_run += rep.added;
        crate::input::intake::log_context_report(
            &d.name,
            &rep,
            context_length,
            &opts,
            cfg.server.clamp_max_tokens,
        );
        let s = queue
            .state(ds)
            .context("dataset state missing after intake")?;
        let dm = metrics.dataset(&d.name);
        dm.rejected.inc_by(s.rejected);
        dm.completion_tokens.inc_by(0);
        if let Some(b) = d.token_budget {
            metrics
                .token_budget
                .with_label_values(&[&d.name])
                .set(b as i64);
        }
        dmetrics.push(dm);
        let budget_left = d
            .token_budget
            .map(|b| {
                format!(
                    "budget left {}",
                    grouped(b.saturating_sub(s.completion_tokens))
                )
            })
            .unwrap_or_else(|| "no budget".into());
        tracing::info!(
            "{}: {} prompts ({} done, {} tokens; {} to go; {}){}",
            d.name,
            grouped(s.items),
            grouped(s.done),
            grouped(s.completion_tokens),
            grouped(s.pending()),
            budget_left,
            if rep.added > 0 || rep.rejected > 0 {
                format!("; {} new, {} rejected this run", rep.added, rep.rejected)
            } else {
                String::new()
            }
        );
        if d.token_budget.is_some_and(|b| s.completion_tokens >= b) {
            tracing::info!(dataset = %d.name, "budget already met: skipping this dataset");
        }
        if stop.is_cancelled() {
            // A signal during intake: what was enqueued is durable (intake is idempotent
            // and resumable); nothing has been requested yet.
            queue.flush()?;
            return Ok(RunSummary {
                interrupted: interrupted.load(Ordering::SeqCst),
                report: StatusReport::from_queue(&queue, &cfg)?,
            });
        }
    }

    // A big intake leaves sled a long log to replay at the next open (after a SIGKILL
    // too): checkpoint now, while this function holds the only handle to the queue.
    if added_this_run >= CHECKPOINT_AFTER_ITEMS {
        queue = match Arc::try_unwrap(queue) {
            Ok(q) => Arc::new(
                tokio::task::spawn_blocking(move || q.checkpoint())
                    .await
                    .context("queue checkpoint panicked")??,
            ),
            Err(shared) => {
                tracing::debug!("queue still shared after intake: no checkpoint");
                shared
            }
        };
    }

    // Shards: adopt what a crash left finished, drop what it left half written (before
    // any request; intake does not touch results or shards).
    let mut archive = Archive::new(queue.clone(), &cfg.output_dir, limits, arch_datasets);
    for &ds in &ds_of {
        let rec = archive
            .recover(ds)
            .map_err(|e| output_failure(&e, &cfg.output_dir, &cfg.data_dir))?;
        if rec.temp_files_removed > 0 || rec.shards_adopted > 0 {
            tracing::info!(dataset = %name_map[&ds], temp_files_removed = rec.temp_files_removed,
                shards_adopted = rec.shards_adopted, rows_adopted = rec.rows_adopted, "recovered output folder");
        }
    }

    let servers = Arc::new(Servers::new(&cfg.server.urls));
    for s in &servers.list {
        metrics.server_up.with_label_values(&[&s.url]).set(1);
        metrics.inflight.with_label_values(&[&s.url]).set(0);
    }

    let specs = cfg
        .datasets
        .iter()
        .enumerate()
        .map(|(i, d)| LaneSpec {
            ds: ds_of[i],
            name: d.name.clone(),
            budget: d.token_budget,
            max_tokens: cfg.sampling_of(d).max_tokens,
            policy: cfg.run.budget_policy,
        })
        .collect();
    let sched = Arc::new(Scheduler::new(queue.clone(), specs));

    if cfg.run.budget_policy == crate::config::BudgetPolicy::Cancel {
        // Policy "cancel": abort a dataset's requests in flight as soon as what they have
        // streamed would take it past its budget.
        let (sched, stop) = (sched.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = tick.tick() => sched.enforce_cancel(),
                    _ = stop.cancelled() => break,
                }
            }
        });
    }
    let fatal: Arc<Mutex<Option<anyhow::Error>>> = Arc::new(Mutex::new(None));
    // Set when the queue's storage failed (disk full or unwritable data_dir): results can
    // no longer be made durable, so requests in flight are not waited for, and sled is
    // not asked to flush again (after an I/O error it may never return from a flush).
    let queue_broken = Arc::new(AtomicBool::new(false));
    let (arch_done_tx, arch_done_rx) = tokio::sync::oneshot::channel::<()>();

    // Archive thread: seeded with results that are durable but not yet in a shard.
    let (arch_tx, arch_rx) = mpsc::unbounded_channel::<(u16, Vec<(ShardRow, CountSource)>)>();
    // Invariant: the archive is seeded from the queue before any new result can be
    // committed, or a result could be both seeded and sent (written twice).
    let (seeded_tx, seeded_rx) = tokio::sync::oneshot::channel::<()>();
    let archive_thread = {
        let (queue, stop, fatal, metrics) =
            (queue.clone(), stop.clone(), fatal.clone(), metrics.clone());
        let (hard_stop, queue_broken) = (hard_stop.clone(), queue_broken.clone());
        let ds_list = ds_of.clone();
        let names = name_map.clone();
        let (out_dir, data_dir) = (cfg.output_dir.clone(), cfg.data_dir.clone());
        std::thread::Builder::new()
            .name("spool-archive".into())
            .spawn(move || {
                let res = archive_loop(
                    &mut archive,
                    &queue,
                    &ds_list,
                    arch_rx,
                    seeded_tx,
                    &metrics,
                    &names,
                );
                if let Err(e) = res {
                    // Disk full or unwritable output (SPEC §4.4): stop dispatching, keep
                    // everything (results are durable in the queue before they reach a
                    // shard), exit 1 naming the path.
                    if matches!(e, crate::output::archive::ArchiveError::Queue(_)) {
                        queue_broken.store(true, Ordering::SeqCst);
                        hard_stop.cancel();
                    }
                    let e = output_failure(&e, &out_dir, &data_dir);
                    tracing::error!("{e}");
                    stop.cancel();
                    archive.abandon_all();
                    // Keep the first fatal error (the committer's, when the queue's disk
                    // is the full one).
                    fatal
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
                let _ = arch_done_tx.send(());
            })
            .context("cannot start the archive thread")?
    };

    // A failed seeding has already stopped the run (the sender is dropped).
    let _ = seeded_rx.await;

    // Committer.
    let (commit_tx, commit_rx) = mpsc::unbounded_channel::<Finished>();
    let committer = {
        let (queue, sched, fatal, stop) =
            (queue.clone(), sched.clone(), fatal.clone(), stop.clone());
        let (hard_stop, queue_broken) = (hard_stop.clone(), queue_broken.clone());
        let dmetrics = dmetrics.clone();
        let data_dir = cfg.data_dir.clone();
        tokio::spawn(async move {
            let committed = commit_loop(commit_rx, queue, sched, &arch_tx, dmetrics).await;
            if let Err(e) = committed {
                if let Some(pause) = fault_pause(FAULT_COMMIT_FAILED_PAUSE_ENV) {
                    tracing::warn!(
                        ms = pause.as_millis() as u64,
                        "fault injection: pausing the committer before it reports its error"
                    );
                    tokio::time::sleep(pause).await;
                }
                let e = anyhow::anyhow!(
                    "cannot store results in the queue in {} (disk full or unwritable?): {e}. \
                     Dispatch stopped; results not stored are requested again by the next run",
                    data_dir.display()
                );
                tracing::error!("{e}");
                queue_broken.store(true, Ordering::SeqCst);
                hard_stop.cancel();
                stop.cancel();
                fatal
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
            // Only now may the archive seal its open shards (it does when this last sender
            // goes): after a failed commit its own queue write is refused as poisoned, and
            // that consequence must not be reported in place of the cause recorded above.
            drop(arch_tx);
        })
    };

    let ctx = Arc::new(Ctx {
        sampling: cfg.datasets.iter().map(|d| cfg.sampling_of(d)).collect(),
        cfg: cfg.clone(),
        queue: queue.clone(),
        sched: sched.clone(),
        upstream,
        servers: servers.clone(),
        builder,
        names: names.clone(),
        dmetrics: dmetrics.clone(),
        stop: stop.clone(),
        hard_stop: hard_stop.clone(),
        commits: commit_tx,
        nonce: AtomicU64::new(0),
    });

    // Monitor: rates, gauges, progress lines, live status, server probes.
    let live = Arc::new(LiveRates::default());
    let monitor_stop = CancellationToken::new();
    let monitor = tokio::spawn(monitor_loop(
        ctx.clone(),
        metrics.clone(),
        live.clone(),
        monitor_stop.clone(),
    ));
    let observed = Arc::new(Observed {
        metrics: metrics.clone(),
        ready: AtomicBool::new(true),
        status: {
            let (queue, cfg, sched, live) =
                (queue.clone(), cfg.clone(), sched.clone(), live.clone());
            Box::new(move || live_status(&queue, &cfg, &sched, &live))
        },
    });
    let http_stop = CancellationToken::new();
    let http_task = if cfg.run.metrics_addr.is_empty() {
        None
    } else {
        let listener = tokio::net::TcpListener::bind(&cfg.run.metrics_addr)
            .await
            .with_context(|| format!("cannot bind run.metrics_addr {}", cfg.run.metrics_addr))?;
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "metrics endpoint listening");
        // Lets `spool status` find this process when the port was chosen by the OS.
        let _ = std::fs::write(cfg.data_dir.join(ENDPOINT_FILE), addr.to_string());
        let (o, s) = (observed.clone(), http_stop.clone());
        Some(tokio::spawn(crate::observe::http::serve(
            listener,
            o,
            async move { s.cancelled().await },
        )))
    };

    // Dispatch.
    let tracker = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(cfg.run.concurrency));
    'dispatch: loop {
        let permit = tokio::select! {
            // Stop first: after the signal not one more request goes out.
            biased;
            _ = stop.cancelled() => break 'dispatch,
            p = slots.clone().acquire_owned() => p.context("slot semaphore closed")?,
        };
        let lease = loop {
            let notified = sched.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if stop.is_cancelled() {
                break 'dispatch;
            }
            if !servers.any_up() {
                crate::run::worker::log_all_down(&servers);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    _ = stop.cancelled() => break 'dispatch,
                }
            }
            match sched.next()? {
                Next::Lease(l) => break l,
                Next::Done => break 'dispatch,
                Next::Wait => {
                    tokio::select! {
                        _ = &mut notified => {}
                        // Streamed tokens move budget estimates without a notification.
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                        _ = stop.cancelled() => break 'dispatch,
                    }
                }
            }
        };
        let ctx = ctx.clone();
        tracker.spawn(async move {
            work(&ctx, lease).await;
            drop(permit);
        });
    }
    // Ends the helper tasks tied to `stop` (shutdown watcher, cancel enforcer).
    stop.cancel();
    tracker.close();
    let grace = Duration::from_secs_f64(cfg.run.shutdown_grace_s.max(0.0));
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            grace_s = cfg.run.shutdown_grace_s,
            "requests still in flight after the grace period: aborting them (their items stay pending)"
        );
        hard_stop.cancel();
        tracker.wait().await;
    }
    // The monitor holds a context (and so a commit sender): stop it before draining.
    monitor_stop.cancel();
    let _ = monitor.await;
    drop(ctx);
    if queue_broken.load(Ordering::SeqCst) {
        // The queue's storage failed: sled may be stuck in a flush that never returns
        // (seen on ENOSPC; regression test `a_full_queue_disk_stops_the_run_…`). Give the
        // committer and the archive a moment, then report without touching sled again:
        // its state on disk is whatever the last successful flush made durable, which
        // the next run resumes from. The queue is never dropped (its destructor flushes).
        let wait = Duration::from_secs(5);
        let _ = tokio::time::timeout(wait, committer).await;
        let _ = tokio::time::timeout(wait, arch_done_rx).await;
        std::mem::forget(queue.clone());
        http_stop.cancel();
        let e = fatal.lock().unwrap_or_else(|p| p.into_inner()).take();
        return Err(e.unwrap_or_else(|| anyhow::anyhow!("queue storage failed")));
    }
    committer.await.context("committer task panicked")?;
    archive_thread
        .join()
        .map_err(|_| anyhow::anyhow!("archive thread panicked"))?;
    let flushed = queue.flush();
    http_stop.cancel();
    if let Some(h) = http_task {
        let _ = h.await;
    }
    // The first fatal error is the one to report (a full disk also fails the last flush).
    if let Some(e) = fatal.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    flushed?;
    let report = StatusReport::from_queue(&queue, &cfg)?;
    let interrupted = interrupted.load(Ordering::SeqCst);
    for d in &report.datasets {
        if let Some(b) = d.budget {
            tracing::info!(dataset = %d.name, completion_tokens = d.completion_tokens, budget = b,
                overshoot = d.overshoot_tokens, wasted = d.wasted_tokens, "budget outcome");
        }
    }
    Ok(RunSummary {
        interrupted,
        report,
    })
}

/// The run's error when shards cannot be written: what failed, where, and that nothing
/// is lost. One line (the cause's text is inlined, not chained, so it is said once).
fn output_failure(
    e: &crate::output::archive::ArchiveError,
    out_dir: &std::path::Path,
    data_dir: &std::path::Path,
) -> anyhow::Error {
    match e {
        crate::output::archive::ArchiveError::Queue(_) => anyhow::anyhow!(
            "cannot record written shards in the queue in {} (disk full or unwritable?): {e}. \
             Dispatch stopped; the next run adopts what was written and shards the rest",
            data_dir.display()
        ),
        _ => anyhow::anyhow!(
            "cannot write shards under {}: {e}. Dispatch stopped; every completed result is \
             kept in the queue ({}) and goes into a shard on the next run, once the output is \
             writable",
            out_dir.display(),
            data_dir.display()
        ),
    }
}

fn load_prompt_tools(cfg: &Config) -> Result<(Option<Tokenizer>, Option<ChatTemplate>)> {
    let Some(t) = &cfg.tokenizer else {
        return Ok((None, None));
    };
    let tok = Tokenizer::from_file(&t.path)
        .with_context(|| format!("{}: key `tokenizer.path`", cfg.source.display()))?;
    let tpl =
        match &t.chat_template {
            Some(p) => Some(ChatTemplate::from_file(p).with_context(|| {
                format!("{}: key `tokenizer.chat_template`", cfg.source.display())
            })?),
            None => None,
        };
    Ok((Some(tok), tpl))
}

fn archive_loop(
    archive: &mut Archive,
    queue: &Queue,
    ds_list: &[u16],
    mut rx: mpsc::UnboundedReceiver<(u16, Vec<(ShardRow, CountSource)>)>,
    seeded: tokio::sync::oneshot::Sender<()>,
    metrics: &Metrics,
    names: &HashMap<u16, String>,
) -> Result<(), crate::output::archive::ArchiveError> {
    let record = |sealed: &[crate::output::shard::SealedShard], ds: u16| {
        let name = names.get(&ds).map(String::as_str).unwrap_or("?");
        for s in sealed {
            metrics.shards_written.with_label_values(&[name]).inc();
            metrics
                .shard_bytes
                .with_label_values(&[name])
                .inc_by(s.bytes);
        }
    };
    for &ds in ds_list {
        let rows = queue.unsharded(ds)?;
        if !rows.is_empty() {
            tracing::info!(dataset = %names[&ds], rows = rows.len(), "results from the last run waiting for a shard");
            let sealed = archive.add(ds, None, rows)?;
            record(&sealed, ds);
        }
    }
    let _ = seeded.send(());
    while let Some((ds, rows)) = rx.blocking_recv() {
        let source = rows.first().map(|r| r.1);
        let rows: Vec<ShardRow> = rows.into_iter().map(|r| r.0).collect();
        let sealed = archive.add(ds, source, rows)?;
        record(&sealed, ds);
    }
    for (ds, s) in archive.seal_all()? {
        record(std::slice::from_ref(&s), ds);
    }
    Ok(())
}

/// Most results applied to the queue in one batch (one fsync).
const COMMIT_MAX: usize = 1024;
/// A batch smaller than this waits up to [`COMMIT_LINGER`] for more results.
const COMMIT_MIN: usize = 256;
/// How long a small batch waits for company before it is committed. At thousands of
/// completions per second the per-batch cost (a blocking-pool hop, a results-log append
/// and its fdatasync, a sled batch and its flush) is a visible share of the client's CPU
/// (BENCHMARKS.md "Fifth pass"); at the rates of a real
/// GPU server (a few per second) it only delays the acknowledgement by this much.
const COMMIT_LINGER: Duration = Duration::from_millis(5);

async fn commit_loop(
    mut rx: mpsc::UnboundedReceiver<Finished>,
    queue: Arc<Queue>,
    sched: Arc<Scheduler>,
    archive: &mpsc::UnboundedSender<(u16, Vec<(ShardRow, CountSource)>)>,
    dmetrics: Vec<DatasetMetrics>,
) -> Result<()> {
    let mut buf = Vec::new();
    while rx.recv_many(&mut buf, COMMIT_MAX).await > 0 {
        // Group commit: a batch smaller than COMMIT_MIN waits up to COMMIT_LINGER for
        // more results, so a fast server's completions share one batch and one fsync.
        // Nothing is acknowledged earlier: the wait only delays the acknowledgement (a
        // worker's slot is already free again), it never skips the fsync.
        if buf.len() < COMMIT_MIN {
            let deadline = tokio::time::Instant::now() + COMMIT_LINGER;
            while buf.len() < COMMIT_MIN {
                let room = COMMIT_MAX - buf.len();
                match tokio::time::timeout_at(deadline, rx.recv_many(&mut buf, room)).await {
                    Ok(n) if n > 0 => {}
                    _ => break,
                }
            }
        }
        let mut metas = Vec::with_capacity(buf.len());
        let mut outcomes = Vec::with_capacity(buf.len());
        for f in buf.drain(..) {
            // Policy "cancel": a result that would take its dataset past the budget is
            // not committed; the item goes back to pending.
            if let Outcome::Done { result, .. } = &f.outcome {
                if !sched.admit(&f.lease, result.completion_tokens) {
                    let _ = queue.add_wasted(f.lease.ds, u64::from(result.completion_tokens));
                    sched.release(&f.lease);
                    continue;
                }
            }
            outcomes.push(f.outcome);
            metas.push((f.lease, f.count_source, f.duration_s, f.ttft_s));
        }
        if outcomes.is_empty() {
            continue;
        }
        let q = queue.clone();
        // One batch and one fsync for everything that arrived together.
        let (applied, outcomes) = tokio::task::spawn_blocking(move || -> Result<_> {
            let a = q.commit(&outcomes)?;
            q.flush()?;
            Ok((a, outcomes))
        })
        .await
        .context("commit task panicked")??;
        let mut to_archive: HashMap<u16, Vec<(ShardRow, CountSource)>> = HashMap::new();
        for ((outcome, ok), (lease, source, duration_s, ttft_s)) in
            outcomes.into_iter().zip(applied).zip(metas)
        {
            let dm = &dmetrics[lease.lane];
            match outcome {
                Outcome::Done { ds, result } if ok => {
                    dm.ok.inc();
                    dm.completion_tokens
                        .inc_by(u64::from(result.completion_tokens));
                    dm.prompt_tokens.inc_by(u64::from(result.prompt_tokens));
                    dm.duration.observe(duration_s);
                    if let Some(t) = ttft_s {
                        dm.ttft.observe(t);
                    }
                    sched.completed(&lease, result.completion_tokens);
                    to_archive.entry(ds).or_default().push((*result, source));
                }
                Outcome::Failed { .. } if ok => {
                    dm.failed.inc();
                    sched.failed(&lease);
                }
                // Not pending any more: nothing to do but end the lease.
                _ => sched.release(&lease),
            }
        }
        for (ds, rows) in to_archive {
            // The archive thread only stops on a fatal error, which has stopped dispatch.
            let _ = archive.send((ds, rows));
        }
    }
    Ok(())
}
