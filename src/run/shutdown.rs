//! How a run stops: the stop signals every task watches, the one path a fatal error takes,
//! and the shutdown steps in their fixed order.
//!
//! Invariants: the first fatal error is the one reported (a full disk also fails what
//! comes after it); shutdown runs stop dispatch → drain requests in flight (up to the
//! grace, then abort them: their items stay pending) → the committer drains → the archive
//! seals its open shards → the queue is flushed → the process exits. After a storage
//! failure the queue is not flushed again: sled may never return from that flush.

use crate::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long the committer and the archive get to end after the queue's storage failed,
/// before the run reports without them (they may be stuck in a sled flush).
const BROKEN_QUEUE_WAIT: Duration = Duration::from_secs(5);

/// The run's stop state, shared by every task that must stop.
#[derive(Default)]
pub(crate) struct Stop {
    /// Cancelled on shutdown (signal, fatal error, or all done): no new request starts.
    pub(crate) stop: CancellationToken,
    /// Cancelled after the grace period or a storage failure: requests in flight end now.
    pub(crate) hard_stop: CancellationToken,
    /// Set when the shutdown signal stopped the run.
    interrupted: AtomicBool,
    /// Set when the queue's storage failed (disk full or unwritable data dir): results can
    /// no longer be made durable, so requests in flight are not waited for.
    queue_broken: AtomicBool,
    /// The first fatal error.
    fatal: Mutex<Option<Error>>,
}

