//! The KV-cache batch of `spool mock-server --kv-tokens N`: what a continuous-batching server
//! (vLLM, SGLang) does with the requests it is sent, in simulated time, step by step.
//!
//! The model:
//! - **Admission.** Requests wait in a FIFO queue and are admitted, oldest first, while the
//!   KV cache has room for their whole context (prompt, plus what they had generated before
//!   a preemption) and fewer than `max_running` run. The head of the queue blocks the rest
//!   (vLLM's and SGLang's FIFO policy).
//! - **Growth and preemption.** Every running request holds one KV token per token of its
//!   context and gains one per decode step. When the next step would not fit, the newest
//!   running request is preempted (vLLM's recompute mode, SGLang's retract): its KV is freed
//!   and it goes back to the front of the queue, keeping what it has generated; when it is
//!   admitted again its whole context is prefilled again — work done twice.
//! - **Step cost.** A decode step costs `max(step_s, seq_s × n) + kv_s × kv_used`: flat while
//!   the batch is small (the weights are read once per step), growing with the batch past
//!   `step_s / seq_s` sequences, and with the KV read by attention. Prefill costs `prefill_s`
//!   per uncached prompt token, at most `chunk` tokens per step, and shares the step with
//!   decoding (chunked prefill). A `speed` factor divides every cost (a server slowed by a
//!   neighbour, or recovered).
//! - **Prefix cache** (radix-style). Prompts are cut into blocks of `block` tokens, each
//!   named by a hash chained over the blocks before it; a prompt prefills only from its first
//!   block the cache lacks (at least one token is always computed). A prompt's blocks enter
//!   the cache when it is admitted (as a radix tree's nodes do: a request admitted after it
//!   shares what it is computing). Cached blocks use free KV only: they are evicted least
//!   recently used as soon as running requests need the room.
//!
//! Invariants: `used` is the sum of the running requests' held tokens; a request is in
//! exactly one of `running` and `waiting`; time is banked only while something runs (an idle
//! batch starts afresh); a step is atomic (its tokens are all granted at its end).

use std::collections::{HashMap, VecDeque};

use super::sim::splitmix64;

/// The server's shape: capacity, costs, limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct KvParams {
    /// KV cache capacity, tokens.
    pub kv_tokens: u64,
    /// Seconds of a decode step with a small batch (one over a lone request's tokens/s).
    pub step_s: f64,
    /// Seconds of compute per sequence in a decode step (one over the throughput ceiling).
    pub seq_s: f64,
    /// Seconds per KV token resident, per decode step (attention reading the cache).
    pub kv_s: f64,
    /// Seconds per prefilled token.
    pub prefill_s: f64,
    /// Most requests running at once (0: only the KV cache limits them).
    pub max_running: usize,
    /// Most prefill tokens per step.
    pub chunk: u32,
    /// Prefix-cache block, tokens.
    pub block: u32,
}

/// What the batch has done since it started: the counters a server exports.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvStats {
    /// Requests preempted (vLLM `num_preemptions_total`, SGLang retractions).
    pub preemptions: u64,
    /// Prompt tokens of the requests admitted (first admission only).
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache.
    pub cached_tokens: u64,
    /// Tokens prefilled (computed), recomputation after preemption included.
    pub prefilled_tokens: u64,
    /// Tokens decoded.
    pub generated_tokens: u64,
    /// Simulated seconds spent executing steps.
    pub busy_s: f64,
}

impl KvStats {
    /// Share of admitted prompt tokens served from the prefix cache.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// A gauge reading of the batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvGauges {
    pub running: usize,
    pub waiting: usize,
    /// KV tokens held by running requests.
    pub used: u64,
    /// Capacity, tokens.
    pub capacity: u64,
}

struct Seq {
    id: u64,
    prompt: u32,
    /// Chained hashes of the prompt's full blocks.
    blocks: Vec<u64>,
    total: u32,
    produced: u32,
    /// Context tokens still to prefill before it decodes.
    prefill_left: u32,
    /// KV tokens it holds while running.
    held: u64,
    /// Admitted before (its prompt already counted in the hit rate).
    seen: bool,
}

