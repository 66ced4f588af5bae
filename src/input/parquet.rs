//! Parquet prompt files, read one row group at a time with only the known columns decoded.
//!
//! Invariant: a Parquet row becomes the JSON object a JSONL line would hold (nulls left
//! out, `messages` / `conversations` / `tools` JSON text decoded), so both formats parse
//! alike.
//!
//! Memory is bounded whatever the file holds (`super::limits`): the footer's size is
//! checked before it is read; every page header of a row group's columns is read (with
//! bounded allocations) and checked before `parquet` decompresses anything — each page at
//! most [`MAX_PAGE_BYTES`] decompressed, each column at most [`MAX_GROUP_VALUES`] values
//! in the group, no `DELTA_BYTE_ARRAY` strings (whose decoded size only decoding shows);
//! strings are decoded as views into their pages, so a dictionary string repeated in every
//! row is held once; a batch holds about [`BATCH_VALUES`] values of a column; and a row's
//! cells are measured before they are copied into JSON (past [`MAX_ROW_BYTES`] or
//! [`MAX_ROW_VALUES`] the row is rejected).

use super::dataset::DatasetError;
use super::limits::{
    size, LimitError, BATCH_VALUES, EXPANSION_FLOOR, MAX_EXPANSION, MAX_FOOTER_BYTES,
    MAX_GROUP_VALUES, MAX_PAGE_BYTES, MAX_ROW_BYTES, MAX_ROW_VALUES,
};
use super::row::{Raw, RawEntry};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Field, Fields, Schema};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use serde_json::{Map, Value};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Rows decoded at a time from a Parquet row group, at most.
const PARQUET_BATCH_ROWS: usize = 1024;

/// The Parquet columns read; any other column is ignored (never decoded).
const PARQUET_COLUMNS: [&str; 5] = ["prompt", "messages", "conversations", "id", "tools"];

/// Most bytes of one page header (its statistics included).
const MAX_PAGE_HEADER_BYTES: usize = 1 << 20;

/// A Parquet file read one row group at a time, [`PARQUET_BATCH_ROWS`] rows per batch,
/// with only the known columns projected.
pub(super) struct ParquetSource {
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
    /// The file's size, and the bytes its rows decoded to so far (held to
    /// [`MAX_EXPANSION`] times the size past [`EXPANSION_FLOOR`]).
    file_len: u64,
    decoded: u64,
}

