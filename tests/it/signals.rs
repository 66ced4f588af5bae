//! SIGINT/SIGTERM to the real binary mid-run: requests in flight drain within
//! `shutdown_grace_s`, the open shard is sealed, exit 130, and the next run resumes
//! exactly; a second signal exits at once and resume is still exact.

use crate::process::{assert_verify_clean, edit_config, mock_log, status_json, Proc};
use crate::support::*;
use spool::mock::{MockConfig, Outcome};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// 200 prompts at ~60 requests/s: several seconds of work to interrupt. One shard
/// holds everything (max_rows 1000), so any shard after the signal was sealed by it.
async fn setup(mock_cfg: MockConfig, grace_s: u32) -> (tempfile::TempDir, PathBuf, Mock, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..mock_cfg
    })
    .await;
    let cfg = streaming_dataset(dir.path(), &mock.url, 200);
    edit_config(&cfg, "max_rows = 25", "max_rows = 1000");
    edit_config(
        &cfg,
        "shutdown_grace_s = 5",
        &format!("shutdown_grace_s = {grace_s}"),
    );
    (dir, cfg, mock, log)
}

fn slow() -> MockConfig {
    MockConfig {
        capacity_tps: 3.0,
        per_request_tps: 2.0,
        ..MockConfig::for_tests()
    }
}

/// After an interrupted run: the shards hold exactly the done items (nothing waits in the
/// queue), nothing is in flight, verify is clean. Returns the rows' ids.
fn check_sealed(cfg: &Path, out: &Path) -> HashSet<String> {
    let j = status_json(cfg);
    let d = &j["datasets"][0];
    assert_eq!(d["done"], d["sharded"], "done items not in a shard: {d}");
    assert_eq!(d["inflight"], 0);
    assert!(d["pending"].as_u64().unwrap() > 0, "nothing left to resume");
    let rows = shard_rows(out, "a");
    assert_eq!(rows.len() as u64, d["done"].as_u64().unwrap());
    assert_verify_clean(cfg);
    rows.into_iter().map(|r| r.id).collect()
}

/// Runs to the end and checks every prompt is in exactly one row and nothing in a shard
/// before was requested again (mock log from `from`).
fn resume_exact(cfg: &Path, out: &Path, log: &Path, from: usize, before: &HashSet<String>) {
    let o = std::process::Command::new(spool_bin())
        .args(["run", "-q", "-c"])
        .arg(cfg)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_verify_clean(cfg);
    let ids: Vec<String> = (0..200).map(|i| format!("p{i}")).collect();
    assert_exactly_once(&shard_rows(out, "a"), &ids);
    for l in &mock_log(log)[from..] {
        assert!(
            !before.contains(&format!("p{}", l.row)),
            "p{} was in a shard but requested again",
            l.row
        );
    }
}

/// SIGINT mid-run: dispatch stops, the requests in flight finish (they are fast), the
/// open shard is sealed with every row done so far, exit 130 well within the grace; the
/// next run resumes exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_drains_seals_the_open_shard_and_exits_130() {
    let (dir, cfg, mock, log) = setup(slow(), 10).await;
    let out = dir.path().join("out");
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    tokio::time::timeout(
        Duration::from_secs(30),
        mock.state.wait_until(|s| s.count(Outcome::Ok) >= 30),
    )
    .await
    .expect("run under way");
    assert!(
        shard_files(&out, "a").is_empty(),
        "no shard before the signal"
    );
    let t0 = Instant::now();
    p.signal(libc::SIGINT);
    let (status, _) = p.wait(Duration::from_secs(30)).await;
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(130), "{}", p.stderr());
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}, grace is 10 s"
    );
    assert!(p.stderr().contains("shutdown requested"), "{}", p.stderr());
    // The last line says what is done, what is left, and the command that goes on.
    let last = p.stderr();
    let last = last.lines().last().unwrap_or("");
    assert!(
        last.starts_with("spool: stopped: ") && last.contains(" of 200 items done"),
        "{last}"
    );
    assert!(
        last.contains("left;")
            && last.contains(&format!(
                "Resume with: {} run -c {}",
                spool_bin().display(),
                cfg.display()
            )),
        "{last}"
    );
    // In flight at the signal finished rather than being cut: no request was abandoned.
    tokio::time::timeout(
        Duration::from_secs(10),
        mock.state.wait_until(|s| s.in_flight == 0),
    )
    .await
    .unwrap();
    let first = mock_log(&log);
    assert!(
        first.iter().all(|l| l.outcome == "ok"),
        "a request in flight was cut rather than drained"
    );
    assert_eq!(shard_files(&out, "a").len(), 1, "the open shard was sealed");
    let before = check_sealed(&cfg, &out);
    // Every answer the mock gave is in the shard (nothing answered was dropped).
    assert_eq!(before.len(), first.len());
    let from = mock_log(&log).len();
    resume_exact(&cfg, &out, &log, from, &before);
}

