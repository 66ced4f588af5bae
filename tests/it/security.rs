//! Security: the metrics endpoint is loopback unless told otherwise; the API key never
//! leaves the request header (logs at trace level, status, verify, shards, the queue,
//! stored error messages — even when a server echoes it back); a run writes nothing
//! outside `data_dir` and `output_dir`.

use crate::faults::{HandServer, Reply};
use crate::process::{edit_config, spool, Proc};
use crate::support::*;
use spool::mock::MockConfig;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `run.metrics_addr` left out of the config means a loopback address.
#[test]
fn the_metrics_endpoint_binds_loopback_by_default() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
    let cfg = write_config(
        dir.path(),
        "http://127.0.0.1:9",
        "completions",
        false,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    edit_config(&cfg, "metrics_addr = \"\"\n", "");
    let c = load(&cfg);
    let addr: std::net::SocketAddr = c.run.metrics_addr.parse().unwrap();
    assert!(addr.ip().is_loopback(), "default metrics_addr {addr}");
}

/// Every file under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(bytes) = std::fs::read(&p) {
                if bytes.windows(needle.len()).any(|w| w == needle) {
                    hits.push(p);
                }
            }
        }
    }
    hits
}

fn key() -> String {
    format!("sk-spool-test-{:016x}", rand::random::<u64>())
}

/// Checks the key is nowhere: the run's stderr, `status` (table and JSON), `verify`, and
/// every byte of every file spool wrote (queue, shards, rejections).
fn assert_no_key(key: &str, dir: &Path, cfg: &Path, run_stderr: &str) {
    assert!(!run_stderr.contains(key), "key in the log");
    for args in [&["status"][..], &["status", "--json"], &["verify"]] {
        let o = spool(cfg, args, &[]);
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!all.contains(key), "key in `spool {args:?}`: {all}");
    }
    let hits = files_containing(dir, key.as_bytes());
    assert!(hits.is_empty(), "key written to {hits:?}");
}

/// Against a faulty mock (500s, 429s, cut streams, garbled events), logging at trace
/// level for every crate (`RUST_LOG=trace`): the key appears nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_never_appears_in_logs_status_or_files() {
    let key = key();
    let mock = Mock::start(MockConfig {
        fail_500: 0.1,
        fail_429: 0.1,
        retry_after_s: 0,
        drop_mid_stream: 0.1,
        malformed: 0.05,
        seed: 9,
        ..fast_mock()
    })
    .await;
    for env in [&[][..], &[("RUST_LOG", "trace")][..]] {
        let dir = tempfile::tempdir().unwrap();
        write_prompts(&dir.path().join("p.jsonl"), "p", 30);
        let mut rows = std::fs::read_to_string(dir.path().join("p.jsonl")).unwrap();
        rows.push_str("{not json\n");
        std::fs::write(dir.path().join("p.jsonl"), rows).unwrap();
        let cfg = keyed_config(dir.path(), &mock.url, "sglang", true, 12);
        let mut env = env.to_vec();
        env.push(("SPOOL_TEST_API_KEY", &key));
        let mut p = Proc::spawn(&cfg, &["run", "-vv"], &env);
        let (status, _) = p.wait(Duration::from_secs(120)).await;
        assert_eq!(status.code(), Some(0), "{}", p.stderr());
        let level = if env.len() > 1 { "TRACE" } else { "DEBUG" };
        assert!(p.count(level) > 10, "logging at {level} level");
        assert_no_key(&key, dir.path(), &cfg, &p.stderr());
    }
}

