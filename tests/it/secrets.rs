//! Secrets never leave: every credential spool sends — the API key, the object store's
//! access key id and session token, the request signatures — stays out of every log line,
//! file, object, `/status` and `status` output, even when an inference server and the
//! object store echo the request's headers back in their error bodies, and wherever an
//! error message is cut.

use crate::process::{spool, Proc};
use crate::s3::Moto;
use crate::support::{fast_mock, write_config, Ds, Mock};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The request's headers as `name: value` lines, the way a debugging server echoes them.
fn header_lines(headers: &axum::http::HeaderMap) -> String {
    headers
        .iter()
        .map(|(k, v)| format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())))
        .collect()
}

/// Forwards a request to `upstream` and returns its answer as it came.
async fn forward(client: &reqwest::Client, upstream: &str, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let url = format!(
        "{upstream}{}",
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let mut up = client.request(parts.method.clone(), &url);
    for (k, v) in &parts.headers {
        if k != "host" && k != "content-length" {
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
    let mut b = Response::builder().status(answer.status());
    let head = parts.method == axum::http::Method::HEAD;
    for (k, v) in answer.headers() {
        if k != "transfer-encoding" && k != "connection" && (head || k != "content-length") {
            b = b.header(k, v);
        }
    }
    let bytes = answer.bytes().await.unwrap_or_default();
    if head {
        return b.body(Body::empty()).unwrap();
    }
    b.header("content-length", bytes.len().to_string())
        .body(Body::from(bytes))
        .unwrap()
}

/// In front of the mock inference server: a prompt with `echo` gets a 401 whose plain-text
/// body echoes every request header, padded so that the 500-character cut of an error
/// message falls 9–12 characters into the API key; the prompt with `hang` is held until
/// released; everything else is the mock's answer.
struct EchoServer {
    url: String,
    echoed: Arc<AtomicU64>,
    release: Arc<tokio::sync::Notify>,
}

struct EchoState {
    upstream: String,
    client: reqwest::Client,
    echoed: Arc<AtomicU64>,
    release: Arc<tokio::sync::Notify>,
}

impl EchoServer {
    async fn start(upstream: &str) -> EchoServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let echoed = Arc::new(AtomicU64::new(0));
        let release = Arc::new(tokio::sync::Notify::new());
        let st = Arc::new(EchoState {
            upstream: upstream.into(),
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            echoed: echoed.clone(),
            release: release.clone(),
        });
        let app = axum::Router::new().fallback(echo_upstream).with_state(st);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        EchoServer {
            url,
            echoed,
            release,
        }
    }
}

async fn echo_upstream(State(st): State<Arc<EchoState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body);
    if text.contains("echo") {
        let n = st.echoed.fetch_add(1, Ordering::SeqCst);
        // "authorization: Bearer " is 22 characters; the key then starts at 488..=491.
        let pad = "x".repeat(488 - 22 + (n % 4) as usize);
        let auth = parts
            .headers
            .get("authorization")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        let mut others = parts.headers.clone();
        others.remove("authorization");
        let echo = format!("{pad}authorization: {auth}\n{}", header_lines(&others));
        return Response::builder()
            .status(401)
            .header("content-type", "text/plain")
            .body(Body::from(echo))
            .unwrap();
    }
    if text.contains("hang") {
        st.release.notified().await;
    }
    forward(
        &st.client,
        &st.upstream,
        Request::from_parts(parts, Body::from(body)),
    )
    .await
}

/// In front of moto: while armed, every third request gets a 400 whose XML body echoes
/// the request the way S3's `SignatureDoesNotMatch` does (the access key id, the signature
/// and the canonical request with every header); records the signatures it saw.
struct EchoStore {
    endpoint: String,
    armed: Arc<AtomicI64>,
    echoed: Arc<AtomicU64>,
    signatures: Arc<Mutex<Vec<String>>>,
    tokens: Arc<Mutex<Vec<String>>>,
}

struct StoreState {
    upstream: String,
    client: reqwest::Client,
    n: AtomicU64,
    armed: Arc<AtomicI64>,
    echoed: Arc<AtomicU64>,
    signatures: Arc<Mutex<Vec<String>>>,
    tokens: Arc<Mutex<Vec<String>>>,
}

impl EchoStore {
    async fn start(upstream: &str) -> EchoStore {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let armed = Arc::new(AtomicI64::new(0));
        let echoed = Arc::new(AtomicU64::new(0));
        let signatures = Arc::new(Mutex::new(Vec::new()));
        let tokens = Arc::new(Mutex::new(Vec::new()));
        let st = Arc::new(StoreState {
            upstream: upstream.into(),
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            n: AtomicU64::new(0),
            armed: armed.clone(),
            echoed: echoed.clone(),
            signatures: signatures.clone(),
            tokens: tokens.clone(),
        });
        let app = axum::Router::new().fallback(echo_store).with_state(st);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        EchoStore {
            endpoint,
            armed,
            echoed,
            signatures,
            tokens,
        }
    }

    /// The next `n` echoes (one request in three) are armed.
    fn arm(&self, n: i64) {
        self.armed.store(n, Ordering::SeqCst);
    }
}

async fn echo_store(State(st): State<Arc<StoreState>>, req: Request) -> Response {
    let auth = req
        .headers()
        .get("authorization")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    if let Some(sig) = auth.split("Signature=").nth(1) {
        st.signatures.lock().unwrap().push(sig.trim().to_string());
    }
    if let Some(t) = req.headers().get("x-amz-security-token") {
        st.tokens
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(t.as_bytes()).into_owned());
    }
    let n = st.n.fetch_add(1, Ordering::SeqCst) + 1;
    if n % 3 == 0 && st.armed.fetch_sub(1, Ordering::SeqCst) > 0 {
        st.echoed.fetch_add(1, Ordering::SeqCst);
        let akid = auth
            .split("Credential=")
            .nth(1)
            .and_then(|c| c.split('/').next())
            .unwrap_or_default();
        let sig = auth.split("Signature=").nth(1).unwrap_or_default();
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the signature you provided.</Message><AWSAccessKeyId>{akid}</AWSAccessKeyId><SignatureProvided>{sig}</SignatureProvided><CanonicalRequest>{} {}\n{}</CanonicalRequest><RequestId>echo</RequestId></Error>",
            req.method(),
            req.uri(),
            header_lines(req.headers()),
        );
        return Response::builder()
            .status(400)
            .header("content-type", "application/xml")
            .body(Body::from(body))
            .unwrap();
    }
    forward(&st.client, &st.upstream, req).await
}

