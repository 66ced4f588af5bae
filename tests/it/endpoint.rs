//! The metrics endpoint cannot be turned against the run, and `spool status` cannot be
//! lied to: idle sockets cannot starve the run of file descriptors; a port held by another
//! process stops `run` before any server is asked; `status -c` trusts only the endpoint
//! that proves it holds the run's token; `status --url` reads a bounded body from the same
//! origin within a timeout; text from outside (servers' messages, remote reports) is
//! printed with its control characters escaped.

use crate::faults::{HandServer, Reply};
use crate::process::{edit_config, spool, Proc};
use crate::support::*;
use spool::mock::MockConfig;
use spool::observe::status::{DatasetPhase, DatasetStatus, StatusReport};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `n` prompts in dataset `a` against `url`; the endpoint off until a test turns it on.
fn one_dataset(dir: &Path, url: &str, stream: bool, n: usize) -> std::path::PathBuf {
    write_prompts(&dir.join("p.jsonl"), "p", n);
    write_config(
        dir,
        url,
        "completions",
        stream,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    )
}

/// Raises this process's soft open-files limit to its hard one (the flood below needs
/// more sockets than the usual 1024).
fn raise_own_nofile() {
    spool::run::descriptors::raise_soft_limit();
}

/// `spool run -c cfg` with its open-files limit set to `n` (soft and hard) before exec.
fn run_with_nofile(cfg: &Path, n: u64) -> Proc {
    let mut c = Command::new("prlimit");
    c.arg(format!("--nofile={n}:{n}"))
        .arg(spool_bin())
        .args(["run", "-c"])
        .arg(cfg);
    Proc::from_command(c)
}

/// Waits for `data_dir/metrics.addr` (written once the endpoint is bound).
async fn endpoint_addr(data: &Path, p: &Proc) -> String {
    let f = data.join(spool::run::job::ENDPOINT_FILE);
    for _ in 0..1500 {
        if let Ok(a) = std::fs::read_to_string(&f) {
            if !a.is_empty() {
                return a.trim().to_string();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no {} after 15 s; stderr:\n{}", f.display(), p.stderr());
}

/// A run limited to 200 open files, while a client connects to its metrics endpoint as
/// often as it can (up to 600 sockets, never sending a byte, held until the run ends),
/// completes:
/// exit 0, every item in a shard, `verify` clean. The endpoint holds only its share of
/// descriptors; the rest of the clients wait in the kernel's backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_starve_the_run_of_file_descriptors() {
    raise_own_nofile();
    let mock = Mock::start(MockConfig {
        time_scale: 1.0,
        capacity_tps: 5000.0,
        per_request_tps: 500.0,
        ..MockConfig::for_tests()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset(dir.path(), &mock.url, true, 300);
    edit_config(
        &cfg,
        "metrics_addr = \"\"",
        "metrics_addr = \"127.0.0.1:0\"",
    );
    let mut p = run_with_nofile(&cfg, 200);
    let addr = endpoint_addr(&dir.path().join("data"), &p).await;
    // Until a connect does not complete: the endpoint stopped accepting and the kernel's
    // backlog is full (before the fix, every one of the 600 was accepted).
    let mut held = Vec::new();
    for _ in 0..600 {
        match tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(&addr),
        )
        .await
        {
            Ok(Ok(s)) => held.push(s),
            _ => break,
        }
    }
    assert!(held.len() >= 100, "only {} connections opened", held.len());
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("Too many open files"), "{stderr}");
    drop(held);
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_eq!(rows.len(), 300, "every item in a shard");
    crate::process::assert_verify_clean(&cfg);
}

/// A listener standing in for the inference server: it records whether anything
/// connected (the start-up probe, a self-check, a request).
fn witness() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    (l, url)
}

/// `run` whose metrics port is held by another process fails at once (exit 2), before it
/// asks any server anything or enqueues a row, and says how to pick a free port (`:0`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_use_stops_the_run_before_any_server_is_asked() {
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = squatter.local_addr().unwrap().to_string();
    let (server, url) = witness();
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset(dir.path(), &url, false, 5);
    edit_config(
        &cfg,
        "metrics_addr = \"\"",
        &format!("metrics_addr = \"{taken}\""),
    );
    edit_config(&cfg, "self_check = false", "self_check = true");
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&taken), "{stderr}");
    assert!(
        stderr.contains("127.0.0.1:0"),
        "says how to pick a free port: {stderr}"
    );
    assert!(
        matches!(server.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the server was contacted: {stderr}"
    );
    let st = crate::process::status_json(&cfg);
    assert_eq!(st["datasets"][0]["items"], 0, "nothing enqueued: {st}");
}

