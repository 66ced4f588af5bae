//! The queue's one door for writes. Every batch goes through [`Queue::apply`] (or
//! [`Queue::apply_batch`]); a failed write poisons the queue and leaves the repair marker.
//!
//! sled applies a batch key by key and stops at the first error, so a *failed* write (a full
//! disk) can leave half a batch in memory and on disk. Invariant: after any failed write the
//! queue is poisoned — it refuses every later write, naming that first failure — and leaves a `needs-repair` marker
//! ([`REPAIR_MARKER`]); the next open sees the marker and the run rebuilds every dataset's
//! records and counters ([`Queue::repair`]) before anything else touches them.

use crate::knobs::FAULT_QUEUE_TORN_COMMIT;
use crate::store::queue::{Queue, QueueError, REPAIR_MARKER};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;

/// One batch's writes in key order — the order sled applies them in, which the injected
/// torn commit reproduces.
#[derive(Default)]
pub(crate) struct Writes(pub(crate) BTreeMap<Vec<u8>, Option<Vec<u8>>>);

impl Writes {
    /// Sets `k` to `v`.
    pub(crate) fn insert(&mut self, k: impl AsRef<[u8]>, v: impl AsRef<[u8]>) {
        self.0
            .insert(k.as_ref().to_vec(), Some(v.as_ref().to_vec()));
    }

    /// Removes `k`.
    pub(crate) fn remove(&mut self, k: impl AsRef<[u8]>) {
        self.0.insert(k.as_ref().to_vec(), None);
    }
}

impl Queue {
    /// Refuses every write once one has failed: sled may hold half a batch in memory, and
    /// building on it would make the tear durable.
    pub(crate) fn writable(&self) -> Result<(), QueueError> {
        match self.poisoned.get() {
            Some(cause) => Err(QueueError::Poisoned {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Passes a write's result through, poisoning the queue (and leaving the repair marker)
    /// when it failed.
    pub(crate) fn written<T>(&self, r: Result<T, sled::Error>) -> Result<T, QueueError> {
        r.map_err(|e| {
            let e = QueueError::Storage(e);
            self.poison(&e);
            e
        })
    }

    /// Stops every later write, which is refused naming `cause`, and leaves the repair
    /// marker (once: the first failure is the cause).
    pub(crate) fn poison(&self, cause: &QueueError) {
        if self.poisoned.set(cause.to_string()).is_ok() {
            mark_needs_repair(&self.path.join(REPAIR_MARKER));
        }
    }

    /// Applies a batch; the one door for batches, so a failure always poisons.
    pub(crate) fn apply(&self, writes: Writes) -> Result<(), QueueError> {
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
    pub(crate) fn apply_batch(&self, batch: sled::Batch) -> Result<(), QueueError> {
        self.writable()?;
        let r = self.tree.apply_batch(batch);
        self.written(r)
    }

    /// The injected torn commit: writes, durably, the keys that sort before the result
    /// (sled applies a batch in key order), then fails like a full disk.
    pub(crate) fn torn(&self, writes: Writes) -> QueueError {
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
        let injected =
            std::io::Error::other(format!("injected torn write ({FAULT_QUEUE_TORN_COMMIT})"));
        self.written::<()>(Err(sled::Error::Io(injected)))
            .expect_err("an Err stays an Err")
    }

    /// The injected torn commit ([`Faults::queue_torn_commit`](crate::knobs::Faults)): true
    /// when this commit tears — it appends its results to the log, writes only the keys that
    /// sort before the counters (the pending bits), then fails, as sled does when a disk fills
    /// in the middle of a batch.
    pub(crate) fn tears_now(&self) -> bool {
        self.torn_commit_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|prev| prev == 1)
            .unwrap_or(false)
    }

    /// Makes everything written so far durable (fsync).
    pub fn flush(&self) -> Result<(), QueueError> {
        self.writable()?;
        let r = self.db.flush();
        self.written(r)?;
        Ok(())
    }
}

/// Leaves the repair marker, durably where the disk allows (an empty file needs no data
/// block). If even that fails, says how to recover by hand.
pub(crate) fn mark_needs_repair(marker: &Path) {
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

/// Drives sled's garbage collection after a big batch. sled frees the node versions a write
/// replaces through crossbeam's epoch GC, which reclaims only a few bags of garbage per
/// `pin`; a writer that applies big batches without reading in between pins too rarely, so
/// garbage would outgrow reclamation and memory grow with every enqueued item. Flushing
/// this thread's bag and collecting about once per 64 writes keeps it flat.
pub(crate) fn reclaim(writes: usize) {
    for _ in 0..writes.div_ceil(64) {
        crossbeam_epoch::pin().flush();
    }
}
