//! The inference servers: routing (prefix-aware with bounded load, least requests, or
//! round robin), each server's limit on requests in flight (`concurrency = "auto"`),
//! take-out after repeated errors, probe-in when a health check answers, and the "every
//! server down" state.
//!
//! Prefix routing: a prompt goes to the server an earlier prompt with the longest common
//! prefix went to (its samples, a conversation's turns, prompts sharing a system prompt
//! or a few-shot block), else to where its first block hashes on a ring of the servers
//! (consistent hashing); either only while that server's load is within `1.25 ×` its share
//! of what is in flight and under its limit (bounded load), else the next server on the
//! ring, so a hot prefix spills over instead of piling up.
//!
//! Invariants: `inflight` counts exactly the attempts between `pick` and their end, so
//! routing and the `spool_inflight_requests` gauge agree; it changes only through the
//! [`InFlight`] guard of [`Server::begin`], so an attempt that panics or is cancelled is
//! no longer counted. With limits, a server is picked only while its in-flight is under its
//! limit (two pickers racing may pass it by one, for an instant); without, never waits.
//! The "no inference server reachable" line is written here only, by
//! [`Servers::every_server_down`], at most once per interval whoever asks (the dispatcher
//! and every waiting worker ask), so an outage is visible without flooding the log.

use crate::config::Routing;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// One configured server and its load.
pub(crate) struct Server {
    pub(crate) url: String,
    pub(crate) inflight: AtomicUsize,
    pub(crate) up: AtomicBool,
    pub(crate) errors: AtomicU32,
    /// Most attempts in flight (`usize::MAX`: no per-server limit).
    pub(crate) limit: AtomicUsize,
    /// Tokens received from it (its throughput, for the limit and the ETA).
    pub(crate) streamed: AtomicU64,
    /// Answers it gave (its completions, for the limit).
    pub(crate) answered: AtomicU64,
    /// Woken when an attempt ends or a limit moves (waiters for room), with limits only.
    room: Option<Arc<Notify>>,
}

impl Server {
    /// Counts one attempt in flight until the guard is dropped: however the attempt ends
    /// (an answer, an error, a panic unwinding through it, a cancel dropping it).
    pub(crate) fn begin(&self) -> InFlight<'_> {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InFlight(self)
    }

    fn has_room(&self) -> bool {
        self.inflight.load(Ordering::Relaxed) < self.limit.load(Ordering::Relaxed)
    }

    fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }
}

/// One attempt counted in its server's `inflight`; the drop gives it back.
pub(crate) struct InFlight<'a>(&'a Server);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        if let Some(n) = &self.0.room {
            n.notify_waiters();
        }
    }
}

/// Where the prompts with a given prefix went, bounded in size.
#[derive(Default)]
struct PrefixRoutes {
    to: HashMap<u64, usize>,
}

/// Entries kept before the prefix map starts over (a few MB at most).
const PREFIX_ROUTES_MAX: usize = 1 << 17;
/// Bounded load: a server takes a prompt while its in-flight stays under this times its
/// share.
const LOAD_BOUND: f64 = 1.25;
/// Ring points per server.
const RING_POINTS: u64 = 64;

/// The servers with routing, limits and take-out / probe-in.
pub(crate) struct Servers {
    pub(crate) list: Vec<Server>,
    down_log: DownLog,
    routing: Routing,
    /// Per-server limits apply (`concurrency = "auto"`).
    limited: bool,
    room: Arc<Notify>,
    ring: Vec<(u64, usize)>,
    routes: Mutex<PrefixRoutes>,
    turn: AtomicUsize,
}

/// The prefixes of a prompt that route it: hashes of its first 64, 128, … 4096 tokens (or
/// 256, 512, … 16384 bytes of its text), then of the whole prompt; shortest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RouteKey(Vec<u64>);

