//! `concurrency = "auto"`: each server's own limit on requests in flight, moved once a
//! second by what the server shows.
//!
//! A continuous-batching server's throughput rises with the requests it runs up to a knee:
//! the batch stops getting cheaper per token (compute-bound), or the KV cache is full and
//! further requests queue, or worse are admitted and then preempted and recomputed as the
//! running ones grow. Past the knee more concurrency buys nothing and costs latency,
//! preemptions and, under `budget_policy = "cancel"`, tokens thrown away.
//!
//! The [`Controller`] of one server:
//! - **Server signals first** (its `/metrics`, when it exports vLLM's or SGLang's gauges):
//!   slow start doubles no further than the KV usage allows and ends at the first
//!   preemption; preemptions that outnumber completions over a few seconds, or twice over
//!   in one (thrashing), cut the limit to 85 % of what is in flight, once per cut (the
//!   next cut waits until the last has taken effect: requests in flight only leave as they
//!   end, and preemptions until then are the last level's); while the server preempts
//!   more than once per two completions, or a probe up bought nothing, probes alternate
//!   down and up; a queue at the server two seconds running brings the limit down to
//!   what it runs plus a quarter when its cache is full (requests to admit as running ones
//!   end), plus 3 % when not.
//! - **Then throughput** (tokens/s from this server): slow start doubles the limit each
//!   settled interval while throughput follows (elasticity `d ln T / d ln n` ≥ 0.5), ends
//!   a tenth past where linear growth from the last level would have met the throughput
//!   of the first level that did not follow (the knee of a roofline), then steady probes
//!   of +10 % every few seconds, judged on three seconds against the level's average, are
//!   kept only if throughput follows by at least a quarter of the step (else the limit
//!   goes back), so the limit stays near the knee. A throughput that falls 20 % at the
//!   same limit (a server thrashing without saying so) triggers a probe down of 10 %, kept
//!   while throughput does not follow it down (gradient, as Envoy's adaptive concurrency and Netflix's concurrency-limits do
//!   with latency; here throughput is what the job is after).
//! - The limit grows only while it is binding (the client filled it), never passes
//!   `max_concurrency`, and never goes below 1: a server is never starved to zero.
//!
//! Invariants: the controller is pure (no clock, no I/O): it sees [`Sample`]s, so tests
//! script a server's answers; `limit()` is always in `1..=max`.

use crate::run::servers::Servers;
use crate::upstream::{Upstream, UpstreamError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// What a server's `/metrics` says (vLLM's or SGLang's names).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Signals {
    /// Requests in the server's batch.
    pub running: f64,
    /// Requests queued at the server.
    pub waiting: f64,
    /// KV cache in use, 0–1 (absent if the server does not say).
    pub kv_usage: Option<f64>,
    /// Preemptions (or retractions) since the server started: a counter.
    pub preemptions: Option<f64>,
}

/// One second of one server.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sample {
    /// Seconds since the last sample.
    pub dt: f64,
    /// Attempts in flight to the server now.
    pub inflight: f64,
    /// Tokens received from the server over `dt`.
    pub tokens: f64,
    /// Requests it completed over `dt`.
    pub completions: f64,
    /// Its `/metrics`, if it exports them.
    pub signals: Option<Signals>,
}

/// Limit at start (doubled by slow start from there).
pub(crate) const START_LIMIT: usize = 8;
const START: f64 = START_LIMIT as f64;
/// Multiplicative cut on a preemption.
const CUT: f64 = 0.85;
/// Elasticity that keeps slow start doubling.
const SLOW_START_GAIN: f64 = 0.5;
/// Elasticity a steady probe up must show to be kept.
const PROBE_GAIN: f64 = 0.25;
/// Intervals between steady probes.
const PROBE_EVERY: u32 = 5;
/// KV usage slow start aims at, at most.
const KV_TARGET: f64 = 0.95;
/// Preemptions per completed request past which the server thrashes.
const THRASH: f64 = 1.0;
/// Requests waiting at a server whose KV cache is full, as a share of those it runs, that
/// the limit allows…
const QUEUE_FULL: f64 = 0.25;
/// …and at a server capped by its batch size.
const QUEUE_CAPPED: f64 = 0.03;
/// Preemptions per completion (averaged) past which probes go down as well as up.
const PROBE_DOWN_PREEMPTIONS: f64 = 0.5;
/// Intervals over which preemptions are weighed against completions.
const THRASH_OVER: usize = 3;
/// Intervals a preemption's level caps the probes.
const CEILING_KEPT: u32 = 60;
/// KV usage under which a server cut by its signals is taken to have room again…
const KV_ROOMY: f64 = 0.5;
/// …for this many intervals running.
const ROOMY_FOR: u32 = 5;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    SlowStart,
    Steady,
}

