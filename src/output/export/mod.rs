//! `spool export`: the sealed shards in the forms drafter-training tools read as they are.
//!
//! One pass streams the rows of the chosen datasets (config order, shards in index order,
//! rows in shard order, one decoded batch at a time) through three steps:
//! 1. [`rows`]: each shard row becomes an [`ExportRow`]; a completion that ended its turn
//!    gets the model's end-of-turn id appended when the server left it out.
//! 2. [`gates`]: the quality gates keep, flag or drop it, and every row and item is counted
//!    in the [`Accounting`].
//! 3. a [`Sink`] per format writes the kept rows.
//!
//! Invariants:
//! - Memory does not grow with the number of rows: a sink holds at most one item's rows
//!   (an item's rows are contiguous in its shard) or a fixed-size table.
//! - The output appears under `--out` only complete: it is written under a hidden
//!   temporary name beside it (a file, or a folder for `hf`), synced, then renamed, and the
//!   folder holding it synced; its summary likewise.
//! - An export replaces only what an export wrote: a folder at `--out` that is not an
//!   earlier `hf` export (nor empty) is refused ([`claim_out`]), or moved aside when asked.
//! - Only sealed `part-*.parquet` files are read, so an export may run while `run` works.
//! - `kept + dropped = rows read`, and at the item level the queue's own counts are
//!   checked against what the shards hold (see [`gates::Accounting::check`]).
//! - With `--holdout`, every row of an item goes to the same side, chosen by a hash of
//!   (dataset, id) alone, so every form and every later export split alike.
//! - In every id export a completion that ended its turn (`stop`, `tool_calls`) ends with
//!   exactly one end-of-turn id, and one cut by `max_tokens` has none.

pub mod batch;
pub mod charts;
pub mod error;
pub mod gates;
pub mod hf;
pub mod holdout;
pub mod npy;
pub mod report;
pub mod rows;
pub mod sharegpt;
pub mod specforge;
pub mod speculators;
pub mod stats;
pub mod tokens;
pub mod vocab;

pub use gates::{Accounting, Gates, ThinkGate};
pub use rows::{EndOfTurn, ExportRow, TurnEnds};

use crate::config::Config;
use crate::output::export::error::{Context, ExportError, Result};
use crate::prompt::tokenizer::Tokenizer;
use crate::store::report::StatusReport;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The output form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// JSONL `{id, dataset, sample, turn, conversations}` (ShareGPT turns).
    Sharegpt,
    /// Parquet `{id, dataset, sample, turn, input_ids, loss_mask, finish_reason}`.
    Tokens,
    /// The `tokens` rows as JSONL.
    TokensJsonl,
    /// JSONL `{id, input_ids, loss_mask}` for SpecForge's pre-tokenized path.
    Specforge,
    /// JSONL `{id, conversations, tools}` for SpecForge to render with its template.
    SpecforgeChat,
    /// JSONL, one row per generation in vllm-project/speculators' shape.
    Speculators,
    /// Counts of every completion token id (safetensors).
    TokenFreq,
    /// The `d2t`/`t2d` mapping of an N-token draft vocabulary (safetensors).
    DraftVocab,
    /// OpenAI batch output JSONL (`{id, custom_id, response, error}`).
    OpenaiBatch,
    /// A folder HuggingFace `datasets` loads as a `DatasetDict`, with a dataset card.
    Hf,
    /// One HTML page of counts and histograms: what was generated, at a glance.
    Report,
}

impl Format {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Format::Sharegpt => "sharegpt",
            Format::Tokens => "tokens",
            Format::TokensJsonl => "tokens-jsonl",
            Format::Specforge => "specforge",
            Format::SpecforgeChat => "specforge-chat",
            Format::Speculators => "speculators",
            Format::TokenFreq => "token-freq",
            Format::DraftVocab => "draft-vocab",
            Format::OpenaiBatch => "openai-batch",
            Format::Hf => "hf",
            Format::Report => "report",
        }
    }

    /// Whether the form writes token ids (`hf` keeps rows without them too), so a
    /// completion's end of turn matters in it.
    pub fn writes_ids(self) -> bool {
        self.needs_ids() || self == Format::Hf
    }

    /// Whether the form is made of token ids, so rows without ids cannot be in it.
    pub fn needs_ids(self) -> bool {
        matches!(
            self,
            Format::Tokens
                | Format::TokensJsonl
                | Format::Specforge
                | Format::Speculators
                | Format::TokenFreq
                | Format::DraftVocab
        )
    }
}

