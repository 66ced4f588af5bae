//! `sharegpt`: JSONL, one line per generation,
//! `{"id", "dataset", "sample", "turn", "finish_reason", "tools", "conversations": [...input
//! turns, {"role": "assistant", "content", "reasoning_content"?, "tool_calls"}]}`.
//!
//! The input turns are the messages the generation was requested after (the row's
//! `messages`), or the prompt as one `user` turn.
//!
//! Invariant, for every chat-shaped JSONL form (this one and `specforge-chat`): `tools` is a
//! JSON string on every line (`"[]"` when the row had none) and every assistant message has
//! `tool_calls` as a JSON string (`"[]"` when it made none) — what SpecForge's own loader
//! (`safe_conversations_generator`) makes of them. HuggingFace `datasets` fixes a JSON
//! file's schema from its first 10 MB: a key or a nested shape that first appears later
//! fails the whole load, a string that is always there does not.

use super::{Accounting, ExportRow, Jsonl, Sink};
use crate::output::export::error::{Context, ExportError, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The `sharegpt` writer.
pub struct ShareGptSink {
    out: Jsonl,
}

impl ShareGptSink {
    pub fn create(path: &Path) -> Result<Self> {
        Ok(Self {
            out: Jsonl::create(path)?,
        })
    }
}

impl Sink for ShareGptSink {
    fn push(&mut self, row: &ExportRow) -> Result<()> {
        let mut line = sharegpt_line(row)?;
        line["finish_reason"] = json!(row.row.finish_reason);
        line["tools"] = json!(tools_string(row)?);
        self.out.line(&line)
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        self.out.finish()
    }
}

/// The input turns of a row: its stored messages, or its prompt as one user turn.
pub fn input_turns(row: &ExportRow) -> Result<Vec<Value>> {
    let r = &row.row;
    Ok(match &r.messages {
        Some(m) => match serde_json::from_str::<Value>(m)
            .with_context(|| format!("item `{}`: stored messages are not JSON", r.id))?
        {
            Value::Array(a) => a,
            _ => {
                return Err(ExportError::broken(format!(
                    "item `{}`: stored messages are not a JSON array",
                    r.id
                )))
            }
        },
        None => vec![json!({"role": "user", "content": r.prompt})],
    })
}

/// The input turns as the chat forms write them: every assistant message's `tool_calls`
/// as a JSON string (module invariant).
pub fn chat_turns(row: &ExportRow) -> Result<Vec<Value>> {
    Ok(input_turns(row)?.into_iter().map(chat_message).collect())
}

/// A message as the chat forms write it: an assistant's `tool_calls` as JSON text, `"[]"`
/// when it has none; other messages as they are.
pub fn chat_message(mut m: Value) -> Value {
    if m["role"] != "assistant" {
        return m;
    }
    if let Some(o) = m.as_object_mut() {
        let calls = match o.remove("tool_calls") {
            None | Some(Value::Null) => "[]".to_string(),
            Some(Value::String(s)) => s,
            Some(v) => v.to_string(),
        };
        o.insert("tool_calls".into(), Value::String(calls));
    }
    m
}

/// The row's tools as the chat forms write them: the stored JSON array as text, `"[]"`
/// when it had none; stored tools that are not JSON are an error naming the item.
pub fn tools_string(row: &ExportRow) -> Result<String> {
    let r = &row.row;
    match &r.tools {
        None => Ok("[]".into()),
        Some(t) => {
            serde_json::from_str::<Value>(t)
                .with_context(|| format!("item `{}`: stored tools are not JSON", r.id))?;
            Ok(t.clone())
        }
    }
}

/// The generated assistant turn as OpenAI's API answers it: content, and
/// `reasoning_content` / `tool_calls` (objects) when set.
pub fn openai_assistant(row: &ExportRow) -> Result<Value> {
    let r = &row.row;
    let mut assistant = json!({"role": "assistant", "content": r.completion});
    if let Some(t) = &r.reasoning {
        assistant["reasoning_content"] = json!(t);
    }
    if let Some(t) = &r.tool_calls {
        let calls: Value = serde_json::from_str(t)
            .with_context(|| format!("item `{}`: stored tool_calls are not JSON", r.id))?;
        assistant["tool_calls"] = calls;
    }
    Ok(assistant)
}

/// The generated assistant turn: content, `reasoning_content` when set, and `tool_calls`
/// as JSON text (`"[]"` when none).
pub fn assistant_turn(row: &ExportRow) -> Result<Value> {
    let r = &row.row;
    let mut assistant = json!({"role": "assistant", "content": r.completion});
    if let Some(t) = &r.reasoning {
        assistant["reasoning_content"] = json!(t);
    }
    let calls = match &r.tool_calls {
        Some(t) => {
            serde_json::from_str::<Value>(t)
                .with_context(|| format!("item `{}`: stored tool_calls are not JSON", r.id))?;
            t.clone()
        }
        None => "[]".into(),
    };
    assistant["tool_calls"] = json!(calls);
    Ok(assistant)
}

/// One `sharegpt` line.
pub fn sharegpt_line(row: &ExportRow) -> Result<Value> {
    let r = &row.row;
    let mut turns = chat_turns(row)?;
    turns.push(assistant_turn(row)?);
    Ok(
        json!({"id": r.id, "dataset": r.dataset, "sample": r.sample, "turn": r.turn,
        "conversations": turns}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    fn row(messages: Option<&str>, completion: &str, reasoning: Option<&str>) -> ExportRow {
        prepare(
            ShardRow {
                id: "a".into(),
                dataset: "d".into(),
                prompt: "raw prompt".into(),
                messages: messages.map(Into::into),
                completion: completion.into(),
                reasoning: reasoning.map(Into::into),
                sample: 2,
                turn: 1,
                ..ShardRow::default()
            },
            "".into(),
            None,
        )
    }

    /// A line is the stored input turns (or the prompt as one user turn) plus the
    /// completion as the assistant turn, with its reasoning as `reasoning_content`;
    /// messages that are not JSON are an error.
    #[test]
    fn sharegpt_lines_append_the_completion() {
        let m = r#"[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]"#;
        let v = sharegpt_line(&row(Some(m), "ans", None)).unwrap();
        assert_eq!(
            v,
            json!({"id": "a", "dataset": "d", "sample": 2, "turn": 1, "conversations": [
                {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "ans", "tool_calls": "[]"}]})
        );
        let v = sharegpt_line(&row(None, "4", Some("2+2"))).unwrap();
        assert_eq!(
            v["conversations"],
            json!([{"role": "user", "content": "raw prompt"},
                {"role": "assistant", "content": "4", "reasoning_content": "2+2", "tool_calls": "[]"}])
        );
        assert!(sharegpt_line(&row(Some("{"), "x", None)).is_err());
    }
}
