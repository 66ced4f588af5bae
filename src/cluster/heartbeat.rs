//! A worker's status in the store (`_spool/pNNNN/status.json`): where its partition
//! stands, and a heartbeat, so `spool status` tells a running worker from a dead one and
//! the budget agent takes back a dead partition's unused budget.
//!
//! A running worker writes it at start and every [`EVERY`] (with its live `/status`
//! when its metrics endpoint is on), and once more when it stops. Beside it each worker
//! keeps its own presence (`_spool/pNNNN/writers/<writer>.json`, the same record without
//! the report), since two workers of one partition (twins) overwrite each other's status:
//! a worker that stops asks it whether a twin still runs before giving budget back.
//! Invariant: a status object is shown or used only if it is filed under its own
//! partition of this job's count (and a presence under its own writer), with a writer id
//! and dataset names; it is read up to `commits::RECORD_BYTES`.

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

/// Writes partition `p`'s status and `writer`'s presence.
pub async fn write(
    bucket: &Bucket,
    p: Partition,
    writer: &str,
    running: bool,
    report: Option<StatusReport>,
) -> Result<(), BucketError> {
    write_presence(bucket, p, writer, running).await?;
    let body = serde_json::to_vec_pretty(&status(p, writer, running, report)).unwrap_or_default();
    bucket.put(&commits::status_key(p.index), body.into()).await
}

/// Writes `writer`'s presence alone: a worker stopping while a twin runs leaves the
/// partition's status to the twin, which is still running it.
pub async fn write_presence(
    bucket: &Bucket,
    p: Partition,
    writer: &str,
    running: bool,
) -> Result<(), BucketError> {
    let body = serde_json::to_vec_pretty(&status(p, writer, running, None)).unwrap_or_default();
    bucket
        .put(&presence_key(p.index, writer), body.into())
        .await
}

fn status(p: Partition, writer: &str, running: bool, report: Option<StatusReport>) -> WorkerStatus {
    WorkerStatus {
        format: commits::FORMAT,
        partition: p.index,
        partitions: p.count,
        writer: writer.into(),
        heartbeat_unix: crate::cluster::job::now_unix(),
        running,
        report,
    }
}

/// The key of `writer`'s presence in partition `p`.
pub fn presence_key(p: u32, writer: &str) -> String {
    format!("{}/writers/{writer}.json", commits::partition_prefix(p))
}

/// The other workers of partition `p` (twins of `me`, running since `since_unix`) that
/// say they are running, with a heartbeat within [`STALE_S`] and after `me` started: a
/// worker killed before `me` took over is not a twin (a twin beats every [`EVERY`], so
/// only a worker stopping within its first beat's period can miss one). A presence filed under another name, or that is not a
/// worker's of this partition, is [`CommitError::Untrusted`], naming it.
pub async fn live_twins(
    bucket: &Bucket,
    p: Partition,
    me: &str,
    since_unix: u64,
) -> Result<Vec<String>, CommitError> {
    let prefix = format!("{}/writers/", commits::partition_prefix(p.index));
    let now = crate::cluster::job::now_unix();
    let mut live = Vec::new();
    for (key, _) in bucket.list(&prefix).await? {
        let Some(name) = key
            .strip_prefix(&prefix)
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|n| crate::config::valid_name(n))
        else {
            return Err(untrusted(
                &key,
                "not a worker's presence (they are named writers/<writer id>.json)",
            ));
        };
        if name == me {
            continue;
        }
        let Some(body) = bucket.get_capped(&key, commits::RECORD_BYTES).await? else {
            continue;
        };
        let s: WorkerStatus = serde_json::from_slice(&body)
            .map_err(|e| untrusted(&key, format!("not a worker's presence: {e}")))?;
        if s.partition != p.index || s.partitions != p.count || s.writer != name {
            return Err(untrusted(
                &key,
                format!(
                    "it says writer {:?} of partition {} of {}, but is filed under writer {name:?} of partition {} of {}",
                    s.writer, s.partition, s.partitions, p.index, p.count
                ),
            ));
        }
        let fresh = now.saturating_sub(s.heartbeat_unix) <= STALE_S;
        if s.running && fresh && s.heartbeat_unix > since_unix {
            live.push(s.writer);
        }
    }
    Ok(live)
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
