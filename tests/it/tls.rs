//! `https://` servers and configs that cannot work, through the real binary.
//!
//! A private CA and server certificates are made here with rcgen; a TLS-terminating
//! front (tokio-rustls, on 127.0.0.1 port 0) forwards each connection to the plain
//! in-process mock. A run through it with `server.ca_cert` completes, streaming and whole;
//! a certificate the client refuses stops the run at start (exit 2) naming TLS, the
//! certificate's fault and the URL; URLs, API keys and CA files that cannot work are
//! refused at start (exit 2) naming the key.

use crate::process::{assert_verify_clean, edit_config};
use crate::support::*;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A CA and a server certificate it signed.
struct Pki {
    ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
}

/// A fresh CA and a certificate from it for `names` (DNS names or IP addresses).
fn pki(names: &[&str]) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "spool test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let cert = rcgen::CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    Pki {
        ca_pem: ca.pem(),
        chain: vec![cert.der().clone()],
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
    }
}

/// A TLS-terminating front for a plain HTTP server, serving until dropped.
struct TlsFront {
    url: String,
    /// Handshakes completed: requests really went over TLS.
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsFront {
    /// Serves `pki`'s certificate on 127.0.0.1 (port 0) and forwards to `backend`
    /// (`http://host:port`).
    async fn start(pki: &Pki, backend: &str) -> TlsFront {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(pki.chain.clone(), PrivateKeyDer::Pkcs8(pki.key.clone_key()))
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let backend = backend.strip_prefix("http://").unwrap().to_string();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let h = handshakes.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, backend, h) = (acceptor.clone(), backend.clone(), h.clone());
                tokio::spawn(async move {
                    // A refused handshake is the client's verdict: just drop the connection.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    h.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut plain) = tokio::net::TcpStream::connect(&backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsFront {
            url,
            handshakes,
            task,
        }
    }
}

/// A config for one dataset of `n` prompts against `url`, with `server_extra` lines in
/// `[server]` (e.g. `ca_cert = "ca.pem"`).
fn setup(dir: &Path, url: &str, stream: bool, n: usize, server_extra: &str) -> PathBuf {
    write_prompts(&dir.join("p.jsonl"), "t", n);
    let cfg = write_config(
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
    );
    edit_config(&cfg, "[run]", &format!("{server_extra}\n[run]"));
    cfg
}

/// `spool <args>` as a child process awaited on the runtime (the mock and the front run
/// on it); a run that has not ended within a minute fails the test instead of hanging it.
async fn spool_async(cfg: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let child = tokio::process::Command::new(spool_bin())
        .args(args)
        .arg("-c")
        .arg(cfg)
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(std::time::Duration::from_secs(60), child)
        .await
        .expect("spool did not end within 60 s")
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// An `https://` server signed by a private CA given as `server.ca_cert` (a path relative
/// to the config): every prompt completes exactly once, streaming and whole (a whole
/// answer from an `https://` server goes through reqwest, not the plain-HTTP client),
/// the requests went over TLS, and `verify` is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_against_https_with_a_private_ca_completes_streaming_and_whole() {
    let pki = pki(&["127.0.0.1", "localhost"]);
    for stream in [true, false] {
        let mock = Mock::start(fast_mock()).await;
        let front = TlsFront::start(&pki, &mock.url).await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
        let cfg = setup(dir.path(), &front.url, stream, 30, "ca_cert = \"ca.pem\"");
        let o = spool_async(&cfg, &["run"], &[]).await;
        assert_eq!(o.status.code(), Some(0), "stream={stream}: {}", stderr(&o));
        let ids: Vec<String> = (0..30).map(|i| format!("t{i}")).collect();
        let rows = shard_rows(&dir.path().join("out"), "a");
        assert_exactly_once(&rows, &ids);
        assert!(
            rows.iter().all(|r| !r.completion.is_empty()),
            "stream={stream}: an empty completion"
        );
        assert!(
            front.handshakes.load(Ordering::SeqCst) >= 1,
            "stream={stream}: no TLS handshake"
        );
        assert!(
            mock.stats().requests >= 30,
            "stream={stream}: {:?}",
            mock.stats()
        );
        assert_verify_clean(&cfg);
    }
}

/// A certificate from a CA the client does not trust (no `server.ca_cert`): the run stops
/// at start with exit 2, naming TLS, the certificate's fault, the URL and the key to set,
/// and no generation request is sent (it is not waited on like a server that is down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_stops_the_run_at_start_naming_the_url() {
    let pki = pki(&["127.0.0.1"]);
    let mock = Mock::start(fast_mock()).await;
    let front = TlsFront::start(&pki, &mock.url).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = setup(dir.path(), &front.url, true, 5, "");
    let o = spool_async(&cfg, &["run"], &[]).await;
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    for part in [
        "TLS",
        "certificate",
        "UnknownIssuer",
        front.url.as_str(),
        "server.ca_cert",
    ] {
        assert!(e.contains(part), "no `{part}` in: {e}");
    }
    assert!(
        !e.contains("cannot connect"),
        "reported as unreachable: {e}"
    );
    assert_eq!(front.handshakes.load(Ordering::SeqCst), 0);
    assert_eq!(mock.stats().requests, 0, "a request reached the server");
}

