//! The observability endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`.
//!
//! Invariants: read-only; nothing served here can change the run. It binds wherever
//! `run.metrics_addr` says, loopback by default. Whatever clients do, it holds at most
//! [`ServeLimits::max_connections`] sockets (a fixed share of the process's file
//! descriptors, see `run::descriptors`): past that it stops accepting and connections wait
//! in the kernel's backlog, which costs the process no descriptor. A connection gets
//! [`ServeLimits::header_timeout`] to send its request head and lives at most
//! [`ServeLimits::connection_timeout`]; one request per connection (no keep-alive), so an
//! idle socket is closed, never kept.
//!
//! `/status` carries the servers' error messages (failure reasons) only for a client that
//! sends the run's token (`Authorization: Bearer`, the token file in `data_dir`): anyone
//! who can reach the port sees counts, states and line numbers, not what servers said.
//! With `?challenge=<hex>` it proves it is the run that owns the queue: the
//! `x-spool-proof` header is HMAC-SHA256(token, challenge) ([`proof`]).
//!
//! `/readyz` is 200 while at least one inference server is in rotation (its
//! `spool_server_up` gauge is 1, kept by the monitor from the routing state: a server is
//! taken out after 3 consecutive errors, connection refused included, and probed back in),
//! 503 otherwise.

use crate::observe::metrics::Metrics;
use crate::observe::status::StatusReport;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The response header carrying the proof of identity.
pub const PROOF_HEADER: &str = "x-spool-proof";

/// Shown in `/status` instead of a failure's reason to a client without the token.
pub const REASON_HIDDEN: &str =
    "(reason hidden from the endpoint: `spool status -c` on the run's machine shows it)";

/// What the endpoint reads.
pub struct Observed {
    pub metrics: Arc<Metrics>,
    /// False forces `/readyz` to 503; when true, readiness is "a server in rotation"
    /// (read from the `spool_server_up` gauges).
    pub ready: AtomicBool,
    /// Produces the live status report.
    pub status: Box<dyn Fn() -> StatusReport + Send + Sync>,
    /// The run's secret (in `data_dir`, readable by its owner only): proves the endpoint
    /// to `spool status -c` and lets that client see failure reasons. `None`: no proof,
    /// reasons always hidden.
    pub token: Option<String>,
}

/// How much of the process one client may hold.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Sockets held at once (accepted and not yet closed).
    pub max_connections: usize,
    /// From accept to the end of the request head.
    pub header_timeout: Duration,
    /// From accept to close, whatever happens in between.
    pub connection_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 32,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(20),
        }
    }
}

/// The router (tests mount it directly).
pub fn router(state: Arc<Observed>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .with_state(state)
}

async fn metrics(State(s): State<Arc<Observed>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn readyz(State(s): State<Arc<Observed>>) -> impl IntoResponse {
    if s.ready.load(Ordering::Relaxed) && s.metrics.any_server_up() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no inference server reachable\n",
        )
    }
}

/// `?challenge=<hex>` of a `/status` request.
#[derive(serde::Deserialize)]
struct StatusQuery {
    challenge: Option<String>,
}

async fn status(
    State(s): State<Arc<Observed>>,
    Query(q): Query<StatusQuery>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let mut report = (s.status)();
    let authorized = s.token.as_deref().is_some_and(|t| {
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| {
                // Equal MACs, compared in constant time: the token is not guessed byte by byte.
                let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, t.as_bytes());
                let want = ring::hmac::sign(&key, t.as_bytes());
                ring::hmac::verify(&key, given.as_bytes(), want.as_ref()).is_ok()
            })
    });
    if !authorized {
        for d in &mut report.datasets {
            for f in &mut d.failures {
                f.1 = REASON_HIDDEN.to_string();
            }
        }
    }
    let mut resp = axum::Json(report).into_response();
    if let (Some(token), Some(ch)) = (s.token.as_deref(), q.challenge.as_deref()) {
        if let Ok(v) = HeaderValue::from_str(&proof(token, ch)) {
            resp.headers_mut().insert(PROOF_HEADER, v);
        }
    }
    resp
}

