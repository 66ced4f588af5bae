//! Wire formats of the three generation APIs: request parsing (with the servers' error
//! shapes) and response rendering (whole bodies and SSE events), as SGLang and vLLM send
//! them. Pure functions of their inputs, except the clock read for `created`.
//!
//! Invariants:
//! - Every text field is `detokenize` of the id field next to it, so text and ids agree.
//! - SGLang streams are cumulative unless `incremental`; `meta_info.completion_tokens` is
//!   the running total in both modes (as SGLang does).

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::sim::{detokenize, ids_key, text_key, tokenize, Finish, EOS_ID, VOCAB};

/// The three generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    /// SGLang native `/generate`.
    Generate,
    /// vLLM/OpenAI `/v1/completions`.
    Completions,
    /// vLLM/OpenAI `/v1/chat/completions`.
    Chat,
}

impl Api {
    pub(crate) fn endpoint(self) -> &'static str {
        match self {
            Api::Generate => "/generate",
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

/// A parsed, validated generation request.
#[derive(Debug, Clone)]
pub(crate) struct GenRequest {
    pub api: Api,
    /// SGLang `rid` from the body, else the `X-Request-Id` header.
    pub rid: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The client asked for `token_ids` (vLLM `return_token_ids`).
    pub return_token_ids: bool,
    /// The prompt as the mock tokenizer sees it.
    pub prompt_ids: Vec<u32>,
    /// Hash of the prompt: seeds the completion.
    pub key: u64,
    /// Requested cap (before clamping to the context), or the server's default.
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub ignore_eos: bool,
}

/// A request the server refuses with a 4xx.
#[derive(Debug, Clone)]
pub(crate) struct Rejection {
    pub status: u16,
    pub message: String,
    /// Whether the (parsed) request asked to stream: SGLang answers validation errors of
    /// streaming requests inside a 200 event stream.
    pub stream: bool,
    pub rid: Option<String>,
}

fn bad(message: impl Into<String>, stream: bool, rid: Option<String>) -> Rejection {
    Rejection {
        status: 400,
        message: message.into(),
        stream,
        rid,
    }
}

/// vLLM's error body (also used for the injected 429/500 on every API).
pub(crate) fn openai_error(status: u16, kind: &str, message: &str) -> Value {
    json!({"object": "error", "message": message, "type": kind, "param": null, "code": status})
}

/// SGLang's error body (`_create_error_response`).
pub(crate) fn sglang_error(message: &str) -> Value {
    json!({"error": {"message": message}})
}

/// SGLang's default `max_new_tokens`.
const SGLANG_DEFAULT_MAX_NEW: u32 = 128;
/// OpenAI's (and vLLM's) default `max_tokens` for legacy completions.
const COMPLETIONS_DEFAULT_MAX: u32 = 16;

/// Parses and validates a generation body. `context_len` gives chat its default cap.
pub(crate) fn parse(
    api: Api,
    body: &[u8],
    header_rid: Option<String>,
    context_len: u32,
) -> Result<GenRequest, Rejection> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("JSON decode error: {e}"), false, header_rid.clone()))?;
    let Value::Object(obj) = value else {
        return Err(bad("request body must be a JSON object", false, header_rid));
    };
    let stream = opt_bool(&obj, "stream").unwrap_or(false);
    let rid = match obj.get("rid") {
        Some(Value::String(s)) if api == Api::Generate => Some(s.clone()),
        _ => header_rid,
    };
    let fail = |m: String| bad(m, stream, rid.clone());
    match parse_fields(api, &obj, context_len) {
        Ok(f) => Ok(GenRequest {
            api,
            rid: rid.clone(),
            stream,
            include_usage: f.include_usage,
            return_token_ids: f.return_token_ids,
            prompt_ids: f.prompt_ids,
            key: f.key,
            max_tokens: f.max_tokens,
            min_tokens: f.min_tokens,
            ignore_eos: f.ignore_eos,
        }),
        Err(m) => Err(fail(m)),
    }
}

