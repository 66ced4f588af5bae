//! The pure, deterministic parts of the simulation: the mock "tokenizer", the completion
//! plan of a prompt, the fault mix and the capacity arithmetic. Nothing here touches time,
//! I/O or shared state, so all of it is unit tested directly.
//!
//! Invariants:
//! - Every output id has a text of its own and detokenizing is concatenation, so text and
//!   ids can never disagree: word id `t < VOCAB` reads `" w{t}"`, the marker ids
//!   [`THINK_OPEN`], [`THINK_CLOSE`], [`TOOL_OPEN`], [`TOOL_CLOSE`] read their tags, and
//!   `CHAR_BASE + c` reads the one character `c` (the JSON of a tool call).
//! - A plan depends only on `(seed, prompt key, limits)`: the same prompt gets the same
//!   length and the same ids on every attempt, and a capped plan is a prefix of the
//!   uncapped one (lengths are drawn before ids from the same stream). A plain plan (no
//!   think block, no tool call) draws exactly the ids it always did.
//! - A think block takes about 60 % of the drawn length (`(3n + 2) / 5` words), the answer
//!   the rest; a tool call replaces the answer words.

use std::ops::Range;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};

/// Size of the mock vocabulary: every generated id is below it.
pub(crate) const VOCAB: u32 = 32_000;
/// The id reported as the matched stop token (Qwen's `<|im_end|>`); never part of the output.
pub(crate) const EOS_ID: u32 = 151_645;

/// Opens a think block (Qwen3's `<think>`), with the newline its template puts after it.
pub(crate) const THINK_OPEN: u32 = 32_001;
/// Closes a think block, with the blank line before the answer.
pub(crate) const THINK_CLOSE: u32 = 32_002;
/// Opens a tool call (Hermes/Qwen3 `<tool_call>`).
pub(crate) const TOOL_OPEN: u32 = 32_003;
/// Closes a tool call.
pub(crate) const TOOL_CLOSE: u32 = 32_004;
/// Id `CHAR_BASE + c` is the single character `c`: spells the JSON of a tool call, so its
/// text stays the concatenation of its ids' texts. Above every Unicode scalar plus the
/// vocabulary, and past [`EOS_ID`].
pub(crate) const CHAR_BASE: u32 = 0x0100_0000;

const THINK_OPEN_TEXT: &str = "<think>\n";
const THINK_CLOSE_TEXT: &str = "\n</think>\n\n";
const TOOL_OPEN_TEXT: &str = "<tool_call>\n";
const TOOL_CLOSE_TEXT: &str = "\n</tool_call>";

/// The text of one marker id, if `id` is one.
fn marker_text(id: u32) -> Option<&'static str> {
    match id {
        THINK_OPEN => Some(THINK_OPEN_TEXT),
        THINK_CLOSE => Some(THINK_CLOSE_TEXT),
        TOOL_OPEN => Some(TOOL_OPEN_TEXT),
        TOOL_CLOSE => Some(TOOL_CLOSE_TEXT),
        _ => None,
    }
}

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
    // The tags read back as their markers, so a rendered think block or tool call in a
    // prompt is seen as one (e.g. an empty think block closing a prompt).
    match word {
        "<think>" => return THINK_OPEN,
        "</think>" => return THINK_CLOSE,
        "<tool_call>" => return TOOL_OPEN,
        "</tool_call>" => return TOOL_CLOSE,
        _ => {}
    }
    if let Some(id) = word.strip_prefix('w').and_then(|d| d.parse::<u32>().ok()) {
        if id < VOCAB && !word[1..].starts_with('+') {
            return id;
        }
    }
    // The modulo keeps the value below VOCAB, so the cast cannot truncate.
    (fnv1a(word.as_bytes()) % u64::from(VOCAB)) as u32
}

/// Text of a run of token ids: the concatenation of each id's text.
pub(crate) fn detokenize(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 8);
    push_text(&mut s, ids);
    s
}

