//! `spool run`: the application layer that wires the stages together, as named steps read
//! top to bottom in [`run`].
//!
//! Start-up: open the store (repairing it if a failed write left the marker) → bind the
//! metrics endpoint (a port in use stops the run here, before any server is asked) → load
//! the prompt tools → connect to and probe the servers → check spool's rendering against
//! the servers' (`template_check`) → intake every dataset → checkpoint the
//! queue after a big intake (while this job holds its only handle) → recover the output
//! folder → start the archive thread, the committer, the monitor and the endpoint →
//! dispatch. Shutdown (`run::shutdown`) runs in a fixed order on the signal, a fatal error,
//! or when all is done.
//!
//! Tasks: the dispatcher leases rows into request slots; one worker task per lease talks to
//! a server with retries; the committer applies finished attempts in group commits and only
//! then tells the scheduler and hands rows to the archive thread; a monitor task samples
//! rates, updates gauges and logs progress.
//!
//! `datasets` holds the intake steps (open, enqueue, checkpoint), `endpoint` the metrics
//! endpoint and the monitor.

mod datasets;
mod endpoint;

pub use endpoint::{ENDPOINT_FILE, TOKEN_FILE};

use crate::config::{BudgetPolicy, Config, DatasetConfig, PromptSource, TemplateCheck};
use crate::error::{Context, Error, Kind};
use crate::knobs::Knobs;
use crate::observe::metrics::{DatasetMetrics, Metrics};
use crate::observe::status::StatusReport;
use crate::output::archive::{self, Archive, ArchiveDataset};
use crate::output::schema::{
    META_CONFIG_SHA256, META_SAMPLING, META_TOKENIZER_SHA256, META_VERSION,
};
use crate::output::shard::ShardLimits;
use crate::prompt::draw::Drawer;
use crate::prompt::model_folder::ModelFiles;
use crate::prompt::remote::RemoteRenderer;
use crate::prompt::syntax::Syntax;
use crate::prompt::{ChatTemplate, PromptBuilder, Tokenizer};
use crate::run::archiver::{output_failure, Archiver, Archiving, ToArchive};
use crate::run::committer::{self, CommitReceiver, Committer};
use crate::run::dispatcher::dispatch;
use crate::run::plan::JobPlan;
use crate::run::probe::Probed;
use crate::run::scheduler::{LaneSpec, Scheduler};
use crate::run::servers::Servers;
use crate::run::shutdown::{shut_down, Running, Stop};
use crate::run::worker::Ctx;
use crate::store::queue::Queue;
use crate::upstream::render::{Detected, RenderKind, ServerRenderer};
use crate::upstream::tls::TrustRoots;
use crate::upstream::{Upstream, UpstreamOptions};
use datasets::{checkpoint, Datasets};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How a run ended (the caller maps it to an exit code).
#[derive(Debug)]
pub struct RunSummary {
    /// Stopped by the shutdown signal before finishing.
    pub interrupted: bool,
    /// Datasets whose input must be fixed: intake stopped at an input limit
    /// (`input::limits`; the rows before it were generated, the rest of the file was not
    /// taken in), or every row was rejected (state `rejected`).
    pub limited: Vec<String>,
    /// The final status, from the queue.
    pub report: StatusReport,
}

impl RunSummary {
    /// How the run ended when it did not fail: `None` is a clean finish (exit 0).
    pub fn ending(&self) -> Option<Kind> {
        if self.interrupted {
            Some(Kind::Interrupted)
        } else if !self.limited.is_empty() {
            // An input file to fix, as a bad file found at start would be.
            Some(Kind::Usage)
        } else if self.report.failed() > 0 {
            Some(Kind::ItemsFailed)
        } else {
            None
        }
    }

    /// The exit code of a run that did not fail.
    pub fn exit_code(&self) -> u8 {
        self.ending()
            .map_or(crate::error::exit::OK, Kind::exit_code)
    }
}

