//! One dataset's lane: its pending rows, leases in flight, open items and the budget
//! gate that says whether it may start another request.
//!
//! Invariants: a (row, sample) is in at most one of `buffer`, `returned`, `ready` and
//! `inflight`; the gate counts completed tokens plus the expected final tokens of every
//! request in flight (waiting conversations too, when asked) and a margin for their spread,
//! so a lane stops before its budget rather than after.

use super::LaneSpec;
use crate::config::BudgetPolicy;
use crate::estimate::lengths::LengthModel;
use crate::store::queue::{Queue, QueueError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Standard deviations of the in-flight sum the gate holds back ([`Lane::margin`]): three,
/// because the sum of a few heavy-tailed lengths is skewed well past a normal's two.
const MARGIN_SD: f64 = 3.0;

/// A lease in flight: its streamed tokens and whether it waits between turns.
pub(super) type Flight = (Arc<AtomicU32>, Arc<AtomicBool>);

/// An item whose generations are running.
#[derive(Debug, Default)]
pub(super) struct OpenItem {
    /// Its samples leased now.
    pub(super) live: u32,
    /// Its samples that have ended.
    pub(super) ended: u32,
    /// Samples that ended before their last turn, and why.
    pub(super) partial: Vec<(u32, String)>,
    /// Samples that ended with their last turn.
    pub(super) complete: Vec<u32>,
    /// Some generation of it is kept in the queue (so closing it yields rows).
    pub(super) kept: bool,
    pub(super) server: Option<usize>,
}

pub(super) struct Lane {
    pub(super) spec: LaneSpec,
    /// Pending rows read from the queue, not yet leased.
    pub(super) buffer: VecDeque<u64>,
    /// Leases given back (shutdown, cancel): served before the buffer.
    pub(super) returned: VecDeque<(u64, u32)>,
    /// Samples of opened items not leased yet: served before new rows.
    pub(super) ready: VecDeque<(u64, u32)>,
    pub(super) open: HashMap<u64, OpenItem>,
    /// Items handed to the committer to close, not yet closed.
    pub(super) closing: std::collections::HashSet<u64>,
    /// Turns per conversation seen (sum, count): how many requests an item makes.
    pub(super) turns_seen: (u64, u64),
    pub(super) cursor: Option<u64>,
    pub(super) exhausted: bool,
    pub(super) inflight: HashMap<(u64, u32), Flight>,
    pub(super) completed_tokens: u64,
    pub(super) lengths: LengthModel,
    pub(super) cancel: CancellationToken,
    pub(super) budget_logged: bool,
    /// Benchmarks only: the naive gate "dispatch until completed tokens ≥ budget".
    pub(super) naive_budget: bool,
    /// Policy "cancel" fired: no more dispatching for this lane in this run.
    pub(super) closed: bool,
    /// Policy "cancel": tokens admitted by the committer, not yet completed.
    pub(super) admitted: u64,
}

impl Lane {
    pub(super) fn inflight_streamed(&self) -> Vec<u32> {
        self.inflight
            .values()
            .map(|(a, _)| a.load(Ordering::Relaxed))
            .collect()
    }

    /// Requests generating now (conversations waiting between turns are not).
    pub(super) fn generating(&self) -> usize {
        self.inflight
            .values()
            .filter(|(_, w)| !w.load(Ordering::Relaxed))
            .count()
    }

    /// The streamed tokens of the requests in flight, with conversations waiting between
    /// turns or without.
    fn streamed(&self, count_waiting: bool) -> impl Iterator<Item = u32> + '_ {
        self.inflight
            .values()
            .filter(move |(_, w)| count_waiting || !w.load(Ordering::Relaxed))
            .map(|(a, _)| a.load(Ordering::Relaxed))
    }

    /// Completed tokens plus what the requests in flight are expected to produce in all;
    /// conversations waiting between turns count as a new request each, or not at all.
    pub(super) fn committed_estimate(&self, count_waiting: bool) -> f64 {
        let inflight: f64 = self
            .streamed(count_waiting)
            .map(|s| self.lengths.expected_final(s))
            .sum();
        self.completed_tokens as f64 + inflight
    }

    /// The tokens the gate holds back beyond the expected finals in flight: [`MARGIN_SD`]
    /// standard deviations of their sum. Completion lengths are heavy-tailed; once the gate
    /// shuts, what the requests in flight make beyond their expectation cannot be undone,
    /// while anything below is filled by the next dispatches. This matters most for a
    /// cluster partition: its allowance is cut when the job's pool runs out, and with N
    /// partitions N pipelines are cut, each one's overrun adding up while their shortfalls
    /// are filled. The margin shrinks with the work in flight, so a lane still fills to its
    /// budget, and it is zero with nothing in flight or no fit yet (the prior is the cap).
    pub(super) fn margin(&self) -> f64 {
        if self.naive_budget {
            return 0.0;
        }
        let var: f64 = self
            .inflight
            .values()
            .map(|(a, _)| self.lengths.variance_final(a.load(Ordering::Relaxed)))
            .sum();
        MARGIN_SD * var.sqrt()
    }

    /// What the lane must hold to start one more request on a budget that may still grow:
    /// the new request counted as in flight, margin included. A cluster partition's lane
    /// gambles on a request that may not fit only once the job's pool is spent and it holds
    /// the last of it ([`Self::gate_open`]); before that it asks for more, so N partitions
    /// do not each end one size-biased request over.
    pub(super) fn next_need(&self, count_waiting: bool) -> f64 {
        let (estimate, var) = self.moments(count_waiting);
        self.need_after(estimate, var)
    }

    /// What the lane holds (completed tokens, the expected finals in flight and the
    /// [`Self::margin`]) and its [`Self::next_need`], waiting conversations counted, from
    /// one pass over the requests in flight: what it reports to a partition's budget agent.
    pub(super) fn held_and_next_need(&self) -> (f64, f64) {
        let (estimate, var) = self.moments(true);
        let held = match self.naive_budget {
            true => estimate,
            false => estimate + MARGIN_SD * var.sqrt(),
        };
        (held, self.need_after(estimate, var))
    }

    /// Completed tokens plus the expected finals in flight, and the variance of their sum.
    fn moments(&self, count_waiting: bool) -> (f64, f64) {
        let (mut mean, mut var) = (self.completed_tokens as f64, 0.0);
        for s in self.streamed(count_waiting) {
            mean += self.lengths.expected_final(s);
            var += self.lengths.variance_final(s);
        }
        (mean, var)
    }

    /// What one more request needs held on top of `estimate` (variance `var` in flight).
    fn need_after(&self, estimate: f64, var: f64) -> f64 {
        let var = var + self.lengths.variance_final(0);
        estimate + self.lengths.expected_new() + MARGIN_SD * var.sqrt()
    }

    /// Whether one more request may start: dispatching stops as soon as completed tokens
    /// plus the expected final tokens of the work in flight (and the margin) reach the
    /// budget; on a budget that may still grow, as soon as the next request and its
    /// margin do not fit ([`Self::next_need`]).
    pub(super) fn budget_allows(&self) -> bool {
        self.gate_open(true)
    }

    /// The budget gate, counting waiting conversations (for a new item, so they go
    /// first) or not (for a waiting conversation's next turn, so they cannot all wait on
    /// each other).
    pub(super) fn gate_open(&self, count_waiting: bool) -> bool {
        match self.budget() {
            None => true,
            Some(b) if self.naive_budget => self.completed_tokens < b,
            Some(b) if !self.budget_final() => self.next_need(count_waiting) <= b as f64,
            Some(b) => {
                self.committed_estimate(count_waiting) + self.margin() + self.half_next() < b as f64
            }
        }
    }

    /// Half the expected length of the request about to start, once lengths are fitted: it
    /// starts only if the expected total with it passes the budget by at most half a
    /// request, so a dataset ends within about half a completion either side of its budget
    /// rather than up to a whole one over (N partitions end N times). Before a fit (the
    /// prior is the cap) nothing is added, so a budget under one completion still runs.
    fn half_next(&self) -> f64 {
        match self.lengths.fitted() {
            Some(_) => 0.5 * self.lengths.expected_new(),
            None => 0.0,
        }
    }

    /// Requests an item makes: its samples times the turns its conversations have had.
    pub(super) fn requests_per_item(&self) -> f64 {
        let turns = match self.turns_seen {
            (_, 0) => 1.0,
            (sum, n) => sum as f64 / n as f64,
        };
        f64::from(self.spec.samples.max(1)) * turns
    }

    /// With the budget met: the next open item to close (nothing of it leased), with its
    /// samples' reasons. Items with nothing kept are only forgotten (they stay pending).
    pub(super) fn take_close(&mut self) -> Option<(u64, Vec<(u32, String)>)> {
        if !self.budget_met() {
            return None;
        }
        self.ready.clear();
        self.returned.clear();
        let idle: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, o)| o.live == 0)
            .map(|(r, _)| *r)
            .collect();
        for row in idle {
            let Some(o) = self.open.remove(&row) else {
                continue;
            };
            if !o.kept {
                continue;
            }
            let mut partial = o.partial;
            for s in 0..self.spec.samples {
                if !partial.iter().any(|(p, _)| *p == s) && !o.complete.contains(&s) {
                    partial.push((s, "budget".to_string()));
                }
            }
            partial.sort();
            self.closing.insert(row);
            return Some((row, partial));
        }
        None
    }

    pub(super) fn budget_met(&self) -> bool {
        self.closed
            || (self.budget_final() && self.budget().is_some_and(|b| self.completed_tokens >= b))
    }

    /// The budget now: the growing allowance's, else the configured one.
    pub(super) fn budget(&self) -> Option<u64> {
        match &self.spec.allowance {
            Some(a) => Some(a.granted()),
            None => self.spec.budget,
        }
    }

    /// Whether the budget will not grow (always, unless an allowance says more may come).
    pub(super) fn budget_final(&self) -> bool {
        self.spec.allowance.as_ref().is_none_or(|a| a.is_last())
    }

    /// Policy "cancel": abort every request in flight and dispatch no more in this run.
    pub(super) fn close(&mut self) {
        self.closed = true;
        self.cancel.cancel();
        self.cancel = CancellationToken::new();
    }

    pub(super) fn count_tokens(&mut self, tokens: u32) {
        self.completed_tokens += u64::from(tokens);
        if self.spec.policy == BudgetPolicy::Cancel {
            self.admitted = self.admitted.saturating_sub(u64::from(tokens));
        }
        self.lengths.observe(tokens);
    }

    pub(super) fn refill(&mut self, queue: &Queue) -> Result<(), QueueError> {
        if self.buffer.is_empty() && !self.exhausted {
            let rows = queue.pending_rows(self.spec.ds, self.cursor, 1024)?;
            if rows.is_empty() {
                self.exhausted = true;
            }
            if let Some(&last) = rows.last() {
                self.cursor = Some(last);
            }
            self.buffer.extend(rows);
        }
        Ok(())
    }

    pub(super) fn has_rows(&self) -> bool {
        !self.returned.is_empty()
            || !self.ready.is_empty()
            || !self.buffer.is_empty()
            || !self.exhausted
    }

    /// The next (row, sample) to lease: given back first, then samples of open items,
    /// then a new row (opened when its items have several generations).
    pub(super) fn take(&mut self) -> Option<(u64, u32)> {
        if let Some(x) = self.returned.pop_front().or_else(|| self.ready.pop_front()) {
            return Some(x);
        }
        let row = self.buffer.pop_front()?;
        if self.spec.multi {
            self.open.entry(row).or_default();
            self.ready.extend((1..self.spec.samples).map(|s| (row, s)));
        }
        Some((row, 0))
    }

    pub(super) fn can_dispatch(&self) -> bool {
        !self.budget_met() && self.budget_allows() && self.has_rows()
    }

    pub(super) fn finished(&self) -> bool {
        self.inflight.is_empty()
            && !self.can_dispatch()
            && self.closing.is_empty()
            && !(self.budget_met() && self.open.values().any(|o| o.live == 0 && o.kept))
    }
}
