//! The pure, deterministic parts of the simulation: the mock "tokenizer", the completion
//! plan of a prompt, the fault mix and the capacity arithmetic. Nothing here touches time,
//! I/O or shared state, so all of it is unit tested directly.
//!
//! Invariants:
//! - Token id `t` (always `< VOCAB`) detokenizes to `" w{t}"`, so detokenizing is
//!   concatenation and text and ids can never disagree.
//! - A plan depends only on `(seed, prompt key, limits)`: the same prompt gets the same
//!   length and the same ids on every attempt, and a capped plan is a prefix of the
//!   uncapped one (lengths are drawn before ids from the same stream).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};

/// Size of the mock vocabulary: every generated id is below it.
pub(crate) const VOCAB: u32 = 32_000;
/// The id reported as the matched stop token (Qwen's `<|im_end|>`); never part of the output.
pub(crate) const EOS_ID: u32 = 151_645;

/// FNV-1a 64: a hash that is stable across Rust releases (unlike `DefaultHasher`), so
/// seeds and prompt keys give the same outputs everywhere.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64 finaliser: spreads a seed so that nearby seeds give unrelated streams.
pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Key of a text prompt (tagged so a text never collides with an id list by construction).
pub(crate) fn text_key(text: &str) -> u64 {
    let mut bytes = Vec::with_capacity(text.len() + 2);
    bytes.extend_from_slice(b"t:");
    bytes.extend_from_slice(text.as_bytes());
    fnv1a(&bytes)
}

/// Key of a token-id prompt.
pub(crate) fn ids_key(ids: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(ids.len() * 4 + 2);
    bytes.extend_from_slice(b"i:");
    for id in ids {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    fnv1a(&bytes)
}

/// The mock tokenizer: one token per whitespace-separated word. A word `w{t}` with
/// `t < VOCAB` maps back to `t` (so mock output fed back in round-trips); any other word
/// maps to a stable hash of itself.
pub(crate) fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace().map(word_id).collect()
}

fn word_id(word: &str) -> u32 {
    if let Some(id) = word.strip_prefix('w').and_then(|d| d.parse::<u32>().ok()) {
        if id < VOCAB && !word[1..].starts_with('+') {
            return id;
        }
    }
    // The modulo keeps the value below VOCAB, so the cast cannot truncate.
    (fnv1a(word.as_bytes()) % u64::from(VOCAB)) as u32
}

/// Text of a run of token ids: the concatenation of `" w{t}"`.
pub(crate) fn detokenize(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 8);
    let mut buf = itoa::Buffer::new();
    for id in ids {
        s.push_str(" w");
        s.push_str(buf.format(*id));
    }
    s
}

/// Why a plan ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// The model "emitted EOS" before the cap.
    Stop,
    /// The cap (`max_tokens`, or what the context leaves) cut it.
    Length,
}

/// What a request will generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub ids: Vec<u32>,
    pub finish: Finish,
}

/// The completion-length distribution: lognormal with a given mean (of the
/// distribution, not of the underlying normal) and sigma, floored at `min_tokens`.
#[derive(Debug, Clone)]
pub(crate) struct LengthModel {
    dist: LogNormal<f64>,
    min_tokens: u32,
    seed: u64,
}

/// Limits a request puts on its plan.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Effective cap (already clamped to what the context leaves).
    pub max_tokens: u32,
    /// Request-level minimum (`min_new_tokens` / `min_tokens`), on top of the server's.
    pub min_tokens: u32,
    /// Generate exactly `max_tokens` (SGLang/vLLM `ignore_eos`).
    pub ignore_eos: bool,
}

impl LengthModel {
    /// `mu = ln(mean) - sigma²/2` makes `mean` the mean of the lognormal itself.
    pub(crate) fn new(mean: f64, sigma: f64, min_tokens: u32, seed: u64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            mean.is_finite() && mean > 0.0,
            "mean_tokens must be > 0, got {mean}"
        );
        anyhow::ensure!(
            sigma.is_finite() && sigma >= 0.0,
            "sigma must be >= 0, got {sigma}"
        );
        let mu = mean.ln() - sigma * sigma / 2.0;
        let dist = LogNormal::new(mu, sigma)
            .map_err(|e| anyhow::anyhow!("bad lognormal (mean {mean}, sigma {sigma}): {e}"))?;
        Ok(Self {
            dist,
            min_tokens,
            seed,
        })
    }

    fn rng(&self, key: u64) -> StdRng {
        StdRng::seed_from_u64(splitmix64(self.seed) ^ splitmix64(key))
    }

    /// The uncapped length this prompt "wants" (what the model would say given room).
    #[cfg(test)]
    pub(crate) fn natural_len(&self, key: u64) -> u32 {
        let mut rng = self.rng(key);
        Self::draw(&self.dist, &mut rng).max(self.min_tokens)
    }

    fn draw(dist: &LogNormal<f64>, rng: &mut StdRng) -> u32 {
        // `as` saturates for floats: a huge draw becomes u32::MAX, which the cap then cuts.
        dist.sample(rng).round() as u32
    }

    /// The full plan of a prompt under `limits`.
    pub(crate) fn plan(&self, key: u64, limits: Limits) -> Plan {
        let mut rng = self.rng(key);
        let natural = Self::draw(&self.dist, &mut rng)
            .max(self.min_tokens)
            .max(limits.min_tokens);
        let (len, finish) = if limits.ignore_eos || natural >= limits.max_tokens {
            (limits.max_tokens, Finish::Length)
        } else {
            (natural, Finish::Stop)
        };
        let ids = (0..len).map(|_| rng.random_range(0..VOCAB)).collect();
        Plan { ids, finish }
    }
}