impl Stop {
    /// Watches `shutdown` from the start of the run, so a signal during a long intake is a
    /// clean stop too.
    pub(crate) fn watch(
        self: &Arc<Self>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
        grace_s: f64,
    ) {
        let me = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown => {
                    me.interrupted.store(true, Ordering::SeqCst);
                    tracing::info!(grace_s, "shutdown requested: no new requests; waiting for those in flight (a second signal exits at once)");
                    me.stop.cancel();
                }
                _ = me.stop.cancelled() => {}
            }
        });
    }

    /// Whether the shutdown signal stopped the run.
    pub(crate) fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    /// Whether the queue's storage failed during the run.
    pub(crate) fn queue_broken(&self) -> bool {
        self.queue_broken.load(Ordering::SeqCst)
    }

    /// The one path of a fatal error: logs it, stops dispatch (at once, for requests in
    /// flight too, when `queue_broken`: their results could not be stored) and keeps it
    /// unless an earlier one is kept already.
    pub(crate) fn fail(&self, e: Error, queue_broken: bool) {
        tracing::error!("{e}");
        if queue_broken {
            self.queue_broken.store(true, Ordering::SeqCst);
            self.hard_stop.cancel();
        }
        self.stop.cancel();
        self.fatal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    }

    /// The first fatal error, if any.
    pub(crate) fn take_fatal(&self) -> Option<Error> {
        self.fatal.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The run's moving parts, as shutdown ends them.
pub(crate) struct Running<S> {
    /// Requests in flight.
    pub(crate) requests: TaskTracker,
    /// How long requests in flight are waited for.
    pub(crate) grace: Duration,
    /// The monitor task and its stop.
    pub(crate) monitor: (CancellationToken, JoinHandle<()>),
    /// What keeps the committer's channel open (the workers' shared context): dropped once
    /// requests and the monitor are done, so the committer drains and ends.
    pub(crate) senders: S,
    /// The committer task; when it ends it lets the archive seal.
    pub(crate) committer: JoinHandle<()>,
    /// The archive thread (it ends after sealing); `done` fires when it ends.
    pub(crate) archiver: (
        std::thread::JoinHandle<()>,
        tokio::sync::oneshot::Receiver<()>,
    ),
    /// The metrics endpoint and its stop.
    pub(crate) http: (CancellationToken, Option<JoinHandle<std::io::Result<()>>>),
}

/// Stops the run in the fixed order: stop dispatch → drain requests in flight (abort them
/// after the grace) → the committer drains → the archive seals → `flush` the queue. Returns
/// the first fatal error, else the flush's result. After a storage failure `flush` is not
/// called.
pub(crate) async fn shut_down<S>(
    stop: &Stop,
    parts: Running<S>,
    flush: impl FnOnce() -> Result<(), Error>,
) -> Result<(), Error> {
    // Also ends the helper tasks tied to `stop` (shutdown watcher, cancel enforcer).
    stop.stop.cancel();
    parts.requests.close();
    if tokio::time::timeout(parts.grace, parts.requests.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_s = parts.grace.as_secs_f64(),
            "requests still in flight after the grace period: aborting them (their items stay pending)"
        );
        stop.hard_stop.cancel();
        parts.requests.wait().await;
    }
    // The monitor holds a commit sender too: stop it before the committer can drain.
    parts.monitor.0.cancel();
    let _ = parts.monitor.1.await;
    drop(parts.senders);
    let (archiver, archiver_done) = parts.archiver;
    if stop.queue_broken() {
        // Give the committer and the archive a moment, then report without touching sled
        // again: what the last successful flush made durable is what the next run resumes.
        let _ = tokio::time::timeout(BROKEN_QUEUE_WAIT, parts.committer).await;
        let _ = tokio::time::timeout(BROKEN_QUEUE_WAIT, archiver_done).await;
        parts.http.0.cancel();
        return Err(stop
            .take_fatal()
            .unwrap_or_else(|| Error::msg("queue storage failed")));
    }
    parts
        .committer
        .await
        .map_err(|e| Error::runtime(e).context("committer task panicked"))?;
    archiver
        .join()
        .map_err(|_| Error::msg("archive thread panicked"))?;
    let flushed = flush();
    parts.http.0.cancel();
    if let Some(h) = parts.http.1 {
        let _ = h.await;
    }
    // The first fatal error is the one to report (a full disk also fails the last flush).
    if let Some(e) = stop.take_fatal() {
        return Err(e);
    }
    flushed
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    type Log = Arc<Mutex<Vec<&'static str>>>;

    fn note(log: &Log, step: &'static str) {
        log.lock().unwrap().push(step);
    }

    /// Stand-ins for the run's tasks, each noting in `log` when it ends: a request that
    /// only ends when aborted, a monitor, a committer that drains when the last sender
    /// goes, and an archive thread that seals when the committer is done.
    fn running(log: &Log, stop: &Stop, grace: Duration) -> Running<mpsc::UnboundedSender<()>> {
        let requests = TaskTracker::new();
        {
            let (log, hard) = (log.clone(), stop.hard_stop.clone());
            requests.spawn(async move {
                hard.cancelled().await;
                note(&log, "request aborted");
            });
        }
        let monitor_stop = CancellationToken::new();
        let monitor = {
            let (log, s) = (log.clone(), monitor_stop.clone());
            tokio::spawn(async move {
                s.cancelled().await;
                note(&log, "monitor stopped");
            })
        };
        let (senders, mut rx) = mpsc::unbounded_channel::<()>();
        let (to_archive, from_committer) = std::sync::mpsc::channel::<()>();
        let committer = {
            let log = log.clone();
            tokio::spawn(async move {
                while rx.recv().await.is_some() {}
                note(&log, "committer drained");
                drop(to_archive);
            })
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let archiver = {
            let log = log.clone();
            std::thread::spawn(move || {
                while from_committer.recv().is_ok() {}
                note(&log, "shards sealed");
                let _ = done_tx.send(());
            })
        };
        Running {
            requests,
            grace,
            monitor: (monitor_stop, monitor),
            senders,
            committer,
            archiver: (archiver, done_rx),
            http: (CancellationToken::new(), None),
        }
    }

    /// Shutdown walks its steps in the fixed order: dispatch stopped, the request still in
    /// flight after the grace aborted, then the committer drains, the archive seals, and
    /// only then is the queue flushed.
    #[tokio::test]
    async fn shutdown_runs_its_steps_in_order() {
        let log: Log = Arc::default();
        let stop = Stop::default();
        let parts = running(&log, &stop, Duration::from_millis(50));
        let flushed = {
            let log = log.clone();
            move || {
                note(&log, "queue flushed");
                Ok(())
            }
        };
        shut_down(&stop, parts, flushed).await.unwrap();
        assert!(stop.stop.is_cancelled());
        assert_eq!(
            *log.lock().unwrap(),
            [
                "request aborted",
                "monitor stopped",
                "committer drained",
                "shards sealed",
                "queue flushed"
            ]
        );
    }

    /// After a storage failure the queue is not flushed again, and the first fatal error
    /// is the one reported.
    #[tokio::test]
    async fn a_broken_queue_is_not_flushed_and_the_first_error_wins() {
        let log: Log = Arc::default();
        let stop = Stop::default();
        let parts = running(&log, &stop, Duration::from_secs(60));
        stop.fail(Error::msg("cannot store results"), true);
        stop.fail(Error::msg("cannot record written shards"), false);
        let flushed = {
            let log = log.clone();
            move || {
                note(&log, "queue flushed");
                Ok(())
            }
        };
        let e = shut_down(&stop, parts, flushed).await.unwrap_err();
        assert_eq!(e.to_string(), "cannot store results");
        assert!(stop.hard_stop.is_cancelled());
        assert!(!log.lock().unwrap().contains(&"queue flushed"));
    }
}
