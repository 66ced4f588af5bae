//! Faults against the real code: Retry-After, servers that are down and come
//! back, streams cut half way, hanging requests, endless responses, a full disk and an
//! unwritable output. Fault-specific helpers (hand-written servers, tmpfs mounts) used by
//! other test files live here too (`pub(crate)`).

use crate::process::*;
use crate::support::*;
use serde_json::Value;
use spool::mock::{MockConfig, MockState};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// A loopback port that is bound but not listening (connections are refused) until
/// [`Reserved::serve_mock`] starts a mock on it: "a server that is down, then comes back".
pub(crate) struct Reserved {
    fd: OwnedFd,
    pub port: u16,
}

impl Reserved {
    pub(crate) fn new() -> Reserved {
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let fd = OwnedFd::from_raw_fd(fd);
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            addr.sin_family = libc::AF_INET as libc::sa_family_t;
            addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
            addr.sin_port = 0;
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let p = &addr as *const libc::sockaddr_in as *const libc::sockaddr;
            assert_eq!(libc::bind(fd.as_raw_fd(), p, len), 0);
            let mut got: libc::sockaddr_in = std::mem::zeroed();
            let mut glen = len;
            let gp = &mut got as *mut libc::sockaddr_in as *mut libc::sockaddr;
            assert_eq!(libc::getsockname(fd.as_raw_fd(), gp, &mut glen), 0);
            Reserved {
                fd,
                port: u16::from_be(got.sin_port),
            }
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts listening and serves a mock with `cfg` on the port.
    pub(crate) fn serve_mock(self, cfg: MockConfig) -> (Arc<MockState>, CancellationToken) {
        assert_eq!(unsafe { libc::listen(self.fd.as_raw_fd(), 1024) }, 0);
        let std_listener = std::net::TcpListener::from(self.fd);
        std_listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
        let state = MockState::new(cfg).unwrap();
        let stop = CancellationToken::new();
        let (st, s) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            spool::mock::serve_state(listener, st, async move { s.cancelled().await })
                .await
                .unwrap();
        });
        (state, stop)
    }
}

/// What a [`HandServer`] answers to every POST.
#[derive(Clone, Debug)]
pub(crate) enum Reply {
    /// 200, `application/json`, a body that never ends.
    EndlessBody,
    /// 200, SSE, one event that never ends (no blank line ever comes).
    EndlessEvent,
    /// 200, SSE, completion deltas of 1 kB each, forever.
    EndlessDeltas,
    /// 200, SGLang's cumulative `/generate` stream: `n` events, each repeating the whole
    /// output so far (as SGLang does by default), then `[DONE]`.
    Cumulative(u32),
    /// This status with this body.
    Status(u16, String),
    /// 401 whose body echoes the request's `Authorization` header.
    EchoAuth,
}

/// A tiny HTTP/1.1 server for replies the mock does not make. GETs (health probes) get a
/// model list. Records every `Authorization` header and the bytes sent per connection.
pub(crate) struct HandServer {
    pub url: String,
    pub auth: Arc<Mutex<Vec<String>>>,
    /// Bytes written on each POST connection before it closed.
    pub sent: Arc<Mutex<Vec<u64>>>,
    pub posts: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Drop for HandServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl HandServer {
    pub(crate) async fn start(reply: Reply) -> HandServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let auth = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let posts = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let (a, s, p, st) = (auth.clone(), sent.clone(), posts.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    c = listener.accept() => c,
                    _ = st.cancelled() => break,
                };
                let Ok((sock, _)) = conn else { continue };
                let (reply, a, s, p, st) =
                    (reply.clone(), a.clone(), s.clone(), p.clone(), st.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = serve_conn(sock, reply, a, s, p) => {}
                        _ = st.cancelled() => {}
                    }
                });
            }
        });
        HandServer {
            url,
            auth,
            sent,
            posts,
            stop,
        }
    }
}

