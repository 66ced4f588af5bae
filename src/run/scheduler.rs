//! Which item goes into the next free request slot.
//!
//! Datasets are lanes served in config order; a lane stops dispatching when its rows run
//! out or when its completed tokens plus the expected final tokens of its requests in
//! flight reach its budget, and the free slot goes to the next lane at once. Leases live
//! only in memory: the queue still has a leased item as pending, so a crash returns it to
//! the queue by itself.
//!
//! An item of a dataset with several generations (`samples`, `turns = "all"`) is *open*
//! while they run: each sample is leased on its own and runs its turns in order in one
//! worker (so its history is its own replies); when every sample has ended the committer
//! closes the item. A continuing conversation waits between turns while the budget gate
//! is shut, and a new item is not started while conversations wait; once the budget is
//! met, open items that have kept generations are closed partial (`Next::Close`).
//!
//! Invariants: a (row, sample) is leased at most once at a time; a lease ends exactly
//! once, by [`Scheduler::completed`], [`Scheduler::failed`], [`Scheduler::end_sample`] or
//! [`Scheduler::release`]; streamed tokens are counted through a per-lease atomic,
//! without taking the scheduler lock.
//!
//! `lane` is one dataset's state and budget gate, `eta` when the lanes are expected to
//! finish.

mod eta;
mod lane;

pub use eta::{lane_etas, run_eta};

use lane::Lane;

use crate::config::BudgetPolicy;
use crate::estimate::lengths::LengthModel;
use crate::estimate::tail::LaneWork;
use crate::knobs::Bench;
use crate::run::allowance::Allowance;
use crate::store::queue::{Queue, QueueError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What the scheduler needs to know of a dataset.
#[derive(Debug, Clone)]
pub struct LaneSpec {
    pub ds: u16,
    pub name: String,
    pub budget: Option<u64>,
    pub max_tokens: u32,
    pub policy: BudgetPolicy,
    /// Generations per prompt.
    pub samples: u32,
    /// Items have several generations (samples or every turn) and are opened and closed.
    pub multi: bool,
    /// A budget that grows while the run goes (a cluster partition's), read in place of
    /// `budget`.
    pub allowance: Option<Arc<Allowance>>,
}

/// A row handed to a worker.
#[derive(Debug, Clone)]
pub struct Lease {
    pub lane: usize,
    pub ds: u16,
    pub row: u64,
    /// Which sample of the item (0 for single-generation items).
    pub sample: u32,
    /// The item has several generations: the worker commits each as it comes.
    pub multi: bool,
    /// The server the item's earlier generations went to, kept while it is up.
    pub server: Option<usize>,
    /// Tokens streamed so far by this lease's current attempt.
    pub streamed: Arc<AtomicU32>,
    /// Set while a conversation waits between turns: it counts as a request about to
    /// start, not as one generating.
    pub waiting: Arc<AtomicBool>,
    /// Cancelled when the budget policy "cancel" aborts the dataset's requests in flight.
    pub cancel: CancellationToken,
}

/// A snapshot of one lane for progress lines, status, metrics and ETAs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LaneView {
    pub name: String,
    /// Requests (generations) in flight.
    pub inflight: usize,
    /// Items started and not yet closed: a request in flight, a conversation between
    /// turns, samples still to run, or closing. `pending` elsewhere excludes them.
    pub inflight_items: usize,
    pub inflight_streamed_tokens: u64,
    pub completed_tokens: u64,
    pub budget: Option<u64>,
    /// Tokens the lane is still expected to generate (in flight and not yet started).
    pub remaining_tokens_estimate: f64,
    pub expected_tokens_per_item: f64,
    pub dispatching: bool,
    pub finished: bool,
    /// Prompts not yet started that the lane may still dispatch (0 once its rows are out or
    /// its budget is met), whether or not the budget gate is open right now.
    pub pending_to_start: f64,
    /// Budget minus completed tokens (`None`: no budget).
    pub budget_left: Option<f64>,
    /// What the lane still has to do, for the ETA's simulation of the batch
    /// ([`crate::estimate::tail::finish_times`], run by the monitor, not on every snapshot).
    #[serde(skip)]
    pub work: LaneWork,
}

/// The dispatch state of every dataset.
pub struct Scheduler {
    lanes: Mutex<Vec<Lane>>,
    queue: Arc<Queue>,
    last_fit: Mutex<Option<std::time::Instant>>,
    /// Benchmarks only: lane k+1 waits until lane k is finished.
    serial: bool,
    /// Woken whenever a lease ends (a slot or budget may have freed up).
    pub changed: Notify,
}

