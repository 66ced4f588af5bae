//! `concurrency = "auto"` and prefix routing against the mock's KV-cache model: outcomes
//! (rows, preemptions, limits, cache hits), never wall-clock speed.

use crate::support::*;
use spool::mock::{MetricNames, MockConfig};
use spool::observe::status::StatusReport;
use std::path::Path;
use std::time::Duration;

/// A KV-bound server: about 20 requests of this workload fit its cache; past that the
/// newest are preempted and recomputed.
fn kv_mock() -> MockConfig {
    MockConfig {
        time_scale: 20.0,
        mean_tokens: 200.0,
        sigma: 0.5,
        capacity_tps: 3000.0,
        per_request_tps: 60.0,
        kv_tokens: 5000,
        prefill_tps: 2000.0,
        ..MockConfig::for_tests()
    }
}

fn config(dir: &Path, urls: &[&str], run: &str, n: usize, extra: &str) -> std::path::PathBuf {
    write_prompts(&dir.join("p.jsonl"), "p", n);
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    let text = format!(
        r#"data_dir = "data"
output_dir = "out"
[server]
api = "completions"
urls = [{}]
stream = true
request_timeout_s = 120
self_check = false
{extra}
[run]
{run}
metrics_addr = "127.0.0.1:0"
progress_every = 100000
[sampling]
max_tokens = 1000
[[dataset]]
name = "d"
path = "p.jsonl"
"#,
        urls.join(", ")
    );
    let p = dir.join("spool.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The live `/status` of the run whose `data_dir` is `data`, once it serves one.
async fn live_status(data: &Path) -> Option<StatusReport> {
    let addr = std::fs::read_to_string(data.join("metrics.addr")).ok()?;
    spool::observe::status::fetch(&format!("http://{}", addr.trim()), Duration::from_secs(2))
        .await
        .ok()
}

/// Starts the run of `cfg` in the background (it runs until aborted): its task and its
/// `data_dir`, where [`until`] reads its `/status`.
fn start(
    cfg: &Path,
) -> (
    tokio::task::JoinHandle<Result<spool::run::job::RunSummary, spool::error::Error>>,
    std::path::PathBuf,
) {
    init_logs();
    let run = tokio::spawn(spool::run::job::run(
        load(cfg).into(),
        spool::knobs::Knobs::default(),
        std::future::pending(),
    ));
    (run, cfg.with_file_name("data"))
}

/// Polls the run's `/status` until `pred` holds (a run reports once a second), at most
/// `limit`; returns the report that satisfied it.
async fn until(
    data: &Path,
    limit: Duration,
    mut pred: impl FnMut(&StatusReport) -> bool,
) -> StatusReport {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(r) = live_status(data).await {
            if pred(&r) {
                return r;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met within {limit:?}; last status: {:?}",
            live_status(data).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("p{i}")).collect()
}

/// On a KV-bound server, `"auto"` finds a limit near what the cache holds and preempts far
/// less than a fixed concurrency past the knee (96, five times what fits), with every row
/// written once either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_preempts_less_than_a_fixed_setting_past_the_knee() {
    let mut preemptions = Vec::new();
    for run in [
        "concurrency = 96",
        "concurrency = \"auto\"\nmax_concurrency = 256",
    ] {
        let mock = Mock::start(kv_mock()).await;
        let dir = tempfile::tempdir().unwrap();
        let n = 600;
        let cfg = config(dir.path(), &[&mock.url], run, n, "");
        run_to_end(&cfg).await;
        assert_exactly_once(&shard_rows(&dir.path().join("out"), "d"), &ids(n));
        let (stats, _) = mock.state.kv().unwrap();
        eprintln!(
            "{run:?}: {} preemptions, hit rate {:.2}",
            stats.preemptions,
            stats.hit_rate()
        );
        preemptions.push(stats.preemptions);
    }
    let (fixed, auto) = (preemptions[0], preemptions[1]);
    assert!(fixed > 50, "the fixed setting thrashes: {fixed}");
    assert!(auto * 3 < fixed, "auto {auto} vs fixed {fixed}");
}

/// A server whose KV cache shrinks mid-run (a neighbour takes memory) gets a lower limit
/// than its twin; when the memory comes back its limit rises again; no limit is ever 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_slowing_mid_run_gets_a_lower_limit_and_recovers() {
    let slow = Mock::start(MockConfig {
        metrics_names: MetricNames::Vllm,
        ..kv_mock()
    })
    .await;
    let twin = Mock::start(MockConfig {
        metrics_names: MetricNames::Sglang,
        ..kv_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000;
    let cfg = config(
        dir.path(),
        &[&slow.url, &twin.url],
        "concurrency = \"auto\"\nmax_concurrency = 256",
        n,
        "",
    );
    let (run, data) = start(&cfg);
    let limits =
        |r: &StatusReport| -> Vec<u64> { r.servers.iter().map(|s| s.limit.unwrap_or(0)).collect() };
    let settled = until(&data, Duration::from_secs(90), |r| {
        r.servers.len() == 2 && r.datasets[0].done > 300
    })
    .await;
    eprintln!("settled: {:?}", limits(&settled));
    slow.state.set_kv(None, Some(1500));
    let cut = until(&data, Duration::from_secs(90), |r| {
        let l = limits(r);
        l.len() == 2 && l.iter().all(|&x| x >= 1) && (l[0] as f64) < 0.6 * l[1] as f64
    })
    .await;
    eprintln!("after the cut: {:?}", limits(&cut));
    slow.state.set_kv(None, Some(5000));
    let back = until(&data, Duration::from_secs(120), |r| {
        let l = limits(r);
        l.len() == 2 && l[0] as f64 >= 0.75 * l[1] as f64
    })
    .await;
    eprintln!("recovered: {:?}", limits(&back));
    run.abort();
}

/// A server that dies mid-run leaves rotation; its requests finish on the other, which
/// stays within its own limit, and every row is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_dying_mid_run_loses_nothing() {
    let dying = Mock::start(kv_mock()).await;
    let other = Mock::start(kv_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let n = 800;
    let cfg = config(
        dir.path(),
        &[&dying.url, &other.url],
        "concurrency = \"auto\"\nmax_concurrency = 256",
        n,
        "max_attempts = 20",
    );
    let (run, data) = start(&cfg);
    until(&data, Duration::from_secs(90), |r| r.datasets[0].done > 150).await;
    dying.stop().await;
    let down = until(&data, Duration::from_secs(60), |r| {
        r.servers.first().is_some_and(|s| !s.up)
    })
    .await;
    let live = &down.servers[1];
    assert!(live.up && live.limit.is_some_and(|l| l >= 1), "{down:?}");
    run.await.unwrap().unwrap();
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "d"), &ids(n));
}

/// Prompts sharing long prefixes, with 4 samples each, across 4 servers: prefix routing
/// keeps the prefix-cache hit rate at ≥ 90 % of what one server reaches, where
/// least-requests and round-robin routing spread each prefix over every server; no
/// server is left with much less than its share of the work, and the servers stay about
/// as busy as under least-requests routing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routing_keeps_the_cache_hits_of_one_server() {
    let cache_mock = || MockConfig {
        time_scale: 50.0,
        mean_tokens: 40.0,
        sigma: 0.3,
        kv_tokens: 400_000,
        prefill_tps: 20_000.0,
        capacity_tps: 2000.0,
        ..MockConfig::for_tests()
    };
    // 32 shared blocks (a few-shot block of 200 words) of 10 prompts each, each prompt with
    // a question of its own (100 words), in a shuffled order, 4 samples each.
    let write = |dir: &Path| {
        let mut rows = Vec::new();
        for g in 0..32 {
            let block: Vec<String> = (0..200).map(|w| format!("g{g}w{w}")).collect();
            let block = block.join(" ");
            for k in 0..10 {
                let own: Vec<String> = (0..100).map(|w| format!("g{g}k{k}q{w}")).collect();
                rows.push(format!(
                    "{{\"id\": \"g{g}k{k}\", \"prompt\": \"{block} {}\"}}\n",
                    own.join(" ")
                ));
            }
        }
        // A fixed shuffle: datasets mix their tasks.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| (i * 7919) % rows.len());
        let s: String = order.iter().map(|&i| rows[i].as_str()).collect();
        std::fs::write(dir.join("p.jsonl"), s).unwrap();
    };
    let mut results = Vec::new();
    for (servers, routing) in [
        (1, "prefix"),
        (4, "prefix"),
        (4, "least_requests"),
        (4, "round_robin"),
    ] {
        let mut mocks = Vec::new();
        for _ in 0..servers {
            mocks.push(Mock::start(cache_mock()).await);
        }
        let urls: Vec<&str> = mocks.iter().map(|m| m.url.as_str()).collect();
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(
            dir.path(),
            &urls,
            "concurrency = 32",
            0,
            &format!("routing = \"{routing}\""),
        );
        write(dir.path());
        let text = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("path = \"p.jsonl\"\n", "path = \"p.jsonl\"\nsamples = 4\n");
        std::fs::write(&cfg, text).unwrap();
        let began = std::time::Instant::now();
        run_to_end(&cfg).await;
        let wall = began.elapsed().as_secs_f64();
        let rows = shard_rows(&dir.path().join("out"), "d");
        assert_eq!(rows.len(), 320 * 4, "every sample of every prompt");
        let (mut prompt, mut cached, mut busy) = (0u64, 0u64, 0.0f64);
        let mut served = Vec::new();
        for m in &mocks {
            let (s, _) = m.state.kv().unwrap();
            prompt += s.prompt_tokens;
            cached += s.cached_tokens;
            busy += s.busy_s;
            served.push(m.stats().requests);
        }
        let hit = cached as f64 / prompt as f64;
        // Utilisation: the share of the run the servers spent executing steps (simulated
        // seconds ÷ the run's wall time at the time scale), averaged over the servers.
        let utilisation = busy / (wall * cache_mock().time_scale * servers as f64);
        eprintln!(
            "{servers} server(s), {routing}: hit rate {hit:.3}, utilisation {utilisation:.3}, \
             {wall:.1} s, requests per server {served:?}"
        );
        results.push((hit, served, utilisation));
    }
    let one = results[0].0;
    let (prefix, ref served, used) = results[1];
    // Loose (a debug build on a shared machine; the figure is in BENCHMARKS): prefix
    // routing keeps the servers about as busy as least-requests routing does.
    assert!(
        used >= 0.85 * results[2].2,
        "utilisation {used:.3} vs {results:?}"
    );
    assert!(
        prefix >= 0.9 * one,
        "prefix routing {prefix:.3} vs one server {one:.3}"
    );
    assert!(
        results[2].0 < prefix && results[3].0 < prefix,
        "{results:?}"
    );
    let (lo, hi) = (served.iter().min().unwrap(), served.iter().max().unwrap());
    assert!(*lo * 2 >= *hi, "each server keeps a fair share: {served:?}");
}

