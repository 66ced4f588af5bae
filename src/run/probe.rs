//! What the inference server is, learned at start-up: its context length and the shape of
//! its answers.
//!
//! Three things, each logged once per server:
//!
//! - **Context length**: `[server] context_length` when set, else asked from the server:
//!   `/get_model_info` (`context_length`, `max_context_length`; SGLang and the mock),
//!   `/v1/models` (`max_model_len` of the configured model, else of the first; vLLM and
//!   SGLang), `/get_server_info` (`context_length`; SGLang) and `/props`
//!   (`default_generation_settings.n_ctx`; llama.cpp), first answer wins. With several
//!   servers the smallest is used. Intake rejects prompts that leave no room for
//!   generation, and `clamp_max_tokens` clamps with it.
//! - **Self-check** (`[server] self_check`, on by default): one tiny generation (8 tokens,
//!   `ignore_eos`, greedy) through the configured API and streaming mode, read event by
//!   event to learn whether SGLang streams cumulative or incremental output, and whether
//!   token ids and usage come back. Its `rid` is `_selfcheck-0-<n>`. The workers detect the
//!   shape on every stream anyway; this makes the server's flags visible in the log before
//!   hours of generation, and warns when counts will be approximate.
//! - **Rendering endpoints** (`upstream::render::detect`): whether the server renders
//!   prompts itself (vLLM's `/tokenize` with messages, llama.cpp's `/apply-template`,
//!   SGLang's `/tokenize` with a prompt), for `[tokenizer] source = "server"` and the
//!   start-up template check. Asked only with a `[tokenizer]` that needs it.
//!
//! Nothing here fails the run: a server that does not answer is logged and the run goes
//! on (the workers wait for it as usual).

use crate::config::{Api, Config, PromptSource, TemplateCheck};
use crate::upstream::render::{detect, Detected};
use crate::upstream::{dialect, sse, Upstream, UpstreamError};
use serde_json::Value;
use std::time::Duration;

/// Timeout of each context-length query.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of the self-check generation (it may queue behind a busy batch).
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// Tokens the self-check asks for: enough for several stream events.
const CHECK_TOKENS: u32 = 8;
/// Bytes of a self-check event the parser may hold (the whole answer is read within 1 MiB).
const SELF_CHECK_CAP: u64 = 1 << 20;

/// Where a context length came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextLength {
    pub tokens: u32,
    /// `config`, or the endpoint and key, such as `/v1/models max_model_len`.
    pub source: String,
}

/// How a server streams (SGLang's `/generate`; the OpenAI APIs always stream deltas).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamShape {
    /// Every event repeats the whole output so far (SGLang's default).
    Cumulative,
    /// Every event carries only the new part (`--incremental-streaming-output`, OpenAI).
    Incremental,
    /// Too few events to tell (the workers still tell per stream).
    Unknown,
}

/// What the self-check saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfCheck {
    /// `None` when not streaming.
    pub stream: Option<StreamShape>,
    /// Events with content (1 for a non-streaming answer).
    pub events: usize,
    /// The server returned completion token ids.
    pub token_ids: bool,
    /// The server reported the completion token count.
    pub usage: bool,
}

/// The smallest context length of the servers, or the configured one.
pub fn effective_context(configured: Option<u32>, found: &[Option<ContextLength>]) -> Option<u32> {
    if configured.is_some() {
        return configured;
    }
    found.iter().flatten().map(|c| c.tokens).min()
}

fn positive(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .filter(|&n| n > 0)
        .map(|n| n.min(u64::from(u32::MAX)) as u32)
}

/// The context length in one endpoint's answer, with the key it came from.
pub fn context_from(path: &str, v: &Value, model: &str) -> Option<(u32, &'static str)> {
    match path {
        "/get_model_info" | "/get_server_info" => {
            ["context_length", "max_context_length", "max_model_len"]
                .into_iter()
                .find_map(|k| positive(v.get(k)).map(|n| (n, k)))
        }
        "/v1/models" => {
            let data = v.get("data")?.as_array()?;
            let m = data
                .iter()
                .find(|m| m.get("id").and_then(Value::as_str) == Some(model))
                .or_else(|| data.first())?;
            positive(m.get("max_model_len")).map(|n| (n, "max_model_len"))
        }
        "/props" => positive(
            v.get("default_generation_settings")
                .and_then(|s| s.get("n_ctx")),
        )
        .map(|n| (n, "default_generation_settings.n_ctx")),
        _ => None,
    }
}

