//! The queue's in-memory view of its item blocks: every dataset's `B` records (the block
//! index), its open block file, and the few blocks last decoded.
//!
//! Invariants: the index holds exactly the `B` records sled holds, by first row (blocks never
//! overlap), and changes only after sled has them; a decoded block is keyed by (dataset,
//! first row, offset), and the cache is cleared whenever blocks are dropped, so a block
//! written again at the same place is read afresh.

use crate::store::blocks::{Bitmap, Block, BlockError, BlockFile, BlockRef};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

/// Blocks kept decoded for [`Queue::item`](crate::store::queue::Queue::item): dispatch and
/// intake's checks read rows in file order, so a few recent blocks serve nearly every read.
const CACHED_BLOCKS: usize = 8;

/// A decoded block's identity: (dataset, first row, offset).
type BlockKey = (u16, u64, u64);

/// The block index, block files and decoded blocks of one queue.
pub(crate) struct BlockCache {
    /// The queue's folder, where the block files are.
    dir: PathBuf,
    /// Every dataset's blocks by first row: the `B` records, kept in memory (a few hundred
    /// bytes per thousand items).
    index: Mutex<HashMap<u16, Vec<Arc<BlockRef>>>>,
    files: Mutex<HashMap<u16, Arc<BlockFile>>>,
    decoded: Mutex<VecDeque<(BlockKey, Arc<Block>)>>,
}

impl BlockCache {
    /// The view of the queue in `dir` whose `B` records are `index`.
    pub(crate) fn new(dir: PathBuf, index: HashMap<u16, Vec<Arc<BlockRef>>>) -> Self {
        BlockCache {
            dir,
            index: Mutex::new(index),
            files: Mutex::new(HashMap::new()),
            decoded: Mutex::new(VecDeque::new()),
        }
    }

    fn lock_index(&self) -> MutexGuard<'_, HashMap<u16, Vec<Arc<BlockRef>>>> {
        // A panic while the index was locked cannot leave it half-changed: every change is
        // one push, extend or insert.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_decoded(&self) -> MutexGuard<'_, VecDeque<(BlockKey, Arc<Block>)>> {
        self.decoded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A dataset's blocks, in row order.
    pub(crate) fn blocks(&self, ds: u16) -> Vec<Arc<BlockRef>> {
        self.lock_index().get(&ds).cloned().unwrap_or_default()
    }

    /// Records new blocks of a dataset, after every block already known (sled has them).
    pub(crate) fn extend(&self, ds: u16, refs: impl IntoIterator<Item = BlockRef>) {
        self.lock_index()
            .entry(ds)
            .or_default()
            .extend(refs.into_iter().map(Arc::new));
    }

    /// Keeps only `kept` of a dataset's blocks (a repair dropped the rest) and forgets every
    /// decoded block.
    pub(crate) fn keep_only(&self, ds: u16, kept: Vec<Arc<BlockRef>>) {
        self.lock_index().insert(ds, kept);
        self.lock_decoded().clear();
    }

    /// The dataset's block file, opened on first use (cutting off an unrecorded tail).
    pub(crate) fn file(&self, ds: u16) -> Result<Arc<BlockFile>, BlockError> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(&ds) {
            return Ok(f.clone());
        }
        let f = Arc::new(BlockFile::open(
            BlockFile::path(&self.dir, ds),
            self.blocks_end(ds),
            "an item append (an interrupted enqueue)",
        )?);
        files.insert(ds, f.clone());
        Ok(f)
    }

    /// The end of the dataset's last recorded block in its file.
    pub(crate) fn blocks_end(&self, ds: u16) -> u64 {
        self.lock_index()
            .get(&ds)
            .and_then(|v| v.last())
            .map_or(0, |r| r.offset + u64::from(r.len))
    }

    /// The last item row of the dataset, if it has items.
    pub(crate) fn last_row(&self, ds: u16) -> Option<u64> {
        let index = self.lock_index();
        index.get(&ds)?.last()?.last_row()
    }

    /// The block whose rows include `row`.
    pub(crate) fn block_of(&self, ds: u16, row: u64) -> Option<Arc<BlockRef>> {
        let index = self.lock_index();
        let v = index.get(&ds)?;
        let i = v.partition_point(|r| r.first_row <= row).checked_sub(1)?;
        let r = &v[i];
        (row < r.first_row + r.span()).then(|| r.clone())
    }

    /// The first row of the block holding `row` or the last one before it (0 if none): where
    /// a scan for rows from `row` on starts.
    pub(crate) fn scan_start(&self, ds: u16, row: u64) -> u64 {
        let index = self.lock_index();
        index
            .get(&ds)
            .and_then(|v| {
                let i = v.partition_point(|r| r.first_row <= row).checked_sub(1)?;
                Some(v[i].first_row)
            })
            .unwrap_or(0)
    }

    /// The block holding the item at `row`, and its position there.
    pub(crate) fn locate(&self, ds: u16, row: u64) -> Option<(Arc<BlockRef>, usize)> {
        let r = self.block_of(ds, row)?;
        let i = r.index_of(row)?;
        Some((r, i))
    }

    /// A block's items, if they are decoded already.
    pub(crate) fn cached(&self, ds: u16, r: &BlockRef) -> Option<Arc<Block>> {
        let id = (ds, r.first_row, r.offset);
        self.lock_decoded()
            .iter()
            .find(|(k, _)| *k == id)
            .map(|(_, b)| b.clone())
    }

    /// A block's items, from the cache or read (and checked) from its file.
    pub(crate) fn block(&self, ds: u16, r: &BlockRef) -> Result<Arc<Block>, BlockError> {
        if let Some(b) = self.cached(ds, r) {
            return Ok(b);
        }
        let b = Arc::new(self.file(ds)?.read(r)?);
        let mut decoded = self.lock_decoded();
        if decoded.len() >= CACHED_BLOCKS {
            decoded.pop_front();
        }
        decoded.push_back(((ds, r.first_row, r.offset), b.clone()));
        Ok(b)
    }

    /// Writes blocks (their rows and bytes) to the dataset's file with one sync; returns their
    /// records, not yet stored.
    pub(crate) fn append(
        &self,
        ds: u16,
        blocks: &[(Vec<u64>, Vec<u8>)],
    ) -> Result<Vec<BlockRef>, BlockError> {
        let file = self.file(ds)?;
        let bytes: Vec<&[u8]> = blocks.iter().map(|b| &b.1[..]).collect();
        let offsets = file.append(&bytes)?;
        Ok(blocks
            .iter()
            .zip(offsets)
            .map(|((rows, bytes), offset)| {
                let first_row = rows[0];
                let mut bits = Bitmap::empty(rows[rows.len() - 1] - first_row + 1);
                for r in rows {
                    bits.set(r - first_row, true);
                }
                BlockRef {
                    first_row,
                    offset,
                    len: bytes.len() as u32,
                    count: rows.len() as u32,
                    xxh64: twox_hash::XxHash64::oneshot(0, bytes),
                    rows: bits,
                }
            })
            .collect())
    }
}
