//! The inference server as seen by a worker: one `generate` call per attempt.
//!
//! `sglang` speaks SGLang's native `/generate`; `openai` speaks `/v1/completions` and
//! `/v1/chat/completions` (vLLM, llama.cpp, SGLang's OpenAI layer, …). Both stream SSE or
//! not, and both report tokens as they arrive through a [`TokenSink`] so budgets and ETAs
//! see work in flight.
//!
//! Invariants: a `Generation` is returned only for a response that ended normally (a stream
//! must end with a finish reason or `[DONE]`); a stream cut half way is an error and its
//! partial output is dropped; no response body is buffered past `max_response_bytes`;
//! a redirect is never followed, on any path: it is the same permanent error
//! ([`UpstreamError::Redirect`]) whether the answer is streamed or whole; the API key is
//! sent as a header and never appears in an error or a log line.

mod h1;
mod openai;
mod sglang;
pub(crate) mod sse;
pub mod tls;

use crate::config::{Api, Sampling};
use std::time::{Duration, Instant};

/// Why an attempt failed; `is_retriable` decides between backoff and a permanent failure.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to {url}: {detail}")]
    Connect { url: String, detail: String },
    #[error("request timed out")]
    Timeout,
    #[error("HTTP {code}: {message}")]
    Status {
        code: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("stream cut before the end: {0}")]
    StreamCut(String),
    #[error("malformed response: {0}")]
    Malformed(String),
    #[error("response larger than {0} bytes, refused")]
    TooLarge(u64),
    /// Inference servers do not redirect, and following one to another host would hand it
    /// the API key: a redirect is refused on every path, naming where it pointed.
    #[error("HTTP {code} redirect from {url} to {location} refused: spool does not follow redirects (point server.url at the final address)")]
    Redirect {
        code: u16,
        url: String,
        location: String,
    },
    /// A server URL no request can be made to (a path with a space, an invalid host).
    #[error("cannot request {url}: {detail}")]
    BadUrl { url: String, detail: String },
}

impl UpstreamError {
    /// Transient errors (connection, timeout, 408, 429, 5xx, cut streams, garbled bodies)
    /// are worth another attempt; other 4xx mean the request itself is bad.
    pub fn is_retriable(&self) -> bool {
        match self {
            UpstreamError::Connect { .. }
            | UpstreamError::Timeout
            | UpstreamError::StreamCut(_)
            | UpstreamError::Malformed(_) => true,
            UpstreamError::Status { code, .. } => *code == 408 || *code == 429 || *code >= 500,
            UpstreamError::TooLarge(_)
            | UpstreamError::Redirect { .. }
            | UpstreamError::BadUrl { .. } => false,
        }
    }

    /// The server's `Retry-After`, which backoff honours.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            UpstreamError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// A connection that could not be made says nothing about the item: it must not burn
    /// an attempt (SPEC §4.4, dispatch pauses while every server is down).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. })
    }

    /// The same error with every occurrence of `secret` replaced by `***` (a server may
    /// echo the request's headers in its error body; the key must not reach a log line,
    /// the queue or `status`).
    pub fn redacted(self, secret: &str) -> UpstreamError {
        if secret.is_empty() {
            return self;
        }
        let r = |s: String| {
            if s.contains(secret) {
                s.replace(secret, "***")
            } else {
                s
            }
        };
        match self {
            UpstreamError::Connect { url, detail } => UpstreamError::Connect {
                url: r(url),
                detail: r(detail),
            },
            UpstreamError::Status {
                code,
                message,
                retry_after,
            } => UpstreamError::Status {
                code,
                message: r(message),
                retry_after,
            },
            UpstreamError::StreamCut(s) => UpstreamError::StreamCut(r(s)),
            UpstreamError::Malformed(s) => UpstreamError::Malformed(r(s)),
            UpstreamError::Redirect {
                code,
                url,
                location,
            } => UpstreamError::Redirect {
                code,
                url: r(url),
                location: r(location),
            },
            UpstreamError::BadUrl { url, detail } => UpstreamError::BadUrl {
                url: r(url),
                detail: r(detail),
            },
            e @ (UpstreamError::Timeout | UpstreamError::TooLarge(_)) => e,
        }
    }

    /// Short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect { .. } => "connect",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Status { .. } => "status",
            UpstreamError::StreamCut(_) => "stream_cut",
            UpstreamError::Malformed(_) => "malformed",
            UpstreamError::TooLarge(_) => "too_large",
            UpstreamError::Redirect { .. } => "redirect",
            UpstreamError::BadUrl { .. } => "bad_url",
        }
    }
}

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