impl RouteKey {
    /// The key of a prompt: its token ids when known, else its text.
    pub(crate) fn of(ids: Option<&[u32]>, text: &str) -> RouteKey {
        let mut out = Vec::new();
        let mut h = twox_hash::XxHash64::with_seed(0x5e11);
        use std::hash::Hasher;
        match ids {
            Some(ids) => {
                let mut at = 0;
                let mut next = 64;
                while next <= ids.len() && next <= 4096 {
                    for t in &ids[at..next] {
                        h.write_u32(*t);
                    }
                    out.push(h.finish());
                    at = next;
                    next *= 2;
                }
                for t in &ids[at..] {
                    h.write_u32(*t);
                }
            }
            None => {
                let b = text.as_bytes();
                let mut at = 0;
                let mut next = 256;
                while next <= b.len() && next <= 16384 {
                    h.write(&b[at..next]);
                    out.push(h.finish());
                    at = next;
                    next *= 2;
                }
                h.write(&b[at..]);
            }
        }
        h.write_u8(0xff);
        out.push(h.finish());
        RouteKey(out)
    }
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
    #[cfg(test)]
    pub(crate) fn new(urls: &[String], down_log_interval: Duration) -> Self {
        Self::with(urls, down_log_interval, Routing::LeastRequests, None)
    }

    /// The servers of `urls` routed by `routing`; with `limit`, each starts limited to it
    /// (`concurrency = "auto"`: [`crate::run::concurrency`] moves the limits).
    pub(crate) fn with(
        urls: &[String],
        down_log_interval: Duration,
        routing: Routing,
        limit: Option<usize>,
    ) -> Self {
        let room = Arc::new(Notify::new());
        let mut ring: Vec<(u64, usize)> = (0..urls.len())
            .flat_map(|i| {
                (0..RING_POINTS).map(move |k| {
                    let mut h = twox_hash::XxHash64::with_seed(k);
                    std::hash::Hasher::write(&mut h, urls[i].as_bytes());
                    (std::hash::Hasher::finish(&h), i)
                })
            })
            .collect();
        ring.sort_unstable();
        Self {
            list: urls
                .iter()
                .map(|u| Server {
                    url: u.trim_end_matches('/').to_string(),
                    inflight: AtomicUsize::new(0),
                    up: AtomicBool::new(true),
                    errors: AtomicU32::new(0),
                    limit: AtomicUsize::new(limit.unwrap_or(usize::MAX)),
                    streamed: AtomicU64::new(0),
                    answered: AtomicU64::new(0),
                    room: limit.map(|_| room.clone()),
                })
                .collect(),
            down_log: DownLog {
                interval: down_log_interval,
                last: Mutex::new(None),
            },
            routing,
            limited: limit.is_some(),
            room,
            ring,
            routes: Mutex::new(PrefixRoutes::default()),
            turn: AtomicUsize::new(0),
        }
    }

    /// Whether servers have limits of their own (`concurrency = "auto"`).
    pub(crate) fn limited(&self) -> bool {
        self.limited
    }

    /// Sets server `i`'s limit (at least 1) and wakes whoever waits for room.
    pub(crate) fn set_limit(&self, i: usize, limit: usize) {
        self.list[i].limit.store(limit.max(1), Ordering::Relaxed);
        self.room.notify_waiters();
    }

    /// Requests the dispatcher may hold: the sum of the limits of the servers in rotation
    /// (all of them while none is), at least 1.
    pub(crate) fn total_limit(&self) -> usize {
        let sum = |up_only: bool| -> usize {
            self.list
                .iter()
                .filter(|s| !up_only || s.is_up())
                .map(|s| s.limit.load(Ordering::Relaxed))
                .fold(0usize, usize::saturating_add)
        };
        match sum(true) {
            0 => sum(false).max(1),
            n => n,
        }
    }

    /// Woken when an attempt ends or a limit moves (with limits only).
    pub(crate) fn room(&self) -> &Notify {
        &self.room
    }

