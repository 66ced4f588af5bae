//! The budget agent: a worker's claims of budget tickets for its lanes as they need
//! them, pooling a lane's room when it is short of one more request, taking the last of
//! the pool (less waiting partitions' debts), the end-of-run settling (a twin of the
//! partition still running keeps what is unused), and taking back a dead partition's
//! unused allowance.
//!
//! Invariants: see the parent module; the agent only claims, records and releases
//! through its functions, so the budget log and the partition's log stay in step.

use super::{record_claim, release, ticket_size, unused, BudgetLog};
use crate::cluster::commits::{self, untrusted, CommitError, CommitLog};
use crate::cluster::partition::Partition;
use crate::output::bucket::Bucket;
use crate::run::allowance::Allowance;
use futures_util::StreamExt;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// How often the agent looks at its lanes.
const TICK: Duration = Duration::from_millis(100);

/// How often a budget-bound worker looks for stale partitions when the pool is empty.
const RECLAIM_EVERY: Duration = Duration::from_secs(60);

/// One budgeted dataset the agent serves.
pub struct Lane {
    pub dataset: String,
    pub budget: u64,
    pub ledger: BudgetLog,
    pub allowance: Arc<Allowance>,
    /// With the pool empty, the next look at it: backing off, so a lane finishing its
    /// last requests does not poll the store.
    quiet_until: Option<std::time::Instant>,
    backoff: Duration,
    /// This partition's waiting marker is up: it found the pool empty and wants more.
    marked: bool,
    /// Since when it has found the pool empty.
    empty_since: Option<std::time::Instant>,
    /// Another worker of this partition (a twin) committed rows this one had made too:
    /// the lane takes no more tickets and finishes on what it holds.
    yielded: bool,
    /// The lane had nothing generating at the last look.
    was_idle: bool,
}

impl Lane {
    /// A lane of `dataset`, whose job budget is `budget`.
    pub fn new(dataset: &str, budget: u64, ledger: BudgetLog, allowance: Arc<Allowance>) -> Lane {
        Lane {
            dataset: dataset.into(),
            budget,
            ledger,
            allowance,
            quiet_until: None,
            backoff: Duration::ZERO,
            marked: false,
            empty_since: None,
            yielded: false,
            was_idle: false,
        }
    }

    /// With nothing to take from the pool, the next look at it comes later and later (up to
    /// [`MAX_BACKOFF`]), so a lane waiting on others does not poll the store.
    fn back_off(&mut self) {
        self.backoff = (self.backoff * 2).clamp(MIN_BACKOFF, MAX_BACKOFF);
        self.quiet_until = Some(std::time::Instant::now() + self.backoff);
    }
}

/// The first wait between looks at a pool that cannot start a request here.
const MIN_BACKOFF: Duration = Duration::from_millis(250);

/// The longest wait between looks at a pool that cannot start a request here: short,
/// because a job's last partitions wait on each other this way (the job ends that much
/// later) until one takes the last of the pool. A look is two listings and the heartbeats
/// of partitions not yet waiting: at 256 partitions, under a thousand requests a second
/// for the minutes of a budget's tail.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The longest a partition waits, with the pool empty, for others to give budget back.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// The key of partition `p`'s marker for `dataset`: up while it waits for budget with the
/// pool empty, and once its worker has stopped (it gives nothing back after that).
pub fn waiting_key(dataset: &str, p: u32) -> String {
    format!("_spool/waiting/{dataset}/p{p:04}.json")
}

/// The partitions with a waiting marker for `dataset` (waiting for budget, or stopped).
/// A marker's name must be a partition of the job's.
async fn marked(
    bucket: &Bucket,
    me: Partition,
    dataset: &str,
) -> Result<HashSet<u32>, CommitError> {
    let prefix = format!("_spool/waiting/{dataset}/");
    let mut marked = HashSet::new();
    for (key, _) in bucket.list(&prefix).await? {
        let p = key
            .strip_prefix(&prefix)
            .and_then(|n| n.strip_prefix('p'))
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|n| n.len() == 4 && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&p| p < me.count);
        match p {
            Some(p) => {
                marked.insert(p);
            }
            None => return Err(untrusted(&key, "not a partition's waiting marker")),
        }
    }
    Ok(marked)
}