async fn serve_conn(
    mut sock: tokio::net::TcpStream,
    reply: Reply,
    auth: Arc<Mutex<Vec<String>>>,
    sent: Arc<Mutex<Vec<u64>>>,
    posts: Arc<AtomicU64>,
) {
    // Request head, then the body by Content-Length.
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match sock.read(&mut tmp).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut content_length = 0usize;
    let mut authorization = String::new();
    let mut rid = String::new();
    for line in head.lines() {
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("x-request-id:") {
            rid = line["x-request-id:".len()..].trim().to_string();
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            content_length = v.trim().parse().unwrap_or(0);
        }
        if lower.starts_with("authorization:") {
            authorization = line["authorization:".len()..].trim().to_string();
        }
    }
    while buf.len() < head_end + content_length {
        match sock.read(&mut tmp).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
    auth.lock().unwrap().push(authorization.clone());
    if rid.starts_with("_selfcheck") {
        // spool's start-up self-check: not an item; answered "busy" and not counted.
        let body = r#"{"error":{"message":"busy"}}"#;
        let resp = format!(
            "HTTP/1.1 503 Busy\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = sock.write_all(resp.as_bytes()).await;
        return;
    }
    if head.starts_with("GET") {
        let body = r#"{"object":"list","data":[{"id":"mock-model","object":"model","max_model_len":1000000}],"model_path":"mock-model","context_length":1000000}"#;
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = sock.write_all(resp.as_bytes()).await;
        return;
    }
    posts.fetch_add(1, Ordering::Relaxed);
    let mut n = 0u64;
    let mut put = |bytes: Vec<u8>| {
        n += bytes.len() as u64;
        bytes
    };
    let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let result: std::io::Result<()> = async {
        match &reply {
            Reply::EndlessBody | Reply::EndlessEvent | Reply::EndlessDeltas => {
                let (head, start, piece): (&str, &str, Vec<u8>) = match reply {
                    Reply::EndlessBody => (
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n",
                        r#"{"choices":[{"index":0,"text":""#,
                        vec![b'x'; 64 << 10],
                    ),
                    Reply::EndlessEvent => (sse, r#"data: {"choices":[{"index":0,"text":""#, vec![b'x'; 64 << 10]),
                    _ => (
                        sse,
                        "",
                        format!(
                            "data: {{\"choices\":[{{\"index\":0,\"text\":\"{}\",\"finish_reason\":null}}]}}\n\n",
                            "y".repeat(1000)
                        )
                        .into_bytes(),
                    ),
                };
                sock.write_all(&put(format!("{head}{start}").into_bytes()))
                    .await?;
                loop {
                    sock.write_all(&put(piece.clone())).await?;
                }
            }
            Reply::Cumulative(total) => {
                sock.write_all(&put(sse.as_bytes().to_vec())).await?;
                let mut text = String::new();
                let mut ids: Vec<u32> = Vec::new();
                for k in 1..=*total {
                    text.push_str(&format!(" w{k}"));
                    ids.push(k);
                    let finish = if k == *total {
                        serde_json::json!({"type": "length", "length": k})
                    } else {
                        Value::Null
                    };
                    let ev = serde_json::json!({"text": text, "output_ids": ids,
                        "meta_info": {"prompt_tokens": 1, "completion_tokens": k, "finish_reason": finish}});
                    sock.write_all(&put(format!("data: {ev}\n\n").into_bytes()))
                        .await?;
                }
                sock.write_all(&put(b"data: [DONE]\n\n".to_vec())).await?;
                Ok(())
            }
            Reply::Status(code, body) => {
                let resp = format!(
                    "HTTP/1.1 {code} Whatever\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                sock.write_all(&put(resp.into_bytes())).await
            }
            Reply::EchoAuth => {
                let body = serde_json::json!({"error": {"message": format!("invalid credentials: Authorization: {authorization}")}}).to_string();
                let resp = format!(
                    "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                sock.write_all(&put(resp.into_bytes())).await
            }
        }
    }
    .await;
    let _ = result;
    let _ = sock.shutdown().await;
    sent.lock().unwrap().push(n);
}

/// A small tmpfs mounted on `dir` (root only); unmounted on drop.
pub(crate) struct Tmpfs {
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mounts with `opts` (e.g. `size=1m`, `size=1m,ro`); `None` when this machine does
    /// not allow mounting (not root, no CAP_SYS_ADMIN).
    pub(crate) fn mount(dir: &Path, opts: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs {
            dir: dir.to_path_buf(),
        })
    }

    /// `mount -o remount,<opts>`.
    pub(crate) fn remount(&self, opts: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(&self.dir)
            .status()
            .unwrap();
        assert!(ok.success(), "remount {opts}");
    }

    /// Fills it up: writes a filler file until the disk is full; returns the file.
    pub(crate) fn fill(&self) -> PathBuf {
        use std::io::Write;
        let p = self.dir.join("filler");
        let mut f = std::fs::File::create(&p).unwrap();
        let block = vec![0u8; 64 << 10];
        loop {
            if f.write_all(&block).is_err() {
                break;
            }
        }
        let one = [0u8; 1];
        while f.write_all(&one).is_ok() {}
        p
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// Items requested (any outcome) in `lines`, as (dataset, row).
pub(crate) fn requested(lines: &[LogLine]) -> HashSet<(String, u64)> {
    lines.iter().map(|l| (l.ds.clone(), l.row)).collect()
}

/// Items answered in full (`ok`) in `lines`.
pub(crate) fn completed(lines: &[LogLine]) -> HashSet<(String, u64)> {
    lines
        .iter()
        .filter(|l| l.outcome == "ok")
        .map(|l| (l.ds.clone(), l.row))
        .collect()
}

fn one_dataset_config(dir: &Path, url: &str, api: &str, stream: bool, n: usize) -> PathBuf {
    write_prompts(&dir.join("p.jsonl"), "p", n);
    write_config(
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
    )
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

// ---------------------------------------------------------------------------------------
// Retries
// ---------------------------------------------------------------------------------------

/// A 429 with `Retry-After: 1` is never retried sooner than 1 s later (measured from the
/// mock's own log: the 429's end to the next request's start for the same item), every
/// 429 costs exactly one attempt (the `attempts` column adds up), and the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_and_each_429_is_one_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        fail_429: 0.35,
        retry_after_s: 1,
        seed: 7,
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    let n = 24;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    edit_config(&cfg, "max_attempts = 4", "max_attempts = 12");
    let s = run_to_end(&cfg).await;
    assert_eq!(s.report.datasets[0].done, n as u64);
    let lines = mock_log(&log);
    let n429 = lines.iter().filter(|l| l.outcome == "429").count();
    assert!(n429 >= 3, "too few 429s to show anything: {n429}");
    let mut by_item: HashMap<u64, Vec<&LogLine>> = HashMap::new();
    for l in &lines {
        by_item.entry(l.row).or_default().push(l);
    }
    let mut gaps = Vec::new();
    for reqs in by_item.values_mut() {
        reqs.sort_by_key(|l| l.start_ms());
        for w in reqs.windows(2) {
            if w[0].outcome == "429" {
                // ms clocks on both sides: allow their rounding (2 ms), nothing more.
                let gap = w[1].start_ms() as i64 - w[0].end_ms as i64;
                assert!(
                    gap >= 998,
                    "retried {gap} ms after a 429 with Retry-After: 1"
                );
                gaps.push(gap);
            }
        }
    }
    assert_eq!(gaps.len(), n429, "every 429 was followed by a retry");
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_exactly_once(&rows, &ids("p", n));
    let retries: u32 = rows.iter().map(|r| r.attempts - 1).sum();
    assert_eq!(retries as usize, n429, "attempts column = requests made");
    eprintln!(
        "429s: {n429}, shortest wait after one {} ms",
        gaps.iter().min().unwrap()
    );
}

/// A permanent 4xx (here 404 from a server that does not know the model) is not retried:
/// the item fails at its first attempt with the server's message stored, shown by
/// `spool status`, and `run` exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_4xx_is_not_retried_and_its_reason_is_shown() {
    let server = HandServer::start(Reply::Status(
        404,
        r#"{"object":"error","message":"The model `mock-model` does not exist.","type":"NotFoundError","code":404}"#.into(),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset_config(dir.path(), &server.url, "completions", false, 3);
    let out = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(server.posts.load(Ordering::Relaxed), 3, "one request each");
    let st = spool(&cfg, &["status"], &[]);
    let text = String::from_utf8_lossy(&st.stdout);
    assert!(
        text.contains("HTTP 404: The model `mock-model` does not exist."),
        "{text}"
    );
    let j = status_json(&cfg);
    assert_eq!(j["datasets"][0]["failed"], 3);
    assert_eq!(j["datasets"][0]["state"], "failed_items");
}

// ---------------------------------------------------------------------------------------
// Servers down
// ---------------------------------------------------------------------------------------

/// Every server down from the start: dispatch pauses, no attempt is burned, the log says
/// so once per interval (shortened to 300 ms by `SPOOL_DOWN_LOG_INTERVAL_MS`; a minute
/// by default), and when a server starts listening on the port the run resumes by itself
/// and completes with every item answered at its first attempt — streaming (reqwest) and
/// whole responses (`upstream::h1`) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_servers_down_pauses_burns_nothing_and_resumes_by_itself() {
    for stream in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("mock.log");
        let port = Reserved::new();
        let n = 40;
        let cfg = one_dataset_config(dir.path(), &port.url(), "sglang", stream, n);
        // Two attempts only: had a refused connection burned one, items would fail.
        edit_config(&cfg, "max_attempts = 4", "max_attempts = 2");
        let interval_ms = 300u64;
        let mut p = Proc::spawn(
            &cfg,
            &["run"],
            &[("SPOOL_DOWN_LOG_INTERVAL_MS", &interval_ms.to_string())],
        );
        let down = "no inference server reachable";
        let t0 = Instant::now();
        p.wait_for(down, 4, Duration::from_secs(30)).await;
        let paused_for = t0.elapsed();
        let lines_while_down = p.count(down);
        // Once per interval, not once per refused connection (16 workers retrying).
        let most = paused_for.as_millis() as u64 / interval_ms + 2;
        assert!(
            lines_while_down as u64 <= most,
            "{lines_while_down} lines in {paused_for:?}"
        );
        assert!(!p.stderr().contains("failed permanently"), "{}", p.stderr());

        let (state, stop) = port.serve_mock(MockConfig {
            log: Some(log.clone()),
            ..fast_mock()
        });
        let (status, _) = p.wait(Duration::from_secs(60)).await;
        assert_eq!(status.code(), Some(0), "{}", p.stderr());
        assert!(
            p.stderr().contains("server back in rotation"),
            "{}",
            p.stderr()
        );
        let rows = shard_rows(&dir.path().join("out"), "a");
        assert_exactly_once(&rows, &ids("p", n));
        assert!(
            rows.iter().all(|r| r.attempts == 1),
            "a refused connection counted as an attempt"
        );
        assert_eq!(mock_log(&log).len(), n, "one request per item");
        assert!(state.stats().requests >= n as u64);
        stop.cancel();
    }
}

// ---------------------------------------------------------------------------------------
// Cut streams and hangs
// ---------------------------------------------------------------------------------------

/// Streams cut half way (40 % of requests) are failed attempts whose partial output is
/// dropped: on each streaming API the rows are identical to a fault-free run's (the mock
/// is deterministic per prompt), and the retries add up to the cuts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_half_way_is_retried_and_its_partial_output_discarded() {
    for api in ["sglang", "completions", "chat"] {
        let n = 30;
        let run = |drop: f64| async move {
            let dir = tempfile::tempdir().unwrap();
            let log = dir.path().join("mock.log");
            let mock = Mock::start(MockConfig {
                drop_mid_stream: drop,
                seed: 11,
                log: Some(log.clone()),
                ..fast_mock()
            })
            .await;
            let cfg = one_dataset_config(dir.path(), &mock.url, api, true, n);
            edit_config(&cfg, "max_attempts = 4", "max_attempts = 20");
            let s = run_to_end(&cfg).await;
            assert_eq!(s.report.datasets[0].done, n as u64, "{api}");
            let mut rows = shard_rows(&dir.path().join("out"), "a");
            rows.sort_by_key(|r| r.row);
            let drops = mock_log(&log)
                .iter()
                .filter(|l| l.outcome == "dropped")
                .count() as u64;
            (rows, drops)
        };
        let (clean, _) = run(0.0).await;
        let (cut, drops) = run(0.4).await;
        assert!(drops >= 3, "{api}: too few cuts to show anything ({drops})");
        let retries: u32 = cut.iter().map(|r| r.attempts - 1).sum();
        assert_eq!(u64::from(retries), drops, "{api}: each cut is one attempt");
        assert_eq!(clean.len(), cut.len());
        for (a, b) in clean.iter().zip(&cut) {
            assert_eq!(a.id, b.id);
            assert_eq!(a.completion, b.completion, "{api} {}: text", a.id);
            assert_eq!(a.completion_token_ids, b.completion_token_ids, "{api}");
            assert_eq!(a.completion_tokens, b.completion_tokens, "{api}");
            assert_eq!(a.finish_reason, b.finish_reason, "{api}");
        }
    }
}

/// A request that hangs is cut by `request_timeout_s` (0.5 s here): the mock sees the
/// client give up after ~0.5 s, the item is retried, and the run completes — streaming
/// (reqwest) and whole responses (`upstream::h1`) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_request_is_cut_by_request_timeout_and_retried() {
    for stream in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("mock.log");
        let mock = Mock::start(MockConfig {
            hang: 0.3,
            seed: 5,
            log: Some(log.clone()),
            ..fast_mock()
        })
        .await;
        let n = 30;
        let cfg = one_dataset_config(dir.path(), &mock.url, "sglang", stream, n);
        edit_config(&cfg, "request_timeout_s = 20", "request_timeout_s = 0.5");
        edit_config(&cfg, "max_attempts = 4", "max_attempts = 12");
        let s = run_to_end(&cfg).await;
        assert_eq!(s.report.datasets[0].done, n as u64);
        // The mock logs a hang when the client hangs up; wait for every one to be logged.
        tokio::time::timeout(
            Duration::from_secs(10),
            mock.state.wait_until(|s| s.in_flight == 0),
        )
        .await
        .unwrap();
        let hangs: Vec<LogLine> = mock_log(&log)
            .into_iter()
            .filter(|l| l.outcome == "hang")
            .collect();
        assert!(hangs.len() >= 3, "too few hangs: {}", hangs.len());
        for h in &hangs {
            assert!(
                (450..3000).contains(&h.latency_ms),
                "a hang was cut after {} ms, not by the 0.5 s timeout",
                h.latency_ms
            );
        }
        let rows = shard_rows(&dir.path().join("out"), "a");
        assert_exactly_once(&rows, &ids("p", n));
        let retries: u32 = rows.iter().map(|r| r.attempts - 1).sum();
        assert_eq!(retries as usize, hangs.len());
    }
}

// ---------------------------------------------------------------------------------------
// Response size
// ---------------------------------------------------------------------------------------

/// Servers that never stop sending — a JSON body, one SSE event, endless small deltas —
/// are refused at `max_response_bytes` (1 MiB) quickly (long before the 30 s request
/// timeout), the item fails permanently with the reason, the server could push only a
/// few MB before the connection closed, and spool's peak memory stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_response_is_refused_at_the_cap_without_exhausting_memory() {
    for (reply, stream) in [
        (Reply::EndlessBody, false),
        (Reply::EndlessEvent, true),
        (Reply::EndlessDeltas, true),
    ] {
        let server = HandServer::start(reply.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let cfg = one_dataset_config(dir.path(), &server.url, "completions", stream, 1);
        edit_config(
            &cfg,
            "request_timeout_s = 20",
            "request_timeout_s = 30\nmax_response_bytes = 1048576",
        );
        let t0 = Instant::now();
        let mut p = Proc::spawn(&cfg, &["run", "-q"], &[]);
        let (status, peak) = p.wait(Duration::from_secs(60)).await;
        let took = t0.elapsed();
        assert_eq!(status.code(), Some(3), "{reply:?}: {}", p.stderr());
        assert!(took < Duration::from_secs(20), "{reply:?}: took {took:?}");
        let st = String::from_utf8_lossy(&spool(&cfg, &["status"], &[]).stdout).to_string();
        assert!(
            st.contains("response larger than 1048576 bytes, refused"),
            "{reply:?}: {st}"
        );
        // Let the server notice the closed connection.
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.sent.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "server never saw the close");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let sent = server.sent.lock().unwrap().clone();
        assert_eq!(sent.len(), 1, "refused, not retried");
        assert!(
            sent[0] < 64 << 20,
            "{reply:?}: {} bytes pushed before spool hung up",
            sent[0]
        );
        assert!(peak < 200 << 20, "{reply:?}: peak memory {} MB", peak >> 20);
        eprintln!(
            "{reply:?}: refused after {took:?}, server pushed {} kB, peak RSS {} MB",
            sent[0] >> 10,
            peak >> 20
        );
    }
}

/// Regression: SGLang's default stream repeats the whole output in every event, so a
/// long completion streams far more bytes in total than it holds. The cap once counted
/// the total and refused such a response; it must count what is held (one event, the
/// output). Here 2 000 events total ~20 MB against a 1 MiB cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cumulative_stream_larger_in_total_than_the_cap_is_accepted() {
    let server = HandServer::start(Reply::Cumulative(2000)).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset_config(dir.path(), &server.url, "sglang", true, 1);
    edit_config(
        &cfg,
        "request_timeout_s = 20",
        "request_timeout_s = 60\nmax_response_bytes = 1048576",
    );
    let out = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sent = server.sent.lock().unwrap().clone();
    assert!(sent[0] > 8 << 20, "total streamed only {} bytes", sent[0]);
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].completion_tokens, 2000);
    assert_eq!(
        rows[0].completion_token_ids.as_deref(),
        Some(&(1..=2000).collect::<Vec<u32>>()[..])
    );
    assert!(rows[0].completion.ends_with(" w2000"));
}

