//! Partitions: which worker of a cluster job owns an item.
//!
//! A job of N partitions runs N spool processes (a Kubernetes Indexed Job, a Slurm array),
//! each with its own `data_dir`. Item (dataset, id) belongs to partition
//! `xxh64(dataset ‖ 0x00 ‖ id, seed 0) mod N`.
//!
//! Invariants: the owner depends only on (dataset, id, N) — not on the file order, the run,
//! the machine or the build — so a restarted or rescheduled worker takes exactly the items
//! its predecessor had.
//!
//! The value itself ([`Partition`], [`owner`]) is `config::partition`'s, so every stage
//! that filters or labels by partition reads it without importing the cluster layer; this
//! module works out which one a worker is.

pub use crate::config::partition::{owner, Partition};

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
    #[error("this Slurm array's tasks are {min}..={max} ({count} of them), not 0..={last}: SLURM_ARRAY_TASK_COUNT is not the job's partition count here (a rerun of some tasks, --array=2,5); set [run] partitions or --partitions", last = count.saturating_sub(1))]
    SparseArray { min: u64, max: u64, count: u64 },
}

impl Partition {
    /// Works out this worker's partition: the count from the config or `--partitions`, else
    /// `SLURM_ARRAY_TASK_COUNT` of an array `0..=N−1`; the index from `--partition`, else
    /// `JOB_COMPLETION_INDEX` (Kubernetes Indexed Jobs), else `SLURM_ARRAY_TASK_ID` itself
    /// (task i is partition i, so a rerun of tasks 2 and 5 runs partitions 2 and 5). `env`
    /// reads a variable (the process environment outside tests). `None`: not partitioned.
    pub fn resolve(
        configured: Option<u32>,
        flag: Option<u32>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Partition>, PartitionError> {
        let number = |name: &str| env_number(&env, name);
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
            (id, "SLURM_ARRAY_TASK_ID".into())
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
    /// `SLURM_ARRAY_TASK_COUNT` when the array's tasks are `0..=COUNT−1` (the count of a
    /// sparse array, a rerun of some tasks, is not the job's: refused); `None` when neither
    /// says (not partitioned, or a command outside the array: the job record says).
    pub fn count(
        configured: Option<u32>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<u32>, PartitionError> {
        if configured.is_some() {
            return Ok(configured);
        }
        let number = |name: &str| env_number(&env, name);
        let Some(count) = number("SLURM_ARRAY_TASK_COUNT")? else {
            return Ok(None);
        };
        let min = number("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
        let max = number("SLURM_ARRAY_TASK_MAX")?.unwrap_or(count.saturating_sub(1));
        if min != 0 || max.checked_add(1) != Some(count) {
            return Err(PartitionError::SparseArray { min, max, count });
        }
        Ok(Some(count.min(u64::from(u32::MAX)) as u32))
    }
}

/// Variable `name` as a whole number (`None` when unset or blank).
fn env_number(
    env: &impl Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<u64>, PartitionError> {
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
}

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

    /// Items spread over the partitions close to evenly.
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

    /// The index comes from the flag, then Kubernetes, then Slurm (the task id itself); the
    /// count from the config, then a Slurm array of tasks `0..=N−1`.
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
            ("SLURM_ARRAY_TASK_ID", "2"),
            ("SLURM_ARRAY_TASK_MIN", "0"),
            ("SLURM_ARRAY_TASK_MAX", "3"),
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

    /// A rerun of some tasks of an array (`--array=2,5` of a 6-partition job) runs
    /// partitions 2 and 5 — the task id, not its place in the rerun — and the rerun's task
    /// count (2) is never taken for the job's: without a configured count it is refused,
    /// and an id outside the configured count is refused too.
    #[test]
    fn sparse_slurm_arrays_run_the_task_ids_partitions() {
        for (id, want) in [("2", 2), ("5", 5)] {
            let vars = [
                ("SLURM_ARRAY_TASK_ID", id),
                ("SLURM_ARRAY_TASK_MIN", "2"),
                ("SLURM_ARRAY_TASK_MAX", "5"),
                ("SLURM_ARRAY_TASK_COUNT", "2"),
            ];
            let rerun = env(&vars);
            assert_eq!(
                Partition::resolve(Some(6), None, &rerun),
                Ok(Some(Partition {
                    index: want,
                    count: 6
                }))
            );
            assert!(matches!(
                Partition::resolve(None, None, &rerun),
                Err(PartitionError::SparseArray {
                    min: 2,
                    max: 5,
                    count: 2
                })
            ));
        }
        let outside = env(&[
            ("SLURM_ARRAY_TASK_ID", "7"),
            ("SLURM_ARRAY_TASK_COUNT", "8"),
        ]);
        assert!(matches!(
            Partition::resolve(Some(6), None, &outside),
            Err(PartitionError::OutOfRange {
                index: 7,
                count: 6,
                ..
            })
        ));
        // An array 1..=4 (count 4) is not the job's 0..=3 either.
        let shifted = env(&[
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_MAX", "4"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
        ]);
        assert!(Partition::resolve(None, None, &shifted).is_err());
    }
}