/// What the user asked of one export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub format: Format,
    pub out: PathBuf,
    /// Only this dataset (default: every dataset of the config).
    pub dataset: Option<String>,
    /// `specforge-chat`: one row per assistant turn (SpecForge's expanded rows).
    pub per_turn: bool,
    /// `draft-vocab`: the draft vocabulary's size.
    pub draft_vocab: Option<usize>,
    /// `token-freq`/`draft-vocab`: the target model's vocabulary size (default: `vocab_size`
    /// of the `config.json` beside the tokenizer).
    pub target_vocab: Option<usize>,
    /// Hold out this fraction of each dataset's items for evaluation ([`holdout`]).
    pub holdout: Option<f64>,
    pub gates: Gates,
    /// The queue's counts (from the running process or the queue), for the item-level
    /// accounting; None when neither answers.
    pub status: Option<StatusReport>,
    /// `--end-of-turn ID|TOKEN`: the id a turn that ended without one gets, when the server
    /// named none (default: the model's, when spool can tell it).
    pub end_of_turn: Option<String>,
    /// The folder the shards are read from in place of `output_dir` (a cluster job's
    /// published shards, downloaded).
    pub shards: Option<PathBuf>,
}

impl ExportOptions {
    /// `format` to `out` with every dataset, the default gates and nothing else set: what
    /// the CLI does without flags.
    pub fn new(format: Format, out: impl Into<PathBuf>) -> Self {
        ExportOptions {
            format,
            out: out.into(),
            dataset: None,
            per_turn: false,
            draft_vocab: None,
            target_vocab: None,
            holdout: None,
            gates: Gates::default(),
            status: None,
            end_of_turn: None,
            shards: None,
        }
    }

    /// The folder the shards are read from.
    pub fn shards_dir<'a>(&'a self, cfg: &'a Config) -> &'a Path {
        self.shards.as_deref().unwrap_or(&cfg.output_dir)
    }
}

/// What every sink may need besides the rows.
#[derive(Debug, Clone)]
pub struct ExportContext {
    /// The config's tokenizer, when it has one.
    pub tokenizer: Option<Tokenizer>,
    /// How the model ends a turn (the id appended to completions that ended theirs).
    pub end_of_turn: Option<TurnEnds>,
    /// The datasets exported, in order.
    pub datasets: Vec<String>,
    /// The config's queue folder (`openai-batch` reads the failed items there).
    pub data_dir: PathBuf,
    /// The config's shard folder (`openai-batch` reads each dataset's `_rejected.jsonl`).
    pub output_dir: PathBuf,
    /// Each exported dataset's sampling as its config says (defaults with its overrides),
    /// for formats that record what generated a row.
    pub sampling: std::collections::BTreeMap<String, crate::config::Sampling>,
    /// `server.model`, for formats that name the model (`hf`'s card).
    pub model: String,
    /// Per dataset of `datasets`, what was asked of the server (sampling and generation
    /// keys, as JSON), for formats that document it.
    pub generation: Vec<serde_json::Value>,
}

/// Writes the kept rows of one export in its format.
pub trait Sink {
    /// Called before the first row of each dataset (also for a dataset without rows).
    fn begin_dataset(&mut self, _name: &str) -> Result<()> {
        Ok(())
    }
    /// One kept row, in dataset, shard and row order; an item's rows come together.
    fn push(&mut self, row: &ExportRow) -> Result<()>;
    /// Writes what is left and syncs it; the accounting is complete by now.
    fn finish(self: Box<Self>, accounting: &Accounting) -> Result<()>;
}

/// What an export wrote.
#[derive(Debug, Clone, Default)]
pub struct ExportReport {
    pub shards: u64,
    pub accounting: Accounting,
}

/// A buffered JSONL file: one `serde_json` value per line, synced on `finish`.
pub struct Jsonl {
    w: BufWriter<File>,
}

