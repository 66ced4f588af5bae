//! The HTTP/1.1 client against scripted servers: framing, bounds, pooling and reuse.

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
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}"
        .into()
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
/// and it goes on a new connection). Which case occurs is a race, hence fifty requests;
/// the second one unhandled is "connection closed before message completed".
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

/// A server that answers on an idle connection unasked (a `408` as its idle timeout
/// fires) and closes it: the next request goes on a new connection and gets its own
/// answer, not the stale `408`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unasked_answer_on_an_idle_connection_is_not_taken_for_the_next() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (timed_out, timed_out_rx) = tokio::sync::oneshot::channel();
    let (answered, answered_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut timed_out = Some((answered_rx, timed_out));
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut tmp = [0u8; 4096];
            while !buf.ends_with(b"{}") {
                match sock.read(&mut tmp).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            }
            sock.write_all(ok(0).as_bytes()).await.unwrap();
            if let Some((answered, t)) = timed_out.take() {
                // Once the client has read its answer (so the 408 cannot arrive with it).
                answered.await.unwrap();
                sock.write_all(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
                        .await
                        .unwrap();
                sock.shutdown().await.unwrap();
                t.send(()).unwrap();
            }
        }
    });
    let mut c = client();
    c.idle_check_after = Duration::ZERO;
    let first = c
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(first.status.as_u16(), 200);
    answered.send(()).unwrap();
    timed_out_rx.await.unwrap();
    let second = c
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(
        (second.status.as_u16(), second.body.as_slice()),
        (200, &b"{\"ok\":true}"[..])
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
        format!(
            "HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }
    let (url, _, _) = serve(usize::MAX, busy).await;
    let r = client()
        .post_json(&url, "/v1/completions", "r", b"{}".to_vec(), 1 << 20)
        .await
        .unwrap();
    assert_eq!(r.status.as_u16(), 429);
    assert_eq!(r.retry_after.unwrap(), "2");
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

/// Bodies framed every way a server may frame them read back whole, and only a
/// connection that can carry another request is reused: `Content-Length` and
/// `chunked` (with a chunk extension and a trailer) keep it; `Connection: close` and an
/// HTTP/1.0 body ended by the connection's end do not; a `100 Continue` before the
/// answer is skipped.
#[tokio::test]
async fn answers_are_framed_by_length_chunks_or_the_connection_end() {
    fn chunked(_: usize) -> String {
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4;x=1\r\n{\"ok\r\n7\r\n\":true}\r\n0\r\nx-trailer: 1\r\n\r\n".into()
    }
    fn close(_: usize) -> String {
        "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 11\r\n\r\n{\"ok\":true}".into()
    }
    fn until_end(_: usize) -> String {
        "HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{\"ok\":true}".into()
    }
    fn interim(_: usize) -> String {
        format!("HTTP/1.1 100 Continue\r\n\r\n{}", ok(0))
    }
    // (reply, per-connection answers the server gives, connections for 3 requests)
    type Answer = fn(usize) -> String;
    let cases: [(Answer, usize, usize); 4] = [
        (chunked, usize::MAX, 1),
        (interim, usize::MAX, 1),
        // The server keeps it open, but said it would not.
        (close, usize::MAX, 3),
        (until_end, 1, 3),
    ];
    for (i, (reply, per_conn, want_conns)) in cases.into_iter().enumerate() {
        let (url, conns, _) = serve(per_conn, reply).await;
        let c = client();
        for _ in 0..3 {
            let r = c
                .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
                .await
                .unwrap_or_else(|e| panic!("case {i}: {e}"));
            assert_eq!(
                (r.status.as_u16(), r.body.as_slice()),
                (200, &b"{\"ok\":true}"[..]),
                "case {i}"
            );
        }
        assert_eq!(conns.load(Ordering::SeqCst), want_conns, "case {i}");
    }
}

/// An answer that arrives one byte per segment (head, chunk sizes and body all split
/// anywhere) reads back the same as one that arrives at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_arriving_a_byte_at_a_time_is_read_whole() {
    let replies = [
        ok(0),
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nb\r\n{\"ok\":true}\r\n0\r\n\r\n"
            .to_string(),
    ];
    for reply in replies {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let r2 = reply.clone();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            sock.set_nodelay(true).unwrap();
            let mut buf = Vec::new();
            let mut tmp = [0u8; 4096];
            while !buf.ends_with(b"{}") {
                let n = sock.read(&mut tmp).await.unwrap();
                assert!(n > 0);
                buf.extend_from_slice(&tmp[..n]);
            }
            for b in r2.as_bytes() {
                sock.write_all(std::slice::from_ref(b)).await.unwrap();
                sock.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            // Keeps the connection open until the client is done with it.
            let _ = sock.read(&mut tmp).await;
        });
        let r = client()
            .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
            .await
            .unwrap_or_else(|e| panic!("{reply:?}: {e}"));
        assert_eq!(r.body, b"{\"ok\":true}", "{reply:?}");
    }
}

/// What is not an answer is an error naming what was wrong, never a body: a head that
/// is not HTTP, an answer cut before its `Content-Length`, a chunked 2xx body past the
/// cap.
#[tokio::test]
async fn broken_answers_are_errors_not_bodies() {
    fn not_http(_: usize) -> String {
        "SSH-2.0-OpenSSH_9.6\r\n\r\n".into()
    }
    fn short(_: usize) -> String {
        "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"ok\":".into()
    }
    fn big_chunks(_: usize) -> String {
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n8\r\n01234567\r\n8\r\n89abcdef\r\n0\r\n\r\n".into()
    }
    let (url, _, _) = serve(1, not_http).await;
    let e = client()
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
        .await
        .err();
    assert!(
        matches!(&e, Some(UpstreamError::Malformed(m)) if m.contains("response head")),
        "{e:?}"
    );
    let (url, _, _) = serve(1, short).await;
    let e = client()
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 1 << 20)
        .await
        .err();
    assert!(
        matches!(&e, Some(UpstreamError::StreamCut(m)) if m.contains("before the body ended")),
        "{e:?}"
    );
    let (url, _, _) = serve(usize::MAX, big_chunks).await;
    let c = client();
    let r = c
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 16)
        .await
        .unwrap();
    assert_eq!(r.body, b"0123456789abcdef");
    let e = c
        .post_json(&url, "/generate", "r", b"{}".to_vec(), 12)
        .await
        .err();
    assert!(matches!(e, Some(UpstreamError::TooLarge(12))), "{e:?}");
}

