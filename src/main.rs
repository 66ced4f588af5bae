//! The `spool` binary: parses arguments, reads the test and benchmark switches once, calls
//! into the library and exits with the code of how the command ended
//! ([`spool::error::Kind`]). The only place that prints to stdout.

use clap::{Parser, Subcommand};
use spool::config::{Config, Overrides};
use spool::error::{exit, exit_code, Context, Error};
use spool::observe::printable::{escape_except, json_safe};
use spool::observe::status::StatusReport;
use std::path::PathBuf;
use std::process::ExitCode;

/// mimalloc, not glibc malloc: per-chunk and per-record allocations dominate the client's
/// CPU profile otherwise. Built with `no_thp`: mimalloc would otherwise ask for transparent
/// huge pages, and each thread's first touch would cost 2 MiB of RSS.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "spool",
    version = spool::knobs::VERSION,
    about = "Prompt datasets → LLM completions → zstd Parquet shards, crash-safe and resumable"
)]
struct Cli {
    /// Config file.
    #[arg(
        short = 'c',
        long = "config",
        global = true,
        default_value = "spool.toml"
    )]
    config: PathBuf,
    /// Override `data_dir`.
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Override `output_dir`.
    #[arg(long, global = true)]
    output_dir: Option<PathBuf>,
    /// Override `run.concurrency` (a number, or "auto").
    #[arg(long, global = true)]
    concurrency: Option<spool::config::Concurrency>,
    /// Override `run.metrics_addr` ("" disables the endpoint).
    #[arg(long, global = true)]
    metrics_addr: Option<String>,
    /// Override `run.partitions`: the workers of a cluster job.
    #[arg(long, global = true, value_name = "N")]
    partitions: Option<u32>,
    /// This worker's partition (else `JOB_COMPLETION_INDEX`, else `SLURM_ARRAY_TASK_ID`).
    #[arg(long, global = true, value_name = "I")]
    partition: Option<u32>,
    /// Less output (warnings and errors only).
    #[arg(short = 'q', long, global = true)]
    quiet: bool,
    /// More output (debug; twice for trace).
    #[arg(short = 'v', long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Enqueue every dataset, drain the queue under the budgets, write shards.
    Run,
    /// A table per dataset from the queue (or the running process).
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// A remote run's metrics endpoint (`http://HOST:PORT`): its live `/status`, without
        /// a config or the queue.
        #[arg(long, value_name = "URL")]
        url: Option<String>,
    },
    /// Check the shards against the queue: every completed item in exactly one shard. For
    /// an object-store output: the published shards against `_manifest.json` and the logs.
    Verify,
    /// Publish a cluster job's committed shards and write `_manifest.json` (run once every
    /// partition has finished: `afterok` in Slurm, a second Job in Kubernetes).
    Finalize {
        /// Publish what is committed even if some partitions have not finished.
        #[arg(long)]
        partial: bool,
        /// Machine-readable output (the manifest).
        #[arg(long)]
        json: bool,
    },
    /// Move permanently failed items back to pending.
    Retry {
        /// Only this dataset.
        #[arg(long)]
        dataset: Option<String>,
    },
    /// Print the first rows of a shard as JSON lines (a quick look without Python).
    Show {
        /// A `part-*.parquet` file.
        shard: PathBuf,
        /// How many rows.
        #[arg(short = 'n', long, default_value_t = 3)]
        rows: usize,
        /// Cut long strings to this many characters (0 = whole).
        #[arg(long, default_value_t = 160)]
        width: usize,
    },
    /// Write the sealed shards in a form a training framework reads as it is.
    Export {
        /// The output form (README, "Export", has an example row of each).
        #[arg(long, value_enum)]
        format: spool::output::export::Format,
        /// Output file, or folder for `hf` (written under a temporary name, renamed when complete).
        #[arg(long)]
        out: PathBuf,
        /// Move aside what is at `--out` when it is not an earlier export (a folder of other
        /// files; a folder where a file goes), instead of refusing.
        #[arg(long)]
        force: bool,
        /// Only this dataset (default: every dataset of the config).
        #[arg(long)]
        dataset: Option<String>,
        /// `specforge-chat`: one row per assistant turn, as SpecForge's expanded rows.
        #[arg(long)]
        per_turn: bool,
        /// `draft-vocab`: the draft vocabulary's size N.
        #[arg(long, value_name = "N")]
        draft_vocab: Option<usize>,
        /// `token-freq`/`draft-vocab`: the target model's vocabulary size (default: `vocab_size` of the `config.json` beside the tokenizer).
        #[arg(long, value_name = "N")]
        target_vocab: Option<usize>,
        /// Hold out this fraction of each dataset's items (whole conversations, by id hash) in an eval file beside the output (e.g. 0.02).
        #[arg(long, value_name = "FRACTION")]
        holdout: Option<f64>,
        /// Leave out rows with these finish reasons (comma-separated, e.g. `length,abort`; default: keep all).
        #[arg(long, value_delimiter = ',', value_name = "REASONS")]
        exclude_finish: Vec<String>,
        /// Keep completions with no text, thinking or tool call (default: dropped).
        #[arg(long)]
        keep_empty: bool,
        /// Answers that still hold think markers after the thinking was split: flag, drop or keep.
        #[arg(long, value_enum, default_value = "flag")]
        think_markers: spool::output::export::ThinkGate,
    },
    /// A simulated inference server for demos, tests and benchmarks.
    MockServer(spool::mock::MockConfig),
}

