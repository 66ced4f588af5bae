//! The inference servers: least-requests-in-flight routing, take-out after repeated
//! errors, probe-in when a health check answers, and the "every server down" state.
//!
//! Invariants: `inflight` counts exactly the attempts between `pick` and their end, so
//! routing and the `spool_inflight_requests` gauge agree; it changes only through the
//! [`InFlight`] guard of [`Server::begin`], so an attempt that panics or is cancelled is
//! no longer counted. The "no inference server reachable" line is written here only, by
//! [`Servers::every_server_down`], at most once per interval whoever asks (the dispatcher
//! and every waiting worker ask), so an outage is visible without flooding the log.

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
    down_log: DownLog,
}

/// When "every server down" was last logged: the line repeats at most once per
/// `interval` while the outage lasts, whoever notices it.
struct DownLog {
    interval: Duration,
    last: Mutex<Option<Instant>>,
}

impl DownLog {
    /// Whether the line is due now; if so, it counts as written from now on.
    fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < self.interval) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

/// Consecutive failures that take a server out of rotation.
const TAKE_OUT_AFTER: u32 = 3;

impl Servers {
    /// The servers of `urls`, all in rotation; "every server down" is repeated at most
    /// once per `down_log_interval`.
    pub(crate) fn new(urls: &[String], down_log_interval: Duration) -> Self {
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
            down_log: DownLog {
                interval: down_log_interval,
                last: Mutex::new(None),
            },
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

    /// `preferred` while it is in rotation, else [`Servers::pick`]: a conversation's turns
    /// stay on the server whose prefix cache holds their history.
    pub(crate) fn pick_preferring(&self, preferred: Option<usize>) -> usize {
        match preferred {
            Some(i)
                if self
                    .list
                    .get(i)
                    .is_some_and(|s| s.up.load(Ordering::Relaxed)) =>
            {
                i
            }
            _ => self.pick(),
        }
    }

    /// Whether some server is in rotation (a worker waiting for one polls this).
    pub(crate) fn any_up(&self) -> bool {
        self.list.iter().any(|s| s.up.load(Ordering::Relaxed))
    }

    /// Server `i` answered: its error count restarts and it is back in rotation.
    pub(crate) fn ok(&self, i: usize) {
        let s = &self.list[i];
        s.errors.store(0, Ordering::Relaxed);
        if !s.up.swap(true, Ordering::Relaxed) {
            tracing::info!(server = %s.url, "server back in rotation");
        }
    }

    /// Server `i` failed an attempt; [`TAKE_OUT_AFTER`] in a row take it out of rotation
    /// until a probe or an answer puts it back.
    pub(crate) fn error(&self, i: usize) {
        let s = &self.list[i];
        let n = s.errors.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= TAKE_OUT_AFTER && s.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(server = %s.url, consecutive_errors = n, "server taken out of rotation; probing it");
        }
    }

    /// Whether every server is out of rotation. When it is, the log says so (at most once
    /// per interval for all callers together): the dispatcher and the workers that found
    /// no server report it here, and the line is written once for them all.
    pub(crate) fn every_server_down(&self) -> bool {
        if self.any_up() {
            return false;
        }
        if self.down_log.due() {
            tracing::warn!(
                servers = self.list.len(),
                "no inference server reachable: dispatch paused until one answers"
            );
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::panic::AssertUnwindSafe;

    /// A conversation keeps its server while that server is in rotation, even when
    /// another has fewer requests in flight; once it is taken out, the least loaded wins.
    #[test]
    fn a_preferred_server_is_kept_while_it_is_up() {
        let urls = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".to_string(),
        ];
        let servers = Servers::new(&urls, Duration::from_secs(60));
        let _busy = servers.list[1].begin();
        assert_eq!(servers.pick(), 0);
        assert_eq!(servers.pick_preferring(Some(1)), 1);
        assert_eq!(servers.pick_preferring(None), 0);
        servers.list[1].up.store(false, Ordering::Relaxed);
        assert_eq!(servers.pick_preferring(Some(1)), 0);
        assert_eq!(servers.pick_preferring(Some(7)), 0);
    }

    /// The in-flight count comes back down however an attempt ends: normally, by a panic
    /// unwinding through it, or by its future being dropped (a cancel) while it waits.
    #[tokio::test]
    async fn an_attempt_that_panics_or_is_dropped_is_no_longer_in_flight() {
        let servers = Servers::new(&["http://127.0.0.1:1".to_string()], Duration::from_secs(60));
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

    /// "Every server down" is reported to the caller each time, but logged only once per
    /// interval for all callers together; with servers up nothing is reported.
    #[test]
    fn every_server_down_is_logged_once_per_interval() {
        let servers = Servers::new(&["http://127.0.0.1:1".to_string()], Duration::from_secs(60));
        assert!(
            !servers.every_server_down(),
            "a fresh server is in rotation"
        );
        for _ in 0..TAKE_OUT_AFTER {
            servers.error(0);
        }
        assert!(servers.every_server_down());
        assert!(servers.every_server_down(), "still down: reported again");
        assert!(
            !servers.down_log.due(),
            "logged once, not again within the interval"
        );
        servers.ok(0);
        assert!(!servers.every_server_down());

        let often = DownLog {
            interval: Duration::ZERO,
            last: Mutex::new(None),
        };
        assert!(
            often.due() && often.due(),
            "a zero interval repeats every time"
        );
    }
}
