//! The inference servers: least-requests-in-flight routing, take-out after repeated
//! errors, probe-in when a health check answers (SPEC §4.3).
//!
//! Invariant: `inflight` counts exactly the attempts between `pick` and their end, so
//! routing and the `spool_inflight_requests` gauge agree; it changes only through the
//! [`InFlight`] guard of [`Server::begin`], so an attempt that panics or is cancelled is
//! no longer counted.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One configured server and its load.
pub(crate) struct Server {
    pub(crate) url: String,
    pub(crate) inflight: AtomicUsize,
    pub(crate) up: AtomicBool,
    pub(crate) errors: AtomicU32,
}

impl Server {
    /// Counts one attempt in flight until the guard is dropped: however the attempt ends
    /// (an answer, an error, a panic unwinding through it, a cancel dropping it).
    pub(crate) fn begin(&self) -> InFlight<'_> {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight(&self.inflight)
    }
}

/// One attempt counted in its server's `inflight`; the drop gives it back.
pub(crate) struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The servers with least-requests routing and take-out / probe-in.
pub(crate) struct Servers {
    pub(crate) list: Vec<Server>,
    pub(crate) last_down_log: Mutex<Option<Instant>>,
}

/// Consecutive failures that take a server out of rotation.
const TAKE_OUT_AFTER: u32 = 3;

impl Servers {
    pub(crate) fn new(urls: &[String]) -> Self {
        Self {
            list: urls
                .iter()
                .map(|u| Server {
                    url: u.trim_end_matches('/').to_string(),
                    inflight: AtomicUsize::new(0),
                    up: AtomicBool::new(true),
                    errors: AtomicU32::new(0),
                })
                .collect(),
            last_down_log: Mutex::new(None),
        }
    }

    /// The up server with the fewest requests in flight (any server if all are down).
    pub(crate) fn pick(&self) -> usize {
        let key = |(i, s): (usize, &Server)| {
            (
                !s.up.load(Ordering::Relaxed),
                s.inflight.load(Ordering::Relaxed),
                i,
            )
        };
        self.list
            .iter()
            .enumerate()
            .min_by_key(|x| key(*x))
            .map(|(i, _)| i)
            .unwrap_or(0)
    }

    pub(crate) fn any_up(&self) -> bool {
        self.list.iter().any(|s| s.up.load(Ordering::Relaxed))
    }

    pub(crate) fn ok(&self, i: usize) {
        let s = &self.list[i];
        s.errors.store(0, Ordering::Relaxed);
        if !s.up.swap(true, Ordering::Relaxed) {
            tracing::info!(server = %s.url, "server back in rotation");
        }
    }

    pub(crate) fn error(&self, i: usize) {
        let s = &self.list[i];
        let n = s.errors.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= TAKE_OUT_AFTER && s.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(server = %s.url, consecutive_errors = n, "server taken out of rotation; probing it");
        }
    }

    /// Logs "every server down" at most once a minute.
    pub(crate) fn log_all_down(&self) {
        let mut last = self.last_down_log.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(
                servers = self.list.len(),
                "no inference server reachable: dispatch paused until one answers"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::panic::AssertUnwindSafe;

    /// The in-flight count comes back down however an attempt ends: normally, by a panic
    /// unwinding through it, or by its future being dropped (a cancel) while it waits.
    #[tokio::test]
    async fn an_attempt_that_panics_or_is_dropped_is_no_longer_in_flight() {
        let servers = Servers::new(&["http://127.0.0.1:1".to_string()]);
        let s = &servers.list[0];
        let count = || s.inflight.load(Ordering::Relaxed);

        let done = async {
            let _g = s.begin();
            assert_eq!(count(), 1);
        };
        done.await;
        assert_eq!(count(), 0);

        let panicked = AssertUnwindSafe(async {
            let _g = s.begin();
            assert_eq!(count(), 1);
            panic!("a bug in the client");
        })
        .catch_unwind()
        .await;
        assert!(panicked.is_err());
        assert_eq!(count(), 0, "a panic left the attempt counted");

        let waiting = async {
            let _g = s.begin();
            std::future::pending::<()>().await;
        };
        let cancelled = tokio::time::timeout(std::time::Duration::from_millis(10), waiting).await;
        assert!(cancelled.is_err());
        assert_eq!(count(), 0, "a dropped attempt left it counted");
    }
}
