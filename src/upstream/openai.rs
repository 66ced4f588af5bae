//! OpenAI-style `/v1/completions` and `/v1/chat/completions` (vLLM, llama.cpp, SGLang, …).
//!
//! Asks for `stream_options.include_usage` and vLLM's `return_token_ids` (and, for a whole
//! chat answer, SGLang's `return_prompt_token_ids`, which SGLang refuses on a stream);
//! servers that ignore them still work (counts then come from the tokenizer or the
//! chunks). A chat answer's prompt ids are read where each server puts them: vLLM at the
//! top level (in the first chunk of a stream), SGLang in the choice. Streaming chunks are
//! always deltas.
//!
//! Chat requests carry the row's `tools` and the dataset's `chat_template_kwargs` (vLLM and
//! SGLang both read them at the top level), since the server renders the template;
//! `/v1/completions` never sends them, its prompt being already rendered by spool's
//! template with them. Chat answers give the reasoning parser's output
//! (`reasoning_content`, or vLLM's newer `reasoning`; the first non-empty of the two, in
//! that order, per answer or per delta, so a server sending both is not read twice) and
//! the parsed `tool_calls` (see `tool_calls`); `content` stays the visible answer, `null`
//! when the answer is only calls. Streamed reasoning and tool-call pieces are generated
//! tokens like content: they feed the sink and the chunk count.
//!
//! Invariants: a request body's keys, their order and values are pinned byte for byte
//! (`request_bodies_are_pinned_byte_for_byte`), and a field left unset is skipped, never
//! sent as `null`; an answer's unknown fields are ignored, and a known one of the wrong
//! JSON type is a malformed answer naming the field.

use super::dialect::{stream_error, to_json, Dialect, Seen};
use super::{sse, tool_calls, GenerateRequest, Generation, TokenSink, UpstreamError};
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

    fn body_without_token_ids(
        &self,
        req: &GenerateRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<Vec<u8>, UpstreamError> {
        let mut body = request_body(req, model, stream, self.chat);
        body.return_token_ids = false;
        to_json(&body)
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

    /// The text is the content, or the reasoning when there is none (a reasoning model's
    /// few check tokens are all thinking, and still output).
    fn check_event(&self, e: &Value) -> Seen {
        let c = e.get("choices").and_then(|c| c.get(0));
        let m = c.and_then(|c| c.get("delta").or_else(|| c.get("message")));
        fn field<'v>(v: Option<&'v Value>, k: &str) -> Option<&'v str> {
            v.and_then(|v| v.get(k))
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
        }
        let text = field(c, "text")
            .or_else(|| field(m, "content"))
            .or_else(|| field(m, "reasoning_content"))
            .or_else(|| field(m, "reasoning"))
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
    /// SGLang's spelling for a chat answer's prompt ids; only on a whole chat answer
    /// (SGLang refuses it on a stream).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    return_prompt_token_ids: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<Prompt<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<Messages<'a>>,
    /// Chat only, and only a non-empty list.
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a Value>,
    /// Chat only, and only a non-empty map.
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_kwargs: Option<&'a serde_json::Map<String, Value>>,
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
/// prompt as one user turn), `tools` and `chat_template_kwargs` when given, else
/// (`/v1/completions`) with `prompt` (token ids when known) and neither.
pub(super) fn request_body<'a>(
    req: &GenerateRequest<'a>,
    model: &'a str,
    stream: bool,
    chat: bool,
) -> RequestBody<'a> {
    let s = req.sampling;
    let tools = req
        .tools
        .filter(|t| chat && !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()));
    let chat_template_kwargs = req.chat_template_kwargs.filter(|k| chat && !k.is_empty());
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
        return_prompt_token_ids: chat && !stream,
        prompt,
        messages,
        tools,
        chat_template_kwargs,
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

/// A string field where `null` reads as absent; another type is an error naming `field`
/// (serde's own message does not say which field it was).
fn named_string<'de, D>(d: D, field: &str) -> Result<Option<Cow<'de, str>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    <Option<Cow<'de, str>> as serde::Deserialize>::deserialize(d)
        .map_err(|e| serde::de::Error::custom(format!("`{field}`: {e}")))
}

fn reasoning_content<'de, D>(d: D) -> Result<Option<Cow<'de, str>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    named_string(d, "reasoning_content")
}

