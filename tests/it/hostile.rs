//! A hostile inference server: the real `spool` binary against a raw-socket server that
//! answers every generation request with a canned, malicious byte sequence (broken
//! framing, endless heads, trailers and bodies, smuggled answers, a byte a second,
//! nonsense numbers, SSE quirks, redirects), streaming and not.
//!
//! Every case holds spool to the same promises: nothing in its stderr says `panicked`, the
//! run ends by itself within [`RUN_DEADLINE`] with exit 0 or 3, its peak RSS stays under
//! [`RSS_LIMIT`] with `max_response_bytes` at 8 MiB and 4 requests in flight, `spool
//! verify` is clean, and every row in the shards is one of the prompts. Cases with a
//! definite right answer check it too: streams the event-stream rules allow (a byte-order
//! mark, bare-CR line ends) keep every token of text, framing RFC 9112 calls an
//! unrecoverable error (differing `Content-Length`s, a `+` in a length or chunk size, a
//! garbage status line, a chunk size that does not fit 64 bits) completes nothing, a
//! smuggled second answer never reaches a shard, a connection that carried an answer
//! framed by both `Content-Length` and `Transfer-Encoding` is not used again, ids that do
//! not fit 32 bits are never written wrapped, and a redirect gets one behaviour whether
//! streaming or not.
//!
//! Invariants of the harness: only loopback, port 0; a run that exceeds the memory limit
//! is killed at once (an unbounded buffer must not take the machine down) and fails its
//! case; a run that does not end by the deadline is killed and fails its case, so a hang
//! is a failure, not a stuck suite. The server answers the start-up probe's `GET`s
//! sensibly (health, context length) so the run proceeds to the requests under test (but
//! one case, where only they are hostile); the self-check `POST` meets the hostile answer
//! like any other request.

use crate::process::assert_verify_clean;
use crate::support::{shard_rows, spool_bin, write_prompts};
use spool::store::row::ShardRow;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests in flight.
const CONCURRENCY: usize = 4;
/// `server.max_response_bytes`.
const MAX_RESPONSE_BYTES: u64 = 8 << 20;
/// `server.request_timeout_s`: short, so that slow answers end runs soon.
const REQUEST_TIMEOUT_S: u64 = 2;
/// `server.max_attempts`: one retry, so that failing runs end soon.
const MAX_ATTEMPTS: u32 = 2;
/// Peak RSS a run may reach; more means something buffers without bound.
const RSS_LIMIT: u64 = 250 << 20;
/// A run still going after this hangs: even the slowest case (every attempt timing out)
/// ends in about 10 s, on a loaded machine too.
const RUN_DEADLINE: Duration = Duration::from_secs(30);
/// How long the server keeps an answered-but-abandoned connection open (so the client,
/// not the server, decides when to give up).
const HOLD: Duration = Duration::from_secs(30);
/// The text every legitimate answer carries, in pieces (the stream's deltas).
const PIECES: [&str; 4] = ["Hello", " hostile", " world", "!"];
/// The token ids of [`PIECES`], one per piece.
const IDS: [u32; 4] = [11, 12, 13, 14];
/// The text of the answer a client must never take for its own.
const SMUGGLED: &str = "SMUGGLED";

/// The server's malicious answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// `2\r\nab\r\nfffffffffffffffe\r\n`: a chunk size whose sum with the position
    /// overflows.
    ChunkSizeOverflow,
    /// A chunk of 2^63 − 1 bytes, then bytes that never end.
    HugeChunkSize,
    /// A complete answer in a chunk, then a chunk size of 16^40 (wraps to 0 in u64) and
    /// an empty trailer section: a wrapping parser reads a complete, valid message.
    WrappingChunkSize,
    /// A chunked body, its last chunk, then trailer lines that never end (streaming, the
    /// body is a stream's first event, so the end of the body must be read).
    EndlessTrailers,
    /// A status line, then a header line that never ends.
    EndlessHead,
    /// 200 000 header lines before a valid answer.
    ManyHeaderLines,
    /// `Content-Length: 10000000000`, then bytes until the client hangs up.
    HugeContentLength,
    /// No length, no chunking: a body to the connection's end that never ends.
    EndlessBodyToEof,
    /// `Content-Length` and `Transfer-Encoding: chunked`, and a second answer after the
    /// chunked body in the same write.
    ClTeSmuggle,
    /// `Content-Length` and `Transfer-Encoding: chunked` on a valid answer, and the
    /// connection kept open for the next request.
    ClTeReuse,
    /// Two differing `Content-Length`s; the longer one would read a valid body too.
    DuplicateContentLength,
    /// `Content-Length: +N`: not a valid length (digits only).
    PlusContentLength,
    /// A chunk size `+N`: not a valid chunk size (hex digits only).
    PlusChunkSize,
    /// `HTTP/1.1 2OO OK` before a valid answer.
    GarbageStatusLine,
    /// A valid answer, one byte a second.
    OneByteASecond,
    /// Negative, huge, fractional token counts and ids.
    NonsenseNumbers,
    /// An SSE `data:` line that never ends.
    EndlessSseLine,
    /// A valid stream starting with a byte-order mark.
    SseBom,
    /// A valid stream whose lines end with a bare CR.
    SseCrLineEnds,
    /// A stream whose last event (the one with the finish reason) has no blank line
    /// after it, and no `[DONE]`: the event-stream rules discard it, so the stream never
    /// finished.
    SseUnterminatedLastEvent,
    /// `307` to the same path under `/moved`, where a valid answer waits.
    Redirect,
    /// The start-up probe's `GET`s get a body that never ends; generation requests get
    /// valid answers.
    HostileProbe,
    /// Nothing hostile: the control that shows the harness's answers are valid for each
    /// API, so a failing case fails for its hostility.
    Clean,
    /// Chat answers whose reasoning or tool-call fields have the wrong JSON type
    /// (`reasoning_content: 5`, `tool_calls: "x"`, a streamed call index of -1, a whole
    /// call's name a number, arguments a number).
    WrongTypes,
    /// A chat stream of tool-call fragments that never ends, each event a new call at a
    /// far-apart index: what it holds must be refused at the cap.
    ToolCallFlood,
    /// A legal chat answer with reasoning (both spellings, streamed) and a tool call
    /// before its content: the visible text and every id are kept.
    ReasoningAndTools,
}