struct Fields {
    prompt_ids: Vec<u32>,
    key: u64,
    max_tokens: u32,
    min_tokens: u32,
    ignore_eos: bool,
    include_usage: bool,
    return_token_ids: bool,
}

fn parse_fields(api: Api, obj: &Map<String, Value>, context_len: u32) -> Result<Fields, String> {
    if opt_bool(obj, "stream").is_none() && !matches!(obj.get("stream"), None | Some(Value::Null)) {
        return Err("stream: Input should be a valid boolean".into());
    }
    match api {
        Api::Generate => {
            let (prompt_ids, key) = match (obj.get("text"), obj.get("input_ids")) {
                (Some(t), Some(i)) if !t.is_null() && !i.is_null() => {
                    return Err("Either text or input_ids should be provided, not both.".into())
                }
                (Some(t), _) if !t.is_null() => text_prompt(t, "text")?,
                (_, Some(i)) if !i.is_null() => ids_prompt(i, "input_ids")?,
                _ => return Err("Either text or input_ids should be provided.".into()),
            };
            let sp = match obj.get("sampling_params") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(_) => return Err("sampling_params: Input should be an object".into()),
            };
            Ok(Fields {
                prompt_ids,
                key,
                max_tokens: opt_u32(&sp, "max_new_tokens")?.unwrap_or(SGLANG_DEFAULT_MAX_NEW),
                min_tokens: opt_u32(&sp, "min_new_tokens")?.unwrap_or(0),
                ignore_eos: opt_bool(&sp, "ignore_eos").unwrap_or(false),
                include_usage: false,
                return_token_ids: false,
            })
        }
        Api::Completions | Api::Chat => {
            let (prompt_ids, key) = if api == Api::Completions {
                match obj.get("prompt") {
                    None | Some(Value::Null) => {
                        return Err("Field required: prompt".into());
                    }
                    Some(Value::String(_)) | Some(Value::Array(_)) => {
                        completion_prompt(&obj["prompt"])?
                    }
                    Some(_) => return Err("prompt: must be a string or a list of token ids".into()),
                }
            } else {
                chat_prompt(obj.get("messages"))?
            };
            if let Some(n) = opt_u32(obj, "n")? {
                if n != 1 {
                    return Err(format!(
                        "n={n} is not supported by the mock server; use n=1"
                    ));
                }
            }
            let max = match opt_u32(obj, "max_tokens")? {
                Some(m) => Some(m),
                None if api == Api::Chat => opt_u32(obj, "max_completion_tokens")?,
                None => None,
            };
            if max == Some(0) {
                return Err("max_tokens must be at least 1, got 0.".into());
            }
            let default_max = match api {
                Api::Completions => COMPLETIONS_DEFAULT_MAX,
                _ => context_len.saturating_sub(prompt_ids.len() as u32),
            };
            let include_usage = match obj.get("stream_options") {
                Some(Value::Object(so)) => opt_bool(so, "include_usage").unwrap_or(false),
                _ => false,
            };
            Ok(Fields {
                prompt_ids,
                key,
                max_tokens: max.unwrap_or(default_max),
                min_tokens: opt_u32(obj, "min_tokens")?.unwrap_or(0),
                ignore_eos: opt_bool(obj, "ignore_eos").unwrap_or(false),
                include_usage,
                return_token_ids: opt_bool(obj, "return_token_ids").unwrap_or(false),
            })
        }
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Option<bool> {
    obj.get(key).and_then(Value::as_bool)
}

fn opt_u32(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n < 0 => Err(format!("{key} must be at least 0, got {n}.")),
            Some(n) => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
            None => Err(format!("{key}: Input should be a valid integer, got {v}")),
        },
    }
}

fn text_prompt(v: &Value, field: &str) -> Result<(Vec<u32>, u64), String> {
    match v {
        Value::String(s) => Ok((tokenize(s), text_key(s))),
        // A one-element batch is the same request; real batches are not simulated.
        Value::Array(a) if a.len() == 1 => text_prompt(&a[0], field),
        _ => Err(format!(
            "{field}: must be a string (batched requests are not supported by the mock server)"
        )),
    }
}