/// A certificate from the trusted CA but for another host name: exit 2 at start naming
/// TLS, the name mismatch and the URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_stops_the_run_naming_the_url() {
    let pki = pki(&["other.example"]);
    let mock = Mock::start(fast_mock()).await;
    let front = TlsFront::start(&pki, &mock.url).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
    let cfg = setup(dir.path(), &front.url, false, 5, "ca_cert = \"ca.pem\"");
    let o = spool_async(&cfg, &["run"], &[]).await;
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    for part in ["TLS", "not valid for name", front.url.as_str()] {
        assert!(e.contains(part), "no `{part}` in: {e}");
    }
    assert_eq!(mock.stats().requests, 0, "a request reached the server");
}

/// An `https://` URL for a server that speaks plain HTTP: exit 2 at start naming TLS, the
/// URL and the likely cause, not an endless wait for a server that "cannot be reached".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_url_for_a_plain_http_server_stops_the_run_naming_the_url() {
    let mock = Mock::start(fast_mock()).await;
    let url = mock.url.replacen("http://", "https://", 1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = setup(dir.path(), &url, true, 5, "");
    let o = spool_async(&cfg, &["run"], &[]).await;
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    for part in ["TLS", url.as_str(), "plain http://"] {
        assert!(e.contains(part), "no `{part}` in: {e}");
    }
    assert_eq!(mock.stats().requests, 0, "a generation reached the server");
}

/// Through the library: a client trusting the private CA generates over TLS, whole and
/// streaming; one trusting only the system's roots fails with an error naming the URL
/// and the certificate (mid-run, a refused certificate reads as a connection that could
/// not be made: dispatch pauses rather than burning the item's attempts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_client_speaks_tls_with_the_roots_it_is_given() {
    use spool::upstream::tls::TrustRoots;
    use spool::upstream::{GenerateRequest, Upstream, UpstreamOptions};
    let pki = pki(&["127.0.0.1"]);
    let mock = Mock::start(fast_mock()).await;
    let front = TlsFront::start(&pki, &mock.url).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let roots = TrustRoots::Only(spool::upstream::tls::load_ca(&ca).unwrap());
    let opts = |stream| UpstreamOptions {
        api: spool::config::Api::Completions,
        model: "mock-model".into(),
        api_key: None,
        stream,
        request_timeout: std::time::Duration::from_secs(20),
        max_response_bytes: 1 << 20,
        pool_size: 2,
    };
    let sampling = spool::config::Sampling {
        max_tokens: 16,
        ..Default::default()
    };
    let req = GenerateRequest {
        rid: "r1",
        prompt: "Hello",
        prompt_ids: None,
        messages: None,
        sampling: &sampling,
        tools: None,
        chat_template_kwargs: None,
    };
    for stream in [false, true] {
        let up = Upstream::with_roots(opts(stream), &roots).unwrap();
        let g = up.generate(&front.url, &req, &|_| {}).await.unwrap();
        assert!(!g.text.is_empty(), "stream={stream}");
    }
    let system = Upstream::new(opts(false)).unwrap();
    let e = system
        .generate(&front.url, &req, &|_| {})
        .await
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains(&front.url) && shown.contains("certificate"),
        "{shown}"
    );
    assert!(e.is_unreachable(), "{e:?}");
}

/// A config in `dir` against a closed port, for the refusal tests.
fn refusal_config(dir: &Path) -> PathBuf {
    setup(dir, "http://127.0.0.1:9", false, 1, "")
}