/// Asks one server for its context length; `None` when no endpoint tells.
pub async fn discover_context(up: &Upstream, base: &str, model: &str) -> Option<ContextLength> {
    for path in [
        "/get_model_info",
        "/v1/models",
        "/get_server_info",
        "/props",
    ] {
        match up.get_json(base, path, INFO_TIMEOUT).await {
            Ok(v) => {
                if let Some((tokens, key)) = context_from(path, &v, model) {
                    return Some(ContextLength {
                        tokens,
                        source: format!("{path} {key}"),
                    });
                }
            }
            // Down: the other endpoints will not answer either.
            Err(e) if e.is_unreachable() => return None,
            Err(_) => {}
        }
    }
    None
}

/// The JSON events of an SSE body, read by the workers' parser (`[DONE]` and events that
/// are not JSON skipped: the self-check only describes what it sees).
fn sse_events(body: &[u8]) -> Result<Vec<Value>, String> {
    let events = sse::data_events(body, SELF_CHECK_CAP).map_err(|e| e.to_string())?;
    Ok(events
        .iter()
        .map(|d| d.trim())
        .filter(|d| !d.is_empty() && *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect())
}

/// Reads what a self-check answer says (`events`: the stream's events, or the one body).
pub fn analyse(api: Api, stream: bool, events: &[Value]) -> Result<SelfCheck, String> {
    let dialect = dialect::of(api);
    if let Some(err) = events.iter().find_map(|e| e.get("error")) {
        return Err(format!("the server answered with an error: {err}"));
    }
    let (mut token_ids, mut usage) = (false, false);
    // Per content event: (ids in it, running count reported, text).
    let mut seen: Vec<(Option<usize>, Option<u64>, String)> = Vec::new();
    for e in events {
        let e = match e {
            Value::Array(a) if a.len() == 1 => &a[0],
            e => e,
        };
        let seen_e = dialect.check_event(e);
        usage |= seen_e.usage;
        let (ids, count, text) = (seen_e.ids, seen_e.count, seen_e.text);
        if ids.is_some() {
            token_ids = true;
        }
        if count.is_some() {
            usage = true;
        }
        if ids.unwrap_or(0) > 0 || !text.is_empty() || count.is_some() {
            seen.push((ids, count, text));
        }
    }
    if seen.is_empty() && !usage {
        return Err("the answer holds no output".into());
    }
    let shape = if !stream {
        None
    } else if dialect.streams_deltas_only() {
        Some(StreamShape::Incremental)
    } else {
        Some(shape_of(&seen))
    };
    Ok(SelfCheck {
        stream: shape,
        events: seen.len().max(1),
        token_ids,
        usage,
    })
}

/// Which hypothesis every event agrees with: ids (or text) that are the whole output so
/// far, or only the new part. Both (one event) or neither: unknown.
fn shape_of(seen: &[(Option<usize>, Option<u64>, String)]) -> StreamShape {
    let with_counts: Vec<(usize, u64)> = seen
        .iter()
        .filter_map(|(ids, c, _)| Some(((*ids)?, (*c)?)))
        .collect();
    let (cumulative, incremental) = if with_counts.len() == seen.len() && seen.len() >= 2 {
        let cumulative = with_counts.iter().all(|&(n, c)| n as u64 == c);
        let mut sum = 0u64;
        let incremental = with_counts.iter().all(|&(n, c)| {
            sum += n as u64;
            sum == c
        });
        (cumulative, incremental)
    } else {
        // Text only: cumulative when each text extends the one before.
        let texts: Vec<&str> = seen
            .iter()
            .map(|s| s.2.as_str())
            .filter(|t| !t.is_empty())
            .collect();
        if texts.len() < 2 {
            return StreamShape::Unknown;
        }
        let cumulative = texts
            .windows(2)
            .all(|w| w[1].starts_with(w[0]) && w[1].len() > w[0].len());
        (cumulative, !cumulative)
    };
    match (cumulative, incremental) {
        (true, false) => StreamShape::Cumulative,
        (false, true) => StreamShape::Incremental,
        _ => StreamShape::Unknown,
    }
}

/// Sends the self-check request to `base` and reads the answer.
pub async fn self_check(
    up: &Upstream,
    base: &str,
    api: Api,
    model: &str,
    stream: bool,
    prompt_ids: Option<&[u32]>,
    nonce: u64,
) -> Result<SelfCheck, String> {
    let rid = format!("_selfcheck-0-{nonce}");
    let dialect = dialect::of(api);
    let mut body = dialect.check_body(model, stream, prompt_ids, CHECK_TOKENS, &rid);
    let bytes = match up
        .post_raw(base, dialect.path(), &rid, &body, CHECK_TIMEOUT)
        .await
    {
        // A server that refuses token ids on a stream: learnt here, checked without them.
        Err(e) if stream && crate::upstream::refuses_stream_ids(&e) => {
            up.stream_without_ids(base);
            if let Some(b) = body.as_object_mut() {
                b.remove("return_token_ids");
            }
            up.post_raw(base, dialect.path(), &rid, &body, CHECK_TIMEOUT)
                .await
        }
        other => other,
    }
    .map_err(|e: UpstreamError| e.to_string())?;
    let events = if stream {
        sse_events(&bytes)?
    } else {
        vec![serde_json::from_slice::<Value>(&bytes).map_err(|e| format!("not JSON: {e}"))?]
    };
    analyse(api, stream, &events)
}

/// One line describing a self-check, for the log.
pub fn describe(c: &SelfCheck) -> String {
    let shape = match c.stream {
        None => "not streaming".to_string(),
        Some(StreamShape::Cumulative) => format!("streams cumulative output ({} events)", c.events),
        Some(StreamShape::Incremental) => format!("streams deltas ({} events)", c.events),
        Some(StreamShape::Unknown) => format!(
            "stream shape not visible in {} event(s) (detected per stream)",
            c.events
        ),
    };
    format!(
        "{shape}; token ids: {}; usage: {}",
        if c.token_ids {
            "returned"
        } else {
            "not returned"
        },
        if c.usage { "reported" } else { "not reported" }
    )
}

/// What the start-up probe found.
#[derive(Debug, Clone)]
pub struct Probed {
    /// The context length to enforce, if any is known.
    pub context: Option<u32>,
    /// Per server URL, its rendering endpoints (empty without a `[tokenizer]`).
    pub rendering: Vec<(String, Detected)>,
}

/// Start-up probe of every server: context lengths and rendering endpoints (awaited,
/// intake needs them) and the self-check (spawned; it logs when it is done and never
/// delays the run).
pub async fn probe(
    cfg: &Config,
    up: &Upstream,
    prompt_ids: Option<Vec<u32>>,
    has_tokenizer: bool,
) -> Probed {
    let mut rendering = Vec::new();
    let wanted = cfg.tokenizer.as_ref().is_some_and(|t| {
        t.source == PromptSource::Server || t.template_check() != TemplateCheck::Off
    });
    if wanted {
        for url in &cfg.server.urls {
            let d = detect(up, url, &cfg.server.model).await;
            match d {
                Detected::Renders(kind) => {
                    tracing::info!(server = %url, endpoints = kind.describe(), "the server renders prompts")
                }
                Detected::NoEndpoint => {
                    tracing::info!(server = %url, "the server has no rendering endpoint (/tokenize, /apply-template)")
                }
                Detected::Unreachable => {}
            }
            rendering.push((url.clone(), d));
        }
    }
    let mut found = Vec::new();
    for url in &cfg.server.urls {
        let c = match cfg.server.context_length {
            Some(_) => None,
            None => discover_context(up, url, &cfg.server.model).await,
        };
        match &c {
            Some(c) => {
                tracing::info!(server = %url, context_length = c.tokens, source = %c.source, "server context length")
            }
            None if cfg.server.context_length.is_none() => tracing::warn!(server = %url,
                "the server does not report its context length: prompts are not checked against it (set server.context_length)"),
            None => {}
        }
        found.push(c);
    }
    let context = effective_context(cfg.server.context_length, &found);
    if let Some(n) = cfg.server.context_length {
        tracing::info!(
            context_length = n,
            "context length from server.context_length"
        );
    }
    if cfg.server.clamp_max_tokens && (context.is_none() || !has_tokenizer) {
        tracing::warn!("server.clamp_max_tokens needs a known context length and a [tokenizer] (prompt ids): max_tokens is sent as configured");
    }
    if cfg.server.self_check {
        for (i, url) in cfg.server.urls.iter().enumerate() {
            let (up, url, api, model, stream, ids) = (
                up.clone(),
                url.clone(),
                cfg.server.api,
                cfg.server.model.clone(),
                cfg.server.stream,
                prompt_ids.clone(),
            );
            let nonce = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
                .wrapping_add(i as u64);
            tokio::spawn(async move {
                match self_check(&up, &url, api, &model, stream, ids.as_deref(), nonce).await {
                    Ok(c) => {
                        tracing::info!(server = %url, "self-check: {}", describe(&c));
                        if !c.usage && !c.token_ids && !has_tokenizer {
                            tracing::warn!(server = %url, "the server reports neither usage nor token ids and no [tokenizer] is configured: completion_tokens will count stream chunks (approximate)");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(server = %url, error = %e, "self-check failed (the run goes on)")
                    }
                }
            });
        }
    }
    Probed { context, rendering }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each server kind's endpoint gives its context length under its own key (the
    /// configured model's, else the first); the smallest of several servers is used, and a
    /// configured length wins.
    #[test]
    fn context_lengths_from_each_server_shape() {
        let mock_sglang =
            json!({"model_path": "m", "max_context_length": 4096, "context_length": 4096});
        assert_eq!(
            context_from("/get_model_info", &mock_sglang, "m"),
            Some((4096, "context_length"))
        );
        let real_sglang = json!({"model_path": "m", "is_generation": true});
        assert_eq!(context_from("/get_model_info", &real_sglang, "m"), None);
        let vllm = json!({"object": "list", "data": [
            {"id": "other", "max_model_len": 1000},
            {"id": "m", "max_model_len": 32768}]});
        assert_eq!(
            context_from("/v1/models", &vllm, "m"),
            Some((32768, "max_model_len"))
        );
        assert_eq!(
            context_from("/v1/models", &vllm, "unknown"),
            Some((1000, "max_model_len"))
        );
        let llama = json!({"default_generation_settings": {"n_ctx": 8192}});
        assert_eq!(
            context_from("/props", &llama, "m"),
            Some((8192, "default_generation_settings.n_ctx"))
        );
        assert_eq!(
            context_from("/get_server_info", &json!({"context_length": null}), "m"),
            None
        );
        let c = |n| {
            Some(ContextLength {
                tokens: n,
                source: String::new(),
            })
        };
        assert_eq!(
            effective_context(None, &[c(4096), None, c(2048)]),
            Some(2048)
        );
        assert_eq!(effective_context(Some(100), &[c(4096)]), Some(100));
        assert_eq!(effective_context(None, &[None]), None);
    }

    fn sg(ids: &[u32], count: u64, text: &str) -> Value {
        json!({"text": text, "output_ids": ids, "meta_info": {"completion_tokens": count}})
    }

    /// SGLang's cumulative and delta streams are told apart by ids and counts, or by the
    /// text alone; one event is too few to tell, and an error event is an error.
    #[test]
    fn sglang_stream_shapes_are_told_apart() {
        let cumulative = [
            sg(&[1, 2], 2, "a b"),
            sg(&[1, 2, 3], 3, "a b c"),
            sg(&[1, 2, 3], 3, "a b c"),
        ];
        let c = analyse(Api::Sglang, true, &cumulative).unwrap();
        assert_eq!(c.stream, Some(StreamShape::Cumulative));
        assert!(c.token_ids && c.usage);
        let incremental = [sg(&[1, 2], 2, "a b"), sg(&[3], 3, " c"), sg(&[], 3, "")];
        assert_eq!(
            analyse(Api::Sglang, true, &incremental).unwrap().stream,
            Some(StreamShape::Incremental)
        );
        let one = [sg(&[1, 2, 3], 3, "a b c")];
        assert_eq!(
            analyse(Api::Sglang, true, &one).unwrap().stream,
            Some(StreamShape::Unknown)
        );
        // No ids, no counts: told from the text.
        let texts = [json!({"text": "a"}), json!({"text": "a b"})];
        let c = analyse(Api::Sglang, true, &texts).unwrap();
        assert_eq!(c.stream, Some(StreamShape::Cumulative));
        assert!(!c.token_ids && !c.usage);
        let err = [json!({"error": {"message": "bad"}})];
        assert!(analyse(Api::Sglang, true, &err).is_err());
    }

    /// OpenAI-style answers, streamed or whole, report whether token ids and usage came
    /// back; their streams are deltas.
    #[test]
    fn openai_answers_report_ids_and_usage() {
        let events = [
            json!({"choices": [{"text": " w1", "token_ids": [1]}]}),
            json!({"choices": [{"text": " w2", "token_ids": [2], "finish_reason": "length"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}),
        ];
        let c = analyse(Api::Completions, true, &events).unwrap();
        assert_eq!(
            c,
            SelfCheck {
                stream: Some(StreamShape::Incremental),
                events: 2,
                token_ids: true,
                usage: true
            }
        );
        let bare = [json!({"choices": [{"delta": {"content": "hi"}}]})];
        let c = analyse(Api::Chat, true, &bare).unwrap();
        assert!(!c.token_ids && !c.usage);
        let unary = [
            json!({"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}}),
        ];
        let c = analyse(Api::Chat, false, &unary).unwrap();
        assert_eq!((c.stream, c.usage), (None, true));
    }

    /// The self-check reads events as the workers do: comments and `[DONE]` skipped.
    #[test]
    fn sse_bodies_are_cut_into_events() {
        let body = b"data: {\"a\":1}\n\n: comment\n\ndata: [DONE]\n\n";
        assert_eq!(sse_events(body).unwrap(), vec![json!({"a": 1})]);
    }

    /// An event whose JSON spans several `data:` lines is one event (the lines joined),
    /// a BOM and CR line ends are read by the rules, and an unfinished last event is
    /// discarded.
    #[test]
    fn sse_events_follow_the_event_stream_rules() {
        let body =
            b"\xEF\xBB\xBFdata: {\"a\":\rdata: 1}\r\rdata: {\"b\":2}\r\n\r\ndata: {\"c\":3}\n";
        assert_eq!(
            sse_events(body).unwrap(),
            vec![json!({"a": 1}), json!({"b": 2})]
        );
    }
}