/// A probe in progress: the level it started from and the throughput there, and the
/// intervals it has waited for in-flight to reach its new limit.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Probe {
    from_limit: f64,
    from_n: f64,
    from_tps: f64,
    waited: u32,
    /// In steady state, the intervals seen at the new level and their sums of in-flight
    /// and throughput: a verdict on one noisy second would keep a level by chance.
    seen: u32,
    sum_n: f64,
    sum_tps: f64,
}

/// Intervals a steady probe is judged over.
const JUDGE_OVER: u32 = 3;

/// Intervals a probe waits for in-flight to reach its limit before it is judged anyway.
const PROBE_WAIT: u32 = 20;

/// One server's limit.
#[derive(Debug, Clone)]
pub struct Controller {
    limit: f64,
    max: f64,
    phase: Phase,
    /// Intervals to wait before judging (a change takes an interval to show).
    settle: u32,
    /// Intervals until the next steady probe.
    next_probe: u32,
    probe: Option<Probe>,
    /// Throughput at the current limit (moving average), for detecting a fall.
    level_tps: Option<f64>,
    last_preemptions: Option<f64>,
    /// Preemptions and completions of the last [`THRASH_OVER`] intervals.
    recent: std::collections::VecDeque<(f64, f64)>,
    /// Preemptions and completions per interval, averaged over the last ten or so.
    preempt_avg: (f64, f64),
    /// The last probe up bought nothing: past the knee, so preemptions here are not the
    /// price of throughput and a probe down may shed them.
    flat_above: bool,
    queue_streak: u32,
    /// In-flight the last cut aimed at: the next cut waits until in-flight is down there.
    cut_to: Option<f64>,
    /// In-flight at the last preemption, and intervals since: probes stay under it for a
    /// minute (so the limit does not preempt again and again), then may try past it.
    ceiling: Option<(f64, u32)>,
    /// The limit was last cut by the server's signals (not by its throughput): once the
    /// server shows plenty of room for a while, slow start begins again (it recovered).
    cut_by_signal: bool,
    /// Intervals running in which the server showed plenty of room.
    roomy: u32,
    /// The server's last KV usage: slow start's doubling is capped where it would pass
    /// [`KV_TARGET`] (usage grows about in step with the requests running).
    kv: Option<f64>,
    /// Requests the server runs, averaged over the last seconds: what a full cache holds
    /// moves with the lengths of the requests in it.
    running: Option<f64>,
    /// Intervals since the server last reported a preemption.
    since_preemption: u32,
    /// While it preempts, probes alternate down and up (throughput decides which stays).
    down_next: bool,
    /// Why the limit last moved (for logs and tests).
    reason: &'static str,
}

impl Controller {
    /// A server's controller with limit at most `max` (≥ 1).
    pub fn new(max: usize) -> Self {
        let max = max.max(1) as f64;
        Self {
            limit: START.min(max),
            max,
            phase: Phase::SlowStart,
            settle: 1,
            next_probe: PROBE_EVERY,
            probe: None,
            level_tps: None,
            last_preemptions: None,
            recent: std::collections::VecDeque::new(),
            preempt_avg: (0.0, 0.0),
            flat_above: false,
            queue_streak: 0,
            cut_to: None,
            ceiling: None,
            cut_by_signal: false,
            roomy: 0,
            kv: None,
            running: None,
            since_preemption: u32::MAX,
            down_next: true,
            reason: "start",
        }
    }

    /// The limit now: requests this server may have in flight.
    pub fn limit(&self) -> usize {
        self.limit.round().clamp(1.0, self.max) as usize
    }