fn ids_prompt(v: &Value, field: &str) -> Result<(Vec<u32>, u64), String> {
    let Value::Array(a) = v else {
        return Err(format!("{field}: must be a list of token ids"));
    };
    if a.len() == 1 && a[0].is_array() {
        return ids_prompt(&a[0], field);
    }
    let mut ids = Vec::with_capacity(a.len());
    for x in a {
        match x.as_u64() {
            Some(id) if id <= u64::from(u32::MAX) => ids.push(id as u32),
            _ => {
                return Err(format!(
                    "{field}: must be a list of non-negative token ids (batched requests are not supported by the mock server)"
                ))
            }
        }
    }
    let key = ids_key(&ids);
    Ok((ids, key))
}

fn completion_prompt(v: &Value) -> Result<(Vec<u32>, u64), String> {
    match v {
        Value::String(_) => text_prompt(v, "prompt"),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => text_prompt(&a[0], "prompt"),
        Value::Array(_) => ids_prompt(v, "prompt"),
        _ => Err("prompt: must be a string or a list of token ids".into()),
    }
}

/// Chat prompt: each message rendered as `"{role}: {content}\n"`, counted by the mock
/// tokenizer (so the role word counts as one prompt token per message).
fn chat_prompt(v: Option<&Value>) -> Result<(Vec<u32>, u64), String> {
    let Some(Value::Array(msgs)) = v else {
        return Err("Field required: messages (a list of messages)".into());
    };
    if msgs.is_empty() {
        return Err("messages: List should have at least 1 item".into());
    }
    let mut rendered = String::new();
    for (i, m) in msgs.iter().enumerate() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(format!("messages[{i}].role: Field required"));
        };
        rendered.push_str(role);
        rendered.push_str(": ");
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => rendered.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        rendered.push_str(t);
                        rendered.push(' ');
                    }
                }
            }
            Some(_) => {
                return Err(format!(
                    "messages[{i}].content: must be a string or a list of parts"
                ))
            }
        }
        rendered.push('\n');
    }
    Ok((tokenize(&rendered), text_key(&rendered)))
}

/// vLLM's context-length message. `requested` = prompt + max tokens.
pub(crate) fn openai_context_message(context_len: u32, prompt: u32, max_tokens: u32) -> String {
    let requested = u64::from(prompt) + u64::from(max_tokens);
    format!(
        "This model's maximum context length is {context_len} tokens. However, you requested {requested} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )
}

/// SGLang's input-too-long message.
pub(crate) fn sglang_context_message(context_len: u32, prompt: u32) -> String {
    format!(
        "The input ({prompt} tokens) is longer than the model's context length ({context_len} tokens)."
    )
}

/// Why the output ended, as reported on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FinishOut {
    Stop,
    Length,
    Abort,
}

impl From<Finish> for FinishOut {
    fn from(f: Finish) -> Self {
        match f {
            Finish::Stop => FinishOut::Stop,
            Finish::Length => FinishOut::Length,
        }
    }
}

/// `data: {json}\n\n`.
pub(crate) fn sse_event(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    // Serialising a Value to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The stream terminator both server families send.
pub(crate) const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Everything constant over one response, to render its bodies and events.
#[derive(Debug, Clone)]
pub(crate) struct Render {
    pub api: Api,
    /// `cmpl-…` / `chatcmpl-…`, or the SGLang rid.
    pub id: String,
    pub created: u64,
    pub model: String,
    pub prompt_ids: Vec<u32>,
    /// `token_ids` / `prompt_token_ids` are sent (asked for and not `--no-token-ids`).
    pub token_ids: bool,
    /// `usage` is sent at all (not `--no-usage`).
    pub usage: bool,
    /// A usage chunk ends the stream (`stream_options.include_usage` and `usage`).
    pub usage_chunk: bool,
    /// SGLang deltas instead of cumulative output.
    pub incremental: bool,
}

/// vLLM's `usage` object.
#[derive(serde::Serialize)]
struct Usage {
    prompt_tokens: u32,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: (),
}

/// A whole `/v1/completions` or `/v1/chat/completions` body, as vLLM orders its fields.
#[derive(serde::Serialize)]
struct FullBody<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [FullChoice<'a>; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
}

#[derive(serde::Serialize)]
struct FullChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<FullMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a String>,
    logprobs: (),
    finish_reason: &'static str,
    stop_reason: (),
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
}

