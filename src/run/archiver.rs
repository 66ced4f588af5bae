//! The archive thread: writes durable results into shards, off the request path.
//!
//! Invariants: it is seeded from the queue (results durable but in no shard yet) before the
//! committer may send anything, or a result could be both seeded and sent (written twice);
//! it seals its open shards only when the committer's sender is gone; a failure stops the
//! run through the one fatal-error path and loses nothing (every result is in the queue
//! before it reaches a shard).

use crate::error::Error;
use crate::observe::metrics::Metrics;
use crate::output::archive::{Archive, ArchiveError};
use crate::output::shard::SealedShard;
use crate::run::shutdown::Stop;
use crate::store::queue::Queue;
use crate::store::row::ShardRow;
use crate::upstream::CountSource;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Durable rows of one dataset, with where their token counts came from.
pub(crate) type Batch = (u16, Vec<(ShardRow, CountSource)>);

/// The committer's side of the archive's channel.
pub(crate) type ToArchive = mpsc::UnboundedSender<Batch>;

/// What the archive thread works with.
pub(crate) struct Archiver {
    pub(crate) archive: Archive,
    pub(crate) queue: Arc<Queue>,
    /// Datasets in config order (seeded in this order).
    pub(crate) datasets: Vec<u16>,
    pub(crate) names: HashMap<u16, String>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) stop: Arc<Stop>,
    /// Named in the error when shards cannot be written.
    pub(crate) output_dir: PathBuf,
    /// Named in the error when written shards cannot be recorded.
    pub(crate) data_dir: PathBuf,
}

/// The running archive thread.
pub(crate) struct Archiving {
    /// Where the committer sends durable rows.
    pub(crate) to_archive: ToArchive,
    /// Fires once seeding is done; dropped unfired when seeding failed (the run is stopped).
    pub(crate) seeded: oneshot::Receiver<()>,
    pub(crate) thread: std::thread::JoinHandle<()>,
    /// Fires when the thread ends, so shutdown can wait for it with a deadline.
    pub(crate) done: oneshot::Receiver<()>,
}

impl Archiver {
    /// Starts the archive thread.
    pub(crate) fn spawn(self) -> Result<Archiving, Error> {
        let (to_archive, rx) = mpsc::unbounded_channel::<Batch>();
        let (seeded_tx, seeded) = oneshot::channel::<()>();
        let (done_tx, done) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("spool-archive".into())
            .spawn(move || {
                let Archiver {
                    mut archive,
                    queue,
                    datasets,
                    names,
                    metrics,
                    stop,
                    output_dir,
                    data_dir,
                } = self;
                let res = archive_loop(
                    &mut archive,
                    &queue,
                    &datasets,
                    rx,
                    seeded_tx,
                    &metrics,
                    &names,
                );
                if let Err(e) = res {
                    // Disk full or unwritable output: stop dispatching and keep everything
                    // (results are durable in the queue before they reach a shard).
                    let queue_broken = matches!(e, ArchiveError::Queue(_));
                    archive.abandon_all();
                    // The committer's error is kept instead when it came first (the
                    // queue's disk is the full one).
                    stop.fail(output_failure(&e, &output_dir, &data_dir), queue_broken);
                }
                let _ = done_tx.send(());
            })
            .map_err(|e| Error::runtime(e).context("cannot start the archive thread"))?;
        Ok(Archiving {
            to_archive,
            seeded,
            thread,
            done,
        })
    }
}

/// The run's error when shards cannot be written: what failed, where, and that nothing
/// is lost. One line (the cause's text is inlined, not chained, so it is said once).
pub(crate) fn output_failure(e: &ArchiveError, out_dir: &Path, data_dir: &Path) -> Error {
    match e {
        ArchiveError::Queue(_) => Error::msg(format!(
            "cannot record written shards in the queue in {} (disk full or unwritable?): {e}. \
             Dispatch stopped; the next run adopts what was written and shards the rest",
            data_dir.display()
        )),
        _ => Error::msg(format!(
            "cannot write shards under {}: {e}. Dispatch stopped; every completed result is \
             kept in the queue ({}) and goes into a shard on the next run, once the output is \
             writable",
            out_dir.display(),
            data_dir.display()
        )),
    }
}

