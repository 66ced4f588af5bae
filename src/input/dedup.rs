//! Duplicate ids among a dataset's items, found exactly with bounded memory and in time
//! that stays linear (up to a logarithm) in the rows, however many of them are duplicates.
//!
//! Intake must refuse a row whose id an earlier row has, and name that row. A blocked
//! Bloom filter ([`IdFilter`], 256 KiB growing to 32 MiB with the ids) proves most ids new
//! without any lookup. Every id also leaves its 64-bit hash and row in one of 256 spill
//! partitions (by the hash's top byte), buffered 512 entries per partition in memory. A full
//! buffer is sorted and appended to its partition's file as a sorted run; runs are merged
//! pairwise like a binary counter (a run is merged into the one before it once it is as
//! long), so a partition holds at most log2(entries / 512) + 1 runs and each entry is
//! rewritten that many times at most. Each run keeps the hash of every 64th entry in
//! memory (its fences), so an id the filter cannot rule out costs one read of one 1 KiB
//! page per run plus, unless a 4096-bit summary of its partition's buffer rules the hash
//! out, a scan of that buffer — never a whole partition, so
//! a file of millions of duplicate rows costs what as many new rows do, not their square.
//! The rows whose hash is equal are the only candidates, and the caller confirms each by
//! comparing the stored id.
//!
//! Memory: the filter (≤ 32 MiB), the buffers (≤ 2 MiB, and 128 KiB of summaries), the fences (8 bytes a page:
//! 1/128 of the spilled bytes, ~1.2 MiB at 10 M ids) and, only while a merge or a filter
//! rebuild runs, one partition's bytes twice (1/128 of the spill, ~1.2 MiB at 10 M ids).
//!
//! The filter starts small and is rebuilt 8× larger from the spilled hashes each time it
//! holds [`IdFilter::IDS_PER_BLOCK`] ids per block, so a small dataset does not pay a page
//! fault (two: read, then write) per id, as a filter of the full 32 MiB would cost it.
//!
//! Invariants: [`IdSet::candidates`] returns every earlier row with an equal id (it may
//! return more, never fewer), across rebuilds, which re-insert every hash spilled or
//! buffered, and across merges, which keep every entry of both runs; a partition's file is
//! its runs end to end, each sorted by (hash, row); the spill files are scratch, rebuilt
//! from the queue by each intake that needs them and removed when the set is dropped.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Seed of the id hash, shared by the filter and the spill partitions.
const SEED: u64 = 0x5eed;
/// Spill entries buffered per partition before they are written: 512 × 256 × 16 bytes = 2 MiB
/// at most; larger buffers grow the resident memory by all they take to fill.
const BUFFERED: usize = 512;
const PARTS: usize = 256;
/// Bits of a partition's buffer summary (512 bytes each, 128 KiB for all).
const BUF_BITS: usize = 4096;
/// Bytes of a spilled entry: the hash, then the row (little-endian).
const ENTRY: usize = 16;
/// Entries per fenced page: a lookup reads one page (1 KiB) of a run; larger pages make the
/// copy and scan of each duplicate's lookup a large share of intake's work.
const PAGE: usize = 64;

/// A spill file could not be written or read.
#[derive(Debug, thiserror::Error)]
#[error("duplicate-id index {path}: {source}")]
pub struct SpillError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// A blocked Bloom filter of ids (at most 32 MiB: ~0.01 % false positives at 10 M ids, and
/// each false positive reads a spill file; more ids only raise that rate, never give a
/// wrong answer): `may_contain` false proves absence.
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

/// A sorted run of a partition's file.
struct Run {
    /// Its first entry's index in the file.
    start: u64,
    /// Entries.
    len: u64,
    /// The hash of the first entry of each [`PAGE`] entries: where a hash can be.
    fences: Vec<u64>,
}

