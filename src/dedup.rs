//! Duplicate ids among a dataset's items, found exactly with bounded memory.
//!
//! Intake must refuse a row whose id an earlier row has, and name that row. A blocked
//! Bloom filter ([`IdFilter`], 256 KiB growing to 32 MiB with the ids) proves most ids new
//! without any lookup. Every id also leaves its 64-bit hash and row in one of 256 spill
//! files (by the hash's top byte, buffered 8 KiB per file), so an id the filter cannot rule
//! out costs one read of 1/256 of the hashes — the rows whose hash is equal are the only
//! candidates, and the caller confirms each by comparing the stored id. Memory stays under
//! ~34 MiB whatever the number of ids (the queue's own id index, one random sled key per
//! item, grew with it).
//!
//! The filter starts small and is rebuilt 8× larger from the spilled hashes each time it
//! holds [`IdFilter::IDS_PER_BLOCK`] ids per block: a fixed 32 MiB filter cost a small
//! dataset a page fault (two: read, then write) per id — ~5 % of a 30,000-prompt run's CPU.
//!
//! Invariants: [`IdSet::candidates`] returns every earlier row with an equal id (it may
//! return more, never fewer), across rebuilds, which re-insert every hash spilled or
//! buffered; the spill files are scratch, rebuilt from the queue by each intake that needs
//! them and removed when the set is dropped.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

/// Seed of the id hash (the filter's, kept from format 1).
const SEED: u64 = 0x5eed;
/// Spill entries buffered per partition before they are written: 512 × 256 × 16 bytes = 2 MiB
/// at most (4,096 made RSS grow by the 16 MiB the buffers took to fill: 216 MiB at 100 k
/// prompts, 231 MiB at 1 M).
const BUFFERED: usize = 512;
const PARTS: usize = 256;

/// A spill file could not be written or read.
#[derive(Debug, thiserror::Error)]
#[error("duplicate-id index {path}: {source}")]
pub struct SpillError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// A blocked Bloom filter of ids (at most 32 MiB: ~0.01 % false positives at 10 M ids, where
/// 16 MiB gave ~0.3 % and each false positive reads a spill file; more ids only raise that
/// rate, never give a wrong answer): `may_contain` false proves absence.
pub struct IdFilter {
    /// 512-bit blocks (a power of two), allocated zeroed on first insert.
    blocks: Vec<[u64; 8]>,
    len: usize,
}

impl IdFilter {
    /// The first size: 256 KiB.
    const MIN_BLOCKS: usize = 1 << 12;
    /// The last size: 32 MiB.
    const MAX_BLOCKS: usize = 1 << 19;
    const PROBES: u32 = 6;
    /// Ids per block past which [`IdSet`] rebuilds the filter larger (~0.003 % false
    /// positives at this load).
    pub const IDS_PER_BLOCK: u64 = 16;

    fn with_blocks(len: usize) -> Self {
        debug_assert!(len.is_power_of_two());
        Self {
            blocks: Vec::new(),
            len,
        }
    }

    /// Ids this filter holds before it should be rebuilt larger (never, at the last size).
    fn capacity(&self) -> u64 {
        if self.len >= Self::MAX_BLOCKS {
            u64::MAX
        } else {
            self.len as u64 * Self::IDS_PER_BLOCK
        }
    }

    /// The block and the bit positions (within 512) of an id's hash.
    fn probes(&self, h: u64) -> (usize, impl Iterator<Item = usize>) {
        let block = (h as usize) & (self.len - 1);
        // Independent bits for the probes: the high half, remixed.
        let bits = (h >> 32).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (
            block,
            (0..Self::PROBES).map(move |i| ((bits >> (i * 9)) & 511) as usize),
        )
    }

    fn insert_hash(&mut self, h: u64) {
        if self.blocks.is_empty() {
            self.blocks = vec![[0u64; 8]; self.len];
        }
        let (b, bits) = self.probes(h);
        let block = &mut self.blocks[b];
        for bit in bits {
            block[bit >> 6] |= 1 << (bit & 63);
        }
    }

