//! Durable results → Parquet shards: the commit protocol between the queue and the files.
//!
//! 1. A worker's result is committed to the queue (appended to the dataset's results log,
//!    synced, then recorded with the counters) and the queue is flushed (fsync) *before*
//!    the row is handed to the archive. "Unsharded" below: in the results log, recorded.
//! 2. The archive appends rows to a temporary shard file; when the shard is full (or at
//!    shutdown) it is closed, fsynced, renamed to `part-N.parquet` and the directory fsynced.
//! 3. Only then are its rows recorded as sharded (`S` records: shard N's rows), `next_shard`
//!    N+1 and the log's unsharded part a new start, in one queue batch, flushed.
//!
//! A crash before 2's rename leaves a temporary file (deleted by [`Archive::recover`]) and
//! the rows still unsharded (written again into a new shard). A crash between the rename
//! and 3 leaves a complete `part-N.parquet` with N ≥ `next_shard`: recovery *adopts* it,
//! recording exactly its rows as sharded. Hence:
//!
//! Invariant: every done item is either unsharded (no shard yet) or sharded (listed by an
//! `S` record of exactly one shard file); a `part-*.parquet` file is complete and its rows
//! are never written again; an item's rows (one per generation) are never split between
//! shards, as the limits are checked between items.
//!
//! Rows handed to [`Archive::add`] are buffered in memory and converted to Arrow in
//! batches of up to [`APPEND_BATCH_ROWS`] (one Parquet row group), not one small batch per
//! group commit, because per-batch Arrow/Parquet overhead is paid per call and completions
//! arrive by the thousand per second. The buffer holds only rows already durable in the
//! queue, so a crash loses nothing (recovery seeds the archive from the unsharded results),
//! and it is written out before any limit is checked or the shard sealed, so shards close
//! on the configured limits exactly.

use crate::knobs::Faults;
use crate::output::reader;
use crate::output::schema::META_COUNT_SOURCE;
use crate::output::shard::{self, SealedShard, ShardError, ShardLimits};
use crate::output::writer::{row_bytes, ShardWriter, ROW_GROUP_MAX_ROWS};
use crate::store::queue::{Queue, QueueError, Repair, ShardedRow};
use crate::store::row::ShardRow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Failures of the archive; all stop the run (exit 1), nothing already durable is lost.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("cannot list {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("shard {path} holds row {row} (id `{id}`), which the queue does not have waiting for a shard; refusing to guess (run `spool verify`)")]
    Inconsistent { path: PathBuf, row: u64, id: String },
    /// [`Archive::seal`] was asked for a dataset with no open shard.
    #[error("dataset `{dataset}` has no open shard to seal")]
    NotOpen { dataset: String },
}

/// Repairs every dataset of a queue left torn by a failed write (see [`Queue::repair`]),
/// from the shard files in `output_dir/<dataset>/`, then clears the marker. A shard that
/// cannot be read stops the repair: guessing could generate a row twice.
pub fn repair_queue(
    queue: &Queue,
    output_dir: &Path,
) -> Result<Vec<(String, Repair)>, ArchiveError> {
    let mut out = Vec::new();
    for state in queue.states() {
        let dir = output_dir.join(&state.name);
        let mut in_shards: HashMap<u64, ShardedRow> = HashMap::new();
        let mut shards: Vec<(u64, PathBuf)> = list(&dir)?
            .into_iter()
            .filter_map(|(name, path)| shard::parse_shard_index(&name).map(|i| (i, path)))
            .collect();
        // Lowest index first: of two copies of a row (which `spool verify` reports), the
        // first shard's is the one recorded.
        shards.sort();
        for (index, path) in shards {
            for c in reader::read_counts(&path)? {
                let r = in_shards.entry(c.row).or_insert(ShardedRow {
                    shard: index,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                });
                // An item's rows (its generations) are all in one shard: their tokens add up.
                if r.shard == index {
                    r.prompt_tokens += u64::from(c.prompt_tokens);
                    r.completion_tokens += u64::from(c.completion_tokens);
                }
            }
        }
        out.push((state.name.clone(), queue.repair(state.index, &in_shards)?));
    }
    queue.finish_repair()?;
    Ok(out)
}

