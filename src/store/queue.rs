//! The durable queue: sled is the source of truth for every item's state.
//!
//! One sled tree holds the records under one-byte key prefixes, so that every state change
//! is a single atomic `apply_batch`; the prompts themselves are appended to per-dataset
//! block files ([`crate::store::blocks`]) that sled records point into:
//!
//! | key | value | meaning |
//! | --- | --- | --- |
//! | `v` | format (u32 BE) | [`FORMAT_VERSION`] |
//! | `V` | format (u32 BE) | a migration from that format is under way ([`MIGRATING_KEY`]) |
//! | `m` name | [`DatasetState`] (JSON) | counters of a dataset |
//! | `B` ds first_row | [`BlockRef`] | a block of items in `items/<ds>.blocks`, and which rows they are |
//! | `P` ds first_row | bitmap over the block's rows | which of its items are pending (absent: none) |
//! | `S` ds shard first_row | the shard's rows from `first_row` (varint deltas, ≤ [`SHARD_RECORD_ROWS`]) | done and in shard N |
//! | `f` ds row | [`Failure`] (JSON) | failed permanently |
//!
//! `ds` is the dataset's u16 index (BE), `row` its 0-based line (u64 BE), so scans run in
//! file order; `shard` is u64 BE. Results done but not yet in a shard are in the dataset's
//! results log ([`crate::store::results`], `results/<ds>.log`), between the counters'
//! `results_start` and `results_end`. An item is in exactly one of pending (its `P` bit),
//! the results log, an `S` record, `f`. Format 1 stored each item under its own keys (`i`
//! item, `p` pending, `k` id index); format 2 stored unsharded results in sled (`r` ds row →
//! [`ShardRow`] as JSON); formats 2 and 3 stored one `s` ds row → shard record per sharded
//! item (a sealed 10,000-row shard was 10,000 sled inserts, ~10 % of a run's CPU with
//! instant responses). Older formats are migrated when the queue is opened ([`Queue::open`]):
//! `v` moves to the new format (with a `V` marker naming the old one) *before* any record is
//! rewritten, so a spool that predates the new format refuses a half-migrated queue instead of
//! misreading it, and an interrupted migration resumes at the next open.
//!
//! Invariants: counters change only in the same batch as the items they count, so they are
//! never recomputed by scanning; an outcome is applied only to an item that is still pending
//! (a late answer to a cancelled request cannot complete an item twice); in-flight state is
//! not stored (a lease is in memory), so after a crash every unfinished item is simply
//! pending; one process at a time (an exclusive lock file); blocks never overlap and are
//! recorded in row order (an enqueue only adds rows after the last block's).
//!
//! sled replays its log since its last recovery snapshot at every open, and writes a
//! snapshot only then (sled 0.34 has no other way to make one): after a big intake,
//! [`Queue::checkpoint`] reopens the database so that a restart — clean or after a SIGKILL —
//! does not replay the whole enqueue log again.
//!
//! sled applies a batch key by key and stops at the first error, so a *failed* write (a full
//! disk) can leave half a batch in memory and on disk. Invariant: after any failed write the
//! queue is poisoned — it writes nothing more — and leaves a `needs-repair` marker; the next
//! open sees the marker and the run rebuilds every dataset's records and counters
//! ([`Queue::repair`]) before anything else touches them.

use crate::output::shard::ShardRow;
use crate::store::blocks::{
    encode_block, Bitmap, Block, BlockError, BlockFile, BlockRef, RecordReader, BLOCK_ITEMS,
    BLOCK_SPAN,
};
use crate::store::results::{encode_record, ResultLog};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Queue-level failures: all are fatal for the run (exit 1) except `Locked` (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("queue in {path} is used by another spool process (lock held on {path}/spool.lock)")]
    Locked { path: PathBuf },
    #[error("cannot open queue in {path}: {detail}")]
    Open { path: PathBuf, detail: String },
    #[error("queue storage error: {0}")]
    Storage(#[from] sled::Error),
    #[error("corrupt queue record {key}: {detail}")]
    Corrupt { key: String, detail: String },
    #[error("queue format {found} is newer than this spool understands ({supported})")]
    Version { found: u32, supported: u32 },
    #[error("an earlier queue write failed, so nothing more is written to the queue (the next run repairs it)")]
    Poisoned,
    #[error(transparent)]
    Items(#[from] BlockError),
    #[error("rows are enqueued in file order, once: row {row} comes after row {last}")]
    RowOrder { row: u64, last: u64 },
}

/// Left in the queue folder by a failed write; its presence makes the next run repair.
pub const REPAIR_MARKER: &str = "needs-repair";

/// Test-only fault (like the shard writer's): the Nth commit that completes an item appends
/// its results to the log, writes only the keys that sort before the counters (the pending
/// bits), then fails — what sled leaves when a disk fills in the middle of a batch.
const FAULT_TORN_COMMIT: &str = "SPOOL_FAULT_QUEUE_TORN_COMMIT";

/// Test-only fault: the Nth batch a migration writes is made durable and then the migration
/// stops with an error — what a kill or a power cut leaves in the middle of a migration.
const FAULT_MIGRATION_STOP: &str = "SPOOL_FAULT_QUEUE_MIGRATION_STOP";

/// Present while a migration is under way, holding the format it started from. `v` already
/// says the new format then: every spool refuses a format newer than its own, so a spool
/// older than the migration never reads the half-rewritten records, and this one resumes the
/// migration (each step is resumable) at the next open.
pub const MIGRATING_KEY: &[u8] = b"V";

/// sled page-cache size. 64 MiB, not 128: at 1 M prompts it cut the enqueue pass's peak
/// RSS from 386 to 294 MiB at the same CPU per prompt (the queue is written and read
/// mostly in order; BENCHMARKS.md, scale section).
const CACHE_BYTES: u64 = 64 << 20;

/// Version of the record layout above; bump on any incompatible change. 1: one record per
/// item (`i`, `p`, `k`); 2: item blocks; 3: the results log (older ones are migrated by
/// [`Queue::open`]).
pub const FORMAT_VERSION: u32 = 4;

/// Most rows one `S` record lists (a 10,000-row shard takes three): each value stays a few
/// KiB, far below the size at which sled 0.34 writes a value to a blob file of its own.
pub const SHARD_RECORD_ROWS: usize = 4096;

/// Blocks also end once their records hold this many bytes (long conversations), so a block
/// read to dispatch one item stays small.
const BLOCK_BYTES: usize = 4 << 20;

/// Blocks kept decoded for [`Queue::item`]: dispatch and intake's checks read rows in file
/// order, so a few recent blocks serve nearly every read.
const CACHED_BLOCKS: usize = 8;

/// Durable per-dataset counters and cursors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DatasetState {
    pub index: u16,
    pub name: String,
    /// Lines of the input file already taken in by enqueue.
    pub scanned_lines: u64,
    pub items: u64,
    pub done: u64,
    pub failed: u64,
    pub rejected: u64,
    pub completion_tokens: u64,
    pub prompt_tokens: u64,
    /// Index the next shard file gets.
    pub next_shard: u64,
    /// Done items whose row is in a shard.
    pub sharded: u64,
    /// Tokens generated by requests aborted by the "cancel" budget policy.
    #[serde(default)]
    pub wasted_tokens: u64,
    /// A fingerprinted prefix of the input file that is wholly taken in, so a restart can
    /// skip it after hashing it instead of parsing and checking every row. Added after
    /// format 1 shipped: optional, left out when absent, ignored by older spools (they
    /// drop it when they rewrite the record, and the next run simply checks every row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan_mark: Option<ScanMark>,
    /// The results log's first unsharded record (or `results_end` when none is). Format 3;
    /// left out while 0, so a record without results reads and writes as before.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub results_start: u64,
    /// The end of the results log's recorded part: bytes past it were never recorded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub results_end: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A prefix of a line-based input file: its first `lines` lines are `bytes` bytes
/// (decompressed, for `.jsonl.zst`) ending with a newline, whose xxHash64 is `xxh64`.
///
/// Invariant: `lines` never exceeds the dataset's `scanned_lines` (a mark is written in the
/// same batch as the items it covers, or later), so an unchanged prefix holds only rows
/// already taken in and can be skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScanMark {
    pub lines: u64,
    pub bytes: u64,
    pub xxh64: u64,
}

impl DatasetState {
    /// Items neither done nor failed (derived, never stored).
    pub fn pending(&self) -> u64 {
        self.items - self.done - self.failed
    }
}

/// The prompt of one item, as it will be sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Item {
    pub id: String,
    pub hash: [u8; 16],
    /// The exact text sent (after the chat template).
    pub prompt: String,
    /// Input messages as JSON text, when the row had them.
    pub messages: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
}

impl Item {
    /// The item's record in a block (format 2; the id is in the block's id table), binary
    /// so that enqueue does not escape every prompt as JSON again: `hash` (16 bytes), the
    /// prompt (u32 LE length, UTF-8), the messages (length, or `u32::MAX` for none), the
    /// prompt ids (count, or `u32::MAX` for none, then u32 LE each).
    pub fn encode_record(&self) -> Vec<u8> {
        let ids = self.prompt_ids.as_ref().map_or(0, |v| v.len() * 4);
        let msgs = self.messages.as_ref().map_or(0, |m| m.len());
        let mut v = Vec::with_capacity(28 + self.prompt.len() + msgs + ids);
        v.extend_from_slice(&self.hash);
        let put = |v: &mut Vec<u8>, b: Option<&[u8]>| match b {
            Some(b) => {
                v.extend_from_slice(&(b.len() as u32).to_le_bytes());
                v.extend_from_slice(b);
            }
            None => v.extend_from_slice(&u32::MAX.to_le_bytes()),
        };
        put(&mut v, Some(self.prompt.as_bytes()));
        put(&mut v, self.messages.as_ref().map(|m| m.as_bytes()));
        match &self.prompt_ids {
            Some(ids) => {
                v.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                for id in ids {
                    v.extend_from_slice(&id.to_le_bytes());
                }
            }
            None => v.extend_from_slice(&u32::MAX.to_le_bytes()),
        }
        v
    }

    /// Reads [`Item::encode_record`]'s bytes back; `Err` says what does not add up.
    pub fn decode_record(id: String, b: &[u8]) -> Result<Item, String> {
        let mut r = RecordReader(b);
        let hash: [u8; 16] = r.take(16)?.try_into().expect("16 bytes");
        let prompt = r.text("prompt")?;
        let messages = r.opt_text("messages")?;
        let prompt_ids = r.opt_ids("prompt ids")?;
        r.finish()?;
        Ok(Item {
            id,
            hash,
            prompt,
            messages,
            prompt_ids,
        })
    }
}

/// An [`Item`] encoded for the queue, with the row and id it is stored under.
#[derive(Debug, Clone)]
pub struct EncodedItem {
    pub row: u64,
    pub id: String,
    /// The item's record ([`Item::encode_record`]).
    pub record: Vec<u8>,
}

impl EncodedItem {
    /// Encodes `item` for row `row`.
    pub fn new(row: u64, item: &Item) -> Self {
        Self {
            row,
            id: item.id.clone(),
            record: item.encode_record(),
        }
    }
}

/// Why an item failed permanently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: String,
    pub attempts: u32,
}

