//! A worker's status in the store (`_spool/pNNNN/status.json`): where its partition
//! stands, and a heartbeat, so `spool status` tells a running worker from a dead one and
//! the budget agent takes back a dead partition's unused budget.
//!
//! A running worker writes it at start and every [`EVERY`] (with its live `/status`
//! when its metrics endpoint is on), and once more when it stops. Invariant: a status
//! object is shown or used only if it is filed under its own partition of this job's
//! count, with a writer id and dataset names; it is read up to `commits::RECORD_BYTES`.

use crate::cluster::commits::{self, untrusted, CommitError};
use crate::cluster::partition::Partition;
use crate::observe::status::StatusReport;
use crate::output::bucket::{Bucket, BucketError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How often a running worker writes its status.
pub const EVERY: Duration = Duration::from_secs(15);

/// A running worker whose heartbeat is older than this shows as stale.
pub const STALE_S: u64 = 60;

/// The stored status of a partition's worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub format: u32,
    pub partition: u32,
    pub partitions: u32,
    pub writer: String,
    /// When it was written (seconds since the Unix epoch).
    pub heartbeat_unix: u64,
    /// Written by a running worker (else when it stopped).
    pub running: bool,
    /// Its queue's report, when it had one.
    #[serde(default)]
    pub report: Option<StatusReport>,
}

/// Writes partition `p`'s status.
pub async fn write(
    bucket: &Bucket,
    p: Partition,
    writer: &str,
    running: bool,
    report: Option<StatusReport>,
) -> Result<(), BucketError> {
    let s = WorkerStatus {
        format: commits::FORMAT,
        partition: p.index,
        partitions: p.count,
        writer: writer.into(),
        heartbeat_unix: crate::cluster::job::now_unix(),
        running,
        report,
    };
    let body = serde_json::to_vec_pretty(&s).unwrap_or_default();
    bucket.put(&commits::status_key(p.index), body.into()).await
}

/// Reads partition `p`'s status: `None` when there is none; one that is not a worker's of
/// this partition is [`CommitError::Untrusted`], naming it.
pub async fn read(bucket: &Bucket, p: Partition) -> Result<Option<WorkerStatus>, CommitError> {
    let key = commits::status_key(p.index);
    let Some(body) = bucket.get_capped(&key, commits::RECORD_BYTES).await? else {
        return Ok(None);
    };
    let s: WorkerStatus = serde_json::from_slice(&body)
        .map_err(|e| untrusted(&key, format!("not a worker's status: {e}")))?;
    if s.partition != p.index || s.partitions != p.count {
        return Err(untrusted(
            &key,
            format!(
                "it says partition {} of {}, but is filed under partition {} of {}",
                s.partition, s.partitions, p.index, p.count
            ),
        ));
    }
    if !crate::config::valid_name(&s.writer) {
        return Err(untrusted(
            &key,
            format!("writer {:?} is not a writer id", s.writer),
        ));
    }
    if let Some(d) = s
        .report
        .iter()
        .flat_map(|r| &r.datasets)
        .find(|d| !commits::is_dataset_name(&d.name))
    {
        return Err(untrusted(
            &key,
            format!("dataset {:?} is not a dataset name", d.name),
        ));
    }
    Ok(Some(s))
}
