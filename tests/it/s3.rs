//! A real S3 API for the tests: moto's server on a loopback port, and a fault-injecting
//! proxy in front of it (503 SlowDown, connections reset mid-answer, answers slower than
//! the client's timeout, S3's 409 `ConditionalRequestConflict` to a conditional create,
//! or a store that ignores `If-None-Match`). Also the object-store boundary's own tests
//! against them.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use spool::output::bucket::{Bucket, BucketOptions, Created};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// moto's S3 server, killed on drop.
pub(crate) struct Moto {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
}

impl Moto {
    /// Starts `moto_server` on 127.0.0.1, port 0, and waits for the port it prints.
    pub(crate) fn start() -> Moto {
        let mut child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("moto_server (pip install \"moto[server]\")");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let endpoint = loop {
            let line = lines
                .next()
                .expect("moto_server exited before listening")
                .unwrap();
            if let Some(at) = line.find("http://127.0.0.1:") {
                break line[at..].trim().to_string();
            }
        };
        // Keep draining its log so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Moto { child, endpoint }
    }

    /// Creates bucket `name` (moto does not check signatures: a bare PUT will do).
    pub(crate) fn create_bucket(&self, name: &str) {
        let addr = self.endpoint.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "PUT /{name} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    /// The environment a spool process needs to reach `endpoint` (moto or a proxy).
    pub(crate) fn env(endpoint: &str) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT_URL".into(), endpoint.into()),
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test-secret".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which requests the proxy spoils: the n-th request (counting from 1) gets a 503 when
/// `n % every_503 == 0`, else a reset when `n % every_reset == 0` (after moto has acted
/// on it: the answer is lost, not the request), else a delay when `n % every_delay == 0`.
/// The k-th conditional create (`If-None-Match`) gets S3's 409
/// `ConditionalRequestConflict` without reaching moto when `k % every_conflict == 0`;
/// with `drop_conditions` every conditional create reaches moto without its condition
/// (a store that ignores it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FaultPlan {
    pub every_503: u64,
    pub every_reset: u64,
    pub every_delay: u64,
    pub delay: Duration,
    pub every_conflict: u64,
    pub drop_conditions: bool,
}

impl Default for FaultPlan {
    /// No fault.
    fn default() -> Self {
        FaultPlan {
            every_503: u64::MAX,
            every_reset: u64::MAX,
            every_delay: u64::MAX,
            delay: Duration::ZERO,
            every_conflict: u64::MAX,
            drop_conditions: false,
        }
    }
}

/// What the proxy did.
#[derive(Default)]
pub(crate) struct FaultCounts {
    pub requests: AtomicU64,
    pub slowdowns: AtomicU64,
    pub resets: AtomicU64,
    pub delays: AtomicU64,
    /// Resets of a conditional create's answer: the object was created, the client never
    /// heard so.
    pub lost_creates: AtomicU64,
    /// Conditional creates seen, and those answered 409 ConditionalRequestConflict.
    pub conditional: AtomicU64,
    pub conflicts: AtomicU64,
}

struct ProxyState {
    upstream: String,
    plan: FaultPlan,
    counts: Arc<FaultCounts>,
    client: reqwest::Client,
}

/// A loopback HTTP proxy in front of moto that injects faults by plan.
pub(crate) struct FaultProxy {
    pub endpoint: String,
    pub counts: Arc<FaultCounts>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub(crate) async fn start(upstream: &str, plan: FaultPlan) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let counts = Arc::new(FaultCounts::default());
        let state = Arc::new(ProxyState {
            upstream: upstream.to_string(),
            plan,
            counts: counts.clone(),
            client: {
                spool::upstream::tls::install_provider();
                reqwest::Client::builder().no_proxy().build().unwrap()
            },
        });
        let app = axum::Router::new().fallback(forward).with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FaultProxy {
            endpoint,
            counts,
            task,
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(State(st): State<Arc<ProxyState>>, req: Request) -> Response {
    let n = st.counts.requests.fetch_add(1, Ordering::SeqCst) + 1;
    let p = st.plan;
    let conditional =
        req.method() == axum::http::Method::PUT && req.headers().contains_key("if-none-match");
    if conditional {
        let k = st.counts.conditional.fetch_add(1, Ordering::SeqCst) + 1;
        if k % p.every_conflict == 0 {
            st.counts.conflicts.fetch_add(1, Ordering::SeqCst);
            return Response::builder()
                .status(409)
                .header("content-type", "application/xml")
                .body(Body::from(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>ConditionalRequestConflict</Code><Message>A conflicting conditional operation is currently in progress against this resource. Please try again.</Message><RequestId>proxy</RequestId></Error>",
                ))
                .unwrap();
        }
    }
    if n % p.every_503 == 0 {
        st.counts.slowdowns.fetch_add(1, Ordering::SeqCst);
        return Response::builder()
            .status(503)
            .header("content-type", "application/xml")
            .body(Body::from(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>",
            ))
            .unwrap();
    }
    let delay = n % p.every_delay == 0 && n % p.every_reset != 0;
    if delay {
        st.counts.delays.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(p.delay).await;
    }
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let url = format!(
        "{}{}",
        st.upstream,
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let mut up = st.client.request(parts.method.clone(), &url);
    for (k, v) in &parts.headers {
        let dropped = p.drop_conditions && k == "if-none-match";
        if k != "host" && k != "content-length" && !dropped {
            up = up.header(k, v);
        }
    }
    let answer = match up.body(body).send().await {
        Ok(a) => a,
        Err(e) => {
            return Response::builder()
                .status(502)
                .body(Body::from(e.to_string()))
                .unwrap()
        }
    };
    let status = answer.status();
    let headers = answer.headers().clone();
    let bytes = answer.bytes().await.unwrap_or_default();
    let mut b = Response::builder().status(status);
    if parts.method == axum::http::Method::HEAD {
        // A HEAD answer's length is the object's: passed through, never cut.
        for (k, v) in &headers {
            if k != "transfer-encoding" && k != "connection" {
                b = b.header(k, v);
            }
        }
        return b.body(Body::empty()).unwrap();
    }
    for (k, v) in &headers {
        if k != "content-length" && k != "transfer-encoding" && k != "connection" {
            b = b.header(k, v);
        }
    }
    if n % p.every_reset == 0 {
        // The server acted; the client gets half an answer and a closed connection.
        st.counts.resets.fetch_add(1, Ordering::SeqCst);
        if parts.method == axum::http::Method::PUT && parts.headers.contains_key("if-none-match") {
            st.counts.lost_creates.fetch_add(1, Ordering::SeqCst);
        }
        let half = bytes.slice(..bytes.len() / 2);
        let stream = futures_util::stream::iter(vec![
            Ok::<Bytes, std::io::Error>(half),
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "injected reset",
            )),
        ]);
        return b
            .header("content-length", (bytes.len() + 1).to_string())
            .body(Body::from_stream(stream))
            .unwrap();
    }
    b.header("content-length", bytes.len().to_string())
        .body(Body::from(bytes))
        .unwrap()
}

/// Opens `s3://bucket/prefix` through `endpoint` with short timeouts, in-process, with the
/// settings a worker would get from its environment.
pub(crate) fn s3_bucket(endpoint: &str, url: &str) -> Bucket {
    let opts = BucketOptions {
        timeout_s: Some(2.0),
        max_retries: Some(10),
        retry_timeout_s: Some(60.0),
        ..Default::default()
    };
    Bucket::open_with_env(url, &opts, &Moto::env(endpoint)).unwrap()
}

/// Row count of a Parquet object read by pyarrow through `s3://` at `endpoint`.
pub(crate) fn pyarrow_rows(endpoint: &str, path: &str) -> u64 {
    let script = r#"
import sys, pyarrow.fs as fs, pyarrow.dataset as ds
endpoint, path = sys.argv[1], sys.argv[2]
s3 = fs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="test", secret_key="test-secret", region="us-east-1")
print(ds.dataset(path, filesystem=s3, format="parquet").count_rows())
"#;
    let out = Command::new("python3")
        .args(["-c", script, endpoint, path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A real shard to upload: the v1 fixture's first one.
fn fixture_shard() -> std::path::PathBuf {
    let dir = crate::support::fixtures().join("shard-v1");
    let mut found = Vec::new();
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                found.push(p);
            }
        }
    }
    found.sort();
    found
        .into_iter()
        .next()
        .expect("a shard in tests/fixtures/shard-v1")
}

fn sha256(path: &Path) -> String {
    use sha2::Digest;
    spool::config::hex(&sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

/// Against moto: a 20 MiB file uploads in parts and is not listed until complete, then
/// reads back byte for byte; a conditional create is ours once, ours again when retried
/// with the same bytes, and theirs for other bytes; pyarrow reads an uploaded shard
/// through `s3://`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_round_trip_through_moto() {
    let moto = Moto::start();
    moto.create_bucket("spool-test");
    let b = s3_bucket(&moto.endpoint, "s3://spool-test/run-1");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.bin");
    let data: Vec<u8> = (0..20u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&big, &data).unwrap();
    let (listed_during, up) = {
        let upload = b.upload("x/big.bin", &big);
        tokio::pin!(upload);
        // Look while the parts are in flight: nothing is visible before completion.
        let mut listed = Vec::new();
        let up = loop {
            tokio::select! {
                biased;
                r = &mut upload => break r.unwrap(),
                _ = tokio::time::sleep(Duration::from_millis(30)) => {
                    listed.push(b.head("x/big.bin").await.unwrap());
                }
            }
        };
        (listed, up)
    };
    // Absent while parts were in flight; present only whole (a look may land just after
    // completion, before the upload's future is polled).
    assert!(
        listed_during.iter().any(Option::is_none),
        "no look landed during the upload"
    );
    assert!(
        listed_during
            .iter()
            .flatten()
            .all(|(size, _)| *size == data.len() as u64),
        "a partial object was visible: {listed_during:?}"
    );
    assert_eq!(up.bytes, data.len() as u64);
    assert_eq!(up.sha256, sha256(&big));
    let back = dir.path().join("back.bin");
    b.download("x/big.bin", &back).await.unwrap();
    assert_eq!(sha256(&back), up.sha256);
    assert_eq!(
        b.create("c/0.json", Bytes::from("mine")).await.unwrap(),
        Created::Mine
    );
    assert_eq!(
        b.create("c/0.json", Bytes::from("mine")).await.unwrap(),
        Created::Mine
    );
    assert_eq!(
        b.create("c/0.json", Bytes::from("other")).await.unwrap(),
        Created::Theirs(Bytes::from("mine"))
    );
    let keys: Vec<String> = b
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, ["c/0.json", "x/big.bin"]);
    let shard = fixture_shard();
    b.upload("d/part-000000.parquet", &shard).await.unwrap();
    let rows = spool::output::reader::read_rows(&shard).unwrap().len() as u64;
    assert!(rows > 0);
    let endpoint = moto.endpoint.trim_start_matches("http://");
    assert_eq!(pyarrow_rows(endpoint, "spool-test/run-1/d"), rows);
}

/// Through the fault proxy (503 SlowDown, resets after the store acted, answers slower
/// than the timeout) every operation still succeeds, a conditional create whose answer was
/// lost is still ours, and each kind of fault really happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_faults_are_retried_and_lost_answers_recognised() {
    let moto = Moto::start();
    moto.create_bucket("spool-faults");
    let proxy = FaultProxy::start(
        &moto.endpoint,
        FaultPlan {
            every_503: 3,
            every_reset: 5,
            every_delay: 7,
            delay: Duration::from_millis(2500),
            ..FaultPlan::default()
        },
    )
    .await;
    let b = s3_bucket(&proxy.endpoint, "s3://spool-faults/p");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("f.bin");
    std::fs::write(&f, vec![7u8; 100_000]).unwrap();
    for i in 0..12 {
        let body = Bytes::from(format!("record {i}"));
        let key = format!("c/{i}.json");
        assert_eq!(b.create(&key, body.clone()).await.unwrap(), Created::Mine);
        assert_eq!(b.get(&key).await.unwrap(), Some(body));
        b.upload(&format!("o/{i}.bin"), &f).await.unwrap();
    }
    assert_eq!(b.list("c/").await.unwrap().len(), 12);
    let c = &proxy.counts;
    let (s, r, d) = (
        c.slowdowns.load(Ordering::SeqCst),
        c.resets.load(Ordering::SeqCst),
        c.delays.load(Ordering::SeqCst),
    );
    assert!(
        s > 0 && r > 0 && d > 0,
        "faults: {s} slowdowns, {r} resets, {d} delays"
    );
    // Creates whose answer was lost, yet reported as ours above (all twelve were Mine).
    let lost = c.lost_creates.load(Ordering::SeqCst);
    assert!(
        lost > 0,
        "no create lost its answer: {s} slowdowns, {r} resets"
    );
}

