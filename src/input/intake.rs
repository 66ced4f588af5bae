//! A dataset file taken in, idempotently: new rows parsed, rendered, tokenized and handed
//! to an [`IntakeSink`] in batches; rows taken in by an earlier run only checked.
//!
//! Lines already taken in are only checked (same content hash, or the run refuses); lines
//! after them are parsed, rendered, tokenized and handed on; bad rows, duplicate ids and
//! prompts that leave no room for generation in the server's context are rejected.
//!
//! Parallelism: one reader thread cuts the file into chunks of raw rows; `threads` workers
//! parse, render, tokenize and encode whole chunks; this thread puts the chunks back in file
//! order and does everything that must be sequential (duplicate ids, `max_prompts`, the
//! sink's batches). Channels between the stages are bounded, and so are the bytes of raw
//! rows between the reader and the sequential stage (`IN_FLIGHT_BYTES`) and of a batch
//! (`BATCH_BYTES`), so memory does not depend on the file's size nor on its rows' sizes
//! (each at most `limits::MAX_ROW_BYTES`).
//!
//! With `[tokenizer] source = "server"` ([`IntakeOptions::server`]) the workers ask the
//! server to render instead: each chunk's new rows are sent to its rendering endpoint
//! (several requests in flight per worker) and the server's text and ids are what is
//! enqueued, so the queue keeps the exact ids sent and a restart never asks again. The
//! cost is the server's tokenizer throughput (one or two requests per row) before the
//! first generation; a server that cannot be reached stops intake (nothing is rejected
//! for it, the next run resumes), one that refuses a row rejects that row.
//!
//! Invariants: a batch of items and the scan position that covers them are one
//! [`IntakeSink::commit`], so a crash mid-intake resumes at the first line not taken in;
//! the outcome (items, ids, rejections, their order) is the same as a sequential pass,
//! whatever the thread count; no prompt is handed on twice. The sink is where the items
//! go (the queue, for a run), so this stage does not know the queue's types.
//!
//! `render` fixes how a dataset's rows become prompts, `pipeline` runs the reader and
//! worker stages, `prepare` is a worker's job on one chunk, `collector` the sequential
//! stage, `sample` the rows the start-up template check compares.
mod collector;
mod pipeline;
mod prepare;
mod render;
mod sample;

pub use sample::{sample_rows, SampledRow, CHECK_ROWS, CHECK_SCAN};

use collector::Collector;
use pipeline::{read_chunks, work_chunks, InFlight, PreparedChunk, RawChunk};
use render::stage;

use crate::config::partition::Partition;
use crate::config::{DatasetConfig, GenerationSpec};
use crate::input::dataset::{DatasetError, DatasetReader, PrefixMark};
use crate::input::dedup::SpillError;
use crate::input::limits::LimitError;
use crate::input::row::{Rejection, Row};
use crate::prompt::remote::{IdsSource, RemoteRenderer};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Rows per batch handed to the sink ...
const BATCH: usize = 1024;
/// ... or fewer, once the batch's rows were this many bytes of input.
const BATCH_BYTES: usize = 32 << 20;
/// Bytes of raw rows read and not yet taken in by the sequential stage, at most (one
/// chunk more when a single chunk is larger): with the batch, what intake holds.
const IN_FLIGHT_BYTES: usize = 64 << 20;
/// Rows per chunk handed to a worker ...
const CHUNK_ROWS: usize = 256;
/// ... or fewer, once the chunk holds this many bytes of raw lines.
const CHUNK_BYTES: usize = 4 << 20;

/// Why intake stopped.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The sink (the queue, or the rejected-rows file) failed.
    #[error(transparent)]
    Sink(SinkError),
    #[error(transparent)]
    Spill(#[from] SpillError),
    #[error("{path}: line {line} changed since it was enqueued (id `{id}`); spool will not mix two versions of a dataset. Restore the file, or use a new dataset name or data_dir")]
    Changed {
        path: PathBuf,
        line: u64,
        id: String,
    },
    #[error("{path}: the file has {lines} lines but {scanned} were enqueued before; it was truncated or replaced")]
    Shrunk {
        path: PathBuf,
        lines: u64,
        scanned: u64,
    },
    /// The sink holds no progress for the dataset: it was never opened there.
    #[error("dataset `{0}` is not opened in the queue")]
    NotOpened(String),
    #[error("a prompt worker thread panicked")]
    Panicked,
    /// The dataset's generation keys cannot be used (the config check refuses them first).
    #[error("dataset `{dataset}`: {detail}")]
    Generation { dataset: String, detail: String },
    /// No server answered the rendering requests (`source = "server"`); what was taken in
    /// is kept and the next run resumes.
    #[error("dataset `{dataset}`: the server could not render prompts: {detail}")]
    Render { dataset: String, detail: String },
}