/// SIGTERM while requests hang: spool waits the grace (2 s), then aborts them (their
/// items stay pending), seals and exits 130 shortly after the grace; resume is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_hanging_requests_exits_130_after_the_grace() {
    let (dir, cfg, mock, log) = setup(
        MockConfig {
            hang: 0.3,
            seed: 3,
            ..slow()
        },
        2,
    )
    .await;
    edit_config(&cfg, "request_timeout_s = 20", "request_timeout_s = 600");
    let out = dir.path().join("out");
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    tokio::time::timeout(
        Duration::from_secs(30),
        mock.state
            .wait_until(|s| s.count(Outcome::Ok) >= 20 && s.in_flight > s.active as u64),
    )
    .await
    .expect("some requests hanging");
    let t0 = Instant::now();
    p.signal(libc::SIGTERM);
    let (status, _) = p.wait(Duration::from_secs(30)).await;
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(130), "{}", p.stderr());
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "exit {took:?} after SIGTERM; grace is 2 s"
    );
    assert!(
        p.stderr().contains("after the grace period"),
        "{}",
        p.stderr()
    );
    let before = check_sealed(&cfg, &out);
    // The rest of the run without hangs.
    let clean = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    edit_config(&cfg, &mock.url, &clean.url);
    tokio::time::timeout(
        Duration::from_secs(10),
        mock.state.wait_until(|s| s.in_flight == 0),
    )
    .await
    .unwrap();
    let from = mock_log(&log).len();
    resume_exact(&cfg, &out, &log, from, &before);
}

/// A second signal exits at once — here while the shutdown is sealing the shard (the
/// writer pauses inside finalisation) — with 130; the next run recovers (drops the
/// temporary file or adopts the renamed shard) and resumes exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once_and_resume_is_exact() {
    let (dir, cfg, mock, log) = setup(slow(), 30).await;
    let out = dir.path().join("out");
    let mut p = Proc::spawn(&cfg, &["run"], &[("SPOOL_FAULT_SHARD_PAUSE_MS", "20000")]);
    tokio::time::timeout(
        Duration::from_secs(30),
        mock.state.wait_until(|s| s.count(Outcome::Ok) >= 30),
    )
    .await
    .expect("run under way");
    p.signal(libc::SIGINT);
    // The shard writer announces its pause inside finalisation.
    p.wait_for("pausing shard finalisation", 1, Duration::from_secs(30))
        .await;
    let t0 = Instant::now();
    p.signal(libc::SIGTERM);
    let (status, _) = p.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(130), "{}", p.stderr());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(p.stderr().contains("second signal"), "{}", p.stderr());
    tokio::time::timeout(
        Duration::from_secs(10),
        mock.state.wait_until(|s| s.in_flight == 0),
    )
    .await
    .unwrap();
    // Killed before the shard was renamed: no part file, the rows wait in the queue.
    let before: HashSet<String> = shard_rows(&out, "a").into_iter().map(|r| r.id).collect();
    let from = mock_log(&log).len();
    resume_exact(&cfg, &out, &log, from, &before);
    // Nothing the mock answered in full before was generated again.
    let first: HashSet<u64> = mock_log(&log)[..from]
        .iter()
        .filter(|l| l.outcome == "ok")
        .map(|l| l.row)
        .collect();
    for l in &mock_log(&log)[from..] {
        assert!(!first.contains(&l.row), "p{} generated twice", l.row);
    }
}

/// A signal during intake (two datasets of 100 000 prompts; the signal lands while the
/// first is being enqueued) is a clean stop too: exit 130, no request sent, the second
/// dataset not started; the next run finishes the intake with every row enqueued exactly
/// once (the counts are exact) and runs (tiny budgets keep it short).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_intake_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    let n = 100_000;
    write_prompts(&dir.path().join("a.jsonl"), "a", n);
    write_prompts(&dir.path().join("b.jsonl"), "b", n);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[
            Ds {
                name: "a",
                file: "a.jsonl",
                budget: Some(100),
            },
            Ds {
                name: "b",
                file: "b.jsonl",
                budget: Some(100),
            },
        ],
        "",
    );
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    // Logged just before intake starts.
    p.wait_for("server context length", 1, Duration::from_secs(30))
        .await;
    p.signal(libc::SIGINT);
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("shutdown requested"), "{stderr}");
    assert!(
        !stderr.contains("b: "),
        "the second dataset was enqueued after the signal: {stderr}"
    );
    assert!(mock_log(&log).is_empty(), "requests sent after the signal");
    let o = std::process::Command::new(spool_bin())
        .args(["run", "-q", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let j = status_json(&cfg);
    for d in j["datasets"].as_array().unwrap() {
        assert_eq!(d["items"].as_u64(), Some(n as u64), "{d}");
        assert_eq!(d["state"], "budget_met", "{d}");
    }
    assert_verify_clean(&cfg);
}

/// Regression: a worker waiting out a retry backoff (here a 429's `Retry-After: 60`)
/// kept its lease through the shutdown grace and then retried, so a signal took the
/// whole grace (30 s) to act. Nothing is in flight during a backoff: the lease is given
/// back at once and the run exits 130 promptly; resume is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_does_not_wait_for_retry_backoffs() {
    let (dir, cfg, mock, log) = setup(
        MockConfig {
            fail_429: 0.5,
            retry_after_s: 60,
            seed: 4,
            ..slow()
        },
        30,
    )
    .await;
    let out = dir.path().join("out");
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    tokio::time::timeout(
        Duration::from_secs(30),
        mock.state
            .wait_until(|s| s.count(Outcome::Ok) >= 3 && s.count(Outcome::Http429) >= 12),
    )
    .await
    .unwrap_or_else(|_| panic!("workers in backoff: {:?}\n{}", mock.stats(), p.stderr()));
    let t0 = Instant::now();
    p.signal(libc::SIGINT);
    let (status, _) = p.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(130), "{}", p.stderr());
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "exit took {:?} (grace 30 s, Retry-After 60 s)",
        t0.elapsed()
    );
    let before = check_sealed(&cfg, &out);
    let clean = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    edit_config(&cfg, &mock.url, &clean.url);
    let from = mock_log(&log).len();
    resume_exact(&cfg, &out, &log, from, &before);
}
