//! `spool mock-server`: a simulated continuous-batching inference server speaking SGLang's
//! `/generate` and vLLM's `/v1/completions` and `/v1/chat/completions` (streaming and not),
//! with `/health`, `/v1/models`, `/get_model_info` and `/abort_request`, and with
//! `--tokenize-api` one server kind's rendering endpoints (`render`: vLLM's `/tokenize`,
//! llama.cpp's `/apply-template`, SGLang's `/v1/tokenize`). It is what the demo, the tests
//! and the benchmarks run against.
//!
//! How it simulates (see the submodules for details):
//! - **Tokens.** One token per whitespace-separated word of a text prompt (or one per id
//!   of an id prompt; chat messages are rendered `"{role}: {content}\n"` first), or the
//!   real tokenizer's ids with `--tokenizer` (see **Prompts**). Output
//!   token `t` (in `0..32000`) has the text `" w{t}"`, so text is always the concatenation
//!   of the ids' texts (markers and tool-call characters too, see below). Chat renders
//!   `"tools: {names}\n"` first when tools are offered, an assistant's `reasoning_content`
//!   (or `reasoning`) as `<think>\n{r}\n</think>\n\n` before its content, and its
//!   `tool_calls` as ` <tool_call> {name}` after it; `tool` messages as any other role.
//! - **Prompts** are rendered and encoded by `render`: chat by `--chat-template` when
//!   given, text by `--tokenizer`'s real tokenizer when given (so a chat answer's
//!   `prompt_token_ids` and `usage.prompt_tokens` are what `/tokenize` answers).
//! - **Real tokens** (`--tokenizer PATH`: a `tokenizer.json`, or a model folder such as
//!   Kimi's tiktoken one). The same plans,
//!   each id replaced by real tokens of that tokenizer (see `vocab`): words are one-token
//!   English words after a space, the think block Qwen3-style `<think>` `\n` … `\n`
//!   `</think>` `\n\n`, so encoding the text gives back the ids. No tool calls.
//!   `--eos-in-ids` ends a stopped completion with the end-of-turn id (counted).
//! - **Thinking** (`--think`). Every completion opens with a think block: id 32001 reads
//!   `"<think>\n"`, then about 60 % of the planned words (`(3n + 2) / 5`), then id 32002
//!   reading `"\n</think>\n\n"`, then the answer words (2 more tokens than without). No
//!   block when the chat request sends `chat_template_kwargs.enable_thinking: false`, or a
//!   text/id prompt ends with an empty think block (`<think>\n\n</think>\n\n`, ids 32001
//!   32002, or Qwen3's own ids 151667 271 151668 271: how Qwen3's template renders
//!   `enable_thinking=false`). A prompt ending with
//!   `<think>` (32001) already opened the block: the output has no open marker. The mock
//!   tokenizer reads the words `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as ids
//!   32001–32004.
//! - **Reasoning parser** (`--reasoning-parser`, `--reasoning-field reasoning_content|
//!   reasoning`). Chat answers only: the thinking words (no markers) go to
//!   `message.<field>` (whole) or `delta.<field>` events (streamed, before the content
//!   events), the answer to `content` (null when empty). A block cut by the cap is all
//!   reasoning. Token ids and usage always count every generated id, markers included;
//!   `/generate` and `/v1/completions` never split (nor does chat without the flag).
//! - **Tool calls.** A chat request with a non-empty `tools` whose last message is the
//!   user's answers (after any think block) with one call to `tools[h % len]` (`h` a hash
//!   of the seeded prompt key; `tool_choice: "none"` makes no call, a named `tool_choice`
//!   calls that tool), arguments `{"q":"w{t}"}`, `content` null (unless unsplit thinking
//!   precedes it), `finish_reason` `tool_calls`, id `call_<24 hex>`. The tokens spell
//!   `<tool_call>\n{"name": "…", "arguments": {"q":"w…"}}\n</tool_call>`: tags 32003 and
//!   32004, one id `0x1000000 + c` per character `c` of the JSON. Streamed as vLLM does:
//!   `delta.tool_calls[{index, id, type, function: {name}}]`, then
//!   `delta.tool_calls[{index, function: {arguments}}]` pieces; ids hidden by the parser
//!   (tags, JSON frame) ride on the next event. A call cut by the cap is plain content.
//!   When the last message is a `tool` result (or anything but the user's) it answers text.
//! - **Seeds.** A request seed (`seed`; SGLang's `sampling_params.sampling_seed`) is mixed
//!   into the plan's key: same seed, same output; another seed, another output. Without
//!   one the output is a pure function of the prompt.
//! - **Lengths.** Lognormal with mean `mean_tokens` and `sigma`, at least `min_tokens`,
//!   capped by the request's max tokens (`finish_reason` "length" then, else "stop"). Length
//!   and ids are a pure function of `(seed, prompt)`, so a retried prompt regenerates the
//!   same output.
//! - **Stops.** A stopped completion reports its end as the servers do: SGLang's
//!   `finish_reason: {"type": "stop", "matched": <the end-of-turn id>}`, vLLM's
//!   `stop_reason: null`. The request's `stop` strings (SGLang's `sampling_params.stop`,
//!   the OpenAI `stop`) are looked for in the output's text after each token: the first
//!   listed that the token completes ends it there, also past the cap — the ids through
//!   that token, the text (every event's, reasoning and content alike) before the string,
//!   `finish_reason` "stop" with `matched` / `stop_reason` the string.
//! - **Speed.** A scheduler ticks every 5 ms and gives each request in flight
//!   `min(per_request_tps, capacity_tps / n_in_flight) × time_scale` tokens per second;
//!   tokens reach clients only through ticks, so the first token waits for one. With
//!   `--instant` there is no scheduler: every request has all its tokens at once.
//! - **KV cache** (`--kv-tokens N`). The batch becomes a real server's ([`kv`]): requests
//!   are admitted while the KV cache has room and queue otherwise, grow as they generate,
//!   the newest is preempted (and later recomputed) when they overflow, a step costs
//!   `max(1 / per_request_tps, n / capacity_tps)` plus attention over the cache
//!   (`--attention-ms-per-mtok`) plus prefill (`--prefill-tps`) of what the radix-style
//!   prefix cache lacks. `/metrics` exports the gauges and counters real servers do, in
//!   vLLM's and SGLang's names ([`exporter`]).
//! - **Faults.** Per generation request, from an RNG seeded by `seed` (independent of the
//!   outputs): 500, 429 with `Retry-After`, hang, malformed body/event, connection cut
//!   half way.
//! - **Record.** Each generation request ends with exactly one outcome, counted in
//!   [`MockStats`] and, with `--log`, written as one flushed JSONL line.
//!
//! Time scale: rates are multiplied by `time_scale`; `e2e_latency` is reported in
//! simulated seconds; `Retry-After` stays in real seconds (a client obeys it literally).
//!
//! Server behaviours copied on purpose (so clients meet them here before production):
//! - Errors: vLLM's `{"object":"error","message","type","param","code"}` on the OpenAI
//!   APIs; SGLang's `{"error":{"message"}}` on `/generate`. A *streaming* `/generate` that
//!   fails validation gets SGLang's answer: 200, one `data: {"error":…}` event, `[DONE]`.
//!   Injected 500/429 use the vLLM body on every API.
//! - Context: a prompt of `context_len` tokens or more is refused (vLLM's or SGLang's
//!   message); a max-tokens cap past the context is clamped silently.
//! - Default caps when none is sent: SGLang 128, completions 16, chat what the context
//!   leaves. `ignore_eos` and `min_new_tokens`/`min_tokens` are honoured; `n > 1` and
//!   batched prompts are refused (not simulated).
//! - `/abort_request` (`rid` or `abort_all`) cancels by the SGLang `rid`, or by the
//!   `X-Request-Id` header on the OpenAI APIs: the output so far ends with finish reason
//!   abort. Clients that disconnect leave the batch at once.
//!
//! Log line (`--log`), one per generation request, appended and flushed when it ends:
//! `{"ts_ms", "endpoint", "rid", "outcome", "stream", "prompt_tokens",
//! "completion_tokens", "latency_ms"}` — `outcome` is one of [`Outcome::as_str`],
//! `rid` the body's `rid` or the `X-Request-Id` header or null, `completion_tokens` the
//! tokens delivered to the client. With `--log-bodies` each line also has `"request"`: the
//! body as received (its JSON, or a string when it is not JSON).

