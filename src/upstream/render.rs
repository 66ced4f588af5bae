//! The server's own rendering of prompts (`[tokenizer] source = "server"` and the
//! start-up `template_check`): the endpoints each server kind offers, found at start by
//! [`detect`], and [`ServerRenderer`], which renders through them.
//!
//! What each kind renders, and how:
//! - **vLLM** (and SGLang versions whose `/tokenize` takes messages): chat and plain
//!   prompts. `POST /tokenize` with `messages`, `tools`, `chat_template_kwargs`,
//!   `add_generation_prompt: true` and `add_special_tokens: false` (the template writes
//!   BOS itself) gives the ids; `POST /detokenize` gives their text (vLLM's `prompt`,
//!   SGLang's `text`). A plain prompt is `POST /tokenize` with `prompt` and
//!   `add_special_tokens`.
//! - **llama.cpp's server**: chat and plain prompts. `POST /apply-template` (`messages`,
//!   `tools`, `chat_template_kwargs`) gives the text, `POST /tokenize` with `content`,
//!   `add_special: true`, `parse_special: true` its ids, as the server's own chat path
//!   tokenizes (its template output loses a leading BOS that `add_special` puts back as
//!   a token). llama.cpp answers a template that fails with a 500: one that persists
//!   through the retries is that row's refusal.
//! - **SGLang** whose `/tokenize` takes only `prompt`: plain prompts only.
//!
//! Invariants: a 4xx (other than 408 and 429) is the row's refusal
//! ([`RemoteError::Refused`], with the server's message), the same on every attempt;
//! other failures are retried with backoff up to `server.max_attempts`, then the input is
//! [`RemoteError::Unavailable`], which says nothing about the row. Answers are read
//! within `server.max_response_bytes`; ids must be `u32`s and agree with any count given.
//! The API key is only ever a header.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use serde_json::{json, Map, Value};

use super::{check_status, map_reqwest, read_capped, Upstream, UpstreamError};
use crate::prompt::remote::{RemoteError, RemoteRenderer, RenderInput};
use crate::prompt::BuiltPrompt;

/// Timeout of each detection request at start.
const DETECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a rendering request may take (tokenizing is milliseconds, but a server
/// may be busy).
const RENDER_TIMEOUT: Duration = Duration::from_secs(120);
/// Rendering requests in flight per [`RemoteRenderer::render_blocking`] call.
const CONCURRENCY: usize = 16;

/// Which rendering endpoints a server has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenderKind {
    /// vLLM's `/tokenize` taking `messages` (and `/detokenize`).
    Tokenize,
    /// llama.cpp's `/apply-template` and `/tokenize` (`content`).
    LlamaCpp,
    /// SGLang's `/tokenize` taking only `prompt`.
    TextOnly,
}

impl RenderKind {
    /// Whether it renders chat messages (every kind renders plain prompts).
    pub fn chat(self) -> bool {
        !matches!(self, RenderKind::TextOnly)
    }

    /// The endpoints, for the log and for messages.
    pub fn describe(self) -> &'static str {
        match self {
            RenderKind::Tokenize => "POST /tokenize with messages (vLLM): chat and text",
            RenderKind::LlamaCpp => "POST /apply-template and /tokenize (llama.cpp): chat and text",
            RenderKind::TextOnly => "POST /tokenize with a prompt only (SGLang): text, not chat",
        }
    }
}

/// What the detection found at one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    Renders(RenderKind),
    /// It answers, without any rendering endpoint.
    NoEndpoint,
    /// It did not answer at all.
    Unreachable,
}

/// One message to render at detection.
fn hello() -> Value {
    json!([{"role": "user", "content": "Hello"}])
}

