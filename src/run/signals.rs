//! A server's own load signals, read from its `/metrics` (Prometheus text format) under
//! vLLM's names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` or the older `vllm:gpu_cache_usage_perc`,
//! `vllm:num_preemptions_total`) or SGLang's (`sglang:num_running_reqs`,
//! `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:num_retracted_requests_total`).
//!
//! Only sample lines `name{labels} value [timestamp]` of those names are read; everything
//! else is skipped. The parser is ours: the Prometheus parsing crate we looked at
//! (`prometheus-parse`) refuses metric names with a colon, which both servers use. A
//! family that appears with several label sets (one per engine or data-parallel rank) is
//! summed, the KV usage averaged. Nothing the server says is trusted beyond a number:
//! non-finite or negative values are dropped, and the body is capped by the client.

use crate::run::concurrency::Signals;

/// The families read, per meaning: vLLM's first, then SGLang's.
const RUNNING: &[&str] = &["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: &[&str] = &["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const KV: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];
const PREEMPTIONS: &[&str] = &[
    "vllm:num_preemptions_total",
    "sglang:num_retracted_requests_total",
];

/// The name and value of a sample line, if it is one.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    let rest = &line[name_end..];
    let rest = if rest.starts_with('{') {
        // Label values may hold '}' only inside quotes.
        let mut quoted = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                '}' if !quoted => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        &rest[end? + 1..]
    } else {
        rest
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some((name, value))
}

/// The signals in a `/metrics` body; `None` when it has neither family's running gauge.
pub fn parse(text: &str) -> Option<Signals> {
    // Per family name: (sum, count).
    let mut seen: Vec<(&str, f64, u32)> = Vec::new();
    let wanted = |n: &str| {
        RUNNING.contains(&n) || WAITING.contains(&n) || KV.contains(&n) || PREEMPTIONS.contains(&n)
    };
    for line in text.lines() {
        let Some((name, v)) = sample(line) else {
            continue;
        };
        if !wanted(name) {
            continue;
        }
        match seen.iter_mut().find(|(n, _, _)| *n == name) {
            Some(e) => {
                e.1 += v;
                e.2 += 1;
            }
            None => seen.push((name, v, 1)),
        }
    }
    let first = |names: &[&str], mean: bool| {
        names.iter().find_map(|n| {
            seen.iter()
                .find(|(m, _, _)| m == n)
                .map(|(_, sum, k)| if mean { sum / f64::from(*k) } else { *sum })
        })
    };
    Some(Signals {
        running: first(RUNNING, false)?,
        waiting: first(WAITING, false).unwrap_or(0.0),
        kv_usage: first(KV, true).map(|u| u.min(1.0)),
        preemptions: first(PREEMPTIONS, false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's v1 names, with a label set per engine, are summed (usage averaged); comments,
    /// other families and histograms are skipped.
    #[test]
    fn reads_vllm_names() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 30.0
vllm:num_requests_running{engine="1",model_name="m"} 12.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.8
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
"#;
        let s = parse(text).unwrap();
        assert_eq!(s.running, 42.0);
        assert_eq!(s.waiting, 3.0);
        assert!((s.kv_usage.unwrap() - 0.7).abs() < 1e-9);
        assert_eq!(s.preemptions, Some(7.0));
    }

    /// SGLang's names; a label value holding a brace or a space does not confuse the line.
    #[test]
    fn reads_sglang_names() {
        let text = "sglang:num_running_reqs{model_name=\"a} b\"} 5\n\
                    sglang:num_queue_reqs{model_name=\"a} b\"} 0\n\
                    sglang:token_usage{model_name=\"x\"} 0.25\n\
                    sglang:num_retracted_requests_total{model_name=\"x\"} 2 1700000000000\n";
        let s = parse(text).unwrap();
        assert_eq!((s.running, s.waiting), (5.0, 0.0));
        assert_eq!(s.kv_usage, Some(0.25));
        assert_eq!(s.preemptions, Some(2.0));
    }

    /// A body without a running gauge (another server, garbage) gives nothing; bad numbers
    /// are dropped.
    #[test]
    fn anything_else_gives_nothing() {
        assert_eq!(parse("process_cpu_seconds_total 3\n"), None);
        assert_eq!(parse("not prometheus at all {{{"), None);
        let s = parse("vllm:num_requests_running NaN\nvllm:num_requests_running 4\nvllm:num_requests_waiting -3\n")
            .unwrap();
        assert_eq!((s.running, s.waiting), (4.0, 0.0));
    }
}
