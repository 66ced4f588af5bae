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

use crate::cluster::partition::Partition;
use crate::config::{DatasetConfig, GenerationSpec, HistoryReasoning, Sampling, Turns};
use crate::input::dataset::{DatasetError, DatasetReader, PrefixMark};
use crate::input::dedup::{IdSet, SpillError};
use crate::input::limits::LimitError;
use crate::input::row::{Entry, Input, Parser, Raw, RawEntry, Rejection, Row};
use crate::prompt::conversation::Conversation;
use crate::prompt::draw::Drawer;
use crate::prompt::remote::{IdsSource, RemoteError, RemoteRenderer, RenderInput};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// How the workers render a row's prompt: the same for every row of a dataset.
struct Render {
    /// The dataset's name and the partition's filter ([`IntakeOptions::filter`]).
    dataset: String,
    filter: Option<ItemFilter>,
    /// See [`IntakeOptions::server_templates`].
    server_templates: bool,
    turns: Turns,
    /// The dataset's template variables that every generation gets (`enable_thinking =
    /// false` for `reasoning = "disable"`); a row's `tools` are added to them.
    kwargs: Map<String, Value>,
    /// See [`IntakeOptions::server`].
    server: Option<Arc<dyn RemoteRenderer>>,
}

/// What a row's prompt is, before it is rendered.
enum Planned {
    /// Rendered by spool's builder, or the server.
    Input(RenderInput),
    /// Sent as the messages themselves, unrendered (`api = "chat"` without a template).
    AsIs(BuiltPrompt),
}

impl Render {
    /// What one row's prompt is made of: its messages (turn 0's request with `turns =
    /// "all"`) with the dataset's fixed variables and the row's tools, or its text.
    fn plan(&self, builder: &PromptBuilder, row: &Row, server: bool) -> Result<Planned, String> {
        let m = match &row.input {
            Input::Prompt(p) => {
                if row.tools.is_some() {
                    return Err("`tools` needs `messages` or `conversations` (a `prompt` is                                 sent as is, with no template to put them in)"
                        .into());
                }
                return Ok(Planned::Input(RenderInput::text(builder, p)));
            }
            Input::Messages(m) => m,
        };
        let first;
        let messages = match self.turns {
            Turns::Last => m,
            Turns::All => {
                let c = Conversation::new(m.as_array().cloned().unwrap_or_default());
                if c.turns() == 0 {
                    return Err("the conversation has no assistant turn to generate (no                                 assistant message, and it does not end with a user or tool                                 message)"
                        .into());
                }
                first = Value::Array(c.request(0, &[], HistoryReasoning::Drop)?);
                &first
            }
        };
        if self.server_templates && !builder.has_template() && !server {
            return Ok(Planned::AsIs(BuiltPrompt {
                text: messages.to_string(),
                token_ids: None,
            }));
        }
        let mut kwargs = self.kwargs.clone();
        if let Some(tools) = &row.tools {
            kwargs.insert("tools".into(), tools.clone());
        }
        Ok(Planned::Input(RenderInput::Chat {
            messages: messages.clone(),
            kwargs,
        }))
    }

    /// The prompt of one row rendered by spool's builder, and who made its ids.
    fn build(
        &self,
        builder: &PromptBuilder,
        row: &Row,
    ) -> Result<(BuiltPrompt, Option<IdsSource>), String> {
        let built = match self.plan(builder, row, false)? {
            Planned::AsIs(b) => b,
            Planned::Input(i) => i.build(builder).map_err(|e| e.to_string())?,
        };
        let from = built.token_ids.as_ref().map(|_| IdsSource::Client);
        Ok((built, from))
    }
}

/// Rejections per batch at most: a long run of bad rows (the second half of a file
/// repeated whole) still records its scan position, without a sync of the rejected rows and
/// a sink commit every thousand rows.
const REJECTS_PER_BATCH: usize = 8 * BATCH;
/// Rejections of each kind logged one per line per intake; past that a batch's further
/// rejections are logged as one line with their count (each is still in the sink).
const REJECTS_LOGGED: u64 = 10;

