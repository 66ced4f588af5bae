//! SGLang's native `/generate`.
//!
//! SGLang streams *cumulative* `text`/`output_ids` by default and *deltas* when started with
//! `--incremental-streaming-output`. The shape is detected per event from
//! `meta_info.completion_tokens` (always cumulative) so tokens are never double counted.
//! `finish_reason` is an object such as `{"type": "length", "length": 128}`.
//!
//! The body never carries `tools` or `chat_template_kwargs`: the prompt was rendered by
//! spool's template with them already. The answer's text is raw (any thinking stays in
//! it), so a `Generation` from here has no `reasoning` or `tool_calls` of its own.

use super::dialect::{stream_error, to_json, Dialect, Seen};
use super::{sse, GenerateRequest, Generation, TokenSink, UpstreamError};
use crate::config::Sampling;
use futures_util::future::BoxFuture;
use serde_json::{json, Value};

/// SGLang's `/generate` dialect.
pub(super) struct Sglang;

impl Dialect for Sglang {
    fn path(&self) -> &'static str {
        "/generate"
    }

    fn health_path(&self) -> &'static str {
        "/health"
    }

    fn body(
        &self,
        req: &GenerateRequest<'_>,
        _model: &str,
        stream: bool,
    ) -> Result<Vec<u8>, UpstreamError> {
        to_json(&body(req, stream))
    }

    fn parse_whole(&self, body: &[u8]) -> Result<Generation, UpstreamError> {
        parse_full(body)
    }

    fn read_stream<'a>(
        &'a self,
        r: &'a mut sse::Reader,
        sink: TokenSink<'a>,
    ) -> BoxFuture<'a, Result<Generation, UpstreamError>> {
        Box::pin(read_stream(r, sink))
    }

    /// SGLang keeps generating after the connection drops; `/abort_request` stops it.
    fn abort(&self, rid: &str) -> Option<(&'static str, Value)> {
        Some(("/abort_request", json!({ "rid": rid })))
    }

    fn check_body(
        &self,
        _model: &str,
        stream: bool,
        prompt_ids: Option<&[u32]>,
        max_tokens: u32,
        rid: &str,
    ) -> Value {
        let mut b = json!({
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": true},
            "stream": stream,
        });
        match prompt_ids {
            Some(ids) => b["input_ids"] = json!(ids),
            None => b["text"] = json!("Hello"),
        }
        b["rid"] = json!(rid);
        b
    }

    fn check_event(&self, e: &Value) -> Seen {
        let meta = e.get("meta_info");
        Seen {
            ids: e.get("output_ids").and_then(Value::as_array).map(Vec::len),
            count: meta
                .and_then(|m| m.get("completion_tokens"))
                .and_then(Value::as_u64),
            text: e
                .get("text")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            usage: false,
        }
    }

    /// Cumulative by default, deltas with `--incremental-streaming-output`.
    fn streams_deltas_only(&self) -> bool {
        false
    }
}

/// The request body: the prompt's ids when known, else its text; SGLang's names for the
/// sampling fields (`max_new_tokens`, `sampling_seed`).
pub(super) fn body(req: &GenerateRequest<'_>, stream: bool) -> Value {
    let mut sp = serde_json::Map::new();
    sp.insert("max_new_tokens".into(), json!(req.sampling.max_tokens));
    sampling_fields(req.sampling, &mut sp);
    if let Some(stop) = sp.remove("seed") {
        sp.insert("sampling_seed".into(), stop);
    }
    let mut b = serde_json::Map::new();
    match req.prompt_ids {
        Some(ids) => b.insert("input_ids".into(), json!(ids)),
        None => b.insert("text".into(), json!(req.prompt)),
    };
    b.insert("sampling_params".into(), Value::Object(sp));
    b.insert("stream".into(), json!(stream));
    b.insert("rid".into(), json!(req.rid));
    Value::Object(b)
}

fn finish_reason(meta: &Value) -> Option<String> {
    let fr = meta.get("finish_reason")?;
    match fr {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => Some(
            o.get("type")
                .and_then(|t| t.as_str())
                .unwrap_or("unknown")
                .to_string(),
        ),
        other => Some(other.to_string()),
    }
}

pub(super) fn parse_full(bytes: &[u8]) -> Result<Generation, UpstreamError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| UpstreamError::Malformed(format!("/generate body: {e}")))?;
    // A batch answer is a list; we send one prompt.
    let v = match v {
        Value::Array(mut a) if a.len() == 1 => a.remove(0),
        v => v,
    };
    let text = v
        .get("text")
        .and_then(|t| t.as_str())
        .ok_or_else(|| UpstreamError::Malformed("/generate body has no `text`".into()))?
        .to_string();
    let meta = v.get("meta_info").cloned().unwrap_or(Value::Null);
    let ids = as_ids("output_ids", v.get("output_ids"))?;
    Ok(Generation {
        text,
        token_ids: ids,
        prompt_tokens: as_u32("prompt_tokens", meta.get("prompt_tokens"))?,
        completion_tokens: as_u32("completion_tokens", meta.get("completion_tokens"))?,
        finish_reason: finish_reason(&meta).unwrap_or_else(|| "unknown".into()),
        ttft_ms: None,
        latency_ms: 0,
        chunks: 1,
        reasoning: None,
        tool_calls: None,
        prompt_token_ids: None,
    })
}