/// The API the server speaks (what `server.api` says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Sglang,
    Completions,
    Chat,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Sglang => "sglang",
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
}

// --- The answers ---------------------------------------------------------------------

/// A whole (non-streamed) answer's JSON carrying [`PIECES`] and [`IDS`].
fn whole_body(api: Api, text: &str) -> String {
    let ids = serde_json::json!(IDS);
    let n = IDS.len();
    let v = match api {
        Api::Sglang => serde_json::json!({
            "text": text, "output_ids": ids,
            "meta_info": {"prompt_tokens": 5, "completion_tokens": n, "finish_reason": {"type": "stop"}},
        }),
        Api::Completions => serde_json::json!({
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": n},
        }),
        Api::Chat => serde_json::json!({
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                          "token_ids": ids, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": n},
        }),
    };
    v.to_string()
}

/// The JSON events of a delta stream of [`PIECES`] (SGLang incremental output, or the
/// OpenAI chunks), the last one carrying the finish reason, then usage.
fn stream_events(api: Api) -> Vec<String> {
    let last = PIECES.len() - 1;
    let mut ev: Vec<String> = PIECES
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let fin = (i == last).then_some("stop");
            match api {
                Api::Sglang => serde_json::json!({
                    "text": p, "output_ids": [IDS[i]],
                    "meta_info": {"prompt_tokens": 5, "completion_tokens": i + 1,
                                  "finish_reason": fin.map(|f| serde_json::json!({"type": f}))},
                }),
                Api::Completions => serde_json::json!({
                    "choices": [{"index": 0, "text": p, "token_ids": [IDS[i]], "finish_reason": fin}],
                }),
                Api::Chat => serde_json::json!({
                    "choices": [{"index": 0, "delta": {"content": p}, "token_ids": [IDS[i]],
                                 "finish_reason": fin}],
                }),
            }
            .to_string()
        })
        .collect();
    if api != Api::Sglang {
        ev.push(
            serde_json::json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": PIECES.len()}})
                .to_string(),
        );
    }
    ev
}

/// An SSE body of `events` and `[DONE]`, each line ended by `eol`.
fn sse(events: &[String], eol: &str) -> String {
    let mut s = String::new();
    for e in events.iter().map(String::as_str).chain(["[DONE]"]) {
        s.push_str(&format!("data: {e}{eol}{eol}"));
    }
    s
}

/// A stream's first event alone: a stream that has not ended yet.
fn unfinished_stream(api: Api) -> String {
    format!("data: {}\n\n", stream_events(api)[0])
}

/// The legitimate payload of an answer: a whole JSON body, or a delta stream.
fn payload(api: Api, stream: bool) -> String {
    if stream {
        sse(&stream_events(api), "\n")
    } else {
        whole_body(api, &PIECES.concat())
    }
}

fn content_type(stream: bool) -> &'static str {
    if stream {
        "text/event-stream"
    } else {
        "application/json"
    }
}

/// A complete, well-framed `200` answer carrying `body`.
fn framed(stream: bool, body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n{body}",
        content_type(stream),
        body.len()
    )
}

/// Answers of the nonsense-numbers case, taken in turn.
fn nonsense_bodies(api: Api, stream: bool) -> Vec<String> {
    // Ids and counts that do not fit: 2^32 + 5 (wraps to 5 in u32), negatives,
    // fractions, 2^64, 1e300.
    let variants: Vec<serde_json::Value> = match api {
        Api::Sglang => vec![
            serde_json::json!({"text": "nonsense", "output_ids": [11, 4294967301u64],
                "meta_info": {"id": -1, "prompt_tokens": -7, "completion_tokens": 2, "finish_reason": {"type": "stop"}}}),
            serde_json::json!({"text": "nonsense", "output_ids": [11, 2.5],
                "meta_info": {"prompt_tokens": 1e300, "completion_tokens": -2, "finish_reason": {"type": "stop"}}}),
            serde_json::from_str(r#"{"text": "nonsense", "meta_info": {"prompt_tokens": 18446744073709551616, "completion_tokens": 4294967296, "finish_reason": "stop"}}"#).unwrap(),
            serde_json::json!({"text": "nonsense", "output_ids": [-1, -2],
                "meta_info": {"completion_tokens": 1.5, "finish_reason": "length"}}),
        ],
        Api::Completions | Api::Chat => {
            let choice = |ids: serde_json::Value| {
                if api == Api::Chat {
                    let key = if stream { "delta" } else { "message" };
                    serde_json::json!([{"index": -1, key: {"role": "assistant", "content": "nonsense"},
                        "token_ids": ids, "finish_reason": "stop"}])
                } else {
                    serde_json::json!([{"index": -1, "text": "nonsense", "token_ids": ids, "finish_reason": "stop"}])
                }
            };
            vec![
                serde_json::json!({"id": -1, "choices": choice(serde_json::json!([11, 4294967301u64])),
                    "usage": {"prompt_tokens": -7, "completion_tokens": 2}}),
                serde_json::json!({"choices": choice(serde_json::json!([11, 2.5])),
                    "usage": {"prompt_tokens": 1e300, "completion_tokens": -2}}),
                serde_json::from_str(&format!(
                    r#"{{"choices": {}, "usage": {{"prompt_tokens": 18446744073709551616, "completion_tokens": 4294967296}}}}"#,
                    choice(serde_json::json!([11]))
                ))
                .unwrap(),
                serde_json::json!({"choices": choice(serde_json::json!([-1, -2])),
                    "usage": {"completion_tokens": 1.5}}),
            ]
        }
    };
    variants
        .into_iter()
        .map(|v| {
            let v = v.to_string();
            if stream {
                sse(&[v], "\n")
            } else {
                v
            }
        })
        .collect()
}

// --- The server ----------------------------------------------------------------------

/// What the server saw.
#[derive(Default)]
struct Seen {
    /// Generation requests (the probe's self-check included).
    generations: AtomicUsize,
    /// Requests sent on a connection after an answer framed by both `Content-Length` and
    /// `Transfer-Encoding`.
    after_cl_te: AtomicUsize,
}

/// The hostile server: one thread accepting, one per connection; stopped when dropped.
struct Hostile {
    url: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
}

impl Hostile {
    fn start(case: Case, api: Api, stream: bool) -> Hostile {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Seen::default());
        let (st, se) = (stop.clone(), seen.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let se = se.clone();
                std::thread::spawn(move || serve(conn, case, api, stream, &se));
            }
        });
        Hostile { url, stop, seen }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
    }
}