/// Why a row was rejected, for the one-line-per-row log budget.
#[derive(Clone, Copy)]
enum RejectKind {
    /// Not a valid row (parse, types, size).
    BadRow = 0,
    DuplicateId = 1,
    /// The template or the tokenizer failed.
    Build = 2,
    OverContext = 3,
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

/// A row after the parallel stage; `T` is the sink's encoded item.
enum Prepared<T> {
    Rejected(Rejection),
    /// A good row another partition owns, or one already committed: not built.
    Elsewhere {
        row: u64,
        committed: bool,
    },
    /// A good row; `built` is `None` for rows taken in by an earlier run (only checked).
    Row {
        row: u64,
        id: String,
        hash: [u8; 16],
        /// Its size in the file (the batch is cut by bytes too).
        bytes: usize,
        built: Option<Result<Ready<T>, String>>,
    },
    /// A new row the server could not render for a reason that is not the row's (down,
    /// overloaded): intake stops here rather than reject it.
    Unavailable(String),
}

/// A new row built and encoded for the sink on a worker thread, so the sequential stage
/// only checks ids and batches.
struct Ready<T> {
    /// Prompt tokens (`None` without a tokenizer).
    tokens: Option<u64>,
    item: T,
}

/// The sink's encoder of a new row, its prompt and who made the prompt's ids.
type Encode<T> = fn(&Row, BuiltPrompt, Option<IdsSource>) -> T;

/// Parses and builds one chunk (the parallel stage); `encode` is the sink's encoder. With
/// a server renderer, the chunk's new rows are rendered there together (one call, several
/// requests in flight) after they are all parsed.
fn prepare<T>(
    parser: &Parser,
    builder: &PromptBuilder,
    encode: Encode<T>,
    render: &Render,
    scanned: u64,
    chunk: Vec<RawEntry>,
) -> Vec<Prepared<T>> {
    let server = render.server.as_deref();
    let mut out = Vec::with_capacity(chunk.len());
    // (place in `out`, the row, what the server renders).
    let mut remote: Vec<(usize, Row, RenderInput)> = Vec::new();
    for raw in chunk {
        let line = raw.line();
        let bytes = raw_bytes(&raw);
        let row = match parser.parse(raw) {
            Entry::Rejected(r) => {
                out.push(Prepared::Rejected(r));
                continue;
            }
            Entry::Row(row) => row,
        };
        if let Some(f) = &render.filter {
            let owned = f.partition.owns(&render.dataset, &row.id);
            if !owned || f.committed.contains(&row.id) {
                out.push(Prepared::Elsewhere {
                    row: row.row,
                    committed: owned,
                });
                continue;
            }
        }
        if line <= scanned {
            out.push(Prepared::Row {
                row: row.row,
                id: row.id,
                hash: row.hash,
                bytes,
                built: None,
            });
            continue;
        }
        let built = match server {
            Some(_) => match render.plan(builder, &row, true) {
                Ok(Planned::Input(input)) => {
                    out.push(Prepared::Row {
                        row: row.row,
                        id: row.id.clone(),
                        hash: row.hash,
                        bytes,
                        built: None,
                    });
                    remote.push((out.len() - 1, row, input));
                    continue;
                }
                Ok(Planned::AsIs(b)) => Ok((b, None)),
                Err(why) => Err(why),
            },
            None => build_locally(render, builder, &row),
        };
        out.push(Prepared::Row {
            row: row.row,
            id: row.id.clone(),
            hash: row.hash,
            bytes,
            built: Some(built.map(|(b, from)| ready(encode, &row, b, from))),
        });
    }
    if let (Some(server), false) = (server, remote.is_empty()) {
        let inputs: Vec<RenderInput> = remote.iter().map(|(_, _, i)| i.clone()).collect();
        let rendered = server.render_blocking(&inputs);
        for ((at, row, _), r) in remote.into_iter().zip(rendered) {
            match r {
                Ok(b) => {
                    if let Prepared::Row { built, .. } = &mut out[at] {
                        *built = Some(Ok(ready(encode, &row, b, Some(IdsSource::Server))));
                    }
                }
                Err(RemoteError::Refused(why)) => {
                    if let Prepared::Row { built, .. } = &mut out[at] {
                        *built = Some(Err(format!(
                            "the server refused to render the prompt: {why}"
                        )));
                    }
                }
                Err(RemoteError::Unavailable(why)) => out[at] = Prepared::Unavailable(why),
            }
        }
    }
    out
}

/// A row rendered by spool's builder; a panic in the template engine or the tokenizer
/// rejects this row only (a lost chunk would stall the in-order collector).
fn build_locally(
    render: &Render,
    builder: &PromptBuilder,
    row: &Row,
) -> Result<(BuiltPrompt, Option<IdsSource>), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| render.build(builder, row)))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!(
                "internal error while rendering or tokenizing: {what}"
            ))
        })
}