    /// The server for an attempt: the conversation's (`preferred`) while it is up, else
    /// by the routing policy among the servers with room; waits while every server in
    /// rotation is at its limit. With every server down it answers at once (any server:
    /// the attempt finds it unreachable and waits for a probe).
    pub(crate) async fn pick_for(&self, preferred: Option<usize>, key: &RouteKey) -> usize {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.any_up() {
                return self.pick();
            }
            if let Some(i) = self.choose(preferred, key) {
                return i;
            }
            // A limit may move without an attempt ending: look again now and then.
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// The routing decision, or `None` while no server in rotation has room.
    fn choose(&self, preferred: Option<usize>, key: &RouteKey) -> Option<usize> {
        if let Some(i) = preferred.filter(|&i| self.list.get(i).is_some_and(Server::is_up)) {
            return self.list[i].has_room().then_some(i);
        }
        if self.list.len() == 1 {
            return self.list[0].has_room().then_some(0);
        }
        match self.routing {
            Routing::LeastRequests => self.least_loaded(),
            Routing::RoundRobin => {
                let n = self.list.len();
                let start = self.turn.fetch_add(1, Ordering::Relaxed);
                (0..n)
                    .map(|k| (start + k) % n)
                    .find(|&i| self.list[i].is_up() && self.list[i].has_room())
            }
            Routing::Prefix => self.by_prefix(key),
        }
    }

    /// The up server with room and the least in flight relative to its limit.
    fn least_loaded(&self) -> Option<usize> {
        self.list
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_up() && s.has_room())
            .min_by(|(i, a), (j, b)| {
                let load = |s: &Server| {
                    s.inflight.load(Ordering::Relaxed) as f64
                        / s.limit.load(Ordering::Relaxed).max(1) as f64
                };
                load(a)
                    .total_cmp(&load(b))
                    .then(
                        a.inflight
                            .load(Ordering::Relaxed)
                            .cmp(&b.inflight.load(Ordering::Relaxed)),
                    )
                    .then(i.cmp(j))
            })
            .map(|(i, _)| i)
    }

    /// Whether server `i` may take one more under the bounded-load rule.
    fn within_bound(&self, i: usize) -> bool {
        let s = &self.list[i];
        if !s.is_up() || !s.has_room() {
            return false;
        }
        let (mut total, mut weight_sum) = (0usize, 0.0f64);
        let weight = |s: &Server| match s.limit.load(Ordering::Relaxed) {
            usize::MAX => 1.0,
            l => l as f64,
        };
        for x in self.list.iter().filter(|x| x.is_up()) {
            total += x.inflight.load(Ordering::Relaxed);
            weight_sum += weight(x);
        }
        let share = weight(s) / weight_sum.max(1e-9);
        let bound = (LOAD_BOUND * (total + 1) as f64 * share).ceil();
        (s.inflight.load(Ordering::Relaxed) + 1) as f64 <= bound
    }

