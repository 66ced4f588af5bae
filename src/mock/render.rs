//! The mock's own rendering of prompts, and the rendering endpoints it serves with
//! `--tokenize-api`, each in the shape of the server it stands for:
//!
//! - `vllm`: `POST /tokenize` with `prompt` (`add_special_tokens`, default true) or
//!   `messages` (`add_generation_prompt` default true, `continue_final_message`,
//!   `add_special_tokens` default false, `tools`, `chat_template_kwargs`), answering
//!   `{count, max_model_len, tokens, token_strs}`; `POST /detokenize` (`tokens`) answering
//!   `{prompt}`. A `model` other than the served one is vLLM's 404; errors are vLLM's
//!   `{"object": "error", …}` bodies.
//! - `llama-cpp`: `POST /apply-template` (`messages`, `tools`, `chat_template_kwargs`)
//!   answering `{prompt}` — a leading BOS the tokenizer adds itself removed, as llama.cpp
//!   does — and `POST /tokenize` (`content`, `add_special` default false; a missing
//!   `content` gives no tokens) answering `{tokens}`; `POST /detokenize` answering
//!   `{content}`. Errors are llama.cpp's `{"error": {code, message, type}}`: a template
//!   that fails is a 500 `server_error`, as llama.cpp answers it.
//! - `sglang`: `POST /tokenize` and `/v1/tokenize` with `prompt` only (a string or a list
//!   of them; `messages` is refused, as SGLang servers before their chat tokenization
//!   did), answering `{tokens, count, max_model_len}`; `/detokenize` and `/v1/detokenize`
//!   answering `{text}`.
//!
//! Rendering: with `--chat-template`, chat is that template's rendering (spool's own Jinja
//! environment, so a test can give the mock a template that differs from spool's on
//! purpose); without it, the mock's `role: content` lines. Text is encoded by the real
//! tokenizer with `--tokenizer`, else by the mock's word tokenizer. The same rendering
//! gives `/v1/chat/completions` its prompt ids, so a chat answer's `prompt_token_ids`
//! equal what `/tokenize` answers for the same messages.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::api::{chat_prompt, openai_error};
use super::sim::{detokenize, tokenize};
use super::MockState;
use crate::prompt::{ChatTemplate, Tokenizer};

/// Which server's rendering endpoints the mock serves (`--tokenize-api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenizeApi {
    /// vLLM's `/tokenize` (a prompt or messages) and `/detokenize`.
    #[value(name = "vllm")]
    Vllm,
    /// llama.cpp's `/apply-template`, `/tokenize` (`content`) and `/detokenize`.
    #[value(name = "llama-cpp")]
    LlamaCpp,
    /// SGLang's `/tokenize` and `/v1/tokenize` (a prompt only) and `/detokenize`.
    #[value(name = "sglang")]
    Sglang,
}

/// How the mock turns prompts into ids: a chat template and a real tokenizer, each
/// optional.
#[derive(Debug, Default)]
pub(crate) struct MockRendering {
    template: Option<ChatTemplate>,
    tokenizer: Option<Tokenizer>,
}

impl MockRendering {
    /// Loads `--chat-template` and `--tokenizer`, errors naming the flag.
    pub(crate) fn load(template: Option<&Path>, tokenizer: Option<&Path>) -> Result<Self> {
        let template = template
            .map(|p| {
                ChatTemplate::from_file(p)
                    .map_err(|e| anyhow!("{e}"))
                    .with_context(|| format!("--chat-template {}", p.display()))
            })
            .transpose()?;
        let tokenizer = tokenizer
            .map(|p| {
                Tokenizer::from_file(p)
                    .map_err(|e| anyhow!("{e}"))
                    .with_context(|| format!("--tokenizer {}", p.display()))
            })
            .transpose()?;
        Ok(Self {
            template,
            tokenizer,
        })
    }

