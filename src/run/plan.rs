//! What a run takes besides its config ([`JobPlan`]): what it learns at start from outside
//! the file — the partition it is (flags, the scheduler's environment), the folder its
//! shards go to (a cluster worker's local staging folder), the local copies of fetched
//! object-store inputs, and a cluster partition's settled work and the allowances
//! (its budgets) that grow while it runs. The CLI and `run::inputs` fill the first part, the
//! cluster layer (`cluster::worker`) the rest; a one-machine run of a local config has the
//! empty plan.
//!
//! The partition is the plan's rather than an override of the file: working it out needs
//! the loaded file's `[run] partitions`. Only its index in `data_dir` (`{partition}`) is an
//! override (`config::Overrides::partition`), so `Config::load` validates the folder it
//! names.
//!
//! Invariant: the config stays as loaded (read-only after validation, shared as
//! `Arc<Config>`); whatever a run learns rides here, never in `Config`, and every stage
//! reads these values through the plan's accessors, which fall back to the config.

use crate::config::partition::Partition;
use crate::config::{Config, DatasetConfig};
use crate::run::allowance::Allowance;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The run's plan beyond the config.
#[derive(Debug, Default, Clone)]
pub struct JobPlan {
    /// This worker's partition of a cluster job (`None`: not partitioned).
    pub partition: Option<Partition>,
    /// Where the run writes its shards in place of `output_dir` (a cluster worker stages
    /// them in its `data_dir`, then publishes them to the store).
    pub output_dir: Option<PathBuf>,
    /// Per dataset, the local copy read in place of an object-store `path`.
    pub inputs: HashMap<String, PathBuf>,
    /// Per dataset, the ids already committed to the object store (or failed for good
    /// there), which intake skips.
    pub committed: HashMap<String, Arc<HashSet<String>>>,
    /// Per dataset, a budget that grows while the run goes (a cluster partition's part of
    /// its job's budget), read by the scheduler in place of the budget.
    pub allowances: HashMap<String, Arc<Allowance>>,
}

impl JobPlan {
    /// The folder the run's shards go to: the staging folder, else the config's.
    pub fn output_dir<'a>(&'a self, cfg: &'a Config) -> &'a Path {
        self.output_dir.as_deref().unwrap_or(&cfg.output_dir)
    }

    /// The file dataset `d` is read from: its fetched local copy, else its `path`.
    pub fn input_path<'a>(&'a self, d: &'a DatasetConfig) -> &'a Path {
        self.inputs.get(&d.name).map_or(&d.path, PathBuf::as_path)
    }

    /// The budget dataset `d` is held to now: a growing allowance's grant so far, else its
    /// `token_budget` (so a partition's outcome and status name what it was granted).
    pub fn budget(&self, d: &DatasetConfig) -> Option<u64> {
        match self.allowances.get(&d.name) {
            Some(a) => Some(a.granted()),
            None => d.token_budget,
        }
    }

    /// Whether `d`'s budget may still grow (a partition's allowance before the job's pool
    /// is empty): a budget it has reached is then no reason to stop.
    pub fn budget_grows(&self, d: &DatasetConfig) -> bool {
        self.allowances.get(&d.name).is_some_and(|a| !a.is_last())
    }
}
