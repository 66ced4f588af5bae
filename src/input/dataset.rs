//! Prompt files → rows (SPEC §3), streamed: never the whole file in memory.
//!
//! Reads `.jsonl` and `.jsonl.zst` line by line, and `.parquet` row group by row group (only
//! the `prompt`, `messages`, `conversations` and `id` columns are decoded, 1024 rows at a
//! time). A row carries exactly one of `prompt`, `messages` or `conversations` (ShareGPT,
//! converted to messages, a trailing assistant turn dropped) and optionally an `id`. A bad
//! row becomes a [`Rejection`] naming its line (or Parquet row) and reason; only a file that
//! cannot be opened or decoded is an error.
//!
//! Reading is split in two so intake can parse in parallel: [`DatasetReader::next_raw`]
//! only cuts the file into [`RawEntry`]s (a line's bytes, or a Parquet row as a JSON
//! object), and [`Parser::parse`] turns one into an [`Entry`] (JSON parsing, shape checks,
//! ids and hashes). [`DatasetReader::next_entry`] does both.
//!
//! Invariants: `row` is the 0-based line index (Parquet: the 0-based row index across row
//! groups), so it is stable when lines (rows) are appended; the same content gives the
//! same [`Row::hash`] and the same derived id in every run, whatever the file format.

use crate::store::queue::ScanMark;
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::hash::Hasher as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use twox_hash::XxHash64;

/// Longest line accepted; longer lines are rejected without being held in memory.
pub const MAX_LINE_BYTES: usize = 32 << 20;

/// Rows decoded at a time from a Parquet row group.
const PARQUET_BATCH_ROWS: usize = 1024;

/// The Parquet columns read; any other column is ignored (never decoded).
const PARQUET_COLUMNS: [&str; 4] = ["prompt", "messages", "conversations", "id"];

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
    #[error("dataset file {path}: unsupported format (use .jsonl, .jsonl.zst or .parquet)")]
    Format { path: PathBuf },
    #[error("dataset file {path}: {detail}")]
    Parquet { path: PathBuf, detail: String },
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
    /// 0-based line index in the file (Parquet: row index).
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
    /// 1-based line number, as editors show it (Parquet: 1-based row number).
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
    dataset: String,
}

impl Parser {
    /// A parser for rows of `path` in dataset `dataset` (its name seeds derived ids).
    pub fn new(path: &Path, dataset: &str) -> Self {
        Self {
            file: path.display().to_string(),
            dataset: dataset.to_string(),
        }
    }

    /// Parses one raw row: a good row, or its rejection.
    pub fn parse(&self, e: RawEntry) -> Entry {
        let row = e.row;
        let res = match e.raw {
            Raw::Bad(reason) => Err(reason),
            Raw::Object(obj) => parse_object(&self.dataset, row, obj),
            Raw::Line(bytes) => match std::str::from_utf8(&bytes) {
                Ok(text) => parse_row(&self.dataset, row, text.trim()),
                Err(e) => Err(format!("invalid UTF-8 at byte {}", e.valid_up_to())),
            },
        };
        match res {
            Ok(r) => Entry::Row(r),
            Err(reason) => Entry::Rejected(self.reject(row, reason)),
        }
    }

    /// A rejection of row `row` of this file.
    pub fn reject(&self, row: u64, reason: String) -> Rejection {
        Rejection {
            file: self.file.clone(),
            line: row + 1,
            row,
            reason,
        }
    }
}

enum Source {
    Lines {
        reader: Box<dyn BufRead + Send>,
        buf: Vec<u8>,
        /// Where the reader stands (bytes consumed, their running xxHash64).
        pos: LinePos,
    },
    Parquet(Box<ParquetSource>),
}

/// Bytes consumed from a line-based file and their running fingerprint.
struct LinePos {
    bytes: u64,
    hasher: XxHash64,
    /// The last byte consumed was a newline (or nothing was consumed): a mark may be taken.
    at_line_end: bool,
}

impl LinePos {
    fn new() -> Self {
        Self {
            bytes: 0,
            hasher: XxHash64::with_seed(0),
            at_line_end: true,
        }
    }
}

/// Streams entries from a dataset file.
pub struct DatasetReader {
    path: PathBuf,
    parser: Parser,
    source: Source,
    /// Lines (Parquet: rows) consumed so far.
    line: u64,
}