fn reasoning<'de, D>(d: D) -> Result<Option<Cow<'de, str>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    named_string(d, "reasoning")
}

/// A chat `message` (whole answers) or `delta` (stream chunks).
#[derive(serde::Deserialize)]
struct Message<'a> {
    #[serde(default, borrow, deserialize_with = "null_as_empty")]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "reasoning_content")]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "reasoning")]
    reasoning: Option<Cow<'a, str>>,
    /// Checked field by field in `tool_calls` (rare, and its errors name the field).
    #[serde(default)]
    tool_calls: Option<Value>,
}

impl<'a> Message<'a> {
    /// The reasoning parser's output: `reasoning_content`, else `reasoning`, whichever is
    /// first non-empty (vLLM has sent both with the same text).
    fn take_reasoning(&mut self) -> Option<Cow<'a, str>> {
        [self.reasoning_content.take(), self.reasoning.take()]
            .into_iter()
            .flatten()
            .find(|r| !r.is_empty())
    }
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
    /// SGLang's chat answer's prompt ids.
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

impl<'a> Choice<'a> {
    /// The choice's text: `text` (completions), `message.content` or `delta.content` (chat).
    #[cfg(test)]
    fn take_text(&mut self, chat: bool, delta: bool) -> Option<Cow<'a, str>> {
        self.take_output(chat, delta).text
    }

    /// What the choice generated: its text (`text` for completions, `message` or `delta`
    /// content for chat), and for chat the reasoning and the tool calls.
    fn take_output(&mut self, chat: bool, delta: bool) -> Output<'a> {
        if !chat {
            return Output {
                text: self.text.take(),
                reasoning: None,
                tool_calls: None,
            };
        }
        let m = if delta {
            self.delta.take()
        } else {
            self.message.take()
        };
        match m {
            Some(mut m) => Output {
                reasoning: m.take_reasoning(),
                tool_calls: m.tool_calls.take(),
                text: m.content,
            },
            None => Output {
                text: None,
                reasoning: None,
                tool_calls: None,
            },
        }
    }
}

/// One choice's generated output, taken out of it.
struct Output<'a> {
    text: Option<Cow<'a, str>>,
    reasoning: Option<Cow<'a, str>>,
    /// The raw `tool_calls` field (chat).
    tool_calls: Option<Value>,
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
    /// vLLM's chat answer's prompt ids (the first chunk of a stream).
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
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
    let out = c.take_output(chat, false);
    let tool_calls = tool_calls::whole(out.tool_calls.as_ref(), "message.tool_calls")
        .map_err(|e| in_body(e, "completion body"))?;
    let reasoning = out.reasoning.map(Cow::into_owned);
    // An answer that is only reasoning or calls may leave `content` out.
    let text = match out.text {
        Some(t) => t.into_owned(),
        None if chat && (reasoning.is_some() || tool_calls.is_some()) => String::new(),
        None => {
            return Err(UpstreamError::Malformed(
                "completion choice has no text".into(),
            ))
        }
    };
    let usage = v.usage.as_ref();
    let prompt_token_ids = if chat {
        v.prompt_token_ids.take().or(c.prompt_token_ids.take())
    } else {
        None
    };
    Ok(Generation {
        prompt_token_ids,
        text,
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
        reasoning,
        tool_calls,
    })
}

/// A malformed-answer error with `what` (the body or the chunk) before its message, as
/// serde's errors are reported.
fn in_body(e: UpstreamError, what: &str) -> UpstreamError {
    match e {
        UpstreamError::Malformed(m) => UpstreamError::Malformed(format!("{what}: {m}")),
        e => e,
    }
}

/// What a stream has delivered so far.
#[derive(Default)]
struct StreamState {
    text: String,
    reasoning: String,
    calls: tool_calls::Assembler,
    ids: Vec<u32>,
    has_ids: bool,
    finish: Option<String>,
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    chunks: u32,
    prompt_token_ids: Option<Vec<u32>>,
}

