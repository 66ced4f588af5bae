//! OpenAI-style `/v1/completions` and `/v1/chat/completions` (vLLM, llama.cpp, SGLang, …).
//!
//! Asks for `stream_options.include_usage` and vLLM's `return_token_ids`; servers that
//! ignore either still work (counts then come from the tokenizer or the chunks).
//! Streaming chunks are always deltas.
//!
//! Invariants: a request body's keys, their order and values are pinned byte for byte
//! (`request_bodies_are_pinned_byte_for_byte`), and a field left unset is skipped, never
//! sent as `null`; an answer's unknown fields are ignored.

use super::dialect::{stream_error, to_json, Dialect, Seen};
use super::{sse, GenerateRequest, Generation, TokenSink, UpstreamError};
use futures_util::future::BoxFuture;
use serde_json::Value;
use std::borrow::Cow;

/// An OpenAI-style dialect: completions (`prompt`, `text`) or chat (`messages`, `message`
/// and `delta` content); both share the answer's shape, so one type speaks both.
pub(super) struct OpenAi {
    chat: bool,
}

/// `/v1/completions`.
pub(super) static COMPLETIONS: OpenAi = OpenAi { chat: false };
/// `/v1/chat/completions`.
pub(super) static CHAT: OpenAi = OpenAi { chat: true };

impl Dialect for OpenAi {
    fn path(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    fn health_path(&self) -> &'static str {
        "/v1/models"
    }

    fn body(
        &self,
        req: &GenerateRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<Vec<u8>, UpstreamError> {
        to_json(&request_body(req, model, stream, self.chat))
    }

    fn parse_whole(&self, body: &[u8]) -> Result<Generation, UpstreamError> {
        parse_full(body, self.chat)
    }

    fn read_stream<'a>(
        &'a self,
        r: &'a mut sse::Reader,
        sink: TokenSink<'a>,
    ) -> BoxFuture<'a, Result<Generation, UpstreamError>> {
        Box::pin(read_stream(r, self.chat, sink))
    }

    /// These servers stop generating when the connection is dropped.
    fn abort(&self, _rid: &str) -> Option<(&'static str, Value)> {
        None
    }

    fn check_body(
        &self,
        model: &str,
        stream: bool,
        prompt_ids: Option<&[u32]>,
        max_tokens: u32,
        _rid: &str,
    ) -> Value {
        let mut b = serde_json::json!({
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": stream,
            "return_token_ids": true,
        });
        if stream {
            b["stream_options"] = serde_json::json!({"include_usage": true});
        }
        if self.chat {
            b["messages"] = serde_json::json!([{"role": "user", "content": "Hello"}]);
        } else {
            match prompt_ids {
                Some(ids) => b["prompt"] = serde_json::json!(ids),
                None => b["prompt"] = serde_json::json!("Hello"),
            }
        }
        b
    }

    fn check_event(&self, e: &Value) -> Seen {
        let c = e.get("choices").and_then(|c| c.get(0));
        let text = c
            .and_then(|c| {
                c.get("text")
                    .or_else(|| c.get("delta").and_then(|d| d.get("content")))
                    .or_else(|| c.get("message").and_then(|m| m.get("content")))
            })
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        Seen {
            ids: c
                .and_then(|c| c.get("token_ids"))
                .and_then(Value::as_array)
                .map(Vec::len),
            count: None,
            text,
            usage: e
                .get("usage")
                .and_then(|u| u.get("completion_tokens"))
                .is_some(),
        }
    }

    fn streams_deltas_only(&self) -> bool {
        true
    }
}

// Requests borrow every field (the prompt, its ids, the chat messages) and are serialised
// once: with instant answers, a JSON map built per request is a visible share of the
// client's CPU.

/// One request to `/v1/completions` (`prompt`) or `/v1/chat/completions` (`messages`).
#[derive(serde::Serialize)]
pub(super) struct RequestBody<'a> {
    model: &'a str,
    max_tokens: u32,
    temperature: f64,
    top_p: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<&'a [String]>,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    return_token_ids: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<Prompt<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<Messages<'a>>,
}

#[derive(serde::Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// Token ids when the prompt was tokenized, else its text.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Ids(&'a [u32]),
    Text(&'a str),
}

/// The row's messages as given, or the prompt as one user turn.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum Messages<'a> {
    Given(&'a Value),
    Prompt([UserTurn<'a>; 1]),
}

#[derive(serde::Serialize)]
struct UserTurn<'a> {
    role: &'static str,
    content: &'a str,
}

/// The body of `req`: for chat (`/v1/chat/completions`) with `messages` (the row's, or the
/// prompt as one user turn), else (`/v1/completions`) with `prompt` (token ids when known).
pub(super) fn request_body<'a>(
    req: &GenerateRequest<'a>,
    model: &'a str,
    stream: bool,
    chat: bool,
) -> RequestBody<'a> {
    let s = req.sampling;
    let (prompt, messages) = if chat {
        let messages = match req.messages {
            Some(m) => Messages::Given(m),
            None => Messages::Prompt([UserTurn {
                role: "user",
                content: req.prompt,
            }]),
        };
        (None, Some(messages))
    } else {
        let prompt = match req.prompt_ids {
            Some(ids) => Prompt::Ids(ids),
            None => Prompt::Text(req.prompt),
        };
        (Some(prompt), None)
    };
    RequestBody {
        model,
        max_tokens: s.max_tokens,
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        seed: s.seed,
        stop: s.stop.as_deref(),
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        return_token_ids: true,
        prompt,
        messages,
    }
}