    fn may_contain_hash(&self, h: u64) -> bool {
        if self.blocks.is_empty() {
            return false;
        }
        let (b, mut bits) = self.probes(h);
        let block = &self.blocks[b];
        bits.all(|bit| block[bit >> 6] & (1 << (bit & 63)) != 0)
    }

    #[cfg(test)]
    fn insert(&mut self, id: &[u8]) {
        self.insert_hash(hash(id));
    }

    #[cfg(test)]
    fn may_contain(&self, id: &[u8]) -> bool {
        self.may_contain_hash(hash(id))
    }
}

fn hash(id: &[u8]) -> u64 {
    twox_hash::XxHash64::oneshot(SEED, id)
}

/// One partition's entries: on disk, then buffered.
#[derive(Default)]
struct Part {
    buf: Vec<(u64, u64)>,
    file: Option<File>,
}

/// The ids of one dataset's items: the filter plus the spilled (hash, row) pairs.
pub struct IdSet {
    filter: IdFilter,
    dir: PathBuf,
    parts: Vec<Part>,
    scratch: Vec<u8>,
    /// Entries buffered per partition before a write ([`BUFFERED`]; smaller in tests).
    spill_at: usize,
    /// Ids the filter could not rule out (each looked up in the spill files).
    lookups: u64,
    /// Ids inserted (the filter is rebuilt larger past its capacity).
    len: u64,
}

impl IdSet {
    /// An empty set spilling into `dir` (created on first spill; a leftover of a killed
    /// process is removed first).
    pub fn new(dir: PathBuf) -> IdSet {
        let _ = std::fs::remove_dir_all(&dir);
        IdSet {
            filter: IdFilter::with_blocks(IdFilter::MIN_BLOCKS),
            dir,
            parts: (0..PARTS).map(|_| Part::default()).collect(),
            scratch: Vec::new(),
            spill_at: BUFFERED,
            lookups: 0,
            len: 0,
        }
    }

    fn err(&self, source: std::io::Error) -> SpillError {
        SpillError {
            path: self.dir.clone(),
            source,
        }
    }