/// Regression: the SSE reader searched the whole buffer for an event boundary on every
/// chunk, so a body without boundaries cost time quadratic in the cap (minutes at a
/// 32 MiB cap). It is now refused at the cap in linear time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_end_is_refused_in_linear_time() {
    let server = HandServer::start(Reply::EndlessEvent).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset_config(dir.path(), &server.url, "completions", true, 1);
    edit_config(
        &cfg,
        "request_timeout_s = 20",
        "request_timeout_s = 120\nmax_response_bytes = 33554432",
    );
    let t0 = Instant::now();
    let mut p = Proc::spawn(&cfg, &["run", "-q"], &[]);
    // Linear: well under a second of scanning; quadratic: many minutes.
    let (status, _) = p.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(3), "{}", p.stderr());
    assert!(p.stderr().contains("response larger than 33554432 bytes"));
    eprintln!("refused after {:?}", t0.elapsed());
}

// ---------------------------------------------------------------------------------------
// Disk full, unwritable output
// ---------------------------------------------------------------------------------------

/// Checks a stopped-by-the-disk run and resumes it: exit 1 with a message naming the
/// output path; results durable in the queue; no stray file; dispatch stopped early;
/// then, with space back, the next run completes, verify is clean, every prompt is in
/// exactly one row, and nothing answered before the stop was requested again.
/// `dir` holds `spool.toml`, `out/` and the mock's `mock.log`.
async fn disk_stop_then_resume(
    dir: &Path,
    mock: &Mock,
    n: usize,
    fault_env: &[(&str, &str)],
    expect_in_message: &str,
    make_space: impl FnOnce(),
) {
    let (cfg, out, log) = (
        &dir.join("spool.toml"),
        &dir.join("out"),
        &dir.join("mock.log"),
    );
    let mut p = Proc::spawn(cfg, &["run"], fault_env);
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with("spool: error: cannot write shards under")
            && last.contains(&out.display().to_string())
            && last.contains(expect_in_message)
            && last.contains("kept in the queue"),
        "unclear message: {last}"
    );
    tokio::time::timeout(
        Duration::from_secs(10),
        mock.state.wait_until(|s| s.in_flight == 0),
    )
    .await
    .unwrap();
    let first = mock_log(log);
    let answered = completed(&first);
    assert!(
        first.len() < n,
        "dispatch went on after the disk failed: {} of {n} requested",
        first.len()
    );
    let j = status_json(cfg);
    let done = j["datasets"][0]["done"].as_u64().unwrap();
    assert_eq!(
        done as usize,
        answered.len(),
        "every answer kept in the queue"
    );
    assert!(done > 0);
    for e in std::fs::read_dir(out.join("a")).into_iter().flatten() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            name.starts_with("part-") && name.ends_with(".parquet"),
            "stray file {name}"
        );
    }

    make_space();
    let out2 = spool(cfg, &["run", "-q"], &[]);
    assert_eq!(
        out2.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out2.stderr)
    );
    assert_verify_clean(cfg);
    let rows = shard_rows(out, "a");
    assert_exactly_once(&rows, &ids("p", n));
    let all = mock_log(log);
    let again = requested(&all[first.len()..]);
    let twice: Vec<_> = answered.intersection(&again).collect();
    assert!(
        twice.is_empty(),
        "requested again after the stop: {twice:?}"
    );
}

