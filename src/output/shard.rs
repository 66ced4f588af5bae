//! Output shards: completed items as zstd-compressed Parquet files (SPEC §5).
//!
//! A shard is `output_dir/<dataset>/part-NNNNNN.parquet`. [`ShardWriter`] writes it under a
//! hidden temporary name (`.part-NNNNNN.parquet.tmp`), row group by row group so memory
//! stays bounded, then `finish` closes it, fsyncs the file, renames it to its final name
//! and fsyncs the directory.
//!
//! Invariant: a file named part-*.parquet is always complete. Nothing else ever creates a
//! file under that name, and an existing one is never overwritten. A crash leaves at most a
//! temporary file, which [`is_temp_file`] recognises so recovery can delete it.
//!
//! The column list, types and nullability are the output contract: [`schema`] is the single
//! Rust definition, `schemas/shard.schema.json` the machine-readable copy, and a unit test
//! keeps the two equal. List columns use the Arrow convention: item field named `item`,
//! non-nullable (`list<item: uint32 not null>` in pyarrow's spelling; in Parquet a 3-level
//! LIST `repeated group list { required int32 item (UINT_32) }`). A token id is never null,
//! and pyarrow, DuckDB and parquet-rs read this as written (checked by
//! `tests/it/shard_read.rs`). Strings are Utf8 (i32 offsets): appends are converted in
//! batches small enough that offsets cannot overflow.
//!
//! Row groups are written every [`ROW_GROUP_MAX_ROWS`] rows or ~[`ROW_GROUP_MAX_BYTES`],
//! whichever comes first, so a writer holds at most one row group in memory.
//!
//! Encoding (not part of the contract: any Parquet reader decodes either): the columns in
//! [`PLAIN_COLUMNS`] — unique values, long texts and the token-id lists — are written
//! without a dictionary; every other column keeps parquet-rs's default dictionary
//! encoding, which pays for `dataset`, `finish_reason`, `model` and the small integers.
//! A test checks each column chunk of a written file against that list, so a misspelt
//! column path cannot silently leave a dictionary on.
//!
//! Fault points, for the crash and disk-full test harnesses, are given at construction
//! ([`crate::knobs::Faults`]):
//! - `shard_pause`: `finish` sleeps that long after the temporary file is fsynced but
//!   before the rename, and again after the rename (and directory fsync) but before
//!   returning, so an external SIGKILL can land inside finalisation.
//! - `shard_write_error`: `append` and `finish` fail with an injected [`ShardError::Io`] of
//!   kind `StorageFull` ("injected write error (SPOOL_FAULT_SHARD_WRITE_ERROR)"), as a full
//!   disk would; the writer is then unusable and dropping it removes the temporary file.

use crate::knobs::Faults;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use arrow_array::builder::{ListBuilder, UInt32Builder};
use arrow_array::{
    Array, ArrayRef, ListArray, RecordBatch, StringArray, TimestampMillisecondArray, UInt32Array,
    UInt64Array,
};
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Schema, SchemaRef, TimeUnit};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::{Compression, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::metadata::{KeyValue, ParquetMetaData};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

const INJECTED_ERROR: &str = "injected write error (SPOOL_FAULT_SHARD_WRITE_ERROR)";

/// Metadata key: the spool version that wrote the shard (required).
pub const META_VERSION: &str = "spool.version";
/// Metadata key: sha256 of the config file (required).
pub const META_CONFIG_SHA256: &str = "spool.config_sha256";
/// Metadata key: the effective sampling parameters as JSON (required).
pub const META_SAMPLING: &str = "spool.sampling";
/// Metadata key: sha256 of the tokenizer file, when a tokenizer is used.
pub const META_TOKENIZER_SHA256: &str = "spool.tokenizer_sha256";
/// Metadata key: where completion token counts came from (server, tokenizer, chunks).
pub const META_COUNT_SOURCE: &str = "spool.count_source";
/// Keys every shard written by `spool run` carries; `spool verify` checks them.
pub const REQUIRED_METADATA_KEYS: &[&str] = &[META_VERSION, META_CONFIG_SHA256, META_SAMPLING];

/// parquet-rs stores the Arrow schema under this key; it is not caller metadata.
const ARROW_SCHEMA_KEY: &str = "ARROW:schema";

/// A row group is written every this many rows (bounded memory, cheap partial reads).
pub const ROW_GROUP_MAX_ROWS: usize = 1024;
/// ... or when its estimated encoded size reaches this, whichever comes first.
pub const ROW_GROUP_MAX_BYTES: usize = 64 << 20;
/// Appended rows are converted to Arrow in batches of at most this many text bytes, so a
/// batch never overflows Utf8's i32 offsets.
const BATCH_MAX_BYTES: usize = 64 << 20;
/// Rows per batch when reading back.
const READ_BATCH_ROWS: usize = 1024;

/// Columns written without dictionary encoding, because a dictionary buys nothing there.
/// `id` and `row` are unique per dataset, so within a shard; `prompt`, `messages` and
/// `completion` are long texts that do not repeat (parquet-rs hashed each into a dictionary
/// until it outgrew its 1 MiB page limit, then fell back to plain). The token-id lists
/// are the expensive case: their ids do repeat, but a row group holds millions of them over
/// a 151 k vocabulary, so the dictionary held and every id was hashed — ~18 % of the
/// writer's time in a `make bench-shard` profile — for a file within 1 % of the plain
/// one's size after zstd (BENCHMARKS.md, shard section).
pub const PLAIN_COLUMNS: &[&str] = &[
    "id",
    "row",
    "prompt",
    "messages",
    "completion",
    "prompt_token_ids",
    "completion_token_ids",
];

/// The Parquet leaf path of top-level column `name`: the column itself, or for a list
/// column its values (`name.list.item`, the 3-level LIST layout the module doc describes).
fn leaf_path(name: &str) -> ColumnPath {
    let is_list = schema()
        .field_with_name(name)
        .is_ok_and(|f| matches!(f.data_type(), DataType::List(_)));
    let mut parts = vec![name.to_string()];
    if is_list {
        parts.extend(["list".to_string(), list_item_field().name().clone()]);
    }
    ColumnPath::new(parts)
}

/// One completed item: a row of a shard, and also the durable result record the queue
/// keeps in its results log until the row is in a shard (`results::encode_row`: its field
/// order is a compatibility boundary, as are the serde field names, which format-2 queues
/// stored as JSON and the migration reads).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardRow {
    /// Item id (SPEC §3).
    pub id: String,
    /// Dataset name.
    pub dataset: String,
    /// 0-based row index in the input file.
    pub row: u64,
    /// The exact text sent, after the chat template.
    pub prompt: String,
    /// Input messages as JSON text, when the input row had messages or conversations.
    pub messages: Option<String>,
    /// Prompt token ids (None without a tokenizer).
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Generated text.
    pub completion: String,
    /// Generated token ids, from the server or the tokenizer.
    pub completion_token_ids: Option<Vec<u32>>,
    /// Prompt token count.
    pub prompt_tokens: u32,
    /// Completion token count; this is what budgets count.
    pub completion_tokens: u32,
    /// `stop`, `length`, … as the server said.
    pub finish_reason: String,
    /// Model name.
    pub model: String,
    /// Requests it took.
    pub attempts: u32,
    /// Last attempt, request to last byte.
    pub latency_ms: u32,
    /// Time to first token (streaming only).
    pub ttft_ms: Option<u32>,
    /// Unix ms UTC; column `completed_at`, timestamp(ms, "UTC").
    pub completed_at_ms: i64,
}