#[derive(serde::Serialize)]
struct FullMessage<'a> {
    role: &'static str,
    content: &'a str,
    tool_calls: &'static [u8],
}

impl Render {
    fn prompt_tokens(&self) -> u32 {
        self.prompt_ids.len() as u32
    }

    fn sglang_finish(&self, f: FinishOut, completion: u32) -> Value {
        match f {
            FinishOut::Stop => json!({"type": "stop", "matched": EOS_ID}),
            FinishOut::Length => json!({"type": "length", "length": completion}),
            FinishOut::Abort => {
                json!({"type": "abort", "message": format!("Abort request {}", self.id)})
            }
        }
    }

    fn openai_finish(f: FinishOut) -> &'static str {
        match f {
            FinishOut::Stop => "stop",
            FinishOut::Length => "length",
            FinishOut::Abort => "abort",
        }
    }

    fn usage_of(&self, completion: u32) -> Usage {
        let p = self.prompt_tokens();
        Usage {
            prompt_tokens: p,
            total_tokens: u64::from(p) + u64::from(completion),
            completion_tokens: completion,
            prompt_tokens_details: (),
        }
    }

    fn usage_value(&self, completion: u32) -> Value {
        json!(self.usage_of(completion))
    }

    fn sglang_body(
        &self,
        ids: &[u32],
        completion: u32,
        finish: Option<FinishOut>,
        latency_s: f64,
    ) -> Value {
        json!({
            "text": detokenize(ids),
            "output_ids": ids,
            "meta_info": {
                "id": self.id,
                "finish_reason": finish.map(|f| self.sglang_finish(f, completion)),
                "prompt_tokens": self.prompt_tokens(),
                "completion_tokens": completion,
                "cached_tokens": 0,
                "e2e_latency": latency_s
            }
        })
    }

    /// The whole non-streaming body for output `ids`, serialised. OpenAI-style bodies are
    /// written from borrowed structs (their fields in a fixed order) rather than
    /// built as a `Value` per response: with instant responses that allocation is much of
    /// the mock's CPU, which a client measured against it shares the machine with.
    pub(crate) fn full(&self, ids: &[u32], finish: FinishOut, latency_s: f64) -> Vec<u8> {
        let n = ids.len() as u32;
        let body = match self.api {
            Api::Generate => serde_json::to_vec(&self.sglang_body(ids, n, Some(finish), latency_s)),
            Api::Completions | Api::Chat => {
                let text = detokenize(ids);
                let chat = self.api == Api::Chat;
                serde_json::to_vec(&FullBody {
                    id: &self.id,
                    object: if chat {
                        "chat.completion"
                    } else {
                        "text_completion"
                    },
                    created: self.created,
                    model: &self.model,
                    choices: [FullChoice {
                        index: 0,
                        message: chat.then_some(FullMessage {
                            role: "assistant",
                            content: &text,
                            tool_calls: &[],
                        }),
                        text: (!chat).then_some(&text),
                        logprobs: (),
                        finish_reason: Self::openai_finish(finish),
                        stop_reason: (),
                        token_ids: self.token_ids.then_some(ids),
                        prompt_token_ids: (self.token_ids && !chat).then_some(&self.prompt_ids[..]),
                    }],
                    usage: self.usage.then(|| self.usage_of(n)),
                    prompt_token_ids: (self.token_ids && chat).then_some(&self.prompt_ids[..]),
                })
            }
        };
        // Serialising plain structs and a `Value` to a Vec cannot fail.
        body.unwrap_or_default()
    }

    fn openai_chunk(&self, choice: Map<String, Value>, extra: Option<(&str, Value)>) -> Value {
        let mut body = Map::new();
        body.insert("id".into(), json!(self.id));
        body.insert(
            "object".into(),
            json!(if self.api == Api::Chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            }),
        );
        body.insert("created".into(), json!(self.created));
        body.insert("model".into(), json!(self.model));
        body.insert("choices".into(), json!([Value::Object(choice)]));
        if self.usage_chunk {
            body.insert("usage".into(), Value::Null);
        }
        if let Some((k, v)) = extra {
            body.insert(k.into(), v);
        }
        Value::Object(body)
    }

    /// Events sent before any token (chat's role chunk).
    pub(crate) fn prelude(&self) -> Vec<Value> {
        if self.api != Api::Chat {
            return Vec::new();
        }
        let mut choice = Map::new();
        choice.insert("index".into(), json!(0));
        choice.insert("delta".into(), json!({"role": "assistant", "content": ""}));
        choice.insert("logprobs".into(), Value::Null);
        choice.insert("finish_reason".into(), Value::Null);
        let extra = self
            .token_ids
            .then(|| ("prompt_token_ids", json!(self.prompt_ids)));
        vec![self.openai_chunk(choice, extra)]
    }

    /// One content event. `all` is the whole output so far, `from` where this event's new
    /// tokens start; `first` marks the first content event (vLLM attaches the prompt ids).
    pub(crate) fn content(
        &self,
        all: &[u32],
        from: usize,
        finish: Option<FinishOut>,
        first: bool,
        latency_s: f64,
    ) -> Value {
        let delta = &all[from..];
        let n = all.len() as u32;
        match self.api {
            Api::Generate => {
                let shown = if self.incremental { delta } else { all };
                self.sglang_body(shown, n, finish, latency_s)
            }
            Api::Completions | Api::Chat => {
                let mut choice = Map::new();
                choice.insert("index".into(), json!(0));
                if self.api == Api::Chat {
                    choice.insert("delta".into(), json!({"content": detokenize(delta)}));
                } else {
                    choice.insert("text".into(), json!(detokenize(delta)));
                }
                choice.insert("logprobs".into(), Value::Null);
                choice.insert(
                    "finish_reason".into(),
                    finish.map_or(Value::Null, |f| json!(Self::openai_finish(f))),
                );
                choice.insert("stop_reason".into(), Value::Null);
                if self.token_ids {
                    choice.insert("token_ids".into(), json!(delta));
                    if first && self.api == Api::Completions {
                        choice.insert("prompt_token_ids".into(), json!(self.prompt_ids));
                    }
                }
                self.openai_chunk(choice, None)
            }
        }
    }

    /// The usage chunk closing an OpenAI stream, when asked for.
    pub(crate) fn usage_event(&self, completion: u32) -> Option<Value> {
        if !self.usage_chunk || self.api == Api::Generate {
            return None;
        }
        let mut v = self.openai_chunk(Map::new(), None);
        v["choices"] = json!([]);
        v["usage"] = self.usage_value(completion);
        Some(v)
    }
}

