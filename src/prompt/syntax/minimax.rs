//! MiniMax-M2 tool calls, as SGLang's `minimax-m2` detector reads them:
//! `<minimax:tool_call><invoke name="F"><parameter name="P">V</parameter>…</invoke></minimax:tool_call>`,
//! each value converted by the types its schema allows.
//!
//! Invariant: the answer is the text outside complete `<minimax:tool_call>` blocks, as
//! written; calls to tools not offered are dropped.

use super::deepseek::base_call;
use super::values::{float_value, loads, py_float, py_int, schema_properties, tool_parameters};
use super::ParsedCall;
use regex::Regex;
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::sync::LazyLock;

pub const OPEN: &str = "<minimax:tool_call>";
const CLOSE: &str = "</minimax:tool_call>";

static INVOKE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?s)<invoke name="(.*?)</invoke>|<invoke name="(.*)\z"#).expect("a valid pattern")
});
static PARAM: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?s)<parameter name="(.*?)</parameter>|<parameter name="(.*?)\n?\z"#)
        .expect("a valid pattern")
});

/// (answer, calls) when the text opens a tool-call block.
pub fn split_calls(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    if !text.contains(OPEN) {
        return None;
    }
    let mut normal = String::new();
    let mut calls = Vec::new();
    let mut cursor = 0;
    loop {
        let Some(s) = text[cursor..].find(OPEN).map(|s| cursor + s) else {
            normal.push_str(&text[cursor..]);
            break;
        };
        normal.push_str(&text[cursor..s]);
        let Some(e) = text[s..].find(CLOSE).map(|e| s + e) else {
            normal.push_str(&text[s..]);
            break;
        };
        cursor = e + CLOSE.len();
        calls.extend(block(&text[s..cursor], tools));
    }
    Some((normal, calls))
}

fn block(block: &str, tools: &[Value]) -> Vec<ParsedCall> {
    let mut out = Vec::new();
    for m in INVOKE.captures_iter(block) {
        let txt = m.get(1).or(m.get(2)).map_or("", |g| g.as_str());
        let Some(idx) = txt.find("\">") else {
            continue;
        };
        let name = txt[..idx].trim();
        let body = &txt[idx + 2..];
        let props = tool_parameters(tools, name)
            .filter(|p| p.is_object())
            .map(schema_properties)
            .unwrap_or_default();
        let mut params = Map::new();
        for pm in PARAM.captures_iter(body) {
            let ptxt = pm.get(1).or(pm.get(2)).map_or("", |g| g.as_str());
            let Some(pidx) = ptxt.find("\">") else {
                continue;
            };
            let pname = ptxt[..pidx].trim().to_owned();
            let pval = ptxt[pidx + 2..]
                .trim_start_matches('\n')
                .trim_end_matches('\n');
            let types = types_of(props.get(&pname));
            params.insert(pname, convert(pval, &types));
        }
        out.extend(base_call(name, &Value::Object(params), tools));
    }
    out
}

/// `_extract_types_from_schema` (strings when the schema says nothing).
fn types_of(schema: Option<&Value>) -> BTreeSet<String> {
    let mut types = BTreeSet::new();
    if let Some(Value::Object(s)) = schema {
        match s.get("type") {
            Some(Value::String(t)) => {
                types.insert(t.clone());
            }
            Some(Value::Array(ts)) => {
                types.extend(ts.iter().filter_map(Value::as_str).map(str::to_owned))
            }
            _ => {}
        }
        if let Some(Value::Array(values)) = s.get("enum") {
            for v in values {
                types.insert(
                    match v {
                        Value::Null => "null",
                        Value::Bool(_) => "boolean",
                        Value::Number(n) if n.is_f64() => "number",
                        Value::Number(_) => "integer",
                        Value::String(_) => "string",
                        Value::Array(_) => "array",
                        Value::Object(_) => "object",
                    }
                    .to_owned(),
                );
            }
        }
        for k in ["anyOf", "oneOf", "allOf"] {
            if let Some(Value::Array(choices)) = s.get(k) {
                for c in choices {
                    types.extend(types_of(Some(c)));
                }
            }
        }
    }
    if types.is_empty() {
        types.insert("string".into());
    }
    types
}

/// `_convert_param_value_with_types`.
fn convert(value: &str, types: &BTreeSet<String>) -> Value {
    let lower = value.to_lowercase();
    let types: BTreeSet<String> = types.iter().map(|t| t.to_lowercase()).collect();
    if lower == "null" || types.contains("null") || matches!(lower.as_str(), "none" | "nil") {
        return Value::Null;
    }
    for t in [
        "integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str",
        "text",
    ] {
        if !types.contains(t) {
            continue;
        }
        match t {
            "string" | "str" | "text" => return Value::String(value.to_owned()),
            "integer" | "int" => {
                if let Some(i) = py_int(value) {
                    return Value::from(i);
                }
            }
            "number" | "float" => {
                if let Some(f) = py_float(value) {
                    if f.fract() == 0.0 && f.abs() < 9.2e18 {
                        return Value::from(f as i64);
                    }
                    if let Some(v) = float_value(f) {
                        return v;
                    }
                }
            }
            "boolean" | "bool" => match lower.trim() {
                "true" | "1" | "yes" | "on" => return Value::Bool(true),
                "false" | "0" | "no" | "off" => return Value::Bool(false),
                _ => {}
            },
            _ => {
                if let Some(v) = loads(value) {
                    return v;
                }
            }
        }
    }
    loads(value).unwrap_or_else(|| Value::String(value.to_owned()))
}
