//! Budgets, the cancel policy, slots across the dataset boundary, and routing around a dead
//! server.

use crate::process::edit_config;
use crate::support::*;
use std::path::Path;
use std::process::Command;

/// A mock slow enough that many requests are in flight at once (~125 tok/s each).
fn slow_mock() -> spool::mock::MockConfig {
    spool::mock::MockConfig {
        capacity_tps: 2.0,
        per_request_tps: 0.5,
        ..spool::mock::MockConfig::for_tests()
    }
}

/// With `budget_policy = "cancel"` a dataset never ends past its budget: the result that
/// would cross it is not committed and the requests still in flight are aborted; their
/// items go back to pending, and the tokens thrown away are reported. A later run with a
/// larger budget completes exactly those items, each once. (The abort of requests in flight
/// itself is pinned by the scheduler's unit test `cancel_aborts_the_work_in_flight`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_never_exceeds_the_budget_and_returns_items_to_pending() {
    let mock = Mock::start(slow_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("a.jsonl"), "a", 120);
    // Smaller than two completions: the one that crosses it must be refused.
    let budget = 120u64;
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "a",
            file: "a.jsonl",
            budget: Some(budget),
        }],
        "",
    );
    edit_config(
        &cfg,
        "shutdown_grace_s = 5",
        "shutdown_grace_s = 5\nbudget_policy = \"cancel\"",
    );
    let s = run_to_end(&cfg).await;
    let a = &s.report.datasets[0];
    assert!(
        a.completion_tokens <= budget,
        "cancel: {} > {budget}",
        a.completion_tokens
    );
    assert_eq!(a.overshoot_tokens, 0);
    assert!(
        a.wasted_tokens > 0,
        "the result crossing the budget was thrown away"
    );
    assert!(a.pending > 0 && a.pending + a.done == 120);
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_eq!(rows.len() as u64, a.done);
    assert_eq!(
        rows.iter()
            .map(|r| u64::from(r.completion_tokens))
            .sum::<u64>(),
        a.completion_tokens
    );

    // The cancelled items are pending, not lost: a larger budget completes everything once.
    edit_config(
        &cfg,
        &format!("token_budget = {budget}"),
        "token_budget = 1000000",
    );
    let again = run_to_end(&cfg).await;
    assert_eq!(again.report.datasets[0].done, 120);
    assert_exactly_once(
        &shard_rows(&dir.path().join("out"), "a"),
        &(0..120).map(|i| format!("a{i}")).collect::<Vec<_>>(),
    );
}

/// No slot idles at the dataset boundary: the second dataset's first completions arrive
/// while the first dataset's last requests are still in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_dataset_starts_while_the_previous_tail_is_in_flight() {
    let mock = Mock::start(slow_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("a.jsonl"), "a", 40);
    write_prompts(&dir.path().join("b.jsonl"), "b", 40);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[
            Ds {
                name: "a",
                file: "a.jsonl",
                budget: None,
            },
            Ds {
                name: "b",
                file: "b.jsonl",
                budget: None,
            },
        ],
        "",
    );
    run_to_end(&cfg).await;
    let out = dir.path().join("out");
    let a = shard_rows(&out, "a");
    let b = shard_rows(&out, "b");
    assert_eq!((a.len(), b.len()), (40, 40));
    let a_last = a.iter().map(|r| r.completed_at_ms).max().unwrap();
    let b_first = b.iter().map(|r| r.completed_at_ms).min().unwrap();
    assert!(
        b_first < a_last,
        "b started only after a's tail: first b {b_first} ≥ last a {a_last}"
    );
    // And datasets are still served in order: a's first completion precedes b's.
    assert!(a.iter().map(|r| r.completed_at_ms).min().unwrap() <= b_first);
}

/// With two `urls`, one of which refuses connections, every item is still generated exactly
/// once on the live server, and no attempt is burned on the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_routed_around() {
    let mock = Mock::start(fast_mock()).await;
    // A port that refuses connections: bound, then closed.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("a.jsonl"), "a", 60);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[Ds {
            name: "a",
            file: "a.jsonl",
            budget: None,
        }],
        "",
    );
    edit_config(
        &cfg,
        &format!("urls = [\"{}\"]", mock.url),
        &format!("urls = [\"{dead}\", \"{}\"]", mock.url),
    );
    let s = run_to_end(&cfg).await;
    assert_eq!(s.report.datasets[0].done, 60);
    assert_eq!(s.report.failed(), 0);
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_exactly_once(&rows, &(0..60).map(|i| format!("a{i}")).collect::<Vec<_>>());
    assert!(
        rows.iter().all(|r| r.attempts == 1),
        "a refused connection burns no attempt"
    );
    // One request per item.
    assert_eq!(mock.stats().requests, 60);
}

fn run_binary(cfg: &Path, naive: bool) -> u64 {
    let mut c = Command::new(spool_bin());
    c.args(["run", "-q", "-c"]).arg(cfg);
    if naive {
        c.env(spool::knobs::BENCH_NAIVE_BUDGET, "1");
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let st = Command::new(spool_bin())
        .args(["status", "--json", "-c"])
        .arg(cfg)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    v["datasets"][0]["overshoot_tokens"].as_u64().unwrap()
}

/// Counting the expected tokens of the work in flight stops dispatch early enough: the
/// overshoot past the budget is a fraction of what the naive policy ("dispatch until the
/// completed tokens reach the budget") produces on the same server and prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_stops_early_enough_unlike_the_naive_policy() {
    let mock = Mock::start(slow_mock()).await;
    let mut overshoot = Vec::new();
    for naive in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_prompts(&dir.path().join("a.jsonl"), "a", 300);
        let cfg = write_config(
            dir.path(),
            &mock.url,
            "sglang",
            true,
            &[Ds {
                name: "a",
                file: "a.jsonl",
                budget: Some(3000),
            }],
            "",
        );
        let cfgp = cfg.clone();
        overshoot.push(
            tokio::task::spawn_blocking(move || run_binary(&cfgp, naive))
                .await
                .unwrap(),
        );
    }
    let (spool, naive) = (overshoot[0], overshoot[1]);
    eprintln!("overshoot: spool {spool}, naive {naive}");
    assert!(
        naive > 200,
        "the naive policy overshoots by about a slot set: {naive}"
    );
    assert!(spool * 3 < naive, "spool {spool} vs naive {naive}");
}
