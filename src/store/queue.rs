//! The durable queue: sled is the source of truth for every item's state. This module is
//! its API — open, datasets and their counters, enqueue, reading items, pending rows,
//! commit, the unsharded results and `mark_sharded`; the record layout is in
//! [`crate::store::keys`], the records in [`crate::store::records`], the write door in
//! [`crate::store::writes`], the migrations in [`crate::store::migrate`] and the repair in
//! [`crate::store::repair`].
//!
//! Invariants: counters change only in the same batch as the items they count, so they are
//! never recomputed by scanning; an outcome is applied only to an item that is still pending
//! (a late answer to a cancelled request cannot complete an item twice), and a generation
//! only once per (row, sample, turn) while its item is open; in-flight state is
//! not stored (a lease is in memory), so after a crash every unfinished item is simply
//! pending; one process at a time (an exclusive lock file); blocks never overlap and are
//! recorded in row order (an enqueue only adds rows after the last block's).
//!
//! sled replays its log since its last recovery snapshot at every open, and writes a
//! snapshot only then (sled 0.34 has no other way to make one): after a big intake,
//! [`Queue::checkpoint`] reopens the database so that a restart — clean or after a SIGKILL —
//! does not replay the whole enqueue log again.

// The types and constants of the queue's API, where callers name them with the queue.
pub use crate::store::keys::{FORMAT_VERSION, MIGRATING_KEY};
pub use crate::store::records::{DatasetState, EncodedItem, Failure, Item, Outcome, ScanMark};
pub use crate::store::repair::{Audit, Repair, ShardedRow};

use crate::store::blocks::{
    encode_block, Bitmap, BlockError, BlockFile, BlockRef, BLOCK_ITEMS, BLOCK_SPAN,
};
use crate::store::cache::BlockCache;
use crate::store::keys::{
    decode_shard_record, gen_key, key, meta_key, prefix, put_shard_rows, row_of,
};
use crate::store::records::{decode, encode};
use crate::store::results::{
    decode_row, encode_group_record, encode_record, encode_row, ResultLog,
};
use crate::store::row::ShardRow;
use crate::store::writes::{reclaim, Writes};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Mutex, MutexGuard};

