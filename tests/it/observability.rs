//! Observability of a real `spool run`: the `/metrics` scrape passes
//! `promtool check metrics` and carries every series with its documented labels; every
//! PromQL query of the Grafana dashboard answers with data from a real Prometheus that
//! scraped a run; `/readyz` follows server reachability; progress bars on a pseudo-terminal
//! and plain progress lines otherwise; `spool status` live and from the queue, and its JSON
//! shape as docs/metrics.md documents it.
//!
//! Needs `prometheus` and `promtool` on PATH (Debian's `prometheus` package; `.ci/run`
//! installs it): the tests fail, not skip, without them.

use crate::support::*;
use spool::mock::{MockConfig, MockState};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The metrics table of docs/metrics.md: name → (type, labels). Histograms list their own labels (`le` comes on top).
const DOCUMENTED_SERIES: &[(&str, &str, &[&str])] = &[
    ("spool_requests_total", "counter", &["dataset", "outcome"]),
    ("spool_completion_tokens_total", "counter", &["dataset"]),
    ("spool_prompt_tokens_total", "counter", &["dataset"]),
    ("spool_streamed_tokens_total", "counter", &["dataset"]),
    ("spool_items", "gauge", &["dataset", "state"]),
    ("spool_token_budget", "gauge", &["dataset"]),
    ("spool_budget_remaining_tokens", "gauge", &["dataset"]),
    ("spool_eta_seconds", "gauge", &["dataset"]),
    ("spool_request_duration_seconds", "histogram", &["dataset"]),
    (
        "spool_time_to_first_token_seconds",
        "histogram",
        &["dataset"],
    ),
    ("spool_inflight_requests", "gauge", &["server"]),
    ("spool_server_up", "gauge", &["server"]),
    ("spool_server_concurrency_limit", "gauge", &["server"]),
    ("spool_shards_written_total", "counter", &["dataset"]),
    ("spool_shard_bytes_total", "counter", &["dataset"]),
];

/// More series, also in the metrics table of docs/metrics.md.
const EXTRA_SERIES: &[(&str, &str, &[&str])] = &[("spool_run_eta_seconds", "gauge", &[])];

// ---------------------------------------------------------------------------------------
// Helpers

/// Kills a child process when dropped (a failed assertion must not leave it running).
struct Proc {
    child: Child,
    name: &'static str,
}

impl Proc {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
    /// SIGINT, then the exit code (waits at most `limit`).
    fn interrupt(&mut self, limit: Duration) -> Option<i32> {
        unsafe {
            libc::kill(self.pid(), libc::SIGINT);
        }
        self.wait(limit)
    }
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {limit:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A binary on PATH, or a failure naming the package that provides it.
fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let p = dir.join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "`{name}` is not on PATH: install Debian's `prometheus` package \
         (apt-get install -y --no-install-recommends prometheus), as .ci/run does"
    );
}

/// A mock that makes a run last: ~40-token completions at 100 tok/s each (≈0.4 s), so
/// `concurrency` requests in flight give ≈2.5 × concurrency completions a second.
fn slow_mock() -> MockConfig {
    MockConfig {
        capacity_tps: 100_000.0,
        per_request_tps: 100.0,
        mean_tokens: 40.0,
        sigma: 0.5,
        time_scale: 1.0,
        ..MockConfig::for_tests()
    }
}