#[cfg(test)]
impl ShardRow {
    /// A minimal finished row for tests of the modules that carry rows (queue, archive,
    /// verify); tests set what they check with struct-update syntax.
    pub(crate) fn for_tests(id: String, dataset: &str, row: u64) -> Self {
        Self {
            id,
            dataset: dataset.into(),
            row,
            prompt: "p".into(),
            messages: None,
            prompt_token_ids: None,
            completion: "c".into(),
            completion_token_ids: None,
            prompt_tokens: 1,
            completion_tokens: 0,
            finish_reason: "stop".into(),
            model: "m".into(),
            attempts: 1,
            latency_ms: 1,
            ttft_ms: None,
            completed_at_ms: 0,
        }
    }
}

/// When a shard is closed and how hard it is compressed (from `[shards]` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLimits {
    /// Close the shard at this many rows.
    pub max_rows: usize,
    /// ... or at about this many bytes (estimated), whichever comes first.
    pub max_bytes: u64,
    /// zstd level, 1..=22.
    pub compression_level: i32,
}

impl Default for ShardLimits {
    /// The config defaults (SPEC §4): 10 000 rows, 256 MiB, zstd 3.
    fn default() -> Self {
        Self {
            max_rows: 10_000,
            max_bytes: 256 << 20,
            compression_level: 3,
        }
    }
}

/// Why a shard could not be written or read. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// Filesystem error (including a full disk).
    #[error("shard {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The Parquet layer failed (encoding, or a corrupt/truncated file on read).
    #[error("shard {}: parquet: {source}", path.display())]
    Parquet {
        /// The shard file.
        path: PathBuf,
        /// The parquet-rs error.
        source: ParquetError,
    },
    /// Converting rows to or from Arrow failed.
    #[error("shard {}: arrow: {source}", path.display())]
    Arrow {
        /// The shard file.
        path: PathBuf,
        /// The arrow-rs error.
        source: ArrowError,
    },
    /// The file's columns are not the SPEC §5 schema.
    #[error("shard {}: schema differs from SPEC §5: {detail}", path.display())]
    Schema {
        /// The shard file.
        path: PathBuf,
        /// The first difference found.
        detail: String,
    },
    /// The final name is taken: a sealed shard is never overwritten.
    #[error("shard {} already exists; refusing to overwrite a sealed shard", path.display())]
    Exists {
        /// The existing shard.
        path: PathBuf,
    },
    /// Bad limits or metadata given to [`ShardWriter::create`].
    #[error("shard {}: invalid settings: {detail}", path.display())]
    Invalid {
        /// The shard that was to be written.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// An earlier write failed, so the temporary file's content is unknown.
    #[error("shard {}: an earlier write failed; the shard must be abandoned", path.display())]
    Poisoned {
        /// The temporary file.
        path: PathBuf,
    },
}

impl ShardError {
    /// The file the error is about (for logs and `spool verify` reports).
    pub fn path(&self) -> &Path {
        match self {
            ShardError::Io { path, .. }
            | ShardError::Parquet { path, .. }
            | ShardError::Arrow { path, .. }
            | ShardError::Schema { path, .. }
            | ShardError::Exists { path }
            | ShardError::Invalid { path, .. }
            | ShardError::Poisoned { path } => path,
        }
    }

    fn io(path: &Path, source: io::Error) -> Self {
        ShardError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn parquet(path: &Path, source: ParquetError) -> Self {
        ShardError::Parquet {
            path: path.to_path_buf(),
            source,
        }
    }

    fn arrow(path: &Path, source: ArrowError) -> Self {
        ShardError::Arrow {
            path: path.to_path_buf(),
            source,
        }
    }

    fn schema(path: &Path, detail: String) -> Self {
        ShardError::Schema {
            path: path.to_path_buf(),
            detail,
        }
    }
}

fn list_item_field() -> FieldRef {
    Arc::new(Field::new("item", DataType::UInt32, false))
}

/// The shard schema, exactly SPEC §5 (names, types, nullability, order). Writers and
/// readers both check against it, so it is the one definition of the output contract.
pub fn schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            let ids = DataType::List(list_item_field());
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Utf8, false),
                Field::new("dataset", DataType::Utf8, false),
                Field::new("row", DataType::UInt64, false),
                Field::new("prompt", DataType::Utf8, false),
                Field::new("messages", DataType::Utf8, true),
                Field::new("prompt_token_ids", ids.clone(), true),
                Field::new("completion", DataType::Utf8, false),
                Field::new("completion_token_ids", ids, true),
                Field::new("prompt_tokens", DataType::UInt32, false),
                Field::new("completion_tokens", DataType::UInt32, false),
                Field::new("finish_reason", DataType::Utf8, false),
                Field::new("model", DataType::Utf8, false),
                Field::new("attempts", DataType::UInt32, false),
                Field::new("latency_ms", DataType::UInt32, false),
                Field::new("ttft_ms", DataType::UInt32, true),
                Field::new(
                    "completed_at",
                    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                    false,
                ),
            ]))
        })
        .clone()
}

