//! A dataset row: what a line (or Parquet row) of a prompt file asks for, or why it is
//! rejected.
//!
//! A row carries exactly one of `prompt`, `messages` or `conversations` (ShareGPT,
//! converted to messages, a trailing assistant turn dropped unless the parser keeps whole
//! conversations for `turns = "all"`), optionally an `id` and optionally `tools` (an array
//! of OpenAI function schemas, part of the row's content). A line in the OpenAI batch shape
//! (`custom_id`, `method`, `url`, `body`: [`super::batch`]) is the same row, its
//! `custom_id` the id, with the body's sampling as the row's own ([`Row::sampling`]).
//! [`Parser::parse`] turns a [`RawEntry`] cut by the reader into an [`Entry`]: JSON parsing,
//! shape checks, ids and hashes, so intake can parse on many threads.
//!
//! Invariants: `row` is the 0-based line index (Parquet: the 0-based row index across row
//! groups), so it is stable when lines (rows) are appended; the same content gives the
//! same [`Row::hash`] and the same derived id in every run, whatever the file format.

use super::batch::{self, RowSampling};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::path::Path;

/// What a row asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// Sent as is, no template.
    Prompt(String),
    /// OpenAI chat messages (from `messages` or converted `conversations`).
    Messages(Value),
}

/// One good row.
#[derive(Debug, Clone)]
pub struct Row {
    /// 0-based line index in the file (Parquet: row index).
    pub row: u64,
    pub id: String,
    pub input: Input,
    /// OpenAI function schemas offered to the model (an array of objects).
    pub tools: Option<Value>,
    /// A batch row's own sampling (part of its content), None for other rows.
    pub sampling: Option<Box<RowSampling>>,
    /// Content fingerprint: detects a row that changed between runs.
    pub hash: [u8; 16],
}

/// A row that will not be generated, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rejection {
    pub file: String,
    /// 1-based line number, as editors show it (Parquet: 1-based row number).
    pub line: u64,
    pub row: u64,
    pub reason: String,
    /// The row's id when it is known (a batch row's `custom_id`, a row refused after
    /// parsing), so that an export can answer for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// A line of a dataset file, parsed.
#[derive(Debug)]
pub enum Entry {
    Row(Row),
    Rejected(Rejection),
}

/// A row as cut from the file, not yet parsed.
#[derive(Debug, Clone)]
pub enum Raw {
    /// One JSONL line's bytes (trailing newline included).
    Line(Vec<u8>),
    /// One Parquet row: the columns present, as JSON (nulls left out).
    Object(Map<String, Value>),
    /// Unusable before parsing (too long, bad UTF-8, an undecodable Parquet cell).
    Bad(String),
}

/// A row of the file before parsing, with its position.
#[derive(Debug, Clone)]
pub struct RawEntry {
    /// 0-based row index.
    pub row: u64,
    pub raw: Raw,
}

impl RawEntry {
    /// 1-based line (Parquet: row) number.
    pub fn line(&self) -> u64 {
        self.row + 1
    }
}

/// Turns [`RawEntry`]s of one file into [`Entry`]s; cheap to clone, `Send + Sync`.
#[derive(Debug, Clone)]
pub struct Parser {
    file: String,
    pub(super) dataset: String,
    /// Keep a ShareGPT conversation's trailing assistant turn (`turns = "all"`).
    whole: bool,
    /// The dataset's generations per prompt (what a batch row's `body.n` must be).
    samples: u32,
}

impl Parser {
    /// A parser for rows of `path` in dataset `dataset` (its name seeds derived ids).
    pub fn new(path: &Path, dataset: &str) -> Self {
        Self {
            file: path.display().to_string(),
            dataset: dataset.to_string(),
            whole: false,
            samples: 1,
        }
    }

    /// This parser for a dataset generating `samples` generations per prompt.
    pub fn samples(mut self, samples: u32) -> Self {
        self.samples = samples;
        self
    }

    /// This parser keeping whole conversations (a ShareGPT row's trailing assistant turn
    /// too), as `turns = "all"` regenerates every assistant turn.
    pub fn whole_conversations(mut self, whole: bool) -> Self {
        self.whole = whole;
        self
    }

