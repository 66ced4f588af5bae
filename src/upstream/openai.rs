//! OpenAI-style `/v1/completions` and `/v1/chat/completions` (vLLM, llama.cpp, SGLang, …).
//!
//! Asks for `stream_options.include_usage` and vLLM's `return_token_ids`; servers that
//! ignore either still work (counts then come from the tokenizer or the chunks).
//! Streaming chunks are always deltas.

use super::{sampling_fields, sse, GenerateRequest, Generation, TokenSink, UpstreamError};
use serde_json::{json, Value};
use std::borrow::Cow;

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

// --- Responses, parsed into borrowed typed structs. ---------------------------------------
//
// Scenario 1 of issue 7 (instant responses) showed `serde_json::Value` trees as a visible
// share of the client's CPU: every chunk built a map per object and a `Value` per token
// id. These structs read only the fields used; strings borrow from the event when they
// have no escapes, and token ids go straight into a `Vec<u32>`. Unknown fields are ignored,
// as with the `Value` reading they replace.

/// A string field where `null` reads as empty (as the `Value` reading did); absent is `None`.
fn null_as_empty<'de, D>(d: D) -> Result<Option<Cow<'de, str>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let v: Option<Cow<'de, str>> = serde::Deserialize::deserialize(d)?;
    Ok(Some(v.unwrap_or(Cow::Borrowed(""))))
}

/// A count clamped to `u32` (a server reporting more is not worth failing the item over).
fn clamped_u32<'de, D>(d: D) -> Result<Option<u32>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let v: Option<u64> = serde::Deserialize::deserialize(d)?;
    Ok(v.map(|n| n.min(u64::from(u32::MAX)) as u32))
}

#[derive(serde::Deserialize)]
struct Usage {
    #[serde(default, deserialize_with = "clamped_u32")]
    prompt_tokens: Option<u32>,
    #[serde(default, deserialize_with = "clamped_u32")]
    completion_tokens: Option<u32>,
}

#[derive(serde::Deserialize)]
struct Message<'a> {
    #[serde(default, borrow, deserialize_with = "null_as_empty")]
    content: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow, deserialize_with = "null_as_empty")]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    message: Option<Message<'a>>,
    #[serde(default, borrow)]
    delta: Option<Message<'a>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

impl<'a> Choice<'a> {
    /// The choice's text: `text` (completions), `message.content` or `delta.content` (chat).
    fn take_text(&mut self, chat: bool, delta: bool) -> Option<Cow<'a, str>> {
        if chat {
            let m = if delta {
                self.delta.take()
            } else {
                self.message.take()
            };
            m.and_then(|m| m.content)
        } else {
            self.text.take()
        }
    }
}

/// A whole (non-streamed) body, or one streamed chunk.
#[derive(serde::Deserialize)]
struct Body<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    /// An error object sent inside a 200 stream.
    #[serde(default)]
    error: Option<Value>,
}

pub(super) fn parse_full(bytes: &[u8], chat: bool) -> Result<Generation, UpstreamError> {
    let mut v: Body<'_> = serde_json::from_slice(bytes)
        .map_err(|e| UpstreamError::Malformed(format!("completion body: {e}")))?;
    if v.choices.is_empty() {
        return Err(UpstreamError::Malformed(
            "completion body has no choices".into(),
        ));
    }
    let mut c = v.choices.swap_remove(0);
    let text = c
        .take_text(chat, false)
        .ok_or_else(|| UpstreamError::Malformed("completion choice has no text".into()))?;
    let usage = v.usage.as_ref();
    Ok(Generation {
        text: text.into_owned(),
        token_ids: c.token_ids,
        prompt_tokens: usage.and_then(|u| u.prompt_tokens),
        completion_tokens: usage.and_then(|u| u.completion_tokens),
        finish_reason: c
            .finish_reason
            .map(Cow::into_owned)
            .unwrap_or_else(|| "unknown".to_string()),
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
        let mut v: Body<'_> = serde_json::from_str(&data)
            .map_err(|e| UpstreamError::Malformed(format!("stream chunk: {e}")))?;
        if let Some(err) = &v.error {
            return Err(super::stream_error(err));
        }
        if let Some(u) = &v.usage {
            prompt_tokens = u.prompt_tokens.or(prompt_tokens);
            completion_tokens = u.completion_tokens.or(completion_tokens);
        }
        if v.choices.is_empty() {
            continue;
        }
        let mut c = v.choices.swap_remove(0);
        let piece = c.take_text(chat, true).unwrap_or_default();
        let new = match &c.token_ids {
            Some(n) => n.len() as u32,
            None => u32::from(!piece.is_empty()),
        };
        if let Some(n) = &c.token_ids {
            has_ids = true;
            ids.extend_from_slice(n);
        }
        if !piece.is_empty() || new > 0 {
            chunks += 1;
        }
        text.push_str(&piece);
        r.check_retained(text.len() + ids.len() * 4)?;
        if let Some(f) = c.finish_reason {
            finish = Some(f.into_owned());
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

#[cfg(test)]
mod typed_tests {
    use super::*;

    /// The typed reading accepts what the `Value` reading did: escaped text (owned),
    /// `null` text or usage, chat deltas without content, unknown fields.
    #[test]
    fn stream_chunks_of_every_shape_parse() {
        let c = r#"{"id":"x","choices":[{"index":0,"text":" a\"b\n","token_ids":[7],"finish_reason":null,"extra":1}],"usage":null}"#;
        let mut b: Body<'_> = serde_json::from_str(c).unwrap();
        let mut ch = b.choices.swap_remove(0);
        assert_eq!(ch.take_text(false, true).as_deref(), Some(" a\"b\n"));
        assert_eq!(ch.token_ids, Some(vec![7]));
        assert!(ch.finish_reason.is_none() && b.usage.is_none());
        let nul = r#"{"choices":[{"text":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":5000000000}}"#;
        let mut b: Body<'_> = serde_json::from_str(nul).unwrap();
        assert_eq!(b.choices[0].take_text(false, true).as_deref(), Some(""));
        let u = b.usage.unwrap();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens),
            (Some(3), Some(u32::MAX))
        );
        let chat = r#"{"choices":[{"delta":{"role":"assistant"}}]}"#;
        let mut b: Body<'_> = serde_json::from_str(chat).unwrap();
        assert_eq!(b.choices[0].take_text(true, true), None);
        let only_usage = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#;
        let b: Body<'_> = serde_json::from_str(only_usage).unwrap();
        assert!(b.choices.is_empty() && b.usage.is_some());
        let err = r#"{"error":{"message":"boom","code":500}}"#;
        let b: Body<'_> = serde_json::from_str(err).unwrap();
        assert!(b.error.is_some());
    }
}