impl DatasetReader {
    /// Opens `path` for dataset `dataset` (its name seeds derived ids). The format comes
    /// from the name: `.jsonl` (also `.json`, `.ndjson`), `.jsonl.zst` / `.zst`, `.parquet`.
    pub fn open(path: &Path, dataset: &str) -> Result<Self, DatasetError> {
        let name = path.to_string_lossy();
        let open_err = |source| DatasetError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(open_err)?;
        let source = if name.ends_with(".parquet") {
            Source::Parquet(Box::new(ParquetSource::open(path, file)?))
        } else if name.ends_with(".jsonl.zst") || name.ends_with(".zst") {
            let dec = zstd::stream::read::Decoder::new(file).map_err(open_err)?;
            Source::Lines {
                reader: Box::new(BufReader::with_capacity(1 << 16, dec)),
                buf: Vec::new(),
                pos: LinePos::new(),
            }
        } else if name.ends_with(".jsonl") || name.ends_with(".json") || name.ends_with(".ndjson") {
            Source::Lines {
                // 1 MiB reads: a restart hashes the whole enqueued prefix (4.5 GB at 10 M
                // prompts), and 64 KiB reads cost as much system time as the hashing.
                reader: Box::new(BufReader::with_capacity(1 << 20, file)),
                buf: Vec::new(),
                pos: LinePos::new(),
            }
        } else {
            return Err(DatasetError::Format {
                path: path.to_path_buf(),
            });
        };
        Ok(Self {
            path: path.to_path_buf(),
            parser: Parser::new(path, dataset),
            source,
            line: 0,
        })
    }

    /// Lines (Parquet: rows) read so far.
    pub fn lines_read(&self) -> u64 {
        self.line
    }

    /// Where the reader stands in a line-based file, as a [`ScanMark`]: the lines read so
    /// far, their bytes and fingerprint. `None` for Parquet, or when the last line read has
    /// no newline yet (text appended to it later would change that line).
    pub fn mark(&self) -> Option<ScanMark> {
        match &self.source {
            Source::Lines { pos, .. } if pos.at_line_end => Some(ScanMark {
                lines: self.line,
                bytes: pos.bytes,
                xxh64: pos.hasher.finish(),
            }),
            _ => None,
        }
    }

    /// At the start of a line-based file: reads the first `m.bytes` bytes, hashing them, and
    /// if their xxHash64 is `m.xxh64` stays after them (the next row is line `m.lines`) and
    /// returns `true`. Otherwise (a changed file, a shorter one, Parquet, or not at the
    /// start) starts again from the beginning and returns `false`, so the caller checks
    /// every row as without a mark.
    pub fn skip_prefix(&mut self, m: &ScanMark) -> Result<bool, DatasetError> {
        let Source::Lines { reader, pos, .. } = &mut self.source else {
            return Ok(false);
        };
        if pos.bytes != 0 || self.line != 0 {
            return Ok(false);
        }
        let mut left = m.bytes;
        while left > 0 {
            let avail = match reader.fill_buf() {
                Ok(a) => a,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(DatasetError::Read {
                        path: self.path.clone(),
                        line: 1,
                        source,
                    })
                }
            };
            if avail.is_empty() {
                break;
            }
            let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            pos.hasher.write(&avail[..take]);
            pos.at_line_end = avail[take - 1] == b'\n';
            reader.consume(take);
            pos.bytes += take as u64;
            left -= take as u64;
        }
        if left == 0 && pos.at_line_end && pos.hasher.finish() == m.xxh64 {
            self.line = m.lines;
            return Ok(true);
        }
        *self = DatasetReader::open(&self.path, &self.parser.dataset)?;
        Ok(false)
    }

    /// The parser for this file's raw rows.
    pub fn parser(&self) -> Parser {
        self.parser.clone()
    }

    /// The next entry, `Ok(None)` at the end of the file. Blank lines are skipped.
    pub fn next_entry(&mut self) -> Result<Option<Entry>, DatasetError> {
        Ok(self.next_raw()?.map(|raw| self.parser.parse(raw)))
    }

    /// The next row, unparsed; `Ok(None)` at the end of the file. Blank lines are skipped.
    pub fn next_raw(&mut self) -> Result<Option<RawEntry>, DatasetError> {
        match &mut self.source {
            Source::Parquet(p) => {
                let next = p.next_row()?;
                if let Some(e) = &next {
                    self.line = e.row + 1;
                }
                Ok(next)
            }
            Source::Lines { reader, buf, pos } => loop {
                buf.clear();
                let (n, too_long) = read_line_capped(reader.as_mut(), buf, MAX_LINE_BYTES, pos)
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
                    return Ok(Some(RawEntry {
                        row,
                        raw: Raw::Bad(format!("line longer than {} MiB", MAX_LINE_BYTES >> 20)),
                    }));
                }
                if buf.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(RawEntry {
                    row,
                    raw: Raw::Line(std::mem::take(buf)),
                }));
            },
        }
    }
}