/// Two servers, one stopped mid-run (out of rotation at once): the ETA re-estimates from
/// the capacity left within seconds. Loose bound (the benchmark has the targets): the
/// median error from 5 s after the loss to the last 5 s is under 35 %; an ETA still
/// counting the lost server's capacity would be about half the time left (50 % off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eta_follows_a_server_loss() {
    let fluid = || MockConfig {
        time_scale: 20.0,
        mean_tokens: 300.0,
        sigma: 1.0,
        capacity_tps: 850.0,
        per_request_tps: 60.0,
        ..MockConfig::for_tests()
    };
    let dying = Mock::start(fluid()).await;
    let other = Mock::start(fluid()).await;
    let dir = tempfile::tempdir().unwrap();
    let n = 5000;
    let cfg = config(
        dir.path(),
        &[&dying.url, &other.url],
        "concurrency = 150",
        n,
        "max_attempts = 50",
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_tokens = 1000", "max_tokens = 4000");
    std::fs::write(&cfg, text).unwrap();
    let (run, data) = start(&cfg);
    until(&data, Duration::from_secs(120), |r| {
        r.datasets[0].done > 2500
    })
    .await;
    let mut samples = Vec::new();
    for _ in 0..20 {
        if let Some(r) = live_status(&data).await {
            if let Some(eta) = r.datasets[0].eta_s {
                samples.push((tokio::time::Instant::now(), eta));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    dying.stop().await;
    let lost = tokio::time::Instant::now();
    while !run.is_finished() {
        if let Some(r) = live_status(&data).await {
            if let Some(eta) = r.datasets[0].eta_s {
                samples.push((tokio::time::Instant::now(), eta));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let end = tokio::time::Instant::now();
    for (t, eta) in &samples {
        eprintln!(
            "t-loss {:6.1} eta {:6.1} actual {:6.1}",
            t.saturating_duration_since(lost).as_secs_f64()
                - lost.saturating_duration_since(*t).as_secs_f64(),
            eta,
            end.duration_since(*t).as_secs_f64()
        );
    }
    run.await.unwrap().unwrap();
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "d"), &ids(n));
    let mut errors: Vec<f64> = samples
        .iter()
        .filter(|(t, _)| *t >= lost + Duration::from_secs(5) && *t + Duration::from_secs(5) <= end)
        .map(|(t, eta)| {
            let actual = end.duration_since(*t).as_secs_f64();
            (eta - actual).abs() / actual
        })
        .collect();
    assert!(
        errors.len() >= 5,
        "too few ETA samples after the loss: {}",
        errors.len()
    );
    errors.sort_by(f64::total_cmp);
    let median = errors[errors.len() / 2];
    eprintln!(
        "ETA after the loss: {} samples over {:.0} s, median error {:.1} %",
        errors.len(),
        (end - lost).as_secs_f64(),
        100.0 * median
    );
    assert!(median < 0.35, "median ETA error {:.1} %", 100.0 * median);
}
