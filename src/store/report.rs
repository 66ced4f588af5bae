//! What the queue says of each dataset, as `spool status`, `/status`, the progress lines
//! and the export's gates read it: the one vocabulary of states and the one definition of
//! each count (`done + inflight + pending + failed = items`).
//!
//! Built from the queue's durable counters alone; a running process lays its work in
//! flight and its rates over it (`observe::monitor`). Invariant: nothing here reads an
//! item; the cost is one small record per dataset.

use crate::config::{Config, DatasetConfig};
use crate::store::queue::{Queue, QueueError};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a dataset stands: the one vocabulary of `spool status`, `/status`, and the
/// progress bars, so a state reads the same on every screen and in the JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetPhase {
    /// Configured, but nothing of it is in the queue yet.
    #[default]
    NotStarted,
    /// Items left to do and none in flight.
    Pending,
    /// Requests of it are in flight (or being dispatched).
    Running,
    /// Every item done.
    Done,
    /// Its token budget is used up; the items left will not be requested.
    BudgetMet,
    /// Nothing left to do, and some items failed permanently.
    FailedItems,
    /// Every row of its file was rejected: nothing to do until the file or the config is
    /// fixed (the rejections name the line and the reason).
    Rejected,
}

impl DatasetPhase {
    /// The state's name on screen and in the JSON (`budget_met`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetPhase::NotStarted => "not_started",
            DatasetPhase::Pending => "pending",
            DatasetPhase::Running => "running",
            DatasetPhase::Done => "done",
            DatasetPhase::BudgetMet => "budget_met",
            DatasetPhase::FailedItems => "failed_items",
            DatasetPhase::Rejected => "rejected",
        }
    }

    /// Whether the dataset will request nothing more.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            DatasetPhase::Done
                | DatasetPhase::BudgetMet
                | DatasetPhase::FailedItems
                | DatasetPhase::Rejected
        )
    }
}

impl fmt::Display for DatasetPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state compares equal to its name, as a reader of the JSON sees it.
impl PartialEq<&str> for DatasetPhase {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// One dataset's line. Its counts are of items and add up: `done + inflight + pending +
/// failed = items` (rejected rows never became items); requests are counted apart, as
/// requests. Progress lines, `spool status`, `/status` and `/metrics` all show these.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DatasetStatus {
    pub name: String,
    pub items: u64,
    pub done: u64,
    /// Items not started: none of their requests in flight or done.
    pub pending: u64,
    /// Items started and not yet done (a request in flight, a conversation between turns,
    /// samples still to run); 0 when no run is active.
    pub inflight: u64,
    /// Generations (one per sample and turn) started and not yet committed; a server's
    /// `inflight` counts its requests on the wire.
    #[serde(default)]
    pub requests_inflight: u64,
    pub failed: u64,
    pub rejected: u64,
    pub completion_tokens: u64,
    pub prompt_tokens: u64,
    pub budget: Option<u64>,
    /// Completed tokens past the budget ("finish" policy), 0 when under.
    pub overshoot_tokens: u64,
    /// Tokens thrown away by the "cancel" policy.
    pub wasted_tokens: u64,
    pub shards: u64,
    /// Done items whose rows are in shards (the rest are durable in the queue, waiting).
    pub sharded: u64,
    pub state: DatasetPhase,
    pub tokens_per_s: Option<f64>,
    pub requests_per_s: Option<f64>,
    pub eta_s: Option<f64>,
    /// First permanent failures: (1-based line, reason).
    pub failures: Vec<(u64, String)>,
}

/// One inference server, live: whether it is in rotation, its attempts in flight, its
/// limit (with `concurrency = "auto"`) and the tokens/s it gives.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ServerStatus {
    pub url: String,
    pub up: bool,
    pub inflight: u64,
    /// Requests it may have in flight (`None`: one limit for all servers, `run.concurrency`).
    pub limit: Option<u64>,
    pub tokens_per_s: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusReport {
    /// True when produced by a running `spool run`.
    pub running: bool,
    pub datasets: Vec<DatasetStatus>,
    /// The servers, in a live report only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<ServerStatus>,
}

impl StatusReport {
    /// From the queue alone (the process may have stopped). `budget` is the budget each
    /// dataset is held to: a run's plan's (a cluster partition's tickets), else the
    /// config's `token_budget`.
    pub fn from_queue(
        queue: &Queue,
        cfg: &Config,
        budget: &dyn Fn(&DatasetConfig) -> Option<u64>,
    ) -> Result<StatusReport, QueueError> {
        StatusReport::from_queue_since(queue, cfg, budget, None)
    }

    /// As [`Self::from_queue`], taking a dataset's first failures from `previous` while
    /// its failed count is unchanged (a running process asks every second).
    pub fn from_queue_since(
        queue: &Queue,
        cfg: &Config,
        budget: &dyn Fn(&DatasetConfig) -> Option<u64>,
        previous: Option<&StatusReport>,
    ) -> Result<StatusReport, QueueError> {
        let states = queue.states();
        let mut datasets = Vec::new();
        for d in &cfg.datasets {
            let budget = budget(d);
            let Some(s) = states.iter().find(|s| s.name == d.name) else {
                datasets.push(DatasetStatus {
                    name: d.name.clone(),
                    budget,
                    state: DatasetPhase::NotStarted,
                    ..Default::default()
                });
                continue;
            };
            let known = previous
                .and_then(|r| r.datasets.iter().find(|p| p.name == d.name))
                .filter(|p| p.failed == s.failed);
            let failures = match known {
                Some(p) => p.failures.clone(),
                None => queue
                    .failures(s.index, 5)?
                    .into_iter()
                    .map(|(row, f)| (row + 1, f.reason))
                    .collect(),
            };
            // Met, or (policy "cancel", which never crosses it) closer to it than one
            // average completion: nothing more will fit.
            let avg = s.completion_tokens.checked_div(s.done).unwrap_or(u64::MAX);
            let budget_met = budget.is_some_and(|b| {
                s.completion_tokens >= b || (s.wasted_tokens > 0 && b - s.completion_tokens < avg)
            });
            let state = if s.items == 0 && s.rejected > 0 {
                DatasetPhase::Rejected
            } else if budget_met {
                DatasetPhase::BudgetMet
            } else if s.pending() == 0 && s.failed > 0 {
                DatasetPhase::FailedItems
            } else if s.pending() == 0 && s.items > 0 {
                DatasetPhase::Done
            } else {
                DatasetPhase::Pending
            };
            datasets.push(DatasetStatus {
                name: s.name.clone(),
                items: s.items,
                done: s.done,
                pending: s.pending(),
                inflight: 0,
                requests_inflight: 0,
                failed: s.failed,
                rejected: s.rejected,
                completion_tokens: s.completion_tokens,
                prompt_tokens: s.prompt_tokens,
                budget,
                overshoot_tokens: budget
                    .map(|b| s.completion_tokens.saturating_sub(b))
                    .unwrap_or(0),
                wasted_tokens: s.wasted_tokens,
                shards: s.next_shard,
                sharded: s.sharded,
                state,
                tokens_per_s: None,
                requests_per_s: None,
                eta_s: None,
                failures,
            });
        }
        Ok(StatusReport {
            running: false,
            datasets,
            servers: Vec::new(),
        })
    }

    /// Items that failed permanently, over all datasets (exit code 3 when > 0).
    pub fn failed(&self) -> u64 {
        self.datasets.iter().map(|d| d.failed).sum()
    }
}
