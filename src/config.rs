//! `spool.toml`: the user's description of a job (docs/configuration.md documents every
//! key).
//!
//! Invariants: every key is known (serde `deny_unknown_fields`), so a typo is an error naming
//! the key and the file, never a silently ignored setting; every relative path is resolved
//! against the config file's directory at load time, so nothing later depends on the cwd;
//! dataset names are safe folder names (`[A-Za-z0-9_.-]+`, not `.` or `..`) and unique;
//! every server URL is `http://` or `https://` with a host, written in the characters RFC
//! 3986 allows (nothing is percent-encoded on the user's behalf, so the URL that is logged
//! is the URL that is requested), without user info, query or fragment; `server.ca_cert`
//! holds at least one usable CA certificate; an API key is header-safe.

use crate::upstream::tls::TrustRoots;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A config that cannot be used; the message names the file and the key (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bad config {path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    #[error("bad config {path}: key `{key}`: {detail}")]
    Invalid {
        path: PathBuf,
        key: String,
        detail: String,
    },
}

/// Which wire protocol the inference server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// SGLang's native `/generate`: token ids in and out, cancel by `rid`.
    Sglang,
    /// OpenAI-style `/v1/completions` (vLLM, llama.cpp, SGLang, …).
    Completions,
    /// OpenAI-style `/v1/chat/completions`: the server applies its own template.
    Chat,
}

/// What to do with requests in flight once a dataset's budget is met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPolicy {
    /// Let them finish: a small, reported overshoot, no wasted generation.
    #[default]
    Finish,
    /// Abort them and return the items to pending: never over budget.
    Cancel,
}

/// The whole job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    #[serde(default = "default_output_dir")]
    pub output_dir: PathBuf,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub tokenizer: Option<TokenizerConfig>,
    #[serde(default)]
    pub sampling: Sampling,
    #[serde(default)]
    pub shards: ShardConfig,
    /// Object-store settings beyond the `AWS_*` environment (an `s3://` output or input).
    #[serde(default)]
    pub storage: crate::output::bucket::BucketOptions,
    #[serde(default, rename = "dataset")]
    pub datasets: Vec<DatasetConfig>,
    /// Defaults for every dataset's generation keys (each `[[dataset]]` may override).
    /// Spelled out here and there rather than `#[serde(flatten)]`ed: flattening loses the
    /// line of an unknown key in the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<Turns>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_reasoning: Option<HistoryReasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    /// Template variables; a table of integer weights is drawn from per row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_length: Option<OnLength>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_format: Option<PromptFormat>,
    /// Where this config was read from (not a key).
    #[serde(skip)]
    pub source: PathBuf,
    /// sha256 of the config file's bytes, stamped into every shard.
    #[serde(skip)]
    pub sha256: String,
    /// This worker's partition of a cluster job (not a key: worked out at start from
    /// `[run] partitions`, `--partition` and the scheduler's environment).
    #[serde(skip)]
    pub partition: Option<crate::cluster::partition::Partition>,
    /// Per dataset, the ids already committed to the object store, which intake skips
    /// (not a key: read from the store at start).
    #[serde(skip)]
    pub committed: HashMap<String, Arc<HashSet<String>>>,
    /// Per dataset, a budget that grows while the run goes (a cluster partition's part of
    /// its job's budget), read in place of `token_budget` (not a key).
    #[serde(skip)]
    pub allowances: HashMap<String, Arc<crate::run::allowance::Allowance>>,
}

/// The inference server(s).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    #[serde(default = "default_api")]
    pub api: Api,
    #[serde(default = "default_urls")]
    pub urls: Vec<String>,
    #[serde(default = "default_model")]
    pub model: String,
    /// Name of the env var holding the bearer token; the token itself is never in the config.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// A PEM file of the CA(s) that sign the `https://` servers' certificates (a private
    /// CA); when set, these are the only roots trusted. Absent: the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<PathBuf>,
    #[serde(default = "default_request_timeout")]
    pub request_timeout_s: f64,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_true")]
    pub stream: bool,
    /// Cap on one response body; a larger one is refused rather than exhausting memory.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: u64,
    /// The model's context length in tokens, when the server does not report it (or to
    /// use a smaller one). Absent: asked from the server at start (see `probe`: SGLang
    /// `/get_model_info` and `/get_server_info`, `/v1/models` `max_model_len`, llama.cpp
    /// `/props`). Prompts that leave no room for generation are rejected at intake.
    #[serde(default)]
    pub context_length: Option<u32>,
    /// Send `max_tokens = min(max_tokens, context − prompt tokens)` instead of the
    /// configured `max_tokens` when the prompt leaves less room than that (vLLM refuses
    /// such requests). Needs the context length and prompt ids (a `[tokenizer]`).
    #[serde(default)]
    pub clamp_max_tokens: bool,
    /// One tiny generation request per server at start, to log its streaming shape and
    /// whether it returns token ids and usage.
    #[serde(default = "default_true")]
    pub self_check: bool,
    /// How requests are spread over `urls`.
    #[serde(default)]
    pub routing: Routing,
}