// ---------------------------------------------------------------------------------------
// Parquet
// ---------------------------------------------------------------------------------------

/// A Parquet file read one row group at a time, [`PARQUET_BATCH_ROWS`] rows per batch,
/// with only the known columns projected.
struct ParquetSource {
    path: PathBuf,
    file: std::fs::File,
    meta: ArrowReaderMetadata,
    mask: ProjectionMask,
    /// Names of the projected columns, in the batches' column order.
    names: Vec<String>,
    next_group: usize,
    reader: Option<ParquetRecordBatchReader>,
    batch: Option<RecordBatch>,
    pos: usize,
    row: u64,
}

impl ParquetSource {
    fn open(path: &Path, file: std::fs::File) -> Result<Self, DatasetError> {
        let err = |detail: String| DatasetError::Parquet {
            path: path.to_path_buf(),
            detail,
        };
        let meta = ArrowReaderMetadata::load(&file, Default::default())
            .map_err(|e| err(format!("not a readable Parquet file: {e}")))?;
        let schema = meta.schema().clone();
        let mut roots = Vec::new();
        let mut names = Vec::new();
        for (i, f) in schema.fields().iter().enumerate() {
            if !PARQUET_COLUMNS.contains(&f.name().as_str()) {
                continue;
            }
            if let Err(t) = supported(f.data_type()) {
                return Err(err(format!(
                    "column `{}` has type {t}, which spool cannot read (use strings, integers, lists and structs)",
                    f.name()
                )));
            }
            roots.push(i);
            names.push(f.name().clone());
        }
        if !names
            .iter()
            .any(|n| n == "prompt" || n == "messages" || n == "conversations")
        {
            return Err(err(
                "none of the columns `prompt`, `messages`, `conversations`".into(),
            ));
        }
        // Roots are counted in the Parquet schema, which has the same top-level fields.
        let mask = ProjectionMask::roots(meta.parquet_schema(), roots);
        Ok(Self {
            path: path.to_path_buf(),
            file,
            meta,
            mask,
            names,
            next_group: 0,
            reader: None,
            batch: None,
            pos: 0,
            row: 0,
        })
    }

    fn error(&self, detail: String) -> DatasetError {
        DatasetError::Parquet {
            path: self.path.clone(),
            detail,
        }
    }

    /// The next batch of the current row group, opening the next group when it ends.
    fn next_batch(&mut self) -> Result<Option<RecordBatch>, DatasetError> {
        loop {
            if let Some(r) = &mut self.reader {
                match r.next() {
                    Some(Ok(b)) => return Ok(Some(b)),
                    Some(Err(e)) => {
                        return Err(self.error(format!(
                            "cannot decode row group {}: {e}",
                            self.next_group - 1
                        )))
                    }
                    None => self.reader = None,
                }
            }
            if self.next_group >= self.meta.metadata().num_row_groups() {
                return Ok(None);
            }
            let file = self.file.try_clone().map_err(|source| DatasetError::Read {
                path: self.path.clone(),
                line: self.row + 1,
                source,
            })?;
            let reader =
                ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.meta.clone())
                    .with_row_groups(vec![self.next_group])
                    .with_projection(self.mask.clone())
                    .with_batch_size(PARQUET_BATCH_ROWS)
                    .build()
                    .map_err(|e| {
                        self.error(format!("cannot read row group {}: {e}", self.next_group))
                    })?;
            self.next_group += 1;
            self.reader = Some(reader);
        }
    }

    fn next_row(&mut self) -> Result<Option<RawEntry>, DatasetError> {
        loop {
            if let Some(b) = &self.batch {
                if self.pos < b.num_rows() {
                    let i = self.pos;
                    self.pos += 1;
                    let row = self.row;
                    self.row += 1;
                    return Ok(Some(RawEntry {
                        row,
                        raw: row_object(&self.names, b, i),
                    }));
                }
            }
            self.batch = None;
            self.pos = 0;
            match self.next_batch()? {
                Some(b) => self.batch = Some(b),
                None => return Ok(None),
            }
        }
    }
}

