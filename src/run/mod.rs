//! The run stage: `job` wires the stages together for `spool run` (start-up, dispatch
//! under budgets) and leans on one module per job: `dispatcher` (leases into request
//! slots), `scheduler` (which row or sample next), `worker` (a request with its retries),
//! `turns` (a sample's turns in order) and `servers` (where requests go), `concurrency`
//! (each server's limit with `concurrency = "auto"`, from `signals` of its `/metrics`),
//! `probe` (what the servers are), `committer`
//! (the one writer of results and counters), `archiver` (the thread that writes shards)
//! and `shutdown` (the stop signals, the fatal-error path, the shutdown order);
//! `descriptors` keeps the run's file descriptors out of the metrics endpoint's reach;
//! `template_check` (spool's rendering against the server's, before any generation) and
//! `prompt_ids` (the prompt ids a row keeps, and who made them).
//!
//! Invariant: an item (or one sample of it) is leased to at most one request at a time,
//! and a result is committed at most once.

mod archiver;
mod committer;
pub mod concurrency;
pub mod descriptors;
mod dispatcher;
pub mod enqueue;
pub mod job;
pub mod probe;
mod prompt_ids;
pub mod scheduler;
pub mod servers;
mod shutdown;
pub mod signals;
pub mod template_check;
mod turns;
pub mod worker;
