//! The one shard reader: opens a shard, reads its footer (metadata, row and row-group
//! counts, codecs) and decodes its rows, whole or a few projected columns, batch by batch.
//! `spool show`, `verify`, `export`, the archive's recovery and queue repair all read
//! shards through it.
//!
//! Invariant: rows are only decoded from a shard whose schema [`check_schema`] accepted, so
//! every column has the type [`schema`] gives it and a failed downcast means a bug, not a
//! foreign file.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::{
    Array, ListArray, RecordBatch, StringArray, TimestampMillisecondArray, UInt32Array, UInt64Array,
};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;
use parquet::basic::Compression;
use parquet::file::metadata::ParquetMetaData;

#[cfg(doc)]
use crate::output::schema::schema;
use crate::output::schema::{check_schema, is_appended, ARROW_SCHEMA_KEY};
use crate::output::shard::ShardError;
use crate::prompt::remote::IdsSource;
use crate::store::row::ShardRow;

/// Rows per decoded batch: bounds the memory of one read whatever the shard's size.
const READ_BATCH_ROWS: usize = 1024;

/// An open shard whose footer has been read; rows are decoded by [`ShardReader::batches`].
pub struct ShardReader {
    path: PathBuf,
    builder: ParquetRecordBatchReaderBuilder<File>,
}

impl std::fmt::Debug for ShardReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardReader")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ShardReader {
    /// Opens `path` and reads its footer, whatever its columns (metadata can be read from
    /// any Parquet file).
    pub fn open(path: &Path) -> Result<Self, ShardError> {
        let file = File::open(path).map_err(|e| ShardError::io(path, e))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| ShardError::parquet(path, e))?
            .with_batch_size(READ_BATCH_ROWS);
        Ok(Self {
            path: path.to_path_buf(),
            builder,
        })
    }

    /// Opens `path` and checks its columns are the shard schema, so its rows can be decoded.
    pub fn open_checked(path: &Path) -> Result<Self, ShardError> {
        let reader = Self::open(path)?;
        check_schema(path, reader.builder.schema())?;
        Ok(reader)
    }

    /// The shard file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Key-value metadata as given to the writer (the `ARROW:schema` entry parquet-rs adds
    /// is left out).
    pub fn metadata(&self) -> Vec<(String, String)> {
        caller_metadata(self.builder.metadata())
    }

    /// Footer facts: rows, row groups, codecs and metadata, without decoding a row.
    pub fn info(&self) -> ShardInfo {
        let meta = self.builder.metadata();
        let rows = u64::try_from(meta.file_metadata().num_rows()).unwrap_or_default();
        let all_zstd = meta
            .row_groups()
            .iter()
            .flat_map(|rg| rg.columns())
            .all(|c| matches!(c.compression(), Compression::ZSTD(_)));
        ShardInfo {
            rows,
            row_groups: meta.num_row_groups(),
            all_zstd,
            metadata: caller_metadata(meta),
        }
    }

    /// The rows as record batches of at most [`READ_BATCH_ROWS`] rows, decoding only the
    /// named `columns` (in schema order) or, with `None`, all of them. Columns are found by
    /// name in the batches ([`column`]).
    pub fn batches(self, columns: Option<&[&str]>) -> Result<Batches, ShardError> {
        let path = self.path;
        let mut builder = self.builder;
        if let Some(columns) = columns {
            let schema = builder.schema().clone();
            let roots = columns
                .iter()
                // A shard written before an appended column lacks it: it reads as absent
                // ([`opt_column`]).
                .filter(|c| !is_appended(c) || schema.index_of(c).is_ok())
                .map(|c| {
                    builder
                        .schema()
                        .index_of(c)
                        .map_err(|e| ShardError::arrow(&path, e))
                })
                .collect::<Result<Vec<usize>, _>>()?;
            let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
            builder = builder.with_projection(mask);
        }
        let inner = builder.build().map_err(|e| ShardError::parquet(&path, e))?;
        Ok(Batches { path, inner })
    }
}

/// A shard's decoded record batches; each error names the file.
pub struct Batches {
    path: PathBuf,
    inner: ParquetRecordBatchReader,
}

impl Iterator for Batches {
    type Item = Result<RecordBatch, ShardError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.inner
            .next()
            .map(|b| b.map_err(|e| ShardError::arrow(&self.path, e)))
    }
}

/// Column `name` of a decoded shard batch as its Arrow array type.
pub fn column<'a, T: 'static>(
    path: &Path,
    batch: &'a RecordBatch,
    name: &str,
) -> Result<&'a T, ShardError> {
    batch
        .column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<T>())
        .ok_or_else(|| {
            ShardError::schema(
                path,
                format!(
                    "column `{name}` does not decode as {}",
                    std::any::type_name::<T>()
                ),
            )
        })
}