// Answers are read into typed structs holding only the fields used: strings borrow from
// the event when they have no escapes and token ids go straight into a `Vec<u32>`, since a
// JSON tree per chunk is a visible share of the client's CPU with fast servers.

/// A string field where `null` reads as empty; absent is `None`.
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
    /// serde's own `Vec<u32>`, read in its one pass over the array (faster than skipping
    /// it to a `RawValue` and parsing that by hand).
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
        reasoning: None,
        tool_calls: None,
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
            return Err(stream_error(err));
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
        reasoning: None,
        tool_calls: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Sampling;

    /// A choice's token ids are read exactly (random ids and whitespace), and what is not
    /// an array of `u32` — signs, fractions, exponents, ids past `u32`, strings — is
    /// refused with serde's error, not read wrong; `null` is no ids.
    #[test]
    fn token_ids_are_read_exactly_and_bad_ones_refused() {
        let ids_of = |json: &str| -> Result<Option<Vec<u32>>, String> {
            let body = format!(r#"{{"choices":[{{"text":"x","token_ids":{json}}}]}}"#);
            serde_json::from_str::<Body<'_>>(&body)
                .map(|mut b| b.choices.swap_remove(0).token_ids)
                .map_err(|e| e.to_string())
        };
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let spaces = [" ", "", "\n", "\t", "  "];
        for _ in 0..500 {
            let n = (next() % 40) as usize;
            let ids: Vec<u32> = (0..n)
                .map(|_| match next() % 4 {
                    0 => 0,
                    1 => u32::MAX,
                    _ => (next() % 200_000) as u32,
                })
                .collect();
            let mut json = String::from("[");
            for (k, id) in ids.iter().enumerate() {
                json.push_str(spaces[(next() % 5) as usize]);
                json.push_str(&id.to_string());
                json.push_str(spaces[(next() % 5) as usize]);
                if k + 1 < ids.len() {
                    json.push(',');
                }
            }
            json.push_str(spaces[(next() % 5) as usize]);
            json.push(']');
            assert_eq!(ids_of(&json), Ok(Some(ids)), "{json}");
        }
        assert_eq!(ids_of("null"), Ok(None));
        for bad in ["[-1]", "[1.0]", "[1e3]", "[4294967296]", "[\"7\"]", "7"] {
            let e = ids_of(bad).expect_err(bad);
            let serde = serde_json::from_str::<Vec<u32>>(bad)
                .expect_err(bad)
                .to_string();
            let serde = serde.split(" at line").next().unwrap_or_default();
            assert!(e.contains(serde), "{bad}: {e} / {serde}");
        }
    }

    fn sampling(all: bool) -> Sampling {
        Sampling {
            max_tokens: 64,
            temperature: 0.7,
            top_p: 1.0,
            top_k: all.then_some(20),
            min_p: all.then_some(0.05),
            seed: all.then_some(7),
            stop: all.then(|| vec!["</s>".to_string(), "\n\n".to_string()]),
        }
    }

    /// The bytes of each body shape (completions with text or ids, chat with the prompt or
    /// the row's messages, every optional sampling field or none): keys in this order,
    /// unset fields skipped, never `null`.
    #[test]
    fn request_bodies_are_pinned_byte_for_byte() {
        let (none, all) = (sampling(false), sampling(true));
        let messages = serde_json::json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi \"you\""}]);
        fn req<'a>(
            sampling: &'a Sampling,
            prompt_ids: Option<&'a [u32]>,
            messages: Option<&'a Value>,
        ) -> GenerateRequest<'a> {
            GenerateRequest {
                rid: "r1",
                prompt: "say \"hi\"\n",
                prompt_ids,
                messages,
                sampling,
                tools: None,
                chat_template_kwargs: None,
            }
        }
        let ids = [1u32, 2, 151_643];
        let body = |b: RequestBody<'_>| serde_json::to_string(&b).unwrap();
        assert_eq!(
            body(request_body(&req(&none, None, None), "m", false, false)),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":false,"return_token_ids":true,"prompt":"say \"hi\"\n"}"#
        );
        assert_eq!(
            body(request_body(&req(&all, Some(&ids), None), "m", true, false)),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"top_k":20,"min_p":0.05,"seed":7,"stop":["</s>","\n\n"],"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,"prompt":[1,2,151643]}"#
        );
        assert_eq!(
            body(request_body(&req(&none, Some(&ids), None), "m", true, true)),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,"messages":[{"role":"user","content":"say \"hi\"\n"}]}"#
        );
        assert_eq!(
            body(request_body(
                &req(&all, None, Some(&messages)),
                "m",
                false,
                true
            )),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"top_k":20,"min_p":0.05,"seed":7,"stop":["</s>","\n\n"],"stream":false,"return_token_ids":true,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi \"you\""}]}"#
        );
    }

    /// A whole completions body and a whole chat body give their text, ids, usage and
    /// finish reason.
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

    /// Every chunk shape servers send parses: escaped text (owned), `null` text or usage,
    /// chat deltas without content, unknown fields, an error object.
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
