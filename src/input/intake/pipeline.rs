//! The reader and worker stages of intake: raw rows cut into numbered chunks on one
//! thread, prepared on `threads` workers in whatever order they finish.
//!
//! Invariants: the bytes of raw rows between the reader and the sequential stage stay
//! under [`IN_FLIGHT_BYTES`] (one chunk more when a single chunk is larger); a chunk is
//! at most [`CHUNK_ROWS`] rows or [`CHUNK_BYTES`] bytes; every stage stops once `stop` is
//! set or its channel closes.

use super::prepare::{prepare, raw_bytes, Encode, Prepared};
use super::render::Render;
use super::{CHUNK_BYTES, CHUNK_ROWS, IN_FLIGHT_BYTES};
use crate::input::dataset::{DatasetError, DatasetReader, PrefixMark};
use crate::input::row::{Parser, RawEntry};
use crate::prompt::PromptBuilder;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Mutex;
use std::time::Duration;

/// A chunk of raw rows, numbered, with the reader's [`PrefixMark`] after its last row and
/// its size in bytes.
pub(super) type RawChunk = (u64, Vec<RawEntry>, Option<PrefixMark>, usize);
/// A chunk after the parallel stage, with the size of its raw rows.
pub(super) type PreparedChunk<T> = (u64, Vec<Prepared<T>>, Option<PrefixMark>, usize);

/// Bytes of raw rows between the reader and the sequential stage: the reader waits while
/// more than [`IN_FLIGHT_BYTES`] are, so a file of huge rows holds a bounded number.
#[derive(Default)]
pub(super) struct InFlight {
    bytes: Mutex<usize>,
    freed: std::sync::Condvar,
}

impl InFlight {
    /// Waits until `n` more bytes fit (or nothing is in flight), then counts them; `false`
    /// when `stop` was set meanwhile.
    pub(super) fn acquire(&self, n: usize, stop: &AtomicBool) -> bool {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        while *b > 0 && *b + n > IN_FLIGHT_BYTES {
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            b = self
                .freed
                .wait_timeout(b, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *b += n;
        true
    }

    pub(super) fn release(&self, n: usize) {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        *b = b.saturating_sub(n);
        self.freed.notify_all();
    }
}

/// The reader stage: raw rows in chunks, numbered, until the end, an error or `stop`.
pub(super) fn read_chunks(
    mut reader: DatasetReader,
    out: SyncSender<RawChunk>,
    stop: &AtomicBool,
    in_flight: &InFlight,
) -> Result<(), DatasetError> {
    let mut seq = 0u64;
    let mut chunk = Vec::with_capacity(CHUNK_ROWS);
    let mut bytes = 0;
    loop {
        let raw = match reader.next_raw() {
            Ok(Some(raw)) => raw,
            Ok(None) => break,
            Err(e @ DatasetError::Limit(_)) => {
                // The rows before the limit are taken in (and their rejections kept).
                if !chunk.is_empty() && in_flight.acquire(bytes, stop) {
                    let _ = out.send((seq, chunk, None, bytes));
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        bytes += raw_bytes(&raw);
        chunk.push(raw);
        if chunk.len() >= CHUNK_ROWS || bytes >= CHUNK_BYTES {
            if stop.load(Ordering::Relaxed)
                || !in_flight.acquire(bytes, stop)
                || out
                    .send((
                        seq,
                        std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK_ROWS)),
                        reader.mark(),
                        bytes,
                    ))
                    .is_err()
            {
                return Ok(());
            }
            seq += 1;
            bytes = 0;
        }
    }
    if !chunk.is_empty() && in_flight.acquire(bytes, stop) {
        let _ = out.send((seq, chunk, reader.mark(), bytes));
    }
    Ok(())
}

/// The worker stage: chunks in, prepared chunks out, in whatever order they finish.
pub(super) fn work_chunks<T>(
    jobs: &Mutex<Receiver<RawChunk>>,
    out: SyncSender<PreparedChunk<T>>,
    parser: &Parser,
    builder: &PromptBuilder,
    encode: Encode<T>,
    render: &Render,
    scanned: u64,
) {
    loop {
        // The lock is held only to take the next chunk.
        let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((seq, chunk, mark, bytes)) = job else {
            return;
        };
        let done = prepare(parser, builder, encode, render, scanned, chunk);
        if out.send((seq, done, mark, bytes)).is_err() {
            return;
        }
    }
}
