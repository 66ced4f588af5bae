//! Completion-length statistics: how many tokens a request will produce, learnt from the
//! completions seen so far. The budget gate asks how many tokens the work in flight will
//! still produce; the ETA asks how long a request that has streamed so far will still run
//! ([`LengthModel::survival`]; [`crate::estimate::tail`] turns that into when a dataset is
//! finished).
//!
//! [`LengthModel`] fits a log-normal completion-length distribution by maximum likelihood to
//! the completions seen so far *and* to the requests in flight, treated as right-censored
//! observations (a request that has streamed 3 000 tokens will produce at least 3 000; a
//! completion stopped by `max_tokens` is censored at the cap). Early in a run only short
//! completions have finished; the censored terms are what keep the fit from inheriting that
//! short-first bias. The fit is refreshed by [`LengthModel::refit`] (once a second, by the
//! monitor), so the scheduler's hot path only evaluates closed forms.
//!
//! Invariants: `expected_final(s) >= s` and `<= max_tokens`; until [`MIN_SAMPLES`]
//! completions are seen the estimate is the conservative `max_tokens`, so a fresh run
//! never dispatches past its budget on optimism.

/// Completions needed before the fitted distribution replaces the conservative prior.
pub const MIN_SAMPLES: usize = 8;

/// A fitted log-normal: ln L ~ N(mu, sigma²).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormal {
    pub mu: f64,
    pub sigma: f64,
}

/// A dataset's completion lengths and the distribution fitted to them. Finished
/// completions are kept as sufficient statistics (count, Σ ln L, Σ ln² L, count at the cap),
/// so memory and fitting cost do not grow with the run.
#[derive(Debug, Clone)]
pub struct LengthModel {
    max_tokens: u32,
    seen: u64,
    sum: u64,
    /// Completions below the cap: count, Σ ln L, Σ (ln L)².
    n_exact: f64,
    s1: f64,
    s2: f64,
    /// Completions stopped by the cap (lower bounds of their natural length).
    n_cap: f64,
    fit: Option<LogNormal>,
}

impl LengthModel {
    /// An empty model for completions capped at `max_tokens`.
    pub fn new(max_tokens: u32) -> Self {
        Self {
            max_tokens: max_tokens.max(1),
            seen: 0,
            sum: 0,
            n_exact: 0.0,
            s1: 0.0,
            s2: 0.0,
            n_cap: 0.0,
            fit: None,
        }
    }

    /// The cap every completion is subject to.
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Records a finished completion's length.
    pub fn observe(&mut self, len: u32) {
        let len = len.min(self.max_tokens);
        self.seen += 1;
        self.sum += u64::from(len);
        if len >= self.max_tokens {
            self.n_cap += 1.0;
        } else {
            let l = f64::from(len.max(1)).ln();
            self.n_exact += 1.0;
            self.s1 += l;
            self.s2 += l * l;
        }
    }

    /// Number of finished completions seen.
    pub fn samples(&self) -> usize {
        self.seen as usize
    }

    /// Mean of the finished completions (biased short early in a run; for display).
    pub fn observed_mean(&self) -> Option<f64> {
        (self.seen > 0).then(|| self.sum as f64 / self.seen as f64)
    }

    /// The current fit, once there is one.
    pub fn fitted(&self) -> Option<LogNormal> {
        self.fit
    }

    /// Refits the distribution to the completions and the requests in flight (`censored`:
    /// tokens each has streamed so far).
    pub fn refit(&mut self, censored: &[u32]) {
        if (self.seen as usize) < MIN_SAMPLES || self.n_exact < 2.0 {
            return;
        }
        self.fit = Some(self.fit_lognormal(censored));
    }

