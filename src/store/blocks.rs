//! Item blocks: the prompts of enqueued items, appended to one file per dataset.
//!
//! An enqueue writes its items as blocks of at most [`BLOCK_ITEMS`] items to
//! `data_dir/items/<ds>.blocks`, syncs the file, and only then records each block in sled
//! (a `B` record: [`BlockRef`]). A block is never rewritten, so an item costs one sequential
//! append instead of per-item B-tree inserts, and sled holds a few records per thousand
//! items (its memory and restart time do not grow with the prompts' bytes).
//!
//! Block bytes (little-endian): `count: u32`, `count` id lengths (`u32`), the ids, `count`
//! record lengths (`u32`), the records ([`Item::encode_record`](crate::store::records::Item::encode_record)). Items
//! are in row order; the [`BlockRef`]'s row bitmap says which rows they are.
//!
//! Invariants: bytes are in the file and synced before a `B` record names them; the file's
//! bytes past the last recorded block are a torn append and are cut off before the next one
//! ([`BlockFile::open`]); every read checks the block's xxHash64 against its record, so a
//! damaged file is reported (naming the file and offset), never decoded as other items.
//!
//! This is also the queue's file layer: a file or directory a queue record will name is
//! created durably ([`create_dir_durably`], [`sync_parent`]) — its directory is fsynced
//! before anything is written that relies on it, because a power cut can otherwise keep the
//! record and lose the file's name.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

/// The mode of the folders spool makes for others to read (the queue's, the shards'):
/// owner and group (`output::files` re-exports it beside the file modes).
pub const DIR_MODE: u32 = 0o750;
use std::sync::Mutex;

/// Items per block: a block is the unit read back to dispatch an item (cached), so it is
/// kept to about a megabyte.
pub const BLOCK_ITEMS: usize = 1024;
/// Rows a block may span (items plus the rejected lines between them), so its bitmaps stay
/// small (≤ 1 KiB): the pending bitmap is rewritten on every completion.
pub const BLOCK_SPAN: u64 = 8192;

/// Where and what a block is: the value of its `B` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRef {
    pub first_row: u64,
    pub offset: u64,
    pub len: u32,
    pub count: u32,
    pub xxh64: u64,
    /// Bit `i` set: row `first_row + i` is one of the block's items.
    pub rows: Bitmap,
}

impl BlockRef {
    /// The `B` record's value (the key holds `first_row`).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(28 + self.rows.0.len());
        v.extend_from_slice(&self.offset.to_be_bytes());
        v.extend_from_slice(&self.len.to_be_bytes());
        v.extend_from_slice(&self.count.to_be_bytes());
        v.extend_from_slice(&self.xxh64.to_be_bytes());
        v.extend_from_slice(&self.rows.0);
        v
    }

    /// Reads a `B` record back; `None` when it is malformed.
    pub fn decode(first_row: u64, v: &[u8]) -> Option<BlockRef> {
        if v.len() < 24 {
            return None;
        }
        let r = BlockRef {
            first_row,
            offset: u64::from_be_bytes(v[0..8].try_into().ok()?),
            len: u32::from_be_bytes(v[8..12].try_into().ok()?),
            count: u32::from_be_bytes(v[12..16].try_into().ok()?),
            xxh64: u64::from_be_bytes(v[16..24].try_into().ok()?),
            rows: Bitmap(v[24..].to_vec()),
        };
        (r.rows.count() == u64::from(r.count)).then_some(r)
    }

    /// Rows covered, items or not: `first_row .. first_row + span`.
    pub fn span(&self) -> u64 {
        self.rows.bits()
    }

    /// The item's position in the block, when `row` is one of its items.
    pub fn index_of(&self, row: u64) -> Option<usize> {
        let bit = row.checked_sub(self.first_row)?;
        self.rows.get(bit).then(|| self.rows.rank(bit))
    }

    /// The block's last item row (its span ends there).
    pub fn last_row(&self) -> Option<u64> {
        let (i, b) = self
            .rows
            .0
            .iter()
            .enumerate()
            .rev()
            .find(|(_, b)| **b != 0)?;
        Some(self.first_row + i as u64 * 8 + 7 - u64::from(b.leading_zeros()))
    }

    /// The block's item rows, ascending.
    pub fn item_rows(&self) -> impl Iterator<Item = u64> + '_ {
        let first = self.first_row;
        self.rows.ones().map(move |b| first + b)
    }
}

