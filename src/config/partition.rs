//! A worker's place in a cluster job ([`Partition`]: partition `index` of `count`) and
//! which partition owns an item ([`owner`]); `cluster::partition` works out which one a
//! worker is, from `[run] partitions`, `--partition` and the scheduler's environment.
//!
//! Invariant: the owner depends only on (dataset, id, count) — not on the file order, the
//! run, the machine or the build — so a restarted or rescheduled worker takes exactly the
//! items its predecessor had.

/// One worker's place in a job of `count` partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partition {
    pub index: u32,
    pub count: u32,
}

impl Partition {
    /// The single partition of a one-process job.
    pub const WHOLE: Partition = Partition { index: 0, count: 1 };

    /// Whether this partition owns item `id` of `dataset`.
    pub fn owns(&self, dataset: &str, id: &str) -> bool {
        owner(dataset, id, self.count) == self.index
    }

    /// The zero-padded name used in object keys and file names (`p0003`).
    pub fn name(&self) -> String {
        format!("p{:04}", self.index)
    }
}

/// The partition of item `id` of `dataset` among `count`: XXH64 (seed 0) of the dataset
/// name, a zero byte and the id, modulo `count`. XXH64 is a published, fixed algorithm (not
/// `std`'s hasher, which may change between releases), because the assignment is a stored
/// fact; and its low bits are well mixed, so any N spreads evenly.
pub fn owner(dataset: &str, id: &str, count: u32) -> u32 {
    let mut key = Vec::with_capacity(dataset.len() + 1 + id.len());
    key.extend_from_slice(dataset.as_bytes());
    key.push(0);
    key.extend_from_slice(id.as_bytes());
    (twox_hash::XxHash64::oneshot(0, &key) % u64::from(count.max(1))) as u32
}