    /// Why the limit last moved.
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    fn set(&mut self, limit: f64, reason: &'static str) {
        let limit = limit.clamp(1.0, self.max);
        if limit < self.limit - 0.5 {
            // Preemptions go on while in-flight comes down to a lower limit: they are the
            // last level's, not this one's, until it is there.
            self.cut_to = Some(limit);
        }
        self.limit = limit;
        self.reason = reason;
        self.level_tps = None;
    }

    /// A server back in rotation starts again from half its limit, in slow start.
    pub fn restart(&mut self) {
        let l = (self.limit / 2.0).max(START.min(self.max));
        self.set(l, "back in rotation");
        self.phase = Phase::SlowStart;
        self.probe = None;
        self.settle = 1;
        self.cut_to = None;
    }

    /// One interval's observation; returns the new limit.
    pub fn observe(&mut self, s: &Sample) -> usize {
        if s.dt <= 0.0 {
            return self.limit();
        }
        let tps = s.tokens.max(0.0) / s.dt;
        let n = s.inflight.max(0.0);
        if let Some(to) = self.cut_to {
            if n <= to + 0.5 {
                // The cut has taken effect: preemptions from here on are its level's.
                self.cut_to = None;
                self.recent.clear();
            }
        }
        self.ceiling = self
            .ceiling
            .map(|(c, age)| (c, age + 1))
            .filter(|(_, age)| *age <= CEILING_KEPT);
        if let Some(sig) = s.signals {
            if self.server_says(&sig, n, s.completions) {
                return self.limit();
            }
        }
        if self.settle > 0 {
            self.settle -= 1;
            return self.limit();
        }
        let binding = n + 1.0 >= 0.9 * self.limit;
        match self.probe.take() {
            // In-flight moves down only as requests end: judge once it is there.
            Some(mut p)
                if self.limit < p.from_limit && n > self.limit + 1.0 && p.waited < PROBE_WAIT =>
            {
                p.waited += 1;
                self.probe = Some(p);
            }
            Some(mut p) if self.phase == Phase::Steady && p.seen + 1 < JUDGE_OVER => {
                p.seen += 1;
                p.sum_n += n;
                p.sum_tps += tps;
                self.probe = Some(p);
            }
            Some(p) if self.phase == Phase::Steady => {
                let k = f64::from(p.seen + 1);
                self.judge(p, (p.sum_n + n) / k, (p.sum_tps + tps) / k);
            }
            Some(p) => self.judge(p, n, tps),
            None if !binding => {}
            None => self.grow_or_watch(n, tps),
        }
        self.limit()
    }