/// Requests in flight: a fixed number across all servers, or `"auto"` (each server's own
/// limit, found by [`crate::run::concurrency`], at most `max_concurrency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concurrency {
    Fixed(usize),
    Auto,
}

impl Concurrency {
    /// The fixed number, if it is one.
    pub fn fixed(self) -> Option<usize> {
        match self {
            Concurrency::Fixed(n) => Some(n),
            Concurrency::Auto => None,
        }
    }
}

impl std::str::FromStr for Concurrency {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Concurrency::Auto),
            n => n
                .parse()
                .map(Concurrency::Fixed)
                .map_err(|_| format!("`{n}`: a number of requests, or \"auto\"")),
        }
    }
}

impl Serialize for Concurrency {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Concurrency::Fixed(n) => s.serialize_u64(*n as u64),
            Concurrency::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Concurrency {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom("expected a number of requests or \"auto\""))?
        {
            Raw::N(n) => Ok(Concurrency::Fixed(n as usize)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// How a request picks its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// A prompt goes where its prefix went before (samples, shared system prompts and
    /// few-shot blocks share that server's prefix cache), else where its prefix hashes on a
    /// ring; either only while that server's load stays within bounds.
    #[default]
    Prefix,
    /// The server with the fewest requests in flight.
    LeastRequests,
    /// Servers in turn.
    RoundRobin,
}

/// The worker pool and the process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default = "default_concurrency")]
    pub concurrency: Concurrency,
    /// With `concurrency = "auto"`: the most requests in flight on one server.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
    #[serde(default = "default_progress_every")]
    pub progress_every: u64,
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace_s: f64,
    #[serde(default = "default_metrics_addr")]
    pub metrics_addr: String,
    #[serde(default)]
    pub budget_policy: BudgetPolicy,
    /// Workers of a cluster job (a Kubernetes Indexed Job's completions, a Slurm array's
    /// size); each takes the items that hash to its index. Absent: one process, or
    /// `SLURM_ARRAY_TASK_COUNT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u32>,
}

/// Client-side tokenization and chat templating.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// SGLang's `--reasoning-parser` name, in place of the one the template implies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<String>,
    /// SGLang's `--tool-call-parser` name, in place of the one the template implies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_parser: Option<String>,
    /// Who renders prompts into ids: spool (`client`), or the server's own rendering
    /// endpoint (`server`), for models whose rendering spool does not reproduce.
    #[serde(default)]
    pub source: PromptSource,
    /// The start-up comparison of spool's rendering with the server's; absent: on where a
    /// server renders (a warning only with `source = "server"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_check: Option<TemplateCheck>,
}

/// Who renders prompts into the ids that are sent and stored (`[tokenizer] source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptSource {
    /// spool's template and tokenizer, on every core at intake.
    #[default]
    Client,
    /// The server's rendering endpoint (vLLM `/tokenize`, llama.cpp `/apply-template`).
    Server,
}

/// What a difference found by the start-up template check does (`true`, `"warn"`,
/// `false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value", into = "serde_json::Value")]
pub enum TemplateCheck {
    /// Stops the run (exit 2) before any generation.
    Stop,
    /// Logs the difference and goes on.
    Warn,
    /// No check.
    Off,
}

impl TryFrom<serde_json::Value> for TemplateCheck {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        match v {
            serde_json::Value::Bool(true) => Ok(TemplateCheck::Stop),
            serde_json::Value::Bool(false) => Ok(TemplateCheck::Off),
            serde_json::Value::String(s) if s == "warn" => Ok(TemplateCheck::Warn),
            other => Err(format!("expected true, false or \"warn\", not {other}")),
        }
    }
}

impl From<TemplateCheck> for serde_json::Value {
    fn from(c: TemplateCheck) -> serde_json::Value {
        match c {
            TemplateCheck::Stop => true.into(),
            TemplateCheck::Warn => "warn".into(),
            TemplateCheck::Off => false.into(),
        }
    }
}