/// Column `name` as its Arrow array type, or None when the shard has no such column (an
/// appended one in a shard written before it, or not projected).
pub fn opt_column<'a, T: 'static>(
    path: &Path,
    batch: &'a RecordBatch,
    name: &str,
) -> Result<Option<&'a T>, ShardError> {
    match batch.column_by_name(name) {
        None => Ok(None),
        Some(_) => column::<T>(path, batch, name).map(Some),
    }
}

/// Row `i` of an optional text column that may be absent.
pub fn text_at(a: Option<&StringArray>, i: usize) -> Option<String> {
    a.and_then(|a| opt_string(a, i))
}

/// The token ids of row `i` of a `list<uint32>` column; `None` when the list is null.
pub fn ids_at(path: &Path, list: &ListArray, i: usize) -> Result<Option<Vec<u32>>, ShardError> {
    if list.is_null(i) {
        return Ok(None);
    }
    let values = list.value(i);
    let ids = values
        .as_any()
        .downcast_ref::<UInt32Array>()
        .ok_or_else(|| ShardError::schema(path, "token id list items are not uint32".into()))?;
    Ok(Some(ids.values().to_vec()))
}

fn opt_string(a: &StringArray, i: usize) -> Option<String> {
    a.is_valid(i).then(|| a.value(i).to_owned())
}

/// Appends the rows of one decoded batch (every column projected) to `out`.
pub fn batch_to_rows(
    path: &Path,
    batch: &RecordBatch,
    out: &mut Vec<ShardRow>,
) -> Result<(), ShardError> {
    let id = column::<StringArray>(path, batch, "id")?;
    let dataset = column::<StringArray>(path, batch, "dataset")?;
    let row = column::<UInt64Array>(path, batch, "row")?;
    let prompt = column::<StringArray>(path, batch, "prompt")?;
    let messages = column::<StringArray>(path, batch, "messages")?;
    let prompt_ids = column::<ListArray>(path, batch, "prompt_token_ids")?;
    let completion = column::<StringArray>(path, batch, "completion")?;
    let completion_ids = column::<ListArray>(path, batch, "completion_token_ids")?;
    let prompt_tokens = column::<UInt32Array>(path, batch, "prompt_tokens")?;
    let completion_tokens = column::<UInt32Array>(path, batch, "completion_tokens")?;
    let finish_reason = column::<StringArray>(path, batch, "finish_reason")?;
    let model = column::<StringArray>(path, batch, "model")?;
    let attempts = column::<UInt32Array>(path, batch, "attempts")?;
    let latency = column::<UInt32Array>(path, batch, "latency_ms")?;
    let ttft = column::<UInt32Array>(path, batch, "ttft_ms")?;
    let completed_at = column::<TimestampMillisecondArray>(path, batch, "completed_at")?;
    let sample = opt_column::<UInt32Array>(path, batch, "sample")?;
    let turn = opt_column::<UInt32Array>(path, batch, "turn")?;
    let text = |name| opt_column::<StringArray>(path, batch, name);
    let (reasoning, tool_calls, tools, sampling, partial) = (
        text("reasoning")?,
        text("tool_calls")?,
        text("tools")?,
        text("sampling")?,
        text("partial")?,
    );
    let source = text("prompt_ids_source")?;
    out.reserve(batch.num_rows());
    for i in 0..batch.num_rows() {
        out.push(ShardRow {
            id: id.value(i).to_owned(),
            dataset: dataset.value(i).to_owned(),
            row: row.value(i),
            prompt: prompt.value(i).to_owned(),
            messages: opt_string(messages, i),
            prompt_token_ids: ids_at(path, prompt_ids, i)?,
            completion: completion.value(i).to_owned(),
            completion_token_ids: ids_at(path, completion_ids, i)?,
            prompt_tokens: prompt_tokens.value(i),
            completion_tokens: completion_tokens.value(i),
            finish_reason: finish_reason.value(i).to_owned(),
            model: model.value(i).to_owned(),
            attempts: attempts.value(i),
            latency_ms: latency.value(i),
            ttft_ms: ttft.is_valid(i).then(|| ttft.value(i)),
            completed_at_ms: completed_at.value(i),
            sample: sample.map_or(0, |a| a.value(i)),
            turn: turn.map_or(0, |a| a.value(i)),
            reasoning: text_at(reasoning, i),
            tool_calls: text_at(tool_calls, i),
            tools: text_at(tools, i),
            sampling: text_at(sampling, i),
            partial: text_at(partial, i),
            prompt_ids_source: match text_at(source, i) {
                None => None,
                Some(s) => Some(IdsSource::parse(&s).ok_or_else(|| {
                    ShardError::schema(
                        path,
                        format!(
                            "column `prompt_ids_source` holds {s:?} (client or server expected)"
                        ),
                    )
                })?),
            },
        });
    }
    Ok(())
}

