//! The inference server as seen by a worker: one `generate` call per attempt.
//!
//! The client here is the same for every API; what differs is a dialect behind
//! [`dialect::Dialect`], one per file: `sglang` speaks SGLang's native `/generate`, `openai`
//! speaks `/v1/completions` and `/v1/chat/completions` (vLLM, llama.cpp, SGLang's OpenAI
//! layer, …). Every dialect streams SSE or not, and reports tokens as they arrive through a
//! [`TokenSink`] so budgets and ETAs see work in flight. Whole answers to `http://` servers
//! go through `h1` (hyper's connection API), the rest through reqwest; `error` says why an
//! attempt failed.
//!
//! Invariants: a `Generation` is returned only for a response that ended normally (a stream
//! must end with a finish reason or `[DONE]`); a stream cut half way is an error and its
//! partial output is dropped; no response body is buffered past `max_response_bytes`;
//! a redirect is never followed, on any path: it is the same permanent error
//! ([`UpstreamError::Redirect`]) whether the answer is streamed or whole; the API key is
//! sent as a header and never appears in an error or a log line.

pub(crate) mod dialect;
mod error;
mod h1;
mod openai;
pub mod render;
mod sglang;
pub(crate) mod sse;
pub mod tls;
mod tool_calls;

pub use error::UpstreamError;

use crate::config::{Api, Sampling};
use dialect::Dialect;
use error::{ambiguous_framing, map_reqwest, redirect_error, root_cause, status_error};
use std::time::{Duration, Instant};

/// Where a completion's token count came from (recorded in shard metadata).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CountSource {
    /// `usage` / `meta_info` reported by the server.
    Server,
    /// The length of the token ids the server returned.
    TokenIds,
    /// Client-side tokenizer over the text.
    Tokenizer,
    /// Number of streamed chunks (last resort).
    Chunks,
}

impl CountSource {
    /// Its name as stored (shard metadata `spool.count_source`, the serde form).
    pub fn name(self) -> &'static str {
        match self {
            CountSource::Server => "server",
            CountSource::TokenIds => "token_ids",
            CountSource::Tokenizer => "tokenizer",
            CountSource::Chunks => "chunks",
        }
    }
}

/// One attempt's input.
pub struct GenerateRequest<'a> {
    /// Unique per attempt: SGLang's `rid`, `X-Request-Id` elsewhere; used to abort.
    pub rid: &'a str,
    pub prompt: &'a str,
    pub prompt_ids: Option<&'a [u32]>,
    /// The chat messages (for `api = "chat"`).
    pub messages: Option<&'a serde_json::Value>,
    pub sampling: &'a Sampling,
    /// OpenAI function schemas offered to the model (chat API; the client-side template
    /// has already rendered them into `prompt` for the others).
    pub tools: Option<&'a serde_json::Value>,
    /// Sent as the chat API's `chat_template_kwargs` (e.g. `enable_thinking = false`).
    pub chat_template_kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// One finished generation, as the server reported it.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub token_ids: Option<Vec<u32>>,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: Option<u32>,
    pub finish_reason: String,
    pub ttft_ms: Option<u32>,
    pub latency_ms: u32,
    /// Number of content events received (the count of last resort).
    pub chunks: u32,
    /// The thinking the server's reasoning parser split off (`reasoning_content`, or
    /// vLLM's newer `reasoning`); None when it sent none.
    pub reasoning: Option<String>,
    /// Generated tool calls (OpenAI's `tool_calls` array), when the server parsed some.
    pub tool_calls: Option<serde_json::Value>,
    /// The prompt's ids as the server rendered them (chat answers of vLLM with
    /// `return_token_ids`, of SGLang with `return_prompt_token_ids`); None elsewhere.
    pub prompt_token_ids: Option<Vec<u32>>,
    /// What the server said the generation stopped on, besides its finish reason.
    pub matched: Matched,
}

