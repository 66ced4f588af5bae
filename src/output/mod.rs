//! Stage 5, output: committed results become zstd Parquet shards; the same shards are read
//! back by `spool show`, `verify` and `export` through the one [`reader`].
//!
//! Invariant: a shard is visible under its final name only once it is complete and synced.
//! Every file and folder here is made through [`files`]: explicit modes, no planted names.

pub mod archive;
pub mod bucket;
pub mod export;
pub mod files;
pub mod reader;
pub mod schema;
pub mod shard;
pub mod verify;
pub mod writer;
