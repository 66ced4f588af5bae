//! The simulated GPU: one ticker task hands out tokens to every request in flight, the
//! way a continuous-batching server advances its whole batch each step.
//!
//! Invariants:
//! - Over any tick the tokens granted sum to at most `capacity_tps × dt × time_scale`, and
//!   no request gets more than `per_request_tps × dt × time_scale` (fractions carry over).
//! - A request joining mid-tick is only credited from the moment it joined.
//! - A slot leaves the batch as soon as it is done, aborted, or its [`Job`] is dropped
//!   (client gone), so capacity is never spent on nobody.
//! - The ticker parks on a `Notify` while the batch is empty: an idle mock burns no CPU.
//! - With a KV model ([`Engine::with_kv`]) the slots only carry progress to the handlers:
//!   who runs, and how fast, is the [`KvBatch`]'s, advanced by the real time since the last
//!   tick times `time_scale`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::kv::{KvBatch, KvGauges, KvParams, KvStats};
use super::sim::{grant, per_request_rate};
use super::Counters;

/// Real time between two scheduler steps.
const TICK: Duration = Duration::from_millis(5);

/// Where a job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobState {
    Running,
    Done,
    /// Cancelled through `/abort_request`.
    Aborted,
    /// The server is shutting down: the connection is to be cut.
    Shutdown,
}

/// Tokens produced so far and the state: what a handler waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Progress {
    pub produced: u32,
    pub state: JobState,
}

struct Slot {
    total: u32,
    produced: u32,
    carry: f64,
    /// Last instant this slot was credited up to.
    last: Instant,
    rid: Option<String>,
    tx: watch::Sender<Progress>,
}

#[derive(Default)]
struct Inner {
    slots: HashMap<u64, Slot>,
    next_id: u64,
    ticker_running: bool,
    shutdown: bool,
    /// The KV-cache model, when the server has one.
    kv: Option<KvBatch>,
    /// When the KV model was last advanced (`None` after an idle spell: no time banked).
    last_tick: Option<Instant>,
}

/// The batch and its rates.
pub(crate) struct Engine {
    inner: Mutex<Inner>,
    wake: Notify,
    capacity_tps: f64,
    per_request_tps: f64,
    time_scale: f64,
    counters: Arc<Counters>,
    /// Every request is done as it joins (`--instant`): no batch, no ticker.
    pub(crate) instant: bool,
}

/// A handler's ticket for one generation; dropping it takes the request out of the batch.
pub(crate) struct Job {
    id: Option<u64>,
    rx: watch::Receiver<Progress>,
    engine: Arc<Engine>,
}

impl Job {
    /// The latest progress, without waiting.
    pub(crate) fn current(&mut self) -> Progress {
        *self.rx.borrow_and_update()
    }

    /// Waits for the next change. A vanished sender (cannot happen while the slot lives,
    /// since the final state is always sent first) reads as a shutdown.
    pub(crate) async fn next(&mut self) -> Progress {
        match self.rx.changed().await {
            Ok(()) => *self.rx.borrow_and_update(),
            Err(_) => Progress {
                produced: self.rx.borrow().produced,
                state: JobState::Shutdown,
            },
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.engine.remove(id);
        }
    }
}