/// Appends the text of `ids` to `s`.
pub(crate) fn push_text(s: &mut String, ids: &[u32]) {
    let mut buf = itoa::Buffer::new();
    for &id in ids {
        if let Some(t) = marker_text(id) {
            s.push_str(t);
        } else if id >= CHAR_BASE {
            // Only the mock's own tool-call ids get here; anything else reads as U+FFFD.
            s.push(char::from_u32(id - CHAR_BASE).unwrap_or(char::REPLACEMENT_CHARACTER));
        } else {
            s.push_str(" w");
            s.push_str(buf.format(id));
        }
    }
}

/// The ids spelling `text` one character each.
fn char_ids(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.chars().map(|c| CHAR_BASE + u32::from(c))
}

/// Why a plan ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// The model "emitted EOS" before the cap.
    Stop,
    /// The cap (`max_tokens`, or what the context leaves) cut it.
    Length,
}

/// Whether (and how) an output starts with a think block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Think {
    /// No think block.
    Off,
    /// Open marker, thinking words, close marker.
    Block,
    /// The prompt already opened the block (templates that end with `<think>\n`): thinking
    /// words and the close marker only.
    Opened,
}

/// What shape a request's output takes besides its length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape<'a> {
    pub think: Think,
    /// Names of the tools to pick the one call from; empty for a text answer.
    pub tools: &'a [String],
}

#[cfg(test)]
impl Shape<'_> {
    /// A plain answer: words only.
    pub(crate) const PLAIN: Shape<'static> = Shape {
        think: Think::Off,
        tools: &[],
    };
}

/// The one tool call a plan makes, and where its pieces lie in the plan's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ToolPlan {
    pub name: String,
    /// The arguments as a JSON object string (OpenAI's `function.arguments`).
    pub arguments: String,
    /// From the open marker to just past the close marker.
    pub span: Range<usize>,
    /// Just past the character that closes the name: the call is announced from here.
    pub name_end: usize,
    /// The characters of `arguments`.
    pub args: Range<usize>,
}

/// What one output id is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// A think-block marker.
    ThinkMarker,
    /// A word of the thinking.
    Thinking,
    /// A tool call's tags and JSON around its name and arguments.
    ToolFrame,
    /// The last character of a tool call's name (where a parser knows the name).
    ToolName,
    /// A character of a tool call's arguments.
    ToolArgs,
    /// A word of the answer.
    Answer,
}

/// What a request will generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub ids: Vec<u32>,
    pub finish: Finish,
    /// Thinking words (markers excluded); empty without a think block.
    pub thinking: Range<usize>,
    /// Just past the think block's close marker; 0 without a think block.
    pub think_end: usize,
    pub tool: Option<ToolPlan>,
}

impl Plan {
    /// What output id `i` is part of.
    pub(crate) fn part(&self, i: usize) -> Part {
        if i < self.think_end {
            return if self.thinking.contains(&i) {
                Part::Thinking
            } else {
                Part::ThinkMarker
            };
        }
        match &self.tool {
            Some(t) if t.span.contains(&i) => {
                if t.args.contains(&i) {
                    Part::ToolArgs
                } else if i + 1 == t.name_end {
                    Part::ToolName
                } else {
                    Part::ToolFrame
                }
            }
            _ => Part::Answer,
        }
    }

    /// Whether the first `n` ids hold the whole tool call (a cut one is only text).
    pub(crate) fn tool_complete(&self, n: usize) -> bool {
        self.tool.as_ref().is_some_and(|t| n >= t.span.end)
    }
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