    /// Applies the server's own signals; true when they decided this interval.
    fn server_says(&mut self, sig: &Signals, n: f64, completions: f64) -> bool {
        let preempted_n = match (sig.preemptions, self.last_preemptions) {
            (Some(now), Some(before)) => (now - before).max(0.0),
            _ => 0.0,
        };
        let preempted = preempted_n > 0.0;
        self.since_preemption = if preempted {
            0
        } else {
            self.since_preemption.saturating_add(1)
        };
        // Thrashing: more preemptions than completions (each costs a recomputation).
        // Over a few intervals (a burst of preemptions at the cache's edge is not a
        // thrash), or at once when one interval is twice over.
        self.preempt_avg = (
            0.9 * self.preempt_avg.0 + 0.1 * preempted_n,
            0.9 * self.preempt_avg.1 + 0.1 * completions.max(0.0),
        );
        self.recent.push_back((preempted_n, completions.max(0.0)));
        if self.recent.len() > THRASH_OVER {
            self.recent.pop_front();
        }
        let (p_sum, c_sum) = self
            .recent
            .iter()
            .fold((0.0, 0.0), |(p, c), (dp, dc)| (p + dp, c + dc));
        let thrashing = preempted_n > 2.0 * THRASH * completions.max(1.0)
            || (preempted && self.recent.len() >= THRASH_OVER && p_sum > THRASH * c_sum.max(1.0));
        if let Some(p) = sig.preemptions {
            self.last_preemptions = Some(p);
        }
        self.kv = sig.kv_usage;
        let running = match self.running {
            Some(r) => 0.8 * r + 0.2 * sig.running,
            None => sig.running,
        };
        self.running = Some(running);
        // A request waits a step or two before a server admits it: only a queue that a
        // full cache holds back, or one too long to be arrivals, is a queue.
        let full = sig.kv_usage.is_some_and(|u| u >= 0.8);
        let queued = sig.waiting >= 1.0 && (full || sig.waiting >= 0.1 * sig.running + 2.0);
        self.queue_streak = if queued { self.queue_streak + 1 } else { 0 };
        let roomy = !preempted && !queued && sig.kv_usage.is_some_and(|u| u < KV_ROOMY);
        self.roomy = if roomy { self.roomy + 1 } else { 0 };
        if self.roomy >= ROOMY_FOR && self.cut_by_signal && self.cut_to.is_none() {
            self.cut_by_signal = false;
            self.ceiling = None;
            self.phase = Phase::SlowStart;
            self.probe = None;
            self.reason = "server has room again";
        }
        if preempted && !thrashing && self.phase == Phase::SlowStart {
            // At the KV cache's edge: slow start ends here; throughput decides the rest.
            self.phase = Phase::Steady;
            self.probe = None;
            self.next_probe = PROBE_EVERY;
            self.reason = "knee (preemptions)";
        }
        if thrashing {
            self.cut_by_signal = true;
            self.ceiling = Some((n.max(1.0), 0));
            if self.cut_to.is_none() {
                let to = (self.limit.min(n.max(1.0)) * CUT).floor();
                self.set(to, "preemptions");
                self.recent.clear();
                self.cut_to = Some(self.limit);
                self.phase = Phase::Steady;
                self.probe = None;
                self.settle = 2;
                self.next_probe = PROBE_EVERY * 2;
            }
            return true;
        }
        if self.queue_streak >= 2 && self.cut_to.is_none() {
            // A full cache admits from the queue as the requests it runs end: a quarter
            // of what it runs, waiting, keeps it fed. A server capped by its batch size
            // (room in its cache) gains nothing from a queue.
            let (base, headroom) = if full {
                (running.max(sig.running), QUEUE_FULL)
            } else {
                (sig.running, QUEUE_CAPPED)
            };
            let to = base + (headroom * base).ceil().max(1.0);
            if to < self.limit {
                self.cut_by_signal = true;
                self.set(to, "server queue");
                self.cut_to = Some(self.limit);
                self.phase = Phase::Steady;
                self.probe = None;
                self.settle = 2;
                self.next_probe = PROBE_EVERY;
                return true;
            }
        }
        // A queue forming (or a burst being admitted): wait a second before judging.
        self.queue_streak > 0
    }

    /// A probe's verdict: keep the new level if throughput followed the step enough.
    fn judge(&mut self, p: Probe, n: f64, tps: f64) {
        let e = elasticity(p.from_n, p.from_tps, n, tps);
        match self.phase {
            Phase::SlowStart if e.is_some_and(|e| e >= SLOW_START_GAIN) => {
                self.probe_up(n, tps, 2.0, "slow start");
            }
            Phase::SlowStart => {
                // The knee is between the two levels: where growing linearly from the lower
                // would have reached the upper's throughput, plus a tenth.
                self.phase = Phase::Steady;
                self.next_probe = PROBE_EVERY;
                let knee = if p.from_tps > 0.0 && tps > 0.0 {
                    p.from_n * tps / p.from_tps
                } else {
                    self.limit
                };
                let (lo, hi) = (p.from_limit.min(self.limit), p.from_limit.max(self.limit));
                let to = (1.1 * knee).ceil().max(lo).min(hi);
                self.set(to, "knee");
                self.settle = 1;
            }
            Phase::Steady => {
                let down = self.limit < p.from_limit;
                self.next_probe = PROBE_EVERY;
                self.flat_above = !down && !e.is_some_and(|e| e >= PROBE_GAIN);
                match e {
                    Some(e) if !down && e >= PROBE_GAIN => self.reason = "probe up kept",
                    // Down and throughput did not follow it: keep, and go on while free.
                    Some(e) if down && e < 0.5 => {
                        self.reason = "probe down kept";
                        if e < 0.1 {
                            self.probe_up(n, tps, 0.9, "probe down");
                        }
                    }
                    Some(_) => {
                        self.set(p.from_limit, "probe reverted");
                        self.settle = 1;
                    }
                    None if down => self.reason = "probe down inconclusive",
                    None => {
                        self.set(p.from_limit, "probe up inconclusive");
                        self.settle = 1;
                    }
                }
            }
        }
    }

