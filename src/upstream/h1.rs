//! A keep-alive HTTP/1.1 client for whole-body (non-streaming) generation requests to
//! `http://` servers, on hyper's connection API: per server a pool of idle connections, and
//! per request one `Request` built from parts known in advance.
//!
//! reqwest's per-request machinery — URL parsing and URL → URI conversion, its retry and
//! redirect layers, the legacy pool's checkout, header-map copies — was ~19 % of the
//! client's samples with instant responses (issue 7); this client cut CPU per completion
//! by 27 % (BENCHMARKS.md). Streaming requests, health checks and the start-up probes keep
//! using reqwest.
//!
//! Invariants: a connection goes back to its pool only after its response was read to the
//! end and hyper still has it open; a request on a reused connection that hyper hands back
//! unsent, or whose connection dies before any answer (a server closing it as idle), is
//! sent once more, at once, on a new connection — at most once per call, and nothing else
//! is retried here (attempts are the worker's); no body is buffered past the caller's cap.

use super::{root_cause, UpstreamError};
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Sender = SendRequest<Full<Bytes>>;

/// A server's address split once: where to connect and what to put in each request.
struct Target {
    /// `host:port` to connect to (port 80 when the URL has none).
    connect: String,
    /// The `Host` header.
    host: HeaderValue,
    /// A path prefix of the base URL (`http://h:8000/prefix`), without the trailing `/`.
    prefix: String,
}

