//! Opening the queue: the exclusive lock, sled, the format check, the migrations and the
//! results logs; and reopening sled to make it write a recovery snapshot.
//!
//! Invariants: one process at a time (`spool.lock`, held until the [`Queue`] is dropped); a
//! queue of a newer format than this spool's is refused, never misread; a queue left with
//! the repair marker opens with [`Queue::needs_repair`] set.

use crate::knobs::Faults;
use crate::store::blocks::BlockRef;
use crate::store::cache::BlockCache;
use crate::store::keys::{ds_of, row_of, FORMAT_VERSION, MIGRATING_KEY};
use crate::store::queue::{Queue, QueueError, REPAIR_MARKER};
use crate::store::records::{decode, DatasetState};
use crate::store::writes::mark_needs_repair;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

/// sled page-cache size: the queue is written and read mostly in order, so 64 MiB serves it
/// as well as more would, and a bigger cache only raises peak memory at a million prompts.
const CACHE_BYTES: u64 = 64 << 20;

impl Queue {
    /// Opens (or creates) the queue in `dir`, taking the exclusive lock; no fault is armed.
    pub fn open(dir: &Path) -> Result<Queue, QueueError> {
        Queue::open_with(dir, &Faults::default())
    }

    /// [`Queue::open`], with the queue's fault points armed as `faults` says (the torn
    /// commit and the migration stop; the others are not the queue's).
    pub fn open_with(dir: &Path, faults: &Faults) -> Result<Queue, QueueError> {
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
        let q = Queue {
            db,
            tree,
            states: Mutex::new(states),
            blocks: BlockCache::new(dir.to_path_buf(), index),
            results: Mutex::new(HashMap::new()),
            path: dir.to_path_buf(),
            _lock: lock,
            poisoned: std::sync::OnceLock::new(),
            needs_repair: AtomicBool::new(marker.exists()),
            torn_commit_in: AtomicU64::new(faults.queue_torn_commit.unwrap_or(0)),
            migration_stop_in: AtomicU64::new(faults.queue_migration_stop.unwrap_or(0)),
        };
        if found < FORMAT_VERSION {
            q.begin_migration(found)?;
        }
        if found < 2 {
            q.migrate_v1_to_v2()?;
        }
        if found < 4 {
            q.migrate_v3_to_v4()?;
        }
        for s in q.states() {
            q.open_results(&s)?;
        }
        // After the logs are open: it moves results into them.
        if found < 3 {
            q.migrate_v2_to_v3()?;
        }
        if found < FORMAT_VERSION {
            q.finish_migration()?;
        }
        Ok(q)
    }

    /// Flushes, closes and reopens the sled database, so that sled writes a recovery
    /// snapshot now (sled 0.34 writes one only at open). The next open — after a clean
    /// stop or a SIGKILL — then replays only the log written after this point, instead of
    /// everything since this process opened the queue (after a big intake, seconds of
    /// replay). Costs that replay once, here. The lock file stays
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
}

/// Opens the sled database under `dir` (the caller holds `spool.lock`).
///
/// sled 0.34 writes its recovery snapshot only here, at open, after replaying its whole log
/// since the previous snapshot; [`Queue::checkpoint`] relies on that.
pub(crate) fn open_sled(dir: &Path) -> Result<sled::Db, QueueError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fixtures::item;
    use crate::store::records::Item;
    use std::path::Path;

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

    /// One process at a time: a second open of a held queue is refused as locked.
    #[test]
    fn a_second_process_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _q = Queue::open(dir.path()).unwrap();
        assert!(matches!(
            Queue::open(dir.path()),
            Err(QueueError::Locked { .. })
        ));
    }
}
