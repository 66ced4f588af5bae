//! Server-sent events by the WHATWG event-stream rules: one incremental parser for the
//! workers' streams ([`Reader`]) and the start-up self-check ([`data_events`]).
//!
//! The rules kept (HTML, "Interpreting an event stream"): one leading UTF-8 byte-order
//! mark is skipped, at the stream's start only; a line ends at CRLF, LF or a bare CR (a CR
//! that ends a chunk ends its line at once, and an LF opening the next chunk is then the
//! rest of that CRLF, not a blank line); a line opening with `:` is a comment; a line is
//! split at its first `:` into field and value, one space after the colon dropped (no
//! colon: the whole line is the field, the value empty); `data` appends the value and an
//! LF to the event's data, `event` sets its type, `id` sets the last event id unless the
//! value holds a NUL, `retry` is kept when it is all ASCII digits, other fields are
//! ignored; a blank line dispatches the event (its data without the final LF, its type
//! `message` unless set) unless the data is empty; the stream's end discards an event
//! that no blank line ended. Field names are case-sensitive. One deviation: event data
//! that is not UTF-8 is an error rather than decoded with replacement characters, since
//! the payload is JSON (always UTF-8) and a silently altered completion would be stored
//! as if it were what the server produced.
//!
//! Memory is bounded by the cap (`server.max_response_bytes`), not by the bytes streamed:
//! SGLang's default (cumulative) streams resend the whole output in every event, so a
//! legitimate 10k-token completion streams hundreds of MB in total while holding only
//! one event at a time. What is capped is what is held: an unfinished line plus the
//! event being built (a line or an event that never ends is refused at the cap), and
//! the output accumulated so far (the protocol reports it through
//! [`Reader::check_retained`]; an endless stream of small deltas is refused at the cap).
//! Total time is bounded by `request_timeout_s`.
//!
//! Invariants: held bytes never exceed the cap; every byte received is examined once, in
//! place in its chunk (only an unfinished line is copied), so parsing is linear in the
//! bytes received whatever the chunking; the events do not depend on where the chunks
//! split the stream; a body that ends without the caller having seen its terminal event
//! is reported by the caller as a cut stream.

use super::{map_reqwest, UpstreamError};
use bytes::{Buf, Bytes};
use std::time::Instant;

/// Why an event stream was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SseError {
    /// An unfinished line plus the event being built grew past the cap.
    #[error("an SSE line or event holds more than {0} bytes")]
    TooLarge(u64),
    /// The data of a complete event is not UTF-8 (JSON cannot be).
    #[error("SSE event data is not UTF-8")]
    NotUtf8,
}

impl From<SseError> for UpstreamError {
    fn from(e: SseError) -> Self {
        match e {
            SseError::TooLarge(cap) => UpstreamError::TooLarge(cap),
            SseError::NotUtf8 => UpstreamError::Malformed(e.to_string()),
        }
    }
}

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Event {
    /// The `data` lines joined by `\n`.
    pub data: String,
    /// The `event` field, empty for the default type `message`; kept by the rules, though
    /// the protocols spool speaks read only `data`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub event: String,
    /// The last event id at dispatch (it persists across events, as the rules say).
    #[cfg_attr(not(test), allow(dead_code))]
    pub id: String,
}

/// The UTF-8 byte-order mark a stream may open with.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// The incremental event-stream parser: bytes in, in chunks split anywhere; events out.
#[derive(Debug)]
pub(crate) struct Parser {
    /// Bytes of a line whose end has not arrived yet.
    line: Vec<u8>,
    /// The data buffer (each `data` value followed by an LF).
    data: Vec<u8>,
    /// The event type buffer.
    event: Vec<u8>,
    /// The last event id (persists across events).
    last_id: String,
    /// The reconnection time a `retry` field set, in milliseconds.
    retry: Option<u64>,
    /// BOM bytes matched so far while the stream's first bytes are still being looked at.
    bom_matched: usize,
    /// Whether the stream's start is still being checked for a BOM.
    at_start: bool,
    /// The last line ended with a CR at a chunk's end: an LF next completes that CRLF.
    after_cr: bool,
    cap: u64,
}