/// S3 answers a conditional create 409 `ConditionalRequestConflict` while another
/// conditional write to the key is in progress; object_store reports it as "already
/// exists". With nothing in place that is a conflict to try again, not someone else's
/// record (before, an empty "record" that failed to parse): every create through a proxy
/// answering every second conditional create 409 is ours, and one over another's bytes is
/// still theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_create_conflicts_are_tried_again() {
    let moto = Moto::start();
    moto.create_bucket("spool-409");
    let proxy = FaultProxy::start(
        &moto.endpoint,
        FaultPlan {
            every_conflict: 2,
            ..FaultPlan::default()
        },
    )
    .await;
    let b = s3_bucket(&proxy.endpoint, "s3://spool-409/p");
    for i in 0..12 {
        let body = Bytes::from(format!("record {i}"));
        let key = format!("c/{i}.json");
        assert_eq!(b.create(&key, body.clone()).await.unwrap(), Created::Mine);
        assert_eq!(b.get(&key).await.unwrap(), Some(body));
    }
    assert_eq!(
        b.create("c/0.json", Bytes::from("other")).await.unwrap(),
        Created::Theirs(Bytes::from("record 0"))
    );
    let conflicts = proxy.counts.conflicts.load(Ordering::SeqCst);
    assert!(conflicts >= 6, "{conflicts} conflicts answered");
}