/// Queue-level failures: all are fatal for the run (exit 1) except `Locked` (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// Another process holds `spool.lock`: one process at a time.
    #[error("queue in {path} is used by another spool process (lock held on {path}/spool.lock)")]
    Locked { path: PathBuf },
    /// The queue's folder, lock file or sled database cannot be opened or made durable, or
    /// an injected stop ended a migration.
    #[error("cannot open queue in {path}: {detail}")]
    Open { path: PathBuf, detail: String },
    /// sled failed a read or a write (a failed write also poisons the queue).
    #[error("queue storage error: {0}")]
    Storage(#[from] sled::Error),
    /// A sled record does not decode: the queue's records are damaged.
    #[error("corrupt queue record {key}: {detail}")]
    Corrupt { key: String, detail: String },
    /// The queue was written by a newer spool; it is refused, never misread.
    #[error("queue format {found} is newer than this spool understands ({supported})")]
    Version { found: u32, supported: u32 },
    /// A write failed earlier in this process; writing on could make its tear durable.
    /// `cause` is that failure, since the refusal can be the first error a run reports.
    #[error("an earlier queue write failed ({cause}), so nothing more is written to the queue (the next run repairs it)")]
    Poisoned { cause: String },
    /// A block file or results log could not be read or written, or is damaged.
    #[error(transparent)]
    File(#[from] BlockError),
    /// An enqueue offered a row at or before one already enqueued (blocks must not overlap).
    #[error("rows are enqueued in file order, once: row {row} comes after row {last}")]
    RowOrder { row: u64, last: u64 },
    /// A caller named a dataset index the queue has no counters for (never opened).
    #[error("dataset {ds} is not in the queue (it was never opened)")]
    UnknownDataset { ds: u16 },
    /// A repair finished but its marker could not be removed (the next run repairs again).
    #[error("cannot remove the repair marker {path}: {source}")]
    Marker {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Left in the queue folder by a failed write; its presence makes the next run repair.
pub const REPAIR_MARKER: &str = "needs-repair";

/// Blocks also end once their records hold this many bytes (long conversations), so a block
/// read to dispatch one item stays small.
pub(crate) const BLOCK_BYTES: usize = 4 << 20;

/// The sled database plus the in-memory copy of the counters.
pub struct Queue {
    pub(crate) db: sled::Db,
    pub(crate) tree: sled::Tree,
    pub(crate) states: Mutex<HashMap<u16, DatasetState>>,
    /// The block index, block files and decoded blocks.
    pub(crate) blocks: BlockCache,
    /// Every dataset's results log. Lock order: `states` before `results`.
    pub(crate) results: Mutex<HashMap<u16, ResultLog>>,
    pub(crate) path: PathBuf,
    /// Held while the queue is open: `spool.lock`, locked exclusively.
    pub(crate) _lock: std::fs::File,
    /// The first failed write, once one has failed: every later write is refused, naming it.
    pub(crate) poisoned: std::sync::OnceLock<String>,
    pub(crate) needs_repair: AtomicBool,
    /// Commits left before the injected torn commit (0: none armed).
    pub(crate) torn_commit_in: AtomicU64,
    /// Migration batches left before the injected stop (0: none armed).
    pub(crate) migration_stop_in: AtomicU64,
}

/// A block's rows and bytes, from items in row order.
pub(crate) fn block_of_items(items: &[EncodedItem]) -> (Vec<u64>, Vec<u8>) {
    let rows = items.iter().map(|it| it.row).collect();
    let bytes = encode_block(items.iter().map(|it| (it.id.as_bytes(), &it.record[..])));
    (rows, bytes)
}

impl Queue {
    /// Opens a dataset's results log (cutting off an unrecorded tail) and indexes its
    /// unsharded results: the records past `results_start` whose item is in no other state
    /// (a repair may have given one another; a row completed twice keeps its newest).
    pub(crate) fn open_results(&self, s: &DatasetState) -> Result<(), QueueError> {
        let ds = s.index;
        let mut log = ResultLog::open(
            ResultLog::path(&self.path, ds),
            s.results_start,
            s.results_end,
        )?;
        let dead = self.dead_results(ds, log.rows())?;
        log.forget(dead, s.results_end);
        self.lock_results().insert(ds, log);
        Ok(())
    }

    /// Of `rows` with a result in the log, those whose item is gone or in another state.
    pub(crate) fn dead_results(
        &self,
        ds: u16,
        rows: impl Iterator<Item = u64>,
    ) -> Result<Vec<u64>, QueueError> {
        let rows: Vec<u64> = rows.collect();
        let mut sharded = HashSet::new();
        if !rows.is_empty() {
            let wanted: HashSet<u64> = rows.iter().copied().collect();
            for kv in self.tree.scan_prefix(prefix(b'S', ds)) {
                let (k, v) = kv?;
                let (_, in_shard) = decode_shard_record(&k, &v)?;
                sharded.extend(in_shard.into_iter().filter(|r| wanted.contains(r)));
            }
        }
        let mut dead = Vec::new();
        for row in rows {
            let live = match self.blocks.block_of(ds, row) {
                Some(r) if r.index_of(row).is_some() => {
                    !self
                        .pending_bits(ds, &r)?
                        .is_some_and(|b| b.get(row - r.first_row))
                        && !sharded.contains(&row)
                        && !self.tree.contains_key(key(b'f', ds, row))?
                }
                _ => false,
            };
            if !live {
                dead.push(row);
            }
        }
        Ok(dead)
    }

    pub(crate) fn lock_results(&self) -> MutexGuard<'_, HashMap<u16, ResultLog>> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes blocks (their rows and bytes) to the dataset's file with one sync; returns their
    /// records, not yet stored.
    pub(crate) fn append_blocks(
        &self,
        ds: u16,
        blocks: &[(Vec<u64>, Vec<u8>)],
    ) -> Result<Vec<BlockRef>, QueueError> {
        self.writable()?;
        Ok(self.blocks.append(ds, blocks)?)
    }

    /// Arms the injected torn commit for the `nth` commit from now (tests of the modules
    /// that drive commits).
    #[cfg(test)]
    pub(crate) fn tear_commit_for_tests(&self, nth: u64) {
        self.torn_commit_in
            .store(nth, std::sync::atomic::Ordering::SeqCst);
    }

    /// Where the queue lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn lock_states(&self) -> MutexGuard<'_, HashMap<u16, DatasetState>> {
        // A poisoned lock means a panic mid-update of in-memory counters; the durable
        // ones are intact, so continuing with the last written values is safe.
        self.states.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The dataset's state, creating it (with the next free index) on first use.
    pub fn open_dataset(&self, name: &str) -> Result<DatasetState, QueueError> {
        let mut states = self.lock_states();
        if let Some(s) = states.values().find(|s| s.name == name) {
            return Ok(s.clone());
        }
        let index = states.keys().max().map(|m| m + 1).unwrap_or(0);
        let s = DatasetState {
            index,
            name: name.to_string(),
            ..Default::default()
        };
        self.writable()?;
        let r = self.tree.insert(meta_key(name), encode(&s));
        self.written(r)?;
        self.open_results(&s)?;
        states.insert(index, s.clone());
        Ok(s)
    }

    /// A dataset's current counters.
    pub fn state(&self, ds: u16) -> Option<DatasetState> {
        self.lock_states().get(&ds).cloned()
    }

    /// Every dataset known to the queue, by index.
    pub fn states(&self) -> Vec<DatasetState> {
        let mut v: Vec<_> = self.lock_states().values().cloned().collect();
        v.sort_by_key(|s| s.index);
        v
    }

    /// The stored prompt of an item.
    pub fn item(&self, ds: u16, row: u64) -> Result<Option<Item>, QueueError> {
        let Some((r, i)) = self.blocks.locate(ds, row) else {
            return Ok(None);
        };
        let b = self.blocks.block(ds, &r)?;
        let id = String::from_utf8_lossy(b.id(i)).into_owned();
        Item::decode_record(id, b.record(i))
            .map(Some)
            .map_err(|detail| {
                // Built only for the error: a path and two strings per leased item would show
                // in the hot path's allocations.
                QueueError::File(BlockError::Corrupt {
                    path: BlockFile::path(&self.path, ds),
                    offset: r.offset,
                    detail: format!("the item of row {row}: {detail}"),
                })
            })
    }

    /// The id of the item at `row`: from a cached block, else only the id's bytes are read
    /// (intake checks each duplicate candidate this way; reading its whole block, up to
    /// 4 MiB, for each would make a file of scattered duplicates quadratic).
    pub fn item_id(&self, ds: u16, row: u64) -> Result<Option<String>, QueueError> {
        let Some((r, i)) = self.blocks.locate(ds, row) else {
            return Ok(None);
        };
        let id = match self.blocks.cached(ds, &r) {
            Some(b) => String::from_utf8_lossy(b.id(i)).into_owned(),
            None => String::from_utf8_lossy(&self.blocks.file(ds)?.read_id(&r, i)?).into_owned(),
        };
        Ok(Some(id))
    }

    /// Adds new items as pending and advances the scan position, atomically.
    pub fn enqueue(
        &self,
        ds: u16,
        items: &[(u64, Item)],
        scanned_lines: u64,
        rejected: u64,
    ) -> Result<(), QueueError> {
        self.enqueue_marked(ds, items, scanned_lines, rejected, None)
    }

    /// [`enqueue`](Queue::enqueue), also recording `mark` (in the same batch) when it covers
    /// no more than the scan position and more than the mark already stored.
    pub fn enqueue_marked(
        &self,
        ds: u16,
        items: &[(u64, Item)],
        scanned_lines: u64,
        rejected: u64,
        mark: Option<ScanMark>,
    ) -> Result<(), QueueError> {
        let encoded: Vec<EncodedItem> = items
            .iter()
            .map(|(row, item)| EncodedItem::new(*row, item))
            .collect();
        self.enqueue_encoded(ds, &encoded, scanned_lines, rejected, mark)
    }

    /// The enqueue path proper: items already encoded (intake encodes on its worker
    /// threads), appended to the dataset's block file (synced), then recorded as one sled
    /// batch — a `B` and a `P` record per block, the dataset record (scan position,
    /// counters, `mark`) once. Rows must come after every row already enqueued.
    pub fn enqueue_encoded(
        &self,
        ds: u16,
        items: &[EncodedItem],
        scanned_lines: u64,
        rejected: u64,
        mark: Option<ScanMark>,
    ) -> Result<(), QueueError> {
        let mut states = self.lock_states();
        let mut s = known(&states, ds)?;
        let mut last = self.blocks.last_row(ds);
        let mut blocks: Vec<(Vec<u64>, Vec<u8>)> = Vec::new();
        let mut start = 0;
        let mut bytes = 0;
        for (i, it) in items.iter().enumerate() {
            if let Some(l) = last.filter(|&l| it.row <= l) {
                return Err(QueueError::RowOrder {
                    row: it.row,
                    last: l,
                });
            }
            last = Some(it.row);
            let first = items[start].row;
            if i > start
                && (i - start >= BLOCK_ITEMS
                    || it.row - first >= BLOCK_SPAN
                    || bytes >= BLOCK_BYTES)
            {
                blocks.push(block_of_items(&items[start..i]));
                start = i;
                bytes = 0;
            }
            bytes += it.record.len();
        }
        if start < items.len() {
            blocks.push(block_of_items(&items[start..]));
        }
        let refs = if blocks.is_empty() {
            Vec::new()
        } else {
            self.append_blocks(ds, &blocks)?
        };
        let mut batch = sled::Batch::default();
        for r in &refs {
            batch.insert(&key(b'B', ds, r.first_row)[..], r.encode());
            batch.insert(&key(b'P', ds, r.first_row)[..], &r.rows.0[..]);
        }
        s.items += items.len() as u64;
        s.rejected += rejected;
        s.scanned_lines = s.scanned_lines.max(scanned_lines);
        if let Some(m) = mark {
            if m.lines <= s.scanned_lines && s.scan_mark.is_none_or(|old| m.lines >= old.lines) {
                s.scan_mark = Some(m);
            }
        }
        batch.insert(meta_key(&s.name), encode(&s));
        self.apply_batch(batch)?;
        states.insert(ds, s);
        let n = refs.len();
        self.blocks.extend(ds, refs);
        drop(states);
        reclaim(2 * n + 1);
        Ok(())
    }

    /// Every id already enqueued for `ds` with its row, in file order, to `f` (intake seeds
    /// its duplicate filter with them when it adds rows to a dataset that has items). Reads
    /// only the blocks' id tables.
    pub fn for_each_id(&self, ds: u16, mut f: impl FnMut(&[u8], u64)) -> Result<(), QueueError> {
        let refs = self.blocks.blocks(ds);
        if refs.is_empty() {
            return Ok(());
        }
        let file = self.blocks.file(ds)?;
        for r in refs {
            let rows: Vec<u64> = r.item_rows().collect();
            file.read_ids(&r, |i, id| f(id, rows[i]))?;
        }
        Ok(())
    }

    /// Up to `limit` pending rows after `after`, in file order.
    pub fn pending_rows(
        &self,
        ds: u16,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<u64>, QueueError> {
        if after == Some(u64::MAX) {
            return Ok(Vec::new());
        }
        let from = after.map_or(0, |r| r + 1);
        let start = key(b'P', ds, self.blocks.scan_start(ds, from));
        let end = prefix(b'P', ds.wrapping_add(1));
        let mut out = Vec::with_capacity(limit.min(4096));
        let range = if ds == u16::MAX {
            self.tree.range(start.to_vec()..vec![b'P' + 1])
        } else {
            self.tree.range(start.to_vec()..end.to_vec())
        };
        for kv in range {
            let (k, v) = kv?;
            let first = row_of(&k);
            for bit in Bitmap(v.to_vec()).ones() {
                if first + bit >= from {
                    out.push(first + bit);
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Whether an item is still pending.
    pub fn is_pending(&self, ds: u16, row: u64) -> Result<bool, QueueError> {
        let Some(r) = self.blocks.block_of(ds, row) else {
            return Ok(false);
        };
        Ok(self
            .pending_bits(ds, &r)?
            .is_some_and(|b| b.get(row - r.first_row)))
    }

    /// A block's pending bitmap (`None`: none of its items is pending).
    fn pending_bits(&self, ds: u16, r: &BlockRef) -> Result<Option<Bitmap>, QueueError> {
        Ok(self
            .tree
            .get(key(b'P', ds, r.first_row))?
            .map(|v| Bitmap(v.to_vec())))
    }

    /// Applies finished attempts in one atomic batch; returns which were applied (an
    /// outcome for an item that is no longer pending is ignored, as is a generation already
    /// kept or offered twice). A `Generated` keeps its row under `g` and counts its tokens,
    /// the item staying pending; a `Closed` turns the item's kept generations (and its
    /// `result`) into one record of the results log, removes them and clears the pending
    /// bit, or fails the item when it has no row at all. `Done` and `Failed` also drop any
    /// generation kept for the item (nothing else would ever read it).
    pub fn commit(&self, outcomes: &[Outcome]) -> Result<Vec<bool>, QueueError> {
        let mut states = self.lock_states();
        let mut changed: HashMap<u16, DatasetState> = HashMap::new();
        let mut batch = Writes::default();
        let mut applied = Vec::with_capacity(outcomes.len());
        let mut seen = std::collections::HashSet::new();
        // Generations kept by this batch, by item: a `Closed` later in it gathers them too.
        let mut kept: HashMap<(u16, u64), Vec<ShardRow>> = HashMap::new();
        // Pending bitmaps read by this batch (and whether it cleared a bit), by (dataset,
        // first row).
        let mut bits: BTreeMap<(u16, u64), (Option<Bitmap>, bool)> = BTreeMap::new();
        // Results to append to each dataset's log: (row, record).
        let mut records: BTreeMap<u16, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
        for o in outcomes {
            let (ds, row) = match o {
                Outcome::Done { ds, result } | Outcome::Generated { ds, result } => {
                    (*ds, result.row)
                }
                Outcome::Failed { ds, row, .. } | Outcome::Closed { ds, row, .. } => (*ds, *row),
            };
            // An item ends once per batch; its generations may be several, each once.
            let fresh = match o {
                Outcome::Generated { result, .. } => {
                    !seen.contains(&(ds, row, None))
                        && seen.insert((ds, row, Some((result.sample, result.turn))))
                }
                _ => seen.insert((ds, row, None)),
            };
            let Some(r) = self.blocks.block_of(ds, row).filter(|_| fresh) else {
                applied.push(false);
                continue;
            };
            let (pending, cleared) = match bits.entry((ds, r.first_row)) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert((self.pending_bits(ds, &r)?, false))
                }
            };
            let bit = row - r.first_row;
            if !pending.as_ref().is_some_and(|b| b.get(bit)) {
                applied.push(false);
                continue;
            }
            if let Outcome::Generated { result, .. } = o {
                if self
                    .tree
                    .contains_key(gen_key(ds, row, result.sample, result.turn))?
                {
                    applied.push(false);
                    continue;
                }
            } else if let Some(b) = pending {
                b.set(bit, false);
                *cleared = true;
            }
            let s = match changed.get_mut(&ds) {
                Some(s) => s,
                None => {
                    let cur = known(&states, ds)?;
                    changed.entry(ds).or_insert(cur)
                }
            };
            match o {
                Outcome::Done { result, .. } => {
                    s.done += 1;
                    s.completion_tokens += u64::from(result.completion_tokens);
                    s.prompt_tokens += u64::from(result.prompt_tokens);
                    self.drop_generations(ds, row, &mut batch, &mut kept)?;
                    records
                        .entry(ds)
                        .or_default()
                        .push((row, encode_record(result)));
                }
                Outcome::Failed { failure, .. } => {
                    s.failed += 1;
                    self.drop_generations(ds, row, &mut batch, &mut kept)?;
                    batch.insert(key(b'f', ds, row), encode(failure));
                }
                Outcome::Generated { result, .. } => {
                    s.completion_tokens += u64::from(result.completion_tokens);
                    s.prompt_tokens += u64::from(result.prompt_tokens);
                    let mut v = Vec::new();
                    encode_row(result, &mut v);
                    batch.insert(gen_key(ds, row, result.sample, result.turn), v);
                    kept.entry((ds, row)).or_default().push((**result).clone());
                }
                Outcome::Closed {
                    result, partial, ..
                } => {
                    let mut rows = self.drop_generations(ds, row, &mut batch, &mut kept)?;
                    if let Some(result) = result {
                        s.completion_tokens += u64::from(result.completion_tokens);
                        s.prompt_tokens += u64::from(result.prompt_tokens);
                        rows.push((**result).clone());
                    }
                    rows.sort_by_key(|r| (r.sample, r.turn));
                    for r in &mut rows {
                        if let Some((_, why)) = partial.iter().find(|(n, _)| *n == r.sample) {
                            r.partial = Some(why.clone());
                        }
                    }
                    if rows.is_empty() {
                        s.failed += 1;
                        let reason = partial
                            .first()
                            .map_or_else(|| "no generation".to_string(), |(_, why)| why.clone());
                        let failure = Failure {
                            reason,
                            attempts: 0,
                        };
                        batch.insert(key(b'f', ds, row), encode(&failure));
                    } else {
                        s.done += 1;
                        records
                            .entry(ds)
                            .or_default()
                            .push((row, encode_group_record(&rows)));
                    }
                }
            }
            applied.push(true);
        }
        for ((ds, first), (b, cleared)) in bits {
            match b {
                Some(b) if cleared && b.is_clear() => batch.remove(key(b'P', ds, first)),
                Some(b) if cleared => batch.insert(key(b'P', ds, first), b.0),
                _ => {}
            }
        }
        // The results go to their logs, synced, before the batch records them.
        let mut logs = self.lock_results();
        let mut appended = Vec::with_capacity(records.len());
        for (ds, recs) in &records {
            self.writable()?;
            let log = logs.get(ds).ok_or_else(|| unknown(*ds))?;
            let a = log.append(recs).map_err(|e| {
                // A failed append poisons like a failed sled write: the run stops and the
                // next one repairs (the unrecorded tail is cut off at open either way).
                let e = QueueError::File(e);
                self.poison(&e);
                e
            })?;
            let s = changed.get_mut(ds).ok_or_else(|| unknown(*ds))?;
            if log.is_empty() {
                s.results_start = s.results_end;
            }
            s.results_end = a.end;
            appended.push((*ds, a.records));
        }
        for s in changed.values() {
            batch.insert(meta_key(&s.name), encode(s));
        }
        if applied.contains(&true) && self.tears_now() {
            return Err(self.torn(batch));
        }
        self.apply(batch)?;
        for (ds, at) in appended {
            if let Some(log) = logs.get_mut(&ds) {
                log.recorded(at);
            }
        }
        states.extend(changed);
        Ok(applied)
    }

    /// Removes from `batch` the generations kept for item `row` (in sled, and those kept
    /// earlier in this batch) and returns them.
    fn drop_generations(
        &self,
        ds: u16,
        row: u64,
        batch: &mut Writes,
        kept: &mut HashMap<(u16, u64), Vec<ShardRow>>,
    ) -> Result<Vec<ShardRow>, QueueError> {
        let mut rows = self.generations(ds, row)?;
        for r in &rows {
            batch.remove(gen_key(ds, row, r.sample, r.turn));
        }
        for r in kept.remove(&(ds, row)).unwrap_or_default() {
            batch.remove(gen_key(ds, row, r.sample, r.turn));
            rows.push(r);
        }
        Ok(rows)
    }

    /// The generations kept for an open item, in (sample, turn) order: what a worker
    /// builds a conversation's history from, and where a restarted item resumes.
    pub fn generations(&self, ds: u16, row: u64) -> Result<Vec<ShardRow>, QueueError> {
        let mut out = Vec::new();
        for kv in self.tree.scan_prefix(key(b'g', ds, row)) {
            let (k, v) = kv?;
            out.push(decode_generation(&k, &v)?);
        }
        Ok(out)
    }

    /// The rows of the items with kept generations (open items), in file order.
    pub fn open_items(&self, ds: u16) -> Result<Vec<u64>, QueueError> {
        let mut out: Vec<u64> = Vec::new();
        for kv in self.tree.scan_prefix(prefix(b'g', ds)) {
            let (k, _) = kv?;
            let row = row_of(&k);
            if out.last() != Some(&row) {
                out.push(row);
            }
        }
        Ok(out)
    }

    /// Results done but not yet in a shard, in file order.
    pub fn unsharded(&self, ds: u16) -> Result<Vec<ShardRow>, QueueError> {
        let logs = self.lock_results();
        match logs.get(&ds) {
            Some(log) => Ok(log.read_all()?),
            None => Ok(Vec::new()),
        }
    }

    /// The rows of one item waiting for a shard, in its record's order: what a commit that
    /// closed the item wrote (its generations and last result, partial samples marked),
    /// for the committer to hand to the archive together. Empty when none is waiting.
    pub fn unsharded_item(&self, ds: u16, row: u64) -> Result<Vec<ShardRow>, QueueError> {
        match self.lock_results().get(&ds) {
            Some(log) => Ok(log.read_item(row)?),
            None => Ok(Vec::new()),
        }
    }

    /// Whether a row's result is waiting for a shard.
    pub fn is_unsharded(&self, ds: u16, row: u64) -> Result<bool, QueueError> {
        Ok(self
            .lock_results()
            .get(&ds)
            .is_some_and(|l| l.contains(row)))
    }

    /// Records that `rows` are in shard `shard` (the file is already renamed and synced),
    /// and that the next shard gets `shard + 1`. Durable when this returns.
    pub fn mark_sharded(&self, ds: u16, shard: u64, rows: &[u64]) -> Result<(), QueueError> {
        let mut states = self.lock_states();
        let mut s = known(&states, ds)?;
        let mut batch = Writes::default();
        put_shard_rows(&mut batch, ds, shard, rows);
        s.sharded += rows.len() as u64;
        s.next_shard = s.next_shard.max(shard + 1);
        let mut logs = self.lock_results();
        let log = logs.get_mut(&ds).ok_or_else(|| unknown(ds))?;
        s.results_start = log.forget(rows.iter().copied(), s.results_end);
        let start = s.results_start;
        batch.insert(meta_key(&s.name), encode(&s));
        drop(logs);
        self.apply(batch)?;
        states.insert(ds, s);
        drop(states);
        self.flush()?;
        // Durably past the sharded records: their bytes can go.
        if let Some(log) = self.lock_results().get_mut(&ds) {
            log.release_before(start);
        }
        Ok(())
    }

    /// Every (row, shard) of a dataset's sharded items, in file order (verify).
    pub fn sharded_rows(&self, ds: u16) -> Result<Vec<(u64, u64)>, QueueError> {
        let mut out = Vec::new();
        for kv in self.tree.scan_prefix(prefix(b'S', ds)) {
            let (k, v) = kv?;
            let (shard, rows) = decode_shard_record(&k, &v)?;
            out.extend(rows.into_iter().map(|r| (r, shard)));
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Permanently failed items with their reasons, in file order.
    pub fn failures(&self, ds: u16, limit: usize) -> Result<Vec<(u64, Failure)>, QueueError> {
        let mut out = Vec::new();
        for kv in self.tree.scan_prefix(prefix(b'f', ds)).take(limit) {
            let (k, v) = kv?;
            out.push((row_of(&k), decode(&k, &v)?));
        }
        Ok(out)
    }

    /// Moves every failed item of `ds` back to pending; returns how many.
    pub fn retry_failed(&self, ds: u16) -> Result<u64, QueueError> {
        let mut states = self.lock_states();
        let mut s = match states.get(&ds) {
            Some(s) => s.clone(),
            None => return Ok(0),
        };
        let mut batch = Writes::default();
        let mut n = 0u64;
        let mut bits: BTreeMap<u64, Bitmap> = BTreeMap::new();
        for kv in self.tree.scan_prefix(prefix(b'f', ds)) {
            let (k, _) = kv?;
            let row = row_of(&k);
            batch.remove(k.clone());
            n += 1;
            let Some(r) = self.blocks.block_of(ds, row) else {
                continue;
            };
            let b = match bits.entry(r.first_row) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => e.insert(
                    self.pending_bits(ds, &r)?
                        .unwrap_or_else(|| Bitmap::empty(r.span())),
                ),
            };
            b.set(row - r.first_row, true);
        }
        for (first, b) in bits {
            batch.insert(key(b'P', ds, first), b.0);
        }
        s.failed -= n.min(s.failed);
        batch.insert(meta_key(&s.name), encode(&s));
        self.apply(batch)?;
        states.insert(ds, s);
        drop(states);
        self.flush()?;
        Ok(n)
    }

    /// Adds tokens thrown away by cancelled requests to the dataset's record.
    pub fn add_wasted(&self, ds: u16, tokens: u64) -> Result<(), QueueError> {
        let mut states = self.lock_states();
        if let Some(s) = states.get_mut(&ds) {
            s.wasted_tokens += tokens;
            self.writable()?;
            let r = self.tree.insert(meta_key(&s.name), encode(&*s));
            self.written(r)?;
        }
        Ok(())
    }
}

/// A `g` record's generation; a value that does not decode is a corrupt record.
pub(crate) fn decode_generation(k: &[u8], v: &[u8]) -> Result<ShardRow, QueueError> {
    decode_row(v).map_err(|detail| QueueError::Corrupt {
        key: format!("g{}/{}", crate::store::keys::ds_of(k), row_of(k)),
        detail,
    })
}

/// A dataset's counters, which must exist once the dataset was opened.
pub(crate) fn known(
    states: &HashMap<u16, DatasetState>,
    ds: u16,
) -> Result<DatasetState, QueueError> {
    states.get(&ds).cloned().ok_or_else(|| unknown(ds))
}

/// The error for a dataset index with no counters.
pub(crate) fn unknown(ds: u16) -> QueueError {
    QueueError::UnknownDataset { ds }
}

#[cfg(test)]
mod tests;
