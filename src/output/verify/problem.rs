//! What `spool verify` can find wrong: one [`Problem`] per inconsistency between the
//! shards and the queue, each printed as one line naming the file, dataset, row and id
//! involved so the user can find it.

use std::fmt;
use std::path::{Path, PathBuf};

use super::REJECTED_FILE;
use crate::output::shard;

/// One inconsistency between the shards and the queue. Each names the file, dataset, row
/// and id involved so the user can find it; the `Display` is one line.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// A shard cannot be opened or decoded (truncated, corrupt, unreadable).
    UnreadableShard { path: PathBuf, error: String },
    /// A shard's columns are not the shard schema's.
    SchemaDrift { path: PathBuf, detail: String },
    /// A shard lacks a key-value metadata entry every shard must carry.
    MissingMetadata { path: PathBuf, key: String },
    /// A shard has column chunks not compressed with zstd.
    NotZstd { path: PathBuf },
    /// A file in a dataset folder that is neither a shard nor `_rejected.jsonl`
    /// (including a writer's temporary file left by a crash).
    StrayFile { path: PathBuf },
    /// A shard numbered at or past the dataset's `next_shard`: renamed, but the queue was
    /// not updated (a crash in between). `adoptable`: its rows are all waiting in the
    /// queue, so the next `spool run` adopts it; otherwise that run refuses to start.
    UnrecordedShard {
        path: PathBuf,
        next_shard: u64,
        adoptable: bool,
    },
    /// A shard the queue records rows in does not exist.
    MissingShard { path: PathBuf, rows: u64 },
    /// The queue says the item is done and in shard `recorded`, but no readable shard
    /// holds it.
    DoneButInNoShard {
        dataset: String,
        row: u64,
        id: String,
        recorded: PathBuf,
    },
    /// The item is in more than one shard row.
    Duplicate {
        dataset: String,
        row: u64,
        id: String,
        places: Vec<PathBuf>,
    },
    /// A shard row the queue does not have as sharded; `queue_state` says what the queue
    /// has instead.
    NotInQueue {
        path: PathBuf,
        row: u64,
        id: String,
        queue_state: &'static str,
    },
    /// The item is in one shard, but not the one the queue recorded.
    WrongShard {
        dataset: String,
        row: u64,
        id: String,
        recorded: PathBuf,
        found: PathBuf,
    },
    /// A row whose `dataset` column is not the dataset of the folder it is in.
    WrongDataset {
        path: PathBuf,
        row: u64,
        id: String,
        found: String,
    },
    /// A row whose id is not the one the queue enqueued at that row (`queue_row`: where
    /// the queue has that id, if anywhere).
    IdMismatch {
        path: PathBuf,
        row: u64,
        id: String,
        /// The id of the queue's item at that row, if it has one.
        queue_id: Option<String>,
    },
    /// `completion_token_ids` does not hold `completion_tokens` ids.
    TokenCountMismatch {
        path: PathBuf,
        row: u64,
        id: String,
        completion_tokens: u32,
        ids_len: usize,
    },
    /// An enqueued item in no state at all (neither pending, done nor failed): a torn write
    /// lost it.
    Stateless {
        dataset: String,
        row: u64,
        id: String,
    },
    /// The queue holds what a failed write left (its `needs-repair` marker).
    NeedsRepair { path: PathBuf },
    /// A durable counter of the queue differs from what the scan counted.
    CounterMismatch {
        dataset: String,
        what: &'static str,
        counter: u64,
        counted: u64,
    },
}

