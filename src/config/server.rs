//! The `[server]` and `[run]` tables: which servers are asked and how, and the worker pool
//! and process around them, with their defaults.
//!
//! Invariant: every table refuses an unknown key (`deny_unknown_fields`); a default here
//! is the one docs/configuration.md states.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
