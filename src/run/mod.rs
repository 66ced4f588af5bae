//! The run stage: `job` wires the stages together for `spool run` (start-up, dispatch
//! under budgets) and leans on one module per job: `dispatcher` (leases into request
//! slots), `scheduler` (which row or sample next), `worker` (a request with its retries),
//! `turns` (a sample's turns in order) and `servers` (where requests go), `concurrency`
//! (each server's limit with `concurrency = "auto"`, from `signals` of its `/metrics`),
//! `probe` (what the servers are), `committer`
//! (the one writer of results and counters), `archiver` (the thread that writes shards)
//! and `shutdown` (the stop signals, the fatal-error path, the shutdown order).
//!
//! Invariant: an item (or one sample of it) is leased to at most one request at a time,
//! and a result is committed at most once.

mod archiver;
mod committer;
pub mod concurrency;
mod dispatcher;
pub mod enqueue;
pub mod job;
pub mod probe;
pub mod scheduler;
pub mod servers;
mod shutdown;
pub mod signals;
mod turns;
pub mod worker;