impl Run {
    fn new(start: u64, entries: &[(u64, u64)]) -> Run {
        Run {
            start,
            len: entries.len() as u64,
            fences: entries.iter().step_by(PAGE).map(|(h, _)| *h).collect(),
        }
    }

    /// The entries (as a range of this run's indices) that can hold hash `h`: the pages from
    /// the last one starting below `h` through the last one starting at `h` (equal hashes may
    /// straddle a page boundary). Empty when `h` is below the run's first hash.
    fn span_of(&self, h: u64) -> std::ops::Range<u64> {
        let lo = self.fences.partition_point(|&f| f < h).saturating_sub(1);
        let hi = self.fences.partition_point(|&f| f <= h);
        if hi <= lo {
            return 0..0;
        }
        (lo * PAGE) as u64..((hi * PAGE) as u64).min(self.len)
    }
}

/// One partition's entries: sorted runs on disk, then buffered.
#[derive(Default)]
struct Part {
    buf: Vec<(u64, u64)>,
    /// One bit per value of a hash's low 12 bits among `buf`'s entries (empty until the
    /// first): a lookup scans the buffer only if its bit is set, which a duplicate of a
    /// spilled id finds clear with probability (1 − 1/4096)^512 ≈ 0.88 with a full buffer.
    buf_bits: Vec<u64>,
    file: Option<File>,
    runs: Vec<Run>,
}

impl Part {
    /// Entries on disk (the runs end to end).
    fn spilled(&self) -> u64 {
        self.runs.last().map_or(0, |r| r.start + r.len)
    }
}

fn encode(entries: &[(u64, u64)], out: &mut Vec<u8>) {
    out.reserve(entries.len() * ENTRY);
    for (h, row) in entries {
        out.extend_from_slice(&h.to_le_bytes());
        out.extend_from_slice(&row.to_le_bytes());
    }
}

fn decode(bytes: &[u8]) -> impl Iterator<Item = (u64, u64)> + '_ {
    bytes.chunks_exact(ENTRY).map(|e| {
        let (h, row) = e.split_at(8);
        (
            u64::from_le_bytes(h.try_into().expect("8 bytes")),
            u64::from_le_bytes(row.try_into().expect("8 bytes")),
        )
    })
}

/// Reads `n` entries from entry `at` of a partition's file into `out` (replacing it).
fn read_entries(f: &File, at: u64, n: u64, out: &mut Vec<u8>) -> std::io::Result<()> {
    out.clear();
    out.resize(n as usize * ENTRY, 0);
    f.read_exact_at(out, at * ENTRY as u64)
}

