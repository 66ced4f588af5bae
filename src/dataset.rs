//! Prompt files → rows (SPEC §3), streamed: never the whole file in memory.
//!
//! Reads `.jsonl` and `.jsonl.zst` line by line. A row carries exactly one of `prompt`,
//! `messages` or `conversations` (ShareGPT, converted to messages, a trailing assistant
//! turn dropped) and optionally an `id`. A bad row becomes a [`Rejection`] naming its line
//! and reason; only a file that cannot be opened or decoded is an error.
//!
//! Invariants: `row` is the 0-based line index, so it is stable when lines are appended;
//! the same content gives the same [`Row::hash`] and the same derived id in every run.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Longest line accepted; longer lines are rejected without being held in memory.
pub const MAX_LINE_BYTES: usize = 32 << 20;

/// A prompt file that cannot be read at all (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot open dataset file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read dataset file {path} at line {line}: {source}")]
    Read {
        path: PathBuf,
        line: u64,
        source: std::io::Error,
    },
    #[error("dataset file {path}: unsupported format (use .jsonl or .jsonl.zst)")]
    Format { path: PathBuf },
}

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
    /// 0-based line index in the file.
    pub row: u64,
    pub id: String,
    pub input: Input,
    /// Content fingerprint: detects a row that changed between runs.
    pub hash: [u8; 16],
}

/// A row that will not be generated, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rejection {
    pub file: String,
    /// 1-based line number, as editors show it.
    pub line: u64,
    pub row: u64,
    pub reason: String,
}

/// A line of a dataset file, parsed.
#[derive(Debug)]
pub enum Entry {
    Row(Row),
    Rejected(Rejection),
}

/// Streams entries from a dataset file.
pub struct DatasetReader {
    path: PathBuf,
    dataset: String,
    reader: Box<dyn BufRead + Send>,
    line: u64,
    buf: Vec<u8>,
}

impl DatasetReader {
    /// Opens `path` for dataset `dataset` (its name seeds derived ids).
    pub fn open(path: &Path, dataset: &str) -> Result<Self, DatasetError> {
        let name = path.to_string_lossy();
        let file = std::fs::File::open(path).map_err(|source| DatasetError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let reader: Box<dyn BufRead + Send> = if name.ends_with(".jsonl.zst")
            || name.ends_with(".zst")
        {
            let dec =
                zstd::stream::read::Decoder::new(file).map_err(|source| DatasetError::Open {
                    path: path.to_path_buf(),
                    source,
                })?;
            Box::new(BufReader::with_capacity(1 << 16, dec))
        } else if name.ends_with(".jsonl") || name.ends_with(".json") || name.ends_with(".ndjson") {
            Box::new(BufReader::with_capacity(1 << 16, file))
        } else {
            return Err(DatasetError::Format {
                path: path.to_path_buf(),
            });
        };
        Ok(Self {
            path: path.to_path_buf(),
            dataset: dataset.to_string(),
            reader,
            line: 0,
            buf: Vec::new(),
        })
    }

    /// Lines read so far.
    pub fn lines_read(&self) -> u64 {
        self.line
    }

    /// The next entry, `Ok(None)` at the end of the file. Blank lines are skipped.
    pub fn next_entry(&mut self) -> Result<Option<Entry>, DatasetError> {
        loop {
            self.buf.clear();
            let (n, too_long) = read_line_capped(&mut self.reader, &mut self.buf, MAX_LINE_BYTES)
                .map_err(|source| DatasetError::Read {
                path: self.path.clone(),
                line: self.line + 1,
                source,
            })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            let row = self.line - 1;
            if too_long {
                return Ok(Some(self.reject(
                    row,
                    format!("line longer than {} MiB", MAX_LINE_BYTES >> 20),
                )));
            }
            let text = match std::str::from_utf8(&self.buf) {
                Ok(t) => t.trim(),
                Err(e) => {
                    return Ok(Some(self.reject(
                        row,
                        format!("invalid UTF-8 at byte {}", e.valid_up_to()),
                    )))
                }
            };
            if text.is_empty() {
                continue;
            }
            return Ok(Some(match parse_row(&self.dataset, row, text) {
                Ok(r) => Entry::Row(r),
                Err(reason) => self.reject(row, reason),
            }));
        }
    }

    fn reject(&self, row: u64, reason: String) -> Entry {
        Entry::Rejected(Rejection {
            file: self.path.display().to_string(),
            line: row + 1,
            row,
            reason,
        })
    }
}

/// Reads one line into `buf`, keeping at most `cap` bytes; returns (bytes consumed,
/// whether the line was longer than `cap`). The rest of a long line is skipped unread.
fn read_line_capped(
    r: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<(usize, bool)> {
    let mut consumed = 0;
    let mut too_long = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok((consumed, too_long));
        }
        let (take, found) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        if !too_long {
            if buf.len() + take > cap + 1 {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(&avail[..take]);
            }
        }
        r.consume(take);
        consumed += take;
        if found {
            return Ok((consumed, too_long));
        }
    }
}