/// A bit set over a block's rows (bit `i` in byte `i / 8`, least significant first).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Bitmap(pub Vec<u8>);

impl Bitmap {
    /// All clear, for `span` rows.
    pub fn empty(span: u64) -> Bitmap {
        Bitmap(vec![0; span.div_ceil(8) as usize])
    }

    pub fn bits(&self) -> u64 {
        self.0.len() as u64 * 8
    }

    pub fn get(&self, i: u64) -> bool {
        self.0
            .get((i / 8) as usize)
            .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    /// Sets bit `i`; the bitmap must cover it.
    pub fn set(&mut self, i: u64, on: bool) {
        let b = &mut self.0[(i / 8) as usize];
        if on {
            *b |= 1 << (i % 8);
        } else {
            *b &= !(1 << (i % 8));
        }
    }

    pub fn count(&self) -> u64 {
        self.0.iter().map(|b| u64::from(b.count_ones())).sum()
    }

    pub fn is_clear(&self) -> bool {
        self.0.iter().all(|&b| b == 0)
    }

    /// Set bits before `i`.
    pub fn rank(&self, i: u64) -> usize {
        let whole = (i / 8) as usize;
        let mut n: usize = self.0[..whole.min(self.0.len())]
            .iter()
            .map(|b| b.count_ones() as usize)
            .sum();
        if let Some(b) = self.0.get(whole) {
            n += (b & ((1u16 << (i % 8)) - 1) as u8).count_ones() as usize;
        }
        n
    }

    /// Set bits, ascending.
    pub fn ones(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().enumerate().flat_map(|(i, &b)| {
            (0..8u64).filter_map(move |j| (b & (1 << j) != 0).then_some(i as u64 * 8 + j))
        })
    }
}

/// One block's bytes, built from items in row order (`(id, record)`).
pub fn encode_block<'a>(items: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
    let count = items.clone().count();
    let size: usize = items.clone().map(|(i, r)| 8 + i.len() + r.len()).sum();
    let mut v = Vec::with_capacity(4 + size);
    v.extend_from_slice(&(count as u32).to_le_bytes());
    for (id, _) in items.clone() {
        v.extend_from_slice(&(id.len() as u32).to_le_bytes());
    }
    for (id, _) in items.clone() {
        v.extend_from_slice(id);
    }
    for (_, rec) in items.clone() {
        v.extend_from_slice(&(rec.len() as u32).to_le_bytes());
    }
    for (_, rec) in items {
        v.extend_from_slice(rec);
    }
    v
}

/// A block read back and checked: ids and records by position.
#[derive(Debug)]
pub struct Block {
    bytes: Vec<u8>,
    ids: Vec<(usize, usize)>,
    records: Vec<(usize, usize)>,
}

impl Block {
    /// Splits `bytes` into its items; `Err` names what does not add up.
    pub fn parse(bytes: Vec<u8>) -> Result<Block, String> {
        let mut at = 0usize;
        let count = read_u32(&bytes, &mut at)? as usize;
        let ids = spans(&bytes, &mut at, count)?;
        let records = spans(&bytes, &mut at, count)?;
        if at != bytes.len() {
            return Err(format!("{} bytes after the last record", bytes.len() - at));
        }
        Ok(Block {
            bytes,
            ids,
            records,
        })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn id(&self, i: usize) -> &[u8] {
        let (a, b) = self.ids[i];
        &self.bytes[a..b]
    }

    pub fn record(&self, i: usize) -> &[u8] {
        let (a, b) = self.records[i];
        &self.bytes[a..b]
    }
}

fn read_u32(bytes: &[u8], at: &mut usize) -> Result<u32, String> {
    let b = bytes
        .get(*at..*at + 4)
        .ok_or_else(|| format!("truncated at byte {at}"))?;
    *at += 4;
    Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
}

/// `count` lengths then the bytes they measure, as (start, end) pairs.
fn spans(bytes: &[u8], at: &mut usize, count: usize) -> Result<Vec<(usize, usize)>, String> {
    let mut lens = Vec::with_capacity(count);
    for _ in 0..count {
        lens.push(read_u32(bytes, at)? as usize);
    }
    let mut out = Vec::with_capacity(count);
    for n in lens {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| format!("a length of {n} runs past the block's end"))?;
        out.push((*at, end));
        *at = end;
    }
    Ok(out)
}