/// Runs the job until every dataset is finished or `shutdown` resolves. `knobs` are the
/// test and benchmark switches (`Knobs::default()` for a plain run).
///
/// The job runs as a task of the runtime, not on the caller's thread (`block_on`): the
/// dispatch loop then spawns each request's task onto its own worker's queue instead of the
/// runtime's shared one, which would wake a worker thread for nearly every request.
pub async fn run(
    cfg: Arc<Config>,
    knobs: Knobs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary, Error> {
    run_planned(cfg, JobPlan::default(), knobs, shutdown).await
}

/// [`run`] with a plan beyond the config ([`JobPlan`]): its partition, fetched inputs, and
/// a cluster partition's staging folder, settled items and growing budgets.
pub async fn run_planned(
    cfg: Arc<Config>,
    plan: JobPlan,
    knobs: Knobs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary, Error> {
    let plan = Arc::new(plan);
    match tokio::spawn(run_job(cfg, plan, knobs, shutdown)).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::msg(format!("the job's task was cancelled: {e}"))),
    }
}

/// What `Config::load` leaves to the stages that know it: the prompt keys
/// (`prompt::settings`) and the CA file's certificates, returned as the roots the servers
/// are checked against. A run (and a cluster worker, before it writes to the store) calls
/// it before it writes anything, so a bad key is exit 2 with nothing written.
pub fn check(cfg: &Config) -> Result<TrustRoots, Error> {
    crate::prompt::settings::check(cfg)?;
    Ok(crate::upstream::tls::trust_roots(cfg)?)
}