/// The ids of one dataset's items: the filter plus the spilled (hash, row) pairs.
pub struct IdSet {
    filter: IdFilter,
    dir: PathBuf,
    parts: Vec<Part>,
    /// The pages a lookup reads (a few KiB; a whole partition while the filter is rebuilt).
    scratch: Vec<u8>,
    /// Entries buffered per partition before a write ([`BUFFERED`]; smaller in tests).
    spill_at: usize,
    /// Ids the filter could not rule out (each looked up in the spill files).
    lookups: u64,
    /// Bytes those lookups read from the spill files.
    read: u64,
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
            read: 0,
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
        self.insert_hash(hash(id), row)
    }

    fn insert_hash(&mut self, h: u64, row: u64) -> Result<(), SpillError> {
        self.filter.insert_hash(h);
        let p = (h >> 56) as usize;
        let part = &mut self.parts[p];
        part.buf.push((h, row));
        if part.buf_bits.is_empty() {
            part.buf_bits = vec![0; BUF_BITS / 64];
        }
        let b = h as usize % BUF_BITS;
        part.buf_bits[b / 64] |= 1 << (b % 64);
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
        for part in &self.parts {
            if let Some(f) = part.file.as_ref() {
                read_entries(f, 0, part.spilled(), &mut self.scratch)?;
                for (h, _) in decode(&self.scratch) {
                    filter.insert_hash(h);
                }
            }
            for (h, _) in &part.buf {
                filter.insert_hash(*h);
            }
        }
        self.filter = filter;
        Ok(())
    }

    /// Writes partition `p`'s buffer as a sorted run, then merges the last two runs while
    /// the last is as long as the one before it.
    fn spill(&mut self, p: usize) -> std::io::Result<()> {
        if self.parts[p].file.is_none() {
            std::fs::create_dir_all(&self.dir)?;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(self.dir.join(format!("{p:02x}")))?;
            self.parts[p].file = Some(f);
        }
        let part = &mut self.parts[p];
        let f = part.file.as_ref().expect("opened above");
        part.buf.sort_unstable();
        let start = part.spilled();
        let mut bytes = Vec::new();
        encode(&part.buf, &mut bytes);
        f.write_all_at(&bytes, start * ENTRY as u64)?;
        part.runs.push(Run::new(start, &part.buf));
        part.buf.clear();
        part.buf_bits.fill(0);
        while let [.., a, b] = &part.runs[..] {
            if a.len > b.len {
                break;
            }
            let (start, len_a, len) = (a.start, a.len as usize, a.len + b.len);
            // The two runs are the file's tail, end to end: merged in place.
            read_entries(f, start, len, &mut bytes)?;
            let (left, right) = bytes.split_at(len_a * ENTRY);
            let merged = merge(decode(left), decode(right));
            let mut out = Vec::with_capacity(bytes.len());
            encode(&merged, &mut out);
            f.write_all_at(&out, start * ENTRY as u64)?;
            part.runs.truncate(part.runs.len() - 2);
            part.runs.push(Run::new(start, &merged));
        }
        Ok(())
    }

    /// Rows of earlier ids that may equal `id` (equal 64-bit hashes), ascending; empty for
    /// nearly every new id. The caller compares the stored ids.
    pub fn candidates(&mut self, id: &[u8]) -> Result<Vec<u64>, SpillError> {
        self.candidates_hash(hash(id))
    }

    fn candidates_hash(&mut self, h: u64) -> Result<Vec<u64>, SpillError> {
        if !self.filter.may_contain_hash(h) {
            return Ok(Vec::new());
        }
        self.lookups += 1;
        let part = &self.parts[(h >> 56) as usize];
        let mut rows = Vec::new();
        if let Some(f) = part.file.as_ref() {
            for run in &part.runs {
                let span = run.span_of(h);
                if span.is_empty() {
                    continue;
                }
                let read = read_entries(
                    f,
                    run.start + span.start,
                    span.end - span.start,
                    &mut self.scratch,
                );
                if let Err(e) = read {
                    return Err(SpillError {
                        path: self.dir.clone(),
                        source: e,
                    });
                }
                self.read += self.scratch.len() as u64;
                rows.extend(
                    decode(&self.scratch)
                        .filter(|(eh, _)| *eh == h)
                        .map(|(_, r)| r),
                );
            }
        }
        let b = h as usize % BUF_BITS;
        if part
            .buf_bits
            .get(b / 64)
            .is_some_and(|w| w & (1 << (b % 64)) != 0)
        {
            rows.extend(part.buf.iter().filter(|(eh, _)| *eh == h).map(|(_, r)| *r));
        }
        rows.sort_unstable();
        Ok(rows)
    }
}

/// Two sorted sequences as one.
fn merge(
    a: impl Iterator<Item = (u64, u64)>,
    b: impl Iterator<Item = (u64, u64)>,
) -> Vec<(u64, u64)> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    let mut out = Vec::with_capacity(a.size_hint().0 + b.size_hint().0);
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) => {
                if x <= y {
                    a.next()
                } else {
                    b.next()
                }
            }
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => return out,
        };
        out.extend(next);
    }
}