// Column positions in `schema()`.
const COL_ID: usize = 0;
const COL_ROW: usize = 2;
const COL_PROMPT_TOKENS: usize = 8;
const COL_COMPLETION_TOKENS: usize = 9;

/// The final file name of shard `index` (`part-000007.parquet`): sorts by index up to a
/// million shards and matches the `*.parquet` glob readers use.
pub fn shard_file_name(index: u64) -> String {
    format!("part-{index:06}.parquet")
}

/// The index of a final shard name, or None for anything else. Only the canonical
/// spelling [`shard_file_name`] produces is accepted, so two files can't claim one index.
pub fn parse_shard_index(file_name: &str) -> Option<u64> {
    let digits = file_name.strip_prefix("part-")?.strip_suffix(".parquet")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let index: u64 = digits.parse().ok()?;
    (shard_file_name(index) == file_name).then_some(index)
}

/// The temporary name shard `index` is written under: hidden (leading dot, so pyarrow and
/// DuckDB directory scans skip it) and not ending in `.parquet`.
pub fn temp_file_name(index: u64) -> String {
    format!(".{}.tmp", shard_file_name(index))
}

/// Whether `file_name` is a writer's temporary file: only a crash leaves one behind, and
/// recovery deletes it (its rows are still in the queue).
pub fn is_temp_file(file_name: &str) -> bool {
    file_name
        .strip_prefix('.')
        .and_then(|rest| rest.strip_suffix(".tmp"))
        .and_then(parse_shard_index)
        .is_some()
}

/// Sleeps for the `shard_pause` fault, if set, so a kill harness can land inside `finish`.
fn fault_pause(faults: &Faults, at: &'static str, path: &Path) {
    if let Some(pause) = faults.shard_pause {
        tracing::warn!(
            path = %path.display(),
            at,
            pause_ms = pause.as_millis() as u64,
            "fault injection: pausing shard finalisation"
        );
        std::thread::sleep(pause);
    }
}

fn injected_error(path: &Path) -> ShardError {
    ShardError::io(
        path,
        io::Error::new(io::ErrorKind::StorageFull, INJECTED_ERROR),
    )
}

/// Writes one shard. Rows go to a temporary file as they come; the shard becomes visible
/// only in [`ShardWriter::finish`]. Dropping it unfinished removes the temporary file.
pub struct ShardWriter {
    dir: PathBuf,
    index: u64,
    temp_path: PathBuf,
    final_path: PathBuf,
    limits: ShardLimits,
    writer: Option<ArrowWriter<File>>,
    rows: usize,
    /// A write failed: the temp file's content is unknown.
    failed: bool,
    /// The temp file has been renamed (or removed): Drop must leave it alone.
    done: bool,
    /// Test-harness fault points, fixed at construction.
    faults: Faults,
}

