//! Wire formats of the three generation APIs: request parsing (with the servers' error
//! shapes) and response rendering (whole bodies and SSE events), as SGLang and vLLM send
//! them. Pure functions of their inputs, except the clock read for `created`.
//!
//! Invariants:
//! - Every text field is the text of the id field next to it (the mock's own or, with
//!   `--tokenizer`, the real tokenizer's), so text and ids agree.
//! - SGLang streams are cumulative unless `incremental`; `meta_info.completion_tokens` is
//!   the running total in both modes (as SGLang does).

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::render::MockRendering;
use super::sim::{
    detokenize, ids_key, push_text, splitmix64, text_key, Finish, Part, Plan, EOS_ID, THINK_CLOSE,
    THINK_OPEN, VOCAB,
};

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
    /// Hash of the prompt, mixed with the request's seed when it sends one: seeds the
    /// completion.
    pub key: u64,
    /// The request allows a think block: not `chat_template_kwargs.enable_thinking = false`,
    /// and the prompt does not end with an empty think block.
    pub thinking_allowed: bool,
    /// The prompt ends inside an opened think block (`<think>` last).
    pub think_opened: bool,
    /// Tools the answer calls one of (chat with `tools`, last message from the user, not
    /// `tool_choice = "none"`); empty for a text answer.
    pub tools: Vec<String>,
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

/// [`parse_with`] the mock's own tokenizer and chat lines.
#[cfg(test)]
pub(crate) fn parse(
    api: Api,
    body: &[u8],
    header_rid: Option<String>,
    context_len: u32,
) -> Result<GenRequest, Rejection> {
    parse_with(
        api,
        body,
        header_rid,
        context_len,
        &MockRendering::default(),
    )
}

/// Parses and validates a generation body, its prompt tokenized (and chat rendered) by
/// `rendering`. `context_len` gives chat its default cap.
pub(crate) fn parse_with(
    api: Api,
    body: &[u8],
    header_rid: Option<String>,
    context_len: u32,
    rendering: &MockRendering,
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
    match parse_fields(api, &obj, context_len, rendering) {
        Ok(f) => Ok(GenRequest {
            api,
            rid: rid.clone(),
            stream,
            include_usage: f.include_usage,
            return_token_ids: f.return_token_ids,
            prompt_ids: f.prompt_ids,
            key: f.key,
            thinking_allowed: f.thinking_allowed,
            think_opened: f.think_opened,
            tools: f.tools,
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
    thinking_allowed: bool,
    think_opened: bool,
    tools: Vec<String>,
    max_tokens: u32,
    min_tokens: u32,
    ignore_eos: bool,
    include_usage: bool,
    return_token_ids: bool,
}

fn parse_fields(
    api: Api,
    obj: &Map<String, Value>,
    context_len: u32,
    rendering: &MockRendering,
) -> Result<Fields, String> {
    if opt_bool(obj, "stream").is_none() && !matches!(obj.get("stream"), None | Some(Value::Null)) {
        return Err("stream: Input should be a valid boolean".into());
    }
    match api {
        Api::Generate => {
            let (prompt_ids, key) = match (obj.get("text"), obj.get("input_ids")) {
                (Some(t), Some(i)) if !t.is_null() && !i.is_null() => {
                    return Err("Either text or input_ids should be provided, not both.".into())
                }
                (Some(t), _) if !t.is_null() => text_prompt(t, "text", rendering)?,
                (_, Some(i)) if !i.is_null() => ids_prompt(i, "input_ids")?,
                _ => return Err("Either text or input_ids should be provided.".into()),
            };
            let sp = match obj.get("sampling_params") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(_) => return Err("sampling_params: Input should be an object".into()),
            };
            let seed = opt_seed(&sp, "sampling_seed")?;
            Ok(Fields {
                thinking_allowed: !ends_with_empty_think(&prompt_ids),
                think_opened: prompt_ids.last() == Some(&THINK_OPEN),
                key: seeded_key(key, seed),
                prompt_ids,
                tools: Vec::new(),
                max_tokens: opt_u32(&sp, "max_new_tokens")?.unwrap_or(SGLANG_DEFAULT_MAX_NEW),
                min_tokens: opt_u32(&sp, "min_new_tokens")?.unwrap_or(0),
                ignore_eos: opt_bool(&sp, "ignore_eos").unwrap_or(false),
                include_usage: false,
                return_token_ids: false,
            })
        }
        Api::Completions | Api::Chat => {
            let (prompt_ids, key, tools) = if api == Api::Completions {
                match obj.get("prompt") {
                    None | Some(Value::Null) => {
                        return Err("Field required: prompt".into());
                    }
                    Some(Value::String(_)) | Some(Value::Array(_)) => {
                        let (ids, key) = completion_prompt(&obj["prompt"], rendering)?;
                        (ids, key, Vec::new())
                    }
                    Some(_) => return Err("prompt: must be a string or a list of token ids".into()),
                }
            } else {
                let c = chat_prompt(obj, rendering)?;
                (c.ids, c.key, c.tools)
            };
            let (thinking_allowed, think_opened) = if api == Api::Chat {
                (!thinking_disabled(obj)?, false)
            } else {
                (
                    !ends_with_empty_think(&prompt_ids),
                    prompt_ids.last() == Some(&THINK_OPEN),
                )
            };
            let key = seeded_key(key, opt_seed(obj, "seed")?);
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
                thinking_allowed,
                think_opened,
                tools,
                max_tokens: max.unwrap_or(default_max),
                min_tokens: opt_u32(obj, "min_tokens")?.unwrap_or(0),
                ignore_eos: opt_bool(obj, "ignore_eos").unwrap_or(false),
                include_usage,
                return_token_ids: opt_bool(obj, "return_token_ids").unwrap_or(false),
            })
        }
    }
}

