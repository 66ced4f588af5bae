//! Repair and audit: rebuilding a dataset's records and counters after a torn write, and
//! counting its records by state for `spool verify`.
//!
//! A failed write poisons the queue and leaves the repair marker ([`crate::store::writes`]);
//! the next run repairs every dataset before anything else touches the queue, then
//! [`Queue::finish_repair`] removes the marker.
//!
//! Invariant: a repair trusts, in order, the shard files (every row they hold is sharded, in
//! that shard), then the most advanced state recorded (sharded > unsharded result > failed >
//! pending); an item in no state lost its result and is pending again. Generations kept
//! (`g`) for an item still recorded pending count their tokens; those of any other item
//! go, including one brought back from no state (it starts over). It writes one batch,
//! flushed, so an interrupted repair is simply done again.

use crate::store::blocks::{Bitmap, BlockRef};
use crate::store::keys::{decode_shard_record, key, meta_key, prefix, put_shard_rows, row_of};
use crate::store::queue::{decode_generation, known, Queue, QueueError, REPAIR_MARKER};
use crate::store::records::{encode, DatasetState};
use crate::store::writes::Writes;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A done item as its shard file holds it, for [`Queue::repair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardedRow {
    pub shard: u64,
    /// Over the item's rows (one per generation).
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
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

/// An item's state, as recorded and as a repair keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Unsharded,
    Sharded,
    Failed,
}

/// The states recorded for one item (after a torn write, none or several).
#[derive(Debug, Clone, Copy, Default)]
struct Recorded {
    pending: bool,
    unsharded: bool,
    sharded: bool,
    failed: bool,
}

impl Recorded {
    /// Whether `state` is among the recorded ones.
    fn has(self, state: State) -> bool {
        match state {
            State::Pending => self.pending,
            State::Unsharded => self.unsharded,
            State::Sharded => self.sharded,
            State::Failed => self.failed,
        }
    }
}

/// What a repair reads of a dataset before it decides anything.
#[derive(Default)]
struct Findings {
    /// Every item of a kept block, with the states recorded for it.
    rows: BTreeMap<u64, Recorded>,
    /// The pending bitmaps as stored, by their block's first row.
    old_bits: HashMap<u64, Bitmap>,
    /// (prompt, completion) tokens of each item's rows in the log.
    result_tokens: HashMap<u64, (u64, u64)>,
    /// The shard an `S` record puts each item in.
    shard_of: HashMap<u64, u64>,
}

/// A repair's output as it is built: the report, the recounted counters and the writes.
struct Rebuild {
    rep: Repair,
    after: DatasetState,
    batch: Writes,
    /// Rows by the shard they are kept in; each shard's `S` records are written whole.
    shards: BTreeMap<u64, Vec<u64>>,
    /// Pending bitmaps by their block's first row, as the kept states say.
    pending: BTreeMap<u64, Bitmap>,
    /// Results in the log that no longer count as unsharded.
    forget: Vec<u64>,
}

impl Rebuild {
    /// Decides the one state `row` keeps, counting what that corrects and the tokens of a
    /// done row.
    fn choose(
        &mut self,
        row: u64,
        rec: Recorded,
        found: &Findings,
        in_shards: &HashMap<u64, ShardedRow>,
    ) -> State {
        if let Some(f) = in_shards.get(&row) {
            if !rec.sharded || found.shard_of.get(&row) != Some(&f.shard) {
                self.rep.marked_sharded += 1;
            }
            self.shards.entry(f.shard).or_default().push(row);
            self.after.prompt_tokens += f.prompt_tokens;
            self.after.completion_tokens += f.completion_tokens;
            self.after.next_shard = self.after.next_shard.max(f.shard + 1);
            State::Sharded
        } else if let Some(&shard) = found.shard_of.get(&row) {
            self.rep.sharded_without_file += 1;
            self.shards.entry(shard).or_default().push(row);
            State::Sharded
        } else if rec.unsharded {
            let (p, c) = found.result_tokens.get(&row).copied().unwrap_or_default();
            self.after.prompt_tokens += p;
            self.after.completion_tokens += c;
            State::Unsharded
        } else if rec.failed {
            State::Failed
        } else {
            if !rec.pending {
                self.rep.back_to_pending += 1;
            }
            State::Pending
        }
    }

    /// Keeps `row` (an item of `block`) in `keep` only: removes every other state recorded
    /// for it and counts it.
    fn keep(&mut self, ds: u16, block: &BlockRef, row: u64, rec: Recorded, keep: State) {
        if keep == State::Pending {
            self.pending
                .entry(block.first_row)
                .or_insert_with(|| Bitmap::empty(block.span()))
                .set(row - block.first_row, true);
        }
        for extra in [
            State::Unsharded,
            State::Sharded,
            State::Failed,
            State::Pending,
        ] {
            if extra == keep || !rec.has(extra) {
                continue;
            }
            match extra {
                State::Unsharded => self.forget.push(row),
                State::Failed => self.batch.remove(key(b'f', ds, row)),
                // The `S` records are rewritten whole and the pending bitmaps from `pending`.
                State::Sharded | State::Pending => {}
            }
            self.rep.extra_states_removed += 1;
        }
        match keep {
            State::Sharded => {
                self.after.done += 1;
                self.after.sharded += 1;
            }
            State::Unsharded => self.after.done += 1,
            State::Failed => self.after.failed += 1,
            State::Pending => {}
        }
    }

    /// Adds the `S` records of every shard and the pending bitmaps that differ from the
    /// stored ones to the batch.
    fn write_states(&mut self, ds: u16, kept: &[Arc<BlockRef>], old_bits: &HashMap<u64, Bitmap>) {
        for (shard, rows) in &self.shards {
            put_shard_rows(&mut self.batch, ds, *shard, rows);
        }
        for r in kept {
            let want = self.pending.remove(&r.first_row);
            if old_bits.get(&r.first_row) != want.as_ref() {
                match want {
                    Some(b) => self.batch.insert(key(b'P', ds, r.first_row), b.0),
                    None => self.batch.remove(key(b'P', ds, r.first_row)),
                }
            }
        }
        if self.rep.sharded_without_file > 0 {
            // Their token counts are gone with their file: keep what the counters said.
            let before = &self.rep.before;
            self.after.prompt_tokens = self.after.prompt_tokens.max(before.prompt_tokens);
            self.after.completion_tokens =
                self.after.completion_tokens.max(before.completion_tokens);
        }
    }
}

impl Queue {
    /// Whether a failed write of an earlier run may have left half a batch behind: the run
    /// must [`repair`](Queue::repair) every dataset before using the queue.
    pub fn needs_repair(&self) -> bool {
        self.needs_repair.load(Ordering::SeqCst)
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
        let mut states = self.lock_states();
        let before = known(&states, ds)?;
        let mut b = Rebuild {
            rep: Repair {
                before: before.clone(),
                ..Default::default()
            },
            // Counted again from the states kept.
            after: DatasetState {
                items: 0,
                done: 0,
                failed: 0,
                sharded: 0,
                completion_tokens: 0,
                prompt_tokens: 0,
                ..before.clone()
            },
            batch: Writes::default(),
            shards: BTreeMap::new(),
            pending: BTreeMap::new(),
            forget: Vec::new(),
        };
        // Blocks past the scan position: a torn enqueue.
        let (kept, dropped): (Vec<_>, Vec<_>) = self
            .blocks
            .blocks(ds)
            .into_iter()
            .partition(|r| r.first_row < before.scanned_lines);
        for r in &dropped {
            b.batch.remove(key(b'B', ds, r.first_row));
            b.batch.remove(key(b'P', ds, r.first_row));
            b.rep.unscanned_removed += u64::from(r.count);
        }
        let found = self.find_states(ds, &kept, &mut b)?;
        b.after.items = found.rows.len() as u64;
        let mut r_i = 0;
        let mut open = HashSet::new();
        for (&row, &rec) in &found.rows {
            // `kept` and `found.rows` are both in row order, and every row is an item of a
            // kept block: the last one starting at or before it (a block's bitmap span can
            // reach past the next block's first row, so the span does not say).
            while kept.get(r_i + 1).is_some_and(|n| n.first_row <= row) {
                r_i += 1;
            }
            let keep = b.choose(row, rec, &found, in_shards);
            b.keep(ds, &kept[r_i], row, rec, keep);
            // A kept item still recorded pending keeps its generations; one brought back
            // from no state (a close or an end torn after its pending bit, some `g` records
            // perhaps gone with it) starts over, so no history mixes old and new turns.
            if keep == State::Pending && rec.pending {
                open.insert(row);
            }
        }
        self.recount_generations(ds, &open, &mut b)?;
        b.write_states(ds, &kept, &found.old_bits);
        let Rebuild {
            mut rep,
            mut after,
            mut batch,
            forget,
            ..
        } = b;
        if let Some(log) = self.lock_results().get_mut(&ds) {
            after.results_start = log.forget(forget, after.results_end);
        }
        batch.insert(meta_key(&after.name), encode(&after));
        self.apply(batch)?;
        states.insert(ds, after.clone());
        drop(states);
        if !dropped.is_empty() {
            let end = kept.last().map_or(0, |r| r.offset + u64::from(r.len));
            self.blocks.keep_only(ds, kept);
            self.blocks.file(ds)?.truncate(end)?;
        }
        self.flush()?;
        rep.after = after;
        Ok(rep)
    }

    /// Counts the tokens of the generations kept for items still pending (they were counted
    /// when kept), and removes those of items in any other state, or brought back to
    /// pending from none (a close torn after its pending bit: some of its `g` records may
    /// be gone, and a history must not lack an earlier turn).
    fn recount_generations(
        &self,
        ds: u16,
        open: &HashSet<u64>,
        b: &mut Rebuild,
    ) -> Result<(), QueueError> {
        for kv in self.tree.scan_prefix(prefix(b'g', ds)) {
            let (k, v) = kv?;
            if open.contains(&row_of(&k)) {
                let g = decode_generation(&k, &v)?;
                b.after.prompt_tokens += u64::from(g.prompt_tokens);
                b.after.completion_tokens += u64::from(g.completion_tokens);
            } else {
                b.batch.remove(&k);
                b.rep.extra_states_removed += 1;
            }
        }
        Ok(())
    }

    /// Reads every state recorded for the items of `kept`; removes from `b`'s batch the
    /// records the rebuild replaces (every `S` record) or that have no item (`f`), and
    /// marks the log's results without an item to be forgotten.
    fn find_states(
        &self,
        ds: u16,
        kept: &[Arc<BlockRef>],
        b: &mut Rebuild,
    ) -> Result<Findings, QueueError> {
        let mut found = Findings::default();
        for r in kept {
            found
                .rows
                .extend(r.item_rows().map(|row| (row, Recorded::default())));
        }
        for kv in self.tree.scan_prefix(prefix(b'P', ds)) {
            let (k, v) = kv?;
            let first = row_of(&k);
            let bits = Bitmap(v.to_vec());
            for bit in bits.ones() {
                if let Some(rec) = found.rows.get_mut(&(first + bit)) {
                    rec.pending = true;
                }
            }
            found.old_bits.insert(first, bits);
        }
        let unsharded = match self.lock_results().get(&ds) {
            Some(log) => log.read_all()?,
            None => Vec::new(),
        };
        for r in unsharded {
            match found.rows.get_mut(&r.row) {
                Some(rec) => rec.unsharded = true,
                // A state without its item: only a torn enqueue past the scan position.
                None => b.forget.push(r.row),
            }
            // An item's rows (several generations) are one record: their tokens add up.
            let t = found.result_tokens.entry(r.row).or_default();
            t.0 += u64::from(r.prompt_tokens);
            t.1 += u64::from(r.completion_tokens);
        }
        for kv in self.tree.scan_prefix(prefix(b'S', ds)) {
            let (k, v) = kv?;
            let (shard, in_shard) = decode_shard_record(&k, &v)?;
            b.batch.remove(&k);
            for row in in_shard {
                if let Some(rec) = found.rows.get_mut(&row) {
                    rec.sharded = true;
                    found.shard_of.insert(row, shard);
                }
            }
        }
        for kv in self.tree.scan_prefix(prefix(b'f', ds)) {
            let (k, _) = kv?;
            match found.rows.get_mut(&row_of(&k)) {
                Some(rec) => rec.failed = true,
                None => b.batch.remove(&k),
            }
        }
        Ok(found)
    }

    /// Counts a dataset's records by state, for `spool verify` to hold the counters against;
    /// also the items in no state at all (a torn write lost them).
    pub fn audit(&self, ds: u16) -> Result<Audit, QueueError> {
        let mut stated = HashSet::new();
        let mut a = Audit::default();
        let refs = self.blocks.blocks(ds);
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
            Err(source) => {
                return Err(QueueError::Marker {
                    path: marker,
                    source,
                })
            }
        }
        self.needs_repair.store(false, Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures::{audit_counts, copy_dir, done, item, six_items};
    use crate::store::open::open_sled;
    use crate::store::queue::block_of_items;
    use crate::store::records::Outcome;
    use crate::store::records::{EncodedItem, Failure};
    use crate::store::row::ShardRow;
    use std::collections::BTreeMap;

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

    /// A commit torn by a failed write leaves an item in no state — its pending bit gone,
    /// its result never recorded (the counters, which record the results log's end, sort
    /// after the pending bits and are not written, so the log's tail is cut off at the next
    /// open). The failed write poisons the queue and leaves the marker, and the repair
    /// brings the item back to pending with counters recounted, so no run finishes
    /// without it.
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
                Err(QueueError::Poisoned { .. })
            ));
            assert!(matches!(q.flush(), Err(QueueError::Poisoned { .. })));
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
        q.blocks.extend(0, [r]);
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

    /// Every record of the queue, in key order (the order sled applies a batch in).
    fn records(tree: &sled::Tree) -> BTreeMap<Vec<u8>, Vec<u8>> {
        tree.iter()
            .map(|kv| {
                let (k, v) = kv.unwrap();
                (k.to_vec(), v.to_vec())
            })
            .collect()
    }

    /// Regression guard for the `done` counter against torn writes: sled applies a batch key
    /// by key and stops at the first failed write, so a full disk can leave any prefix of a
    /// batch. For each state change (a commit of two results and a failure, two generations
    /// kept, an open item closed, a shard's rows marked, failed items retried, an enqueue), every prefix of its batch is written
    /// onto the queue as it was before, with the block and results files as the change left
    /// them (they are synced before the batch). Before any repair, `done` equals the results
    /// recorded (sharded plus unsharded): the counters sort after every record a batch
    /// writes, so no prefix counts a result it does not hold (were they to sort first, the
    /// counters alone would be a prefix with `done` one above the records). The repair then
    /// makes every counter agree with the records and leaves no item without a state, with
    /// the tokens of exactly the results held and the generations kept for pending items
    /// (a torn close loses its counters but may keep its `g` records: dropped unless the
    /// item is pending again, then counted).
    #[test]
    fn no_torn_prefix_of_any_batch_counts_a_result_the_records_do_not_hold() {
        type Change = fn(&Queue);
        let failed = |row| Outcome::Failed {
            ds: 0,
            row,
            failure: Failure {
                reason: "x".into(),
                attempts: 1,
            },
        };
        let gen = |row, sample, turn, tokens| Outcome::Generated {
            ds: 0,
            result: Box::new(ShardRow {
                sample,
                turn,
                ..*crate::store::fixtures::result("a", row, tokens)
            }),
        };
        let changes: [(&str, Change); 6] = [
            ("generate", |q| {
                let gen = |row, turn, tokens| Outcome::Generated {
                    ds: 0,
                    result: Box::new(ShardRow {
                        turn,
                        ..*crate::store::fixtures::result("a", row, tokens)
                    }),
                };
                let applied = q.commit(&[gen(7, 1, 11), gen(6, 0, 13)]).unwrap();
                assert_eq!(applied, vec![true; 2]);
            }),
            ("close", |q| {
                let close = Outcome::Closed {
                    ds: 0,
                    row: 7,
                    result: Some(Box::new(ShardRow {
                        turn: 2,
                        ..*crate::store::fixtures::result("a", 7, 17)
                    })),
                    partial: Vec::new(),
                };
                assert_eq!(q.commit(&[close]).unwrap(), vec![true]);
            }),
            ("commit", |q| {
                let f = Outcome::Failed {
                    ds: 0,
                    row: 5,
                    failure: Failure {
                        reason: "y".into(),
                        attempts: 2,
                    },
                };
                let applied = q.commit(&[done(3, 40), f, done(6, 60)]).unwrap();
                assert_eq!(applied, vec![true; 3]);
            }),
            ("mark_sharded", |q| q.mark_sharded(0, 1, &[2]).unwrap()),
            ("retry_failed", |q| {
                assert_eq!(q.retry_failed(0).unwrap(), 1)
            }),
            ("enqueue", |q| {
                let items = [(8, item("id8")), (9, item("id9"))];
                q.enqueue(0, &items, 10, 0).unwrap()
            }),
        ];
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        {
            // Rows 0 and 1 in shard 0, row 2 unsharded, row 4 failed, rows 3, 5, 6, 7 pending.
            let q = six_items(&base);
            let more: Vec<_> = (6..8).map(|r| (r, item(&format!("id{r}")))).collect();
            q.enqueue(0, &more, 8, 0).unwrap();
            assert_eq!(q.commit(&[failed(4)]).unwrap(), vec![true]);
            // Row 7 is open: two generations kept.
            let kept = q.commit(&[gen(7, 0, 0, 5), gen(7, 1, 0, 7)]).unwrap();
            assert_eq!(kept, vec![true; 2]);
            q.flush().unwrap();
        }
        for (name, change) in changes {
            let after = tmp.path().join(name);
            copy_dir(&base, &after);
            let writes: Vec<(Vec<u8>, Option<Vec<u8>>)> = {
                let q = Queue::open(&after).unwrap();
                let before = records(&q.tree);
                change(&q);
                q.flush().unwrap();
                let now = records(&q.tree);
                let keys: std::collections::BTreeSet<&Vec<u8>> =
                    before.keys().chain(now.keys()).collect();
                keys.into_iter()
                    .filter(|k| before.get(*k) != now.get(*k))
                    .map(|k| (k.clone(), now.get(k).cloned()))
                    .collect()
            };
            assert!(writes.len() >= 2, "{name}: a batch of one key cannot tear");
            // Shard 1 (row 2) is a complete file before its rows are marked.
            let mut files = shard0();
            if name == "mark_sharded" {
                let r = ShardedRow {
                    shard: 1,
                    prompt_tokens: 1,
                    completion_tokens: 30,
                };
                files.insert(2, r);
            }
            for cut in 0..=writes.len() {
                let torn = tmp.path().join(format!("{name}-{cut}"));
                copy_dir(&base, &torn);
                for files_dir in ["items", "results"] {
                    copy_dir(&after.join(files_dir), &torn.join(files_dir));
                }
                {
                    let db = open_sled(&torn).unwrap();
                    let tree = db.open_tree("q").unwrap();
                    for (k, v) in &writes[..cut] {
                        match v {
                            Some(v) => tree.insert(k, v.as_slice()).map(|_| ()),
                            None => tree.remove(k).map(|_| ()),
                        }
                        .unwrap();
                    }
                    db.flush().unwrap();
                }
                let q = Queue::open(&torn).unwrap();
                let s = q.state(0).unwrap();
                let a = q.audit(0).unwrap();
                let at = format!("{name} torn after {cut} of {} keys", writes.len());
                assert_eq!(
                    s.done,
                    a.sharded + a.unsharded,
                    "{at}: done before the repair"
                );
                q.repair(0, &files).unwrap();
                let s = q.state(0).unwrap();
                let (items, pending, unsharded, sharded, failed) = audit_counts(&q, 0);
                assert_eq!(
                    (s.items, s.done, s.sharded, s.failed),
                    (items, unsharded + sharded, sharded, failed),
                    "{at}: counters after the repair"
                );
                assert_eq!(pending + unsharded + sharded + failed, items, "{at}");
                // Tokens: the results held, sharded and not, and the generations kept for
                // open items — each once.
                let in_files: u64 = q
                    .sharded_rows(0)
                    .unwrap()
                    .iter()
                    .map(|(r, _)| files[r].completion_tokens)
                    .sum();
                let in_log: u64 = q
                    .unsharded(0)
                    .unwrap()
                    .iter()
                    .map(|r| u64::from(r.completion_tokens))
                    .sum();
                let mut kept = 0u64;
                for row in q.open_items(0).unwrap() {
                    assert!(
                        q.is_pending(0, row).unwrap(),
                        "{at}: row {row} kept, not open"
                    );
                    kept += q
                        .generations(0, row)
                        .unwrap()
                        .iter()
                        .map(|g| u64::from(g.completion_tokens))
                        .sum::<u64>();
                }
                assert_eq!(
                    s.completion_tokens,
                    in_files + in_log + kept,
                    "{at}: tokens after the repair"
                );
                // An item whose close tore keeps all its generations or none: a history
                // never lacks an earlier turn of its sample.
                let kept7 = q.generations(0, 7).unwrap().len();
                assert!(
                    kept7 == 0 || kept7 == 2 || (name == "generate" && kept7 == 3),
                    "{at}: row 7 keeps {kept7} generations"
                );
            }
        }
    }

    /// A write refused because the queue is poisoned names the write that failed first: the
    /// refusal can be the first error a run reports (the archive sealing a shard while the
    /// committer's own error is still on its way), and "an earlier write failed" alone
    /// would hide the cause (a full disk) from the user.
    #[test]
    fn a_refused_write_names_the_failed_write_that_poisoned_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let q = six_items(dir.path());
        q.torn_commit_in
            .store(1, std::sync::atomic::Ordering::SeqCst);
        let cause = q.commit(&[done(3, 40)]).unwrap_err().to_string();
        assert!(cause.contains("injected torn write"), "{cause}");
        let refused = [
            q.mark_sharded(0, 1, &[2]).unwrap_err(),
            q.commit(&[done(4, 50)]).unwrap_err(),
            q.flush().unwrap_err(),
        ];
        for e in refused {
            assert!(matches!(e, QueueError::Poisoned { .. }), "{e}");
            assert!(e.to_string().contains("injected torn write"), "{e}");
        }
    }
}