/// A base URL is split once into where to connect, the `Host` header and a path prefix;
/// anything but plain `http://`, and a URL with characters a request line cannot hold,
/// is refused.
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
        // Would be written raw into the request line.
        "http://h:1/a b",
        "http://h:1/a\r\nx: y",
        "http://h h:1",
    ] {
        assert!(Target::parse(no).is_err(), "{no} taken");
    }
}

/// A request to a URL no request line can hold is a permanent error naming the URL,
/// not a server that seems down (which would pause the run for ever).
#[tokio::test]
async fn a_url_a_request_line_cannot_hold_is_a_bad_url() {
    let e = client()
        .post_json("http://127.0.0.1:9/a b", "/generate", "r", vec![], 10)
        .await
        .err();
    assert!(
        matches!(&e, Some(UpstreamError::BadUrl { url, .. }) if url.contains("a b")),
        "{e:?}"
    );
}

/// Reads one request (head and `Content-Length` body) from `sock`; false at its end.
async fn read_request(sock: &mut tokio::net::TcpStream) -> bool {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            if buf.len() >= i + 4 + len {
                return true;
            }
        }
        match sock.read(&mut tmp).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// A hostile loopback server: answers every request with `answer`, then writes `filler`
/// over and over until the client hangs up (an empty `filler` holds the connection open
/// for another request instead); counts connections.
async fn hostile(answer: &'static [u8], filler: &'static [u8]) -> (String, Arc<AtomicUsize>) {
    hostile_seq(Box::leak(Box::new([answer])), filler).await
}

/// [`hostile`] answering the k-th request on a connection with `answers[k]` (the last
/// one for all after).
async fn hostile_seq(
    answers: &'static [&'static [u8]],
    filler: &'static [u8],
) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let conns = Arc::new(AtomicUsize::new(0));
    let c = conns.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut k = 0;
                while read_request(&mut sock).await {
                    let answer = answers[k.min(answers.len() - 1)];
                    k += 1;
                    if sock.write_all(answer).await.is_err() {
                        return;
                    }
                    if !filler.is_empty() {
                        while sock.write_all(filler).await.is_ok() {}
                        return;
                    }
                }
            });
        }
    });
    (url, conns)
}

/// One whole-body request to `url` with a 1 MiB cap, which must end within 20 s (the
/// old hand-written reader looped for ever on several of these answers).
async fn ask(c: &H1Client, url: &str) -> Result<Reply, UpstreamError> {
    tokio::time::timeout(
        Duration::from_secs(20),
        c.post_json(url, "/generate", "r", b"{}".to_vec(), 1 << 20),
    )
    .await
    .expect("the request never ended")
}

