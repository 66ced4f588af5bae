//! A keep-alive HTTP/1.1 client for whole-body (non-streaming) generation requests to
//! `http://` servers: per server a pool of idle hyper client connections
//! (`hyper::client::conn::http1`), each driven in the calling task while it carries a
//! request. hyper frames everything read from the server — status line, headers,
//! `Content-Length`, `chunked` bodies and their trailers, bodies ended by the connection's
//! end — with RFC 9112's rules: differing duplicate lengths, signed or overflowing numbers,
//! a head or trailers past their bound are errors, never guesses.
//!
//! reqwest's per-request machinery (URL parsing, its retry and redirect layers, the legacy
//! pool's checkout) is a large share of the client's cost with instant responses; hyper's
//! connection API without it, polled in the caller's task instead of a connection task of
//! its own (no channel hop and task wake-up per request), avoids it. Streaming requests,
//! health checks and the start-up probes use reqwest.
//!
//! Invariants: every byte read is bounded — a head by [`HEAD_MAX`] (hyper's limit, which
//! also bounds trailers), a 2xx body by the caller's cap (a larger one is `TooLarge`, a
//! larger announced length refused before any of it is read), an error body by
//! [`ERROR_BODY_MAX`] (cut there, its connection dropped). A connection goes back to its
//! pool only after its answer was read to the end and hyper has it idle and ready for another
//! request; an answer framed both by `Transfer-Encoding` and `Content-Length` (a smuggling
//! shape: what follows it on the connection cannot be trusted) is refused and its
//! connection closed. One idle for
//! over a second is polled before use, so one the server closed or answered unasked (`408`)
//! is dropped, not used. A request on a reused connection that fails before any answer
//! head arrives (a server closing it as idle) is sent once more, at once, on a new
//! connection — at most once per call; nothing else is retried here (attempts are the
//! worker's). A request given up (its future dropped) drops, and so closes, its connection.

use super::{root_cause, UpstreamError};
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST, LOCATION, RETRY_AFTER};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::{Body as _, Frame};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Most bytes of a response head (status line and headers), and of a chunked body's
/// trailers, before the answer is refused.
const HEAD_MAX: usize = 64 << 10;
/// hyper's read buffer bound: a head must fit in it; body bytes pass through it.
const READ_BUF_MAX: usize = 128 << 10;
/// How much of an error body is kept (for its message).
const ERROR_BODY_MAX: u64 = 64 << 10;
/// A connection idle longer than this is polled before it is used: a server's idle
/// timeout (seconds) may have closed it, or sent an unasked answer (`408`) before closing,
/// which must not be read as the next request's. Under load connections idle microseconds
/// and the check (one `recv`) is skipped.
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(1);

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
    /// The parts of a plain `http://` base URL; why not, for anything else.
    fn parse(base: &str) -> Result<Target, String> {
        let rest = base
            .strip_prefix("http://")
            .filter(|_| H1Client::serves(base))
            .ok_or("not a plain http:// URL")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err("no host".into());
        }
        let host = authority
            .parse::<http::uri::Authority>()
            .ok()
            .and_then(|_| HeaderValue::from_str(authority).ok())
            .ok_or("the host is not a valid URL authority")?;
        let prefix = path.trim_end_matches('/').to_string();
        // Every request path is the prefix and one of the API's fixed paths: a prefix that
        // is not a valid path (a space, a CR) would be written into the request line.
        if !prefix.is_empty() && prefix.parse::<http::uri::PathAndQuery>().is_err() {
            return Err("the path has characters a URL cannot hold (percent-encode them)".into());
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
        Ok(Target {
            connect,
            host,
            prefix,
        })
    }

    /// The request target for an API path (`/generate`, …) under the prefix.
    fn uri(&self, path: &'static str) -> Result<Uri, http::uri::InvalidUri> {
        if self.prefix.is_empty() {
            Uri::from_maybe_shared(Bytes::from_static(path.as_bytes()))
        } else {
            Uri::try_from(format!("{}{path}", self.prefix))
        }
    }
}

/// One HTTP/1.1 connection: hyper's handle to send on it and the connection itself, which
/// does the reading and writing whenever it is polled (only by the task using it).
struct Conn {
    tx: http1::SendRequest<Full<Bytes>>,
    conn: http1::Connection<TokioIo<TcpStream>, Full<Bytes>>,
    /// The socket `conn` owns (open for as long as `conn` is), for the idle check.
    fd: RawFd,
}

