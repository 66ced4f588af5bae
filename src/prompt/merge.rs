//! Byte-pair merging by rank, shared by the exact encoders ([`super::byte_bpe`] for
//! `tokenizer.json` merges, [`super::tiktoken`] for tiktoken ranks).
//!
//! Invariants:
//! - A piece's bytes start as one id per byte and the adjacent pair with the lowest rank
//!   merges first, leftmost among equals, until no pair has a rank: HuggingFace's
//!   `Word::merge_all` and tiktoken's `byte_pair_merge` alike (the two strategies below
//!   give the same ids).
//! - Per-thread word cache: a piece's ids depend only on its bytes, so caching them is
//!   exact; the cache is bounded ([`CACHE_MAX_WORDS`] pieces of at most
//!   [`CACHE_MAX_BYTES`]) and belongs to one [`Merges`] instance at a time.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};

use ahash::AHashMap;

/// Pieces up to this many bytes are merged by scanning for the lowest rank; longer ones
/// with a heap (the scan is quadratic, the heap's bookkeeping costs more on short words).
const SCAN_MAX_BYTES: usize = 48;
/// Pieces up to this many bytes go into the per-thread word cache.
const CACHE_MAX_BYTES: usize = 64;
/// Entries in one thread's word cache; past this, new words are merged but not kept.
/// About 70 bytes an entry: ~1 MiB a thread at most, whatever the core count (HuggingFace
/// keeps 10,000 words a thread).
const CACHE_MAX_WORDS: usize = 1 << 14;

/// A merge: the pair's rank (lower merges first) and the id of the merged token.
#[derive(Clone, Copy)]
pub(super) struct Merge {
    pub rank: u32,
    pub new_id: u32,
}

#[inline]
pub(super) fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// A piece's bytes to its ids.
pub(super) type Words = AHashMap<Box<[u8]>, Box<[u32]>>;

/// Per-thread cache of the ids of short pieces, for one encoder instance at a time.
#[derive(Default)]
struct WordCache {
    owner: u64,
    words: Words,
}

thread_local! {
    static WORD_CACHE: RefCell<WordCache> = RefCell::new(WordCache::default());
}

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// Reusable buffers for merging one piece.
#[derive(Default)]
pub(super) struct Scratch {
    ids: Vec<u32>,
    ranks: Vec<u32>,
    /// Heap merge: per symbol, (id, prev, next, alive).
    symbols: Vec<(u32, usize, usize, bool)>,
    heap: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

/// The merge table of one vocabulary: the id of each byte and, per adjacent pair of ids,
/// the merge that joins them.
pub(super) struct Merges {
    byte_ids: [u32; 256],
    pairs: AHashMap<u64, Merge>,
    instance: u64,
}

impl Merges {
    /// A table from the id of each byte and the merges keyed by [`pair_key`].
    pub(super) fn new(byte_ids: [u32; 256], pairs: AHashMap<u64, Merge>) -> Self {
        Self {
            byte_ids,
            pairs,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Number of merges.
    pub(super) fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Runs `f` with this thread's word cache, emptied first if another table used it
    /// last; `None` when the cache is already borrowed on this thread.
    pub(super) fn with_cache<R>(&self, f: impl FnOnce(Option<&mut Words>) -> R) -> R {
        WORD_CACHE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut cache) => {
                if cache.owner != self.instance {
                    cache.owner = self.instance;
                    cache.words.clear();
                }
                f(Some(&mut cache.words))
            }
            Err(_) => f(None),
        })
    }