/// A request's `seed` (vLLM) or `sampling_seed` (SGLang): any integer.
fn opt_seed(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(n), _) => Ok(Some(n)),
            // A negative seed is as good a seed: its bits are kept.
            (None, Some(n)) => Ok(Some(n as u64)),
            _ => Err(format!("{key}: Input should be a valid integer, got {v}")),
        },
    }
}

/// The prompt key with the seed mixed in, or the prompt key alone without a seed (so a
/// seedless retry regenerates the same output).
fn seeded_key(key: u64, seed: Option<u64>) -> u64 {
    match seed {
        Some(s) => splitmix64(key ^ splitmix64(s ^ 0x5eed_5eed_5eed_5eed)),
        None => key,
    }
}

/// Qwen3's real ids of `<think>\n\n</think>\n\n`, so an id prompt rendered by the real
/// tokenizer with thinking off is understood as one.
const QWEN3_EMPTY_THINK: [u32; 4] = [151_667, 271, 151_668, 271];

/// A prompt closing with an empty think block: how Qwen3's template renders
/// `enable_thinking = false` (in the mock's ids, or in Qwen3's own).
fn ends_with_empty_think(ids: &[u32]) -> bool {
    ids.ends_with(&[THINK_OPEN, THINK_CLOSE]) || ids.ends_with(&QWEN3_EMPTY_THINK)
}

/// `chat_template_kwargs.enable_thinking == false`.
fn thinking_disabled(obj: &Map<String, Value>) -> Result<bool, String> {
    match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(kw)) => Ok(kw.get("enable_thinking") == Some(&Value::Bool(false))),
        Some(_) => Err("chat_template_kwargs: Input should be a valid dictionary".into()),
    }
}

/// The names of the request's `tools`, each checked to have a `function.name`.
fn tool_names(obj: &Map<String, Value>) -> Result<Vec<String>, String> {
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err("tools: Input should be a valid list".into()),
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("tools[{i}].function.name: Field required"))
        })
        .collect()
}