mod api;
mod engine;
mod exporter;
mod handlers;
pub mod kv;
mod log;
mod render;
mod sim;
mod vocab;

pub use self::render::TokenizeApi;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::routing::{get, post};
use axum::Router;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

use self::api::{Api, GenRequest, Render};
use self::engine::Engine;
use self::log::LogSink;
use self::sim::{Fault, FaultMix, LengthModel};

/// Every knob of the mock; also the flags of `spool mock-server`.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct MockConfig {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub addr: String,
    /// Aggregate tokens/s shared by all requests in flight (the GPU's throughput).
    #[arg(long, default_value_t = 850.0)]
    pub capacity_tps: f64,
    /// Speed cap of a single request, tokens/s.
    #[arg(long, default_value_t = 60.0)]
    pub per_request_tps: f64,
    /// Mean completion length (of the lognormal distribution), tokens.
    /// The default answers in seconds; a reasoning model's traces are nearer 3,500.
    #[arg(long, default_value_t = 300.0)]
    pub mean_tokens: f64,
    /// Sigma of the lognormal completion length (heavier tail when larger).
    #[arg(long, default_value_t = 1.0)]
    pub sigma: f64,
    /// Shortest completion, tokens (before the request's cap).
    #[arg(long, default_value_t = 1)]
    pub min_tokens: u32,
    /// Seed of lengths, token ids and faults.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Speed-up of simulated time: 100 makes everything 100× faster.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Context length: a prompt of this many tokens or more is refused.
    #[arg(long, default_value_t = 32768)]
    pub context_len: u32,
    /// Model name reported by the server.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Answer every request at once, all its tokens in one step: no capacity model, no
    /// ticker (for measuring a client's own overhead, `make bench-overhead`).
    #[arg(long)]
    pub instant: bool,
    /// Stream SGLang deltas (`--incremental-streaming-output`) instead of cumulative output.
    #[arg(long)]
    pub incremental: bool,
    /// Ignore `return_token_ids` on the OpenAI APIs (like servers without it).
    #[arg(long)]
    pub no_token_ids: bool,
    /// Refuse a streamed chat request that asks for `return_token_ids` with a 400, as
    /// SGLang's chat API does.
    #[arg(long)]
    pub refuse_stream_ids: bool,
    /// Never send `usage` on the OpenAI APIs (forces client-side counting).
    #[arg(long)]
    pub no_usage: bool,
    /// Share of generation requests answered 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_500: f64,
    /// Share of generation requests answered 429 with `Retry-After`.
    #[arg(long, default_value_t = 0.0)]
    pub fail_429: f64,
    /// `Retry-After` of the 429s, real seconds.
    #[arg(long, default_value_t = 1)]
    pub retry_after_s: u32,
    /// Share of generation requests whose connection is cut half way.
    #[arg(long, default_value_t = 0.0)]
    pub drop_mid_stream: f64,
    /// Share of generation requests that never answer (until the client gives up).
    #[arg(long, default_value_t = 0.0)]
    pub hang: f64,
    /// Share of generation requests answered with a malformed body or SSE event.
    #[arg(long, default_value_t = 0.0)]
    pub malformed: f64,
    /// Append one JSON line per generation request outcome to this file.
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Each `--log` line also carries the request body as received (`"request"`).
    #[arg(long)]
    pub log_bodies: bool,
    /// Every completion opens with a think block (a reasoning model such as Qwen3).
    #[arg(long)]
    pub think: bool,
    /// Chat answers split the think block off into the reasoning field (vLLM's and
    /// SGLang's `--reasoning-parser`).
    #[arg(long)]
    pub reasoning_parser: bool,
    /// The field the reasoning parser fills: `reasoning_content`, or vLLM's newer `reasoning`.
    #[arg(long, value_enum, default_value_t = ReasoningField::ReasoningContent)]
    pub reasoning_field: ReasoningField,
    /// A tokenizer (a HuggingFace `tokenizer.json`, or a model folder such as Kimi's
    /// `tiktoken.model` one): completions are made of that tokenizer's real tokens (ids and
    /// text consistent), think markers its `<think>`/`</think>`; no tool calls. Without it,
    /// ids are the mock's own (`w{t}` words).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// With `--tokenizer`: a completion that stops ends with the end-of-turn id
    /// (`eos_token` of the `tokenizer_config.json` beside it) in its ids and counts, as
    /// some servers send it; by default it is left out, as SGLang and vLLM do.
    #[arg(long)]
    pub eos_in_ids: bool,
    /// KV cache capacity in tokens: admission, growth, preemption with recompute, prefill
    /// and a prefix cache, as a real server (0: the plain shared-capacity model).
    #[arg(long, default_value_t = 0)]
    pub kv_tokens: u64,
    /// With `--kv-tokens`: milliseconds a decode step spends per million KV tokens held
    /// (attention reading the cache).
    #[arg(long, default_value_t = 0.0)]
    pub attention_ms_per_mtok: f64,
    /// With `--kv-tokens`: prefill throughput, prompt tokens/s (0: prefill is free).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_tps: f64,
    /// With `--kv-tokens`: most requests running at once (0: only the KV cache limits).
    #[arg(long, default_value_t = 0)]
    pub max_running: usize,
    /// With `--kv-tokens`: most prefill tokens per step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    pub prefill_chunk: u32,
    /// With `--kv-tokens`: prefix-cache block size, tokens.
    #[arg(long, default_value_t = 16)]
    pub cache_block: u32,
    /// Which names `/metrics` exports the server's gauges under (`none`: no `/metrics`).
    #[arg(long, value_enum, default_value_t = MetricNames::Both)]
    pub metrics_names: MetricNames,
    /// Serve the rendering endpoints of this server kind (`vllm`: `/tokenize` taking a
    /// prompt or messages, `/detokenize`; `llama-cpp`: `/apply-template`, `/tokenize`
    /// taking `content`, `/detokenize`; `sglang`: `/tokenize` and `/v1/tokenize` taking a
    /// prompt only). None by default.
    #[arg(long, value_enum)]
    pub tokenize_api: Option<TokenizeApi>,
    /// A chat template (a `.jinja` file, or a `tokenizer_config.json` with one) the mock
    /// renders chat with, on its rendering endpoints and for `/v1/chat/completions`'
    /// prompt ids, instead of its own `role: content` lines.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
}