impl Parser {
    /// A parser holding at most `cap` bytes of unfinished line and event.
    pub(crate) fn new(cap: u64) -> Self {
        Self {
            line: Vec::new(),
            data: Vec::new(),
            event: Vec::new(),
            last_id: String::new(),
            retry: None,
            bom_matched: 0,
            at_start: true,
            after_cr: false,
            cap,
        }
    }

    /// Bytes held: the unfinished line and the event being built.
    pub(crate) fn held(&self) -> usize {
        self.line.len() + self.data.len() + self.event.len() + self.last_id.len()
    }

    /// The reconnection time the stream asked for (kept by the rules; spool does not
    /// reconnect a stream, it retries the request).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn retry(&self) -> Option<u64> {
        self.retry
    }

    /// Reads `input` up to the end of the first event it completes: returns the bytes
    /// consumed and that event, or all of `input` and `None` (an unfinished line is kept
    /// for the next call). Call again with the rest until it is consumed.
    pub(crate) fn feed(&mut self, input: &[u8]) -> Result<(usize, Option<Event>), SseError> {
        let mut pos = 0;
        if self.at_start {
            pos = self.skip_bom(input)?;
            if self.at_start {
                return Ok((pos, None));
            }
        }
        if self.after_cr && pos < input.len() {
            self.after_cr = false;
            if input[pos] == b'\n' {
                pos += 1;
            }
        }
        while pos < input.len() {
            let rest = &input[pos..];
            let Some(i) = memchr::memchr2(b'\n', b'\r', rest) else {
                self.reserve(rest.len())?;
                self.line.extend_from_slice(rest);
                return Ok((input.len(), None));
            };
            pos += i + 1;
            if rest[i] == b'\r' {
                match input.get(pos) {
                    Some(b'\n') => pos += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            // Checked whether or not the line is copied, so that where chunks split the
            // stream never decides whether it is refused.
            self.reserve(i)?;
            let event = if self.line.is_empty() {
                self.process(&rest[..i])?
            } else {
                self.line.extend_from_slice(&rest[..i]);
                let line = std::mem::take(&mut self.line);
                let r = self.process(&line);
                self.line = line;
                self.line.clear();
                r?
            };
            if event.is_some() {
                return Ok((pos, event));
            }
        }
        Ok((pos, None))
    }

    /// Consumes the stream's opening bytes while they match the BOM; on a mismatch the
    /// matched bytes (never a line end) become the start of the first line.
    fn skip_bom(&mut self, input: &[u8]) -> Result<usize, SseError> {
        let mut pos = 0;
        while self.at_start && pos < input.len() {
            if input[pos] == BOM[self.bom_matched] {
                pos += 1;
                self.bom_matched += 1;
                self.at_start = self.bom_matched < BOM.len();
            } else {
                self.at_start = false;
                self.reserve(self.bom_matched)?;
                self.line.extend_from_slice(&BOM[..self.bom_matched]);
            }
        }
        Ok(pos)
    }

    /// Refuses `more` bytes that would take what is held past the cap.
    fn reserve(&self, more: usize) -> Result<(), SseError> {
        if (self.held() + more) as u64 > self.cap {
            return Err(SseError::TooLarge(self.cap));
        }
        Ok(())
    }

    /// One complete line (without its end).
    fn process(&mut self, line: &[u8]) -> Result<Option<Event>, SseError> {
        if line.is_empty() {
            return self.dispatch();
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(0) => return Ok(None),
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                self.reserve(value.len() + 1)?;
                self.data.extend_from_slice(value);
                self.data.push(b'\n');
            }
            b"event" => {
                self.reserve(value.len())?;
                self.event.clear();
                self.event.extend_from_slice(value);
            }
            b"id" if memchr::memchr(0, value).is_none() => {
                self.reserve(value.len())?;
                self.last_id = String::from_utf8_lossy(value).into_owned();
            }
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                self.retry = Some(value.iter().fold(0u64, |n, d| {
                    n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
                }));
            }
            _ => {}
        }
        Ok(None)
    }

    /// A blank line: the event built so far, unless its data is empty.
    fn dispatch(&mut self) -> Result<Option<Event>, SseError> {
        let event = String::from_utf8_lossy(&self.event).into_owned();
        self.event.clear();
        if self.data.is_empty() {
            return Ok(None);
        }
        self.data.pop();
        // The next event gets a buffer of this one's size: one allocation per event, and
        // the data handed out without a copy.
        let next = Vec::with_capacity(self.data.len());
        let data = std::mem::replace(&mut self.data, next);
        let data = String::from_utf8(data).map_err(|_| SseError::NotUtf8)?;
        Ok(Some(Event {
            data,
            event,
            id: self.last_id.clone(),
        }))
    }
}

