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
mod tests;