/// A server that rejects the key and echoes the `Authorization` header in its 401 body:
/// the key was sent (the server saw it) but the stored reason shows `***` in its place,
/// and the key is in no log line, status output or file — streaming (reqwest) and whole
/// responses (`upstream::h1`) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_echoing_the_key_in_an_error_does_not_leak_it() {
    for stream in [true, false] {
        let key = key();
        let server = HandServer::start(Reply::EchoAuth).await;
        let dir = tempfile::tempdir().unwrap();
        write_prompts(&dir.path().join("p.jsonl"), "p", 3);
        let cfg = keyed_config(dir.path(), &server.url, "chat", stream, 4);
        let mut p = Proc::spawn(&cfg, &["run", "-vv"], &[("SPOOL_TEST_API_KEY", &key)]);
        let (status, _) = p.wait(Duration::from_secs(60)).await;
        assert_eq!(status.code(), Some(3), "{}", p.stderr());
        assert!(
            server
                .auth
                .lock()
                .unwrap()
                .iter()
                .any(|a| a == &format!("Bearer {key}")),
            "the key was sent"
        );
        let st = String::from_utf8_lossy(&spool(&cfg, &["status"], &[]).stdout).into_owned();
        assert!(st.contains("HTTP 401") && st.contains("Bearer ***"), "{st}");
        assert_no_key(&key, dir.path(), &cfg, &p.stderr());
    }
}

/// A one-dataset config (`p.jsonl`) whose API key comes from `SPOOL_TEST_API_KEY`.
fn keyed_config(
    dir: &Path,
    url: &str,
    api: &str,
    stream: bool,
    max_attempts: u32,
) -> std::path::PathBuf {
    let cfg = write_config(
        dir,
        url,
        api,
        stream,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    edit_config(
        &cfg,
        "max_attempts = 4",
        &format!("max_attempts = {max_attempts}\napi_key_env = \"SPOOL_TEST_API_KEY\""),
    );
    cfg
}

/// Every path under `dir`, with its length and modification time.
fn snapshot(dir: &Path) -> Vec<(String, u64, std::time::SystemTime)> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            let m = std::fs::metadata(&p).unwrap();
            v.push((
                p.strip_prefix(dir).unwrap().display().to_string(),
                if m.is_dir() { 0 } else { m.len() },
                m.modified().unwrap(),
            ));
            if m.is_dir() {
                stack.push(p);
            }
        }
    }
    v.sort();
    v
}

/// A run with inputs outside the config's folder, dotted dataset names, rejected rows,
/// several shards and a budget writes only under `data_dir` and `output_dir`: every
/// other path is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_writes_nothing_outside_data_dir_and_output_dir() {
    let mock = Mock::start(fast_mock()).await;
    let root = tempfile::tempdir().unwrap();
    let conf = root.path().join("conf");
    let inputs = root.path().join("inputs");
    std::fs::create_dir_all(&conf).unwrap();
    std::fs::create_dir_all(&inputs).unwrap();
    write_prompts(&inputs.join("a.jsonl"), "a", 60);
    write_prompts(&inputs.join("b.jsonl"), "b", 30);
    let mut b = std::fs::read_to_string(inputs.join("b.jsonl")).unwrap();
    b.push_str("{\"prompt\": 1}\n");
    std::fs::write(inputs.join("b.jsonl"), b).unwrap();
    let cfg = write_config(
        &conf,
        &mock.url,
        "completions",
        true,
        &[
            Ds {
                name: "v1.2-chat..x",
                file: "../inputs/a.jsonl",
                budget: None,
            },
            Ds {
                name: "_b",
                file: "../inputs/b.jsonl",
                budget: Some(500),
            },
        ],
        "",
    );
    let before = snapshot(root.path());
    let o = spool(&cfg, &["run", "-q"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let after = snapshot(root.path());
    let inside = |p: &str| p.starts_with("conf/data") || p.starts_with("conf/out");
    for entry in &after {
        if inside(&entry.0) || entry.0 == "conf" {
            continue;
        }
        assert!(before.contains(entry), "written outside: {entry:?}");
    }
    assert_eq!(
        before
            .iter()
            .filter(|e| !inside(&e.0) && e.0 != "conf")
            .count(),
        after
            .iter()
            .filter(|e| !inside(&e.0) && e.0 != "conf")
            .count(),
    );
    assert!(!shard_files(&conf.join("out"), "v1.2-chat..x").is_empty());
}