impl Target {
    /// `None` for anything but `http://` (left to reqwest).
    fn parse(base: &str) -> Option<Target> {
        if !H1Client::serves(base) {
            return None;
        }
        let rest = base.strip_prefix("http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return None;
        }
        let has_port = match authority.rfind(']') {
            Some(close) => authority[close..].contains(':'),
            None => authority.contains(':'),
        };
        let connect = if has_port {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Some(Target {
            connect,
            host: HeaderValue::from_str(authority).ok()?,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }
}

/// One server's idle connections.
struct Pool {
    target: Arc<Target>,
    idle: Vec<Sender>,
}

/// A response read to the end.
pub(crate) struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

/// The connection pools of every `http://` server, shared by all workers.
pub(crate) struct H1Client {
    pools: Mutex<HashMap<String, Pool>>,
    /// Idle connections kept per server (the run's concurrency).
    max_idle: usize,
    connect_timeout: Duration,
    authorization: Option<HeaderValue>,
}

impl H1Client {
    pub(crate) fn new(max_idle: usize, connect_timeout: Duration, api_key: Option<&str>) -> Self {
        let authorization = api_key.and_then(|k| {
            let mut v = HeaderValue::from_str(&format!("Bearer {k}")).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        H1Client {
            pools: Mutex::new(HashMap::new()),
            max_idle,
            connect_timeout,
            authorization,
        }
    }

    /// Whether requests to `base` go through this client (plain `http://`, no user info).
    pub(crate) fn serves(base: &str) -> bool {
        base.starts_with("http://") && !base.contains('@')
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server's target, and an idle connection to it that hyper still has open (`None`
    /// when there is none); `None` altogether when `base` is not plain `http://`.
    fn checkout(&self, base: &str) -> Option<(Arc<Target>, Option<Sender>)> {
        let mut pools = self.lock();
        if !pools.contains_key(base) {
            let target = Arc::new(Target::parse(base)?);
            pools.insert(
                base.to_string(),
                Pool {
                    target,
                    idle: Vec::new(),
                },
            );
        }
        let pool = pools.get_mut(base)?;
        let mut sender = None;
        while let Some(s) = pool.idle.pop() {
            if !s.is_closed() {
                sender = Some(s);
                break;
            }
        }
        Some((pool.target.clone(), sender))
    }

    fn checkin(&self, base: &str, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        if let Some(pool) = self.lock().get_mut(base) {
            if pool.idle.len() < self.max_idle {
                pool.idle.push(sender);
            }
        }
    }

    async fn connect(&self, base: &str, addr: &str) -> Result<Sender, UpstreamError> {
        let unreachable = |detail: String| UpstreamError::Connect {
            url: base.to_string(),
            detail,
        };
        let stream =
            tokio::time::timeout(self.connect_timeout, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| unreachable("connect timed out".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
        // Small requests and answers: never wait for Nagle.
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| unreachable(root_cause(&e)))?;
        tokio::spawn(async move {
            // Ends when the server or the last `Sender` closes it; nothing to report.
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// POSTs a JSON `body` to `base` + `path` and reads the answer to the end, at most `cap`
    /// bytes of it (a larger 2xx body is `TooLarge`; of an error body only the first 64 KiB
    /// are kept, for its message). The caller applies the request timeout.
    pub(crate) async fn post_json(
        &self,
        base: &str,
        path: &str,
        rid: &str,
        body: Vec<u8>,
        cap: u64,
    ) -> Result<Reply, UpstreamError> {
        let Some((t, pooled)) = self.checkout(base) else {
            return Err(UpstreamError::Connect {
                url: base.to_string(),
                detail: "not an http:// URL".into(),
            });
        };
        let uri = format!("{}{path}", t.prefix);
        let body = Bytes::from(body);
        let request = || {
            let mut b = Request::builder()
                .method(Method::POST)
                .uri(uri.as_str())
                .header(HOST, t.host.clone())
                .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if let Ok(v) = HeaderValue::from_str(rid) {
                b = b.header("x-request-id", v);
            }
            if let Some(a) = &self.authorization {
                b = b.header(AUTHORIZATION, a.clone());
            }
            b.body(Full::new(body.clone()))
                .map_err(|e| UpstreamError::Malformed(format!("request: {e}")))
        };
        let mut reused = pooled.is_some();
        let mut sender = match pooled {
            Some(s) => s,
            None => self.connect(base, &t.connect).await?,
        };
        let response = loop {
            if sender.ready().await.is_err() {
                // Closed while idle: a new connection, as if there had been none.
                if reused {
                    reused = false;
                    sender = self.connect(base, &t.connect).await?;
                    continue;
                }
                return Err(UpstreamError::StreamCut("connection closed".into()));
            }
            match sender.try_send_request(request()?).await {
                Ok(r) => break r,
                // Unsent, or the reused connection died before any answer — nearly always
                // a server closing it as idle while the request was on its way: sent once
                // more on a new connection, as curl does ("Connection died, retrying a
                // fresh connect"). A server that had received it may generate it twice;
                // the item still commits once, and a second failure is the worker's.
                Err(e)
                    if reused && (e.message().is_some() || e.error().is_incomplete_message()) =>
                {
                    reused = false;
                    sender = self.connect(base, &t.connect).await?;
                }
                Err(e) => return Err(UpstreamError::StreamCut(root_cause(e.error()))),
            }
        };
        let (parts, mut incoming) = response.into_parts();
        let ok = parts.status.is_success();
        let content_length = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if ok && content_length.is_some_and(|n| n > cap) {
            return Err(UpstreamError::TooLarge(cap));
        }
        let keep = if ok { cap } else { 64 << 10 };
        let mut out = Vec::with_capacity(content_length.unwrap_or(0).min(keep) as usize);
        let mut complete = true;
        while let Some(frame) = incoming.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) if ok => return Err(UpstreamError::StreamCut(root_cause(&e))),
                // An error body is only for its message: what arrived is enough.
                Err(_) => {
                    complete = false;
                    break;
                }
            };
            if let Ok(chunk) = frame.into_data() {
                if (out.len() + chunk.len()) as u64 > keep {
                    if ok {
                        return Err(UpstreamError::TooLarge(cap));
                    }
                    out.extend_from_slice(&chunk[..(keep as usize).saturating_sub(out.len())]);
                    complete = false;
                    break;
                }
                out.extend_from_slice(&chunk);
            }
        }
        if complete {
            self.checkin(base, sender);
        }
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback server: answers each request with `reply(k)` (k counts requests), and
    /// closes a connection after `per_conn` answers; counts connections and requests.
    async fn serve(
        per_conn: usize,
        reply: fn(usize) -> String,
    ) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (conns, reqs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (c, r) = (conns.clone(), reqs.clone());
        tokio::spawn(async move {
            loop {
                let (mut sock, _) = listener.accept().await.unwrap();
                c.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut tmp = [0u8; 4096];
                    for _ in 0..per_conn {
                        let (head_end, len) = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                                let len = head
                                    .lines()
                                    .find_map(|l| l.strip_prefix("content-length:"))
                                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                                break (i + 4, len);
                            }
                            match sock.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&tmp[..n]),
                            }
                        };
                        while buf.len() < head_end + len {
                            match sock.read(&mut tmp).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&tmp[..n]),
                            }
                        }
                        buf.drain(..head_end + len);
                        let k = r.fetch_add(1, Ordering::SeqCst);
                        if sock.write_all(reply(k).as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    // Closed as a server's idle timeout would: no `Connection: close`.
                    let _ = sock.shutdown().await;
                });
            }
        });
        (url, conns, reqs)
    }

    fn ok(_: usize) -> String {
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}".into()
    }

    fn client() -> H1Client {
        H1Client::new(8, Duration::from_secs(5), Some("sk-test"))
    }

    /// Sequential requests reuse one keep-alive connection: one connection for all.
    #[tokio::test]
    async fn a_connection_is_reused_while_the_server_keeps_it() {
        let (url, conns, reqs) = serve(usize::MAX, ok).await;
        let c = client();
        for _ in 0..20 {
            let r = c
                .post_json(&url, "/v1/completions", "r1", b"{}".to_vec(), 1 << 20)
                .await
                .unwrap();
            assert_eq!(
                (r.status.as_u16(), r.body.as_slice()),
                (200, &b"{\"ok\":true}"[..])
            );
        }
        assert_eq!(
            (conns.load(Ordering::SeqCst), reqs.load(Ordering::SeqCst)),
            (1, 20)
        );
    }

    /// A server that closes each keep-alive connection after its answer (an idle timeout
    /// firing between requests) costs a new connection, never an error: whether hyper has
    /// seen the close before the next request (the pool skips the connection) or only while
    /// sending it (the request comes back unsent, or the connection ends before any answer,
    /// and it goes on a new connection). Without the second case this failed about one run
    /// in five ("connection closed before message completed").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_the_server_closed_while_idle_is_replaced_not_an_error() {
        let (url, conns, reqs) = serve(1, ok).await;
        let c = client();
        for i in 0..50 {
            let r = c
                .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
                .await;
            assert_eq!(
                r.map(|r| r.status.as_u16())
                    .unwrap_or_else(|e| panic!("request {i}: {e}")),
                200
            );
        }
        assert_eq!(
            (conns.load(Ordering::SeqCst), reqs.load(Ordering::SeqCst)),
            (50, 50)
        );
    }