fn main() -> ExitCode {
    // Before any thread: what spool and its crates create is never more than 0640/0750.
    spool::output::files::restrict_umask();
    let cli = Cli::parse();
    init_logging(cli.quiet, cli.verbose);
    spool::upstream::tls::install_provider();
    match real_main(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // Errors quote files and servers: their control characters are escaped (the
            // line breaks of a config error's excerpt are spool's own).
            let msg = spool::error::render(&e);
            eprintln!(
                "spool: error: {}",
                spool::observe::printable::escape_except(&msg, &['\n'])
            );
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Logging to stderr, and the progress mode: on a terminal (and without `-q`) progress
/// bars are installed and log lines are written above them; otherwise plain progress lines
/// are logged, so a log file stays readable.
fn init_logging(quiet: bool, verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},sled=warn,hyper=warn,reqwest=warn")));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    if spool::observe::bars::wanted(quiet) {
        spool::observe::bars::install();
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(spool::observe::bars::LogWriter)
        .with_ansi(ansi)
        .with_target(false)
        .init();
}

/// The config with this worker's partition worked out (flags, then the scheduler's
/// environment) and `{partition}` in `data_dir` replaced by its index.
fn load(cli: &Cli) -> Result<Config, Error> {
    let mut cfg = Config::load(&cli.config, &overrides(cli))?;
    cfg.partition = spool::cluster::partition::Partition::resolve(
        cli.partitions.or(cfg.run.partitions),
        cli.partition,
        |k| std::env::var(k).ok(),
    )?;
    if let Some(p) = cfg.partition {
        let dir = cfg
            .data_dir
            .to_string_lossy()
            .replace("{partition}", &p.index.to_string());
        cfg.data_dir = PathBuf::from(dir);
    }
    Ok(cfg)
}

/// The partition count of a cluster job's output, for the commands that read all
/// partitions: `None` for a one-machine output folder.
fn cluster_count(cli: &Cli, cfg: &Config) -> Result<Option<u32>, Error> {
    let count =
        spool::cluster::partition::Partition::count(cli.partitions.or(cfg.run.partitions), |k| {
            std::env::var(k).ok()
        })?;
    let url = spool::output::bucket::is_url(&cfg.output_dir.to_string_lossy());
    match count {
        Some(0) => Err(spool::cluster::partition::PartitionError::Zero.into()),
        Some(n) => Ok(Some(n)),
        None if url => Ok(Some(1)),
        None => Ok(None),
    }
}

fn overrides(cli: &Cli) -> Overrides {
    Overrides {
        data_dir: cli.data_dir.clone(),
        output_dir: cli.output_dir.clone(),
        concurrency: cli.concurrency,
        metrics_addr: cli.metrics_addr.clone(),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves on the first SIGINT/SIGTERM; a second one exits at once (resume stays exact:
/// nothing is acknowledged that is not durable).
async fn first_signal() {
    wait_signal().await;
    tokio::spawn(async {
        wait_signal().await;
        eprintln!("spool: second signal: exiting now");
        std::process::exit(i32::from(exit::INTERRUPTED));
    });
}

/// What the signal handler of [`remove_on_signal`] removes.
static ON_SIGNAL: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Removes what [`ON_SIGNAL`] holds and exits 130 on the first SIGINT or SIGTERM: a command
/// holding scratch or a temporary output leaves nothing behind when stopped (a normal end
/// removes them itself). Returns once the handler is in place, so a path is added to
/// [`ON_SIGNAL`] before the path exists.
fn remove_on_signal() {
    let (ready, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            let _ = ready.send(());
            return;
        };
        rt.block_on(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                let _ = ready.send(());
                return;
            };
            let _ = ready.send(());
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            let paths = ON_SIGNAL.lock().map(|p| p.clone()).unwrap_or_default();
            for p in &paths {
                let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
            }
            eprintln!("spool: interrupted; its scratch and temporary files are removed");
            std::process::exit(i32::from(exit::INTERRUPTED));
        });
    });
    let _ = wait.recv();
}