/// A fault injected into one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    None,
    Http500,
    Http429,
    Hang,
    Malformed,
    Drop,
}

/// Shares of each fault; their sum is at most 1 (checked at start-up).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FaultMix {
    pub http_500: f64,
    pub http_429: f64,
    pub hang: f64,
    pub malformed: f64,
    pub drop: f64,
}

impl FaultMix {
    /// Fails unless every share is in [0, 1] and they sum to at most 1.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        let shares = [
            ("fail_500", self.http_500),
            ("fail_429", self.http_429),
            ("hang", self.hang),
            ("malformed", self.malformed),
            ("drop_mid_stream", self.drop),
        ];
        for (name, p) in shares {
            anyhow::ensure!(
                (0.0..=1.0).contains(&p),
                "{name} must be a share in [0, 1], got {p}"
            );
        }
        let sum: f64 = shares.iter().map(|(_, p)| p).sum();
        anyhow::ensure!(sum <= 1.0 + 1e-9, "fault shares sum to {sum}, more than 1");
        Ok(())
    }

    /// Maps one uniform draw `u` in [0, 1) to a fault: consecutive intervals of the shares.
    pub(crate) fn pick(&self, u: f64) -> Fault {
        let mut edge = 0.0;
        for (p, fault) in [
            (self.http_500, Fault::Http500),
            (self.http_429, Fault::Http429),
            (self.hang, Fault::Hang),
            (self.malformed, Fault::Malformed),
            (self.drop, Fault::Drop),
        ] {
            edge += p;
            if u < edge {
                return fault;
            }
        }
        Fault::None
    }
}

/// Tokens per real second one request gets when `n_active` share the server:
/// `min(per_request, capacity / n)`, sped up by `time_scale`.
pub(crate) fn per_request_rate(
    capacity_tps: f64,
    per_request_tps: f64,
    n_active: usize,
    time_scale: f64,
) -> f64 {
    if n_active == 0 {
        return 0.0;
    }
    (capacity_tps / n_active as f64).min(per_request_tps) * time_scale
}