impl StreamState {
    /// Folds in one event's data: `None` for `[DONE]`, else how many new completion
    /// tokens it brought (its ids, or one per event carrying any generated piece).
    fn push(&mut self, data: &str, chat: bool) -> Result<Option<u32>, UpstreamError> {
        if data.trim() == "[DONE]" {
            return Ok(None);
        }
        let mut v: Body<'_> = serde_json::from_str(data)
            .map_err(|e| UpstreamError::Malformed(format!("stream chunk: {e}")))?;
        if let Some(err) = &v.error {
            return Err(stream_error(err));
        }
        if let Some(u) = &v.usage {
            self.prompt_tokens = u.prompt_tokens.or(self.prompt_tokens);
            self.completion_tokens = u.completion_tokens.or(self.completion_tokens);
        }
        if chat && self.prompt_token_ids.is_none() {
            self.prompt_token_ids = v.prompt_token_ids.take();
        }
        if v.choices.is_empty() {
            return Ok(Some(0));
        }
        let mut c = v.choices.swap_remove(0);
        let out = c.take_output(chat, true);
        let piece = out.text.unwrap_or_default();
        let thought = out.reasoning.unwrap_or_default();
        let called = self
            .calls
            .push(out.tool_calls.as_ref(), "delta.tool_calls")
            .map_err(|e| in_body(e, "stream chunk"))?;
        let generated = !piece.is_empty() || !thought.is_empty() || called;
        let new = match &c.token_ids {
            Some(n) => n.len() as u32,
            None => u32::from(generated),
        };
        if let Some(n) = &c.token_ids {
            self.has_ids = true;
            self.ids.extend_from_slice(n);
        }
        if generated || new > 0 {
            self.chunks += 1;
        }
        self.text.push_str(&piece);
        self.reasoning.push_str(&thought);
        if let Some(f) = c.finish_reason {
            self.finish = Some(f.into_owned());
        }
        Ok(Some(new))
    }

    /// Bytes of output held (text, reasoning, calls, ids), which the reader caps.
    fn retained(&self) -> usize {
        self.text.len() + self.reasoning.len() + self.calls.retained() + self.ids.len() * 4
    }

    /// The generation, once the stream has ended (`done`: with `[DONE]`).
    fn finish(self, done: bool, ttft_ms: Option<u32>) -> Result<Generation, UpstreamError> {
        if !done {
            return Err(UpstreamError::StreamCut(
                "stream ended without [DONE]".into(),
            ));
        }
        let Some(finish_reason) = self.finish else {
            return Err(UpstreamError::StreamCut(
                "stream ended without a finish_reason".into(),
            ));
        };
        Ok(Generation {
            prompt_token_ids: self.prompt_token_ids,
            text: self.text,
            token_ids: self.has_ids.then_some(self.ids),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            finish_reason,
            ttft_ms,
            latency_ms: 0,
            chunks: self.chunks,
            reasoning: (!self.reasoning.is_empty()).then_some(self.reasoning),
            tool_calls: self.calls.finish()?,
        })
    }
}

pub(super) async fn read_stream(
    r: &mut sse::Reader,
    chat: bool,
    sink: TokenSink<'_>,
) -> Result<Generation, UpstreamError> {
    let mut st = StreamState::default();
    let mut done = false;
    while let Some(data) = r.next_event().await? {
        let Some(new) = st.push(&data, chat)? else {
            done = true;
            break;
        };
        r.check_retained(st.retained())?;
        if new > 0 {
            r.mark_first_token();
            sink(new);
        }
    }
    st.finish(done, r.ttft_ms)
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
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"top_k":20,"min_p":0.05,"seed":7,"stop":["</s>","\n\n"],"stream":false,"return_token_ids":true,"return_prompt_token_ids":true,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi \"you\""}]}"#
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
        assert_eq!(g.prompt_token_ids, None);
    }

    /// A chat answer's prompt ids are read where vLLM puts them (the top level, the first
    /// chunk of a stream) and where SGLang does (the choice); completions answers' are
    /// not taken (spool sent those ids itself).
    #[test]
    fn chat_prompt_ids_are_read_in_both_servers_shapes() {
        let vllm = br#"{"choices":[{"index":0,"message":{"content":"yo"},"finish_reason":"stop","token_ids":[9]}],"prompt_token_ids":[1,2,3]}"#;
        assert_eq!(
            parse_full(vllm, true).unwrap().prompt_token_ids,
            Some(vec![1, 2, 3])
        );
        let sglang = br#"{"choices":[{"index":0,"message":{"content":"yo"},"finish_reason":"stop","prompt_token_ids":[4,5]}]}"#;
        assert_eq!(
            parse_full(sglang, true).unwrap().prompt_token_ids,
            Some(vec![4, 5])
        );
        let completion = br#"{"choices":[{"index":0,"text":"yo","finish_reason":"stop","prompt_token_ids":[4,5]}]}"#;
        assert_eq!(
            parse_full(completion, false).unwrap().prompt_token_ids,
            None
        );
        let mut st = StreamState::default();
        for e in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[7,8]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[1]}],"prompt_token_ids":null}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[2],"finish_reason":"stop"}]}"#,
        ] {
            st.push(e, true).unwrap();
        }
        let g = st.finish(true, None).unwrap();
        assert_eq!(
            (g.prompt_token_ids, g.text.as_str()),
            (Some(vec![7, 8]), "ab")
        );
    }
}