/// A dataset folder's entries as (file name, path); none when the folder does not exist.
fn list(dir: &Path) -> Result<Vec<(String, PathBuf)>, ArchiveError> {
    let entries = shard::folder_entries(dir).map_err(|source| ArchiveError::List {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(entries
        .into_iter()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect())
}

/// What recovery found in a dataset's folder.
#[derive(Debug, Default, Clone)]
pub struct Recovery {
    pub temp_files_removed: usize,
    pub shards_adopted: usize,
    pub rows_adopted: usize,
}

/// Rows buffered per open shard before they are converted and appended (one row group).
pub const APPEND_BATCH_ROWS: usize = ROW_GROUP_MAX_ROWS;
/// ... or once their text and ids reach this many bytes, whichever first.
const APPEND_BATCH_BYTES: usize = 8 << 20;

struct Open {
    writer: ShardWriter,
    /// Durable rows not yet appended to the writer (see the module docs).
    pending: Vec<ShardRow>,
    pending_bytes: usize,
    /// Items (their `row`) of this shard, appended or pending: what the queue marks sharded.
    rows: Vec<u64>,
    /// Shard rows, appended or pending (an item has one per generation).
    row_count: usize,
    /// The same items, to refuse a second copy of one (a defence: the job never sends one).
    seen: std::collections::HashSet<u64>,
}

impl Open {
    /// Converts and appends the buffered rows.
    fn append_pending(&mut self) -> Result<(), ShardError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.writer.append(&self.pending)?;
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }
}

/// Owns the open shard of every dataset; runs on its own thread, off the request path.
pub struct Archive {
    queue: Arc<Queue>,
    output_dir: PathBuf,
    limits: ShardLimits,
    datasets: HashMap<u16, ArchiveDataset>,
    open: HashMap<u16, Open>,
    /// Test-harness fault points, given to every shard writer.
    faults: Faults,
}

/// What the archive knows of a dataset: its folder name and its shards' metadata.
#[derive(Debug, Clone)]
pub struct ArchiveDataset {
    pub name: String,
    /// Key-value metadata of every shard (version, config and tokenizer digests, sampling).
    pub metadata: Vec<(String, String)>,
}

impl Archive {
    /// An archive writing under `output_dir/<dataset>/`.
    pub fn new(
        queue: Arc<Queue>,
        output_dir: &Path,
        limits: ShardLimits,
        datasets: HashMap<u16, ArchiveDataset>,
        faults: &Faults,
    ) -> Self {
        Self {
            queue,
            output_dir: output_dir.to_path_buf(),
            limits,
            datasets,
            open: HashMap::new(),
            faults: *faults,
        }
    }

    fn name(&self, ds: u16) -> &str {
        self.datasets
            .get(&ds)
            .map(|d| d.name.as_str())
            .unwrap_or("unknown")
    }

    fn dir(&self, ds: u16) -> PathBuf {
        self.output_dir.join(self.name(ds))
    }

    /// Brings a dataset's folder and the queue back into agreement after any stop.
    pub fn recover(&self, ds: u16) -> Result<Recovery, ArchiveError> {
        let dir = self.dir(ds);
        let mut rec = Recovery::default();
        let next = self.queue.state(ds).map(|s| s.next_shard).unwrap_or(0);
        let mut unrecorded = Vec::new();
        for (name, path) in list(&dir)? {
            if shard::is_temp_file(&name) {
                let _ = std::fs::remove_file(&path);
                rec.temp_files_removed += 1;
            } else if let Some(i) = shard::parse_shard_index(&name) {
                if i >= next {
                    unrecorded.push((i, path));
                }
            }
        }
        unrecorded.sort();
        for (index, path) in unrecorded {
            let keys = reader::read_keys(&path)?;
            let mut rows = Vec::with_capacity(keys.len());
            for (id, row) in keys {
                if !self.queue.is_unsharded(ds, row)? {
                    return Err(ArchiveError::Inconsistent { path, row, id });
                }
                // An item's rows are consecutive in its shard: it is marked once.
                if rows.last() != Some(&row) {
                    rows.push(row);
                }
            }
            self.queue.mark_sharded(ds, index, &rows)?;
            tracing::info!(path = %path.display(), rows = rows.len(), "adopted a shard finished before the last stop");
            rec.shards_adopted += 1;
            rec.rows_adopted += rows.len();
        }
        Ok(rec)
    }

    /// A new shard for dataset `ds`, numbered by the queue's `next_shard`, its metadata
    /// stamped with where `source` says the rows' token counts came from.
    fn open_shard(&self, ds: u16, source: Option<&str>) -> Result<Open, ArchiveError> {
        let index = self.queue.state(ds).map(|s| s.next_shard).unwrap_or(0);
        let mut meta = self
            .datasets
            .get(&ds)
            .map(|d| d.metadata.clone())
            .unwrap_or_default();
        if let Some(src) = source {
            meta.push((META_COUNT_SOURCE.into(), src.to_string()));
        }
        let writer = ShardWriter::create(&self.dir(ds), index, &self.limits, meta, &self.faults)?;
        Ok(Open {
            writer,
            pending: Vec::new(),
            pending_bytes: 0,
            rows: Vec::new(),
            row_count: 0,
            seen: Default::default(),
        })
    }

    /// Appends durable results; returns the shards sealed on the way. `source` says where
    /// the rows' token counts came from (`upstream::CountSource::name`, stamped into the
    /// shard that opens for them). An
    /// item's rows come together, consecutively, in one call (as
    /// [`Queue::unsharded_item`] gives them): a later row of an item already taken is
    /// refused as a second copy.
    pub fn add(
        &mut self,
        ds: u16,
        source: Option<&str>,
        rows: Vec<ShardRow>,
    ) -> Result<Vec<SealedShard>, ArchiveError> {
        let mut sealed = Vec::new();
        let mut rest = rows.into_iter().peekable();
        while rest.peek().is_some() {
            let open = match self.open.remove(&ds) {
                Some(open) => open,
                None => self.open_shard(ds, source)?,
            };
            let open = self.open.entry(ds).or_insert(open);
            // Limits are checked between items: an item's rows (its generations, consecutive
            // here) all go to this shard, so max_rows is exact for one-row items.
            while open.row_count < self.limits.max_rows {
                let Some(first) = rest.next() else { break };
                let item = first.row;
                let mut rows = vec![first];
                while let Some(r) = rest.next_if(|r| r.row == item) {
                    rows.push(r);
                }
                if !open.seen.insert(item) {
                    tracing::error!(row = item, id = %rows[0].id, "item offered twice to the open shard: ignored");
                    continue;
                }
                open.rows.push(item);
                open.row_count += rows.len();
                for r in rows {
                    open.pending_bytes += row_bytes(&r);
                    open.pending.push(r);
                }
                if open.pending.len() >= APPEND_BATCH_ROWS
                    || open.pending_bytes >= APPEND_BATCH_BYTES
                    || open.writer.estimated_bytes() + open.pending_bytes as u64
                        >= self.limits.max_bytes
                {
                    open.append_pending()?;
                    if open.writer.is_full() {
                        break;
                    }
                }
            }
            if open.row_count >= self.limits.max_rows {
                open.append_pending()?;
            }
            if open.writer.is_full() {
                sealed.push(self.seal(ds)?);
            }
        }
        Ok(sealed)
    }

    /// Closes a dataset's open shard (end of run, shutdown).
    pub fn seal(&mut self, ds: u16) -> Result<SealedShard, ArchiveError> {
        let Some(mut open) = self.open.remove(&ds) else {
            return Err(ArchiveError::NotOpen {
                dataset: self.name(ds).to_string(),
            });
        };
        open.append_pending()?;
        let sealed = open.writer.finish()?;
        self.queue.mark_sharded(ds, sealed.index, &open.rows)?;
        tracing::info!(
            dataset = %self.name(ds),
            path = %sealed.path.display(), rows = sealed.rows, bytes = sealed.bytes,
            "shard written"
        );
        Ok(sealed)
    }

    /// Seals every open shard.
    pub fn seal_all(&mut self) -> Result<Vec<(u16, SealedShard)>, ArchiveError> {
        let mut out = Vec::new();
        let open: Vec<u16> = self.open.keys().copied().collect();
        for ds in open {
            out.push((ds, self.seal(ds)?));
        }
        Ok(out)
    }

    /// Drops the open shards' temporary files (their rows stay durable in the queue).
    pub fn abandon_all(&mut self) {
        for (_, o) in self.open.drain() {
            o.writer.abandon();
        }
    }
}

#[cfg(test)]
impl Archive {
    /// An archive of the one dataset `ds`, named `name`, with no shard metadata and no
    /// faults armed: what the tests of the archive and of its thread start from.
    pub(crate) fn of_one_dataset(
        queue: Arc<Queue>,
        out: &Path,
        ds: u16,
        name: &str,
        limits: ShardLimits,
    ) -> Archive {
        let dataset = ArchiveDataset {
            name: name.into(),
            metadata: Vec::new(),
        };
        Archive::new(
            queue,
            out,
            limits,
            HashMap::from([(ds, dataset)]),
            &Faults::default(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(i: u64) -> ShardRow {
        ShardRow {
            prompt: format!("prompt {i}"),
            completion: format!(" w{i}"),
            completion_token_ids: Some(vec![i as u32]),
            prompt_tokens: 2,
            completion_tokens: 1,
            ..ShardRow::for_tests(format!("id-{i}"), "d", i)
        }
    }

    /// Buffering (rows appended a row group at a time) keeps `max_rows` exact, writes
    /// the buffer out before sealing, and loses no row at the end of a run.
    #[test]
    fn buffered_rows_fill_shards_exactly_and_are_written_when_sealed() {
        let tmp = tempfile::tempdir().unwrap();
        let queue = Arc::new(Queue::open(&tmp.path().join("q")).unwrap());
        let ds = queue.open_dataset("d").unwrap().index;
        let limits = ShardLimits {
            max_rows: 3,
            max_bytes: 1 << 30,
            compression_level: 3,
        };
        let out = tmp.path().join("out");
        let mut archive = Archive::of_one_dataset(queue, &out, ds, "d", limits);
        let mut sealed = Vec::new();
        for chunk in (0..7u64).collect::<Vec<_>>().chunks(2) {
            let rows = chunk.iter().map(|&i| row(i)).collect();
            sealed.extend(archive.add(ds, None, rows).unwrap());
        }
        assert_eq!(
            sealed.iter().map(|s| s.rows).collect::<Vec<_>>(),
            vec![3, 3]
        );
        let last = archive.seal_all().unwrap();
        assert_eq!(last.len(), 1);
        sealed.push(last.into_iter().next().unwrap().1);
        let mut all = Vec::new();
        for s in &sealed {
            all.extend(
                reader::read_rows(&s.path)
                    .unwrap()
                    .into_iter()
                    .map(|r| r.row),
            );
        }
        assert_eq!(all, (0..7).collect::<Vec<_>>());
    }

    /// An item's rows (its generations) are never split between shards: the row limit is
    /// checked between items, so a shard may pass it by the rest of the item that crossed
    /// it, and the queue marks each item once, in the shard that holds all its rows.
    #[test]
    fn an_item_is_never_split_between_shards() {
        let tmp = tempfile::tempdir().unwrap();
        let queue = Arc::new(Queue::open(&tmp.path().join("q")).unwrap());
        let ds = queue.open_dataset("d").unwrap().index;
        let limits = ShardLimits {
            max_rows: 3,
            max_bytes: 1 << 30,
            compression_level: 3,
        };
        let out = tmp.path().join("out");
        let mut archive = Archive::of_one_dataset(queue.clone(), &out, ds, "d", limits);
        let gens = |item: u64, n: u32| -> Vec<ShardRow> {
            (0..n).map(|turn| ShardRow { turn, ..row(item) }).collect()
        };
        let mut sealed = archive.add(ds, None, gens(0, 1)).unwrap();
        let mut second = gens(1, 3);
        second.extend(gens(2, 2));
        sealed.extend(archive.add(ds, None, second).unwrap());
        sealed.extend(archive.add(ds, None, gens(3, 1)).unwrap());
        assert_eq!(sealed.len(), 2);
        let rows_of = |s: &SealedShard| -> Vec<(u64, u32)> {
            reader::read_rows(&s.path)
                .unwrap()
                .into_iter()
                .map(|r| (r.row, r.turn))
                .collect()
        };
        assert_eq!(rows_of(&sealed[0]), vec![(0, 0), (1, 0), (1, 1), (1, 2)]);
        assert_eq!(rows_of(&sealed[1]), vec![(2, 0), (2, 1), (3, 0)]);
        assert_eq!(
            queue.sharded_rows(ds).unwrap(),
            vec![(0, 0), (1, 0), (2, 1), (3, 1)]
        );
        assert_eq!(queue.state(ds).unwrap().sharded, 4);
    }

    /// Sealing a dataset with no open shard is refused as exactly that, naming the dataset.
    #[test]
    fn sealing_without_an_open_shard_names_the_dataset() {
        let tmp = tempfile::tempdir().unwrap();
        let queue = Arc::new(Queue::open(&tmp.path().join("q")).unwrap());
        let ds = queue.open_dataset("d").unwrap().index;
        let out = tmp.path().join("out");
        let mut archive = Archive::of_one_dataset(queue, &out, ds, "d", ShardLimits::default());
        let err = archive.seal(ds).unwrap_err();
        assert!(
            matches!(&err, ArchiveError::NotOpen { dataset } if dataset == "d"),
            "{err}"
        );
        assert!(archive.seal_all().unwrap().is_empty());
    }
}
