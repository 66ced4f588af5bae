//! The observability endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`.
//!
//! Invariant: read-only; nothing served here can change the run. It binds wherever
//! `run.metrics_addr` says, loopback by default.
//!
//! `/readyz` is 200 while at least one inference server is in rotation (its
//! `spool_server_up` gauge is 1, kept by the monitor from the routing state: a server is
//! taken out after 3 consecutive errors, connection refused included, and probed back in),
//! 503 otherwise.

use crate::observe::metrics::Metrics;
use crate::observe::status::StatusReport;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the endpoint reads.
pub struct Observed {
    pub metrics: Arc<Metrics>,
    /// False forces `/readyz` to 503; when true, readiness is "a server in rotation"
    /// (read from the `spool_server_up` gauges).
    pub ready: AtomicBool,
    /// Produces the live status report.
    pub status: Box<dyn Fn() -> StatusReport + Send + Sync>,
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

async fn status(State(s): State<Arc<Observed>>) -> impl IntoResponse {
    axum::Json((s.status)())
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<Observed>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