/// Reads a whole shard back (`spool show`, tests), after checking its schema.
pub fn read_rows(path: &Path) -> Result<Vec<ShardRow>, ShardError> {
    let mut rows = Vec::new();
    for batch in ShardReader::open_checked(path)?.batches(None)? {
        batch_to_rows(path, &batch?, &mut rows)?;
    }
    Ok(rows)
}

/// Only the (id, row) pairs, cheaply (the two columns are projected; prompts and
/// completions are not decoded). Crash recovery uses it to adopt a shard renamed before
/// the queue recorded it.
pub fn read_keys(path: &Path) -> Result<Vec<(String, u64)>, ShardError> {
    let mut keys = Vec::new();
    for batch in ShardReader::open_checked(path)?.batches(Some(&["id", "row"]))? {
        let batch = batch?;
        let ids = column::<StringArray>(path, &batch, "id")?;
        let rows = column::<UInt64Array>(path, &batch, "row")?;
        keys.extend(
            ids.iter()
                .zip(rows.iter())
                .map(|(id, row)| (id.unwrap_or_default().to_owned(), row.unwrap_or_default())),
        );
    }
    Ok(keys)
}

/// One shard row's key and token counts, without its text or ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCounts {
    pub row: u64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// The rows of a shard with their token counts (three projected columns): queue repair
/// rebuilds its counters from them without decoding completions.
pub fn read_counts(path: &Path) -> Result<Vec<RowCounts>, ShardError> {
    let columns: &[&str] = &["row", "prompt_tokens", "completion_tokens"];
    let mut out = Vec::new();
    for batch in ShardReader::open_checked(path)?.batches(Some(columns))? {
        let batch = batch?;
        let rows = column::<UInt64Array>(path, &batch, "row")?;
        let prompt = column::<UInt32Array>(path, &batch, "prompt_tokens")?;
        let completion = column::<UInt32Array>(path, &batch, "completion_tokens")?;
        for i in 0..batch.num_rows() {
            out.push(RowCounts {
                row: rows.value(i),
                prompt_tokens: prompt.value(i),
                completion_tokens: completion.value(i),
            });
        }
    }
    Ok(out)
}

