//! Python's view of template values, as jinja2 under transformers prints them.
//!
//! Invariants: `{{ value }}` prints what Python's `str()` prints (`None`, `True`,
//! `['a', 1]`); `tojson` is Python's `json.dumps(ensure_ascii=False)` (`", "`/`": "`
//! separators, no HTML escaping); JSON objects keep their key order end to end, so
//! `tojson` and `.items()` see keys in the order the row wrote them.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use minijinja::value::{Kwargs, Object, ObjectExt, ObjectRepr, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};
use serde_json::Value as JsonValue;

/// A map that keeps insertion order (minijinja's own maps sort their keys unless built
/// with `preserve_order`), so `tojson` and `.items()` see keys in the order written.
#[derive(Debug, Default)]
pub(super) struct OrderedMap {
    entries: Vec<(Value, Value)>,
}

impl OrderedMap {
    /// Inserts or replaces `key`, keeping the position of the first insertion.
    pub(super) fn insert(&mut self, key: &str, value: Value) {
        match self
            .entries
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some(key))
        {
            Some(entry) => entry.1 = value,
            None => self.entries.push((Value::from(key), value)),
        }
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> minijinja::value::Enumerator {
        self.mapped_key_value_enumerator(|this| {
            Box::new(this.entries.iter().map(|(k, v)| (k.clone(), v.clone())))
        })
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&py_repr(&Value::from_dyn_object(self.clone())))
    }
}

/// A JSON value as a template value (objects keep their key order).
pub(super) fn json_to_value(value: &JsonValue) -> Value {
    match value {
        JsonValue::Null => Value::from(()),
        JsonValue::Bool(b) => Value::from(*b),
        JsonValue::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        JsonValue::String(s) => Value::from(s.as_str()),
        JsonValue::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        JsonValue::Object(map) => {
            let entries = map
                .iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v)))
                .collect();
            Value::from_object(OrderedMap { entries })
        }
    }
}

/// Names a message's reasoning may come under, in the order transformers looks for it.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A message as transformers' `apply_chat_template` hands it to the template: null-valued
/// keys dropped (`_normalize_chat_messages`), then the reasoning aliased
/// (`_alias_reasoning_fields`): when any of `reasoning_content`, `thinking`, `reasoning` is
/// set, the first of them becomes both `thinking` (first key, unless the message has its own)
/// and `reasoning_content` (in its place, else last), so every template finds it.
pub(super) fn message_to_value(message: &JsonValue) -> Value {
    let JsonValue::Object(map) = message else {
        return json_to_value(message);
    };
    let present = |(_, v): &(&String, &JsonValue)| !v.is_null();
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|key| map.get(*key).filter(|v| !v.is_null()));
    let mut entries: Vec<(Value, Value)> = Vec::with_capacity(map.len() + 2);
    if let Some(reasoning) = reasoning {
        let thinking = map
            .get("thinking")
            .filter(|v| !v.is_null())
            .unwrap_or(reasoning);
        entries.push((Value::from("thinking"), json_to_value(thinking)));
    }
    for (key, value) in map.iter().filter(present) {
        match (key.as_str(), reasoning) {
            ("thinking", Some(_)) => {}
            ("reasoning_content", Some(reasoning)) => {
                entries.push((Value::from(key.as_str()), json_to_value(reasoning)))
            }
            _ => entries.push((Value::from(key.as_str()), json_to_value(value))),
        }
    }
    if let Some(reasoning) = reasoning {
        if map.get("reasoning_content").is_none_or(JsonValue::is_null) {
            entries.push((Value::from("reasoning_content"), json_to_value(reasoning)));
        }
    }
    Value::from_object(OrderedMap { entries })
}

/// jinja2's `iterable` test (`iter(value)` succeeds): strings, lists, dicts and undefined
/// are; `none` is not, where minijinja would iterate it as empty.
pub(super) fn is_iterable(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
        )
}

/// jinja2's `sequence` test (`len(value)` and `value.__getitem__` exist): strings, lists,
/// dicts and undefined are; `none`, numbers and generators are not.
pub(super) fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
}

