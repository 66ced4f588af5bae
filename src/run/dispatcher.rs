//! The dispatcher: leases rows into request slots and starts one worker task per lease.
//!
//! Invariants: at most `run.concurrency` requests are in flight; after the stop not one
//! more request goes out; while every server is down nothing is leased (the monitor
//! probes them back).

use crate::error::{Context, Error};
use crate::run::scheduler::{Next, Scheduler};
use crate::run::servers::Servers;
use crate::run::worker::{work, Ctx};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Leases rows into request slots until every dataset is done or the run stops;
/// returns the requests still in flight.
pub(crate) async fn dispatch(
    ctx: &Arc<Ctx>,
    sched: &Scheduler,
    servers: &Servers,
    stop: &CancellationToken,
    concurrency: usize,
) -> Result<TaskTracker, Error> {
    let requests = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(concurrency));
    'dispatch: loop {
        let permit = tokio::select! {
            // Stop first: after the signal not one more request goes out.
            biased;
            _ = stop.cancelled() => break 'dispatch,
            p = slots.clone().acquire_owned() => p.map_err(Error::runtime).context("slot semaphore closed")?,
        };
        let lease = loop {
            let notified = sched.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if stop.is_cancelled() {
                break 'dispatch;
            }
            if servers.every_server_down() {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    _ = stop.cancelled() => break 'dispatch,
                }
            }
            match sched.next()? {
                Next::Lease(l) => break l,
                // Budget met: an open item's kept generations become its rows.
                Next::Close {
                    lane,
                    ds,
                    row,
                    partial,
                } => {
                    ctx.commits.close(lane, ds, row, partial);
                    continue;
                }
                Next::Done => break 'dispatch,
                Next::Wait => {
                    tokio::select! {
                        _ = &mut notified => {}
                        // Streamed tokens move budget estimates without a notification.
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                        _ = stop.cancelled() => break 'dispatch,
                    }
                }
            }
        };
        let ctx = ctx.clone();
        requests.spawn(async move {
            work(&ctx, lease).await;
            drop(permit);
        });
    }
    Ok(requests)
}
