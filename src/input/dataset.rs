//! Prompt files → raw rows, streamed: never the whole file in memory.
//!
//! Reads `.jsonl` and `.jsonl.zst` line by line, and `.parquet` row group by row group
//! (see [`super::parquet`]). [`DatasetReader::next_raw`] only cuts the file into
//! [`RawEntry`]s (a line's bytes, or a Parquet row as a JSON object), so intake can parse
//! them in parallel with [`Parser`]; [`DatasetReader::next_entry`] does both. A bad row
//! becomes a rejection naming its line (or Parquet row) and reason; only a file that
//! cannot be opened or decoded is an error.
//!
//! Invariant: a [`PrefixMark`] is only taken at a line end, so an unchanged prefix holds
//! whole lines, and skipping it leaves the reader where reading them would have.

use super::limits::{size, LimitError, EXPANSION_FLOOR, MAX_EXPANSION, ZSTD_WINDOW_LOG_MAX};
use super::parquet::ParquetSource;
use super::row::{Entry, Parser, Raw, RawEntry};
use std::hash::Hasher as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use twox_hash::XxHash64;

/// Longest line accepted; longer lines are rejected without being held in memory.
pub const MAX_LINE_BYTES: usize = super::limits::MAX_ROW_BYTES;

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
    /// Past a file limit (`super::limits`): intake of the dataset stops, the run goes on.
    #[error(transparent)]
    Limit(#[from] LimitError),
}

/// A prefix of a line-based input file: its first `lines` lines are `bytes` bytes
/// (decompressed, for `.jsonl.zst`) ending with a newline, whose xxHash64 is `xxh64`.
/// Intake keeps it with the rows it covers, so a restart can skip an unchanged prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMark {
    pub lines: u64,
    pub bytes: u64,
    pub xxh64: u64,
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
    /// For a compressed file: compressed bytes read so far, to hold the expansion to
    /// [`MAX_EXPANSION`].
    compressed: Option<Arc<AtomicU64>>,
}

impl LinePos {
    fn new(compressed: Option<Arc<AtomicU64>>) -> Self {
        Self {
            bytes: 0,
            hasher: XxHash64::with_seed(0),
            at_line_end: true,
            compressed,
        }
    }

    /// `Err` (the limit passed) once a compressed file has expanded past
    /// [`MAX_EXPANSION`] times its compressed bytes, beyond [`EXPANSION_FLOOR`].
    fn check_expansion(&self) -> std::io::Result<()> {
        let Some(c) = &self.compressed else {
            return Ok(());
        };
        let compressed = c.load(Ordering::Relaxed).max(1);
        if self.bytes > EXPANSION_FLOOR && self.bytes / compressed > MAX_EXPANSION {
            return Err(std::io::Error::other(Expanded {
                decompressed: self.bytes,
                compressed,
            }));
        }
        Ok(())
    }
}

/// A compressed file that expanded past [`MAX_EXPANSION`].
#[derive(Debug)]
struct Expanded {
    decompressed: u64,
    compressed: u64,
}

impl std::fmt::Display for Expanded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "decompressed {} from {} of the file, more than {MAX_EXPANSION}× its compressed size (a decompression bomb, or data no real dataset compresses to)",
            size(self.decompressed),
            size(self.compressed)
        )
    }
}

impl std::error::Error for Expanded {}

/// A reader counting the bytes it has read (the compressed side of a decoder).
struct Counted<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
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
            let read = Arc::new(AtomicU64::new(0));
            let counted = Counted {
                inner: file,
                read: read.clone(),
            };
            let mut dec = zstd::stream::read::Decoder::new(counted).map_err(open_err)?;
            // A frame asking for a bigger window is an error, not an allocation.
            dec.window_log_max(ZSTD_WINDOW_LOG_MAX).map_err(open_err)?;
            Source::Lines {
                reader: Box::new(BufReader::with_capacity(1 << 16, dec)),
                buf: Vec::new(),
                pos: LinePos::new(Some(read)),
            }
        } else if name.ends_with(".jsonl") || name.ends_with(".json") || name.ends_with(".ndjson") {
            Source::Lines {
                // 1 MiB reads: a restart hashes the whole prefix taken in, and smaller
                // reads cost as much system time as the hashing.
                reader: Box::new(BufReader::with_capacity(1 << 20, file)),
                buf: Vec::new(),
                pos: LinePos::new(None),
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

    /// Where the reader stands in a line-based file, as a [`PrefixMark`]: the lines read so
    /// far, their bytes and fingerprint. `None` for Parquet, or when the last line read has
    /// no newline yet (text appended to it later would change that line).
    pub fn mark(&self) -> Option<PrefixMark> {
        match &self.source {
            Source::Lines { pos, .. } if pos.at_line_end => Some(PrefixMark {
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
    pub fn skip_prefix(&mut self, m: &PrefixMark) -> Result<bool, DatasetError> {
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
                    .map_err(|source| {
                        match source.get_ref().and_then(|e| e.downcast_ref::<Expanded>()) {
                            Some(x) => DatasetError::Limit(LimitError {
                                path: self.path.clone(),
                                what: format!("line {}: {x}", self.line + 1),
                            }),
                            None => DatasetError::Read {
                                path: self.path.clone(),
                                line: self.line + 1,
                                source,
                            },
                        }
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
        pos.check_expansion()?;
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

    /// Over-long lines and bad UTF-8 reject their row only; blank lines are skipped, row
    /// numbers kept.
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

    /// A `.jsonl.zst` file is read through the decoder.
    #[test]
    fn zstd_files_stream() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl.zst");
        let raw = b"{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n";
        std::fs::write(&p, zstd::encode_all(&raw[..], 3).unwrap()).unwrap();
        assert_eq!(read_all(&p, "d").unwrap().len(), 2);
    }
}