fn disk_mock() -> MockConfig {
    // ~60 requests/s: the disk fails (first shard, 25 rows) long before 300 are done.
    MockConfig {
        capacity_tps: 3.0,
        per_request_tps: 2.0,
        ..MockConfig::for_tests()
    }
}

/// Disk full under `output_dir`, on a real 1 MiB tmpfs that is filled up first (where
/// the machine allows mounting; else the shard writer's injected `StorageFull` error):
/// see [`disk_stop_then_resume`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_stops_dispatch_keeps_results_and_the_next_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..disk_mock()
    })
    .await;
    let n = 300;
    one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    let out = dir.path().join("out");
    match Tmpfs::mount(&out, "size=1m") {
        Some(fs) => {
            let filler = fs.fill();
            eprintln!("disk full: real tmpfs");
            disk_stop_then_resume(dir.path(), &mock, n, &[], "No space left on device", || {
                std::fs::remove_file(&filler).unwrap()
            })
            .await;
            drop(fs);
        }
        None => {
            eprintln!("disk full: cannot mount here; injected write error instead");
            disk_stop_then_resume(
                dir.path(),
                &mock,
                n,
                &[("SPOOL_FAULT_SHARD_WRITE_ERROR", "1")],
                "injected write error",
                || {},
            )
            .await;
        }
    }
}

