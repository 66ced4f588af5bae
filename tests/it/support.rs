//! Shared test support: an in-process mock server on a loopback port, configs and prompt
//! files in temp dirs, and readers of what spool left behind.

#![allow(dead_code)]

use spool::mock::{MockConfig, MockState, MockStats};
use spool::store::row::ShardRow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The mock inference server, serving until dropped or stopped.
pub struct Mock {
    pub url: String,
    pub state: Arc<MockState>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Mock {
    /// Starts a mock with `cfg` on 127.0.0.1, port 0.
    pub async fn start(cfg: MockConfig) -> Mock {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = MockState::new(cfg).unwrap();
        let stop = CancellationToken::new();
        let (st, s) = (state.clone(), stop.clone());
        let task = tokio::spawn(async move {
            spool::mock::serve_state(listener, st, async move { s.cancelled().await })
                .await
                .unwrap();
        });
        Mock {
            url,
            state,
            stop,
            task: Some(task),
        }
    }

    pub fn stats(&self) -> MockStats {
        self.state.stats()
    }

    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Fast mock settings: 1000× time, completions of ~50 tokens.
pub fn fast_mock() -> MockConfig {
    MockConfig {
        capacity_tps: 5000.0,
        per_request_tps: 500.0,
        ..MockConfig::for_tests()
    }
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The `[tokenizer]` table of the Qwen3 fixture (its tokenizer and chat template).
pub fn qwen_table() -> String {
    let dir = fixtures().join("tokenizers/qwen3");
    format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        dir.join("tokenizer.json").display(),
        dir.join("tokenizer_config.json").display()
    )
}

/// The real `spool` binary built for this test run.
pub fn spool_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_spool"))
}

/// Writes `n` prompt rows with explicit ids `"{prefix}{i}"`.
pub fn write_prompts(path: &Path, prefix: &str, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!(
            "{{\"id\": \"{prefix}{i}\", \"prompt\": \"Write item {i} of {prefix}: tell me about number {i}.\"}}\n"
        ));
    }
    std::fs::write(path, s).unwrap();
}

/// Writes `n` chat rows (alternating `messages` and ShareGPT `conversations`).
pub fn write_chats(path: &Path, prefix: &str, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        if i % 2 == 0 {
            s.push_str(&format!(
                "{{\"id\": \"{prefix}{i}\", \"messages\": [{{\"role\": \"system\", \"content\": \"You are terse.\"}}, {{\"role\": \"user\", \"content\": \"Question {i}: why?\"}}]}}\n"
            ));
        } else {
            s.push_str(&format!(
                "{{\"id\": \"{prefix}{i}\", \"conversations\": [{{\"from\": \"human\", \"value\": \"Question {i}: how?\"}}, {{\"from\": \"gpt\", \"value\": \"old answer\"}}]}}\n"
            ));
        }
    }
    std::fs::write(path, s).unwrap();
}

/// The plainest config: dataset `a` from `p.jsonl`, raw completions, no stream.
pub fn one_dataset(dir: &Path, url: &str) -> PathBuf {
    write_config(
        dir,
        url,
        "completions",
        false,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    )
}

/// `n` prompts in `p.jsonl` as dataset `a`, streamed from SGLang's native API at `url`.
pub fn streaming_dataset(dir: &Path, url: &str, n: usize) -> PathBuf {
    write_prompts(&dir.join("p.jsonl"), "p", n);
    write_config(
        dir,
        url,
        "sglang",
        true,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    )
}

/// A dataset entry of a test config.
pub struct Ds<'a> {
    pub name: &'a str,
    pub file: &'a str,
    pub budget: Option<u64>,
}

/// Writes `spool.toml` in `dir` and returns its path. `extra` is appended verbatim
/// before the datasets (e.g. `[tokenizer]` tables).
pub fn write_config(
    dir: &Path,
    url: &str,
    api: &str,
    stream: bool,
    datasets: &[Ds<'_>],
    extra: &str,
) -> PathBuf {
    let mut s = format!(
        r#"data_dir = "data"
output_dir = "out"

[server]
api = "{api}"
urls = ["{url}"]
model = "mock-model"
stream = {stream}
request_timeout_s = 20
max_attempts = 4
# Request counts in tests are exact: no start-up self-check request (tested on its own).
self_check = false

[run]
concurrency = 16
progress_every = 20
shutdown_grace_s = 5
metrics_addr = ""

[sampling]
max_tokens = 200

[shards]
max_rows = 25
{extra}
"#
    );
    for d in datasets {
        s.push_str(&format!(
            "\n[[dataset]]\nname = \"{}\"\npath = \"{}\"\n",
            d.name, d.file
        ));
        if let Some(b) = d.budget {
            s.push_str(&format!("token_budget = {b}\n"));
        }
    }
    let p = dir.join("spool.toml");
    std::fs::write(&p, s).unwrap();
    p
}

/// Loads a config the way the CLI does.
pub fn load(path: &Path) -> spool::config::Config {
    spool::config::Config::load(path, &Default::default()).unwrap()
}

/// Logs of the library go to the test's captured output.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info,sled=warn"))
        .with_test_writer()
        .try_init();
}

/// Runs the job in-process to the end.
pub async fn run_to_end(path: &Path) -> spool::run::job::RunSummary {
    init_logs();
    spool::run::job::run(
        load(path).into(),
        spool::knobs::Knobs::default(),
        std::future::pending(),
    )
    .await
    .unwrap()
}

/// Every `part-*.parquet` under `out/<dataset>/`, in name order.
pub fn shard_files(out: &Path, dataset: &str) -> Vec<PathBuf> {
    let dir = out.join(dataset);
    let mut v: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("part-") && n.ends_with(".parquet")
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// All rows of a dataset's shards.
pub fn shard_rows(out: &Path, dataset: &str) -> Vec<ShardRow> {
    shard_files(out, dataset)
        .iter()
        .flat_map(|p| spool::output::reader::read_rows(p).unwrap())
        .collect()
}

/// Asserts each of `ids` appears in exactly one row and nothing else does.
pub fn assert_exactly_once(rows: &[ShardRow], ids: &[String]) {
    let mut seen = std::collections::HashMap::<&str, usize>::new();
    for r in rows {
        *seen.entry(r.id.as_str()).or_default() += 1;
    }
    let dups: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dups.is_empty(), "duplicated ids: {dups:?}");
    let missing: Vec<_> = ids
        .iter()
        .filter(|i| !seen.contains_key(i.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "missing ids ({}): {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert_eq!(rows.len(), ids.len(), "rows that are not in the input");
}

/// Decodes mock token ids to the mock's text (token t is " w{t}"; 32001–32004 are the think
/// and tool-call markers; a tool call's JSON is one id per character from 0x1000000).
pub fn mock_text(ids: &[u32]) -> String {
    ids.iter()
        .map(|&t| match t {
            32001 => "<think>\n".to_string(),
            32002 => "\n</think>\n\n".to_string(),
            32003 => "<tool_call>\n".to_string(),
            32004 => "\n</tool_call>".to_string(),
            t if t >= 0x100_0000 => {
                char::from_u32(t - 0x100_0000).map_or(String::new(), String::from)
            }
            t => format!(" w{t}"),
        })
        .collect()
}

/// POSTs `body` as JSON to `url` + `path` (a server on loopback): the status and the JSON
/// answer.
pub async fn post_json(url: &str, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    spool::upstream::tls::install_provider();
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The JSON values of a JSONL file, blank lines skipped.
pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