impl TokenizerConfig {
    /// The check as configured, else its default: stop with spool's rendering, warn with
    /// the server's (spool's rendering is then sent nowhere).
    pub fn template_check(&self) -> TemplateCheck {
        self.template_check.unwrap_or(match self.source {
            PromptSource::Client => TemplateCheck::Stop,
            PromptSource::Server => TemplateCheck::Warn,
        })
    }
}

/// Sampling parameters; `[sampling]` gives defaults, `[dataset.sampling]` overrides per key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    #[serde(default = "default_top_p")]
    pub top_p: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
}

/// Per-dataset overrides: every key optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingOverride {
    pub max_tokens: Option<u32>,
    /// A number, a list (drawn uniformly per generation) or a weighted table.
    pub temperature: Option<Choice>,
    /// A number, a list (drawn uniformly per generation) or a weighted table.
    pub top_p: Option<Choice>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
}

/// A sampling value of a dataset: one number, or several drawn from per generation
/// (`[0.6, 1.0]` uniformly, `{ "0.6" = 3, "1.0" = 1 }` by weight).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value", into = "serde_json::Value")]
pub enum Choice {
    One(f64),
    List(Vec<f64>),
    Weighted(Vec<(f64, u64)>),
}

impl Choice {
    /// The value used where one number is needed (the first listed; a table's first
    /// value in file order); the per-generation draw is [`crate::prompt::draw::Drawer`]'s.
    pub fn first(&self) -> f64 {
        match self {
            Choice::One(v) => *v,
            Choice::List(l) => l.first().copied().unwrap_or(f64::NAN),
            Choice::Weighted(w) => w.first().map_or(f64::NAN, |(v, _)| *v),
        }
    }

    /// The values and their weights (1 each for a list).
    pub fn options(&self) -> Result<Vec<(f64, u64)>, String> {
        match self {
            Choice::One(v) => Ok(vec![(*v, 1)]),
            Choice::List(l) => Ok(l.iter().map(|v| (*v, 1)).collect()),
            Choice::Weighted(w) => Ok(w.clone()),
        }
    }
}

impl TryFrom<serde_json::Value> for Choice {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Choice, String> {
        use serde_json::Value;
        let number = |v: &Value| {
            v.as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| format!("{v} is not a number"))
        };
        match &v {
            Value::Number(_) => number(&v).map(Choice::One),
            Value::Array(l) if l.is_empty() => Err("an empty list has nothing to draw".into()),
            Value::Array(l) => l
                .iter()
                .map(number)
                .collect::<Result<_, _>>()
                .map(Choice::List),
            Value::Object(t) if t.is_empty() => Err("an empty table has nothing to draw".into()),
            Value::Object(t) => t
                .iter()
                .map(|(k, w)| {
                    let value = k
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|f| f.is_finite())
                        .ok_or_else(|| format!("table key `{k}` is not a number"))?;
                    match w.as_u64() {
                        Some(n) if n > 0 => Ok((value, n)),
                        _ => Err(format!(
                            "the weight of `{k}` must be a positive integer, not {w}"
                        )),
                    }
                })
                .collect::<Result<_, _>>()
                .map(Choice::Weighted),
            other => Err(format!(
                "expected a number, a list of numbers or a table of weights, not {other}"
            )),
        }
    }
}

impl From<Choice> for serde_json::Value {
    fn from(c: Choice) -> serde_json::Value {
        use serde_json::Value;
        match c {
            Choice::One(v) => Value::from(v),
            Choice::List(l) => Value::from(l),
            Choice::Weighted(w) => Value::Object(
                w.into_iter()
                    .map(|(v, n)| (v.to_string(), Value::from(n)))
                    .collect(),
            ),
        }
    }
}

/// When a shard is closed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    #[serde(default = "default_max_rows")]
    pub max_rows: usize,
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    #[serde(default = "default_compression_level")]
    pub compression_level: i32,
}

/// One prompt set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    pub name: String,
    pub path: PathBuf,
    #[serde(default)]
    pub token_budget: Option<u64>,
    #[serde(default)]
    pub max_prompts: Option<u64>,
    #[serde(default)]
    pub sampling: SamplingOverride,
    /// Overrides of the top level's generation keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<Turns>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_reasoning: Option<HistoryReasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    /// Template variables; a table of integer weights is drawn from per row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// What a turn cut by `max_tokens` does to its conversation (`turns = "all"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_length: Option<OnLength>,
    /// How a `prompt` row reaches the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_format: Option<PromptFormat>,
}