/// What a server names as the stop it matched: SGLang's `meta_info.finish_reason.matched`
/// (`/generate`) and `matched_stop` (its OpenAI API), vLLM's `stop_reason`. A token id is
/// the model's stop token (EOS, end of turn; spool sends no `stop_token_ids`), a string one
/// of the request's `stop` strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Matched {
    /// The answer has no such field (llama.cpp, OpenAI).
    #[default]
    Unsaid,
    /// The field is null: on a `stop`, vLLM's way of saying the model's own EOS.
    Null,
    /// A token id.
    Token(u32),
    /// A stop string.
    Text(String),
}

impl Matched {
    /// The field's JSON value read as a match: absent is [`Matched::Unsaid`]; a number that
    /// is no token id or another type is a malformed answer naming `field`.
    pub(crate) fn from_json(
        field: &str,
        v: Option<&serde_json::Value>,
    ) -> Result<Matched, UpstreamError> {
        use serde_json::Value;
        match v {
            None => Ok(Matched::Unsaid),
            Some(Value::Null) => Ok(Matched::Null),
            Some(Value::String(s)) => Ok(Matched::Text(s.clone())),
            Some(Value::Number(n)) => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Matched::Token)
                .ok_or_else(|| {
                    UpstreamError::Malformed(format!("`{field}` is {n}, not a token id"))
                }),
            Some(other) => Err(UpstreamError::Malformed(format!(
                "`{field}` is {other}, not a token id or a string"
            ))),
        }
    }
}

/// Called with the number of new completion tokens as they stream in.
pub type TokenSink<'a> = &'a (dyn Fn(u32) + Send + Sync);

/// A client for one API flavour, shared by every worker (connection reuse).
#[derive(Clone)]
pub struct Upstream {
    client: reqwest::Client,
    /// Whole-body requests to `http://` servers (see `h1`); streams use `client`.
    h1: std::sync::Arc<h1::H1Client>,
    request_timeout: Duration,
    api: Api,
    /// How `api` is spoken (the one place that depends on which API it is).
    dialect: &'static dyn Dialect,
    model: String,
    api_key: Option<String>,
    /// The API key, for redacting what servers say back.
    secrets: crate::secrets::Secrets,
    stream: bool,
    max_response_bytes: u64,
    /// `Some(context)`: clamp `max_tokens` to what fits (see [`Upstream::with_max_tokens_clamp`]).
    clamp_context: Option<u32>,
    /// Servers that refused a stream asking for token ids (SGLang's chat API answers 400):
    /// their streams are sent without the request from then on.
    no_stream_ids: std::sync::Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Deliberately without the key.
        f.debug_struct("Upstream")
            .field("api", &self.api)
            .field("model", &self.model)
            .field("stream", &self.stream)
            .finish()
    }
}

/// Settings for [`Upstream::new`].
pub struct UpstreamOptions {
    pub api: Api,
    pub model: String,
    pub api_key: Option<String>,
    pub stream: bool,
    pub request_timeout: Duration,
    pub max_response_bytes: u64,
    pub pool_size: usize,
}

impl Upstream {
    /// Builds the HTTP clients (whole-body `http://` requests pooled per server, sized for
    /// the concurrency; streams and `https://` on reqwest), trusting
    /// the system's CAs for `https://` servers.
    pub fn new(o: UpstreamOptions) -> Result<Self, UpstreamError> {
        Self::with_roots(o, &tls::TrustRoots::System)
    }

    /// [`Upstream::new`] trusting `roots` for `https://` servers (`server.ca_cert`).
    pub fn with_roots(o: UpstreamOptions, roots: &tls::TrustRoots) -> Result<Self, UpstreamError> {
        let client = tls::configure(reqwest::Client::builder(), roots)
            .no_proxy()
            .timeout(o.request_timeout)
            .connect_timeout(Duration::from_secs(10).min(o.request_timeout))
            // No idle connections: reqwest cannot be told to drop the one connection whose
            // answer was framed ambiguously (`ambiguous_framing`), and hyper pools it once
            // the body is in. Streams last seconds to minutes, so a connection per request
            // is noise; whole-body `http://` requests keep their pool (`h1`).
            .pool_max_idle_per_host(0)
            // The same answer to a redirect as the whole-body client's (`UpstreamError::Redirect`).
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .build()
            .map_err(|e| UpstreamError::ClientBuild(e.to_string()))?;
        let connect_timeout = Duration::from_secs(10).min(o.request_timeout);
        Ok(Self {
            client,
            h1: std::sync::Arc::new(h1::H1Client::new(
                o.pool_size,
                connect_timeout,
                o.api_key.as_deref(),
            )),
            request_timeout: o.request_timeout,
            api: o.api,
            dialect: dialect::of(o.api),
            model: o.model,
            secrets: crate::secrets::Secrets::new(o.api_key.iter()),
            api_key: o.api_key,
            stream: o.stream,
            max_response_bytes: o.max_response_bytes,
            clamp_context: None,
            no_stream_ids: Default::default(),
        })
    }