    fn grow_or_watch(&mut self, n: f64, tps: f64) {
        match self.phase {
            Phase::SlowStart => self.probe_up(n, tps, 2.0, "slow start"),
            Phase::Steady => {
                let fell = self.level_tps.is_some_and(|l| tps < 0.8 * l);
                self.level_tps = Some(match self.level_tps {
                    Some(l) => 0.7 * l + 0.3 * tps,
                    None => tps,
                });
                if fell {
                    // Judged against the fallen throughput, not the level before.
                    self.level_tps = None;
                    self.probe_up(n, tps, 0.9, "probe down");
                    return;
                }
                self.next_probe = self.next_probe.saturating_sub(1);
                // A server at its cache's edge preempts a little at its best level: a
                // probe down there only costs throughput, unless more bought nothing.
                let (p, c) = self.preempt_avg;
                let preempting = self.since_preemption < 2 * PROBE_EVERY
                    && (p > PROBE_DOWN_PREEMPTIONS * c.max(1.0) || self.flat_above);
                if self.next_probe == 0 && preempting && self.down_next {
                    // Preempting at this level: see whether less costs throughput (and
                    // next time whether more still buys some).
                    self.down_next = false;
                    self.probe_up(n, tps, 0.9, "probe down (preemptions)");
                } else if self.next_probe == 0 && self.limit < self.max {
                    self.down_next = true;
                    self.probe_up(n, tps, 1.1, "probe up");
                }
            }
        }
    }

    /// Moves the limit by `factor` (at least one request) and remembers where it was.
    fn probe_up(&mut self, n: f64, tps: f64, factor: f64, reason: &'static str) {
        let from = self.limit;
        let to = if factor >= 1.0 {
            let factor = match self.kv {
                Some(u) if u > 0.05 && self.phase == Phase::SlowStart => {
                    factor.min((KV_TARGET / u).max(1.1))
                }
                _ => factor,
            };
            if factor <= 1.0 {
                return;
            }
            let up = (from * factor).max(from + 1.0);
            let up = match self.ceiling {
                Some((c, _)) => up.min((c * 0.97).floor()),
                None => up,
            };
            if up <= from {
                return;
            }
            up
        } else {
            (from * factor).min(from - 1.0)
        };
        let to = to.clamp(1.0, self.max);
        if (to - from).abs() < 0.5 {
            return;
        }
        // In steady state the level's average, not its last second.
        let from_tps = match (self.phase, self.level_tps) {
            (Phase::Steady, Some(l)) => l,
            _ => tps,
        };
        self.probe = Some(Probe {
            from_limit: from,
            from_n: n,
            from_tps,
            waited: 0,
            seen: 0,
            sum_n: 0.0,
            sum_tps: 0.0,
        });
        self.set(to, reason);
        self.settle = 1;
    }
}

/// How long a scrape of `/metrics` may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(800);

/// When to ask a server's `/metrics` again.
#[derive(Default, Clone, Copy)]
struct Scraping {
    failures: u32,
    resume: Option<Instant>,
}

impl Scraping {
    fn due(&self, now: Instant) -> bool {
        self.resume.is_none_or(|t| now >= t)
    }

    /// A failed scrape: after three in a row, or a 404, the server is taken to export
    /// nothing for a while (its throughput alone steers it).
    fn failed(&mut self, now: Instant, not_found: bool) {
        self.failures += 1;
        if not_found {
            self.resume = Some(now + Duration::from_secs(600));
        } else if self.failures >= 3 {
            self.resume = Some(now + Duration::from_secs(60));
        }
    }
}

/// Reads a server's signals; `Err(true)` for a 404 (it has no `/metrics`).
async fn scrape(upstream: &Upstream, url: &str) -> Result<Option<Signals>, bool> {
    match upstream.get_text(url, "/metrics", SCRAPE_TIMEOUT).await {
        Ok(text) => Ok(crate::run::signals::parse(&text)),
        Err(UpstreamError::Status { code: 404, .. }) => Err(true),
        Err(_) => Err(false),
    }
}

