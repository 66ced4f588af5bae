//! Partitions: which worker of a cluster job owns an item, and its share of a budget.
//!
//! A job of N partitions runs N spool processes (a Kubernetes Indexed Job, a Slurm array),
//! each with its own `data_dir`. Item (dataset, id) belongs to partition
//! `xxh64(dataset ‖ 0x00 ‖ id, seed 0) mod N`.
//!
//! Invariants: the owner depends only on (dataset, id, N) — not on the file order, the run,
//! the machine or the build — so a restarted or rescheduled worker takes exactly the items
//! its predecessor had; a dataset's shares of a budget sum to the budget exactly.

use std::collections::HashMap;

/// One worker's place in a job of `count` partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partition {
    pub index: u32,
    pub count: u32,
}

/// Why the partition could not be worked out.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PartitionError {
    #[error("{source_name} = {value:?} is not a partition index (a whole number ≥ 0)")]
    NotANumber { source_name: String, value: String },
    #[error("partition {index} (from {source_name}) is outside 0..{count}")]
    OutOfRange {
        index: u64,
        count: u32,
        source_name: String,
    },
    #[error("partitions = {count}, but no partition index was given: pass --partition I, or run as a Kubernetes Indexed Job (JOB_COMPLETION_INDEX) or a Slurm job array (SLURM_ARRAY_TASK_ID)")]
    NoIndex { count: u32 },
    #[error("--partition {index} was given, but not how many partitions the job has: set [run] partitions or --partitions")]
    NoCount { index: u32 },
    #[error("partitions must be at least 1")]
    Zero,
}

impl Partition {
    /// The single partition of a one-process job.
    pub const WHOLE: Partition = Partition { index: 0, count: 1 };

    /// Works out this worker's partition: the count from the config or `--partitions`, else
    /// `SLURM_ARRAY_TASK_COUNT`; the index from `--partition`, else `JOB_COMPLETION_INDEX`
    /// (Kubernetes Indexed Jobs), else `SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN`. `env`
    /// reads a variable (the process environment outside tests). `None`: not partitioned.
    pub fn resolve(
        configured: Option<u32>,
        flag: Option<u32>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Partition>, PartitionError> {
        let number = |name: &str| -> Result<Option<u64>, PartitionError> {
            match env(name).map(|v| v.trim().to_string()) {
                None => Ok(None),
                Some(v) if v.is_empty() => Ok(None),
                Some(v) => v
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| PartitionError::NotANumber {
                        source_name: name.into(),
                        value: v,
                    }),
            }
        };
        let count = Self::count(configured, &env)?;
        let Some(count) = count else {
            // Not partitioned, unless an index was asked for explicitly.
            return match flag {
                Some(index) => Err(PartitionError::NoCount { index }),
                None => Ok(None),
            };
        };
        if count == 0 {
            return Err(PartitionError::Zero);
        }
        let (index, source_name) = if let Some(i) = flag {
            (u64::from(i), "--partition".to_string())
        } else if let Some(i) = number("JOB_COMPLETION_INDEX")? {
            (i, "JOB_COMPLETION_INDEX".into())
        } else if let Some(id) = number("SLURM_ARRAY_TASK_ID")? {
            let min = number("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            (
                id.saturating_sub(min),
                "SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN".into(),
            )
        } else if count == 1 {
            (0, "the default".into())
        } else {
            return Err(PartitionError::NoIndex { count });
        };
        if index >= u64::from(count) {
            return Err(PartitionError::OutOfRange {
                index,
                count,
                source_name,
            });
        }
        Ok(Some(Partition {
            index: index as u32,
            count,
        }))
    }