/// Parses one JSON line into a row, or the reason it is rejected.
pub fn parse_row(dataset: &str, row: u64, text: &str) -> Result<Row, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(obj) = v else {
        return Err("a row must be a JSON object".into());
    };
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
        ["conversations"] => Input::Messages(convert_sharegpt(&obj["conversations"])?),
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
    let canonical = serde_json::to_string(&content).map_err(|e| e.to_string())?;
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
        hash,
    })
}

fn type_name(v: &Value) -> &'static str {
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

fn convert_sharegpt(v: &Value) -> Result<Value, String> {
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
    // The trailing assistant turn is what we generate.
    if out
        .last()
        .and_then(|m| m.get("role"))
        .and_then(|r| r.as_str())
        == Some("assistant")
    {
        out.pop();
    }
    check_messages(&Value::Array(out))
}

/// Total size of a readable source, for progress of the enqueue step.
pub fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Reads a whole small file through the dataset decoder (tests, examples).
pub fn read_all(path: &Path, dataset: &str) -> Result<Vec<Entry>, DatasetError> {
    let mut r = DatasetReader::open(path, dataset)?;
    let mut out = Vec::new();
    while let Some(e) = r.next_entry()? {
        out.push(e);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(text: &str) -> String {
        parse_row("d", 0, text).unwrap_err()
    }

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

    #[test]
    fn derived_ids_are_stable_and_content_based() {
        let a = parse_row("d", 0, r#"{"prompt": "hi"}"#).unwrap();
        let b = parse_row("d", 9, r#"{"prompt": "hi", "other": 1}"#).unwrap();
        let c = parse_row("e", 0, r#"{"prompt": "hi"}"#).unwrap();
        assert_eq!(a.id, b.id);
        assert_eq!(a.hash, b.hash);
        assert_ne!(a.id, c.id);
    }

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

    #[test]
    fn long_lines_and_bad_utf8_are_rejected_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        let mut data = b"{\"prompt\": \"a\"}\n{\"prompt\": \"\xff\"}\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
        data.extend_from_slice(b"\n\n{\"prompt\": \"b\"}\n");
        std::fs::write(&p, data).unwrap();
        let entries = read_all(&p, "d").unwrap();
        let kinds: Vec<String> = entries
            .iter()
            .map(|e| match e {
                Entry::Row(r) => format!("row{}", r.row),
                Entry::Rejected(j) => {
                    format!("rej{}:{}", j.line, j.reason.split(' ').next().unwrap())
                }
            })
            .collect();
        assert_eq!(kinds, ["row0", "rej2:invalid", "rej3:line", "row4"]);
    }

    #[test]
    fn zstd_files_stream() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl.zst");
        let raw = b"{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n";
        std::fs::write(&p, zstd::encode_all(&raw[..], 3).unwrap()).unwrap();
        assert_eq!(read_all(&p, "d").unwrap().len(), 2);
    }
}