impl Jsonl {
    pub fn create(path: &Path) -> Result<Self> {
        let file = crate::output::files::replace(path, crate::output::files::FILE_MODE)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self {
            w: BufWriter::with_capacity(1 << 20, file),
        })
    }

    pub fn line(&mut self, v: &impl serde::Serialize) -> Result<()> {
        serde_json::to_writer(&mut self.w, v)?;
        self.w.write_all(b"\n")?;
        Ok(())
    }

    pub fn finish(self) -> Result<()> {
        let file = self.w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(())
    }
}

/// Writes `bytes` as the file at `path` (a new file, or one replaced) and syncs it; errors
/// name the file.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = crate::output::files::replace(path, crate::output::files::FILE_MODE)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Why `--out` cannot be written as asked: the user's to settle.
#[derive(Debug, thiserror::Error)]
pub enum OutError {
    #[error("--out {}: a folder holding files that are not a spool `hf` export; export to a new or empty folder, or pass --force to move it aside", path.display())]
    NotAnExport { path: PathBuf },
    #[error("--out {}: a folder, and --format {format} writes a file; name a file, or pass --force to move the folder aside", path.display())]
    Folder { path: PathBuf, format: &'static str },
    #[error("--out {}: not a folder, and --format hf writes one; name a folder, or pass --force to move it aside", path.display())]
    NotAFolder { path: PathBuf },
    #[error("cannot move {} aside: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Whether `dir` holds nothing but an earlier `hf` export (its card, Parquet files and
/// pictures), or nothing at all: what an export may replace.
pub fn is_spool_export(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    for e in entries {
        let Ok(e) = e else { return false };
        let Ok(kind) = e.file_type() else {
            return false;
        };
        let name = e.file_name();
        let ok = match name.to_str() {
            Some("README.md") if kind.is_file() => {
                std::fs::metadata(e.path()).is_ok_and(|m| m.len() < 64 << 20)
                    && std::fs::read_to_string(e.path())
                        .is_ok_and(|card| card.contains(hf::CARD_MARK))
            }
            Some(dir @ ("data" | "images")) if kind.is_dir() => {
                let ext = if dir == "data" { ".parquet" } else { ".svg" };
                std::fs::read_dir(e.path()).is_ok_and(|files| {
                    files.into_iter().all(|f| {
                        f.is_ok_and(|f| {
                            f.file_type().is_ok_and(|t| t.is_file())
                                && f.file_name().to_string_lossy().ends_with(ext)
                        })
                    })
                })
            }
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
}

/// Makes `out` ready for an export in `format`: nothing to do when it is absent, a file
/// (for a file format), or an earlier `hf` export or empty folder (for `hf`; replaced once
/// the new export is complete). Anything else is refused, or with `force` moved aside to
/// `<out>.old-<unix seconds>`, which is returned.
pub fn claim_out(out: &Path, format: Format, force: bool) -> Result<Option<PathBuf>, OutError> {
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return Ok(None);
    };
    let refused = match (format, meta.is_dir()) {
        (Format::Hf, true) if is_spool_export(out) => return Ok(None),
        (Format::Hf, true) => OutError::NotAnExport { path: out.into() },
        (Format::Hf, false) => OutError::NotAFolder { path: out.into() },
        (_, true) => OutError::Folder {
            path: out.into(),
            format: format.name(),
        },
        (_, false) => return Ok(None),
    };
    if !force {
        return Err(refused);
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    let mut aside = out.with_file_name(format!("{name}.old-{secs}"));
    let mut n = 2;
    while std::fs::symlink_metadata(&aside).is_ok() {
        aside = out.with_file_name(format!("{name}.old-{secs}-{n}"));
        n += 1;
    }
    std::fs::rename(out, &aside)
        .and_then(|()| crate::store::blocks::sync_parent(out))
        .map_err(|source| OutError::Io {
            path: out.into(),
            source,
        })?;
    Ok(Some(aside))
}

/// Where the output goes while it is written.
pub fn temp_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.tmp"))
}

/// Where the JSON summary of an export goes: beside the output.
pub fn summary_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    out.with_file_name(format!("{name}.summary.json"))
}

fn open_sink(
    opts: &ExportOptions,
    ctx: &ExportContext,
    tmp: &Path,
    holdout: Option<holdout::Holdout>,
) -> Result<Box<dyn Sink>> {
    let one = |tmp: &Path| -> Result<Box<dyn Sink>> {
        Ok(match opts.format {
            Format::Sharegpt => Box::new(sharegpt::ShareGptSink::create(tmp)?),
            Format::Tokens => Box::new(tokens::TokensSink::parquet(tmp)?),
            Format::TokensJsonl => Box::new(tokens::TokensSink::jsonl(tmp)?),
            Format::Specforge => specforge::ids_sink(tmp)?,
            Format::SpecforgeChat => specforge::chat_sink(tmp, opts.per_turn)?,
            Format::Speculators => speculators::sink(tmp, ctx)?,
            Format::TokenFreq => vocab::token_freq_sink(tmp, ctx, opts.target_vocab)?,
            Format::DraftVocab => {
                let Some(n) = opts.draft_vocab else {
                    return Err(ExportError::usage(
                        "--format draft-vocab needs --draft-vocab N (the draft vocabulary's size)",
                    ));
                };
                vocab::draft_vocab_sink(tmp, &opts.out, ctx, n, opts.target_vocab)?
            }
            Format::OpenaiBatch => batch::output_sink(tmp, ctx)?,
            Format::Hf => hf::sink(tmp, ctx, holdout)?,
            Format::Report => report::sink(tmp, ctx, holdout)?,
        })
    };
    let train = one(tmp)?;
    let Some(h) = holdout else {
        return Ok(train);
    };
    let eval: Box<dyn Sink> = match opts.format {
        // Both split inside their own output.
        Format::Hf | Format::Report => return Ok(train),
        // A draft vocabulary comes from the training rows alone.
        Format::DraftVocab => Box::new(holdout::Discard),
        _ => one(&temp_path(&holdout::eval_path(&opts.out)))?,
    };
    Ok(Box::new(holdout::SplitSink {
        holdout: h,
        train,
        eval,
    }))
}

/// Every (temporary, final) path an export in `opts` writes besides its summary: the
/// output, the eval file with `--holdout`, and the `.npy` files of `draft-vocab`. The
/// temporary ones are removed if the export stops before its end.
pub fn outputs(opts: &ExportOptions) -> Vec<(PathBuf, PathBuf)> {
    let mut v = vec![opts.out.clone()];
    let splits_inside = matches!(
        opts.format,
        Format::Hf | Format::Report | Format::DraftVocab
    );
    if opts.holdout.is_some() && !splits_inside {
        v.push(holdout::eval_path(&opts.out));
    }
    if let (Format::DraftVocab, Some(n)) = (opts.format, opts.draft_vocab) {
        v.extend(vocab::npy_paths(&opts.out, n));
    }
    v.into_iter().map(|p| (temp_path(&p), p)).collect()
}

/// What a run needs for its rows to carry token ids, naming the key its config lacks.
fn ids_key(cfg: &Config) -> &'static str {
    match &cfg.tokenizer {
        None => "the run had no [tokenizer]: set [tokenizer] path and run again",
        Some(t)
            if cfg.server.api == crate::config::Api::Chat
                && t.chat_template.is_none()
                && !t.path.is_dir() =>
        {
            "with api = \"chat\" spool makes prompt ids only by rendering the messages: set [tokenizer] chat_template and run again"
        }
        Some(_) => "the rows were generated without [tokenizer]: run them again with it",
    }
}

/// Writes the sealed shards of `cfg`'s datasets to `opts.out` in `opts.format`.
pub fn export(cfg: &Config, opts: &ExportOptions) -> Result<ExportReport> {
    let names: Vec<String> = cfg
        .datasets
        .iter()
        .map(|d| d.name.clone())
        .filter(|n| opts.dataset.as_deref().is_none_or(|d| d == n))
        .collect();
    if let Some(d) = &opts.dataset {
        if names.is_empty() {
            return Err(ExportError::usage(crate::config::ConfigError::Invalid {
                path: cfg.source.clone(),
                key: "--dataset".into(),
                detail: format!("no dataset `{d}` in the config"),
            }));
        }
    }
    let ctx = rows::context(
        cfg,
        opts.shards_dir(cfg),
        names.clone(),
        opts.end_of_turn.as_deref(),
    )?;
    let out = &opts.out;
    if let Some(dir) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        crate::output::files::create_dir_all(dir, crate::output::files::DIR_MODE)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let holdout = opts.holdout.map(holdout::Holdout::new).transpose()?;
    let files = outputs(opts);
    for (tmp, path) in &files {
        // Beside a folder export only files go; a file export's eval file and .npy files
        // are files too.
        let format = if path == out {
            opts.format
        } else {
            Format::Sharegpt
        };
        claim_out(path, format, false)?;
        remove_path(tmp)?;
    }
    let tmp = temp_path(out);
    let remove_temps = || {
        for (t, _) in &files {
            let _ = remove_path(t);
        }
    };
    let res = (|| {
        let mut sink = open_sink(opts, &ctx, &tmp, holdout)?;
        let mut acc = Accounting::new(opts.format, &opts.gates);
        let mut shards = 0;
        for name in &names {
            sink.begin_dataset(name)?;
            acc.begin_dataset(name);
            for shard in rows::shards_of(opts.shards_dir(cfg), name)? {
                shards += 1;
                let ending = rows::Ending {
                    ends: ctx
                        .end_of_turn
                        .as_ref()
                        .filter(|_| opts.format.writes_ids()),
                    stop_strings: ctx
                        .sampling
                        .get(name)
                        .and_then(|s| s.stop.as_ref())
                        .is_some_and(|v| !v.is_empty()),
                };
                rows::for_each_row(&shard, ending, |row| {
                    match acc.judge(&opts.gates, opts.format, row) {
                        Some(row) => {
                            if holdout.is_some_and(|h| h.holds(&row)) {
                                acc.hold_out(&row);
                            }
                            sink.push(&row)
                        }
                        None => Ok(()),
                    }
                })?;
            }
            acc.end_dataset(opts.status.as_ref());
        }
        acc.finish()?;
        let without_ids: u64 = acc
            .datasets
            .iter()
            .filter_map(|d| d.dropped.get("no_token_ids"))
            .sum();
        if opts.format.needs_ids() && acc.kept() == 0 && without_ids > 0 {
            return Err(ExportError::usage(format!(
                "none of the {without_ids} completed rows has token ids: a `{}` export needs them ({})",
                opts.format.name(),
                ids_key(cfg)
            )));
        }
        sink.finish(&acc)?;
        Ok(ExportReport {
            shards,
            accounting: acc,
        })
    })();
    let mut report = match res {
        Ok(r) => r,
        Err(e) => {
            remove_temps();
            return Err(e);
        }
    };
    report.accounting.holdout = holdout.map(|h| h.fraction());
    if opts.format == Format::Hf && out.is_dir() {
        // A folder cannot be renamed over a non-empty one: the old export goes first, and
        // only an export (checked again: it may have changed while this one ran).
        if let Err(e) = claim_out(out, opts.format, false) {
            remove_temps();
            return Err(e.into());
        }
        std::fs::remove_dir_all(out)
            .with_context(|| format!("cannot replace {}", out.display()))?;
    }
    for (tmp, path) in &files {
        std::fs::rename(tmp, path)
            .and_then(|()| crate::store::blocks::sync_parent(path))
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    }
    let summary = summary_path(out);
    crate::output::files::write_durably(&summary, report.accounting.summary_json(out)?.as_bytes())
        .with_context(|| format!("cannot write {}", summary.display()))?;
    Ok(report)
}

/// Removes a leftover temporary file or folder.
fn remove_path(p: &Path) -> Result<()> {
    let r = if p.is_dir() {
        std::fs::remove_dir_all(p)
    } else {
        std::fs::remove_file(p)
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", p.display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The export is written under a hidden temporary name beside `--out`, and its summary
    /// beside it.
    #[test]
    fn temp_file_is_hidden_next_to_the_output() {
        assert_eq!(
            temp_path(Path::new("/x/y.parquet")),
            Path::new("/x/.y.parquet.tmp")
        );
        assert_eq!(
            summary_path(Path::new("/x/y.jsonl")),
            Path::new("/x/y.jsonl.summary.json")
        );
    }
}