    /// Adds an id at `row`.
    pub fn insert(&mut self, id: &[u8], row: u64) -> Result<(), SpillError> {
        let h = hash(id);
        self.filter.insert_hash(h);
        let p = (h >> 56) as usize;
        self.parts[p].buf.push((h, row));
        if self.parts[p].buf.len() >= self.spill_at {
            self.spill(p).map_err(|e| self.err(e))?;
        }
        self.len += 1;
        if self.len > self.filter.capacity() {
            self.grow().map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// Replaces the filter with one 8× larger holding every hash so far (read back from
    /// the spill files and the buffers).
    fn grow(&mut self) -> std::io::Result<()> {
        let mut filter = IdFilter::with_blocks((self.filter.len * 8).min(IdFilter::MAX_BLOCKS));
        for part in &mut self.parts {
            if let Some(f) = part.file.as_mut() {
                self.scratch.clear();
                f.seek(SeekFrom::Start(0))?;
                f.read_to_end(&mut self.scratch)?;
                for e in self.scratch.chunks_exact(16) {
                    filter.insert_hash(u64::from_le_bytes(e[..8].try_into().expect("8 bytes")));
                }
            }
            for (h, _) in &part.buf {
                filter.insert_hash(*h);
            }
        }
        self.filter = filter;
        Ok(())
    }

    fn spill(&mut self, p: usize) -> std::io::Result<()> {
        if self.parts[p].file.is_none() {
            std::fs::create_dir_all(&self.dir)?;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(self.dir.join(format!("{p:02x}")))?;
            self.parts[p].file = Some(f);
        }
        let part = &mut self.parts[p];
        let mut bytes = Vec::with_capacity(part.buf.len() * 16);
        for (h, row) in part.buf.drain(..) {
            bytes.extend_from_slice(&h.to_le_bytes());
            bytes.extend_from_slice(&row.to_le_bytes());
        }
        part.file.as_mut().expect("opened above").write_all(&bytes)
    }

    /// Rows of earlier ids that may equal `id` (equal 64-bit hashes), ascending; empty for
    /// nearly every new id. The caller compares the stored ids.
    pub fn candidates(&mut self, id: &[u8]) -> Result<Vec<u64>, SpillError> {
        let h = hash(id);
        if !self.filter.may_contain_hash(h) {
            return Ok(Vec::new());
        }
        self.lookups += 1;
        let p = (h >> 56) as usize;
        let mut rows = Vec::new();
        if let Some(f) = self.parts[p].file.as_mut() {
            self.scratch.clear();
            let read = f
                .seek(SeekFrom::Start(0))
                .and_then(|_| f.read_to_end(&mut self.scratch));
            if let Err(e) = read {
                return Err(self.err(e));
            }
            for e in self.scratch.chunks_exact(16) {
                if u64::from_le_bytes(e[..8].try_into().expect("8 bytes")) == h {
                    rows.push(u64::from_le_bytes(e[8..].try_into().expect("8 bytes")));
                }
            }
        }
        rows.extend(
            self.parts[p]
                .buf
                .iter()
                .filter(|(eh, _)| *eh == h)
                .map(|(_, r)| *r),
        );
        rows.sort_unstable();
        Ok(rows)
    }
}

impl IdSet {
    /// Ids looked up in the spill files so far (the filter's "maybe"s): the cost of the
    /// exact check, logged by intake.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }
}

impl Drop for IdSet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_filter_never_forgets_an_id() {
        let mut f = IdFilter::with_blocks(IdFilter::MAX_BLOCKS);
        assert!(!f.may_contain(b"x"));
        let ids: Vec<String> = (0..100_000).map(|i| format!("id{i}")).collect();
        for id in &ids {
            f.insert(id.as_bytes());
        }
        assert!(ids.iter().all(|id| f.may_contain(id.as_bytes())));
        let false_pos = (0..100_000)
            .filter(|i| f.may_contain(format!("other{i}").as_bytes()))
            .count();
        assert!(false_pos < 100, "{false_pos} false positives in 100k");
    }

    /// Every earlier row of an id is a candidate, whether its entry was spilled to disk or is
    /// still buffered, across two rebuilds of the filter (each 8× larger); new ids have none
    /// and are rarely looked up; the scratch folder goes with the set.
    #[test]
    fn candidates_include_every_earlier_row_spilled_or_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let spill = dir.path().join("ids");
        let mut s = IdSet::new(spill.clone());
        s.spill_at = 64;
        let n = 600_000u64;
        assert!(n > IdFilter::MIN_BLOCKS as u64 * 8 * IdFilter::IDS_PER_BLOCK);
        for r in 0..n {
            s.insert(format!("id{r}").as_bytes(), r).unwrap();
        }
        s.insert(b"id7", n).unwrap();
        assert!(
            spill.read_dir().unwrap().count() > 200,
            "entries were spilled"
        );
        assert_eq!(s.candidates(b"id7").unwrap(), vec![7, n]);
        for r in (0..n).step_by(997) {
            assert!(s
                .candidates(format!("id{r}").as_bytes())
                .unwrap()
                .contains(&r));
        }
        let stray = (0..10_000)
            .map(|i| s.candidates(format!("new{i}").as_bytes()).unwrap().len())
            .sum::<usize>();
        assert_eq!(stray, 0, "a 64-bit hash match for a new id");
        assert_eq!(s.filter.len, IdFilter::MIN_BLOCKS * 64, "rebuilt twice");
        let before = s.lookups();
        for i in 0..100_000 {
            s.candidates(format!("fresh{i}").as_bytes()).unwrap();
        }
        let fp = s.lookups() - before;
        assert!(
            fp < 50,
            "{fp} of 100,000 new ids looked up: the filter did not grow with the ids"
        );
        drop(s);
        assert!(!spill.exists());
    }
}
