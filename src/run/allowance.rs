//! A budget that grows while the run goes: a cluster partition's part of its job's budget,
//! taken from the job's pool in tickets (`cluster::budget`) as the lane needs them.
//!
//! The scheduler reads `granted` where a one-process run reads its fixed budget, and
//! reports what the lane wants (its completed tokens plus the expected final tokens of its
//! requests in flight, and a margin for how far those may run over); the partition's budget agent grants more while the pool lasts and
//! says when it is the last (`is_last`: the pool is spent). Until then the lane starts a
//! request only with room for it and its margin (`next_need`), a lane whose gate is shut
//! waits instead of finishing, and policy "cancel" does not close it.
//!
//! Invariant: `granted` is set only by the agent, from the partition's log (its tickets
//! less what it gave back and what other writers of the partition committed); the
//! commit-time cap (`cluster::worker`) holds the budget exactly, whatever this says.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::sync::Notify;

/// One dataset's growing budget in one run.
#[derive(Debug, Default)]
pub struct Allowance {
    granted: AtomicU64,
    last: AtomicBool,
    /// Completed tokens plus the expected final tokens of the requests in flight and the
    /// gate's margin for their spread.
    demand: AtomicU64,
    /// Completed tokens.
    completed: AtomicU64,
    /// The scheduler has reported at least once.
    reported: AtomicBool,
    /// The expected tokens of one new request.
    request_tokens: AtomicU64,
    /// The lane has rows it would dispatch with more budget.
    wants: AtomicBool,
    /// Tokens this run completed for items another writer committed first (a twin): in
    /// the lane's completed tokens and in the partition's, so counted once by adding them
    /// back.
    duplicates: AtomicU64,
    /// What the lane must hold to start one more request with the margin (the gate of a
    /// budget that may still grow), as last reported.
    next_need: AtomicU64,
    /// Nothing generating (conversations may wait between turns): what the lane holds
    /// beyond its completed tokens is idle.
    idle: AtomicBool,
    /// Woken when `granted` or `last` change (the dispatcher then looks again).
    pub changed: Notify,
}

impl Allowance {
    /// An allowance of `granted` tokens, more to come.
    pub fn new(granted: u64) -> Allowance {
        let a = Allowance::default();
        a.granted.store(granted, Ordering::Relaxed);
        a
    }

    /// The lane's budget now.
    pub fn granted(&self) -> u64 {
        self.granted.load(Ordering::Relaxed)
    }

    /// No more will be granted: the lane may finish on what it has.
    pub fn is_last(&self) -> bool {
        self.last.load(Ordering::Relaxed)
    }

    /// Sets the budget and whether it is the last (the agent).
    pub fn set(&self, granted: u64, last: bool) {
        let old = self.granted.swap(granted, Ordering::Relaxed);
        let was_last = self.last.swap(last, Ordering::Relaxed);
        if old != granted || was_last != last {
            self.changed.notify_waiters();
        }
    }

    /// What the lane wants (the scheduler, as it decides).
    pub fn report(&self, demand: f64, completed: u64, request_tokens: f64, wants: bool) {
        self.demand
            .store(demand.max(0.0).ceil() as u64, Ordering::Relaxed);
        self.completed.store(completed, Ordering::Relaxed);
        self.request_tokens
            .store(request_tokens.max(1.0).ceil() as u64, Ordering::Relaxed);
        self.wants.store(wants, Ordering::Relaxed);
        self.reported.store(true, Ordering::Relaxed);
    }

    /// What the lane must hold to start its next request, and whether nothing is
    /// generating (the scheduler, with [`Self::report`]).
    pub fn report_next(&self, need: f64, idle: bool) {
        self.next_need
            .store(need.max(0.0).ceil() as u64, Ordering::Relaxed);
        self.idle.store(idle, Ordering::Relaxed);
    }

    /// What the lane must hold to start its next request (0 until reported).
    pub fn next_need(&self) -> u64 {
        self.next_need.load(Ordering::Relaxed)
    }

    /// Whether the lane had nothing generating, as last reported.
    pub fn idle(&self) -> bool {
        self.idle.load(Ordering::Relaxed)
    }

    /// Whether the scheduler has reported yet (before, `wants_more` means nothing).
    pub fn reported(&self) -> bool {
        self.reported.load(Ordering::Relaxed)
    }

    /// Completed tokens, as last reported.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Completed tokens plus the expected final tokens in flight (and the margin), as last
    /// reported.
    pub fn demand(&self) -> u64 {
        self.demand.load(Ordering::Relaxed)
    }

    /// The expected tokens of one new request, as last reported (at least 1).
    pub fn request_tokens(&self) -> u64 {
        self.request_tokens.load(Ordering::Relaxed).max(1)
    }

    /// Whether the lane has rows it would dispatch with more budget.
    pub fn wants_more(&self) -> bool {
        self.wants.load(Ordering::Relaxed)
    }

    /// Counts tokens completed here for items another writer committed first.
    pub fn add_duplicates(&self, tokens: u64) {
        self.duplicates.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Tokens completed here for items another writer committed first.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
}