/// The metric names `/metrics` uses: a vLLM's, an SGLang's, both, or no endpoint at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MetricNames {
    /// `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, …
    Vllm,
    /// `sglang:num_running_reqs`, `sglang:token_usage`, …
    Sglang,
    /// Both families.
    #[default]
    Both,
    /// No `/metrics` route (404), as a server that exports nothing.
    None,
}

/// Where a reasoning parser puts the thinking of a chat answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ReasoningField {
    /// `reasoning_content` (SGLang, and vLLM until it renamed it).
    #[default]
    #[value(name = "reasoning_content")]
    ReasoningContent,
    /// `reasoning` (vLLM's newer servers).
    #[value(name = "reasoning")]
    Reasoning,
}

impl ReasoningField {
    /// The JSON field name.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningField::ReasoningContent => "reasoning_content",
            ReasoningField::Reasoning => "reasoning",
        }
    }
}

impl Default for MockConfig {
    /// The CLI defaults (a unit test keeps the two in step).
    fn default() -> Self {
        Self {
            addr: "127.0.0.1:30000".into(),
            capacity_tps: 850.0,
            per_request_tps: 60.0,
            mean_tokens: 300.0,
            sigma: 1.0,
            min_tokens: 1,
            seed: 0,
            time_scale: 1.0,
            context_len: 32768,
            model: "mock-model".into(),
            instant: false,
            incremental: false,
            no_token_ids: false,
            refuse_stream_ids: false,
            no_usage: false,
            fail_500: 0.0,
            fail_429: 0.0,
            retry_after_s: 1,
            drop_mid_stream: 0.0,
            hang: 0.0,
            malformed: 0.0,
            log: None,
            log_bodies: false,
            think: false,
            reasoning_parser: false,
            reasoning_field: ReasoningField::ReasoningContent,
            tokenizer: None,
            eos_in_ids: false,
            kv_tokens: 0,
            attention_ms_per_mtok: 0.0,
            prefill_tps: 0.0,
            max_running: 0,
            prefill_chunk: 8192,
            cache_block: 16,
            metrics_names: MetricNames::Both,
            tokenize_api: None,
            chat_template: None,
        }
    }
}