/// What one intake pass did.
#[derive(Debug, Clone, Default)]
pub struct IntakeReport {
    pub added: u64,
    pub rejected: u64,
    pub lines: u64,
    /// Rejected because prompt tokens + 1 exceed the context length.
    pub over_context: u64,
    /// Added, but prompt tokens + `max_tokens` exceed the context length.
    pub short_of_room: u64,
    /// Prompt tokens of the rows added (0 without a tokenizer).
    pub prompt_tokens: u64,
    /// Wall time of the pass.
    pub seconds: f64,
    /// Lines skipped unparsed: an unchanged prefix, by its fingerprint ([`PrefixMark`]).
    pub skipped_lines: u64,
    /// Rows another partition owns (not taken in here).
    pub elsewhere: u64,
    /// Rows this partition owns that are already committed to the object store by an
    /// earlier or concurrent worker (not taken in again).
    pub committed: u64,
    /// The first row rejected this pass (`file line N: reason`): when every row is
    /// rejected, usually for one configuration reason, the run names it.
    pub first_rejection: Option<String>,
}

/// How intake builds prompts.
#[derive(Debug, Clone, Default)]
pub struct IntakeOptions {
    /// The server applies the chat template (`api = "chat"`), so messages need no local
    /// template; without one, the `prompt` column holds the messages as JSON.
    pub server_templates: bool,
    /// The server's context length: a prompt of this many tokens or more is rejected.
    pub context_length: Option<u32>,
    /// The dataset's `max_tokens`, to count prompts that leave less room than that.
    pub max_tokens: u32,
    /// Worker threads for parsing, rendering and tokenizing; 0 = one per core.
    pub threads: usize,
    /// The dataset's generation keys ([`crate::config::Config::generation_of`]): with
    /// `turns = "all"` an item keeps its whole conversation and its prompt is turn 0's
    /// request; prompts are rendered with its fixed template variables.
    pub generation: GenerationSpec,
    /// In a partitioned job: which rows this worker takes in.
    pub filter: Option<ItemFilter>,
    /// `[tokenizer] source = "server"`: the server renders prompts instead of `builder`.
    pub server: Option<Arc<dyn RemoteRenderer>>,
    /// The file read in place of the dataset's `path`: the local copy of an object-store
    /// input (the run's plan).
    pub file: Option<PathBuf>,
}

impl IntakeOptions {
    /// The file dataset `d` is read from.
    pub fn file_of<'a>(&'a self, d: &'a DatasetConfig) -> &'a Path {
        self.file.as_deref().unwrap_or(&d.path)
    }
}

/// Which rows of a dataset one partition takes in: those it owns
/// ([`Partition::owns`]) and no one has committed yet. A bad row without a usable id is
/// reported by exactly one partition, the owner of its line number.
#[derive(Debug, Clone)]
pub struct ItemFilter {
    pub partition: Partition,
    /// Ids of the dataset already committed to the object store (by any worker).
    pub committed: Arc<std::collections::HashSet<String>>,
}

impl ItemFilter {
    fn owns_line(&self, dataset: &str, line: u64) -> bool {
        self.partition.owns(dataset, &format!("\0line {line}"))
    }
}

/// An error of the sink, kept whole for the run's error chain.
pub type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// What intake knows of a dataset from earlier runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Lines of the file taken in (items and rejections) so far.
    pub scanned_lines: u64,
    /// Items taken in so far.
    pub items: u64,
    /// The fingerprint of a prefix of the file holding only lines taken in.
    pub mark: Option<PrefixMark>,
}

/// Where intake puts what it takes in, and what it asks about earlier runs: for a run,
/// the queue and the dataset's rejected-rows file. Defined here, implemented where the
/// queue is known, so the input stage does not depend on the store.
///
/// Invariant an implementation keeps: [`IntakeSink::commit`] makes every rejection handed
/// to it so far durable before it records the batch that counts them, so a row counted
/// rejected is durably in the rejected-rows file.
pub trait IntakeSink {
    /// A new item as the sink stores it, encoded on the worker threads.
    type Item: Send;