/// A store that ignores `If-None-Match` (here a proxy dropping it before moto) would let
/// two workers take one commit number. The worker's start-up probe finds that a second
/// create of one key replaced the first and refuses to run (exit 2, naming the store),
/// with no record written; `finalize` refuses the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_ignores_conditional_creates_is_refused() {
    let moto = Moto::start();
    moto.create_bucket("spool-nocond");
    let proxy = FaultProxy::start(
        &moto.endpoint,
        FaultPlan {
            drop_conditions: true,
            ..FaultPlan::default()
        },
    )
    .await;
    let mock = crate::support::Mock::start(crate::support::fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = crate::cluster::cluster_config(
        dir.path(),
        &mock.url,
        "s3://spool-nocond/run",
        1,
        10,
        100_000,
    );
    let env_owned = Moto::env(&proxy.endpoint);
    let env: Vec<(&str, &str)> = env_owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for args in [&["run", "-q", "--partition", "0"][..], &["finalize"]] {
        let out = crate::process::spool(&cfg, args, &env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("does not honour conditional creates")
                && err.contains("s3://spool-nocond/run"),
            "{args:?}: {err}"
        );
    }
    assert!(proxy.counts.conditional.load(Ordering::SeqCst) >= 2);
    let b = s3_bucket(&moto.endpoint, "s3://spool-nocond/run");
    let objects: Vec<String> = b
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(
        !objects
            .iter()
            .any(|k| k.contains("/commits/") || k.contains("_spool/job/")),
        "{objects:?}"
    );
    assert_eq!(mock.stats().requests, 0, "nothing was generated");
    mock.stop().await;
}
