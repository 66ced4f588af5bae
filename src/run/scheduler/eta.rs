//! When each lane, and the run, is expected to finish: a simulation of the batch as it
//! drains, from the lanes' snapshots and the servers' learned speed.
//!
//! Invariant: an unfinished lane has no ETA (`None`) until the speed curve is known; a
//! finished lane's is 0.

use super::LaneView;
use crate::estimate::speed::SpeedCurve;
use crate::estimate::tail::{finish_times, LaneWork};

/// Seconds until each lane is finished (its last request completes), from the server's
/// learned [`SpeedCurve`] and the run's `concurrency`: a simulation of the batch as it drains
/// ([`crate::estimate::tail`]), because the last requests of a run go faster than today's per-request
/// speed. `None` for every unfinished lane until the curve is known (no throughput yet).
pub fn lane_etas(
    views: &[LaneView],
    curve: Option<&SpeedCurve>,
    concurrency: usize,
) -> Vec<Option<f64>> {
    let times = curve.map(|c| {
        let work: Vec<LaneWork> = views
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let own = &v.work.lengths;
                if own.fitted().is_some() {
                    return v.work.clone();
                }
                // A dataset with no completions yet: its gate assumes `max_tokens` per request
                // (safe for the budget), but it will soon learn its lengths and start more,
                // shorter requests. Estimate with the nearest fitted dataset's lengths,
                // earlier ones first, and re-derive how many requests it will start.
                let Some(donor) = views[..i]
                    .iter()
                    .rev()
                    .chain(&views[i + 1..])
                    .map(|d| &d.work.lengths)
                    .find(|m| m.fitted().is_some())
                else {
                    return v.work.clone();
                };
                let lengths = own.or_borrowed_fit(donor);
                let to_start = match v.budget_left {
                    Some(left) => {
                        let finals: f64 = v
                            .work
                            .streamed
                            .iter()
                            .map(|&s| lengths.expected_final(s))
                            .sum();
                        let room = (left - finals).max(0.0);
                        v.pending_to_start
                            .min((room / lengths.expected_new().max(1.0)).ceil())
                    }
                    None => v.pending_to_start,
                };
                LaneWork {
                    streamed: v.work.streamed.clone(),
                    to_start,
                    pending: v.work.pending,
                    budget_left: v.work.budget_left,
                    lengths,
                }
            })
            .collect();
        finish_times(&work, c, concurrency)
    });
    views
        .iter()
        .enumerate()
        .map(|(i, v)| {
            if v.finished {
                Some(0.0)
            } else {
                times.as_ref().and_then(|t| t.get(i).copied())
            }
        })
        .collect()
}

/// ETA of the whole run: that of the last lane (`None` if any lane's is unknown).
pub fn run_eta(etas: &[Option<f64>]) -> Option<f64> {
    etas.iter().try_fold(0.0f64, |acc, e| e.map(|e| acc.max(e)))
}
