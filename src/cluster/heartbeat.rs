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
/// say they are running, with a heartbeat within [`STALE_S`] and after `me` started. A
/// running presence whose last beat is not after `me` started may be a worker killed
/// before `me` took over (it says running until it goes stale) or a twin that started
/// with `me` and has not beaten since (beats come every [`EVERY`], later when a sweep
/// holds them up): it is read again until `patience` after that beat, and counts once it
/// beats. A presence filed under another name, or that is not a worker's of this
/// partition, is [`CommitError::Untrusted`], naming it.
pub async fn live_twins(
    bucket: &Bucket,
    p: Partition,
    me: &str,
    since_unix: u64,
    patience: Duration,
) -> Result<Vec<String>, CommitError> {
    let mut told = false;
    loop {
        let now = crate::cluster::job::now_unix();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let (mut live, mut doubtful) = (Vec::new(), false);
        for s in presences(bucket, p, me).await? {
            if !s.running || now.saturating_sub(s.heartbeat_unix) > STALE_S {
                continue;
            }
            if s.heartbeat_unix > since_unix {
                live.push(s.writer);
            } else if now_ms < u128::from(s.heartbeat_unix) * 1000 + patience.as_millis() {
                doubtful = true;
            }
        }
        if !doubtful {
            return Ok(live);
        }
        if !told {
            told = true;
            tracing::info!(partition = p.index, patience_s = patience.as_secs(),
                "another worker of this partition says it runs but has not beaten since this one started: watching it for a beat");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The presences of partition `p`'s workers other than `me`.
async fn presences(
    bucket: &Bucket,
    p: Partition,
    me: &str,
) -> Result<Vec<WorkerStatus>, CommitError> {
    let prefix = format!("{}/writers/", commits::partition_prefix(p.index));
    let mut out = Vec::new();
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
        out.push(s);
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::bucket::BucketOptions;
    use std::sync::Arc;

    fn presence(writer: &str, heartbeat_unix: u64, running: bool) -> bytes::Bytes {
        let mut s = status(Partition { index: 0, count: 2 }, writer, running, None);
        s.heartbeat_unix = heartbeat_unix;
        serde_json::to_vec(&s).unwrap().into()
    }

    /// A twin that started in the same second as this worker and has not beaten since
    /// counts once it beats while this worker watches it; without the watch (or one that
    /// never beats again, a worker killed before) it does not.
    #[test]
    fn a_twin_not_seen_beating_since_this_worker_started_is_watched_for_a_beat() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
            let p = Partition { index: 0, count: 2 };
            let since = crate::cluster::job::now_unix();
            b.put(&presence_key(0, "w1"), presence("w1", since, true))
                .await
                .unwrap();
            let at_once = live_twins(&b, p, "w0", since, Duration::ZERO)
                .await
                .unwrap();
            assert!(at_once.is_empty(), "{at_once:?}");
            // It never beats again: dropped once the patience is spent.
            let dead = live_twins(&b, p, "w0", since, Duration::from_millis(1500))
                .await
                .unwrap();
            assert!(dead.is_empty(), "{dead:?}");
            // It beats once the watch has read it.
            let before = b.requests();
            let beat = {
                let b = b.clone();
                tokio::spawn(async move {
                    while b.requests() < before + 2 {
                        tokio::task::yield_now().await;
                    }
                    b.put(&presence_key(0, "w1"), presence("w1", since + 1, true))
                        .await
                        .unwrap();
                })
            };
            let live = live_twins(&b, p, "w0", since, Duration::from_secs(30))
                .await
                .unwrap();
            beat.await.unwrap();
            assert_eq!(live, vec!["w1".to_string()]);
        });
    }
}
