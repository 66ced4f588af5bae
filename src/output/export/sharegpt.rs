//! `sharegpt`: JSONL, one line per generation,
//! `{"id", "dataset", "sample", "turn", "finish_reason", "conversations": [...input turns,
//! {"role": "assistant", "content", "reasoning_content"?}]}`.
//!
//! The input turns are the messages the generation was requested after (the row's
//! `messages`), or the prompt as one `user` turn.

use super::{Accounting, ExportRow, Jsonl, Sink};
use anyhow::{bail, Context, Result};
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
            _ => bail!("item `{}`: stored messages are not a JSON array", r.id),
        },
        None => vec![json!({"role": "user", "content": r.prompt})],
    })
}

/// The generated assistant turn: content, and `reasoning_content` / `tool_calls` when set.
pub fn assistant_turn(row: &ExportRow) -> Result<Value> {
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

/// One `sharegpt` line.
pub fn sharegpt_line(row: &ExportRow) -> Result<Value> {
    let r = &row.row;
    let mut turns = input_turns(row)?;
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
                {"role": "assistant", "content": "ans"}]})
        );
        let v = sharegpt_line(&row(None, "4", Some("2+2"))).unwrap();
        assert_eq!(
            v["conversations"],
            json!([{"role": "user", "content": "raw prompt"},
                {"role": "assistant", "content": "4", "reasoning_content": "2+2"}])
        );
        assert!(sharegpt_line(&row(Some("{"), "x", None)).is_err());
    }
}