/// One attempt's input.
pub struct GenerateRequest<'a> {
    /// Unique per attempt: SGLang's `rid`, `X-Request-Id` elsewhere; used to abort.
    pub rid: &'a str,
    pub prompt: &'a str,
    pub prompt_ids: Option<&'a [u32]>,
    /// The chat messages (for `api = "chat"`).
    pub messages: Option<&'a serde_json::Value>,
    pub sampling: &'a Sampling,
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
    model: String,
    api_key: Option<String>,
    stream: bool,
    max_response_bytes: u64,
    /// `Some(context)`: clamp `max_tokens` to what fits (see [`Upstream::with_max_tokens_clamp`]).
    clamp_context: Option<u32>,
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
            .map_err(|e| UpstreamError::Connect {
                url: String::new(),
                detail: e.to_string(),
            })?;
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
            model: o.model,
            api_key: o.api_key,
            stream: o.stream,
            max_response_bytes: o.max_response_bytes,
            clamp_context: None,
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
        let path = match self.api {
            Api::Sglang => "/generate",
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        };
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
        let body = match self.api {
            Api::Sglang => serde_json::to_vec(&sglang::body(req, false)),
            Api::Completions | Api::Chat => serde_json::to_vec(&openai::request_body(
                req,
                &self.model,
                false,
                self.api == Api::Chat,
            )),
        }
        .map_err(|e| UpstreamError::Malformed(format!("request: {e}")))?;
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
        let g = match self.api {
            Api::Sglang => sglang::parse_full(body)?,
            Api::Completions | Api::Chat => openai::parse_full(body, self.api == Api::Chat)?,
        };
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
        let rb = match self.api {
            Api::Sglang => self.post(&url, &sglang::body(req, self.stream)),
            Api::Completions | Api::Chat => {
                let chat = self.api == Api::Chat;
                self.post(
                    &url,
                    &openai::request_body(req, &self.model, self.stream, chat),
                )
            }
        };
        let resp = rb
            .header("x-request-id", req.rid)
            .send()
            .await
            .map_err(|e| map_reqwest(&url, e))?;
        let resp = check_status(resp).await?;
        let g = if self.stream {
            let mut reader =
                sse::Reader::new(resp, self.max_response_bytes, started, base.to_string());
            match self.api {
                Api::Sglang => sglang::read_stream(&mut reader, sink).await?,
                Api::Completions | Api::Chat => {
                    openai::read_stream(&mut reader, self.api == Api::Chat, sink).await?
                }
            }
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

    /// Asks SGLang to stop generating `rid` (budget cancel). Best effort.
    pub async fn abort(&self, base: &str, rid: &str) {
        if self.api != Api::Sglang {
            return; // OpenAI-style servers abort when the connection is dropped.
        }
        let url = format!("{}/abort_request", base.trim_end_matches('/'));
        let _ = self
            .post(&url, &serde_json::json!({ "rid": rid }))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
    }

    /// Whether the server answers its health endpoint.
    pub async fn healthy(&self, base: &str) -> bool {
        let path = match self.api {
            Api::Sglang => "/health",
            _ => "/v1/models",
        };
        let url = format!("{}{}", base.trim_end_matches('/'), path);
        let mut rb = self.client.get(&url).timeout(Duration::from_secs(5));
        if let Some(k) = &self.api_key {
            rb = rb.bearer_auth(k);
        }
        matches!(rb.send().await, Ok(r) if r.status().is_success())
    }

    /// A POST of `body` as JSON (serialised once, by reqwest) with the API key.
    fn post(&self, url: &str, body: &impl serde::Serialize) -> reqwest::RequestBuilder {
        let mut rb = self.client.post(url).json(body);
        if let Some(k) = &self.api_key {
            rb = rb.bearer_auth(k);
        }
        rb
    }
}

