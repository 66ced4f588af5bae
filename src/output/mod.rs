//! Stage 5, output: committed results become zstd Parquet shards; the same shards are read
//! back by `verify`, `export` and `show`.
//!
//! Invariant: a shard is visible under its final name only once it is complete and synced.

pub mod archive;
pub mod export;
pub mod shard;
pub mod verify;