/// The most generations per prompt (`samples`): a bound on one item's kept generations.
pub const MAX_SAMPLES: u32 = 1024;

/// What happens to the model's thinking.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reasoning {
    /// Kept apart from the answer, in the `reasoning` column.
    #[default]
    Save,
    /// Thinking switched off (`enable_thinking = false` in the template or the request).
    Disable,
    /// Left in the completion text as generated.
    Raw,
}

/// Which assistant turns of a conversation are generated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Turns {
    /// The last one, after the conversation as given.
    #[default]
    Last,
    /// Every one, in order, each after the replies generated before it (on-policy).
    All,
}

/// Whether earlier generated turns' thinking is sent back in a conversation's history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HistoryReasoning {
    #[default]
    Drop,
    Keep,
}

/// What a turn cut by `max_tokens` does to the rest of its conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnLength {
    /// The conversation ends there, partial (`partial = "length"`): no later turn is
    /// conditioned on a cut reply.
    #[default]
    Stop,
    /// Later turns go on after the cut reply.
    Continue,
}

/// How a `prompt` row is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptFormat {
    /// As one user turn through the chat template, as a chat model sees a request.
    Chat,
    /// The text as is, no template.
    Raw,
}

/// A dataset's generation keys with the defaults applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationSpec {
    pub reasoning: Reasoning,
    pub turns: Turns,
    pub history_reasoning: HistoryReasoning,
    pub samples: u32,
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub on_length: OnLength,
    /// None: the default, `chat` where a chat template renders prompts, else `raw`.
    pub prompt_format: Option<PromptFormat>,
}

impl GenerationSpec {
    /// Whether an item of this dataset has more than one generation (and so is kept in
    /// parts until it is closed).
    pub fn is_multi(&self) -> bool {
        self.samples > 1 || self.turns == Turns::All
    }
}

impl Config {
    /// The generation keys of dataset `d`: its own, else the top level's, else defaults.
    pub fn generation_of(&self, d: &DatasetConfig) -> GenerationSpec {
        let (own, top) = (d, self);
        let mut kwargs = top.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(k) = &own.chat_template_kwargs {
            kwargs.extend(k.clone());
        }
        GenerationSpec {
            reasoning: own.reasoning.or(top.reasoning).unwrap_or_default(),
            turns: own.turns.or(top.turns).unwrap_or_default(),
            history_reasoning: own
                .history_reasoning
                .or(top.history_reasoning)
                .unwrap_or_default(),
            samples: own.samples.or(top.samples).unwrap_or(1),
            chat_template_kwargs: kwargs,
            on_length: own.on_length.or(top.on_length).unwrap_or_default(),
            prompt_format: own.prompt_format.or(top.prompt_format),
        }
    }
}

fn default_data_dir() -> PathBuf {
    "spool-data".into()
}
fn default_output_dir() -> PathBuf {
    "spool-out".into()
}
fn default_api() -> Api {
    Api::Sglang
}
fn default_urls() -> Vec<String> {
    vec!["http://127.0.0.1:30000".into()]
}
fn default_model() -> String {
    "default".into()
}
fn default_request_timeout() -> f64 {
    3600.0
}
fn default_max_attempts() -> u32 {
    6
}
fn default_true() -> bool {
    true
}
fn default_max_response_bytes() -> u64 {
    64 << 20
}
fn default_concurrency() -> Concurrency {
    Concurrency::Fixed(150)
}
fn default_max_concurrency() -> usize {
    512
}
fn default_progress_every() -> u64 {
    50
}
fn default_shutdown_grace() -> f64 {
    30.0
}
fn default_metrics_addr() -> String {
    "127.0.0.1:9464".into()
}
fn default_max_tokens() -> u32 {
    10240
}
fn default_temperature() -> f64 {
    0.7
}
fn default_top_p() -> f64 {
    0.95
}
fn default_max_rows() -> usize {
    10_000
}
fn default_max_bytes() -> u64 {
    256 << 20
}
fn default_compression_level() -> i32 {
    3
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api: default_api(),
            urls: default_urls(),
            model: default_model(),
            api_key_env: None,
            ca_cert: None,
            request_timeout_s: default_request_timeout(),
            max_attempts: default_max_attempts(),
            stream: true,
            max_response_bytes: default_max_response_bytes(),
            context_length: None,
            clamp_max_tokens: false,
            self_check: true,
            routing: Routing::Prefix,
        }
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            concurrency: default_concurrency(),
            max_concurrency: default_max_concurrency(),
            progress_every: default_progress_every(),
            shutdown_grace_s: default_shutdown_grace(),
            metrics_addr: default_metrics_addr(),
            budget_policy: BudgetPolicy::Finish,
            partitions: None,
        }
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            max_tokens: default_max_tokens(),
            temperature: default_temperature(),
            top_p: default_top_p(),
            top_k: None,
            min_p: None,
            seed: None,
            stop: None,
        }
    }
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            max_rows: default_max_rows(),
            max_bytes: default_max_bytes(),
            compression_level: default_compression_level(),
        }
    }
}