fn random_text(alphabet: &[u8], n: usize) -> String {
    (0..n)
        .map(|_| alphabet[rand::random_range(0..alphabet.len())] as char)
        .collect()
}

/// Appends a command's stdout and stderr to `said`.
fn note(said: &mut String, what: &str, out: &std::process::Output) {
    said.push_str(&format!("\n== {what}\n"));
    said.push_str(&String::from_utf8_lossy(&out.stdout));
    said.push_str(&String::from_utf8_lossy(&out.stderr));
}

/// Every `len`-byte window of `secret`.
fn windows(secret: &str, len: usize) -> Vec<&str> {
    (0..=secret.len().saturating_sub(len))
        .map(|i| &secret[i..i + len])
        .collect()
}

/// Every 8-character piece of each secret, with the secret's name.
fn pieces(secrets: &[(&str, String)]) -> std::collections::HashMap<Vec<u8>, String> {
    let mut m = std::collections::HashMap::new();
    for (name, s) in secrets {
        for w in windows(s, 8) {
            m.insert(w.as_bytes().to_vec(), format!("the {name} (`{w}`)"));
        }
    }
    m
}

/// Where any 8-character piece of any secret was found in `text`.
fn leaks(
    pieces: &std::collections::HashMap<Vec<u8>, String>,
    where_: &str,
    text: &[u8],
) -> Vec<String> {
    let mut found: Vec<String> = text
        .windows(8)
        .filter_map(|w| pieces.get(w))
        .map(|what| format!("{where_}: 8 characters of {what}"))
        .collect();
    found.dedup();
    found.truncate(5);
    found
}

