//! The shard writer: rows to a hidden temporary file, then one durable rename.
//!
//! [`ShardWriter`] writes shard `N` as `.part-NNNNNN.parquet.tmp`, row group by row group
//! (every [`ROW_GROUP_MAX_ROWS`] rows or ~[`ROW_GROUP_MAX_BYTES`], whichever comes first, so
//! a writer holds at most one row group in memory); `finish` closes it, fsyncs the file,
//! renames it to `part-NNNNNN.parquet` and fsyncs the directory. Appends are converted to
//! Arrow in batches small enough that Utf8's i32 offsets cannot overflow. The columns in
//! [`PLAIN_COLUMNS`] are written without a dictionary; a test checks each column chunk of a
//! written file against that list, so a misspelt column path cannot leave one on.
//!
//! Invariant: a file named `part-*.parquet` is always complete. Nothing else creates a file
//! under that name, and an existing one is never overwritten. A crash leaves at most a
//! temporary file, which [`is_temp_file`] recognises so recovery can delete it.
//!
//! Fault points, for the crash and disk-full test harnesses, are given at construction
//! ([`crate::knobs::Faults`]):
//! - `shard_pause`: `finish` sleeps that long after the temporary file is fsynced but
//!   before the rename, and again after the rename (and directory fsync) but before
//!   returning, so an external SIGKILL can land inside finalisation.
//! - `shard_write_error`: `append` and `finish` fail with an injected [`ShardError::Io`] of
//!   kind `StorageFull` ("injected write error (SPOOL_FAULT_SHARD_WRITE_ERROR)"), as a full
//!   disk would; the writer is then unusable and dropping it removes the temporary file.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt32Builder};
use arrow_array::{
    ArrayRef, RecordBatch, StringArray, TimestampMillisecondArray, UInt32Array, UInt64Array,
};
use arrow_schema::ArrowError;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use crate::knobs::Faults;
use crate::output::schema::{leaf_path, list_item_field, schema, PLAIN_COLUMNS};
#[cfg(doc)]
use crate::output::shard::is_temp_file;
use crate::output::shard::{shard_file_name, temp_file_name, SealedShard, ShardError, ShardLimits};
use crate::store::row::ShardRow;

/// A row group is written every this many rows (bounded memory, cheap partial reads).
pub const ROW_GROUP_MAX_ROWS: usize = 1024;
/// ... or when its estimated encoded size reaches this, whichever comes first.
pub const ROW_GROUP_MAX_BYTES: usize = 64 << 20;
/// Appended rows are converted to Arrow in batches of at most this many text bytes, so a
/// batch never overflows Utf8's i32 offsets.
const BATCH_MAX_BYTES: usize = 64 << 20;
const INJECTED_ERROR: &str = "injected write error (SPOOL_FAULT_SHARD_WRITE_ERROR)";

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
        // A stale temporary file from a crash is replaced, never written through.
        let file = crate::output::files::replace(&temp_path, crate::output::files::FILE_MODE)
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
    /// recovery to adopt (`reader::read_keys`).
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