impl IdSet {
    /// Ids looked up in the spill files so far (the filter's "maybe"s): the cost of the
    /// exact check, logged by intake.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// Bytes of spill files those lookups read: a few KiB each, whatever the ids' number.
    pub fn lookup_bytes(&self) -> u64 {
        self.read
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

    /// Every inserted id is found again: the filter has false positives, never false
    /// negatives.
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

    /// A duplicate's lookup reads a page per sorted run, not its partition: with 600,000
    /// ids (partitions of ~37 KB in at most 3 runs), 6,000 lookups of present ids average
    /// at most four 1 KiB pages each (a whole partition is 36), and every one finds its
    /// row.
    #[test]
    fn a_lookup_reads_pages_not_partitions() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = IdSet::new(dir.path().join("ids"));
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let hashes: Vec<u64> = (0..600_000).map(|_| next()).collect();
        for (row, &h) in hashes.iter().enumerate() {
            s.insert_hash(h, row as u64).unwrap();
        }
        let part_bytes = std::fs::metadata(dir.path().join("ids").join("00"))
            .unwrap()
            .len();
        assert!(part_bytes > 30_000, "a partition holds {part_bytes} bytes");
        for row in (0..hashes.len()).step_by(100) {
            let got = s.candidates_hash(hashes[row]).unwrap();
            assert!(got.contains(&(row as u64)), "row {row}: {got:?}");
        }
        // A page per run; two of a run when the hash starts a page.
        let per = s.lookup_bytes() / s.lookups();
        assert!(
            per <= 4 * (PAGE * ENTRY) as u64,
            "{per} bytes read per lookup (partitions of {part_bytes})"
        );
    }

    /// Many entries of one hash (straddling page and run boundaries) and hashes at the ends
    /// of a partition's range are all found, through spills and merges of every size.
    #[test]
    fn equal_hashes_across_pages_and_runs_are_all_found() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = IdSet::new(dir.path().join("ids"));
        s.spill_at = 37;
        let same = 0x42u64 << 56 | 7;
        let (low, high) = (0x42u64 << 56, (0x43u64 << 56) - 1);
        let mut want = Vec::new();
        for row in 0..5_000u64 {
            let h = match row % 5 {
                0 => same,
                1 => low,
                2 => high,
                _ => 0x42u64 << 56 | (row * 2_654_435_761 % (1 << 40)),
            };
            s.insert_hash(h, row).unwrap();
            if h == same {
                want.push(row);
            }
        }
        assert!(s.parts[0x42].runs.len() > 1, "several runs");
        assert_eq!(s.candidates_hash(same).unwrap(), want);
        assert_eq!(s.candidates_hash(low).unwrap().len(), 1_000);
        assert_eq!(s.candidates_hash(high).unwrap().len(), 1_000);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Against a list of every (hash, row) inserted: after any sequence of inserts (all in
        /// one partition, many hashes repeated, buffers of any size, so runs are spilled,
        /// merged and paged), a lookup returns exactly the rows of the equal hash — never
        /// fewer, and no row of another hash.
        #[test]
        fn candidates_match_a_model(
            ops in proptest::collection::vec((0u64..400, proptest::bool::weighted(0.8)), 1..3000),
            spill_at in 1usize..64,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut s = IdSet::new(dir.path().join("ids"));
            s.spill_at = spill_at;
            let mut model: Vec<(u64, u64)> = Vec::new();
            for (row, (k, insert)) in ops.into_iter().enumerate() {
                // Top byte 0x17: one partition; low bits: 400 distinct hashes.
                let h = 0x17u64 << 56 | k.wrapping_mul(0x9e37_79b9) & ((1 << 40) - 1);
                if insert {
                    s.insert_hash(h, row as u64).unwrap();
                    model.push((h, row as u64));
                } else {
                    let want: Vec<u64> =
                        model.iter().filter(|(mh, _)| *mh == h).map(|(_, r)| *r).collect();
                    proptest::prop_assert_eq!(s.candidates_hash(h).unwrap(), want);
                }
            }
        }
    }
}