    /// Censored maximum likelihood: exact completions through their sums, completions at
    /// the cap and requests in flight as lower bounds. Nelder–Mead over (mu, ln sigma).
    fn fit_lognormal(&self, censored: &[u32]) -> LogNormal {
        let cap = self.max_tokens;
        let cens: Vec<f64> = censored
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| f64::from(c.min(cap)).ln())
            .collect();
        let ln_cap = f64::from(cap).ln();
        let (n, s1, s2, n_cap) = (self.n_exact, self.s1, self.s2, self.n_cap);
        let log_surv = |z: f64| (0.5 * erfc(z / std::f64::consts::SQRT_2)).max(1e-300).ln();
        let nll = |p: [f64; 2]| -> f64 {
            let (mu, ls) = (p[0], p[1]);
            let sigma = ls.exp();
            let mut v = (s2 - 2.0 * mu * s1 + n * mu * mu) / (2.0 * sigma * sigma) + n * ls;
            if n_cap > 0.0 {
                v -= n_cap * log_surv((ln_cap - mu) / sigma);
            }
            for &c in &cens {
                v -= log_surv((c - mu) / sigma);
            }
            v
        };
        let (mu0, ls0) = match self.fit {
            Some(d) => (d.mu, d.sigma.ln()),
            None => {
                let m = s1 / n;
                let var = (s2 / n - m * m).max(0.01);
                (m, var.sqrt().ln())
            }
        };
        let (mu, ls) = nelder_mead(nll, [mu0, ls0], [0.3, 0.2], 200);
        LogNormal {
            mu,
            sigma: ls.exp().clamp(0.01, 10.0),
        }
    }

    /// Sets the fit directly (tests of the arithmetic built on it).
    #[cfg(test)]
    pub(crate) fn set_fit_for_tests(&mut self, mu: f64, sigma: f64) {
        self.fit = Some(LogNormal { mu, sigma });
    }

    /// For estimates only (the ETA), never for the budget gate: this model, or, while it has
    /// no fit of its own, one with `other`'s fit (the same server and model; far closer to
    /// the truth than the conservative `max_tokens` a fresh dataset's gate starts from).
    pub fn or_borrowed_fit(&self, other: &LengthModel) -> LengthModel {
        let mut m = self.clone();
        if m.fit.is_none() {
            m.fit = other.fit;
        }
        m
    }

    /// Expected final length of a request that has produced `streamed` tokens so far.
    pub fn expected_final(&self, streamed: u32) -> f64 {
        let cap = f64::from(self.max_tokens);
        let s = f64::from(streamed.min(self.max_tokens));
        match self.fit {
            None => cap,
            Some(_) if streamed >= self.max_tokens => cap,
            Some(d) => d.conditional_mean(s, cap).clamp(s, cap),
        }
    }

    /// Variance of the final length of a request that has streamed `streamed` tokens: how
    /// far its [`Self::expected_final`] may be off. Zero without a fit (the prior is the
    /// cap itself) and for a request at the cap.
    pub fn variance_final(&self, streamed: u32) -> f64 {
        let cap = f64::from(self.max_tokens);
        let s = f64::from(streamed.min(self.max_tokens));
        match self.fit {
            Some(d) if streamed < self.max_tokens => {
                let m = d.conditional_mean(s, cap).clamp(s, cap);
                (d.conditional_second_moment(s, cap) - m * m).max(0.0)
            }
            _ => 0.0,
        }
    }

    /// Expected length of a request not yet started.
    pub fn expected_new(&self) -> f64 {
        self.expected_final(0)
    }

    /// A final length for a request that has streamed `streamed` tokens, drawn from the fit
    /// conditioned on `L > streamed` by inverting its survival function at `u` ∈ (0, 1): the
    /// ETA's sampled drain ([`crate::estimate::tail`]) feeds it stratified `u` so that few draws
    /// suffice. Without a fit every request runs to the cap (the conservative prior), as does
    /// one the fit thinks should already be over.
    pub fn sample_final(&self, streamed: u32, u: f64) -> f64 {
        let cap = f64::from(self.max_tokens);
        let s = f64::from(streamed.min(self.max_tokens));
        let Some(d) = self.fit else {
            return cap;
        };
        let base = d.survival(s);
        if base < 1e-12 {
            return cap;
        }
        // P(L > x | L > s) = u  ⇔  S(x) = u·S(s); at or past the cap the request stops there.
        let p = u.clamp(1e-12, 1.0 - 1e-12) * base;
        if p <= d.survival(cap) {
            return cap;
        }
        let x = (d.mu - d.sigma * inverse_normal_cdf(p)).exp();
        x.clamp(s, cap)
    }

    /// P(L > x) under the fit (with the cap: 0 at and beyond it).
    pub fn survival(&self, x: f64) -> f64 {
        let cap = f64::from(self.max_tokens);
        if x >= cap {
            return 0.0;
        }
        match self.fit {
            None => 1.0,
            Some(d) => d.survival(x),
        }
    }

    /// Expected longest remaining length (in tokens) among requests that have streamed
    /// `streamed`: E[max_i (L_i − s_i) | L_i > s_i]. What decides when a draining dataset
    /// is done at a constant per-request speed (the ETA's simulation, [`crate::estimate::tail`], also
    /// lets the speed rise as the batch shrinks).
    pub fn expected_max_remaining(&self, streamed: &[u32]) -> f64 {
        if streamed.is_empty() {
            return 0.0;
        }
        let cap = f64::from(self.max_tokens);
        if self.fit.is_none() {
            let min_s = streamed.iter().copied().min().unwrap_or(0);
            return cap - f64::from(min_s);
        }
        let base: Vec<(f64, f64)> = streamed
            .iter()
            .map(|&s| {
                let s = f64::from(s);
                (s, self.survival(s).max(1e-300))
            })
            .collect();
        // E[max] = ∫ P(max > t) dt over a grid of the remaining range.
        let steps = 256;
        let dt = cap / steps as f64;
        let mut total = 0.0;
        for k in 0..steps {
            let t = (k as f64 + 0.5) * dt;
            let mut all_done = 1.0;
            for &(s, ss) in &base {
                let p_more = (self.survival(s + t) / ss).min(1.0);
                all_done *= 1.0 - p_more;
                if all_done < 1e-12 {
                    break;
                }
            }
            total += (1.0 - all_done) * dt;
        }
        total
    }
}

