//! Stage 1, input: dataset files become rows, rows are checked for duplicates and handed
//! on to be rendered, encoded and stored.
//!
//! Invariant: a row the user gave is either taken in, or rejected with a message naming its
//! file and line; nothing is dropped silently.
//!
//! [`batch`] reads rows in the OpenAI batch shape. [`dataset`] streams a file as raw rows ([`parquet`] for Parquet files); [`row`] parses a
//! raw row or says why it is rejected; [`dedup`] is the set of ids taken in; [`intake`]
//! runs them in parallel and hands the result to an [`intake::IntakeSink`]. The stage does
//! not know the queue: the sink is implemented where the queue is (`crate::run::enqueue`).
//! Dataset files kept in object storage are fetched to a local copy first, by the run
//! (`crate::run::inputs`), since the object store's door is `output::bucket`.
//! [`limits`] holds the sizes every row and file is held to (memory bounded on any input).

pub mod batch;
pub mod dataset;
pub mod dedup;
pub mod intake;
pub mod limits;
pub mod parquet;
pub mod row;
