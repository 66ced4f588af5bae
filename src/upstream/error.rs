//! Why an attempt failed, and how an answer or a transport failure becomes that reason.
//!
//! Invariants: each variant names one condition, and [`UpstreamError::is_retriable`]
//! decides between backoff and a permanent failure from the variant alone (with the status
//! code for `Status`); a connection that could not be made, whether refused or timed out,
//! is [`UpstreamError::Connect`] and burns no attempt.

use std::time::Duration;

/// Characters of a server's error text kept (after redaction): its message, a `Location`.
pub const MESSAGE_CHARS: usize = 500;

/// Why an attempt failed; `is_retriable` decides between backoff and a permanent failure.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made (refused, or the connect timed out): says nothing about
    /// the item, so it burns no attempt.
    #[error("cannot connect to {url}: {detail}")]
    Connect { url: String, detail: String },
    /// No whole answer within `request_timeout_s`.
    #[error("request timed out")]
    Timeout,
    /// A non-2xx answer (or an error object inside a stream), with the server's message.
    #[error("HTTP {code}: {message}")]
    Status {
        code: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    /// The exchange ended before a whole answer arrived: the connection closed or reset
    /// after it was made, or a stream ended without its terminal event.
    #[error("stream cut before the end: {0}")]
    StreamCut(String),
    /// An answer that arrived whole but cannot be read as the dialect's answer.
    #[error("malformed response: {0}")]
    Malformed(String),
    /// An answer past `server.max_response_bytes`, refused rather than buffered.
    #[error("response larger than {0} bytes, refused")]
    TooLarge(u64),
    /// Inference servers do not redirect, and following one to another host would hand it
    /// the API key: a redirect is refused on every path, naming where it pointed.
    #[error("HTTP {code} redirect from {url} to {location} refused: spool does not follow redirects (point server.url at the final address)")]
    Redirect {
        code: u16,
        url: String,
        location: String,
    },
    /// A server URL no request can be made to (a path with a space, an invalid host).
    #[error("cannot request {url}: {detail}")]
    BadUrl { url: String, detail: String },
    /// The HTTP client could not be built (its TLS settings refused): no request can be
    /// made to any server.
    #[error("cannot build the HTTP client: {0}")]
    ClientBuild(String),
    /// A request body serde could not encode: a bug of ours, the same on every attempt.
    #[error("cannot encode the request: {0}")]
    Encode(String),
}

impl UpstreamError {
    /// Transient errors (connection, timeout, 408, 429, 5xx, cut streams, garbled bodies)
    /// are worth another attempt; other 4xx mean the request itself is bad.
    pub fn is_retriable(&self) -> bool {
        match self {
            UpstreamError::Connect { .. }
            | UpstreamError::Timeout
            | UpstreamError::StreamCut(_)
            | UpstreamError::Malformed(_) => true,
            UpstreamError::Status { code, .. } => *code == 408 || *code == 429 || *code >= 500,
            UpstreamError::TooLarge(_)
            | UpstreamError::Redirect { .. }
            | UpstreamError::BadUrl { .. }
            | UpstreamError::ClientBuild(_)
            | UpstreamError::Encode(_) => false,
        }
    }

    /// The server's `Retry-After`, which backoff honours.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            UpstreamError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// A connection that could not be made says nothing about the item: it must not burn
    /// an attempt, and dispatch pauses while every server is down.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. })
    }

    /// The same error with every secret and credential-shaped field in its text replaced
    /// by `***` (a server may echo the request's headers in its error body: the key must
    /// not reach a log line, the queue or `status`), then the server's text cut to
    /// [`MESSAGE_CHARS`] — in that order, so a cut never leaves part of a key.
    pub fn redacted(self, secrets: &crate::secrets::Secrets) -> UpstreamError {
        let r = |s: String| secrets.redact(&s);
        let shown = |s: String| crate::secrets::cut(&secrets.redact(&s), MESSAGE_CHARS);
        match self {
            UpstreamError::Connect { url, detail } => UpstreamError::Connect {
                url: r(url),
                detail: r(detail),
            },
            UpstreamError::Status {
                code,
                message,
                retry_after,
            } => UpstreamError::Status {
                code,
                message: shown(message),
                retry_after,
            },
            UpstreamError::StreamCut(s) => UpstreamError::StreamCut(r(s)),
            UpstreamError::Malformed(s) => UpstreamError::Malformed(r(s)),
            UpstreamError::Redirect {
                code,
                url,
                location,
            } => UpstreamError::Redirect {
                code,
                url: r(url),
                location: shown(location),
            },
            UpstreamError::BadUrl { url, detail } => UpstreamError::BadUrl {
                url: r(url),
                detail: r(detail),
            },
            UpstreamError::ClientBuild(s) => UpstreamError::ClientBuild(r(s)),
            UpstreamError::Encode(s) => UpstreamError::Encode(r(s)),
            e @ (UpstreamError::Timeout | UpstreamError::TooLarge(_)) => e,
        }
    }

    /// Short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect { .. } => "connect",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Status { .. } => "status",
            UpstreamError::StreamCut(_) => "stream_cut",
            UpstreamError::Malformed(_) => "malformed",
            UpstreamError::TooLarge(_) => "too_large",
            UpstreamError::Redirect { .. } => "redirect",
            UpstreamError::BadUrl { .. } => "bad_url",
            UpstreamError::ClientBuild(_) => "client_build",
            UpstreamError::Encode(_) => "encode",
        }
    }
}

