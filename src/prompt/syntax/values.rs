//! Python's view of the values the tool-call parsers build: `json.dumps` text, `json.loads`,
//! `int()`, `float()`, `ast.literal_eval` and the JSON-schema type lookups SGLang's
//! detectors share, so a call's `arguments` are the bytes SGLang's server would send.
//!
//! Invariant: `dumps` is `json.dumps(v, ensure_ascii=False)` for every value `loads` can
//! give (`", "` / `": "` separators, Python's float repr, key order kept). Inputs Python
//! reads that serde cannot hold (`NaN`, integers past 64 bits, bytes, sets, complex
//! numbers) are refused here, and the callers keep the text as written instead.

use serde_json::{Map, Number, Value};

/// `json.dumps(value, ensure_ascii=False)`.
pub fn dumps(value: &Value) -> String {
    let mut out = String::new();
    write_json(&mut out, value);
    out
}

fn write_json(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&number_repr(n)),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_json(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_str(out, k);
                out.push_str(": ");
                write_json(out, v);
            }
            out.push('}');
        }
    }
}

/// A JSON string as Python's `json.dumps(..., ensure_ascii=False)` writes it.
fn write_str(out: &mut String, s: &str) {
    crate::prompt::python::write_json_str(out, s, false);
}

fn number_repr(n: &Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() => float_repr(f),
        _ => n.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that read back, fixed notation for
/// exponents in -4..16 (with `.0` when integral), else `1e-05` / `1.5e+16`.
pub fn float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let mant = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits.clone()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.abs())
    }
}

/// `json.loads(text)`, for the values serde can hold.
pub fn loads(text: &str) -> Option<Value> {
    serde_json::from_str(text).ok()
}

/// Python's `str.strip()` (Unicode whitespace, and the separators Python counts as space).
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

fn py_space(c: char) -> bool {
    c.is_whitespace() || matches!(c, '\u{1c}'..='\u{1f}')
}

/// Python's `int(text)`: optional sign, decimal digits with single underscores between
/// them, surrounding whitespace ignored.
pub fn py_int(text: &str) -> Option<i64> {
    let t = py_strip(text);
    let (neg, body) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let digits = underscored_digits(body)?;
    let v: i64 = digits.parse().ok()?;
    Some(if neg { -v } else { v })
}

/// `body` without its underscores when it is digits with single underscores between them.
fn underscored_digits(body: &str) -> Option<String> {
    if body.is_empty() || body.starts_with('_') || body.ends_with('_') || body.contains("__") {
        return None;
    }
    if !body.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return None;
    }
    Some(body.replace('_', ""))
}

/// Python's `float(text)` for finite values (infinities and NaN are refused: JSON has no
/// text for them).
pub fn py_float(text: &str) -> Option<f64> {
    let t = py_strip(text);
    let (sign, body) = match t.as_bytes().first() {
        Some(b'-') => ("-", &t[1..]),
        Some(b'+') => ("", &t[1..]),
        _ => ("", t),
    };
    let (mantissa, exp) = match body.find(['e', 'E']) {
        Some(i) => (&body[..i], Some(&body[i + 1..])),
        None => (body, None),
    };
    let (int_part, frac) = match mantissa.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (mantissa, None),
    };
    let part = |p: &str| {
        if p.is_empty() {
            Some(String::new())
        } else {
            underscored_digits(p)
        }
    };
    let int_digits = part(int_part)?;
    let frac_digits = match frac {
        Some(f) => part(f)?,
        None => String::new(),
    };
    if int_digits.is_empty() && frac_digits.is_empty() {
        return None;
    }
    let mut s = format!("{sign}{int_digits}.{frac_digits}0");
    if int_digits.is_empty() {
        s = format!("{sign}0.{frac_digits}");
    }
    if let Some(e) = exp {
        let (esign, edigits) = match e.as_bytes().first() {
            Some(b'-') => ("-", &e[1..]),
            Some(b'+') => ("", &e[1..]),
            _ => ("", e),
        };
        let edigits = underscored_digits(edigits)?;
        s = format!("{s}e{esign}{edigits}");
    }
    s.parse::<f64>().ok().filter(|f| f.is_finite())
}

/// A float as JSON (None for values JSON cannot hold).
pub fn float_value(f: f64) -> Option<Value> {
    Number::from_f64(f).map(Value::Number)
}

