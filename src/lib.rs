//! spool: prompt datasets → LLM completions → zstd Parquet shards, crash-safe and resumable.
//!
//! The data flows one way: `config` → `dataset` (rows) → `template` (prompt text and ids)
//! → `queue` (sled, the source of truth) → `scheduler` (budgets, slots) → `upstream`
//! (the inference server) → `queue` (results, durably) → `shard` (Parquet files).
//! `job` wires them together for `spool run`; `status`, `metrics` and `http` observe.

pub mod archive;
pub mod bars;
pub mod blocks;
pub mod budget;
pub mod byte_bpe;
pub mod config;
pub mod dataset;
pub mod dedup;
pub mod drain;
pub mod error;
pub mod export;
pub mod http;
pub mod intake;
pub mod job;
pub mod metrics;
pub mod mock;
pub mod monitor;
pub mod probe;
pub mod progress;
pub mod queue;
pub mod results;
pub mod scheduler;
pub mod servers;
pub mod shard;
pub mod status;
pub mod template;
pub mod upstream;
pub mod verify;
pub mod worker;
