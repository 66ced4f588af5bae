//! A job across machines: partitions of the items, each a spool process with its own
//! `data_dir`, whose shards are committed to one object-store prefix.
//!
//! `partition` says which items a worker owns and its share of a budget; `commits` is a
//! partition's log in the object store; `worker` runs a partition and publishes its
//! shards; `manifest` is `spool finalize` and the check of the published output.

pub mod commits;
pub mod manifest;
pub mod partition;
pub mod worker;