    /// A request given up half way (budget cancel, the request timeout, a hard stop) closes
    /// its connection, which is how an OpenAI-style server learns to stop generating; it
    /// does not go back to the pool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_given_up_closes_its_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (got, got_rx) = tokio::sync::oneshot::channel();
        let (closed, closed_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut tmp = [0u8; 4096];
            while !buf.ends_with(b"{}") {
                let n = sock.read(&mut tmp).await.unwrap();
                assert!(n > 0, "closed before the request arrived");
                buf.extend_from_slice(&tmp[..n]);
            }
            got.send(()).unwrap();
            // Never answers; reports the client hanging up.
            let n = sock.read(&mut tmp).await.unwrap_or(0);
            closed.send(n).unwrap();
        });
        let c = Arc::new(client());
        let c2 = c.clone();
        let u = url.clone();
        let task = tokio::spawn(async move {
            c2.post_json(&u, "/v1/completions", "r", b"{}".to_vec(), 1 << 20)
                .await
        });
        got_rx.await.unwrap();
        task.abort();
        let n = tokio::time::timeout(Duration::from_secs(10), closed_rx)
            .await
            .expect("the connection stayed open after the request was given up")
            .unwrap();
        assert_eq!(n, 0, "EOF, not more bytes");
        assert!(c.lock().get(&url).is_none_or(|p| p.idle.is_empty()));
    }

    /// An error status comes back with its headers and body (for `Retry-After` and the
    /// message); a 2xx body past the cap is refused; nothing listening is `Connect`.
    #[tokio::test]
    async fn errors_keep_their_status_headers_and_body_and_the_cap_holds() {
        fn busy(_: usize) -> String {
            let body = r#"{"object":"error","message":"busy","code":429}"#;
            format!("HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        }
        let (url, _, _) = serve(usize::MAX, busy).await;
        let r = client()
            .post_json(&url, "/v1/completions", "r", b"{}".to_vec(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(r.status.as_u16(), 429);
        assert_eq!(r.headers.get("retry-after").unwrap(), "2");
        assert!(String::from_utf8_lossy(&r.body).contains("busy"));
        let (url, _, _) = serve(usize::MAX, ok).await;
        let e = client()
            .post_json(&url, "/v1/completions", "r", b"{}".to_vec(), 5)
            .await
            .err();
        assert!(matches!(e, Some(UpstreamError::TooLarge(5))), "{e:?}");
        let free = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = client()
            .post_json(&format!("http://{free}"), "/x", "r", vec![], 10)
            .await
            .err();
        assert!(
            e.as_ref().is_some_and(UpstreamError::is_unreachable),
            "{e:?}"
        );
    }

    /// A base URL is split once into where to connect, the `Host` header and a path prefix;
    /// anything but plain `http://` is left to reqwest.
    #[test]
    fn targets_are_split_once_and_only_plain_http_is_taken() {
        let parts = |base: &str| {
            let t = Target::parse(base).unwrap();
            (t.connect, t.host.to_str().unwrap().to_string(), t.prefix)
        };
        assert_eq!(
            parts("http://127.0.0.1:30000"),
            (
                "127.0.0.1:30000".into(),
                "127.0.0.1:30000".into(),
                String::new()
            )
        );
        assert_eq!(
            parts("http://gpu-box/v1proxy/"),
            ("gpu-box:80".into(), "gpu-box".into(), "/v1proxy".into())
        );
        let t = Target::parse("http://[::1]:8000").unwrap();
        assert_eq!(t.connect, "[::1]:8000");
        assert_eq!(Target::parse("http://[::1]").unwrap().connect, "[::1]:80");
        for no in [
            "https://api.example.com",
            "http://",
            "http://u:p@h:1",
            "127.0.0.1:8000",
        ] {
            assert!(Target::parse(no).is_none(), "{no} taken");
        }
    }
}
