//! Token budgets and ETAs: how many tokens the work in flight will still produce.
//!
//! [`LengthModel`] learns a dataset's completion-length distribution from the completions
//! seen so far *and* from the requests in flight, treated as censored observations (a
//! request that has streamed 3 000 tokens will produce at least 3 000). This is the
//! Kaplan–Meier product-limit estimator; it removes the short-first bias that makes
//! estimates from finished requests alone far too low early in a run.
//!
//! Invariants: `expected_final(s) >= s` and `<= max_tokens`; with no data the estimate
//! is the conservative `max_tokens`, so a fresh run never dispatches past its budget on
//! optimism.

/// A dataset's completion lengths: finished ones exactly, in-flight ones as lower bounds.
#[derive(Debug, Clone)]
pub struct LengthModel {
    max_tokens: u32,
    /// Completed lengths, kept sorted.
    done: Vec<u32>,
}

/// Completions needed before the learned distribution replaces the conservative prior.
const MIN_SAMPLES: usize = 8;

impl LengthModel {
    /// An empty model for completions capped at `max_tokens`.
    pub fn new(max_tokens: u32) -> Self {
        Self {
            max_tokens: max_tokens.max(1),
            done: Vec::new(),
        }
    }

    /// Records a finished completion's length.
    pub fn observe(&mut self, len: u32) {
        let len = len.min(self.max_tokens);
        let at = self.done.partition_point(|&x| x <= len);
        self.done.insert(at, len);
    }

    /// Number of finished completions seen.
    pub fn samples(&self) -> usize {
        self.done.len()
    }

    /// The estimated survival curve S(t) = P(L > t) at the distinct lengths, from finished
    /// lengths (events) and in-flight progress (censored). Returns (t, S(t)) steps.
    fn survival(&self, censored: &[u32]) -> Vec<(u32, f64)> {
        let mut cens: Vec<u32> = censored.iter().map(|&c| c.min(self.max_tokens)).collect();
        cens.sort_unstable();
        let n_total = self.done.len() + cens.len();
        let mut at_risk = n_total as f64;
        let mut s = 1.0;
        let mut steps = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < self.done.len() {
            let t = self.done[i];
            // Censored strictly before t leave the risk set first.
            while j < cens.len() && cens[j] < t {
                at_risk -= 1.0;
                j += 1;
            }
            let mut d = 0.0;
            while i < self.done.len() && self.done[i] == t {
                d += 1.0;
                i += 1;
            }
            if at_risk > 0.0 {
                s *= 1.0 - d / at_risk;
            }
            at_risk -= d;
            steps.push((t, s));
        }
        steps
    }

    /// Expected final length of a request that has produced `streamed` tokens so far,
    /// given the other requests in flight (`censored`, their streamed counts).
    pub fn expected_final(&self, streamed: u32, censored: &[u32]) -> f64 {
        let cap = f64::from(self.max_tokens);
        let s0 = f64::from(streamed.min(self.max_tokens));
        if self.done.len() < MIN_SAMPLES || streamed >= self.max_tokens {
            return cap.max(s0);
        }
        let steps = self.survival(censored);
        // E[L | L > s] = s + ∫_s^cap S(t) dt / S(s), S a right-continuous step function.
        let surv_at = |t: u32| -> f64 {
            let k = steps.partition_point(|&(x, _)| x <= t);
            if k == 0 {
                1.0
            } else {
                steps[k - 1].1
            }
        };
        let s_s = surv_at(streamed);
        if s_s <= 1e-12 {
            // Everything seen ended before `streamed`: the tail is unknown; assume the
            // request runs half of the way to the cap.
            return s0 + (cap - s0) / 2.0;
        }
        let mut area = 0.0;
        let mut prev_t = s0;
        let mut prev_s = s_s;
        let mut k = steps.partition_point(|&(x, _)| x <= streamed);
        while k < steps.len() {
            let (t, sv) = steps[k];
            let t = f64::from(t);
            area += prev_s * (t - prev_t);
            prev_t = t;
            prev_s = sv;
            k += 1;
        }
        // Beyond the last event the curve is unknown; if mass remains, it runs to the cap.
        area += prev_s * (cap - prev_t).max(0.0);
        (s0 + area / s_s).clamp(s0, cap)
    }

    /// Expected length of a request not yet started.
    pub fn expected_new(&self, censored: &[u32]) -> f64 {
        self.expected_final(0, censored)
    }
}

/// Seconds left for a dataset at the current token throughput.
///
/// `remaining_tokens` is the work left under the budget (the smaller of remaining prompts ×
/// expected tokens per prompt and the remaining budget, minus what is in flight already
/// produced); `tokens_per_s` counts streamed tokens, so it is honest from the first minute.
pub fn eta_seconds(remaining_tokens: f64, tokens_per_s: f64) -> Option<f64> {
    if remaining_tokens <= 0.0 {
        return Some(0.0);
    }
    if tokens_per_s <= 1e-9 {
        return None;
    }
    Some(remaining_tokens / tokens_per_s)
}

/// Formats seconds as `2h41m`, `3m05s`, `12s`.
pub fn format_duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "?".into();
    }
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_data_means_the_conservative_cap() {
        let m = LengthModel::new(1000);
        assert_eq!(m.expected_new(&[]), 1000.0);
        assert_eq!(m.expected_final(1200, &[]), 1000.0);
    }

    #[test]
    fn complete_data_gives_the_mean_and_conditional_means() {
        let mut m = LengthModel::new(1000);
        for l in [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000] {
            m.observe(l);
        }
        let e = m.expected_new(&[]);
        assert!((e - 550.0).abs() < 1e-6, "{e}");
        // Given it already passed 650: the mean of {700, 800, 900, 1000}.
        let c = m.expected_final(650, &[]);
        assert!((c - 850.0).abs() < 1e-6, "{c}");
        assert!(m.expected_final(999, &[]) >= 999.0);
    }

    #[test]
    fn censoring_corrects_the_short_first_bias() {
        // Early in a run only the short ones have finished; 20 long ones are in flight.
        let mut m = LengthModel::new(10_000);
        for l in [50, 80, 100, 120, 150, 200, 220, 250, 300, 310] {
            m.observe(l);
        }
        let naive = m.expected_new(&[]);
        let censored = vec![400u32; 20];
        let km = m.expected_new(&censored);
        assert!(naive < 200.0, "{naive}");
        assert!(
            km > 2.0 * naive,
            "KM {km} should see the long tail naive {naive} misses"
        );
    }

    #[test]
    fn durations_format() {
        assert_eq!(format_duration(9660.0), "2h41m");
        assert_eq!(format_duration(185.0), "3m05s");
        assert_eq!(format_duration(12.4), "12s");
    }
}