/// One request's method and path (its body is read and dropped).
struct Request {
    method: String,
    path: String,
}

/// Reads one request (head and `Content-Length` body) from `s`, keeping what follows in
/// `buf`; `None` at the connection's end.
fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Request> {
    let mut tmp = [0u8; 16 << 10];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let mut lines = head.split("\r\n");
            let mut first = lines.next()?.split(' ');
            let method = first.next()?.to_string();
            let path = first.next()?.to_string();
            let len: usize = lines
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse().ok())
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                match s.read(&mut tmp) {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => buf.extend_from_slice(&tmp[..n]),
                }
            }
            buf.drain(..total);
            return Some(Request { method, path });
        }
        if buf.len() > 1 << 20 {
            return None;
        }
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
}

/// Writes `unit` over and over until the client hangs up.
fn write_forever(s: &mut TcpStream, unit: &[u8]) {
    let block = unit.repeat((64 << 10) / unit.len().max(1));
    while s.write_all(&block).is_ok() {}
}

/// Keeps the connection open, reading and dropping whatever comes, until the client
/// hangs up (or [`HOLD`] passes).
fn hold(s: &mut TcpStream) {
    let _ = s.set_read_timeout(Some(HOLD));
    let mut tmp = [0u8; 16 << 10];
    while matches!(s.read(&mut tmp), Ok(n) if n > 0) {}
}