/// A detection request: its path and body, whether an answer is in the shape sought, and
/// the kind such an answer means.
type Probe = (&'static str, Value, fn(&Value) -> bool, RenderKind);

/// Asks `base` which rendering endpoints it has, trying vLLM's `/tokenize` with
/// messages, llama.cpp's `/apply-template`, then `/tokenize` with a prompt: the first
/// that answers in its server's shape wins.
pub async fn detect(up: &Upstream, base: &str, model: &str) -> Detected {
    // A vLLM-shaped `/tokenize` answer: ids and their count (llama.cpp's has no count).
    let tokenized: fn(&Value) -> bool =
        |v| tokens_of(v, "/tokenize").is_ok_and(|t| !t.is_empty()) && v.get("count").is_some();
    let apply_template: fn(&Value) -> bool = |v| v.get("prompt").is_some_and(Value::is_string);
    let probes: [Probe; 3] = [
        (
            "/tokenize",
            json!({
                "model": model, "messages": hello(),
                "add_generation_prompt": true, "add_special_tokens": false,
            }),
            tokenized,
            RenderKind::Tokenize,
        ),
        (
            "/apply-template",
            json!({"messages": hello()}),
            apply_template,
            RenderKind::LlamaCpp,
        ),
        (
            "/tokenize",
            json!({"model": model, "prompt": "Hello"}),
            tokenized,
            RenderKind::TextOnly,
        ),
    ];
    for (path, body, answers, kind) in probes {
        match up
            .post_json(base, path, &body, DETECT_TIMEOUT, 1 << 20)
            .await
        {
            Ok(v) if answers(&v) => return Detected::Renders(kind),
            Err(e) if e.is_unreachable() => return Detected::Unreachable,
            _ => {}
        }
    }
    Detected::NoEndpoint
}

/// The ids of a `/tokenize` answer: `tokens`, every one a `u32`, as many as any `count`.
fn tokens_of(v: &Value, path: &str) -> Result<Vec<u32>, UpstreamError> {
    let bad = |why: String| UpstreamError::Malformed(format!("{path}: {why}"));
    let tokens = v
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no `tokens` array".into()))?;
    let ids = tokens
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(format!("`tokens` holds {t}, not a token id")))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    match v.get("count").map(Value::as_u64) {
        None => Ok(ids),
        Some(Some(n)) if n == ids.len() as u64 => Ok(ids),
        Some(_) => Err(bad(format!(
            "`count` is {}, but `tokens` holds {}",
            v["count"],
            ids.len()
        ))),
    }
}

/// The text of a `/detokenize` answer: vLLM's `prompt`, SGLang's `text` or llama.cpp's
/// `content`.
fn text_of(v: &Value, path: &str) -> Result<String, UpstreamError> {
    ["prompt", "text", "content"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .map(str::to_owned)
        .ok_or_else(|| UpstreamError::Malformed(format!("{path}: no text in the answer")))
}

impl Upstream {
    /// Posts `body` to `path` and reads the JSON answer (at most `cap` bytes) within
    /// `timeout`.
    pub(crate) async fn post_json(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        timeout: Duration,
        cap: u64,
    ) -> Result<Value, UpstreamError> {
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let resp = self
            .post(&url, body)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| self.redact(map_reqwest(&url, e)))?;
        let resp = check_status(resp).await.map_err(|e| self.redact(e))?;
        let bytes = read_capped(resp, cap).await?;
        serde_json::from_slice(&bytes).map_err(|e| UpstreamError::Malformed(format!("{path}: {e}")))
    }
}

/// The chat request's template variables split as servers take them: `tools` apart, the
/// rest as `chat_template_kwargs`.
fn chat_fields(kwargs: &Map<String, Value>) -> (Option<&Value>, Map<String, Value>) {
    let tools = kwargs.get("tools").filter(|t| !t.is_null());
    let rest = kwargs
        .iter()
        .filter(|(k, _)| k.as_str() != "tools")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (tools, rest)
}

/// Prompts rendered by the servers that can (round robin over those able to render each
/// input), several at a time.
#[derive(Debug)]
pub struct ServerRenderer {
    up: Upstream,
    servers: Vec<(String, RenderKind)>,
    model: String,
    attempts: u32,
    cap: u64,
    handle: tokio::runtime::Handle,
    next: AtomicUsize,
}

