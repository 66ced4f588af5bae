//! Stage 4, run: start-up, dispatch under budgets, the workers and their servers, the
//! committer and shutdown; `job` wires the stages together for `spool run`.
//!
//! Invariant: an item is leased to at most one request at a time, and a result is
//! committed at most once.

pub mod enqueue;
pub mod job;
pub mod probe;
pub mod scheduler;
pub mod servers;
pub mod worker;
