//! The shard: a zstd Parquet file of completed items, `output_dir/<dataset>/part-NNNNNN.parquet`,
//! and the vocabulary its writer, reader, archive and verifier share: the row, the limits
//! that close a shard, the error, and the file names.
//!
//! Invariant: only the canonical name [`shard_file_name`] gives is a shard, only
//! [`temp_file_name`] a shard being written; two files never claim one index.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use arrow_schema::ArrowError;
use parquet::errors::ParquetError;

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
    /// The config's defaults: 10 000 rows, 256 MiB, zstd 3.
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
    /// The file's columns are not the shard schema (`output::schema`).
    #[error("shard {}: schema differs from the shard schema: {detail}", path.display())]
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
    /// Bad limits or metadata given to the shard writer.
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

    /// The message without the file name, for reports that name the file themselves.
    pub fn detail(&self) -> String {
        match self {
            ShardError::Io { source, .. } => source.to_string(),
            ShardError::Parquet { source, .. } => source.to_string(),
            ShardError::Arrow { source, .. } => source.to_string(),
            ShardError::Schema { detail, .. } | ShardError::Invalid { detail, .. } => {
                detail.clone()
            }
            other => other.to_string(),
        }
    }

    pub(crate) fn io(path: &Path, source: io::Error) -> Self {
        ShardError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn parquet(path: &Path, source: ParquetError) -> Self {
        ShardError::Parquet {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn arrow(path: &Path, source: ArrowError) -> Self {
        ShardError::Arrow {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn schema(path: &Path, detail: String) -> Self {
        ShardError::Schema {
            path: path.to_path_buf(),
            detail,
        }
    }
}

/// A shard the writer's `finish` made visible: what the queue records.
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

/// The entries of a dataset's output folder; none when the folder does not exist (nothing
/// has been written to it yet).
pub fn folder_entries(dir: &Path) -> io::Result<Vec<fs::DirEntry>> {
    match fs::read_dir(dir) {
        Ok(entries) => entries.collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::schema::schema;
    use crate::output::writer::tests::sample;
    use crate::store::row::ShardRow;

    /// Only the canonical `part-NNNNNN.parquet` spelling is a shard, and only its hidden
    /// `.tmp` form a writer's temporary file.
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

    /// The row's serde field names are the column names (`completed_at_ms` for the
    /// timestamp), and a row survives JSON.
    #[test]
    fn shard_row_serde_field_names() {
        let v = serde_json::to_value(sample(1)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let schema = schema();
        let mut cols: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        // The one deliberate difference: the column is a timestamp, the field says its unit.
        let at = cols.iter().position(|c| *c == "completed_at").unwrap();
        cols[at] = "completed_at_ms";
        assert_eq!(keys, cols);
        let back: ShardRow = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample(1));
    }

    /// A folder that does not exist holds no entries; an existing one lists its files.
    #[test]
    fn folder_entries_of_a_missing_folder_are_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(folder_entries(&dir.path().join("absent"))
            .unwrap()
            .is_empty());
        fs::write(dir.path().join(shard_file_name(0)), b"x").unwrap();
        let names: Vec<_> = folder_entries(dir.path())
            .unwrap()
            .iter()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [shard_file_name(0)]);
    }
}
