//! The interface every API dialect implements: where a generation is posted, the body it
//! sends, how a whole answer and a stream are read, how a request is aborted, and what the
//! start-up self-check sends and reads.
//!
//! Invariants: [`of`] is the one place an [`Api`] picks its dialect, so the client in
//! `mod.rs` never asks which API it speaks; a dialect is stateless (one static value per
//! API, shared by every worker), and whatever it reads it reports through the same
//! [`Generation`] and [`UpstreamError`] types, so retries and shard rows do not depend on
//! the dialect.

use super::{openai, sglang, sse, GenerateRequest, Generation, TokenSink, UpstreamError};
use crate::config::Api;
use futures_util::future::BoxFuture;

/// One API dialect. Adding one means a file implementing this and an arm in [`of`].
pub(crate) trait Dialect: Send + Sync {
    /// The path generation requests are posted to (e.g. `/generate`).
    fn path(&self) -> &'static str;

    /// The path whose 2xx answer means the server is up (probed while it is out of rotation).
    fn health_path(&self) -> &'static str;

    /// The JSON body of one attempt; `model` is the configured model name.
    fn body(
        &self,
        req: &GenerateRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<Vec<u8>, UpstreamError>;

    /// [`Dialect::body`] without asking for completion token ids: for a server that
    /// refuses the request for ids on a stream (SGLang's chat API). Dialects that never
    /// ask for them send the same body.
    fn body_without_token_ids(
        &self,
        req: &GenerateRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<Vec<u8>, UpstreamError> {
        self.body(req, model, stream)
    }

    /// A whole (non-streamed) answer's body.
    fn parse_whole(&self, body: &[u8]) -> Result<Generation, UpstreamError>;

    /// A streamed answer, its new completion tokens reported to `sink` as they arrive.
    fn read_stream<'a>(
        &'a self,
        r: &'a mut sse::Reader,
        sink: TokenSink<'a>,
    ) -> BoxFuture<'a, Result<Generation, UpstreamError>>;

    /// The request (path and body) that stops the server generating `rid`; `None` when
    /// dropping the connection is what aborts it.
    fn abort(&self, rid: &str) -> Option<(&'static str, serde_json::Value)>;

    /// The self-check's request body (posted to [`Dialect::path`]): `max_tokens` tokens,
    /// greedy, `ignore_eos`, the prompt's ids when known, else a one-word prompt.
    fn check_body(
        &self,
        model: &str,
        stream: bool,
        prompt_ids: Option<&[u32]>,
        max_tokens: u32,
        rid: &str,
    ) -> serde_json::Value;

    /// What one event of a self-check answer (or the whole answer) holds.
    fn check_event(&self, event: &serde_json::Value) -> Seen;

    /// Whether every stream carries deltas only; `false`: the shape (cumulative or deltas)
    /// depends on the server's flags and is told from the events.
    fn streams_deltas_only(&self) -> bool;
}

/// What one self-check event holds, in the dialect's terms read out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// How many completion token ids it carries (`None`: no ids field).
    pub(crate) ids: Option<usize>,
    /// The running completion token count it reports.
    pub(crate) count: Option<u64>,
    /// Its completion text.
    pub(crate) text: String,
    /// It reports usage (a completion token count) apart from a running count.
    pub(crate) usage: bool,
}

/// The dialect `api` speaks.
pub(crate) fn of(api: Api) -> &'static dyn Dialect {
    match api {
        Api::Sglang => &sglang::Sglang,
        Api::Completions => &openai::COMPLETIONS,
        Api::Chat => &openai::CHAT,
    }
}

/// A request body as JSON bytes, as reqwest's `json` would send it; a body serde cannot
/// encode is [`UpstreamError::Encode`], a bug of ours rather than of the answer.
pub(super) fn to_json(body: &impl serde::Serialize) -> Result<Vec<u8>, UpstreamError> {
    serde_json::to_vec(body).map_err(|e| UpstreamError::Encode(e.to_string()))
}

