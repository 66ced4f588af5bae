//! A run's metrics endpoint and monitor: the port bound at start (before any server is
//! asked), the address and token written to `data_dir`, and the monitor and the endpoint
//! started once the run dispatches.
//!
//! Invariants: the token file is written with mode 0600 and never through a symlink; the
//! endpoint's connections are held to its share of the file descriptors; a port that
//! cannot be bound stops the run with a usage error naming `run.metrics_addr`.

use super::Job;
use crate::error::{Context, Error, Kind};
use crate::observe::http::Observed;
use crate::observe::metrics::Metrics;
use crate::observe::monitor::{live_status, monitor_loop, LiveRates};
use crate::run::servers::probe_in;
use crate::run::view::RunView;
use crate::run::worker::Ctx;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// File in `data_dir` holding the address the running process's endpoint is bound to.
pub const ENDPOINT_FILE: &str = "metrics.addr";

/// File in `data_dir` (mode 0600) holding the running process's endpoint token: its
/// `/status` proves it holds it, so `spool status` trusts no other process on the port.
pub const TOKEN_FILE: &str = "metrics.token";

/// The metrics endpoint, bound at start and served once the run dispatches.
pub(super) struct Endpoint {
    pub(super) listener: tokio::net::TcpListener,
    pub(super) token: String,
    pub(super) limits: crate::observe::http::ServeLimits,
}

impl Job {
    /// Binds `run.metrics_addr` (when set) before anything is asked of a server, writes
    /// the bound address and a fresh token to `data_dir`, and sizes the endpoint's share of
    /// file descriptors (raising the soft limit first).
    pub(super) async fn bind_endpoint(&self) -> Result<Option<Endpoint>, Error> {
        let cfg = &self.cfg;
        let limit = crate::run::descriptors::raise_soft_limit();
        // Under "auto" each server may reach `max_concurrency`.
        let slots = cfg
            .run
            .concurrency
            .fixed()
            .unwrap_or(cfg.run.max_concurrency * cfg.server.urls.len());
        let reserve = crate::run::descriptors::reserve(slots, cfg.datasets.len());
        if limit < reserve {
            tracing::warn!(
                limit,
                reserve,
                concurrency = slots,
                "the open-files limit (ulimit -n) is low for this concurrency; raise it"
            );
        }
        if cfg.run.metrics_addr.is_empty() {
            return Ok(None);
        }
        let listener = tokio::net::TcpListener::bind(&cfg.run.metrics_addr)
            .await
            .map_err(|e| {
                let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                    "another process holds that port: pick a free one, or port 0 for any free \
                     port (`--metrics-addr 127.0.0.1:0`; `spool status` finds it), or \
                     `--metrics-addr \"\"` to disable the endpoint"
                } else {
                    "use an address of this machine (`127.0.0.1:0` for any free port on \
                     loopback), or `--metrics-addr \"\"` to disable the endpoint"
                };
                Error::new(
                    Kind::Usage,
                    anyhow::anyhow!(
                        "cannot bind run.metrics_addr {}: {e}; {hint}",
                        cfg.run.metrics_addr
                    ),
                )
            })?;
        let addr = listener.local_addr()?;
        let token: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        write_private(&cfg.data_dir.join(TOKEN_FILE), token.as_bytes())
            .with_context(|| format!("cannot write {}", cfg.data_dir.join(TOKEN_FILE).display()))?;
        // Lets `spool status` find this process when the port was chosen by the OS.
        let _ = std::fs::write(cfg.data_dir.join(ENDPOINT_FILE), addr.to_string());
        let limits = crate::observe::http::ServeLimits {
            max_connections: crate::run::descriptors::endpoint_share(limit, reserve),
            ..Default::default()
        };
        tracing::info!(%addr, max_connections = limits.max_connections, "metrics endpoint bound");
        Ok(Some(Endpoint {
            listener,
            token,
            limits,
        }))
    }

    /// Starts the monitor (rates, gauges, progress lines, live status, server probes) and,
    /// when configured, serves the endpoint bound at start; returns each with its stop.
    #[allow(clippy::type_complexity)]
    pub(super) fn observe(
        &self,
        ctx: &Arc<Ctx>,
        metrics: &Arc<Metrics>,
        endpoint: Option<Endpoint>,
    ) -> (
        (CancellationToken, JoinHandle<()>),
        (CancellationToken, Option<JoinHandle<std::io::Result<()>>>),
    ) {
        let view = RunView::new(
            &ctx.cfg,
            &self.plan,
            &ctx.queue,
            &ctx.sched,
            &ctx.servers,
            &ctx.dmetrics,
        );
        let live = Arc::new(LiveRates::default());
        let monitor_stop = CancellationToken::new();
        // The monitor watches through a read-only view; putting servers back in rotation
        // is the run's own job, stopped with it.
        let monitor = {
            let view = view.clone();
            let probe = probe_in(
                ctx.servers.clone(),
                ctx.upstream.clone(),
                monitor_stop.clone(),
            );
            let watch = monitor_loop(view, metrics.clone(), live.clone(), monitor_stop.clone());
            tokio::spawn(async move {
                tokio::join!(probe, watch);
            })
        };
        let http_stop = CancellationToken::new();
        let http_task = endpoint.map(|e| {
            let observed = Arc::new(Observed {
                metrics: metrics.clone(),
                ready: AtomicBool::new(true),
                status: Box::new(move || live_status(&view, &live)),
                token: Some(e.token),
            });
            if let Ok(addr) = e.listener.local_addr() {
                tracing::info!(%addr, "metrics endpoint listening");
            }
            let s = http_stop.clone();
            tokio::spawn(crate::observe::http::serve(
                e.listener,
                observed,
                async move { s.cancelled().await },
                e.limits,
            ))
        });
        ((monitor_stop, monitor), (http_stop, http_task))
    }
}

/// Writes a file only its owner can read, replacing one left by an earlier run (never
/// through a symlink).
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}