    /// The ids of one pre-tokenized piece (its UTF-8 bytes). `whole` gives the id of a
    /// piece that is one token as it stands, for vocabularies where that comes before
    /// merging (tiktoken's); it is asked only on a cache miss.
    pub(super) fn piece(
        &self,
        bytes: &[u8],
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        cache: Option<&mut Words>,
        whole: impl Fn(&[u8]) -> Option<u32>,
    ) {
        if let [b] = bytes {
            out.push(self.byte_ids[*b as usize]);
            return;
        }
        let cache = cache.filter(|_| bytes.len() <= CACHE_MAX_BYTES);
        if let Some(ids) = cache.as_ref().and_then(|c| c.get(bytes)) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        if let Some(id) = whole(bytes) {
            out.push(id);
        } else if bytes.len() <= SCAN_MAX_BYTES {
            self.merge_scan(bytes, out, scratch);
        } else {
            self.merge_heap(bytes, out, scratch);
        }
        if let Some(cache) = cache {
            if cache.len() < CACHE_MAX_WORDS {
                cache.insert(bytes.into(), out[start..].into());
            }
        }
    }

    #[inline]
    fn rank(&self, a: u32, b: u32) -> Option<Merge> {
        self.pairs.get(&pair_key(a, b)).copied()
    }

    /// Merges by repeatedly applying the lowest-ranked pair, leftmost among equals.
    pub(super) fn merge_scan(&self, bytes: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        let ids = &mut scratch.ids;
        let ranks = &mut scratch.ranks;
        ids.clear();
        ids.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]));
        ranks.clear();
        ranks.extend(
            ids.windows(2)
                .map(|w| self.rank(w[0], w[1]).map_or(u32::MAX, |m| m.rank)),
        );
        loop {
            let mut best = u32::MAX;
            let mut at = 0;
            for (i, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = i;
                }
            }
            if best == u32::MAX {
                break;
            }
            let Some(merge) = self.rank(ids[at], ids[at + 1]) else {
                break;
            };
            ids[at] = merge.new_id;
            ids.remove(at + 1);
            ranks.remove(at);
            if at > 0 {
                ranks[at - 1] = self.rank(ids[at - 1], ids[at]).map_or(u32::MAX, |m| m.rank);
            }
            if at + 1 < ids.len() {
                ranks[at] = self.rank(ids[at], ids[at + 1]).map_or(u32::MAX, |m| m.rank);
            }
        }
        out.extend_from_slice(ids);
    }

    /// The same merges with a heap and a linked list (HuggingFace's `Word::merge_all`):
    /// for long pieces, where the scan would be quadratic.
    pub(super) fn merge_heap(&self, bytes: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        const NONE: usize = usize::MAX;
        let symbols = &mut scratch.symbols;
        let heap = &mut scratch.heap;
        symbols.clear();
        heap.clear();
        let n = bytes.len();
        symbols.extend(bytes.iter().enumerate().map(|(i, &b)| {
            let prev = if i == 0 { NONE } else { i - 1 };
            let next = if i + 1 == n { NONE } else { i + 1 };
            (self.byte_ids[b as usize], prev, next, true)
        }));
        for i in 0..n.saturating_sub(1) {
            if let Some(m) = self.rank(symbols[i].0, symbols[i + 1].0) {
                heap.push(Reverse((m.rank, i, m.new_id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let (left, _, next, alive) = symbols[pos];
            if !alive || next == NONE {
                continue;
            }
            let right = symbols[next];
            // A stale entry: the pair at `pos` has changed since it was pushed (a changed
            // pair always spans more text, so it merges to a different id).
            if self.rank(left, right.0).is_none_or(|m| m.new_id != new_id) {
                continue;
            }
            symbols[pos].0 = new_id;
            symbols[pos].2 = right.2;
            symbols[next].3 = false;
            if right.2 != NONE {
                symbols[right.2].1 = pos;
            }
            let prev = symbols[pos].1;
            if prev != NONE {
                if let Some(m) = self.rank(symbols[prev].0, new_id) {
                    heap.push(Reverse((m.rank, prev, m.new_id)));
                }
            }
            if right.2 != NONE {
                if let Some(m) = self.rank(new_id, symbols[right.2].0) {
                    heap.push(Reverse((m.rank, pos, m.new_id)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.3).map(|s| s.0));
    }
}