impl std::fmt::Debug for ShardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardWriter")
            .field("temp_path", &self.temp_path)
            .field("rows", &self.rows)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl ShardWriter {
    /// Creates `dir` if needed and a temporary file for shard `index` in it. `metadata`:
    /// file key-value metadata (spool.version, spool.config_sha256, spool.sampling, ...
    /// given by the caller). Fails with [`ShardError::Exists`] if shard `index` is already
    /// sealed; a stale temporary file from a crash is overwritten.
    pub fn create(
        dir: &Path,
        index: u64,
        limits: &ShardLimits,
        metadata: Vec<(String, String)>,
        faults: &Faults,
    ) -> Result<Self, ShardError> {
        let final_path = dir.join(shard_file_name(index));
        let temp_path = dir.join(temp_file_name(index));
        let invalid = |detail: String| ShardError::Invalid {
            path: final_path.clone(),
            detail,
        };
        if limits.max_rows == 0 {
            return Err(invalid("max_rows must be at least 1".into()));
        }
        let level = ZstdLevel::try_new(limits.compression_level)
            .map_err(|e| invalid(format!("zstd level {}: {e}", limits.compression_level)))?;
        if let Some((key, _)) = metadata.iter().find(|(k, _)| k.starts_with("ARROW:")) {
            return Err(invalid(format!("metadata key {key:?} is reserved")));
        }

        create_dir_durably(dir)?;
        if final_path
            .try_exists()
            .map_err(|e| ShardError::io(&final_path, e))?
        {
            return Err(ShardError::Exists { path: final_path });
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp_path)
            .map_err(|e| ShardError::io(&temp_path, e))?;

        let props = PLAIN_COLUMNS
            .iter()
            .fold(WriterProperties::builder(), |b, col| {
                b.set_column_dictionary_enabled(leaf_path(col), false)
            })
            .set_compression(Compression::ZSTD(level))
            .set_max_row_group_row_count(Some(ROW_GROUP_MAX_ROWS))
            .set_max_row_group_bytes(Some(ROW_GROUP_MAX_BYTES))
            .set_key_value_metadata(Some(
                metadata
                    .into_iter()
                    .map(|(k, v)| KeyValue::new(k, v))
                    .collect(),
            ))
            .build();
        let writer = match ArrowWriter::try_new(file, schema(), Some(props)) {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&temp_path);
                return Err(ShardError::parquet(&temp_path, e));
            }
        };
        tracing::debug!(path = %temp_path.display(), index, "shard opened");
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            temp_path,
            final_path,
            limits: *limits,
            writer: Some(writer),
            rows: 0,
            failed: false,
            done: false,
            faults: *faults,
        })
    }

    fn usable_writer(&mut self) -> Result<&mut ArrowWriter<File>, ShardError> {
        match self.writer.as_mut() {
            Some(w) if !self.failed => Ok(w),
            _ => Err(ShardError::Poisoned {
                path: self.temp_path.clone(),
            }),
        }
    }

    /// Appends rows; writes row groups to the temp file as they fill (every
    /// [`ROW_GROUP_MAX_ROWS`] rows or ~[`ROW_GROUP_MAX_BYTES`], whichever first), so
    /// memory stays bounded. After an error the writer is unusable: abandon it.
    pub fn append(&mut self, rows: &[ShardRow]) -> Result<(), ShardError> {
        self.usable_writer()?;
        if rows.is_empty() {
            return Ok(());
        }
        if self.faults.shard_write_error {
            self.failed = true;
            return Err(injected_error(&self.temp_path));
        }
        // Convert everything first: a conversion error then leaves the file untouched.
        let batches = batch_chunks(rows)
            .map(|chunk| rows_to_batch(chunk).map_err(|e| ShardError::arrow(&self.temp_path, e)))
            .collect::<Result<Vec<_>, _>>()?;
        for batch in &batches {
            let result = self.usable_writer()?.write(batch);
            if let Err(e) = result {
                self.failed = true;
                return Err(ShardError::parquet(&self.temp_path, e));
            }
            self.rows += batch.num_rows();
        }
        Ok(())
    }

    /// Rows appended so far (for rolling and progress).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes written to the temp file plus the estimated encoded size of the row group
    /// still in memory: the shard's size on disk, roughly, for the `max_bytes` limit.
    pub fn estimated_bytes(&self) -> u64 {
        self.writer
            .as_ref()
            .map_or(0, |w| (w.bytes_written() + w.in_progress_size()) as u64)
    }

    /// Whether the shard has reached a limit and should be finished: rows >= max_rows or
    /// estimated bytes >= max_bytes.
    pub fn is_full(&self) -> bool {
        self.rows >= self.limits.max_rows || self.estimated_bytes() >= self.limits.max_bytes
    }

    /// The index this writer was created for.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// The temporary file being written (for logs).
    pub fn temp_path(&self) -> &Path {
        &self.temp_path
    }

    /// The name the shard will have once finished.
    pub fn final_path(&self) -> &Path {
        &self.final_path
    }

    /// Closes the file, fsyncs it, renames temp → final name, fsyncs the directory. A
    /// reader globbing *.parquet sees the shard from the rename on, already complete and
    /// synced; once this returns it is also durable. On an error
    /// before the rename the temporary file is removed and no shard exists; the only error
    /// after it (a failed directory fsync) leaves the final file in place, for crash
    /// recovery to adopt via [`read_keys`].
    pub fn finish(mut self) -> Result<SealedShard, ShardError> {
        self.usable_writer()?;
        let faults = self.faults;
        if faults.shard_write_error {
            self.failed = true;
            return Err(injected_error(&self.temp_path));
        }
        let Some(writer) = self.writer.take() else {
            return Err(ShardError::Poisoned {
                path: self.temp_path.clone(),
            });
        };
        // into_inner flushes the last row group and writes the footer.
        let file = writer
            .into_inner()
            .map_err(|e| ShardError::parquet(&self.temp_path, e))?;
        file.sync_all()
            .map_err(|e| ShardError::io(&self.temp_path, e))?;
        let bytes = file
            .metadata()
            .map_err(|e| ShardError::io(&self.temp_path, e))?
            .len();
        drop(file);

        fault_pause(&faults, "before_rename", &self.temp_path);
        if self
            .final_path
            .try_exists()
            .map_err(|e| ShardError::io(&self.final_path, e))?
        {
            return Err(ShardError::Exists {
                path: self.final_path.clone(),
            });
        }
        fs::rename(&self.temp_path, &self.final_path)
            .map_err(|e| ShardError::io(&self.final_path, e))?;
        self.done = true;
        sync_dir(&self.dir)?;
        fault_pause(&faults, "after_rename", &self.final_path);

        tracing::debug!(
            path = %self.final_path.display(),
            index = self.index,
            rows = self.rows,
            bytes,
            "shard sealed"
        );
        Ok(SealedShard {
            path: self.final_path.clone(),
            index: self.index,
            rows: self.rows,
            bytes,
        })
    }

    /// Drops the temp file (used when a shard must be abandoned, e.g. after a write
    /// error); its rows stay in the queue and go into a later shard.
    pub fn abandon(mut self) {
        self.remove_temp("abandoned");
    }

    fn remove_temp(&mut self, why: &'static str) {
        if self.done {
            return;
        }
        self.done = true;
        // Close the handle first; the half-written content is discarded anyway.
        self.writer = None;
        match fs::remove_file(&self.temp_path) {
            Ok(()) => tracing::debug!(
                path = %self.temp_path.display(),
                rows = self.rows,
                why,
                "shard temp file removed"
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                path = %self.temp_path.display(),
                error = %e,
                why,
                "could not remove shard temp file"
            ),
        }
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        self.remove_temp("dropped unfinished");
    }
}

/// A shard that `finish` made visible: what the queue records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedShard {
    /// Final path (`…/part-NNNNNN.parquet`).
    pub path: PathBuf,
    /// Shard index.
    pub index: u64,
    /// Rows in it.
    pub rows: usize,
    /// File size.
    pub bytes: u64,
}

/// Creates `dir` (and parents), fsyncing the parent of every level it made, so the
/// directory entries survive a power loss along with the shards in them.
fn create_dir_durably(dir: &Path) -> Result<(), ShardError> {
    crate::store::blocks::create_dir_durably(dir).map_err(|e| ShardError::io(dir, e))
}

fn sync_dir(dir: &Path) -> Result<(), ShardError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ShardError::io(dir, e))
}

/// Approximate Arrow bytes of one row, for batch splitting.
fn row_bytes(r: &ShardRow) -> usize {
    r.id.len()
        + r.dataset.len()
        + r.prompt.len()
        + r.messages.as_ref().map_or(0, String::len)
        + r.completion.len()
        + r.finish_reason.len()
        + r.model.len()
        + 4 * (r.prompt_token_ids.as_ref().map_or(0, Vec::len)
            + r.completion_token_ids.as_ref().map_or(0, Vec::len))
        + 64
}