/// The tools an answer may call: none under `tool_choice = "none"`, the named one under
/// `{"type": "function", "function": {"name": …}}`, else all.
fn callable_tools(obj: &Map<String, Value>, names: Vec<String>) -> Result<Vec<String>, String> {
    match obj.get("tool_choice") {
        Some(Value::String(s)) if s == "none" => Ok(Vec::new()),
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or("tool_choice.function.name: Field required")?;
            if !names.iter().any(|n| n == name) {
                return Err(format!("tool_choice: no tool named {name:?} in tools"));
            }
            Ok(vec![name.to_owned()])
        }
        _ => Ok(names),
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

fn text_prompt(
    v: &Value,
    field: &str,
    rendering: &MockRendering,
) -> Result<(Vec<u32>, u64), String> {
    match v {
        Value::String(s) => Ok((rendering.encode(s, true)?, text_key(s))),
        // A one-element batch is the same request; real batches are not simulated.
        Value::Array(a) if a.len() == 1 => text_prompt(&a[0], field, rendering),
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

fn completion_prompt(v: &Value, rendering: &MockRendering) -> Result<(Vec<u32>, u64), String> {
    match v {
        Value::String(_) => text_prompt(v, "prompt", rendering),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            text_prompt(&a[0], "prompt", rendering)
        }
        Value::Array(_) => ids_prompt(v, "prompt"),
        _ => Err("prompt: must be a string or a list of token ids".into()),
    }
}

/// A chat request's prompt as the mock renders it.
pub(crate) struct ChatPrompt {
    /// The rendered text.
    pub text: String,
    pub ids: Vec<u32>,
    pub key: u64,
    /// The tools an answer is to call.
    pub tools: Vec<String>,
}

/// Chat prompt: with `--chat-template`, that template's rendering (the request's `tools`
/// and `chat_template_kwargs` as its variables, a generation prompt added unless
/// `add_generation_prompt` is false); else the tools' names first (`"tools: a b\n"`, as
/// templates render the schemas), then each message as `"{role}: {content}\n"`, an
/// assistant's `reasoning_content` (or `reasoning`) as a think block before its content and
/// its `tool_calls` as `<tool_call> {name}` after it. Encoded without special tokens by
/// the real tokenizer, or counted by the mock tokenizer (so the role word counts as one
/// prompt token per message). Its tools to call: those offered when the last message is
/// the user's.
pub(crate) fn chat_prompt(
    obj: &Map<String, Value>,
    rendering: &MockRendering,
) -> Result<ChatPrompt, String> {
    let Some(Value::Array(msgs)) = obj.get("messages") else {
        return Err("Field required: messages (a list of messages)".into());
    };
    if msgs.is_empty() {
        return Err("messages: List should have at least 1 item".into());
    }
    let names = tool_names(obj)?;
    let last_user = msgs
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("user");
    if let Some(text) = rendering.render_chat(obj)? {
        let tools = if last_user {
            callable_tools(obj, names)?
        } else {
            Vec::new()
        };
        let ids = rendering.encode(&text, false)?;
        let key = text_key(&text);
        return Ok(ChatPrompt {
            text,
            ids,
            key,
            tools,
        });
    }
    let mut rendered = String::new();
    if !names.is_empty() {
        rendered.push_str("tools: ");
        rendered.push_str(&names.join(" "));
        rendered.push('\n');
    }
    let mut last_role = "";
    for (i, m) in msgs.iter().enumerate() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(format!("messages[{i}].role: Field required"));
        };
        last_role = role;
        rendered.push_str(role);
        rendered.push_str(": ");
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|k| m.get(*k).and_then(Value::as_str));
        if let Some(r) = reasoning {
            rendered.push_str("<think>\n");
            rendered.push_str(r);
            rendered.push_str("\n</think>\n\n");
        }
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
        match m.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                for (j, c) in calls.iter().enumerate() {
                    let Some(name) = c
                        .get("function")
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                    else {
                        return Err(format!(
                            "messages[{i}].tool_calls[{j}].function.name: Field required"
                        ));
                    };
                    rendered.push_str(" <tool_call> ");
                    rendered.push_str(name);
                }
            }
            Some(_) => return Err(format!("messages[{i}].tool_calls: must be a list")),
        }
        rendered.push('\n');
    }
    let tools = if last_role == "user" {
        callable_tools(obj, names)?
    } else {
        Vec::new()
    };
    Ok(ChatPrompt {
        ids: rendering.encode(&rendered, false)?,
        key: text_key(&rendered),
        text: rendered,
        tools,
    })
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
    /// Chat's reasoning parser: the field the thinking goes to (`reasoning_content` or
    /// `reasoning`); None leaves the think block in the content.
    pub reasoning_field: Option<&'static str>,
    /// The id of the answer's tool call (`call_…`), if it makes one.
    pub tool_call_id: String,
    /// `--tokenizer`: the text of real ids; None for the mock's own ids.
    pub vocab: Option<std::sync::Arc<super::vocab::RealVocab>>,
}