/// A forged report: a run that looks live and nearly done.
fn forged_report() -> StatusReport {
    StatusReport {
        running: true,
        servers: Vec::new(),
        datasets: vec![DatasetStatus {
            name: "a".into(),
            items: 999,
            done: 998,
            state: DatasetPhase::Running,
            ..Default::default()
        }],
    }
}

/// Serves `body` (with `head` lines) to every request on `listener`, counting requests.
fn serve_raw(
    listener: tokio::net::TcpListener,
    head: String,
    body: Vec<u8>,
) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (head, body) = (head.clone(), body.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\n{head}content-length: {}\r\nconnection: close\r\n\r\n",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    hits
}

/// A finished run's queue; then another process takes the metrics port and answers a
/// forged live report (the run's address and a token file left as a crashed run leaves
/// them). `spool status` asks it, finds it cannot prove it holds the token, warns, and
/// reports from the queue: not running, the real counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_does_not_trust_a_squatter_on_the_metrics_port() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset(dir.path(), &mock.url, false, 10);
    let out = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let hits = serve_raw(
        listener,
        "content-type: application/json\r\n".into(),
        serde_json::to_vec(&forged_report()).unwrap(),
    );
    let data = dir.path().join("data");
    std::fs::write(data.join(spool::run::job::ENDPOINT_FILE), &addr).unwrap();
    std::fs::write(data.join(spool::run::job::TOKEN_FILE), "0123456789abcdef").unwrap();
    edit_config(
        &cfg,
        "metrics_addr = \"\"",
        &format!("metrics_addr = \"{addr}\""),
    );
    let out = spool(&cfg, &["status", "--json"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        hits.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "not asked"
    );
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["running"], false, "{st}");
    assert_eq!(st["datasets"][0]["items"], 10, "{st}");
    assert_eq!(st["datasets"][0]["done"], 10, "{st}");
    assert!(stderr.contains("cannot prove"), "{stderr}");
}

/// `status -c` shows the report of an endpoint that proves it holds the token in
/// `data_dir` (a live run's), failure reasons included; `status --url` of the same
/// endpoint gets the counts and lines but not the servers' messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_trusts_the_endpoint_that_proves_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset(dir.path(), "http://127.0.0.1:9", false, 3);
    std::fs::create_dir_all(dir.path().join("data")).unwrap();
    let data = dir.path().join("data");
    let token = "feedc0de";
    std::fs::write(data.join(spool::run::job::TOKEN_FILE), token).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::fs::write(data.join(spool::run::job::ENDPOINT_FILE), &addr).unwrap();
    let observed = std::sync::Arc::new(spool::observe::http::Observed {
        metrics: std::sync::Arc::new(spool::observe::metrics::Metrics::for_partition(None)),
        ready: std::sync::atomic::AtomicBool::new(true),
        status: Box::new(|| StatusReport {
            running: true,
            servers: Vec::new(),
            datasets: vec![DatasetStatus {
                name: "a".into(),
                items: 3,
                failed: 3,
                failures: vec![(1, "HTTP 400: prompt rejected by policy 7".into())],
                state: DatasetPhase::FailedItems,
                ..Default::default()
            }],
        }),
        token: Some(token.into()),
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(spool::observe::http::serve(
        listener,
        observed,
        async move { s.cancelled().await },
        Default::default(),
    ));
    let out = spool(&cfg, &["status"], &[]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.starts_with("live from the running process"),
        "{table}"
    );
    assert!(table.contains("prompt rejected by policy 7"), "{table}");
    let out = spool(&cfg, &["status", "--url", &format!("http://{addr}")], &[]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("failed at line 1"), "{table}");
    assert!(
        !table.contains("policy 7"),
        "reasons only with the token: {table}"
    );
    stop.cancel();
}

/// `spool status --url` against a server streaming an endless chunked body fails with a
/// message naming the size limit, within its timeout and in little memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_url_caps_the_body() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("{:x}\r\n{}\r\n", 1 << 16, "[".repeat(1 << 16));
                while s.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    let mut c = Command::new(spool_bin());
    c.args(["status", "--url", &format!("http://{addr}")]);
    let started = std::time::Instant::now();
    let mut p = Proc::from_command(c);
    let (status, peak) = p.wait(Duration::from_secs(30)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("larger than 4 MiB"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10), "{stderr}");
    assert!(peak < 100 << 20, "peak RSS {} MiB", peak >> 20);
}

