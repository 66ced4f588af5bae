//! Stage 3, store: the crash-safe queue (sled records, prompt blocks, the results log),
//! the one source of truth of what is pending, in flight, done and sharded.
//!
//! Invariant: a state change is acknowledged only after it is durable; every record format
//! is versioned and migrated forward.

pub mod blocks;
mod cache;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod keys;
mod migrate;
mod open;
pub mod queue;
pub mod records;
pub mod repair;
pub mod results;
pub mod row;
pub mod stop_reason;
mod writes;