fn caller_metadata(meta: &ParquetMetaData) -> Vec<(String, String)> {
    meta.file_metadata()
        .key_value_metadata()
        .map(|kvs| {
            kvs.iter()
                .filter(|kv| kv.key != ARROW_SCHEMA_KEY)
                .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

/// Key-value metadata of a shard file, as given to the writer (see
/// [`ShardReader::metadata`]); the schema is not checked.
pub fn read_metadata(path: &Path) -> Result<Vec<(String, String)>, ShardError> {
    Ok(ShardReader::open(path)?.metadata())
}

/// What `spool verify` needs to know about a shard without decoding its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardInfo {
    /// Rows, from the footer.
    pub rows: u64,
    /// Row groups.
    pub row_groups: usize,
    /// Whether every column chunk is zstd-compressed.
    pub all_zstd: bool,
    /// Caller metadata, as [`read_metadata`].
    pub metadata: Vec<(String, String)>,
}

/// Footer facts of a shard, after checking its schema.
pub fn read_info(path: &Path) -> Result<ShardInfo, ShardError> {
    Ok(ShardReader::open_checked(path)?.info())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::writer::tests::{sample, write};
    use arrow_array::ArrayRef;
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use proptest::prelude::*;
    use std::fs;
    use std::sync::Arc;

    /// Rows with nulls, empty lists and unicode read back equal, and their keys in order.
    #[test]
    fn shard_roundtrip_with_nulls_empty_lists_unicode() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<ShardRow> = (0..50).map(sample).collect();
        let sealed = write(dir.path(), 3, &rows);
        assert_eq!(sealed.index, 3);
        assert_eq!(sealed.rows, 50);
        assert_eq!(sealed.path, dir.path().join("part-000003.parquet"));
        assert_eq!(sealed.bytes, fs::metadata(&sealed.path).unwrap().len());
        assert_eq!(read_rows(&sealed.path).unwrap(), rows);
        let keys = read_keys(&sealed.path).unwrap();
        let expected: Vec<(String, u64)> = rows.iter().map(|r| (r.id.clone(), r.row)).collect();
        assert_eq!(keys, expected);
    }

    /// A file that is not Parquet, or is missing, fails with an error naming it.
    #[test]
    fn shard_read_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part-000009.parquet");
        fs::write(&path, b"not parquet").unwrap();
        let err = read_rows(&path).unwrap_err();
        assert!(matches!(err, ShardError::Parquet { .. }));
        assert!(err.to_string().contains("part-000009.parquet"), "{err}");
        assert_eq!(err.path(), path);
        let missing = dir.path().join("part-000010.parquet");
        assert!(matches!(read_keys(&missing), Err(ShardError::Io { .. })));
    }

    /// A Parquet file with other columns is refused before any row is decoded.
    #[test]
    fn shard_rejects_foreign_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part-000000.parquet");
        let other = Arc::new(Schema::new(vec![Field::new("id", DataType::Utf8, false)]));
        let batch = RecordBatch::try_new(
            other.clone(),
            vec![Arc::new(StringArray::from(vec!["a"])) as ArrayRef],
        )
        .unwrap();
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), other, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        assert!(matches!(read_rows(&path), Err(ShardError::Schema { .. })));
        assert!(matches!(read_keys(&path), Err(ShardError::Schema { .. })));
    }

    /// A shard written before `prompt_ids_source` (every other column) reads, that column
    /// None, whole and projected; a value other than client or server is refused, naming
    /// the column.
    #[test]
    fn shards_written_before_prompt_ids_source_read() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<ShardRow> = (0..9).map(sample).collect();
        let full = crate::output::writer::rows_to_batch(&rows).unwrap();
        let n = full.num_columns();
        let old = full.project(&(0..n - 1).collect::<Vec<_>>()).unwrap();
        let path = dir.path().join("part-000000.parquet");
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), old.schema(), None).unwrap();
        w.write(&old).unwrap();
        w.close().unwrap();
        let want: Vec<ShardRow> = rows
            .iter()
            .map(|r| ShardRow {
                prompt_ids_source: None,
                ..r.clone()
            })
            .collect();
        assert_eq!(read_rows(&path).unwrap(), want);
        let projected = ShardReader::open_checked(&path)
            .unwrap()
            .batches(Some(&["id", "prompt_ids_source"]))
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(projected.num_columns(), 1);

        let mut columns = full.columns().to_vec();
        columns[n - 1] = Arc::new(StringArray::from(vec![Some("model"); rows.len()]));
        let bad = RecordBatch::try_new(full.schema(), columns).unwrap();
        let bad_path = dir.path().join("part-000001.parquet");
        let mut w =
            ArrowWriter::try_new(File::create(&bad_path).unwrap(), bad.schema(), None).unwrap();
        w.write(&bad).unwrap();
        w.close().unwrap();
        let err = read_rows(&bad_path).unwrap_err().to_string();
        assert!(
            err.contains("prompt_ids_source") && err.contains("\"model\""),
            "{err}"
        );
    }

    fn arb_row() -> impl Strategy<Value = ShardRow> {
        let ids = proptest::option::of(proptest::collection::vec(any::<u32>(), 0..20));
        (
            (
                ".*",
                "[a-z0-9_]{0,8}",
                any::<u64>(),
                ".*",
                proptest::option::of(".*"),
            ),
            (ids.clone(), ".*", ids, any::<u32>(), any::<u32>()),
            (
                "[a-z]{0,6}",
                ".{0,6}",
                any::<u32>(),
                any::<u32>(),
                any::<Option<u32>>(),
                any::<i64>(),
            ),
        )
            .prop_map(
                |(
                    (id, dataset, row, prompt, messages),
                    (
                        prompt_token_ids,
                        completion,
                        completion_token_ids,
                        prompt_tokens,
                        completion_tokens,
                    ),
                    (finish_reason, model, attempts, latency_ms, ttft_ms, completed_at_ms),
                )| ShardRow {
                    id,
                    dataset,
                    row,
                    prompt,
                    messages,
                    prompt_token_ids,
                    completion,
                    completion_token_ids,
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                    model,
                    attempts,
                    latency_ms,
                    ttft_ms,
                    completed_at_ms,
                    sample: 0,
                    turn: 0,
                    reasoning: None,
                    tool_calls: None,
                    tools: None,
                    sampling: None,
                    partial: None,
                    prompt_ids_source: None,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Any rows written read back equal.
        #[test]
        fn shard_proptest_roundtrip(rows in proptest::collection::vec(arb_row(), 0..40)) {
            let dir = tempfile::tempdir().unwrap();
            let sealed = write(dir.path(), 0, &rows);
            prop_assert_eq!(read_rows(&sealed.path).unwrap(), rows);
        }
    }
}
