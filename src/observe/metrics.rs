//! Every Prometheus series spool exports (listed in docs/metrics.md), defined once here.
//!
//! Invariants: label sets are bounded — `dataset` takes the config's dataset names,
//! `server` the configured URLs, `outcome`/`state` fixed enums; hot-path counters are
//! pre-resolved per dataset ([`DatasetMetrics`]) so updating them takes no lock (an
//! `IntCounter` is one atomic add, a `Histogram` observation atomics only). Gauges are
//! written once a second by the monitor. A gauge whose value is unknown (an ETA without a
//! measured rate, a budget that is not set) is absent rather than a sentinel.
//!
//! A partitioned job's worker adds `partition` (its index) to every series.
//!
//! `spool_run_eta_seconds` (no labels) is the whole run's ETA, beside the per-dataset one.

use prometheus::core::Collector;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The registry and every family.
pub struct Metrics {
    pub registry: Registry,
    /// Held for writing by the monitor while it writes one tick's gauges and report, for
    /// reading while `/metrics` renders: a scrape never sees half a tick.
    pub tick: std::sync::RwLock<()>,
    pub requests: IntCounterVec,
    pub completion_tokens: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub streamed_tokens: IntCounterVec,
    pub items: IntGaugeVec,
    pub token_budget: IntGaugeVec,
    pub budget_remaining: IntGaugeVec,
    pub eta: GaugeVec,
    /// The whole run's ETA; absent while unknown, hence a
    /// family without labels rather than a plain gauge. Set it with [`Metrics::set_run_eta`].
    pub run_eta: GaugeVec,
    pub request_duration: HistogramVec,
    pub ttft: HistogramVec,
    pub inflight: IntGaugeVec,
    pub server_up: IntGaugeVec,
    pub concurrency_limit: IntGaugeVec,
    pub shards_written: IntCounterVec,
    pub shard_bytes: IntCounterVec,
    pub prompt_disagreements: IntCounterVec,
}

/// One dataset's hot-path handles.
#[derive(Clone)]
pub struct DatasetMetrics {
    pub ok: IntCounter,
    pub retry: IntCounter,
    pub failed: IntCounter,
    pub rejected: IntCounter,
    pub completion_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub streamed_tokens: IntCounter,
    pub duration: prometheus::Histogram,
    pub ttft: prometheus::Histogram,
    /// Chat answers whose prompt disagrees with spool's own rendering.
    pub prompt_disagreements: IntCounter,
    /// Set once the first disagreement of the dataset has been logged.
    pub disagreement_warned: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
        1800.0, 3600.0,
    ]
}

fn ttft_buckets() -> Vec<f64> {
    vec![
        0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    ]
}

impl Metrics {
    /// Registers every family in a fresh registry.
    pub fn new() -> Self {
        Self::for_partition(None)
    }