/// The prefix cache: block hash → last use, with a lazily cleaned LRU queue.
#[derive(Default)]
struct PrefixCache {
    last: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl PrefixCache {
    fn len(&self) -> usize {
        self.last.len()
    }

    fn contains(&self, h: u64) -> bool {
        self.last.contains_key(&h)
    }

    fn touch(&mut self, h: u64) {
        self.clock += 1;
        self.last.insert(h, self.clock);
        self.order.push_back((h, self.clock));
        if self.order.len() > 4 * self.last.len() + 1024 {
            let last = &self.last;
            self.order.retain(|(h, t)| last.get(h) == Some(t));
        }
    }

    /// Drops least recently used blocks until at most `keep` remain.
    fn evict_to(&mut self, keep: usize) {
        while self.last.len() > keep {
            let Some((h, t)) = self.order.pop_front() else {
                self.last.clear();
                return;
            };
            if self.last.get(&h) == Some(&t) {
                self.last.remove(&h);
            }
        }
    }
}

/// Chained hashes of the full `block`-token blocks of `prompt`.
pub(crate) fn block_hashes(prompt: &[u32], block: u32) -> Vec<u64> {
    let b = block.max(1) as usize;
    let mut out = Vec::with_capacity(prompt.len() / b);
    let mut h = 0x6b76_6361_6368_6521u64;
    for chunk in prompt.chunks_exact(b) {
        for &t in chunk {
            h = splitmix64(h ^ u64::from(t));
        }
        out.push(h);
    }
    out
}

/// A request's progress after an advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Update {
    pub id: u64,
    pub produced: u32,
    pub done: bool,
}

/// The batch.
pub(crate) struct KvBatch {
    p: KvParams,
    /// Divides every cost: 1 normal, 0.5 half as fast.
    speed: f64,
    capacity: u64,
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    used: u64,
    cache: PrefixCache,
    /// Simulated seconds granted and not yet spent on a step.
    budget: f64,
    stats: KvStats,
}

impl KvBatch {
    pub(crate) fn new(p: KvParams) -> Self {
        Self {
            capacity: p.kv_tokens,
            p,
            speed: 1.0,
            running: Vec::new(),
            waiting: VecDeque::new(),
            used: 0,
            cache: PrefixCache::default(),
            budget: 0.0,
            stats: KvStats::default(),
        }
    }

    /// Queues a request of `total` tokens to generate after `prompt`.
    pub(crate) fn add(&mut self, id: u64, prompt: &[u32], total: u32) {
        let n = u32::try_from(prompt.len()).unwrap_or(u32::MAX).max(1);
        self.waiting.push_back(Seq {
            id,
            prompt: n,
            blocks: block_hashes(prompt, self.p.block),
            total,
            produced: 0,
            prefill_left: 0,
            held: 0,
            seen: false,
        });
    }

