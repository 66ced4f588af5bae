//! `GET /metrics` of the mock: the scheduler's gauges and counters in the names vLLM (v1
//! engine) and SGLang export them under, in the Prometheus text format (written by the
//! `prometheus` crate), so a client that reads a real server's signals reads the mock's.
//!
//! Without a KV model the batch has no queue and no cache: running is the requests
//! generating, everything else 0.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use prometheus::{Counter, Encoder, Gauge, Opts, Registry, TextEncoder};

use super::kv::{KvGauges, KvStats};
use super::{MetricNames, MockState};

/// One sample: name, help, value, counter (else gauge).
type Sample = (&'static str, &'static str, f64, bool);

fn vllm(s: &KvStats, g: &KvGauges, generated: f64) -> Vec<Sample> {
    let usage = if g.capacity > 0 {
        g.used as f64 / g.capacity as f64
    } else {
        0.0
    };
    vec![
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            g.running as f64,
            false,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            g.waiting as f64,
            false,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
            false,
        ),
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            s.preemptions as f64,
            true,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prompt_tokens as f64,
            true,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.cached_tokens as f64,
            true,
        ),
        (
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prefilled_tokens as f64,
            true,
        ),
        (
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            generated,
            true,
        ),
    ]
}

fn sglang(s: &KvStats, g: &KvGauges, generated: f64) -> Vec<Sample> {
    let usage = if g.capacity > 0 {
        g.used as f64 / g.capacity as f64
    } else {
        0.0
    };
    vec![
        (
            "sglang:num_running_reqs",
            "The number of running requests.",
            g.running as f64,
            false,
        ),
        (
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            g.waiting as f64,
            false,
        ),
        (
            "sglang:num_used_tokens",
            "The number of used tokens.",
            g.used as f64,
            false,
        ),
        (
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            g.capacity as f64,
            false,
        ),
        ("sglang:token_usage", "The token usage.", usage, false),
        (
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            s.hit_rate(),
            false,
        ),
        (
            "sglang:num_retracted_requests_total",
            "Total number of retracted requests.",
            s.preemptions as f64,
            true,
        ),
        (
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prefilled_tokens as f64,
            true,
        ),
        (
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            generated,
            true,
        ),
    ]
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(st): State<Arc<MockState>>) -> Response {
    let (stats, gauges) = st.kv().unwrap_or_else(|| {
        (
            KvStats::default(),
            KvGauges {
                running: st.engine.active(),
                ..KvGauges::default()
            },
        )
    });
    let generated = st.stats().tokens_generated as f64;
    let mut samples = Vec::new();
    if matches!(st.cfg.metrics_names, MetricNames::Vllm | MetricNames::Both) {
        samples.extend(vllm(&stats, &gauges, generated));
    }
    if matches!(
        st.cfg.metrics_names,
        MetricNames::Sglang | MetricNames::Both
    ) {
        samples.extend(sglang(&stats, &gauges, generated));
    }
    let registry = Registry::new();
    for (name, help, value, counter) in samples {
        let opts = Opts::new(name, help).const_label("model_name", st.cfg.model.clone());
        // Names and labels are fixed and valid; a failure would only drop that series.
        if counter {
            if let Ok(c) = Counter::with_opts(opts) {
                c.inc_by(value.max(0.0));
                let _ = registry.register(Box::new(c));
            }
        } else if let Ok(g) = Gauge::with_opts(opts) {
            g.set(value);
            let _ = registry.register(Box::new(g));
        }
    }
    let mut body = Vec::new();
    let enc = TextEncoder::new();
    if enc.encode(&registry.gather(), &mut body).is_err() {
        body.clear();
    }
    ([(CONTENT_TYPE, enc.format_type().to_string())], body).into_response()
}