/// Every event of a whole SSE body; an event the body does not finish is discarded.
pub(crate) fn events(body: &[u8], cap: u64) -> Result<Vec<Event>, SseError> {
    let mut parser = Parser::new(cap);
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (used, ev) = parser.feed(rest)?;
        rest = &rest[used..];
        out.extend(ev);
    }
    Ok(out)
}

/// The data of every event of a whole SSE body (the start-up self-check reads its answer
/// whole).
pub(crate) fn data_events(body: &[u8], cap: u64) -> Result<Vec<String>, SseError> {
    Ok(events(body, cap)?.into_iter().map(|e| e.data).collect())
}

/// Pulls event data out of a streaming response, one event at a time.
pub(crate) struct Reader {
    resp: reqwest::Response,
    /// What is left of the last chunk received (it may hold further events).
    chunk: Bytes,
    parser: Parser,
    cap: u64,
    started: Instant,
    /// Milliseconds from request start to the first content event (set by the protocol).
    pub ttft_ms: Option<u32>,
    url: String,
}

impl Reader {
    /// Reads `resp`'s body as events, holding at most `cap` bytes of line and event;
    /// `started` is the request's start (for the time to first token), `url` names the
    /// server in transport errors.
    pub(crate) fn new(resp: reqwest::Response, cap: u64, started: Instant, url: String) -> Self {
        Self {
            resp,
            chunk: Bytes::new(),
            parser: Parser::new(cap),
            cap,
            started,
            ttft_ms: None,
            url,
        }
    }

    /// Marks the first token's arrival (once).
    pub(crate) fn mark_first_token(&mut self) {
        if self.ttft_ms.is_none() {
            self.ttft_ms = Some(self.started.elapsed().as_millis().min(u32::MAX as u128) as u32);
        }
    }

    /// Refuses the response once the output accumulated from it (`bytes`, as the protocol
    /// counts it) exceeds the cap.
    pub(crate) fn check_retained(&self, bytes: usize) -> Result<(), UpstreamError> {
        if bytes as u64 > self.cap {
            return Err(UpstreamError::TooLarge(self.cap));
        }
        Ok(())
    }

