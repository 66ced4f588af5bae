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
//! `prompt_ids` (the prompt ids a row keeps, and who made them); `ending` (why a
//! generation ended, from the server's answer); `pitfalls` (settings
//! that do nothing, warned about at start); `inputs` (dataset files in object storage,
//! fetched to a local copy before intake); `plan` (what a run takes besides its config,
//! which it never changes: its partition, staging folder, fetched inputs and budgets).
//!
//! Invariant: an item (or one sample of it) is leased to at most one request at a time,
//! and a result is committed at most once.
//!
//! Invariant: leases live in memory only; a crash leaves a leased item pending, and an outcome
//! for an item no longer pending is ignored. Attempts are therefore counted per process.
//!
//! Invariant: a lane dispatches only while completed tokens plus the expected final tokens of
//! its requests in flight stay under its budget (`max_tokens` expected until 8 completions);
//! under "cancel" the committer admits only results within the budget.
//!
//! Invariant: a conversation's turn k is requested only after its turn k−1 is committed, with
//! a history built from the committed replies of the same sample; a committed generation
//! (`Outcome::Generated`, kept until its item is closed) is never requested again. A lease is
//! one (item, sample) and runs its turns in order on the server its first turn went to while
//! that server is up; the committer closes the item when its last sample ends, or when the
//! budget is met between turns (unfinished samples marked partial).
//!
//! Invariant: leases held ≤ `run.concurrency`, or with `"auto"` ≤ the sum of the limits of
//! the servers in rotation (read at each dispatch); an attempt goes to a server under its
//! limit (two racing pickers may pass it by one for an instant), or waits; a limit is ≥ 1.
//!
//! Invariant: every lease ends in one place whatever its task did (a panic in an attempt is
//! a failed attempt, elsewhere it fails the item); a server's in-flight count is a guard.

pub mod allowance;
mod archiver;
mod committer;
pub mod concurrency;
pub mod descriptors;
mod dispatcher;
mod ending;
pub mod enqueue;
pub mod inputs;
pub mod job;
pub mod pitfalls;
pub mod plan;
pub mod probe;
mod prompt_ids;
pub mod scheduler;
pub mod servers;
mod shutdown;
pub mod signals;
pub mod template_check;
mod turns;
pub mod view;
pub mod worker;