// --- Context limits (issue 6): clamping max_tokens to what the context leaves. ---------

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
        let mut rb = self.client.get(&url).timeout(timeout);
        if let Some(k) = &self.api_key {
            rb = rb.bearer_auth(k);
        }
        let resp = rb.send().await.map_err(|e| map_reqwest(&url, e))?;
        let resp = check_status(resp).await.map_err(|e| self.redact(e))?;
        let bytes = read_capped(resp, 1 << 20).await?;
        serde_json::from_slice(&bytes).map_err(|e| UpstreamError::Malformed(format!("{path}: {e}")))
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

    /// The error without the API key (a server may echo it back in an error body).
    fn redact(&self, e: UpstreamError) -> UpstreamError {
        match &self.api_key {
            Some(k) => e.redacted(k),
            None => e,
        }
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

// -----------------------------------------------------------------------------------------

/// Classifies a transport error. A connection that could not be made — refused, or a
/// connect *timeout* (a host that is down drops the SYN) — is `Connect`, which burns no
/// attempt; checking `is_timeout` first once turned a dead server into permanently failed
/// items (regression test: `connect_timeout_is_unreachable_not_a_timeout`).
fn map_reqwest(url: &str, e: reqwest::Error) -> UpstreamError {
    if e.is_connect() {
        UpstreamError::Connect {
            url: url.to_string(),
            detail: root_cause(&e),
        }
    } else if e.is_timeout() {
        UpstreamError::Timeout
    } else if e.is_body() || e.is_decode() {
        UpstreamError::StreamCut(root_cause(&e))
    } else {
        // Request-level failures after connecting (reset, closed): transient.
        UpstreamError::StreamCut(root_cause(&e))
    }
}

/// RFC 9112 §6.3: an answer with both `Transfer-Encoding` and `Content-Length` may be read
/// by either by a proxy on the way, so what follows it on the connection (a smuggled
/// answer) cannot be trusted; it is handled as an error, which also closes its connection.
fn ambiguous_framing(headers: &http::HeaderMap) -> Option<UpstreamError> {
    (headers.contains_key(http::header::TRANSFER_ENCODING)
        && headers.contains_key(http::header::CONTENT_LENGTH))
    .then(|| {
        UpstreamError::Malformed(
            "answer framed by both Transfer-Encoding and Content-Length (a request-smuggling shape); its connection is closed".into(),
        )
    })
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// `Retry-After` as RFC 9110 allows it: delay-seconds (fractions tolerated) or an
/// HTTP-date, which counts from `now` (a date already past means "now").
fn parse_retry_after(v: &str, now: std::time::SystemTime) -> Option<Duration> {
    let v = v.trim();
    if let Ok(s) = v.parse::<f64>() {
        return (s.is_finite() && s >= 0.0).then(|| Duration::from_secs_f64(s));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Turns a non-2xx response into an error carrying the server's message and Retry-After.
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

/// A 3xx answer as the error every path gives it: refused, naming the request's URL and
/// where the server pointed (shown as sent, lossily if it is not text).
fn redirect_error(
    code: u16,
    url: &str,
    location: Option<&reqwest::header::HeaderValue>,
) -> UpstreamError {
    let location = location.map_or_else(
        || "(no Location)".to_string(),
        |l| {
            String::from_utf8_lossy(l.as_bytes())
                .chars()
                .take(500)
                .collect()
        },
    );
    UpstreamError::Redirect {
        code,
        url: url.to_string(),
        location,
    }
}

/// A non-2xx answer as an error: the server's message and its `Retry-After`.
fn status_error(
    code: u16,
    retry_after: Option<&reqwest::header::HeaderValue>,
    body: &[u8],
) -> UpstreamError {
    UpstreamError::Status {
        code,
        message: error_message(body),
        retry_after: retry_after
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now())),
    }
}

/// The human part of an error body: vLLM/OpenAI `{"message"}` or `{"error": {"message"}}`.
fn error_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        let m = v
            .get("message")
            .or_else(|| v.get("error").and_then(|e| e.get("message")))
            .or_else(|| v.get("error"))
            .or_else(|| v.get("detail"));
        if let Some(m) = m {
            return match m.as_str() {
                Some(s) => s.to_string(),
                None => m.to_string(),
            };
        }
    }
    let s = String::from_utf8_lossy(body);
    s.chars().take(500).collect()
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

fn sampling_fields(s: &Sampling, obj: &mut serde_json::Map<String, serde_json::Value>) {
    use serde_json::json;
    obj.insert("temperature".into(), json!(s.temperature));
    obj.insert("top_p".into(), json!(s.top_p));
    if let Some(k) = s.top_k {
        obj.insert("top_k".into(), json!(k));
    }
    if let Some(p) = s.min_p {
        obj.insert("min_p".into(), json!(p));
    }
    if let Some(seed) = s.seed {
        obj.insert("seed".into(), json!(seed));
    }
    if let Some(stop) = &s.stop {
        obj.insert("stop".into(), json!(stop));
    }
}

/// An error object sent inside a 200 stream (SGLang reports request validation this way):
/// a status code it carries, or a context-length complaint, is permanent; else the stream
/// is treated as cut.
fn stream_error(err: &serde_json::Value) -> UpstreamError {
    let message = err
        .get("message")
        .and_then(|m| m.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| err.to_string());
    let code = err.get("code").and_then(|c| c.as_u64()).map(|c| c as u16);
    let lower = message.to_ascii_lowercase();
    match code {
        Some(code) if (400..600).contains(&code) => UpstreamError::Status {
            code,
            message,
            retry_after: None,
        },
        _ if lower.contains("context length") || lower.contains("too long") => {
            UpstreamError::Status {
                code: 400,
                message,
                retry_after: None,
            }
        }
        _ => UpstreamError::StreamCut(format!("server error in stream: {message}")),
    }
}

/// A count the server reported: absent or not a number is `None` (servers differ in what
/// they fill in); a number no token count can be (negative, fractional, past `u32`) is a
/// malformed answer rather than a value clamped or wrapped into a plausible one.
fn as_u32(field: &str, v: Option<&serde_json::Value>) -> Result<Option<u32>, UpstreamError> {
    match v {
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| UpstreamError::Malformed(format!("`{field}` is {n}, not a count"))),
        _ => Ok(None),
    }
}

