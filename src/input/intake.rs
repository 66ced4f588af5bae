//! Dataset file → queue, idempotently (SPEC §3, §4.1).
//!
//! Lines already taken in by an earlier run are only checked (same content hash, or the run
//! refuses); lines after them are parsed, rendered, tokenized and enqueued in batches; bad
//! rows, and prompts that leave no room for generation in the server's context, are
//! appended to `output_dir/<dataset>/_rejected.jsonl`.
//!
//! Parallelism: one reader thread cuts the file into chunks of raw rows; `threads` workers
//! parse, render and tokenize whole chunks; this thread puts the chunks back in file order
//! and does everything that must be sequential (duplicate ids, `max_prompts`, the queue
//! writes). Channels between the stages are bounded, so at most
//! `MAX_CHUNKS_IN_FLIGHT × CHUNK_ROWS` rows (and one queue batch) are in memory, whatever
//! the file size.
//!
//! Invariants: a batch of items and the scan position that covers them are one queue batch,
//! so a crash mid-intake resumes at the first line not taken in; the outcome (items, ids,
//! rejections, their order) is the same as a sequential pass, whatever the thread count;
//! no prompt is enqueued twice.

use crate::config::DatasetConfig;
use crate::input::dataset::{
    DatasetError, DatasetReader, Entry, Input, Parser, Raw, RawEntry, Rejection, Row,
};
use crate::input::dedup::{IdSet, SpillError};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use crate::store::queue::{EncodedItem, Item, Queue, QueueError, ScanMark};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Rows per queue batch.
const BATCH: usize = 1024;
/// Rows per chunk handed to a worker ...
const CHUNK_ROWS: usize = 256;
/// ... or fewer, once the chunk holds this many bytes of raw lines.
const CHUNK_BYTES: usize = 4 << 20;

/// Why intake stopped.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Queue(#[from] QueueError),
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
    #[error("cannot write {path}: {source}")]
    Rejects {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a prompt worker thread panicked")]
    Panicked,
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
    /// Lines skipped unparsed: an unchanged prefix, by its fingerprint ([`ScanMark`]).
    pub skipped_lines: u64,
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
}

/// Rejections per queue batch at most: a long run of bad rows (the second half of a file
/// repeated whole) still records its scan position, without an fsync of the log and a
/// queue commit every thousand rows.
const REJECTS_PER_BATCH: usize = 8 * BATCH;
/// Rejections of each kind logged one per line per intake; past that a batch's further
/// rejections are logged as one line with their count (each is still in `_rejected.jsonl`).
const REJECTS_LOGGED: u64 = 10;
/// Buffered rejection lines past which they are written before the batch ends (bounds
/// memory; the fsync still comes before the queue counts them).
const REJECTS_BUFFERED: usize = 1 << 20;

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

/// Appends rejected rows to `_rejected.jsonl` (created only if there is one). Lines are
/// buffered and written with one call per queue batch, then synced, before the queue
/// counts them: a row counted rejected is durably in the file.
struct RejectLog {
    path: PathBuf,
    file: Option<std::fs::File>,
    /// Lines not yet written.
    pending: Vec<u8>,
    /// Rejections logged one per line so far, by [`RejectKind`].
    logged: [u64; 4],
    /// Rejections since the last sync not logged one per line.
    unlogged: u64,
}

impl RejectLog {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            file: None,
            pending: Vec::new(),
            logged: [0; 4],
            unlogged: 0,
        }
    }

    fn write(&mut self, r: &Rejection, kind: RejectKind) -> Result<(), IntakeError> {
        // A Rejection is strings and integers: serializing it cannot fail.
        let _ = serde_json::to_writer(&mut self.pending, r);
        self.pending.push(b'\n');
        let logged = &mut self.logged[kind as usize];
        if *logged < REJECTS_LOGGED {
            *logged += 1;
            tracing::warn!(file = %r.file, line = r.line, reason = %r.reason, "row rejected");
        } else {
            self.unlogged += 1;
        }
        if self.pending.len() >= REJECTS_BUFFERED {
            self.write_pending()?;
        }
        Ok(())
    }

    /// Appends the buffered lines (opening the file on the first).
    fn write_pending(&mut self) -> Result<(), IntakeError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let err = |source| IntakeError::Rejects {
            path: self.path.clone(),
            source,
        };
        if self.file.is_none() {
            // Durably named (folder and file): the queue's counters soon say these rows
            // were rejected, and a later run never reads them again.
            if let Some(dir) = self.path.parent() {
                crate::store::blocks::create_dir_durably(dir).map_err(err)?;
            }
            let existed = self.path.exists();
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .map_err(err)?;
            if !existed {
                crate::store::blocks::sync_parent(&self.path).map_err(err)?;
            }
            self.file = Some(f);
        }
        if let Some(f) = &mut self.file {
            f.write_all(&self.pending).map_err(err)?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Writes and syncs every rejection so far; then logs the count not logged one by one.
    fn sync(&mut self) -> Result<(), IntakeError> {
        self.write_pending()?;
        if let Some(f) = &self.file {
            f.sync_data().map_err(|source| IntakeError::Rejects {
                path: self.path.clone(),
                source,
            })?;
        }
        if self.unlogged > 0 {
            tracing::warn!(rejected = self.unlogged, path = %self.path.display(),
                "more rows rejected (logged one per line only for the first 10 of each kind; all are in the file)");
            self.unlogged = 0;
        }
        Ok(())
    }
}