impl MockConfig {
    /// Fast settings for tests: 1000× time, short completions (mean 50, sigma 0.5), port 0.
    pub fn for_tests() -> Self {
        Self {
            addr: "127.0.0.1:0".into(),
            time_scale: 1000.0,
            mean_tokens: 50.0,
            sigma: 0.5,
            ..Self::default()
        }
    }

    fn faults(&self) -> FaultMix {
        FaultMix {
            http_500: self.fail_500,
            http_429: self.fail_429,
            hang: self.hang,
            malformed: self.malformed,
            drop: self.drop_mid_stream,
        }
    }

    /// The KV model's parameters, when `--kv-tokens` asks for one.
    pub(crate) fn kv_params(&self) -> Option<kv::KvParams> {
        (self.kv_tokens > 0 && !self.instant).then(|| kv::KvParams {
            kv_tokens: self.kv_tokens,
            step_s: 1.0 / self.per_request_tps,
            seq_s: 1.0 / self.capacity_tps,
            kv_s: self.attention_ms_per_mtok / 1e3 / 1e6,
            prefill_s: if self.prefill_tps > 0.0 {
                1.0 / self.prefill_tps
            } else {
                0.0
            },
            max_running: self.max_running,
            chunk: self.prefill_chunk.max(1),
            block: self.cache_block.max(1),
        })
    }