/// Whether a partition other than `me` may still give `dataset`'s budget back: it took
/// tickets, is not `marked` (neither waiting for budget nor stopped) and its worker shows
/// a heartbeat within `heartbeat::STALE_S`.
async fn others_may_return(
    bucket: &Bucket,
    me: Partition,
    ledger: &BudgetLog,
    marked: &HashSet<u32>,
) -> Result<bool, CommitError> {
    let now = crate::cluster::job::now_unix();
    for q in (0..me.count).filter(|&q| q != me.index) {
        if marked.contains(&q) || ledger.claims_of(q).is_empty() {
            continue;
        }
        let p = Partition {
            index: q,
            count: me.count,
        };
        let fresh = crate::cluster::heartbeat::read(bucket, p)
            .await
            .ok()
            .flatten()
            .is_some_and(|s| {
                s.running
                    && now.saturating_sub(s.heartbeat_unix) <= crate::cluster::heartbeat::STALE_S
            });
        if fresh {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The tokens that the `marked` partitions other than `me` completed past their
/// allowance of `dataset`, as their markers say. A marker is a neighbour's word: one that
/// does not parse owes nothing, and the sum only holds back the last of the pool (at
/// worst it is left unused), never grants anything.
pub(super) async fn debts(
    bucket: &Bucket,
    me: Partition,
    dataset: &str,
    marked: &HashSet<u32>,
) -> Result<u64, CommitError> {
    let mut keys = Vec::new();
    for &p in marked {
        if p != me.index {
            keys.push(waiting_key(dataset, p));
        }
    }
    let owed = futures_util::stream::iter(keys)
        .map(|k| async move { bucket.get_capped(&k, MARKER_BYTES).await })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let mut total = 0u64;
    for body in owed {
        let body = match body {
            Err(crate::output::bucket::BucketError::TooLarge { .. }) => None,
            other => other?,
        };
        let debt = body
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v.get("debt").and_then(|d| d.as_u64()))
            .unwrap_or(0);
        total = total.saturating_add(debt);
    }
    Ok(total)
}

/// The most bytes of a waiting marker read.
const MARKER_BYTES: u64 = 4 << 10;

/// Claims tickets for a worker's lanes as they need them, and keeps each lane's allowance
/// in step with the partition's log.
pub struct Agent {
    pub log: Arc<Mutex<CommitLog>>,
    pub lanes: Vec<Lane>,
    pub writer: String,
    pub partition: Partition,
    pub bucket: Arc<Bucket>,
    pub stale_after: Duration,
}

impl Agent {
    /// The lane's budget from the partition's log: its allowance less what other writers
    /// of the partition committed (spent, but in no local queue), plus what this writer
    /// completed for items they committed first (counted in both).
    pub fn granted(log: &CommitLog, dataset: &str, writer: &str, a: &Allowance) -> u64 {
        (log.dataset(dataset).allowance() + a.duplicates())
            .saturating_sub(log.tokens_by_others(writer, dataset))
    }

    /// Runs until `stop`; a failed claim is logged and tried at the next tick.
    pub async fn run(mut self, stop: tokio_util::sync::CancellationToken) -> Self {
        let mut last_reclaim: Option<std::time::Instant> = None;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return self,
                _ = tokio::time::sleep(TICK) => {}
            }
            for i in 0..self.lanes.len() {
                match self.tick(i, &mut last_reclaim).await {
                    Ok(()) => {}
                    Err(CommitError::Sealed { .. }) => return self,
                    Err(e) => tracing::warn!(dataset = %self.lanes[i].dataset, error = %e,
                        "cannot take budget from the job's pool yet; trying again"),
                }
            }
        }
    }

    pub(super) async fn tick(
        &mut self,
        i: usize,
        last_reclaim: &mut Option<std::time::Instant>,
    ) -> Result<(), CommitError> {
        let (partition, writer) = (self.partition, self.writer.clone());
        let lane = &mut self.lanes[i];
        let a = lane.allowance.clone();
        if !a.reported() {
            return Ok(());
        }
        let granted = a.granted();
        let floor = a.request_tokens();
        if !a.wants_more() {
            // Out of rows (or closed): what the lane holds beyond its requests in flight
            // (kept twice over) goes back now, for the partitions still going — unless a
            // twin shares the partition: what it has in flight is counted nowhere here.
            if a.duplicates() > 0 {
                return Ok(());
            }
            let inflight = a.demand().saturating_sub(a.completed());
            let keep = a.demand() + inflight + floor;
            if granted > keep {
                let mut log = self.log.lock().await;
                let tokens = (granted - keep).min(unused(&log, &lane.dataset));
                if tokens > 0 {
                    tracing::info!(dataset = %lane.dataset, tokens,
                        "out of items: giving unused budget back to the job's pool");
                    release(&mut log, &mut lane.ledger, &lane.dataset, &writer, tokens).await?;
                    a.set(
                        Agent::granted(&log, &lane.dataset, &writer, &a),
                        a.is_last(),
                    );
                }
            }
            return Ok(());
        }
        // A twin ahead of this worker commits what it makes: tickets taken now would be
        // spent on rows thrown away and come back only when this worker ends, after the
        // others may have finished on what they held.
        if lane.yielded {
            return Ok(());
        }
        if a.duplicates() > 0 {
            lane.yielded = true;
            tracing::info!(dataset = %lane.dataset, partition = partition.index, granted,
                "another worker of this partition commits rows this one made too: taking no more budget, finishing on what it holds");
            a.set(granted, true);
            return Ok(());
        }
        // Room for the next request with its margin, or a ticket of what the pool had last
        // seen.
        let need = a.next_need().max(a.demand() + floor);
        let want = (a.demand()
            + ticket_size(lane.ledger.pool(lane.budget), partition.count, floor).max(floor))
        .max(need);
        if granted >= want && !a.is_last() {
            return Ok(());
        }
        // A lane whose last request just ended looks at once: what it holds may be needed
        // elsewhere, or it may be the one to take the last of the pool.
        if a.idle() != lane.was_idle {
            lane.was_idle = a.idle();
            lane.quiet_until = None;
        }
        if lane
            .quiet_until
            .is_some_and(|t| std::time::Instant::now() < t)
        {
            return Ok(());
        }
        // The lane's gate is about to shut (or is shut and the pool may have refilled).
        lane.ledger.catch_up().await?;
        let pool = lane.ledger.pool(lane.budget);
        // Tokens completed past the allowance (requests in flight that ran long): paid
        // from the pool before anyone takes the last of it.
        let debt = a.completed().saturating_sub(granted);
        if pool > 0 && granted + pool >= need {
            let size = want
                .saturating_sub(granted)
                .max(ticket_size(pool, partition.count, floor))
                .min(pool);
            return self.take(i, size, false).await;
        }
        if pool > 0 && debt > 0 {
            return self.take(i, debt.min(pool), false).await;
        }
        // The pool cannot start another request here. With requests generating the lane
        // waits for them: they may leave room, or end it short.
        if !a.idle() {
            lane.back_off();
            return Ok(());
        }
        let (bucket, ds) = (self.bucket.clone(), lane.dataset.clone());
        // Idle and short of one more request: what it holds goes to the pool, where a
        // partition that can start a request with it, or the one that takes the last of
        // the pool, finds it. Gambled here instead, N partitions would each end one
        // size-biased request over the budget.
        if !a.is_last() {
            let mut log = self.log.lock().await;
            let tokens = granted.saturating_sub(a.completed()).min(unused(&log, &ds));
            if tokens > 0 {
                tracing::debug!(dataset = %ds, tokens, need, "short of one more request: holding budget in the job's pool");
                release(&mut log, &mut lane.ledger, &ds, &writer, tokens).await?;
                a.set(Agent::granted(&log, &ds, &writer, &a), false);
            }
        }
        if !lane.marked {
            let marker = serde_json::json!({ "state": "waiting", "debt": debt }).to_string();
            bucket
                .put(&waiting_key(&ds, partition.index), marker.into())
                .await?;
            lane.marked = true;
            lane.empty_since = Some(std::time::Instant::now());
        }
        // A dead partition's unused tickets come back before this one decides it is the
        // last: otherwise it could finish on what it holds while they are returned.
        let due = last_reclaim.is_none_or(|t| t.elapsed() >= RECLAIM_EVERY);
        if due {
            *last_reclaim = Some(std::time::Instant::now());
            let stale = self.stale_after;
            reclaim(&bucket, partition, &writer, &ds, &mut lane.ledger, stale).await?;
            if lane.ledger.pool(lane.budget) + a.granted() >= need {
                // Claimed on the next tick, as any refill is.
                return Ok(());
            }
        }
        // The last of the pool once no partition still running could start a request with
        // it or give some back (or after waiting long enough): taken whole by the first
        // partition to see it, which finishes on it; the others finish on what they hold.
        let waited = lane.empty_since.is_some_and(|t| t.elapsed() >= MAX_WAIT);
        if !a.is_last() {
            let marked = marked(&bucket, partition, &ds).await?;
            if waited || !others_may_return(&bucket, partition, &lane.ledger, &marked).await? {
                lane.ledger.catch_up().await?;
                // What waiting partitions ran past their allowance stays in the pool for
                // them.
                let owed = debts(&bucket, partition, &ds, &marked).await?;
                let pool = lane.ledger.pool(lane.budget).saturating_sub(owed);
                if pool > 0 {
                    return self.take(i, pool, true).await;
                }
                tracing::info!(dataset = %ds, granted = a.granted(), "the job's budget is all taken: this partition finishes on what it holds");
                a.set(a.granted(), true);
            }
        }
        self.lanes[i].back_off();
        Ok(())
    }

    /// Claims a ticket of `size` tokens for lane `i`, records it in the partition's log and
    /// grants it (`last`: it is the last of the pool, and the lane finishes on it).
    async fn take(&mut self, i: usize, size: u64, last: bool) -> Result<(), CommitError> {
        let (partition, writer) = (self.partition, self.writer.clone());
        let lane = &mut self.lanes[i];
        let a = lane.allowance.clone();
        let Some((ticket, tokens)) = lane
            .ledger
            .claim(lane.budget, partition, &writer, size)
            .await?
        else {
            return Ok(());
        };
        lane.backoff = Duration::ZERO;
        lane.quiet_until = None;
        lane.empty_since = None;
        // The last of the pool leaves the marker up: the others finish on what they hold.
        if lane.marked && !last {
            self.bucket
                .delete(&waiting_key(&lane.dataset, partition.index))
                .await?;
            lane.marked = false;
        }
        let mut log = self.log.lock().await;
        record_claim(&mut log, &lane.dataset, &writer, ticket, tokens).await?;
        let granted = Agent::granted(&log, &lane.dataset, &writer, &a);
        drop(log);
        tracing::debug!(dataset = %lane.dataset, ticket, tokens, granted, last,
            "budget ticket claimed");
        if last {
            tracing::info!(dataset = %lane.dataset, granted, "the job's budget is all taken: this partition takes the last of it and finishes on what it holds");
        }
        a.set(granted, last);
        Ok(())
    }

    /// At the end of a run: a lane past its allowance (policy "finish") takes what it used
    /// from the pool; each lane's unused allowance goes back to the pool, unless `twins`
    /// of this partition still run and this worker did not make every item of the lane's
    /// dataset (`made_all`) — what is unused is then what a twin may have in flight, and
    /// it settles the partition when it stops (true is returned: the done marker says
    /// so, and a twin that dies instead has it taken back as a dead partition's). Ask for
    /// the twins after this worker's presence says it stopped, so twins stopping together
    /// never both leave it to the other.
    pub async fn settle(
        &mut self,
        twins: &[String],
        made_all: &HashSet<String>,
    ) -> Result<bool, CommitError> {
        let (p, writer) = (self.partition, self.writer.clone());
        let mut left = false;
        let mut log = self.log.lock().await;
        log.catch_up().await?;
        for lane in &mut self.lanes {
            lane.ledger.catch_up().await?;
            let d = log.dataset(&lane.dataset);
            let (allowance, spent) = (d.allowance(), d.tokens);
            drop(d);
            if spent > allowance {
                let want = spent - allowance;
                if let Some((ticket, tokens)) =
                    lane.ledger.claim(lane.budget, p, &writer, want).await?
                {
                    record_claim(&mut log, &lane.dataset, &writer, ticket, tokens).await?;
                }
            }
            // Every item made and committed: a twin can only make duplicates.
            if !twins.is_empty() && !made_all.contains(&lane.dataset) {
                left = true;
                tracing::info!(dataset = %lane.dataset, twins = ?twins, unused = allowance.saturating_sub(spent),
                    "another worker of this partition still runs: leaving it the partition's unused budget to settle");
                continue;
            }
            if allowance > spent {
                tracing::info!(dataset = %lane.dataset, tokens = allowance - spent,
                    "giving unused budget back to the job's pool");
                release(
                    &mut log,
                    &mut lane.ledger,
                    &lane.dataset,
                    &writer,
                    allowance - spent,
                )
                .await?;
            }
            // Stopped: it gives nothing more back, so no one waits for it.
            self.bucket
                .put(&waiting_key(&lane.dataset, p.index), "stopped".into())
                .await?;
        }
        Ok(left)
    }

    /// Brings each lane's allowance in step with the partition's log (a twin's commits and
    /// claims, a release someone wrote for this partition).
    pub async fn refresh(&self) {
        let log = self.log.lock().await;
        for lane in &self.lanes {
            let granted = Agent::granted(&log, &lane.dataset, &self.writer, &lane.allowance);
            lane.allowance.set(granted, lane.allowance.is_last());
        }
    }
}

