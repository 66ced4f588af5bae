//! The committer: the one task that writes finished attempts and counters to the queue.
//!
//! Group commit: whatever has arrived is applied in one batch with one fsync; only then is
//! the scheduler told and are the rows handed to the archive. Invariants: nothing is
//! acknowledged before it is durable; the committer is the only writer of a dataset's
//! counters during a run (workers send wasted tokens here instead of writing them); the
//! archive may seal its open shards only after the committer has ended, so a refused
//! archive write is never reported in place of a failed commit.

use crate::error::{Context, Error};
use crate::observe::metrics::DatasetMetrics;
use crate::run::archiver::ToArchive;
use crate::run::scheduler::{Lease, Scheduler};
use crate::run::shutdown::Stop;
use crate::run::worker::Finished;
use crate::store::queue::{Outcome, Queue};
use crate::store::row::ShardRow;
use crate::upstream::CountSource;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Most results applied to the queue in one batch (one fsync).
const COMMIT_MAX: usize = 1024;
/// A batch smaller than this waits up to [`COMMIT_LINGER`] for more results.
const COMMIT_MIN: usize = 256;
/// How long a small batch waits for company before it is committed: at thousands of
/// completions per second the per-batch cost (a blocking-pool hop, a results-log append
/// and its fdatasync, a sled batch and its flush) is a visible share of the client's CPU;
/// at the rates of a real GPU server it only delays the acknowledgement by this much.
const COMMIT_LINGER: Duration = Duration::from_millis(5);

/// What workers send the committer.
pub(crate) enum ToCommit {
    /// A finished attempt to apply.
    Finished(Finished),
    /// Tokens a cancelled request streamed and threw away, for the dataset's counter.
    Wasted { ds: u16, tokens: u64 },
    /// A sample of an open item ended without a new generation (`partial`: why, when
    /// before its last turn); its lease ends here.
    SampleEnded {
        lease: Lease,
        partial: Option<String>,
    },
    /// The budget is met: close an open item (see [`Next::Close`](crate::run::scheduler::Next::Close)).
    Close {
        lane: usize,
        ds: u16,
        row: u64,
        partial: Vec<(u32, String)>,
    },
}

/// The workers' side of the committer's channel.
#[derive(Clone)]
pub(crate) struct Commits(mpsc::UnboundedSender<ToCommit>);

/// The committer's side of its channel.
pub(crate) type CommitReceiver = mpsc::UnboundedReceiver<ToCommit>;

/// A new channel to the committer.
pub(crate) fn channel() -> (Commits, CommitReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Commits(tx), rx)
}

impl Commits {
    /// Hands a finished attempt over. A closed channel means the committer stopped on a
    /// fatal error, which has stopped the run: the item stays pending in the queue.
    pub(crate) fn finished(&self, f: Finished) {
        let _ = self.0.send(ToCommit::Finished(f));
    }

    /// Counts tokens thrown away by a cancelled request (lost with the run if the committer
    /// has stopped: a counter, not a result).
    pub(crate) fn wasted(&self, ds: u16, tokens: u64) {
        let _ = self.0.send(ToCommit::Wasted { ds, tokens });
    }

    /// Ends a sample of an open item that has no new generation to commit.
    pub(crate) fn sample_ended(&self, lease: Lease, partial: Option<String>) {
        let _ = self.0.send(ToCommit::SampleEnded { lease, partial });
    }

    /// Closes an open item the budget has stopped.
    pub(crate) fn close(&self, lane: usize, ds: u16, row: u64, partial: Vec<(u32, String)>) {
        let _ = self.0.send(ToCommit::Close {
            lane,
            ds,
            row,
            partial,
        });
    }
}

/// What the committer works with.
pub(crate) struct Committer {
    pub(crate) queue: Arc<Queue>,
    pub(crate) sched: Arc<Scheduler>,
    /// Per lane, in config order.
    pub(crate) dmetrics: Vec<DatasetMetrics>,
    /// Durable rows go here; dropped when the committer ends, which lets the archive seal.
    pub(crate) to_archive: ToArchive,
    pub(crate) stop: Arc<Stop>,
    /// Named in the error when the queue cannot store results.
    pub(crate) data_dir: PathBuf,
    /// Fault point: after a failed commit, wait this long before reporting it.
    pub(crate) failed_pause: Option<Duration>,
}