impl LogNormal {
    /// P(L > x).
    pub fn survival(&self, x: f64) -> f64 {
        if x <= 0.0 {
            return 1.0;
        }
        0.5 * erfc(((x.ln() - self.mu) / self.sigma) / std::f64::consts::SQRT_2)
    }

    /// E[min(L, cap) | L > s].
    pub fn conditional_mean(&self, s: f64, cap: f64) -> f64 {
        self.conditional_moment(1.0, s, cap)
    }

    /// E[min(L, cap)² | L > s]: with [`Self::conditional_mean`], the spread of a request's
    /// final length.
    pub fn conditional_second_moment(&self, s: f64, cap: f64) -> f64 {
        self.conditional_moment(2.0, s, cap)
    }

    /// E[min(L, cap)^k | L > s], from the log-normal's truncated moments
    /// (E[L^k; a < L < b] = e^{kμ + k²σ²/2} (Φ(β − kσ) − Φ(α − kσ))).
    fn conditional_moment(&self, k: f64, s: f64, cap: f64) -> f64 {
        let sig = self.sigma;
        let phi = |z: f64| 0.5 * erfc(-z / std::f64::consts::SQRT_2);
        let alpha = if s <= 0.0 {
            f64::NEG_INFINITY
        } else {
            (s.ln() - self.mu) / sig
        };
        let beta = (cap.ln() - self.mu) / sig;
        let p_more = 1.0 - phi(alpha);
        if p_more < 1e-12 {
            return s.powf(k);
        }
        let part = (k * self.mu + k * k * sig * sig / 2.0).exp()
            * (phi(beta - k * sig) - phi(alpha - k * sig));
        (part + cap.powf(k) * (1.0 - phi(beta))) / p_more
    }
}