    /// Encodes a new row, its prompt and who made the prompt's ids (called on the worker
    /// threads, hence no `self`).
    fn encode(row: &Row, prompt: BuiltPrompt, ids: Option<IdsSource>) -> Self::Item;

    /// The dataset's progress; `None` when the sink does not know the dataset.
    fn progress(&self) -> Option<Progress>;

    /// Where the duplicate-id set may spill its runs.
    fn id_spill_path(&self) -> PathBuf;

    /// Calls `f` with each id taken in by earlier runs and its row.
    fn for_each_id(&self, f: &mut dyn FnMut(&[u8], u64)) -> Result<(), SinkError>;

    /// The id of the item taken in at `row`, if any.
    fn item_id(&self, row: u64) -> Result<Option<String>, SinkError>;

    /// The id and content hash of the item taken in at `row`, if any.
    fn item_hash(&self, row: u64) -> Result<Option<(String, [u8; 16])>, SinkError>;

    /// Keeps a rejected row (buffered; made durable by the next commit).
    fn reject(&mut self, r: &Rejection) -> Result<(), SinkError>;

    /// Makes the rejections so far durable, then records `items`, `rejected` rejections
    /// and the scan position (`scanned_lines`, `mark`) as one batch.
    fn commit(
        &mut self,
        items: &[Self::Item],
        scanned_lines: u64,
        rejected: u64,
        mark: Option<PrefixMark>,
    ) -> Result<(), SinkError>;

    /// Makes everything committed durable.
    fn flush(&mut self) -> Result<(), SinkError>;

    /// The rejected-rows file, as named in the log.
    fn rejects_path(&self) -> &Path;
}

/// Takes in new rows of `d` into `sink` and checks the old ones.
pub fn intake<S: IntakeSink>(
    sink: &mut S,
    d: &DatasetConfig,
    builder: &PromptBuilder,
    opts: &IntakeOptions,
) -> Result<IntakeReport, IntakeError> {
    let state = sink
        .progress()
        .ok_or_else(|| IntakeError::NotOpened(d.name.clone()))?;
    let mut reader = DatasetReader::open(opts.file_of(d), &d.name)?;
    let (parser, render) = stage(&reader, d, opts, builder)?;
    let render = &render;
    // Restart fast path: an unchanged prefix (same bytes, by fingerprint) holds only rows
    // already taken in, so it is hashed, not parsed and checked row by row.
    let mut skipped = None;
    if let Some(m) = state.mark.filter(|m| m.lines <= state.scanned_lines) {
        let t = Instant::now();
        if reader.skip_prefix(&m)? {
            tracing::info!(dataset = %d.name, lines = m.lines, bytes = m.bytes,
                seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
                "input prefix unchanged (fingerprint): its rows are not checked again");
            skipped = Some(m);
        } else {
            tracing::info!(dataset = %d.name, lines = m.lines,
                "input prefix changed or shorter than its fingerprint: checking every row");
        }
    }
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut collector = Collector::new(sink, d, opts, state, skipped);
    let stop = AtomicBool::new(false);
    let in_flight = InFlight::default();
    let scanned = state.scanned_lines;
    let (read_res, collect_res) = std::thread::scope(|s| {
        let (job_tx, job_rx) = sync_channel::<RawChunk>(threads * 2);
        let (done_tx, done_rx) = sync_channel::<PreparedChunk<S::Item>>(threads * 2);
        let stop = &stop;
        let in_flight = &in_flight;
        let reader = s.spawn(move || read_chunks(reader, job_tx, stop, in_flight));
        let jobs = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::with_capacity(threads);
        for _ in 0..threads {
            let (jobs, out, parser) = (jobs.clone(), done_tx.clone(), parser.clone());
            workers.push(s.spawn(move || {
                work_chunks(&jobs, out, &parser, builder, S::encode, render, scanned)
            }));
        }
        drop((jobs, done_tx));
        let collected = collector.collect(done_rx, in_flight);
        // Whatever happened, let the other stages wind down (their sends fail).
        stop.store(true, Ordering::Relaxed);
        let panicked = workers.into_iter().any(|w| w.join().is_err());
        let read = reader
            .join()
            .map_err(|_| IntakeError::Panicked)
            .and_then(|r| r.map_err(IntakeError::from));
        let collected = if panicked {
            Err(IntakeError::Panicked)
        } else {
            collected
        };
        (read, collected)
    });
    let stopped_early = collect_res?;
    if let (false, Err(IntakeError::Dataset(DatasetError::Limit(e)))) =
        (stopped_early, read_res.as_ref())
    {
        let e = LimitError {
            path: e.path.clone(),
            what: e.what.clone(),
        };
        // Every row before the limit was taken in (the reader stopped there): keep them
        // and their rejections, then stop this dataset.
        collector.keep_before_limit()?;
        return Err(IntakeError::Dataset(DatasetError::Limit(e)));
    }
    read_res?;
    collector.finish(stopped_early)
}

