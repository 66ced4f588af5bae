//! Once a second: rates, gauges, progress (bars on a terminal, lines otherwise), live
//! status and `/readyz` (through `spool_server_up`), all read through a
//! [`RunView`]: the monitor changes nothing of the run.
//!
//! Rates are per dataset over streamed tokens (work in flight included); ETAs use the
//! server's speed learned from the totals over datasets, since datasets share it
//! ([`crate::estimate::speed::SpeedLearner`], [`crate::run::scheduler::lane_etas`],
//! [`crate::run::scheduler::run_eta`]). `/status` reports an ETA counted down from the tick that
//! computed it, so a poll between ticks is not up to a second late.
//!
//! At the end of a run the monitor waits (bounded) until every lease has ended, so the last
//! gauges, the last progress line of each dataset and the final bars show final numbers.

use crate::config::DatasetConfig;
use crate::estimate::speed::{SpeedCurve, SpeedLearner};
use crate::observe::bars::{self, DatasetBar, RunLine};
use crate::observe::metrics::Metrics;
use crate::observe::progress::{format_line, LineClock, LineFields, Rate};
use crate::observe::status::{DatasetPhase, ServerStatus, StatusReport};
use crate::run::scheduler::{lane_etas, run_eta, LaneView};
use crate::run::view::RunView;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The report each tick computed, and when: `/status` serves it (its ETAs counted down
/// since), so `/status`, `/metrics` and the progress lines show the same moment.
#[derive(Default)]
pub(crate) struct LiveRates {
    snapshot: Mutex<Option<(StatusReport, Instant)>>,
}

/// How long the end of a run waits for the last leases to end before the final figures.
const FINAL_WAIT: Duration = Duration::from_secs(3);

/// The report of one moment: the queue's counts with the lanes' work in flight laid over
/// them, so `pending` never counts an item in flight and `inflight` counts items (requests
/// apart, as `requests_inflight`).
fn report_now(view: &RunView, views: &[LaneView], previous: Option<&StatusReport>) -> StatusReport {
    let budget = |d: &DatasetConfig| view.budget(d);
    let mut r = StatusReport::from_queue_since(view.queue(), view.cfg(), &budget, previous)
        .unwrap_or_default();
    r.running = true;
    for d in &mut r.datasets {
        if let Some(v) = views.iter().find(|v| v.name == d.name) {
            d.inflight = (v.inflight_items as u64).min(d.pending);
            d.pending -= d.inflight;
            d.requests_inflight = v.inflight as u64;
            if d.state == DatasetPhase::Pending && (d.inflight > 0 || v.dispatching) {
                d.state = DatasetPhase::Running;
            }
        }
    }
    r
}

/// `/status`: the last tick's report, its ETAs counted down since; before the first tick,
/// the counts of this moment.
pub(crate) fn live_status(view: &RunView, live: &LiveRates) -> StatusReport {
    let snapshot = live
        .snapshot
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let Some((mut r, at)) = snapshot else {
        return report_now(view, &view.lanes(), None);
    };
    let since = at.elapsed().as_secs_f64();
    for d in &mut r.datasets {
        d.eta_s = d.eta_s.map(|e| (e - since).max(0.0));
    }
    r
}

/// The monitor's memory between ticks.
struct Monitor {
    start: Instant,
    rates: Vec<Rate>,
    clocks: Vec<LineClock>,
    /// `done` of each dataset at the first tick (a bar appears once a dataset moves).
    start_done: Vec<Option<u64>>,
    /// Datasets that have a bar.
    shown: Vec<bool>,
    /// The servers' speed as a function of requests in flight, for the ETAs: over all of
    /// them, and each server's own (a server leaving rotation takes its share at once).
    speed: SpeedLearner,
    server_speed: Vec<SpeedLearner>,
    server_rates: Vec<Rate>,
}

impl Monitor {
    fn new(n: usize, servers: usize, every: u64, now: Instant) -> Self {
        Self {
            start: now,
            rates: (0..n).map(|_| Rate::default()).collect(),
            clocks: (0..n).map(|_| LineClock::new(every, 0, now)).collect(),
            start_done: vec![None; n],
            shown: vec![false; n],
            speed: SpeedLearner::default(),
            server_speed: (0..servers).map(|_| SpeedLearner::default()).collect(),
            server_rates: (0..servers).map(|_| Rate::default()).collect(),
        }
    }

    /// The curve of the servers in rotation: their capacities added up (each learnt on its
    /// own), the fastest per-request ceiling seen; the run's overall curve until every
    /// server in rotation has one of its own.
    fn curve(&mut self, view: &RunView, now: Instant) -> Option<SpeedCurve> {
        let mut sum = 0.0;
        let mut cap: Option<f64> = None;
        let mut complete = true;
        let mut any_up = false;
        for (i, s) in view.servers().iter().enumerate() {
            let learner = &mut self.server_speed[i];
            learner.sample(now, s.streamed, s.inflight);
            if !s.up {
                continue;
            }
            any_up = true;
            match learner.curve() {
                Some(c) => {
                    sum += c.capacity_tps;
                    cap = match (cap, c.per_request_cap_tps) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                }
                None => complete = false,
            }
        }
        if any_up && complete && sum > 0.0 {
            Some(SpeedCurve {
                capacity_tps: sum,
                per_request_cap_tps: cap
                    .or_else(|| self.speed.curve().and_then(|c| c.per_request_cap_tps)),
            })
        } else {
            self.speed.curve()
        }
    }

    /// One pass: the moment's report, then gauges, progress and `/status` from it. `last`
    /// = the run is over: every dataset that moved gets its final line.
    fn tick(&mut self, view: &RunView, metrics: &Metrics, live: &LiveRates, last: bool) {
        let now = Instant::now();
        let views = view.lanes();
        let previous = live
            .snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(r, _)| r.clone());
        let mut report = report_now(view, &views, previous.as_ref());
        let dmetrics = view.dataset_metrics();
        let readings = view.servers();
        let bars = bars::active();

        // Rates first: every ETA needs the total throughput.
        let mut per_ds = Vec::with_capacity(views.len());
        for (i, _) in views.iter().enumerate() {
            let dm = &dmetrics[i];
            self.rates[i].sample(now, dm.streamed_tokens.get(), dm.ok.get());
            per_ds.push(self.rates[i].rates().unwrap_or((0.0, 0.0)));
        }
        let total_tok_s: f64 = per_ds.iter().map(|r| r.0).sum();
        let streamed: u64 = dmetrics.iter().map(|d| d.streamed_tokens.get()).sum();
        let inflight: usize = views.iter().map(|v| v.inflight).sum();
        self.speed.sample(now, streamed, inflight);
        let curve = self.curve(view, now);
        let slots = view
            .cfg()
            .run
            .concurrency
            .fixed()
            .unwrap_or_else(|| view.total_limit());
        let etas = lane_etas(&views, curve.as_ref(), slots);

        // From here to the report's store, one moment for `/metrics` and `/status`.
        let moment = metrics.tick.write().unwrap_or_else(|p| p.into_inner());
        let mut bar_rows = Vec::new();
        let mut run = RunLine {
            done: 0,
            total: 0,
            tokens: 0,
            tok_per_s: total_tok_s,
            eta_s: run_eta(&etas),
            servers_up: 0,
            servers: readings.len(),
            limits: Vec::new(),
            elapsed_s: now.duration_since(self.start).as_secs_f64(),
        };
        for (i, v) in views.iter().enumerate() {
            let dm = &dmetrics[i];
            let Some(d) = report.datasets.iter_mut().find(|d| d.name == v.name) else {
                continue;
            };
            if self.start_done[i].is_none() {
                self.start_done[i] = Some(d.done);
                self.clocks[i] = LineClock::new(view.cfg().run.progress_every, d.done, now);
            }
            let (tok_s, req_s) = per_ds[i];
            let eta = etas.get(i).copied().flatten();
            d.tokens_per_s = Some(tok_s);
            d.requests_per_s = Some(req_s);
            d.eta_s = eta;
            let d = &*d;
            let name = v.name.as_str();
            for (state, n) in [
                ("pending", d.pending),
                ("inflight", d.inflight),
                ("done", d.done),
                ("failed", d.failed),
            ] {
                metrics
                    .items
                    .with_label_values(&[name, state])
                    .set(n as i64);
            }
            if let Some(b) = v.budget {
                // A cluster partition's budget grows as it takes tickets from the job's pool.
                metrics
                    .token_budget
                    .with_label_values(&[name])
                    .set(b as i64);
                metrics
                    .budget_remaining
                    .with_label_values(&[name])
                    .set(b.saturating_sub(d.completion_tokens) as i64);
            }
            metrics.set_eta(name, eta);
            run.done += d.done;
            run.total += d.items;
            run.tokens += d.completion_tokens;

            let moved = d.inflight > 0 || Some(d.done) != self.start_done[i];
            self.shown[i] |= moved;
            let fields = LineFields {
                name,
                done: d.done,
                total: d.items,
                pending: d.pending,
                inflight: d.inflight,
                failed: d.failed,
                retries: dm.retry.get(),
                req_per_s: req_s,
                tok_per_s: tok_s,
                avg_completion: if d.done > 0 {
                    d.completion_tokens as f64 / d.done as f64
                } else {
                    0.0
                },
                tokens: d.completion_tokens,
                budget: v.budget,
                eta_s: eta,
            };
            if bars.is_some() {
                if self.shown[i] {
                    bar_rows.push(DatasetBar {
                        name,
                        done: d.done,
                        total: d.items,
                        failed: d.failed,
                        tokens: d.completion_tokens,
                        budget: v.budget,
                        tok_per_s: tok_s,
                        eta_s: eta,
                        state: d.state,
                    });
                }
            } else {
                let due = if last {
                    self.clocks[i].finish(d.done, now) || self.shown[i]
                } else {
                    self.clocks[i].due(d.done, d.inflight > 0, now)
                };
                if due {
                    tracing::info!("{}", format_line(&fields));
                }
            }
        }
        metrics.set_run_eta(run.eta_s);
        let mut servers = Vec::with_capacity(readings.len());
        for (i, s) in readings.iter().enumerate() {
            run.servers_up += usize::from(s.up);
            if let Some(l) = s.limit {
                run.limits.push(l);
            }
            self.server_rates[i].sample(now, s.streamed, 0);
            metrics
                .inflight
                .with_label_values(&[&s.url])
                .set(s.inflight as i64);
            metrics
                .server_up
                .with_label_values(&[&s.url])
                .set(i64::from(s.up));
            let shown = s.limit.or(view.cfg().run.concurrency.fixed()).unwrap_or(0);
            metrics
                .concurrency_limit
                .with_label_values(&[&s.url])
                .set(i64::try_from(shown).unwrap_or(i64::MAX));
            servers.push(ServerStatus {
                url: s.url.clone(),
                up: s.up,
                inflight: s.inflight as u64,
                limit: s.limit.map(|l| l as u64),
                tokens_per_s: self.server_rates[i].rates().map(|r| r.0),
            });
        }
        report.servers = servers;
        *live.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = Some((report, now));
        drop(moment);
        if let Some(b) = bars {
            b.update(&bar_rows, &run);
        }
    }
}

pub(crate) async fn monitor_loop(
    view: RunView,
    metrics: Arc<Metrics>,
    live: Arc<LiveRates>,
    stop: CancellationToken,
) {
    let mut m = Monitor::new(
        view.dataset_metrics().len(),
        view.servers().len(),
        view.cfg().run.progress_every,
        Instant::now(),
    );
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        m.tick(&view, &metrics, &live, false);
    }
    leases_ended(&view, FINAL_WAIT).await;
    m.tick(&view, &metrics, &live, true);
    if let Some(b) = bars::active() {
        b.finish();
    }
}

/// Waits until no lease is held and no item is left closing (every result committed or
/// given back), at most `limit`.
async fn leases_ended(view: &RunView, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let notified = view.lanes_changed();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if view
            .lanes()
            .iter()
            .all(|v| v.inflight == 0 && v.inflight_items == 0)
        {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return;
        }
    }
}