/// Reads the binary records of the queue's files (items, results): little-endian integers,
/// text and id lists as a u32 length (`u32::MAX`: absent) then the bytes or u32s. Errors
/// say what does not add up, for the caller to name the file and offset.
pub(crate) struct RecordReader<'a>(pub &'a [u8]);

impl<'a> RecordReader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "record cut short ({} bytes left, {n} needed)",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A length, `None` for the `u32::MAX` that marks an absent field.
    pub fn len(&mut self) -> Result<Option<usize>, String> {
        Ok(match self.u32()? {
            u32::MAX => None,
            n => Some(n as usize),
        })
    }

    pub fn opt_text(&mut self, what: &str) -> Result<Option<String>, String> {
        match self.len()? {
            None => Ok(None),
            Some(n) => String::from_utf8(self.take(n)?.to_vec())
                .map(Some)
                .map_err(|_| format!("{what} is not UTF-8")),
        }
    }

    pub fn text(&mut self, what: &str) -> Result<String, String> {
        self.opt_text(what)?.ok_or_else(|| format!("no {what}"))
    }

    /// Skips a text field without checking it (to reach a later field cheaply).
    pub fn skip_text(&mut self) -> Result<(), String> {
        if let Some(n) = self.len()? {
            self.take(n)?;
        }
        Ok(())
    }

    pub fn opt_ids(&mut self, what: &str) -> Result<Option<Vec<u32>>, String> {
        match self.len()? {
            None => Ok(None),
            Some(n) => Ok(Some(
                self.take(n.checked_mul(4).ok_or(format!("too many {what}"))?)?
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            )),
        }
    }

    /// The end of a record: nothing may be left.
    pub fn finish(self) -> Result<(), String> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(format!("{n} bytes after the record")),
        }
    }
}

/// Creates `dir` and its missing parents, fsyncing the parent of each directory it made:
/// without that, a power cut can lose a new directory (and every file in it) even after the
/// files themselves were synced. An existing directory costs one `stat`.
pub fn create_dir_durably(dir: &Path) -> std::io::Result<()> {
    // The missing levels, deepest first.
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.as_os_str().is_empty() && !d.is_dir() {
        missing.push(d);
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    // 0750 (less where the umask says so): output folders are read by the group.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    for made in missing.iter().rev() {
        sync_parent(made)?;
    }
    Ok(())
}

/// Fsyncs the directory holding `path`, making its entry there (a new file or directory, a
/// rename) durable: fsyncing a file does not make its name durable.
pub fn sync_parent(path: &Path) -> std::io::Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(parent)?.sync_all()
}

/// Why a queue file (an item block file or a results log) could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("queue file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("queue file {path}, at byte {offset}: {detail}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
}

/// A dataset's block file: appended under a lock, read concurrently.
#[derive(Debug)]
pub struct BlockFile {
    path: PathBuf,
    file: File,
    /// Where the next block goes: the end of the last recorded block.
    end: Mutex<u64>,
    /// The id offsets of the block [`BlockFile::read_id`] read last, keyed by its offset,
    /// length and count: consecutive candidates mostly fall in one block, so its length
    /// table is read once for them rather than once each.
    id_starts: Mutex<IdStarts>,
}

/// A block's id offsets from its start: `starts[i]..starts[i + 1]` is item `i`'s id.
#[derive(Debug, Default)]
struct IdStarts {
    key: Option<(u64, u32, u32)>,
    starts: Vec<u64>,
    scratch: Vec<u8>,
}

impl BlockFile {
    /// The file of dataset `ds` under `data_dir`.
    pub fn path(data_dir: &Path, ds: u16) -> PathBuf {
        data_dir.join("items").join(format!("{ds}.blocks"))
    }