    /// Fails with a message naming the flag when a knob is out of range.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("capacity_tps", self.capacity_tps),
            ("per_request_tps", self.per_request_tps),
            ("time_scale", self.time_scale),
        ] {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{name} must be > 0, got {v}");
        }
        anyhow::ensure!(self.context_len > 0, "context_len must be > 0");
        for (name, v) in [
            ("attention_ms_per_mtok", self.attention_ms_per_mtok),
            ("prefill_tps", self.prefill_tps),
        ] {
            anyhow::ensure!(v.is_finite() && v >= 0.0, "{name} must be >= 0, got {v}");
        }
        anyhow::ensure!(
            !self.eos_in_ids || self.tokenizer.is_some(),
            "--eos-in-ids needs --tokenizer (the end-of-turn id is the tokenizer's)"
        );
        self.faults().validate()?;
        LengthModel::new(self.mean_tokens, self.sigma, self.min_tokens, self.seed)?;
        Ok(())
    }
}

/// How a generation request ended: the `outcome` of its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Answered in full.
    Ok,
    /// Injected 500.
    Http500,
    /// Injected 429.
    Http429,
    /// Injected hang, ended by the client giving up (or shutdown).
    Hang,
    /// Injected malformed body or event.
    Malformed,
    /// Connection cut (injected, or the server shutting down).
    Dropped,
    /// Cancelled through `/abort_request`.
    Aborted,
    /// The client disconnected before the end.
    ClientGone,
    /// Refused with a 4xx (bad JSON, missing prompt, prompt over the context).
    BadRequest,
}

impl Outcome {
    /// How many outcomes there are.
    pub const COUNT: usize = 9;

    /// Every outcome, in index order.
    pub const ALL: [Outcome; Outcome::COUNT] = [
        Outcome::Ok,
        Outcome::Http500,
        Outcome::Http429,
        Outcome::Hang,
        Outcome::Malformed,
        Outcome::Dropped,
        Outcome::Aborted,
        Outcome::ClientGone,
        Outcome::BadRequest,
    ];

    /// The name used in the log file.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Http500 => "500",
            Outcome::Http429 => "429",
            Outcome::Hang => "hang",
            Outcome::Malformed => "malformed",
            Outcome::Dropped => "dropped",
            Outcome::Aborted => "aborted",
            Outcome::ClientGone => "client_gone",
            Outcome::BadRequest => "400",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A snapshot of what the mock has done, for tests and benchmarks in the same process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Generation requests received.
    pub requests: u64,
    /// Generation requests that have ended, by outcome (index = `Outcome as usize`).
    pub outcomes: [u64; Outcome::COUNT],
    /// Tokens produced by the simulated GPU (including those of cut or aborted requests).
    pub tokens_generated: u64,
    /// Requests in the batch right now (generating).
    pub active: usize,
    /// Generation requests received and not yet ended (includes hangs and queued events).
    pub in_flight: u64,
}

impl MockStats {
    /// Requests that ended with `o`.
    pub fn count(&self, o: Outcome) -> u64 {
        self.outcomes[o.index()]
    }