    /// The full plan of a prompt under `limits`, shaped by `shape`.
    pub(crate) fn plan(&self, key: u64, limits: Limits, shape: Shape<'_>) -> Plan {
        let mut rng = self.rng(key);
        let natural = Self::draw(&self.dist, &mut rng)
            .max(self.min_tokens)
            .max(limits.min_tokens);
        let n = natural as usize;
        let (open, close) = match shape.think {
            Think::Off => (0, 0),
            Think::Block => (1, 1),
            Think::Opened => (0, 1),
        };
        let think_words = if shape.think == Think::Off {
            0
        } else {
            (n * 3 + 2) / 5
        };
        let thinking = open..open + think_words;
        let think_end = thinking.end + close;
        let tool = (!shape.tools.is_empty()).then(|| tool_call(key, shape.tools, think_end));
        let tool_ids: Vec<u32> = tool.as_ref().map_or_else(Vec::new, |t| {
            std::iter::once(TOOL_OPEN)
                .chain(char_ids(&call_json(&t.name, &t.arguments)))
                .chain(std::iter::once(TOOL_CLOSE))
                .collect()
        });
        let rest = if tool.is_some() {
            tool_ids.len()
        } else {
            n - think_words
        };
        let natural_total = think_end + rest;
        let max = limits.max_tokens as usize;
        let (len, finish) = if limits.ignore_eos || natural_total >= max {
            (max, Finish::Length)
        } else {
            (natural_total, Finish::Stop)
        };
        let ids = (0..len)
            .map(|i| {
                if i < open {
                    THINK_OPEN
                } else if i < thinking.end {
                    rng.random_range(0..VOCAB)
                } else if i < think_end {
                    THINK_CLOSE
                } else if let Some(&id) = tool_ids.get(i - think_end) {
                    id
                } else {
                    rng.random_range(0..VOCAB)
                }
            })
            .collect();
        Plan {
            ids,
            finish,
            thinking,
            think_end,
            tool,
        }
    }
}

/// The raw text of a tool call between its tags (Hermes/Qwen3 style).
fn call_json(name: &str, arguments: &str) -> String {
    // A `String` always serialises.
    let name = serde_json::to_string(name).unwrap_or_default();
    format!("{{\"name\": {name}, \"arguments\": {arguments}}}")
}