    /// Opens (or creates) the file, cutting off bytes past `end` (an append the queue never
    /// recorded; `what` names it for the log). A file shorter than `end` has lost recorded
    /// data: an error. A new file (and folder) is made durable before it is returned, since
    /// the queue records it names outlive a power cut only if its name does too.
    pub fn open(path: PathBuf, end: u64, what: &str) -> Result<BlockFile, BlockError> {
        let io = |source| BlockError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            create_dir_durably(dir).map_err(io)?;
        }
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(file) => {
                sync_parent(&path).map_err(io)?;
                file
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io)?,
            Err(e) => return Err(io(e)),
        };
        let len = file.metadata().map_err(io)?.len();
        if len < end {
            return Err(BlockError::Corrupt {
                path: path.clone(),
                offset: len,
                detail: format!(
                    "the file ends at byte {len}, but the queue records data up to byte {end}"
                ),
            });
        }
        if len > end {
            tracing::warn!(path = %path.display(), bytes = len - end, "cutting off {what} the queue never recorded");
            file.set_len(end).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        Ok(BlockFile {
            path,
            file,
            end: Mutex::new(end),
            id_starts: Mutex::default(),
        })
    }

    pub fn file_path(&self) -> &Path {
        &self.path
    }

    /// The open file (the results log punches holes in it).
    pub(crate) fn raw(&self) -> &std::fs::File {
        &self.file
    }

    /// Where the next append goes.
    pub fn end(&self) -> u64 {
        *self.end.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends blocks and syncs the file; returns each block's offset. On an error nothing
    /// is recorded, and the bytes written are cut off by the next open.
    pub fn append(&self, blocks: &[&[u8]]) -> Result<Vec<u64>, BlockError> {
        let io = |source| BlockError::Io {
            path: self.path.clone(),
            source,
        };
        let mut end = self.end.lock().unwrap_or_else(|p| p.into_inner());
        let mut at = *end;
        let mut offsets = Vec::with_capacity(blocks.len());
        for b in blocks {
            self.file.write_all_at(b, at).map_err(io)?;
            offsets.push(at);
            at += b.len() as u64;
        }
        self.file.sync_data().map_err(io)?;
        *end = at;
        Ok(offsets)
    }

    /// Moves the append position back to `end` (after a repair dropped blocks past it).
    pub fn truncate(&self, end: u64) -> Result<(), BlockError> {
        let mut cur = self.end.lock().unwrap_or_else(|p| p.into_inner());
        self.file.set_len(end).map_err(|source| BlockError::Io {
            path: self.path.clone(),
            source,
        })?;
        *cur = end;
        // A block appended later may start where a dropped one did.
        self.id_starts.lock().unwrap_or_else(|p| p.into_inner()).key = None;
        Ok(())
    }

    /// Reads a block and checks it against its record.
    pub fn read(&self, r: &BlockRef) -> Result<Block, BlockError> {
        let corrupt = |detail: String| BlockError::Corrupt {
            path: self.path.clone(),
            offset: r.offset,
            detail,
        };
        let mut bytes = vec![0u8; r.len as usize];
        self.file
            .read_exact_at(&mut bytes, r.offset)
            .map_err(|e| corrupt(format!("cannot read {} bytes: {e}", r.len)))?;
        let h = twox_hash::XxHash64::oneshot(0, &bytes);
        if h != r.xxh64 {
            return Err(corrupt(format!(
                "checksum {h:016x} is not the recorded {:016x}",
                r.xxh64
            )));
        }
        let block = Block::parse(bytes).map_err(corrupt)?;
        if block.len() != r.count as usize {
            return Err(corrupt(format!(
                "{} items, the queue records {}",
                block.len(),
                r.count
            )));
        }
        Ok(block)
    }

    /// The ids of a block, in row order, without reading its records (the checksum covers
    /// the whole block, so it is not checked here; lengths are).
    pub fn read_ids(
        &self,
        r: &BlockRef,
        mut f: impl FnMut(usize, &[u8]),
    ) -> Result<(), BlockError> {
        let corrupt = |detail: String| BlockError::Corrupt {
            path: self.path.clone(),
            offset: r.offset,
            detail,
        };
        let head = 4 + 4 * r.count as usize;
        if head > r.len as usize {
            return Err(corrupt("the block is shorter than its id table".into()));
        }
        let mut h = vec![0u8; head];
        self.file
            .read_exact_at(&mut h, r.offset)
            .map_err(|e| corrupt(format!("cannot read: {e}")))?;
        let lens: Vec<usize> = h[4..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
            .collect();
        let total: usize = lens.iter().sum();
        if head + total > r.len as usize {
            return Err(corrupt("ids run past the block's end".into()));
        }
        let mut ids = vec![0u8; total];
        self.file
            .read_exact_at(&mut ids, r.offset + head as u64)
            .map_err(|e| corrupt(format!("cannot read: {e}")))?;
        let mut at = 0;
        for (i, n) in lens.into_iter().enumerate() {
            f(i, &ids[at..at + n]);
            at += n;
        }
        Ok(())
    }

    /// The id of the block's `index`-th item alone: the id-length table up to it, then its
    /// bytes (two small reads), so checking one duplicate candidate never reads the block's
    /// records. Lengths are checked against the block's size, not its checksum.
    pub fn read_id(&self, r: &BlockRef, index: usize) -> Result<Vec<u8>, BlockError> {
        let corrupt = |detail: String| BlockError::Corrupt {
            path: self.path.clone(),
            offset: r.offset,
            detail,
        };
        if index >= r.count as usize {
            return Err(corrupt(format!(
                "item {index} asked of a block of {}",
                r.count
            )));
        }
        let head = 4 + 4 * r.count as u64;
        if head > u64::from(r.len) {
            return Err(corrupt("the block is shorter than its id table".into()));
        }
        let (before, n) = {
            let mut cache = self.id_starts.lock().unwrap_or_else(|p| p.into_inner());
            let key = (r.offset, r.len, r.count);
            if cache.key != Some(key) {
                let c = &mut *cache;
                c.key = None;
                c.scratch.resize(4 * r.count as usize, 0);
                self.file
                    .read_exact_at(&mut c.scratch, r.offset + 4)
                    .map_err(|e| corrupt(format!("cannot read: {e}")))?;
                c.starts.clear();
                c.starts.push(0);
                let mut at = 0u64;
                for l in c.scratch.chunks_exact(4) {
                    at += u64::from(u32::from_le_bytes(l.try_into().expect("4 bytes")));
                    c.starts.push(at);
                }
                c.key = Some(key);
            }
            (
                cache.starts[index],
                cache.starts[index + 1] - cache.starts[index],
            )
        };
        let mut id = vec![0u8; n as usize];
        self.file
            .read_exact_at(&mut id, r.offset + head + before)
            .map_err(|e| corrupt(format!("cannot read: {e}")))?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block reads back item by item, its ids read alone (all of them, or one) agree, and
    /// a flipped byte is reported by the checksum instead of being decoded.
    #[test]
    fn blocks_read_back_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let f = BlockFile::open(BlockFile::path(dir.path(), 3), 0, "a test append").unwrap();
        let items = [(&b"a"[..], &b"{\"x\":1}"[..]), (b"bb", b""), (b"", b"rec3")];
        let bytes = encode_block(items.iter().copied());
        let offs = f.append(&[&[9; 5], &bytes]).unwrap();
        assert_eq!(offs, vec![0, 5]);
        let mut rows = Bitmap::empty(10);
        for i in [0, 4, 9] {
            rows.set(i, true);
        }
        let r = BlockRef {
            first_row: 100,
            offset: 5,
            len: bytes.len() as u32,
            count: 3,
            xxh64: twox_hash::XxHash64::oneshot(0, &bytes),
            rows,
        };
        assert_eq!(BlockRef::decode(100, &r.encode()), Some(r.clone()));
        assert_eq!(r.index_of(104), Some(1));
        assert_eq!(r.index_of(109), Some(2));
        assert_eq!(r.index_of(103), None);
        assert_eq!(r.item_rows().collect::<Vec<_>>(), vec![100, 104, 109]);
        assert_eq!(r.last_row(), Some(109));
        let b = f.read(&r).unwrap();
        assert_eq!(
            (b.id(1), b.record(0), b.record(2)),
            (&b"bb"[..], &b"{\"x\":1}"[..], &b"rec3"[..])
        );
        let mut ids = Vec::new();
        f.read_ids(&r, |i, id| ids.push((i, id.to_vec()))).unwrap();
        assert_eq!(
            ids,
            vec![(0, b"a".to_vec()), (1, b"bb".to_vec()), (2, vec![])]
        );
        for (i, id) in ids {
            assert_eq!(f.read_id(&r, i).unwrap(), id, "item {i}");
        }
        assert!(f.read_id(&r, 3).is_err());
        f.file.write_all_at(b"Z", 5 + 20).unwrap();
        let e = f.read(&r).unwrap_err().to_string();
        assert!(
            e.contains("checksum") && e.contains("3.blocks") && e.contains("byte 5"),
            "{e}"
        );
    }

    /// `read_id` answers from whichever block it is asked, alternating between two, and
    /// after a truncate a new block at the same offset (same length and count) is read
    /// afresh rather than through the remembered id offsets of the dropped one.
    #[test]
    fn read_id_follows_blocks_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let f = BlockFile::open(BlockFile::path(dir.path(), 4), 0, "a test append").unwrap();
        let block = |ids: [&[u8]; 2]| encode_block(ids.into_iter().map(|id| (id, &b"r"[..])));
        let at = |offset: u64, bytes: &[u8]| BlockRef {
            first_row: 0,
            offset,
            len: bytes.len() as u32,
            count: 2,
            xxh64: 0,
            rows: Bitmap::empty(2),
        };
        let (a, b) = (block([b"a", b"bbb"]), block([b"cc", b"d"]));
        let offs = f.append(&[&a, &b]).unwrap();
        let (ra, rb) = (at(offs[0], &a), at(offs[1], &b));
        for _ in 0..2 {
            assert_eq!(f.read_id(&ra, 1).unwrap(), b"bbb");
            assert_eq!(f.read_id(&rb, 0).unwrap(), b"cc");
            assert_eq!(f.read_id(&rb, 1).unwrap(), b"d");
            assert_eq!(f.read_id(&ra, 0).unwrap(), b"a");
        }
        f.truncate(0).unwrap();
        let c = block([b"xyz", b"w"]);
        assert_eq!(c.len(), a.len());
        assert_eq!(f.append(&[&c]).unwrap(), vec![0]);
        assert_eq!(f.read_id(&at(0, &c), 0).unwrap(), b"xyz");
        assert_eq!(f.read_id(&at(0, &c), 1).unwrap(), b"w");
    }

    /// An append the queue never recorded is cut off at open; a file shorter than what the
    /// queue records is refused.
    #[test]
    fn unrecorded_tails_are_cut_and_short_files_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = BlockFile::path(dir.path(), 0);
        BlockFile::open(p.clone(), 0, "a test append")
            .unwrap()
            .append(&[&[1; 10], &[2; 7]])
            .unwrap();
        let f = BlockFile::open(p.clone(), 10, "a test append").unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 10);
        assert_eq!(f.append(&[&[3; 2]]).unwrap(), vec![10]);
        drop(f);
        assert!(matches!(
            BlockFile::open(p, 20, "a test append"),
            Err(BlockError::Corrupt { .. })
        ));
    }

    /// Rank and iteration agree with a plain bit-by-bit count.
    #[test]
    fn bitmap_rank_matches_counting() {
        let mut b = Bitmap::empty(70);
        for i in [0u64, 3, 7, 8, 15, 16, 63, 64, 69] {
            b.set(i, true);
        }
        for i in 0..=70 {
            assert_eq!(b.rank(i), (0..i).filter(|&j| b.get(j)).count(), "{i}");
        }
        assert_eq!(b.ones().count() as u64, b.count());
        b.set(3, false);
        assert!(!b.get(3) && b.count() == 8 && !b.is_clear());
    }
}