/// What `next` found.
#[derive(Debug)]
pub enum Next {
    Lease(Lease),
    /// The budget is met: close this open item with these samples' reasons (its kept
    /// generations become rows).
    Close {
        lane: usize,
        ds: u16,
        row: u64,
        partial: Vec<(u32, String)>,
    },
    /// Nothing can start now, but requests in flight may change that.
    Wait,
    /// Every lane is finished.
    Done,
}

impl Scheduler {
    /// Lanes in config order, each seeded with the queue's completed tokens. `bench`:
    /// `naive_budget` gates budgets on completed tokens alone, as a naive script does (the
    /// baseline `make bench-eta` measures the estimate of work in flight against);
    /// `serial_datasets` serves datasets strictly one after the other.
    pub fn new(queue: Arc<Queue>, specs: Vec<LaneSpec>, bench: Bench) -> Self {
        let lanes = specs
            .into_iter()
            .map(|spec| {
                let completed_tokens = queue
                    .state(spec.ds)
                    .map(|s| s.completion_tokens)
                    .unwrap_or(0);
                Lane {
                    lengths: LengthModel::new(spec.max_tokens),
                    spec,
                    buffer: VecDeque::new(),
                    returned: VecDeque::new(),
                    ready: VecDeque::new(),
                    open: HashMap::new(),
                    closing: Default::default(),
                    turns_seen: (0, 0),
                    cursor: None,
                    exhausted: false,
                    inflight: HashMap::new(),
                    completed_tokens,
                    cancel: CancellationToken::new(),
                    budget_logged: false,
                    naive_budget: bench.naive_budget,
                    closed: false,
                    admitted: 0,
                }
            })
            .collect();
        Self {
            lanes: Mutex::new(lanes),
            queue,
            last_fit: Mutex::new(None),
            serial: bench.serial_datasets,
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Lane>> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seeds a lane's length model with lengths already known (e.g. from the queue).
    pub fn seed_lengths(&self, lane: usize, lengths: impl IntoIterator<Item = u32>) {
        let mut lanes = self.lock();
        if let Some(l) = lanes.get_mut(lane) {
            for x in lengths {
                l.lengths.observe(x);
            }
        }
    }

    /// Refits the lanes' length models at most once a second (cheap enough to call often).
    fn maybe_refit(&self, lanes: &mut [Lane]) {
        let mut last = self.last_fit.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(1)) {
            return;
        }
        *last = Some(std::time::Instant::now());
        for l in lanes.iter_mut() {
            let streamed = l.inflight_streamed();
            l.lengths.refit(&streamed);
        }
    }

    /// The next row to send: the first lane in order that has rows and budget room.
    pub fn next(&self) -> Result<Next, QueueError> {
        let mut lanes = self.lock();
        self.maybe_refit(&mut lanes);
        let mut all_finished = true;
        for (i, lane) in lanes.iter_mut().enumerate() {
            if self.serial && i > 0 && !all_finished {
                break; // benchmarks: the previous lane's tail is still in flight
            }
            if let Some((row, partial)) = lane.take_close() {
                return Ok(Next::Close {
                    lane: i,
                    ds: lane.spec.ds,
                    row,
                    partial,
                });
            }
            if let Some(a) = &lane.spec.allowance {
                let (held, need) = lane.held_and_next_need();
                a.report(
                    held,
                    lane.completed_tokens,
                    lane.lengths.expected_new(),
                    !lane.closed && lane.has_rows(),
                );
                a.report_next(need, lane.generating() == 0);
            }
            if lane.budget_met() || !lane.budget_allows() {
                if !lane.closing.is_empty() {
                    all_finished = false;
                }
                // A growing budget: wait for more rather than finish.
                if !lane.budget_final() && !lane.closed && lane.has_rows() {
                    all_finished = false;
                    continue;
                }
                if !lane.budget_logged && lane.inflight.is_empty() {
                    lane.budget_logged = true;
                    tracing::info!(
                        dataset = %lane.spec.name,
                        completed_tokens = lane.completed_tokens,
                        budget = lane.budget().unwrap_or(0),
                        "budget reached: no more dispatching for this dataset"
                    );
                }
                if !lane.inflight.is_empty() {
                    all_finished = false;
                }
                continue;
            }
            lane.refill(&self.queue)?;
            match lane.take() {
                Some((row, sample)) => {
                    let streamed = Arc::new(AtomicU32::new(0));
                    let waiting = Arc::new(AtomicBool::new(false));
                    lane.inflight
                        .insert((row, sample), (streamed.clone(), waiting.clone()));
                    // The budget agent must not take the lane for idle with this in flight.
                    if let Some(a) = &lane.spec.allowance {
                        a.report_next(lane.next_need(true), false);
                    }
                    let server = match lane.open.get_mut(&row) {
                        Some(o) => {
                            o.live += 1;
                            o.server
                        }
                        None => None,
                    };
                    return Ok(Next::Lease(Lease {
                        lane: i,
                        ds: lane.spec.ds,
                        row,
                        sample,
                        multi: lane.spec.multi,
                        server,
                        streamed,
                        waiting,
                        cancel: lane.cancel.clone(),
                    }));
                }
                None => {
                    if !lane.inflight.is_empty() {
                        all_finished = false;
                    }
                }
            }
        }
        Ok(if all_finished { Next::Done } else { Next::Wait })
    }

    /// Policy "cancel": whether a finished request may be committed without taking the
    /// dataset past its budget. Admitted tokens count at once (the committer admits a batch
    /// one by one); a refusal aborts the lane's requests in flight. Other policies admit all.
    pub fn admit(&self, lease: &Lease, tokens: u32) -> bool {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        if lane.spec.policy != BudgetPolicy::Cancel {
            return true;
        }
        match lane.budget() {
            // A growing budget admits: the commit-time cap holds the job's budget.
            Some(b)
                if lane.budget_final()
                    && lane.completed_tokens + lane.admitted + u64::from(tokens) > b =>
            {
                lane.close();
                false
            }
            _ => {
                lane.admitted += u64::from(tokens);
                true
            }
        }
    }

    /// Policy "cancel": aborts a lane's requests in flight as soon as what they have already
    /// generated would take it past its budget. Called by the monitor.
    pub fn enforce_cancel(&self) {
        let mut lanes = self.lock();
        for lane in lanes.iter_mut() {
            if lane.spec.policy != BudgetPolicy::Cancel || lane.closed || !lane.budget_final() {
                continue;
            }
            if let Some(b) = lane.budget() {
                let streamed: u64 = lane.inflight_streamed().iter().map(|&s| u64::from(s)).sum();
                if lane.completed_tokens >= b
                    || (lane.completed_tokens + streamed > b && !lane.inflight.is_empty())
                {
                    tracing::info!(dataset = %lane.spec.name, completed_tokens = lane.completed_tokens,
                        inflight_tokens = streamed, budget = b, "budget reached: cancelling requests in flight");
                    lane.close();
                }
            }
        }
    }

    /// A lease ended with a durable result of `tokens` completion tokens.
    pub fn completed(&self, lease: &Lease, tokens: u32) {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        lane.inflight.remove(&(lease.row, lease.sample));
        lane.count_tokens(tokens);
        drop(lanes);
        self.changed.notify_waiters();
    }

    /// One generation of an open item is durable; its lease goes on (the next turn).
    pub fn turn_completed(&self, lease: &Lease, tokens: u32) {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        lane.count_tokens(tokens);
        if let Some(o) = lane.open.get_mut(&lease.row) {
            o.kept = true;
        }
        drop(lanes);
        self.changed.notify_waiters();
    }

    /// A sample of an open item has ended (`partial`: before its last turn, and why); its
    /// lease ends. Returns the item's samples' reasons when this was its last sample: the
    /// item is then to be closed (and is no longer open here).
    pub fn end_sample(&self, lease: &Lease, partial: Option<String>) -> Option<Vec<(u32, String)>> {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        lane.inflight.remove(&(lease.row, lease.sample));
        let samples = lane.spec.samples.max(1);
        let done = match lane.open.get_mut(&lease.row) {
            Some(o) => {
                o.live = o.live.saturating_sub(1);
                o.ended += 1;
                match partial {
                    Some(p) => o.partial.push((lease.sample, p)),
                    None => o.complete.push(lease.sample),
                }
                o.ended >= samples
            }
            None => true,
        };
        let closed = if done {
            let mut p = lane
                .open
                .remove(&lease.row)
                .map(|o| o.partial)
                .unwrap_or_default();
            p.sort();
            // Started until the committer has closed it (`closed`), never pending between.
            lane.closing.insert(lease.row);
            Some(p)
        } else {
            None
        };
        drop(lanes);
        self.changed.notify_waiters();
        closed
    }

    /// What a worker learned starting a sample: whether the item already has kept
    /// generations (closing it then yields rows), and how many turns its conversation has.
    pub fn note_start(&self, lease: &Lease, kept: bool, turns: u32) {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        if let Some(o) = lane.open.get_mut(&lease.row) {
            o.kept |= kept;
        }
        if lease.sample == 0 && turns > 0 {
            lane.turns_seen.0 += u64::from(turns);
            lane.turns_seen.1 += 1;
        }
    }

    /// The server an open item's generation went to: its next ones prefer it.
    pub fn note_server(&self, lease: &Lease, server: usize) {
        let mut lanes = self.lock();
        if let Some(o) = lanes[lease.lane].open.get_mut(&lease.row) {
            o.server.get_or_insert(server);
        }
    }

    /// Whether a conversation may start its next turn: `Some(true)` go, `Some(false)`
    /// stop (the budget is met), `None` wait (the gate is shut by the work generating).
    pub fn may_continue(&self, lease: &Lease) -> Option<bool> {
        let lanes = self.lock();
        let lane = &lanes[lease.lane];
        if lane.budget_met() {
            Some(false)
        } else if lane.gate_open(false) {
            Some(true)
        } else {
            None
        }
    }

    /// The committer has closed an item (its last sample ended, or handed out by
    /// [`Next::Close`]).
    pub fn closed(&self, lane: usize, row: u64) {
        let mut lanes = self.lock();
        lanes[lane].closing.remove(&row);
        drop(lanes);
        self.changed.notify_waiters();
    }

    /// A lease ended with a permanent failure.
    pub fn failed(&self, lease: &Lease) {
        let mut lanes = self.lock();
        lanes[lease.lane]
            .inflight
            .remove(&(lease.row, lease.sample));
        drop(lanes);
        self.changed.notify_waiters();
    }

    /// A lease is given back unfinished (shutdown, budget cancel): the row stays pending
    /// and is offered again first.
    pub fn release(&self, lease: &Lease) {
        let mut lanes = self.lock();
        let lane = &mut lanes[lease.lane];
        if lane.inflight.remove(&(lease.row, lease.sample)).is_some() {
            lane.returned.push_back((lease.row, lease.sample));
            if let Some(o) = lane.open.get_mut(&lease.row) {
                o.live = o.live.saturating_sub(1);
            }
        }
        drop(lanes);
        self.changed.notify_waiters();
    }

    /// Snapshots for progress, metrics, `/status` and ETAs.
    pub fn views(&self) -> Vec<LaneView> {
        let mut lanes = self.lock();
        self.maybe_refit(&mut lanes);
        lanes
            .iter()
            .map(|l| {
                let streamed = l.inflight_streamed();
                let exp_new = l.lengths.expected_new();
                let finals: Vec<f64> = streamed
                    .iter()
                    .map(|&s| l.lengths.expected_final(s))
                    .collect();
                let inflight_rest: f64 = finals
                    .iter()
                    .zip(&streamed)
                    .map(|(f, &s)| f - f64::from(s))
                    .sum();
                let dispatching = l.can_dispatch();
                // Prompts not yet started, and the budget's room after the expected finals
                // of the requests in flight (`None`: no budget).
                // Requests not yet started: an item makes `samples` × turns requests.
                let started = if l.spec.multi {
                    l.open.len()
                } else {
                    l.inflight.len()
                };
                let pending = self
                    .queue
                    .state(l.spec.ds)
                    .map(|s| s.pending())
                    .unwrap_or(0)
                    .saturating_sub(started as u64) as f64
                    * l.requests_per_item();
                let budget_left = l.budget().map(|b| b as f64 - l.completed_tokens as f64);
                let room = budget_left.map(|left| (left - finals.iter().sum::<f64>()).max(0.0));
                // Requests the lane is still expected to start: its pending prompts, or as
                // many as the budget gate will let through (it dispatches while completed
                // plus expected final tokens stay under the budget, so one more than fits).
                let to_start = match room {
                    _ if !dispatching => 0.0,
                    Some(room) => pending.min((room / exp_new.max(1.0)).ceil()),
                    None => pending,
                };
                let pending_to_start = if !l.budget_met() && l.has_rows() {
                    pending
                } else {
                    0.0
                };
                let future = match room {
                    Some(room) if dispatching => (to_start * exp_new).min(room),
                    _ => to_start * exp_new,
                };
                let inflight_items = if l.spec.multi {
                    l.open.len() + l.closing.len()
                } else {
                    l.inflight
                        .keys()
                        .map(|(row, _)| row)
                        .collect::<std::collections::HashSet<_>>()
                        .len()
                };
                LaneView {
                    name: l.spec.name.clone(),
                    inflight: l.inflight.len(),
                    inflight_items,
                    inflight_streamed_tokens: streamed.iter().map(|&s| u64::from(s)).sum(),
                    completed_tokens: l.completed_tokens,
                    budget: l.budget(),
                    remaining_tokens_estimate: inflight_rest + future,
                    expected_tokens_per_item: exp_new,
                    dispatching,
                    finished: l.finished(),
                    pending_to_start,
                    budget_left,
                    work: LaneWork {
                        streamed,
                        to_start,
                        pending: pending_to_start,
                        budget_left,
                        lengths: l.lengths.clone(),
                    },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