/// Splits rows into batches of at most a row group's rows and [`BATCH_MAX_BYTES`].
fn batch_chunks(rows: &[ShardRow]) -> impl Iterator<Item = &[ShardRow]> {
    let mut rest = rows;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let mut n = 0;
        while n < rest.len() && n < ROW_GROUP_MAX_ROWS {
            bytes += row_bytes(&rest[n]);
            if n > 0 && bytes > BATCH_MAX_BYTES {
                break;
            }
            n += 1;
        }
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        Some(chunk)
    })
}

fn strings<'a>(rows: &'a [ShardRow], f: impl Fn(&'a ShardRow) -> &'a str) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
}

fn u32s(rows: &[ShardRow], f: impl Fn(&ShardRow) -> u32) -> ArrayRef {
    Arc::new(rows.iter().map(f).collect::<UInt32Array>())
}

fn id_lists(rows: &[ShardRow], f: impl Fn(&ShardRow) -> Option<&Vec<u32>>) -> ArrayRef {
    let mut builder = ListBuilder::new(UInt32Builder::new()).with_field(list_item_field());
    for r in rows {
        match f(r) {
            Some(ids) => {
                builder.values().append_slice(ids);
                builder.append(true);
            }
            None => builder.append(false),
        }
    }
    Arc::new(builder.finish())
}

fn rows_to_batch(rows: &[ShardRow]) -> Result<RecordBatch, ArrowError> {
    let columns: Vec<ArrayRef> = vec![
        strings(rows, |r| &r.id),
        strings(rows, |r| &r.dataset),
        Arc::new(rows.iter().map(|r| r.row).collect::<UInt64Array>()),
        strings(rows, |r| &r.prompt),
        Arc::new(
            rows.iter()
                .map(|r| r.messages.as_deref())
                .collect::<StringArray>(),
        ),
        id_lists(rows, |r| r.prompt_token_ids.as_ref()),
        strings(rows, |r| &r.completion),
        id_lists(rows, |r| r.completion_token_ids.as_ref()),
        u32s(rows, |r| r.prompt_tokens),
        u32s(rows, |r| r.completion_tokens),
        strings(rows, |r| &r.finish_reason),
        strings(rows, |r| &r.model),
        u32s(rows, |r| r.attempts),
        u32s(rows, |r| r.latency_ms),
        Arc::new(rows.iter().map(|r| r.ttft_ms).collect::<UInt32Array>()),
        Arc::new(
            TimestampMillisecondArray::from(
                rows.iter().map(|r| r.completed_at_ms).collect::<Vec<i64>>(),
            )
            .with_timezone("UTC"),
        ),
    ];
    RecordBatch::try_new(schema(), columns)
}

/// Fails unless `found` has exactly the SPEC §5 columns (names, types, nullability, order).
fn check_schema(path: &Path, found: &Schema) -> Result<(), ShardError> {
    let expected = schema();
    if found.fields().len() != expected.fields().len() {
        return Err(ShardError::schema(
            path,
            format!(
                "{} columns, expected {}",
                found.fields().len(),
                expected.fields().len()
            ),
        ));
    }
    for (i, (f, e)) in found.fields().iter().zip(expected.fields()).enumerate() {
        if f.name() != e.name()
            || f.data_type() != e.data_type()
            || f.is_nullable() != e.is_nullable()
        {
            return Err(ShardError::schema(
                path,
                format!(
                    "column {i} is {:?} {} (nullable {}), expected {:?} {} (nullable {})",
                    f.name(),
                    f.data_type(),
                    f.is_nullable(),
                    e.name(),
                    e.data_type(),
                    e.is_nullable()
                ),
            ));
        }
    }
    Ok(())
}

fn open_reader(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<File>, ShardError> {
    let file = File::open(path).map_err(|e| ShardError::io(path, e))?;
    ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| ShardError::parquet(path, e))
        .map(|b| b.with_batch_size(READ_BATCH_ROWS))
}

fn column<'a, T: 'static>(
    path: &Path,
    batch: &'a RecordBatch,
    index: usize,
) -> Result<&'a T, ShardError> {
    batch
        .columns()
        .get(index)
        .and_then(|c| c.as_any().downcast_ref::<T>())
        .ok_or_else(|| {
            ShardError::schema(
                path,
                format!(
                    "column {index} does not decode as {}",
                    std::any::type_name::<T>()
                ),
            )
        })
}

