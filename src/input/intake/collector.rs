//! The sequential stage of intake: prepared chunks put back in file order, then each row
//! checked (its hash against an earlier run's, its id against every earlier id, the
//! context length, `max_prompts`) and handed to the sink in batches.
//!
//! Invariants: the outcome is the one a sequential pass gives, whatever the thread count;
//! a batch and the scan position that covers it are one [`IntakeSink::commit`]; a bad row
//! without a usable id is reported only by the partition owning its line; rejections are
//! logged one per line only for the first [`REJECTS_LOGGED`] of each kind.

use super::pipeline::{InFlight, PreparedChunk};
use super::prepare::Prepared;
use super::{IntakeError, IntakeOptions, IntakeReport, IntakeSink, Progress, BATCH, BATCH_BYTES};
use crate::config::DatasetConfig;
use crate::input::dataset::PrefixMark;
use crate::input::dedup::IdSet;
use crate::input::row::Rejection;
use std::collections::BTreeMap;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// Rejections per batch at most: a long run of bad rows (the second half of a file
/// repeated whole) still records its scan position, without a sync of the rejected rows and
/// a sink commit every thousand rows.
pub(super) const REJECTS_PER_BATCH: usize = 8 * BATCH;
/// Rejections of each kind logged one per line per intake; past that a batch's further
/// rejections are logged as one line with their count (each is still in the sink).
pub(super) const REJECTS_LOGGED: u64 = 10;

/// Why a row was rejected, for the one-line-per-row log budget.
#[derive(Clone, Copy)]
pub(super) enum RejectKind {
    /// Not a valid row (parse, types, size).
    BadRow = 0,
    DuplicateId = 1,
    /// The template or the tokenizer failed.
    Build = 2,
    OverContext = 3,
}

/// The sequential stage, in file order.
pub(super) struct Collector<'a, S: IntakeSink> {
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

impl<'a, S: IntakeSink> Collector<'a, S> {
    /// The sequential stage of `d`, resuming at the sink's progress `state` (and after the
    /// unchanged prefix `skipped`, when one was skipped unparsed).
    pub(super) fn new(
        sink: &'a mut S,
        d: &'a DatasetConfig,
        opts: &'a IntakeOptions,
        state: Progress,
        skipped: Option<PrefixMark>,
    ) -> Self {
        let ids = IdSet::new(sink.id_spill_path());
        Collector {
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
        }
    }

    /// Takes prepared chunks, puts them in order and processes them; `Ok(true)` when it
    /// stopped at `max_prompts` before the end of the file.
    pub(super) fn collect(
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
    pub(super) fn duplicate_of(&mut self, id: &str) -> Result<Option<u64>, IntakeError> {
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

    pub(super) fn reject(&mut self, r: Rejection, kind: RejectKind) -> Result<(), IntakeError> {
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
        if self.report.first_rejection.is_none() {
            self.report.first_rejection = Some(format!("{} line {}: {}", r.file, r.line, r.reason));
        }
        Ok(())
    }

    /// One row, in file order; `Ok(false)` = stop here (`max_prompts` reached).
    pub(super) fn take(&mut self, p: Prepared<S::Item>) -> Result<bool, IntakeError> {
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
        // A cluster job's cap is a place in the file, the same for every partition, volume
        // and run: its first `max_prompts` lines (rows of a Parquet file), whoever owns them.
        if self.opts.filter.is_some() && line > self.cap {
            self.last_line = line - 1;
            return Ok(false);
        }
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
                                path: self.opts.file_of(self.d).to_path_buf(),
                                line,
                                id: old_id,
                            });
                        }
                    }
                    return Ok(true);
                }
                if self.opts.filter.is_none() && self.items >= self.cap {
                    // Past max_prompts: not taken in, and not counted as scanned.
                    self.last_line = line - 1;
                    return Ok(false);
                }
                let dup = self.duplicate_of(&id)?;
                let rejection = |reason| Rejection {
                    file: self.opts.file_of(self.d).display().to_string(),
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

    pub(super) fn maybe_flush(&mut self, line: u64) -> Result<(), IntakeError> {
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
    pub(super) fn commit(&mut self, scanned_lines: u64) -> Result<(), IntakeError> {
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
    pub(super) fn keep_before_limit(&mut self) -> Result<(), IntakeError> {
        if self.last_line >= self.scanned {
            self.commit(self.last_line)?;
        }
        self.sink.flush().map_err(IntakeError::Sink)
    }

    pub(super) fn finish(mut self, stopped_at_cap: bool) -> Result<IntakeReport, IntakeError> {
        if self.last_line < self.scanned && !stopped_at_cap && self.items < self.cap {
            return Err(IntakeError::Shrunk {
                path: self.opts.file_of(self.d).to_path_buf(),
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