/// The shard writer's injected write error (as on a full disk), which needs no root:
/// the same promises as the real full disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_shard_write_error_stops_the_run_and_the_next_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..disk_mock()
    })
    .await;
    let n = 300;
    one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    disk_stop_then_resume(
        dir.path(),
        &mock,
        n,
        &[("SPOOL_FAULT_SHARD_WRITE_ERROR", "1")],
        "injected write error",
        || {},
    )
    .await;
}

/// An output folder spool cannot use at start (the dataset's folder is taken by a file):
/// exit 1 naming it before any request; once the obstacle is gone the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_output_folder_at_start_exits_1_naming_it_and_sends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    let n = 30;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let obstacle = out.join("a");
    std::fs::write(&obstacle, "in the way").unwrap();
    let o = spool(&cfg, &["run", "-q"], &[]);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    // Warnings may come first (`-q` keeps them); the error is the line that says why.
    let error = stderr
        .lines()
        .find(|l| l.starts_with("spool: error:"))
        .unwrap_or("");
    assert!(
        error.starts_with("spool: error: cannot write shards under")
            && stderr.contains(&obstacle.display().to_string())
            && stderr.matches("Not a directory").count() == 1,
        "{stderr}"
    );
    assert!(mock_log(&log).is_empty(), "requests sent");
    std::fs::remove_file(&obstacle).unwrap();
    let o = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_verify_clean(&cfg);
    assert_exactly_once(&shard_rows(&out, "a"), &ids("p", n));
}