impl ServerRenderer {
    /// A renderer over `servers` (URL and kind); `None` when there are none. Must be
    /// built inside the runtime its blocking calls use.
    pub fn new(
        up: Upstream,
        servers: Vec<(String, RenderKind)>,
        model: String,
        attempts: u32,
        max_response_bytes: u64,
    ) -> Option<ServerRenderer> {
        if servers.is_empty() {
            return None;
        }
        Some(ServerRenderer {
            up,
            servers,
            model,
            attempts: attempts.max(1),
            cap: max_response_bytes,
            handle: tokio::runtime::Handle::current(),
            next: AtomicUsize::new(0),
        })
    }

    /// Whether some server renders chat messages.
    pub fn renders_chat(&self) -> bool {
        self.servers.iter().any(|(_, k)| k.chat())
    }

    /// The next server able to render `input`.
    fn pick(&self, input: &RenderInput) -> Option<&(String, RenderKind)> {
        let able: Vec<&(String, RenderKind)> = self
            .servers
            .iter()
            .filter(|(_, k)| !input.is_chat() || k.chat())
            .collect();
        if able.is_empty() {
            return None;
        }
        Some(able[self.next.fetch_add(1, Ordering::Relaxed) % able.len()])
    }

    /// One request, retried while it fails for a reason other than the input; a 5xx
    /// that persists is the input's when `persistent_5xx_refuses`.
    async fn call(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        persistent_5xx_refuses: bool,
    ) -> Result<Value, RemoteError> {
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let err = match self
                .up
                .post_json(base, path, body, RENDER_TIMEOUT, self.cap)
                .await
            {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let at = format!("POST {}{path}", base.trim_end_matches('/'));
            match &err {
                UpstreamError::Status { code, .. } if !err.is_retriable() => {
                    return Err(RemoteError::Refused(format!("{at}: {err} (code {code})")))
                }
                UpstreamError::TooLarge(_) => {
                    return Err(RemoteError::Refused(format!("{at}: {err}")))
                }
                _ if !err.is_retriable() => {
                    return Err(RemoteError::Unavailable(format!("{at}: {err}")))
                }
                _ => {}
            }
            if attempt >= self.attempts {
                let status_5xx = matches!(&err, UpstreamError::Status { code, .. } if *code >= 500);
                let why = format!("{at}: {err} (after {attempt} attempts)");
                return Err(if status_5xx && persistent_5xx_refuses {
                    RemoteError::Refused(why)
                } else {
                    RemoteError::Unavailable(why)
                });
            }
            let wait = Duration::from_millis(250u64 << attempt.min(6));
            tracing::debug!(server = %base, path, attempt, error = %err, "rendering request failed; retrying");
            tokio::time::sleep(
                err.retry_after()
                    .unwrap_or(wait)
                    .min(Duration::from_secs(30)),
            )
            .await;
        }
    }

    async fn render_input(&self, input: &RenderInput) -> Result<BuiltPrompt, RemoteError> {
        let Some((base, kind)) = self.pick(input) else {
            return Err(RemoteError::Refused(format!(
                "no server renders chat messages (found: {}); use [tokenizer] source = \"client\"",
                self.describe()
            )));
        };
        let malformed = |e: UpstreamError| RemoteError::Unavailable(format!("{base}: {e}"));
        match (kind, input) {
            (RenderKind::LlamaCpp, RenderInput::Text { text, add_special }) => {
                let body =
                    json!({"content": text, "add_special": add_special, "parse_special": true});
                let v = self.call(base, "/tokenize", &body, false).await?;
                let ids = tokens_of(&v, "/tokenize").map_err(malformed)?;
                Ok(BuiltPrompt {
                    text: text.clone(),
                    token_ids: Some(ids),
                })
            }
            (RenderKind::LlamaCpp, RenderInput::Chat { messages, kwargs }) => {
                let (tools, rest) = chat_fields(kwargs);
                let mut body = json!({"messages": messages, "add_generation_prompt": true});
                if let Some(t) = tools {
                    body["tools"] = t.clone();
                }
                if !rest.is_empty() {
                    body["chat_template_kwargs"] = Value::Object(rest);
                }
                let v = self.call(base, "/apply-template", &body, true).await?;
                let text = v
                    .get("prompt")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        malformed(UpstreamError::Malformed(
                            "/apply-template: no `prompt`".into(),
                        ))
                    })?
                    .to_owned();
                let body = json!({"content": text, "add_special": true, "parse_special": true});
                let v = self.call(base, "/tokenize", &body, false).await?;
                let ids = tokens_of(&v, "/tokenize").map_err(malformed)?;
                Ok(BuiltPrompt {
                    text,
                    token_ids: Some(ids),
                })
            }
            (_, RenderInput::Text { text, add_special }) => {
                let body =
                    json!({"model": self.model, "prompt": text, "add_special_tokens": add_special});
                let v = self.call(base, "/tokenize", &body, false).await?;
                let ids = tokens_of(&v, "/tokenize").map_err(malformed)?;
                Ok(BuiltPrompt {
                    text: text.clone(),
                    token_ids: Some(ids),
                })
            }
            (_, RenderInput::Chat { messages, kwargs }) => {
                let (tools, rest) = chat_fields(kwargs);
                let mut body = json!({
                    "model": self.model, "messages": messages,
                    "add_generation_prompt": true, "add_special_tokens": false,
                });
                if let Some(t) = tools {
                    body["tools"] = t.clone();
                }
                if !rest.is_empty() {
                    body["chat_template_kwargs"] = Value::Object(rest);
                }
                let v = self.call(base, "/tokenize", &body, false).await?;
                let ids = tokens_of(&v, "/tokenize").map_err(malformed)?;
                let body = json!({"model": self.model, "tokens": ids});
                let v = self.call(base, "/detokenize", &body, false).await?;
                let text = text_of(&v, "/detokenize").map_err(malformed)?;
                Ok(BuiltPrompt {
                    text,
                    token_ids: Some(ids),
                })
            }
        }
    }
}