    /// The ids of `text`: the real tokenizer's (special tokens added when `add_special`),
    /// or the mock's words.
    pub(crate) fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        match &self.tokenizer {
            Some(t) => t.encode(text, add_special).map_err(|e| e.to_string()),
            None => Ok(tokenize(text)),
        }
    }

    /// The text of `ids`, special tokens included.
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match &self.tokenizer {
            Some(t) => t.decode(ids).map_err(|e| e.to_string()),
            None => Ok(detokenize(ids)),
        }
    }

    /// A chat request's messages rendered by `--chat-template` (its `tools` and
    /// `chat_template_kwargs` as variables, `add_generation_prompt` default true);
    /// `Ok(None)` without a template. `Err` is the template's message.
    pub(crate) fn render_chat(&self, obj: &Map<String, Value>) -> Result<Option<String>, String> {
        let Some(t) = &self.template else {
            return Ok(None);
        };
        let messages = obj.get("messages").cloned().unwrap_or(Value::Null);
        let mut vars = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(k)) => k.clone(),
            Some(_) => {
                return Err("chat_template_kwargs: Input should be a valid dictionary".into())
            }
        };
        if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
            vars.insert("tools".into(), tools.clone());
        }
        let add = obj
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        t.render(&messages, add, &vars)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    /// The text the tokenizer puts before a sequence itself (a BOS), if any.
    fn bos_prefix(&self) -> &str {
        self.tokenizer.as_ref().map_or("", |t| t.special_prefix())
    }
}

/// The JSON object of a body, or why not.
fn object(body: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err("request body must be a JSON object".into()),
        Err(e) => Err(format!("JSON decode error: {e}")),
    }
}

/// A list of token ids from `field`, or why not.
fn ids_field(obj: &Map<String, Value>, field: &str) -> Result<Vec<u32>, String> {
    let Some(Value::Array(a)) = obj.get(field) else {
        return Err(format!("Field required: {field} (a list of token ids)"));
    };
    a.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("{field}: {v} is not a token id"))
        })
        .collect()
}

fn opt_bool(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("{key}: Input should be a valid boolean, got {v}")),
    }
}

/// vLLM's 400.
fn vllm_bad(message: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(openai_error(400, "BadRequestError", message)),
    )
        .into_response()
}

/// vLLM's check of the request's `model` (absent or null: the served one).
fn vllm_model(st: &MockState, obj: &Map<String, Value>) -> Option<Response> {
    match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) if *m == st.cfg.model => None,
        Some(m) => {
            let name = m.as_str().map_or_else(|| m.to_string(), str::to_owned);
            let body = json!({
                "object": "error",
                "message": format!("The model `{name}` does not exist."),
                "type": "NotFoundError",
                "param": "model",
                "code": 404
            });
            Some((StatusCode::NOT_FOUND, Json(body)).into_response())
        }
    }
}

/// `POST /tokenize` (vLLM): a prompt, or messages rendered by the chat template.
pub(crate) async fn vllm_tokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return vllm_bad(&m),
    };
    if let Some(r) = vllm_model(&st, &obj) {
        return r;
    }
    let ids = if obj.get("messages").is_some_and(|m| !m.is_null()) {
        vllm_chat_ids(&st, &obj)
    } else {
        match obj.get("prompt") {
            Some(Value::String(p)) => opt_bool(&obj, "add_special_tokens", true)
                .and_then(|special| st.rendering.encode(p, special)),
            _ => Err("Either `prompt` or `messages` should be provided.".into()),
        }
    };
    let ids = match ids {
        Ok(ids) => ids,
        Err(m) => return vllm_bad(&m),
    };
    Json(json!({
        "count": ids.len(),
        "max_model_len": st.cfg.context_len,
        "tokens": ids,
        "token_strs": null
    }))
    .into_response()
}

/// The ids of a vLLM `/tokenize` chat request.
fn vllm_chat_ids(st: &MockState, obj: &Map<String, Value>) -> Result<Vec<u32>, String> {
    let add = opt_bool(obj, "add_generation_prompt", true)?;
    if opt_bool(obj, "continue_final_message", false)? && add {
        return Err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into(),
        );
    }
    if opt_bool(obj, "return_token_strs", false)? {
        return Err("return_token_strs is not supported by the mock server".into());
    }
    let special = opt_bool(obj, "add_special_tokens", false)?;
    let prompt = chat_prompt(obj, &st.rendering)?;
    if special {
        st.rendering.encode(&prompt.text, true)
    } else {
        Ok(prompt.ids)
    }
}

/// `POST /detokenize` (vLLM): `{"prompt": text}`.
pub(crate) async fn vllm_detokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return vllm_bad(&m),
    };
    if let Some(r) = vllm_model(&st, &obj) {
        return r;
    }
    match ids_field(&obj, "tokens").and_then(|ids| st.rendering.decode(&ids)) {
        Ok(text) => Json(json!({ "prompt": text })).into_response(),
        Err(m) => vllm_bad(&m),
    }
}