    /// Prefix routing: the server of the longest prefix seen before, else the ring's, each
    /// within bounded load, else the least loaded; the prefixes not seen before are
    /// recorded as going where this prompt goes.
    fn by_prefix(&self, key: &RouteKey) -> Option<usize> {
        let mut routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        let known = key
            .0
            .iter()
            .rev()
            .filter_map(|h| routes.to.get(h).copied())
            .find(|&i| i < self.list.len() && self.list[i].is_up());
        let chosen = match known {
            Some(i) if self.within_bound(i) => Some(i),
            _ => {
                let first = key.0.first().copied().unwrap_or(0);
                let at = self.ring.partition_point(|(h, _)| *h < first);
                let n = self.ring.len();
                let mut seen = vec![false; self.list.len()];
                let mut pick = None;
                for k in 0..n {
                    let (_, i) = self.ring[(at + k) % n];
                    if std::mem::replace(&mut seen[i], true) {
                        continue;
                    }
                    if self.within_bound(i) {
                        pick = Some(i);
                        break;
                    }
                }
                pick.or_else(|| self.least_loaded())
            }
        };
        if let Some(i) = chosen {
            if routes.to.len() > PREFIX_ROUTES_MAX {
                routes.to.clear();
            }
            for h in &key.0 {
                routes.to.entry(*h).or_insert(i);
            }
        }
        chosen
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

    /// Whether some server is in rotation (a worker waiting for one polls this).
    pub(crate) fn any_up(&self) -> bool {
        self.list.iter().any(|s| s.up.load(Ordering::Relaxed))
    }

    /// Server `i` answered: its error count restarts and it is back in rotation.
    pub(crate) fn ok(&self, i: usize) {
        let s = &self.list[i];
        s.answered.fetch_add(1, Ordering::Relaxed);
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

/// How often servers out of rotation are health-checked.
const PROBE_EVERY: Duration = Duration::from_secs(2);

/// Puts a server taken out of rotation back once its health check answers, looking every
/// [`PROBE_EVERY`] until `stop`.
pub(crate) async fn probe_in(
    servers: Arc<Servers>,
    upstream: crate::upstream::Upstream,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(PROBE_EVERY) => {}
            _ = stop.cancelled() => return,
        }
        for (i, s) in servers.list.iter().enumerate() {
            if !s.is_up() && upstream.healthy(&s.url).await {
                servers.ok(i);
            }
        }
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
        let key = RouteKey::of(None, "a prompt");
        assert_eq!(servers.pick(), 0);
        assert_eq!(servers.choose(Some(1), &key), Some(1));
        assert_eq!(servers.choose(None, &key), Some(0));
        servers.list[1].up.store(false, Ordering::Relaxed);
        assert_eq!(servers.choose(Some(1), &key), Some(0));
        assert_eq!(servers.choose(Some(7), &key), Some(0));
    }

    /// Prefix routing: a prompt sharing a prefix with an earlier one goes to its server
    /// while that server is within 1.25 × its share of what is in flight, and spills to
    /// another when it is not; prompts without a shared prefix spread over the ring.
    #[test]
    fn prefixes_stick_to_a_server_within_bounded_load() {
        let urls: Vec<String> = (1..=4).map(|p| format!("http://127.0.0.1:{p}")).collect();
        let servers = Servers::with(&urls, Duration::from_secs(60), Routing::Prefix, None);
        let shared: Vec<u32> = (0..512).collect();
        let prompt = |k: u32| {
            let mut p = shared.clone();
            p.extend([100_000 + k, 7, 7]);
            p
        };
        // 8 in flight on each server.
        let mut held: Vec<InFlight<'_>> = servers
            .list
            .iter()
            .flat_map(|s| (0..8).map(move |_| s.begin()))
            .collect();
        let first = servers
            .choose(None, &RouteKey::of(Some(&prompt(0)), ""))
            .unwrap();
        held.push(servers.list[first].begin());
        for k in 1..=3 {
            let i = servers
                .choose(None, &RouteKey::of(Some(&prompt(k)), ""))
                .unwrap();
            assert_eq!(i, first, "prompt {k} shares the prefix");
            held.push(servers.list[i].begin());
        }
        // 12 of 36 on `first`: one more would pass 1.25 × its share (11.6); it spills.
        let spill = servers
            .choose(None, &RouteKey::of(Some(&prompt(9)), ""))
            .unwrap();
        assert_ne!(spill, first);
        drop(held);
        // Unrelated prompts land on more than one server.
        let spread: std::collections::HashSet<usize> = (0..64u32)
            .map(|k| {
                let p: Vec<u32> = (0..80).map(|t| t * 1000 + k).collect();
                servers.choose(None, &RouteKey::of(Some(&p), "")).unwrap()
            })
            .collect();
        assert!(spread.len() >= 3, "{spread:?}");
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