    /// Takes a request out (done elsewhere, aborted, client gone), freeing its KV.
    pub(crate) fn remove(&mut self, id: u64) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.used -= s.held;
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        }
    }

    /// Sets the speed factor (1 normal; 0.5 every step takes twice as long).
    pub(crate) fn set_speed(&mut self, speed: f64) {
        self.speed = speed.max(1e-6);
    }

    /// Sets the KV capacity (a neighbour taking memory, or giving it back); running
    /// requests past it are preempted at the next step.
    pub(crate) fn set_capacity(&mut self, tokens: u64) {
        self.capacity = tokens.max(1);
    }

    pub(crate) fn stats(&self) -> KvStats {
        self.stats
    }

    pub(crate) fn gauges(&self) -> KvGauges {
        KvGauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used: self.used,
            capacity: self.capacity,
        }
    }

    /// Requests running or waiting.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    fn free_for_cache(&mut self) {
        let free = self.capacity.saturating_sub(self.used);
        let blocks = (free / u64::from(self.p.block.max(1))) as usize;
        if self.cache.len() > blocks {
            self.cache.evict_to(blocks);
        }
    }

    /// Admits from the queue while KV and `max_running` allow.
    fn admit(&mut self) {
        while let Some(head) = self.waiting.front() {
            if self.p.max_running > 0 && self.running.len() >= self.p.max_running {
                break;
            }
            let need = u64::from(head.prompt) + u64::from(head.produced);
            // A request larger than the whole cache still runs alone (never stuck forever).
            if self.used + need > self.capacity && !self.running.is_empty() {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let hit = s
                .blocks
                .iter()
                .take_while(|h| self.cache.contains(**h))
                .count() as u64
                * u64::from(self.p.block);
            let hit = hit.min(u64::from(s.prompt) - 1) as u32;
            for h in &s.blocks {
                self.cache.touch(*h);
            }
            if !s.seen {
                s.seen = true;
                self.stats.prompt_tokens += u64::from(s.prompt);
                self.stats.cached_tokens += u64::from(hit);
            }
            s.prefill_left = s.prompt + s.produced - hit;
            s.held = need;
            self.used += need;
            self.running.push(s);
        }
        self.free_for_cache();
    }

    /// Preempts the newest running requests until every decoding one can grow by a token.
    fn make_room(&mut self) {
        loop {
            let decoding = self.running.iter().filter(|s| s.prefill_left == 0).count() as u64;
            if self.used + decoding <= self.capacity || self.running.len() <= 1 {
                return;
            }
            let Some(mut s) = self.running.pop() else {
                return;
            };
            self.used -= s.held;
            s.held = 0;
            self.stats.preemptions += 1;
            self.waiting.push_front(s);
        }
    }

    fn decode_cost(&self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        self.p.step_s.max(self.p.seq_s * n as f64) + self.p.kv_s * self.used as f64
    }

    /// Grants `dt` more simulated seconds and runs every step they pay for; returns the
    /// requests that moved.
    pub(crate) fn advance(&mut self, dt: f64) -> Vec<Update> {
        let mut moved: HashMap<u64, Update> = HashMap::new();
        self.budget += dt.max(0.0);
        loop {
            self.admit();
            if self.running.is_empty() {
                self.budget = 0.0;
                break;
            }
            self.make_room();
            if !self.bulk(&mut moved) && !self.step(&mut moved) {
                break;
            }
        }
        moved.into_values().collect()
    }

    /// Several plain decode steps at once, while nothing changes the batch (no prefill, no
    /// admission possible, no request ending, no overflow). False when that does not apply.
    fn bulk(&mut self, moved: &mut HashMap<u64, Update>) -> bool {
        if self.running.iter().any(|s| s.prefill_left > 0) {
            return false;
        }
        let admissible = self.waiting.front().is_some_and(|h| {
            (self.p.max_running == 0 || self.running.len() < self.p.max_running)
                && self.used + u64::from(h.prompt) + u64::from(h.produced) <= self.capacity
        });
        if admissible {
            return false;
        }
        let n = self.running.len() as u64;
        let to_finish = self
            .running
            .iter()
            .map(|s| s.total.saturating_sub(s.produced))
            .min()
            .unwrap_or(0) as u64;
        let to_overflow = self.capacity.saturating_sub(self.used) / n;
        // Cost of k steps: k·t1 + a·k(k−1), the KV term growing by n tokens a step.
        let t1 = self.decode_cost(n as usize) / self.speed;
        let a = self.p.kv_s * n as f64 / (2.0 * self.speed);
        let fit = if a > 0.0 {
            let b = t1 - a;
            ((-b + (b * b + 4.0 * a * self.budget).sqrt()) / (2.0 * a)).floor()
        } else {
            (self.budget / t1).floor()
        };
        let k = (fit.max(0.0) as u64).min(to_finish).min(to_overflow);
        if k < 2 {
            return false;
        }
        let kf = k as f64;
        let cost = kf * t1 + a * kf * (kf - 1.0);
        self.budget -= cost;
        self.stats.busy_s += cost;
        self.stats.generated_tokens += k * n;
        self.used += k * n;
        let k32 = k as u32;
        for s in &mut self.running {
            s.produced += k32;
            s.held += k;
        }
        self.finish(moved);
        true
    }

    /// One step (decode, and prefill chunks); false when the budget does not pay for it.
    fn step(&mut self, moved: &mut HashMap<u64, Update>) -> bool {
        let decoding = self.running.iter().filter(|s| s.prefill_left == 0).count();
        let mut chunk = self.p.chunk.max(1);
        let mut prefill = 0u32;
        for s in &self.running {
            if chunk == 0 {
                break;
            }
            let x = s.prefill_left.min(chunk);
            prefill += x;
            chunk -= x;
        }
        let cost =
            (self.decode_cost(decoding) + self.p.prefill_s * f64::from(prefill)) / self.speed;
        if self.budget < cost {
            return false;
        }
        self.budget -= cost;
        self.stats.busy_s += cost;
        self.stats.prefilled_tokens += u64::from(prefill);
        let mut chunk = self.p.chunk.max(1);
        let mut grown = 0u64;
        for s in &mut self.running {
            if s.prefill_left == 0 {
                s.produced += 1;
                s.held += 1;
                grown += 1;
            } else if chunk > 0 {
                let x = s.prefill_left.min(chunk);
                chunk -= x;
                s.prefill_left -= x;
                if s.prefill_left == 0 {
                    // The step that ends a prefill samples the next token.
                    s.produced += 1;
                    s.held += 1;
                    grown += 1;
                }
            }
        }
        self.used += grown;
        self.stats.generated_tokens += grown;
        self.finish(moved);
        self.free_for_cache();
        true
    }

    /// Records every running request's progress and takes out those that are done.
    fn finish(&mut self, moved: &mut HashMap<u64, Update>) {
        let mut freed = 0;
        self.running.retain(|s| {
            let done = s.produced >= s.total;
            moved.insert(
                s.id,
                Update {
                    id: s.id,
                    produced: s.produced.min(s.total),
                    done,
                },
            );
            if done {
                freed += s.held;
            }
            !done
        });
        self.used -= freed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kv: u64) -> KvParams {
        KvParams {
            kv_tokens: kv,
            step_s: 1.0 / 60.0,
            seq_s: 1.0 / 850.0,
            kv_s: 0.0,
            prefill_s: 0.0,
            max_running: 0,
            chunk: 8192,
            block: 16,
        }
    }

    fn prompt(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 100_000 + i).collect()
    }

    /// Runs `n` requests of `len` tokens on average (spread from a quarter to 1.75×),
    /// refilled as they finish, for `secs` simulated seconds in 50 ms grants.
    fn closed_loop(p: KvParams, n: usize, prompt_len: usize, len: u32, secs: f64) -> KvStats {
        let mut b = KvBatch::new(p);
        let length = |i: u64| len / 4 + (splitmix64(i) % u64::from(3 * len / 2)) as u32;
        let mut next = 0u64;
        for _ in 0..n {
            b.add(next, &prompt(next as u32, prompt_len), length(next));
            next += 1;
        }
        let mut t = 0.0;
        while t < secs {
            for u in b.advance(0.05) {
                if u.done {
                    b.add(next, &prompt(next as u32, prompt_len), length(next));
                    next += 1;
                }
            }
            t += 0.05;
        }
        b.stats()
    }

    /// Without KV pressure the batch runs at `min(n / step_s, 1 / seq_s)` tokens/s: a lone
    /// request at 60 tok/s, a full batch at the 850 tok/s ceiling.
    #[test]
    fn decode_speed_follows_the_step_cost() {
        let solo = closed_loop(params(10_000_000), 1, 10, 1000, 100.0);
        let tps = solo.generated_tokens as f64 / 100.0;
        assert!((tps - 60.0).abs() < 1.5, "solo {tps}");
        let full = closed_loop(params(10_000_000), 150, 10, 1000, 100.0);
        let tps = full.generated_tokens as f64 / 100.0;
        assert!((tps - 850.0).abs() < 15.0, "full {tps}");
        assert_eq!(full.preemptions, 0);
    }

    /// With a small cache the throughput curve has a knee: it rises with concurrency while
    /// the requests fit, and past the knee it falls as preemptions make the server
    /// recompute what it had already computed.
    #[test]
    fn throughput_has_a_knee_and_falls_past_it() {
        let p = KvParams {
            kv_tokens: 60_000,
            prefill_s: 1.0 / 2000.0,
            seq_s: 1.0 / 3000.0,
            ..params(0)
        };
        let at = |n| {
            let s = closed_loop(p, n, 200, 1500, 300.0);
            (s.generated_tokens as f64 / 300.0, s.preemptions)
        };
        let curve: Vec<(usize, f64, u64)> = [16, 32, 48, 64, 96, 128, 192]
            .into_iter()
            .map(|n| {
                let (t, p) = at(n);
                (n, t, p)
            })
            .collect();
        eprintln!("{curve:?}");
        let (t16, t32) = (curve[0].1, curve[1].1);
        assert_eq!(
            (curve[0].2, curve[1].2),
            (0, 0),
            "no preemption while all fit"
        );
        assert!(t32 > 1.5 * t16, "rises: {t16} -> {t32}");
        let peak = curve.iter().map(|c| c.1).fold(0.0, f64::max);
        let last = curve.last().unwrap();
        assert!(last.2 > 0, "overflow preempts");
        assert!(last.1 < 0.9 * peak, "falls past the knee: {curve:?}");
    }

    /// A preempted request keeps what it generated and resumes after its context is
    /// prefilled again; the newest request is the one preempted.
    #[test]
    fn the_newest_request_is_preempted_and_recomputed() {
        let mut b = KvBatch::new(KvParams {
            kv_tokens: 100,
            block: 64,
            ..params(0)
        });
        b.add(1, &prompt(1, 30), 60);
        b.add(2, &prompt(2, 30), 60);
        // Both fit (60 of 100); they grow 2 tokens a step and overflow after 20 steps.
        b.advance(21.0 / 60.0);
        let g = b.gauges();
        assert_eq!((g.running, g.waiting), (1, 1));
        assert_eq!(b.stats().preemptions, 1);
        assert_eq!(b.waiting.front().map(|s| s.id), Some(2));
        let kept = b.waiting.front().map(|s| s.produced).unwrap_or(0);
        assert!(kept >= 19, "kept {kept}");
        // Request 1 ends, 2 comes back: its prompt and its tokens are prefilled again.
        let before = b.stats().prefilled_tokens;
        let mut done = Vec::new();
        for _ in 0..400 {
            done.extend(b.advance(0.05).into_iter().filter(|u| u.done).map(|u| u.id));
        }
        assert_eq!(done, vec![1, 2]);
        assert!(b.stats().prefilled_tokens - before >= 30 + u64::from(kept));
        assert_eq!(b.gauges().used, 0);
    }

    /// A prompt whose prefix was prefilled before is served from the cache from its first
    /// missing block; the hit rate counts the tokens found.
    #[test]
    fn the_prefix_cache_skips_what_was_prefilled() {
        let mut b = KvBatch::new(KvParams {
            prefill_s: 0.001,
            ..params(1_000_000)
        });
        let shared = prompt(7, 160);
        let mut a = shared.clone();
        a.extend([1, 2, 3, 4]);
        let mut c = shared.clone();
        c.extend([9, 9, 9, 9, 9, 9, 9, 9]);
        b.add(1, &a, 5);
        while b.len() > 0 {
            b.advance(0.1);
        }
        b.add(2, &c, 5);
        while b.len() > 0 {
            b.advance(0.1);
        }
        let s = b.stats();
        assert_eq!(s.prompt_tokens, 164 + 168);
        assert_eq!(s.cached_tokens, 160);
        assert_eq!(s.prefilled_tokens, 164 + 8);
    }

    /// A server slowed to half speed generates half as much in the same time; a smaller
    /// capacity preempts what no longer fits.
    #[test]
    fn speed_and_capacity_change_at_run_time() {
        let mut b = KvBatch::new(params(1_000_000));
        for i in 0..10 {
            b.add(i, &prompt(i as u32, 10), 100_000);
        }
        b.advance(10.0);
        let fast = b.stats().generated_tokens;
        b.set_speed(0.5);
        b.advance(10.0);
        let slow = b.stats().generated_tokens - fast;
        assert!(
            (slow as f64 / fast as f64 - 0.5).abs() < 0.05,
            "{fast} {slow}"
        );
        b.set_capacity(3000);
        b.advance(0.1);
        assert!(b.gauges().used <= 3000 + 10);
        assert!(b.stats().preemptions > 0);
    }
}