/// String methods as Python has them, where minijinja-contrib's `pycompat` differs; every
/// other method goes to `pycompat`.
pub(super) fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(s), "title", []) = (value.as_str(), method, args) {
        return Ok(Value::from(py_title(s)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.title()`: a cased character is upper-cased after an uncased one (any
/// non-letter, not just whitespace: `</think>` becomes `</Think>`), lower-cased after a cased
/// one.
fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut after_cased = false;
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        if cased && after_cased {
            out.extend(c.to_lowercase());
        } else if cased {
            out.extend(c.to_uppercase());
        } else {
            out.push(c);
        }
        after_cased = cased;
    }
    out
}

/// Python's `repr(float)` (shortest round-trip digits, exponent outside 1e-4..1e16).
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sign = if f < 0.0 { "-" } else { "" };
    // `{:e}` gives the shortest round-trip digits, e.g. "1.2345e6" or "1e-7".
    let sci = format!("{:e}", f.abs());
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return f.to_string();
    };
    let Ok(exp) = exp.parse::<i32>() else {
        return f.to_string();
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let decpt = exp + 1;
    if decpt <= -4 || decpt > 16 {
        let mantissa = if n == 1 {
            digits
        } else {
            format!("{}.{}", &digits[..1], &digits[1..])
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    } else if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{sign}{int}.{frac}")
    }
}

fn py_number(value: &Value) -> String {
    if value.is_integer() {
        value.to_string()
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => value.to_string(),
        }
    }
}

/// Python's `str(value)`: what `{{ value }}` prints in jinja2.
pub(super) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` (strings quoted), as containers print their items.
fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_py_repr(&mut out, value);
    out
}

fn write_py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(value)),
        ValueKind::String => write_py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(items) => {
                out.push('[');
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item);
                }
                out.push(']');
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                out.push('{');
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &key);
                    out.push_str(": ");
                    write_py_repr(out, &value.get_item(&key).unwrap_or_default());
                }
                out.push('}');
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        _ => out.push_str(&value.to_string()),
    }
}

/// Whether Python's `str.isprintable()` is false for `c` (approximated for the
/// categories that matter in prompts: controls, format characters, odd spaces).
fn py_unprintable(c: char) -> bool {
    matches!(c,
        '\0'..='\x1f' | '\x7f'..='\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}'
        | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{2064}' | '\u{3000}' | '\u{feff}'
        | '\u{e000}'..='\u{f8ff}')
}

