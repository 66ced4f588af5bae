//! The server's speed as a function of requests in flight, learnt from what the monitor
//! sees: the [`SpeedCurve`] the tail simulation ([`crate::estimate::tail`]) runs on.
//!
//! A continuous-batching server shares its throughput among the requests in its batch:
//! while the batch is full each request gets `capacity / n`; as the batch empties the
//! requests left go faster, up to the server's per-request ceiling. [`SpeedLearner`] turns
//! once-a-second samples (streamed tokens over all datasets, requests in flight) into that
//! curve: the aggregate capacity, measured while the batch is (nearly) full, and the
//! per-request ceiling, measured only once the batch has been small enough for throughput
//! to fall below capacity.
//!
//! A step in the rate (a server slowed down or sped up, a batch that now thrashes) is
//! followed within seconds: when the capacity of the last [`RECENT`] seconds stays more
//! than [`STEP`] away from the window's for three samples running, the older samples are
//! dropped. Between full batches (a batch refilling after a change) the last capacity
//! measured stands.
//!
//! Invariants: until a ceiling has been seen none is assumed (the capacity is shared
//! evenly, as work-conserving servers do); a lone request never gets more than the whole
//! capacity; memory is bounded by the sampling window.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How far back the speed learner looks (as the token rates do).
const WINDOW: Duration = Duration::from_secs(120);
/// An interval counts as "batch full" when it had at least this share of the most requests
/// in flight seen in the window.
const FULL_SHARE: f64 = 0.75;
/// An interval counts as capped by the per-request ceiling when its throughput was below this
/// share of capacity (and requests were in flight).
const CAPPED_SHARE: f64 = 0.8;
/// The span that reveals a step in the rate.
const RECENT: Duration = Duration::from_secs(10);
/// A relative change of capacity that counts as a step.
const STEP: f64 = 0.15;

/// How fast the server generates as a function of how many requests it is running.
///
/// Modelled as `per_request(n) = min(ceiling, capacity / n)`: the shape of a continuous
/// batching server (and of `spool mock-server`), where throughput is flat once the batch is
/// large enough and a small batch is limited by the decode speed of one sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedCurve {
    /// Aggregate tokens/s with a full batch.
    pub capacity_tps: f64,
    /// Fastest one request goes (tokens/s), once observed; `None` = not seen yet.
    pub per_request_cap_tps: Option<f64>,
}

impl SpeedCurve {
    /// Tokens/s each request gets with `n` requests in flight. At least one request is
    /// assumed active (a lone request never gets more than the whole capacity).
    pub fn per_request(&self, n: f64) -> f64 {
        let share = self.capacity_tps / n.max(1.0);
        match self.per_request_cap_tps {
            Some(c) => share.min(c),
            None => share,
        }
    }
}

/// Learns a [`SpeedCurve`] from what the monitor sees each second. Only the totals over all
/// datasets matter: they share the server.
#[derive(Debug, Default)]
pub struct SpeedLearner {
    /// (instant, streamed tokens over all datasets, requests in flight over all datasets).
    samples: VecDeque<(Instant, u64, usize)>,
    /// Last per-request ceiling measured; kept beyond the window (it is seen only in tails).
    cap: Option<f64>,
    /// Last capacity measured (stands while no full batch is in the window).
    last_capacity: Option<f64>,
    /// Samples running in which the recent capacity stood off the window's.
    off: u32,
}