#[cfg(test)]
mod reasoning_and_tools_tests {
    use super::*;
    use crate::config::Sampling;
    use serde_json::json;

    /// A stream fed event by event: the generation, the tokens the sink saw, and the
    /// largest retained size reported.
    fn stream(events: &[Value], chat: bool) -> Result<(Generation, u32, usize), UpstreamError> {
        let mut st = StreamState::default();
        let (mut tokens, mut held) = (0, 0);
        let mut done = false;
        for e in events.iter().map(Value::to_string).chain(["[DONE]".into()]) {
            match st.push(&e, chat)? {
                Some(n) => tokens += n,
                None => {
                    done = true;
                    break;
                }
            }
            held = held.max(st.retained());
        }
        Ok((st.finish(done, None)?, tokens, held))
    }

    fn delta(d: Value, fin: Option<&str>) -> Value {
        json!({"choices": [{"index": 0, "delta": d, "finish_reason": fin}]})
    }

    /// A whole chat answer's reasoning comes from `reasoning_content`, else from vLLM's
    /// `reasoning`; with both, `reasoning_content`; `null` and `""` are none. `content`
    /// stays the visible answer.
    #[test]
    fn reasoning_is_read_from_whole_answers_in_both_spellings() {
        let whole = |m: Value| {
            let body = json!({"choices": [{"index": 0, "message": m, "finish_reason": "stop"}]});
            parse_full(body.to_string().as_bytes(), true).unwrap()
        };
        let g = whole(json!({"role": "assistant", "content": "42", "reasoning_content": "6 x 7"}));
        assert_eq!(
            (g.text.as_str(), g.reasoning.as_deref()),
            ("42", Some("6 x 7"))
        );
        let g = whole(json!({"content": "42", "reasoning": "six sevens"}));
        assert_eq!(g.reasoning.as_deref(), Some("six sevens"));
        let g = whole(json!({"content": "42", "reasoning_content": "a", "reasoning": "b"}));
        assert_eq!(g.reasoning.as_deref(), Some("a"));
        let g = whole(json!({"content": "42", "reasoning_content": "", "reasoning": "b"}));
        assert_eq!(g.reasoning.as_deref(), Some("b"));
        for m in [
            json!({"content": "42", "reasoning_content": null}),
            json!({"content": "42", "reasoning_content": "", "reasoning": null}),
            json!({"content": "42"}),
        ] {
            assert_eq!(whole(m.clone()).reasoning, None, "{m}");
        }
        // Only thinking (cut by max_tokens): no content at all is an empty answer.
        let g = whole(json!({"role": "assistant", "reasoning_content": "hmm"}));
        assert_eq!((g.text.as_str(), g.reasoning.as_deref()), ("", Some("hmm")));
        // Completions have no reasoning field: the raw text keeps the thinking.
        let c = br#"{"choices":[{"text":"<think>x</think>y","reasoning_content":"z","finish_reason":"stop"}]}"#;
        let g = parse_full(c, false).unwrap();
        assert_eq!((g.text.as_str(), g.reasoning), ("<think>x</think>y", None));
    }