    /// The job's partition count: `configured` (the config or `--partitions`), else
    /// `SLURM_ARRAY_TASK_COUNT`; `None` when the job is not partitioned.
    pub fn count(
        configured: Option<u32>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<u32>, PartitionError> {
        if configured.is_some() {
            return Ok(configured);
        }
        match env("SLURM_ARRAY_TASK_COUNT").map(|v| v.trim().to_string()) {
            None => Ok(None),
            Some(v) if v.is_empty() => Ok(None),
            Some(v) => v
                .parse::<u64>()
                .map(|n| Some(n.min(u64::from(u32::MAX)) as u32))
                .map_err(|_| PartitionError::NotANumber {
                    source_name: "SLURM_ARRAY_TASK_COUNT".into(),
                    value: v,
                }),
        }
    }

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

/// Splits `budget` over partitions in proportion to their item counts, by largest
/// remainder (ties to the lower index), so the shares sum to `budget` exactly. With no
/// items at all the budget is split evenly.
pub fn split(budget: u64, items: &[u64]) -> Vec<u64> {
    let n = items.len();
    if n == 0 {
        return Vec::new();
    }
    let total: u128 = items.iter().map(|&c| u128::from(c)).sum();
    let weights: Vec<u128> = if total == 0 {
        vec![1; n]
    } else {
        items.iter().map(|&c| u128::from(c)).collect()
    };
    let total = weights.iter().sum::<u128>();
    let b = u128::from(budget);
    let mut shares: Vec<u64> = weights.iter().map(|w| (b * w / total) as u64).collect();
    let mut rest = budget - shares.iter().sum::<u64>();
    let mut order: Vec<usize> = (0..n).collect();
    // Largest remainder first; the index breaks ties so the split is deterministic.
    order.sort_by_key(|&i| (std::cmp::Reverse(b * weights[i] % total), i));
    for &i in order.iter().cycle() {
        if rest == 0 {
            break;
        }
        shares[i] += 1;
        rest -= 1;
    }
    shares
}

/// Item counts per partition of each dataset, for the budget split.
pub type ItemCounts = HashMap<String, Vec<u64>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    /// The owner is a stored fact: these values pin FNV-1a 64 so a change of hash (which
    /// would move items between partitions of a running job) fails here.
    #[test]
    fn the_owner_of_an_item_is_pinned() {
        // Python's `xxhash.xxh64(b"\x00").intdigest()`: the separator alone.
        assert_eq!(
            owner("", "", 1 << 31),
            (16_804_241_149_081_757_544_u64 % (1 << 31)) as u32
        );
        let got: Vec<u32> = (0..8)
            .map(|i| owner("chat", &format!("id-{i}"), 4))
            .collect();
        assert_eq!(got, PINNED);
        // Same id, other dataset: assigned independently.
        let a: Vec<u32> = (0..64).map(|i| owner("a", &i.to_string(), 4)).collect();
        let b: Vec<u32> = (0..64).map(|i| owner("b", &i.to_string(), 4)).collect();
        assert_ne!(a, b);
    }

    /// `xxhash.xxh64(b"chat\x00id-{i}").intdigest() % 4` for i in 0..8, by Python's `xxhash`.
    const PINNED: [u32; 8] = [0, 1, 0, 0, 1, 3, 1, 3];

    /// Items spread over the partitions close to evenly, so static budget shares follow.
    #[test]
    fn items_spread_evenly_over_partitions() {
        let mut counts = [0u32; 4];
        for i in 0..40_000 {
            counts[owner("prompts", &format!("row-{i}"), 4) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..=10_500).contains(&c), "{counts:?}");
        }
    }

    /// Shares follow the item counts and sum to the budget exactly, ties resolved by index.
    #[test]
    fn shares_sum_to_the_budget() {
        assert_eq!(split(10, &[1, 1, 1]), vec![4, 3, 3]);
        assert_eq!(split(1_000, &[100, 300, 0, 600]), vec![100, 300, 0, 600]);
        assert_eq!(split(7, &[0, 0]), vec![4, 3]);
        for budget in [0u64, 1, 999, 1_000_003] {
            let s = split(budget, &[13, 7, 29, 1]);
            assert_eq!(s.iter().sum::<u64>(), budget);
        }
        assert!(split(5, &[]).is_empty());
    }

    /// The index comes from the flag, then Kubernetes, then Slurm (relative to the array's
    /// first task); the count from the config, then Slurm.
    #[test]
    fn the_partition_comes_from_flag_kubernetes_or_slurm() {
        let none = env(&[]);
        assert_eq!(Partition::resolve(None, None, &none), Ok(None));
        assert_eq!(
            Partition::resolve(Some(4), Some(2), &none),
            Ok(Some(Partition { index: 2, count: 4 }))
        );
        let k8s = env(&[("JOB_COMPLETION_INDEX", "3"), ("SLURM_ARRAY_TASK_ID", "1")]);
        assert_eq!(
            Partition::resolve(Some(4), None, &k8s),
            Ok(Some(Partition { index: 3, count: 4 }))
        );
        let slurm = env(&[
            ("SLURM_ARRAY_TASK_ID", "12"),
            ("SLURM_ARRAY_TASK_MIN", "10"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
        ]);
        assert_eq!(
            Partition::resolve(None, None, &slurm),
            Ok(Some(Partition { index: 2, count: 4 }))
        );
        assert_eq!(
            Partition::resolve(Some(4), None, &none),
            Err(PartitionError::NoIndex { count: 4 })
        );
        assert!(matches!(
            Partition::resolve(Some(4), Some(4), &none),
            Err(PartitionError::OutOfRange {
                index: 4,
                count: 4,
                ..
            })
        ));
        let bad = env(&[("JOB_COMPLETION_INDEX", "x")]);
        assert!(matches!(
            Partition::resolve(Some(2), None, &bad),
            Err(PartitionError::NotANumber { .. })
        ));
        assert_eq!(
            Partition::resolve(Some(1), None, &none),
            Ok(Some(Partition::WHOLE))
        );
    }
}