fn nelder_mead(
    f: impl Fn([f64; 2]) -> f64,
    x0: [f64; 2],
    step: [f64; 2],
    iters: usize,
) -> (f64, f64) {
    let mut pts = [x0, [x0[0] + step[0], x0[1]], [x0[0], x0[1] + step[1]]];
    let mut vals = pts.map(&f);
    for _ in 0..iters {
        let mut idx = [0usize, 1, 2];
        idx.sort_by(|&a, &b| vals[a].total_cmp(&vals[b]));
        let (b, m, w) = (idx[0], idx[1], idx[2]);
        if (vals[w] - vals[b]).abs() < 1e-9 {
            break;
        }
        let c = [(pts[b][0] + pts[m][0]) / 2.0, (pts[b][1] + pts[m][1]) / 2.0];
        let at = |t: f64| [c[0] + t * (pts[w][0] - c[0]), c[1] + t * (pts[w][1] - c[1])];
        let r = at(-1.0);
        let fr = f(r);
        if fr < vals[b] {
            let e = at(-2.0);
            let fe = f(e);
            if fe < fr {
                pts[w] = e;
                vals[w] = fe;
            } else {
                pts[w] = r;
                vals[w] = fr;
            }
        } else if fr < vals[m] {
            pts[w] = r;
            vals[w] = fr;
        } else {
            let k = at(0.5);
            let fk = f(k);
            if fk < vals[w] {
                pts[w] = k;
                vals[w] = fk;
            } else {
                for i in [m, w] {
                    pts[i] = [(pts[i][0] + pts[b][0]) / 2.0, (pts[i][1] + pts[b][1]) / 2.0];
                    vals[i] = f(pts[i]);
                }
            }
        }
    }
    let best = (0..3)
        .min_by(|&a, &b| vals[a].total_cmp(&vals[b]))
        .unwrap_or(0);
    (pts[best][0], pts[best][1])
}

