//! A function per command. Each builds what it needs from the config and its flags
//! ([`Flags`]), calls into the library, prints its answer, and returns its exit code.

use crate::cli::signals::{
    first_signal, remove_on_signal, remove_on_signal_too, scratch_removed_on_signal, wait_signal,
};
use crate::ExportArgs;
use spool::cluster::partition::Partition;
use spool::config::{Config, Overrides};
use spool::error::{exit, Context, Error};
use spool::observe::figures::{grouped, human};
use spool::observe::printable::{escape_except, json_safe};
use spool::observe::status::StatusReport;
use spool::run::plan::JobPlan;
use std::path::PathBuf;
use std::sync::Arc;

/// The config and this worker's partition, worked out from `[run] partitions`, the flags
/// and the scheduler's environment; `{partition}` in `data_dir` is replaced by its index.
/// The partition needs the file's `[run] partitions`, so a `data_dir` that names it is
/// loaded again with the index as an override: the config is never changed once loaded.
pub(crate) fn load(flags: &Flags) -> Result<(Config, Option<Partition>), Error> {
    let cfg = Config::load(&flags.config, &overrides(flags))?;
    let partition = Partition::resolve(
        flags.partitions.or(cfg.run.partitions),
        flags.partition,
        |k| std::env::var(k).ok(),
    )?;
    match partition {
        Some(p) if cfg.data_dir.to_string_lossy().contains("{partition}") => {
            let o = Overrides {
                partition: Some(p.index),
                ..overrides(flags)
            };
            Ok((Config::load(&flags.config, &o)?, partition))
        }
        _ => Ok((cfg, partition)),
    }
}

/// A cluster job's output, for the commands that read all partitions: its store, its
/// partition count (the config's or `--partitions`, else the job record's) and its job
/// record; `None` for a one-machine output folder, unless `folder_too` (a shared folder is
/// then read as a cluster job's output). With `check`, a config that is not the job
/// record's shape (inputs aside) is refused, exit 2 naming both values.
pub(crate) fn cluster_job(
    flags: &Flags,
    cfg: &Config,
    rt: &tokio::runtime::Runtime,
    check: bool,
    folder_too: bool,
) -> Result<Option<ClusterJob>, Error> {
    use spool::cluster::job;
    let configured = spool::cluster::partition::Partition::count(
        flags.partitions.or(cfg.run.partitions),
        |k| std::env::var(k).ok(),
    )?;
    let url = folder_too || spool::output::bucket::is_url(&cfg.output_dir.to_string_lossy());
    if configured == Some(0) {
        return Err(spool::cluster::partition::PartitionError::Zero.into());
    }
    if configured.is_none() && !url {
        return Ok(None);
    }
    let bucket = spool::cluster::worker::open_bucket(cfg)?;
    let record = rt.block_on(job::read_latest(&bucket))?;
    let count = configured
        .or(record.as_ref().map(|r| r.partitions))
        .unwrap_or(1);
    if let (Some(r), true) = (&record, check) {
        let here = job::shape_of(cfg, count, &Default::default(), "cli");
        job::refuse_differences(
            r,
            &here,
            false,
            "use the job's config (or its partition count), or a new output_dir for a new job",
        )?;
    }
    Ok(Some(ClusterJob {
        bucket,
        count,
        record,
    }))
}

/// What [`cluster_job`] found.
pub(crate) struct ClusterJob {
    bucket: std::sync::Arc<spool::output::bucket::Bucket>,
    count: u32,
    record: Option<spool::cluster::job::JobRecord>,
}

pub(crate) fn overrides(flags: &Flags) -> Overrides {
    Overrides {
        data_dir: flags.data_dir.clone(),
        output_dir: flags.output_dir.clone(),
        concurrency: flags.concurrency,
        metrics_addr: flags.metrics_addr.clone(),
        server_urls: flags.server_urls.clone(),
        partition: None,
    }
}

/// What the command line says over the config, whichever command it came with (a flag a
/// command does not take is `None`).
#[derive(Debug, Default)]
pub(crate) struct Flags {
    pub(crate) config: PathBuf,
    pub(crate) data_dir: Option<PathBuf>,
    pub(crate) output_dir: Option<PathBuf>,
    pub(crate) concurrency: Option<spool::config::Concurrency>,
    pub(crate) metrics_addr: Option<String>,
    pub(crate) server_urls: Vec<String>,
    pub(crate) partitions: Option<u32>,
    pub(crate) partition: Option<u32>,
}