/// Output on a read-only file system (as a failing disk is remounted): the first shard
/// cannot be written; the run stops as on a full disk (see [`disk_stop_then_resume`]),
/// and resumes exactly once the file system is writable. Needs mounting; says so and
/// checks nothing where that is refused (the injected-error test covers the logic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_output_stops_the_run_and_the_next_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let Some(fs) = Tmpfs::mount(&out, "size=16m,ro") else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
        return;
    };
    let log = dir.path().join("mock.log");
    let mock = Mock::start(MockConfig {
        log: Some(log.clone()),
        ..disk_mock()
    })
    .await;
    let n = 300;
    one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    disk_stop_then_resume(dir.path(), &mock, n, &[], "Read-only file system", || {
        fs.remount("rw")
    })
    .await;
}

/// The queue's own disk full (data_dir on a small tmpfs that unsharded results fill up), three
/// runs at once: each stops with exit 1 and a message naming data_dir and the cause, and
/// once its disk is grown, the next run resumes exactly. Regression: after ENOSPC sled
/// may never return from a flush; the run's last flush hung forever (about one run in
/// three under load; three concurrent runs catch it most of the time). Needs mounting;
/// says so and checks nothing where that is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_disk_stops_the_run_and_the_next_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    // Long completions (~3000 tokens, ~20 kB a row) fill 4 MiB after ~100 results.
    let mock = Mock::start(MockConfig {
        mean_tokens: 3000.0,
        sigma: 0.1,
        capacity_tps: 200.0,
        per_request_tps: 100.0,
        log: Some(log.clone()),
        ..MockConfig::for_tests()
    })
    .await;
    let n = 400;
    let mut cases = Vec::new();
    for k in 0..3 {
        let d = dir.path().join(format!("run{k}"));
        std::fs::create_dir_all(&d).unwrap();
        let Some(fs) = Tmpfs::mount(&d.join("q"), "size=4m") else {
            eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
            return;
        };
        let cfg = one_dataset_config(&d, &mock.url, "completions", false, n);
        edit_config(&cfg, "data_dir = \"data\"", "data_dir = \"q/data\"");
        edit_config(&cfg, "max_tokens = 200", "max_tokens = 5000");
        // One shard for the whole run: results stay in the queue's results log until the
        // end (with 25-row shards the log gives its space back as it goes, and 4 MiB
        // would not fill).
        edit_config(&cfg, "max_rows = 25", "max_rows = 1000");
        // Distinct prompts per run, so the mock log tells them apart.
        let text = std::fs::read_to_string(d.join("p.jsonl"))
            .unwrap()
            .replace("Write item", &format!("Run {k}: write item"));
        std::fs::write(d.join("p.jsonl"), text).unwrap();
        cases.push((d, fs, cfg));
    }
    let mut procs: Vec<Proc> = cases
        .iter()
        .map(|(_, _, cfg)| Proc::spawn(cfg, &["run"], &[]))
        .collect();
    for p in &mut procs {
        let (status, _) = p.wait(Duration::from_secs(120)).await;
        let stderr = p.stderr();
        assert_eq!(status.code(), Some(1), "{stderr}");
        let last = stderr.lines().last().unwrap_or("");
        assert!(
            last.starts_with("spool: error: cannot ")
                && last.contains("in the queue in")
                && last.contains("q/data")
                && last.contains("No space left on device"),
            "{last}"
        );
    }
    assert!(mock_log(&log).len() < 3 * n, "dispatch went on");
    for (d, fs, cfg) in &cases {
        // The failed write poisoned the queue and left the marker of a repair.
        assert!(d.join("q/data/needs-repair").exists());
        fs.remount("size=256m");
        let out = spool(cfg, &["run", "-q"], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(stderr.contains("queue repaired"), "{stderr}");
        assert_verify_clean(cfg);
        assert_exactly_once(&shard_rows(&d.join("out"), "a"), &ids("p", n));
    }
}