/// One cluster worker against a server and an object store that both echo the request's
/// headers in their error bodies (a 401 from the server, padded so the 500-character cut
/// lands inside the key; the store's `SignatureDoesNotMatch` with the canonical request),
/// then `status` (the live `/status`, `--url`, `--json`, the table), `finalize`, `verify`
/// and a cluster `export` through the same failing store: no 8-character piece of the API
/// key, the access key id, the secret key, the session token or any request signature is
/// in any log line, output, file under the test's folder or object in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credential_leaves_through_echoed_errors() {
    spool::upstream::tls::install_provider();
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start();
    moto.create_bucket("spool-secrets");
    let store = EchoStore::start(&moto.endpoint).await;
    let mock = Mock::start(fast_mock()).await;
    let server = EchoServer::start(&mock.url).await;

    let alnum = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let api_key = format!("sk-live-{}", random_text(b"abcdef0123456789", 40));
    let akid = format!("AKIA{}", random_text(alnum, 16));
    let secret = random_text(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789/+", 40);
    let token = format!(
        "IQoJb3JpZ2luX2Vj{}",
        random_text(b"abcdefghijklmnopqrstuvwxyz0123456789/+=", 300)
    );

    let mut rows = String::new();
    for i in 0..30 {
        let kind = match i {
            5 | 9 | 13 | 17 | 21 | 25 => "echo",
            29 => "hang",
            _ => "plain",
        };
        rows.push_str(&format!(
            "{{\"id\": \"r{i}\", \"prompt\": \"{kind} prompt {i}\"}}\n"
        ));
    }
    std::fs::write(dir.path().join("p.jsonl"), rows).unwrap();
    let cfg = write_config(
        dir.path(),
        &server.url,
        "sglang",
        false,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            "output_dir = \"out\"",
            "output_dir = \"s3://spool-secrets/run\"",
        )
        .replace(
            "metrics_addr = \"\"",
            "metrics_addr = \"127.0.0.1:0\"\npartitions = 1",
        )
        .replace(
            "max_attempts = 4",
            "max_attempts = 2\napi_key_env = \"SPOOL_TEST_API_KEY\"",
        )
        .replace("max_rows = 25", "max_rows = 8");
    std::fs::write(&cfg, text).unwrap();
    let mut env: Vec<(String, String)> = Moto::env(&store.endpoint)
        .into_iter()
        .filter(|(k, _)| k != "AWS_ACCESS_KEY_ID" && k != "AWS_SECRET_ACCESS_KEY")
        .collect();
    env.extend([
        ("AWS_ACCESS_KEY_ID".into(), akid.clone()),
        ("AWS_SECRET_ACCESS_KEY".into(), secret.clone()),
        ("AWS_SESSION_TOKEN".into(), token.clone()),
        ("SPOOL_TEST_API_KEY".into(), api_key.clone()),
    ]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();

    let mut said = String::new();

    store.arm(4);
    let mut worker = Proc::spawn(&cfg, &["run", "-vv", "--partition", "0"], &env);
    // Every echoed item has failed and the hanging one is in flight: look at it live.
    let addr_file = dir.path().join("data").join(spool::run::job::ENDPOINT_FILE);
    let deadline = Instant::now() + Duration::from_secs(60);
    let live = loop {
        assert!(
            Instant::now() < deadline,
            "no live status: {}",
            worker.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(addr) = std::fs::read_to_string(&addr_file) else {
            continue;
        };
        let Ok(r) = reqwest::get(format!("http://{}/status", addr.trim())).await else {
            continue;
        };
        let body = r.text().await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["datasets"][0]["failed"] == 6 && v["datasets"][0]["done"] == 23 {
            break (addr.trim().to_string(), body);
        }
    };
    said.push_str(&live.1);
    let url = format!("http://{}", live.0);
    for args in [
        &["status", "--url", url.as_str(), "--json"][..],
        &["status", "--url", url.as_str()],
        &["status", "--json"],
        &["status"],
    ] {
        let out = spool(&cfg, args, &env);
        note(&mut said, &format!("{args:?}"), &out);
    }
    server.release.notify_waiters();
    let (status, _) = worker.wait(Duration::from_secs(120)).await;
    assert_eq!(status.code(), Some(3), "{}", worker.stderr());
    said.push_str(&worker.stderr());

    // The store's commands meet echoes too; each is run until it succeeds.
    let exp = dir.path().join("exp");
    for args in [
        &["finalize", "--partial", "-vv"][..],
        &["verify", "-vv"],
        &[
            "export",
            "--format",
            "sharegpt",
            "--out",
            exp.join("a.jsonl").to_str().unwrap(),
        ],
        &["status", "--json", "-vv"],
    ] {
        store.arm(1);
        for _ in 0..6 {
            let out = spool(&cfg, args, &env);
            note(&mut said, &format!("{args:?}"), &out);
            if out.status.success() {
                break;
            }
        }
    }
    assert!(
        exp.join("a.jsonl").is_file(),
        "the export never succeeded:\n{said}"
    );
    assert!(
        server.echoed.load(Ordering::SeqCst) >= 6,
        "the server echoed nothing"
    );
    assert!(
        store.echoed.load(Ordering::SeqCst) >= 3,
        "the store echoed nothing"
    );
    assert!(
        store.tokens.lock().unwrap().contains(&token),
        "the session token was not sent"
    );

    let mut secrets: Vec<(&str, String)> = vec![
        ("API key", api_key.clone()),
        ("access key id", akid.clone()),
        ("secret key", secret.clone()),
        ("session token", token.clone()),
    ];
    let mut signatures = store.signatures.lock().unwrap().clone();
    signatures.sort();
    signatures.dedup();
    assert!(!signatures.is_empty());
    for s in &signatures {
        secrets.push(("request signature", s.clone()));
    }
    let secrets = pieces(&secrets);
    let mut found = leaks(&secrets, "output", said.as_bytes());
    for rel in crate::forged::objects(dir.path()) {
        let bytes = std::fs::read(dir.path().join(&rel)).unwrap_or_default();
        found.extend(leaks(&secrets, &rel, &bytes));
    }
    let bucket = crate::s3::s3_bucket(&moto.endpoint, "s3://spool-secrets/run");
    let listed = bucket.list("").await.unwrap();
    assert!(
        listed.iter().any(|(k, _)| k == "_manifest.json"),
        "{listed:?}"
    );
    for (key, _) in &listed {
        let body = bucket.get(key).await.unwrap().unwrap_or_default();
        found.extend(leaks(&secrets, &format!("object {key}"), &body));
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
    assert!(
        said.contains("***"),
        "nothing was redacted: the echoes never reached an error"
    );
    mock.stop().await;
}

/// Keeps the test's helpers honest: a window finds a piece, and only a real one.
#[test]
fn windows_find_every_piece_of_a_secret() {
    let secrets = pieces(&[("key", "abcdefghijkl".to_string())]);
    assert!(leaks(&secrets, "x", b"...cdefghij...").len() == 1);
    assert!(leaks(&secrets, "x", b"...cdefghi...").is_empty());
    assert_eq!(windows("abcdefghij", 8).len(), 3);
}