/// Seeds the archive from the queue, then adds what arrives until the committer is gone,
/// then seals every open shard.
fn archive_loop(
    archive: &mut Archive,
    queue: &Queue,
    datasets: &[u16],
    mut rx: mpsc::UnboundedReceiver<Batch>,
    seeded: oneshot::Sender<()>,
    metrics: &Metrics,
    names: &HashMap<u16, String>,
) -> Result<(), ArchiveError> {
    let record = |sealed: &[SealedShard], ds: u16| {
        let name = names.get(&ds).map(String::as_str).unwrap_or("?");
        for s in sealed {
            metrics.shards_written.with_label_values(&[name]).inc();
            metrics
                .shard_bytes
                .with_label_values(&[name])
                .inc_by(s.bytes);
        }
    };
    for &ds in datasets {
        let rows = queue.unsharded(ds)?;
        if !rows.is_empty() {
            let name = names.get(&ds).map(String::as_str).unwrap_or("?");
            tracing::info!(dataset = %name, rows = rows.len(), "results from the last run waiting for a shard");
            let sealed = archive.add(ds, None, rows)?;
            record(&sealed, ds);
        }
    }
    let _ = seeded.send(());
    while let Some((ds, rows)) = rx.blocking_recv() {
        let source = rows.first().map(|r| r.1.name());
        let rows: Vec<ShardRow> = rows.into_iter().map(|r| r.0).collect();
        let sealed = archive.add(ds, source, rows)?;
        record(&sealed, ds);
    }
    for (ds, s) in archive.seal_all()? {
        record(std::slice::from_ref(&s), ds);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::shard::ShardLimits;
    use crate::store::fixtures::item;
    use crate::store::queue::Outcome;

    /// A queue in `dir/data` with dataset `a` of `n` items, the first `done` of them
    /// committed (durable, in no shard yet).
    fn queue_of(dir: &Path, n: u64, done: u64) -> (Arc<Queue>, u16) {
        let q = Queue::open(&dir.join("data")).unwrap();
        let ds = q.open_dataset("a").unwrap().index;
        let items: Vec<_> = (0..n).map(|r| (r, item(&format!("a{r}")))).collect();
        q.enqueue(ds, &items, n, 0).unwrap();
        let outcomes: Vec<_> = (0..done).map(|r| result(ds, r)).collect();
        q.commit(&outcomes).unwrap();
        q.flush().unwrap();
        (Arc::new(q), ds)
    }

    fn row(r: u64) -> ShardRow {
        ShardRow::for_tests(format!("a{r}"), "a", r)
    }

    fn result(ds: u16, r: u64) -> Outcome {
        Outcome::Done {
            ds,
            result: Box::new(row(r)),
        }
    }

    fn archiver(dir: &Path, queue: &Arc<Queue>, ds: u16, stop: &Arc<Stop>) -> Archiver {
        let limits = ShardLimits {
            max_rows: 1000,
            max_bytes: 1 << 30,
            compression_level: 3,
        };
        Archiver {
            archive: Archive::of_one_dataset(queue.clone(), &dir.join("out"), ds, "a", limits),
            queue: queue.clone(),
            datasets: vec![ds],
            names: HashMap::from([(ds, "a".to_string())]),
            metrics: Arc::new(Metrics::new()),
            stop: stop.clone(),
            output_dir: dir.join("out"),
            data_dir: dir.join("data"),
        }
    }

    /// Results seeded from the queue and results sent by the committer go into one shard,
    /// sealed when the committer's sender goes, and the queue marks every row sharded.
    #[tokio::test]
    async fn the_archive_seals_a_shard_and_marks_it_sharded() {
        let dir = tempfile::tempdir().unwrap();
        let (queue, ds) = queue_of(dir.path(), 3, 2);
        let stop = Arc::new(Stop::default());
        let a = archiver(dir.path(), &queue, ds, &stop).spawn().unwrap();
        a.seeded.await.unwrap();
        queue.commit(&[result(ds, 2)]).unwrap();
        a.to_archive
            .send((ds, vec![(row(2), CountSource::Server)]))
            .unwrap();
        drop(a.to_archive);
        a.thread.join().unwrap();
        assert!(stop.take_fatal().is_none());
        let shard = dir.path().join("out/a/part-000000.parquet");
        assert_eq!(crate::output::reader::read_rows(&shard).unwrap().len(), 3);
        assert!(queue.unsharded(ds).unwrap().is_empty());
        assert_eq!(queue.state(ds).unwrap().next_shard, 1);
    }

    /// An output that cannot be written stops the run through the fatal-error path: the
    /// thread ends without seeding, dispatch is stopped, and the error names the output
    /// folder and says the results are kept.
    #[tokio::test]
    async fn the_archive_stops_the_run_when_the_output_cannot_be_written() {
        let dir = tempfile::tempdir().unwrap();
        let (queue, ds) = queue_of(dir.path(), 2, 2);
        std::fs::create_dir_all(dir.path().join("out")).unwrap();
        std::fs::write(dir.path().join("out/a"), b"a file where a folder goes").unwrap();
        let stop = Arc::new(Stop::default());
        let a = archiver(dir.path(), &queue, ds, &stop).spawn().unwrap();
        assert!(a.seeded.await.is_err(), "seeding cannot succeed");
        a.thread.join().unwrap();
        assert!(a.done.await.is_ok());
        assert!(stop.stop.is_cancelled());
        assert!(!stop.queue_broken());
        let msg = stop.take_fatal().expect("the failure is kept").to_string();
        assert!(
            msg.contains("cannot write shards under") && msg.contains("kept in the queue"),
            "{msg}"
        );
        assert_eq!(queue.unsharded(ds).unwrap().len(), 2);
    }
}