// The reported stop id lies outside the mock vocabulary, so it never shows up in an output.
const _: () = assert!(VOCAB < EOS_ID);

#[cfg(test)]
mod tests {
    use super::*;

    fn render(api: Api, incremental: bool) -> Render {
        Render {
            api,
            id: "r".into(),
            created: 1,
            model: "m".into(),
            prompt_ids: vec![1, 2, 3],
            token_ids: true,
            usage: true,
            usage_chunk: true,
            incremental,
        }
    }

    /// An SSE event is one `data:` line and a blank line; the stream ends with `[DONE]`.
    #[test]
    fn sse_events_are_framed() {
        let e = sse_event(&json!({"a": 1}));
        assert_eq!(&e[..], b"data: {\"a\":1}\n\n");
        assert_eq!(SSE_DONE, b"data: [DONE]\n\n");
    }

    /// SGLang events carry the text and ids so far, or only the new ones with
    /// `incremental_streaming_output`; the finish reason comes with the last.
    #[test]
    fn sglang_events_are_cumulative_or_incremental() {
        let all = [5, 6, 7];
        let cum = render(Api::Generate, false).content(&all, 1, None, false, 0.0);
        assert_eq!(cum["text"], " w5 w6 w7");
        assert_eq!(cum["output_ids"], json!([5, 6, 7]));
        assert_eq!(cum["meta_info"]["completion_tokens"], 3);
        assert!(cum["meta_info"]["finish_reason"].is_null());
        let inc = render(Api::Generate, true).content(&all, 1, Some(FinishOut::Length), false, 0.0);
        assert_eq!(inc["text"], " w6 w7");
        assert_eq!(inc["output_ids"], json!([6, 7]));
        assert_eq!(inc["meta_info"]["completion_tokens"], 3);
        assert_eq!(
            inc["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 3})
        );
    }

    /// OpenAI chunks carry the new text and ids, a separate usage chunk when asked for, chat's
    /// role chunk first, and a full chat body the message and usage.
    #[test]
    fn openai_chunks_carry_deltas_and_usage() {
        let r = render(Api::Completions, false);
        let c = r.content(&[5, 6], 1, Some(FinishOut::Stop), true, 0.0);
        assert_eq!(c["choices"][0]["text"], " w6");
        assert_eq!(c["choices"][0]["token_ids"], json!([6]));
        assert_eq!(c["choices"][0]["prompt_token_ids"], json!([1, 2, 3]));
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert!(c["usage"].is_null());
        let u = r.usage_event(2).expect("usage chunk");
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 5);
        let chat = render(Api::Chat, false);
        assert_eq!(
            chat.prelude()[0]["choices"][0]["delta"]["role"],
            "assistant"
        );
        let full: Value = serde_json::from_slice(&chat.full(&[9], FinishOut::Length, 0.0)).unwrap();
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], " w9");
        assert_eq!(full["usage"]["completion_tokens"], 1);
    }

    /// Each API's request body is read into one request (caps, ids, rid, usage option);
    /// malformed JSON, a missing prompt and a negative cap are refused with a 400.
    #[test]
    fn parse_reads_each_api_and_rejects_bad_input() {
        let g = parse(
            Api::Generate,
            br#"{"input_ids":[1,2],"sampling_params":{"max_new_tokens":7},"rid":"x","stream":true}"#,
            None,
            100,
        )
        .expect("generate");
        assert_eq!((g.prompt_ids.len(), g.max_tokens, g.stream), (2, 7, true));
        assert_eq!(g.rid.as_deref(), Some("x"));
        let c = parse(
            Api::Completions,
            br#"{"prompt":"a b c"}"#,
            Some("h".into()),
            100,
        )
        .expect("completions");
        assert_eq!(
            (c.prompt_ids.len(), c.max_tokens),
            (3, COMPLETIONS_DEFAULT_MAX)
        );
        assert_eq!(c.rid.as_deref(), Some("h"));
        let ch = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"hi there"}],"stream_options":{"include_usage":true}}"#,
            None,
            100,
        )
        .expect("chat");
        assert_eq!(
            (ch.prompt_ids.len(), ch.max_tokens, ch.include_usage),
            (3, 97, true)
        );
        assert_eq!(
            parse(Api::Completions, b"{oops", None, 9)
                .err()
                .map(|r| r.status),
            Some(400)
        );
        let r = parse(Api::Generate, br#"{"stream":true}"#, None, 9).expect_err("no prompt");
        assert!(r.stream);
        assert!(parse(Api::Completions, br#"{"max_tokens":3}"#, None, 9).is_err());
        assert!(parse(
            Api::Completions,
            br#"{"prompt":"a","max_tokens":-1}"#,
            None,
            9
        )
        .is_err());
        // Same prompt text on either OpenAI-ish API keys the same way as on SGLang.
        let s = parse(Api::Generate, br#"{"text":"a b c"}"#, None, 100).expect("text");
        assert_eq!(s.key, c.key);
    }
}