fn client() -> reqwest::Client {
    spool::upstream::tls::install_provider();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn get(url: &str) -> (u16, String) {
    match client().get(url).send().await {
        Ok(r) => {
            let code = r.status().as_u16();
            (code, r.text().await.unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Polls `data/metrics.addr` (written once the endpoint is bound).
async fn endpoint(data_dir: &Path, proc_: &mut Proc) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(a) = std::fs::read_to_string(data_dir.join("metrics.addr")) {
            if !a.trim().is_empty() {
                return format!("http://{}", a.trim());
            }
        }
        assert!(proc_.running(), "spool exited before binding its endpoint");
        assert!(Instant::now() < deadline, "no metrics.addr after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_run(cfg: &Path, args: &[&str], stderr: Stdio) -> Proc {
    let child = Command::new(spool_bin())
        .arg("run")
        .arg("-c")
        .arg(cfg)
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    Proc {
        child,
        name: "spool run",
    }
}

/// The text exposition parsed: family → (type, samples as (name, labels, value)).
type Samples = Vec<(String, BTreeMap<String, String>, f64)>;

fn parse_exposition(text: &str) -> BTreeMap<String, (String, Samples)> {
    let mut fams: BTreeMap<String, (String, Samples)> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (n, t) = (it.next().unwrap(), it.next().unwrap());
            fams.insert(n.to_string(), (t.to_string(), Vec::new()));
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once("=\"").unwrap();
            map.insert(k.to_string(), v.trim_end_matches('"').to_string());
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| fams.contains_key(*f)))
            .unwrap_or(name);
        let v: f64 = value.parse().unwrap();
        fams.get_mut(family)
            .unwrap_or_else(|| panic!("sample {name} without a TYPE line"))
            .1
            .push((name.to_string(), map, v));
    }
    fams
}

fn sample(fams: &BTreeMap<String, (String, Samples)>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let family = name
        .strip_suffix("_count")
        .filter(|f| fams.contains_key(*f))
        .unwrap_or(name);
    fams.get(family)
        .and_then(|(_, s)| {
            s.iter().find(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
        })
        .map(|s| s.2)
        .unwrap_or(f64::NAN)
}

/// Two datasets: `alpha` (budgeted, many items: still running when scraped) after a small
/// `warm` one that finishes first.
fn live_setup(dir: &Path, alpha_items: usize, url: &str) -> PathBuf {
    write_prompts(&dir.join("warm.jsonl"), "w", 30);
    write_prompts(&dir.join("alpha.jsonl"), "a", alpha_items);
    write_config(
        dir,
        url,
        "sglang",
        true,
        &[
            Ds {
                name: "warm",
                file: "warm.jsonl",
                budget: None,
            },
            Ds {
                name: "alpha",
                file: "alpha.jsonl",
                budget: Some(10_000_000),
            },
        ],
        "",
    )
}

/// Strips ANSI escape sequences (CSI `ESC [ … letter`, and lone `ESC x`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            if it.peek() == Some(&'[') {
                it.next();
                for d in it.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                it.next();
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `line` has the shape of the progress line docs/guarantees.md shows:
/// `B3_magicoder done=50/9998 pending=9940 inflight=8 failed=0 retries=2 0.3 req/s 1.1k tok/s avg_comp=1232tok tokens=100.0k/10.0M ETA=2h41m`.
fn is_progress_line(line: &str) -> bool {
    progress_fields(line).is_some()
}

/// A progress line's fields: name, the counts (done, total, pending, inflight, failed,
/// retries) and the tokens text; `None` unless the line has the documented shape.
fn progress_fields(line: &str) -> Option<(String, [u64; 6], String)> {
    let t: Vec<&str> = line.split_whitespace().collect();
    let num = |s: &str| s.parse::<f64>().is_ok();
    let human = |s: &str| {
        let n = s.trim_end_matches(['k', 'M', 'G']);
        n.parse::<u64>().is_ok() || (n.len() < s.len() && n.contains('.') && num(n))
    };
    let i = t.iter().position(|w| *w == "req/s")?;
    if i < 7 || t.len() != i + 6 {
        return None;
    }
    let field = |w: &str, key: &str| w.strip_prefix(key)?.parse::<u64>().ok();
    let (done, total) = t[i - 6].strip_prefix("done=")?.split_once('/')?;
    let counts = [
        done.parse().ok()?,
        total.parse().ok()?,
        field(t[i - 5], "pending=")?,
        field(t[i - 4], "inflight=")?,
        field(t[i - 3], "failed=")?,
        field(t[i - 2], "retries=")?,
    ];
    let (rps, tok) = (t[i - 1], t[i + 1]);
    let tokens = t[i + 4].strip_prefix("tokens=")?;
    let ok = num(rps)
        && rps.contains('.')
        && num(tok.trim_end_matches('k'))
        && t[i + 2] == "tok/s"
        && t[i + 3]
            .strip_prefix("avg_comp=")
            .and_then(|s| s.strip_suffix("tok"))
            .is_some_and(|n| n.parse::<u64>().is_ok())
        && tokens.split('/').all(human)
        && t[i + 5].starts_with("ETA=")
        && t[i + 5].len() > 4;
    ok.then(|| (t[..i - 6].join(" "), counts, tokens.to_string()))
}

// ---------------------------------------------------------------------------------------
// The scrape itself

/// A scrape taken while the run is going passes `promtool check metrics` and carries every
/// The documented series with exactly its documented type and labels; the other endpoints and
/// `spool status` (live, then from the queue) answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mid_run_scrape_passes_promtool_with_every_spec_series() {
    let promtool = tool("promtool");
    let mock = Mock::start(MockConfig {
        fail_500: 0.05,
        ..slow_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = live_setup(dir.path(), 2000, &mock.url);
    let mut run = spawn_run(
        &cfg,
        &["--metrics-addr", "127.0.0.1:0", "--concurrency", "8"],
        Stdio::null(),
    );
    let base = endpoint(&dir.path().join("data"), &mut run).await;

    // Wait until the scrape shows real traffic on alpha (completions, a TTFT, a shard, a
    // retry, a known ETA) and `warm`, served first, finished.
    let deadline = Instant::now() + Duration::from_secs(40);
    let (text, fams) = loop {
        let (code, text) = get(&format!("{base}/metrics")).await;
        assert_eq!(code, 200, "{text}");
        let fams = parse_exposition(&text);
        let a = [("dataset", "alpha")];
        let ready = sample(&fams, "spool_requests_total", &[a[0], ("outcome", "ok")]) >= 10.0
            && sample(&fams, "spool_requests_total", &[a[0], ("outcome", "retry")]) >= 1.0
            && sample(&fams, "spool_time_to_first_token_seconds_count", &a) >= 1.0
            && sample(&fams, "spool_shards_written_total", &a) >= 1.0
            && sample(&fams, "spool_eta_seconds", &a) > 0.0
            && sample(
                &fams,
                "spool_items",
                &[("dataset", "warm"), ("state", "done")],
            ) == 30.0;
        if ready {
            break (text, fams);
        }
        assert!(run.running(), "spool ended before the scrape");
        assert!(
            Instant::now() < deadline,
            "no traffic in the scrape after 40 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(run.running(), "the scrape must be taken mid-run");
    assert!(
        sample(
            &fams,
            "spool_items",
            &[("dataset", "alpha"), ("state", "pending")]
        ) > 0.0,
        "alpha still has pending items when scraped"
    );

    // promtool: the exposition is valid and lint-clean.
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Every documented series: type and exact label names, for every dataset / the server.
    for (name, kind, labels) in DOCUMENTED_SERIES.iter().chain(EXTRA_SERIES) {
        let (t, samples) = fams
            .get(*name)
            .unwrap_or_else(|| panic!("{name} missing from the scrape:\n{text}"));
        assert_eq!(t, kind, "{name} has type {t}, docs/metrics.md says {kind}");
        assert!(!samples.is_empty(), "{name} has no sample");
        let want: BTreeSet<&str> = labels.iter().copied().collect();
        for (sname, l, _) in samples {
            let mut got: BTreeSet<&str> = l.keys().map(String::as_str).collect();
            if sname.ends_with("_bucket") {
                assert!(got.remove("le"), "{sname} without le");
            }
            assert_eq!(got, want, "{sname} labels {l:?}");
        }
        if want.contains("dataset") {
            let ds: BTreeSet<&str> = samples.iter().map(|s| s.1["dataset"].as_str()).collect();
            let expect: BTreeSet<&str> =
                if *name == "spool_token_budget" || *name == "spool_budget_remaining_tokens" {
                    ["alpha"].into() // budget series are absent without a budget
                } else {
                    ["alpha", "warm"].into()
                };
            assert_eq!(ds, expect, "{name}: datasets");
        }
        if want.contains("server") {
            let servers: BTreeSet<&str> = samples.iter().map(|s| s.1["server"].as_str()).collect();
            assert_eq!(servers, [mock.url.as_str()].into(), "{name}: servers");
        }
    }
    // Fixed label values: every outcome and state.
    for o in ["ok", "retry", "failed", "rejected"] {
        assert!(
            !sample(
                &fams,
                "spool_requests_total",
                &[("dataset", "alpha"), ("outcome", o)]
            )
            .is_nan(),
            "outcome {o}"
        );
    }
    for s in ["pending", "inflight", "done", "failed"] {
        assert!(
            !sample(&fams, "spool_items", &[("dataset", "alpha"), ("state", s)]).is_nan(),
            "state {s}"
        );
    }
    // Gauges agree with what they mean.
    assert_eq!(
        sample(&fams, "spool_token_budget", &[("dataset", "alpha")]),
        1e7
    );
    assert_eq!(
        sample(&fams, "spool_server_up", &[("server", mock.url.as_str())]),
        1.0
    );
    assert_eq!(
        sample(
            &fams,
            "spool_items",
            &[("dataset", "warm"), ("state", "done")]
        ),
        30.0,
        "warm is served first and is finished"
    );
    assert_eq!(
        sample(&fams, "spool_eta_seconds", &[("dataset", "warm")]),
        0.0
    );
    let items: f64 = ["pending", "inflight", "done", "failed"]
        .iter()
        .map(|st| sample(&fams, "spool_items", &[("dataset", "alpha"), ("state", st)]))
        .sum();
    assert_eq!(items, 2000.0, "alpha's items by state add up to its items");
    // Remaining budget: budget − completed tokens (the gauge is at most a tick behind the
    // counter; this is a fresh run, so the durable count is this process's).
    let used = 1e7
        - sample(
            &fams,
            "spool_budget_remaining_tokens",
            &[("dataset", "alpha")],
        );
    let counted = sample(
        &fams,
        "spool_completion_tokens_total",
        &[("dataset", "alpha")],
    );
    assert!(
        used > 0.0 && used <= counted,
        "used {used} vs counted {counted}"
    );

    // The other endpoints.
    assert_eq!(get(&format!("{base}/healthz")).await.0, 200);
    assert_eq!(get(&format!("{base}/readyz")).await.0, 200);
    let (code, body) = get(&format!("{base}/status")).await;
    assert_eq!(code, 200);
    let st: spool::observe::status::StatusReport = serde_json::from_str(&body).unwrap();
    assert!(st.running);
    let alpha = st.datasets.iter().find(|d| d.name == "alpha").unwrap();
    assert_eq!(alpha.state, "running");
    assert!(alpha.tokens_per_s.unwrap() > 0.0 && alpha.eta_s.unwrap() > 0.0);

    // `spool status` reads the live process: a rate and an ETA column.
    // (`--metrics-addr` as the run had it: the config file disables the endpoint.)
    let live = Command::new(spool_bin())
        .args(["status", "--metrics-addr", "127.0.0.1:0", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&live.stdout).to_string();
    assert!(live.status.success(), "{table}");
    assert!(
        table.starts_with("live from the running process"),
        "{table}"
    );
    let header = table.lines().nth(1).unwrap();
    for col in [
        "dataset",
        "done",
        "pending",
        "inflight",
        "failed",
        "rejected",
        "tokens/budget",
        "overshoot",
        "shards",
        "tok/s",
        "req/s",
        "ETA",
        "state",
    ] {
        assert!(header.contains(col), "column {col} in {table}");
    }
    let alpha_row = table.lines().find(|l| l.starts_with("alpha ")).unwrap();
    assert!(
        alpha_row.contains("/10.0M") && alpha_row.ends_with("running"),
        "{table}"
    );

    // `spool status --url` shows the same live table from anywhere, without the config.
    let elsewhere = tempfile::tempdir().unwrap();
    let remote = Command::new(spool_bin())
        .args(["status", "--url", &base])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    let rtable = String::from_utf8_lossy(&remote.stdout).to_string();
    assert!(
        remote.status.success(),
        "{}",
        String::from_utf8_lossy(&remote.stderr)
    );
    assert!(
        rtable.starts_with("live from the running process"),
        "{rtable}"
    );
    assert!(
        rtable
            .lines()
            .any(|l| l.starts_with("alpha ") && l.ends_with("running")),
        "{rtable}"
    );

    assert_eq!(run.interrupt(Duration::from_secs(30)), Some(130));
    // The stopped run's endpoint no longer answers: an error naming it, exit 1.
    let gone = Command::new(spool_bin())
        .args(["status", "--url", &base])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert_eq!(gone.status.code(), Some(1));
    let err = String::from_utf8_lossy(&gone.stderr);
    assert!(err.contains(&format!("{base}/status")), "{err}");
    // Stopped: from the queue alone, without rates.
    let after = Command::new(spool_bin())
        .args(["status", "--metrics-addr", "127.0.0.1:0", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&after.stdout).to_string();
    assert!(after.status.success(), "{table}");
    assert!(
        table.starts_with("from the queue (no run active)"),
        "{table}"
    );
    assert!(
        !table.contains("tok/s") && !table.contains("ETA"),
        "{table}"
    );
    let json = Command::new(spool_bin())
        .args(["status", "--json", "--metrics-addr", "127.0.0.1:0", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let st: spool::observe::status::StatusReport = serde_json::from_slice(&json.stdout).unwrap();
    assert!(!st.running);
    assert!(st.datasets.iter().all(|d| d.tokens_per_s.is_none()));
}

// ---------------------------------------------------------------------------------------
// The dashboard against a real Prometheus

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("grafana/dashboards/spool.json");
    let d: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut out = Vec::new();
    fn walk(v: &serde_json::Value, title: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(o) => {
                let t = o.get("title").and_then(|t| t.as_str()).unwrap_or(title);
                if let Some(e) = o.get("expr").and_then(|e| e.as_str()) {
                    out.push((t.to_string(), e.to_string()));
                }
                for x in o.values() {
                    walk(x, t, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, title, out)),
            _ => {}
        }
    }
    walk(&d["panels"], "", &mut out);
    out
}

/// The dashboard's queries as Grafana sends them with `dataset` and `partition` set
/// (`.*` is the partition variable's "All", which also matches series without the label).
fn substitute(expr: &str, dataset: &str, partition: &str) -> String {
    expr.replace("${dataset}", dataset)
        .replace("$dataset", dataset)
        .replace("${partition}", partition)
        .replace("$partition", partition)
        .replace("$__rate_interval", "30s")
        .replace("$__interval", "5s")
        .replace("$__range", "1m")
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `Ok(number of series with a finite value)` or the error / empty result.
async fn prom_query(prom: &str, q: &str) -> Result<usize, String> {
    let url = format!("{prom}/api/v1/query?query={}", urlencode(q));
    let (code, body) = get(&url).await;
    let v: serde_json::Value =
        serde_json::from_str(&body).map_err(|_| format!("HTTP {code}: {body}"))?;
    if v["status"] != "success" {
        return Err(format!("error: {}", v["error"]));
    }
    let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
    if result.is_empty() {
        return Err("no series".into());
    }
    let finite = result
        .iter()
        .filter(|r| {
            r["value"][1]
                .as_str()
                .and_then(|x| x.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
        .count();
    if finite == 0 {
        return Err(format!("only NaN/Inf values: {result:?}"));
    }
    Ok(finite)
}

/// A real Prometheus scrapes a run every second; then every PromQL `expr` of
/// `grafana/dashboards/spool.json`, with its variables substituted (partition: "All"), must
/// answer with at least one series holding a finite value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_answer_from_real_prometheus() {
    dashboard_answers_for(&[], ".*").await;
}

/// As above for a worker of a partitioned job (partition 1 of 2, every series labelled
/// `partition="1"`) with the dashboard's partition variable set to that worker: every query
/// answers, and with the variable on another partition none does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_answer_for_one_partition_of_a_cluster_job() {
    dashboard_answers_for(&["--partitions", "2", "--partition", "1"], "1").await;
}

/// Runs spool with `extra` arguments under a real Prometheus until every dashboard query,
/// with `partition` substituted, answers with data.
async fn dashboard_answers_for(extra: &[&str], partition: &str) {
    let prometheus = tool("prometheus");
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 20, "dashboard exprs: {exprs:?}");
    let mock = Mock::start(MockConfig {
        fail_500: 0.05,
        ..slow_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = live_setup(dir.path(), 5000, &mock.url);
    let mut args = vec!["--metrics-addr", "127.0.0.1:0", "--concurrency", "8"];
    args.extend_from_slice(extra);
    let mut run = spawn_run(&cfg, &args, Stdio::null());
    let base = endpoint(&dir.path().join("data"), &mut run).await;
    let target = base.trim_start_matches("http://").to_string();

    let pdir = dir.path().join("prometheus");
    std::fs::create_dir_all(pdir.join("tsdb")).unwrap();
    std::fs::write(
        pdir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: spool\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let prom_url = format!("http://127.0.0.1:{port}");
    let mut prom = Proc {
        child: Command::new(&prometheus)
            .arg(format!(
                "--config.file={}",
                pdir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                pdir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        name: "prometheus",
    };

    // Poll until every query answers (Prometheus needs a few scrapes for rate() and the
    // quantiles); fail with the queries that still do not after the deadline.
    let started = Instant::now();
    let deadline = started + Duration::from_secs(45);
    let mut failures;
    let mut rounds = 0;
    loop {
        assert!(prom.running(), "prometheus exited: {:?}", {
            let mut s = String::new();
            use std::io::Read;
            let _ = prom.child.stderr.take().unwrap().read_to_string(&mut s);
            s
        });
        assert!(run.running(), "spool ended while Prometheus was scraping");
        failures = Vec::new();
        let mut answered = 0;
        for (title, e) in &exprs {
            let q = substitute(e, "alpha", partition);
            match prom_query(&prom_url, &q).await {
                Ok(_) => answered += 1,
                Err(err) => failures.push(format!("{title}: {q}\n    -> {err}")),
            }
        }
        rounds += 1;
        if failures.is_empty() {
            eprintln!(
                "all {answered} dashboard queries answered after {:.1} s ({rounds} rounds)",
                started.elapsed().as_secs_f64()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} dashboard queries without data after 45 s of scraping:\n{}",
            failures.len(),
            exprs.len(),
            failures.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    // A partition selected: the same queries on another partition find nothing, so each
    // one really filters by the variable.
    if partition != ".*" {
        for (title, e) in &exprs {
            let q = substitute(e, "alpha", "0");
            assert_eq!(
                prom_query(&prom_url, &q).await,
                Err("no series".to_string()),
                "{title}: {q}"
            );
        }
    }
    // The queries ran against live scrapes of this run, not leftovers.
    assert_eq!(
        prom_query(&prom_url, "up{job=\"spool\"} == 1").await,
        Ok(1),
        "Prometheus scrapes spool"
    );
    assert_eq!(run.interrupt(Duration::from_secs(30)), Some(130));
}

/// The dashboard is built on exactly the documented series,
/// every series is on some panel, and it has the variables and panels the issue asks for.
#[test]
fn dashboard_uses_every_spec_series_and_only_those() {
    let exprs = dashboard_exprs();
    let known: BTreeSet<&str> = DOCUMENTED_SERIES
        .iter()
        .chain(EXTRA_SERIES)
        .map(|s| s.0)
        .collect();
    let mut used = BTreeSet::new();
    for (title, e) in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("spool_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| known.contains(f)))
                .unwrap_or(&name)
                .to_string();
            assert!(
                known.contains(family.as_str()),
                "panel {title} uses {name}, not a spool series"
            );
            used.insert(family);
            rest = &rest[i + name.len()..];
        }
    }
    let unused: Vec<_> = known.iter().filter(|k| !used.contains(**k)).collect();
    assert!(unused.is_empty(), "series on no panel: {unused:?}");

    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("grafana/dashboards/spool.json");
    let d: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "dataset", "partition"]);
    assert_eq!(d["templating"]["list"][0]["type"], "datasource");
    assert_eq!(d["templating"]["list"][0]["query"], "prometheus");
    let partition = &d["templating"]["list"][2];
    assert_eq!(
        partition["query"]["query"],
        "label_values(spool_items, partition)"
    );
    assert_eq!(partition["multi"], true);
    assert_eq!(partition["includeAll"], true);
    assert_eq!(partition["allValue"], ".*", "the value `substitute` uses");
    for p in d["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        }
    }
    let titles: Vec<&str> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for want in [
        "Completion tokens/s by dataset",
        "Requests/s by dataset",
        "Run ETA",
        "ETA by dataset",
        "Budget burn-down",
        "Items by state",
        "Requests in flight per server",
        "Server up",
        "Errors and retries/s",
        "Request duration quantiles",
        "Time to first token quantiles",
        "Shards written/min",
        "Shard bytes/s",
    ] {
        assert!(titles.contains(&want), "panel {want} missing: {titles:?}");
    }
    // Every series is filtered by the partition variable and every query aggregates over
    // partitions (a sum, or the worst of them), so a cluster run shows one line per
    // dataset or server rather than one per pod.
    for (title, e) in &exprs {
        let selectors = e.matches("spool_").count();
        assert!(selectors > 0, "panel {title} reads no spool series: {e}");
        assert_eq!(
            e.matches(r#"partition=~"$partition""#).count(),
            selectors,
            "panel {title}: every series needs partition=~\"$partition\": {e}"
        );
        assert!(
            ["sum(", "sum by (", "max(", "max by (", "min by (", "count("]
                .iter()
                .any(|a| e.contains(a)),
            "panel {title} does not aggregate over partitions: {e}"
        );
    }
    // Per-dataset panels honour the variable.
    for (title, e) in &exprs {
        let per_server = e.contains("spool_inflight_requests")
            || e.contains("spool_server_up")
            || e.contains("spool_server_concurrency_limit")
            || e.contains("spool_run_eta_seconds");
        let run_total = title == "Run throughput";
        if !per_server && !run_total {
            assert!(
                e.contains("$dataset"),
                "panel {title} ignores $dataset: {e}"
            );
        }
    }
    // The provisioning points at the dashboards folder.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("grafana");
    let provider =
        std::fs::read_to_string(root.join("provisioning/dashboards/spool.yaml")).unwrap();
    assert!(provider.contains("type: file"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mount = provider
        .lines()
        .find_map(|l| l.trim().strip_prefix("path: "))
        .unwrap();
    assert!(
        readme.contains(&format!("grafana/dashboards:{mount}")),
        "grafana/README.md mounts grafana/dashboards at the provider's path {mount}"
    );
    let ds =
        std::fs::read_to_string(root.join("provisioning/datasources/prometheus.yaml")).unwrap();
    assert!(ds.contains("type: prometheus"));
}

// ---------------------------------------------------------------------------------------
// /readyz

/// `/readyz` is 503 while the only server refuses connections and 200 once one answers
/// (the monitor probes it back in); `/healthz` is 200 throughout; `spool_server_up` agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_server_reachability() {
    // A port nothing listens on (yet).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("a.jsonl"), "a", 2000);
    let cfg = write_config(
        dir.path(),
        &url,
        "sglang",
        true,
        &[Ds {
            name: "a",
            file: "a.jsonl",
            budget: None,
        }],
        "",
    );
    let mut run = spawn_run(&cfg, &["--metrics-addr", "127.0.0.1:0"], Stdio::null());
    let base = endpoint(&dir.path().join("data"), &mut run).await;

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = get(&format!("{base}/readyz")).await;
        if code == 503 {
            assert!(body.contains("no inference server"), "{body}");
            break;
        }
        assert_eq!(code, 200, "{body}");
        assert!(
            Instant::now() < deadline,
            "/readyz still 200 with no server"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(get(&format!("{base}/healthz")).await.0, 200);
    let (_, m) = get(&format!("{base}/metrics")).await;
    assert!(
        m.contains(&format!("spool_server_up{{server=\"{url}\"}} 0")),
        "{m}"
    );

    // The server comes up on that port: probed back in, ready, and the run completes.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let state = MockState::new(slow_mock()).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let s2 = stop.clone();
    let server = tokio::spawn(async move {
        spool::mock::serve_state(listener, state, async move { s2.cancelled().await })
            .await
            .unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, _) = get(&format!("{base}/readyz")).await;
        if code == 200 {
            break;
        }
        assert!(run.running(), "spool exited while waiting for its server");
        assert!(
            Instant::now() < deadline,
            "/readyz not 200 after the server came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, m) = get(&format!("{base}/metrics")).await;
    assert!(
        m.contains(&format!("spool_server_up{{server=\"{url}\"}} 1")),
        "{m}"
    );
    assert_eq!(run.interrupt(Duration::from_secs(30)), Some(130));
    stop.cancel();
    let _ = server.await;
}

// ---------------------------------------------------------------------------------------
// Progress: bars on a terminal, lines otherwise

fn progress_setup(dir: &Path, url: &str) -> PathBuf {
    write_prompts(&dir.join("alpha.jsonl"), "a", 60);
    write_prompts(&dir.join("beta.jsonl"), "b", 30);
    write_config(
        dir,
        url,
        "sglang",
        true,
        &[
            Ds {
                name: "alpha",
                file: "alpha.jsonl",
                budget: Some(1_000_000),
            },
            Ds {
                name: "beta",
                file: "beta.jsonl",
                budget: None,
            },
        ],
        "",
    )
}

/// Just enough of a VT100 to replay what indicatif and tracing write to a terminal:
/// printable text with deferred auto-wrap at the right margin, CR, LF, cursor up/down,
/// erase in line/display; colours and modes are ignored.
struct Vt {
    width: usize,
    rows: Vec<Vec<char>>,
    row: usize,
    col: usize,
    wrap: bool,
}

impl Vt {
    fn new(width: usize) -> Self {
        Vt {
            width,
            rows: vec![vec![' '; width]],
            row: 0,
            col: 0,
            wrap: false,
        }
    }

    fn ensure(&mut self) {
        while self.rows.len() <= self.row {
            self.rows.push(vec![' '; self.width]);
        }
    }

    fn feed(&mut self, s: &str) {
        let mut it = s.chars().peekable();
        while let Some(c) = it.next() {
            match c {
                '\u{1b}' => {
                    if it.peek() != Some(&'[') {
                        it.next();
                        continue;
                    }
                    it.next();
                    let mut params = String::new();
                    let mut fin = ' ';
                    for d in it.by_ref() {
                        if ('\u{40}'..='\u{7e}').contains(&d) {
                            fin = d;
                            break;
                        }
                        params.push(d);
                    }
                    let n = params.trim_start_matches('?').parse::<usize>().unwrap_or(0);
                    self.wrap = false;
                    match fin {
                        'A' => self.row = self.row.saturating_sub(n.max(1)),
                        'B' => self.row += n.max(1),
                        'C' => self.col = (self.col + n.max(1)).min(self.width - 1),
                        'D' => self.col = self.col.saturating_sub(n.max(1)),
                        'G' => self.col = n.saturating_sub(1).min(self.width - 1),
                        'K' => {
                            self.ensure();
                            let (r, c) = (self.row, self.col);
                            let range = match n {
                                1 => 0..c + 1,
                                2 => 0..self.width,
                                _ => c..self.width,
                            };
                            self.rows[r][range].iter_mut().for_each(|x| *x = ' ');
                        }
                        'J' if n == 0 => {
                            self.ensure();
                            let (r, c) = (self.row, self.col);
                            self.rows[r][c..].iter_mut().for_each(|x| *x = ' ');
                            self.rows.truncate(r + 1);
                        }
                        _ => {}
                    }
                    self.ensure();
                }
                '\r' => {
                    self.col = 0;
                    self.wrap = false;
                }
                '\n' => {
                    self.row += 1;
                    self.col = 0;
                    self.wrap = false;
                    self.ensure();
                }
                c if c.is_control() => {}
                c => {
                    if self.wrap {
                        self.row += 1;
                        self.col = 0;
                        self.wrap = false;
                    }
                    self.ensure();
                    let (r, col) = (self.row, self.col);
                    self.rows[r][col] = c;
                    if col + 1 == self.width {
                        self.wrap = true;
                    } else {
                        self.col += 1;
                    }
                }
            }
        }
    }

    /// The screen's lines, trailing blanks trimmed.
    fn lines(&self) -> Vec<String> {
        let mut l: Vec<String> = self
            .rows
            .iter()
            .map(|r| r.iter().collect::<String>().trim_end().to_string())
            .collect();
        while l.last().is_some_and(|x| x.is_empty()) {
            l.pop();
        }
        l
    }
}

/// Whether `l` holds the end of a dataset bar, `] NN%` (a log line may quote `[tokenizer] path`).
fn bar_end(l: &str) -> bool {
    l.match_indices("] ").any(|(i, _)| {
        let rest = l[i + 2..].trim_start();
        let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
        digits > 0 && rest[digits..].starts_with('%')
    })
}

/// Under a pseudo-terminal (`script`), `spool run` draws bars (one per dataset and a run
/// line, redrawn in place) instead of progress lines, and log lines written during the
/// run (debug retries of a faulty server) stay whole, above the bars, never on a bar's line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_bars_on_a_terminal() {
    let script = tool("script");
    let mock = Mock::start(MockConfig {
        fail_500: 0.1,
        ..slow_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = progress_setup(dir.path(), &mock.url);
    const WIDTH: usize = 200;
    let cmd = format!(
        "stty cols {WIDTH} rows 60; exec {} run -c {} --concurrency 16",
        spool_bin().display(),
        cfg.display()
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(script)
            .args(["-qfec", &cmd, "/dev/null"])
            .env("TERM", "xterm-256color")
            .env("RUST_LOG", "info,sled=warn,spool=debug")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let raw = String::from_utf8_lossy(&out.stdout).to_string();
    // 0, or 3 if an item failed for good against the faulty server.
    assert!(
        matches!(out.status.code(), Some(0 | 3)),
        "spool under script failed:\n{raw}"
    );
    // Redrawn in place: cursor-up and erase-line sequences.
    assert!(
        raw.contains("\u{1b}[1A") && raw.contains("\u{1b}[2K"),
        "no redraw sequences:\n{raw:?}"
    );
    // A running bar showed the rate and an ETA at some point.
    let flat = strip_ansi(&raw);
    assert!(
        flat.contains(" tok/s · ETA ") && flat.contains("/60 items · "),
        "no running bar:\n{flat}"
    );
    let mut vt = Vt::new(WIDTH);
    vt.feed(&raw);
    let screen = vt.lines();
    let shown = screen.join("\n");
    // The final bars: alpha, beta, then the run line (log lines after the run only
    // follow them).
    let i = screen
        .iter()
        .rposition(|l| l.starts_with("run ") && l.contains(" items · "))
        .unwrap_or_else(|| panic!("no run line:\n{shown}"));
    assert!(i >= 2, "{shown}");
    let (a, b, run_line) = (&screen[i - 2], &screen[i - 1], &screen[i]);
    // (An item may fail for good against this faulty server: "59/60 items (1 failed)".)
    assert!(
        a.starts_with("alpha [====================] 100% ")
            && a.contains("/60 items")
            && a.ends_with("/1.0M tok · done"),
        "alpha's final bar (items, tokens vs budget):\n{shown}"
    );
    assert!(
        b.starts_with("beta  [====================] 100% ")
            && b.contains("/30 items")
            && b.ends_with(" tok · done"),
        "beta's final bar:\n{shown}"
    );
    assert!(
        run_line.contains("/90 items · ") && run_line.ends_with(" · servers 1/1 up · ETA 0s"),
        "final run line:\n{shown}"
    );
    // No plain progress lines on a terminal.
    assert!(
        !screen.iter().any(|l| is_progress_line(l)),
        "plain progress lines on a terminal:\n{shown}"
    );
    // Log lines are whole and never share a line with a bar: the resume line of each
    // dataset, and the retries logged while the bars were drawn.
    for name in ["alpha", "beta"] {
        let l = screen
            .iter()
            .find(|l| l.contains(&format!(" INFO {name}: ")) && l.contains(" prompts ("))
            .unwrap_or_else(|| panic!("no resume line for {name}:\n{shown}"));
        assert!(
            l.ends_with("rejected this run"),
            "resume line cut or mixed: {l}"
        );
    }
    let retries: Vec<&String> = screen
        .iter()
        .filter(|l| l.contains("attempt failed; retrying"))
        .collect();
    assert!(
        !retries.is_empty(),
        "no retry logged during the run:\n{shown}"
    );
    for l in &retries {
        assert!(l.contains(" DEBUG "), "{l}");
    }
    for l in &screen {
        let log = l.contains(" INFO ") || l.contains(" DEBUG ") || l.contains(" WARN ");
        assert!(
            !(log && (l.contains(" items · ") || bar_end(l))),
            "a log line and a bar share a line: {l:?}\n{shown}"
        );
        assert!(
            !l.contains(" items · ")
                || l.starts_with("alpha ")
                || l.starts_with("beta ")
                || l.starts_with("run "),
            "a bar not at the start of its line: {l:?}\n{shown}"
        );
    }
}

/// Without a terminal (stderr piped) the progress lines are logged, with no escape codes,
/// ending with a final line per dataset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_lines_without_a_terminal() {
    let mock = Mock::start(slow_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = progress_setup(dir.path(), &mock.url);
    let mut run = spawn_run(&cfg, &["--concurrency", "16"], Stdio::piped());
    let mut stderr = run.child.stderr.take().unwrap();
    let text = tokio::task::spawn_blocking(move || {
        let mut s = String::new();
        use std::io::Read;
        stderr.read_to_string(&mut s).unwrap();
        s
    })
    .await
    .unwrap();
    assert_eq!(run.wait(Duration::from_secs(30)), Some(0), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes without a terminal:\n{text}"
    );
    let progress: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once(" INFO ").map(|x| x.1.trim()))
        .filter(|l| is_progress_line(l))
        .collect();
    for name in ["alpha", "beta"] {
        let mine: Vec<&&str> = progress
            .iter()
            .filter(|l| l.starts_with(&format!("{name} ")))
            .collect();
        assert!(!mine.is_empty(), "no progress line for {name}:\n{text}");
        let total = if name == "alpha" { 60 } else { 30 };
        assert!(
            mine.last().unwrap().starts_with(&format!(
                "{name} done={total}/{total} pending=0 inflight=0 "
            )),
            "the last line of {name} shows it finished:\n{text}"
        );
    }
    assert!(
        progress
            .iter()
            .any(|l| l.starts_with("alpha ") && l.contains("/1.0M ETA=")),
        "tokens against alpha's budget:\n{text}"
    );
    assert!(
        !text.contains(" items · "),
        "bars drawn without a terminal:\n{text}"
    );
}

#[test]
fn progress_line_shape_checker_is_strict() {
    assert!(is_progress_line(
        "B3_magicoder done=50/9998 pending=9940 inflight=8 failed=0 retries=2 0.3 req/s 1.1k tok/s avg_comp=1232tok tokens=100.0k/10.0M ETA=2h41m"
    ));
    assert!(is_progress_line(
        "b done=30/30 pending=0 inflight=0 failed=0 retries=2 12.0 req/s 480 tok/s avg_comp=40tok tokens=1200 ETA=0s"
    ));
    assert!(!is_progress_line(
        "b done=30/30 pending=0 inflight=0 failed=0 retries=2 12 req/s 480 tok/s avg_comp=40tok tokens=1200 ETA=0s"
    ));
    assert!(!is_progress_line(
        "b 30/30 (2 err) 12.0 req/s 480 tok/s avg_comp=40tok tot=0.0M ETA=0s"
    ));
    assert!(!is_progress_line(
        "b done=30/30 pending=0 inflight=0 failed=0 retries=2 12.0 req/s 480 tok/s"
    ));
}

// ---------------------------------------------------------------------------------------
// `spool status --json` shape

/// The `spool status --json` example of docs/metrics.md has exactly the keys the report serialises,
/// and names every `state` value.
#[test]
fn status_json_shape_matches_the_docs() {
    let page =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
            .unwrap();
    let section = page
        .split("## `spool status --json`")
        .nth(1)
        .expect("docs/metrics.md section `spool status --json`");
    let json = section
        .split("```json output\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("a ```json output block");
    let doc: serde_json::Value =
        serde_json::from_str(&json.replace('…', "...")).expect("docs/metrics.md JSON parses");
    let real = serde_json::to_value(spool::observe::status::StatusReport {
        running: true,
        datasets: vec![spool::observe::status::DatasetStatus::default()],
        servers: Vec::new(),
    })
    .unwrap();
    let keys =
        |v: &serde_json::Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(keys(&doc), keys(&real), "top-level keys");
    assert_eq!(
        keys(&doc["datasets"][0]),
        keys(&real["datasets"][0]),
        "dataset keys (same names, same order)"
    );
    for state in [
        "not_started",
        "pending",
        "running",
        "done",
        "budget_met",
        "failed_items",
    ] {
        assert!(section.contains(&format!("`{state}`")), "state {state}");
    }
}

/// The metrics table of docs/metrics.md is the one the scrape is checked against: every
/// series checked there is a row with the same type and labels, and every row names a
/// series spool defines.
#[test]
fn metrics_table_in_the_docs_matches_the_checked_series() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let defined = std::fs::read_to_string(root.join("src/observe/metrics.rs")).unwrap();
    let mut table: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in page.lines().filter(|l| l.starts_with("| `spool_")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`').to_string();
        let labels = cells[3]
            .split(',')
            .map(|l| l.trim().trim_matches('`').to_string())
            .filter(|l| !l.is_empty() && l != "—")
            .collect();
        assert!(
            defined.contains(&format!("\"{name}\"")),
            "docs/metrics.md lists {name}, which src/observe/metrics.rs does not define"
        );
        table.insert(name, (cells[2].to_string(), labels));
    }
    for (name, kind, labels) in DOCUMENTED_SERIES.iter().chain(EXTRA_SERIES) {
        let (t, l) = table
            .get(*name)
            .unwrap_or_else(|| panic!("{name} is not in the table of docs/metrics.md"));
        assert_eq!(t, kind, "{name}: type");
        assert_eq!(l, labels, "{name}: labels");
    }
}

// ---------------------------------------------------------------------------------------
// One definition of each count

/// A dataset's counts as one screen shows them: (done, pending, inflight, failed).
type Counts = (u64, u64, u64, u64);

fn report_counts(r: &serde_json::Value, name: &str) -> (Counts, u64, u64) {
    let d = r["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {r}"));
    let n = |k: &str| d[k].as_u64().unwrap_or_else(|| panic!("{k} in {d}"));
    (
        (n("done"), n("pending"), n("inflight"), n("failed")),
        n("items"),
        n("requests_inflight"),
    )
}

/// During a live run with two samples per prompt (so requests are not items), `/status`,
/// `spool status --json` (another process, through the endpoint), and `/metrics` taken at
/// one moment show the same counts; they add up to the items, `pending` excludes what is
/// in flight, `inflight` counts items and `requests_inflight` generations; a server's
/// requests in flight agree with `spool_inflight_requests`. Every progress line adds up too, and the last line of
/// each dataset is the final state `spool status` reads from the queue afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_status_endpoint_and_metrics_agree_at_one_moment() {
    let mock = Mock::start(slow_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = streaming_dataset(dir.path(), &mock.url, 120);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("path = \"p.jsonl\"\n", "path = \"p.jsonl\"\nsamples = 2\n")
        .replace("progress_every = 20", "progress_every = 5")
        .replace("metrics_addr = \"\"", "metrics_addr = \"127.0.0.1:0\"");
    std::fs::write(&cfg, text).unwrap();
    let mut run = spawn_run(&cfg, &["--concurrency", "6"], Stdio::piped());
    let mut stderr = run.child.stderr.take().unwrap();
    let log = tokio::task::spawn_blocking(move || {
        let mut s = String::new();
        use std::io::Read;
        stderr.read_to_string(&mut s).unwrap();
        s
    });
    let base = endpoint(&dir.path().join("data"), &mut run).await;
    let status_json = || async {
        let (code, body) = get(&format!("{base}/status")).await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    let mut agreed = 0;
    let mut items_apart = false;
    for _ in 0..200 {
        if !run.running() || agreed >= 5 {
            break;
        }
        let before = status_json().await;
        let (_, metrics) = get(&format!("{base}/metrics")).await;
        let cli = Command::new(spool_bin())
            .args(["status", "--json", "-q", "-c"])
            .arg(&cfg)
            .output()
            .unwrap();
        let after = status_json().await;
        let (counts, items, requests) = report_counts(&before, "a");
        if counts != report_counts(&after, "a").0 || !cli.status.success() {
            continue; // a tick (or the run's end) fell between the reads: not one moment
        }
        if counts.0 == 0 || counts.1 == 0 {
            continue; // not yet under way, or nothing left waiting
        }
        let cli: serde_json::Value = serde_json::from_slice(&cli.stdout).unwrap();
        assert!(cli["running"] == true, "{cli}");
        assert_eq!(
            report_counts(&cli, "a").0,
            counts,
            "spool status vs /status"
        );
        let fams = parse_exposition(&metrics);
        let gauge = |state: &str| {
            sample(&fams, "spool_items", &[("dataset", "a"), ("state", state)]) as u64
        };
        assert_eq!(
            (
                gauge("done"),
                gauge("pending"),
                gauge("inflight"),
                gauge("failed")
            ),
            counts,
            "/metrics vs /status:\n{before}"
        );
        let (done, pending, inflight, failed) = counts;
        assert_eq!(done + pending + inflight + failed, items, "{before}");
        // Attempts on the wire, per server: the same figure in both.
        assert_eq!(
            before["servers"][0]["inflight"].as_u64().unwrap(),
            sample(&fams, "spool_inflight_requests", &[("server", &mock.url)]) as u64,
            "a server's requests in flight: /status vs /metrics"
        );
        assert!(inflight <= requests && requests <= 2 * inflight, "{before}");
        items_apart |= inflight < requests;
        agreed += 1;
    }
    assert!(
        agreed >= 5,
        "only {agreed} consistent moments sampled while the run went on"
    );
    assert!(
        items_apart,
        "requests never outnumbered items in flight with 2 samples"
    );
    assert_eq!(run.wait(Duration::from_secs(60)), Some(0));
    let log = log.await.unwrap();
    let lines: Vec<_> = log
        .lines()
        .filter_map(|l| l.split_once(" INFO ").map(|x| x.1.trim()))
        .filter_map(progress_fields)
        .collect();
    assert!(lines.len() >= 3, "{log}");
    for (name, [done, total, pending, inflight, failed, _], _) in &lines {
        assert_eq!(name, "a");
        assert_eq!(done + pending + inflight + failed, *total, "{log}");
    }
    let final_status = Command::new(spool_bin())
        .args([
            "status",
            "--json",
            "-q",
            "--metrics-addr",
            "127.0.0.1:0",
            "-c",
        ])
        .arg(&cfg)
        .output()
        .unwrap();
    let final_status: serde_json::Value = serde_json::from_slice(&final_status.stdout).unwrap();
    let ((done, pending, inflight, failed), items, _) = report_counts(&final_status, "a");
    let (_, last, tokens) = lines.last().unwrap();
    assert_eq!(
        *last,
        [done, items, pending, inflight, failed, last[5]],
        "the last progress line is not the final state:\n{log}"
    );
    assert_eq!((done, items), (120, 120));
    // Tokens in human units: a few thousand, never `0.0M`.
    let completion = final_status["datasets"][0]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        completion > 0 && !tokens.starts_with("0.0"),
        "tokens={tokens}"
    );
    mock.stop().await;
}