/// What a chat client is shown of one output id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    Reasoning,
    Content,
    /// The tool call's name is known: the call is announced.
    ToolHead,
    ToolArgs,
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
    content: Option<&'a str>,
    /// `Some(None)` sends null: a parser that found no thinking.
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Option<&'a str>>,
    tool_calls: Vec<Value>,
}

impl Render {
    /// Appends the text of `ids`: the real tokenizer's, or the mock's own.
    fn push_text(&self, s: &mut String, ids: &[u32]) {
        match &self.vocab {
            Some(v) => v.push_text(s, ids),
            None => push_text(s, ids),
        }
    }

    /// The text of `ids`.
    fn text(&self, ids: &[u32]) -> String {
        match &self.vocab {
            Some(v) => {
                let mut s = String::new();
                v.push_text(&mut s, ids);
                s
            }
            None => detokenize(ids),
        }
    }

    fn prompt_tokens(&self) -> u32 {
        self.prompt_ids.len() as u32
    }

    fn sglang_finish(&self, f: FinishOut, completion: u32) -> Value {
        match f {
            FinishOut::Stop => {
                let eos = self.vocab.as_ref().map_or(EOS_ID, |v| v.eos);
                json!({"type": "stop", "matched": eos})
            }
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
            "text": self.text(ids),
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

    /// What a chat client is shown of output id `i`, None when a parser hides it (markers
    /// and the tool call's JSON frame). `tool_ok`: the tool call is whole, so it is parsed.
    fn shown(&self, plan: &Plan, i: usize, tool_ok: bool) -> Option<Shown> {
        let split = self.reasoning_field.is_some();
        match plan.part(i) {
            Part::ThinkMarker if split => None,
            Part::Thinking if split => Some(Shown::Reasoning),
            Part::ToolFrame if tool_ok => None,
            Part::ToolName if tool_ok => Some(Shown::ToolHead),
            Part::ToolArgs if tool_ok => Some(Shown::ToolArgs),
            _ => Some(Shown::Content),
        }
    }

    /// Chat's finish reason: a whole tool call that ended the output is `tool_calls`.
    fn chat_finish(f: FinishOut, tool_ok: bool) -> &'static str {
        if tool_ok && f == FinishOut::Stop {
            "tool_calls"
        } else {
            Self::openai_finish(f)
        }
    }

    fn tool_call_value(&self, plan: &Plan) -> Option<Value> {
        plan.tool.as_ref().map(|t| {
            json!({
                "id": self.tool_call_id,
                "type": "function",
                "function": {"name": t.name, "arguments": t.arguments}
            })
        })
    }

    /// The whole non-streaming body for the first `upto` ids of `plan`, serialised.
    /// OpenAI-style bodies are written from borrowed structs (their fields in a fixed order)
    /// rather than built as a `Value` per response: with instant responses that allocation
    /// is much of the mock's CPU, which a client measured against it shares the machine
    /// with.
    pub(crate) fn full(
        &self,
        plan: &Plan,
        upto: usize,
        finish: FinishOut,
        latency_s: f64,
    ) -> Vec<u8> {
        let ids = &plan.ids[..upto];
        let n = ids.len() as u32;
        let body = match self.api {
            Api::Generate => serde_json::to_vec(&self.sglang_body(ids, n, Some(finish), latency_s)),
            Api::Completions | Api::Chat => {
                let chat = self.api == Api::Chat;
                let plain = plan.think_end == 0 && plan.tool.is_none();
                let tool_ok = chat && plan.tool_complete(upto);
                let (reasoning, text) = if chat && !plain {
                    let (mut reasoning, mut content) = (String::new(), String::new());
                    for i in 0..upto {
                        match self.shown(plan, i, tool_ok) {
                            Some(Shown::Reasoning) => self.push_text(&mut reasoning, &ids[i..=i]),
                            Some(Shown::Content) => self.push_text(&mut content, &ids[i..=i]),
                            _ => {}
                        }
                    }
                    (reasoning, content)
                } else {
                    (String::new(), self.text(ids))
                };
                let split = self.reasoning_field.is_some();
                let reasoning = split.then_some((!reasoning.is_empty()).then_some(&reasoning[..]));
                let content = if (split || tool_ok) && text.is_empty() {
                    None
                } else {
                    Some(&text[..])
                };
                let finish_reason = if chat {
                    Self::chat_finish(finish, tool_ok)
                } else {
                    Self::openai_finish(finish)
                };
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
                        message: chat.then(|| FullMessage {
                            role: "assistant",
                            content,
                            reasoning_content: reasoning
                                .filter(|_| self.reasoning_field == Some("reasoning_content")),
                            reasoning: reasoning
                                .filter(|_| self.reasoning_field == Some("reasoning")),
                            tool_calls: if tool_ok {
                                self.tool_call_value(plan).into_iter().collect()
                            } else {
                                Vec::new()
                            },
                        }),
                        text: (!chat).then_some(&text),
                        logprobs: (),
                        finish_reason,
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

    /// Chat stream events for output ids `from..upto` of `plan`. Each event carries the
    /// ids since the one before; thinking and content go in separate events, thinking
    /// first. Ids a parser hides go with the next shown piece, or stay unsent until one
    /// comes or the stream finishes: the returned index is how far ids were sent. With
    /// `finish` all ids to `upto` are sent and the last event carries the reason.
    pub(crate) fn chat_events(
        &self,
        plan: &Plan,
        from: usize,
        upto: usize,
        finish: Option<FinishOut>,
    ) -> (Vec<Value>, usize) {
        let tool_ok = plan.tool_complete(plan.ids.len());
        let mut events = Vec::new();
        let mut run: Option<(Shown, String)> = None;
        let mut ids_from = from;
        let mut run_end = from;
        for i in from..upto {
            let Some(kind) = self.shown(plan, i, tool_ok) else {
                continue;
            };
            let same = matches!(&run, Some((k, _)) if *k == kind && kind != Shown::ToolHead);
            if !same {
                if let Some((k, text)) = run.take() {
                    let ids = &plan.ids[ids_from..run_end];
                    events.push(self.chat_delta(plan, k, &text, ids, None));
                    ids_from = run_end;
                }
                run = Some((kind, String::new()));
            }
            if let Some((k, text)) = &mut run {
                if *k != Shown::ToolHead {
                    self.push_text(text, &plan.ids[i..=i]);
                }
            }
            run_end = i + 1;
        }
        match finish {
            Some(f) => {
                let (k, text) = run.unwrap_or((Shown::Content, String::new()));
                let reason = Self::chat_finish(f, tool_ok);
                let ids = &plan.ids[ids_from..upto];
                events.push(self.chat_delta(plan, k, &text, ids, Some(reason)));
                (events, upto)
            }
            None => {
                if let Some((k, text)) = run {
                    let ids = &plan.ids[ids_from..run_end];
                    events.push(self.chat_delta(plan, k, &text, ids, None));
                    ids_from = run_end;
                }
                (events, ids_from)
            }
        }
    }

    /// One chat chunk showing `text` as `kind`, carrying `ids`.
    fn chat_delta(
        &self,
        plan: &Plan,
        kind: Shown,
        text: &str,
        ids: &[u32],
        finish: Option<&'static str>,
    ) -> Value {
        let delta = match kind {
            Shown::Reasoning => {
                let mut d = Map::new();
                let field = self.reasoning_field.unwrap_or("reasoning_content");
                d.insert(field.into(), json!(text));
                Value::Object(d)
            }
            Shown::Content => json!({ "content": text }),
            Shown::ToolHead => {
                let mut call = self.tool_call_value(plan).unwrap_or(Value::Null);
                if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                    f.remove("arguments");
                }
                call["index"] = json!(0);
                json!({ "tool_calls": [call] })
            }
            Shown::ToolArgs => {
                json!({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            }
        };
        let mut choice = Map::new();
        choice.insert("index".into(), json!(0));
        choice.insert("delta".into(), delta);
        choice.insert("logprobs".into(), Value::Null);
        choice.insert(
            "finish_reason".into(),
            finish.map_or(Value::Null, |f| json!(f)),
        );
        choice.insert("stop_reason".into(), Value::Null);
        if self.token_ids {
            choice.insert("token_ids".into(), json!(ids));
        }
        self.openai_chunk(choice, None)
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
                    choice.insert("delta".into(), json!({"content": self.text(delta)}));
                } else {
                    choice.insert("text".into(), json!(self.text(delta)));
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
            reasoning_field: None,
            tool_call_id: "call_0".into(),
            vocab: None,
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
        let plan = Plan {
            ids: vec![9],
            finish: Finish::Length,
            thinking: 0..0,
            think_end: 0,
            tool: None,
        };
        let full: Value =
            serde_json::from_slice(&chat.full(&plan, 1, FinishOut::Length, 0.0)).unwrap();
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], " w9");
        assert_eq!(full["usage"]["completion_tokens"], 1);
    }

    /// The new chat fields are checked and read: bad `tools`, `tool_choice`,
    /// `chat_template_kwargs` and seeds are 400s naming the field; tools are called only
    /// after a user message and not under `tool_choice = "none"`; a seed changes the key.
    #[test]
    fn parse_reads_tools_kwargs_and_seeds() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"a"}}]{extra}}}"#);
            parse(Api::Chat, body.as_bytes(), None, 100)
        };
        let fn_tools =
            r#","tools":[{"type":"function","function":{"name":"f"}},{"function":{"name":"g"}}]"#;
        assert_eq!(chat(fn_tools).expect("tools").tools, ["f", "g"]);
        let named =
            format!(r#"{fn_tools},"tool_choice":{{"type":"function","function":{{"name":"g"}}}}"#);
        assert_eq!(chat(&named).expect("named").tools, ["g"]);
        let none = format!(r#"{fn_tools},"tool_choice":"none""#);
        assert!(chat(&none).expect("none").tools.is_empty());
        for (extra, names) in [
            (r#","tools":"f""#, "tools"),
            (r#","tools":[{"function":{}}]"#, "tools[0].function.name"),
            (r#","chat_template_kwargs":[1]"#, "chat_template_kwargs"),
            (r#","seed":"x""#, "seed"),
        ] {
            let err = chat(extra).expect_err(extra).message;
            assert!(err.starts_with(names), "{extra}: {err}");
        }
        let off = chat(r#","chat_template_kwargs":{"enable_thinking":false}"#).expect("kwargs");
        assert!(!off.thinking_allowed);
        assert!(chat("").expect("plain").thinking_allowed);
        let after_tool = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"a"},{"role":"tool","content":"r"}],"tools":[{"function":{"name":"f"}}]}"#,
            None,
            100,
        )
        .expect("tool result last");
        assert!(after_tool.tools.is_empty());
        let unseeded = chat("").expect("plain").key;
        assert_ne!(chat(r#","seed":1"#).expect("seed").key, unseeded);
        assert_eq!(
            chat(r#","seed":1"#).expect("seed").key,
            chat(r#","seed":1"#).expect("seed").key
        );
        let g = parse(
            Api::Generate,
            br#"{"text":"a","sampling_params":{"sampling_seed":5}}"#,
            None,
            100,
        )
        .expect("sglang seed");
        assert_ne!(
            g.key,
            parse(Api::Generate, br#"{"text":"a"}"#, None, 100)
                .expect("g")
                .key
        );
    }

    /// With a reasoning parser, a think block cut by the cap is all reasoning (content
    /// null), and a whole one splits into reasoning and content, ids covering both.
    #[test]
    fn a_parser_splits_whole_chat_bodies_and_keeps_a_cut_block_as_reasoning() {
        let mut r = render(Api::Chat, false);
        r.reasoning_field = Some("reasoning");
        let plan = Plan {
            ids: vec![THINK_OPEN, 5, 6, THINK_CLOSE, 7],
            finish: Finish::Stop,
            thinking: 1..3,
            think_end: 4,
            tool: None,
        };
        let whole: Value = serde_json::from_slice(&r.full(&plan, 5, FinishOut::Stop, 0.0)).unwrap();
        let msg = &whole["choices"][0]["message"];
        assert_eq!(
            (msg["reasoning"].as_str(), msg["content"].as_str()),
            (Some(" w5 w6"), Some(" w7"))
        );
        assert!(msg.get("reasoning_content").is_none());
        assert_eq!(
            whole["choices"][0]["token_ids"],
            json!([THINK_OPEN, 5, 6, THINK_CLOSE, 7])
        );
        let cut: Value = serde_json::from_slice(&r.full(&plan, 2, FinishOut::Length, 0.0)).unwrap();
        let msg = &cut["choices"][0]["message"];
        assert_eq!(msg["reasoning"], " w5");
        assert!(msg["content"].is_null());
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
