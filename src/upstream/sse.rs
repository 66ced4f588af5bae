//! Server-sent events over a streaming response: yields each event's `data` payload.
//!
//! Invariants: the total bytes read never exceed the cap; a body that ends without the
//! caller having seen its terminal event is reported by the caller as a cut stream.

use super::{map_reqwest, UpstreamError};
use std::time::Instant;

/// Pulls `data:` payloads out of an SSE body, one event at a time.
pub(crate) struct Reader {
    resp: reqwest::Response,
    buf: Vec<u8>,
    read: u64,
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
            read: 0,
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
                    self.read += chunk.len() as u64;
                    if self.read > self.cap {
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
            let Some(end) = find_event_end(&self.buf) else {
                return Ok(None);
            };
            let (raw, skip) = end;
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

/// Position of the end of the first event and the separator length (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
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
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }
}