/// A chunk size near `u64::MAX` after a first chunk (added unchecked, it slices out of
/// bounds) is refused at the cap, and one past `u64::MAX` is a malformed answer;
/// neither panics.
#[tokio::test]
async fn a_chunk_size_near_u64_max_is_an_error_not_a_panic() {
    let (url, _) = hostile(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\nfffffffffffffffe\r\n",
        &[b'x'; 4096],
    )
    .await;
    let e = ask(&client(), &url).await.err();
    assert!(matches!(e, Some(UpstreamError::TooLarge(_))), "{e:?}");
    let (url, _) = hostile(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n1fffffffffffffffff\r\n",
        b"",
    )
    .await;
    let e = ask(&client(), &url).await.err();
    assert!(matches!(e, Some(UpstreamError::Malformed(_))), "{e:?}");
}

/// Trailer lines that never end after `0\r\n` are refused at a bound (kept, they are
/// gigabytes in seconds), as are a head that never ends and a head of 200 000 header
/// lines.
#[tokio::test]
async fn endless_trailers_and_heads_are_refused_at_a_bound() {
    const ENDLESS: &[u8] = b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    // (answer, what repeats after it forever, a word the error must hold)
    let cases: [(&'static [u8], &'static [u8], &str); 4] = [
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n",
            b"x-trailer: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
            "",
        ),
        // One trailer line that never ends: the bytes' bound, not the lines'.
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-trailer: ",
            ENDLESS,
            "",
        ),
        (b"HTTP/1.1 200 OK\r\nx-endless: ", ENDLESS, "response head"),
        (b"HTTP/1.1 200 OK\r\n", b"a: b\r\n", "response head"),
    ];
    for (answer, filler, word) in cases {
        let (url, _) = hostile(answer, filler).await;
        let e = ask(&client(), &url).await.err();
        assert!(
            matches!(&e, Some(UpstreamError::Malformed(m)) if m.contains(word)),
            "{e:?}"
        );
    }
}

/// A 10 GB `Content-Length` on a 2xx is refused before any of it is read; a 2xx body
/// ended by the connection's end that never ends is cut at the cap; an error body that
/// never ends is kept to its first 64 KiB (for its message) and its connection dropped.
#[tokio::test]
async fn bodies_that_never_end_are_cut_at_their_cap() {
    let (url, _) = hostile(
        b"HTTP/1.1 200 OK\r\ncontent-length: 10737418240\r\n\r\n",
        b"",
    )
    .await;
    let e = ask(&client(), &url).await.err();
    assert!(matches!(e, Some(UpstreamError::TooLarge(_))), "{e:?}");
    let (url, _) = hostile(b"HTTP/1.1 200 OK\r\n\r\n", b"0123456789abcdef").await;
    let e = ask(&client(), &url).await.err();
    assert!(matches!(e, Some(UpstreamError::TooLarge(_))), "{e:?}");
    let (url, conns) = hostile(
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 10737418240\r\n\r\n",
        b"0123456789abcdef",
    )
    .await;
    let c = client();
    for _ in 0..2 {
        let r = ask(&c, &url).await.unwrap();
        assert_eq!((r.status.as_u16(), r.body.len()), (500, 64 << 10));
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        2,
        "a cut body's connection reused"
    );
}