/// Regression (root cause of the full-queue-disk failures, made deterministic): sled applies
/// a batch key by key and stops at the first failed write, so a full disk could leave an
/// item's pending key removed and the counters advanced while its result was never written;
/// the next run trusted the counters and finished without the item (lost) or with `done` one
/// ahead. The injected torn commit writes exactly that half batch. The run must stop with the
/// error, `verify` must name the lost rows and the pending repair, and the next run must
/// repair the queue, putting back exactly the rows verify named, and generate them again:
/// every prompt exactly once, verify clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_queue_write_is_repaired_by_the_next_run() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    // Enough items that a 5th commit comes however results group: each wave of
    // `concurrency` fast answers can be a single group commit.
    let n = 200;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    let first = spool(
        &cfg,
        &["run", "-q"],
        &[("SPOOL_FAULT_QUEUE_TORN_COMMIT", "5")],
    );
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("injected torn write"), "{stderr}");
    assert!(dir.path().join("data").join("needs-repair").exists());

    let v = spool(&cfg, &["verify", "-q"], &[]);
    let report = String::from_utf8_lossy(&v.stdout);
    assert_eq!(v.status.code(), Some(1), "{report}");
    assert!(report.contains("needs-repair"), "{report}");
    // The torn commit held every result of one group commit: how many depends on timing,
    // so count the rows verify names (at least one) and expect the repair to bring back
    // exactly those.
    let lost = report
        .matches("is enqueued but neither pending, done nor failed")
        .count();
    assert!(lost >= 1, "the lost row is named: {report}");

    let second = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("queue repaired"), "{stderr}");
    assert!(
        stderr.contains(&format!("back_to_pending={lost} ")),
        "{lost} rows named by verify: {stderr}"
    );
    assert!(!dir.path().join("data").join("needs-repair").exists());
    assert_verify_clean(&cfg);
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "a"), &ids("p", n));
}

/// Regression (the full-queue-disk test's rare failure): when a commit fails, the archive
/// seals its open shard as the run stops, and its queue write is refused because the queue
/// is poisoned. That refusal is a consequence; if the committer's task was descheduled
/// between its failure and reporting it (forced here by a pause), the archive's "an
/// earlier queue write failed" was reported instead of the cause (`No space left on
/// device`, here the injected torn write). The archive may now seal only once the
/// committer has recorded its error. The next run repairs the queue and adopts the shard:
/// every prompt once, verify clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_reported_as_the_cause_not_the_archives_refused_write() {
    // One shard for the run: it is still open, with the rows of the first two commits, when
    // the third fails.
    let last = a_failed_commit_then_a_resume("max_rows = 1000").await;
    assert!(
        last.starts_with("spool: error: cannot store results in the queue in")
            && last.contains("injected torn write"),
        "the cause is reported, not its consequence: {last}"
    );
}

/// Regression (the same report, from a shard sealed in the middle of a run): with one row
/// per shard the archive is still sealing the rows of earlier commits when a commit fails;
/// each seal's queue write is refused (the queue is poisoned), and while the committer is
/// paused before reporting, that refusal is the first error recorded. The refusal names the
/// write that failed first, so the run's last line names the cause (here the injected torn
/// write) whichever task reports first. The next run repairs the queue and adopts the
/// shards: every prompt once, verify clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_sealed_after_a_failed_commit_still_reports_the_cause() {
    // A shard per row: the archive has a backlog of seals when the third commit fails.
    let last = a_failed_commit_then_a_resume("max_rows = 1").await;
    assert!(
        last.starts_with("spool: error: cannot ")
            && last.contains("in the queue in")
            && last.contains("injected torn write"),
        "the cause is named, not only its consequence: {last}"
    );
}

/// 200 prompts with shards closed at `max_rows`; the third commit is torn and the
/// committer paused a second before it reports: the run exits 1. The next run repairs the
/// queue and adopts the shards (every prompt once, verify clean). Returns the first run's
/// last stderr line, the error it reported.
async fn a_failed_commit_then_a_resume(max_rows: &str) -> String {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let n = 200;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    edit_config(&cfg, "max_rows = 25", max_rows);
    let first = spool(
        &cfg,
        &["run"],
        &[
            ("SPOOL_FAULT_QUEUE_TORN_COMMIT", "3"),
            ("SPOOL_FAULT_COMMIT_FAILED_PAUSE_MS", "1000"),
        ],
    );
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("pausing the committer before it reports its error"),
        "{stderr}"
    );
    let last = stderr.lines().last().unwrap_or("").to_string();
    let second = spool(&cfg, &["run", "-q"], &[]);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("queue repaired"), "{stderr}");
    assert_verify_clean(&cfg);
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "a"), &ids("p", n));
    last
}