/// Whether spool can turn a column of this type into JSON (`Err` = the type's name).
fn supported(t: &DataType) -> Result<(), String> {
    match t {
        DataType::Null
        | DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Float32
        | DataType::Float64
        | DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Utf8View => Ok(()),
        DataType::List(f) | DataType::LargeList(f) => supported(f.data_type()),
        DataType::Struct(fields) => fields.iter().try_for_each(|f| supported(f.data_type())),
        DataType::Dictionary(_, v) => supported(v),
        other => Err(other.to_string()),
    }
}

/// One Parquet row as the JSON object a JSONL line would hold. String cells of
/// `messages` / `conversations` are JSON text and are decoded.
fn row_object(names: &[String], batch: &RecordBatch, i: usize) -> Raw {
    let mut obj = Map::new();
    for (name, col) in names.iter().zip(batch.columns()) {
        let v = match cell_json(col.as_ref(), i) {
            Ok(v) => v,
            Err(e) => return Raw::Bad(format!("column `{name}`: {e}")),
        };
        let v = match v {
            Value::String(s) if name == "messages" || name == "conversations" => {
                match serde_json::from_str::<Value>(&s) {
                    Ok(v) => v,
                    Err(e) => {
                        return Raw::Bad(format!("`{name}` is a string but not valid JSON: {e}"))
                    }
                }
            }
            v => v,
        };
        if !v.is_null() {
            obj.insert(name.clone(), v);
        }
    }
    Raw::Object(obj)
}

/// Cell `i` of an Arrow array as JSON (struct fields that are null are left out).
fn cell_json(a: &dyn Array, i: usize) -> Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => a.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => a.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => a.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => a.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => a.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => a.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float32 => f64::from(a.as_primitive::<Float32Type>().value(i)).into(),
        DataType::Float64 => a.as_primitive::<Float64Type>().value(i).into(),
        DataType::Utf8 => Value::String(a.as_string::<i32>().value(i).to_owned()),
        DataType::LargeUtf8 => Value::String(a.as_string::<i64>().value(i).to_owned()),
        DataType::Utf8View => Value::String(a.as_string_view().value(i).to_owned()),
        DataType::List(_) => list_json(a.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list_json(a.as_list::<i64>().value(i).as_ref())?,
        DataType::Struct(_) => {
            let s = a.as_struct();
            let mut obj = Map::new();
            for (f, col) in s.fields().iter().zip(s.columns()) {
                let v = cell_json(col.as_ref(), i)?;
                if !v.is_null() {
                    obj.insert(f.name().clone(), v);
                }
            }
            Value::Object(obj)
        }
        DataType::Dictionary(_, _) => {
            let d = a
                .as_any_dictionary_opt()
                .ok_or_else(|| "undecodable dictionary".to_string())?;
            let key = cell_json(d.keys(), i)?
                .as_u64()
                .ok_or_else(|| "dictionary key is not an index".to_string())?;
            cell_json(d.values().as_ref(), key as usize)?
        }
        other => return Err(format!("unsupported type {other}")),
    })
}

fn list_json(items: &dyn Array) -> Result<Value, String> {
    (0..items.len())
        .map(|j| cell_json(items, j))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// Past this length a line buffer grows to the line cap at once (see `read_line_capped`).
const GROW_EXACT_BYTES: usize = 1 << 20;

/// Reads one line into `buf`, keeping at most `cap` bytes; returns (bytes consumed,
/// whether the line was longer than `cap`). The rest of a long line is skipped unread.
fn read_line_capped(
    r: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
    pos: &mut LinePos,
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
        let (take, found) = match memchr::memchr(b'\n', avail) {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        pos.hasher.write(&avail[..take]);
        pos.bytes += take as u64;
        pos.at_line_end = found;
        if !too_long {
            if buf.len() + take > cap + 1 {
                too_long = true;
                // Give the memory back now: the rest of the file is mostly short lines.
                *buf = Vec::new();
            } else {
                if buf.len() + take > buf.capacity() && buf.len() + take > GROW_EXACT_BYTES {
                    // One allocation of the whole cap, not a chain of doublings: an
                    // allocator that copies on realloc would otherwise hold about twice
                    // the line while it grows. Only the pages written count in RSS.
                    buf.reserve_exact(cap + 1 - buf.len());
                }
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
    parse_object(dataset, row, obj)
}

/// Parses one row given as a JSON object (a JSONL line, or a Parquet row).
pub fn parse_object(dataset: &str, row: u64, obj: Map<String, Value>) -> Result<Row, String> {
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