impl SpeedLearner {
    /// Adds a sample and updates the per-request ceiling if the batch was small enough to
    /// reveal it.
    pub fn sample(&mut self, now: Instant, streamed_tokens: u64, inflight: usize) {
        self.samples.push_back((now, streamed_tokens, inflight));
        while self.samples.len() > 2 && now.duration_since(self.samples[0].0) > WINDOW {
            self.samples.pop_front();
        }
        self.follow_steps(now);
        let Some((capacity, full)) = self.capacity() else {
            return;
        };
        self.last_capacity = Some(capacity);
        // Capped intervals: a batch that stayed clearly smaller than the full one (not the
        // start of a run, where it fills up), whose throughput fell short of capacity, and
        // whose requests went faster than a full batch's share (a hiccup of the server at a
        // full batch reveals nothing about the ceiling).
        let mut capped: Vec<f64> = self
            .intervals()
            .filter(|iv| iv.n_min >= 1.0 && iv.n_max < FULL_SHARE * full)
            .filter(|iv| iv.tps < CAPPED_SHARE * capacity)
            .map(|iv| iv.tps / iv.n)
            .filter(|&r| r > capacity / full)
            .collect();
        if !capped.is_empty() {
            capped.sort_by(f64::total_cmp);
            // The median: robust against an interval whose average batch is off.
            self.cap = Some(capped[capped.len() / 2]);
        }
    }

    /// Drops the samples before the last [`RECENT`] seconds once their capacity has stood
    /// off the window's for three samples.
    fn follow_steps(&mut self, now: Instant) {
        let since = now.checked_sub(RECENT);
        let (Some(all), Some(recent)) =
            (self.capacity(), since.and_then(|t| self.capacity_since(t)))
        else {
            self.off = 0;
            return;
        };
        if (recent.0 / all.0 - 1.0).abs() > STEP {
            self.off += 1;
        } else {
            self.off = 0;
        }
        if self.off >= 3 {
            self.off = 0;
            if let Some(t) = since {
                while self.samples.len() > 2 && self.samples[0].0 < t {
                    self.samples.pop_front();
                }
            }
        }
    }

    /// [`SpeedLearner::capacity`] over the intervals that start at `since` or later.
    fn capacity_since(&self, since: Instant) -> Option<(f64, f64)> {
        let ivs: Vec<Interval> = self.intervals_from(since).collect();
        let full = ivs.iter().map(|iv| iv.n).fold(0.0, f64::max);
        if full <= 0.0 {
            return None;
        }
        let (tokens, dt) = ivs
            .iter()
            .filter(|iv| iv.n >= FULL_SHARE * full)
            .fold((0.0, 0.0), |(k, t), iv| (k + iv.tokens, t + iv.dt));
        (dt >= 3.0 && tokens > 0.0).then(|| (tokens / dt, full))
    }

    fn intervals(&self) -> impl Iterator<Item = Interval> + '_ {
        self.intervals_from(self.samples.front().map_or_else(Instant::now, |s| s.0))
    }

    fn intervals_from(&self, since: Instant) -> impl Iterator<Item = Interval> + '_ {
        self.samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .filter(move |(a, _)| a.0 >= since)
            .filter_map(|(a, b)| {
                let dt = b.0.duration_since(a.0).as_secs_f64();
                (dt >= 0.2).then(|| Interval {
                    dt,
                    tokens: b.1.saturating_sub(a.1) as f64,
                    tps: b.1.saturating_sub(a.1) as f64 / dt,
                    n: (a.2 + b.2) as f64 / 2.0,
                    n_min: a.2.min(b.2) as f64,
                    n_max: a.2.max(b.2) as f64,
                })
            })
    }

    /// Aggregate tokens/s over the window's intervals with a (nearly) full batch, and the
    /// size of that full batch.
    fn capacity(&self) -> Option<(f64, f64)> {
        let full = self.intervals().map(|iv| iv.n).fold(0.0, f64::max);
        if full <= 0.0 {
            return None;
        }
        let (tokens, dt) = self
            .intervals()
            .filter(|iv| iv.n >= FULL_SHARE * full)
            .fold((0.0, 0.0), |(k, t), iv| (k + iv.tokens, t + iv.dt));
        (dt >= 0.5 && tokens > 0.0).then(|| (tokens / dt, full))
    }

    /// The curve, once a second of data with requests in flight exists.
    pub fn curve(&self) -> Option<SpeedCurve> {
        let capacity_tps = self.capacity().map(|c| c.0).or(self.last_capacity)?;
        Some(SpeedCurve {
            capacity_tps,
            per_request_cap_tps: self.cap,
        })
    }
}