/// An error object sent inside a 200 stream (SGLang reports request validation this way):
/// a status code it carries, or a context-length complaint, is permanent; else the stream
/// is treated as cut.
pub(super) fn stream_error(err: &serde_json::Value) -> UpstreamError {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each API posts to its own path and probes its own health endpoint; only SGLang has
    /// an abort request (OpenAI-style servers stop when the connection drops).
    #[test]
    fn each_api_picks_its_paths_and_abort() {
        let paths = |api| {
            let d = of(api);
            (
                d.path(),
                d.health_path(),
                d.abort("r1").map(|(p, b)| (p, b.to_string())),
            )
        };
        assert_eq!(
            paths(Api::Sglang),
            (
                "/generate",
                "/health",
                Some(("/abort_request", r#"{"rid":"r1"}"#.to_string()))
            )
        );
        assert_eq!(
            paths(Api::Completions),
            ("/v1/completions", "/v1/models", None)
        );
        assert_eq!(
            paths(Api::Chat),
            ("/v1/chat/completions", "/v1/models", None)
        );
    }

    /// An error object inside a stream: a status it carries or a context-length complaint
    /// is a permanent `Status`; anything else is a cut stream, retried.
    #[test]
    fn stream_errors_are_status_or_cut() {
        let e = stream_error(&serde_json::json!({"message": "bad", "code": 422}));
        assert!(
            matches!(e, UpstreamError::Status { code: 422, .. }),
            "{e:?}"
        );
        let e = stream_error(&serde_json::json!({"message": "Input is too long"}));
        assert!(
            matches!(e, UpstreamError::Status { code: 400, .. }),
            "{e:?}"
        );
        let e = stream_error(&serde_json::json!({"message": "oom", "code": 7}));
        assert!(
            matches!(e, UpstreamError::StreamCut(_)) && e.is_retriable(),
            "{e:?}"
        );
    }

    /// A generation with `tools` and `chat_template_kwargs`, byte for byte per API: chat
    /// sends both after the messages; `/v1/completions` and `/generate` send neither
    /// (spool's template rendered them into the prompt).
    #[test]
    fn generation_bodies_carry_tools_and_kwargs_for_chat_only() {
        let sampling = crate::config::Sampling {
            max_tokens: 8,
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            min_p: None,
            seed: None,
            stop: None,
        };
        let tools =
            serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let kwargs: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"enable_thinking":false}"#).unwrap();
        let req = GenerateRequest {
            rid: "r",
            prompt: "Hello",
            prompt_ids: Some(&[3]),
            messages: None,
            sampling: &sampling,
            tools: Some(&tools),
            chat_template_kwargs: Some(&kwargs),
        };
        let body = |api| String::from_utf8(of(api).body(&req, "m", false).unwrap()).unwrap();
        assert_eq!(
            body(Api::Chat),
            r#"{"model":"m","max_tokens":8,"temperature":0.0,"top_p":1.0,"stream":false,"return_token_ids":true,"return_prompt_token_ids":true,"messages":[{"role":"user","content":"Hello"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"chat_template_kwargs":{"enable_thinking":false}}"#
        );
        assert_eq!(
            body(Api::Completions),
            r#"{"model":"m","max_tokens":8,"temperature":0.0,"top_p":1.0,"stream":false,"return_token_ids":true,"prompt":[3]}"#
        );
        assert_eq!(
            body(Api::Sglang),
            r#"{"input_ids":[3],"sampling_params":{"max_new_tokens":8,"temperature":0.0,"top_p":1.0},"stream":false,"rid":"r"}"#
        );
    }

    /// The self-check's bodies, byte for byte: SGLang's with the prompt ids and the `rid`,
    /// OpenAI's with usage asked for when streaming, chat with a one-turn prompt.
    #[test]
    fn self_check_bodies_are_pinned_byte_for_byte() {
        let body = |api, stream, ids: Option<&[u32]>| {
            of(api).check_body("m", stream, ids, 8, "r").to_string()
        };
        assert_eq!(
            body(Api::Sglang, true, Some(&[1, 2])),
            r#"{"sampling_params":{"max_new_tokens":8,"temperature":0.0,"ignore_eos":true},"stream":true,"input_ids":[1,2],"rid":"r"}"#
        );
        assert_eq!(
            body(Api::Sglang, false, None),
            r#"{"sampling_params":{"max_new_tokens":8,"temperature":0.0,"ignore_eos":true},"stream":false,"text":"Hello","rid":"r"}"#
        );
        assert_eq!(
            body(Api::Completions, true, None),
            r#"{"model":"m","max_tokens":8,"temperature":0.0,"ignore_eos":true,"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true},"prompt":"Hello"}"#
        );
        assert_eq!(
            body(Api::Completions, false, Some(&[3])),
            r#"{"model":"m","max_tokens":8,"temperature":0.0,"ignore_eos":true,"stream":false,"return_token_ids":true,"prompt":[3]}"#
        );
        assert_eq!(
            body(Api::Chat, false, Some(&[3])),
            r#"{"model":"m","max_tokens":8,"temperature":0.0,"ignore_eos":true,"stream":false,"return_token_ids":true,"messages":[{"role":"user","content":"Hello"}]}"#
        );
    }
}