/// Locks, ignoring poison: every critical section leaves `Inner` consistent before any
/// operation that could panic, so a poisoned lock still guards valid data.
fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Engine {
    pub(crate) fn new(
        capacity_tps: f64,
        per_request_tps: f64,
        time_scale: f64,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            capacity_tps,
            per_request_tps,
            time_scale,
            counters,
            instant: false,
        }
    }

    /// The server has a KV cache: admission, preemption and step costs as [`KvBatch`] says.
    pub(crate) fn with_kv(self, p: KvParams) -> Self {
        lock(&self.inner).kv = Some(KvBatch::new(p));
        self
    }

    /// Joins the batch with `total` tokens to produce after `prompt`. Must run inside a
    /// Tokio runtime (the ticker is spawned on first use).
    pub(crate) fn submit(self: &Arc<Self>, prompt: &[u32], total: u32, rid: Option<String>) -> Job {
        let job = self.insert(prompt, total, rid, Instant::now());
        if job.id.is_some() {
            let spawn = {
                let mut g = lock(&self.inner);
                !std::mem::replace(&mut g.ticker_running, true)
            };
            if spawn {
                tokio::spawn(Arc::clone(self).run_ticker());
            }
            self.wake.notify_one();
        }
        job
    }

    /// Adds a slot credited from `now` (no ticker involved: tests drive `tick` by hand).
    fn insert(
        self: &Arc<Self>,
        prompt: &[u32],
        total: u32,
        rid: Option<String>,
        now: Instant,
    ) -> Job {
        let mut g = lock(&self.inner);
        let terminal = if g.shutdown {
            Some(JobState::Shutdown)
        } else if total == 0 {
            Some(JobState::Done)
        } else {
            None
        };
        if terminal.is_none() && self.instant {
            drop(g);
            self.counters.add_tokens(u64::from(total));
            let (_tx, rx) = watch::channel(Progress {
                produced: total,
                state: JobState::Done,
            });
            return Job {
                id: None,
                rx,
                engine: Arc::clone(self),
            };
        }
        if let Some(state) = terminal {
            let (_tx, rx) = watch::channel(Progress { produced: 0, state });
            return Job {
                id: None,
                rx,
                engine: Arc::clone(self),
            };
        }
        let (tx, rx) = watch::channel(Progress {
            produced: 0,
            state: JobState::Running,
        });
        let id = g.next_id;
        g.next_id += 1;
        if let Some(kv) = &mut g.kv {
            kv.add(id, prompt, total);
        }
        g.slots.insert(
            id,
            Slot {
                total,
                produced: 0,
                carry: 0.0,
                last: now,
                rid,
                tx,
            },
        );
        drop(g);
        self.counters.bump();
        Job {
            id: Some(id),
            rx,
            engine: Arc::clone(self),
        }
    }

    /// Ends every running job whose rid is `rid` with [`JobState::Aborted`]; returns how many.
    pub(crate) fn abort_rid(&self, rid: &str) -> usize {
        self.finish_where(JobState::Aborted, |s| s.rid.as_deref() == Some(rid))
    }

    /// Ends every running job with [`JobState::Aborted`].
    pub(crate) fn abort_all(&self) -> usize {
        self.finish_where(JobState::Aborted, |_| true)
    }

    /// Ends every job with [`JobState::Shutdown`], refuses new ones, stops the ticker.
    pub(crate) fn shutdown(&self) {
        lock(&self.inner).shutdown = true;
        self.finish_where(JobState::Shutdown, |_| true);
        self.wake.notify_one();
    }

    /// Requests currently in the batch (with a KV model: running, not queued).
    pub(crate) fn active(&self) -> usize {
        let g = lock(&self.inner);
        match &g.kv {
            Some(kv) => kv.gauges().running,
            None => g.slots.len(),
        }
    }

    /// The KV model's counters and gauges, if the server has one.
    pub(crate) fn kv_state(&self) -> Option<(KvStats, KvGauges)> {
        lock(&self.inner)
            .kv
            .as_ref()
            .map(|kv| (kv.stats(), kv.gauges()))
    }

    /// Changes the KV model's speed (1 normal, 0.5 half as fast) and capacity at run time.
    pub(crate) fn set_kv(&self, speed: Option<f64>, capacity: Option<u64>) {
        if let Some(kv) = &mut lock(&self.inner).kv {
            if let Some(s) = speed {
                kv.set_speed(s);
            }
            if let Some(c) = capacity {
                kv.set_capacity(c);
            }
        }
    }

    fn finish_where(&self, state: JobState, pred: impl Fn(&Slot) -> bool) -> usize {
        let mut g = lock(&self.inner);
        let ids: Vec<u64> = g
            .slots
            .iter()
            .filter(|(_, s)| pred(s))
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some(kv) = &mut g.kv {
                kv.remove(*id);
            }
            if let Some(s) = g.slots.remove(id) {
                s.tx.send_replace(Progress {
                    produced: s.produced,
                    state,
                });
            }
        }
        drop(g);
        if !ids.is_empty() {
            self.counters.bump();
        }
        ids.len()
    }

    fn remove(&self, id: u64) {
        let mut g = lock(&self.inner);
        if let Some(kv) = &mut g.kv {
            kv.remove(id);
        }
        let removed = g.slots.remove(&id).is_some();
        drop(g);
        if removed {
            self.counters.bump();
        }
    }

    async fn run_ticker(self: Arc<Self>) {
        loop {
            // Park while idle. `notify_one` stores a permit when nobody waits, so a submit
            // racing with this check is never missed.
            loop {
                {
                    let mut g = lock(&self.inner);
                    if g.shutdown {
                        return;
                    }
                    if !g.slots.is_empty() {
                        break;
                    }
                    g.last_tick = None;
                }
                self.wake.notified().await;
            }
            tokio::time::sleep(TICK).await;
            self.tick(Instant::now());
        }
    }

    /// One scheduler step: credit every slot for the time since it was last credited.
    fn tick(&self, now: Instant) {
        let mut g = lock(&self.inner);
        if g.kv.is_some() {
            return self.tick_kv(g, now);
        }
        let rate = per_request_rate(
            self.capacity_tps,
            self.per_request_tps,
            g.slots.len(),
            self.time_scale,
        );
        let mut generated = 0u64;
        let mut finished = Vec::new();
        for (id, s) in g.slots.iter_mut() {
            let dt = now.saturating_duration_since(s.last).as_secs_f64();
            s.last = now;
            let (k, carry) = grant(rate, dt, s.carry, s.total - s.produced);
            s.carry = carry;
            if k == 0 {
                continue;
            }
            s.produced += k;
            generated += u64::from(k);
            let state = if s.produced >= s.total {
                finished.push(*id);
                JobState::Done
            } else {
                JobState::Running
            };
            s.tx.send_replace(Progress {
                produced: s.produced,
                state,
            });
        }
        for id in &finished {
            g.slots.remove(id);
        }
        drop(g);
        if generated > 0 {
            self.counters.add_tokens(generated);
        }
    }

    /// A tick of the KV model: the real time since the last one, scaled, runs its steps.
    fn tick_kv(&self, mut g: MutexGuard<'_, Inner>, now: Instant) {
        let dt = g
            .last_tick
            .map_or(TICK, |t| now.saturating_duration_since(t))
            .as_secs_f64();
        g.last_tick = Some(now);
        let g = &mut *g;
        let Some(kv) = &mut g.kv else {
            return;
        };
        let mut generated = 0u64;
        for u in kv.advance(dt * self.time_scale) {
            let Some(s) = g.slots.get_mut(&u.id) else {
                continue;
            };
            generated += u64::from(u.produced.saturating_sub(s.produced));
            s.produced = u.produced;
            let state = if u.done {
                JobState::Done
            } else {
                JobState::Running
            };
            s.tx.send_replace(Progress {
                produced: s.produced,
                state,
            });
            if u.done {
                g.slots.remove(&u.id);
            }
        }
        if generated > 0 {
            self.counters.add_tokens(generated);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(cap: f64, per: f64, scale: f64) -> Arc<Engine> {
        Arc::new(Engine::new(cap, per, scale, Arc::new(Counters::new())))
    }

    /// Ticks by hand every 5 ms of synthetic time until no slot is left; returns the
    /// synthetic seconds it took.
    fn drain(e: &Engine, t0: Instant) -> f64 {
        let mut now = t0;
        while e.active() > 0 {
            now += TICK;
            e.tick(now);
        }
        (now - t0).as_secs_f64()
    }

    /// Requests in flight together share the aggregate capacity: four of 100 tokens at
    /// 1000 tok/s take 400 ms, and every token is counted.
    #[test]
    fn concurrent_jobs_share_capacity() {
        // 4 jobs × 100 tokens at 1000 tok/s aggregate (per-request cap not binding): 400 ms.
        let e = engine(1000.0, 1000.0, 1.0);
        let t0 = Instant::now();
        let mut jobs: Vec<Job> = (0..4).map(|_| e.insert(&[], 100, None, t0)).collect();
        let took = drain(&e, t0);
        assert!((0.399..0.411).contains(&took), "took {took}");
        for j in &mut jobs {
            assert_eq!(
                j.current(),
                Progress {
                    produced: 100,
                    state: JobState::Done
                }
            );
        }
        assert_eq!(e.counters.snapshot_tokens(), 400);
    }

    /// A lone request goes no faster than the per-request ceiling, times the time scale.
    #[test]
    fn single_job_is_capped_per_request_and_time_scaled() {
        // 50 tok/s per request × 10 = 500 tok/s: 100 tokens in 200 ms.
        let e = engine(1000.0, 50.0, 10.0);
        let t0 = Instant::now();
        let _job = e.insert(&[], 100, None, t0);
        let took = drain(&e, t0);
        assert!((0.199..0.206).contains(&took), "took {took}");
    }

    /// A request that joins between ticks is credited only from when it joined.
    #[test]
    fn late_joiner_is_credited_from_its_arrival_only() {
        let e = engine(1000.0, 1000.0, 1.0);
        let t0 = Instant::now();
        let mut a = e.insert(&[], 1000, None, t0);
        let mut b = e.insert(&[], 1000, None, t0 + Duration::from_millis(4));
        e.tick(t0 + TICK);
        // Two in flight: 500 tok/s each; a had 5 ms (2.5 tokens), b 1 ms (0.5 tokens).
        assert_eq!(a.current().produced, 2);
        assert_eq!(b.current().produced, 0);
    }

    /// A submitted request is driven to the end by the ticker alone, then leaves the batch.
    #[tokio::test]
    async fn submitted_jobs_run_to_completion_on_the_ticker() {
        let e = engine(1e6, 1e6, 1.0);
        let mut job = e.submit(&[], 50, None);
        let mut p = job.current();
        while p.state == JobState::Running {
            p = job.next().await;
        }
        assert_eq!(p.produced, 50);
        assert_eq!(e.active(), 0);
    }

    /// `--instant`: a request is done with all its tokens the moment it joins, without a
    /// ticker or a batch, and its tokens are counted.
    #[test]
    fn an_instant_engine_answers_at_once() {
        let counters = Arc::new(Counters::new());
        let mut e = Engine::new(850.0, 60.0, 1.0, counters.clone());
        e.instant = true;
        let e = Arc::new(e);
        let mut job = e.insert(&[], 70, None, Instant::now());
        assert_eq!(
            job.current(),
            Progress {
                produced: 70,
                state: JobState::Done
            }
        );
        assert_eq!(e.active(), 0);
        assert!(!lock(&e.inner).ticker_running);
        assert_eq!(
            counters.tokens.load(std::sync::atomic::Ordering::Relaxed),
            70
        );
    }

    /// An abort by rid, a dropped job and a shutdown each take requests out of the batch; after
    /// shutdown every new request ends at once as shut down (a zero-token one on a live engine
    /// is simply done).
    #[test]
    fn abort_drop_and_shutdown_leave_the_batch() {
        let e = engine(100.0, 100.0, 1.0);
        let t0 = Instant::now();
        let mut a = e.insert(&[], 1000, Some("r1".into()), t0);
        let b = e.insert(&[], 1000, None, t0);
        assert_eq!(e.active(), 2);
        assert_eq!(e.abort_rid("r1"), 1);
        assert_eq!(a.current().state, JobState::Aborted);
        drop(b);
        assert_eq!(e.active(), 0);
        let mut c = e.insert(&[], 1000, None, t0);
        e.shutdown();
        assert_eq!(c.current().state, JobState::Shutdown);
        let mut d = e.insert(&[], 10, None, t0);
        assert_eq!(d.current().state, JobState::Shutdown);
        let mut z = e.insert(&[], 0, None, t0);
        assert_eq!(z.current().state, JobState::Shutdown);
        let mut z = engine(1.0, 1.0, 1.0).insert(&[], 0, None, t0);
        assert_eq!(z.current().state, JobState::Done);
    }
}