/// Complementary error function (Numerical Recipes' Chebyshev fit, |error| < 1.2e-7).
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Φ⁻¹(p), the standard normal quantile (Acklam's rational approximation, relative error
/// < 1.2e-9 before rounding), for inverse-transform sampling.
pub fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_distr::{Distribution, LogNormal as LN};

    fn draws(n: usize, mean: f64, sigma: f64, seed: u64) -> Vec<f64> {
        let mu = mean.ln() - sigma * sigma / 2.0;
        let d = LN::new(mu, sigma).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| d.sample(&mut rng)).collect()
    }

    /// With no completion seen, every request is expected to run to `max_tokens`, so a fresh
    /// run never dispatches past its budget on optimism.
    #[test]
    fn no_data_means_the_conservative_cap() {
        let m = LengthModel::new(1000);
        assert_eq!(m.expected_new(), 1000.0);
        assert_eq!(m.expected_final(1200), 1000.0);
    }

    /// The complementary error function matches reference values to 2e-7.
    #[test]
    fn erfc_is_accurate() {
        for (x, want) in [
            (0.0, 1.0),
            (1.0, 0.157_299_207),
            (-1.0, 1.842_700_793),
            (2.5, 0.000_406_952),
        ] {
            assert!((erfc(x) - want).abs() < 2e-7, "erfc({x}) = {}", erfc(x));
        }
    }

    /// Fitted to many finished completions alone, the model recovers the mean of the
    /// distribution they were drawn from.
    #[test]
    fn complete_data_recovers_the_distribution() {
        let mut m = LengthModel::new(100_000);
        for x in draws(3000, 3500.0, 1.0, 1) {
            m.observe(x.round().max(1.0) as u32);
        }
        m.refit(&[]);
        let e = m.expected_new();
        assert!((e - 3500.0).abs() / 3500.0 < 0.06, "mean {e}");
        assert!(m.expected_final(5000) > 5000.0);
    }

    /// The short-first bias: early in a run, the finished completions are the short ones.
    /// Treating the requests in flight as censored recovers the true mean; the naive mean of
    /// finished ones is far too low.
    #[test]
    fn censoring_corrects_the_short_first_bias() {
        // 600 requests started together at the same speed; at "time" 1500 tokens, those
        // shorter have finished and the rest are in flight with 1500 streamed.
        let lens = draws(600, 3500.0, 1.0, 7);
        let mut m = LengthModel::new(10_240);
        let mut inflight = Vec::new();
        for l in &lens {
            let l = l.round().max(1.0) as u32;
            if l <= 1500 {
                m.observe(l.min(10_240));
            } else {
                inflight.push(1500u32);
            }
        }
        let naive = m.observed_mean().unwrap();
        m.refit(&inflight);
        let truth = lens.iter().map(|l| l.min(10_240.0)).sum::<f64>() / lens.len() as f64;
        let fitted = m.expected_new();
        assert!(naive < 0.4 * truth, "naive {naive} truth {truth}");
        assert!(
            (fitted - truth).abs() / truth < 0.15,
            "fitted {fitted} truth {truth}"
        );
    }

    /// The mean length given what has streamed is above what has streamed and never above
    /// the cap; from zero it is the distribution's mean.
    #[test]
    fn conditional_means_and_the_cap() {
        let d = LogNormal {
            mu: 7.0,
            sigma: 1.0,
        };
        let c0 = d.conditional_mean(0.0, 1e9);
        assert!((c0 - (7.5f64).exp()).abs() / c0 < 1e-3);
        assert!(d.conditional_mean(5000.0, 10_240.0) <= 10_240.0);
        assert!(d.conditional_mean(5000.0, 10_240.0) > 5000.0);
    }

    /// The conditional second moment is the lognormal's own (E[L²] = e^{2μ+2σ²}) without a
    /// cap, and a request's variance shrinks to nothing at the cap and without a fit.
    #[test]
    fn variance_of_a_final_length() {
        let d = LogNormal {
            mu: 5.0,
            sigma: 1.0,
        };
        let m2 = d.conditional_second_moment(0.0, 1e12);
        assert!((m2 - (12.0f64).exp()).abs() / m2 < 1e-3, "{m2}");
        let mut m = LengthModel::new(4096);
        assert_eq!(m.variance_final(10), 0.0);
        m.set_fit_for_tests(5.0, 1.0);
        let v0 = m.variance_final(0);
        // Var of a lognormal (μ 5, σ 1) is e^{11}(e − 1), less with the cap at 4096.
        assert!(
            v0 > 0.5 * (11.0f64).exp() * (1f64.exp() - 1.0) && v0 < (11.0f64).exp() * 1.72,
            "{v0}"
        );
        assert!(
            m.variance_final(1000) > v0,
            "a long request's end is less certain"
        );
        assert_eq!(m.variance_final(4096), 0.0);
    }

    /// The expected longest remaining completion grows with the number in flight and stays
    /// within the cap.
    #[test]
    fn max_remaining_grows_with_the_number_in_flight() {
        let mut m = LengthModel::new(10_240);
        for x in draws(500, 3500.0, 1.0, 3) {
            m.observe(x.round().max(1.0) as u32);
        }
        m.refit(&[]);
        let one = m.expected_max_remaining(&[0]);
        let many = m.expected_max_remaining(&[0; 100]);
        assert!(many > one && many <= 10_240.0, "{one} {many}");
    }

    /// The normal quantile is the inverse of the CDF built on `erfc`, from the far tails to
    /// the median.
    #[test]
    fn the_normal_quantile_inverts_erfc() {
        for &p in &[1e-9, 1e-4, 0.01, 0.024, 0.2, 0.5, 0.8, 0.976, 0.999] {
            let z = inverse_normal_cdf(p);
            let back = 0.5 * erfc(-z / std::f64::consts::SQRT_2);
            assert!(
                (back - p).abs() <= 1e-6 * p.max(1e-3),
                "p {p}: z {z}, back {back}"
            );
        }
        assert_eq!(inverse_normal_cdf(0.5), 0.0);
    }

    /// Conditional draws respect what has streamed and the cap, and their mean is the
    /// conditional mean the budget gate uses.
    #[test]
    fn conditional_draws_match_the_conditional_mean() {
        let mut m = LengthModel::new(10_240);
        assert_eq!(m.sample_final(0, 0.5), 10_240.0, "no fit: the cap");
        m.set_fit_for_tests(3500f64.ln() - 0.5, 1.0);
        for &s in &[0u32, 2000, 8000] {
            let n = 20_000;
            let draws: Vec<f64> = (0..n)
                .map(|i| m.sample_final(s, (i as f64 + 0.5) / n as f64))
                .collect();
            assert!(draws.iter().all(|&x| x >= f64::from(s) && x <= 10_240.0));
            let mean = draws.iter().sum::<f64>() / n as f64;
            let want = m.expected_final(s);
            assert!(
                (mean - want).abs() < 0.005 * want,
                "s {s}: {mean} vs {want}"
            );
        }
    }
}