/// Logs what the context limit did to a dataset's new rows (once per dataset and run).
pub fn log_context_report(
    name: &str,
    rep: &IntakeReport,
    context_length: Option<u32>,
    opts: &IntakeOptions,
    clamp: bool,
) {
    let Some(ctx) = context_length else { return };
    if rep.over_context > 0 {
        tracing::warn!(dataset = %name, rejected = rep.over_context, context_length = ctx,
            "prompts too long for the server's context were rejected (see _rejected.jsonl)");
    }
    if rep.short_of_room > 0 {
        if clamp {
            tracing::info!(dataset = %name, prompts = rep.short_of_room, max_tokens = opts.max_tokens, context_length = ctx,
                "prompts whose max_tokens will be clamped to what the context leaves");
        } else {
            tracing::warn!(dataset = %name, prompts = rep.short_of_room, max_tokens = opts.max_tokens, context_length = ctx,
                "prompts leave less than max_tokens of the context: a server may refuse them (vLLM does); set server.clamp_max_tokens = true to clamp");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::remote::RenderInput;

    /// A sink in memory: what intake hands on, with no queue behind it.
    #[derive(Default)]
    struct Memory {
        dir: PathBuf,
        progress: Progress,
        items: Vec<(u64, String, [u8; 16], String)>,
        pending: Vec<Rejection>,
        rejected: Vec<Rejection>,
        commits: Vec<(usize, u64, u64)>,
    }

    impl IntakeSink for Memory {
        type Item = (u64, String, [u8; 16], String);

        fn encode(row: &Row, prompt: BuiltPrompt, _: Option<IdsSource>) -> Self::Item {
            (row.row, row.id.clone(), row.hash, prompt.text)
        }
        fn progress(&self) -> Option<Progress> {
            Some(self.progress)
        }
        fn id_spill_path(&self) -> PathBuf {
            self.dir.join("ids")
        }
        fn for_each_id(&self, f: &mut dyn FnMut(&[u8], u64)) -> Result<(), SinkError> {
            self.items.iter().for_each(|i| f(i.1.as_bytes(), i.0));
            Ok(())
        }
        fn item_id(&self, row: u64) -> Result<Option<String>, SinkError> {
            Ok(self.items.iter().find(|i| i.0 == row).map(|i| i.1.clone()))
        }
        fn item_hash(&self, row: u64) -> Result<Option<(String, [u8; 16])>, SinkError> {
            Ok(self
                .items
                .iter()
                .find(|i| i.0 == row)
                .map(|i| (i.1.clone(), i.2)))
        }
        fn reject(&mut self, r: &Rejection) -> Result<(), SinkError> {
            self.pending.push(r.clone());
            Ok(())
        }
        fn commit(
            &mut self,
            items: &[Self::Item],
            scanned_lines: u64,
            rejected: u64,
            mark: Option<PrefixMark>,
        ) -> Result<(), SinkError> {
            // The rejections a batch counts were all handed over before it.
            assert_eq!(self.pending.len() as u64, rejected);
            self.rejected.append(&mut self.pending);
            self.items.extend_from_slice(items);
            self.progress = Progress {
                scanned_lines,
                items: self.items.len() as u64,
                mark: mark.or(self.progress.mark),
            };
            self.commits.push((items.len(), scanned_lines, rejected));
            Ok(())
        }
        fn flush(&mut self) -> Result<(), SinkError> {
            Ok(())
        }
        fn rejects_path(&self) -> &Path {
            Path::new("memory")
        }
    }

    /// The template check's rows: the first three good rows, then the first row with
    /// each feature not yet seen (tools, a system prompt, an earlier assistant turn, a
    /// tool result, reasoning in history); bad rows and rows with nothing new are passed.
    #[test]
    fn the_check_samples_the_first_rows_and_each_feature_once() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.jsonl");
        let user = r#"{"role": "user", "content": "q"}"#;
        let tools = r#""tools": [{"type": "function", "function": {"name": "f"}}]"#;
        let rows = [
            format!(r#"{{"messages": [{user}]}}"#),
            "{bad".to_string(),
            format!(r#"{{"messages": [{user}]}}"#),
            format!(r#"{{"messages": [{user}]}}"#),
            format!(r#"{{"messages": [{user}]}}"#),
            format!(r#"{{"messages": [{user}], {tools}}}"#),
            format!(r#"{{"messages": [{user}], {tools}}}"#),
            format!(r#"{{"messages": [{{"role": "system", "content": "s"}}, {user}]}}"#),
            format!(r#"{{"messages": [{user}, {{"role": "assistant", "content": "a"}}, {user}]}}"#),
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "", "tool_calls": [{{"type": "function", "function": {{"name": "f", "arguments": "{{}}"}}}}]}}, {{"role": "tool", "content": "r"}}]}}"#
            ),
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "a", "reasoning_content": "t"}}, {user}]}}"#
            ),
            format!(r#"{{"messages": [{user}]}}"#),
        ];
        std::fs::write(&file, rows.join("\n") + "\n").unwrap();
        let d = DatasetConfig {
            name: "m".into(),
            path: file,
            token_budget: None,
            max_prompts: None,
            sampling: Default::default(),
            reasoning: None,
            turns: None,
            history_reasoning: None,
            samples: None,
            chat_template_kwargs: None,
            on_length: None,
            prompt_format: None,
        };
        let picked = sample_rows(
            &d,
            &PromptBuilder::new(None, None),
            &IntakeOptions::default(),
        )
        .unwrap();
        let lines: Vec<u64> = picked.iter().map(|r| r.line).collect();
        assert_eq!(lines, [1, 3, 4, 6, 8, 9, 10, 11]);
        let RenderInput::Chat { kwargs, .. } = &picked[3].input else {
            panic!("a chat row");
        };
        assert!(kwargs.contains_key("tools"), "the row's tools are rendered");
    }

    /// Without a queue, intake hands the sink every good row in file order and every bad
    /// or duplicate row as a rejection counted in the same commit, with the scan position;
    /// a second pass over the unchanged file adds nothing.
    #[test]
    fn a_sink_gets_rows_rejections_and_the_scan_position() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.jsonl");
        std::fs::write(
            &file,
            "{\"prompt\": \"a\", \"id\": 1}\n{bad\n{\"prompt\": \"b\", \"id\": 1}\n{\"prompt\": \"c\"}\n",
        )
        .unwrap();
        let d = DatasetConfig {
            name: "d".into(),
            path: file.clone(),
            token_budget: None,
            max_prompts: None,
            sampling: Default::default(),
            reasoning: None,
            turns: None,
            history_reasoning: None,
            samples: None,
            chat_template_kwargs: None,
            on_length: None,
            prompt_format: None,
        };
        let builder = PromptBuilder::new(None, None);
        let opts = IntakeOptions {
            threads: 2,
            ..Default::default()
        };
        let mut sink = Memory {
            dir: dir.path().to_path_buf(),
            ..Default::default()
        };
        let rep = intake(&mut sink, &d, &builder, &opts).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.lines), (2, 2, 4));
        let texts: Vec<&str> = sink.items.iter().map(|i| i.3.as_str()).collect();
        assert_eq!(texts, ["a", "c"]);
        let lines: Vec<u64> = sink.rejected.iter().map(|r| r.line).collect();
        assert_eq!(lines, [2, 3]);
        assert!(sink.rejected[1].reason.contains("first at line 1"));
        assert_eq!(sink.commits.last(), Some(&(2, 4, 2)));
        assert_eq!(sink.progress.mark.map(|m| m.lines), Some(4));

        let rep = intake(&mut sink, &d, &builder, &opts).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.skipped_lines), (0, 0, 4));
        assert_eq!(sink.items.len(), 2);
    }
}