/// Takes back the unused allowance of `dataset` from every partition but `me` whose worker
/// shows no heartbeat for `stale_after` and that is not done: a release in its log (so a
/// worker that was only slow sees it before it commits again), then returned to the pool.
pub(super) async fn reclaim(
    bucket: &Arc<Bucket>,
    me: Partition,
    writer: &str,
    dataset: &str,
    ledger: &mut BudgetLog,
    stale_after: Duration,
) -> Result<(), CommitError> {
    let now = crate::cluster::job::now_unix();
    for index in (0..me.count).filter(|&i| i != me.index) {
        if ledger.claims_of(index).is_empty() {
            continue;
        }
        let p = Partition {
            index,
            count: me.count,
        };
        // A done partition gave back what it did not use, unless it left it to a twin.
        if commits::read_done(bucket, p)
            .await?
            .is_some_and(|d| !d.twin_settles)
        {
            continue;
        }
        let heartbeat = crate::cluster::heartbeat::read(bucket, p)
            .await
            .ok()
            .flatten()
            .map_or(0, |s| s.heartbeat_unix);
        if now.saturating_sub(heartbeat) < stale_after.as_secs() {
            continue;
        }
        let mut log = CommitLog::load(bucket.clone(), p, commits::LoadOptions::READER).await?;
        if log.sealed().is_some() {
            continue;
        }
        let tokens = unused(&log, dataset);
        if tokens == 0 {
            continue;
        }
        tracing::warn!(
            dataset,
            partition = index,
            tokens,
            heartbeat_age_s = now.saturating_sub(heartbeat),
            "taking back the unused budget of a partition whose worker shows no heartbeat"
        );
        release(&mut log, ledger, dataset, writer, tokens).await?;
    }
    Ok(())
}