/// Regression: a 429 counted as a server error, so three in a row took a healthy but
/// busy server out of rotation, paused dispatch and logged "no inference server
/// reachable". A throttling server stays in rotation; its Retry-After paces the retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_server_stays_in_rotation() {
    let mock = Mock::start(MockConfig {
        fail_429: 0.4,
        retry_after_s: 0,
        seed: 21,
        ..fast_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, 30);
    edit_config(&cfg, "max_attempts = 4", "max_attempts = 30");
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    assert_eq!(status.code(), Some(0), "{}", p.stderr());
    assert!(mock.stats().count(spool::mock::Outcome::Http429) >= 10);
    let log = p.stderr();
    assert!(!log.contains("taken out of rotation"), "{log}");
    assert!(!log.contains("no inference server reachable"), "{log}");
}

// ---------------------------------------------------------------------------------------
// Panics in a request
// ---------------------------------------------------------------------------------------

/// A request task that panics (injected in the 3rd attempt, where a bug in the HTTP client
/// meeting a hostile answer would) is one failed attempt: its lease and its server's
/// in-flight count are given back, the item is retried and completes, the log says why,
/// and the run ends by itself. Without the catch the lease never ended and the run waited
/// forever (this test then fails at its time limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_request_is_a_failed_attempt_and_the_item_is_retried() {
    for stream in [true, false] {
        let mock = Mock::start(fast_mock()).await;
        let dir = tempfile::tempdir().unwrap();
        let n = 20;
        let cfg = one_dataset_config(dir.path(), &mock.url, "completions", stream, n);
        let mut p = Proc::spawn(&cfg, &["run"], &[("SPOOL_FAULT_PANIC_IN_REQUEST", "3")]);
        let (status, _) = p.wait(Duration::from_secs(60)).await;
        let stderr = p.stderr();
        assert_eq!(status.code(), Some(0), "stream={stream}: {stderr}");
        assert_eq!(
            p.count("the request panicked; counted as a failed attempt"),
            1,
            "stream={stream}: {stderr}"
        );
        assert!(stderr.contains("injected panic in request 3"), "{stderr}");
        assert_verify_clean(&cfg);
        let rows = shard_rows(&dir.path().join("out"), "a");
        assert_exactly_once(&rows, &ids("p", n));
        // The panicking attempt counted: one item took two attempts, every other one.
        let mut attempts: Vec<u32> = rows.iter().map(|r| r.attempts).collect();
        attempts.sort_unstable();
        let mut want = vec![1; n - 1];
        want.push(2);
        assert_eq!(attempts, want, "stream={stream}");
    }
}

/// An item whose every attempt panics is retried up to `max_attempts`, then failed for good
/// with the panic's message as its reason (exit 3, `status` shows it); the other items
/// complete, and `verify` is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_whose_every_attempt_panics_fails_with_the_panic_as_reason() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let n = 6;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    // One request at a time: the first item's two attempts are the first two requests.
    edit_config(&cfg, "concurrency = 16", "concurrency = 1");
    edit_config(&cfg, "max_attempts = 4", "max_attempts = 2");
    let mut p = Proc::spawn(&cfg, &["run"], &[("SPOOL_FAULT_PANIC_IN_REQUEST", "1-2")]);
    let (status, _) = p.wait(Duration::from_secs(60)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert_eq!(
        p.count("the request panicked; counted as a failed attempt"),
        2,
        "{stderr}"
    );
    let j = status_json(&cfg);
    let d = &j["datasets"][0];
    assert_eq!(d["failed"], 1, "{j}");
    assert_eq!(d["done"], n as u64 - 1, "{j}");
    let reason = d["failures"][0][1].as_str().unwrap_or_default();
    assert_eq!(d["failures"][0][0], 1, "the first line failed: {j}");
    assert!(
        reason.contains("the request panicked: injected panic in request 2")
            && reason.contains("gave up after 2 attempts"),
        "{reason}"
    );
    assert_verify_clean(&cfg);
    let mut want = ids("p", n);
    want.remove(0);
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "a"), &want);
}

/// A panic in an item's task outside any attempt (injected while the shard row of the 1st
/// completed answer is built) fails that item at once with the panic's message; the other
/// items complete and the run ends by itself (exit 3), `verify` clean. Without the catch
/// around the whole task its lease never ended and the run waited forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_outside_an_attempt_fails_the_item_and_the_run_ends() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let n = 10;
    let cfg = one_dataset_config(dir.path(), &mock.url, "completions", true, n);
    let mut p = Proc::spawn(&cfg, &["run"], &[("SPOOL_FAULT_PANIC_IN_ROW", "1")]);
    let (status, _) = p.wait(Duration::from_secs(60)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(3), "{stderr}");
    let j = status_json(&cfg);
    let d = &j["datasets"][0];
    assert_eq!(d["failed"], 1, "{j}");
    assert_eq!(d["done"], n as u64 - 1, "{j}");
    let reason = d["failures"][0][1].as_str().unwrap_or_default();
    assert!(
        reason.contains("spool panicked handling this item: injected panic in row 1"),
        "{reason}"
    );
    assert_verify_clean(&cfg);
    assert_eq!(shard_rows(&dir.path().join("out"), "a").len(), n - 1);
}
