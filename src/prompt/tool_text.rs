//! Tool calls in raw text: templates in the Hermes style (Qwen2.5/Qwen3) have the model
//! write each call as `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`; a raw
//! completion from `/generate` or `/v1/completions` is split into its answer and the calls,
//! in OpenAI's `tool_calls` shape, as a server's tool-call parser would.
//!
//! Invariant: text is taken apart only when every block parses as a call; otherwise it is
//! left whole and no call is reported (the row keeps what the model wrote).

use super::ChatTemplate;
use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The tool-call syntax of a template whose model writes calls in its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolCallSyntax;

impl ToolCallSyntax {
    /// The syntax `template` teaches its model, if it is one this splits.
    pub fn of_template(template: &ChatTemplate) -> Option<ToolCallSyntax> {
        Self::of_source(template.source())
    }

    /// The syntax a template source teaches, if it is one this splits.
    pub fn of_source(source: &str) -> Option<ToolCallSyntax> {
        (source.contains(OPEN) && source.contains(CLOSE)).then_some(ToolCallSyntax)
    }

    /// (answer, calls) of a raw completion: the text outside the blocks (trailing
    /// whitespace trimmed) and the calls as an OpenAI `tool_calls` array; `(text, None)`
    /// when it has no block or a block is not a call.
    pub fn split(&self, text: &str) -> (String, Option<Value>) {
        let mut answer = String::new();
        let mut calls = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(OPEN) {
            let Some(len) = rest[start + OPEN.len()..].find(CLOSE) else {
                return (text.to_owned(), None);
            };
            let body = &rest[start + OPEN.len()..start + OPEN.len() + len];
            let Some(call) = parse_call(body, calls.len(), text) else {
                return (text.to_owned(), None);
            };
            calls.push(call);
            answer.push_str(&rest[..start]);
            rest = &rest[start + OPEN.len() + len + CLOSE.len()..];
        }
        if calls.is_empty() {
            return (text.to_owned(), None);
        }
        answer.push_str(rest);
        (answer.trim_end().to_owned(), Some(Value::Array(calls)))
    }
}

/// One block's call, with an id derived from the completion and its place (stable across
/// reads, unique within the reply).
fn parse_call(body: &str, k: usize, text: &str) -> Option<Value> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?;
    let arguments = match v.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    let h = twox_hash::XxHash64::oneshot(k as u64, text.as_bytes());
    Some(json!({
        "id": format!("call_{h:016x}"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_source() -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/qwen3/tokenizer_config.json");
        let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        v["chat_template"].as_str().unwrap().to_owned()
    }

    /// Qwen3's template teaches the syntax; a template without tool calls does not.
    #[test]
    fn the_syntax_is_found_in_qwen3s_template() {
        assert_eq!(
            ToolCallSyntax::of_source(&qwen3_source()),
            Some(ToolCallSyntax)
        );
        assert_eq!(ToolCallSyntax::of_source("{{ messages }}"), None);
    }

    /// Two calls are taken out of the text in order, in OpenAI's shape, arguments as JSON
    /// text, ids distinct and stable; the answer is the text around them.
    #[test]
    fn calls_are_split_off_in_order() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let (answer, calls) = ToolCallSyntax.split(text);
        assert_eq!(answer, "Let me look.");
        let calls = calls.expect("two calls");
        assert_eq!(calls[0]["function"]["name"], "search");
        assert_eq!(calls[0]["function"]["arguments"], "{\"q\":\"x\"}");
        assert_eq!(calls[1]["function"]["name"], "time");
        assert_eq!(calls[0]["type"], "function");
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        assert_eq!(ToolCallSyntax.split(text).1.unwrap(), calls);
    }

    /// Text without blocks, with an unclosed block or with a block that is not a call is
    /// left whole, with no call reported.
    #[test]
    fn anything_but_whole_calls_is_left_as_written() {
        for text in [
            "just an answer",
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}",
            "<tool_call>\nnot json\n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
        ] {
            assert_eq!(
                ToolCallSyntax.split(text),
                (text.to_owned(), None),
                "{text}"
            );
        }
    }
}