    /// As [`Metrics::new`]; a worker of a partitioned job labels every series with its
    /// `partition` (one value per process, so the label set stays bounded by the job's
    /// partitions), and dashboards sum over it.
    pub fn for_partition(partition: Option<crate::config::partition::Partition>) -> Self {
        let labels = partition.map(|p| {
            std::collections::HashMap::from([("partition".to_string(), p.index.to_string())])
        });
        let registry = Registry::new_custom(None, labels)
            .expect("a fixed, valid label name and a number as its value");
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("metric definitions are static and valid");
                registry
                    .register(Box::new(m.clone()))
                    .expect("each metric is registered once");
                m
            }};
        }
        let ds = &["dataset"];
        Self {
            requests: reg!(IntCounterVec::new(
                Opts::new(
                    "spool_requests_total",
                    "Finished attempts by outcome (ok, retry, failed, rejected)."
                ),
                &["dataset", "outcome"]
            )),
            completion_tokens: reg!(IntCounterVec::new(
                Opts::new(
                    "spool_completion_tokens_total",
                    "Completion tokens of completed items (what the budget counts)."
                ),
                ds
            )),
            prompt_tokens: reg!(IntCounterVec::new(
                Opts::new(
                    "spool_prompt_tokens_total",
                    "Prompt tokens of completed items."
                ),
                ds
            )),
            streamed_tokens: reg!(IntCounterVec::new(
                Opts::new(
                    "spool_streamed_tokens_total",
                    "Completion tokens as they arrive, requests in flight included."
                ),
                ds
            )),
            items: reg!(IntGaugeVec::new(
                Opts::new(
                    "spool_items",
                    "Items by state (pending, inflight, done, failed)."
                ),
                &["dataset", "state"]
            )),
            token_budget: reg!(IntGaugeVec::new(
                Opts::new(
                    "spool_token_budget",
                    "The dataset's completion-token budget (a cluster partition's: the tickets it holds)."
                ),
                ds
            )),
            budget_remaining: reg!(IntGaugeVec::new(
                Opts::new(
                    "spool_budget_remaining_tokens",
                    "Budget left: budget minus completed tokens."
                ),
                ds
            )),
            eta: reg!(GaugeVec::new(
                Opts::new(
                    "spool_eta_seconds",
                    "Estimated seconds until the dataset is finished."
                ),
                ds
            )),
            run_eta: reg!(GaugeVec::new(
                Opts::new(
                    "spool_run_eta_seconds",
                    "Estimated seconds until every dataset is finished."
                ),
                &[]
            )),
            request_duration: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "spool_request_duration_seconds",
                    "Successful requests, request to last byte."
                )
                .buckets(latency_buckets()),
                ds
            )),
            ttft: reg!(HistogramVec::new(
                HistogramOpts::new(
                    "spool_time_to_first_token_seconds",
                    "Time to first token of streamed requests."
                )
                .buckets(ttft_buckets()),
                ds
            )),
            inflight: reg!(IntGaugeVec::new(
                Opts::new("spool_inflight_requests", "Requests in flight per server."),
                &["server"]
            )),
            server_up: reg!(IntGaugeVec::new(
                Opts::new(
                    "spool_server_up",
                    "1 while a server is in rotation, 0 while taken out."
                ),
                &["server"]
            )),
            concurrency_limit: reg!(IntGaugeVec::new(
                Opts::new(
                    "spool_server_concurrency_limit",
                    "Requests a server may have in flight: its own limit with concurrency = \"auto\", else run.concurrency."
                ),
                &["server"]
            )),
            shards_written: reg!(IntCounterVec::new(
                Opts::new("spool_shards_written_total", "Shard files sealed."),
                ds
            )),
            shard_bytes: reg!(IntCounterVec::new(
                Opts::new("spool_shard_bytes_total", "Bytes of sealed shard files."),
                ds
            )),
            prompt_disagreements: reg!(IntCounterVec::new(
                Opts::new(
                    "spool_prompt_token_disagreements_total",
                    "Chat answers whose prompt differs from spool's own rendering: the server's prompt ids, or else its usage.prompt_tokens, against spool's ids."
                ),
                ds
            )),
            registry,
            tick: std::sync::RwLock::new(()),
        }
    }

    /// Pre-resolves a dataset's series (and makes the counters exist at zero from the
    /// start, so `rate()` has a baseline). The ETA is left absent until it is known.
    pub fn dataset(&self, name: &str) -> DatasetMetrics {
        let r = |o: &str| self.requests.with_label_values(&[name, o]);
        self.shards_written.with_label_values(&[name]);
        self.shard_bytes.with_label_values(&[name]);
        DatasetMetrics {
            ok: r("ok"),
            retry: r("retry"),
            failed: r("failed"),
            rejected: r("rejected"),
            completion_tokens: self.completion_tokens.with_label_values(&[name]),
            prompt_tokens: self.prompt_tokens.with_label_values(&[name]),
            streamed_tokens: self.streamed_tokens.with_label_values(&[name]),
            duration: self.request_duration.with_label_values(&[name]),
            ttft: self.ttft.with_label_values(&[name]),
            prompt_disagreements: self.prompt_disagreements.with_label_values(&[name]),
            disagreement_warned: Default::default(),
        }
    }

    /// Sets a dataset's ETA, or removes the series while it is unknown.
    pub fn set_eta(&self, dataset: &str, eta_s: Option<f64>) {
        match eta_s {
            Some(e) if e.is_finite() => self.eta.with_label_values(&[dataset]).set(e.max(0.0)),
            _ => {
                let _ = self.eta.remove_label_values(&[dataset]);
            }
        }
    }

    /// Sets the run's ETA, or removes the series while it is unknown.
    pub fn set_run_eta(&self, eta_s: Option<f64>) {
        let none: [&str; 0] = [];
        match eta_s {
            Some(e) if e.is_finite() => self.run_eta.with_label_values(&none).set(e.max(0.0)),
            _ => {
                let _ = self.run_eta.remove_label_values(&none);
            }
        }
    }

    /// Whether any `spool_server_up` series is 1 (what `/readyz` answers).
    pub fn any_server_up(&self) -> bool {
        self.server_up
            .collect()
            .iter()
            .flat_map(|f| f.get_metric())
            .any(|m| m.get_gauge().get_value() > 0.0)
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let families = {
            let _tick = self.tick.read().unwrap_or_else(|p| p.into_inner());
            self.registry.gather()
        };
        let _ = TextEncoder::new().encode(&families, &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partition's worker labels every series with its index, and only with that one
    /// value; a single process adds no label.
    #[test]
    fn a_partition_labels_every_series() {
        let p = crate::config::partition::Partition { index: 3, count: 4 };
        let m = Metrics::for_partition(Some(p));
        m.dataset("a").ok.inc();
        m.set_run_eta(Some(1.0));
        m.inflight.with_label_values(&["http://x"]).set(1);
        let text = m.render();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(samples.len() > 5, "{text}");
        for l in &samples {
            assert!(l.contains("partition=\"3\""), "unlabelled: {l}");
        }
        assert!(
            text.contains("spool_run_eta_seconds{partition=\"3\"} 1"),
            "{text}"
        );
        assert!(!Metrics::new().render().contains("partition="));
    }

    /// Every documented series appears in a scrape, with the labels it is documented with.
    #[test]
    fn every_series_is_exported_with_its_labels() {
        let m = Metrics::new();
        let d = m.dataset("a");
        d.ok.inc();
        d.duration.observe(0.5);
        d.ttft.observe(0.1);
        m.items.with_label_values(&["a", "pending"]).set(3);
        m.token_budget.with_label_values(&["a"]).set(10);
        m.budget_remaining.with_label_values(&["a"]).set(7);
        m.set_eta("a", Some(12.0));
        m.set_run_eta(Some(12.0));
        m.inflight.with_label_values(&["http://x"]).set(1);
        m.server_up.with_label_values(&["http://x"]).set(1);
        let text = m.render();
        for name in [
            "spool_requests_total{dataset=\"a\",outcome=\"ok\"}",
            "spool_completion_tokens_total{dataset=\"a\"}",
            "spool_prompt_tokens_total{dataset=\"a\"}",
            "spool_streamed_tokens_total{dataset=\"a\"}",
            "spool_items{dataset=\"a\",state=\"pending\"}",
            "spool_token_budget{dataset=\"a\"}",
            "spool_budget_remaining_tokens{dataset=\"a\"}",
            "spool_eta_seconds{dataset=\"a\"}",
            "spool_request_duration_seconds_bucket{dataset=\"a\"",
            "spool_time_to_first_token_seconds_bucket{dataset=\"a\"",
            "spool_inflight_requests{server=\"http://x\"}",
            "spool_server_up{server=\"http://x\"}",
            "spool_shards_written_total{dataset=\"a\"}",
            "spool_shard_bytes_total{dataset=\"a\"}",
            "spool_prompt_token_disagreements_total{dataset=\"a\"}",
            "spool_run_eta_seconds 12",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    /// An ETA that is unknown or not finite is left out of the scrape, never written as a
    /// sentinel value a dashboard would plot.
    #[test]
    fn unknown_eta_is_absent_not_a_sentinel() {
        let m = Metrics::new();
        m.dataset("a");
        assert!(!m.render().contains("spool_eta_seconds{"));
        m.set_eta("a", Some(30.0));
        assert!(m.render().contains("spool_eta_seconds{dataset=\"a\"} 30"));
        m.set_eta("a", None);
        assert!(!m.render().contains("spool_eta_seconds{"));
        m.set_eta("a", Some(f64::INFINITY));
        assert!(!m.render().contains("spool_eta_seconds{"));
        m.set_run_eta(Some(5.0));
        assert!(m.render().contains("\nspool_run_eta_seconds 5\n"));
        m.set_run_eta(None);
        assert!(!m.render().contains("\nspool_run_eta_seconds "));
    }

    /// `/readyz` is ready exactly while some server's `spool_server_up` is 1.
    #[test]
    fn readiness_follows_server_up() {
        let m = Metrics::new();
        assert!(!m.any_server_up(), "no server configured: not ready");
        m.server_up.with_label_values(&["http://a"]).set(0);
        m.server_up.with_label_values(&["http://b"]).set(0);
        assert!(!m.any_server_up());
        m.server_up.with_label_values(&["http://b"]).set(1);
        assert!(m.any_server_up());
    }

    /// Increments through the pre-resolved per-dataset handles, from several threads, are
    /// all in the exported series.
    #[test]
    fn hot_path_handles_are_the_exported_series() {
        // The pre-resolved handles must be the very series the registry exports, so a
        // worker's lock-free `inc` is what a scrape sees.
        let m = Metrics::new();
        let d = m.dataset("a");
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        d.streamed_tokens.inc();
                        d.ok.inc();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let text = m.render();
        assert!(text.contains("spool_streamed_tokens_total{dataset=\"a\"} 40000"));
        assert!(text.contains("spool_requests_total{dataset=\"a\",outcome=\"ok\"} 40000"));
    }
}
