//! The `spool` binary: parses arguments, reads the test and benchmark switches once, calls
//! into the library and exits with the code of how the command ended
//! ([`spool::error::Kind`]); `cli/` holds a function per command. With `cli/`, the only place
//! that prints to stdout.

mod cli;

use clap::{Parser, Subcommand};
use cli::commands::{export, finalize, mock_server, retry, run, show, status, verify, Flags};
use spool::error::{exit_code, Error};
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
    /// Less output (warnings and errors only).
    #[arg(short = 'q', long, global = true)]
    quiet: bool,
    /// More output (debug; twice for trace).
    #[arg(short = 'v', long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// The job's config file, and the folders the command line may move.
#[derive(clap::Args, Debug, Clone)]
struct ConfigArgs {
    /// Config file.
    #[arg(short = 'c', long = "config", default_value = "spool.toml")]
    config: PathBuf,
    /// Override `data_dir`.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Override `output_dir`.
    #[arg(long)]
    output_dir: Option<PathBuf>,
}

/// A cluster job's partition count, for the commands that read every partition.
#[derive(clap::Args, Debug, Clone)]
struct PartitionsArg {
    /// Override `run.partitions`: the workers of a cluster job.
    #[arg(long, value_name = "N")]
    partitions: Option<u32>,
}

/// This worker's partition of a cluster job.
#[derive(clap::Args, Debug, Clone)]
struct PartitionArg {
    /// This worker's partition (else `JOB_COMPLETION_INDEX`, else `SLURM_ARRAY_TASK_ID`).
    #[arg(long, value_name = "I")]
    partition: Option<u32>,
}

/// Where a running process's endpoint is.
#[derive(clap::Args, Debug, Clone)]
struct MetricsArg {
    /// Override `run.metrics_addr` ("" disables the endpoint).
    #[arg(long)]
    metrics_addr: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Enqueue every dataset, drain the queue under the budgets, write shards.
    Run {
        #[command(flatten)]
        cfg: ConfigArgs,
        /// Override `run.concurrency` (a number, or "auto").
        #[arg(long)]
        concurrency: Option<spool::config::Concurrency>,
        #[command(flatten)]
        metrics: MetricsArg,
        /// Override `server.urls` (repeat for several): a Slurm task's own server port.
        #[arg(long = "server-url", value_name = "URL")]
        server_urls: Vec<String>,
        #[command(flatten)]
        partitions: PartitionsArg,
        #[command(flatten)]
        partition: PartitionArg,
        /// A cluster worker: change the job record where that is safe (a budget, a higher
        /// max_prompts, new input, a new dataset) instead of refusing the difference.
        #[arg(long)]
        reshape: bool,
    },
    /// A table per dataset from the queue (or the running process).
    Status {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[command(flatten)]
        metrics: MetricsArg,
        #[command(flatten)]
        partitions: PartitionsArg,
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
    Verify {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[command(flatten)]
        partitions: PartitionsArg,
    },
    /// Publish a cluster job's committed shards and write `_manifest.json` (run once every
    /// partition has finished: `afterok` in Slurm, a second Job in Kubernetes).
    Finalize {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[command(flatten)]
        partitions: PartitionsArg,
        /// Publish what is committed even if some partitions have not finished.
        #[arg(long)]
        partial: bool,
        /// Machine-readable output (the manifest).
        #[arg(long)]
        json: bool,
        /// Then delete the uploads under `_spool/*/shards/` (published shards' originals and
        /// orphans of killed uploads).
        #[arg(long)]
        gc: bool,
    },
    /// Move permanently failed items back to pending.
    Retry {
        #[command(flatten)]
        cfg: ConfigArgs,
        #[command(flatten)]
        partitions: PartitionsArg,
        #[command(flatten)]
        partition: PartitionArg,
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
        #[command(flatten)]
        cfg: ConfigArgs,
        #[command(flatten)]
        partitions: PartitionsArg,
        #[command(flatten)]
        export: ExportArgs,
    },
    /// A simulated inference server for demos, tests and benchmarks.
    MockServer(spool::mock::MockConfig),
}

/// What `spool export` writes, and which rows.
#[derive(clap::Args, Debug, Clone)]
struct ExportArgs {
    /// The output form (docs/export/ has an example row of each).
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
    /// The id a completion that ended its turn gets when the server named none: a token
    /// id or a token such as `<|im_end|>` (default: the model's, when spool can tell it).
    #[arg(long, value_name = "ID|TOKEN")]
    end_of_turn: Option<String>,
}

fn main() -> ExitCode {
    // Before any thread: what spool and its crates create is never more than 0640/0750.
    spool::output::files::restrict_umask();
    let cli = Cli::parse();
    // Builds made for tests only: the guide's command lines are checked to parse, not run.
    #[cfg(feature = "fault-injection")]
    if std::env::var_os("SPOOL_PARSE_ONLY").is_some() {
        return ExitCode::SUCCESS;
    }
    // Commands that report on stdout log only warnings unless asked (`-v`): their answer
    // is the output, not the queue's opening lines.
    let reporting = !matches!(
        cli.command,
        Command::Run { .. } | Command::Finalize { .. } | Command::MockServer(_)
    );
    init_logging(cli.quiet, cli.verbose, reporting);
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
fn init_logging(quiet: bool, verbose: u8, reporting: bool) {
    use tracing_subscriber::EnvFilter;
    let default = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) if reporting => "warn",
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

fn real_main(cli: Cli) -> Result<u8, Error> {
    let knobs = spool::knobs::Knobs::from_env();
    match &cli.command {
        Command::Run {
            cfg,
            concurrency,
            metrics,
            server_urls,
            partitions,
            partition,
            reshape,
        } => {
            let flags = Flags {
                concurrency: *concurrency,
                metrics_addr: metrics.metrics_addr.clone(),
                server_urls: server_urls.clone(),
                partition: partition.partition,
                ..Flags::of(cfg).with_partitions(partitions)
            };
            run(&flags, knobs, *reshape)
        }
        Command::Status {
            cfg,
            metrics,
            partitions,
            json,
            url,
        } => {
            let flags = Flags {
                metrics_addr: metrics.metrics_addr.clone(),
                ..Flags::of(cfg).with_partitions(partitions)
            };
            status(&flags, *json, url.as_deref(), &knobs)
        }
        Command::Verify { cfg, partitions } => {
            verify(&Flags::of(cfg).with_partitions(partitions), &knobs)
        }
        Command::Finalize {
            cfg,
            partitions,
            partial,
            json,
            gc,
        } => finalize(
            &Flags::of(cfg).with_partitions(partitions),
            *partial,
            *json,
            *gc,
        ),
        Command::Retry {
            cfg,
            partitions,
            partition,
            dataset,
        } => {
            let flags = Flags {
                partition: partition.partition,
                ..Flags::of(cfg).with_partitions(partitions)
            };
            retry(&flags, dataset.as_deref(), &knobs)
        }
        Command::Show { shard, rows, width } => show(shard, *rows, *width),
        Command::Export {
            cfg,
            partitions,
            export: args,
        } => export(&Flags::of(cfg).with_partitions(partitions), args, &knobs),
        Command::MockServer(mcfg) => mock_server(mcfg.clone()),
    }
}