/// Classifies a transport error. A connection that could not be made — refused, or a
/// connect *timeout* (a host that is down drops the SYN) — is `Connect`, which burns no
/// attempt; it is checked before `is_timeout`, which a connect timeout also answers, or a
/// dead server would fail items for good (`connect_timeout_is_unreachable_not_a_timeout`).
pub(super) fn map_reqwest(url: &str, e: reqwest::Error) -> UpstreamError {
    if e.is_connect() {
        UpstreamError::Connect {
            url: url.to_string(),
            detail: root_cause(&e),
        }
    } else if e.is_timeout() {
        UpstreamError::Timeout
    } else {
        // A body cut, or a request-level failure after connecting (reset, closed): transient.
        UpstreamError::StreamCut(root_cause(&e))
    }
}

/// RFC 9112 §6.3: an answer with both `Transfer-Encoding` and `Content-Length` may be read
/// by either by a proxy on the way, so what follows it on the connection (a smuggled
/// answer) cannot be trusted; it is handled as an error, which also closes its connection.
pub(super) fn ambiguous_framing(headers: &http::HeaderMap) -> Option<UpstreamError> {
    (headers.contains_key(http::header::TRANSFER_ENCODING)
        && headers.contains_key(http::header::CONTENT_LENGTH))
    .then(|| {
        UpstreamError::Malformed(
            "answer framed by both Transfer-Encoding and Content-Length (a request-smuggling shape); its connection is closed".into(),
        )
    })
}

/// An error with its chain of causes, `: `-separated (reqwest's own text names none).
pub(super) fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// `Retry-After` as RFC 9110 allows it: delay-seconds (fractions tolerated) or an
/// HTTP-date, which counts from `now` (a date already past means "now").
pub(super) fn parse_retry_after(v: &str, now: std::time::SystemTime) -> Option<Duration> {
    let v = v.trim();
    if let Ok(s) = v.parse::<f64>() {
        return (s.is_finite() && s >= 0.0).then(|| Duration::from_secs_f64(s));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// A 3xx answer as the error every path gives it: refused, naming the request's URL and
/// where the server pointed (shown as sent, lossily if it is not text).
pub(super) fn redirect_error(
    code: u16,
    url: &str,
    location: Option<&reqwest::header::HeaderValue>,
) -> UpstreamError {
    // Whole: it is cut only after redaction (`UpstreamError::redacted`).
    let location = location.map_or_else(
        || "(no Location)".to_string(),
        |l| String::from_utf8_lossy(l.as_bytes()).into_owned(),
    );
    UpstreamError::Redirect {
        code,
        url: url.to_string(),
        location,
    }
}

/// A non-2xx answer as an error: the server's message and its `Retry-After`.
pub(super) fn status_error(
    code: u16,
    retry_after: Option<&reqwest::header::HeaderValue>,
    body: &[u8],
) -> UpstreamError {
    UpstreamError::Status {
        code,
        message: error_message(body),
        retry_after: retry_after
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, std::time::SystemTime::now())),
    }
}