impl Problem {
    /// The file the problem is about, when it is about one file.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Problem::UnreadableShard { path, .. }
            | Problem::SchemaDrift { path, .. }
            | Problem::MissingMetadata { path, .. }
            | Problem::NotZstd { path }
            | Problem::StrayFile { path }
            | Problem::UnrecordedShard { path, .. }
            | Problem::MissingShard { path, .. }
            | Problem::NotInQueue { path, .. }
            | Problem::WrongDataset { path, .. }
            | Problem::IdMismatch { path, .. }
            | Problem::TokenCountMismatch { path, .. }
            | Problem::NeedsRepair { path } => Some(path),
            Problem::DoneButInNoShard { recorded, .. } => Some(recorded),
            Problem::WrongShard { found, .. } => Some(found),
            Problem::Duplicate { .. }
            | Problem::CounterMismatch { .. }
            | Problem::Stateless { .. } => None,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnreadableShard { path, error } => {
                write!(f, "{}: unreadable shard: {error}", path.display())
            }
            Problem::SchemaDrift { path, detail } => write!(
                f,
                "{}: schema differs from the shard schema: {detail}",
                path.display()
            ),
            Problem::MissingMetadata { path, key } => {
                write!(f, "{}: metadata key `{key}` is missing", path.display())
            }
            Problem::NotZstd { path } => write!(
                f,
                "{}: some column chunks are not zstd-compressed",
                path.display()
            ),
            Problem::StrayFile { path } => {
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if shard::is_temp_file(&name) {
                    write!(
                        f,
                        "{}: stray file: a shard writer's temporary file left by a crash \
                         (the next `spool run` deletes it)",
                        path.display()
                    )
                } else {
                    write!(
                        f,
                        "{}: stray file: neither a part-NNNNNN.parquet shard nor {REJECTED_FILE}",
                        path.display()
                    )
                }
            }
            Problem::UnrecordedShard {
                path,
                next_shard,
                adoptable,
            } => {
                write!(
                    f,
                    "{}: shard not recorded in the queue (its next_shard is {next_shard}): \
                     a run stopped between the rename and the queue update; ",
                    path.display()
                )?;
                if *adoptable {
                    write!(f, "the next `spool run` adopts it")
                } else {
                    write!(
                        f,
                        "its rows are not all waiting for a shard, so `spool run` will refuse it \
                         (see the other problems for its rows)"
                    )
                }
            }
            Problem::MissingShard { path, rows } => write!(
                f,
                "{}: missing: the queue records {rows} row(s) in this shard",
                path.display()
            ),
            Problem::DoneButInNoShard {
                dataset,
                row,
                id,
                recorded,
            } => write!(
                f,
                "{dataset}: row {row} (id `{id}`) is done and recorded in {}, but no readable \
                 shard holds it",
                recorded.display()
            ),
            Problem::Duplicate {
                dataset,
                row,
                id,
                places,
            } => {
                let places: Vec<String> = places.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "{dataset}: row {row} (id `{id}`) is in {} shard rows: {}",
                    places.len(),
                    places.join(", ")
                )
            }
            Problem::NotInQueue {
                path,
                row,
                id,
                queue_state,
            } => write!(
                f,
                "{}: row {row} (id `{id}`) is not recorded as sharded in the queue, which has it \
                 {queue_state}",
                path.display()
            ),
            Problem::WrongShard {
                dataset,
                row,
                id,
                recorded,
                found,
            } => write!(
                f,
                "{dataset}: row {row} (id `{id}`) is in {} but the queue records it in {}",
                found.display(),
                recorded.display()
            ),
            Problem::WrongDataset {
                path,
                row,
                id,
                found,
            } => write!(
                f,
                "{}: row {row} (id `{id}`) belongs to dataset `{found}`",
                path.display()
            ),
            Problem::IdMismatch {
                path,
                row,
                id,
                queue_id,
            } => match queue_id {
                Some(q) => write!(
                    f,
                    "{}: row {row} has id `{id}`, but the queue's item at row {row} is `{q}`",
                    path.display()
                ),
                None => write!(
                    f,
                    "{}: row {row} has id `{id}`, but the queue has no item at row {row}",
                    path.display()
                ),
            },
            Problem::TokenCountMismatch {
                path,
                row,
                id,
                completion_tokens,
                ids_len,
            } => write!(
                f,
                "{}: row {row} (id `{id}`): completion_tokens is {completion_tokens} but \
                 completion_token_ids holds {ids_len} ids",
                path.display()
            ),
            Problem::CounterMismatch {
                dataset,
                what,
                counter,
                counted,
            } => write!(
                f,
                "{dataset}: queue counter `{what}` is {counter} but the queue records and shards \
                 hold {counted}"
            ),
            Problem::Stateless { dataset, row, id } => write!(
                f,
                "{dataset}: row {row} (id `{id}`) is enqueued but neither pending, done nor \
                 failed (a failed write lost it; `spool run` repairs the queue when it left its \
                 marker)"
            ),
            Problem::NeedsRepair { path } => write!(
                f,
                "{}: a queue write failed in the last run and may have left half a batch; the \
                 next `spool run` repairs the queue before anything else",
                path.display()
            ),
        }
    }
}