/// `get_schema_properties`: the top-level `properties` of a tool's `parameters`,
/// descending into `anyOf`/`oneOf`/`allOf` branches when there are none.
pub fn schema_properties(schema: &Value) -> Map<String, Value> {
    let Some(obj) = schema.as_object() else {
        return Map::new();
    };
    if let Some(Value::Object(p)) = obj.get("properties") {
        return p.clone();
    }
    let mut merged = Map::new();
    for keyword in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(branches)) = obj.get(keyword) {
            for b in branches {
                for (k, v) in schema_properties(b) {
                    merged.entry(k).or_insert(v);
                }
            }
        }
    }
    merged
}

/// The type name Python gives a JSON value in an `enum` (`bool` before `int`).
fn enum_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `infer_type_from_json_schema`: the primary type of a parameter's schema.
pub fn infer_type(schema: &Value) -> Option<String> {
    let obj = schema.as_object()?;
    if let Some(t) = obj.get("type") {
        match t {
            Value::String(s) => return Some(s.clone()),
            Value::Array(ts) if !ts.is_empty() => {
                let non_null = ts.iter().find(|t| t.as_str() != Some("null"));
                return Some(match non_null {
                    Some(Value::String(s)) => s.clone(),
                    // A non-string entry: Python returns it as is; its name is its JSON.
                    Some(other) => other.to_string(),
                    None => "string".into(),
                });
            }
            _ => {}
        }
    }
    let truthy = |k: &str| match obj.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Object(o)) if o.is_empty() => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(v) => Some(v),
    };
    if obj.contains_key("anyOf") || obj.contains_key("oneOf") {
        if let Some(Value::Array(subs)) = truthy("anyOf").or_else(|| obj.get("oneOf")) {
            let types: Vec<String> = subs.iter().filter_map(infer_type).collect();
            if !types.is_empty() {
                let mut distinct: Vec<&String> = Vec::new();
                for t in &types {
                    if !distinct.contains(&t) {
                        distinct.push(t);
                    }
                }
                if distinct.len() == 1 {
                    return Some(types[0].clone());
                }
                if distinct.len() == 2 && types.iter().any(|t| t == "null") {
                    return types.iter().find(|t| *t != "null").cloned();
                }
                if types.iter().any(|t| t == "string") {
                    return Some("string".into());
                }
                return Some(types[0].clone());
            }
        }
    }
    if let Some(Value::Array(values)) = obj.get("enum") {
        if values.is_empty() {
            return Some("string".into());
        }
        let first = enum_type(&values[0]);
        return Some(if values.iter().all(|v| enum_type(v) == first) {
            first.into()
        } else {
            "string".into()
        });
    }
    if let Some(Value::Array(subs)) = obj.get("allOf") {
        for s in subs {
            if let Some(t) = infer_type(s) {
                if t != "string" {
                    return Some(t);
                }
            }
        }
        return Some("string".into());
    }
    if obj.contains_key("properties") {
        return Some("object".into());
    }
    if obj.contains_key("items") {
        return Some("array".into());
    }
    None
}

/// The `parameters` schema of the tool named `name` in an OpenAI `tools` array.
pub fn tool_parameters<'a>(tools: &'a [Value], name: &str) -> Option<&'a Value> {
    tools
        .iter()
        .find(|t| tool_name(t) == Some(name))
        .and_then(|t| t.get("function"))
        .and_then(|f| f.get("parameters"))
}

/// Whether an OpenAI `tools` array offers `name` (SGLang drops calls to other names).
pub fn offers(tools: &[Value], name: &str) -> bool {
    !name.is_empty() && tools.iter().any(|t| tool_name(t) == Some(name))
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
}

/// `ast.literal_eval(text)` for literals JSON can hold: strings, numbers, `True`,
/// `False`, `None`, lists, tuples (as arrays) and dicts with string keys.
pub fn literal_eval(text: &str) -> Option<Value> {
    let mut p = Literal {
        s: text.trim_start_matches([' ', '\t']).as_bytes(),
        at: 0,
    };
    let v = p.value()?;
    p.space();
    (p.at == p.s.len()).then_some(v)
}

struct Literal<'a> {
    s: &'a [u8],
    at: usize,
}