/// A built row encoded for the sink.
fn ready<T>(encode: Encode<T>, row: &Row, b: BuiltPrompt, from: Option<IdsSource>) -> Ready<T> {
    Ready {
        tokens: b.token_ids.as_ref().map(|ids| ids.len() as u64),
        item: encode(row, b, from),
    }
}

fn raw_bytes(r: &RawEntry) -> usize {
    match &r.raw {
        Raw::Line(b) => b.len(),
        Raw::Bad(s) => s.len(),
        Raw::Object(o) => object_bytes(o),
    }
}

/// About the memory of a Parquet row's JSON: its strings, 64 bytes a value besides.
fn object_bytes(o: &Map<String, Value>) -> usize {
    fn value(v: &Value) -> usize {
        64 + match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(value).sum(),
            Value::Object(o) => o.iter().map(|(k, v)| k.len() + value(v)).sum(),
            _ => 0,
        }
    }
    o.iter().map(|(k, v)| k.len() + value(v)).sum()
}

/// A chunk of raw rows, numbered, with the reader's [`PrefixMark`] after its last row and
/// its size in bytes.
type RawChunk = (u64, Vec<RawEntry>, Option<PrefixMark>, usize);
/// A chunk after the parallel stage, with the size of its raw rows.
type PreparedChunk<T> = (u64, Vec<Prepared<T>>, Option<PrefixMark>, usize);

/// Bytes of raw rows between the reader and the sequential stage: the reader waits while
/// more than [`IN_FLIGHT_BYTES`] are, so a file of huge rows holds a bounded number.
#[derive(Default)]
struct InFlight {
    bytes: Mutex<usize>,
    freed: std::sync::Condvar,
}