/// A row after the parallel stage.
enum Prepared {
    Rejected(Rejection),
    /// A good row; `built` is `None` for rows taken in by an earlier run (only checked).
    Row {
        row: u64,
        id: String,
        hash: [u8; 16],
        built: Option<Result<Ready, String>>,
    },
}

/// A new row built and encoded for the queue on a worker thread, so the sequential stage
/// only checks ids and batches.
struct Ready {
    /// Prompt tokens (`None` without a tokenizer).
    tokens: Option<u64>,
    item: EncodedItem,
}

impl Ready {
    fn new(row: &Row, built: BuiltPrompt) -> Self {
        let messages = match &row.input {
            Input::Messages(m) => Some(m.to_string()),
            Input::Prompt(_) => None,
        };
        let tokens = built.token_ids.as_ref().map(|ids| ids.len() as u64);
        let item = Item {
            id: row.id.clone(),
            hash: row.hash,
            prompt: built.text,
            messages,
            prompt_ids: built.token_ids,
        };
        Self {
            tokens,
            item: EncodedItem::new(row.row, &item),
        }
    }
}

/// Parses and builds one chunk (the parallel stage).
fn prepare(
    parser: &Parser,
    builder: &PromptBuilder,
    server_templates: bool,
    scanned: u64,
    chunk: Vec<RawEntry>,
) -> Vec<Prepared> {
    chunk
        .into_iter()
        .map(|raw| {
            let line = raw.line();
            match parser.parse(raw) {
                Entry::Rejected(r) => Prepared::Rejected(r),
                Entry::Row(row) => {
                    let built = (line > scanned).then(|| {
                        // A panic in the template engine or the tokenizer rejects this row
                        // only: a lost chunk would stall the in-order collector.
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            match &row.input {
                                Input::Prompt(p) => builder.build_text(p),
                                Input::Messages(m)
                                    if server_templates && !builder.has_template() =>
                                {
                                    Ok(BuiltPrompt {
                                        text: m.to_string(),
                                        token_ids: None,
                                    })
                                }
                                Input::Messages(m) => builder.build_chat(m),
                            }
                            .map_err(|e| e.to_string())
                        }))
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
                        .map(|b| Ready::new(&row, b))
                    });
                    Prepared::Row {
                        row: row.row,
                        id: row.id,
                        hash: row.hash,
                        built,
                    }
                }
            }
        })
        .collect()
}

fn raw_bytes(r: &RawEntry) -> usize {
    match &r.raw {
        Raw::Line(b) => b.len(),
        Raw::Bad(s) => s.len(),
        Raw::Object(_) => 256,
    }
}

/// A chunk of raw rows, numbered, with the reader's [`ScanMark`] after its last row.
type RawChunk = (u64, Vec<RawEntry>, Option<ScanMark>);
/// A chunk after the parallel stage.
type PreparedChunk = (u64, Vec<Prepared>, Option<ScanMark>);

/// The reader stage: raw rows in chunks, numbered, until the end, an error or `stop`.
fn read_chunks(
    mut reader: DatasetReader,
    out: SyncSender<RawChunk>,
    stop: &AtomicBool,
) -> Result<(), DatasetError> {
    let mut seq = 0u64;
    let mut chunk = Vec::with_capacity(CHUNK_ROWS);
    let mut bytes = 0;
    while let Some(raw) = reader.next_raw()? {
        bytes += raw_bytes(&raw);
        chunk.push(raw);
        if chunk.len() >= CHUNK_ROWS || bytes >= CHUNK_BYTES {
            if stop.load(Ordering::Relaxed)
                || out
                    .send((
                        seq,
                        std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_ROWS)),
                        reader.mark(),
                    ))
                    .is_err()
            {
                return Ok(());
            }
            seq += 1;
            bytes = 0;
        }
    }
    if !chunk.is_empty() {
        let _ = out.send((seq, chunk, reader.mark()));
    }
    Ok(())
}