impl Sampling {
    /// The effective sampling of a dataset: the defaults with its overrides applied.
    pub fn with(&self, o: &SamplingOverride) -> Sampling {
        Sampling {
            max_tokens: o.max_tokens.unwrap_or(self.max_tokens),
            temperature: o
                .temperature
                .as_ref()
                .map_or(self.temperature, Choice::first),
            top_p: o.top_p.as_ref().map_or(self.top_p, Choice::first),
            top_k: o.top_k.or(self.top_k),
            min_p: o.min_p.or(self.min_p),
            seed: o.seed.or(self.seed),
            stop: o.stop.clone().or_else(|| self.stop.clone()),
        }
    }
}

/// Command-line settings that win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub output_dir: Option<PathBuf>,
    pub concurrency: Option<Concurrency>,
    pub metrics_addr: Option<String>,
    /// Replaces `[server] urls` (a Slurm task's own server port).
    pub server_urls: Vec<String>,
}

impl Config {
    /// Reads, validates and resolves a config file; CLI overrides are applied last.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes.clone()).map_err(|_| ConfigError::Parse {
            path: path.to_path_buf(),
            detail: "not UTF-8".into(),
        })?;
        let mut cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            detail: e.to_string().trim_end().to_string(),
        })?;
        cfg.source = path.to_path_buf();
        cfg.sha256 = hex(&Sha256::digest(&bytes));
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        cfg.apply(overrides);
        cfg.resolve(&base);
        cfg.validate()?;
        Ok(cfg)
    }

    fn apply(&mut self, o: &Overrides) {
        if let Some(d) = &o.data_dir {
            self.data_dir = d.clone();
        }
        if let Some(d) = &o.output_dir {
            self.output_dir = d.clone();
        }
        if let Some(c) = o.concurrency {
            self.run.concurrency = c;
        }
        if let Some(a) = &o.metrics_addr {
            self.run.metrics_addr = a.clone();
        }
        if !o.server_urls.is_empty() {
            self.server.urls = o.server_urls.clone();
        }
    }

    fn resolve(&mut self, base: &Path) {
        let join = |p: &PathBuf| {
            // A `scheme://` location (object storage) is not a path.
            if p.is_absolute() || p.to_string_lossy().contains("://") {
                p.clone()
            } else {
                base.join(p)
            }
        };
        self.data_dir = join(&self.data_dir);
        self.output_dir = join(&self.output_dir);
        self.server.ca_cert = self.server.ca_cert.as_ref().map(join);
        if let Some(t) = &mut self.tokenizer {
            t.path = join(&t.path);
            t.chat_template = t.chat_template.as_ref().map(join);
        }
        for d in &mut self.datasets {
            d.path = join(&d.path);
        }
    }

    /// An error naming this config's file and `key` (exit code 2), also for what is only
    /// found out at start-up (a server's certificate refused).
    pub fn invalid(&self, key: &str, detail: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.source.clone(),
            key: key.into(),
            detail: detail.into(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.server.urls.is_empty() {
            return Err(self.invalid("server.urls", "at least one URL is needed"));
        }
        for (i, u) in self.server.urls.iter().enumerate() {
            if let Err(why) = check_url(u) {
                // Debug form: a space, tab or line break in the URL is visible.
                return Err(self.invalid(&format!("server.urls[{i}]"), format!("{u:?}: {why}")));
            }
        }
        self.trust_roots()?;
        if self.server.max_attempts == 0 {
            return Err(self.invalid("server.max_attempts", "must be at least 1"));
        }
        if self.server.request_timeout_s.is_nan() || self.server.request_timeout_s <= 0.0 {
            return Err(self.invalid("server.request_timeout_s", "must be > 0"));
        }
        if self.server.context_length == Some(0) {
            return Err(self.invalid("server.context_length", "must be > 0"));
        }
        if self.run.concurrency == Concurrency::Fixed(0) {
            return Err(self.invalid("run.concurrency", "must be at least 1"));
        }
        if self.run.max_concurrency == 0 {
            return Err(self.invalid("run.max_concurrency", "must be at least 1"));
        }
        if self.shards.max_rows == 0 {
            return Err(self.invalid("shards.max_rows", "must be at least 1"));
        }
        if !(1..=22).contains(&self.shards.compression_level) {
            return Err(self.invalid("shards.compression_level", "zstd levels are 1..=22"));
        }
        if self.datasets.is_empty() {
            return Err(self.invalid("dataset", "no [[dataset]] given"));
        }
        if let Some(t) = &self.tokenizer {
            use crate::prompt::syntax::{REASONING_PARSERS, TOOL_PARSERS};
            for (key, name, known) in [
                (
                    "tokenizer.reasoning_parser",
                    &t.reasoning_parser,
                    REASONING_PARSERS,
                ),
                ("tokenizer.tool_parser", &t.tool_parser, TOOL_PARSERS),
            ] {
                if let Some(n) = name.as_deref().filter(|n| !known.contains(n)) {
                    return Err(self.invalid(
                        key,
                        format!("unknown parser `{n}`; known: {}", known.join(", ")),
                    ));
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, d) in self.datasets.iter().enumerate() {
            let key = format!("dataset[{i}].name");
            if !valid_name(&d.name) {
                return Err(self.invalid(
                    &key,
                    format!(
                        "`{}` is not a safe folder name (use [A-Za-z0-9_.-]+, not `.` or `..`)",
                        d.name
                    ),
                ));
            }
            if !seen.insert(d.name.clone()) {
                return Err(self.invalid(&key, format!("`{}` appears twice", d.name)));
            }
            let s = self.sampling.with(&d.sampling);
            if s.max_tokens == 0 {
                return Err(
                    self.invalid(&format!("dataset[{i}].sampling.max_tokens"), "must be > 0")
                );
            }
            if let Some(n) = d.samples.filter(|n| !(1..=MAX_SAMPLES).contains(n)) {
                return Err(self.invalid(
                    &format!("dataset[{i}].samples"),
                    format!("dataset `{}`: must be 1..={MAX_SAMPLES}, not {n}", d.name),
                ));
            }
            let prompt_format = d.prompt_format.or(self.prompt_format);
            if prompt_format == Some(PromptFormat::Raw) && self.server.api == Api::Chat {
                let key = match d.prompt_format {
                    Some(_) => format!("dataset[{i}].prompt_format"),
                    None => "prompt_format".into(),
                };
                return Err(self.invalid(
                    &key,
                    format!(
                        "dataset `{}`: \"raw\" needs a text API (api = \"sglang\" or \"completions\"): the chat API renders every prompt as a turn",
                        d.name
                    ),
                ));
            }
            if let Err(why) = crate::prompt::draw::Drawer::of_dataset(self, d) {
                let key = why.split(':').next().unwrap_or_default();
                return Err(self.invalid(
                    &format!("dataset[{i}].{key}"),
                    format!("dataset `{}`: {why}", d.name),
                ));
            }
        }
        if let Some(n) = self.samples.filter(|n| !(1..=MAX_SAMPLES).contains(n)) {
            return Err(self.invalid("samples", format!("must be 1..={MAX_SAMPLES}, not {n}")));
        }
        if self.sampling.max_tokens == 0 {
            return Err(self.invalid("sampling.max_tokens", "must be > 0"));
        }
        Ok(())
    }

    /// The dataset's effective sampling parameters.
    pub fn sampling_of(&self, d: &DatasetConfig) -> Sampling {
        self.sampling.with(&d.sampling)
    }

    /// The API key from the environment, if configured. Never logged. A key that cannot
    /// go into an `Authorization` header as is (a space, a control character such as a
    /// trailing newline, non-ASCII) is refused here rather than rejected by every request.
    pub fn api_key(&self) -> Result<Option<String>, ConfigError> {
        match &self.server.api_key_env {
            None => Ok(None),
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => match v.bytes().position(|b| !(0x21..0x7f).contains(&b)) {
                    None => Ok(Some(v)),
                    Some(at) => Err(self.invalid(
                        "server.api_key_env",
                        format!(
                            "the key in `{var}` has a character that cannot be sent in an HTTP header \
                             (byte {at} of {}: {}); only visible ASCII is allowed",
                            v.len(),
                            byte_kind(v.as_bytes()[at])
                        ),
                    )),
                },
                _ => Err(self.invalid(
                    "server.api_key_env",
                    format!("environment variable `{var}` is not set"),
                )),
            },
        }
    }

    /// The CAs `https://` servers are checked against: `server.ca_cert`'s, or the system's.
    pub fn trust_roots(&self) -> Result<TrustRoots, ConfigError> {
        match &self.server.ca_cert {
            None => Ok(TrustRoots::System),
            Some(p) => crate::upstream::tls::load_ca(p)
                .map(TrustRoots::Only)
                .map_err(|why| self.invalid("server.ca_cert", why)),
        }
    }
}

/// Why `url` cannot be a server's base URL (paths such as `/generate` are appended to it).
fn check_url(url: &str) -> Result<(), String> {
    let bytes = url.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if !url_byte(b) {
            return Err(format!(
                "{} at byte {i} is not allowed in a URL (percent-encode it, e.g. a space as %20)",
                byte_kind(b)
            ));
        }
        if b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        {
            return Err(format!(
                "`%` at byte {i} does not start a percent-encoding (`%` and two hex digits)"
            ));
        }
    }
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("http" | "https")) {
        return Err(match scheme {
            Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {
                "write the scheme in lower case (`http://` or `https://`)".into()
            }
            Some(s) => format!("scheme `{s}` is not supported (use http:// or https://)"),
            None => "not an http:// or https:// URL".into(),
        });
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("no host".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(
            "user info (`user:password@`) is not supported: it would be logged; use server.api_key_env"
                .into(),
        );
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(
            "a `?query` or `#fragment` is not supported: API paths are appended to the URL".into(),
        );
    }
    Ok(())
}

