//! The dispatcher: leases rows into request slots and starts one worker task per lease.
//!
//! Invariants: at most `run.concurrency` leases are held (with `"auto"`: the sum of the
//! limits of the servers in rotation, read each time a slot is wanted, so a limit cut or a
//! server lost shrinks it as leases end); after the stop not one more request goes out;
//! while every server is down nothing is leased (the monitor probes them back).

use crate::error::Error;
use crate::run::scheduler::{Next, Scheduler};
use crate::run::servers::Servers;
use crate::run::worker::{work, Ctx};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Leases held, and a wake-up when one ends.
#[derive(Default)]
struct Slots {
    held: AtomicUsize,
    freed: Notify,
}

/// One lease's slot; the drop gives it back.
struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
        self.0.freed.notify_one();
    }
}

/// Waits for a slot under `capacity()` (read afresh on every wake-up); `None` on stop.
async fn slot(
    slots: &Arc<Slots>,
    servers: &Servers,
    capacity: &impl Fn() -> usize,
    stop: &CancellationToken,
) -> Option<Slot> {
    loop {
        if stop.is_cancelled() {
            return None;
        }
        // Only the dispatcher takes slots: check-then-add cannot race with another taker.
        if slots.held.load(Ordering::Relaxed) < capacity() {
            slots.held.fetch_add(1, Ordering::Relaxed);
            return Some(Slot(slots.clone()));
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return None,
            _ = slots.freed.notified() => {}
            _ = servers.room().notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// Leases rows into request slots until every dataset is done or the run stops;
/// returns the requests still in flight.
pub(crate) async fn dispatch(
    ctx: &Arc<Ctx>,
    sched: &Scheduler,
    servers: &Servers,
    stop: &CancellationToken,
    concurrency: Option<usize>,
) -> Result<TaskTracker, Error> {
    let requests = TaskTracker::new();
    let slots = Arc::new(Slots::default());
    let capacity = || concurrency.unwrap_or_else(|| servers.total_limit());
    'dispatch: loop {
        // Stop first: after the signal not one more request goes out.
        let Some(permit) = slot(&slots, servers, &capacity, stop).await else {
            break 'dispatch;
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