/// Steers every server's limit once a second until `stop`: reads its `/metrics` (when it
/// has them), its throughput and what is in flight, and sets the limit its [`Controller`]
/// answers. A server out of rotation keeps its limit but is not counted by the dispatcher;
/// back in rotation it starts again from half of it.
pub(crate) async fn steer(
    servers: Arc<Servers>,
    upstream: Upstream,
    max: usize,
    stop: CancellationToken,
) {
    let n = servers.list.len();
    let mut ctl: Vec<Controller> = (0..n).map(|_| Controller::new(max)).collect();
    let mut scraping = vec![Scraping::default(); n];
    let mut last_tokens: Vec<u64> = servers
        .list
        .iter()
        .map(|s| s.streamed.load(Ordering::Relaxed))
        .collect();
    let mut last_answered: Vec<u64> = servers
        .list
        .iter()
        .map(|s| s.answered.load(Ordering::Relaxed))
        .collect();
    let mut was_up = vec![true; n];
    for (i, c) in ctl.iter().enumerate() {
        servers.set_limit(i, c.limit());
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let now = Instant::now();
        let scrapes =
            futures_util::future::join_all(servers.list.iter().enumerate().map(|(i, s)| {
                let due = s.up.load(Ordering::Relaxed) && scraping[i].due(now);
                let upstream = &upstream;
                async move {
                    if due {
                        Some(scrape(upstream, &s.url).await)
                    } else {
                        None
                    }
                }
            }))
            .await;
        let now = Instant::now();
        let dt = now.duration_since(last).as_secs_f64();
        last = now;
        for (i, (s, scraped)) in servers.list.iter().zip(scrapes).enumerate() {
            let tokens = s.streamed.load(Ordering::Relaxed);
            let delta = tokens.saturating_sub(last_tokens[i]);
            last_tokens[i] = tokens;
            let answered = s.answered.load(Ordering::Relaxed);
            let completions = answered.saturating_sub(last_answered[i]);
            last_answered[i] = answered;
            if !s.up.load(Ordering::Relaxed) {
                was_up[i] = false;
                continue;
            }
            if !std::mem::replace(&mut was_up[i], true) {
                ctl[i].restart();
            }
            let signals = match scraped {
                Some(Ok(sig)) => {
                    scraping[i] = Scraping::default();
                    sig
                }
                Some(Err(not_found)) => {
                    scraping[i].failed(now, not_found);
                    None
                }
                None => None,
            };
            let before = ctl[i].limit();
            let limit = ctl[i].observe(&Sample {
                dt,
                inflight: s.inflight.load(Ordering::Relaxed) as f64,
                tokens: delta as f64,
                completions: completions as f64,
                signals,
            });
            if limit != before {
                tracing::debug!(server = %s.url, from = before, to = limit, reason = ctl[i].reason(), "concurrency limit");
                servers.set_limit(i, limit);
            }
        }
    }
}

