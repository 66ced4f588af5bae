//! Server-sent events over a streaming response: yields each event's `data` payload.
//!
//! Memory is bounded by the cap (`server.max_response_bytes`), but not the bytes streamed:
//! SGLang's default (cumulative) streams resend the whole output in every event, so a
//! legitimate 10k-token completion streams hundreds of MB in total while holding only
//! one event at a time. What is capped is what is held: the bytes of one event not yet
//! complete (an endless event is refused at the cap), and the output accumulated so far
//! (the protocol reports it through [`Reader::check_retained`]; an endless stream of small
//! deltas is refused at the cap). Total time is bounded by `request_timeout_s`.
//!
//! Invariants: held bytes never exceed the cap; finding an event's end costs time linear
//! in the bytes received (a body without event boundaries is scanned once, not once per
//! chunk); a body that ends without the caller having seen its terminal event is reported
//! by the caller as a cut stream.

use super::{map_reqwest, UpstreamError};
use std::time::Instant;

/// Pulls `data:` payloads out of an SSE body, one event at a time.
pub(crate) struct Reader {
    resp: reqwest::Response,
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for an event boundary (minus the overlap a
    /// separator split across chunks needs).
    scanned: usize,
    cap: u64,
    started: Instant,
    /// Milliseconds from request start to the first content event (set by the protocol).
    pub ttft_ms: Option<u32>,
    url: String,
}

impl Reader {
    pub(crate) fn new(resp: reqwest::Response, cap: u64, started: Instant, url: String) -> Self {
        Self {
            resp,
            buf: Vec::with_capacity(4096),
            scanned: 0,
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
    /// of the body.
    pub(crate) async fn next_event(&mut self) -> Result<Option<String>, UpstreamError> {
        loop {
            if let Some(ev) = self.take_event()? {
                return Ok(Some(ev));
            }
            match self
                .resp
                .chunk()
                .await
                .map_err(|e| map_reqwest(&self.url, e))?
            {
                Some(chunk) => {
                    if (self.buf.len() + chunk.len()) as u64 > self.cap {
                        return Err(UpstreamError::TooLarge(self.cap));
                    }
                    self.buf.extend_from_slice(&chunk);
                }
                None => {
                    // A final event without the blank line still counts.
                    if self.buf.iter().any(|b| !b.is_ascii_whitespace()) {
                        self.buf.extend_from_slice(b"\n\n");
                        return self.take_event();
                    }
                    return Ok(None);
                }
            }
        }
    }

    fn take_event(&mut self) -> Result<Option<String>, UpstreamError> {
        loop {
            let Some((raw, skip)) = find_event_end(&self.buf, self.scanned) else {
                // Nothing up to here ends an event; a separator may still straddle the
                // next chunk, so its first 3 bytes are searched again.
                self.scanned = self.buf.len().saturating_sub(3);
                return Ok(None);
            };
            self.scanned = 0;
            let block: Vec<u8> = self.buf.drain(..raw + skip).take(raw).collect();
            let text = String::from_utf8(block)
                .map_err(|_| UpstreamError::Malformed("SSE event is not UTF-8".into()))?;
            let mut data: Option<String> = None;
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("data:") {
                    let rest = rest.strip_prefix(' ').unwrap_or(rest);
                    match &mut data {
                        Some(d) => {
                            d.push('\n');
                            d.push_str(rest);
                        }
                        None => data = Some(rest.to_string()),
                    }
                }
            }
            if let Some(d) = data {
                return Ok(Some(d));
            }
            // Comments / keep-alives: keep looking.
        }
    }
}

/// Position of the end of the first event at or after `from`, and the separator length
/// (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    let mut i = from;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if i + 3 < buf.len() && &buf[i..i + 4] == b"\r\n\r\n" {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::find_event_end;

    #[test]
    fn event_boundaries() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y", 0), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n", 0), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n", 0), None);
        // Resuming a scan finds a separator that straddled two chunks.
        let buf = b"data: x\r\n\r\n";
        assert_eq!(find_event_end(buf, buf.len() - 3 - 2), Some((7, 4)));
    }
}