    /// Parses one raw row: a good row, or its rejection.
    pub fn parse(&self, e: RawEntry) -> Entry {
        let row = e.row;
        let (whole, samples) = (self.whole, self.samples);
        let res = match e.raw {
            Raw::Bad(reason) => Err((reason, None)),
            Raw::Object(obj) => parse_object_full(&self.dataset, row, obj, whole, samples),
            Raw::Line(bytes) => match std::str::from_utf8(&bytes) {
                Ok(text) => parse_text(&self.dataset, row, text.trim(), whole, samples),
                Err(e) => Err((format!("invalid UTF-8 at byte {}", e.valid_up_to()), None)),
            },
        };
        match res {
            Ok(r) => Entry::Row(r),
            Err((reason, id)) => Entry::Rejected(Rejection {
                id,
                ..self.reject(row, reason)
            }),
        }
    }

    /// A rejection of row `row` of this file.
    pub fn reject(&self, row: u64, reason: String) -> Rejection {
        Rejection {
            file: self.file.clone(),
            line: row + 1,
            row,
            reason,
            id: None,
        }
    }
}

/// Parses one JSON line into a row, or the reason it is rejected.
pub fn parse_row(dataset: &str, row: u64, text: &str) -> Result<Row, String> {
    parse_text(dataset, row, text, false, 1).map_err(|(reason, _)| reason)
}

/// A row's rejection reason, with its id when known.
type Refusal = (String, Option<String>);

fn parse_text(
    dataset: &str,
    row: u64,
    text: &str,
    whole: bool,
    samples: u32,
) -> Result<Row, Refusal> {
    let v = super::limits::parse_json_bounded(text, super::limits::MAX_ROW_VALUES)
        .map_err(|reason| (reason, None))?;
    let Value::Object(obj) = v else {
        return Err(("a row must be a JSON object".into(), None));
    };
    parse_object_full(dataset, row, obj, whole, samples)
}

/// Parses one row given as a JSON object (a JSONL line, or a Parquet row).
pub fn parse_object(dataset: &str, row: u64, obj: Map<String, Value>) -> Result<Row, String> {
    parse_object_full(dataset, row, obj, false, 1).map_err(|(reason, _)| reason)
}

/// A plain row or a batch row (turned into the plain row's fields first).
fn parse_object_full(
    dataset: &str,
    row: u64,
    obj: Map<String, Value>,
    whole: bool,
    samples: u32,
) -> Result<Row, Refusal> {
    if !batch::is_batch_row(&obj) {
        return parse_object_as(dataset, row, obj, whole, None).map_err(|r| (r, None));
    }
    let id = batch::custom_id_of(&obj);
    let b = batch::parse_batch(&obj, samples).map_err(|r| (r, id.clone()))?;
    let mut plain = b.input;
    plain.insert("id".into(), Value::String(b.custom_id));
    let sampling = Some(Box::new(b.sampling)).filter(|s| !s.is_empty());
    parse_object_as(dataset, row, plain, whole, sampling).map_err(|r| (r, id))
}

/// `tools`, when the row has them: an array of objects (OpenAI function schemas).
fn check_tools(v: Option<&Value>) -> Result<Option<Value>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(tools)) => match tools.iter().position(|t| !t.is_object()) {
            Some(i) => Err(format!(
                "tools[{i}] must be an object (an OpenAI function schema), not {}",
                type_name(&tools[i])
            )),
            None => Ok(Some(Value::Array(tools.clone()))),
        },
        Some(other) => Err(format!(
            "`tools` must be an array of OpenAI function schemas, not {}",
            type_name(other)
        )),
    }
}

