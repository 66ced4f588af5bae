//! A job across machines: partitions of the items, each a spool process with its own
//! `data_dir`, whose shards are committed to one object-store prefix.
//!
//! `partition` says which items a worker owns; `job` is the job record, the shape every
//! worker and command checks; `commits` is a partition's log in the object store;
//! `budget` shares each budget over the partitions in tickets; `heartbeat` is a worker's
//! status in the store; `worker` runs a partition, `publisher` uploads and commits its
//! shards; `finalize` seals and publishes the job, `manifest` is what it leaves for
//! readers; `verify`, `status` and `retry` are those commands of a cluster job.
//!
//! The protocol, per partition: a worker uploads a sealed local shard (multipart: never
//! visible in part), minus the items an earlier record of the partition holds (and, under
//! "cancel", those past its allowance), to a key unique to its writer, shard and content;
//! having read records `0..k` it creates record `k` with a conditional put; if another
//! writer's record `k` is there it reads it and starts again at `k+1`; records read while
//! the shard uploaded are checked against it before the put. A worker that
//! starts withdraws its partition's done marker; one that finishes records its items that
//! failed for good, gives back unused budget and writes the marker. `finalize` refuses
//! until every partition has a marker (or `--partial`), appends a seal to every log (a
//! conditional create, so a late commit lands before it and is published, or after it
//! and is refused), publishes the records before the seal and writes `_manifest.json`
//! last. Invariants: the shard records of a partition hold disjoint items, each naming an
//! object wholly uploaded before the record existed, so the published folder holds each
//! committed item once; nothing is committed after a seal; no store object is used
//! before it passes the checks of its kind (`commits::check`, `job::parse`, the budget
//! log's, `heartbeat::read`).
//!
//! Invariant: the job's shape (partition count, inputs, budgets, `max_prompts`, item
//! settings) is fixed in the job record; no worker reads or writes anything else before its
//! shape matches, and `finalize`, `verify` and `status` refuse a config that does not.
//!
//! Invariant: a budget's claims less its returns never pass it (tickets are conditional
//! creates in the budget log); a partition's allowance is its claims less its releases, in
//! its own log; under "cancel" no commit passes the allowance, so the job's committed tokens
//! never pass the budget.
//!
//! Invariant: nothing read from the store is trusted. A record, checkpoint, job record, budget
//! ticket, done marker, status or rejected-rows object is used only if a worker of this job
//! could have written it (filed under its own name, this job's partition count, dataset
//! names, items its partition owns and no earlier record holds, a shard exactly at its
//! writer's upload key, a claim the budget log gives, nothing but a retry after a seal);
//! anything else is an error naming the object — `finalize` and the worker stop before
//! publishing or skipping anything, `verify` reports it. A published copy is kept only with
//! its record's size and sha256. A manifest is used only once its names are dataset names
//! and its paths the published names, so no name from a store becomes a local path. An
//! object is read into memory only up to a stated size.

pub mod budget;
pub mod commits;
pub mod finalize;
pub mod heartbeat;
pub mod job;
pub mod manifest;
pub mod partition;
mod publisher;
pub mod status;
pub mod verify;
pub mod worker;