    /// A stream's reasoning deltas are concatenated in order, whichever spelling each
    /// event uses (one event with both is read once); each reasoning event counts as a
    /// generated token for the sink and the chunks; the text is the content only.
    #[test]
    fn reasoning_is_concatenated_from_stream_deltas_in_both_spellings() {
        let events = [
            delta(json!({"role": "assistant", "content": ""}), None),
            delta(json!({"reasoning_content": "Let"}), None),
            delta(json!({"reasoning": " me"}), None),
            delta(
                json!({"reasoning_content": " think", "reasoning": " think"}),
                None,
            ),
            delta(json!({"reasoning_content": null, "content": "Yes"}), None),
            delta(json!({"content": "."}), Some("stop")),
        ];
        let (g, tokens, held) = stream(&events, true).unwrap();
        assert_eq!(g.text, "Yes.");
        assert_eq!(g.reasoning.as_deref(), Some("Let me think"));
        assert_eq!((tokens, g.chunks), (5, 5));
        assert!(held >= "Let me thinkYes.".len(), "{held}");
        // Ids, when sent, are the count (reasoning tokens included).
        let with_ids = [
            json!({"choices": [{"delta": {"reasoning_content": "ab"}, "token_ids": [1, 2]}]}),
            json!({"choices": [{"delta": {"content": "c"}, "token_ids": [3], "finish_reason": "length"}]}),
        ];
        let (g, tokens, _) = stream(&with_ids, true).unwrap();
        assert_eq!((g.token_ids, tokens), (Some(vec![1, 2, 3]), 3));
        let (g, _, _) = stream(&[delta(json!({"content": "x"}), Some("stop"))], true).unwrap();
        assert_eq!(g.reasoning, None);
    }