/// Framing no looser than RFC 9112: differing duplicate `Content-Length`s, a `+` sign in
/// a length or a chunk size are malformed answers, not read by a guess.
#[tokio::test]
async fn ambiguous_lengths_are_malformed() {
    let answers: [&'static [u8]; 4] = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2, 11\r\n\r\n{\"ok\":true}",
        b"HTTP/1.1 200 OK\r\ncontent-length: +11\r\n\r\n{\"ok\":true}",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+b\r\n{\"ok\":true}\r\n0\r\n\r\n",
    ];
    for a in answers {
        let (url, _) = hostile(a, b"").await;
        let e = ask(&client(), &url).await.err();
        assert!(
            matches!(e, Some(UpstreamError::Malformed(_))),
            "{}: {e:?}",
            String::from_utf8_lossy(a)
        );
    }
    // Equal duplicates say one thing: read as it.
    let (url, _) = hostile(
        b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
        b"",
    )
    .await;
    assert_eq!(ask(&client(), &url).await.unwrap().body, b"{\"ok\":true}");
}

/// An answer framed by both `Transfer-Encoding` and `Content-Length` is refused as
/// malformed and its connection closed: what the server sends on it next (here a second
/// answer, smuggled in after the first) is never taken for the next request's. An
/// answer on its own with the same chunks is read and keeps its connection.
#[tokio::test]
async fn transfer_encoding_with_content_length_is_refused_and_never_reused() {
    const EVIL: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n{\"evil\":true}";
    let (url, conns) = hostile_seq(
            &[
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\nb\r\n{\"ok\":true}\r\n0\r\n\r\n",
                EVIL,
            ],
            b"",
        )
        .await;
    let c = client();
    for _ in 0..3 {
        let e = ask(&c, &url).await.err();
        assert!(
            matches!(&e, Some(UpstreamError::Malformed(m)) if m.contains("Transfer-Encoding")),
            "{e:?}"
        );
    }
    assert_eq!(conns.load(Ordering::SeqCst), 3);
    // The same without the `Content-Length`: reused, and the next answer is taken.
    let (url, conns) = hostile_seq(
        &[
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nb\r\n{\"ok\":true}\r\n0\r\n\r\n",
            EVIL,
        ],
        b"",
    )
    .await;
    let c = client();
    assert_eq!(ask(&c, &url).await.unwrap().body, b"{\"ok\":true}");
    assert_eq!(ask(&c, &url).await.unwrap().body, b"{\"evil\":true}");
    assert_eq!(conns.load(Ordering::SeqCst), 1);
}

/// A status line that is not one, and a redirect: the first is malformed, the second
/// comes back with its `Location` (the caller refuses it, naming both).
#[tokio::test]
async fn garbage_status_lines_are_malformed_and_redirects_keep_their_location() {
    let (url, _) = hostile(b"HTTP/1.1 2000000 OK\r\ncontent-length: 0\r\n\r\n", b"").await;
    let e = ask(&client(), &url).await.err();
    assert!(
        matches!(&e, Some(UpstreamError::Malformed(m)) if m.contains("response head")),
        "{e:?}"
    );
    let (url, _) = hostile(
            b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://elsewhere.example/generate\r\ncontent-length: 0\r\n\r\n",
            b"",
        )
        .await;
    let r = ask(&client(), &url).await.unwrap();
    assert_eq!(r.status.as_u16(), 307);
    assert_eq!(r.location.unwrap(), "http://elsewhere.example/generate");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    /// Any bytes at all served as the answer to a whole-body request (pieces of HTTP
    /// mixed with noise, then the connection's end): no panic, an error or a body
    /// within its cap, and an end within seconds.
    #[test]
    fn any_answer_bytes_end_in_an_error_or_a_capped_body(pieces in proptest::collection::vec(
        proptest::prop_oneof![
            proptest::strategy::Just(b"HTTP/1.1 200 OK\r\n".to_vec()),
            proptest::strategy::Just(b"HTTP/1.0 500 x\r\n".to_vec()),
            proptest::strategy::Just(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()),
            proptest::strategy::Just(b"content-length: ".to_vec()),
            proptest::strategy::Just(b"transfer-encoding: chunked\r\n".to_vec()),
            proptest::strategy::Just(b"connection: close\r\n".to_vec()),
            proptest::strategy::Just(b"\r\n".to_vec()),
            proptest::strategy::Just(b"0\r\n".to_vec()),
            proptest::strategy::Just(b"fffffffffffffffe".to_vec()),
            proptest::strategy::Just(b"10737418240".to_vec()),
            proptest::strategy::Just(b"+5".to_vec()),
            proptest::strategy::Just(b";ext=1".to_vec()),
            proptest::strategy::Just(b"x-t: v\r\n".to_vec()),
            proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ],
        0..24,
    )) {
        let answer: Vec<u8> = pieces.concat();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            let a = answer.clone();
            tokio::spawn(async move {
                let (mut sock, _) = listener.accept().await.unwrap();
                if read_request(&mut sock).await {
                    let _ = sock.write_all(&a).await;
                }
                let _ = sock.shutdown().await;
                // Until the client hangs up.
                let mut tmp = [0u8; 64];
                let _ = sock.read(&mut tmp).await;
            });
            let cap = 64;
            let r = tokio::time::timeout(
                Duration::from_secs(5),
                client().post_json(&url, "/generate", "r", b"{}".to_vec(), cap),
            )
            .await
            .unwrap_or_else(|_| panic!("no end: {:?}", String::from_utf8_lossy(&answer)));
            if let Ok(r) = r {
                let bound = if r.status.is_success() { cap } else { ERROR_BODY_MAX };
                assert!(r.body.len() as u64 <= bound, "{} bytes", r.body.len());
            }
        });
    }
}