fn write_py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_unprintable(c) => {
                let code = c as u32;
                let _ = if code < 0x100 {
                    write!(out, "\\x{code:02x}")
                } else {
                    write!(out, "\\u{code:04x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's truth value (`bool(value)`) of a JSON value as `json.loads` gives it: `None`,
/// `False`, zero and empty strings, lists and dicts are false.
pub(super) fn json_truthy(value: &JsonValue) -> bool {
    match value {
        JsonValue::Null => false,
        JsonValue::Bool(b) => *b,
        JsonValue::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        JsonValue::String(s) => !s.is_empty(),
        JsonValue::Array(a) => !a.is_empty(),
        JsonValue::Object(m) => !m.is_empty(),
    }
}

/// Python's `str(value)` of a JSON value as `json.loads` gives it (`None`, `True`,
/// `{'a': 1}`, `1.0`), as f-strings in model code print it.
pub(super) fn py_str_json(value: &JsonValue) -> String {
    py_str(&json_to_value(value))
}

/// Python's `json.dumps(value, ensure_ascii=False)` of a JSON value as `json.loads` gives it.
pub(super) fn json_dumps(value: &JsonValue) -> String {
    let mut out = String::new();
    // Values from JSON are always serializable: the writer fails only on other kinds.
    let _ = write_json(&mut out, &json_to_value(value), &JsonStyle::default(), 0);
    out
}

/// Options of Python's `json.dumps`, as transformers' `tojson` passes them.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for JsonStyle {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` filter, i.e. Python's `json.dumps` with those arguments
/// (`sort_keys` only by keyword: minijinja filters take at most five arguments).
pub(super) fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named
            .or(positional)
            .filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(separators, "separators")?;
    let sort_keys = pick(None, "sort_keys")?;
    kwargs.assert_all_used()?;

    let mut style = JsonStyle {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonStyle::default()
    };
    if let Some(indent) = indent {
        style.indent = Some(match indent.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = indent.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                " ".repeat(n.max(0) as usize)
            }
        });
        // Python's default item separator is "," once indent is set.
        style.item_sep = ",".into();
    }
    if let Some(separators) = separators {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                style.item_sep = item.as_str().unwrap_or_default().to_owned();
                style.key_sep = key.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ))
            }
        }
    }
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json_newline(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&match f {
                    f if f.is_nan() => "NaN".to_owned(),
                    f if f.is_infinite() && f > 0.0 => "Infinity".to_owned(),
                    f if f.is_infinite() => "-Infinity".to_owned(),
                    f => py_float_repr(f),
                });
            }
        }
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_json_newline(out, style, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            write_json_newline(out, style, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_json_newline(out, style, level + 1);
                write_json_str(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, level + 1)?;
            }
            write_json_newline(out, style, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A map key as Python's json module writes it (non-string keys are converted).
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut out = String::new();
            write_json(&mut out, key, &JsonStyle::default(), 0)?;
            Ok(out)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

pub(crate) fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::ChatTemplate;
    use serde_json::{json, Map};
    use std::path::PathBuf;

    fn render_expr(expr: &str, vars: JsonValue) -> String {
        let extra = vars.as_object().cloned().unwrap_or_default();
        ChatTemplate::from_source(expr, Map::new(), PathBuf::from("test.jinja"))
            .unwrap()
            .render(&json!([]), false, &extra)
            .unwrap()
    }

    /// Python's `json.dumps(value)` with the default options transformers uses.
    fn py_json_dumps(value: &Value) -> Result<String, Error> {
        let mut out = String::new();
        write_json(&mut out, value, &JsonStyle::default(), 0)?;
        Ok(out)
    }

    fn to_json(value: JsonValue) -> String {
        py_json_dumps(&json_to_value(&value)).unwrap()
    }

    /// `tojson` writes what Python's `json.dumps` writes: key order, separators, escapes,
    /// floats.
    #[test]
    fn tojson_is_python_json_dumps() {
        assert_eq!(
            to_json(json!({"b": 1, "a": [true, null, 1.5, "x"]})),
            r#"{"b": 1, "a": [true, null, 1.5, "x"]}"#
        );
        // No HTML escaping, no ASCII escaping.
        assert_eq!(to_json(json!("< & ' > é 中 😀")), r#""< & ' > é 中 😀""#);
        // Controls escaped as Python does; DEL kept.
        assert_eq!(
            to_json(json!("q\"b\\n\n\r\t\u{8}\u{c}\u{1}\u{7f}")),
            "\"q\\\"b\\\\n\\n\\r\\t\\b\\f\\u0001\u{7f}\""
        );
        assert_eq!(to_json(json!([])), "[]");
        assert_eq!(to_json(json!({})), "{}");
        assert_eq!(
            to_json(json!({"z": {"y": {"x": []}}, "a": 0})),
            r#"{"z": {"y": {"x": []}}, "a": 0}"#
        );
        assert_eq!(to_json(json!(1e20)), "1e+20");
        assert_eq!(to_json(json!(-0.00001)), "-1e-05");
        assert_eq!(
            to_json(json!(12345678901234567890u64)),
            "12345678901234567890"
        );
    }

    /// In a template, `tojson` keeps key order and honours `indent`, `sort_keys`,
    /// `ensure_ascii` and `separators`; `.items()` keeps the order too.
    #[test]
    fn tojson_filter_in_templates_keeps_key_order_and_options() {
        let vars = json!({"x": {"name": "f", "b": [1, 2], "a": {"é": "<&>"}}});
        assert_eq!(
            render_expr("{{ x | tojson }}", vars.clone()),
            r#"{"name": "f", "b": [1, 2], "a": {"é": "<&>"}}"#
        );
        assert_eq!(
            render_expr("{{ x | tojson(indent=2) }}", vars.clone()),
            "{\n  \"name\": \"f\",\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": {\n    \"é\": \"<&>\"\n  }\n}"
        );
        assert_eq!(
            render_expr(
                "{{ x | tojson(sort_keys=true, ensure_ascii=true) }}",
                vars.clone()
            ),
            r#"{"a": {"\u00e9": "<&>"}, "b": [1, 2], "name": "f"}"#
        );
        assert_eq!(
            render_expr("{{ x.b | tojson(separators=(',', ':')) }}", vars.clone()),
            "[1,2]"
        );
        assert_eq!(
            render_expr("{{ '😀' | tojson(ensure_ascii=true) }}", json!({})),
            r#""\ud83d\ude00""#
        );
        // `.items()` follows the JSON order too.
        assert_eq!(
            render_expr("{% for k, v in x.items() %}{{ k }};{% endfor %}", vars),
            "name;b;a;"
        );
    }

    /// `str.title()` upper-cases after any uncased character, as Python does; `none` is
    /// neither iterable nor a sequence, strings and dicts are both, undefined is both.
    #[test]
    fn title_and_jinja2_tests_follow_python() {
        assert_eq!(
            py_title("</think> it's 1st ÉTÉ 中文x"),
            "</Think> It'S 1St Été 中文X"
        );
        let vars = json!({"n": null, "s": "x", "d": {"a": 1}, "l": [1]});
        assert_eq!(
            render_expr(
                "{{ n is iterable }}{{ n is sequence }}{{ s is iterable }}{{ s is sequence }}{{ d is sequence }}{{ l is sequence }}{{ nope is iterable }}{{ nope is sequence }}|{{ '{\"k\": 1}'.title() }}",
                vars
            ),
            "FalseFalseTrueTrueTrueTrueTrueTrue|{\"K\": 1}"
        );
    }

    /// Null keys are dropped, and the first reasoning field found becomes `thinking` (first
    /// key) and `reasoning_content` (in its place, else last), as transformers aliases them.
    #[test]
    fn messages_drop_nulls_and_alias_reasoning() {
        let keys = |message: JsonValue| {
            let value = message_to_value(&message);
            let mut out = Vec::new();
            for key in value.try_iter().unwrap() {
                let item = value.get_item(&key).unwrap();
                out.push(format!("{}={}", key, py_str(&item)));
            }
            out.join(" ")
        };
        assert_eq!(
            keys(json!({"role": "assistant", "content": "a", "reasoning": "r", "name": null})),
            "thinking=r role=assistant content=a reasoning=r reasoning_content=r"
        );
        assert_eq!(
            keys(
                json!({"role": "assistant", "reasoning_content": "rc", "thinking": "t", "content": "a"})
            ),
            "thinking=t role=assistant reasoning_content=rc content=a"
        );
        assert_eq!(
            keys(json!({"role": "assistant", "reasoning_content": null, "thinking": "t"})),
            "thinking=t role=assistant reasoning_content=t"
        );
        assert_eq!(keys(json!({"role": "user", "content": null})), "role=user");
    }

    /// Values print as Python's `str()` prints them, floats as its `repr()`.
    #[test]
    fn values_print_like_python() {
        let vars = json!({"n": null, "t": true, "f": 1.0, "i": 3, "l": ["a", 1, null, false], "d": {"k": "it's"}});
        assert_eq!(
            render_expr("{{ n }}|{{ t }}|{{ f }}|{{ i }}|{{ nope }}", vars.clone()),
            "None|True|1.0|3|"
        );
        assert_eq!(
            render_expr("{{ l }} {{ d }}", vars),
            r#"['a', 1, None, False] {'k': "it's"}"#
        );
        assert_eq!(py_float_repr(0.1), "0.1");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1234567890123456.0), "1234567890123456.0");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(-2.5e-7), "-2.5e-07");
    }
}