/// The end of an item's attempts, applied by [`Queue::commit`].
#[derive(Debug, Clone)]
pub enum Outcome {
    Done { ds: u16, result: Box<ShardRow> },
    Failed { ds: u16, row: u64, failure: Failure },
}

/// The sled database plus the in-memory copy of the counters.
pub struct Queue {
    db: sled::Db,
    tree: sled::Tree,
    states: Mutex<HashMap<u16, DatasetState>>,
    /// Every dataset's blocks by first row: the `B` records, kept in memory (a few hundred
    /// bytes per thousand items).
    index: Mutex<HashMap<u16, Vec<Arc<BlockRef>>>>,
    files: Mutex<HashMap<u16, Arc<BlockFile>>>,
    cache: Mutex<VecDeque<(BlockKey, Arc<Block>)>>,
    /// Every dataset's results log. Lock order: `states` before `results`.
    results: Mutex<HashMap<u16, ResultLog>>,
    path: PathBuf,
    _lock: std::fs::File,
    poisoned: AtomicBool,
    needs_repair: AtomicBool,
    /// Commits left before the injected torn commit (0: none armed).
    torn_commit_in: AtomicU64,
    /// Migration batches left before the injected stop (0: none armed).
    migration_stop_in: AtomicU64,
}

/// A cached block: (dataset, first row, offset). A repair that drops blocks clears the
/// cache, so a block written again at the same place is read afresh.
type BlockKey = (u16, u64, u64);

/// A done row as its shard file holds it, for [`Queue::repair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardedRow {
    pub shard: u64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// A dataset's records counted by state ([`Queue::audit`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Audit {
    pub items: u64,
    pub pending: u64,
    pub unsharded: u64,
    pub sharded: u64,
    pub failed: u64,
    /// Rows with an item but no state: lost by a torn write.
    pub stateless: Vec<u64>,
}

/// What [`Queue::repair`] changed in one dataset.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Repair {
    /// Rows in no state (a torn commit dropped their result): generated again.
    pub back_to_pending: u64,
    /// Rows found in a shard file that the queue had not recorded as sharded.
    pub marked_sharded: u64,
    /// Rows recorded in two states at once; the most advanced one is kept.
    pub extra_states_removed: u64,
    /// Rows past the scan position (a torn enqueue): removed, intake reads them again.
    pub unscanned_removed: u64,
    /// Rows recorded as sharded that no shard file holds (`spool verify` names them).
    pub sharded_without_file: u64,
    pub before: DatasetState,
    pub after: DatasetState,
}

impl Repair {
    /// Whether the repair found anything wrong.
    pub fn changed(&self) -> bool {
        self.before != self.after
            || self.back_to_pending
                + self.marked_sharded
                + self.extra_states_removed
                + self.unscanned_removed
                > 0
    }
}

fn key(prefix: u8, ds: u16, row: u64) -> [u8; 11] {
    let mut k = [0u8; 11];
    k[0] = prefix;
    k[1..3].copy_from_slice(&ds.to_be_bytes());
    k[3..11].copy_from_slice(&row.to_be_bytes());
    k
}

/// Key of the `S` record listing `shard`'s rows from `first_row`.
fn shard_key(ds: u16, shard: u64, first_row: u64) -> [u8; 19] {
    let mut k = [0u8; 19];
    k[0] = b'S';
    k[1..3].copy_from_slice(&ds.to_be_bytes());
    k[3..11].copy_from_slice(&shard.to_be_bytes());
    k[11..19].copy_from_slice(&first_row.to_be_bytes());
    k
}

/// Adds the `S` records of `shard` holding `rows` (any order, no repeats) to `batch`.
fn put_shard_rows(batch: &mut Writes, ds: u16, shard: u64, rows: &[u64]) {
    let mut rows = rows.to_vec();
    rows.sort_unstable();
    for chunk in rows.chunks(SHARD_RECORD_ROWS) {
        let mut v = Vec::with_capacity(chunk.len() * 2);
        for pair in chunk.windows(2) {
            put_varint(&mut v, pair[1] - pair[0]);
        }
        batch.insert(shard_key(ds, shard, chunk[0]), v);
    }
}

fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The shard and the rows of an `S` record.
fn decode_shard_record(k: &[u8], v: &[u8]) -> Result<(u64, Vec<u64>), QueueError> {
    if k.len() != 19 {
        return Err(QueueError::Corrupt {
            key: format!("S {k:02x?}"),
            detail: "bad shard record key".into(),
        });
    }
    let shard = u64::from_be_bytes(k[3..11].try_into().expect("8 bytes"));
    let mut row = u64::from_be_bytes(k[11..19].try_into().expect("8 bytes"));
    let bad = |detail: &str| QueueError::Corrupt {
        key: format!("S{}/shard {shard}/row {}", ds_of(k), row_of_bytes(&k[11..])),
        detail: detail.into(),
    };
    let mut rows = vec![row];
    let (mut n, mut shift) = (0u64, 0u32);
    for &b in v {
        if shift > 63 {
            return Err(bad("varint too long"));
        }
        n |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            row = row
                .checked_add(n)
                .filter(|_| n > 0)
                .ok_or_else(|| bad("rows not ascending"))?;
            rows.push(row);
            (n, shift) = (0, 0);
        } else {
            shift += 7;
        }
    }
    if shift != 0 {
        return Err(bad("cut varint"));
    }
    Ok((shard, rows))
}

fn prefix(p: u8, ds: u16) -> [u8; 3] {
    let b = ds.to_be_bytes();
    [p, b[0], b[1]]
}

fn ds_of(k: &[u8]) -> u16 {
    u16::from_be_bytes([k[1], k[2]])
}

/// A block's rows and bytes, from items in row order.
fn block_of_items(items: &[EncodedItem]) -> (Vec<u64>, Vec<u8>) {
    let rows = items.iter().map(|it| it.row).collect();
    let bytes = encode_block(items.iter().map(|it| (it.id.as_bytes(), &it.record[..])));
    (rows, bytes)
}

fn row_of(k: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&k[3..11]);
    u64::from_be_bytes(b)
}

fn meta_key(name: &str) -> Vec<u8> {
    let mut k = vec![b'm'];
    k.extend_from_slice(name.as_bytes());
    k
}

fn id_key(ds: u16, id: &str) -> Vec<u8> {
    let mut k = prefix(b'k', ds).to_vec();
    k.extend_from_slice(id.as_bytes());
    k
}

fn decode<T: for<'de> Deserialize<'de>>(k: &[u8], v: &[u8]) -> Result<T, QueueError> {
    serde_json::from_slice(v).map_err(|e| QueueError::Corrupt {
        key: String::from_utf8_lossy(k).into_owned(),
        detail: e.to_string(),
    })
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Invariant: our record types serialize infallibly (no maps with non-string keys).
    serde_json::to_vec(v).expect("queue records serialize")
}

impl Queue {
    /// Opens (or creates) the queue in `dir`, taking the exclusive lock.
    pub fn open(dir: &Path) -> Result<Queue, QueueError> {
        let migration_stop = std::env::var(FAULT_MIGRATION_STOP)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Queue::open_with(dir, migration_stop)
    }