    /// Requests that have ended, whatever the outcome.
    pub fn ended(&self) -> u64 {
        self.outcomes.iter().sum()
    }
}

/// Shared counters; every change bumps a watch so waiters wake (no polling in tests).
pub(crate) struct Counters {
    outcomes: [AtomicU64; Outcome::COUNT],
    requests: AtomicU64,
    in_flight: AtomicU64,
    tokens: AtomicU64,
    changed: watch::Sender<u64>,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            outcomes: Default::default(),
            requests: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            changed: watch::channel(0).0,
        }
    }

    pub(crate) fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn add_tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Ordering::Relaxed);
        self.bump();
    }

    fn started(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.bump();
    }

    fn ended(&self, o: Outcome) {
        self.outcomes[o.index()].fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.bump();
    }

    #[cfg(test)]
    pub(crate) fn snapshot_tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }
}

/// The running mock: configuration, batch, RNGs, counters and log. Create it with
/// [`MockState::new`], serve it with [`serve_state`] (or mount [`router`]), read
/// [`MockState::stats`] while it runs. One state serves until its shutdown; it does not
/// restart.
pub struct MockState {
    cfg: MockConfig,
    engine: Arc<Engine>,
    counters: Arc<Counters>,
    lengths: LengthModel,
    fault_mix: FaultMix,
    fault_rng: Mutex<StdRng>,
    log: Option<LogSink>,
    shutdown: watch::Sender<bool>,
    next_id: AtomicU64,
    /// `--tokenizer`: the real tokens completions are made of.
    vocab: Option<Arc<vocab::RealVocab>>,
    /// How prompts become ids (`--chat-template`, `--tokenizer`).
    rendering: render::MockRendering,
}