impl Literal<'_> {
    fn space(&mut self) {
        while self.at < self.s.len() && matches!(self.s[self.at], b' ' | b'\t' | b'\n' | b'\r') {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, b: u8) -> bool {
        self.space();
        if self.peek() == Some(b) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.space();
        match self.peek()? {
            b'[' => self.seq(b'[', b']').map(Value::Array),
            b'(' => self.seq(b'(', b')').map(Value::Array),
            b'{' => self.dict(),
            b'\'' | b'"' => self.strings(),
            b'r' | b'R' | b'u' | b'U' if matches!(self.s.get(self.at + 1), Some(b'\'' | b'"')) => {
                self.strings()
            }
            b'-' | b'+' => {
                let neg = self.peek() == Some(b'-');
                self.at += 1;
                match self.value()? {
                    Value::Number(n) if neg => negate(&n),
                    v @ Value::Number(_) => Some(v),
                    _ => None,
                }
            }
            c if c.is_ascii_digit() || c == b'.' => self.number(),
            _ => self.name(),
        }
    }

    fn seq(&mut self, open: u8, close: u8) -> Option<Vec<Value>> {
        self.at += 1;
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                // `(x)` is x itself, not a tuple.
                if open == b'(' && items.len() == 1 && !self.s[..self.at - 1].ends_with(b",") {
                    return None;
                }
                return Some(items);
            }
            items.push(self.value()?);
            if !self.eat(b',') {
                self.space();
                if self.peek() != Some(close) {
                    return None;
                }
            }
        }
    }

    fn dict(&mut self) -> Option<Value> {
        self.at += 1;
        let mut map = Map::new();
        loop {
            if self.eat(b'}') {
                return Some(Value::Object(map));
            }
            let Value::String(k) = self.value()? else {
                return None;
            };
            if !self.eat(b':') {
                return None;
            }
            let v = self.value()?;
            map.insert(k, v);
            if !self.eat(b',') {
                self.space();
                if self.peek() != Some(b'}') {
                    return None;
                }
            }
        }
    }

    /// Adjacent string literals, concatenated as Python does.
    fn strings(&mut self) -> Option<Value> {
        let mut out = String::new();
        loop {
            self.space();
            let raw = matches!(self.peek(), Some(b'r' | b'R'));
            if matches!(self.peek(), Some(b'r' | b'R' | b'u' | b'U')) {
                self.at += 1;
            }
            let q = self.peek()?;
            if q != b'\'' && q != b'"' {
                return None;
            }
            out.push_str(&self.string(q, raw)?);
            self.space();
            match self.peek() {
                Some(b'\'' | b'"') => {}
                Some(b'r' | b'R' | b'u' | b'U')
                    if matches!(self.s.get(self.at + 1), Some(b'\'' | b'"')) => {}
                _ => return Some(Value::String(out)),
            }
        }
    }

    fn string(&mut self, q: u8, raw: bool) -> Option<String> {
        let triple = self.s[self.at..].starts_with(&[q, q, q]);
        let delim: Vec<u8> = if triple { vec![q, q, q] } else { vec![q] };
        self.at += delim.len();
        let mut buf = Vec::new();
        loop {
            if self.s[self.at..].starts_with(&delim) {
                self.at += delim.len();
                return String::from_utf8(buf).ok();
            }
            let c = *self.s.get(self.at)?;
            if c == b'\n' && !triple {
                return None;
            }
            if c == b'\\' {
                let n = *self.s.get(self.at + 1)?;
                if raw {
                    buf.extend_from_slice(&[c, n]);
                    self.at += 2;
                    continue;
                }
                self.at += 2;
                match n {
                    b'n' => buf.push(b'\n'),
                    b't' => buf.push(b'\t'),
                    b'r' => buf.push(b'\r'),
                    b'\\' => buf.push(b'\\'),
                    b'\'' => buf.push(b'\''),
                    b'"' => buf.push(b'"'),
                    b'0' => buf.push(0),
                    b'a' => buf.push(7),
                    b'b' => buf.push(8),
                    b'f' => buf.push(12),
                    b'v' => buf.push(11),
                    b'\n' => {}
                    b'x' | b'u' | b'U' => {
                        let len = match n {
                            b'x' => 2,
                            b'u' => 4,
                            _ => 8,
                        };
                        let hex = std::str::from_utf8(self.s.get(self.at..self.at + len)?).ok()?;
                        let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                        let mut tmp = [0u8; 4];
                        buf.extend_from_slice(ch.encode_utf8(&mut tmp).as_bytes());
                        self.at += len;
                    }
                    other => buf.extend_from_slice(&[b'\\', other]),
                }
                continue;
            }
            buf.push(c);
            self.at += 1;
        }
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.at;
        while self.at < self.s.len()
            && (self.s[self.at].is_ascii_alphanumeric() || matches!(self.s[self.at], b'.' | b'_'))
        {
            // An exponent's sign belongs to the number.
            self.at += 1;
            if matches!(self.s[self.at - 1], b'e' | b'E')
                && matches!(self.s.get(self.at), Some(b'+' | b'-'))
            {
                self.at += 1;
            }
        }
        let t = std::str::from_utf8(&self.s[start..self.at]).ok()?;
        if let Some(i) = py_int(t) {
            return Some(Value::from(i));
        }
        let lower = t.to_ascii_lowercase();
        for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
            if let Some(d) = lower.strip_prefix(prefix) {
                return i64::from_str_radix(&d.replace('_', ""), radix)
                    .ok()
                    .map(Value::from);
            }
        }
        if t.len() > 1 && t.starts_with('0') && t.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
            return None;
        }
        if t.ends_with(['j', 'J']) {
            return None;
        }
        py_float(t).and_then(float_value)
    }

    fn name(&mut self) -> Option<Value> {
        let start = self.at;
        while self.at < self.s.len()
            && (self.s[self.at].is_ascii_alphanumeric() || self.s[self.at] == b'_')
        {
            self.at += 1;
        }
        match &self.s[start..self.at] {
            b"True" => Some(Value::Bool(true)),
            b"False" => Some(Value::Bool(false)),
            b"None" => Some(Value::Null),
            _ => None,
        }
    }
}