impl Conn {
    /// Whether the connection can carry a request now: hyper has it idle and wanting one,
    /// and (with `check`) the server has sent nothing on it since — neither its end nor an
    /// unasked answer, either of which means it is being closed.
    fn ready(&mut self, check: bool) -> bool {
        if check {
            quiet(self.fd) && self.settle()
        } else {
            self.tx.is_ready()
        }
    }

    /// Polls hyper's connection once, which moves one whose answer was read into its idle
    /// state (wanting a request) or sees its end; whether it can carry a request. Nothing
    /// waits on this poll, so a connection in the pool wakes no task.
    fn settle(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        if Pin::new(&mut self.conn).poll(&mut cx).is_ready() {
            return false;
        }
        self.tx.is_ready()
    }
}

/// Whether nothing can be read from the socket `fd` now: no bytes, no end. Asked of the
/// kernel itself (a peek that never blocks): tokio's readiness is cached and may not have
/// seen what arrived while the connection was idle.
fn quiet(fd: RawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: `fd` is an open socket for as long as its `Conn` lives (the caller holds it),
    // and `b` is a valid one-byte buffer; MSG_PEEK leaves the byte for hyper.
    let n = unsafe {
        libc::recv(
            fd,
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

/// One server's idle connections.
struct Pool {
    target: Arc<Target>,
    /// Idle connections and since when.
    idle: Vec<(Box<Conn>, Instant)>,
}

/// A response read to the end.
pub(crate) struct Reply {
    pub status: StatusCode,
    /// The `Retry-After` header, for a 429 or 503.
    pub retry_after: Option<HeaderValue>,
    /// The `Location` header, for a redirect.
    pub location: Option<HeaderValue>,
    pub body: Vec<u8>,
}

/// The connection pools of every `http://` server, shared by all workers.
pub(crate) struct H1Client {
    pools: Mutex<HashMap<String, Pool>>,
    /// Idle connections kept per server (the run's concurrency).
    max_idle: usize,
    connect_timeout: Duration,
    /// [`IDLE_CHECK_AFTER`]; zero in tests.
    idle_check_after: Duration,
    /// `Bearer …`, marked sensitive. Never logged.
    authorization: Option<HeaderValue>,
    /// hyper's settings for every connection: the head bound, the read buffer bound.
    builder: http1::Builder,
}

/// How an exchange on one connection ended, when it did not end with a reply.
enum Failure {
    /// The connection failed before an answer's head arrived: on a reused connection the
    /// request goes once more on a new one.
    BeforeAnswer(String),
    /// Anything else: the caller's error as is.
    Other(UpstreamError),
}

impl H1Client {
    pub(crate) fn new(max_idle: usize, connect_timeout: Duration, api_key: Option<&str>) -> Self {
        let authorization = api_key.and_then(|k| {
            let Ok(mut v) = HeaderValue::from_str(&format!("Bearer {k}")) else {
                // The configuration refuses such keys; said here too rather than silently
                // sending every request without one.
                tracing::warn!("the API key is not a valid header value; requests go without it");
                return None;
            };
            v.set_sensitive(true);
            Some(v)
        });
        let mut builder = http1::Builder::new();
        builder.max_header_size(HEAD_MAX).max_buf_size(READ_BUF_MAX);
        H1Client {
            pools: Mutex::new(HashMap::new()),
            max_idle,
            connect_timeout,
            idle_check_after: IDLE_CHECK_AFTER,
            authorization,
            builder,
        }
    }

    /// Whether requests to `base` go through this client (plain `http://`, no user info).
    pub(crate) fn serves(base: &str) -> bool {
        base.starts_with("http://") && !base.contains('@')
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server's target, and an idle connection to it ready for a request (`None` when
    /// there is none).
    fn checkout(&self, base: &str) -> Result<(Arc<Target>, Option<Box<Conn>>), UpstreamError> {
        let mut pools = self.lock();
        if !pools.contains_key(base) {
            let target = Target::parse(base).map_err(|detail| UpstreamError::BadUrl {
                url: base.to_string(),
                detail,
            })?;
            pools.insert(
                base.to_string(),
                Pool {
                    target: Arc::new(target),
                    idle: Vec::new(),
                },
            );
        }
        let Some(pool) = pools.get_mut(base) else {
            unreachable!("inserted above")
        };
        while let Some((mut conn, since)) = pool.idle.pop() {
            if conn.ready(since.elapsed() >= self.idle_check_after) {
                return Ok((pool.target.clone(), Some(conn)));
            }
        }
        Ok((pool.target.clone(), None))
    }

    fn checkin(&self, base: &str, conn: Box<Conn>) {
        if let Some(pool) = self.lock().get_mut(base) {
            if pool.idle.len() < self.max_idle {
                pool.idle.push((conn, Instant::now()));
            }
        }
    }

    async fn connect(&self, base: &str, t: &Target) -> Result<Box<Conn>, UpstreamError> {
        let unreachable = |detail: String| UpstreamError::Connect {
            url: base.to_string(),
            detail,
        };
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&t.connect))
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        // Small requests and answers: never wait for Nagle.
        let _ = stream.set_nodelay(true);
        let fd = stream.as_raw_fd();
        let (tx, conn) = self
            .builder
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(root_cause(&e)))?;
        Ok(Box::new(Conn { tx, conn, fd }))
    }

    /// The request: `POST` of a JSON `body` with the `Host`, the API key and `rid`.
    fn request(
        &self,
        t: &Target,
        path: &'static str,
        rid: &str,
        body: Bytes,
    ) -> Result<Request<Full<Bytes>>, UpstreamError> {
        let uri = t.uri(path).map_err(|e| UpstreamError::BadUrl {
            url: format!("{}{path}", t.prefix),
            detail: e.to_string(),
        })?;
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri;
        let h = req.headers_mut();
        h.insert(HOST, t.host.clone());
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(v) = HeaderValue::from_str(rid) {
            h.insert("x-request-id", v);
        }
        if let Some(a) = &self.authorization {
            h.insert(AUTHORIZATION, a.clone());
        }
        Ok(req)
    }

    /// POSTs a JSON `body` to `base` + `path` and reads the answer to the end, at most `cap`
    /// bytes of it (a larger 2xx body is `TooLarge`; of an error body only the first 64 KiB
    /// are kept, for its message). The caller applies the request timeout.
    pub(crate) async fn post_json(
        &self,
        base: &str,
        path: &'static str,
        rid: &str,
        body: Vec<u8>,
        cap: u64,
    ) -> Result<Reply, UpstreamError> {
        let (t, pooled) = self.checkout(base)?;
        let body = Bytes::from(body);
        let mut reused = pooled.is_some();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect(base, &t).await?,
        };
        loop {
            let req = self.request(&t, path, rid, body.clone())?;
            match exchange(&mut conn, req, cap).await {
                Ok((reply, reusable)) => {
                    if reusable {
                        self.checkin(base, conn);
                    }
                    return Ok(reply);
                }
                // Nearly always a server closing an idle connection while the request was
                // on its way: sent once more on a new connection, as curl does
                // ("Connection died, retrying a fresh connect"). A server that had received
                // it may generate it twice; the item still commits once, and a second
                // failure is the worker's.
                Err(Failure::BeforeAnswer(detail)) if reused => {
                    tracing::debug!(server = %base, error = %detail, "reused connection failed before an answer; once more on a new one");
                    reused = false;
                    conn = self.connect(base, &t).await?;
                }
                Err(Failure::BeforeAnswer(detail)) => return Err(UpstreamError::StreamCut(detail)),
                Err(Failure::Other(e)) => return Err(e),
            }
        }
    }
}

