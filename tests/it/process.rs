//! The real `spool` binary as a process: run it, follow its stderr, signal it, wait for it
//! with its peak memory; edit its config; read the mock server's request log.

use crate::support::spool_bin;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Replaces `from` by `to` in the config file (which must contain it).
pub(crate) fn edit_config(cfg: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(cfg).unwrap();
    assert!(text.contains(from), "config has no `{from}`:\n{text}");
    std::fs::write(cfg, text.replacen(from, to, 1)).unwrap();
}

/// `spool <args> -c cfg` to the end, with extra env vars.
pub(crate) fn spool(cfg: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(spool_bin());
    c.args(args).arg("-c").arg(cfg);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// `spool status --json`.
pub(crate) fn status_json(cfg: &Path) -> Value {
    let out = spool(cfg, &["status", "--json", "-q"], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `spool verify` must say clean (exit 0).
pub(crate) fn assert_verify_clean(cfg: &Path) {
    let out = spool(cfg, &["verify", "-q"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "verify: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verify: clean"), "{stdout}");
}

/// A running `spool` whose stderr is collected line by line.
pub(crate) struct Proc {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Proc {
    pub(crate) fn spawn(cfg: &Path, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut c = Command::new(spool_bin());
        c.args(args).arg("-c").arg(cfg);
        for (k, v) in env {
            c.env(k, v);
        }
        Proc::from_command(c)
    }

    /// Starts a command set up by the caller (limits, wrappers), collecting its stderr.
    pub(crate) fn from_command(mut c: Command) -> Proc {
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let l = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                l.lock().unwrap().push(line);
            }
        });
        Proc {
            child,
            lines,
            reader: Some(reader),
        }
    }

    pub(crate) fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Everything written to stderr so far.
    pub(crate) fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// How many stderr lines contain `needle`.
    pub(crate) fn count(&self, needle: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Polls stderr (every 20 ms) until `needle` has appeared `n` times.
    pub(crate) async fn wait_for(&self, needle: &str, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.count(needle) < n {
            assert!(
                Instant::now() < deadline,
                "`{needle}` not seen {n} times in {timeout:?}; stderr:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(crate) fn signal(&self, sig: i32) {
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// Waits (polling, up to `timeout`) for the exit; returns its status and the peak
    /// resident memory in bytes (from `wait4`'s rusage).
    pub(crate) async fn wait(&mut self, timeout: Duration) -> (ExitStatus, u64) {
        use std::os::unix::process::ExitStatusExt;
        let deadline = Instant::now() + timeout;
        loop {
            let mut status = 0i32;
            let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
            let r = unsafe { libc::wait4(self.pid(), &mut status, libc::WNOHANG, &mut ru) };
            assert!(r >= 0, "wait4 failed");
            if r == self.pid() {
                if let Some(h) = self.reader.take() {
                    let _ = h.join();
                }
                return (ExitStatus::from_raw(status), ru.ru_maxrss as u64 * 1024);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "spool did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proc {
    /// A test that fails half way leaves no `spool` running.
    fn drop(&mut self) {
        if self.reader.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One line of the mock's request log.
#[derive(Debug, Clone)]
pub(crate) struct LogLine {
    pub ds: String,
    pub row: u64,
    /// (sample, turn) of a generation of an item with several (named in its request id).
    pub generation: Option<(u32, u32)>,
    /// The request body, when the mock logs bodies.
    pub request: Option<Value>,
    pub outcome: String,
    /// When the request ended, and how long it took (ms).
    pub end_ms: u64,
    pub latency_ms: u64,
}

impl LogLine {
    pub(crate) fn start_ms(&self) -> u64 {
        self.end_ms - self.latency_ms
    }
}

/// The mock log's lines for items; `rid` is `<dataset>-<row>-<nonce>`. The start-up
/// self-check's requests (`_selfcheck-…`) are left out.
pub(crate) fn mock_log(path: &Path) -> Vec<LogLine> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let rid = v["rid"].as_str().expect("spool sends a request id");
            if rid.starts_with("_selfcheck") {
                return None;
            }
            let mut parts = rid.rsplitn(3, '-');
            let nonce = parts.next().unwrap();
            let row: u64 = parts.next().unwrap().parse().unwrap();
            let ds = parts.next().unwrap().to_string();
            // `s<sample>t<turn>n<nonce>` for a generation of an item with several.
            let generation = nonce.strip_prefix('s').and_then(|x| {
                let (s, rest) = x.split_once('t')?;
                let (t, _) = rest.split_once('n')?;
                Some((s.parse().ok()?, t.parse().ok()?))
            });
            Some(LogLine {
                ds,
                row,
                generation,
                request: v.get("request").cloned(),
                outcome: v["outcome"].as_str().unwrap().to_string(),
                end_ms: v["ts_ms"].as_u64().unwrap(),
                latency_ms: v["latency_ms"].as_u64().unwrap(),
            })
        })
        .collect()
}
