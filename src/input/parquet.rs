//! Parquet prompt files, read one row group at a time with only the known columns decoded.
//!
//! Invariant: a Parquet row becomes the JSON object a JSONL line would hold (nulls left
//! out, `messages` / `conversations` / `tools` JSON text decoded), so both formats parse
//! alike.

use super::dataset::DatasetError;
use super::row::{Raw, RawEntry};
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
use std::path::{Path, PathBuf};

/// Rows decoded at a time from a Parquet row group.
const PARQUET_BATCH_ROWS: usize = 1024;

/// The Parquet columns read; any other column is ignored (never decoded).
const PARQUET_COLUMNS: [&str; 5] = ["prompt", "messages", "conversations", "id", "tools"];

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
}

impl ParquetSource {
    pub(super) fn open(path: &Path, file: std::fs::File) -> Result<Self, DatasetError> {
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

    /// The next row, `Ok(None)` after the last row group.
    pub(super) fn next_row(&mut self) -> Result<Option<RawEntry>, DatasetError> {
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
            Value::String(s)
                if name == "messages" || name == "conversations" || name == "tools" =>
            {
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