impl InFlight {
    /// Waits until `n` more bytes fit (or nothing is in flight), then counts them; `false`
    /// when `stop` was set meanwhile.
    fn acquire(&self, n: usize, stop: &AtomicBool) -> bool {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        while *b > 0 && *b + n > IN_FLIGHT_BYTES {
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            b = self
                .freed
                .wait_timeout(b, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *b += n;
        true
    }

    fn release(&self, n: usize) {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        *b = b.saturating_sub(n);
        self.freed.notify_all();
    }
}

/// The reader stage: raw rows in chunks, numbered, until the end, an error or `stop`.
fn read_chunks(
    mut reader: DatasetReader,
    out: SyncSender<RawChunk>,
    stop: &AtomicBool,
    in_flight: &InFlight,
) -> Result<(), DatasetError> {
    let mut seq = 0u64;
    let mut chunk = Vec::with_capacity(CHUNK_ROWS);
    let mut bytes = 0;
    loop {
        let raw = match reader.next_raw() {
            Ok(Some(raw)) => raw,
            Ok(None) => break,
            Err(e @ DatasetError::Limit(_)) => {
                // The rows before the limit are taken in (and their rejections kept).
                if !chunk.is_empty() && in_flight.acquire(bytes, stop) {
                    let _ = out.send((seq, chunk, None, bytes));
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        bytes += raw_bytes(&raw);
        chunk.push(raw);
        if chunk.len() >= CHUNK_ROWS || bytes >= CHUNK_BYTES {
            if stop.load(Ordering::Relaxed)
                || !in_flight.acquire(bytes, stop)
                || out
                    .send((
                        seq,
                        std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_ROWS)),
                        reader.mark(),
                        bytes,
                    ))
                    .is_err()
            {
                return Ok(());
            }
            seq += 1;
            bytes = 0;
        }
    }
    if !chunk.is_empty() && in_flight.acquire(bytes, stop) {
        let _ = out.send((seq, chunk, reader.mark(), bytes));
    }
    Ok(())
}

/// The worker stage: chunks in, prepared chunks out, in whatever order they finish.
fn work_chunks<T>(
    jobs: &Mutex<Receiver<RawChunk>>,
    out: SyncSender<PreparedChunk<T>>,
    parser: &Parser,
    builder: &PromptBuilder,
    encode: Encode<T>,
    render: &Render,
    scanned: u64,
) {
    loop {
        // The lock is held only to take the next chunk.
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((seq, chunk, mark, bytes)) = job else {
            return;
        };
        let done = prepare(parser, builder, encode, render, scanned, chunk);
        if out.send((seq, done, mark, bytes)).is_err() {
            return;
        }
    }
}

/// The parser and the renderer of `d`'s rows, as `opts` sets them.
fn stage(
    reader: &DatasetReader,
    d: &DatasetConfig,
    opts: &IntakeOptions,
) -> Result<(Parser, Render), IntakeError> {
    let turns = opts.generation.turns;
    let parser = reader
        .parser()
        .whole_conversations(turns == Turns::All)
        .samples(opts.generation.samples);
    let kwargs = Drawer::new(
        &Sampling::default(),
        &opts.generation.chat_template_kwargs,
        opts.generation.reasoning,
    )
    .map_err(|detail| IntakeError::Generation {
        dataset: d.name.clone(),
        detail,
    })?
    .fixed_kwargs();
    let render = Render {
        dataset: d.name.clone(),
        filter: opts.filter.clone(),
        server_templates: opts.server_templates,
        turns,
        kwargs,
        server: opts.server.clone(),
    };
    Ok((parser, render))
}

/// Good rows the start-up template check compares, read from the start of a dataset.
pub const CHECK_ROWS: usize = 8;
/// Lines read at most to find them.
pub const CHECK_SCAN: u64 = 2_000;

/// A row of a dataset and what its prompt is made of, for the start-up template check.
#[derive(Debug, Clone)]
pub struct SampledRow {
    /// 1-based line (Parquet: row number).
    pub line: u64,
    pub id: String,
    pub input: RenderInput,
}

/// The rows the start-up template check compares: among the first [`CHECK_SCAN`] lines of
/// `d`, the first three good rows, then the first row with each of: tools, a system
/// prompt, an earlier assistant turn, a tool result, reasoning in an earlier turn — at
/// most [`CHECK_ROWS`]. Each is what intake would render (turn 0's request with `turns =
/// "all"`, the dataset's fixed variables, the row's tools). Rows intake sends unrendered
/// or would reject are left out.
pub fn sample_rows(
    d: &DatasetConfig,
    builder: &PromptBuilder,
    opts: &IntakeOptions,
) -> Result<Vec<SampledRow>, IntakeError> {
    let mut reader = DatasetReader::open(&d.path, &d.name)?;
    let (parser, render) = stage(&reader, d, opts)?;
    let mut picked: Vec<SampledRow> = Vec::new();
    let mut covered = [false; 5];
    while let Some(raw) = reader.next_raw()? {
        let line = raw.line();
        if line > CHECK_SCAN || picked.len() >= CHECK_ROWS {
            break;
        }
        let Entry::Row(row) = parser.parse(raw) else {
            continue;
        };
        let Ok(Planned::Input(input)) = render.plan(builder, &row, false) else {
            continue;
        };
        let features = features_of(&row, &input);
        let new = features.iter().zip(&covered).any(|(f, c)| *f && !c);
        if picked.len() < 3 || new {
            for (c, f) in covered.iter_mut().zip(features) {
                *c |= f;
            }
            picked.push(SampledRow {
                line,
                id: row.id,
                input,
            });
        }
    }
    Ok(picked)
}

/// Which of the features [`sample_rows`] looks for a row has: tools, a system prompt, an
/// earlier assistant turn, a tool result, reasoning in an earlier turn.
fn features_of(row: &Row, input: &RenderInput) -> [bool; 5] {
    let RenderInput::Chat { messages, .. } = input else {
        return [false; 5];
    };
    let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
    let role = |r: &str| {
        list.iter()
            .any(|m| m.get("role").and_then(Value::as_str) == Some(r))
    };
    let reasoning = list.iter().any(|m| {
        ["reasoning_content", "reasoning"]
            .iter()
            .any(|k| m.get(*k).is_some_and(|v| !v.is_null()))
    });
    [
        row.tools.is_some(),
        role("system"),
        role("assistant"),
        role("tool"),
        reasoning,
    ]
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
    let mut reader = DatasetReader::open(&d.path, &d.name)?;
    let (parser, render) = stage(&reader, d, opts)?;
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
    let ids = IdSet::new(sink.id_spill_path());
    let mut collector = Collector {
        sink,
        d,
        opts,
        scanned: state.scanned_lines,
        logged: [0; 4],
        unlogged: 0,
        report: IntakeReport {
            skipped_lines: skipped.map_or(0, |m| m.lines),
            ..Default::default()
        },
        items: state.items,
        batch: Vec::with_capacity(BATCH),
        batch_bytes: 0,
        ids,
        ids_seeded: state.items == 0,
        batch_rejected: 0,
        batch_ids: std::collections::HashMap::new(),
        cap: d.max_prompts.unwrap_or(u64::MAX),
        last_line: skipped.map_or(0, |m| m.lines),
        mark: skipped,
        started: Instant::now(),
        last_log: Instant::now(),
    };
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

/// The sequential stage, in file order.
struct Collector<'a, S: IntakeSink> {
    sink: &'a mut S,
    d: &'a DatasetConfig,
    opts: &'a IntakeOptions,
    scanned: u64,
    /// Rejections logged one per line so far, by [`RejectKind`].
    logged: [u64; 4],
    /// Rejections since the last commit not logged one per line.
    unlogged: u64,
    report: IntakeReport,
    items: u64,
    batch: Vec<S::Item>,
    /// Input bytes of the rows in `batch`.
    batch_bytes: usize,
    /// Every id taken in for the dataset, seeded from the sink on first use when the
    /// dataset already had items.
    ids: IdSet,
    ids_seeded: bool,
    batch_rejected: u64,
    batch_ids: std::collections::HashMap<String, u64>,
    cap: u64,
    last_line: u64,
    /// The mark after the last chunk wholly processed: recorded with the next batch.
    mark: Option<PrefixMark>,
    started: Instant,
    last_log: Instant,
}

impl<S: IntakeSink> Collector<'_, S> {
    /// Takes prepared chunks, puts them in order and processes them; `Ok(true)` when it
    /// stopped at `max_prompts` before the end of the file.
    fn collect(
        &mut self,
        done: Receiver<PreparedChunk<S::Item>>,
        in_flight: &InFlight,
    ) -> Result<bool, IntakeError> {
        let mut waiting = BTreeMap::new();
        let mut next = 0u64;
        for (seq, rows, mark, bytes) in done {
            waiting.insert(seq, (rows, mark, bytes));
            while let Some((rows, mark, bytes)) = waiting.remove(&next) {
                next += 1;
                for p in rows {
                    if !self.take(p)? {
                        return Ok(true);
                    }
                }
                in_flight.release(bytes);
                // Every line up to the mark is taken in (in `batch` or the sink).
                if mark.is_some() {
                    self.mark = mark;
                }
                if self.last_log.elapsed() >= Duration::from_secs(10) {
                    self.last_log = Instant::now();
                    let secs = self.started.elapsed().as_secs_f64().max(1e-9);
                    tracing::info!(dataset = %self.d.name, lines = self.last_line, added = self.report.added,
                        rows_per_s = (self.last_line.saturating_sub(self.scanned) as f64 / secs) as u64, "enqueueing");
                }
            }
        }
        Ok(false)
    }

    /// The row of an earlier row with this id, if any. The id set answers most new ids
    /// from its filter; the rest are confirmed against the stored ids of its candidates.
    fn duplicate_of(&mut self, id: &str) -> Result<Option<u64>, IntakeError> {
        if !self.ids_seeded {
            let t = Instant::now();
            let ids = &mut self.ids;
            let mut spilled = Ok(());
            self.sink
                .for_each_id(&mut |id, row| {
                    if spilled.is_ok() {
                        spilled = ids.insert(id, row);
                    }
                })
                .map_err(IntakeError::Sink)?;
            spilled?;
            self.ids_seeded = true;
            tracing::debug!(dataset = %self.d.name, items = self.items,
                seconds = t.elapsed().as_secs_f64(), "duplicate-id set seeded from the queue");
        }
        let candidates = self.ids.candidates(id.as_bytes())?;
        if candidates.is_empty() {
            return Ok(None);
        }
        if let Some(&row) = self.batch_ids.get(id) {
            return Ok(Some(row));
        }
        for row in candidates {
            // Rows of the batch not yet committed are covered by `batch_ids` above.
            if self
                .sink
                .item_id(row)
                .map_err(IntakeError::Sink)?
                .as_deref()
                == Some(id)
            {
                return Ok(Some(row));
            }
        }
        Ok(None)
    }

    fn reject(&mut self, r: Rejection, kind: RejectKind) -> Result<(), IntakeError> {
        self.sink.reject(&r).map_err(IntakeError::Sink)?;
        let logged = &mut self.logged[kind as usize];
        if *logged < REJECTS_LOGGED {
            *logged += 1;
            tracing::warn!(file = %r.file, line = r.line, reason = %r.reason, "row rejected");
        } else {
            self.unlogged += 1;
        }
        self.batch_rejected += 1;
        self.report.rejected += 1;
        Ok(())
    }

    /// One row, in file order; `Ok(false)` = stop here (`max_prompts` reached).
    fn take(&mut self, p: Prepared<S::Item>) -> Result<bool, IntakeError> {
        let (line, already) = match &p {
            Prepared::Unavailable(detail) => {
                return Err(IntakeError::Render {
                    dataset: self.d.name.clone(),
                    detail: detail.clone(),
                })
            }
            Prepared::Rejected(r) => (r.line, r.line <= self.scanned),
            Prepared::Row { row, .. } | Prepared::Elsewhere { row, .. } => {
                (row + 1, *row < self.scanned)
            }
        };
        self.last_line = line;
        match p {
            Prepared::Rejected(r) => {
                let mine = self
                    .opts
                    .filter
                    .as_ref()
                    .is_none_or(|f| f.owns_line(&self.d.name, r.line));
                if !already && mine {
                    self.reject(r, RejectKind::BadRow)?;
                }
            }
            // Returned above.
            Prepared::Unavailable(_) => {}
            Prepared::Elsewhere { committed, .. } => {
                if !already {
                    if committed {
                        self.report.committed += 1;
                    } else {
                        self.report.elsewhere += 1;
                    }
                }
            }
            Prepared::Row {
                row,
                id,
                hash,
                bytes,
                built,
            } => {
                if already {
                    let old = self.sink.item_hash(row).map_err(IntakeError::Sink)?;
                    if let Some((old_id, old_hash)) = old {
                        if old_hash != hash {
                            return Err(IntakeError::Changed {
                                path: self.d.path.clone(),
                                line,
                                id: old_id,
                            });
                        }
                    }
                    return Ok(true);
                }
                if self.items >= self.cap {
                    // Past max_prompts: not taken in, and not counted as scanned.
                    self.last_line = line - 1;
                    return Ok(false);
                }
                let dup = self.duplicate_of(&id)?;
                let rejection = |reason| Rejection {
                    file: self.d.path.display().to_string(),
                    line,
                    row,
                    reason,
                    id: Some(id.clone()),
                };
                if let Some(first) = dup {
                    let rej = rejection(format!(
                        "duplicate id `{}` (first at line {})",
                        id,
                        first + 1
                    ));
                    self.reject(rej, RejectKind::DuplicateId)?;
                    return self.maybe_flush(line).map(|_| true);
                }
                let ready = match built {
                    Some(Ok(b)) => b,
                    Some(Err(reason)) => {
                        let rej = rejection(reason);
                        self.reject(rej, RejectKind::Build)?;
                        return self.maybe_flush(line).map(|_| true);
                    }
                    None => unreachable!("rows after the scan position are always built"),
                };
                if let (Some(ctx), Some(n)) = (self.opts.context_length, ready.tokens) {
                    if n + 1 > u64::from(ctx) {
                        let rej = rejection(format!(
                            "prompt is {n} tokens and the server's context length is {ctx}: no room for generation"
                        ));
                        self.report.over_context += 1;
                        self.reject(rej, RejectKind::OverContext)?;
                        return self.maybe_flush(line).map(|_| true);
                    }
                    if n + u64::from(self.opts.max_tokens) > u64::from(ctx) {
                        self.report.short_of_room += 1;
                    }
                }
                self.report.prompt_tokens += ready.tokens.unwrap_or(0);
                self.ids.insert(id.as_bytes(), row)?;
                self.batch_ids.insert(id, row);
                self.batch.push(ready.item);
                self.batch_bytes += bytes;
                self.items += 1;
                self.report.added += 1;
            }
        }
        self.maybe_flush(line)?;
        Ok(true)
    }

    fn maybe_flush(&mut self, line: u64) -> Result<(), IntakeError> {
        if self.batch.len() >= BATCH
            || self.batch_bytes >= BATCH_BYTES
            || self.batch_rejected as usize >= REJECTS_PER_BATCH
        {
            self.commit(line)?;
            self.batch.clear();
            self.batch_bytes = 0;
            self.batch_ids.clear();
            self.batch_rejected = 0;
        }
        Ok(())
    }

    /// Hands the batch to the sink with the scan position `scanned_lines`, then logs the
    /// count of the rejections not logged one by one.
    fn commit(&mut self, scanned_lines: u64) -> Result<(), IntakeError> {
        self.sink
            .commit(&self.batch, scanned_lines, self.batch_rejected, self.mark)
            .map_err(IntakeError::Sink)?;
        if self.unlogged > 0 {
            tracing::warn!(rejected = self.unlogged, path = %self.sink.rejects_path().display(),
                "more rows rejected (logged one per line only for the first 10 of each kind; all are in the file)");
            self.unlogged = 0;
        }
        Ok(())
    }

    /// Commits what was taken in before the reader stopped at a limit (nothing, when the
    /// limit came inside the part of the file an earlier run took in).
    fn keep_before_limit(&mut self) -> Result<(), IntakeError> {
        if self.last_line >= self.scanned {
            self.commit(self.last_line)?;
        }
        self.sink.flush().map_err(IntakeError::Sink)
    }

    fn finish(mut self, stopped_at_cap: bool) -> Result<IntakeReport, IntakeError> {
        if self.last_line < self.scanned && !stopped_at_cap && self.items < self.cap {
            return Err(IntakeError::Shrunk {
                path: self.d.path.clone(),
                lines: self.last_line,
                scanned: self.scanned,
            });
        }
        self.commit(self.last_line.max(self.scanned))?;
        self.sink.flush().map_err(IntakeError::Sink)?;
        self.report.lines = self.last_line;
        self.report.seconds = self.started.elapsed().as_secs_f64();
        if self.report.added > 0 {
            let secs = self.report.seconds.max(1e-9);
            tracing::info!(
                dataset = %self.d.name,
                added = self.report.added,
                rejected = self.report.rejected,
                prompt_tokens = self.report.prompt_tokens,
                seconds = format!("{:.2}", self.report.seconds),
                prompts_per_s = (self.report.added as f64 / secs) as u64,
                tokens_per_s = (self.report.prompt_tokens as f64 / secs) as u64,
                id_lookups = self.ids.lookups(),
                id_lookup_bytes = self.ids.lookup_bytes(),
                "enqueued"
            );
        }
        Ok(self.report)
    }
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
