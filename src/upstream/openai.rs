//! OpenAI-style `/v1/completions` and `/v1/chat/completions` (vLLM, llama.cpp, SGLang, …).
//!
//! Asks for `stream_options.include_usage` and vLLM's `return_token_ids`; servers that
//! ignore either still work (counts then come from the tokenizer or the chunks).
//! Streaming chunks are always deltas.

use super::{
    as_ids, as_u32, sampling_fields, sse, GenerateRequest, Generation, TokenSink, UpstreamError,
};
use serde_json::{json, Value};

fn common(req: &GenerateRequest<'_>, model: &str, stream: bool) -> serde_json::Map<String, Value> {
    let mut b = serde_json::Map::new();
    b.insert("model".into(), json!(model));
    b.insert("max_tokens".into(), json!(req.sampling.max_tokens));
    sampling_fields(req.sampling, &mut b);
    b.insert("stream".into(), json!(stream));
    if stream {
        b.insert("stream_options".into(), json!({"include_usage": true}));
    }
    b.insert("return_token_ids".into(), json!(true));
    b
}

pub(super) fn completions_body(req: &GenerateRequest<'_>, model: &str, stream: bool) -> Value {
    let mut b = common(req, model, stream);
    match req.prompt_ids {
        Some(ids) => b.insert("prompt".into(), json!(ids)),
        None => b.insert("prompt".into(), json!(req.prompt)),
    };
    Value::Object(b)
}

pub(super) fn chat_body(req: &GenerateRequest<'_>, model: &str, stream: bool) -> Value {
    let mut b = common(req, model, stream);
    let messages = match req.messages {
        Some(m) => m.clone(),
        None => json!([{"role": "user", "content": req.prompt}]),
    };
    b.insert("messages".into(), messages);
    Value::Object(b)
}

fn choice_text(c: &Value, chat: bool, delta: bool) -> Option<String> {
    let t = if chat {
        let m = if delta {
            c.get("delta")
        } else {
            c.get("message")
        };
        m.and_then(|m| m.get("content"))
    } else {
        c.get("text")
    };
    t.map(|t| t.as_str().unwrap_or("").to_string())
}

pub(super) fn parse_full(bytes: &[u8], chat: bool) -> Result<Generation, UpstreamError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| UpstreamError::Malformed(format!("completion body: {e}")))?;
    let c = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| UpstreamError::Malformed("completion body has no choices".into()))?;
    let text = choice_text(c, chat, false)
        .ok_or_else(|| UpstreamError::Malformed("completion choice has no text".into()))?;
    let usage = v.get("usage");
    Ok(Generation {
        text,
        token_ids: as_ids(c.get("token_ids")),
        prompt_tokens: as_u32(usage.and_then(|u| u.get("prompt_tokens"))),
        completion_tokens: as_u32(usage.and_then(|u| u.get("completion_tokens"))),
        finish_reason: c
            .get("finish_reason")
            .and_then(|f| f.as_str())
            .unwrap_or("unknown")
            .to_string(),
        ttft_ms: None,
        latency_ms: 0,
        chunks: 1,
    })
}

pub(super) async fn read_stream(
    r: &mut sse::Reader,
    chat: bool,
    sink: TokenSink<'_>,
) -> Result<Generation, UpstreamError> {
    let mut text = String::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut has_ids = false;
    let mut finish: Option<String> = None;
    let mut prompt_tokens = None;
    let mut completion_tokens = None;
    let mut chunks = 0u32;
    let mut done = false;
    while let Some(data) = r.next_event().await? {
        if data.trim() == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(&data)
            .map_err(|e| UpstreamError::Malformed(format!("stream chunk: {e}")))?;
        if let Some(err) = v.get("error") {
            return Err(super::stream_error(err));
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            prompt_tokens = as_u32(u.get("prompt_tokens")).or(prompt_tokens);
            completion_tokens = as_u32(u.get("completion_tokens")).or(completion_tokens);
        }
        let Some(c) = v.get("choices").and_then(|c| c.get(0)) else {
            continue;
        };
        let piece = choice_text(c, chat, true).unwrap_or_default();
        let new_ids = as_ids(c.get("token_ids"));
        let new = match &new_ids {
            Some(n) => n.len() as u32,
            None => u32::from(!piece.is_empty()),
        };
        if let Some(n) = new_ids {
            has_ids = true;
            ids.extend_from_slice(&n);
        }
        if !piece.is_empty() || new > 0 {
            chunks += 1;
        }
        text.push_str(&piece);
        r.check_retained(text.len() + ids.len() * 4)?;
        if let Some(f) = c.get("finish_reason").and_then(|f| f.as_str()) {
            finish = Some(f.to_string());
        }
        if new > 0 {
            r.mark_first_token();
            sink(new);
        }
    }
    if !done {
        return Err(UpstreamError::StreamCut(
            "stream ended without [DONE]".into(),
        ));
    }
    let Some(finish_reason) = finish else {
        return Err(UpstreamError::StreamCut(
            "stream ended without a finish_reason".into(),
        ));
    };
    Ok(Generation {
        text,
        token_ids: has_ids.then_some(ids),
        prompt_tokens,
        completion_tokens,
        finish_reason,
        ttft_ms: r.ttft_ms,
        latency_ms: 0,
        chunks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_completion_and_chat_bodies_parse() {
        let c = br#"{"choices":[{"index":0,"text":" hi","finish_reason":"length","token_ids":[5,6]}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
        let g = parse_full(c, false).unwrap();
        assert_eq!(
            (
                g.text.as_str(),
                g.completion_tokens,
                g.finish_reason.as_str()
            ),
            (" hi", Some(2), "length")
        );
        assert_eq!(g.token_ids, Some(vec![5, 6]));
        let ch = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"yo"},"finish_reason":"stop"}]}"#;
        let g = parse_full(ch, true).unwrap();
        assert_eq!(
            (g.text.as_str(), g.completion_tokens, g.token_ids),
            ("yo", None, None)
        );
    }
}