/// Accumulates a `/generate` stream whichever shape the server sends.
#[derive(Default)]
pub(super) struct StreamState {
    text: String,
    ids: Vec<u32>,
    has_ids: bool,
    counted: u32,
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    finish: Option<String>,
    chunks: u32,
    /// Decided on the first event that can tell: `Some(true)` = cumulative.
    cumulative: Option<bool>,
}

impl StreamState {
    /// Folds one event in; returns how many new tokens it brought.
    pub(super) fn push(&mut self, v: &Value) -> Result<u32, UpstreamError> {
        let meta = v.get("meta_info").cloned().unwrap_or(Value::Null);
        let text = v.get("text").and_then(|t| t.as_str()).unwrap_or("");
        let ids = as_ids("output_ids", v.get("output_ids"))?;
        let count = as_u32("completion_tokens", meta.get("completion_tokens"))?;
        let n_new = ids.as_ref().map(|i| i.len() as u32);
        if self.cumulative.is_none() {
            self.cumulative = match (count, n_new) {
                // Deltas: what we have plus this event's ids equals the running count.
                (Some(c), Some(n)) if self.ids.len() as u32 + n == c && !self.ids.is_empty() => {
                    Some(false)
                }
                (Some(c), Some(n)) if n == c && !self.ids.is_empty() => Some(true),
                (Some(_), Some(_)) if self.ids.is_empty() => None, // first event is ambiguous
                _ => None,
            };
            if self.cumulative.is_none() && !self.text.is_empty() && !text.is_empty() {
                // No ids/counts: text that repeats what we have is cumulative.
                self.cumulative = Some(text.starts_with(self.text.as_str()));
            }
        }
        let cumulative =
            self.cumulative.unwrap_or(false) || self.ids.is_empty() && self.text.is_empty();
        if let Some(ids) = ids {
            self.has_ids = true;
            if cumulative {
                self.ids = ids;
            } else {
                self.ids.extend_from_slice(&ids);
            }
        }
        if cumulative {
            self.text = text.to_string();
        } else {
            self.text.push_str(text);
        }
        if !text.is_empty() || n_new.unwrap_or(0) > 0 {
            self.chunks += 1;
        }
        if let Some(p) = as_u32("prompt_tokens", meta.get("prompt_tokens"))? {
            self.prompt_tokens = Some(p);
        }
        if count.is_some() {
            self.completion_tokens = count;
        }
        if let Some(f) = finish_reason(&meta) {
            self.finish = Some(f);
        }
        let now = self.completion_tokens.unwrap_or(if self.has_ids {
            self.ids.len() as u32
        } else {
            self.chunks
        });
        let new = now.saturating_sub(self.counted);
        self.counted = self.counted.max(now);
        Ok(new)
    }

    fn finish(self, ttft_ms: Option<u32>) -> Result<Generation, UpstreamError> {
        let Some(finish_reason) = self.finish else {
            return Err(UpstreamError::StreamCut(
                "/generate stream ended without a finish_reason".into(),
            ));
        };
        if self.has_ids {
            if let Some(c) = self.completion_tokens {
                if c as usize != self.ids.len() {
                    return Err(UpstreamError::Malformed(format!(
                        "stream gave {} output ids but meta_info.completion_tokens = {c}",
                        self.ids.len()
                    )));
                }
            }
        }
        Ok(Generation {
            text: self.text,
            token_ids: self.has_ids.then_some(self.ids),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            finish_reason,
            ttft_ms,
            latency_ms: 0,
            chunks: self.chunks,
            reasoning: None,
            tool_calls: None,
            prompt_token_ids: None,
        })
    }
}

pub(super) async fn read_stream(
    r: &mut sse::Reader,
    sink: TokenSink<'_>,
) -> Result<Generation, UpstreamError> {
    let mut st = StreamState::default();
    let mut done = false;
    while let Some(data) = r.next_event().await? {
        if data.trim() == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(&data)
            .map_err(|e| UpstreamError::Malformed(format!("/generate event: {e}")))?;
        if let Some(err) = v.get("error") {
            return Err(stream_error(err));
        }
        let new = st.push(&v)?;
        r.check_retained(st.text.len() + st.ids.len() * 4)?;
        if new > 0 {
            r.mark_first_token();
            sink(new);
        }
    }
    if !done && st.finish.is_none() {
        return Err(UpstreamError::StreamCut(
            "/generate stream ended without [DONE]".into(),
        ));
    }
    st.finish(r.ttft_ms)
}