/// Between two samples: seconds, tokens, tokens/s, requests in flight (mean of both ends,
/// and the smaller and larger end).
struct Interval {
    dt: f64,
    tokens: f64,
    tps: f64,
    n: f64,
    n_min: f64,
    n_max: f64,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A curve of `capacity` tok/s, each request at most `cap`.
    pub(crate) fn curve(capacity: f64, cap: Option<f64>) -> SpeedCurve {
        SpeedCurve {
            capacity_tps: capacity,
            per_request_cap_tps: cap,
        }
    }

    /// `got` is within the fraction `tol` of `want`.
    pub(crate) fn close(got: f64, want: f64, tol: f64) {
        assert!(
            (got - want).abs() <= tol * want.max(1e-9),
            "got {got}, want {want} (±{:.1} %)",
            tol * 100.0
        );
    }

    /// Each request gets an even share of the capacity, but never more than the ceiling, and
    /// a lone request never more than the whole capacity.
    #[test]
    fn speed_curve_shares_capacity_up_to_the_ceiling() {
        let c = curve(1000.0, Some(60.0));
        assert_eq!(c.per_request(100.0), 10.0);
        assert_eq!(c.per_request(2.0), 60.0);
        // Without a ceiling, a lone request gets the whole capacity, never more.
        assert_eq!(curve(1000.0, None).per_request(0.2), 1000.0);
    }

    /// The learner measures the capacity from a full batch (its warm-up not mistaken for a
    /// small batch) and the per-request ceiling only once a small batch has revealed it.
    #[test]
    fn the_learner_measures_capacity_and_the_ceiling() {
        let t0 = Instant::now();
        let mut l = SpeedLearner::default();
        // The run starts: nothing in flight, then a full batch that is still warming up
        // (which must not pass for a small batch that reveals a ceiling).
        l.sample(t0, 0, 0);
        let mut tokens = 800u64;
        // 30 s of a full batch of 150 at 1000 tok/s.
        for s in 1..30u64 {
            l.sample(t0 + Duration::from_secs(s), tokens, 150);
            tokens += 1000;
        }
        let c = l.curve().unwrap();
        close(c.capacity_tps, 1000.0, 0.01);
        assert_eq!(c.per_request_cap_tps, None, "no small batch seen yet");
        // The batch shrinks to 5, which then get 60 tok/s each (300 tok/s in all).
        for s in 30..40u64 {
            l.sample(t0 + Duration::from_secs(s), tokens, 5);
            tokens += 300;
        }
        let c = l.curve().unwrap();
        close(c.capacity_tps, 1000.0, 0.01);
        close(c.per_request_cap_tps.unwrap(), 60.0, 0.01);
    }

    /// A step in the rate (the server at half speed from second 60) is followed within
    /// seconds, not after the two-minute window has turned over.
    #[test]
    fn the_learner_follows_a_step_within_seconds() {
        let t0 = Instant::now();
        let mut l = SpeedLearner::default();
        let mut tokens = 0u64;
        for s in 0..60u64 {
            l.sample(t0 + Duration::from_secs(s), tokens, 100);
            tokens += 1000;
        }
        close(l.curve().unwrap().capacity_tps, 1000.0, 0.01);
        let mut followed = None;
        for s in 60..120u64 {
            l.sample(t0 + Duration::from_secs(s), tokens, 100);
            tokens += 500;
            if followed.is_none() && (l.curve().unwrap().capacity_tps - 500.0).abs() < 50.0 {
                followed = Some(s - 60);
            }
        }
        let after = followed.expect("the step is followed");
        assert!(after <= 15, "followed after {after} s");
    }
}