    /// [`Queue::open`], with the injected migration stop armed at `migration_stop` batches.
    fn open_with(dir: &Path, migration_stop: u64) -> Result<Queue, QueueError> {
        use fs2::FileExt;
        crate::store::blocks::create_dir_durably(dir).map_err(|e| QueueError::Open {
            path: dir.to_path_buf(),
            detail: e.to_string(),
        })?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("spool.lock"))
            .map_err(|e| QueueError::Open {
                path: dir.to_path_buf(),
                detail: e.to_string(),
            })?;
        if lock.try_lock_exclusive().is_err() {
            return Err(QueueError::Locked {
                path: dir.to_path_buf(),
            });
        }
        let opened = std::time::Instant::now();
        let db = open_sled(dir)?;
        tracing::info!(path = %dir.display(), seconds = format!("{:.2}", opened.elapsed().as_secs_f64()),
            "queue opened (sled replays its log since its last snapshot)");
        let tree = db.open_tree("q")?;
        let marker = dir.join(REPAIR_MARKER);
        let found = match tree.get(b"v")? {
            None => {
                if let Err(e) = tree.insert(b"v", &FORMAT_VERSION.to_be_bytes()) {
                    mark_needs_repair(&marker);
                    return Err(e.into());
                }
                FORMAT_VERSION
            }
            Some(v) => {
                let found =
                    u32::from_be_bytes(v.as_ref().try_into().map_err(|_| QueueError::Corrupt {
                        key: "v".into(),
                        detail: "bad version record".into(),
                    })?);
                if found > FORMAT_VERSION {
                    return Err(QueueError::Version {
                        found,
                        supported: FORMAT_VERSION,
                    });
                }
                found
            }
        };
        // An interrupted migration resumes from the format it started from.
        let found = match tree.get(MIGRATING_KEY)? {
            None => found,
            Some(v) => {
                u32::from_be_bytes(v.as_ref().try_into().map_err(|_| QueueError::Corrupt {
                    key: "V".into(),
                    detail: "bad migration record".into(),
                })?)
            }
        };
        let mut states = HashMap::new();
        for kv in tree.scan_prefix(b"m") {
            let (k, v) = kv?;
            let s: DatasetState = decode(&k, &v)?;
            states.insert(s.index, s);
        }
        let mut index: HashMap<u16, Vec<Arc<BlockRef>>> = HashMap::new();
        for kv in tree.scan_prefix(b"B") {
            let (k, v) = kv?;
            let r = BlockRef::decode(row_of(&k), &v).ok_or_else(|| QueueError::Corrupt {
                key: format!("B{}/{}", ds_of(&k), row_of(&k)),
                detail: "bad block record".into(),
            })?;
            index.entry(ds_of(&k)).or_default().push(Arc::new(r));
        }
        let torn_commit_in = std::env::var(FAULT_TORN_COMMIT)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let q = Queue {
            db,
            tree,
            states: Mutex::new(states),
            index: Mutex::new(index),
            files: Mutex::new(HashMap::new()),
            cache: Mutex::new(VecDeque::new()),
            results: Mutex::new(HashMap::new()),
            path: dir.to_path_buf(),
            _lock: lock,
            poisoned: AtomicBool::new(false),
            needs_repair: AtomicBool::new(marker.exists()),
            torn_commit_in: AtomicU64::new(torn_commit_in),
            migration_stop_in: AtomicU64::new(migration_stop),
        };
        if found < FORMAT_VERSION {
            q.begin_migration(found)?;
        }
        if found < 2 {
            q.migrate_v1()?;
        }
        if found < 4 {
            q.migrate_v3()?;
        }
        for s in q.states() {
            q.open_results(&s)?;
        }
        if found < 3 {
            q.migrate_v2()?;
        }
        if found < FORMAT_VERSION {
            q.finish_migration()?;
        }
        Ok(q)
    }

    /// Records (durably, before any record is rewritten) that the queue is now in
    /// [`FORMAT_VERSION`] and is being migrated from `from`: older spools refuse it from here
    /// on, and this one resumes from `from`. A resumed migration finds its marker in place.
    fn begin_migration(&self, from: u32) -> Result<(), QueueError> {
        if self.tree.contains_key(MIGRATING_KEY)? {
            tracing::warn!(
                from,
                to = FORMAT_VERSION,
                "resuming an interrupted queue migration"
            );
            return Ok(());
        }
        let mut w = Writes::default();
        w.insert(b"v", FORMAT_VERSION.to_be_bytes());
        w.insert(MIGRATING_KEY, from.to_be_bytes());
        self.apply(w)?;
        self.flush()?;
        tracing::info!(
            from,
            to = FORMAT_VERSION,
            "migrating the queue (older spools refuse it from now on)"
        );
        Ok(())
    }

    /// Ends a migration, durably: the marker goes.
    fn finish_migration(&self) -> Result<(), QueueError> {
        let mut w = Writes::default();
        w.insert(b"v", FORMAT_VERSION.to_be_bytes());
        w.remove(MIGRATING_KEY);
        self.apply(w)?;
        self.flush()
    }

    /// Counts a migration batch for the injected stop ([`FAULT_MIGRATION_STOP`]): the Nth
    /// is flushed, then the migration fails as if the process had died there.
    fn migration_step(&self) -> Result<(), QueueError> {
        let stop = self
            .migration_stop_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok_and(|prev| prev == 1);
        if !stop {
            return Ok(());
        }
        self.flush()?;
        Err(QueueError::Open {
            path: self.path.clone(),
            detail: format!("injected stop in the middle of a migration ({FAULT_MIGRATION_STOP})"),
        })
    }

    /// Opens a dataset's results log (cutting off an unrecorded tail) and indexes its
    /// unsharded results: the records past `results_start` whose item is in no other state
    /// (a repair may have given one another; a row completed twice keeps its newest).
    fn open_results(&self, s: &DatasetState) -> Result<(), QueueError> {
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
    fn dead_results(
        &self,
        ds: u16,
        rows: impl Iterator<Item = u64>,
    ) -> Result<Vec<u64>, QueueError> {
        let rows: Vec<u64> = rows.collect();
        let mut sharded = std::collections::HashSet::new();
        if !rows.is_empty() {
            let wanted: std::collections::HashSet<u64> = rows.iter().copied().collect();
            for kv in self.tree.scan_prefix(prefix(b'S', ds)) {
                let (k, v) = kv?;
                let (_, in_shard) = decode_shard_record(&k, &v)?;
                sharded.extend(in_shard.into_iter().filter(|r| wanted.contains(r)));
            }
        }
        let mut dead = Vec::new();
        for row in rows {
            let live = match self.block_of(ds, row) {
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

    fn lock_results(&self) -> std::sync::MutexGuard<'_, HashMap<u16, ResultLog>> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves a format-2 queue's unsharded results (`r` records in sled) to the results log,
    /// one atomic batch per dataset (the records out, the log's end in). Resumable: an
    /// interrupted migration left the records in sled, and the log's unrecorded tail is cut
    /// off when it is opened again.
    fn migrate_v2(&self) -> Result<(), QueueError> {
        let t = std::time::Instant::now();
        let mut moved = 0u64;
        for s in self.states() {
            let ds = s.index;
            let mut keys = Vec::new();
            let mut records = Vec::new();
            for kv in self.tree.scan_prefix(prefix(b'r', ds)) {
                let (k, v) = kv?;
                let row: ShardRow = decode(&k, &v)?;
                records.push((row_of(&k), encode_record(&row)));
                keys.push(k);
            }
            if keys.is_empty() {
                continue;
            }
            let mut states = self.lock_states();
            let mut st = known(&states, ds)?;
            let mut logs = self.lock_results();
            let log = logs.get_mut(&ds).ok_or_else(|| unknown(ds))?;
            self.writable()?;
            let appended = log.append(&records)?;
            st.results_end = appended.end;
            log.recorded(appended.records);
            // A row also recorded in another state (a torn format-2 write, which the
            // repair sorts out) is not unsharded.
            let dead = self.dead_results(ds, records.iter().map(|(row, _)| *row))?;
            st.results_start = log.forget(dead, st.results_end);
            let mut w = Writes::default();
            for k in &keys {
                w.remove(k);
            }
            w.insert(meta_key(&st.name), encode(&st));
            self.apply(w)?;
            states.insert(ds, st);
            moved += keys.len() as u64;
            self.migration_step()?;
        }
        tracing::info!(
            results = moved,
            seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
            "queue migrated from format 2 to format 3 (results log)"
        );
        Ok(())
    }

    /// Rewrites the `s` ds row → shard records of formats 2 and 3 as `S` records, one
    /// atomic batch per [`SHARD_RECORD_ROWS`] `s` records (their `S` records in, they out).
    /// Resumable: an interrupted run left the rest as `s`, and no row is ever in both (each
    /// batch moves its rows whole). The caller records the format.
    fn migrate_v3(&self) -> Result<(), QueueError> {
        let t = std::time::Instant::now();
        let mut moved = 0u64;
        for s in self.states() {
            let ds = s.index;
            let mut scan = self.tree.scan_prefix(prefix(b's', ds)).peekable();
            while scan.peek().is_some() {
                let mut by_shard: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
                let mut w = Writes::default();
                for kv in scan.by_ref().take(SHARD_RECORD_ROWS) {
                    let (k, v) = kv?;
                    by_shard
                        .entry(row_of_bytes(&v))
                        .or_default()
                        .push(row_of(&k));
                    w.remove(&k);
                    moved += 1;
                }
                for (shard, rows) in by_shard {
                    put_shard_rows(&mut w, ds, shard, &rows);
                }
                self.apply(w)?;
                self.migration_step()?;
            }
        }
        if moved > 0 {
            tracing::info!(
                items = moved,
                seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
                "queue migrated to format 4 (one record per shard's rows)"
            );
        }
        Ok(())
    }

    /// Rewrites a format-1 queue's per-item records (`i` item, `p` pending, `k` id index)
    /// as blocks, one atomic batch per block (the block's `B` and `P` records in, its rows'
    /// old keys out). Resumable: rows an earlier, interrupted migration already put in a
    /// block only lose their old keys; rows past the scan position (a torn enqueue) are
    /// dropped, as the repair would, for intake to read again.
    fn migrate_v1(&self) -> Result<(), QueueError> {
        let t = std::time::Instant::now();
        let mut moved = 0u64;
        for s in self.states() {
            let ds = s.index;
            let mut chunk: Vec<(u64, String, Vec<u8>)> = Vec::new();
            let mut bytes = 0usize;
            // Rows up to here are in blocks already (an interrupted migration).
            let migrated = self.last_row(ds);
            for kv in self.tree.scan_prefix(prefix(b'i', ds)) {
                let (k, v) = kv?;
                let row = row_of(&k);
                let item: Item = decode(&k, &v)?;
                let done_before = migrated.is_some_and(|l| row <= l);
                if done_before || row >= s.scanned_lines {
                    let mut w = Writes::default();
                    w.remove(&k);
                    w.remove(key(b'p', ds, row));
                    w.remove(id_key(ds, &item.id));
                    self.apply(w)?;
                    self.migration_step()?;
                    continue;
                }
                let full = chunk.first().is_some_and(|(first, _, _)| {
                    chunk.len() >= BLOCK_ITEMS || row - first >= BLOCK_SPAN || bytes >= BLOCK_BYTES
                });
                if full {
                    moved += chunk.len() as u64;
                    self.migrate_chunk(ds, std::mem::take(&mut chunk))?;
                    bytes = 0;
                }
                let record = item.encode_record();
                bytes += record.len();
                chunk.push((row, item.id, record));
            }
            if !chunk.is_empty() {
                moved += chunk.len() as u64;
                self.migrate_chunk(ds, chunk)?;
            }
            // Leftovers of torn format-1 writes: pending or id keys without an item.
            let mut w = Writes::default();
            for p in [b'p', b'k'] {
                for kv in self.tree.scan_prefix(prefix(p, ds)) {
                    w.remove(kv?.0);
                }
            }
            if !w.0.is_empty() {
                self.apply(w)?;
                self.migration_step()?;
            }
        }
        tracing::info!(
            items = moved,
            seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
            "queue migrated from format 1 to format 2 (item blocks)"
        );
        Ok(())
    }

    /// One block of a format-1 migration.
    fn migrate_chunk(&self, ds: u16, chunk: Vec<(u64, String, Vec<u8>)>) -> Result<(), QueueError> {
        let bytes = encode_block(chunk.iter().map(|(_, id, rec)| (id.as_bytes(), &rec[..])));
        let rows: Vec<u64> = chunk.iter().map(|c| c.0).collect();
        let r = self.append_block(ds, &rows, bytes)?;
        let mut pending = Bitmap::empty(r.span());
        let mut w = Writes::default();
        for (row, id, _) in &chunk {
            if self.tree.contains_key(key(b'p', ds, *row))? {
                pending.set(row - r.first_row, true);
            }
            w.remove(key(b'i', ds, *row));
            w.remove(key(b'p', ds, *row));
            w.remove(id_key(ds, id));
        }
        w.insert(key(b'B', ds, r.first_row), r.encode());
        if !pending.is_clear() {
            w.insert(key(b'P', ds, r.first_row), &pending.0);
        }
        self.apply(w)?;
        self.lock_index().entry(ds).or_default().push(Arc::new(r));
        self.migration_step()
    }

    /// Writes one block's bytes to the dataset's file (synced) and returns its record, not
    /// yet stored.
    fn append_block(&self, ds: u16, rows: &[u64], bytes: Vec<u8>) -> Result<BlockRef, QueueError> {
        let mut refs = self.append_blocks(ds, &[(rows.to_vec(), bytes)])?;
        Ok(refs.remove(0))
    }

    /// Writes blocks (their rows and bytes) to the dataset's file with one sync; returns their
    /// records, not yet stored.
    fn append_blocks(
        &self,
        ds: u16,
        blocks: &[(Vec<u64>, Vec<u8>)],
    ) -> Result<Vec<BlockRef>, QueueError> {
        self.writable()?;
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

    fn lock_index(&self) -> std::sync::MutexGuard<'_, HashMap<u16, Vec<Arc<BlockRef>>>> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The dataset's block file, opened on first use (cutting off an unrecorded tail).
    fn file(&self, ds: u16) -> Result<Arc<BlockFile>, QueueError> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(&ds) {
            return Ok(f.clone());
        }
        let f = Arc::new(BlockFile::open(
            BlockFile::path(&self.path, ds),
            self.blocks_end(ds),
            "an item append (an interrupted enqueue)",
        )?);
        files.insert(ds, f.clone());
        Ok(f)
    }

    /// The end of the dataset's last recorded block in its file.
    fn blocks_end(&self, ds: u16) -> u64 {
        self.lock_index()
            .get(&ds)
            .and_then(|v| v.last())
            .map_or(0, |r| r.offset + u64::from(r.len))
    }

    /// The last item row of the dataset, if it has items.
    fn last_row(&self, ds: u16) -> Option<u64> {
        let index = self.lock_index();
        index.get(&ds)?.last()?.last_row()
    }

    /// The block whose rows include `row`.
    fn block_of(&self, ds: u16, row: u64) -> Option<Arc<BlockRef>> {
        let index = self.lock_index();
        let v = index.get(&ds)?;
        let i = v.partition_point(|r| r.first_row <= row).checked_sub(1)?;
        let r = &v[i];
        (row < r.first_row + r.span()).then(|| r.clone())
    }

    /// The first row of the block holding `row` or the last one before it (0 if none): where
    /// a scan for rows from `row` on starts.
    fn scan_start(&self, ds: u16, row: u64) -> u64 {
        let index = self.lock_index();
        index
            .get(&ds)
            .and_then(|v| {
                let i = v.partition_point(|r| r.first_row <= row).checked_sub(1)?;
                Some(v[i].first_row)
            })
            .unwrap_or(0)
    }

    /// A block's items, from the cache or read (and checked) from its file.
    fn block(&self, ds: u16, r: &BlockRef) -> Result<Arc<Block>, QueueError> {
        let id = (ds, r.first_row, r.offset);
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((_, b)) = cache.iter().find(|(k, _)| *k == id) {
                return Ok(b.clone());
            }
        }
        let b = Arc::new(self.file(ds)?.read(r)?);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHED_BLOCKS {
            cache.pop_front();
        }
        cache.push_back((id, b.clone()));
        Ok(b)
    }

    /// Whether a failed write of an earlier run may have left half a batch behind: the run
    /// must [`repair`](Queue::repair) every dataset before using the queue.
    pub fn needs_repair(&self) -> bool {
        self.needs_repair.load(Ordering::SeqCst)
    }

    /// Refuses every write once one has failed: sled may hold half a batch in memory, and
    /// building on it would make the tear durable.
    fn writable(&self) -> Result<(), QueueError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(QueueError::Poisoned);
        }
        Ok(())
    }

    /// Passes a write's result through, poisoning the queue (and leaving the repair marker)
    /// when it failed.
    fn written<T>(&self, r: Result<T, sled::Error>) -> Result<T, QueueError> {
        r.map_err(|e| {
            self.poison();
            QueueError::Storage(e)
        })
    }

    /// Stops every later write and leaves the repair marker (once).
    fn poison(&self) {
        if !self.poisoned.swap(true, Ordering::SeqCst) {
            mark_needs_repair(&self.path.join(REPAIR_MARKER));
        }
    }

    /// Applies a batch; the one door for batches, so a failure always poisons.
    fn apply(&self, writes: Writes) -> Result<(), QueueError> {
        let mut batch = sled::Batch::default();
        for (k, v) in writes.0 {
            match v {
                Some(v) => batch.insert(k, v),
                None => batch.remove(k),
            }
        }
        self.apply_batch(batch)
    }

    /// Every queue write goes through here: refused once poisoned, and a failure poisons.
    fn apply_batch(&self, batch: sled::Batch) -> Result<(), QueueError> {
        self.writable()?;
        let r = self.tree.apply_batch(batch);
        self.written(r)
    }

    /// The injected torn commit: writes, durably, the keys that sort before the result
    /// (sled applies a batch in key order), then fails like a full disk.
    fn torn(&self, writes: Writes) -> QueueError {
        for (k, v) in writes.0.into_iter().filter(|(k, _)| k[0] < b'm') {
            let r = match v {
                Some(v) => self.tree.insert(k, v).map(|_| ()),
                None => self.tree.remove(k).map(|_| ()),
            };
            if let Err(e) = self.written(r) {
                return e;
            }
        }
        if let Err(e) = self.written(self.db.flush()) {
            return e;
        }
        let injected = std::io::Error::other(format!("injected torn write ({FAULT_TORN_COMMIT})"));
        self.written::<()>(Err(sled::Error::Io(injected)))
            .expect_err("an Err stays an Err")
    }

    /// The injected torn commit (see [`FAULT_TORN_COMMIT`]): true when this one tears.
    fn tears_now(&self) -> bool {
        self.torn_commit_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|prev| prev == 1)
            .unwrap_or(false)
    }

    /// Arms the injected torn commit for the `nth` commit from now (tests of the modules
    /// that drive commits).
    #[cfg(test)]
    pub(crate) fn tear_commit_for_tests(&self, nth: u64) {
        self.torn_commit_in.store(nth, Ordering::SeqCst);
    }

    /// Where the queue lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_states(&self) -> std::sync::MutexGuard<'_, HashMap<u16, DatasetState>> {
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
        let Some((r, i)) = self.locate(ds, row) else {
            return Ok(None);
        };
        let b = self.block(ds, &r)?;
        let id = String::from_utf8_lossy(b.id(i)).into_owned();
        Item::decode_record(id, b.record(i))
            .map(Some)
            .map_err(|detail| QueueError::Corrupt {
                // Built only for the error: a path and two strings per leased item were
                // visible in the hot path's allocations.
                key: format!("{} row {row}", BlockFile::path(&self.path, ds).display()),
                detail,
            })
    }

    /// The id of the item at `row`: from a cached block, else only the id's bytes are read
    /// (intake checks each duplicate candidate this way; reading its whole block, up to
    /// 4 MiB, made a file of scattered duplicates quadratic).
    pub fn item_id(&self, ds: u16, row: u64) -> Result<Option<String>, QueueError> {
        let Some((r, i)) = self.locate(ds, row) else {
            return Ok(None);
        };
        let key = (ds, r.first_row, r.offset);
        let cached = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            cache
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, b)| b.clone())
        };
        let id = match cached {
            Some(b) => String::from_utf8_lossy(b.id(i)).into_owned(),
            None => String::from_utf8_lossy(&self.file(ds)?.read_id(&r, i)?).into_owned(),
        };
        Ok(Some(id))
    }

    /// The block holding the item at `row`, and its position there.
    fn locate(&self, ds: u16, row: u64) -> Option<(Arc<BlockRef>, usize)> {
        let r = self.block_of(ds, row)?;
        let i = r.index_of(row)?;
        Some((r, i))
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
        let mut last = self.last_row(ds);
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
        self.lock_index()
            .entry(ds)
            .or_default()
            .extend(refs.into_iter().map(Arc::new));
        drop(states);
        reclaim(2 * n + 1);
        Ok(())
    }

    /// Every id already enqueued for `ds` with its row, in file order, to `f` (intake seeds
    /// its duplicate filter with them when it adds rows to a dataset that has items). Reads
    /// only the blocks' id tables.
    pub fn for_each_id(&self, ds: u16, mut f: impl FnMut(&[u8], u64)) -> Result<(), QueueError> {
        let refs: Vec<Arc<BlockRef>> = self.lock_index().get(&ds).cloned().unwrap_or_default();
        if refs.is_empty() {
            return Ok(());
        }
        let file = self.file(ds)?;
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
        let start = key(b'P', ds, self.scan_start(ds, from));
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
        let Some(r) = self.block_of(ds, row) else {
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
    /// outcome for an item that is no longer pending is ignored).
    pub fn commit(&self, outcomes: &[Outcome]) -> Result<Vec<bool>, QueueError> {
        let mut states = self.lock_states();
        let mut changed: HashMap<u16, DatasetState> = HashMap::new();
        let mut batch = Writes::default();
        let mut applied = Vec::with_capacity(outcomes.len());
        let mut seen = std::collections::HashSet::new();
        // Pending bitmaps read by this batch (and whether it cleared a bit), by (dataset,
        // first row).
        let mut bits: BTreeMap<(u16, u64), (Option<Bitmap>, bool)> = BTreeMap::new();
        // Results to append to each dataset's log: (row, record).
        let mut records: BTreeMap<u16, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
        for o in outcomes {
            let (ds, row) = match o {
                Outcome::Done { ds, result } => (*ds, result.row),
                Outcome::Failed { ds, row, .. } => (*ds, *row),
            };
            let Some(r) = self.block_of(ds, row).filter(|_| seen.insert((ds, row))) else {
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
            match pending {
                Some(b) if b.get(bit) => {
                    b.set(bit, false);
                    *cleared = true;
                }
                _ => {
                    applied.push(false);
                    continue;
                }
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
                    records
                        .entry(ds)
                        .or_default()
                        .push((row, encode_record(result)));
                }
                Outcome::Failed { failure, .. } => {
                    s.failed += 1;
                    batch.insert(key(b'f', ds, row), encode(failure));
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
                self.poison();
                QueueError::Items(e)
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

    /// Results done but not yet in a shard, in file order.
    pub fn unsharded(&self, ds: u16) -> Result<Vec<ShardRow>, QueueError> {
        let logs = self.lock_results();
        match logs.get(&ds) {
            Some(log) => Ok(log.read_all()?),
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
            let Some(r) = self.block_of(ds, row) else {
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

    /// Rebuilds a dataset's records and counters after a torn write, trusting, in order: the
    /// shard files (`in_shards`: every row they hold), then the most advanced state recorded
    /// (sharded > unsharded result > `f` > pending); an item in no state lost its result and
    /// is pending again. The dataset's `S` records are rewritten whole from what is kept.
    /// Blocks past the scan position (a torn enqueue) are dropped (intake reads them again).
    /// One batch, flushed.
    pub fn repair(
        &self,
        ds: u16,
        in_shards: &HashMap<u64, ShardedRow>,
    ) -> Result<Repair, QueueError> {
        const P: u8 = 1;
        const R: u8 = 2;
        const S: u8 = 4;
        const F: u8 = 8;
        let mut states = self.lock_states();
        let before = known(&states, ds)?;
        let mut rep = Repair {
            before: before.clone(),
            ..Default::default()
        };
        let mut batch = Writes::default();
        let refs: Vec<Arc<BlockRef>> = self.lock_index().get(&ds).cloned().unwrap_or_default();
        let (kept, dropped): (Vec<_>, Vec<_>) = refs
            .into_iter()
            .partition(|r| r.first_row < before.scanned_lines);
        for r in &dropped {
            batch.remove(key(b'B', ds, r.first_row));
            batch.remove(key(b'P', ds, r.first_row));
            rep.unscanned_removed += u64::from(r.count);
        }
        // Every item with the state bits recorded for it.
        let mut rows: BTreeMap<u64, u8> = BTreeMap::new();
        for r in &kept {
            rows.extend(r.item_rows().map(|row| (row, 0)));
        }
        let mut old_bits: HashMap<u64, Bitmap> = HashMap::new();
        for kv in self.tree.scan_prefix(prefix(b'P', ds)) {
            let (k, v) = kv?;
            let first = row_of(&k);
            let b = Bitmap(v.to_vec());
            for bit in b.ones() {
                if let Some(bits) = rows.get_mut(&(first + bit)) {
                    *bits |= P;
                }
            }
            old_bits.insert(first, b);
        }
        let mut result_tokens: HashMap<u64, (u32, u32)> = HashMap::new();
        let mut shard_of: HashMap<u64, u64> = HashMap::new();
        // Results in the log that no longer count as unsharded.
        let mut forget: Vec<u64> = Vec::new();
        let unsharded = match self.lock_results().get(&ds) {
            Some(log) => log.read_all()?,
            None => Vec::new(),
        };
        for r in unsharded {
            match rows.get_mut(&r.row) {
                Some(bits) => *bits |= R,
                // A state without its item: only a torn enqueue past the scan position.
                None => forget.push(r.row),
            }
            result_tokens.insert(r.row, (r.prompt_tokens, r.completion_tokens));
        }
        // The `S` records are rewritten whole from the states kept (below).
        for kv in self.tree.scan_prefix(prefix(b'S', ds)) {
            let (k, v) = kv?;
            let (shard, in_shard) = decode_shard_record(&k, &v)?;
            batch.remove(&k);
            for row in in_shard {
                if let Some(bits) = rows.get_mut(&row) {
                    *bits |= S;
                    shard_of.insert(row, shard);
                }
            }
        }
        for kv in self.tree.scan_prefix(prefix(b'f', ds)) {
            let (k, _) = kv?;
            match rows.get_mut(&row_of(&k)) {
                Some(bits) => *bits |= F,
                None => batch.remove(&k),
            }
        }
        let mut shards: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        let mut after = DatasetState {
            items: rows.len() as u64,
            done: 0,
            failed: 0,
            sharded: 0,
            completion_tokens: 0,
            prompt_tokens: 0,
            ..before.clone()
        };
        let mut pending: BTreeMap<u64, Bitmap> = BTreeMap::new();
        let mut r_i = 0;
        for (&row, &bits) in &rows {
            while kept[r_i].first_row + kept[r_i].span() <= row {
                r_i += 1;
            }
            let block = &kept[r_i];
            let keep = if let Some(f) = in_shards.get(&row) {
                if bits & S == 0 || shard_of.get(&row) != Some(&f.shard) {
                    rep.marked_sharded += 1;
                }
                shards.entry(f.shard).or_default().push(row);
                after.prompt_tokens += u64::from(f.prompt_tokens);
                after.completion_tokens += u64::from(f.completion_tokens);
                after.next_shard = after.next_shard.max(f.shard + 1);
                S
            } else if let Some(&shard) = shard_of.get(&row) {
                rep.sharded_without_file += 1;
                shards.entry(shard).or_default().push(row);
                S
            } else if bits & R != 0 {
                let (p, c) = result_tokens.get(&row).copied().unwrap_or_default();
                after.prompt_tokens += u64::from(p);
                after.completion_tokens += u64::from(c);
                R
            } else if bits & F != 0 {
                F
            } else {
                if bits & P == 0 {
                    rep.back_to_pending += 1;
                }
                P
            };
            if keep == P {
                pending
                    .entry(block.first_row)
                    .or_insert_with(|| Bitmap::empty(block.span()))
                    .set(row - block.first_row, true);
            }
            if keep != R && bits & R != 0 {
                forget.push(row);
                rep.extra_states_removed += 1;
            }
            if S != keep && bits & S != 0 {
                rep.extra_states_removed += 1;
            }
            if F != keep && bits & F != 0 {
                batch.remove(key(b'f', ds, row));
                rep.extra_states_removed += 1;
            }
            if keep != P && bits & P != 0 {
                rep.extra_states_removed += 1;
            }
            match keep {
                S => {
                    after.done += 1;
                    after.sharded += 1;
                }
                R => after.done += 1,
                F => after.failed += 1,
                _ => {}
            }
        }
        for (shard, rows) in &shards {
            put_shard_rows(&mut batch, ds, *shard, rows);
        }
        // Pending bitmaps as the kept states say, written where they differ.
        for r in &kept {
            let want = pending.remove(&r.first_row);
            if old_bits.get(&r.first_row) != want.as_ref() {
                match want {
                    Some(b) => batch.insert(key(b'P', ds, r.first_row), b.0),
                    None => batch.remove(key(b'P', ds, r.first_row)),
                }
            }
        }
        if rep.sharded_without_file > 0 {
            // Their token counts are gone with their file: keep what the counters said.
            after.prompt_tokens = after.prompt_tokens.max(before.prompt_tokens);
            after.completion_tokens = after.completion_tokens.max(before.completion_tokens);
        }
        if let Some(log) = self.lock_results().get_mut(&ds) {
            after.results_start = log.forget(forget, after.results_end);
        }
        batch.insert(meta_key(&after.name), encode(&after));
        self.apply(batch)?;
        states.insert(ds, after.clone());
        drop(states);
        if !dropped.is_empty() {
            let end = kept.last().map_or(0, |r| r.offset + u64::from(r.len));
            self.lock_index().insert(ds, kept);
            self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
            self.file(ds)?.truncate(end)?;
        }
        self.flush()?;
        rep.after = after;
        Ok(rep)
    }

    /// Counts a dataset's records by state, for `spool verify` to hold the counters against;
    /// also the items in no state at all (a torn write lost them).
    pub fn audit(&self, ds: u16) -> Result<Audit, QueueError> {
        let mut stated = std::collections::HashSet::new();
        let mut a = Audit::default();
        let refs: Vec<Arc<BlockRef>> = self.lock_index().get(&ds).cloned().unwrap_or_default();
        for kv in self.tree.scan_prefix(prefix(b'P', ds)) {
            let (k, v) = kv?;
            let first = row_of(&k);
            for bit in Bitmap(v.to_vec()).ones() {
                stated.insert(first + bit);
                a.pending += 1;
            }
        }
        if let Some(log) = self.lock_results().get(&ds) {
            for row in log.rows() {
                stated.insert(row);
                a.unsharded += 1;
            }
        }
        for (row, _) in self.sharded_rows(ds)? {
            stated.insert(row);
            a.sharded += 1;
        }
        for kv in self.tree.scan_prefix(prefix(b'f', ds)) {
            let (k, _) = kv?;
            stated.insert(row_of(&k));
            a.failed += 1;
        }
        for r in &refs {
            for row in r.item_rows() {
                a.items += 1;
                if !stated.contains(&row) {
                    a.stateless.push(row);
                }
            }
        }
        Ok(a)
    }

    /// Ends a repair of every dataset: the marker goes, durably.
    pub fn finish_repair(&self) -> Result<(), QueueError> {
        self.flush()?;
        let marker = self.path.join(REPAIR_MARKER);
        let gone =
            std::fs::remove_file(&marker).and_then(|_| std::fs::File::open(&self.path)?.sync_all());
        match gone {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(QueueError::Open {
                    path: marker,
                    detail: format!("cannot remove the repair marker: {e}"),
                })
            }
        }
        self.needs_repair.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Flushes, closes and reopens the sled database, so that sled writes a recovery
    /// snapshot now (sled 0.34 writes one only at open). The next open — after a clean
    /// stop or a SIGKILL — then replays only the log written after this point, instead of
    /// everything since this process opened the queue (at 1 M prompts, the enqueue log is
    /// ~1.7 GB and its replay took 4.2 s). Costs that replay once, here. The lock file stays
    /// held throughout; counters, flags and the armed fault carry over. Needs the only
    /// handle (`Arc::try_unwrap`): sled cannot reopen while a `Tree` of it is alive.
    pub fn checkpoint(self) -> Result<Queue, QueueError> {
        self.flush()?;
        // Only the sled handles are replaced; the lock file, counters and flags move over.
        let Queue { db, tree, .. } = self;
        drop(tree);
        drop(db);
        let t = std::time::Instant::now();
        let db = open_sled(&self.path)?;
        let tree = db.open_tree("q")?;
        tracing::info!(path = %self.path.display(), seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
            "queue checkpointed (reopened: sled wrote a snapshot, so the next start replays less)");
        Ok(Queue { db, tree, ..self })
    }

    /// Makes everything written so far durable (fsync).
    pub fn flush(&self) -> Result<(), QueueError> {
        self.writable()?;
        let r = self.db.flush();
        self.written(r)?;
        Ok(())
    }
}

/// One batch's writes in key order — the order sled applies them in, which the injected
/// torn commit reproduces.
#[derive(Default)]
struct Writes(BTreeMap<Vec<u8>, Option<Vec<u8>>>);

impl Writes {
    fn insert(&mut self, k: impl AsRef<[u8]>, v: impl AsRef<[u8]>) {
        self.0
            .insert(k.as_ref().to_vec(), Some(v.as_ref().to_vec()));
    }

    fn remove(&mut self, k: impl AsRef<[u8]>) {
        self.0.insert(k.as_ref().to_vec(), None);
    }
}

/// Leaves the repair marker, durably where the disk allows (an empty file needs no data
/// block). If even that fails, says how to recover by hand.
fn mark_needs_repair(marker: &Path) {
    let made = std::fs::File::create(marker)
        .and_then(|f| f.sync_all())
        .and_then(|_| {
            let dir = marker.parent().unwrap_or(Path::new("."));
            std::fs::File::open(dir)?.sync_all()
        });
    match made {
        Ok(()) => {
            tracing::error!(marker = %marker.display(), "a queue write failed; the next run repairs the queue")
        }
        Err(e) => tracing::error!(marker = %marker.display(), error = %e,
            "a queue write failed and the repair marker could not be written; create it (an empty file) before the next run"),
    }
}

/// Opens the sled database under `dir` (the caller holds `spool.lock`).
///
/// sled 0.34 writes its recovery snapshot only here, at open, after replaying its whole log
/// since the previous snapshot; [`Queue::checkpoint`] relies on that.
fn open_sled(dir: &Path) -> Result<sled::Db, QueueError> {
    // We hold spool.lock, so a held sled lock can only be this process's own previous
    // handle whose flusher thread has not yet let go (a reopen): wait for it.
    let mut tries = 0;
    loop {
        let r = sled::Config::new()
            .path(dir.join("queue"))
            .flush_every_ms(Some(1000))
            // sled's default page cache is 1 GiB; the queue is read mostly in order, and
            // a bounded cache keeps RSS flat whatever the queue's length.
            .cache_capacity(CACHE_BYTES)
            .open();
        match r {
            Ok(db) => {
                // sled syncs its log but neither its `conf` (which it writes at open) nor its
                // folder: make `conf`, the names of its files (and of a snapshot it renamed
                // into place while opening) and the folder's own name durable before any
                // record is trusted to survive a power cut.
                let queue = dir.join("queue");
                std::fs::File::open(queue.join("conf"))
                    .and_then(|conf| conf.sync_all())
                    .and_then(|_| crate::store::blocks::sync_parent(&queue.join("db")))
                    .and_then(|_| crate::store::blocks::sync_parent(&queue))
                    .map_err(|e| QueueError::Open {
                        path: queue.clone(),
                        detail: format!("cannot sync the queue's folder: {e}"),
                    })?;
                return Ok(db);
            }
            Err(e) if tries < 200 && e.to_string().contains("could not acquire lock") => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => {
                return Err(QueueError::Open {
                    path: dir.to_path_buf(),
                    detail: e.to_string(),
                })
            }
        }
    }
}

/// Drives sled's garbage collection after a big batch. sled frees the node versions a write
/// replaces through crossbeam's epoch GC, which reclaims only a few bags of garbage per
/// `pin`; a writer that applies big batches without reading in between pins too rarely, so
/// garbage outgrew reclamation and RSS grew by ~2 KB per enqueued item (2.6 GiB at 1 M).
/// Flushing this thread's bag and collecting about once per 64 writes keeps it flat.
fn reclaim(writes: usize) {
    for _ in 0..writes.div_ceil(64) {
        crossbeam_epoch::pin().flush();
    }
}

/// A dataset's counters, which must exist once the dataset was opened.
fn known(states: &HashMap<u16, DatasetState>, ds: u16) -> Result<DatasetState, QueueError> {
    states.get(&ds).cloned().ok_or_else(|| unknown(ds))
}

fn unknown(ds: u16) -> QueueError {
    QueueError::Corrupt {
        key: format!("m{ds}"),
        detail: "unknown dataset".into(),
    }
}

fn row_of_bytes(v: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = v.len().min(8);
    b[8 - n..].copy_from_slice(&v[..n]);
    u64::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A checkpoint reopens sled, which writes a newer snapshot, and keeps everything:
    /// items, counters, pending rows, the id index; the lock stays held throughout, and the
    /// queue stays writable and durable.
    #[test]
    fn a_checkpoint_keeps_the_queue_and_writes_a_newer_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let snapshots = |d: &Path| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(d.join("queue"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("snap."))
                .collect();
            v.sort();
            v
        };
        let q = Queue::open(dir.path()).unwrap();
        let ds = q.open_dataset("d").unwrap().index;
        let items: Vec<(u64, Item)> = (0..50).map(|r| (r, item(&format!("id{r}")))).collect();
        q.enqueue(ds, &items, 50, 0).unwrap();
        q.flush().unwrap();
        let before = snapshots(dir.path());
        let q = q.checkpoint().unwrap();
        let after = snapshots(dir.path());
        assert!(
            after.last() > before.last(),
            "no newer snapshot: {before:?} -> {after:?}"
        );
        assert!(matches!(
            Queue::open(dir.path()),
            Err(QueueError::Locked { .. })
        ));
        assert_eq!(q.state(ds).unwrap().items, 50);
        assert_eq!(q.pending_rows(ds, None, 100).unwrap().len(), 50);
        assert_eq!(q.item(ds, 7).unwrap().unwrap().id, "id7");
        assert_eq!(q.item_id(ds, 9).unwrap().as_deref(), Some("id9"));
        q.enqueue(ds, &[(50, item("id50"))], 51, 0).unwrap();
        q.flush().unwrap();
        drop(q);
        let q = Queue::open(dir.path()).unwrap();
        assert_eq!(q.state(ds).unwrap().items, 51);
        assert_eq!(q.item(ds, 50).unwrap().unwrap().id, "id50");
    }

    fn item(id: &str) -> Item {
        Item {
            id: id.into(),
            hash: [1; 16],
            prompt: format!("p {id}"),
            messages: None,
            prompt_ids: Some(vec![1, 2]),
        }
    }

    fn result(ds_name: &str, row: u64, tokens: u32) -> Box<ShardRow> {
        Box::new(ShardRow {
            completion_tokens: tokens,
            ..ShardRow::for_tests(format!("id{row}"), ds_name, row)
        })
    }

    fn done(row: u64, tokens: u32) -> Outcome {
        Outcome::Done {
            ds: 0,
            result: result("a", row, tokens),
        }
    }

    /// A queue with six items: rows 0 and 1 in shard 0, row 2 done and waiting for a shard.
    fn six_items(dir: &Path) -> Queue {
        let q = Queue::open(dir).unwrap();
        q.open_dataset("a").unwrap();
        let items: Vec<_> = (0..6).map(|r| (r, item(&format!("id{r}")))).collect();
        q.enqueue(0, &items, 6, 0).unwrap();
        q.commit(&[done(0, 10), done(1, 20), done(2, 30)]).unwrap();
        q.mark_sharded(0, 0, &[0, 1]).unwrap();
        q
    }

    /// (items, pending, unsharded, sharded, failed) of a dataset whose every item has a state.
    fn audit_counts(q: &Queue, ds: u16) -> (u64, u64, u64, u64, u64) {
        let a = q.audit(ds).unwrap();
        assert!(a.stateless.is_empty(), "stateless rows {:?}", a.stateless);
        (a.items, a.pending, a.unsharded, a.sharded, a.failed)
    }

    fn shard0() -> HashMap<u64, ShardedRow> {
        [(0, 10), (1, 20)]
            .into_iter()
            .map(|(row, c)| {
                let r = ShardedRow {
                    shard: 0,
                    prompt_tokens: 1,
                    completion_tokens: c,
                };
                (row, r)
            })
            .collect()
    }

    /// Regression (found by the full-queue-disk test): a commit torn by a failed write left
    /// an item in no state — its pending bit gone, its result never recorded (format 3: the
    /// counters, which record the results log's end, sort after the pending bits and were
    /// not written, so the log's tail is cut off at the next open) — and the next run
    /// finished without it. Now the failed write poisons the queue and leaves the marker,
    /// and the repair brings the item back to pending with counters recounted.
    #[test]
    fn a_torn_commit_poisons_the_queue_and_the_repair_brings_the_item_back() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = six_items(dir.path());
            q.torn_commit_in.store(1, Ordering::SeqCst);
            assert!(matches!(
                q.commit(&[done(3, 40)]),
                Err(QueueError::Storage(_))
            ));
            assert!(matches!(
                q.commit(&[done(4, 50)]),
                Err(QueueError::Poisoned)
            ));
            assert!(matches!(q.flush(), Err(QueueError::Poisoned)));
            assert!(dir.path().join(REPAIR_MARKER).exists());
        }
        let q = Queue::open(dir.path()).unwrap();
        assert!(q.needs_repair());
        let torn = q.state(0).unwrap();
        assert_eq!(
            (torn.done, torn.completion_tokens),
            (3, 60),
            "the tear wrote the pending bits only"
        );
        assert_eq!(q.audit(0).unwrap().stateless, vec![3]);
        assert!(
            !q.is_unsharded(0, 3).unwrap(),
            "row 3's unrecorded result was cut off"
        );

        let rep = q.repair(0, &shard0()).unwrap();
        assert_eq!(rep.back_to_pending, 1);
        assert!(rep.changed());
        let s = q.state(0).unwrap();
        assert_eq!(
            (
                s.items,
                s.done,
                s.sharded,
                s.completion_tokens,
                s.next_shard
            ),
            (6, 3, 2, 60, 1)
        );
        assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![3, 4, 5]);
        q.finish_repair().unwrap();
        assert!(!q.needs_repair() && !dir.path().join(REPAIR_MARKER).exists());
        let a = q.audit(0).unwrap();
        assert!(a.stateless.is_empty());
        assert_eq!((a.items, a.pending, a.unsharded, a.sharded), (6, 3, 1, 2));
        // A repair of a sound dataset changes nothing.
        assert!(!q.repair(0, &shard0()).unwrap().changed());
    }

    /// Rows a shard file holds are recorded as in that shard whatever the queue said (a torn
    /// `mark_sharded` moves the results log's start before it writes `S` records), and
    /// `next_shard` moves past it;
    /// a row recorded twice keeps its most advanced state; rows past the scan position (a
    /// torn enqueue) are dropped so intake reads them again.
    #[test]
    fn the_repair_trusts_shard_files_then_the_most_advanced_state() {
        let dir = tempfile::tempdir().unwrap();
        let q = six_items(dir.path());
        // Row 2 went into shard 1, but only the counters (the log's start past it) were
        // written, not its `S` record.
        let end = q.state(0).unwrap().results_end;
        q.lock_results().get_mut(&0).unwrap().forget([2], end);
        // Row 4 is pending and failed at once; row 7 is past the scan position.
        q.tree
            .insert(
                key(b'f', 0, 4),
                encode(&Failure {
                    reason: "x".into(),
                    attempts: 1,
                }),
            )
            .unwrap();
        // A torn enqueue: row 7's block and pending bits written, the scan position not.
        let (rows, bytes) = block_of_items(&[EncodedItem::new(7, &item("id7"))]);
        let r = q.append_blocks(0, &[(rows, bytes)]).unwrap().remove(0);
        q.tree.insert(key(b'B', 0, 7), r.encode()).unwrap();
        q.tree.insert(key(b'P', 0, 7), &r.rows.0[..]).unwrap();
        q.lock_index().get_mut(&0).unwrap().push(Arc::new(r));
        assert_eq!(q.item_id(0, 7).unwrap().as_deref(), Some("id7"));
        let mut files = shard0();
        files.insert(
            2,
            ShardedRow {
                shard: 1,
                prompt_tokens: 1,
                completion_tokens: 30,
            },
        );
        let rep = q.repair(0, &files).unwrap();
        assert_eq!(
            (
                rep.marked_sharded,
                rep.extra_states_removed,
                rep.unscanned_removed
            ),
            (1, 1, 1)
        );
        let s = q.state(0).unwrap();
        assert_eq!(
            (
                s.items,
                s.done,
                s.sharded,
                s.failed,
                s.completion_tokens,
                s.next_shard
            ),
            (6, 3, 3, 1, 60, 2)
        );
        assert_eq!(q.sharded_rows(0).unwrap(), vec![(0, 0), (1, 0), (2, 1)]);
        assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![3, 5]);
        assert_eq!(q.item_id(0, 7).unwrap(), None);
        // The dropped block's bytes are cut off: the next enqueue reuses its place.
        q.enqueue(0, &[(6, item("id6"))], 7, 0).unwrap();
        assert_eq!(q.item(0, 6).unwrap().unwrap().id, "id6");
    }

    /// The queue records are a compatibility boundary: a format-1 dataset record (no
    /// `scan_mark`) still reads, and a record without a mark is written exactly as before.
    #[test]
    fn a_format_1_dataset_record_reads_and_writes_unchanged() {
        let old = r#"{"index":0,"name":"a","scanned_lines":5,"items":4,"done":1,"failed":0,"rejected":1,"completion_tokens":9,"prompt_tokens":3,"next_shard":0,"sharded":0,"wasted_tokens":0}"#;
        let s: DatasetState = decode(b"ma", old.as_bytes()).unwrap();
        assert_eq!((s.items, s.scan_mark), (4, None));
        assert_eq!(String::from_utf8(encode(&s)).unwrap(), old);
        let marked = DatasetState {
            scan_mark: Some(ScanMark {
                lines: 5,
                bytes: 70,
                xxh64: 7,
            }),
            ..s
        };
        let back: DatasetState = decode(b"ma", &encode(&marked)).unwrap();
        assert_eq!(back, marked);
    }

    /// A copy of a fixture queue, opened (and so migrated) by this code, in the current format.
    fn open_fixture(name: &str) -> (tempfile::TempDir, Queue) {
        let dir = tempfile::tempdir().unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        copy_dir(&fixture, dir.path());
        let q = Queue::open(dir.path()).unwrap();
        assert_eq!(
            q.tree.get(b"v").unwrap().unwrap().as_ref(),
            &FORMAT_VERSION.to_be_bytes()
        );
        (dir, q)
    }

    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                copy_dir(&e.path(), &to.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }

    /// The queue records are a compatibility boundary: a queue written by the format-1 code
    /// (`tests/fixtures/queue-v1`, see SOURCES) opens, is migrated to item blocks, to the
    /// results log and to `S` records (format 4), and keeps every item, state, counter, id and
    /// unsharded result; its old per-item and result keys are gone; work goes on, and the
    /// next open does not migrate again.
    #[test]
    fn a_format_1_queue_is_migrated_with_every_item_and_state() {
        let (dir, q) = open_fixture("queue-v1");
        for p in [b'i', b'p', b'k', b'r', b's'] {
            assert_eq!(
                q.tree.scan_prefix([p]).count(),
                0,
                "old {} keys left",
                p as char
            );
        }
        let a = q.state(0).unwrap();
        assert_eq!(
            (
                a.name.as_str(),
                a.scanned_lines,
                a.items,
                a.done,
                a.failed,
                a.rejected
            ),
            ("a", 9, 8, 3, 1, 1)
        );
        assert_eq!(
            (
                a.completion_tokens,
                a.prompt_tokens,
                a.sharded,
                a.next_shard,
                a.wasted_tokens
            ),
            (60, 9, 2, 1, 5)
        );
        assert_eq!(a.scan_mark.map(|m| m.xxh64), Some(42));
        assert_eq!(q.pending_rows(0, None, 100).unwrap(), vec![5, 6, 7, 8]);
        assert_eq!(q.pending_rows(0, Some(6), 100).unwrap(), vec![7, 8]);
        assert_eq!(q.pending_rows(1, None, 100).unwrap(), vec![0, 1, 2]);
        let i4 = q.item(0, 4).unwrap().unwrap();
        assert_eq!(
            (i4.id.as_str(), i4.prompt.as_str(), i4.hash, i4.prompt_ids),
            ("a4", "prompt of a4", [4; 16], Some(vec![4, 5, 6]))
        );
        assert_eq!(
            i4.messages.as_deref(),
            Some(r#"[{"role":"user","content":"a4"}]"#)
        );
        let i7 = q.item(0, 7).unwrap().unwrap();
        assert_eq!((i7.messages, i7.prompt_ids), (None, Some(vec![7, 8, 9])));
        assert_eq!(q.item(0, 6).unwrap().unwrap().prompt_ids, None);
        assert_eq!(q.item(0, 3).unwrap(), None);
        assert_eq!(q.item(1, 2).unwrap().unwrap().id, "b2");
        assert_eq!(q.sharded_rows(0).unwrap(), vec![(0, 0), (1, 0)]);
        assert_eq!(
            q.unsharded(0)
                .unwrap()
                .iter()
                .map(|r| r.row)
                .collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(q.unsharded(0).unwrap()[0].id, "a2");
        assert!(q.is_unsharded(0, 2).unwrap() && !q.is_unsharded(0, 1).unwrap());
        assert!(a.results_end > 0);
        assert_eq!(q.failures(0, 10).unwrap()[0].0, 4);
        assert_eq!(audit_counts(&q, 0), (8, 4, 1, 2, 1));
        let mut ids = Vec::new();
        q.for_each_id(0, |id, row| {
            ids.push((String::from_utf8_lossy(id).into_owned(), row))
        })
        .unwrap();
        assert_eq!(ids.len(), 8);
        assert_eq!(ids[3], ("a4".to_string(), 4));
        assert_eq!(q.commit(&[done(5, 50)]).unwrap(), vec![true]);
        q.flush().unwrap();
        drop(q);
        let q = Queue::open(dir.path()).unwrap();
        assert_eq!(q.pending_rows(0, None, 100).unwrap(), vec![6, 7, 8]);
        assert_eq!(q.state(0).unwrap().completion_tokens, 110);
        assert_eq!(q.item(0, 8).unwrap().unwrap().id, "a8");
        let rows: Vec<u64> = q.unsharded(0).unwrap().iter().map(|r| r.row).collect();
        assert_eq!(rows, vec![2, 5]);
    }

    /// The queue records are a compatibility boundary: a queue written by the format-2 code
    /// (`tests/fixtures/queue-v2`, see SOURCES) opens and its unsharded results (sled `r`
    /// records) move to the results log, exactly (text, token ids, counts), with every
    /// other state and counter kept and no `r` key left; the next result goes after them,
    /// the archive's order; a reopen does not migrate again.
    #[test]
    fn a_format_2_queue_is_migrated_with_its_results_in_the_log() {
        let (dir, q) = open_fixture("queue-v2");
        assert_eq!(q.tree.scan_prefix([b'r']).count(), 0, "old r keys left");
        assert_eq!(q.tree.scan_prefix([b's']).count(), 0, "old s keys left");
        let a = q.state(0).unwrap();
        assert_eq!(
            (
                a.items,
                a.done,
                a.failed,
                a.rejected,
                a.sharded,
                a.next_shard
            ),
            (6, 3, 1, 1, 2, 1)
        );
        assert_eq!((a.completion_tokens, a.prompt_tokens), (6, 9));
        let ra = q.unsharded(0).unwrap();
        assert_eq!(ra.len(), 1);
        assert_eq!(
            (
                ra[0].id.as_str(),
                ra[0].row,
                ra[0].completion.as_str(),
                ra[0].completion_token_ids.clone(),
                ra[0].finish_reason.as_str()
            ),
            ("a2", 2, "two ü \"quoted\"", Some(vec![13, 14, 15]), "stop")
        );
        let rb = q.unsharded(1).unwrap();
        assert_eq!(
            (
                rb.len(),
                rb[0].id.as_str(),
                rb[0].completion_token_ids.clone()
            ),
            (1, "b1", Some(vec![20, 21, 22, 23]))
        );
        assert!(q.is_unsharded(0, 2).unwrap() && !q.is_unsharded(0, 0).unwrap());
        assert_eq!(q.sharded_rows(0).unwrap(), vec![(0, 0), (1, 0)]);
        assert_eq!(q.failures(0, 10).unwrap()[0].0, 4);
        assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![5, 6]);
        assert_eq!(q.pending_rows(1, None, 10).unwrap(), vec![0, 2]);
        assert_eq!(audit_counts(&q, 0), (6, 2, 1, 2, 1));
        assert_eq!(q.commit(&[done(5, 50)]).unwrap(), vec![true]);
        q.flush().unwrap();
        drop(q);
        let q = Queue::open(dir.path()).unwrap();
        let rows: Vec<u64> = q.unsharded(0).unwrap().iter().map(|r| r.row).collect();
        assert_eq!(rows, vec![2, 5]);
        assert_eq!(q.state(0).unwrap().completion_tokens, 56);
        q.mark_sharded(0, 1, &[2, 5]).unwrap();
        assert!(q.unsharded(0).unwrap().is_empty());
        let s = q.state(0).unwrap();
        assert_eq!(s.results_start, s.results_end);
    }

    /// A real format-3 queue (`tests/fixtures/queue-v3`, see SOURCES: shard 0's rows
    /// marked out of row order, shard 1, unsharded results, a failure, pending rows) opens
    /// with its per-row `s` records rewritten as one `S` record per shard — every row in its
    /// shard, no `s` key left — and every other state and counter kept; a shard sealed
    /// after the migration and a reopen (no second migration) keep it so.
    #[test]
    fn a_format_3_queue_is_migrated_with_one_record_per_shard() {
        let (dir, q) = open_fixture("queue-v3");
        assert_eq!(q.tree.scan_prefix([b's']).count(), 0, "old s keys left");
        assert_eq!(q.tree.scan_prefix(prefix(b'S', 0)).count(), 2);
        let want: Vec<(u64, u64)> = (0..250).map(|r| (r, u64::from(r >= 200))).collect();
        assert_eq!(q.sharded_rows(0).unwrap(), want);
        let a = q.state(0).unwrap();
        assert_eq!(
            (a.items, a.done, a.failed, a.sharded, a.next_shard),
            (300, 260, 1, 250, 2)
        );
        let tokens: u64 = (0..260u64).map(|r| r % 7 + 1).sum();
        assert_eq!((a.completion_tokens, a.prompt_tokens), (tokens, 520));
        let waiting = q.unsharded(0).unwrap();
        let rows: Vec<u64> = waiting.iter().map(|r| r.row).collect();
        assert_eq!(rows, (250..260).collect::<Vec<_>>());
        assert_eq!(
            (
                waiting[3].completion.as_str(),
                waiting[3].completion_token_ids.clone()
            ),
            ("c253", Some(vec![253, 7]))
        );
        assert_eq!(q.failures(0, 10).unwrap()[0].0, 270);
        assert_eq!(q.pending_rows(0, None, 100).unwrap().len(), 39);
        assert_eq!(audit_counts(&q, 0), (300, 39, 10, 250, 1));
        q.mark_sharded(0, 2, &(250..260).collect::<Vec<_>>())
            .unwrap();
        drop(q);
        let q = Queue::open(dir.path()).unwrap();
        assert_eq!(q.sharded_rows(0).unwrap().len(), 260);
        assert_eq!(q.sharded_rows(0).unwrap()[255], (255, 2));
        assert!(q.unsharded(0).unwrap().is_empty());
        assert_eq!(audit_counts(&q, 0), (300, 39, 0, 260, 1));
    }

    /// Everything a queue holds, readable: the counters, every row's item and pending bit,
    /// the sharded rows, the unsharded results, the failures and the audit's counts.
    fn contents(q: &Queue) -> Vec<String> {
        let mut states = q.states();
        states.sort_by_key(|s| s.index);
        let mut out = Vec::new();
        for s in states {
            let ds = s.index;
            out.push(format!("{s:?}"));
            for row in 0..s.scanned_lines {
                let item = q.item(ds, row).unwrap();
                out.push(format!("{row} {item:?} {}", q.is_pending(ds, row).unwrap()));
            }
            out.push(format!("{:?}", q.sharded_rows(ds).unwrap()));
            out.push(format!("{:?}", q.unsharded(ds).unwrap()));
            out.push(format!("{:?}", q.failures(ds, usize::MAX).unwrap()));
            out.push(format!("{:?}", audit_counts(q, ds)));
        }
        out
    }

    /// The `v` and `V` records of a closed queue, as any spool opening it reads them first.
    fn version_records(dir: &Path) -> (Option<u32>, Option<u32>) {
        let db = open_sled(dir).unwrap();
        let tree = db.open_tree("q").unwrap();
        let read = |k: &[u8]| {
            tree.get(k)
                .unwrap()
                .map(|v| u32::from_be_bytes(v.as_ref().try_into().unwrap()))
        };
        (read(b"v"), read(MIGRATING_KEY))
    }

    /// A migration is safe to interrupt: for each older fixture (formats 1, 2, 3) and each
    /// batch a migration writes, a stop right after that batch (flushed, as a kill or power
    /// cut would leave it) leaves `v` at the new format — above every older spool's own, which
    /// each refuses (they all check `found > FORMAT_VERSION`, as [`a_newer_queue_format_is_
    /// refused`] shows for this one) — with the marker naming the old format; the next open
    /// completes the migration to exactly what an uninterrupted one gives (every item, state,
    /// counter, result), and the marker is gone. Stopping again at every step of the resumed
    /// migrations still ends there.
    #[test]
    fn an_interrupted_migration_resumes_and_older_spools_refuse_the_queue_meanwhile() {
        for (fixture, format) in [("queue-v1", 1u32), ("queue-v2", 2), ("queue-v3", 3)] {
            let want = contents(&open_fixture(fixture).1);
            let fresh = || {
                let dir = tempfile::tempdir().unwrap();
                let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
                copy_dir(&from.join(fixture), dir.path());
                dir
            };
            let mut stops = 0;
            for n in 1.. {
                let dir = fresh();
                match Queue::open_with(dir.path(), n) {
                    Ok(_) => break,
                    Err(QueueError::Open { detail, .. }) if detail.contains("injected stop") => {}
                    Err(e) => panic!("{fixture}, stop {n}: {e}"),
                }
                stops += 1;
                assert_eq!(
                    version_records(dir.path()),
                    (Some(FORMAT_VERSION), Some(format)),
                    "{fixture}, stop {n}: an older spool would read a half-migrated queue"
                );
                let q = Queue::open(dir.path()).unwrap();
                assert_eq!(contents(&q), want, "{fixture}, resumed after stop {n}");
                drop(q);
                assert_eq!(version_records(dir.path()), (Some(FORMAT_VERSION), None));
            }
            assert!(stops >= 1, "{fixture}: no migration batch to stop after");
            // Interrupted at the first batch of every resumed run, until one completes.
            let dir = fresh();
            let mut runs = 0;
            while let Err(e) = Queue::open_with(dir.path(), 1) {
                assert!(e.to_string().contains("injected stop"), "{fixture}: {e}");
                runs += 1;
                assert!(
                    runs <= stops,
                    "{fixture}: a resumed migration made no progress"
                );
            }
            assert_eq!(contents(&Queue::open(dir.path()).unwrap()), want);
        }
    }

    /// A shard's rows, in any order and with any gaps, read back from its `S` records
    /// sorted — split every [`SHARD_RECORD_ROWS`] rows — and a damaged record (a cut or
    /// overlong varint, rows not ascending, a short key) is an error, not other rows.
    #[test]
    fn shard_records_round_trip_and_damage_is_refused() {
        let mut rows: Vec<u64> = (0..10_000u64).map(|i| i * 3).collect();
        rows.push(1 << 40);
        rows.push(u64::MAX);
        rows.reverse();
        let mut w = Writes::default();
        put_shard_rows(&mut w, 7, 42, &rows);
        assert_eq!(w.0.len(), rows.len().div_ceil(SHARD_RECORD_ROWS));
        let mut back = Vec::new();
        for (k, v) in &w.0 {
            assert_eq!(ds_of(k), 7);
            let (shard, part) = decode_shard_record(k, v.as_deref().unwrap()).unwrap();
            assert_eq!(shard, 42);
            assert!(part.len() <= SHARD_RECORD_ROWS);
            back.extend(part);
        }
        rows.sort_unstable();
        assert_eq!(back, rows);
        let k = shard_key(0, 1, 10);
        assert_eq!(
            decode_shard_record(&k, &[2, 3]).unwrap(),
            (1, vec![10, 12, 15])
        );
        for bad in [&[2, 0x80][..], &[0][..], &[0xff; 11][..]] {
            assert!(decode_shard_record(&k, bad).is_err(), "{bad:?} accepted");
        }
        assert!(decode_shard_record(&k[..18], &[]).is_err());
    }

    /// Item records read back exactly — with and without messages and prompt ids, empty
    /// and non-ASCII text — and a cut or padded record is an error, not another item.
    #[test]
    fn item_records_round_trip_and_damage_is_refused() {
        let items = [
            item("a"),
            Item {
                id: "é".into(),
                hash: [7; 16],
                prompt: String::new(),
                messages: Some("[{\"role\":\"user\",\"content\":\"日本\"}]".into()),
                prompt_ids: Some(vec![]),
            },
            Item {
                id: "x".into(),
                hash: [0; 16],
                prompt: "p\n\u{1F600}".into(),
                messages: None,
                prompt_ids: Some(vec![0, u32::MAX - 1, 151_643]),
            },
        ];
        for it in items {
            let rec = it.encode_record();
            assert_eq!(Item::decode_record(it.id.clone(), &rec), Ok(it.clone()));
            assert!(Item::decode_record(it.id.clone(), &rec[..rec.len() - 1]).is_err());
            let mut longer = rec.clone();
            longer.push(0);
            assert!(Item::decode_record(it.id.clone(), &longer).is_err());
        }
    }

    /// A queue of a newer format than this spool's is refused, not misread.
    #[test]
    fn a_newer_queue_format_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let q = Queue::open(dir.path()).unwrap();
        q.tree
            .insert(b"v", &(FORMAT_VERSION + 1).to_be_bytes())
            .unwrap();
        q.flush().unwrap();
        drop(q);
        assert!(matches!(
            Queue::open(dir.path()),
            Err(QueueError::Version { found, .. }) if found == FORMAT_VERSION + 1
        ));
    }

    /// A damaged item block is reported with its file, not decoded as other prompts.
    #[test]
    fn a_damaged_block_file_is_reported_by_name() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = six_items(dir.path());
            q.flush().unwrap();
        }
        let path = BlockFile::path(dir.path(), 0);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let q = Queue::open(dir.path()).unwrap();
        let e = q.item(0, 3).unwrap_err().to_string();
        assert!(e.contains("0.blocks") && e.contains("checksum"), "{e}");
    }

    /// Rows are enqueued in file order only: a row at or before the last enqueued one is
    /// refused (blocks must not overlap), and nothing of that batch is written.
    #[test]
    fn an_enqueue_out_of_row_order_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let q = six_items(dir.path());
        assert!(matches!(
            q.enqueue(0, &[(7, item("id7")), (5, item("id5b"))], 8, 0),
            Err(QueueError::RowOrder { row: 5, last: 7 })
        ));
        assert_eq!(q.state(0).unwrap().items, 6);
        assert_eq!(q.item(0, 7).unwrap(), None);
    }

    /// Blocks end at [`BLOCK_ITEMS`] items and [`BLOCK_SPAN`] rows; items, pending rows
    /// and commits work across block boundaries and gaps of rejected lines.
    #[test]
    fn items_spread_over_many_blocks_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let q = Queue::open(dir.path()).unwrap();
        q.open_dataset("a").unwrap();
        // 3,000 items, then one far past the span limit.
        let mut items: Vec<_> = (0..3000u64)
            .map(|r| (r * 2, item(&format!("id{r}"))))
            .collect();
        items.push((20_000, item("far")));
        q.enqueue(0, &items, 20_001, 0).unwrap();
        assert_eq!(q.lock_index()[&0].len(), 4);
        assert_eq!(q.item(0, 2048 * 2).unwrap().unwrap().id, "id2048");
        assert_eq!(q.item(0, 2049).unwrap(), None);
        assert_eq!(q.item(0, 20_000).unwrap().unwrap().id, "far");
        assert_eq!(q.pending_rows(0, Some(2046), 2).unwrap(), vec![2048, 2050]);
        assert_eq!(q.pending_rows(0, Some(5998), 5).unwrap(), vec![20_000]);
        let all = q.pending_rows(0, None, usize::MAX).unwrap();
        assert_eq!(all.len(), 3001);
        assert_eq!(
            q.commit(&[done(2046, 1), done(2048, 1)]).unwrap(),
            vec![true, true]
        );
        assert_eq!(q.pending_rows(0, Some(2044), 2).unwrap(), vec![2050, 2052]);
        assert!(!q.is_pending(0, 2048).unwrap() && q.is_pending(0, 2050).unwrap());
    }

    #[test]
    fn a_second_process_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _q = Queue::open(dir.path()).unwrap();
        assert!(matches!(
            Queue::open(dir.path()),
            Err(QueueError::Locked { .. })
        ));
    }

    #[test]
    fn outcomes_apply_once_and_counters_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = Queue::open(dir.path()).unwrap();
            let s = q.open_dataset("a").unwrap();
            q.enqueue(s.index, &[(0, item("x")), (1, item("y"))], 2, 1)
                .unwrap();
            assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![0, 1]);
            let applied = q
                .commit(&[
                    Outcome::Done {
                        ds: 0,
                        result: result("a", 0, 7),
                    },
                    Outcome::Done {
                        ds: 0,
                        result: result("a", 0, 7),
                    },
                ])
                .unwrap();
            assert_eq!(applied, vec![true, false]);
            q.flush().unwrap();
        }
        let q = Queue::open(dir.path()).unwrap();
        let s = q.state(0).unwrap();
        assert_eq!(
            (
                s.items,
                s.done,
                s.pending(),
                s.completion_tokens,
                s.rejected
            ),
            (2, 1, 1, 7, 1)
        );
        assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![1]);
        assert_eq!(q.unsharded(0).unwrap().len(), 1);
        q.mark_sharded(0, 0, &[0]).unwrap();
        assert!(q.unsharded(0).unwrap().is_empty());
        assert_eq!(q.sharded_rows(0).unwrap(), vec![(0, 0)]);
        assert_eq!(q.state(0).unwrap().next_shard, 1);
        assert_eq!(q.item_id(0, 1).unwrap().as_deref(), Some("y"));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Enqueue(u8),
        Done(u8, u16),
        Fail(u8),
        Shard,
        Retry,
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u8..5).prop_map(Op::Enqueue),
            (any::<u8>(), 1u16..500).prop_map(|(r, t)| Op::Done(r, t)),
            any::<u8>().prop_map(Op::Fail),
            Just(Op::Shard),
            Just(Op::Retry),
            Just(Op::Reopen),
        ]
    }

    /// The queue against a model (a map row → state), with restarts in between: counters
    /// always equal what a scan of the model gives, and every item is in one state.
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum M {
        Pending,
        Result(u16),
        Sharded(u16),
        Failed,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        #[test]
        fn queue_matches_model_across_restarts(ops in proptest::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let mut q = Some(Queue::open(dir.path()).unwrap());
            q.as_ref().unwrap().open_dataset("a").unwrap();
            let mut model: Vec<M> = Vec::new();
            for o in ops {
                let qq = q.as_ref().unwrap();
                match o {
                    Op::Enqueue(n) => {
                        let start = model.len() as u64;
                        let items: Vec<_> = (start..start + n as u64).map(|r| (r, item(&format!("i{r}")))).collect();
                        qq.enqueue(0, &items, start + n as u64, 0).unwrap();
                        model.extend(std::iter::repeat_n(M::Pending, n as usize));
                    }
                    Op::Done(r, t) if !model.is_empty() => {
                        let r = r as usize % model.len();
                        let applied = qq.commit(&[Outcome::Done { ds: 0, result: result("a", r as u64, t as u32) }]).unwrap();
                        prop_assert_eq!(applied[0], model[r] == M::Pending);
                        if model[r] == M::Pending { model[r] = M::Result(t); }
                    }
                    Op::Fail(r) if !model.is_empty() => {
                        let r = r as usize % model.len();
                        qq.commit(&[Outcome::Failed { ds: 0, row: r as u64, failure: Failure { reason: "x".into(), attempts: 1 } }]).unwrap();
                        if model[r] == M::Pending { model[r] = M::Failed; }
                    }
                    Op::Shard => {
                        let rows: Vec<u64> = qq.unsharded(0).unwrap().iter().map(|r| r.row).collect();
                        let next = qq.state(0).unwrap().next_shard;
                        qq.mark_sharded(0, next, &rows).unwrap();
                        for r in rows { if let M::Result(t) = model[r as usize] { model[r as usize] = M::Sharded(t); } }
                    }
                    Op::Retry => {
                        qq.retry_failed(0).unwrap();
                        for m in model.iter_mut() { if *m == M::Failed { *m = M::Pending; } }
                    }
                    Op::Reopen => {
                        qq.flush().unwrap();
                        drop(q.take());
                        q = Some(Queue::open(dir.path()).unwrap());
                    }
                    _ => {}
                }
            }
            let qq = q.as_ref().unwrap();
            let s = qq.state(0).unwrap();
            let done = model.iter().filter(|m| matches!(m, M::Result(_) | M::Sharded(_))).count() as u64;
            let tokens: u64 = model.iter().map(|m| match m { M::Result(t) | M::Sharded(t) => *t as u64, _ => 0 }).sum();
            let failed = model.iter().filter(|m| **m == M::Failed).count() as u64;
            prop_assert_eq!(s.items, model.len() as u64);
            prop_assert_eq!(s.done, done);
            prop_assert_eq!(s.failed, failed);
            prop_assert_eq!(s.completion_tokens, tokens);
            let pending: Vec<u64> = model.iter().enumerate().filter(|(_, m)| **m == M::Pending).map(|(i, _)| i as u64).collect();
            prop_assert_eq!(qq.pending_rows(0, None, usize::MAX).unwrap(), pending);
            prop_assert_eq!(s.sharded, model.iter().filter(|m| matches!(m, M::Sharded(_))).count() as u64);
        }
    }
}