impl MockState {
    /// Validates `cfg` and opens the log file (appending).
    pub fn new(cfg: MockConfig) -> anyhow::Result<Arc<Self>> {
        cfg.validate()?;
        let counters = Arc::new(Counters::new());
        let mut engine = Engine::new(
            cfg.capacity_tps,
            cfg.per_request_tps,
            cfg.time_scale,
            Arc::clone(&counters),
        );
        engine.instant = cfg.instant;
        if let Some(p) = cfg.kv_params() {
            engine = engine.with_kv(p);
        }
        let engine = Arc::new(engine);
        let log = cfg.log.as_deref().map(LogSink::open).transpose()?;
        let vocab = cfg
            .tokenizer
            .as_deref()
            .map(|p| vocab::RealVocab::load(p, cfg.eos_in_ids).map(Arc::new))
            .transpose()?;
        let rendering =
            render::MockRendering::load(cfg.chat_template.as_deref(), cfg.tokenizer.as_deref())?;
        Ok(Arc::new(Self {
            vocab,
            rendering,
            lengths: LengthModel::new(cfg.mean_tokens, cfg.sigma, cfg.min_tokens, cfg.seed)?,
            fault_mix: cfg.faults(),
            // A stream of its own, so faults never shift the outputs.
            fault_rng: Mutex::new(StdRng::seed_from_u64(sim::splitmix64(
                cfg.seed ^ 0xfa17_fa17_fa17_fa17,
            ))),
            log,
            shutdown: watch::channel(false).0,
            next_id: AtomicU64::new(0),
            engine,
            counters,
            cfg,
        }))
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &MockConfig {
        &self.cfg
    }

    /// What has happened so far.
    pub fn stats(&self) -> MockStats {
        let mut outcomes = [0u64; Outcome::COUNT];
        for (slot, c) in outcomes.iter_mut().zip(&self.counters.outcomes) {
            *slot = c.load(Ordering::Relaxed);
        }
        MockStats {
            requests: self.counters.requests.load(Ordering::Relaxed),
            outcomes,
            tokens_generated: self.counters.tokens.load(Ordering::Relaxed),
            active: self.engine.active(),
            in_flight: self.counters.in_flight.load(Ordering::Relaxed),
        }
    }

    /// The KV model's counters and gauges (`None` without `--kv-tokens`).
    pub fn kv(&self) -> Option<(kv::KvStats, kv::KvGauges)> {
        self.engine.kv_state()
    }

    /// Slows the KV model down or speeds it up (`speed` 1 normal, 0.5 half as fast) and
    /// changes its KV capacity, while it runs: a server whose neighbour takes GPU time or
    /// memory, and gives it back. No effect without `--kv-tokens`.
    pub fn set_kv(&self, speed: Option<f64>, kv_tokens: Option<u64>) {
        self.engine.set_kv(speed, kv_tokens);
    }

    /// Waits until `pred` holds for the stats (checked at once, then on every change):
    /// lets tests await "request ended", "request generating"… instead of sleeping.
    /// Never returns if `pred` never holds: wrap it in a timeout.
    pub async fn wait_until(&self, mut pred: impl FnMut(&MockStats) -> bool) {
        let mut rx = self.counters.changed.subscribe();
        loop {
            if pred(&self.stats()) {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Starts the shutdown: streams in flight are cut, hanging requests released, new
    /// generations refused (cut). Called by [`serve_state`] when its signal fires.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
        self.engine.shutdown();
    }

    async fn until_shutdown(&self) {
        let mut rx = self.shutdown.subscribe();
        // An error means the sender is gone, i.e. the state is being torn down.
        let _ = rx.wait_for(|down| *down).await;
    }

    fn draw_fault(&self) -> Fault {
        let u: f64 = self
            .fault_rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .random();
        self.fault_mix.pick(u)
    }

    /// A fresh 32-hex-digit id (SGLang's `uuid4().hex` shape).
    fn fresh_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let a = sim::splitmix64(n ^ self.cfg.seed.rotate_left(17) ^ log::now_ms());
        let b = sim::splitmix64(a ^ n);
        format!("{a:016x}{b:016x}")
    }

    fn render(&self, req: &GenRequest) -> Render {
        let id = match req.api {
            Api::Generate => req.rid.clone().unwrap_or_else(|| self.fresh_id()),
            Api::Completions => format!("cmpl-{}", self.fresh_id()),
            Api::Chat => format!("chatcmpl-{}", self.fresh_id()),
        };
        let tool_call_id = if req.tools.is_empty() {
            String::new()
        } else {
            format!("call_{}", &self.fresh_id()[..24])
        };
        Render {
            api: req.api,
            id,
            created: log::now_ms() / 1000,
            model: self.cfg.model.clone(),
            prompt_ids: req.prompt_ids.clone(),
            token_ids: req.return_token_ids && !self.cfg.no_token_ids,
            usage: !self.cfg.no_usage,
            usage_chunk: req.include_usage && !self.cfg.no_usage,
            incremental: self.cfg.incremental,
            reasoning_field: (self.cfg.reasoning_parser && req.api == Api::Chat)
                .then(|| self.cfg.reasoning_field.as_str()),
            tool_call_id,
            vocab: self.vocab.clone(),
            stop: None,
        }
    }
}

/// The mock's routes over `state`, for embedding in another server or a test.
pub fn router(state: Arc<MockState>) -> Router {
    let routes = Router::new();
    let routes = if state.cfg.metrics_names != MetricNames::None {
        routes.route("/metrics", get(exporter::metrics))
    } else {
        routes
    };
    let routes = match state.cfg.tokenize_api {
        None => routes,
        Some(TokenizeApi::Vllm) => routes
            .route("/tokenize", post(render::vllm_tokenize))
            .route("/detokenize", post(render::vllm_detokenize)),
        Some(TokenizeApi::LlamaCpp) => routes
            .route("/apply-template", post(render::llama_apply_template))
            .route("/tokenize", post(render::llama_tokenize))
            .route("/detokenize", post(render::llama_detokenize)),
        Some(TokenizeApi::Sglang) => routes
            .route("/tokenize", post(render::sglang_tokenize))
            .route("/v1/tokenize", post(render::sglang_tokenize))
            .route("/detokenize", post(render::sglang_detokenize))
            .route("/v1/detokenize", post(render::sglang_detokenize)),
    };
    routes
        .route("/generate", post(handlers::generate))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/abort_request", post(handlers::abort_request))
        .route("/health", get(handlers::health))
        .route("/health_generate", get(handlers::health))
        .route("/v1/models", get(handlers::models))
        .route("/get_model_info", get(handlers::model_info))
        .fallback(handlers::not_found)
        .with_state(state)
}

/// Connections a listener of [`bind`] queues before they are accepted.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` for `spool mock-server` with a listen queue of [`LISTEN_BACKLOG`] (as
/// uvicorn's 2048 and nginx's 511 are set explicitly): tokio's default of 1024 overflows
/// when a client opens 1,024 connections at once, and each dropped SYN costs that request
/// a 1 s retransmission (`nstat`: `TcpExtListenOverflows`).
pub async fn bind(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{addr}: no address"))))
}

/// Serves a fresh mock configured by `cfg` on `listener` until `shutdown` resolves.
/// Binds nothing itself, so tests pass a port-0 listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: MockConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = MockState::new(cfg)?;
    serve_state(listener, state, shutdown).await
}

/// Serves `state` on `listener` until `shutdown` resolves, then cuts what is in flight
/// (streams, hangs) and returns once every connection is closed.
pub async fn serve_state(
    listener: tokio::net::TcpListener,
    state: Arc<MockState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    let cfg = state.config();
    tracing::info!(
        %addr,
        capacity_tps = cfg.capacity_tps,
        per_request_tps = cfg.per_request_tps,
        time_scale = cfg.time_scale,
        mean_tokens = cfg.mean_tokens,
        model = %cfg.model,
        "mock server listening"
    );
    let st = Arc::clone(&state);
    let signal = async move {
        shutdown.await;
        st.shutdown();
    };
    axum::serve(listener, router(state))
        .with_graceful_shutdown(signal)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A burst of 1,100 connections to a listener that has accepted none of them yet all
    /// complete their handshake: the queue holds more than tokio's default 1,024, whose
    /// overflow drops SYNs and costs the requests behind them a 1 s retransmission.
    #[tokio::test]
    async fn the_listener_queues_a_burst_of_connections() {
        let listener = bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::task::spawn_blocking(move || {
            let mut held = Vec::new();
            for i in 0..1100 {
                match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(3))
                {
                    Ok(c) => held.push(c),
                    Err(e) if e.raw_os_error() == Some(24) => {
                        eprintln!("SKIPPED after {i}: too few file descriptors (ulimit -n)");
                        return None;
                    }
                    Err(e) => panic!("connection {i} not queued: {e}"),
                }
            }
            Some(held.len())
        })
        .await
        .unwrap();
        assert!(held.is_none_or(|n| n == 1100));
        drop(listener);
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: MockConfig,
    }