/// The steps of a run, in order.
async fn run_job(
    cfg: Arc<Config>,
    plan: Arc<JobPlan>,
    knobs: Knobs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<RunSummary, Error> {
    let job = Job {
        cfg,
        plan,
        knobs,
        stop: Arc::new(Stop::default()),
    };
    job.stop.watch(shutdown, job.cfg.run.shutdown_grace_s);
    let roots = check(&job.cfg)?;
    let queue = job.open_store()?;
    let endpoint = job.bind_endpoint().await?;
    let api_key = job.cfg.api_key()?;
    let (builder, tokenizer_sha) = job.load_prompt_tools()?;
    crate::run::pitfalls::warn(&job.cfg, &builder);
    let datasets = job.open_datasets(&queue)?;
    job.repair(&queue)?;
    let (upstream, probed) = job.probe_servers(api_key, &roots, &builder).await?;
    let context_length = probed.context;
    let renderer = job
        .server_rendering(&upstream, &probed, &builder, context_length)
        .await?;
    let metrics = Arc::new(Metrics::for_partition(job.plan.partition));
    let intake = job
        .intake_all(
            &queue,
            &datasets,
            &builder,
            context_length,
            renderer.clone(),
            &metrics,
        )
        .await?;
    if job.stop.stop.is_cancelled() {
        // A signal during intake: what was enqueued is durable (intake is idempotent and
        // resumable); nothing has been requested yet.
        queue.flush()?;
        return job.summary(&queue, intake.limited);
    }
    let limited = intake.limited.clone();
    let queue = checkpoint(queue, intake.added).await?;
    let archive = job.recover(&queue, &datasets, tokenizer_sha)?;
    let servers = job.servers(&metrics);
    let sched = job.schedule(&queue, &datasets);
    let archiving = job.spawn_archiver(archive, &queue, &datasets, &metrics)?;
    // A failed seeding has already stopped the run (the sender is dropped).
    let _ = archiving.seeded.await;
    let (commits, commit_rx) = committer::channel();
    let dmetrics = intake.dmetrics.clone();
    let committer = job.spawn_committer(
        &queue,
        &sched,
        &intake.dmetrics,
        archiving.to_archive,
        commit_rx,
    );
    let ctx = Arc::new(Ctx {
        gens: job
            .cfg
            .datasets
            .iter()
            .map(|d| job.cfg.generation_of(d))
            .collect(),
        drawers: job
            .cfg
            .datasets
            .iter()
            .map(|d| {
                Drawer::of_dataset(&job.cfg, d).map_err(|e| {
                    Error::new(Kind::Usage, anyhow::anyhow!("dataset {:?}: {e}", d.name))
                })
            })
            .collect::<Result<_, _>>()?,
        syntax: job.syntax(&builder),
        cfg: job.cfg.clone(),
        queue: queue.clone(),
        sched: sched.clone(),
        upstream,
        servers: servers.clone(),
        builder,
        names: datasets.in_order.clone(),
        dmetrics: intake.dmetrics,
        stop: job.stop.stop.clone(),
        hard_stop: job.stop.hard_stop.clone(),
        commits,
        nonce: AtomicU64::new(0),
        faults: crate::run::worker::FaultPoints::new(&job.knobs.faults),
        renderer,
    });
    let (monitor, http) = job.observe(&ctx, &metrics, endpoint);
    let concurrency = job.cfg.run.concurrency.fixed();
    if concurrency.is_none() {
        tokio::spawn(crate::run::concurrency::steer(
            servers.clone(),
            ctx.upstream.clone(),
            job.cfg.run.max_concurrency,
            job.stop.stop.clone(),
        ));
    }
    let requests = dispatch(&ctx, &sched, &servers, &job.stop.stop, concurrency).await?;
    let running = Running {
        requests,
        grace: Duration::from_secs_f64(job.cfg.run.shutdown_grace_s.max(0.0)),
        monitor,
        senders: ctx,
        committer,
        archiver: (archiving.thread, archiving.done),
        http,
    };
    let flushed = {
        let queue = queue.clone();
        move || queue.flush().map_err(Error::from)
    };
    let stopped = shut_down(&job.stop, running, flushed).await;
    if job.stop.queue_broken() {
        // Never dropped: its destructor flushes sled, which may never return after a
        // storage error (seen on ENOSPC).
        std::mem::forget(queue);
        return Err(stopped
            .err()
            .unwrap_or_else(|| Error::msg("queue storage failed")));
    }
    stopped?;
    for (name, dm) in datasets.in_order.iter().zip(&dmetrics) {
        let n = dm.prompt_disagreements.get();
        if n > 0 {
            tracing::warn!(dataset = %name, disagreements = n,
                "chat answers whose prompt differs from spool's rendering this run (spool_prompt_token_disagreements_total)");
        }
    }
    if servers.limited() {
        for s in &servers.list {
            tracing::info!(server = %s.url, limit = s.limit.load(std::sync::atomic::Ordering::Relaxed),
                "concurrency limit at the end (concurrency = \"auto\")");
        }
    }
    let summary = job.summary(&queue, limited)?;
    for d in &summary.report.datasets {
        if let Some(b) = d.budget {
            tracing::info!(dataset = %d.name, completion_tokens = d.completion_tokens, budget = b,
                overshoot = d.overshoot_tokens, wasted = d.wasted_tokens, "budget outcome");
        }
    }
    Ok(summary)
}

/// What every step of a run reads.
struct Job {
    /// The config as loaded, never changed.
    cfg: Arc<Config>,
    /// What the run takes besides the config (empty for one machine's local inputs).
    plan: Arc<JobPlan>,
    /// Test and benchmark switches, read once by the caller.
    knobs: Knobs,
    stop: Arc<Stop>,
}

impl Job {
    /// The reasoning and tool-call syntax raw completions are split by: the template's,
    /// unless `[tokenizer]` names parsers; logged once with why.
    fn syntax(&self, builder: &PromptBuilder) -> crate::run::worker::RunSyntax {
        let t = self.cfg.tokenizer.as_ref();
        let syntax = builder
            .template()
            .map(|tpl| Syntax::of_template(tpl.source()))
            .unwrap_or_else(|| Syntax {
                why: "no chat template".into(),
                ..Syntax::default()
            })
            .overridden(
                t.and_then(|t| t.reasoning_parser.as_deref()),
                t.and_then(|t| t.tool_parser.as_deref()),
            );
        tracing::info!(syntax = %syntax.describe(), "raw completions are split by this syntax");
        crate::run::worker::RunSyntax::new(syntax, builder.tokenizer())
    }

    /// Creates the output folder and opens the queue.
    fn open_store(&self) -> Result<Arc<Queue>, Error> {
        let out = self.plan.output_dir(&self.cfg);
        crate::store::blocks::create_dir_durably(out)
            .with_context(|| format!("cannot create output_dir {}", out.display()))?;
        Ok(Arc::new(Queue::open_with(
            &self.cfg.data_dir,
            &self.knobs.faults,
        )?))
    }

    /// The tokenizer and chat template of the config, and the tokenizer's digest.
    fn load_prompt_tools(&self) -> Result<(Arc<PromptBuilder>, Option<String>), Error> {
        let cfg = &self.cfg;
        let Some(t) = &cfg.tokenizer else {
            return Ok((Arc::new(PromptBuilder::new(None, None)), None));
        };
        let tok = Tokenizer::from_file_with(&t.path, &self.knobs.bench)
            .with_context(|| format!("{}: key `tokenizer.path`", cfg.source.display()))?;
        // `path` naming a model folder brings the folder's template, unless one is named.
        let folder_template = match t.path.is_dir() {
            true => ModelFiles::locate(&t.path)
                .with_context(|| format!("{}: key `tokenizer.path`", cfg.source.display()))?
                .chat_template
                .map(|p| (p, "path")),
            false => None,
        };
        let template = t
            .chat_template
            .clone()
            .map(|p| (p, "chat_template"))
            .or(folder_template);
        let tpl = match template {
            Some((p, key)) => Some(
                ChatTemplate::from_file(&p)
                    .with_context(|| format!("{}: key `tokenizer.{key}`", cfg.source.display()))?,
            ),
            None => None,
        };
        let sha = tok.sha256().to_string();
        Ok((Arc::new(PromptBuilder::new(tpl, Some(tok))), Some(sha)))
    }

    /// Repairs the queue from its records and the shard files when a failed write left the
    /// marker.
    fn repair(&self, queue: &Queue) -> Result<(), Error> {
        if !queue.needs_repair() {
            return Ok(());
        }
        tracing::warn!(
            "the last run stopped on a failed queue write; repairing the queue from its records and the shard files"
        );
        let repaired =
            archive::repair_queue(queue, self.plan.output_dir(&self.cfg)).with_context(|| {
                format!(
                    "cannot repair the queue in {} (left by a failed write, marker `{}`); \
                 `spool verify` lists what is inconsistent",
                    self.cfg.data_dir.display(),
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
        Ok(())
    }

    /// The client for the servers, checked (TLS) and probed for their context length
    /// before any work is queued.
    async fn probe_servers(
        &self,
        api_key: Option<String>,
        roots: &TrustRoots,
        builder: &Arc<PromptBuilder>,
    ) -> Result<(Upstream, Probed), Error> {
        let cfg = &self.cfg;
        let upstream = Upstream::with_roots(
            UpstreamOptions {
                api: cfg.server.api,
                model: cfg.server.model.clone(),
                api_key,
                stream: cfg.server.stream,
                request_timeout: Duration::from_secs_f64(cfg.server.request_timeout_s),
                max_response_bytes: cfg.server.max_response_bytes,
                pool_size: cfg
                    .run
                    .concurrency
                    .fixed()
                    .unwrap_or(cfg.run.max_concurrency),
            },
            roots,
        )?;
        // A certificate refused now would be refused all run: stop before queuing any work.
        upstream
            .check_tls(&cfg.server.urls, cfg.server.ca_cert.is_some())
            .await
            .map_err(|e| cfg.invalid("server.urls", e.to_string()))?;
        // The servers' context length (and a self-check, logged once), before intake.
        let probed = crate::run::probe::probe(cfg, &upstream, builder).await;
        let upstream =
            upstream.with_max_tokens_clamp(probed.context.filter(|_| cfg.server.clamp_max_tokens));
        Ok((upstream, probed))
    }

    /// The servers' own rendering, from what the probe found: checked against spool's
    /// (the start-up template check, before anything is enqueued), and returned when
    /// prompts are rendered there (`[tokenizer] source = "server"`).
    async fn server_rendering(
        &self,
        upstream: &Upstream,
        probed: &Probed,
        builder: &Arc<PromptBuilder>,
        context_length: Option<u32>,
    ) -> Result<Option<Arc<dyn RemoteRenderer>>, Error> {
        let cfg = &self.cfg;
        let Some(t) = &cfg.tokenizer else {
            return Ok(None);
        };
        let servers: Vec<(String, RenderKind)> = probed
            .rendering
            .iter()
            .filter_map(|(url, d)| match d {
                Detected::Renders(kind) => Some((url.clone(), *kind)),
                _ => None,
            })
            .collect();
        let renderer = ServerRenderer::new(
            upstream.clone(),
            servers,
            cfg.server.model.clone(),
            cfg.server.max_attempts,
            cfg.server.max_response_bytes,
        );
        let on_server = t.source == PromptSource::Server;
        let Some(renderer) = renderer else {
            if on_server {
                if probed
                    .rendering
                    .iter()
                    .all(|(_, d)| *d == Detected::Unreachable)
                {
                    return Err(Error::msg(
                        "[tokenizer] source = \"server\": no server answered at start, so none can render prompts; start the server (the next run resumes)",
                    ));
                }
                return Err(cfg
                    .invalid(
                        "tokenizer.source",
                        "\"server\" needs a server that renders prompts, and none of server.urls has a rendering endpoint (vLLM: POST /tokenize with messages; llama.cpp: POST /apply-template; SGLang: POST /tokenize with a prompt); use source = \"client\"",
                    )
                    .into());
            }
            if t.template_check == Some(TemplateCheck::Stop) {
                tracing::warn!("template_check is on, but no server renders prompts (/tokenize, /apply-template): spool's rendering is not checked");
            }
            return Ok(None);
        };
        let options = |d: &DatasetConfig| self.intake_options(d, context_length, None);
        crate::run::template_check::run(cfg, builder, &renderer, t.template_check(), options)
            .await?;
        Ok(on_server.then(|| Arc::new(renderer) as Arc<dyn RemoteRenderer>))
    }

    /// The archive over the output folder, after adopting what a crash left finished and
    /// dropping what it left half written (before any request; intake does not touch
    /// results or shards).
    fn recover(
        &self,
        queue: &Arc<Queue>,
        datasets: &Datasets,
        tokenizer_sha: Option<String>,
    ) -> Result<Archive, Error> {
        let cfg = &self.cfg;
        let limits = ShardLimits {
            max_rows: cfg.shards.max_rows,
            max_bytes: cfg.shards.max_bytes,
            compression_level: cfg.shards.compression_level,
        };
        let mut base_meta = vec![
            (
                META_VERSION.to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ),
            (META_CONFIG_SHA256.to_string(), cfg.sha256.clone()),
        ];
        if let Some(sha) = tokenizer_sha {
            base_meta.push((META_TOKENIZER_SHA256.to_string(), sha));
        }
        let shard_datasets: HashMap<u16, ArchiveDataset> = cfg
            .datasets
            .iter()
            .zip(&datasets.ds)
            .map(|(d, &ds)| {
                let mut metadata = base_meta.clone();
                let sampling = serde_json::to_string(&cfg.sampling_of(d)).unwrap_or_default();
                metadata.push((META_SAMPLING.to_string(), sampling));
                let name = d.name.clone();
                (ds, ArchiveDataset { name, metadata })
            })
            .collect();
        let output_dir = self.plan.output_dir(cfg);
        let archive = Archive::new(
            queue.clone(),
            output_dir,
            limits,
            shard_datasets,
            &self.knobs.faults,
        );
        for &ds in &datasets.ds {
            let rec = archive
                .recover(ds)
                .map_err(|e| output_failure(&e, output_dir, &cfg.data_dir))?;
            if rec.temp_files_removed > 0 || rec.shards_adopted > 0 {
                tracing::info!(dataset = %datasets.names[&ds], temp_files_removed = rec.temp_files_removed,
                    shards_adopted = rec.shards_adopted, rows_adopted = rec.rows_adopted, "recovered output folder");
            }
        }
        Ok(archive)
    }

    /// The servers, each counted up and idle until the monitor's probes say otherwise.
    fn servers(&self, metrics: &Metrics) -> Arc<Servers> {
        let limit = self
            .cfg
            .run
            .concurrency
            .fixed()
            .is_none()
            .then(|| crate::run::concurrency::START_LIMIT.min(self.cfg.run.max_concurrency));
        let servers = Arc::new(Servers::with(
            &self.cfg.server.urls,
            self.knobs.down_log_interval,
            self.cfg.server.routing,
            limit,
        ));
        for s in &servers.list {
            metrics.server_up.with_label_values(&[&s.url]).set(1);
            metrics.inflight.with_label_values(&[&s.url]).set(0);
        }
        servers
    }

    /// Starts the archive thread over the recovered archive.
    fn spawn_archiver(
        &self,
        archive: Archive,
        queue: &Arc<Queue>,
        datasets: &Datasets,
        metrics: &Arc<Metrics>,
    ) -> Result<Archiving, Error> {
        Archiver {
            archive,
            queue: queue.clone(),
            datasets: datasets.ds.clone(),
            names: datasets.names.clone(),
            metrics: metrics.clone(),
            stop: self.stop.clone(),
            output_dir: self.plan.output_dir(&self.cfg).to_path_buf(),
            data_dir: self.cfg.data_dir.clone(),
        }
        .spawn()
    }

    /// Starts the committer, which hands durable rows to `to_archive`.
    fn spawn_committer(
        &self,
        queue: &Arc<Queue>,
        sched: &Arc<Scheduler>,
        dmetrics: &[DatasetMetrics],
        to_archive: ToArchive,
        rx: CommitReceiver,
    ) -> JoinHandle<()> {
        Committer {
            queue: queue.clone(),
            sched: sched.clone(),
            dmetrics: dmetrics.to_vec(),
            to_archive,
            stop: self.stop.clone(),
            data_dir: self.cfg.data_dir.clone(),
            failed_pause: self.knobs.faults.commit_failed_pause,
        }
        .spawn(rx)
    }

    /// The scheduler over the datasets; under policy "cancel", a task that aborts a
    /// dataset's requests in flight as soon as what they streamed would pass its budget.
    fn schedule(&self, queue: &Arc<Queue>, datasets: &Datasets) -> Arc<Scheduler> {
        let cfg = &self.cfg;
        let specs = cfg
            .datasets
            .iter()
            .zip(&datasets.ds)
            .map(|(d, &ds)| LaneSpec {
                ds,
                name: d.name.clone(),
                budget: self.plan.budget(d),
                max_tokens: cfg.sampling_of(d).max_tokens,
                policy: cfg.run.budget_policy,
                samples: cfg.generation_of(d).samples,
                multi: cfg.generation_of(d).is_multi(),
                allowance: self.plan.allowances.get(&d.name).cloned(),
            })
            .collect();
        let sched = Arc::new(Scheduler::new(queue.clone(), specs, self.knobs.bench));
        // A budget granted while the run goes wakes the dispatcher at once.
        for a in self.plan.allowances.values() {
            let (a, sched, stop) = (a.clone(), sched.clone(), self.stop.stop.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = a.changed.notified() => sched.changed.notify_waiters(),
                        _ = stop.cancelled() => break,
                    }
                }
            });
        }
        if cfg.run.budget_policy == BudgetPolicy::Cancel {
            let (sched, stop) = (sched.clone(), self.stop.stop.clone());
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
        sched
    }

    /// The run's outcome, from the queue.
    fn summary(&self, queue: &Queue, limited: Vec<String>) -> Result<RunSummary, Error> {
        Ok(RunSummary {
            interrupted: self.stop.interrupted(),
            limited,
            report: StatusReport::from_queue(queue, &self.cfg, &|d| self.plan.budget(d))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::status::DatasetStatus;

    fn summary(interrupted: bool, failed: u64) -> RunSummary {
        RunSummary {
            interrupted,
            limited: Vec::new(),
            report: StatusReport {
                running: false,
                servers: Vec::new(),
                datasets: vec![DatasetStatus {
                    name: "a".into(),
                    failed,
                    ..DatasetStatus::default()
                }],
            },
        }
    }

    /// A run that finished exits 0, 3 when items failed for good, 2 when a dataset's
    /// intake stopped at an input limit, and 130 when a signal stopped it (also with
    /// failed items: the run did not finish).
    #[test]
    fn a_run_exits_by_how_it_ended() {
        let limited = RunSummary {
            limited: vec!["a".into()],
            ..summary(false, 2)
        };
        assert_eq!(limited.exit_code(), 2);
        assert_eq!(summary(false, 0).exit_code(), 0);
        assert_eq!(summary(false, 2).exit_code(), 3);
        assert_eq!(summary(true, 0).exit_code(), 130);
        assert_eq!(summary(true, 2).exit_code(), 130);
    }
}