/// `d ln T / d ln n` between two levels; `None` when in-flight barely moved (the limit was
/// not reached, so nothing was learnt) or throughput is unknown.
fn elasticity(n0: f64, t0: f64, n1: f64, t1: f64) -> Option<f64> {
    if n0 < 0.5 || n1 < 0.5 || t0 <= 0.0 || t1 <= 0.0 {
        return None;
    }
    let dn = (n1 / n0).ln();
    if dn.abs() < 0.04 {
        return None;
    }
    Some((t1 / t0).ln() / dn)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted server: `tps(n)` tokens/s with `n` in flight, and optional signals.
    struct Scripted<F: FnMut(f64) -> (f64, Option<Signals>)> {
        server: F,
        demand: f64,
    }

    impl<F: FnMut(f64) -> (f64, Option<Signals>)> Scripted<F> {
        /// Runs `secs` intervals; in-flight follows the limit at once going up, and down by
        /// at most `drain` a second (requests in flight only leave as they end).
        fn run(&mut self, c: &mut Controller, secs: usize, n: &mut f64, drain: f64) -> Vec<usize> {
            let mut limits = Vec::new();
            for _ in 0..secs {
                let lim = c.limit() as f64;
                *n = if lim >= *n {
                    lim.min(self.demand)
                } else {
                    (*n - drain).max(lim)
                };
                let (tps, signals) = (self.server)(*n);
                limits.push(c.observe(&Sample {
                    dt: 1.0,
                    inflight: *n,
                    tokens: tps,
                    // Requests of 100 tokens.
                    completions: tps / 100.0,
                    signals,
                }));
            }
            limits
        }
    }

    /// A roofline server: 60 tok/s per request up to a ceiling (knee at `knee`).
    fn roofline(knee: f64) -> impl FnMut(f64) -> (f64, Option<Signals>) {
        move |n| (60.0 * n.min(knee), None)
    }

    /// Without signals, the limit climbs by slow start to the knee of a compute-bound
    /// server within a minute and stays near it (not at `max_concurrency`).
    #[test]
    fn converges_to_the_knee_from_throughput_alone() {
        let mut c = Controller::new(1024);
        let mut s = Scripted {
            server: roofline(100.0),
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 60, &mut n, 5.0);
        let last = *limits.last().unwrap();
        assert!((100..=260).contains(&last), "{limits:?}");
        let tail = &limits[40..];
        assert!(tail.iter().all(|&l| (100..=280).contains(&l)), "{limits:?}");
    }

    /// A knee between two slow-start levels (33, between 32 and 64) is not rounded down to
    /// the lower level: the limit ends past it, where throughput is the plateau's.
    #[test]
    fn a_knee_between_doublings_is_not_rounded_down() {
        let mut c = Controller::new(1024);
        let mut s = Scripted {
            server: roofline(33.3),
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 40, &mut n, 5.0);
        let last = *limits.last().unwrap() as f64;
        assert!((34.0..=48.0).contains(&last), "{limits:?}");
    }

    /// Preemptions that outnumber completions (thrashing: slow start overshot to 128) cut
    /// the limit, once per cut until in-flight is down; it then stays near the level past
    /// which the server preempts (70), probing down while it preempts.
    #[test]
    fn backs_off_on_preemptions() {
        let mut c = Controller::new(1024);
        let mut preempt = 0.0;
        let mut s = Scripted {
            server: move |n: f64| {
                if n > 70.0 {
                    preempt += n - 70.0;
                }
                (
                    60.0 * n.min(70.0),
                    Some(Signals {
                        running: n.min(70.0),
                        waiting: 0.0,
                        // No KV usage exported: slow start overshoots into the thrash.
                        kv_usage: None,
                        preemptions: Some(preempt),
                    }),
                )
            },
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 120, &mut n, 10.0);
        // Within a probe's tenth of the knee on either side.
        let mut tail = limits[30..].to_vec();
        assert!(tail.iter().all(|&l| (55..=82).contains(&l)), "{limits:?}");
        tail.sort_unstable();
        assert!((62..=76).contains(&tail[tail.len() / 2]), "{limits:?}");
        assert!(
            limits.iter().any(|&l| l >= 100),
            "overshoots first: {limits:?}"
        );
        assert!(limits.iter().all(|&l| l >= 1));
    }

    /// A queue at the server brings the limit down to what it runs (plus headroom).
    #[test]
    fn a_server_queue_caps_the_limit_at_what_it_runs() {
        let mut c = Controller::new(1024);
        let mut s = Scripted {
            server: |n: f64| {
                (
                    30.0 * n.min(128.0),
                    Some(Signals {
                        running: n.min(128.0),
                        waiting: (n - 128.0).max(0.0),
                        kv_usage: Some(0.3),
                        preemptions: Some(0.0),
                    }),
                )
            },
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 60, &mut n, 20.0);
        let last = *limits.last().unwrap();
        assert!((128..=140).contains(&last), "{limits:?}");
    }

    /// A full cache admits from the server's queue as its requests end: the limit keeps a
    /// quarter of what it runs waiting there (at a server capped by its batch size, the
    /// test above, it keeps almost none).
    #[test]
    fn a_full_cache_keeps_a_queue_to_admit_from() {
        let mut c = Controller::new(1024);
        let mut s = Scripted {
            server: |n: f64| {
                (
                    60.0 * n.min(80.0),
                    Some(Signals {
                        running: n.min(80.0),
                        waiting: (n - 80.0).max(0.0),
                        kv_usage: Some(if n > 80.0 { 0.97 } else { 0.3 }),
                        preemptions: Some(0.0),
                    }),
                )
            },
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 60, &mut n, 20.0);
        // 80 running and 20 waiting, or a probe's tenth above.
        assert!(
            limits[40..].iter().all(|&l| (95..=112).contains(&l)),
            "{limits:?}"
        );
    }

    /// One second of preemptions at the cache's edge does not cut the limit; the same
    /// preemptions for a few seconds running (a thrash) do.
    #[test]
    fn a_burst_of_preemptions_is_weighed_over_seconds() {
        let sample = |limit: usize, preemptions: f64| Sample {
            dt: 1.0,
            inflight: limit as f64,
            tokens: 60.0 * limit as f64,
            completions: 0.6 * limit as f64,
            signals: Some(Signals {
                running: limit as f64,
                waiting: 0.0,
                kv_usage: Some(0.5),
                preemptions: Some(preemptions),
            }),
        };
        let mut c = Controller::new(128);
        for _ in 0..20 {
            c.observe(&sample(c.limit(), 0.0));
        }
        assert_eq!(c.limit(), 128);
        // 1.5 preemptions per completion, for one second.
        let burst = 1.5 * 0.6 * 128.0;
        c.observe(&sample(128, burst));
        for _ in 0..3 {
            c.observe(&sample(128, burst));
        }
        assert_eq!(c.limit(), 128, "cut by one second: {}", c.reason());
        let mut total = burst;
        for _ in 0..3 {
            total += burst;
            c.observe(&sample(c.limit(), total));
        }
        assert!(c.limit() < 128, "not cut by a thrash");
        assert_eq!(c.reason(), "preemptions");
    }

    /// A step in the server (its knee halves: half its KV taken) is followed down, and its
    /// recovery followed back up; the limit never reaches zero.
    #[test]
    fn follows_a_step_and_recovers() {
        let mut c = Controller::new(1024);
        let knee = std::rc::Rc::new(std::cell::Cell::new(120.0));
        let k = knee.clone();
        let mut preempt = 0.0;
        let mut s = Scripted {
            server: move |n: f64| {
                let kn = k.get();
                if n > kn {
                    preempt += n - kn;
                }
                (
                    60.0 * n.min(kn),
                    Some(Signals {
                        running: n.min(kn),
                        waiting: 0.0,
                        kv_usage: Some((n / (kn * 1.15)).min(1.0)),
                        preemptions: Some(preempt),
                    }),
                )
            },
            demand: 1e9,
        };
        let mut n = 0.0;
        let before = s.run(&mut c, 60, &mut n, 10.0);
        // At the knee (120) or within a probe's tenth of it.
        let mut tail = before[40..].to_vec();
        tail.sort_unstable();
        assert!((70..=132).contains(&tail[tail.len() / 2]), "{before:?}");
        assert!(tail.iter().all(|&l| l <= 140), "{before:?}");
        knee.set(50.0);
        let slowed = s.run(&mut c, 60, &mut n, 10.0);
        let mut tail = slowed[36..].to_vec();
        tail.sort_unstable();
        assert!(tail.iter().all(|&l| l <= 60), "{slowed:?}");
        assert!((30..=55).contains(&tail[tail.len() / 2]), "{slowed:?}");
        assert!(slowed.iter().all(|&l| l >= 1));
        knee.set(120.0);
        let back = s.run(&mut c, 90, &mut n, 10.0);
        assert!(*back.last().unwrap() >= 70, "{back:?}");
    }

    /// Without signals, a server whose throughput falls past a level (thrashing) is probed
    /// down to where throughput stops falling with it.
    #[test]
    fn probes_down_when_throughput_falls_without_signals() {
        let mut c = Controller::new(1024);
        // Rises to 80, then falls: thrashing past the knee.
        let mut s = Scripted {
            server: |n: f64| {
                let t = if n <= 80.0 {
                    60.0 * n
                } else {
                    60.0 * 80.0 * (80.0 / n).powf(2.0)
                };
                (t, None)
            },
            demand: 1e9,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 90, &mut n, 10.0);
        let last = *limits.last().unwrap();
        assert!((50..=100).contains(&last), "{limits:?}");
    }

    /// The limit only grows while it is binding: a client with little work does not
    /// inflate it.
    #[test]
    fn grows_only_while_binding() {
        let mut c = Controller::new(1024);
        let mut s = Scripted {
            server: roofline(1000.0),
            demand: 12.0,
        };
        let mut n = 0.0;
        let limits = s.run(&mut c, 30, &mut n, 5.0);
        assert!(*limits.last().unwrap() <= 32, "{limits:?}");
    }
}