/// The worker stage: chunks in, prepared chunks out, in whatever order they finish.
fn work_chunks(
    jobs: &Mutex<Receiver<RawChunk>>,
    out: SyncSender<PreparedChunk>,
    parser: &Parser,
    builder: &PromptBuilder,
    server_templates: bool,
    scanned: u64,
) {
    loop {
        // The lock is held only to take the next chunk.
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((seq, chunk, mark)) = job else { return };
        let done = prepare(parser, builder, server_templates, scanned, chunk);
        if out.send((seq, done, mark)).is_err() {
            return;
        }
    }
}

/// Takes in new rows of `d` (dataset index `ds`) and checks the old ones.
pub fn intake(
    queue: &Queue,
    ds: u16,
    d: &DatasetConfig,
    builder: &PromptBuilder,
    output_dir: &Path,
    opts: &IntakeOptions,
) -> Result<IntakeReport, IntakeError> {
    let state = queue.state(ds).ok_or_else(|| QueueError::Corrupt {
        key: d.name.clone(),
        detail: "dataset not opened".into(),
    })?;
    let mut reader = DatasetReader::open(&d.path, &d.name)?;
    let parser = reader.parser();
    // Restart fast path: an unchanged prefix (same bytes, by fingerprint) holds only rows
    // already taken in, so it is hashed, not parsed and checked row by row.
    let mut skipped = None;
    if let Some(m) = state.scan_mark.filter(|m| m.lines <= state.scanned_lines) {
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
    let mut collector = Collector {
        queue,
        ds,
        d,
        opts,
        scanned: state.scanned_lines,
        rejects: RejectLog::new(output_dir.join(&d.name).join("_rejected.jsonl")),
        report: IntakeReport {
            skipped_lines: skipped.map_or(0, |m| m.lines),
            ..Default::default()
        },
        items: state.items,
        batch: Vec::with_capacity(BATCH),
        ids: IdSet::new(queue.path().join("items").join(format!("{ds}.ids"))),
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
    let scanned = state.scanned_lines;
    let (read_res, collect_res) = std::thread::scope(|s| {
        let (job_tx, job_rx) = sync_channel::<RawChunk>(threads * 2);
        let (done_tx, done_rx) = sync_channel::<PreparedChunk>(threads * 2);
        let stop = &stop;
        let reader = s.spawn(move || read_chunks(reader, job_tx, stop));
        let jobs = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::with_capacity(threads);
        for _ in 0..threads {
            let (jobs, out, parser) = (jobs.clone(), done_tx.clone(), parser.clone());
            let server_templates = opts.server_templates;
            workers.push(s.spawn(move || {
                work_chunks(&jobs, out, &parser, builder, server_templates, scanned)
            }));
        }
        drop((jobs, done_tx));
        let collected = collector.collect(done_rx);
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
    read_res?;
    collector.finish(stopped_early)
}

/// The sequential stage, in file order.
struct Collector<'a> {
    queue: &'a Queue,
    ds: u16,
    d: &'a DatasetConfig,
    opts: &'a IntakeOptions,
    scanned: u64,
    rejects: RejectLog,
    report: IntakeReport,
    items: u64,
    batch: Vec<EncodedItem>,
    /// Every id enqueued for the dataset, seeded from the queue on first use when the
    /// dataset already had items.
    ids: IdSet,
    ids_seeded: bool,
    batch_rejected: u64,
    batch_ids: std::collections::HashMap<String, u64>,
    cap: u64,
    last_line: u64,
    /// The mark after the last chunk wholly processed: recorded with the next queue batch.
    mark: Option<ScanMark>,
    started: Instant,
    last_log: Instant,
}

impl Collector<'_> {
    /// Takes prepared chunks, puts them in order and processes them; `Ok(true)` when it
    /// stopped at `max_prompts` before the end of the file.
    fn collect(&mut self, done: Receiver<PreparedChunk>) -> Result<bool, IntakeError> {
        let mut waiting: BTreeMap<u64, (Vec<Prepared>, Option<ScanMark>)> = BTreeMap::new();
        let mut next = 0u64;
        for (seq, rows, mark) in done {
            waiting.insert(seq, (rows, mark));
            while let Some((rows, mark)) = waiting.remove(&next) {
                next += 1;
                for p in rows {
                    if !self.take(p)? {
                        return Ok(true);
                    }
                }
                // Every line up to the mark is now taken in (in `batch` or the queue).
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
            self.queue.for_each_id(self.ds, |id, row| {
                if spilled.is_ok() {
                    spilled = ids.insert(id, row);
                }
            })?;
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
            // Rows of the batch not yet written are covered by `batch_ids` above.
            if self.queue.item_id(self.ds, row)?.as_deref() == Some(id) {
                return Ok(Some(row));
            }
        }
        Ok(None)
    }

    fn reject(&mut self, r: Rejection, kind: RejectKind) -> Result<(), IntakeError> {
        self.rejects.write(&r, kind)?;
        self.batch_rejected += 1;
        self.report.rejected += 1;
        Ok(())
    }

    /// One row, in file order; `Ok(false)` = stop here (`max_prompts` reached).
    fn take(&mut self, p: Prepared) -> Result<bool, IntakeError> {
        let (line, already) = match &p {
            Prepared::Rejected(r) => (r.line, r.line <= self.scanned),
            Prepared::Row { row, .. } => (row + 1, *row < self.scanned),
        };
        self.last_line = line;
        match p {
            Prepared::Rejected(r) => {
                if !already {
                    self.reject(r, RejectKind::BadRow)?;
                }
            }
            Prepared::Row {
                row,
                id,
                hash,
                built,
            } => {
                if already {
                    if let Some(old) = self.queue.item(self.ds, row)? {
                        if old.hash != hash {
                            return Err(IntakeError::Changed {
                                path: self.d.path.clone(),
                                line,
                                id: old.id,
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
                self.items += 1;
                self.report.added += 1;
            }
        }
        self.maybe_flush(line)?;
        Ok(true)
    }

    fn maybe_flush(&mut self, line: u64) -> Result<(), IntakeError> {
        if self.batch.len() >= BATCH || self.batch_rejected as usize >= REJECTS_PER_BATCH {
            self.rejects.sync()?;
            self.queue.enqueue_encoded(
                self.ds,
                &self.batch,
                line,
                self.batch_rejected,
                self.mark,
            )?;
            self.batch.clear();
            self.batch_ids.clear();
            self.batch_rejected = 0;
        }
        Ok(())
    }

    fn finish(mut self, stopped_at_cap: bool) -> Result<IntakeReport, IntakeError> {
        if self.last_line < self.scanned && !stopped_at_cap && self.items < self.cap {
            return Err(IntakeError::Shrunk {
                path: self.d.path.clone(),
                lines: self.last_line,
                scanned: self.scanned,
            });
        }
        self.rejects.sync()?;
        self.queue.enqueue_encoded(
            self.ds,
            &self.batch,
            self.last_line.max(self.scanned),
            self.batch_rejected,
            self.mark,
        )?;
        self.queue.flush()?;
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

    fn cfg(path: &Path) -> DatasetConfig {
        DatasetConfig {
            name: "d".into(),
            path: path.to_path_buf(),
            token_budget: None,
            max_prompts: None,
            sampling: Default::default(),
        }
    }

    fn run(q: &Queue, path: &Path, out: &Path) -> Result<IntakeReport, IntakeError> {
        let ds = q.open_dataset("d")?.index;
        let opts = IntakeOptions {
            threads: 2,
            ..Default::default()
        };
        intake(
            q,
            ds,
            &cfg(path),
            &PromptBuilder::new(None, None),
            out,
            &opts,
        )
    }

    fn lines(range: std::ops::Range<usize>) -> String {
        range
            .map(|i| format!("{{\"prompt\": \"prompt number {i}\"}}\n"))
            .collect()
    }

    /// A restart hashes the already-enqueued prefix instead of parsing it; rows appended
    /// since are added; a changed prefix fails the fingerprint and the full row-by-row check
    /// finds the changed row (the run refuses, as without the fast path).
    #[test]
    fn a_restart_skips_the_unchanged_prefix_and_checks_a_changed_one() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        // A blank line and a bad row inside the prefix: both are counted as lines.
        let first = format!("{}\n{{bad\n{}", lines(0..600), lines(600..3000));
        std::fs::write(&file, &first).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.skipped_lines), (3000, 1, 0));
        let s = q.state(0).unwrap();
        let m = s.scan_mark.expect("a mark after a complete pass");
        assert_eq!((m.lines, m.bytes), (3002, first.len() as u64));
        assert_eq!(s.scanned_lines, 3002);

        // Unchanged and appended: the prefix is skipped, the new rows are added.
        let appended = format!("{first}{}", lines(3000..3010));
        std::fs::write(&file, &appended).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.skipped_lines), (10, 0, 3002));
        let s = q.state(0).unwrap();
        assert_eq!((s.items, s.rejected, s.scanned_lines), (3010, 1, 3012));
        assert_eq!(s.scan_mark.map(|m| m.lines), Some(3012));
        assert_eq!(
            q.item(0, 3011).unwrap().map(|i| i.prompt),
            Some("prompt number 3009".into())
        );
        // Nothing new: nothing added, still skipped.
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.skipped_lines), (0, 3012));

        // One row changed inside the prefix: the fingerprint differs, every row is checked
        // and the changed one is refused.
        let changed = appended.replacen("prompt number 7\"", "prompt number 8\"", 1);
        assert_ne!(changed, appended);
        std::fs::write(&file, &changed).unwrap();
        match run(&q, &file, &out) {
            Err(IntakeError::Changed { line, .. }) => assert_eq!(line, 8),
            other => panic!("expected a refusal of line 8, got {other:?}"),
        }
        // A truncated file is still noticed.
        std::fs::write(&file, lines(0..100)).unwrap();
        assert!(matches!(
            run(&q, &file, &out),
            Err(IntakeError::Shrunk { .. })
        ));
    }

    /// Duplicate ids are found through the filter within a pass, across batches, and
    /// against rows enqueued by an earlier run (the filter is seeded from the queue).
    #[test]
    fn duplicates_are_found_within_a_pass_and_across_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        // Row 2000 repeats row 3 (another batch); row 2001 repeats row 2000's neighbour 1999.
        let mut body = lines(0..2000);
        body.push_str(&lines(3..4));
        body.push_str(&lines(1999..2000));
        std::fs::write(&file, &body).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (2000, 2));
        // Appended later: a repeat of row 10 and a new row.
        body.push_str(&lines(10..11));
        body.push_str(&lines(5000..5001));
        std::fs::write(&file, &body).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (1, 1));
        let rejected = std::fs::read_to_string(out.join("d/_rejected.jsonl")).unwrap();
        let reasons: Vec<&str> = rejected.lines().collect();
        assert_eq!(reasons.len(), 3);
        assert!(reasons[0].contains("first at line 4"), "{}", reasons[0]);
        assert!(reasons[1].contains("first at line 2000"), "{}", reasons[1]);
        assert!(reasons[2].contains("first at line 11"), "{}", reasons[2]);
    }

    /// A file holding each of 3,000 prompts twice, shuffled: every first copy is enqueued
    /// and every second one rejected naming the first copy's line, whichever block (none
    /// of them cached) and spilled run the first copy sits in.
    #[test]
    fn shuffled_repeats_are_each_rejected_naming_the_first_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        let mut order: Vec<usize> = (0..3000).chain(0..3000).collect();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in (1..order.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let body: String = order.iter().map(|&i| lines(i..i + 1)).collect();
        std::fs::write(&file, &body).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (3000, 3000));
        let mut first = std::collections::HashMap::new();
        let mut want = Vec::new();
        for (at, &i) in order.iter().enumerate() {
            if let Some(&f) = first.get(&i) {
                want.push((at as u64 + 1, format!("(first at line {})", f + 1)));
            } else {
                first.insert(i, at as u64);
            }
        }
        let got: Vec<(u64, String)> = std::fs::read_to_string(out.join("d/_rejected.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let r: serde_json::Value = serde_json::from_str(l).unwrap();
                let reason = r["reason"].as_str().unwrap();
                let tail = &reason[reason.rfind('(').unwrap()..];
                (r["line"].as_u64().unwrap(), tail.to_string())
            })
            .collect();
        assert_eq!(got, want);
    }

    /// A last line without its newline is not covered by the mark: text appended to that
    /// line would change the row, so it is checked again next time.
    #[test]
    fn a_last_line_without_newline_stays_outside_the_mark() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        let body = lines(0..300);
        std::fs::write(&file, format!("{body}{{\"prompt\": \"last\"}}")).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        assert_eq!(run(&q, &file, &out).unwrap().added, 301);
        let m = q.state(0).unwrap().scan_mark.expect("mark");
        assert!(m.lines <= 300, "{m:?}");
        // The last line grew (no newline in between): the row changed, and it is refused.
        std::fs::write(&file, format!("{body}{{\"prompt\": \"last one\"}}\n")).unwrap();
        assert!(matches!(
            run(&q, &file, &out),
            Err(IntakeError::Changed { line: 301, .. })
        ));
    }
}