fn id_list_at(path: &Path, list: &ListArray, i: usize) -> Result<Option<Vec<u32>>, ShardError> {
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

fn batch_to_rows(
    path: &Path,
    batch: &RecordBatch,
    out: &mut Vec<ShardRow>,
) -> Result<(), ShardError> {
    let id = column::<StringArray>(path, batch, 0)?;
    let dataset = column::<StringArray>(path, batch, 1)?;
    let row = column::<UInt64Array>(path, batch, 2)?;
    let prompt = column::<StringArray>(path, batch, 3)?;
    let messages = column::<StringArray>(path, batch, 4)?;
    let prompt_ids = column::<ListArray>(path, batch, 5)?;
    let completion = column::<StringArray>(path, batch, 6)?;
    let completion_ids = column::<ListArray>(path, batch, 7)?;
    let prompt_tokens = column::<UInt32Array>(path, batch, 8)?;
    let completion_tokens = column::<UInt32Array>(path, batch, 9)?;
    let finish_reason = column::<StringArray>(path, batch, 10)?;
    let model = column::<StringArray>(path, batch, 11)?;
    let attempts = column::<UInt32Array>(path, batch, 12)?;
    let latency = column::<UInt32Array>(path, batch, 13)?;
    let ttft = column::<UInt32Array>(path, batch, 14)?;
    let completed_at = column::<TimestampMillisecondArray>(path, batch, 15)?;
    out.reserve(batch.num_rows());
    for i in 0..batch.num_rows() {
        out.push(ShardRow {
            id: id.value(i).to_owned(),
            dataset: dataset.value(i).to_owned(),
            row: row.value(i),
            prompt: prompt.value(i).to_owned(),
            messages: opt_string(messages, i),
            prompt_token_ids: id_list_at(path, prompt_ids, i)?,
            completion: completion.value(i).to_owned(),
            completion_token_ids: id_list_at(path, completion_ids, i)?,
            prompt_tokens: prompt_tokens.value(i),
            completion_tokens: completion_tokens.value(i),
            finish_reason: finish_reason.value(i).to_owned(),
            model: model.value(i).to_owned(),
            attempts: attempts.value(i),
            latency_ms: latency.value(i),
            ttft_ms: ttft.is_valid(i).then(|| ttft.value(i)),
            completed_at_ms: completed_at.value(i),
        });
    }
    Ok(())
}

/// Reads a whole shard back (verify, export, tests), after checking its schema is SPEC §5.
pub fn read_rows(path: &Path) -> Result<Vec<ShardRow>, ShardError> {
    let builder = open_reader(path)?;
    check_schema(path, builder.schema())?;
    let reader = builder.build().map_err(|e| ShardError::parquet(path, e))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ShardError::arrow(path, e))?;
        batch_to_rows(path, &batch, &mut rows)?;
    }
    Ok(rows)
}

/// Only the (id, row) pairs, cheaply (the two columns are projected; prompts and
/// completions are not decoded). Crash recovery uses it to adopt a shard renamed before
/// the queue recorded it.
pub fn read_keys(path: &Path) -> Result<Vec<(String, u64)>, ShardError> {
    let builder = open_reader(path)?;
    check_schema(path, builder.schema())?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), [COL_ID, COL_ROW]);
    let reader = builder
        .with_projection(mask)
        .build()
        .map_err(|e| ShardError::parquet(path, e))?;
    let mut keys = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ShardError::arrow(path, e))?;
        let ids = column::<StringArray>(path, &batch, 0)?;
        let rows = column::<UInt64Array>(path, &batch, 1)?;
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
    let builder = open_reader(path)?;
    check_schema(path, builder.schema())?;
    let mask = ProjectionMask::roots(
        builder.parquet_schema(),
        [COL_ROW, COL_PROMPT_TOKENS, COL_COMPLETION_TOKENS],
    );
    let reader = builder
        .with_projection(mask)
        .build()
        .map_err(|e| ShardError::parquet(path, e))?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ShardError::arrow(path, e))?;
        let rows = column::<UInt64Array>(path, &batch, 0)?;
        let prompt = column::<UInt32Array>(path, &batch, 1)?;
        let completion = column::<UInt32Array>(path, &batch, 2)?;
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