fn parse_object_as(
    dataset: &str,
    row: u64,
    obj: Map<String, Value>,
    whole: bool,
    sampling: Option<Box<RowSampling>>,
) -> Result<Row, String> {
    let present: Vec<&str> = ["prompt", "messages", "conversations"]
        .into_iter()
        .filter(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
        .collect();
    let input = match present.as_slice() {
        ["prompt"] => match &obj["prompt"] {
            Value::String(s) if s.trim().is_empty() => return Err("empty `prompt`".into()),
            Value::String(s) => Input::Prompt(s.clone()),
            other => {
                return Err(format!(
                    "`prompt` must be a string, not {}",
                    type_name(other)
                ))
            }
        },
        ["messages"] => Input::Messages(check_messages(&obj["messages"])?),
        ["conversations"] => Input::Messages(convert_sharegpt(&obj["conversations"], whole)?),
        [] => return Err("none of `prompt`, `messages`, `conversations`".into()),
        several => {
            return Err(format!(
                "several of {} (exactly one is allowed)",
                several.join(", ")
            ))
        }
    };
    let content = match &input {
        Input::Prompt(p) => Value::String(p.clone()),
        Input::Messages(m) => m.clone(),
    };
    let explicit_id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => return Err("empty `id`".into()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(n.to_string()),
        Some(other) => {
            return Err(format!(
                "`id` must be a string or an integer, not {}",
                type_name(other)
            ))
        }
    };
    let tools = check_tools(obj.get("tools"))?;
    let mut canonical = serde_json::to_string(&content).map_err(|e| e.to_string())?;
    // Tools are content (the same messages with other tools is another prompt); a row
    // without them keeps the fingerprint and id it always had.
    if let Some(t) = &tools {
        canonical.push('\0');
        canonical.push_str(&t.to_string());
    }
    // A batch row's sampling is content too (another max_tokens is another request);
    // rows without it keep their fingerprint.
    if let Some(s) = &sampling {
        canonical.push('\u{1}');
        canonical.push_str(&s.to_value().to_string());
    }
    let digest = Sha256::new()
        .chain_update(dataset.as_bytes())
        .chain_update([0u8])
        .chain_update(canonical.as_bytes())
        .finalize();
    let id = explicit_id
        .clone()
        .unwrap_or_else(|| crate::config::hex(&digest[..12]));
    let mut hasher = Sha256::new()
        .chain_update(canonical.as_bytes())
        .chain_update([0u8]);
    if let Some(i) = &explicit_id {
        hasher.update(i.as_bytes());
    }
    let mut hash = [0u8; 16];
    hash.copy_from_slice(&hasher.finalize()[..16]);
    Ok(Row {
        row,
        id,
        input,
        tools,
        sampling,
        hash,
    })
}

/// How a message names a JSON value's type ("a string", "an array", …).
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_messages(v: &Value) -> Result<Value, String> {
    let Value::Array(msgs) = v else {
        return Err(format!("`messages` must be an array, not {}", type_name(v)));
    };
    if msgs.is_empty() {
        return Err("`messages` is empty".into());
    }
    for (i, m) in msgs.iter().enumerate() {
        let Value::Object(o) = m else {
            return Err(format!("messages[{i}] must be an object"));
        };
        match o.get("role") {
            Some(Value::String(_)) => {}
            _ => return Err(format!("messages[{i}].role must be a string")),
        }
        match o.get("content") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(Value::Null) | None if o.contains_key("tool_calls") => {}
            _ => return Err(format!("messages[{i}].content must be a string")),
        }
    }
    if !msgs.iter().any(|m| {
        m.get("content")
            .and_then(|c| c.as_str())
            .is_some_and(|s| !s.trim().is_empty())
    }) {
        return Err("every message is empty".into());
    }
    Ok(v.clone())
}

