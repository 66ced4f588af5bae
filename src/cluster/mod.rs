//! A job across machines: partitions of the items, each a spool process with its own
//! `data_dir`, whose shards are committed to one object-store prefix.
//!
//! `partition` says which items a worker owns and its share of a budget; `commits` is a
//! partition's log in the object store; `worker` runs a partition and publishes its
//! shards; `manifest` is `spool finalize` and the check of the published output.
//!
//! The cluster commit protocol (`cluster::commits`), per partition:
//!
//! 1. A worker uploads a sealed local shard, minus the rows of items any earlier record of the
//!    partition holds (and, under "cancel", of items that would pass the partition's budget
//!    share), to a key unique to its writer id, shard and content (multipart: a reader never
//!    sees part of an object).
//! 2. Having read records `0..k`, it creates record `k` with a conditional put
//!    (`If-None-Match: *`). If someone else's record `k` exists, it reads it and goes back to 1
//!    at `k+1`. A conditional put whose answer was lost and that finds its own bytes there is
//!    its own.
//! 3. A worker that ends its run cleanly writes `_spool/pNNNN/done.json`. `finalize` refuses
//!    until every partition has one, copies each record's object to
//!    `<dataset>/part-<partition>-<seq>.parquet` and writes `_manifest.json` last.
//!
//! Invariant: the records of a partition hold disjoint items, and each names an object wholly
//! uploaded before the record existed; so the published folder holds each committed item
//! once, and a worker killed at any instant loses nothing (its local shards are published on
//! its next start) and duplicates nothing (items already recorded are left out).
//!
//! Invariant: an item belongs to partition `xxh64(dataset ‖ 0 ‖ id) mod N` — whatever the file
//! order, run or machine; a worker takes in only its own items not yet committed, so a worker
//! on a new, empty `data_dir` generates only what its partition lacks.
//!
//! Invariant: a dataset's budget shares (by item counts, largest remainder) sum to its budget;
//! a worker's budget is its share less the tokens other writers of its partition committed.
//!
//! Invariant: nothing read from the store is trusted. A commit record, done marker or
//! rejected-rows object is used only if a worker of this job could have written it
//! (`commits::check`: its own partition, seq and partition count, a dataset name, items its
//! partition owns and no earlier record holds, a shard exactly at its writer's upload key,
//! no items without one); anything else is an error naming the object — `finalize` and the
//! worker stop before publishing or skipping anything, `verify` reports it. A published copy
//! is kept only with its record's size and sha256. A manifest is used only once its names
//! are dataset names and its paths the published names, so no name from a store becomes a
//! local path. An object is read into memory only up to a stated size.

pub mod commits;
pub mod manifest;
pub mod partition;
pub mod worker;