    /// Which API this client speaks.
    pub fn api(&self) -> Api {
        self.api
    }

    /// One attempt against `base` (e.g. `http://127.0.0.1:30000`).
    pub async fn generate(
        &self,
        base: &str,
        req: &GenerateRequest<'_>,
        sink: TokenSink<'_>,
    ) -> Result<Generation, UpstreamError> {
        self.generate_inner(base, req, sink)
            .await
            .map_err(|e| self.redact(e))
    }

    async fn generate_inner(
        &self,
        base: &str,
        req: &GenerateRequest<'_>,
        sink: TokenSink<'_>,
    ) -> Result<Generation, UpstreamError> {
        let started = Instant::now();
        let clamped = self.clamped_sampling(req);
        let clamped_req;
        let req = match &clamped {
            Some(sampling) => {
                clamped_req = GenerateRequest { sampling, ..*req };
                &clamped_req
            }
            None => req,
        };
        let path = self.dialect.path();
        let mut g = if !self.stream && h1::H1Client::serves(base) {
            self.whole_h1(base, path, req, sink).await?
        } else {
            // reqwest's futures are kilobytes: boxed, so that every item's task (its
            // future is copied when tokio spawns it) stays small on the common h1 path.
            Box::pin(self.via_reqwest(base, path, req, started, sink)).await?
        };
        g.latency_ms = started.elapsed().as_millis().min(u32::MAX as u128) as u32;
        Ok(g)
    }

    /// A whole (non-streamed) answer over spool's own HTTP/1.1 client.
    async fn whole_h1(
        &self,
        base: &str,
        path: &'static str,
        req: &GenerateRequest<'_>,
        sink: TokenSink<'_>,
    ) -> Result<Generation, UpstreamError> {
        let body = self.dialect.body(req, &self.model, false)?;
        let exchange = self
            .h1
            .post_json(base, path, req.rid, body, self.max_response_bytes);
        let reply = tokio::time::timeout(self.request_timeout, exchange)
            .await
            .map_err(|_| UpstreamError::Timeout)??;
        if reply.status.is_redirection() {
            return Err(redirect_error(
                reply.status.as_u16(),
                &format!("{}{path}", base.trim_end_matches('/')),
                reply.location.as_ref(),
            ));
        }
        if !reply.status.is_success() {
            return Err(status_error(
                reply.status.as_u16(),
                reply.retry_after.as_ref(),
                &reply.body,
            ));
        }
        self.parse_whole(&reply.body, sink)
    }

    /// A whole (non-streamed) answer's body, its completion tokens reported to `sink`.
    fn parse_whole(&self, body: &[u8], sink: TokenSink<'_>) -> Result<Generation, UpstreamError> {
        let g = self.dialect.parse_whole(body)?;
        sink(g.completion_tokens.unwrap_or(0));
        Ok(g)
    }

