//! DeepSeek tool calls, as SGLang's detectors read them: V3.1 (`deepseekv31`,
//! `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…`) and
//! V3.2 (`deepseekv32`, DSML: `<｜DSML｜function_calls><｜DSML｜invoke name="…">` with
//! `<｜DSML｜parameter name="…" string="true|false">` or a JSON body), as SGLang 0.5.23
//! reads them.
//!
//! Invariant: arguments are re-serialised as Python's `json.dumps` writes them; calls to
//! tools not offered are dropped; text that does not parse keeps the reply whole.

use super::values::{dumps, loads, offers, py_strip};
use super::ParsedCall;
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

pub const V31_BEGIN: &str = "<｜tool▁calls▁begin｜>";

static V31_CALL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>").expect("a valid pattern")
});
static V31_DETAIL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>")
        .expect("a valid pattern")
});

/// `parse_base_json` for one call: kept when the tool is offered, arguments as Python
/// writes them.
pub(super) fn base_call(name: &str, args: &Value, tools: &[Value]) -> Option<ParsedCall> {
    // `act.get("parameters") or act.get("arguments", {})`: a falsy value becomes `{}`.
    let empty = Value::Object(Map::new());
    let args = if truthy(args) { args } else { &empty };
    offers(tools, name).then(|| ParsedCall {
        id: None,
        name: name.to_owned(),
        arguments: dumps(args),
    })
}

/// Python's truth value of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// V3.1: (answer, calls) when the text opens a tool-call section; a call whose arguments
/// are not JSON keeps the whole text as the answer with no call (SGLang's fallback).
pub fn split_v31(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    let at = text.find(V31_BEGIN)?;
    let normal = py_strip(&text[..at]).to_owned();
    let mut calls = Vec::new();
    for m in V31_CALL.find_iter(text) {
        let Some(d) = V31_DETAIL.captures(m.as_str()) else {
            return Some((text.to_owned(), Vec::new()));
        };
        let Some(args) = loads(&d[2]) else {
            return Some((text.to_owned(), Vec::new()));
        };
        calls.extend(base_call(&d[1], &args, tools));
    }
    Some((normal, calls))
}

static V32_SECTION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)<｜DSML｜function_calls>(.*?)</｜DSML｜function_calls>")
        .expect("a valid pattern")
});
static V32_INVOKE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?s)<｜DSML｜invoke\s+name="(?P<name>[^"]+)"\s*(?:(?P<self_close>/>)|>(?P<body>.*?)(?:(?P<end></｜DSML｜invoke>)|\n?\z))"#)
        .expect("a valid pattern")
});
static V32_PARAM: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?s)<｜DSML｜parameter\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)</｜DSML｜parameter>"#)
        .expect("a valid pattern")
});

const DSML: &str = "｜DSML｜";
const V32_BEGIN: &str = "<｜DSML｜function_calls>";
const V32_INVOKE_START: &str = "<｜DSML｜invoke";

/// `_parse_parameters_from_xml`: a JSON object body, else the parameter tags; `None` for
/// a malformed body (SGLang drops that call).
fn v32_params(body: &str) -> Option<Value> {
    let stripped = py_strip(body);
    if stripped.starts_with('{') {
        return match loads(stripped)? {
            v @ Value::Object(_) => Some(v),
            _ => None,
        };
    }
    let mut params = Map::new();
    let mut leftover = String::new();
    let mut last = 0;
    let mut any = false;
    for c in V32_PARAM.captures_iter(body) {
        let m = c.get(0).expect("group 0 is the match");
        leftover.push_str(&body[last..m.start()]);
        last = m.end();
        any = true;
        let value = py_strip(&c[3]);
        let v = if &c[2] == "true" {
            Value::String(value.to_owned())
        } else {
            loads(value).unwrap_or_else(|| Value::String(value.to_owned()))
        };
        params.insert(c[1].to_owned(), v);
    }
    leftover.push_str(&body[last..]);
    if leftover.contains(DSML) || (!any && !py_strip(&leftover).is_empty()) {
        return None;
    }
    Some(Value::Object(params))
}

/// `_text_before_dsml`: the prose before the first DSML tag, less the blank line the
/// template puts before a call.
fn text_before_dsml(text: &str) -> String {
    let Some(mut idx) = text.find(DSML) else {
        return text.to_owned();
    };
    if text[..idx].ends_with("</") {
        idx -= 2;
    } else if text[..idx].ends_with('<') {
        idx -= 1;
    }
    let t = &text[..idx];
    t.strip_suffix("\n\n").unwrap_or(t).to_owned()
}

/// V3.2 (DSML): (answer, calls) when the text opens a call block or an invoke.
pub fn split_v32(text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
    let (normal, sections): (String, Vec<&str>) = match text.find(V32_BEGIN) {
        Some(idx) => {
            let t = &text[..idx];
            (
                t.strip_suffix("\n\n").unwrap_or(t).to_owned(),
                V32_SECTION
                    .captures_iter(text)
                    .filter_map(|c| c.get(1).map(|g| g.as_str()))
                    .collect(),
            )
        }
        None => {
            let start = text.find(V32_INVOKE_START)?;
            (text_before_dsml(text), vec![&text[start..]])
        }
    };
    let mut calls = Vec::new();
    for section in sections {
        for m in V32_INVOKE.captures_iter(section) {
            let name = py_strip(&m["name"]);
            let body = if m.name("self_close").is_some() {
                ""
            } else if m.name("end").is_some() {
                m.name("body").map_or("", |b| b.as_str())
            } else {
                continue;
            };
            let Some(args) = v32_params(body) else {
                continue;
            };
            calls.extend(base_call(name, &args, tools));
        }
    }
    Some((normal, calls))
}