/// llama.cpp's error body.
fn llama_error(status: StatusCode, message: &str) -> Response {
    let kind = if status == StatusCode::BAD_REQUEST {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let body = json!({"error": {"code": status.as_u16(), "message": message, "type": kind}});
    (status, Json(body)).into_response()
}

/// `POST /apply-template` (llama.cpp): the rendered prompt, without the leading BOS that
/// tokenizing with `add_special` adds back.
pub(crate) async fn llama_apply_template(
    State(st): State<Arc<MockState>>,
    body: Bytes,
) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return llama_error(StatusCode::BAD_REQUEST, &m),
    };
    if !obj.get("messages").is_some_and(Value::is_array) {
        return llama_error(StatusCode::BAD_REQUEST, "'messages' is required");
    }
    let text = match chat_prompt(&obj, &st.rendering) {
        Ok(p) => p.text,
        Err(m) => return llama_error(StatusCode::INTERNAL_SERVER_ERROR, &m),
    };
    let bos = st.rendering.bos_prefix();
    let text = match text.strip_prefix(bos) {
        Some(rest) if !bos.is_empty() => rest.to_owned(),
        _ => text,
    };
    Json(json!({ "prompt": text })).into_response()
}

/// `POST /tokenize` (llama.cpp): `content`'s ids; none without `content`.
pub(crate) async fn llama_tokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return llama_error(StatusCode::BAD_REQUEST, &m),
    };
    let ids = match obj.get("content") {
        None => Ok(Vec::new()),
        Some(Value::String(c)) => {
            if opt_bool(&obj, "with_pieces", false) != Ok(false) {
                return llama_error(
                    StatusCode::BAD_REQUEST,
                    "with_pieces is not supported by the mock server",
                );
            }
            opt_bool(&obj, "add_special", false).and_then(|s| st.rendering.encode(c, s))
        }
        Some(_) => Err("\"content\" must be a string".into()),
    };
    match ids {
        Ok(ids) => Json(json!({ "tokens": ids })).into_response(),
        Err(m) => llama_error(StatusCode::BAD_REQUEST, &m),
    }
}

/// `POST /detokenize` (llama.cpp): `{"content": text}`.
pub(crate) async fn llama_detokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return llama_error(StatusCode::BAD_REQUEST, &m),
    };
    let ids = match obj.get("tokens") {
        None => Ok(Vec::new()),
        Some(_) => ids_field(&obj, "tokens"),
    };
    match ids.and_then(|ids| st.rendering.decode(&ids)) {
        Ok(text) => Json(json!({ "content": text })).into_response(),
        Err(m) => llama_error(StatusCode::BAD_REQUEST, &m),
    }
}

/// `POST /tokenize`, `/v1/tokenize` (SGLang): a prompt or a list of prompts.
pub(crate) async fn sglang_tokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return vllm_bad(&m),
    };
    let special = match opt_bool(&obj, "add_special_tokens", true) {
        Ok(s) => s,
        Err(m) => return vllm_bad(&m),
    };
    let encode = |p: &str| st.rendering.encode(p, special);
    let (tokens, count) = match obj.get("prompt") {
        Some(Value::String(p)) => match encode(p) {
            Ok(ids) => (json!(ids), json!(ids.len())),
            Err(m) => return vllm_bad(&m),
        },
        Some(Value::Array(list)) if list.iter().all(Value::is_string) => {
            let all: Result<Vec<Vec<u32>>, String> = list
                .iter()
                .map(|p| encode(p.as_str().unwrap_or_default()))
                .collect();
            match all {
                Ok(all) => {
                    let counts: Vec<usize> = all.iter().map(Vec::len).collect();
                    (json!(all), json!(counts))
                }
                Err(m) => return vllm_bad(&m),
            }
        }
        _ => return vllm_bad("1 validation error for TokenizeRequest\nprompt\n  Field required"),
    };
    Json(json!({"tokens": tokens, "count": count, "max_model_len": st.cfg.context_len}))
        .into_response()
}

/// `POST /detokenize`, `/v1/detokenize` (SGLang): `{"text": text}`.
pub(crate) async fn sglang_detokenize(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let obj = match object(&body) {
        Ok(o) => o,
        Err(m) => return vllm_bad(&m),
    };
    match ids_field(&obj, "tokens").and_then(|ids| st.rendering.decode(&ids)) {
        Ok(text) => Json(json!({ "text": text })).into_response(),
        Err(m) => vllm_bad(&m),
    }
}