/// Every file and folder under `dir`, to show nothing was written.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p.clone());
            }
            v.push(p);
        }
    }
    v.sort();
    v
}

/// URLs that cannot work — a space, a tab, a line break, a control character, a stray
/// `%`, non-ASCII, an unsupported scheme, an upper-case scheme, no host, user info, a
/// query — each exit 2 naming the key (`server.urls[0]`) and why, and write nothing.
#[tokio::test]
async fn urls_that_cannot_work_exit_2_naming_the_key() {
    for (url, why) in [
        ("http://127.0.0.1:9/v 1", "a space"),
        ("http://127.0.0.1:9/v\\t1", "a tab"),
        ("http://127.0.0.1:9/v1\\n", "a line break"),
        ("http://127.0.0.1:9/\\u0001", "control character 0x01"),
        ("http://127.0.0.1:9/100%", "percent-encoding"),
        ("http://hôte:9", "non-ASCII"),
        ("ftp://127.0.0.1:9", "scheme `ftp` is not supported"),
        ("HTTP://127.0.0.1:9", "lower case"),
        ("127.0.0.1:9", "not an http:// or https:// URL"),
        ("http://:9", "host"),
        ("http://user:pw@127.0.0.1:9", "user info"),
        ("http://127.0.0.1:9/?x=1", "query"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = refusal_config(dir.path());
        edit_config(&cfg, "http://127.0.0.1:9", url);
        let before = tree(dir.path());
        let o = spool_async(&cfg, &["run"], &[]).await;
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{url}: {e}");
        assert!(
            e.contains("server.urls[0]") && e.contains(why) && e.contains("spool.toml"),
            "{url}: {e}"
        );
        assert_eq!(tree(dir.path()), before, "{url}: something was written");
    }
}

/// An API key that cannot go into a header (a trailing newline, a space, non-ASCII):
/// exit 2 naming `server.api_key_env` and the variable, and the key itself never shown.
/// (Dropped silently instead, every request would be answered 401.)
#[tokio::test]
async fn api_keys_that_are_not_header_safe_exit_2_without_showing_the_key() {
    for (key, why) in [
        ("sk-SECRET1234\n", "a line break"),
        ("sk-SECRET 1234", "a space"),
        ("sk-SECRET1234é", "non-ASCII"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = refusal_config(dir.path());
        edit_config(
            &cfg,
            "max_attempts = 4",
            "max_attempts = 4\napi_key_env = \"SPOOL_TLS_TEST_KEY\"",
        );
        let o = spool_async(&cfg, &["run"], &[("SPOOL_TLS_TEST_KEY", key)]).await;
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{key:?}: {e}");
        assert!(
            e.contains("server.api_key_env") && e.contains("SPOOL_TLS_TEST_KEY") && e.contains(why),
            "{key:?}: {e}"
        );
        assert!(!e.contains("SECRET"), "the key was shown: {e}");
    }
}

/// `server.ca_cert` naming a missing file, a file that is not PEM, or a PEM file with
/// no certificate in it: exit 2 naming the key and the path, and nothing written.
#[tokio::test]
async fn a_ca_cert_that_is_missing_or_not_pem_exits_2_naming_key_and_path() {
    let key = rcgen::KeyPair::generate().unwrap();
    for (name, contents, why) in [
        ("missing.pem", None, "cannot read"),
        (
            "junk.pem",
            Some("not a certificate\n".to_string()),
            "no PEM certificate",
        ),
        ("key.pem", Some(key.serialize_pem()), "no PEM certificate"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = refusal_config(dir.path());
        edit_config(&cfg, "[run]", &format!("ca_cert = \"certs/{name}\"\n[run]"));
        if let Some(c) = contents {
            std::fs::create_dir(dir.path().join("certs")).unwrap();
            std::fs::write(dir.path().join("certs").join(name), c).unwrap();
        }
        let before = tree(dir.path());
        let o = spool_async(&cfg, &["run"], &[]).await;
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {e}");
        let full = dir.path().join("certs").join(name);
        assert!(
            e.contains("server.ca_cert") && e.contains(&*full.to_string_lossy()) && e.contains(why),
            "{name}: {e}"
        );
        assert_eq!(tree(dir.path()), before, "{name}: something was written");
    }
}