/// Key-value metadata of a shard file, as given to [`ShardWriter::create`] (the
/// `ARROW:schema` entry parquet-rs adds is left out).
pub fn read_metadata(path: &Path) -> Result<Vec<(String, String)>, ShardError> {
    let builder = open_reader(path)?;
    Ok(caller_metadata(builder.metadata()))
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

/// Footer facts of a shard, after checking its schema is SPEC §5.
pub fn read_info(path: &Path) -> Result<ShardInfo, ShardError> {
    let builder = open_reader(path)?;
    check_schema(path, builder.schema())?;
    let meta = builder.metadata();
    let rows = u64::try_from(meta.file_metadata().num_rows()).unwrap_or_default();
    let all_zstd = meta
        .row_groups()
        .iter()
        .flat_map(|rg| rg.columns())
        .all(|c| matches!(c.compression(), Compression::ZSTD(_)));
    Ok(ShardInfo {
        rows,
        row_groups: meta.num_row_groups(),
        all_zstd,
        metadata: caller_metadata(meta),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn sample(i: u64) -> ShardRow {
        ShardRow {
            id: format!("ds:{i}"),
            dataset: "ds".into(),
            row: i,
            prompt: format!("prompt {i} — ünïcødé 日本語 🚀"),
            messages: i
                .is_multiple_of(2)
                .then(|| format!(r#"[{{"role":"user","content":"hi {i}"}}]"#)),
            prompt_token_ids: match i % 3 {
                0 => None,
                1 => Some(vec![]),
                _ => Some(vec![1, 2, u32::MAX, i as u32]),
            },
            completion: if i.is_multiple_of(5) {
                String::new()
            } else {
                format!("answer {i}\n\t\"q\"")
            },
            completion_token_ids: (!i.is_multiple_of(4)).then(|| (0..(i as u32 % 7)).collect()),
            prompt_tokens: 4,
            completion_tokens: (i as u32) % 7,
            finish_reason: if i.is_multiple_of(2) {
                "stop"
            } else {
                "length"
            }
            .into(),
            model: "m".into(),
            attempts: 1 + (i as u32 % 3),
            latency_ms: 1000 + i as u32,
            ttft_ms: (!i.is_multiple_of(3)).then_some(i as u32),
            completed_at_ms: 1_767_225_600_000 + i as i64,
        }
    }

    fn meta() -> Vec<(String, String)> {
        vec![
            (META_VERSION.into(), "0.1.0".into()),
            (META_CONFIG_SHA256.into(), "ab".repeat(32)),
            (META_SAMPLING.into(), r#"{"temperature":0.7}"#.into()),
        ]
    }

    fn limits(max_rows: usize) -> ShardLimits {
        ShardLimits {
            max_rows,
            max_bytes: 1 << 30,
            compression_level: 3,
        }
    }

    fn list(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn write(dir: &Path, index: u64, rows: &[ShardRow]) -> SealedShard {
        let mut w = ShardWriter::create(dir, index, &limits(1_000_000), meta(), &Faults::default())
            .unwrap();
        w.append(rows).unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn shard_writer_is_send() {
        // `finish` runs on a blocking thread.
        fn assert_send<T: Send + 'static>() {}
        assert_send::<ShardWriter>();
        assert_send::<ShardError>();
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_file_name(7), "part-000007.parquet");
        assert_eq!(shard_file_name(1_234_567), "part-1234567.parquet");
        assert_eq!(parse_shard_index("part-000007.parquet"), Some(7));
        assert_eq!(parse_shard_index("part-1234567.parquet"), Some(1_234_567));
        for bad in [
            "part-7.parquet",
            "part-0000007.parquet",
            "part-+00007.parquet",
            "part-.parquet",
            "part-000007.parquet.tmp",
            ".part-000007.parquet.tmp",
            "_rejected.jsonl",
        ] {
            assert_eq!(parse_shard_index(bad), None, "{bad}");
        }
        assert_eq!(temp_file_name(7), ".part-000007.parquet.tmp");
        assert!(is_temp_file(".part-000007.parquet.tmp"));
        assert!(!is_temp_file("part-000007.parquet"));
        assert!(!is_temp_file(".part-000007.parquet"));
        assert!(!is_temp_file(".foo.tmp"));
    }

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

    #[test]
    fn shard_empty_append_and_multiple_row_groups() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<ShardRow> = (0..(ROW_GROUP_MAX_ROWS as u64 * 2 + 10))
            .map(sample)
            .collect();
        let mut w = ShardWriter::create(
            dir.path(),
            0,
            &limits(1_000_000),
            meta(),
            &Faults::default(),
        )
        .unwrap();
        w.append(&[]).unwrap();
        for chunk in rows.chunks(333) {
            w.append(chunk).unwrap();
        }
        assert_eq!(w.rows(), rows.len());
        assert!(w.estimated_bytes() > 0);
        let sealed = w.finish().unwrap();
        let info = read_info(&sealed.path).unwrap();
        assert_eq!(info.rows, rows.len() as u64);
        assert_eq!(info.row_groups, 3);
        assert_eq!(read_rows(&sealed.path).unwrap(), rows);
    }

    #[test]
    fn shard_is_full_at_max_rows() {
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            ShardWriter::create(dir.path(), 0, &limits(5), meta(), &Faults::default()).unwrap();
        w.append(&[sample(0), sample(1), sample(2), sample(3)])
            .unwrap();
        assert!(!w.is_full());
        w.append(&[sample(4)]).unwrap();
        assert!(w.is_full());
        assert_eq!(w.finish().unwrap().rows, 5);

        let small_bytes = ShardLimits {
            max_bytes: 1,
            ..limits(1000)
        };
        let mut w =
            ShardWriter::create(dir.path(), 1, &small_bytes, meta(), &Faults::default()).unwrap();
        assert!(!w.is_full() || w.estimated_bytes() >= 1);
        w.append(&[sample(0)]).unwrap();
        assert!(w.is_full());
        w.abandon();
    }

    #[test]
    fn shard_invisible_until_finish() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("out").join("ds");
        let mut w = ShardWriter::create(&sub, 7, &limits(100), meta(), &Faults::default()).unwrap();
        w.append(&[sample(1), sample(2)]).unwrap();
        assert_eq!(list(&sub), vec![".part-000007.parquet.tmp".to_string()]);
        assert!(list(&sub).iter().all(|n| !n.ends_with(".parquet")));
        w.finish().unwrap();
        assert_eq!(list(&sub), vec!["part-000007.parquet".to_string()]);
    }

    #[test]
    fn shard_abandon_and_drop_remove_temp() {
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            ShardWriter::create(dir.path(), 0, &limits(100), meta(), &Faults::default()).unwrap();
        w.append(&[sample(1)]).unwrap();
        w.abandon();
        assert!(list(dir.path()).is_empty());
        {
            let mut w =
                ShardWriter::create(dir.path(), 1, &limits(100), meta(), &Faults::default())
                    .unwrap();
            w.append(&[sample(1)]).unwrap();
        }
        assert!(list(dir.path()).is_empty());
    }

    #[test]
    fn shard_never_overwrites_and_replaces_stale_temp() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 0, &[sample(0)]);
        let err = ShardWriter::create(dir.path(), 0, &limits(10), meta(), &Faults::default())
            .unwrap_err();
        assert!(matches!(err, ShardError::Exists { .. }), "{err}");
        assert!(err.to_string().contains("part-000000.parquet"), "{err}");

        fs::write(dir.path().join(temp_file_name(1)), b"garbage from a crash").unwrap();
        let sealed = write(dir.path(), 1, &[sample(1)]);
        assert_eq!(read_rows(&sealed.path).unwrap(), vec![sample(1)]);
    }

    #[test]
    fn shard_metadata_and_zstd() {
        let dir = tempfile::tempdir().unwrap();
        let sealed = write(dir.path(), 0, &[sample(0), sample(1)]);
        assert_eq!(read_metadata(&sealed.path).unwrap(), meta());
        let file = File::open(&sealed.path).unwrap();
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        let md = builder.metadata();
        assert!(md.num_row_groups() >= 1);
        for rg in md.row_groups() {
            assert_eq!(rg.columns().len(), 16);
            for c in rg.columns() {
                assert!(
                    matches!(c.compression(), Compression::ZSTD(_)),
                    "{:?}",
                    c.compression()
                );
            }
        }
        let info = read_info(&sealed.path).unwrap();
        assert!(info.all_zstd);
        assert_eq!(info.metadata, meta());
        // The schema as stored is exactly schema(), field by field.
        assert_eq!(builder.schema().fields(), schema().fields());
    }

    #[test]
    fn shard_dictionary_only_where_values_repeat() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<ShardRow> = (0..100).map(sample).collect();
        let sealed = write(dir.path(), 0, &rows);
        let file = File::open(&sealed.path).unwrap();
        let md = ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .metadata()
            .clone();
        let mut seen = Vec::new();
        for rg in md.row_groups() {
            for c in rg.columns() {
                let top = c.column_path().parts()[0].clone();
                let plain = PLAIN_COLUMNS.contains(&top.as_str());
                assert_eq!(
                    c.dictionary_page_offset().is_none(),
                    plain,
                    "column {} (encodings {:?})",
                    c.column_path(),
                    c.encodings().collect::<Vec<_>>()
                );
                seen.push(top);
            }
        }
        // Every name in the list is a real column (a typo would match nothing).
        for col in PLAIN_COLUMNS {
            assert!(seen.iter().any(|s| s == col), "{col} is not a column");
        }
        // The rows still read back as written.
        assert_eq!(read_rows(&sealed.path).unwrap(), rows);
    }

    #[test]
    fn shard_invalid_settings() {
        let dir = tempfile::tempdir().unwrap();
        let bad_level = ShardLimits {
            compression_level: 99,
            ..limits(10)
        };
        assert!(matches!(
            ShardWriter::create(dir.path(), 0, &bad_level, meta(), &Faults::default()),
            Err(ShardError::Invalid { .. })
        ));
        assert!(matches!(
            ShardWriter::create(dir.path(), 0, &limits(0), meta(), &Faults::default()),
            Err(ShardError::Invalid { .. })
        ));
        let reserved = vec![("ARROW:schema".to_string(), "x".to_string())];
        assert!(matches!(
            ShardWriter::create(dir.path(), 0, &limits(10), reserved, &Faults::default()),
            Err(ShardError::Invalid { .. })
        ));
        assert!(list(dir.path()).is_empty());
    }

    #[test]
    fn shard_injected_write_error() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Faults {
            shard_write_error: true,
            ..Faults::default()
        };
        let mut w =
            ShardWriter::create(dir.path(), 0, &limits(10), meta(), &Faults::default()).unwrap();
        w.faults = faults;
        let err = w.append(&[sample(0)]).unwrap_err();
        assert!(err.to_string().contains(INJECTED_ERROR), "{err}");
        assert!(
            err.to_string().contains(".part-000000.parquet.tmp"),
            "{err}"
        );
        match &err {
            ShardError::Io { source, .. } => assert_eq!(source.kind(), io::ErrorKind::StorageFull),
            other => panic!("{other:?}"),
        }
        // Poisoned from now on, even with the fault gone.
        w.faults = Faults::default();
        assert!(matches!(
            w.append(&[sample(0)]),
            Err(ShardError::Poisoned { .. })
        ));
        assert!(matches!(w.finish(), Err(ShardError::Poisoned { .. })));
        assert!(list(dir.path()).is_empty());

        let mut w =
            ShardWriter::create(dir.path(), 1, &limits(10), meta(), &Faults::default()).unwrap();
        w.append(&[sample(0)]).unwrap();
        w.faults = faults;
        let err = w.finish().unwrap_err();
        assert!(err.to_string().contains(INJECTED_ERROR), "{err}");
        assert!(list(dir.path()).is_empty());
    }

    #[test]
    fn shard_pause_fault_still_seals() {
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            ShardWriter::create(dir.path(), 2, &limits(10), meta(), &Faults::default()).unwrap();
        w.faults = Faults {
            shard_pause: Some(Duration::from_millis(20)),
            ..Faults::default()
        };
        w.append(&[sample(0)]).unwrap();
        let started = std::time::Instant::now();
        let sealed = w.finish().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(read_rows(&sealed.path).unwrap(), vec![sample(0)]);
    }

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

    #[test]
    fn shard_row_serde_field_names() {
        let v = serde_json::to_value(sample(1)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let schema = schema();
        let mut cols: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        // The one deliberate difference: the column is a timestamp, the field says its unit.
        let last = cols.len() - 1;
        cols[last] = "completed_at_ms";
        assert_eq!(keys, cols);
        let back: ShardRow = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample(1));
    }

    /// pyarrow's `str(type)` for the types the schema uses.
    fn pyarrow_type(t: &DataType) -> String {
        match t {
            DataType::Utf8 => "string".into(),
            DataType::UInt32 => "uint32".into(),
            DataType::UInt64 => "uint64".into(),
            DataType::List(item) => format!(
                "list<{}: {}{}>",
                item.name(),
                pyarrow_type(item.data_type()),
                if item.is_nullable() { "" } else { " not null" }
            ),
            DataType::Timestamp(TimeUnit::Millisecond, Some(tz)) => {
                format!("timestamp[ms, tz={tz}]")
            }
            other => panic!("no pyarrow spelling for {other}"),
        }
    }

    #[test]
    fn shard_schema_matches_schema_file() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../schemas/shard.schema.json")).unwrap();
        assert_eq!(doc["name"], "spool shard");
        assert_eq!(doc["version"], 1);
        let columns = doc["columns"].as_array().unwrap();
        let fields = schema();
        assert_eq!(columns.len(), fields.fields().len());
        for (c, f) in columns.iter().zip(fields.fields()) {
            assert_eq!(c["name"].as_str().unwrap(), f.name());
            assert_eq!(
                c["type"].as_str().unwrap(),
                pyarrow_type(f.data_type()),
                "{}",
                f.name()
            );
            assert_eq!(
                c["nullable"].as_bool().unwrap(),
                f.is_nullable(),
                "{}",
                f.name()
            );
            assert!(!c["description"].as_str().unwrap().is_empty());
        }
        let keys: Vec<(&str, bool)> = doc["metadata_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| (k["key"].as_str().unwrap(), k["required"].as_bool().unwrap()))
            .collect();
        let required: Vec<&str> = keys.iter().filter(|k| k.1).map(|k| k.0).collect();
        assert_eq!(required, REQUIRED_METADATA_KEYS);
        let names: Vec<&str> = keys.iter().map(|k| k.0).collect();
        assert_eq!(
            names,
            [
                META_VERSION,
                META_CONFIG_SHA256,
                META_SAMPLING,
                META_TOKENIZER_SHA256,
                META_COUNT_SOURCE
            ]
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
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn shard_proptest_roundtrip(rows in proptest::collection::vec(arb_row(), 0..40)) {
            let dir = tempfile::tempdir().unwrap();
            let sealed = write(dir.path(), 0, &rows);
            prop_assert_eq!(read_rows(&sealed.path).unwrap(), rows);
        }
    }
}
