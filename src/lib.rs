//! spool: prompt datasets → LLM completions → zstd Parquet shards, crash-safe and resumable.
//!
//! The data flows one way through the stages, one folder each: `input` (dataset rows) →
//! `prompt` (prompt text and ids) → `store` (the sled queue, the source of truth) → `run`
//! (dispatch under budgets, workers) → `upstream` (the inference server) → `store`
//! (results, durably) → `output` (Parquet shards). `estimate` and `observe` watch the run;
//! `mock` is the bundled inference server.

pub mod cluster;
pub mod config;
pub mod crypto;
pub mod error;
pub mod estimate;
pub mod input;
pub mod knobs;
pub mod mock;
pub mod observe;
pub mod output;
pub mod prompt;
pub mod run;
pub mod secrets;
pub mod store;
pub mod upstream;