    /// The next event's data (several `data:` lines joined by `\n`), or `None` at the end
    /// of the body (an event the body did not finish is discarded).
    pub(crate) async fn next_event(&mut self) -> Result<Option<String>, UpstreamError> {
        loop {
            let (used, ev) = self.parser.feed(&self.chunk)?;
            self.chunk.advance(used);
            if let Some(ev) = ev {
                return Ok(Some(ev.data));
            }
            match self
                .resp
                .chunk()
                .await
                .map_err(|e| map_reqwest(&self.url, e))?
            {
                Some(chunk) => self.chunk = chunk,
                None => return Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BIG: u64 = 1 << 30;

    /// Events of `chunks` fed one after the other to one parser.
    fn parse_chunks(chunks: &[&[u8]], cap: u64) -> Result<Vec<Event>, SseError> {
        let mut p = Parser::new(cap);
        let mut out = Vec::new();
        for c in chunks {
            let mut rest = *c;
            loop {
                let (used, ev) = p.feed(rest)?;
                assert!(p.held() as u64 <= cap);
                rest = &rest[used..];
                out.extend(ev);
                if rest.is_empty() {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn data(body: &[u8]) -> Vec<String> {
        data_events(body, BIG).unwrap()
    }

    fn ev(data: &str, event: &str, id: &str) -> Event {
        Event {
            data: data.into(),
            event: event.into(),
            id: id.into(),
        }
    }

    /// The spec's first example: events split by blank lines, two `data` lines joined by LF.
    #[test]
    fn spec_example_messages() {
        let body = b"data: This is the first message.\n\ndata: This is the second message, it\ndata: has two lines.\n\ndata: This is the third message.\n\n";
        assert_eq!(
            data(body),
            [
                "This is the first message.",
                "This is the second message, it\nhas two lines.",
                "This is the third message."
            ]
        );
    }

    /// The spec's example with `event` types: each event carries its own, reset after it.
    #[test]
    fn spec_example_event_types() {
        let body = b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n";
        assert_eq!(
            events(body, BIG).unwrap(),
            [
                ev("73857293", "add", ""),
                ev("2153", "remove", ""),
                ev("113411", "add", "")
            ]
        );
    }

    /// The spec's example of `data` with no colon: an empty value; the unfinished last
    /// event is discarded.
    #[test]
    fn spec_example_data_without_colon() {
        assert_eq!(data(b"data\n\ndata\ndata\n\ndata:"), ["", "\n"]);
    }

    /// The spec's example: one space after the colon is dropped, no space is fine.
    #[test]
    fn spec_example_one_space_dropped() {
        assert_eq!(data(b"data:test\n\ndata: test\n\n"), ["test", "test"]);
        assert_eq!(data(b"data:  two\n\n"), [" two"]);
        assert_eq!(data(b"data: a:b\n\n"), ["a:b"]);
    }

    /// Streams of the web-platform tests' `format-*` cases for EventSource, with the data
    /// the browsers must deliver: field names matched exactly (NUL, case, a leading space
    /// or `-`/`_` make another field), values kept byte for byte past the one space.
    #[test]
    fn web_platform_format_cases() {
        let body = b"data:\0\ndata:  2\rData:1\ndata\0:2\ndata:1\r\0data:4\nda-ta:3\rdata_5\ndata:3\rdata:\r\n data:32\ndata:4\n\n";
        assert_eq!(data(body), ["\0\n 2\n1\n3\n\n4"]);
        assert_eq!(
            data(b"data:test\r\ndata\ndata:test\r\n\r"),
            ["test\n\ntest"]
        );
        assert_eq!(
            data(b"data:\ttest\rdata: \ndata:test\n\n"),
            ["\ttest\n\ntest"]
        );
        assert_eq!(data(b"data:\0\n\n"), ["\0"]);
        assert_eq!(
            events(b"event: \ndata:data\n\n", BIG).unwrap(),
            [ev("data", "", "")]
        );
        assert_eq!(
            events(b"id:1\0\ndata:x\n\n", BIG).unwrap(),
            [ev("x", "", "")]
        );
        assert_eq!(
            data(b"retry:1000\ndata:test1\n\nid:test\ndata:test2"),
            ["test1"]
        );
    }

    /// A leading BOM is skipped; a second one, or one later in the stream, is not a BOM
    /// but part of a field name (so that line is ignored).
    #[test]
    fn bom_is_skipped_once_at_the_start_only() {
        assert_eq!(data(b"\xEF\xBB\xBFdata: a\n\n"), ["a"]);
        assert!(data(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\n").is_empty());
        assert_eq!(
            data(b"data: a\n\n\xEF\xBB\xBFdata: b\n\ndata: c\n\n"),
            ["a", "c"]
        );
        // Split anywhere inside the BOM.
        let chunks: [&[u8]; 4] = [b"\xEF", b"\xBB", b"\xBFdata:", b" a\n\n"];
        assert_eq!(parse_chunks(&chunks, BIG).unwrap()[0].data, "a");
        // A start that only looks like a BOM for a byte is kept as line content.
        assert!(data(b"\xEFdata: a\n\n").is_empty());
        assert_eq!(data(b"\xEF\ndata: a\n\n"), ["a"]);
    }

    /// LF, CRLF and a bare CR each end a line, mixed freely.
    #[test]
    fn every_line_end_ends_a_line() {
        for body in [
            &b"data: a\ndata: b\n\ndata: c\n\n"[..],
            b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",
            b"data: a\rdata: b\r\rdata: c\r\r",
            b"data: a\rdata: b\r\n\ndata: c\n\r",
        ] {
            assert_eq!(data(body), ["a\nb", "c"], "{body:?}");
        }
    }

    /// A CR ending a chunk ends its line at once, and an LF opening the next chunk is the
    /// rest of that CRLF, not a blank line (which would split the event).
    #[test]
    fn a_crlf_split_across_chunks_is_one_line_end() {
        let chunks: [&[u8]; 3] = [b"data: a\r", b"\ndata: b\r", b"\n\r\n"];
        assert_eq!(parse_chunks(&chunks, BIG).unwrap(), [ev("a\nb", "", "")]);
        // A blank line ended by a CR dispatches without waiting for the next byte.
        let mut p = Parser::new(BIG);
        assert_eq!(p.feed(b"data: x\r").unwrap(), (8, None));
        assert_eq!(p.feed(b"\r").unwrap(), (1, Some(ev("x", "", ""))));
        // Then an LF is the second half of that CRLF: no further blank line.
        assert_eq!(p.feed(b"\ndata: y\n\n").unwrap().1, Some(ev("y", "", "")));
    }

    /// Comments are ignored, whether alone, between `data` lines or empty.
    #[test]
    fn comments_are_ignored() {
        assert!(data(b": keep-alive\n\n:\n\n").is_empty());
        assert_eq!(data(b"data: a\n: note\ndata: b\n\n"), ["a\nb"]);
    }

    /// `id` persists across events, is ignored when it holds a NUL, and an `id` with no
    /// value resets it; `retry` is kept only when all digits; unknown fields and field
    /// names in another case are ignored.
    #[test]
    fn id_retry_and_unknown_fields() {
        let body = b"id: 7\ndata: a\n\ndata: b\n\nid: x\0y\ndata: c\n\nid\ndata: d\n\n";
        let got = events(body, BIG).unwrap();
        let ids: Vec<&str> = got.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["7", "7", "7", ""]);
        let mut p = Parser::new(BIG);
        p.feed(b"retry: 1500\n").unwrap();
        assert_eq!(p.retry(), Some(1500));
        p.feed(b"retry: 15x\nretry:\n").unwrap();
        assert_eq!(p.retry(), Some(1500));
        assert_eq!(data(b"foo: bar\nData: x\nDATA: y\ndata: z\n\n"), ["z"]);
    }

    /// An event with no `data` is not dispatched, and its type does not leak into the next.
    #[test]
    fn an_event_without_data_is_not_dispatched() {
        assert_eq!(
            events(b"event: ping\n\ndata: x\n\n", BIG).unwrap(),
            [ev("x", "", "")]
        );
        assert!(data(b"id: 1\n\n\n\n").is_empty());
    }

    /// The stream's end discards an event no blank line finished, with or without its
    /// last line end.
    #[test]
    fn an_unterminated_last_event_is_discarded() {
        assert_eq!(data(b"data: a\n\ndata: b\n"), ["a"]);
        assert_eq!(data(b"data: a\n\ndata: b"), ["a"]);
        assert_eq!(data(b"data: a\n\ndata: b\r"), ["a"]);
    }

    /// A line that never ends, and an event whose lines never stop, are refused at the
    /// cap, holding no more than it.
    #[test]
    fn endless_lines_and_events_are_refused_at_the_cap() {
        let mut p = Parser::new(1000);
        let piece = [b'x'; 100];
        let mut refused = false;
        for _ in 0..20 {
            match p.feed(&piece) {
                Ok(_) => assert!(p.held() <= 1000),
                Err(e) => {
                    assert_eq!(e, SseError::TooLarge(1000));
                    refused = true;
                    break;
                }
            }
        }
        assert!(refused);
        let lines = b"data: 0123456789\n".repeat(100);
        assert_eq!(events(&lines, 1000), Err(SseError::TooLarge(1000)));
        // A line exactly at the cap is fine (the cap counts whole lines, field included).
        assert_eq!(data_events(b"data: abc\n\n", 9).unwrap(), ["abc"]);
        assert_eq!(data_events(b"data: abc\n\n", 8), Err(SseError::TooLarge(8)));
        // So is an event exactly at it: held are the data so far and the line being read.
        assert_eq!(data_events(b"data: a\ndata: b\n\n", 9).unwrap(), ["a\nb"]);
        assert_eq!(
            data_events(b"data: a\ndata: b\n\n", 8),
            Err(SseError::TooLarge(8))
        );
    }

    /// Event data that is not UTF-8 is refused, not decoded with replacement characters.
    #[test]
    fn data_not_utf8_is_refused() {
        assert_eq!(events(b"data: \xFF\n\n", BIG), Err(SseError::NotUtf8));
        // Field names and comments are not data.
        assert_eq!(data(b": \xFF\nid: \xFF\ndata: ok\n\n"), ["ok"]);
    }

    /// Serves one request on a loopback listener: reads it whole, then answers 200 with
    /// `body` as an event stream in HTTP chunks of the sizes `sizes` cycles through
    /// (each becomes a separate piece for the reader, so the splits are the ones chosen).
    async fn serve_chunked(body: Vec<u8>, sizes: &'static [usize]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            let body_start = loop {
                let n = sock.read(&mut buf).await.unwrap();
                assert!(n > 0, "request cut");
                req.extend_from_slice(&buf[..n]);
                if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&req[..body_start]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            while req.len() < body_start + len {
                let n = sock.read(&mut buf).await.unwrap();
                assert!(n > 0, "request body cut");
                req.extend_from_slice(&buf[..n]);
            }
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let mut rest = &body[..];
            for &size in sizes.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, more) = rest.split_at(size.min(rest.len()));
                let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
                chunk.extend_from_slice(piece);
                chunk.extend_from_slice(b"\r\n");
                sock.write_all(&chunk).await.unwrap();
                sock.flush().await.unwrap();
                rest = more;
            }
            sock.write_all(b"0\r\n\r\n").await.unwrap();
            let _ = sock.shutdown().await;
        });
        url
    }

    /// `events` as an event stream opening with a BOM (right before the first `data:`),
    /// the events' line ends cycling through `ends`, a comment after each.
    fn bom_stream(events: &[String], ends: &[&str]) -> Vec<u8> {
        let mut body = BOM.to_vec();
        for (k, e) in events.iter().enumerate() {
            let end = ends[k % ends.len()];
            body.extend_from_slice(format!("data: {e}{end}{end}: keep-alive{end}").as_bytes());
        }
        body
    }

    /// Posts to `url` and reads the answer through the workers' streaming path.
    async fn stream_through(url: &str, sglang: bool) -> (super::super::Generation, u32) {
        crate::upstream::tls::install_provider();
        let resp = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .post(url)
            .json(&serde_json::json!({"stream": true}))
            .send()
            .await
            .unwrap();
        let mut r = Reader::new(resp, 1 << 20, Instant::now(), url.to_string());
        let tokens = std::sync::atomic::AtomicU32::new(0);
        let sink = |n: u32| {
            tokens.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        let g = if sglang {
            super::super::sglang::read_stream(&mut r, &sink).await
        } else {
            super::super::openai::read_stream(&mut r, false, &sink).await
        };
        (g.unwrap(), tokens.into_inner())
    }

    /// Through reqwest and the OpenAI protocol's stream reader (deltas): a BOM-prefixed
    /// stream, with LF line ends and then with CR, CRLF and LF mixed, split inside the BOM
    /// and between CR and LF, keeps every token of text (a first event dropped for its
    /// BOM, or CR-ended lines run together, would lose some).
    #[tokio::test]
    async fn a_bom_and_cr_line_ends_keep_every_token_openai() {
        let n = 12;
        let mut evs: Vec<String> = (1..=n)
            .map(|k| {
                let fin = if k == n { "\"length\"" } else { "null" };
                format!(r#"{{"choices":[{{"index":0,"text":" w{k}","finish_reason":{fin}}}]}}"#)
            })
            .collect();
        evs.push("[DONE]".into());
        for ends in [&["\n"][..], &["\r", "\r\n", "\n"]] {
            let url = serve_chunked(bom_stream(&evs, ends), &[1, 2, 3, 5, 8, 13]).await;
            let (g, tokens) = stream_through(&format!("{url}/v1/completions"), false).await;
            let want: String = (1..=n).map(|k| format!(" w{k}")).collect();
            assert_eq!(g.text, want, "{ends:?}");
            assert_eq!((g.finish_reason.as_str(), tokens), ("length", n));
        }
    }

    /// The same through SGLang's `/generate` reader, with cumulative events (every event
    /// repeats the output so far): the last event's text and ids are all kept.
    #[tokio::test]
    async fn a_bom_and_cr_line_ends_keep_every_token_sglang() {
        let n = 10u32;
        let mut evs: Vec<String> = (1..=n)
            .map(|k| {
                let text: String = (1..=k).map(|i| format!(" w{i}")).collect();
                let ids: Vec<u32> = (1..=k).collect();
                let fin = if k == n {
                    serde_json::json!({"type": "length", "length": k})
                } else {
                    serde_json::Value::Null
                };
                serde_json::json!({"text": text, "output_ids": ids,
                    "meta_info": {"prompt_tokens": 1, "completion_tokens": k, "finish_reason": fin}})
                .to_string()
            })
            .collect();
        evs.push("[DONE]".into());
        let url = serve_chunked(bom_stream(&evs, &["\r", "\r\n", "\n"]), &[2, 1, 7, 3]).await;
        let (g, tokens) = stream_through(&format!("{url}/generate"), true).await;
        let want: String = (1..=n).map(|k| format!(" w{k}")).collect();
        assert_eq!(g.text, want);
        assert_eq!(g.token_ids, Some((1..=n).collect()));
        assert_eq!((g.finish_reason.as_str(), tokens), ("length", n));
    }

    /// An event the body does not finish is not dispatched: a stream whose `[DONE]` has no
    /// blank line after it ends without `[DONE]`, which the protocol reports as cut.
    #[tokio::test]
    async fn an_unfinished_done_is_a_cut_stream() {
        let body = b"data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n".to_vec();
        let url = serve_chunked(body, &[7]).await;
        crate::upstream::tls::install_provider();
        let resp = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .send()
            .await
            .unwrap();
        let mut r = Reader::new(resp, 1 << 20, Instant::now(), url);
        let err = super::super::openai::read_stream(&mut r, false, &|_| {})
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::StreamCut(_)), "{err:?}");
    }

    /// A line that never ends, streamed, is refused at the cap rather than held.
    #[tokio::test]
    async fn an_endless_line_is_refused_at_the_cap_through_the_reader() {
        let mut body = b"data: {\"choices\":[{\"text\":\"".to_vec();
        body.extend(std::iter::repeat_n(b'x', 64 << 10));
        let url = serve_chunked(body, &[4096]).await;
        crate::upstream::tls::install_provider();
        let resp = reqwest::Client::new().post(&url).send().await.unwrap();
        let mut r = Reader::new(resp, 8 << 10, Instant::now(), url);
        let err = r.next_event().await.unwrap_err();
        assert!(matches!(err, UpstreamError::TooLarge(8192)), "{err:?}");
        assert!(r.parser.held() <= 8 << 10);
    }

    /// A straightforward reading of the rules over a whole stream, to check the
    /// incremental parser against.
    fn oracle(body: &[u8]) -> Vec<Event> {
        let body = body.strip_prefix(&BOM[..]).unwrap_or(body);
        let mut lines: Vec<&[u8]> = Vec::new();
        let (mut start, mut i) = (0, 0);
        while i < body.len() {
            if body[i] == b'\r' || body[i] == b'\n' {
                lines.push(&body[start..i]);
                if body[i] == b'\r' && body.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            i += 1;
        }
        // Lines after `start` never ended: not part of the stream's lines.
        let mut out = Vec::new();
        let (mut data, mut event, mut id) = (None::<String>, "", String::new());
        for line in lines {
            let line = std::str::from_utf8(line).unwrap();
            if line.is_empty() {
                if let Some(d) = data.take() {
                    out.push(ev(&d, event, &id));
                }
                event = "";
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (f, v) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match f {
                "data" => match &mut data {
                    Some(d) => *d = format!("{d}\n{v}"),
                    None => data = Some(v.to_string()),
                },
                "event" => event = v,
                "id" if !v.contains('\0') => id = v.to_string(),
                _ => {}
            }
        }
        out
    }

    /// Streams made of the pieces the rules treat specially, so that random ones exercise
    /// every rule (and their interleavings) often.
    fn stream() -> impl Strategy<Value = Vec<u8>> {
        const PIECES: [&[u8]; 16] = [
            b"data",
            b"data:",
            b"data: ",
            b"event: ",
            b"id: ",
            b"retry: 12",
            b":",
            b" ",
            b"\n",
            b"\r",
            b"\r\n",
            b"\n\n",
            b"\0",
            b"x",
            b"\xC3\xA9",
            &BOM,
        ];
        let piece = prop::sample::select(&PIECES[..]);
        (any::<bool>(), prop::collection::vec(piece, 0..60)).prop_map(|(bom, pieces)| {
            let mut s = if bom { BOM.to_vec() } else { Vec::new() };
            for p in pieces {
                s.extend_from_slice(p);
            }
            s
        })
    }

    /// `body` cut at `cuts` (positions taken modulo its length).
    fn split<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        at.sort_unstable();
        let mut out = Vec::new();
        let mut prev = 0;
        for c in at.into_iter().chain([body.len()]) {
            out.push(&body[prev..c]);
            prev = c;
        }
        out
    }

    proptest! {
        /// The events do not depend on where chunks split the stream, and they are the
        /// ones a whole-stream reading of the rules gives.
        #[test]
        fn chunking_never_changes_the_events(
            body in stream(),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let whole = events(&body, BIG).unwrap();
            prop_assert_eq!(&whole, &oracle(&body));
            prop_assert_eq!(&parse_chunks(&split(&body, &cuts), BIG).unwrap(), &whole);
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            prop_assert_eq!(&parse_chunks(&bytes, BIG).unwrap(), &whole);
        }

        /// Arbitrary bytes, chunked arbitrarily, never panic and never make the parser
        /// hold more than the cap; whatever they give (events or a refusal), they give
        /// under any chunking.
        #[test]
        fn arbitrary_bytes_stay_within_the_cap(
            body in prop::collection::vec(any::<u8>(), 0..2000),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            cap in 1u64..300,
        ) {
            // parse_chunks asserts the bound after every call.
            prop_assert_eq!(parse_chunks(&split(&body, &cuts), cap), events(&body, cap));
        }

        /// The same with streams built of the rules' special pieces and a small cap, so
        /// that refusals land on every kind of line.
        #[test]
        fn refusals_do_not_depend_on_chunking(
            body in stream(),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            cap in 1u64..40,
        ) {
            prop_assert_eq!(parse_chunks(&split(&body, &cuts), cap), events(&body, cap));
        }
    }
}