    /// The command line's defaults are `MockConfig::default()`, and its flags set the fields
    /// they name.
    #[test]
    fn clap_defaults_match_default() {
        let cli = Cli::try_parse_from(["mock"]).expect("parse");
        assert_eq!(cli.cfg, MockConfig::default());
        let cli = Cli::try_parse_from(["mock", "--incremental", "--fail-429", "0.5", "--log", "x"])
            .expect("parse flags");
        let think = Cli::try_parse_from([
            "mock",
            "--think",
            "--reasoning-parser",
            "--reasoning-field",
            "reasoning",
            "--log-bodies",
        ])
        .expect("parse reasoning flags");
        assert!(think.cfg.think && think.cfg.reasoning_parser && think.cfg.log_bodies);
        assert_eq!(think.cfg.reasoning_field, ReasoningField::Reasoning);
        let named = Cli::try_parse_from(["mock", "--reasoning-field", "reasoning_content"])
            .expect("parse field");
        assert_eq!(named.cfg.reasoning_field, ReasoningField::ReasoningContent);
        assert!(cli.cfg.incremental);
        assert_eq!(cli.cfg.fail_429, 0.5);
        assert_eq!(cli.cfg.log, Some(PathBuf::from("x")));
    }

    /// A config that cannot be simulated (no capacity, fault rates over 1 in all) is refused,
    /// naming the setting.
    #[test]
    fn validation_names_the_bad_knob() {
        assert!(MockConfig::for_tests().validate().is_ok());
        let bad = MockConfig {
            capacity_tps: 0.0,
            ..MockConfig::for_tests()
        };
        let err = bad.validate().expect_err("zero capacity").to_string();
        assert!(err.contains("capacity_tps"), "{err}");
        let bad = MockConfig {
            fail_500: 0.6,
            hang: 0.6,
            ..MockConfig::for_tests()
        };
        assert!(bad.validate().is_err());
    }

    /// Each outcome's counter index is its place in `Outcome::ALL`.
    #[test]
    fn outcome_indices_follow_all() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i);
        }
    }
}