impl ParquetSource {
    pub(super) fn open(path: &Path, file: std::fs::File) -> Result<Self, DatasetError> {
        let err = |detail: String| DatasetError::Parquet {
            path: path.to_path_buf(),
            detail,
        };
        let file_len = file
            .metadata()
            .map_err(|e| err(format!("cannot read its size: {e}")))?
            .len();
        let footer =
            footer_length(&file).map_err(|e| err(format!("not a readable Parquet file: {e}")))?;
        if footer > MAX_FOOTER_BYTES {
            return Err(LimitError {
                path: path.to_path_buf(),
                what: format!(
                    "its footer (metadata) is {}, over the {} limit",
                    size(footer),
                    size(MAX_FOOTER_BYTES)
                ),
            }
            .into());
        }
        let meta = ArrowReaderMetadata::load(&file, Default::default())
            .map_err(|e| err(format!("not a readable Parquet file: {e}")))?;
        // Strings as views into their pages: a dictionary string is held once, however
        // many rows repeat it.
        let viewed = Arc::new(Schema::new_with_metadata(
            meta.schema()
                .fields()
                .iter()
                .map(|f| Arc::new(as_views(f)))
                .collect::<Fields>(),
            meta.schema().metadata().clone(),
        ));
        let meta = ArrowReaderMetadata::try_new(
            meta.metadata().clone(),
            ArrowReaderOptions::new().with_schema(viewed),
        )
        .map_err(|e| err(format!("cannot read its columns: {e}")))?;
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
            file_len,
            decoded: 0,
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
            let rows = self.check_group(self.next_group)?;
            let file = self.file.try_clone().map_err(|source| DatasetError::Read {
                path: self.path.clone(),
                line: self.row + 1,
                source,
            })?;
            let reader =
                ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.meta.clone())
                    .with_row_groups(vec![self.next_group])
                    .with_projection(self.mask.clone())
                    .with_batch_size(rows)
                    .build()
                    .map_err(|e| {
                        self.error(format!("cannot read row group {}: {e}", self.next_group))
                    })?;
            self.next_group += 1;
            self.reader = Some(reader);
        }
    }

    /// Checks every page header of row group `g`'s projected columns before anything of
    /// it is decompressed; returns the rows to decode per batch (about [`BATCH_VALUES`]
    /// values of its widest column).
    fn check_group(&self, g: usize) -> Result<usize, DatasetError> {
        let group = self.meta.metadata().row_group(g);
        let rows = u64::try_from(group.num_rows()).unwrap_or(0).max(1);
        let mut widest = 1u64;
        for (i, col) in group.columns().iter().enumerate() {
            if !self.mask.leaf_included(i) {
                continue;
            }
            let limit = |what: String| -> DatasetError {
                LimitError {
                    path: self.path.clone(),
                    what: format!(
                        "row group {g}, column `{}`: {what}",
                        col.column_path().string()
                    ),
                }
                .into()
            };
            // `byte_range` panics on a negative offset or size: refused here first.
            let start = col
                .dictionary_page_offset()
                .unwrap_or(col.data_page_offset());
            let (Ok(start), Ok(len)) = (u64::try_from(start), u64::try_from(col.compressed_size()))
            else {
                return Err(self.error(format!(
                    "row group {g}, column `{}`: a negative offset or size in the footer",
                    col.column_path().string()
                )));
            };
            let values = scan_pages(&self.file, start, len).map_err(|e| match e {
                PageFault::Limit(what) => limit(what),
                PageFault::Corrupt(what) => self.error(format!(
                    "row group {g}, column `{}`: {what}",
                    col.column_path().string()
                )),
            })?;
            if values > MAX_GROUP_VALUES {
                return Err(limit(format!(
                    "{values} values, over the limit of {MAX_GROUP_VALUES} per column and row group (rewrite the file with smaller row groups, e.g. pyarrow's row_group_size)"
                )));
            }
            widest = widest.max(values.div_ceil(rows));
        }
        Ok(usize::try_from(BATCH_VALUES / widest)
            .unwrap_or(PARQUET_BATCH_ROWS)
            .clamp(1, PARQUET_BATCH_ROWS))
    }

    /// The next row, `Ok(None)` after the last row group.
    pub(super) fn next_row(&mut self) -> Result<Option<RawEntry>, DatasetError> {
        loop {
            if let Some(b) = &self.batch {
                if self.pos < b.num_rows() {
                    let i = self.pos;
                    self.pos += 1;
                    let row = self.row;
                    self.row += 1;
                    let (raw, bytes) = row_object(&self.names, b, i);
                    self.decoded += bytes;
                    if self.decoded > EXPANSION_FLOOR
                        && self.decoded / self.file_len.max(1) > MAX_EXPANSION
                    {
                        return Err(LimitError {
                            path: self.path.clone(),
                            what: format!(
                                "row {row}: its rows decoded to {} from {}, more than {MAX_EXPANSION}× its size on disk (a decompression bomb, or data no real dataset compresses to)",
                                size(self.decoded),
                                size(self.file_len)
                            ),
                        }
                        .into());
                    }
                    return Ok(Some(RawEntry { row, raw }));
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

/// The length of a Parquet file's footer (its metadata), from the last 8 bytes.
fn footer_length(mut file: &std::fs::File) -> std::io::Result<u64> {
    let mut tail = [0u8; 8];
    file.seek(SeekFrom::End(-8))?;
    file.read_exact(&mut tail)?;
    let t = parquet::file::metadata::FooterTail::try_new(&tail)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(t.metadata_length() as u64)
}

/// Why a column chunk's pages are refused.
enum PageFault {
    /// Past a limit.
    Limit(String),
    /// Not a sound column chunk.
    Corrupt(String),
}

/// Reads the page headers of the column chunk at `start..start + len` and checks each
/// against the limits; returns the chunk's values (data pages' `num_values`).
fn scan_pages(file: &std::fs::File, start: u64, len: u64) -> Result<u64, PageFault> {
    use parquet_format_safe::thrift::protocol::TCompactInputProtocol;
    use parquet_format_safe::{Encoding, PageHeader, PageType};
    let corrupt = |e: &dyn std::fmt::Display| PageFault::Corrupt(format!("bad page header: {e}"));
    let mut f = file.try_clone().map_err(|e| corrupt(&e))?;
    let (mut at, end) = (start, start.saturating_add(len));
    let mut values = 0u64;
    while at < end {
        f.seek(SeekFrom::Start(at)).map_err(|e| corrupt(&e))?;
        let mut counted = CountingRead {
            inner: std::io::BufReader::with_capacity(4096, (&mut f).take(end - at)),
            read: 0,
        };
        let header = {
            let mut prot = TCompactInputProtocol::new(&mut counted, MAX_PAGE_HEADER_BYTES);
            PageHeader::read_from_in_protocol(&mut prot).map_err(|e| corrupt(&e))?
        };
        let compressed = u64::try_from(header.compressed_page_size)
            .map_err(|_| corrupt(&"negative compressed size"))?;
        let uncompressed = u64::try_from(header.uncompressed_page_size)
            .map_err(|_| corrupt(&"negative uncompressed size"))?;
        if uncompressed > MAX_PAGE_BYTES {
            return Err(PageFault::Limit(format!(
                "a page of {} decompressed, over the {} limit",
                size(uncompressed),
                size(MAX_PAGE_BYTES)
            )));
        }
        let (n, encoding) = if header.type_ == PageType::DATA_PAGE {
            let h = header
                .data_page_header
                .as_ref()
                .ok_or_else(|| corrupt(&"data page without its header"))?;
            (h.num_values, h.encoding)
        } else if header.type_ == PageType::DATA_PAGE_V2 {
            let h = header
                .data_page_header_v2
                .as_ref()
                .ok_or_else(|| corrupt(&"data page without its header"))?;
            (h.num_values, h.encoding)
        } else {
            (0, Encoding::PLAIN)
        };
        if encoding == Encoding::DELTA_BYTE_ARRAY {
            return Err(PageFault::Limit(
                "DELTA_BYTE_ARRAY pages, whose decoded size cannot be checked before decoding (write the file with PLAIN or dictionary encoding, pyarrow's default)".into(),
            ));
        }
        values += u64::try_from(n).map_err(|_| corrupt(&"negative value count"))?;
        at = at.saturating_add(counted.read).saturating_add(compressed);
        if at > end {
            return Err(corrupt(&"a page runs past its column chunk"));
        }
    }
    Ok(values)
}

/// A reader counting the bytes read through it (a page header's length).
struct CountingRead<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for CountingRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

/// `f` with its strings (also inside lists and structs, and dictionary-encoded ones) read
/// as views: each cell points into the page or dictionary it came from.
fn as_views(f: &Field) -> Field {
    let t = match f.data_type() {
        DataType::Utf8 | DataType::LargeUtf8 => DataType::Utf8View,
        DataType::Dictionary(_, v) if matches!(**v, DataType::Utf8 | DataType::LargeUtf8) => {
            DataType::Utf8View
        }
        DataType::List(item) => DataType::List(Arc::new(as_views(item))),
        DataType::LargeList(item) => DataType::LargeList(Arc::new(as_views(item))),
        DataType::Struct(fields) => {
            DataType::Struct(fields.iter().map(|c| Arc::new(as_views(c))).collect())
        }
        other => other.clone(),
    };
    f.clone().with_data_type(t)
}

/// The size of cell `i` of `a` once in JSON: (bytes, values); strings by their length,
/// every value 8 bytes besides. Stops counting past the row limits.
fn cell_size(a: &dyn Array, i: usize, acc: &mut (u64, u64)) {
    if acc.0 > MAX_ROW_BYTES as u64 || acc.1 > MAX_ROW_VALUES as u64 {
        return;
    }
    acc.1 += 1;
    acc.0 += 8;
    if a.is_null(i) {
        return;
    }
    match a.data_type() {
        DataType::Utf8 => acc.0 += a.as_string::<i32>().value(i).len() as u64,
        DataType::LargeUtf8 => acc.0 += a.as_string::<i64>().value(i).len() as u64,
        DataType::Utf8View => acc.0 += a.as_string_view().value(i).len() as u64,
        DataType::List(_) => list_size(a.as_list::<i32>().value(i).as_ref(), acc),
        DataType::LargeList(_) => list_size(a.as_list::<i64>().value(i).as_ref(), acc),
        DataType::Struct(_) => {
            for c in a.as_struct().columns() {
                cell_size(c.as_ref(), i, acc);
            }
        }
        DataType::Dictionary(_, _) => {
            if let Some(d) = a.as_any_dictionary_opt() {
                if let Some(k) = cell_json(d.keys(), i).ok().and_then(|k| k.as_u64()) {
                    if (k as usize) < d.values().len() {
                        cell_size(d.values().as_ref(), k as usize, acc);
                    }
                }
            }
        }
        _ => {}
    }
}

fn list_size(items: &dyn Array, acc: &mut (u64, u64)) {
    for j in 0..items.len() {
        cell_size(items, j, acc);
    }
}

/// One Parquet row as the JSON object a JSONL line would hold. String cells of
/// `messages` / `conversations` are JSON text and are decoded. A row whose cells are past
/// the row limits is refused before they are copied.
/// Also returns the row's decoded size in bytes (as far as it was measured).
fn row_object(names: &[String], batch: &RecordBatch, i: usize) -> (Raw, u64) {
    let mut acc = (0u64, 0u64);
    for col in batch.columns() {
        cell_size(col.as_ref(), i, &mut acc);
    }
    if acc.0 > MAX_ROW_BYTES as u64 {
        let why = format!(
            "row is over {} once decoded (the limit of a row)",
            size(MAX_ROW_BYTES as u64)
        );
        return (Raw::Bad(why), acc.0);
    }
    if acc.1 > MAX_ROW_VALUES as u64 {
        let why =
            format!("row has more than {MAX_ROW_VALUES} values once decoded (the limit of a row)");
        return (Raw::Bad(why), acc.0);
    }
    (row_json(names, batch, i), acc.0)
}

/// The JSON object of a row already measured.
fn row_json(names: &[String], batch: &RecordBatch, i: usize) -> Raw {
    let mut obj = Map::new();
    for (name, col) in names.iter().zip(batch.columns()) {
        let v = match cell_json(col.as_ref(), i) {
            Ok(v) => v,
            Err(e) => return Raw::Bad(format!("column `{name}`: {e}")),
        };
        let v = match v {
            Value::String(s)
                if name == "messages" || name == "conversations" || name == "tools" =>
            {
                match super::limits::parse_json_bounded(&s, MAX_ROW_VALUES) {
                    Ok(v) => v,
                    Err(e) => return Raw::Bad(format!("`{name}` is a string but {e}")),
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