/// What the body's next poll gave, or that the connection ended with the body unfinished.
enum Next {
    Frame(Option<Result<Frame<Bytes>, hyper::Error>>),
    Gone,
}

/// Sends `req` on `c` and reads one answer, polling the connection alongside (hyper does
/// the reading and writing when its connection is polled); the reply, and whether the
/// connection can carry another request.
async fn exchange(
    c: &mut Conn,
    req: Request<Full<Bytes>>,
    cap: u64,
) -> Result<(Reply, bool), Failure> {
    let Conn { tx, conn, .. } = c;
    // `Some` once hyper's connection has ended (closed, or failed).
    let mut ended: Option<hyper::Result<()>> = None;
    let answer = tx.send_request(req);
    let mut answer = std::pin::pin!(answer);
    let head = poll_fn(|cx| {
        if let Poll::Ready(r) = answer.as_mut().poll(cx) {
            return Poll::Ready(r.map_err(head_error));
        }
        if ended.is_none() {
            if let Poll::Ready(r) = Pin::new(&mut *conn).poll(cx) {
                ended = Some(r);
                // An ended connection has given the request its answer or its error.
                return match answer.as_mut().poll(cx) {
                    Poll::Ready(r) => Poll::Ready(r.map_err(head_error)),
                    Poll::Pending => Poll::Ready(Err(Failure::BeforeAnswer(
                        "connection closed before an answer".into(),
                    ))),
                };
            }
        }
        Poll::Pending
    })
    .await?;

    let (parts, mut body) = head.into_parts();
    let status = parts.status;
    let ok = status.is_success();
    let keep = if ok { cap } else { ERROR_BODY_MAX };
    if let Some(e) = super::ambiguous_framing(&parts.headers) {
        return Err(Failure::Other(e));
    }
    let announced = body.size_hint().exact();
    if ok && announced.is_some_and(|n| n > cap) {
        return Err(Failure::Other(UpstreamError::TooLarge(cap)));
    }
    // Up to 1 MiB on the announced length's word: a length is a claim, not bytes.
    let mut out = Vec::with_capacity(announced.map_or(0, |n| n.min(keep).min(1 << 20) as usize));
    let complete = loop {
        let next = poll_fn(|cx| {
            if let Poll::Ready(f) = Pin::new(&mut body).poll_frame(cx) {
                return Poll::Ready(Next::Frame(f));
            }
            if ended.is_none() {
                if let Poll::Ready(r) = Pin::new(&mut *conn).poll(cx) {
                    ended = Some(r);
                    // An ended connection has given the body its end or its error.
                    return Poll::Ready(match Pin::new(&mut body).poll_frame(cx) {
                        Poll::Ready(f) => Next::Frame(f),
                        Poll::Pending => Next::Gone,
                    });
                }
            }
            Poll::Pending
        })
        .await;
        match next {
            Next::Frame(None) => break true,
            Next::Frame(Some(Ok(frame))) => {
                // Trailers are not kept (hyper bounds them by `HEAD_MAX`).
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if (out.len() + data.len()) as u64 > keep {
                    if ok {
                        return Err(Failure::Other(UpstreamError::TooLarge(cap)));
                    }
                    // An error body is only for its message: its start is enough.
                    let room = (keep as usize).saturating_sub(out.len());
                    out.extend_from_slice(&data[..room.min(data.len())]);
                    break false;
                }
                out.extend_from_slice(&data);
            }
            Next::Frame(Some(Err(e))) if ok => {
                return Err(Failure::Other(body_error(&e, ended.as_ref())))
            }
            Next::Gone if ok => {
                return Err(Failure::Other(UpstreamError::StreamCut(
                    "connection closed before the body ended".into(),
                )))
            }
            // What arrived of an error body is enough for its message.
            Next::Frame(Some(Err(_))) | Next::Gone => break false,
        }
    };
    let reusable = complete && ended.is_none() && c.settle();
    Ok((
        Reply {
            status,
            retry_after: parts.headers.get(RETRY_AFTER).cloned(),
            location: parts.headers.get(LOCATION).cloned(),
            body: out,
        },
        reusable,
    ))
}

