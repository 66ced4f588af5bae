//! Stage 1, input: dataset files become rows, rows are checked for duplicates and handed
//! on to be rendered and queued.
//!
//! Invariant: a row the user gave is either queued, or rejected with a message naming its
//! file and line; nothing is dropped silently.

pub mod dataset;
pub mod dedup;
pub mod intake;