fn negate(n: &Number) -> Option<Value> {
    if let Some(i) = n.as_i64() {
        return i.checked_neg().map(Value::from);
    }
    n.as_f64().and_then(|f| float_value(-f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `dumps` writes what Python's `json.dumps(ensure_ascii=False)` writes, floats in
    /// Python's repr.
    #[test]
    fn dumps_is_pythons() {
        assert_eq!(
            dumps(&json!({"a": 1, "b": [true, null], "c": "é\n\"", "d": 1.5})),
            r#"{"a": 1, "b": [true, null], "c": "é\n\"", "d": 1.5}"#
        );
        for (f, py) in [
            (1.0, "1.0"),
            (100000.0, "100000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(float_repr(f), py, "{f}");
        }
    }

    /// Python's `int()` and `float()` accept and refuse the same spellings.
    #[test]
    fn int_and_float_read_as_python_does() {
        assert_eq!(py_int(" 42\n"), Some(42));
        assert_eq!(py_int("-1_000"), Some(-1000));
        assert_eq!(py_int("1__0"), None);
        assert_eq!(py_int("4.0"), None);
        assert_eq!(py_float("1e3"), Some(1000.0));
        assert_eq!(py_float(".5"), Some(0.5));
        assert_eq!(py_float("5."), Some(5.0));
        assert_eq!(py_float("abc"), None);
        assert_eq!(py_float("inf"), None);
    }

    /// `literal_eval` reads Python literals and refuses names and expressions.
    #[test]
    fn literal_eval_reads_python_literals() {
        assert_eq!(
            literal_eval("{'a': [1, 2.5, True, None], \"b\": ('x',)}"),
            Some(json!({"a": [1, 2.5, true, null], "b": ["x"]}))
        );
        assert_eq!(literal_eval("-3"), Some(json!(-3)));
        assert_eq!(literal_eval("'a' 'b'"), Some(json!("ab")));
        assert_eq!(literal_eval("hello"), None);
        assert_eq!(literal_eval("2024-06-27"), None);
        assert_eq!(literal_eval("(1)"), None);
    }

    /// Types come from a parameter's schema as SGLang infers them.
    #[test]
    fn types_are_inferred_from_schemas() {
        assert_eq!(
            infer_type(&json!({"type": "integer"})).as_deref(),
            Some("integer")
        );
        assert_eq!(
            infer_type(&json!({"type": ["null", "number"]})).as_deref(),
            Some("number")
        );
        assert_eq!(
            infer_type(&json!({"anyOf": [{"type": "integer"}, {"type": "null"}]})).as_deref(),
            Some("integer")
        );
        assert_eq!(
            infer_type(&json!({"enum": ["a", "b"]})).as_deref(),
            Some("string")
        );
        assert_eq!(
            infer_type(&json!({"enum": [1, 2]})).as_deref(),
            Some("integer")
        );
        assert_eq!(
            infer_type(&json!({"properties": {}})).as_deref(),
            Some("object")
        );
        assert_eq!(infer_type(&json!({"description": "x"})), None);
    }
}
