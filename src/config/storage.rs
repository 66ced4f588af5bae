//! The `[shards]` and `[storage]` tables: when a shard is closed and how hard it is
//! compressed, and the object-store settings beyond the `AWS_*` environment.
//!
//! Invariant: an unknown key is refused; `validate` holds `max_rows` ≥ 1 and the level
//! within zstd's 1..=22; nothing here is a credential (those stay in the environment).

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

/// Store settings beyond the `AWS_*` environment (`[storage]`), read by
/// `output::bucket`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketOptions {
    /// The S3 endpoint (else `AWS_ENDPOINT_URL`); an `http://` one allows plain HTTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Else `AWS_REGION` / `AWS_DEFAULT_REGION`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_http: Option<bool>,
    /// Retries of a failed request (5xx, 503 SlowDown, timeouts, resets); default 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<usize>,
    /// One request's timeout; default 60 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// How long a request is retried in all; default 180 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_timeout_s: Option<f64>,
}