    /// A whole answer that is only tool calls (`content` null) gives an empty text, the
    /// calls in the one shape and `finish_reason` `tool_calls` as sent; vLLM's `[]` on a
    /// plain answer is no calls.
    #[test]
    fn tool_calls_are_read_from_whole_answers() {
        let body = json!({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null, "reasoning_content": "need weather",
            "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}}]});
        let g = parse_full(body.to_string().as_bytes(), true).unwrap();
        assert_eq!(
            (g.text.as_str(), g.finish_reason.as_str()),
            ("", "tool_calls")
        );
        assert_eq!(g.reasoning.as_deref(), Some("need weather"));
        assert_eq!(
            g.tool_calls,
            Some(json!([{"id": "chatcmpl-tool-1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]))
        );
        let plain =
            br#"{"choices":[{"message":{"content":"hi","tool_calls":[]},"finish_reason":"stop"}]}"#;
        assert_eq!(parse_full(plain, true).unwrap().tool_calls, None);
        // Only calls, `content` left out altogether.
        let bare = br#"{"choices":[{"message":{"tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#;
        assert_eq!(parse_full(bare, true).unwrap().text, "");
        // Neither content nor any output is still no answer.
        let empty = br#"{"choices":[{"message":{"role":"assistant"},"finish_reason":"stop"}]}"#;
        assert!(matches!(
            parse_full(empty, true),
            Err(UpstreamError::Malformed(_))
        ));
    }

    /// Two tool calls streamed in fragments across events, interleaved by `index`, are
    /// assembled in index order; each fragment counts as a generated token.
    #[test]
    fn tool_calls_are_assembled_from_stream_fragments() {
        let tc = |v: Value| delta(json!({"tool_calls": v}), None);
        let events = [
            delta(json!({"role": "assistant", "content": null}), None),
            tc(
                json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
            ),
            tc(json!([{"index": 0, "function": {"arguments": "{\"city\":"}}])),
            tc(
                json!([{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\""}}]),
            ),
            tc(json!([{"index": 0, "function": {"arguments": " \"Paris\"}"}}])),
            tc(json!([{"index": 1, "function": {"arguments": ": \"CET\"}"}}])),
            delta(json!({}), Some("tool_calls")),
        ];
        let (g, tokens, held) = stream(&events, true).unwrap();
        assert_eq!(
            (g.text.as_str(), g.finish_reason.as_str()),
            ("", "tool_calls")
        );
        assert_eq!(tokens, 5);
        assert!(
            held >= "{\"city\": \"Paris\"}{\"tz\": \"CET\"}".len(),
            "{held}"
        );
        assert_eq!(
            g.tool_calls,
            Some(json!([
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}},
            ]))
        );
    }

    /// A reasoning or tool-call field of the wrong JSON type, whole or streamed, is a
    /// malformed (retriable) answer whose message names the field.
    #[test]
    fn wrong_types_are_malformed_naming_the_field() {
        let whole = |m: Value| {
            let body = json!({"choices": [{"message": m, "finish_reason": "stop"}]});
            parse_full(body.to_string().as_bytes(), true).unwrap_err()
        };
        let streamed = |d: Value| stream(&[delta(d, Some("stop"))], true).unwrap_err();
        let cases = [
            (
                json!({"content": "x", "reasoning_content": 5}),
                "reasoning_content",
            ),
            (json!({"content": "x", "reasoning": ["a"]}), "reasoning"),
            (
                json!({"content": "x", "reasoning_content": {"t": 1}}),
                "reasoning_content",
            ),
        ];
        for (m, field) in &cases {
            for (e, what) in [
                (whole(m.clone()), "completion body"),
                (streamed(m.clone()), "stream chunk"),
            ] {
                assert!(
                    matches!(&e, UpstreamError::Malformed(msg) if msg.starts_with(what) && msg.contains(&format!("`{field}`"))),
                    "{m}: {e}"
                );
                assert!(e.is_retriable(), "{e}");
            }
        }
        let e = whole(json!({"content": null, "tool_calls": [{"function": {"name": 5}}]}));
        assert!(
            matches!(&e, UpstreamError::Malformed(m) if m.starts_with("completion body") && m.contains("`message.tool_calls[0].function.name`")),
            "{e}"
        );
        let e = streamed(
            json!({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": 1}}]}),
        );
        assert!(
            matches!(&e, UpstreamError::Malformed(m) if m.starts_with("stream chunk") && m.contains("`delta.tool_calls[0].function.arguments`")),
            "{e}"
        );
    }

    /// Chat bodies with `tools` and `chat_template_kwargs` pinned byte for byte (after
    /// `messages`); an empty kwargs map or tools list is left out; `/v1/completions`
    /// never sends either (its prompt is rendered with them already).
    #[test]
    fn chat_bodies_with_tools_and_kwargs_are_pinned_byte_for_byte() {
        let sampling = Sampling {
            max_tokens: 64,
            temperature: 0.7,
            top_p: 1.0,
            top_k: None,
            min_p: None,
            seed: None,
            stop: None,
        };
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let kwargs: serde_json::Map<String, Value> =
            serde_json::from_str(r#"{"enable_thinking":false,"reasoning_effort":"high"}"#).unwrap();
        let (empty_tools, empty_kwargs) = (json!([]), serde_json::Map::new());
        let req = |tools, kwargs| GenerateRequest {
            rid: "r1",
            prompt: "hi",
            prompt_ids: None,
            messages: None,
            sampling: &sampling,
            tools,
            chat_template_kwargs: kwargs,
        };
        let body = |r: &GenerateRequest<'_>, stream, chat| {
            serde_json::to_string(&request_body(r, "m", stream, chat)).unwrap()
        };
        assert_eq!(
            body(&req(Some(&tools), Some(&kwargs)), false, true),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":false,"return_token_ids":true,"return_prompt_token_ids":true,"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"chat_template_kwargs":{"enable_thinking":false,"reasoning_effort":"high"}}"#
        );
        assert_eq!(
            body(&req(None, Some(&kwargs)), true, true),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false,"reasoning_effort":"high"}}"#
        );
        let plain = r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":false,"return_token_ids":true,"return_prompt_token_ids":true,"messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            body(&req(Some(&empty_tools), Some(&empty_kwargs)), false, true),
            plain
        );
        assert_eq!(body(&req(Some(&Value::Null), None), false, true), plain);
        assert_eq!(
            body(&req(Some(&tools), Some(&kwargs)), false, false),
            r#"{"model":"m","max_tokens":64,"temperature":0.7,"top_p":1.0,"stream":false,"return_token_ids":true,"prompt":"hi"}"#
        );
    }

    /// The self-check reads a reasoning model's thinking as output when there is no
    /// content (its few tokens are all thinking).
    #[test]
    fn self_check_counts_reasoning_as_output() {
        let e = json!({"choices": [{"message": {"content": null, "reasoning_content": "Okay"}}]});
        assert_eq!(CHAT.check_event(&e).text, "Okay");
        let e = json!({"choices": [{"delta": {"reasoning": "Hm"}}]});
        assert_eq!(CHAT.check_event(&e).text, "Hm");
        let e = json!({"choices": [{"message": {"content": "Hi", "reasoning_content": "x"}}]});
        assert_eq!(CHAT.check_event(&e).text, "Hi");
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