    /// A streamed answer, or a whole one from an `https://` server, over reqwest.
    async fn via_reqwest(
        &self,
        base: &str,
        path: &'static str,
        req: &GenerateRequest<'_>,
        started: Instant,
        sink: TokenSink<'_>,
    ) -> Result<Generation, UpstreamError> {
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let with_ids = !(self.stream && self.streams_without_ids(base));
        let resp = match self.send(&url, req, with_ids).await {
            Err(e) if self.stream && with_ids && refuses_stream_ids(&e) => {
                // SGLang's chat API refuses `return_token_ids` on a stream (400), where vLLM
                // needs it for the ids: learnt per server, the attempt sent again without.
                self.stream_without_ids(base);
                self.send(&url, req, false).await?
            }
            other => other?,
        };
        let g = if self.stream {
            let mut reader =
                sse::Reader::new(resp, self.max_response_bytes, started, base.to_string());
            self.dialect.read_stream(&mut reader, sink).await?
        } else {
            if resp
                .content_length()
                .is_some_and(|n| n > self.max_response_bytes)
            {
                return Err(UpstreamError::TooLarge(self.max_response_bytes));
            }
            let bytes = read_capped(resp, self.max_response_bytes).await?;
            self.parse_whole(&bytes, sink)?
        };
        Ok(g)
    }

    /// Posts one attempt and checks its status; without `with_ids` for a server found to
    /// refuse token ids on a stream.
    async fn send(
        &self,
        url: &str,
        req: &GenerateRequest<'_>,
        with_ids: bool,
    ) -> Result<reqwest::Response, UpstreamError> {
        let body = if with_ids {
            self.dialect.body(req, &self.model, self.stream)?
        } else {
            self.dialect
                .body_without_token_ids(req, &self.model, self.stream)?
        };
        let resp = self
            .post_bytes(url, body)
            .header("x-request-id", req.rid)
            .send()
            .await
            .map_err(|e| map_reqwest(url, e))?;
        check_status(resp).await
    }

    /// Streams to `base` go without asking for token ids from now on (it refused them).
    pub(crate) fn stream_without_ids(&self, base: &str) {
        if let Ok(mut set) = self.no_stream_ids.write() {
            if set.insert(base.to_owned()) {
                tracing::warn!(server = %base, "the server refuses token ids on a stream \
                    (SGLang's chat API); its streams go without them, so completion ids are \
                    spool's own encoding of the text");
            }
        }
    }

    /// Whether `base` was found to refuse token ids on a stream.
    fn streams_without_ids(&self, base: &str) -> bool {
        self.no_stream_ids
            .read()
            .is_ok_and(|set| set.contains(base))
    }

    /// Asks the server to stop generating `rid` (budget cancel), where the dialect has a
    /// request for it; elsewhere dropping the connection did. Best effort.
    pub async fn abort(&self, base: &str, rid: &str) {
        let Some((path, body)) = self.dialect.abort(rid) else {
            return;
        };
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let _ = self
            .post(&url, &body)
            .timeout(Duration::from_secs(5))
            .send()
            .await;
    }

    /// Whether the server answers its health endpoint.
    pub async fn healthy(&self, base: &str) -> bool {
        let url = format!(
            "{}{}",
            base.trim_end_matches('/'),
            self.dialect.health_path()
        );
        let rb = self.authorized(self.client.get(&url).timeout(Duration::from_secs(5)));
        matches!(rb.send().await, Ok(r) if r.status().is_success())
    }

    /// A POST of `body` as JSON (serialised once, by reqwest) with the API key.
    fn post(&self, url: &str, body: &impl serde::Serialize) -> reqwest::RequestBuilder {
        self.authorized(self.client.post(url).json(body))
    }

    /// A POST of a JSON body already serialised, with the same headers in the same order
    /// as [`Upstream::post`] sends.
    fn post_bytes(&self, url: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
        let rb = self
            .client
            .post(url)
            .header(
                reqwest::header::CONTENT_TYPE,
                reqwest::header::HeaderValue::from_static("application/json"),
            )
            .body(body);
        self.authorized(rb)
    }

    /// `rb` with the API key, when one is configured.
    fn authorized(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
    }
}

/// `max_tokens` reduced to what a context of `context` tokens leaves after a prompt of
/// `prompt_tokens` (at least 1: prompts that leave no room are rejected at intake).
pub fn max_tokens_that_fit(max_tokens: u32, context: u32, prompt_tokens: usize) -> u32 {
    let prompt = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
    max_tokens.min(context.saturating_sub(prompt)).max(1)
}