impl Flags {
    pub(crate) fn of(cfg: &crate::ConfigArgs) -> Flags {
        Flags {
            config: cfg.config.clone(),
            data_dir: cfg.data_dir.clone(),
            output_dir: cfg.output_dir.clone(),
            ..Flags::default()
        }
    }

    pub(crate) fn with_partitions(self, p: &crate::PartitionsArg) -> Flags {
        Flags {
            partitions: p.partitions,
            ..self
        }
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// `spool run`: the job, or this worker's partition of a cluster job.
pub(crate) fn run(flags: &Flags, knobs: spool::knobs::Knobs, reshape: bool) -> Result<u8, Error> {
    let (cfg, partition) = load(flags)?;
    let cfg = Arc::new(cfg);
    let rt = runtime()?;
    let plan = JobPlan {
        partition,
        inputs: rt.block_on(spool::run::inputs::fetch_inputs(&cfg))?,
        ..JobPlan::default()
    };
    let cluster = spool::cluster::worker::is_cluster(&cfg, &plan);
    let summary = if cluster {
        rt.block_on(spool::cluster::worker::run(
            cfg,
            plan,
            knobs,
            first_signal(),
            reshape,
        ))
    } else {
        rt.block_on(spool::run::job::run_planned(
            cfg,
            plan,
            knobs,
            first_signal(),
        ))
    };
    // A storage layer stuck after a disk error must not keep the process alive
    // (dropping the runtime would wait for its blocking tasks forever).
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    let summary = summary?;
    if !summary.limited.is_empty() {
        eprintln!(
            "spool: intake of {} stopped: an input limit, or every row rejected (the log names the file, line and reason); fix the input and run again; the other datasets ran",
            summary.limited.join(", ")
        );
    }
    if summary.interrupted {
        eprintln!("{}", closing_line(&summary.report));
    }
    if summary.ending() == Some(spool::error::Kind::ItemsFailed) {
        let failed = summary.report.failed();
        if cluster {
            eprintln!("spool: {failed} item(s) failed permanently; recorded in the partition's log (the partition is done with failures): `spool finalize` lists them, `spool retry` sends them back");
            return Ok(spool::cluster::worker::exit_code(&summary));
        }
        eprintln!(
            "spool: {failed} item(s) failed permanently; see `spool status` and `spool retry`"
        );
    }
    Ok(summary.exit_code())
}

/// `spool status`: a remote endpoint's table, a cluster job's from the store, or this
/// queue's (live from its running process when that proves it owns the queue).
pub(crate) fn status(
    flags: &Flags,
    json: bool,
    url: Option<&str>,
    knobs: &spool::knobs::Knobs,
) -> Result<u8, Error> {
    let report = match url {
        Some(url) => runtime()?.block_on(remote_status(url))?,
        None => {
            let cfg = Config::load(&flags.config, &overrides(flags))?;
            let rt = runtime()?;
            if let Some(job) = cluster_job(flags, &cfg, &rt, true, false)? {
                let datasets: Vec<_> = cfg
                    .datasets
                    .iter()
                    .map(|d| (d.name.clone(), d.token_budget))
                    .collect();
                let st = rt.block_on(spool::cluster::status::status(
                    &job.bucket,
                    job.count,
                    job.record.as_ref().map(|r| r.version),
                    &datasets,
                ))?;
                tracing::info!(requests = %job.bucket.request_counts(), "store requests");
                if json {
                    println!("{}", json_safe(serde_json::to_string_pretty(&st)?));
                } else {
                    print!("{}", escape_except(&st.render_table(), &['\n']));
                }
                return Ok(exit::OK);
            }
            runtime()?.block_on(status_report(&cfg, &knobs.faults))?
        }
    };
    if json {
        println!("{}", json_safe(serde_json::to_string_pretty(&report)?));
    } else {
        print!("{}", report.render_table());
    }
    Ok(exit::OK)
}

/// `spool verify`: every completed item in exactly one shard (or, for a cluster job, the
/// published output against its manifest and logs).
pub(crate) fn verify(flags: &Flags, knobs: &spool::knobs::Knobs) -> Result<u8, Error> {
    let cfg = Config::load(&flags.config, &overrides(flags))?;
    let rt = runtime()?;
    if let Some(job) = cluster_job(flags, &cfg, &rt, true, false)? {
        // Private, fresh, removed on every exit: shards are downloaded there.
        remove_on_signal();
        let scratch = scratch_removed_on_signal(|| spool::output::files::Scratch::new("verify"))
            .context("cannot make a scratch folder in $TMPDIR")?;
        let (manifest, problems) = rt.block_on(spool::cluster::verify::verify(
            &job.bucket,
            job.count,
            scratch.path(),
        ))?;
        drop(scratch);
        if let Some(m) = &manifest {
            for (name, d) in &m.datasets {
                let budget = d.budget.map_or(String::new(), |b| format!(" (budget {b})"));
                println!("{}{budget}", dataset_line(name, d));
            }
        }
        for p in &problems {
            println!("{p}");
        }
        return if problems.is_empty() {
            println!("verify: clean");
            Ok(exit::OK)
        } else {
            println!("verify: {} problem(s)", problems.len());
            Ok(exit::FAILURE)
        };
    }
    if !cfg.data_dir.is_dir() {
        return Err(Error::msg(format!(
            "no queue in {} (data_dir of {}): nothing has run with this config, so there is nothing to verify",
            cfg.data_dir.display(),
            cfg.source.display()
        )));
    }
    let queue = spool::store::queue::Queue::open_with(&cfg.data_dir, &knobs.faults).map_err(|e| match e {
        spool::store::queue::QueueError::Locked { .. } => Error::from(e).context(
            "cannot verify while a `spool run` is active: it holds the queue; verify after it stops",
        ),
        e => e.into(),
    })?;
    let report = spool::output::verify::verify(&queue, &cfg)?;
    print!("{}", report.render_summary());
    for p in &report.problems {
        println!("{p}");
    }
    if report.is_clean() {
        println!("verify: clean");
        Ok(exit::OK)
    } else {
        println!("verify: {} problem(s)", report.problems.len());
        Ok(exit::FAILURE)
    }
}

/// `spool finalize`: a cluster job's committed shards published, with `_manifest.json`.
pub(crate) fn finalize(flags: &Flags, partial: bool, json: bool, gc: bool) -> Result<u8, Error> {
    let cfg = Config::load(&flags.config, &overrides(flags))?;
    let rt = runtime()?;
    // A shared folder: finalize is of a cluster job whatever the config says.
    let job = cluster_job(flags, &cfg, &rt, true, true)?
        .ok_or_else(|| Error::msg("finalize: not a cluster job's output"))?;
    let bucket = &job.bucket;
    let opts = spool::cluster::finalize::FinalizeOptions { partial, gc };
    let done = rt.block_on(spool::cluster::finalize::finalize(
        bucket,
        job.count,
        job.record.as_ref(),
        opts,
    ))?;
    tracing::info!(copied = done.copied, skipped = done.skipped, collected = done.collected,
        requests = %bucket.request_counts(), "finalize done");
    let manifest = done
        .manifest
        .ok_or_else(|| Error::msg("finalize wrote no manifest"))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
    } else {
        for (name, d) in &manifest.datasets {
            let failed = if d.failed.is_empty() {
                String::new()
            } else {
                format!("; {} item(s) failed for good (listed in the manifest; `spool retry` sends them back)", d.failed.len())
            };
            println!("{}{failed}", dataset_line(name, d));
        }
        if !manifest.incomplete.is_empty() {
            println!(
                "partitions {:?} published unfinished (--partial)",
                manifest.incomplete
            );
        }
        println!(
            "published to {} ({})",
            bucket.url(),
            spool::cluster::manifest::MANIFEST
        );
    }
    Ok(exit::OK)
}

/// `spool retry`: permanently failed items back to pending.
pub(crate) fn retry(
    flags: &Flags,
    dataset: Option<&str>,
    knobs: &spool::knobs::Knobs,
) -> Result<u8, Error> {
    // A cluster job: through the store, so the partitions' next workers (on their
    // volumes or new ones) take the items in again.
    if flags.partition.is_none() {
        let cfg = Config::load(&flags.config, &overrides(flags))?;
        let rt = runtime()?;
        if let Some(job) = cluster_job(flags, &cfg, &rt, true, false)? {
            let wanted: Vec<String> = dataset.iter().map(|d| d.to_string()).collect();
            let sent = rt.block_on(spool::cluster::status::retry(
                &job.bucket,
                job.count,
                &wanted,
            ))?;
            for (p, name, n) in &sent {
                println!("p{p:04} {name}: {n} failed item(s) sent back");
            }
            if sent.is_empty() {
                println!("no item failed for good");
            } else {
                println!("run those partitions' workers again, then `spool finalize`");
            }
            return Ok(exit::OK);
        }
    }
    // A partition's queue: `--partition I` picks its data_dir.
    let (cfg, _) = load(flags)?;
    let queue = spool::store::queue::Queue::open_with(&cfg.data_dir, &knobs.faults)?;
    let mut total = 0;
    for s in queue.states() {
        if dataset.as_ref().is_some_and(|d| d != &s.name) {
            continue;
        }
        let n = queue.retry_failed(s.index)?;
        println!("{}: {n} failed item(s) back to pending", s.name);
        total += n;
    }
    if let Some(d) = dataset {
        if !queue.states().iter().any(|s| s.name == d) {
            return Err(spool::config::ConfigError::Invalid {
                path: cfg.source.clone(),
                key: "--dataset".into(),
                detail: format!("no dataset `{d}` in the queue"),
            }
            .into());
        }
    }
    tracing::info!(items = total, "retry done");
    Ok(exit::OK)
}

/// `spool show`: a shard's first rows as JSON lines.
pub(crate) fn show(shard: &std::path::Path, rows: usize, width: usize) -> Result<u8, Error> {
    if !shard.is_file() {
        return Err(Error::new(
            spool::error::Kind::Usage,
            anyhow::anyhow!(
                "{} is not a file: name a `part-*.parquet` shard (`ls <output_dir>/<dataset>/`)",
                shard.display()
            ),
        ));
    }
    let all = spool::output::reader::read_rows(shard)?;
    for r in all.iter().take(rows) {
        let mut v = serde_json::to_value(r)?;
        if width > 0 {
            shorten(&mut v, width);
        }
        println!("{v}");
    }
    println!(
        "({} of {} rows in {})",
        all.len().min(rows),
        all.len(),
        shard.display()
    );
    Ok(exit::OK)
}

/// `spool export`: the sealed shards in a training framework's form.
pub(crate) fn export(
    flags: &Flags,
    args: &ExportArgs,
    knobs: &spool::knobs::Knobs,
) -> Result<u8, Error> {
    let ExportArgs {
        format,
        out,
        force,
        dataset,
        per_turn,
        draft_vocab,
        target_vocab,
        holdout,
        exclude_finish,
        keep_empty,
        think_markers,
        end_of_turn,
    } = args;
    let cfg = Config::load(&flags.config, &overrides(flags))?;
    // What is at --out: an earlier export is replaced, anything else kept.
    let aside = spool::output::export::claim_out(out, *format, *force)?;
    if let Some(aside) = &aside {
        println!("moved {} aside to {}", out.display(), aside.display());
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    remove_on_signal();
    let mut opts = spool::output::export::ExportOptions {
        format: *format,
        out: out.clone(),
        dataset: dataset.clone(),
        per_turn: *per_turn,
        draft_vocab: *draft_vocab,
        target_vocab: *target_vocab,
        holdout: *holdout,
        gates: spool::output::export::Gates {
            exclude_finish: exclude_finish.clone(),
            keep_empty: *keep_empty,
            think: *think_markers,
            ..Default::default()
        },
        status: None,
        end_of_turn: end_of_turn.clone(),
        shards: None,
    };
    for (tmp, _) in spool::output::export::outputs(&opts) {
        remove_on_signal_too(tmp);
    }
    // A cluster job's output: the published shards, fetched (and checked against
    // the manifest) into a private scratch folder beside --out (its file system),
    // read like an output folder, removed on every exit.
    let mut scratch = None;
    if let Some(job) = cluster_job(flags, &cfg, &runtime()?, false, false)? {
        let bucket = job.bucket;
        spool::output::files::create_dir_all(&parent, spool::output::files::DIR_MODE)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        let dir =
            scratch_removed_on_signal(|| spool::output::files::Scratch::new_in(&parent, "export"))
                .with_context(|| format!("cannot make a scratch folder in {}", parent.display()))?;
        let wanted: Vec<String> = dataset.iter().cloned().collect();
        runtime()?.block_on(spool::cluster::manifest::download_published(
            &bucket,
            dir.path(),
            &wanted,
        ))?;
        opts.shards = Some(dir.to_path_buf());
        scratch = Some(dir);
    }
    // A dataset the config does not name is the user's to fix; what export itself
    // reports (files, shards) is a runtime failure.
    if let Some(d) = dataset.as_deref() {
        if !cfg.datasets.iter().any(|x| x.name == d) {
            return Err(Error::from(spool::config::ConfigError::Invalid {
                path: cfg.source.clone(),
                key: "--dataset".into(),
                detail: format!("no dataset `{d}` in the config"),
            }));
        }
    }
    // The queue's counts for the item-level accounting: from the running process,
    // else from the queue; an export goes on without them.
    let status = if cfg.data_dir.is_dir() && scratch.is_none() {
        runtime()?
            .block_on(status_report(&cfg, &knobs.faults))
            .map_err(|e| eprintln!("spool: export without the queue's counts: {e}"))
            .ok()
    } else {
        None
    };
    opts.status = status;
    let r = spool::output::export::export(&cfg, &opts).map_err(Error::from);
    drop(scratch);
    let r = r?;
    let acc = &r.accounting;
    println!("{}", opts.gates.describe());
    for line in acc.lines() {
        println!("{line}");
    }
    println!(
        "export {}: {} row(s) from {} shard(s) to {} (summary: {})",
        format.name(),
        acc.kept(),
        r.shards,
        out.display(),
        spool::output::export::summary_path(out).display()
    );
    for (_, also) in spool::output::export::outputs(&opts).iter().skip(1) {
        println!("  and {}", also.display());
    }
    if *format == spool::output::export::Format::DraftVocab {
        println!(
            "SpecForge's vocab_mapping_path takes a .pt: python -c 'import torch; from safetensors.torch import load_file; torch.save(load_file(\"{}\"), \"vocab_mapping.pt\")'",
            out.display()
        );
    }
    Ok(exit::OK)
}

/// `spool mock-server`: the simulated inference server, until a signal.
pub(crate) fn mock_server(mcfg: spool::mock::MockConfig) -> Result<u8, Error> {
    runtime()?.block_on(async move {
        let listener = spool::mock::bind(&mcfg.addr).await.map_err(|e| {
            // An address to change, as a port in use is (`127.0.0.1:0` picks a free one).
            Error::new(
                spool::error::Kind::Usage,
                anyhow::anyhow!(
                    "cannot bind {}: {e} (`--addr 127.0.0.1:0` picks a free port)",
                    mcfg.addr
                ),
            )
        })?;
        let addr = listener.local_addr()?;
        eprintln!("{}", mock_line(&mcfg));
        println!("listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        spool::mock::serve(listener, mcfg, wait_signal())
            .await
            .map_err(Error::runtime)
    })?;
    Ok(exit::OK)
}

/// What the mock will answer like, said once at start: a newcomer sees why a request
/// takes as long as it does, and which flag changes it.
pub(crate) fn mock_line(m: &spool::mock::MockConfig) -> String {
    let ids = match &m.tokenizer {
        Some(t) => format!("real ids of {}", t.display()),
        None => "its own ids (`w<N>` words; --tokenizer for a real vocabulary's)".into(),
    };
    let speed = if m.instant {
        "answers at once (--instant)".to_string()
    } else {
        let per_s = m.per_request_tps * m.time_scale;
        format!(
            "about {:.0} tok/s a request, {:.0} tok/s in all: a mean completion of {:.0} tokens takes ~{:.0} s (--time-scale, --mean-tokens)",
            per_s,
            m.capacity_tps * m.time_scale,
            m.mean_tokens,
            m.mean_tokens / per_s.max(1e-9)
        )
    };
    format!(
        "spool mock-server: model {:?}, {ids}; {speed}; Ctrl-C stops it",
        m.model
    )
}

/// The last line of an interrupted run: what is done, what is left, and how to go on.
pub(crate) fn closing_line(report: &StatusReport) -> String {
    let (done, items, tokens) = report.datasets.iter().fold((0, 0, 0), |(d, i, t), s| {
        (d + s.done, i + s.items, t + s.completion_tokens)
    });
    let left: u64 = report.datasets.iter().map(|s| s.pending).sum();
    let resume = std::env::args()
        .map(|a| spool::observe::printable::shell_word(&a).into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let (done, items) = (grouped(done), grouped(items));
    let (tokens, left) = (human(tokens), grouped(left));
    format!(
        "spool: stopped: {done} of {items} items done ({tokens} completion tokens), {left} left; every answer received is kept. Resume with: {resume}"
    )
}

/// Cuts long strings and id lists so a row fits on a screen.
pub(crate) fn shorten(v: &mut serde_json::Value, width: usize) {
    match v {
        serde_json::Value::String(s) if s.chars().count() > width => {
            let cut: String = s.chars().take(width).collect();
            *s = format!("{cut}…");
        }
        serde_json::Value::Array(a) if a.len() > 12 => {
            let n = a.len();
            a.truncate(12);
            a.push(serde_json::Value::String(format!("… {n} in all")));
        }
        serde_json::Value::Object(o) => o.values_mut().for_each(|x| shorten(x, width)),
        _ => {}
    }
}

/// A remote run's `/status`; an endpoint that does not answer, or answers something else,
/// is an error naming the URL.
pub(crate) async fn remote_status(url: &str) -> Result<StatusReport, Error> {
    // A URL that cannot be one is the user's to fix; an endpoint that fails is not.
    spool::observe::status::status_url(url)
        .map_err(|e| Error::new(spool::error::Kind::Usage, anyhow::Error::msg(e)))?;
    spool::observe::status::fetch(url, std::time::Duration::from_secs(10))
        .await
        .map_err(Error::msg)
}

/// The running process's `/status` when it answers and proves it owns the queue (the
/// token it wrote in `data_dir`), else the queue alone.
pub(crate) async fn status_report(
    cfg: &Config,
    faults: &spool::knobs::Faults,
) -> Result<StatusReport, Error> {
    let token = std::fs::read_to_string(cfg.data_dir.join(spool::run::job::TOKEN_FILE));
    if let Ok(token) = token {
        // The address a running process actually bound (it may have been given on its
        // command line, or be port 0), then the configured one.
        let mut addrs = Vec::new();
        if let Ok(a) = std::fs::read_to_string(cfg.data_dir.join(spool::run::job::ENDPOINT_FILE)) {
            addrs.push(a.trim().to_string());
        }
        if !cfg.run.metrics_addr.is_empty() {
            addrs.push(cfg.run.metrics_addr.clone());
        }
        addrs.dedup();
        for addr in addrs.iter().filter(|a| !a.ends_with(":0")) {
            match spool::observe::status::fetch_own(
                addr,
                token.trim(),
                std::time::Duration::from_secs(2),
            )
            .await
            {
                Ok(rep) => return Ok(rep),
                Err(e @ spool::observe::status::OwnStatusError::Untrusted(_)) => {
                    tracing::warn!("{e}")
                }
                Err(e) => tracing::debug!(error = %e, "no live status"),
            }
        }
    }
    match spool::store::queue::Queue::open_with(&cfg.data_dir, faults) {
        Ok(q) => Ok(StatusReport::from_queue(&q, cfg, &|d| d.token_budget)?),
        // Exit 1, not 2: the config is right, the endpoint does not answer.
        Err(spool::store::queue::QueueError::Locked { path }) => Err(Error::msg(format!(
            "a `spool run` holds the queue in {} and its metrics endpoint ({}) does not answer; \
             enable run.metrics_addr to see live status",
            path.display(),
            if cfg.run.metrics_addr.is_empty() {
                "disabled"
            } else {
                cfg.run.metrics_addr.as_str()
            }
        ))),
        Err(e) => Err(e.into()),
    }
}

/// A published dataset as `verify` and `finalize` print it.
fn dataset_line(name: &str, d: &spool::cluster::manifest::ManifestDataset) -> String {
    format!(
        "{name}: {} shards, {} items, {} rows, {} completion tokens",
        d.shards.len(),
        d.items,
        d.rows,
        d.completion_tokens
    )
}
