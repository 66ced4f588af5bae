//! The `--log` JSONL file: one line per generation request, written when the request ends
//! (however it ends), each line a single `write` on an append-mode file so lines from
//! concurrent requests never interleave and a reader sees only whole lines.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::Outcome;

/// What one log line says.
#[derive(Debug, Clone)]
pub(crate) struct LogLine<'a> {
    pub endpoint: &'a str,
    pub rid: Option<&'a str>,
    pub outcome: Outcome,
    pub stream: bool,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub latency_ms: u64,
    /// The request body as received (`--log-bodies`).
    pub request: Option<&'a [u8]>,
}

/// The open log file.
pub(crate) struct LogSink {
    file: Mutex<File>,
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl LogSink {
    /// Opens (creating, appending) the log file.
    pub(crate) fn open(path: &Path) -> anyhow::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("cannot open mock log {}: {e}", path.display()))?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    /// Appends one line. A failed write is reported through `tracing` and otherwise
    /// ignored: the log must never take the server down.
    pub(crate) fn write(&self, line: &LogLine<'_>) {
        let mut v = json!({
            "ts_ms": now_ms(),
            "endpoint": line.endpoint,
            "rid": line.rid,
            "outcome": line.outcome.as_str(),
            "stream": line.stream,
            "prompt_tokens": line.prompt_tokens,
            "completion_tokens": line.completion_tokens,
            "latency_ms": line.latency_ms,
        });
        if let Some(body) = line.request {
            // A body that is not JSON is still worth seeing: kept as text.
            v["request"] = serde_json::from_slice(body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
        }
        let mut buf = v.to_string().into_bytes();
        buf.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = f.write_all(&buf).and_then(|()| f.flush()) {
            tracing::warn!(error = %e, "mock: cannot write the request log");
        }
    }
}