/// Token ids the server reported: absent or not a list is `None`; a list holding anything
/// but ids that fit `u32` is a malformed answer, never truncated into other tokens.
fn as_ids(field: &str, v: Option<&serde_json::Value>) -> Result<Option<Vec<u32>>, UpstreamError> {
    let Some(arr) = v.and_then(|v| v.as_array()) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(arr.len());
    for x in arr {
        let id = x
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                UpstreamError::Malformed(format!("`{field}` holds {x}, not a token id"))
            })?;
        out.push(id);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {

    /// Retry-After as delay-seconds or as an HTTP-date (RFC 9110 §10.2.3), both honoured;
    /// a past date means retry now; garbage is ignored.
    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Tue, 01 Dec 2026 10:00:00 GMT").unwrap();
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("0.5", now),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 10:00:42 GMT", now),
            Some(Duration::from_secs(42))
        );
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 09:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-3", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
    }
    use super::*;

    #[test]
    fn retriable_classification() {
        let s = |code| UpstreamError::Status {
            code,
            message: String::new(),
            retry_after: None,
        };
        assert!(s(429).is_retriable() && s(408).is_retriable() && s(503).is_retriable());
        assert!(!s(400).is_retriable() && !s(404).is_retriable());
        assert!(UpstreamError::Timeout.is_retriable());
        assert!(!UpstreamError::TooLarge(1).is_retriable());
        let redirect = UpstreamError::Redirect {
            code: 301,
            url: "http://a/generate".into(),
            location: "http://b/generate".into(),
        };
        let bad = UpstreamError::BadUrl {
            url: "http://a/b c".into(),
            detail: "space".into(),
        };
        for e in [redirect, bad] {
            assert!(!e.is_retriable() && !e.is_unreachable(), "{e}");
        }
    }

    #[test]
    fn max_tokens_clamped_to_the_context_left() {
        assert_eq!(max_tokens_that_fit(200, 64, 10), 54);
        assert_eq!(max_tokens_that_fit(20, 64, 10), 20);
        assert_eq!(max_tokens_that_fit(200, 64, 63), 1);
        assert_eq!(max_tokens_that_fit(200, 64, 100), 1);
    }

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
        let shown = echoed.redacted(key).to_string();
        assert!(
            !shown.contains(key) && shown.contains("Bearer ***"),
            "{shown}"
        );
    }

    /// Regression: a connect *timeout* (a host that is down drops the SYN) was classified
    /// as a request timeout, so a dead server burned attempts until items failed for good.
    #[tokio::test]
    async fn connect_timeout_is_unreachable_not_a_timeout() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // A backlog of 0 holds one pending connection; later SYNs are dropped, as by a
        // host that is down.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        let addr = listener.local_addr().unwrap();
        let _filler = std::net::TcpStream::connect(addr).unwrap();
        tls::install_provider();
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_millis(200))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let url = format!("http://{addr}/generate");
        let err = client.get(&url).send().await.unwrap_err();
        let e = map_reqwest(&url, err);
        assert!(e.is_unreachable(), "{e:?}");
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

    #[test]
    fn error_messages_from_real_server_shapes() {
        let vllm = br#"{"object":"error","message":"This model's maximum context length is 8 tokens.","type":"BadRequestError","code":400}"#;
        assert!(error_message(vllm).starts_with("This model's maximum"));
        let oai = br#"{"error":{"message":"bad thing","type":"invalid_request_error"}}"#;
        assert_eq!(error_message(oai), "bad thing");
        assert_eq!(error_message(b"plain"), "plain");
    }
}