/// The tool call of a prompt: the tool `tools[h % len]` and arguments `{"q":"w{t}"}`, `h`
/// and `t` from the prompt's key, its ids starting at `start`.
fn tool_call(key: u64, tools: &[String], start: usize) -> ToolPlan {
    let h = splitmix64(key ^ 0x7001_ca11_7001_ca11);
    let name = tools[(h % tools.len() as u64) as usize].clone();
    let arguments =
        serde_json::json!({ "q": format!("w{}", (h >> 32) % u64::from(VOCAB)) }).to_string();
    let json = call_json(&name, &arguments);
    let head = call_json(&name, "");
    // `{"name": "…", "arguments": ` then the arguments then `}`: count characters, as ids
    // are characters.
    let head_chars = head.chars().count() - 1;
    let name_chars = serde_json::to_string(&name)
        .unwrap_or_default()
        .chars()
        .count();
    let body = start + 1;
    let name_end = body + "{\"name\": ".len() + name_chars;
    let args_start = body + head_chars;
    let args = args_start..args_start + arguments.chars().count();
    ToolPlan {
        span: start..body + json.chars().count() + 1,
        name,
        arguments,
        name_end,
        args,
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
        let a = m.plan(key, limits(u32::MAX), Shape::PLAIN);
        assert_eq!(a, m.plan(key, limits(u32::MAX), Shape::PLAIN));
        assert_eq!(a.finish, Finish::Stop);
        let cap = (a.ids.len() as u32 / 2).max(1);
        let b = m.plan(key, limits(cap), Shape::PLAIN);
        assert_eq!(b.finish, Finish::Length);
        assert_eq!(b.ids[..], a.ids[..cap as usize]);
        // Another seed gives another output.
        let other = LengthModel::new(100.0, 1.0, 1, 43).expect("model");
        assert_ne!(other.plan(key, limits(u32::MAX), Shape::PLAIN), a);
    }

    /// A plan is never shorter than the minimum asked for, runs to the cap with `ignore_eos`,
    /// and is empty under a zero cap.
    #[test]
    fn plan_respects_minimums_and_ignore_eos() {
        let m = LengthModel::new(5.0, 0.0, 8, 1).expect("model");
        assert_eq!(m.plan(1, limits(100), Shape::PLAIN).ids.len(), 8);
        let l = Limits {
            max_tokens: 30,
            min_tokens: 20,
            ignore_eos: false,
        };
        assert_eq!(m.plan(1, l, Shape::PLAIN).ids.len(), 20);
        let l = Limits {
            max_tokens: 30,
            min_tokens: 0,
            ignore_eos: true,
        };
        let p = m.plan(1, l, Shape::PLAIN);
        assert_eq!((p.ids.len(), p.finish), (30, Finish::Length));
        assert_eq!(m.plan(1, limits(0), Shape::PLAIN).ids.len(), 0);
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

    /// A think block opens the output, takes about 60 % of the drawn words and closes
    /// before the answer; its text is the tags and words in order and reads back as the
    /// same ids. A prompt that opened the block gets no open marker.
    #[test]
    fn think_blocks_wrap_most_of_the_words_and_round_trip() {
        let m = LengthModel::new(100.0, 0.0, 1, 3).expect("model");
        let think = Shape {
            think: Think::Block,
            tools: &[],
        };
        let p = m.plan(9, limits(u32::MAX), think);
        assert_eq!(p.ids.len(), 102);
        assert_eq!((p.thinking.clone(), p.think_end), (1..61, 62));
        assert_eq!((p.ids[0], p.ids[61]), (THINK_OPEN, THINK_CLOSE));
        assert!(p.ids[1..61].iter().chain(&p.ids[62..]).all(|&t| t < VOCAB));
        assert_eq!(
            (p.part(0), p.part(1), p.part(61), p.part(62)),
            (
                Part::ThinkMarker,
                Part::Thinking,
                Part::ThinkMarker,
                Part::Answer
            )
        );
        let text = detokenize(&p.ids);
        assert!(text.starts_with("<think>\n w"), "{text}");
        assert!(text.contains("\n</think>\n\n w"), "{text}");
        assert_eq!(tokenize(&text), p.ids);
        let opened = m.plan(
            9,
            limits(u32::MAX),
            Shape {
                think: Think::Opened,
                tools: &[],
            },
        );
        assert_eq!(opened.ids[..], p.ids[1..]);
        // A cap cuts the same output, markers and all.
        let capped = m.plan(9, limits(30), think);
        assert_eq!(capped.ids[..], p.ids[..30]);
        assert_eq!(capped.finish, Finish::Length);
    }

    /// A tool call replaces the answer: its tags and one character id each spell
    /// `{"name": …, "arguments": {"q":"w…"}}`, the tool picked by the prompt's hash; the
    /// parts name where the name ends and the arguments lie.
    #[test]
    fn tool_calls_spell_their_json_in_character_ids() {
        let m = LengthModel::new(10.0, 0.0, 1, 3).expect("model");
        let tools = ["alpha".to_owned(), "beta".to_owned()];
        let mut names = std::collections::BTreeSet::new();
        for key in 0..16 {
            let p = m.plan(
                key,
                limits(u32::MAX),
                Shape {
                    think: Think::Block,
                    tools: &tools,
                },
            );
            let t = p.tool.clone().expect("a tool call");
            names.insert(t.name.clone());
            assert_eq!(p.ids.len(), t.span.end);
            assert!(p.tool_complete(p.ids.len()) && !p.tool_complete(p.ids.len() - 1));
            let json = detokenize(&p.ids[t.span.start + 1..t.span.end - 1]);
            let v: serde_json::Value = serde_json::from_str(&json).expect("call JSON");
            assert_eq!(v["name"], t.name.as_str());
            assert_eq!(v["arguments"].to_string(), t.arguments);
            assert_eq!(detokenize(&p.ids[t.args.clone()]), t.arguments);
            assert_eq!(detokenize(&p.ids[t.name_end - 1..t.name_end]), "\"");
            assert_eq!(p.part(t.name_end - 1), Part::ToolName);
            assert_eq!(p.part(t.args.start), Part::ToolArgs);
            assert_eq!(p.part(t.span.start), Part::ToolFrame);
            assert!(detokenize(&p.ids).ends_with("}}\n</tool_call>"));
        }
        assert_eq!(names.len(), 2, "both tools get picked over 16 prompts");
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