impl Upstream {
    /// With `Some(context)`, every request whose prompt ids are known asks for at most
    /// [`max_tokens_that_fit`] tokens (`server.clamp_max_tokens`); `None` sends
    /// `max_tokens` as configured.
    pub fn with_max_tokens_clamp(mut self, context: Option<u32>) -> Self {
        self.clamp_context = context;
        self
    }

    /// Reads a small JSON document (`/v1/models`, `/get_model_info`, …) with the API key,
    /// within `timeout`; `None` when the server has no such endpoint or answers garbage.
    pub async fn get_json(
        &self,
        base: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<serde_json::Value, UpstreamError> {
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let rb = self.authorized(self.client.get(&url).timeout(timeout));
        let resp = rb.send().await.map_err(|e| map_reqwest(&url, e))?;
        let resp = check_status(resp).await.map_err(|e| self.redact(e))?;
        let bytes = read_capped(resp, 1 << 20).await?;
        serde_json::from_slice(&bytes).map_err(|e| UpstreamError::Malformed(format!("{path}: {e}")))
    }

    /// Reads a small text document (a server's `/metrics`) with the API key, within
    /// `timeout`, at most 4 MiB.
    pub async fn get_text(
        &self,
        base: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<String, UpstreamError> {
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let rb = self.authorized(self.client.get(&url).timeout(timeout));
        let resp = rb.send().await.map_err(|e| map_reqwest(&url, e))?;
        let resp = check_status(resp).await.map_err(|e| self.redact(e))?;
        let bytes = read_capped(resp, 4 << 20).await?;
        String::from_utf8(bytes).map_err(|e| UpstreamError::Malformed(format!("{path}: {e}")))
    }

    /// Posts `body` to `path` and returns the raw response body (the start-up self-check
    /// reads the stream's events itself), within `timeout`.
    pub async fn post_raw(
        &self,
        base: &str,
        path: &str,
        rid: &str,
        body: &serde_json::Value,
        timeout: Duration,
    ) -> Result<Vec<u8>, UpstreamError> {
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let resp = self
            .post(&url, body)
            .header("x-request-id", rid)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| map_reqwest(&url, e))?;
        let resp = check_status(resp).await.map_err(|e| self.redact(e))?;
        read_capped(resp, 1 << 20).await
    }

    /// The error without the API key or any credential-shaped field (a server may echo
    /// the request's headers back in an error body), its server text then cut.
    fn redact(&self, e: UpstreamError) -> UpstreamError {
        e.redacted(&self.secrets)
    }

    fn clamped_sampling(&self, req: &GenerateRequest<'_>) -> Option<Sampling> {
        let context = self.clamp_context?;
        let n = req.prompt_ids?.len();
        let fit = max_tokens_that_fit(req.sampling.max_tokens, context, n);
        (fit < req.sampling.max_tokens).then(|| Sampling {
            max_tokens: fit,
            ..req.sampling.clone()
        })
    }
}

/// Turns a non-2xx response into an error carrying the server's message and Retry-After.
/// Whether `e` is a server's refusal of `return_token_ids` on a stream (SGLang: "400:
/// return_token_ids is not supported with streaming on /v1/chat/completions").
pub(crate) fn refuses_stream_ids(e: &UpstreamError) -> bool {
    matches!(e, UpstreamError::Status { code: 400, message, .. }
        if message.contains("return_token_ids") && message.contains("stream"))
}

async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, UpstreamError> {
    if let Some(e) = ambiguous_framing(resp.headers()) {
        return Err(e); // dropped unread, the answer's connection is closed, not pooled
    }
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    if status.is_redirection() {
        let location = resp.headers().get(reqwest::header::LOCATION);
        return Err(redirect_error(
            status.as_u16(),
            resp.url().as_str(),
            location,
        ));
    }
    let retry_after = resp.headers().get(reqwest::header::RETRY_AFTER).cloned();
    let body = read_prefix(resp, 64 << 10).await;
    Err(status_error(status.as_u16(), retry_after.as_ref(), &body))
}

async fn read_capped(mut resp: reqwest::Response, cap: u64) -> Result<Vec<u8>, UpstreamError> {
    let mut out = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| map_reqwest(resp.url().as_str(), e))?
    {
        if (out.len() + chunk.len()) as u64 > cap {
            return Err(UpstreamError::TooLarge(cap));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Up to `cap` bytes of a body, whatever follows (an error body is only for its message).
async fn read_prefix(mut resp: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = cap.saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored name of each count source is its serde form, which readers parse.
    #[test]
    fn count_source_names_are_their_serde_form() {
        for c in [
            CountSource::Server,
            CountSource::TokenIds,
            CountSource::Tokenizer,
            CountSource::Chunks,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.name());
        }
    }

    /// `max_tokens` is cut to what the context leaves after the prompt, never below 1.
    #[test]
    fn max_tokens_clamped_to_the_context_left() {
        assert_eq!(max_tokens_that_fit(200, 64, 10), 54);
        assert_eq!(max_tokens_that_fit(20, 64, 10), 20);
        assert_eq!(max_tokens_that_fit(200, 64, 63), 1);
        assert_eq!(max_tokens_that_fit(200, 64, 100), 1);
    }

    /// The API key shows neither in the client's `Debug` nor in an error that echoes it.
    #[test]
    fn debug_and_errors_never_show_the_api_key() {
        let key = "sk-test-SECRET-1234567890";
        let up = Upstream::new(UpstreamOptions {
            api: Api::Chat,
            model: "m".into(),
            api_key: Some(key.into()),
            stream: true,
            request_timeout: Duration::from_secs(1),
            max_response_bytes: 1 << 20,
            pool_size: 1,
        })
        .unwrap();
        assert!(!format!("{up:?}").contains(key));
        let echoed = UpstreamError::Status {
            code: 401,
            message: format!("bad header: Authorization: Bearer {key}"),
            retry_after: None,
        };
        let shown = echoed.redacted(&up.secrets).to_string();
        assert!(
            !shown.contains(key) && shown.contains("Bearer ***"),
            "{shown}"
        );
    }

    /// A redirect gets one answer on both paths, streamed (reqwest) and whole (spool's
    /// HTTP/1.1 client): a permanent error naming the request's URL and the `Location`;
    /// the server it points at (which would receive the API key) is never contacted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redirects_are_refused_on_both_paths_naming_the_url_and_location() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let elsewhere = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let location = format!("http://{}/generate", elsewhere.local_addr().unwrap());
        let contacted = std::sync::Arc::new(AtomicUsize::new(0));
        let c = contacted.clone();
        tokio::spawn(async move {
            while let Ok((_sock, _)) = elsewhere.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let answer =
            format!("HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\n\r\n");
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut tmp = [0u8; 4096];
                    // The request's head is enough; the answer says nothing of its body.
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                    let _ = sock.write_all(answer.as_bytes()).await;
                    let _ = sock.read(&mut tmp).await;
                });
            }
        });
        let sampling = Sampling::default();
        let req = GenerateRequest {
            rid: "r1",
            prompt: "hi",
            prompt_ids: None,
            messages: None,
            sampling: &sampling,
            tools: None,
            chat_template_kwargs: None,
        };
        for stream in [false, true] {
            let up = Upstream::new(UpstreamOptions {
                api: Api::Sglang,
                model: "m".into(),
                api_key: Some("sk-secret".into()),
                stream,
                request_timeout: Duration::from_secs(10),
                max_response_bytes: 1 << 20,
                pool_size: 1,
            })
            .unwrap();
            let e = up.generate(&base, &req, &|_| {}).await.unwrap_err();
            match &e {
                UpstreamError::Redirect {
                    code: 302,
                    url,
                    location: l,
                } => {
                    assert_eq!(url, &format!("{base}/generate"), "stream = {stream}");
                    assert_eq!(l, &location, "stream = {stream}");
                }
                other => panic!("stream = {stream}: {other:?}"),
            }
            assert!(
                !e.is_retriable() && !e.is_unreachable(),
                "stream = {stream}"
            );
            assert!(e.to_string().contains(&location), "{e}");
        }
        assert_eq!(
            contacted.load(Ordering::SeqCst),
            0,
            "the redirect was followed"
        );
    }
}