/// The sampling fields of `sampling_params` named as in the config (`seed` is renamed by
/// the caller); unset ones are left out.
fn sampling_fields(s: &Sampling, obj: &mut serde_json::Map<String, Value>) {
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

/// A count the server reported: absent or not a number is `None` (servers differ in what
/// they fill in); a number no token count can be (negative, fractional, past `u32`) is a
/// malformed answer rather than a value clamped or wrapped into a plausible one.
fn as_u32(field: &str, v: Option<&Value>) -> Result<Option<u32>, UpstreamError> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| UpstreamError::Malformed(format!("`{field}` is {n}, not a count"))),
        _ => Ok(None),
    }
}

/// Token ids the server reported: absent or not a list is `None`; a list holding anything
/// but ids that fit `u32` is a malformed answer, never truncated into other tokens.
fn as_ids(field: &str, v: Option<&Value>) -> Result<Option<Vec<u32>>, UpstreamError> {
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
    use super::*;

    fn ev(text: &str, ids: &[u32], count: u32, fin: Option<&str>) -> Value {
        json!({"text": text, "output_ids": ids, "meta_info": {"completion_tokens": count, "prompt_tokens": 3,
            "finish_reason": fin.map(|f| json!({"type": f, "length": count}))}})
    }

    /// An id past `u32` or a count no token count can be is a malformed answer, never
    /// wrapped or clamped into a plausible token.
    #[test]
    fn ids_and_counts_out_of_range_are_malformed_not_wrapped() {
        let wide =
            br#"{"text":"a","output_ids":[1,4294967301],"meta_info":{"completion_tokens":2}}"#;
        let e = parse_full(wide).unwrap_err();
        assert!(
            matches!(&e, UpstreamError::Malformed(m) if m.contains("output_ids") && m.contains("4294967301")),
            "{e}"
        );
        for bad in ["-1", "2.5", "4294967296"] {
            let body = format!(
                r#"{{"text":"a","output_ids":[1],"meta_info":{{"completion_tokens":{bad}}}}}"#
            );
            let e = parse_full(body.as_bytes()).unwrap_err();
            assert!(
                matches!(&e, UpstreamError::Malformed(m) if m.contains("completion_tokens")),
                "{bad}: {e}"
            );
            let mut s = StreamState::default();
            assert!(
                s.push(&serde_json::from_str(&body).unwrap()).is_err(),
                "{bad}"
            );
        }
        let mut s = StreamState::default();
        assert!(s.push(&ev(" a", &[1], 1, None)).is_ok());
        let g = parse_full(
            br#"{"text":"a","output_ids":[4294967295],"meta_info":{"completion_tokens":"n/a"}}"#,
        )
        .unwrap();
        assert_eq!(
            (g.token_ids, g.completion_tokens),
            (Some(vec![u32::MAX]), None)
        );
    }

    /// A cumulative stream (every event repeats the output so far) counts each token once
    /// and keeps the last text and ids.
    #[test]
    fn cumulative_stream_is_not_double_counted() {
        let mut s = StreamState::default();
        let mut total = 0;
        total += s.push(&ev(" a", &[1], 1, None)).unwrap();
        total += s.push(&ev(" a b c", &[1, 2, 3], 3, None)).unwrap();
        total += s
            .push(&ev(" a b c d", &[1, 2, 3, 4], 4, Some("length")))
            .unwrap();
        assert_eq!(total, 4);
        let g = s.finish(None).unwrap();
        assert_eq!(g.text, " a b c d");
        assert_eq!(g.token_ids.unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(g.finish_reason, "length");
    }

    /// A delta stream (`--incremental-streaming-output`) appends each event's text and ids.
    #[test]
    fn incremental_stream_accumulates() {
        let mut s = StreamState::default();
        let mut total = 0;
        total += s.push(&ev(" a", &[1], 1, None)).unwrap();
        total += s.push(&ev(" b c", &[2, 3], 3, None)).unwrap();
        total += s.push(&ev(" d", &[4], 4, Some("stop"))).unwrap();
        assert_eq!(total, 4);
        let g = s.finish(None).unwrap();
        assert_eq!(g.text, " a b c d");
        assert_eq!(g.token_ids.unwrap(), vec![1, 2, 3, 4]);
    }

    /// One-token events cannot tell the shapes apart until the running count does; the
    /// output is still read right.
    #[test]
    fn one_token_events_are_ambiguous_until_resolved() {
        // Incremental with single-token events: [1], then [2] with count 2 → deltas.
        let mut s = StreamState::default();
        s.push(&ev(" a", &[1], 1, None)).unwrap();
        s.push(&ev(" b", &[2], 2, Some("stop"))).unwrap();
        let g = s.finish(None).unwrap();
        assert_eq!(g.token_ids.unwrap(), vec![1, 2]);
        assert_eq!(g.text, " a b");
    }

    /// A stream that ends without a finish reason is a cut stream, not a generation.
    #[test]
    fn stream_without_finish_is_cut() {
        let mut s = StreamState::default();
        s.push(&ev(" a", &[1], 1, None)).unwrap();
        assert!(matches!(s.finish(None), Err(UpstreamError::StreamCut(_))));
    }
}