impl RemoteRenderer for ServerRenderer {
    fn render<'a>(
        &'a self,
        input: &'a RenderInput,
    ) -> BoxFuture<'a, Result<BuiltPrompt, RemoteError>> {
        self.render_input(input).boxed()
    }

    fn render_blocking(&self, inputs: &[RenderInput]) -> Vec<Result<BuiltPrompt, RemoteError>> {
        let all = futures_util::stream::iter(inputs.iter().map(|i| self.render_input(i)))
            .buffered(CONCURRENCY)
            .collect::<Vec<_>>();
        self.handle.block_on(all)
    }

    fn describe(&self) -> String {
        self.servers
            .iter()
            .map(|(url, kind)| format!("{url}: {}", kind.describe()))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/tokenize` answers are read as ids only when every token is a `u32` and any count
    /// agrees; `/detokenize` answers in each server's spelling give their text.
    #[test]
    fn answers_are_read_in_each_servers_shape() {
        let vllm = json!({"count": 3, "max_model_len": 8, "tokens": [1, 2, 3], "token_strs": null});
        assert_eq!(tokens_of(&vllm, "/t").unwrap(), vec![1, 2, 3]);
        let llama = json!({"tokens": [7]});
        assert_eq!(tokens_of(&llama, "/t").unwrap(), vec![7]);
        for bad in [
            json!({"count": 2, "tokens": [1]}),
            json!({"tokens": [1, -1]}),
            json!({"tokens": [4294967296u64]}),
            json!({"tokens": [{"id": 1, "piece": "a"}]}),
            json!({"ids": [1]}),
        ] {
            assert!(tokens_of(&bad, "/t").is_err(), "{bad}");
        }
        for (v, want) in [
            (json!({"prompt": "a"}), "a"),
            (json!({"text": "b"}), "b"),
            (json!({"content": "c"}), "c"),
        ] {
            assert_eq!(text_of(&v, "/d").unwrap(), want);
        }
        assert!(text_of(&json!({"tokens": []}), "/d").is_err());
    }

    /// A row's `tools` go to the request's `tools`; its other variables to
    /// `chat_template_kwargs`.
    #[test]
    fn tools_are_sent_apart_from_the_template_variables() {
        let kwargs: Map<String, Value> = serde_json::from_value(
            json!({"tools": [{"type": "function"}], "enable_thinking": false}),
        )
        .unwrap();
        let (tools, rest) = chat_fields(&kwargs);
        assert_eq!(tools, Some(&json!([{"type": "function"}])));
        assert_eq!(Value::Object(rest), json!({"enable_thinking": false}));
    }
}