/// A request that got no answer head: a head hyper refused is `Malformed`; anything else
/// (the connection closed or failed) happened before an answer.
fn head_error(e: hyper::Error) -> Failure {
    if e.is_parse() || e.is_parse_too_large() || e.is_parse_status() {
        Failure::Other(UpstreamError::Malformed(format!(
            "response head: {}",
            root_cause(&e)
        )))
    } else {
        Failure::BeforeAnswer(root_cause(&e))
    }
}

/// A 2xx body that failed half way: a connection's end before the body's is a cut answer;
/// bytes that do not frame a body (a bad chunk size, trailers past their bound) are
/// `Malformed`. `ended`: how hyper's connection ended, which says more than the body's
/// error when it ended with one.
fn body_error(e: &hyper::Error, ended: Option<&hyper::Result<()>>) -> UpstreamError {
    let cause: &(dyn std::error::Error + 'static) = match ended {
        Some(Err(c)) => c,
        _ => e,
    };
    let detail = root_cause(cause);
    let mut kind = None;
    let mut cur = Some(cause);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            kind = Some(io.kind());
            break;
        }
        if let Some(h) = c.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() {
                kind = Some(std::io::ErrorKind::UnexpectedEof);
                break;
            }
        }
        cur = c.source();
    }
    match kind {
        Some(std::io::ErrorKind::UnexpectedEof) => {
            UpstreamError::StreamCut(format!("connection closed before the body ended: {detail}"))
        }
        Some(std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput) => {
            UpstreamError::Malformed(format!("response body: {detail}"))
        }
        _ => UpstreamError::StreamCut(format!("in the body: {detail}")),
    }
}

#[cfg(test)]
mod tests;
