//! Stage 3, store: the crash-safe queue (sled records, prompt blocks, the results log),
//! the one source of truth of what is pending, in flight, done and sharded.
//!
//! Invariant: a state change is acknowledged only after it is durable; every record format
//! is versioned and migrated forward.
//!
//! The commit protocol:
//!
//! 1. A result is appended to its dataset's results log and the log synced; then the queue
//!    clears its pending bit and moves the counters and the log's recorded end in one batch,
//!    fsynced, before anything else sees it.
//! 2. The archiver appends durable rows to `.part-N.parquet.tmp`; a full shard is fsynced,
//!    renamed to `part-N.parquet`, its folder fsynced.
//! 3. Then, in one fsynced batch, `S` records list its rows, `next_shard` becomes N+1 and the
//!    log's unsharded start moves past them; the log's bytes before it are given back.
//! 4. On start, before any request: temporary shards are deleted, a `part-N.parquet` with
//!    N ≥ `next_shard` is adopted, and the archive is seeded with every unsharded row before
//!    the first new result can be committed.
//!
//! Invariant: an item is in exactly one state: pending, done-without-shard (in the log past
//! its unsharded start), done-in-shard (one `S` record), failed. An item with several
//! generations (`samples > 1`, `turns = "all"`) stays pending while they come: each finished
//! one is kept once under `g` ds row sample turn (its tokens counted in the same batch); the
//! close moves them, with its last result, into one results-log record (a group: one item,
//! one record, its rows in (sample, turn) order), removes the `g` records and clears the
//! pending bit in one batch. `g` sorts before the counters, so a torn batch keeps generations
//! and loses counters: the repair counts the tokens of those kept for items still recorded
//! pending and drops those of any other item — also of one brought back to pending from no
//! state (a torn close may have removed some), which starts over rather than mix old turns
//! into a new history. The archive checks shard limits between items, so an item's rows
//! are never split between shards.
//!
//! Invariant: bytes are synced before the record that names them (item blocks before `B`, log
//! records before the recorded end); bytes past the last record are cut off before the next
//! append; every block and result read is checked against its xxHash64.
//!
//! Invariant: a file named `part-*.parquet` is complete, and its rows are never written again.
//!
//! Invariant: a new file or folder has its parent folder fsynced before any record or the next
//! open relies on its name.
//!
//! Invariant: counters change only in the batch that changes the items they count.
//!
//! Invariant: a failed queue write poisons the `Queue` (sled stops a batch at the failed key):
//! nothing more is written, a `needs-repair` marker is left, and the next run first rebuilds
//! every dataset from its records and the shard files.
//!
//! Invariant: a migration first replaces the version record, with a `V` marker naming the old
//! format; each step is resumable; every spool refuses a newer format.

pub mod blocks;
mod cache;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod keys;
mod migrate;
mod open;
pub mod queue;
pub mod records;
pub mod repair;
pub mod report;
pub mod results;
pub mod row;
pub mod stop_reason;
mod writes;