impl Committer {
    /// Runs the committer until every sender is gone or a commit fails; a failed commit
    /// stops the run through [`Stop::fail`] as the cause.
    pub(crate) fn spawn(self, rx: CommitReceiver) -> JoinHandle<()> {
        tokio::spawn(async move {
            let Committer {
                queue,
                sched,
                dmetrics,
                to_archive,
                stop,
                data_dir,
                failed_pause,
            } = self;
            let committed = commit_loop(rx, &queue, &sched, &to_archive, &dmetrics).await;
            if let Err(e) = committed {
                if let Some(pause) = failed_pause {
                    tracing::warn!(
                        ms = pause.as_millis() as u64,
                        "fault injection: pausing the committer before it reports its error"
                    );
                    tokio::time::sleep(pause).await;
                }
                let e = Error::msg(format!(
                    "cannot store results in the queue in {} (disk full or unwritable?): {e}. \
                     Dispatch stopped; results not stored are requested again by the next run",
                    data_dir.display()
                ));
                stop.fail(e, true);
            }
            // Only now may the archive seal its open shards (it does when this last sender
            // goes): after a failed commit its own queue write is refused as poisoned, and
            // that consequence must not be reported in place of the cause recorded above.
            drop(to_archive);
        })
    }
}

/// Applies what arrives on `rx` in group commits until every sender is gone.
async fn commit_loop(
    mut rx: CommitReceiver,
    queue: &Arc<Queue>,
    sched: &Scheduler,
    to_archive: &ToArchive,
    dmetrics: &[DatasetMetrics],
) -> Result<(), Error> {
    let mut buf = Vec::new();
    while rx.recv_many(&mut buf, COMMIT_MAX).await > 0 {
        // A batch smaller than COMMIT_MIN waits up to COMMIT_LINGER for more, so a fast
        // server's completions share one batch and one fsync. The wait only delays the
        // acknowledgement (a worker's slot is already free again), it never skips the fsync.
        if buf.len() < COMMIT_MIN {
            let deadline = tokio::time::Instant::now() + COMMIT_LINGER;
            while buf.len() < COMMIT_MIN {
                let room = COMMIT_MAX - buf.len();
                match tokio::time::timeout_at(deadline, rx.recv_many(&mut buf, room)).await {
                    Ok(n) if n > 0 => {}
                    _ => break,
                }
            }
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(buf.len());
        for m in buf.drain(..) {
            match m {
                ToCommit::Wasted { ds, tokens } => {
                    // A counter: a failure here shows in the next commit, which reports it.
                    let _ = queue.add_wasted(ds, tokens);
                }
                ToCommit::Finished(f) => {
                    if let Some(e) = admit(f, queue, sched) {
                        entries.push(e);
                    }
                }
                ToCommit::SampleEnded { lease, partial } => {
                    if let Some(p) = sched.end_sample(&lease, partial) {
                        entries.push(Entry::closing(lease.lane, lease.ds, lease.row, None, p));
                    }
                }
                ToCommit::Close {
                    lane,
                    ds,
                    row,
                    partial,
                } => {
                    entries.push(Entry::closing(lane, ds, row, None, partial));
                }
            }
        }
        if entries.is_empty() {
            continue;
        }
        let q = queue.clone();
        // One batch and one fsync for everything that arrived together; then a closed
        // item's rows are read back as the queue wrote them (its kept generations, some
        // perhaps kept in this very batch, and its last one), for the archive.
        let (applied, entries) = tokio::task::spawn_blocking(move || -> Result<_, Error> {
            let mut entries = entries;
            // Moved out and back rather than cloned: a row is the hot path's payload.
            let outcomes: Vec<Outcome> = entries
                .iter_mut()
                .map(|e| std::mem::replace(&mut e.outcome, placeholder()))
                .collect();
            let committed = q.commit(&outcomes);
            for (e, o) in entries.iter_mut().zip(outcomes) {
                e.outcome = o;
            }
            let a = committed?;
            q.flush()?;
            for (e, ok) in entries.iter_mut().zip(&a) {
                if let (Outcome::Closed { ds, row, .. }, true) = (&e.outcome, ok) {
                    e.closed_rows = Some(q.unsharded_item(*ds, *row)?);
                }
            }
            Ok((a, entries))
        })
        .await
        .map_err(Error::runtime)
        .context("commit task panicked")??;
        let mut batches: HashMap<u16, Vec<(ShardRow, CountSource)>> = HashMap::new();
        for (e, ok) in entries.into_iter().zip(applied) {
            e.settle(ok, sched, dmetrics, &mut batches);
        }
        for (ds, rows) in batches {
            // The archive thread only stops on a fatal error, which has stopped dispatch.
            let _ = to_archive.send((ds, rows));
        }
    }
    Ok(())
}

/// A cheap stand-in for an outcome moved out of its entry for the commit.
fn placeholder() -> Outcome {
    Outcome::Failed {
        ds: 0,
        row: 0,
        failure: crate::store::queue::Failure {
            reason: String::new(),
            attempts: 0,
        },
    }
}

/// Policy "cancel": a result that would take its dataset past the budget is not
/// committed; the item (or the sample) goes back to pending. Otherwise the entry to
/// commit, the last generation of an open item becoming its close.
fn admit(f: Finished, queue: &Queue, sched: &Scheduler) -> Option<Entry> {
    let Finished {
        lease,
        outcome,
        count_source,
        duration_s,
        ttft_s,
        ends_sample,
        ack,
    } = f;
    if let Outcome::Done { result, .. } | Outcome::Generated { result, .. } = &outcome {
        if !sched.admit(&lease, result.completion_tokens) {
            let _ = queue.add_wasted(lease.ds, u64::from(result.completion_tokens));
            sched.release(&lease);
            if let Some(ack) = ack {
                let _ = ack.send(false);
            }
            return None;
        }
    }
    let mut entry = Entry {
        outcome,
        lease: Some(lease),
        count_source,
        duration_s,
        ttft_s,
        lane: 0,
        continues: false,
        ack,
        closed_rows: None,
    };
    let lease = entry.lease.as_ref()?;
    entry.lane = lease.lane;
    if let Outcome::Generated { ds, result } = &entry.outcome {
        match ends_sample {
            None => entry.continues = true,
            Some(partial) => {
                if let Some(p) = sched.end_sample(lease, partial) {
                    entry.outcome = Outcome::Closed {
                        ds: *ds,
                        row: lease.row,
                        result: Some(result.clone()),
                        partial: p,
                    };
                }
            }
        }
    }
    Some(entry)
}

/// One outcome of a batch and what to do once it is durable (or refused).
struct Entry {
    outcome: Outcome,
    /// The lease it ends or goes on with (none for a budget close).
    lease: Option<Lease>,
    count_source: CountSource,
    duration_s: f64,
    ttft_s: Option<f64>,
    lane: usize,
    /// A generation after which its sample goes on (the lease stays).
    continues: bool,
    /// Told whether the generation was committed (a conversation's next turn waits).
    ack: Option<oneshot::Sender<bool>>,
    /// A closed item's rows, for the archive.
    closed_rows: Option<Vec<ShardRow>>,
}

impl Entry {
    fn closing(
        lane: usize,
        ds: u16,
        row: u64,
        result: Option<Box<ShardRow>>,
        partial: Vec<(u32, String)>,
    ) -> Entry {
        Entry {
            outcome: Outcome::Closed {
                ds,
                row,
                result,
                partial,
            },
            lease: None,
            count_source: CountSource::Server,
            duration_s: 0.0,
            ttft_s: None,
            lane,
            continues: false,
            ack: None,
            closed_rows: None,
        }
    }

    /// After the batch: metrics, the scheduler, the worker waiting for its turn, and the
    /// rows for the archive.
    fn settle(
        self,
        ok: bool,
        sched: &Scheduler,
        dmetrics: &[DatasetMetrics],
        batches: &mut HashMap<u16, Vec<(ShardRow, CountSource)>>,
    ) {
        let dm = &dmetrics[self.lane];
        let generated = match &self.outcome {
            Outcome::Done { result, .. } | Outcome::Generated { result, .. } => Some(result),
            Outcome::Closed { result, .. } => result.as_ref(),
            Outcome::Failed { .. } => None,
        };
        if ok {
            if let Some(r) = generated {
                dm.ok.inc();
                dm.completion_tokens.inc_by(u64::from(r.completion_tokens));
                dm.prompt_tokens.inc_by(u64::from(r.prompt_tokens));
                dm.duration.observe(self.duration_s);
                if let Some(t) = self.ttft_s {
                    dm.ttft.observe(t);
                }
            }
        }
        match (self.outcome, self.lease) {
            (Outcome::Done { ds, result }, Some(lease)) if ok => {
                sched.completed(&lease, result.completion_tokens);
                batches
                    .entry(ds)
                    .or_default()
                    .push((*result, self.count_source));
            }
            (Outcome::Failed { .. }, Some(lease)) if ok => {
                dm.failed.inc();
                sched.failed(&lease);
            }
            (Outcome::Generated { result, .. }, Some(lease)) if ok => {
                sched.turn_completed(&lease, result.completion_tokens);
            }
            (
                Outcome::Closed {
                    ds, row, result, ..
                },
                lease,
            ) => {
                if let (Some(r), Some(lease), true) = (&result, &lease, ok) {
                    sched.turn_completed(lease, r.completion_tokens);
                }
                sched.closed(self.lane, row);
                let rows = self.closed_rows.unwrap_or_default();
                if ok && rows.is_empty() {
                    dm.failed.inc();
                }
                if ok {
                    let source = self.count_source;
                    batches
                        .entry(ds)
                        .or_default()
                        .extend(rows.into_iter().map(|r| (r, source)));
                }
            }
            // Not pending any more (or a repeat): nothing to do but end the lease.
            (_, Some(lease)) => {
                if self.continues || !lease.multi {
                    sched.release(&lease);
                }
            }
            (_, None) => {}
        }
        if let Some(ack) = self.ack {
            let _ = ack.send(ok);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BudgetPolicy;
    use crate::observe::metrics::Metrics;
    use crate::run::scheduler::{LaneSpec, Lease, Next};
    use crate::store::fixtures::item;

    /// A queue in `dir` with dataset `a` of `n` pending items, and a scheduler over it.
    fn queue_of(dir: &std::path::Path, n: u64) -> (Arc<Queue>, Arc<Scheduler>) {
        let q = Queue::open(dir).unwrap();
        let s = q.open_dataset("a").unwrap();
        let items: Vec<_> = (0..n).map(|r| (r, item(&format!("a{r}")))).collect();
        q.enqueue(s.index, &items, n, 0).unwrap();
        let q = Arc::new(q);
        let spec = LaneSpec {
            ds: s.index,
            name: "a".into(),
            budget: None,
            max_tokens: 100,
            policy: BudgetPolicy::Finish,
            samples: 1,
            multi: false,
            allowance: None,
        };
        let sched = Arc::new(Scheduler::new(q.clone(), vec![spec], Default::default()));
        (q, sched)
    }

    fn lease(s: &Scheduler) -> Lease {
        match s.next().unwrap() {
            Next::Lease(l) => l,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    fn done(lease: Lease, tokens: u32) -> ToCommit {
        let row = ShardRow {
            completion_tokens: tokens,
            ..ShardRow::for_tests(format!("a{}", lease.row), "a", lease.row)
        };
        ToCommit::Finished(Finished {
            outcome: Outcome::Done {
                ds: lease.ds,
                result: Box::new(row),
            },
            lease,
            count_source: CountSource::Server,
            duration_s: 0.1,
            ttft_s: None,
            ends_sample: None,
            ack: None,
        })
    }

    fn committer(
        queue: &Arc<Queue>,
        sched: &Arc<Scheduler>,
        to_archive: ToArchive,
        stop: &Arc<Stop>,
    ) -> Committer {
        Committer {
            queue: queue.clone(),
            sched: sched.clone(),
            dmetrics: vec![Metrics::new().dataset("a")],
            to_archive,
            stop: stop.clone(),
            data_dir: queue.path().to_path_buf(),
            failed_pause: None,
        }
    }

    /// Results sent together are committed durably (they are done after a reopen), handed
    /// to the archive once, and wasted tokens reach the dataset's counter through the same
    /// writer.
    #[tokio::test]
    async fn the_committer_commits_a_batch_durably() {
        let dir = tempfile::tempdir().unwrap();
        let (queue, sched) = queue_of(dir.path(), 3);
        let ds = queue.states()[0].index;
        let (tx, rx) = channel();
        for _ in 0..3 {
            tx.0.send(done(lease(&sched), 7)).unwrap();
        }
        tx.wasted(ds, 11);
        drop(tx);
        let (arch_tx, mut arch_rx) = mpsc::unbounded_channel();
        let stop = Arc::new(Stop::default());
        committer(&queue, &sched, arch_tx, &stop)
            .spawn(rx)
            .await
            .unwrap();
        assert!(stop.take_fatal().is_none());
        let mut rows = 0;
        while let Some((_, batch)) = arch_rx.recv().await {
            rows += batch.len();
        }
        assert_eq!(rows, 3);
        drop((queue, sched));
        let q = Queue::open(dir.path()).unwrap();
        let s = q.state(ds).unwrap();
        assert_eq!((s.done, s.completion_tokens, s.wasted_tokens), (3, 21, 11));
    }

    /// A failed commit stops the run as the cause: the error names the queue's folder and
    /// the storage failure, requests in flight are stopped at once, and the archive's
    /// channel is closed only after the cause is recorded.
    #[tokio::test]
    async fn a_failed_commit_is_reported_as_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let (queue, sched) = queue_of(dir.path(), 1);
        queue.tear_commit_for_tests(1);
        let (tx, rx) = channel();
        tx.0.send(done(lease(&sched), 5)).unwrap();
        drop(tx);
        let (arch_tx, mut arch_rx) = mpsc::unbounded_channel();
        let stop = Arc::new(Stop::default());
        committer(&queue, &sched, arch_tx, &stop)
            .spawn(rx)
            .await
            .unwrap();
        assert!(arch_rx.recv().await.is_none());
        assert!(stop.queue_broken() && stop.hard_stop.is_cancelled());
        let e = stop.take_fatal().expect("the failed commit is kept");
        let msg = e.to_string();
        assert!(
            msg.contains("cannot store results in the queue") && msg.contains("injected torn"),
            "{msg}"
        );
    }
}