/// `spool status --url` does not follow a redirect to another origin (the report there is
/// never fetched), and a URL without a scheme is refused with what to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_url_refuses_other_origins_and_schemeless_urls() {
    let elsewhere = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = format!("http://{}/status", elsewhere.local_addr().unwrap());
    let hits = serve_raw(
        elsewhere,
        "content-type: application/json\r\n".into(),
        serde_json::to_vec(&forged_report()).unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 302 Found\r\nlocation: {target}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    let out = Command::new(spool_bin())
        .args(["status", "--url", &format!("http://{addr}")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("another origin"), "{stderr}");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);

    let out = Command::new(spool_bin())
        .args(["status", "--url", &addr.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains(&format!("add `http://` (e.g. `http://{addr}`)")),
        "{stderr}"
    );
}

/// `spool status --url` against a server that accepts and never answers gives up after
/// its timeout (10 s) with an error naming the endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_url_times_out() {
    let (silent, url) = witness();
    let mut c = Command::new(spool_bin());
    c.args(["status", "--url", &url]);
    let mut p = Proc::from_command(c);
    let (status, _) = p.wait(Duration::from_secs(30)).await;
    drop(silent);
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("{url}/status")), "{stderr}");
}

/// No control character in `s` but line breaks.
fn assert_printable(what: &str, s: &str) {
    let bad: Vec<char> = s.chars().filter(|c| c.is_control() && *c != '\n').collect();
    assert!(bad.is_empty(), "{what} prints {bad:?}:\n{s}");
}

/// A remote report whose dataset name and failure reason carry terminal escapes, a
/// carriage return, a line break and a C1 control: `status --url` prints them escaped, in
/// the table and in the JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_url_escapes_control_characters() {
    let mut report = forged_report();
    report.datasets[0].name = "a\u{1b}]0;owned\u{7}\u{1b}[2J".into();
    report.datasets[0].failures = vec![(1, "boom\r\nspool: all clean\u{9b}31m".into())];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    serve_raw(
        listener,
        "content-type: application/json\r\n".into(),
        serde_json::to_vec(&report).unwrap(),
    );
    for json in [false, true] {
        let mut args = vec![
            "status".to_string(),
            "--url".into(),
            format!("http://{addr}"),
        ];
        if json {
            args.push("--json".into());
        }
        let out = Command::new(spool_bin()).args(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_printable("status --url", &stdout);
        assert!(
            !stdout.lines().any(|l| l.starts_with("spool: all clean")),
            "a forged line: {stdout}"
        );
        if json {
            let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(v["datasets"][0]["name"], report.datasets[0].name.as_str());
        }
    }
}

/// A server's error message with a line break, a carriage return and terminal escapes:
/// the run's log and `spool status` show it on one line, escaped; no forged log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_messages_are_escaped_in_logs_and_status() {
    let server = HandServer::start(Reply::Status(
        400,
        "{\"error\":{\"message\":\"bad\\r\\n2099-01-01T00:00:00Z  INFO forged: all done \\u001b]0;owned\\u0007\\u009b2J\"}}".into(),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset(dir.path(), &server.url, false, 2);
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("forged: all done"),
        "the message is logged: {stderr}"
    );
    assert_printable("run's log", &stderr);
    assert!(
        !stderr.lines().any(|l| l.starts_with("2099-01-01")),
        "a forged log line: {stderr}"
    );
    let out = spool(&cfg, &["status"], &[]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("forged: all done"), "{table}");
    assert_printable("status", &table);
}