/// Whole tokens earned over `dt_s` at `rate` plus the fraction carried from before, capped
/// at `remaining`. Returns the grant and the new carry (zero once the request is done, and
/// only fractional otherwise, so no burst is ever banked).
pub(crate) fn grant(rate: f64, dt_s: f64, carry: f64, remaining: u32) -> (u32, f64) {
    let earned = rate * dt_s + carry;
    // The epsilon stops float error (0.3 × 10 = 2.999…) from losing a token.
    let whole = (earned + 1e-9).floor();
    if whole >= f64::from(remaining) {
        return (remaining, 0.0);
    }
    // 0 <= whole < remaining <= u32::MAX here, so the cast is exact.
    (whole as u32, (earned - whole).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: u32) -> Limits {
        Limits {
            max_tokens: max,
            min_tokens: 0,
            ignore_eos: false,
        }
    }

    /// Over many prompts the completion lengths have the configured mean.
    #[test]
    fn lognormal_mean_matches_config_over_many_prompts() {
        let m = LengthModel::new(3500.0, 1.0, 1, 7).expect("model");
        let n = 40_000u64;
        let total: f64 = (0..n)
            .map(|i| f64::from(m.natural_len(text_key(&format!("prompt {i}")))))
            .sum();
        let mean = total / n as f64;
        // Standard error is ~23 tokens here; 4 % is > 5 standard errors.
        assert!((mean - 3500.0).abs() < 140.0, "mean {mean}");
    }

    /// The configured mean holds whatever the seed.
    #[test]
    fn lognormal_mean_holds_across_seeds() {
        for seed in 0..5 {
            let m = LengthModel::new(200.0, 0.5, 1, seed).expect("model");
            let n = 10_000u64;
            let total: f64 = (0..n).map(|i| f64::from(m.natural_len(i))).sum();
            let mean = total / n as f64;
            assert!((mean - 200.0).abs() < 6.0, "seed {seed}: mean {mean}");
        }
    }

    /// A prompt's output is a pure function of seed and prompt (so a retry regenerates it), and
    /// a capped output is the prefix of the uncapped one.
    #[test]
    fn plans_are_deterministic_and_capped_plans_are_prefixes() {
        let m = LengthModel::new(100.0, 1.0, 1, 42).expect("model");
        let key = text_key("hello world");
        let a = m.plan(key, limits(u32::MAX));
        assert_eq!(a, m.plan(key, limits(u32::MAX)));
        assert_eq!(a.finish, Finish::Stop);
        let cap = (a.ids.len() as u32 / 2).max(1);
        let b = m.plan(key, limits(cap));
        assert_eq!(b.finish, Finish::Length);
        assert_eq!(b.ids[..], a.ids[..cap as usize]);
        // Another seed gives another output.
        let other = LengthModel::new(100.0, 1.0, 1, 43).expect("model");
        assert_ne!(other.plan(key, limits(u32::MAX)), a);
    }

    /// A plan is never shorter than the minimum asked for, runs to the cap with `ignore_eos`,
    /// and is empty under a zero cap.
    #[test]
    fn plan_respects_minimums_and_ignore_eos() {
        let m = LengthModel::new(5.0, 0.0, 8, 1).expect("model");
        assert_eq!(m.plan(1, limits(100)).ids.len(), 8);
        let l = Limits {
            max_tokens: 30,
            min_tokens: 20,
            ignore_eos: false,
        };
        assert_eq!(m.plan(1, l).ids.len(), 20);
        let l = Limits {
            max_tokens: 30,
            min_tokens: 0,
            ignore_eos: true,
        };
        let p = m.plan(1, l);
        assert_eq!((p.ids.len(), p.finish), (30, Finish::Length));
        assert_eq!(m.plan(1, limits(0)).ids.len(), 0);
    }

    /// Ids detokenize to `" w{id}"` words that tokenize back to the same ids, and any text
    /// tokenizes to one in-vocabulary id per word, stably.
    #[test]
    fn token_text_and_ids_round_trip() {
        let ids = vec![0, 17, 31_999, 5];
        let text = detokenize(&ids);
        assert_eq!(text, " w0 w17 w31999 w5");
        assert_eq!(tokenize(&text), ids);
        // Foreign words still give one in-vocabulary id each, stably.
        let t = tokenize("Hello,  world\n w99999 w+5");
        assert_eq!(t.len(), 4);
        assert!(t.iter().all(|&i| i < VOCAB));
        assert_eq!(t, tokenize("Hello, world w99999 w+5"));
    }

    /// Each request gets an even share of the capacity, never more than the per-request
    /// ceiling, both times the time scale; nothing in flight gets nothing.
    #[test]
    fn capacity_is_shared_then_capped_per_request() {
        assert_eq!(per_request_rate(850.0, 60.0, 1, 1.0), 60.0);
        assert_eq!(per_request_rate(850.0, 60.0, 10, 1.0), 60.0);
        assert_eq!(per_request_rate(850.0, 60.0, 100, 1.0), 8.5);
        assert_eq!(per_request_rate(1000.0, 1000.0, 4, 10.0), 2500.0);
        assert_eq!(per_request_rate(1000.0, 1000.0, 0, 10.0), 0.0);
    }

    /// Fractions of a token carry from tick to tick without being lost, and a grant never
    /// exceeds what the request has left.
    #[test]
    fn grants_carry_fractions_without_losing_or_banking_tokens() {
        // 0.3 tokens per tick: 10 ticks give exactly 3 tokens.
        let (mut carry, mut total) = (0.0, 0u32);
        for _ in 0..10 {
            let (g, c) = grant(60.0, 0.005, carry, 1000);
            total += g;
            carry = c;
        }
        assert_eq!(total, 3);
        assert!(carry < 1.0);
        // Capped at the remaining tokens, carry reset.
        assert_eq!(grant(1e6, 1.0, 0.5, 7), (7, 0.0));
    }

    /// The fault rates split the unit interval in a fixed order, the rest meaning no fault;
    /// rates that sum past 1 or are negative are refused.
    #[test]
    fn fault_mix_partitions_the_unit_interval() {
        let mix = FaultMix {
            http_500: 0.1,
            http_429: 0.2,
            hang: 0.0,
            malformed: 0.1,
            drop: 0.1,
        };
        mix.validate().expect("valid");
        assert_eq!(mix.pick(0.05), Fault::Http500);
        assert_eq!(mix.pick(0.25), Fault::Http429);
        assert_eq!(mix.pick(0.35), Fault::Malformed);
        assert_eq!(mix.pick(0.45), Fault::Drop);
        assert_eq!(mix.pick(0.55), Fault::None);
        let bad = FaultMix {
            http_500: 0.7,
            http_429: 0.7,
            ..FaultMix::default()
        };
        assert!(bad.validate().is_err());
        let neg = FaultMix {
            hang: -0.1,
            ..FaultMix::default()
        };
        assert!(neg.validate().is_err());
    }
}