/// The answer to a challenge: hex HMAC-SHA256 keyed by the run's token. Only a process
/// that read the token file (its owner's) can compute it, and a fresh challenge each time
/// means an answer seen once is of no use again.
pub fn proof(token: &str, challenge: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let tag = ring::hmac::sign(&key, challenge.as_bytes());
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Serves until `shutdown` resolves, within `limits`. Connections still open then are
/// dropped (each is one short request).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<Observed>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let app = router(state);
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // A slot first: at the limit nothing is accepted, so waiting clients hold no
        // descriptor of this process.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let sock = tokio::select! {
            r = listener.accept() => match r {
                Ok((sock, _)) => sock,
                Err(e) => {
                    // Out of descriptors (or a connection reset before accept): back off
                    // instead of spinning on the error.
                    tracing::debug!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Reap finished connections so the set does not grow.
        while conns.try_join_next().is_some() {}
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        conns.spawn(async move {
            let _slot = slot;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(false)
                .max_buf_size(16 * 1024)
                .serve_connection(hyper_util::rt::TokioIo::new(sock), svc);
            let _ = tokio::time::timeout(limits.connection_timeout, conn).await;
        });
    }
    conns.abort_all();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::status::DatasetStatus;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn observed(token: Option<&str>) -> Arc<Observed> {
        Arc::new(Observed {
            metrics: Arc::new(Metrics::for_partition(None)),
            ready: AtomicBool::new(true),
            status: Box::new(|| StatusReport {
                running: true,
                servers: Vec::new(),
                datasets: vec![DatasetStatus {
                    name: "a".into(),
                    failed: 1,
                    failures: vec![(7, "HTTP 500: the server's own words".into())],
                    ..Default::default()
                }],
            }),
            token: token.map(str::to_string),
        })
    }

    async fn start(
        token: Option<&str>,
        limits: ServeLimits,
    ) -> (std::net::SocketAddr, tokio_util::sync::CancellationToken) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(serve(
            l,
            observed(token),
            async move { s.cancelled().await },
            limits,
        ));
        (addr, stop)
    }

    /// One raw HTTP/1.1 GET; the whole answer (the server closes after one request).
    async fn get(addr: std::net::SocketAddr, path: &str, extra: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// `/status` shows a failure's line to anyone but its reason (a server's message)
    /// only with the run's token.
    #[tokio::test]
    async fn status_hides_server_text_without_the_token() {
        let (addr, _stop) = start(Some("t0k"), ServeLimits::default()).await;
        let open = get(addr, "/status", "").await;
        assert!(open.contains("\"failures\":[[7,"), "{open}");
        assert!(!open.contains("own words"), "{open}");
        let wrong = get(addr, "/status", "authorization: Bearer nope\r\n").await;
        assert!(!wrong.contains("own words"), "{wrong}");
        let owner = get(addr, "/status", "authorization: Bearer t0k\r\n").await;
        assert!(
            owner.contains("HTTP 500: the server's own words"),
            "{owner}"
        );
    }

    /// A challenge is answered with HMAC-SHA256(token, challenge), which a client that
    /// knows the token can check.
    #[tokio::test]
    async fn status_proves_the_token_to_a_challenge() {
        let (addr, _stop) = start(Some("t0k"), ServeLimits::default()).await;
        let r = get(addr, "/status?challenge=abc123", "").await;
        let want = format!("{PROOF_HEADER}: {}", proof("t0k", "abc123"));
        assert!(r.contains(&want), "{r}");
        assert_ne!(proof("t0k", "abc123"), proof("t0k", "abc124"));
        assert_ne!(proof("t0k", "abc123"), proof("t0l", "abc123"));
    }

    /// At the limit, no socket is accepted: a request waits (in the kernel's backlog)
    /// until an idle socket closes, and is then answered.
    #[tokio::test]
    async fn sockets_beyond_the_limit_wait_unaccepted() {
        let limits = ServeLimits {
            max_connections: 4,
            header_timeout: Duration::from_secs(60),
            connection_timeout: Duration::from_secs(60),
        };
        let (addr, _stop) = start(None, limits).await;
        let mut idle = Vec::new();
        for _ in 0..4 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let waiting = tokio::spawn(get(addr, "/healthz", ""));
        // Not answered while the 4 idle sockets hold every slot.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiting.is_finished(), "a 5th connection was served");
        drop(idle.pop());
        let ok = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("served once a slot is free")
            .unwrap();
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.contains("connection: close"), "{ok}");
    }

    /// A socket that sends nothing is closed after the header timeout, one that sends
    /// half a head too.
    #[tokio::test]
    async fn idle_sockets_are_closed_after_the_header_timeout() {
        let limits = ServeLimits {
            max_connections: 4,
            header_timeout: Duration::from_millis(200),
            connection_timeout: Duration::from_secs(60),
        };
        let (addr, _stop) = start(None, limits).await;
        let idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /status HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        for mut s in [idle, half] {
            let mut rest = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
                .await
                .expect("closed by the server")
                .ok();
            assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));
        }
    }
}