/// The start-up probe's `GET`s, answered as a sane server would.
fn probe_answer(path: &str) -> String {
    let body = match path {
        "/health" => "",
        "/get_model_info" => r#"{"model_path": "mock-model", "context_length": 4096}"#,
        "/v1/models" => r#"{"data": [{"id": "mock-model", "max_model_len": 4096}]}"#,
        _ => {
            return "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                .into()
        }
    };
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Serves one connection: the probe's `GET`s sanely, generation requests by `case`.
fn serve(mut s: TcpStream, case: Case, api: Api, stream: bool, seen: &Seen) {
    // A client that stops reading must not pin this thread for ever.
    let _ = s.set_write_timeout(Some(HOLD));
    let mut buf = Vec::new();
    // Whether this connection carried a generation answer already.
    let mut answered = false;
    while let Some(req) = read_request(&mut s, &mut buf) {
        if req.method == "GET" && case == Case::HostileProbe {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{\"context_length\": ";
            if s.write_all(head.as_bytes()).is_ok() {
                write_forever(&mut s, b"9");
            }
            return;
        }
        if req.method == "GET" {
            let _ = s.write_all(probe_answer(&req.path).as_bytes());
            return;
        }
        if req.path.ends_with("/abort_request") {
            let _ = s.write_all(framed(false, "{}").as_bytes());
            continue;
        }
        let n = seen.generations.fetch_add(1, Ordering::SeqCst);
        if case == Case::ClTeReuse && answered {
            seen.after_cl_te.fetch_add(1, Ordering::SeqCst);
        }
        answered = true;
        let ct = content_type(stream);
        let p = payload(api, stream);
        match case {
            Case::ChunkSizeOverflow => {
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nfffffffffffffffe\r\n",
                        &p[..2]
                    )
                    .as_bytes(),
                );
                return hold(&mut s);
            }
            Case::HugeChunkSize => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nTransfer-Encoding: chunked\r\n\r\n7fffffffffffffff\r\n"
                );
                if s.write_all(head.as_bytes()).is_ok() {
                    write_forever(&mut s, b"a");
                }
                return;
            }
            Case::WrappingChunkSize => {
                // Streaming, the events before the bad size must not end the stream.
                let first = if stream { unfinished_stream(api) } else { p };
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n1{}\r\n\r\n",
                        first.len(),
                        "0".repeat(40)
                    )
                    .as_bytes(),
                );
                return hold(&mut s);
            }
            Case::EndlessTrailers => {
                let p = if stream { unfinished_stream(api) } else { p };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{p}\r\n0\r\n",
                    p.len()
                );
                if s.write_all(head.as_bytes()).is_ok() {
                    write_forever(
                        &mut s,
                        b"X-Trailer: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
                    );
                }
                return;
            }
            Case::EndlessHead => {
                if s.write_all(b"HTTP/1.1 200 OK\r\nX-Endless: ").is_ok() {
                    write_forever(&mut s, b"a");
                }
                return;
            }
            Case::ManyHeaderLines => {
                let mut a = String::from("HTTP/1.1 200 OK\r\n");
                for i in 0..200_000 {
                    a.push_str(&format!("X-Filler-{}: 1\r\n", i % 7));
                }
                a.push_str(&format!(
                    "Content-Type: {ct}\r\nContent-Length: {}\r\n\r\n{p}",
                    p.len()
                ));
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
            }
            Case::HugeContentLength => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: 10000000000\r\n\r\n"
                );
                if s.write_all(head.as_bytes()).is_ok() {
                    write_forever(&mut s, b"a");
                }
                return;
            }
            Case::EndlessBodyToEof => {
                let head =
                    format!("HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nConnection: close\r\n\r\n");
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                if stream {
                    // Small events, each a new delta: what is retained grows, not one line.
                    let mut k = 0u64;
                    loop {
                        k += 1;
                        let ev = match api {
                            Api::Sglang => serde_json::json!({"text": format!("{k:0>1000}"),
                                "meta_info": {"completion_tokens": k, "finish_reason": null}}),
                            _ => {
                                serde_json::json!({"choices": [{"index": 0, "text": format!("{k:0>1000}"),
                                "delta": {"content": format!("{k:0>1000}")}, "finish_reason": null}]})
                            }
                        };
                        if s.write_all(format!("data: {ev}\n\n").as_bytes()).is_err() {
                            return;
                        }
                    }
                }
                let _ = s.write_all(br#"{"text": ""#);
                write_forever(&mut s, b"a");
                return;
            }
            Case::ClTeSmuggle => {
                let chunked = format!("{:x}\r\n{p}\r\n0\r\n\r\n", p.len());
                let second = framed(stream, &smuggled(api, stream));
                let a = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}{second}",
                    chunked.len() + second.len()
                );
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
                // A client that kept the connection gets this server's answers from here
                // on: all of them smuggled.
                while read_request(&mut s, &mut buf).is_some() {
                    if s.write_all(second.as_bytes()).is_err() {
                        return;
                    }
                }
                return;
            }
            Case::ClTeReuse => {
                let chunked = format!("{:x}\r\n{p}\r\n0\r\n\r\n", p.len());
                let a = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}",
                    chunked.len()
                );
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
            }
            Case::PlusContentLength => {
                let a = framed(stream, &p).replacen("Content-Length: ", "Content-Length: +", 1);
                let _ = s.write_all(a.as_bytes());
                return hold(&mut s);
            }
            Case::PlusChunkSize => {
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nTransfer-Encoding: chunked\r\n\r\n+{:x}\r\n{p}\r\n0\r\n\r\n",
                        p.len()
                    )
                    .as_bytes(),
                );
                return hold(&mut s);
            }
            Case::DuplicateContentLength => {
                // Whitespace after a JSON body is still valid JSON: reading by either
                // length gives a complete answer, so only refusing is visible.
                let pad = if stream {
                    "\n".repeat(64)
                } else {
                    " ".repeat(64)
                };
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nContent-Length: {}\r\n\r\n{p}{pad}",
                        p.len(),
                        p.len() + pad.len()
                    )
                    .as_bytes(),
                );
                return hold(&mut s);
            }
            Case::GarbageStatusLine => {
                let a = framed(stream, &p).replacen("HTTP/1.1 200 OK", "HTTP/1.1 2OO OK", 1);
                let _ = s.write_all(a.as_bytes());
                return hold(&mut s);
            }
            Case::OneByteASecond => {
                for b in framed(stream, &p).bytes() {
                    if s.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            Case::NonsenseNumbers => {
                let bodies = nonsense_bodies(api, stream);
                let a = framed(stream, &bodies[n % bodies.len()]);
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
            }
            Case::EndlessSseLine => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nConnection: close\r\n\r\ndata: {{\"text\": \""
                );
                if s.write_all(head.as_bytes()).is_ok() {
                    write_forever(&mut s, b"a");
                }
                return;
            }
            Case::SseBom => {
                let body = format!("\u{feff}{}", sse(&stream_events(api), "\n"));
                if s.write_all(framed(true, &body).as_bytes()).is_err() {
                    return;
                }
            }
            Case::SseCrLineEnds => {
                let body = sse(&stream_events(api), "\r");
                if s.write_all(framed(true, &body).as_bytes()).is_err() {
                    return;
                }
            }
            Case::HostileProbe | Case::Clean => {
                if s.write_all(framed(stream, &p).as_bytes()).is_err() {
                    return;
                }
            }
            Case::SseUnterminatedLastEvent => {
                let mut ev = stream_events(api);
                if api != Api::Sglang {
                    ev.pop(); // the usage event: the finish reason comes last
                }
                let last = ev.pop().unwrap_or_default();
                let mut body: String = ev.iter().map(|e| format!("data: {e}\n\n")).collect();
                body.push_str(&format!("data: {last}"));
                if s.write_all(framed(true, &body).as_bytes()).is_err() {
                    return;
                }
            }
            Case::WrongTypes => {
                let bodies = wrong_type_bodies(stream);
                let a = framed(stream, &bodies[n % bodies.len()]);
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
            }
            Case::ToolCallFlood => {
                let head =
                    format!("HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nConnection: close\r\n\r\n");
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                // A new call every event, indexes far apart, until the client hangs up.
                let mut block = String::new();
                for k in 0u64.. {
                    let index = (k * 7919) % u64::from(u32::MAX);
                    block.push_str(&format!(
                        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{index},\"id\":\"c{k}\",\"function\":{{\"name\":\"f\",\"arguments\":\"{{}}\"}}}}]}}}}]}}\n\n"
                    ));
                    if block.len() >= 64 << 10 {
                        if s.write_all(block.as_bytes()).is_err() {
                            return;
                        }
                        block.clear();
                    }
                }
                return;
            }
            Case::ReasoningAndTools => {
                if s.write_all(framed(stream, &reasoning_and_tools(stream)).as_bytes())
                    .is_err()
                {
                    return;
                }
            }
            Case::Redirect => {
                let a = if req.path.starts_with("/moved/") {
                    framed(stream, &p)
                } else {
                    format!(
                        "HTTP/1.1 307 Temporary Redirect\r\nLocation: /moved{}\r\nContent-Length: 0\r\n\r\n",
                        req.path
                    )
                };
                if s.write_all(a.as_bytes()).is_err() {
                    return;
                }
            }
        }
    }
}