fn convert_sharegpt(v: &Value, whole: bool) -> Result<Value, String> {
    let Value::Array(turns) = v else {
        return Err(format!(
            "`conversations` must be an array, not {}",
            type_name(v)
        ));
    };
    let mut out = Vec::with_capacity(turns.len());
    for (i, t) in turns.iter().enumerate() {
        let from = t.get("from").and_then(|f| f.as_str());
        let value = t.get("value").and_then(|f| f.as_str());
        let (Some(from), Some(value)) = (from, value) else {
            return Err(format!(
                "conversations[{i}] needs string `from` and `value`"
            ));
        };
        let role = match from {
            "human" | "user" => "user",
            "gpt" | "assistant" | "chatgpt" | "bing" | "bard" => "assistant",
            "system" => "system",
            "tool" | "function" | "observation" => "tool",
            other => {
                return Err(format!(
                    "conversations[{i}].from `{other}` is not a known role"
                ))
            }
        };
        let mut m = Map::new();
        m.insert("role".into(), Value::String(role.into()));
        m.insert("content".into(), Value::String(value.into()));
        out.push(Value::Object(m));
    }
    // The trailing assistant turn is what we generate (with `whole`, it is regenerated
    // like every other assistant turn, so it stays).
    if !whole
        && out
            .last()
            .and_then(|m| m.get("role"))
            .and_then(|r| r.as_str())
            == Some("assistant")
    {
        out.pop();
    }
    check_messages(&Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(text: &str) -> String {
        parse_row("d", 0, text).unwrap_err()
    }

    /// `prompt`, `messages` and ShareGPT `conversations` rows parse; the trailing assistant
    /// turn is dropped.
    #[test]
    fn the_three_shapes_parse() {
        let r = parse_row("d", 3, r#"{"prompt": "hi", "id": 7}"#).unwrap();
        assert_eq!((r.id.as_str(), r.row), ("7", 3));
        let r = parse_row(
            "d",
            0,
            r#"{"messages": [{"role": "user", "content": "x"}]}"#,
        )
        .unwrap();
        assert!(matches!(r.input, Input::Messages(_)));
        let r = parse_row(
            "d",
            0,
            r#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}"#,
        )
        .unwrap();
        let Input::Messages(m) = r.input else {
            panic!()
        };
        assert_eq!(
            m.as_array().unwrap().len(),
            2,
            "trailing assistant turn dropped"
        );
        assert_eq!(m[1]["role"], "user");
    }

    /// A derived id depends on the content and the dataset name, not on the row or other
    /// keys.
    #[test]
    fn derived_ids_are_stable_and_content_based() {
        let a = parse_row("d", 0, r#"{"prompt": "hi"}"#).unwrap();
        let b = parse_row("d", 9, r#"{"prompt": "hi", "other": 1}"#).unwrap();
        let c = parse_row("e", 0, r#"{"prompt": "hi"}"#).unwrap();
        assert_eq!(a.id, b.id);
        assert_eq!(a.hash, b.hash);
        assert_ne!(a.id, c.id);
    }

    /// A batch row is a row under its `custom_id` with its body's sampling, which is part
    /// of its content; a bad one is rejected naming the key, with its custom_id; a plain
    /// row's id and hash do not change.
    #[test]
    fn batch_rows_parse_with_their_custom_id() {
        let p = Parser::new(Path::new("in.jsonl"), "d").samples(2);
        let line = |s: &str| RawEntry {
            row: 4,
            raw: Raw::Line(s.as_bytes().to_vec()),
        };
        let chat = |extra: &str| {
            format!(
                r#"{{"custom_id": "c7", "method": "POST", "url": "/v1/chat/completions", "body": {{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}}}"#
            )
        };
        let Entry::Row(a) = p.parse(line(&chat(r#", "max_tokens": 5, "n": 2"#))) else {
            panic!("a good batch row")
        };
        assert_eq!(a.id, "c7");
        assert!(matches!(a.input, Input::Messages(_)));
        assert_eq!(a.sampling.as_ref().unwrap().max_tokens, Some(5));
        let Entry::Row(b) = p.parse(line(&chat(r#", "max_tokens": 6"#))) else {
            panic!("a good batch row")
        };
        assert_ne!(a.hash, b.hash, "another max_tokens is another request");
        let Entry::Row(c) = p.parse(line(&chat(""))) else {
            panic!("a good batch row")
        };
        assert!(c.sampling.is_none());
        let plain = parse_row(
            "d",
            4,
            r#"{"id": "c7", "messages": [{"role": "user", "content": "hi"}]}"#,
        )
        .unwrap();
        assert_eq!((plain.id.as_str(), plain.hash), ("c7", c.hash));
        let Entry::Rejected(r) = p.parse(line(&chat(r#", "n": 3"#))) else {
            panic!("n must be the dataset's samples")
        };
        assert_eq!((r.line, r.id.as_deref()), (5, Some("c7")));
        assert!(r.reason.contains("`body.n`"), "{}", r.reason);
    }

    /// Each kind of bad row is rejected with a reason that names the problem.
    #[test]
    fn bad_rows_say_why() {
        assert!(reason("{not json").contains("not valid JSON"));
        assert!(reason(r#"{"text": "x"}"#).contains("none of"));
        assert!(reason(r#"{"prompt": "x", "messages": []}"#).contains("several"));
        assert!(reason(r#"{"prompt": 3}"#).contains("must be a string"));
        assert!(reason(r#"{"prompt": "  "}"#).contains("empty"));
        assert!(reason(r#"{"prompt": "x", "id": [1]}"#).contains("`id`"));
        assert!(reason(r#"[1]"#).contains("object"));
    }
}