/// The human part of an error body: vLLM/OpenAI `{"message"}` or `{"error": {"message"}}`,
/// else the body. Whole: it is cut only after redaction (`UpstreamError::redacted`).
pub(super) fn error_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        let m = v
            .get("message")
            .or_else(|| v.get("error").and_then(|e| e.get("message")))
            .or_else(|| v.get("error"))
            .or_else(|| v.get("detail"));
        if let Some(m) = m {
            return match m.as_str() {
                Some(s) => s.to_string(),
                None => m.to_string(),
            };
        }
    }
    String::from_utf8_lossy(body).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Retry-After as delay-seconds or as an HTTP-date (RFC 9110 §10.2.3), both honoured;
    /// a past date means retry now; garbage is ignored.
    #[test]
    fn retry_after_takes_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Tue, 01 Dec 2026 10:00:00 GMT").unwrap();
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("0.5", now),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 10:00:42 GMT", now),
            Some(Duration::from_secs(42))
        );
        assert_eq!(
            parse_retry_after("Tue, 01 Dec 2026 09:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("-3", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
    }

    /// Transient conditions (timeouts, 408, 429, 5xx) are retried; a bad request, a too
    /// large answer, a redirect and a bad URL are not, and none of them is "unreachable".
    #[test]
    fn retriable_classification() {
        let s = |code| UpstreamError::Status {
            code,
            message: String::new(),
            retry_after: None,
        };
        assert!(s(429).is_retriable() && s(408).is_retriable() && s(503).is_retriable());
        assert!(!s(400).is_retriable() && !s(404).is_retriable());
        assert!(UpstreamError::Timeout.is_retriable());
        assert!(!UpstreamError::TooLarge(1).is_retriable());
        let redirect = UpstreamError::Redirect {
            code: 301,
            url: "http://a/generate".into(),
            location: "http://b/generate".into(),
        };
        let bad = UpstreamError::BadUrl {
            url: "http://a/b c".into(),
            detail: "space".into(),
        };
        for e in [redirect, bad] {
            assert!(!e.is_retriable() && !e.is_unreachable(), "{e}");
        }
    }

    /// A connect *timeout* (a host that is down drops the SYN) is unreachable, not a
    /// request timeout: a dead server must not burn attempts until items fail for good.
    #[tokio::test]
    async fn connect_timeout_is_unreachable_not_a_timeout() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // A backlog of 0 holds one pending connection; later SYNs are dropped, as by a
        // host that is down.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        let addr = listener.local_addr().unwrap();
        let _filler = std::net::TcpStream::connect(addr).unwrap();
        crate::upstream::tls::install_provider();
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_millis(200))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let url = format!("http://{addr}/generate");
        let err = client.get(&url).send().await.unwrap_err();
        let e = map_reqwest(&url, err);
        assert!(e.is_unreachable(), "{e:?}");
    }

    /// The human message is found in vLLM's and OpenAI's error bodies; other bodies are
    /// shown as they are.
    #[test]
    fn error_messages_from_real_server_shapes() {
        let vllm = br#"{"object":"error","message":"This model's maximum context length is 8 tokens.","type":"BadRequestError","code":400}"#;
        assert!(error_message(vllm).starts_with("This model's maximum"));
        let oai = br#"{"error":{"message":"bad thing","type":"invalid_request_error"}}"#;
        assert_eq!(error_message(oai), "bad thing");
        assert_eq!(error_message(b"plain"), "plain");
    }

    /// A key the 500-character cut would split is redacted whole first, in a plain body
    /// and in a JSON message; so is an `Authorization` header of a key not configured.
    #[test]
    fn a_key_at_the_cut_is_redacted_whole() {
        let key = "sk-live-0123456789abcdef";
        let secrets = crate::secrets::Secrets::new([key]);
        for start in 480..500 {
            let text = format!("{}Bearer {key} more", "x".repeat(start - 7));
            let json = serde_json::json!({"error": {"message": text.clone()}}).to_string();
            for body in [text.as_bytes(), json.as_bytes()] {
                let e = status_error(401, None, body).redacted(&secrets);
                let shown = e.to_string();
                assert!(!shown.contains("sk-live-"), "{shown}");
                assert!(shown.chars().count() <= MESSAGE_CHARS + 10, "{shown}");
            }
        }
        let other = status_error(401, None, b"authorization: Bearer sk-other-9999\n");
        assert!(!other
            .redacted(&crate::secrets::Secrets::default())
            .to_string()
            .contains("sk-other"));
    }
}
