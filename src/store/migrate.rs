//! The migrations: a queue written in an older format ([`FORMAT_VERSION`]) is brought to the
//! current one when it is opened ([`Queue::open`]), one resumable step per format change.
//!
//! Invariants: `v` moves to the new format (with the `V` marker, [`MIGRATING_KEY`], naming
//! the old one) *before* any record is rewritten, so a spool that predates the new format
//! refuses a half-migrated queue instead of misreading it; every step writes atomic batches
//! that leave each row wholly migrated or not at all, so an interrupted migration resumes at
//! the next open and ends where an uninterrupted one would.

use crate::knobs::FAULT_QUEUE_MIGRATION_STOP;
use crate::store::blocks::{encode_block, Bitmap, BLOCK_ITEMS, BLOCK_SPAN};
use crate::store::keys::{
    id_key, key, meta_key, prefix, put_shard_rows, row_of, row_of_bytes, FORMAT_VERSION,
    MIGRATING_KEY, SHARD_RECORD_ROWS,
};
use crate::store::queue::{known, unknown, Queue, QueueError, BLOCK_BYTES};
use crate::store::records::{decode, encode, Item};
use crate::store::results::encode_record;
use crate::store::row::ShardRow;
use crate::store::writes::Writes;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

impl Queue {
    /// Records (durably, before any record is rewritten) that the queue is now in
    /// [`FORMAT_VERSION`] and is being migrated from `from`: older spools refuse it from here
    /// on, and this one resumes from `from`. A resumed migration finds its marker in place.
    pub(crate) fn begin_migration(&self, from: u32) -> Result<(), QueueError> {
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
    pub(crate) fn finish_migration(&self) -> Result<(), QueueError> {
        let mut w = Writes::default();
        w.insert(b"v", FORMAT_VERSION.to_be_bytes());
        w.remove(MIGRATING_KEY);
        self.apply(w)?;
        self.flush()
    }

    /// Counts a migration batch for the injected stop
    /// ([`Faults::queue_migration_stop`](crate::knobs::Faults)): the Nth is flushed, then the
    /// migration fails as a kill or a power cut in the middle of it would leave it.
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
            detail: format!(
                "injected stop in the middle of a migration ({FAULT_QUEUE_MIGRATION_STOP})"
            ),
        })
    }

    /// Rewrites a format-1 queue's per-item records (`i` item, `p` pending, `k` id index)
    /// as blocks, one atomic batch per block (the block's `B` and `P` records in, its rows'
    /// old keys out). Resumable: rows an earlier, interrupted migration already put in a
    /// block only lose their old keys; rows past the scan position (a torn enqueue) are
    /// dropped, as the repair would, for intake to read again.
    pub(crate) fn migrate_v1_to_v2(&self) -> Result<(), QueueError> {
        let t = std::time::Instant::now();
        let mut moved = 0u64;
        for s in self.states() {
            let ds = s.index;
            let mut chunk: Vec<(u64, String, Vec<u8>)> = Vec::new();
            let mut bytes = 0usize;
            // Rows up to here are in blocks already (an interrupted migration).
            let migrated = self.blocks.last_row(ds);
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
        let r = self.append_blocks(ds, &[(rows, bytes)])?.remove(0);
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
        self.blocks.extend(ds, [r]);
        self.migration_step()
    }

    /// Rewrites the `s` ds row → shard records of formats 2 and 3 as `S` records (format 4),
    /// one atomic batch per [`SHARD_RECORD_ROWS`] `s` records (their `S` records in, they
    /// out). Resumable: an interrupted run left the rest as `s`, and no row is ever in both
    /// (each batch moves its rows whole). It touches no result, so a format-2 queue takes it
    /// before [`migrate_v2_to_v3`](Queue::migrate_v2_to_v3), which checks rows against the
    /// `S` records. The caller records the format.
    pub(crate) fn migrate_v3_to_v4(&self) -> Result<(), QueueError> {
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

    /// Moves a format-2 queue's unsharded results (`r` records in sled) to the results log,
    /// one atomic batch per dataset (the records out, the log's end in). Resumable: an
    /// interrupted migration left the records in sled, and the log's unrecorded tail is cut
    /// off when it is opened again.
    pub(crate) fn migrate_v2_to_v3(&self) -> Result<(), QueueError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::Faults;
    use crate::store::fixtures::{audit_counts, copy_dir, done, open_fixture};
    use crate::store::open::open_sled;
    use std::path::Path;

    /// Faults that stop a migration after its `n`th batch.
    fn stop_at(n: u64) -> Faults {
        Faults {
            queue_migration_stop: Some(n),
            ..Faults::default()
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

    /// A real format-4 queue (`tests/fixtures/shard-v1/data`, written by the build of
    /// `2f50701`) opens in the current format with no migration marker left, every item
    /// (no extra), state and counter kept, and a new item with an extra enqueues and reads
    /// back after a reopen.
    #[test]
    fn a_format_4_queue_opens_as_the_current_format() {
        let (dir, q) = open_fixture("shard-v1/data");
        assert!(!q.tree.contains_key(MIGRATING_KEY).unwrap());
        let s = q.state(0).unwrap();
        assert_eq!(
            (s.items, s.done, s.sharded, s.failed, s.next_shard),
            (4, 4, 4, 0, 2)
        );
        let ids: Vec<String> = (0..4).map(|r| q.item(0, r).unwrap().unwrap().id).collect();
        assert_eq!(ids, ["m0", "c1", "m2", "m3"]);
        assert!((0..4).all(|r| q.item(0, r).unwrap().unwrap().extra.is_none()));
        assert_eq!(audit_counts(&q, 0), (4, 0, 0, 4, 0));
        let with_tools = crate::store::records::Item {
            extra: Some(r#"{"tools":[]}"#.into()),
            ..crate::store::fixtures::item("t4")
        };
        q.enqueue(0, &[(4, with_tools.clone())], 5, 0).unwrap();
        drop(q);
        let q = Queue::open(dir.path()).unwrap();
        assert_eq!(q.item(0, 4).unwrap(), Some(with_tools));
        drop(q);
        assert_eq!(version_records(dir.path()), (Some(FORMAT_VERSION), None));
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
                match Queue::open_with(dir.path(), &stop_at(n)) {
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
            while let Err(e) = Queue::open_with(dir.path(), &stop_at(1)) {
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
}
