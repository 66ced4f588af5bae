//! Qwen3-Coder tool calls, as SGLang's `qwen3_coder` detector reads them:
//! `<tool_call><function=NAME><parameter=P>V</parameter>…</function></tool_call>`, each
//! value converted by its schema type.
//!
//! Invariant: every call is kept (SGLang does not filter by the tools offered), its
//! arguments in Python's `json.dumps` text; the answer is the text before the first call.

use super::values::{
    dumps, float_value, infer_type, literal_eval, loads, py_float, py_int, schema_properties,
};
use super::ParsedCall;
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

pub const OPEN: &str = "<tool_call>";

static BLOCK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<tool_call>(.*?)</tool_call>").expect("a valid pattern"));
static FUNCTION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<function=(.*?)</function>|<function=(.*)\z").expect("a valid pattern")
});

/// (answer, calls) when the text holds `<tool_call>`.
pub fn split_calls(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    if !text.contains(OPEN) {
        return None;
    }
    let mut blocks: Vec<&str> = BLOCK
        .captures_iter(text)
        .filter_map(|c| c.get(1).map(|g| g.as_str()))
        .collect();
    if blocks.is_empty() && text.contains("<function=") {
        blocks.push(text);
    }
    let mut calls = Vec::new();
    for content in blocks {
        for f in FUNCTION.captures_iter(content) {
            let body = f.get(1).or(f.get(2)).map_or("", |g| g.as_str());
            let Some(end) = body.find('>') else {
                continue;
            };
            let name = &body[..end];
            let config = arguments_config(name, tools);
            let mut params = Map::new();
            for p in parameters(&body[end + 1..]) {
                let Some(i) = p.find('>') else {
                    continue;
                };
                let mut v = &p[i + 1..];
                v = v.strip_prefix('\n').unwrap_or(v);
                v = v.strip_suffix('\n').unwrap_or(v);
                params.insert(p[..i].to_owned(), convert(v, &p[..i], &config));
            }
            calls.push(ParsedCall {
                id: None,
                name: name.to_owned(),
                arguments: dumps(&Value::Object(params)),
            });
        }
    }
    let start = text.find(OPEN).or_else(|| text.find("<function="));
    let normal = match start {
        Some(s) if s > 0 => text[..s].to_owned(),
        _ => String::new(),
    };
    Some((normal, calls))
}

/// The captures of `<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)`:
/// each parameter runs to the nearest of those ends.
fn parameters(s: &str) -> Vec<&str> {
    const P: &str = "<parameter=";
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(rel) = s[at..].find(P) {
        let start = at + rel + P.len();
        let rest = &s[start..];
        let eos = if s.ends_with('\n') {
            s.len() - 1
        } else {
            s.len()
        };
        let mut end = eos.max(start);
        let mut consumed = end;
        for (marker, eat) in [("</parameter>", true), (P, false), ("</function>", false)] {
            if let Some(i) = rest.find(marker) {
                let pos = start + i;
                if pos < end || (pos == end && eat) {
                    end = pos;
                    consumed = if eat { pos + marker.len() } else { pos };
                }
            }
        }
        if eos < start {
            end = s.len();
            consumed = end;
        }
        out.push(&s[start..end]);
        at = consumed;
    }
    out
}

/// `_get_arguments_config`: the parameter schemas of tool `name`.
fn arguments_config(name: &str, tools: &[Value]) -> Map<String, Value> {
    for t in tools {
        let Some(f) = t.get("function") else { continue };
        if t.get("type").and_then(Value::as_str) != Some("function")
            || f.get("name").and_then(Value::as_str) != Some(name)
        {
            continue;
        }
        return match f.get("parameters") {
            Some(params @ Value::Object(o)) => {
                let props = schema_properties(params);
                if !props.is_empty() || o.contains_key("properties") {
                    props
                } else {
                    o.clone()
                }
            }
            _ => Map::new(),
        };
    }
    Map::new()
}

/// `_convert_param_value`.
fn convert(value: &str, name: &str, config: &Map<String, Value>) -> Value {
    if value.to_lowercase() == "null" {
        return Value::Null;
    }
    let Some(schema) = config.get(name) else {
        return Value::String(value.to_owned());
    };
    let ty = infer_type(schema)
        .map(|t| t.trim().to_lowercase())
        .unwrap_or_else(|| "string".into());
    let text = || Value::String(value.to_owned());
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return text();
    }
    if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| ty.starts_with(p))
    {
        return py_int(value).map_or_else(text, Value::from);
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        let keep_float = value.contains('.') || value.to_lowercase().contains('e');
        return match py_float(value) {
            Some(f) if !keep_float && f.fract() == 0.0 && f.abs() < 9.2e18 => Value::from(f as i64),
            Some(f) => float_value(f).unwrap_or_else(text),
            None => text(),
        };
    }
    if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        return Value::Bool(value.to_lowercase() == "true");
    }
    if ["object", "array", "arr"].contains(&ty.as_str())
        || ty.starts_with("dict")
        || ty.starts_with("list")
    {
        if let Some(v) = loads(value) {
            return v;
        }
    }
    literal_eval(value).unwrap_or_else(text)
}
