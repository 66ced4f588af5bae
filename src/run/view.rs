//! What observers may read of a running job: its config and plan, queue counts, lanes and
//! servers, through accessors only, so `observe/` shows the run and never steers it
//! (routing, take-out and probe-in stay in [`crate::run::servers`]).

use crate::config::{Config, DatasetConfig};
use crate::observe::metrics::DatasetMetrics;
use crate::run::plan::JobPlan;
use crate::run::scheduler::{LaneView, Scheduler};
use crate::run::servers::Servers;
use crate::store::queue::Queue;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A read-only view of a running job.
#[derive(Clone)]
pub struct RunView {
    cfg: Arc<Config>,
    plan: Arc<JobPlan>,
    queue: Arc<Queue>,
    sched: Arc<Scheduler>,
    servers: Arc<Servers>,
    dmetrics: Arc<Vec<DatasetMetrics>>,
}

/// One server as an observer reads it.
pub struct ServerReading {
    pub url: String,
    pub up: bool,
    /// Attempts in flight.
    pub inflight: usize,
    /// Its own limit with `concurrency = "auto"`, else `None`.
    pub limit: Option<usize>,
    /// Tokens received from it so far.
    pub streamed: u64,
}

impl RunView {
    pub(crate) fn new(
        cfg: &Arc<Config>,
        plan: &Arc<JobPlan>,
        queue: &Arc<Queue>,
        sched: &Arc<Scheduler>,
        servers: &Arc<Servers>,
        dmetrics: &[DatasetMetrics],
    ) -> RunView {
        RunView {
            cfg: cfg.clone(),
            plan: plan.clone(),
            queue: queue.clone(),
            sched: sched.clone(),
            servers: servers.clone(),
            dmetrics: Arc::new(dmetrics.to_vec()),
        }
    }

    /// The run's configuration.
    pub fn cfg(&self) -> &Config {
        &self.cfg
    }

    /// The budget dataset `d` is held to this run ([`JobPlan::budget`]).
    pub fn budget(&self, d: &DatasetConfig) -> Option<u64> {
        self.plan.budget(d)
    }

    /// The queue, for its durable counts.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Each lane's dispatch state now.
    pub fn lanes(&self) -> Vec<LaneView> {
        self.sched.views()
    }

    /// Resolves when a lease ends (a later [`Self::lanes`] may differ); enable it before
    /// reading the lanes so no change between is missed.
    pub fn lanes_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.sched.changed.notified()
    }

    /// Per lane, its counters.
    pub fn dataset_metrics(&self) -> &[DatasetMetrics] {
        &self.dmetrics
    }

    /// Each server now.
    pub fn servers(&self) -> Vec<ServerReading> {
        let limited = self.servers.limited();
        self.servers
            .list
            .iter()
            .map(|s| ServerReading {
                url: s.url.clone(),
                up: s.up.load(Ordering::Relaxed),
                inflight: s.inflight.load(Ordering::Relaxed),
                limit: limited.then(|| s.limit.load(Ordering::Relaxed)),
                streamed: s.streamed.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Requests all servers may have in flight with `concurrency = "auto"`.
    pub fn total_limit(&self) -> usize {
        self.servers.total_limit()
    }
}