/// Adds `path` to what a signal removes ([`remove_on_signal`]).
fn remove_on_signal_too(path: PathBuf) {
    if let Ok(mut p) = ON_SIGNAL.lock() {
        p.push(path);
    }
}

/// A scratch folder made by `make`, added to what a signal removes with no moment between
/// (the handler waits for the list while the folder is made).
fn scratch_removed_on_signal(
    make: impl FnOnce() -> std::io::Result<spool::output::files::Scratch>,
) -> std::io::Result<spool::output::files::Scratch> {
    let mut paths = ON_SIGNAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = make()?;
    paths.push(scratch.to_path_buf());
    Ok(scratch)
}

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn real_main(cli: Cli) -> Result<u8, Error> {
    let knobs = spool::knobs::Knobs::from_env();
    match &cli.command {
        Command::Run => {
            let mut cfg = load(&cli)?;
            let rt = runtime()?;
            rt.block_on(spool::input::remote::fetch_inputs(&mut cfg))?;
            let summary = if spool::cluster::worker::is_cluster(&cfg) {
                rt.block_on(spool::cluster::worker::run(cfg, knobs, first_signal()))
            } else {
                rt.block_on(spool::run::job::run(cfg, knobs, first_signal()))
            };
            // A storage layer stuck after a disk error must not keep the process alive
            // (dropping the runtime would wait for its blocking tasks forever).
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
            let summary = summary?;
            if !summary.limited.is_empty() {
                eprintln!(
                    "spool: intake of {} stopped at an input limit (the log names the file and the limit); the other datasets ran",
                    summary.limited.join(", ")
                );
            }
            if summary.ending() == Some(spool::error::Kind::ItemsFailed) {
                let failed = summary.report.failed();
                eprintln!("spool: {failed} item(s) failed permanently; see `spool status` and `spool retry`");
            }
            Ok(summary.exit_code())
        }
        Command::Status { json, url } => {
            let report = match url {
                Some(url) => runtime()?.block_on(remote_status(url))?,
                None => {
                    let cfg = Config::load(&cli.config, &overrides(&cli))?;
                    if let Some(count) = cluster_count(&cli, &cfg)? {
                        let bucket = spool::cluster::worker::open_bucket(&cfg)?;
                        let datasets: Vec<_> = cfg
                            .datasets
                            .iter()
                            .map(|d| (d.name.clone(), d.token_budget))
                            .collect();
                        let st = runtime()?.block_on(spool::cluster::manifest::status(
                            &bucket, count, &datasets,
                        ))?;
                        if *json {
                            println!("{}", json_safe(serde_json::to_string_pretty(&st)?));
                        } else {
                            print!("{}", escape_except(&st.render_table(), &['\n']));
                        }
                        return Ok(exit::OK);
                    }
                    runtime()?.block_on(status_report(&cfg, &knobs.faults))?
                }
            };
            if *json {
                println!("{}", json_safe(serde_json::to_string_pretty(&report)?));
            } else {
                print!("{}", report.render_table());
            }
            Ok(exit::OK)
        }
        Command::Verify => {
            let cfg = Config::load(&cli.config, &overrides(&cli))?;
            if let Some(count) = cluster_count(&cli, &cfg)? {
                let bucket = spool::cluster::worker::open_bucket(&cfg)?;
                // Private, fresh, removed on every exit: shards are downloaded there.
                remove_on_signal();
                let scratch =
                    scratch_removed_on_signal(|| spool::output::files::Scratch::new("verify"))
                        .context("cannot make a scratch folder in $TMPDIR")?;
                let (manifest, problems) = runtime()?.block_on(
                    spool::cluster::manifest::verify(&bucket, count, scratch.path()),
                )?;
                drop(scratch);
                if let Some(m) = &manifest {
                    for (name, d) in &m.datasets {
                        println!(
                            "{name}: {} shards, {} items, {} rows, {} completion tokens{}",
                            d.shards.len(),
                            d.items,
                            d.rows,
                            d.completion_tokens,
                            d.budget.map_or(String::new(), |b| format!(" (budget {b})"))
                        );
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
        Command::Finalize { partial, json } => {
            let cfg = Config::load(&cli.config, &overrides(&cli))?;
            let count = cluster_count(&cli, &cfg)?.unwrap_or(1);
            let bucket = spool::cluster::worker::open_bucket(&cfg)?;
            let budgets = cfg
                .datasets
                .iter()
                .filter_map(|d| d.token_budget.map(|b| (d.name.clone(), b)))
                .collect();
            let manifest = runtime()?.block_on(spool::cluster::manifest::finalize(
                &bucket, count, &budgets, *partial,
            ))?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&manifest)?);
            } else {
                for (name, d) in &manifest.datasets {
                    println!(
                        "{name}: {} shards, {} items, {} rows, {} completion tokens",
                        d.shards.len(),
                        d.items,
                        d.rows,
                        d.completion_tokens
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
        Command::Retry { dataset } => {
            // A partition's queue: `--partition I` picks its data_dir.
            let cfg = load(&cli)?;
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
                if !queue.states().iter().any(|s| &s.name == d) {
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
        Command::Show { shard, rows, width } => {
            let all = spool::output::reader::read_rows(shard)?;
            for r in all.iter().take(*rows) {
                let mut v = serde_json::to_value(r)?;
                if *width > 0 {
                    shorten(&mut v, *width);
                }
                println!("{v}");
            }
            println!(
                "({} of {} rows in {})",
                all.len().min(*rows),
                all.len(),
                shard.display()
            );
            Ok(exit::OK)
        }
        Command::Export {
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
        } => {
            let mut cfg = Config::load(&cli.config, &overrides(&cli))?;
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
            };
            for (tmp, _) in spool::output::export::outputs(&opts) {
                remove_on_signal_too(tmp);
            }
            // A cluster job's output: the published shards, fetched (and checked against
            // the manifest) into a private scratch folder beside --out (its file system),
            // read like an output folder, removed on every exit.
            let mut scratch = None;
            if cluster_count(&cli, &cfg)?.is_some() {
                let bucket = spool::cluster::worker::open_bucket(&cfg)?;
                spool::output::files::create_dir_all(&parent, spool::output::files::DIR_MODE)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
                let dir = scratch_removed_on_signal(|| {
                    spool::output::files::Scratch::new_in(&parent, "export")
                })
                .with_context(|| format!("cannot make a scratch folder in {}", parent.display()))?;
                let wanted: Vec<String> = dataset.iter().cloned().collect();
                runtime()?.block_on(spool::cluster::manifest::download_published(
                    &bucket,
                    dir.path(),
                    &wanted,
                ))?;
                cfg.output_dir = dir.to_path_buf();
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
            let r = spool::output::export::export(&cfg, &opts).map_err(Error::runtime);
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
        Command::MockServer(mcfg) => {
            let mcfg = mcfg.clone();
            runtime()?.block_on(async move {
                let listener = spool::mock::bind(&mcfg.addr)
                    .await
                    .with_context(|| format!("cannot bind {}", mcfg.addr))?;
                let addr = listener.local_addr()?;
                println!("listening on http://{addr}");
                use std::io::Write;
                let _ = std::io::stdout().flush();
                spool::mock::serve(listener, mcfg, wait_signal())
                    .await
                    .map_err(Error::runtime)
            })?;
            Ok(exit::OK)
        }
    }
}

/// Cuts long strings and id lists so a row fits on a screen.
fn shorten(v: &mut serde_json::Value, width: usize) {
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
async fn remote_status(url: &str) -> Result<StatusReport, Error> {
    spool::observe::status::fetch(url, std::time::Duration::from_secs(10))
        .await
        .map_err(Error::msg)
}

/// The running process's `/status` when it answers and proves it owns the queue (the
/// token it wrote in `data_dir`), else the queue alone.
async fn status_report(cfg: &Config, faults: &spool::knobs::Faults) -> Result<StatusReport, Error> {
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
        Ok(q) => Ok(StatusReport::from_queue(&q, cfg)?),
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
