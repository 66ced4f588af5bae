//! GLM-4.5 / 4.6 tool calls, as SGLang's `glm45` detector reads them:
//! `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…</tool_call>`, each
//! value typed by the tool's schema (`parse_arguments` and its fallbacks).
//!
//! Invariant: a value is typed exactly as SGLang types it (JSON first, then unescaped
//! JSON, then the raw text for strings, then a Python literal, then the text).

use super::deepseek::base_call;
use super::values::{
    dumps, float_value, infer_type, literal_eval, loads, py_strip, schema_properties,
    tool_parameters,
};
use super::ParsedCall;
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

pub const OPEN: &str = "<tool_call>";

static CALL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<tool_call>.*?</tool_call>").expect("a valid pattern"));
static DETAIL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<tool_call>(.*?)(?:\\n|\n)(.*)</tool_call>").expect("a valid pattern")
});
static ARG: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>")
        .expect("a valid pattern")
});

/// (answer, calls) when the text holds `<tool_call>`.
pub fn split_calls(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    let at = text.find(OPEN)?;
    let normal = py_strip(&text[..at]).to_owned();
    let mut calls = Vec::new();
    for m in CALL.find_iter(text) {
        let Some(d) = DETAIL.captures(m.as_str()) else {
            continue;
        };
        let name = &d[1];
        let props = tool_parameters(tools, name)
            .map(schema_properties)
            .unwrap_or_default();
        let mut args = Map::new();
        for pair in ARG.captures_iter(&d[2]) {
            let key = py_strip(&pair[1]).to_owned();
            let ty = props.get(&key).and_then(infer_type);
            args.insert(key, typed(&pair[2], ty.as_deref()));
        }
        calls.extend(base_call(name, &Value::Object(args), tools));
    }
    Some((normal, calls))
}

/// `_convert_to_number`.
fn to_number(s: &str) -> Value {
    let lower = s.to_lowercase();
    let parsed = if s.contains('.') || lower.contains('e') {
        super::values::py_float(s).and_then(float_value)
    } else {
        super::values::py_int(s).map(Value::from)
    };
    parsed.unwrap_or_else(|| Value::String(s.to_owned()))
}

/// `parse_arguments`: (value, is_valid_json).
fn parse_arguments(raw: &str, ty: Option<&str>) -> (Value, bool) {
    let settle = |v: Value| -> (Value, bool) {
        let v = match (&v, ty) {
            (Value::String(s), Some("number")) => to_number(s),
            _ => v,
        };
        (v, true)
    };
    if let Some(v) = loads(raw) {
        return settle(v);
    }
    let wrapped = format!("{{\"tmp\": \"{raw}\"}}");
    if let Some(Value::String(inner)) = loads(&wrapped).and_then(|w| w.get("tmp").cloned()) {
        if let Some(v) = loads(&inner) {
            return settle(v);
        }
    }
    if ty == Some("string") {
        let b = raw.as_bytes();
        if b.len() >= 2 && b[0] == b[b.len() - 1] && matches!(b[0], b'"' | b'\'') {
            return (Value::String(raw[1..raw.len() - 1].to_owned()), true);
        }
        return (Value::String(raw.to_owned()), true);
    }
    if let Some(v) = literal_eval(raw) {
        return (v, true);
    }
    (Value::String(raw.to_owned()), true)
}

/// Python's `str()` of a JSON scalar (`True`, `None`, `1.0`).
fn py_str(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::String(s) => s.clone(),
        other => dumps(other),
    }
}

/// `_parse_argument_pairs` for one value.
fn typed(raw: &str, ty: Option<&str>) -> Value {
    let (v, good) = parse_arguments(raw, ty);
    match ty {
        Some("string") => match v {
            Value::String(_) => v,
            Value::Object(_) | Value::Array(_) => Value::String(dumps(&v)),
            other => Value::String(py_str(&other)),
        },
        _ if good => v,
        _ => Value::String(raw.to_owned()),
    }
}