/// The ids of the reasoning of [`Case::ReasoningAndTools`], before [`IDS`].
const THOUGHT_IDS: [u32; 2] = [21, 22];

/// A chat answer with reasoning and a tool call before [`PIECES`]: whole, or streamed
/// with the reasoning in both spellings and the call's arguments in two fragments.
fn reasoning_and_tools(stream: bool) -> String {
    let ids: Vec<u32> = THOUGHT_IDS.iter().chain(&IDS).copied().collect();
    let usage = serde_json::json!({"prompt_tokens": 5, "completion_tokens": ids.len()});
    if !stream {
        return serde_json::json!({"choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids,
            "message": {"role": "assistant", "content": PIECES.concat(), "reasoning_content": "Think hard",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
            "usage": usage})
        .to_string();
    }
    let chunk = |delta: serde_json::Value, ids: &[u32], fin: Option<&str>| {
        serde_json::json!({"choices": [{"index": 0, "delta": delta, "token_ids": ids, "finish_reason": fin}]})
            .to_string()
    };
    let mut ev = vec![
        chunk(
            serde_json::json!({"reasoning_content": "Think"}),
            &THOUGHT_IDS[..1],
            None,
        ),
        chunk(
            serde_json::json!({"reasoning": " hard"}),
            &THOUGHT_IDS[1..],
            None,
        ),
        chunk(
            serde_json::json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}),
            &[],
            None,
        ),
        chunk(
            serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
            &[],
            None,
        ),
    ];
    let last = PIECES.len() - 1;
    for (i, p) in PIECES.iter().enumerate() {
        ev.push(chunk(
            serde_json::json!({"content": p}),
            &IDS[i..=i],
            (i == last).then_some("stop"),
        ));
    }
    ev.push(serde_json::json!({"choices": [], "usage": usage}).to_string());
    sse(&ev, "\n")
}

/// Answers of the wrong-types case, taken in turn.
fn wrong_type_bodies(stream: bool) -> Vec<String> {
    let key = if stream { "delta" } else { "message" };
    [
        serde_json::json!({"content": "x", "reasoning_content": 5}),
        serde_json::json!({"content": "x", "reasoning": {"a": 1}}),
        serde_json::json!({"content": null, "tool_calls": "x"}),
        // Only streamed calls carry an index; a whole one's name is the wrong type.
        if stream {
            serde_json::json!({"content": null, "tool_calls": [{"index": -1, "function": {"name": "f", "arguments": "{}"}}]})
        } else {
            serde_json::json!({"content": null, "tool_calls": [{"function": {"name": 5, "arguments": "{}"}}]})
        },
        serde_json::json!({"content": null, "tool_calls": [{"index": 0, "function": {"name": "f", "arguments": 7}}]}),
    ]
    .into_iter()
    .map(|m| {
        let v = serde_json::json!({"choices": [{"index": 0, key: m, "token_ids": [IDS[0]], "finish_reason": "stop"}]})
            .to_string();
        if stream {
            sse(&[v], "\n")
        } else {
            v
        }
    })
    .collect()
}

