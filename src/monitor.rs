//! Once a second: rates, gauges, progress lines, live status, and probes of servers taken
//! out of rotation.

use crate::config::Config;
use crate::metrics::Metrics;
use crate::progress::{format_line, LineClock, LineFields, Rate};
use crate::queue::Queue;
use crate::scheduler::{lane_eta, Scheduler};
use crate::status::StatusReport;
use crate::worker::Ctx;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Per dataset: (tokens/s, requests/s, ETA seconds), refreshed by the monitor each second.
pub(crate) type LiveRates = Mutex<HashMap<String, (f64, f64, Option<f64>)>>;

pub(crate) fn live_status(
    queue: &Queue,
    cfg: &Config,
    sched: &Scheduler,
    live: &LiveRates,
) -> StatusReport {
    let mut r = StatusReport::from_queue(queue, cfg).unwrap_or_default();
    r.running = true;
    let views = sched.views();
    let live = live.lock().unwrap_or_else(|p| p.into_inner());
    for d in &mut r.datasets {
        if let Some(v) = views.iter().find(|v| v.name == d.name) {
            d.inflight = v.inflight as u64;
            if d.state == "pending" && (v.inflight > 0 || v.dispatching) {
                d.state = "running".into();
            }
        }
        if let Some((tok, req, eta)) = live.get(&d.name) {
            d.tokens_per_s = Some(*tok);
            d.requests_per_s = Some(*req);
            d.eta_s = *eta;
        }
    }
    r
}

pub(crate) async fn monitor_loop(
    ctx: Arc<Ctx>,
    metrics: Arc<Metrics>,
    live: Arc<LiveRates>,
    stop: CancellationToken,
) {
    let start = Instant::now();
    let mut rates: Vec<Rate> = ctx.names.iter().map(|_| Rate::default()).collect();
    let mut clocks: Vec<LineClock> = ctx
        .names
        .iter()
        .map(|_| LineClock::new(ctx.cfg.run.progress_every, 0, start))
        .collect();
    let mut first = true;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_probe = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let now = Instant::now();
        let views = ctx.sched.views();
        let states = ctx.queue.states();
        let mut live_map = HashMap::new();
        for (i, v) in views.iter().enumerate() {
            let dm = &ctx.dmetrics[i];
            let Some(s) = states.iter().find(|s| s.name == v.name) else {
                continue;
            };
            if first {
                clocks[i] = LineClock::new(ctx.cfg.run.progress_every, s.done, now);
            }
            rates[i].sample(now, dm.streamed_tokens.get(), dm.ok.get());
            let (tok_s, req_s) = rates[i].rates().unwrap_or((0.0, 0.0));
            let eta = if v.finished {
                Some(0.0)
            } else {
                lane_eta(v, tok_s)
            };
            let name = v.name.as_str();
            let pending = s.pending().saturating_sub(v.inflight as u64);
            metrics
                .items
                .with_label_values(&[name, "pending"])
                .set(pending as i64);
            metrics
                .items
                .with_label_values(&[name, "inflight"])
                .set(v.inflight as i64);
            metrics
                .items
                .with_label_values(&[name, "done"])
                .set(s.done as i64);
            metrics
                .items
                .with_label_values(&[name, "failed"])
                .set(s.failed as i64);
            if let Some(b) = v.budget {
                metrics
                    .budget_remaining
                    .with_label_values(&[name])
                    .set(b.saturating_sub(s.completion_tokens) as i64);
            }
            metrics
                .eta
                .with_label_values(&[name])
                .set(eta.unwrap_or(-1.0));
            live_map.insert(v.name.clone(), (tok_s, req_s, eta));
            let active = v.inflight > 0;
            if clocks[i].due(s.done, active, now) {
                let avg = if s.done > 0 {
                    s.completion_tokens as f64 / s.done as f64
                } else {
                    0.0
                };
                tracing::info!(
                    "{}",
                    format_line(&LineFields {
                        name,
                        done: s.done,
                        total: s.items,
                        errors: s.failed + dm.retry.get(),
                        req_per_s: req_s,
                        tok_per_s: tok_s,
                        avg_completion: avg,
                        tokens: s.completion_tokens,
                        budget: v.budget,
                        eta_s: eta,
                    })
                );
            }
        }
        first = false;
        *live.lock().unwrap_or_else(|p| p.into_inner()) = live_map;
        for s in &ctx.servers.list {
            metrics
                .inflight
                .with_label_values(&[&s.url])
                .set(s.inflight.load(Ordering::Relaxed) as i64);
            metrics
                .server_up
                .with_label_values(&[&s.url])
                .set(i64::from(s.up.load(Ordering::Relaxed)));
        }
        // Probe servers taken out of rotation.
        if last_probe.elapsed() >= Duration::from_secs(2) {
            last_probe = Instant::now();
            for (i, s) in ctx.servers.list.iter().enumerate() {
                if !s.up.load(Ordering::Relaxed) && ctx.upstream.healthy(&s.url).await {
                    ctx.servers.ok(i);
                }
            }
        }
    }
}
