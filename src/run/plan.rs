//! What a run takes besides its config: the work a cluster job already settled and the
//! budgets that grow while the run goes. The cluster layer derives it from the job's log
//! and budget pool; a one-machine run has the empty plan.
//!
//! Invariant: the config stays as loaded (read-only after validation); whatever a run
//! learns at start from outside the file rides here, never in `Config`.

use crate::run::allowance::Allowance;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The run's plan beyond the config.
#[derive(Debug, Default, Clone)]
pub struct RunPlan {
    /// Per dataset, the ids already committed to the object store (or failed for good
    /// there), which intake skips.
    pub committed: HashMap<String, Arc<HashSet<String>>>,
    /// Per dataset, a budget that grows while the run goes (a cluster partition's part of
    /// its job's budget), read in place of `token_budget`.
    pub allowances: HashMap<String, Arc<Allowance>>,
}
