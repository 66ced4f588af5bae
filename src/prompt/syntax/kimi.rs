//! Kimi K2 tool calls, as SGLang's `kimi_k2` detector reads them:
//! `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>…`.
//!
//! Invariant: the arguments are the JSON text the model wrote, unchanged, and the call's
//! id is the id it wrote (`functions.NAME:IDX`), so Kimi's template, which renders
//! `tool_call.id` back, re-renders the call as written; calls to tools not offered are
//! kept (SGLang does not filter them); a bare counter id (`3`) names the tool whose
//! parameters best match the arguments' keys, as SGLang infers it.

use super::values::{loads, schema_properties};
use super::ParsedCall;
use regex::Regex;
use serde_json::Value;
use std::collections::BTreeSet;
use std::sync::LazyLock;

pub const SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";

static CALL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>\{.*?\})\s*<\|tool_call_end\|>")
        .expect("a valid pattern")
});
static ID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\A(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)\z").expect("a valid pattern")
});

/// (answer, calls) when the text opens a tool-call section.
pub fn split_calls(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    let at = text.find(SECTION_BEGIN)?;
    let calls = CALL
        .captures_iter(text)
        .filter_map(|c| {
            let id = c.name("id")?.as_str();
            let args = c.name("args")?.as_str();
            let name = match ID.captures(id) {
                Some(m) => m.name("name")?.as_str().to_owned(),
                None if id.bytes().all(|b| b.is_ascii_digit()) => infer_name(tools, args)?,
                None => return None,
            };
            Some(ParsedCall {
                id: Some(id.to_owned()),
                name,
                arguments: args.to_owned(),
            })
        })
        .collect();
    Some((text[..at].to_owned(), calls))
}

/// `_infer_tool_name`: the only tool, else the one whose parameters best match the
/// arguments' keys (overlap less extra keys; the first best wins).
fn infer_name(tools: &[Value], args: &str) -> Option<String> {
    let name_of = |t: &Value| {
        t.get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    match tools {
        [] => return None,
        [only] => return name_of(only),
        _ => {}
    }
    let keys: BTreeSet<String> = loads(args)?.as_object()?.keys().cloned().collect();
    let mut best: Option<(i64, String)> = None;
    for t in tools {
        let params = t
            .get("function")
            .and_then(|f| f.get("parameters"))
            .cloned()
            .unwrap_or(Value::Null);
        let props: BTreeSet<String> = schema_properties(&params).keys().cloned().collect();
        if props.is_empty() {
            continue;
        }
        let score =
            keys.intersection(&props).count() as i64 - keys.difference(&props).count() as i64;
        if best.as_ref().is_none_or(|(s, _)| score > *s) {
            best = name_of(t).map(|n| (score, n));
        }
    }
    best.map(|(_, n)| n)
}