/// Text and token-id bytes of a row plus a fixed overhead: what buffering it or converting
/// it to Arrow costs, roughly. The archive sizes its buffer and the writer its batches by it.
pub(crate) fn row_bytes(r: &ShardRow) -> usize {
    r.id.len()
        + r.prompt.len()
        + r.completion.len()
        + r.messages.as_ref().map_or(0, String::len)
        + [
            &r.reasoning,
            &r.tool_calls,
            &r.tools,
            &r.sampling,
            &r.partial,
        ]
        .into_iter()
        .map(|t| t.as_ref().map_or(0, String::len))
        .sum::<usize>()
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

fn opt_strings<'a>(rows: &'a [ShardRow], f: impl Fn(&'a ShardRow) -> Option<&'a str>) -> ArrayRef {
    Arc::new(rows.iter().map(f).collect::<StringArray>())
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

pub(crate) fn rows_to_batch(rows: &[ShardRow]) -> Result<RecordBatch, ArrowError> {
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
        u32s(rows, |r| r.sample),
        u32s(rows, |r| r.turn),
        opt_strings(rows, |r| r.reasoning.as_deref()),
        opt_strings(rows, |r| r.tool_calls.as_deref()),
        opt_strings(rows, |r| r.tools.as_deref()),
        opt_strings(rows, |r| r.sampling.as_deref()),
        opt_strings(rows, |r| r.partial.as_deref()),
        opt_strings(rows, |r| r.prompt_ids_source.map(|s| s.as_str())),
    ];
    RecordBatch::try_new(schema(), columns)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::output::reader::{read_info, read_metadata, read_rows};
    use crate::output::schema::{META_CONFIG_SHA256, META_SAMPLING, META_VERSION};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use std::time::Duration;

    /// A row with a different mix of nulls, empty lists, unicode and counts for each `i`.
    pub(crate) fn sample(i: u64) -> ShardRow {
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
            sample: i as u32 % 3,
            turn: i as u32 / 2,
            reasoning: (!i.is_multiple_of(2)).then(|| format!("thinking {i} ü")),
            tool_calls: i
                .is_multiple_of(3)
                .then(|| r#"[{"type":"function","function":{"name":"f"}}]"#.into()),
            tools: i.is_multiple_of(3).then(|| "[]".into()),
            sampling: Some(format!(r#"{{"seed":{i}}}"#)),
            partial: (i % 4 == 3).then(|| "budget".into()),
            prompt_ids_source: match i % 3 {
                0 => None,
                1 => Some(crate::prompt::remote::IdsSource::Client),
                _ => Some(crate::prompt::remote::IdsSource::Server),
            },
        }
    }

    /// The required metadata keys, with plausible values.
    pub(crate) fn meta() -> Vec<(String, String)> {
        vec![
            (META_VERSION.into(), "0.1.0".into()),
            (META_CONFIG_SHA256.into(), "ab".repeat(32)),
            (META_SAMPLING.into(), r#"{"temperature":0.7}"#.into()),
        ]
    }

    /// Limits that close a shard at `max_rows` only.
    fn limits(max_rows: usize) -> ShardLimits {
        ShardLimits {
            max_rows,
            max_bytes: 1 << 30,
            compression_level: 3,
        }
    }

    /// The sorted file names in `dir`.
    fn list(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Writes `rows` as shard `index` of `dir` and seals it.
    pub(crate) fn write(dir: &Path, index: u64, rows: &[ShardRow]) -> SealedShard {
        let mut w = ShardWriter::create(dir, index, &limits(1_000_000), meta(), &Faults::default())
            .unwrap();
        w.append(rows).unwrap();
        w.finish().unwrap()
    }

    /// The writer and its error can move to the blocking thread `finish` runs on.
    #[test]
    fn shard_writer_is_send() {
        // `finish` runs on a blocking thread.
        fn assert_send<T: Send + 'static>() {}
        assert_send::<ShardWriter>();
        assert_send::<ShardError>();
    }

    /// An empty append is a no-op, and appends of any size land in row groups of
    /// `ROW_GROUP_MAX_ROWS` rows.
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

    /// A writer is full at `max_rows` rows or at `max_bytes` estimated bytes.
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

    /// Until `finish`, only the hidden temporary file exists; after it, only the shard.
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

    /// Abandoning or dropping an unfinished writer removes its temporary file.
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

    /// A sealed shard is never overwritten, while a temporary file left by a crash is.
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

    /// The caller's metadata is stored as given, every column chunk is zstd, and the stored
    /// schema is the shard schema.
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
            assert_eq!(rg.columns().len(), 24);
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

    /// Exactly the `PLAIN_COLUMNS` are written without a dictionary, and each names a real
    /// column.
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

    /// Bad limits or a reserved metadata key are refused before any file is created.
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

    /// The `shard_write_error` fault fails `append` or `finish` as a full disk would, poisons
    /// the writer and leaves no file.
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

    /// The `shard_pause` fault delays `finish` twice and the shard is still sealed.
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
}
