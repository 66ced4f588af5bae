//! The `[shards]` table: when a shard is closed and how hard it is compressed.
//!
//! Invariant: an unknown key is refused; `validate` holds `max_rows` ≥ 1 and the level
//! within zstd's 1..=22.

use serde::{Deserialize, Serialize};

/// When a shard is closed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    #[serde(default = "default_max_rows")]
    pub max_rows: usize,
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    #[serde(default = "default_compression_level")]
    pub compression_level: i32,
}

fn default_max_rows() -> usize {
    10_000
}
fn default_max_bytes() -> u64 {
    256 << 20
}
fn default_compression_level() -> i32 {
    3
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            max_rows: default_max_rows(),
            max_bytes: default_max_bytes(),
            compression_level: default_compression_level(),
        }
    }
}
