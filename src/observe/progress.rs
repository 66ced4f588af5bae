//! Rates and progress lines: what a run reports of each dataset when no bars are drawn.
//!
//! Rates come from a sliding window over counters sampled once a second: tokens/s counts
//! *streamed* tokens (work in flight included), which is what makes an ETA honest from
//! the first minute; requests/s is shown but never used for the ETA.
//!
//! Invariant: a progress line is logged every `progress_every` completions of a dataset
//! and at least every 60 s while it is active, and once more at the end of a run for a
//! dataset that progressed since its last line. On a terminal the bars of
//! [`crate::observe::bars`] replace the lines.

use crate::observe::figures::{format_duration, human};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How far back rates look.
const WINDOW: Duration = Duration::from_secs(120);

/// Counter samples of one dataset.
#[derive(Debug, Default)]
pub struct Rate {
    samples: VecDeque<(Instant, u64, u64)>,
}

impl Rate {
    /// Adds a sample of (streamed tokens, completed requests) at `now`.
    pub fn sample(&mut self, now: Instant, tokens: u64, requests: u64) {
        self.samples.push_back((now, tokens, requests));
        while self.samples.len() > 2 && now.duration_since(self.samples[0].0) > WINDOW {
            self.samples.pop_front();
        }
    }

    /// (tokens/s, requests/s) over the window, once a second of data exists.
    pub fn rates(&self) -> Option<(f64, f64)> {
        let (t0, k0, r0) = *self.samples.front()?;
        let (t1, k1, r1) = *self.samples.back()?;
        let dt = t1.duration_since(t0).as_secs_f64();
        if dt < 0.5 {
            return None;
        }
        Some(((k1 - k0) as f64 / dt, (r1 - r0) as f64 / dt))
    }
}

/// Decides when a dataset's progress line is due.
#[derive(Debug)]
pub struct LineClock {
    every: u64,
    last_done: u64,
    last_at: Instant,
}

impl LineClock {
    /// A clock logging every `every` completions and at least each minute.
    pub fn new(every: u64, done: u64, now: Instant) -> Self {
        Self {
            every: every.max(1),
            last_done: done,
            last_at: now,
        }
    }

    /// Whether completions happened since the last line (the final line of a run).
    pub fn progressed(&self, done: u64) -> bool {
        done > self.last_done
    }

    /// At the end of a run: a last line is due if anything completed since the last one.
    pub fn finish(&mut self, done: u64, now: Instant) -> bool {
        let due = self.progressed(done);
        if due {
            self.last_done = done;
            self.last_at = now;
        }
        due
    }

    /// Whether a line is due now; resets when it is.
    pub fn due(&mut self, done: u64, active: bool, now: Instant) -> bool {
        let by_count = done >= self.last_done + self.every;
        let by_time = active && now.duration_since(self.last_at) >= Duration::from_secs(60);
        if by_count || by_time {
            self.last_done = done;
            self.last_at = now;
            true
        } else {
            false
        }
    }
}

/// What a progress line shows: the counts of [`crate::observe::status::DatasetStatus`]
/// (items; `pending` excludes those in flight), then retries, rates and tokens.
pub struct LineFields<'a> {
    pub name: &'a str,
    pub done: u64,
    pub total: u64,
    pub pending: u64,
    pub inflight: u64,
    pub failed: u64,
    /// Attempts tried again (a failed item is counted in `failed`, not here).
    pub retries: u64,
    pub req_per_s: f64,
    pub tok_per_s: f64,
    pub avg_completion: f64,
    pub tokens: u64,
    pub budget: Option<u64>,
    pub eta_s: Option<f64>,
}

/// `B3_magicoder done=50/9998 pending=9940 inflight=8 failed=0 retries=2 0.3 req/s 1.1k tok/s avg_comp=1232tok tokens=100.0k/10.0M ETA=2h41m`
pub fn format_line(f: &LineFields<'_>) -> String {
    let tokens = match f.budget {
        Some(b) => format!("{}/{}", human(f.tokens), human(b)),
        None => human(f.tokens),
    };
    format!(
        "{} done={}/{} pending={} inflight={} failed={} retries={} {:.1} req/s {} tok/s avg_comp={}tok tokens={} ETA={}",
        f.name,
        f.done,
        f.total,
        f.pending,
        f.inflight,
        f.failed,
        f.retries,
        f.req_per_s,
        human_rate(f.tok_per_s),
        f.avg_completion.round() as u64,
        tokens,
        f.eta_s.map(format_duration).unwrap_or_else(|| "?".into())
    )
}

fn human_rate(x: f64) -> String {
    if x >= 1000.0 {
        format!("{:.1}k", x / 1000.0)
    } else {
        format!("{x:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A progress line has the documented shape: the item counts by state, retries, rates,
    /// mean completion, tokens against the budget in human units and the ETA.
    #[test]
    fn line_matches_the_documented_shape() {
        let l = format_line(&LineFields {
            name: "B3_magicoder",
            done: 50,
            total: 9998,
            pending: 9940,
            inflight: 8,
            failed: 0,
            retries: 2,
            req_per_s: 0.3,
            tok_per_s: 1100.0,
            avg_completion: 1232.0,
            tokens: 100_000,
            budget: Some(10_000_000),
            eta_s: Some(9660.0),
        });
        assert_eq!(
            l,
            "B3_magicoder done=50/9998 pending=9940 inflight=8 failed=0 retries=2 0.3 req/s 1.1k tok/s avg_comp=1232tok tokens=100.0k/10.0M ETA=2h41m"
        );
        // Small totals keep their size: 24,900 tokens are 24.9k, not 0.0M.
        let small = format_line(&LineFields {
            tokens: 24_900,
            budget: None,
            ..LineFields {
                name: "b",
                done: 30,
                total: 30,
                pending: 0,
                inflight: 0,
                failed: 0,
                retries: 0,
                req_per_s: 12.0,
                tok_per_s: 480.0,
                avg_completion: 830.0,
                tokens: 0,
                budget: None,
                eta_s: Some(0.0),
            }
        });
        assert!(small.ends_with("tokens=24.9k ETA=0s"), "{small}");
    }

    /// A line is due every `progress_every` completions or after 60 s while active, never
    /// while idle, and once more at the end only if the dataset moved since its last line.
    #[test]
    fn clock_fires_by_count_and_by_time() {
        let t = Instant::now();
        let mut c = LineClock::new(50, 0, t);
        assert!(!c.due(49, true, t));
        assert!(c.due(50, true, t));
        assert!(!c.due(60, true, t + Duration::from_secs(59)));
        assert!(c.due(60, true, t + Duration::from_secs(61)));
        assert!(!c.due(60, false, t + Duration::from_secs(200)));
        assert!(!c.progressed(60));
        assert!(c.progressed(61));
        assert!(c.finish(61, t + Duration::from_secs(201)));
        assert!(!c.finish(61, t + Duration::from_secs(202)));
    }
}