/// The bytes RFC 3986 allows in a URI: unreserved, reserved (gen- and sub-delims) and `%`.
fn url_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=%".contains(&b)
}

/// A byte named for an error message (the text around it may be a secret).
fn byte_kind(b: u8) -> String {
    match b {
        b' ' => "a space".into(),
        b'\t' => "a tab".into(),
        b'\n' | b'\r' => "a line break".into(),
        0..=0x1f | 0x7f => format!("control character 0x{b:02x}"),
        0x80.. => "a non-ASCII character".into(),
        _ => format!("`{}`", b as char),
    }
}

/// Whether a dataset name is usable as a folder name under `output_dir`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

/// Lower-case hex of bytes (digests in metadata and logs).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spool.toml");
        std::fs::write(&p, text).unwrap();
        Config::load(&p, &Overrides::default())
    }

    /// An unknown parser name is refused at load, naming the key and listing the names
    /// it takes; a known one loads.
    #[test]
    fn parser_names_are_checked() {
        let cfg = |k: &str, v: &str| {
            format!(
                "[server]\nurls=['http://127.0.0.1:1']\n[tokenizer]\npath='t.json'\n{k} = '{v}'\n\
                 [[dataset]]\nname='a'\npath='a.jsonl'\n"
            )
        };
        let e = load_str(&cfg("tool_parser", "kimi"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.tool_parser") && e.contains("kimi_k2, minimax-m2"),
            "{e}"
        );
        let e = load_str(&cfg("reasoning_parser", "glm4"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.reasoning_parser") && e.contains("glm45"),
            "{e}"
        );
        let ok = load_str(&cfg("reasoning_parser", "kimi_k2")).unwrap();
        assert_eq!(
            ok.tokenizer.unwrap().reasoning_parser.as_deref(),
            Some("kimi_k2")
        );
    }

    /// A misspelt key is an error naming the key and the file, not a setting silently ignored.
    #[test]
    fn unknown_key_is_named() {
        let e = load_str("[run]\nconcurency = 3\n[[dataset]]\nname='a'\npath='a.jsonl'\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("concurency"), "{e}");
        assert!(e.contains("spool.toml"), "{e}");
    }

    /// A typo in the generation keys (a misspelt key, an unknown value) is refused with
    /// its line; bad values are refused naming the dataset and the key; good ones load,
    /// the top level giving defaults.
    #[test]
    fn generation_keys_are_checked() {
        let base =
            "[server]\nurls = ['http://127.0.0.1:1']\n[[dataset]]\nname='a'\npath='a.jsonl'\n";
        for (extra, says) in [
            ("turn = 'all'\n", "line 6"),
            ("turns = 'every'\n", "line 6"),
            ("reasoning = 'hide'\n", "line 6"),
            ("history_reasoning = 'kept'\n", "line 6"),
        ] {
            let e = load_str(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        for (extra, key) in [
            ("samples = 0\n", "dataset[0].samples"),
            ("samples = 1025\n", "dataset[0].samples"),
            (
                "chat_template_kwargs = { effort = { low = 0 } }\n",
                "dataset[0].chat_template_kwargs.effort",
            ),
            (
                "reasoning = 'disable'\nchat_template_kwargs = { enable_thinking = true }\n",
                "enable_thinking",
            ),
        ] {
            let e = load_str(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("dataset `a`"), "{extra}: {e}");
        }
        let e = load_str(&format!(
            "{base}[dataset.sampling]\ntemperature = {{ \"0.6\" = -1 }}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("line 7") && e.contains("positive integer"),
            "{e}"
        );
        let cfg = load_str(&format!(
            "samples = 4\nchat_template_kwargs = {{ effort = {{ low = 4, high = 2 }} }}\n{base}\
             turns = 'all'\n[dataset.sampling]\ntemperature = [0.6, 1.0]\n"
        ))
        .unwrap();
        let g = cfg.generation_of(&cfg.datasets[0]);
        assert_eq!((g.samples, g.turns), (4, Turns::All));
        assert!(g.chat_template_kwargs.contains_key("effort"));
        assert_eq!(cfg.sampling_of(&cfg.datasets[0]).temperature, 0.6);
    }

    /// `[tokenizer] source` and `template_check` read as documented: the check defaults to
    /// stopping with spool's rendering and to a warning with the server's; a bad value is
    /// refused naming the key's line.
    #[test]
    fn tokenizer_source_and_template_check_keys() {
        let base = "[[dataset]]\nname='a'\npath='a.jsonl'\n[tokenizer]\npath='t.json'\n";
        let t = |extra: &str| load_str(&format!("{base}{extra}")).map(|c| c.tokenizer.unwrap());
        let plain = t("").unwrap();
        assert_eq!(plain.source, PromptSource::Client);
        assert_eq!(plain.template_check(), TemplateCheck::Stop);
        let server = t("source = 'server'\n").unwrap();
        assert_eq!(server.template_check(), TemplateCheck::Warn);
        for (v, want) in [
            ("true", TemplateCheck::Stop),
            ("false", TemplateCheck::Off),
            ("'warn'", TemplateCheck::Warn),
        ] {
            let c = t(&format!("source = 'server'\ntemplate_check = {v}\n")).unwrap();
            assert_eq!(c.template_check(), want, "{v}");
        }
        for bad in ["template_check = 'stop'\n", "source = 'both'\n"] {
            let e = t(bad).unwrap_err().to_string();
            assert!(e.contains("line 6"), "{bad}: {e}");
        }
    }

    /// Dataset names that would escape or collide as folder names are refused, naming the key.
    #[test]
    fn bad_dataset_names_are_refused() {
        for n in ["../x", "a/b", "..", ".", ""] {
            let e = load_str(&format!("[[dataset]]\nname='{n}'\npath='a.jsonl'\n")).unwrap_err();
            assert!(e.to_string().contains("dataset[0].name"), "{e}");
        }
    }

    /// The URLs servers are really given pass: a port, a path prefix, a trailing slash,
    /// IPv6, a percent-encoded byte, https; the rest of the rules are shown through the
    /// binary (`tls::urls_that_cannot_work_exit_2_naming_the_key`).
    #[test]
    fn usual_server_urls_pass() {
        for u in [
            "http://127.0.0.1:30000",
            "http://gpu-7.internal:8000/",
            "https://api.example.com/v1-proxy/llm",
            "http://[::1]:8000",
            "http://h:1/a%20b",
            "https://h",
        ] {
            assert_eq!(check_url(u), Ok(()), "{u}");
        }
        assert!(check_url("http://h/a b")
            .unwrap_err()
            .contains("a space at byte 10"));
    }

    /// Relative paths resolve against the config file's folder, a dataset's sampling
    /// overrides the global one key by key, and the config's hash is recorded.
    #[test]
    fn relative_paths_resolve_against_the_config_and_overrides_apply() {
        let c = load_str(
            "data_dir='d'\n[sampling]\nmax_tokens=100\n[[dataset]]\nname='a'\npath='p/a.jsonl'\n[dataset.sampling]\ntemperature=0.1\n",
        )
        .unwrap();
        assert!(c.data_dir.is_absolute() && c.data_dir.ends_with("d"));
        assert!(c.datasets[0].path.ends_with("p/a.jsonl"));
        let s = c.sampling_of(&c.datasets[0]);
        assert_eq!((s.max_tokens, s.temperature), (100, 0.1));
        assert_eq!(c.sha256.len(), 64);
    }
}