/// The smuggled answer: valid in every way, its text [`SMUGGLED`].
fn smuggled(api: Api, stream: bool) -> String {
    if stream {
        let ev = match api {
            Api::Sglang => serde_json::json!({"text": SMUGGLED,
                "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "stop"}}}),
            Api::Completions => {
                serde_json::json!({"choices": [{"index": 0, "text": SMUGGLED, "finish_reason": "stop"}]})
            }
            Api::Chat => {
                serde_json::json!({"choices": [{"index": 0, "delta": {"content": SMUGGLED},
                "finish_reason": "stop"}]})
            }
        };
        sse(&[ev.to_string()], "\n")
    } else {
        whole_body(api, SMUGGLED)
    }
}

// --- The harness ---------------------------------------------------------------------

/// Prompts of a run of `case`. As many as requests in flight, so a failing run is one
/// wave of attempts (spool takes a failing server out of rotation, and each item dispatched
/// while it is out waits for a health probe, seconds apart); twice as many where the case
/// is about what a client does with a connection it used before.
fn prompts(case: Case) -> usize {
    match case {
        Case::ClTeSmuggle | Case::ClTeReuse => 2 * CONCURRENCY,
        _ => CONCURRENCY,
    }
}

/// What one run of `spool run` left.
struct Outcome {
    /// Prompts in the run.
    prompts: usize,
    code: Option<i32>,
    stderr: String,
    rows: Vec<ShardRow>,
    elapsed: Duration,
    /// Requests the client sent on a connection after a `Content-Length` +
    /// `Transfer-Encoding` answer.
    after_cl_te: usize,
}

fn write_config(dir: &Path, url: &str, api: Api, stream: bool) -> PathBuf {
    let s = format!(
        r#"data_dir = "data"
output_dir = "out"

[server]
api = "{api}"
urls = ["{url}"]
model = "mock-model"
stream = {stream}
request_timeout_s = {REQUEST_TIMEOUT_S}
max_attempts = {MAX_ATTEMPTS}
max_response_bytes = {MAX_RESPONSE_BYTES}

[run]
concurrency = {CONCURRENCY}
shutdown_grace_s = 2
metrics_addr = ""

[sampling]
max_tokens = 16

[[dataset]]
name = "hostile"
path = "prompts.jsonl"
"#,
        api = api.name()
    );
    let p = dir.join("spool.toml");
    std::fs::write(&p, s).expect("write config");
    p
}

/// Resident memory of `pid` now, in bytes (0 once it is gone).
fn rss_now(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Runs `spool run` against `url` to its end; kills it (and reports so) past
/// [`RUN_DEADLINE`] or [`RSS_LIMIT`].
// The child is reaped by `wait4` (for its rusage), not by `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run_spool(cfg: &Path, dir: &Path) -> (Option<i32>, u64, String, Duration, Option<String>) {
    let err_path = dir.join("stderr.log");
    let err_file = std::fs::File::create(&err_path).expect("stderr file");
    let child = Command::new(spool_bin())
        .args(["run", "-c"])
        .arg(cfg)
        // A panic's message and place are what a failure report needs, not its frames.
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::from(err_file))
        .spawn()
        .expect("spawn spool");
    let pid = child.id() as i32;
    let started = Instant::now();
    let mut killed = None;
    let (status, ru) = loop {
        let mut status = 0i32;
        // SAFETY: a zeroed rusage is a valid out-parameter for wait4.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: plain syscall on our own child's pid with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        assert!(r >= 0, "wait4 failed");
        if r == pid {
            break (status, ru);
        }
        let rss = rss_now(pid);
        let why = if rss > RSS_LIMIT {
            Some(format!("RSS reached {} MiB", rss >> 20))
        } else if started.elapsed() > RUN_DEADLINE {
            Some(format!("still running after {RUN_DEADLINE:?} (hang)"))
        } else {
            None
        };
        if let Some(why) = why {
            killed = Some(why);
            // SAFETY: signalling our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above; blocking until the killed child is reaped.
            unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
            break (status, ru);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    (code, ru.ru_maxrss as u64 * 1024, stderr, elapsed, killed)
}

/// The last lines of `s`, for failure messages.
fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// A case's own check of a run (`what` names the test in its messages).
type Check = fn(&Outcome, &str);

/// For cases held to the common promises only.
fn no_check(_: &Outcome, _: &str) {}

/// Runs `case` against a fresh queue and asserts the promises every case keeps, then
/// `check` (before `verify`, whose complaints are often a consequence of what `check`
/// names), then `verify`; returns what the run left.
fn run_case(name: &str, case: Case, api: Api, stream: bool, check: Check) -> Outcome {
    let dir = tempfile::tempdir().expect("tempdir");
    let n = prompts(case);
    write_prompts(&dir.path().join("prompts.jsonl"), "h", n);
    let server = Hostile::start(case, api, stream);
    let cfg = write_config(dir.path(), &server.url, api, stream);
    let (code, peak_rss, stderr, elapsed, killed) = run_spool(&cfg, dir.path());
    let what = format!("{name} ({case:?} api={} stream={stream})", api.name());
    let panics: Vec<&str> = stderr.lines().filter(|l| l.contains("panicked")).collect();
    assert!(
        killed.is_none(),
        "{what}: killed: {}; {} panic(s) in its stderr{}; stderr tail:\n{}",
        killed.unwrap_or_default(),
        panics.len(),
        panics
            .first()
            .map(|p| format!(", first: {p}"))
            .unwrap_or_default(),
        tail(&stderr)
    );
    assert!(
        panics.is_empty(),
        "{what}: {} panic(s) in spool's stderr, first: {}",
        panics.len(),
        panics[0]
    );
    assert!(
        matches!(code, Some(0) | Some(3)),
        "{what}: exit {code:?} (want 0 or 3); stderr tail:\n{}",
        tail(&stderr)
    );
    assert!(
        peak_rss < RSS_LIMIT,
        "{what}: peak RSS {} MiB (limit {} MiB)",
        peak_rss >> 20,
        RSS_LIMIT >> 20
    );
    let rows = shard_rows(&dir.path().join("out"), "hostile");
    let ids: Vec<String> = (0..n).map(|i| format!("h{i}")).collect();
    for r in &rows {
        assert!(
            ids.contains(&r.id),
            "{what}: a row for an unknown id {}",
            r.id
        );
    }
    eprintln!(
        "{what}: exit {code:?}, {} of {n} done, peak RSS {} MiB, {:.1} s, {} generation requests",
        rows.len(),
        peak_rss >> 20,
        elapsed.as_secs_f64(),
        server.seen.generations.load(Ordering::SeqCst)
    );
    let o = Outcome {
        prompts: n,
        code,
        stderr,
        rows,
        elapsed,
        after_cl_te: server.seen.after_cl_te.load(Ordering::SeqCst),
    };
    check(&o, &what);
    assert_verify_clean(&cfg);
    o
}

/// No item completes from an answer that is not complete and well framed: framing RFC
/// 9112 calls an unrecoverable error, or a stream that never finished.
fn assert_nothing_completed(o: &Outcome, what: &str) {
    assert!(
        o.rows.is_empty(),
        "{what}: {} item(s) completed from a misframed or unfinished answer, e.g. {:?}",
        o.rows.len(),
        o.rows.first().map(|r| &r.completion)
    );
    assert_eq!(o.code, Some(3), "{what}: every item fails, so exit 3");
}

/// A legal stream: every item completes with every piece of the text and every id.
fn assert_every_token_kept(o: &Outcome, what: &str) {
    assert_eq!(
        o.code,
        Some(0),
        "{what}: a legal stream fails no item; stderr tail:\n{}",
        tail(&o.stderr)
    );
    assert_eq!(o.rows.len(), o.prompts, "{what}: every item completes");
    for r in &o.rows {
        assert_eq!(
            r.completion,
            PIECES.concat(),
            "{what}: text lost in {}",
            r.id
        );
        assert_eq!(
            r.completion_token_ids.as_deref(),
            Some(&IDS[..]),
            "{what}: ids lost in {}",
            r.id
        );
    }
}

// --- The cases -------------------------------------------------------------------------

/// Generates one test per (name, case, api, stream) that runs the case with its own
/// check, if given.
macro_rules! hostile {
    ($($name:ident: $case:ident, $api:ident, $stream:expr $(, $check:expr)?;)*) => {$(
        /// Runs this case against the real binary: no panic, ends by itself with 0 or 3,
        /// peak RSS under the limit, verify clean (and the case's own check, if any).
        #[test]
        fn $name() {
            #[allow(unused_variables)]
            let check: Check = no_check;
            $( let check: Check = $check; )?
            run_case(stringify!($name), Case::$case, Api::$api, $stream, check);
        }
    )*};
}

hostile! {
    chunk_size_overflow_whole: ChunkSizeOverflow, Sglang, false;
    chunk_size_overflow_stream: ChunkSizeOverflow, Sglang, true;
    huge_chunk_size_whole: HugeChunkSize, Sglang, false;
    huge_chunk_size_stream: HugeChunkSize, Sglang, true;
    wrapping_chunk_size_whole: WrappingChunkSize, Sglang, false, assert_nothing_completed;
    wrapping_chunk_size_stream: WrappingChunkSize, Sglang, true, assert_nothing_completed;
    endless_trailers_whole: EndlessTrailers, Sglang, false;
    endless_trailers_stream: EndlessTrailers, Sglang, true;
    endless_head_whole: EndlessHead, Sglang, false, assert_nothing_completed;
    endless_head_stream: EndlessHead, Sglang, true, assert_nothing_completed;
    many_header_lines_whole: ManyHeaderLines, Sglang, false;
    many_header_lines_stream: ManyHeaderLines, Sglang, true;
    huge_content_length_whole: HugeContentLength, Sglang, false, assert_nothing_completed;
    huge_content_length_stream: HugeContentLength, Sglang, true, assert_nothing_completed;
    endless_body_to_eof_whole: EndlessBodyToEof, Sglang, false, assert_nothing_completed;
    endless_body_to_eof_stream: EndlessBodyToEof, Sglang, true, assert_nothing_completed;
    cl_te_smuggle_whole: ClTeSmuggle, Sglang, false, assert_nothing_smuggled;
    cl_te_smuggle_stream: ClTeSmuggle, Sglang, true, assert_nothing_smuggled;
    cl_te_reuse_whole: ClTeReuse, Sglang, false, assert_cl_te_connection_not_reused;
    cl_te_reuse_stream: ClTeReuse, Sglang, true, assert_cl_te_connection_not_reused;
    plus_content_length_whole: PlusContentLength, Sglang, false, assert_nothing_completed;
    plus_content_length_stream: PlusContentLength, Sglang, true, assert_nothing_completed;
    plus_chunk_size_whole: PlusChunkSize, Sglang, false, assert_nothing_completed;
    plus_chunk_size_stream: PlusChunkSize, Sglang, true, assert_nothing_completed;
    duplicate_content_length_whole: DuplicateContentLength, Sglang, false, assert_nothing_completed;
    duplicate_content_length_stream: DuplicateContentLength, Sglang, true, assert_nothing_completed;
    garbage_status_line_whole: GarbageStatusLine, Sglang, false, assert_nothing_completed;
    garbage_status_line_stream: GarbageStatusLine, Sglang, true, assert_nothing_completed;
    one_byte_a_second_whole: OneByteASecond, Sglang, false, assert_ends_by_the_timeouts;
    one_byte_a_second_stream: OneByteASecond, Sglang, true, assert_ends_by_the_timeouts;
    nonsense_numbers_sglang_whole: NonsenseNumbers, Sglang, false, assert_no_wrapped_ids;
    nonsense_numbers_sglang_stream: NonsenseNumbers, Sglang, true, assert_no_wrapped_ids;
    nonsense_numbers_completions_whole: NonsenseNumbers, Completions, false, assert_no_wrapped_ids;
    nonsense_numbers_completions_stream: NonsenseNumbers, Completions, true, assert_no_wrapped_ids;
    nonsense_numbers_chat_whole: NonsenseNumbers, Chat, false, assert_no_wrapped_ids;
    nonsense_numbers_chat_stream: NonsenseNumbers, Chat, true, assert_no_wrapped_ids;
    endless_sse_line_sglang: EndlessSseLine, Sglang, true, assert_nothing_completed;
    endless_sse_line_chat: EndlessSseLine, Chat, true, assert_nothing_completed;
    sse_bom_sglang: SseBom, Sglang, true, assert_every_token_kept;
    sse_bom_completions: SseBom, Completions, true, assert_every_token_kept;
    sse_bom_chat: SseBom, Chat, true, assert_every_token_kept;
    sse_cr_line_ends_sglang: SseCrLineEnds, Sglang, true, assert_every_token_kept;
    sse_cr_line_ends_completions: SseCrLineEnds, Completions, true, assert_every_token_kept;
    sse_cr_line_ends_chat: SseCrLineEnds, Chat, true, assert_every_token_kept;
    sse_unterminated_last_event_sglang: SseUnterminatedLastEvent, Sglang, true, assert_nothing_completed;
    sse_unterminated_last_event_chat: SseUnterminatedLastEvent, Chat, true, assert_nothing_completed;
    clean_sglang_whole: Clean, Sglang, false, assert_every_token_kept;
    clean_sglang_stream: Clean, Sglang, true, assert_every_token_kept;
    clean_completions_whole: Clean, Completions, false, assert_every_token_kept;
    clean_completions_stream: Clean, Completions, true, assert_every_token_kept;
    clean_chat_whole: Clean, Chat, false, assert_every_token_kept;
    clean_chat_stream: Clean, Chat, true, assert_every_token_kept;
    hostile_probe_whole: HostileProbe, Sglang, false, assert_every_token_kept;
    hostile_probe_stream: HostileProbe, Sglang, true, assert_every_token_kept;
    redirect_whole: Redirect, Sglang, false, assert_one_redirect_outcome;
    redirect_stream: Redirect, Sglang, true, assert_one_redirect_outcome;
    wrong_types_chat_whole: WrongTypes, Chat, false, assert_nothing_completed;
    wrong_types_chat_stream: WrongTypes, Chat, true, assert_nothing_completed;
    tool_call_flood_chat: ToolCallFlood, Chat, true, assert_nothing_completed;
    reasoning_and_tools_chat_whole: ReasoningAndTools, Chat, false, assert_visible_text_and_every_id_kept;
    reasoning_and_tools_chat_stream: ReasoningAndTools, Chat, true, assert_visible_text_and_every_id_kept;
}

/// An answer with reasoning and a tool call completes every item; the completion is the
/// visible text only (no reasoning, no call arguments leaked into it), the ids are every
/// id generated, the reasoning's first, and the reasoning and the call have columns of
/// their own.
fn assert_visible_text_and_every_id_kept(o: &Outcome, what: &str) {
    assert_eq!(
        o.code,
        Some(0),
        "{what}: a legal answer fails no item; stderr tail:\n{}",
        tail(&o.stderr)
    );
    assert_eq!(o.rows.len(), o.prompts, "{what}: every item completes");
    let ids: Vec<u32> = THOUGHT_IDS.iter().chain(&IDS).copied().collect();
    for r in &o.rows {
        assert_eq!(r.completion, PIECES.concat(), "{what}: text of {}", r.id);
        assert_eq!(
            r.completion_token_ids.as_deref(),
            Some(&ids[..]),
            "{what}: ids of {}",
            r.id
        );
        assert_eq!(
            r.reasoning.as_deref(),
            Some("Think hard"),
            "{what}: reasoning of {}",
            r.id
        );
        let calls: serde_json::Value =
            serde_json::from_str(r.tool_calls.as_deref().expect("the call is kept")).unwrap();
        assert_eq!(
            calls,
            serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            "{what}: tool calls of {}",
            r.id
        );
    }
}

/// A smuggled second answer never reaches a shard.
fn assert_nothing_smuggled(o: &Outcome, what: &str) {
    let bad: Vec<&str> = o
        .rows
        .iter()
        .filter(|r| r.completion.contains(SMUGGLED))
        .map(|r| r.id.as_str())
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: the smuggled answer was taken as the answer of {bad:?}"
    );
}

/// An answer framed by both `Content-Length` and `Transfer-Encoding` (a smuggling shape,
/// RFC 9112 §6.3) ends its connection: no request follows it there. Whether the answer
/// itself is read (by its chunking) or refused is the client's choice.
fn assert_cl_te_connection_not_reused(o: &Outcome, what: &str) {
    assert_eq!(
        o.after_cl_te, 0,
        "{what}: {} request(s) sent on connections after a Content-Length + Transfer-Encoding answer",
        o.after_cl_te
    );
}

/// Ids that do not fit u32 (2^32 + 5, negatives, fractions) are never written wrapped,
/// truncated or invented: a row's ids are ids the server sent.
fn assert_no_wrapped_ids(o: &Outcome, what: &str) {
    for r in &o.rows {
        if let Some(ids) = &r.completion_token_ids {
            assert!(
                ids.iter().all(|i| IDS.contains(i)),
                "{what}: ids {ids:?} in {} were not sent by the server (wrapped?)",
                r.id
            );
        }
    }
}

/// A byte a second holds no request past its timeout: the run ends within the bound its
/// attempts, timeouts and backoff allow (its waves of requests, two attempts each, up to
/// a second of backoff each, and a few seconds to start, wait for a health probe and
/// finish).
fn assert_ends_by_the_timeouts(o: &Outcome, what: &str) {
    let waves = o.prompts.div_ceil(CONCURRENCY) as u64;
    let bound = Duration::from_secs(waves * u64::from(MAX_ATTEMPTS) * (REQUEST_TIMEOUT_S + 1) + 8);
    assert!(
        o.elapsed < bound,
        "{what}: the run took {:.1} s, over the {bound:?} its timeouts allow",
        o.elapsed.as_secs_f64()
    );
}

/// A redirect is either followed for every item or refused for every item — never a mix.
fn assert_one_redirect_outcome(o: &Outcome, what: &str) {
    assert!(
        o.rows.is_empty() || o.rows.len() == o.prompts,
        "{what}: {} of {} items completed",
        o.rows.len(),
        o.prompts
    );
    if o.rows.is_empty() {
        assert!(
            o.stderr.contains("/moved/"),
            "{what}: a refused redirect names its Location; stderr tail:\n{}",
            tail(&o.stderr)
        );
    }
}

/// A redirect gets one behaviour on every path: streaming and whole-body runs against the
/// same redirecting server complete the same items.
#[test]
fn redirect_is_handled_the_same_streaming_or_not() {
    let name = "redirect_is_handled_the_same_streaming_or_not";
    let whole = run_case(name, Case::Redirect, Api::Sglang, false, no_check);
    let stream = run_case(name, Case::Redirect, Api::Sglang, true, no_check);
    assert_eq!(
        (whole.code, whole.rows.len()),
        (stream.code, stream.rows.len()),
        "redirects: whole-body exit {:?} with {} done, streaming exit {:?} with {} done",
        whole.code,
        whole.rows.len(),
        stream.code,
        stream.rows.len()
    );
}
