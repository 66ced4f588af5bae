//! Every input format, parallel intake, context limits, the start-up probe.

use crate::support::*;
use arrow_array::builder::{Int64Builder, ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Fields, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use serde_json::{json, Value};
use spool::config::Api;
use spool::input::dataset::read_all;
use spool::input::intake::IntakeOptions;
use spool::input::row::{Entry, Input};
use spool::prompt::{ChatTemplate, PromptBuilder, Tokenizer};
use spool::run::enqueue::intake;
use spool::run::probe::{self_check, StreamShape};
use spool::store::queue::Queue;
use spool::upstream::{Upstream, UpstreamOptions};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn qwen_builder() -> PromptBuilder {
    let dir = fixtures().join("tokenizers/qwen3");
    PromptBuilder::new(
        Some(ChatTemplate::from_file(&dir.join("tokenizer_config.json")).unwrap()),
        Some(Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap()),
    )
}

/// Rows used for both formats: (id, prompt, messages, conversations), any of them absent.
type Spec = (
    Option<i64>,
    Option<&'static str>,
    Option<Vec<(&'static str, &'static str)>>,
    Option<Vec<(&'static str, &'static str)>>,
);

fn specs() -> Vec<Spec> {
    vec![
        (Some(10), Some("plain prompt"), None, None),
        (
            Some(11),
            None,
            Some(vec![
                ("system", "Be brief."),
                ("user", "Why is the sky blue?"),
            ]),
            None,
        ),
        (
            None,
            None,
            None,
            Some(vec![("human", "What is 2+2?"), ("gpt", "old answer")]),
        ),
        // Bad: two shapes at once.
        (Some(13), Some("x"), Some(vec![("user", "y")]), None),
        // Bad: no shape at all.
        (Some(14), None, None, None),
        (Some(15), Some("   "), None, None),
        (
            Some(16),
            None,
            Some(vec![
                ("user", "hello"),
                ("assistant", "hi"),
                ("user", "bye"),
            ]),
            None,
        ),
    ]
}

fn turns_json(t: &[(&str, &str)], keys: (&str, &str)) -> Value {
    Value::Array(
        t.iter()
            .map(|(a, b)| json!({keys.0: a, keys.1: b}))
            .collect(),
    )
}

fn write_jsonl(path: &Path, specs: &[Spec]) {
    let mut s = String::new();
    for (id, p, m, c) in specs {
        let mut o = serde_json::Map::new();
        if let Some(id) = id {
            o.insert("id".into(), json!(id));
        }
        if let Some(p) = p {
            o.insert("prompt".into(), json!(p));
        }
        if let Some(m) = m {
            o.insert("messages".into(), turns_json(m, ("role", "content")));
        }
        if let Some(c) = c {
            o.insert("conversations".into(), turns_json(c, ("from", "value")));
        }
        s.push_str(&Value::Object(o).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

fn turns_builder(keys: (&str, &str)) -> ListBuilder<StructBuilder> {
    let fields = Fields::from(vec![
        Field::new(keys.0, DataType::Utf8, true),
        Field::new(keys.1, DataType::Utf8, true),
    ]);
    ListBuilder::new(StructBuilder::from_fields(fields, 0))
}

fn append_turns(b: &mut ListBuilder<StructBuilder>, t: &Option<Vec<(&str, &str)>>) {
    match t {
        None => b.append(false),
        Some(t) => {
            for (x, y) in t {
                let s = b.values();
                s.field_builder::<StringBuilder>(0).unwrap().append_value(x);
                s.field_builder::<StringBuilder>(1).unwrap().append_value(y);
                s.append(true);
            }
            b.append(true);
        }
    }
}

/// Writes `specs` as Parquet with row groups of `group` rows: `messages` and
/// `conversations` as list<struct>, `id` as int64, plus a column spool must ignore.
fn write_parquet(path: &Path, specs: &[Spec], group: usize) {
    let mut id = Int64Builder::new();
    let mut prompt = StringBuilder::new();
    let mut messages = turns_builder(("role", "content"));
    let mut conv = turns_builder(("from", "value"));
    let mut other = StringBuilder::new();
    for (i, p, m, c) in specs {
        id.append_option(*i);
        prompt.append_option(*p);
        append_turns(&mut messages, m);
        append_turns(&mut conv, c);
        other.append_value("ignored");
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(other.finish()),
        Arc::new(id.finish()),
        Arc::new(prompt.finish()),
        Arc::new(messages.finish()),
        Arc::new(conv.finish()),
    ];
    let batch = RecordBatch::try_from_iter(
        ["source", "id", "prompt", "messages", "conversations"]
            .into_iter()
            .zip(columns),
    )
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group))
        .build();
    let mut w = ArrowWriter::try_new(
        std::fs::File::create(path).unwrap(),
        batch.schema(),
        Some(props),
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn summary(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .map(|e| match e {
            Entry::Row(r) => format!(
                "row {} id={} hash={:?} input={:?}",
                r.row, r.id, r.hash, r.input
            ),
            Entry::Rejected(j) => format!("rejected {} {}: {}", j.row, j.line, j.reason),
        })
        .collect()
}

/// A Parquet row is the same item as the equivalent JSONL line (same id, hash, input,
/// rejection), rows are numbered 0.. across row groups, and other columns are ignored.
#[test]
fn parquet_rows_parse_exactly_like_jsonl_lines_across_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let (jp, pp) = (dir.path().join("a.jsonl"), dir.path().join("a.parquet"));
    let specs = specs();
    write_jsonl(&jp, &specs);
    write_parquet(&pp, &specs, 3);
    let groups = parquet::arrow::arrow_reader::ArrowReaderMetadata::load(
        &std::fs::File::open(&pp).unwrap(),
        Default::default(),
    )
    .unwrap()
    .metadata()
    .num_row_groups();
    assert_eq!(groups, 3, "7 rows in row groups of 3");

    let from_jsonl = summary(&read_all(&jp, "d").unwrap());
    let from_parquet = summary(&read_all(&pp, "d").unwrap());
    assert_eq!(from_parquet, from_jsonl);
    let kinds: Vec<&str> = from_parquet
        .iter()
        .map(|s| s.split(' ').next().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["row", "row", "row", "rejected", "rejected", "rejected", "row"]
    );
    assert!(from_parquet[3].contains("several"), "{}", from_parquet[3]);
    assert!(from_parquet[4].contains("none of"), "{}", from_parquet[4]);
    assert!(
        from_parquet[6].starts_with("row 6 id=16"),
        "{}",
        from_parquet[6]
    );
    // The ShareGPT row lost its trailing assistant turn, in both formats.
    assert!(from_parquet[2].contains("What is 2+2?") && !from_parquet[2].contains("old answer"));
}

/// `messages` given as a JSON string column and `id` as a string column also work, and a
/// cell that is not JSON is a rejection naming the row, not an error.
#[test]
fn parquet_json_string_columns_and_string_ids() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.parquet");
    let ids = arrow_array::StringArray::from(vec![Some("a"), Some("b"), None]);
    let msgs = arrow_array::StringArray::from(vec![
        Some(r#"[{"role": "user", "content": "hi"}]"#),
        Some("[not json"),
        Some(r#"[{"role": "user", "content": "third"}]"#),
    ]);
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(ids) as ArrayRef),
        ("messages", Arc::new(msgs) as ArrayRef),
    ])
    .unwrap();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(&p).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let entries = read_all(&p, "d").unwrap();
    match &entries[0] {
        Entry::Row(r) => {
            assert_eq!(r.id, "a");
            assert_eq!(
                r.input,
                Input::Messages(json!([{"role": "user", "content": "hi"}]))
            );
        }
        other => panic!("{other:?}"),
    }
    match &entries[1] {
        Entry::Rejected(j) => {
            assert_eq!((j.row, j.line), (1, 2));
            assert!(j.reason.contains("not valid JSON"), "{}", j.reason);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(&entries[2], Entry::Row(r) if r.row == 2 && r.id.len() == 24));

    // A file without any prompt column, or that is not Parquet, is a file error (exit 2).
    let q = dir.path().join("none.parquet");
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("text", DataType::Utf8, false)])),
        vec![Arc::new(arrow_array::StringArray::from(vec!["x"]))],
    )
    .unwrap();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(&q).unwrap(), batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let err = read_all(&q, "d").unwrap_err().to_string();
    assert!(
        err.contains("none.parquet") && err.contains("none of the columns"),
        "{err}"
    );
    std::fs::write(dir.path().join("junk.parquet"), b"not parquet at all").unwrap();
    let err = read_all(&dir.path().join("junk.parquet"), "d")
        .unwrap_err()
        .to_string();
    assert!(err.contains("junk.parquet"), "{err}");
}

/// Writes `n` chat rows, a few of them bad or duplicated, with varied lengths.
fn write_mixed_chats(path: &Path, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        match i % 97 {
            13 => s.push_str("{not json\n"),
            29 => s.push_str(&format!(
                "{{\"id\": \"c{}\", \"prompt\": \"dup\"}}\n",
                i - 1
            )),
            41 => s.push_str("{\"messages\": [{\"role\": \"user\", \"content\": \"\"}]}\n"),
            _ => {
                let words = "lorem ipsum dolor sit amet ".repeat(1 + i % 7);
                s.push_str(&format!(
                    "{{\"id\": \"c{i}\", \"messages\": [{{\"role\": \"system\", \"content\": \"You are terse.\"}}, {{\"role\": \"user\", \"content\": \"Question {i}: {words}\"}}]}}\n"
                ));
            }
        }
    }
    std::fs::write(path, s).unwrap();
}

fn dataset_cfg(path: &Path, cap: Option<u64>) -> spool::config::DatasetConfig {
    spool::config::DatasetConfig {
        name: "d".into(),
        path: path.to_path_buf(),
        token_budget: None,
        max_prompts: cap,
        sampling: Default::default(),
        reasoning: None,
        turns: None,
        history_reasoning: None,
        samples: None,
        chat_template_kwargs: None,
        on_length: None,
        prompt_format: None,
    }
}

/// Everything a queue holds for dataset `d`, in row order.
fn dump(q: &Queue, ds: u16) -> Vec<String> {
    let s = q.state(ds).unwrap();
    let mut out = vec![format!(
        "items={} rejected={} scanned={}",
        s.items, s.rejected, s.scanned_lines
    )];
    for row in 0..s.scanned_lines + 10 {
        if let Some(item) = q.item(ds, row).unwrap() {
            out.push(format!(
                "{row} {} {:?} {:?}",
                item.id, item.prompt_ids, item.prompt
            ));
        }
    }
    out
}

fn run_intake(dir: &Path, file: &Path, threads: usize, cap: Option<u64>) -> (Vec<String>, String) {
    let data = dir.join(format!("q{threads}"));
    let out = dir.join(format!("o{threads}"));
    let q = Queue::open(&data).unwrap();
    let ds = q.open_dataset("d").unwrap().index;
    let opts = IntakeOptions {
        threads,
        max_tokens: 100,
        ..Default::default()
    };
    let b = qwen_builder();
    intake(&q, ds, &dataset_cfg(file, cap), &b, &out, &opts).unwrap();
    let rejected = std::fs::read_to_string(out.join("d/_rejected.jsonl")).unwrap_or_default();
    (dump(&q, ds), rejected)
}

/// Parallel intake gives exactly what a single thread gives (items, ids, rows, rejections
/// and their order), stops at `max_prompts` at the same line, and resumes without
/// enqueueing anything twice.
#[test]
fn parallel_intake_equals_sequential_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.jsonl");
    write_mixed_chats(&file, 3000);
    let (one, rej_one) = run_intake(dir.path(), &file, 1, None);
    let (four, rej_four) = run_intake(dir.path(), &file, 4, None);
    assert_eq!(one.len(), four.len());
    assert_eq!(
        one, four,
        "4 threads must enqueue exactly what 1 thread does"
    );
    assert_eq!(rej_one, rej_four);
    assert!(
        one[0].starts_with("items=2907 rejected=93 scanned=3000"),
        "{}",
        one[0]
    );
    // Ids are the template's rendering encoded without special tokens.
    let b = qwen_builder();
    let m = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Question 5: ".to_string() + &"lorem ipsum dolor sit amet ".repeat(6)}]);
    let want = b.build_chat(&m).unwrap();
    assert!(one
        .iter()
        .any(|l| l.starts_with(&format!("5 c5 {:?}", want.token_ids))));

    // max_prompts with 3 threads: the same first 500 items, the scan stops at the 500th.
    let capped = dir.path().join("capped");
    std::fs::create_dir_all(&capped).unwrap();
    let (cap3, _) = run_intake(&capped, &file, 3, Some(500));
    let head: Vec<&String> = one[1..].iter().take(500).collect();
    assert_eq!(cap3[1..].iter().collect::<Vec<_>>(), head);
    // The scan position stops just before the first item not taken in.
    let next_row: u64 = one[501].split(' ').next().unwrap().parse().unwrap();
    assert!(
        cap3[0].ends_with(&format!("scanned={next_row}")),
        "{}",
        cap3[0]
    );
    // Resumed without the cap: the rest is added, nothing twice, same result as one pass.
    let (resumed, _) = run_intake(&capped, &file, 3, None);
    assert_eq!(resumed, one);
}

/// The context limit: prompts that leave no room for generation are rejected at intake
/// (with the reason in `_rejected.jsonl`) and never sent; the rest complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_over_the_context_are_rejected_before_sending() {
    let mock = Mock::start(spool::mock::MockConfig {
        context_len: 64,
        ..fast_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut s = String::new();
    for i in 0..20 {
        let words = if i % 4 == 0 {
            "word ".repeat(80)
        } else {
            format!("short {i}")
        };
        s.push_str(&format!(
            "{{\"id\": \"r{i}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{words}\"}}]}}\n"
        ));
    }
    std::fs::write(dir.path().join("c.jsonl"), s).unwrap();
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "c",
            file: "c.jsonl",
            budget: None,
        }],
        &format!("{}\n", qwen_table()),
    );
    let summary = run_to_end(&cfg).await;
    let d = &summary.report.datasets[0];
    assert_eq!((d.items, d.done, d.rejected, d.failed), (15, 15, 5, 0));
    let out = dir.path().join("out");
    let rej: Vec<Value> = std::fs::read_to_string(out.join("c/_rejected.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rej.len(), 5);
    for (k, r) in rej.iter().enumerate() {
        assert_eq!(r["row"], json!(k * 4));
        let reason = r["reason"].as_str().unwrap();
        assert!(
            reason.contains("context length is 64") && reason.contains("no room for generation"),
            "{reason}"
        );
    }
    let rows = shard_rows(&out, "c");
    assert_eq!(rows.len(), 15);
    assert!(rows
        .iter()
        .all(|r| r.prompt_token_ids.as_ref().unwrap().len() < 64));
    // Nothing reached the server only to be refused there.
    assert_eq!(mock.stats().count(spool::mock::Outcome::BadRequest), 0);
    mock.stop().await;
}

/// A server that records every request and answers a fixed completion.
async fn recording_server(context: u32) -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
    use axum::routing::{get, post};
    let seen: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
    let s2 = seen.clone();
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(move || async move {
                axum::Json(json!({"object": "list", "data": [{"id": "mock-model", "max_model_len": context}]}))
            }),
        )
        .route(
            "/v1/completions",
            post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let seen = s2.clone();
                async move {
                    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                    let v: Value = serde_json::from_slice(&body).unwrap();
                    seen.lock().unwrap().push((rid, v));
                    axum::Json(json!({"choices": [{"index": 0, "text": " w1", "finish_reason": "stop", "token_ids": [1]}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (url, seen)
}

/// `clamp_max_tokens = true` sends min(max_tokens, context − prompt tokens) in each
/// request; without it, max_tokens goes as configured. The context comes from
/// `/v1/models` `max_model_len`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clamp_max_tokens_reaches_the_request() {
    for clamp in [true, false] {
        let (url, seen) = recording_server(96).await;
        let dir = tempfile::tempdir().unwrap();
        write_chats(&dir.path().join("c.jsonl"), "c", 12);
        let cfg = write_config(
            dir.path(),
            &url,
            "completions",
            false,
            &[Ds {
                name: "c",
                file: "c.jsonl",
                budget: None,
            }],
            &format!("{}\n", qwen_table()),
        );
        // server.* keys go in the [server] table of the generated config.
        let text = std::fs::read_to_string(&cfg).unwrap().replace(
            "max_attempts = 4\n",
            &format!("max_attempts = 4\nclamp_max_tokens = {clamp}\n"),
        );
        std::fs::write(&cfg, text).unwrap();
        let summary = run_to_end(&cfg).await;
        assert_eq!(summary.report.datasets[0].done, 12);
        let seen = seen.lock().unwrap().clone();
        let work: Vec<&(String, Value)> = seen
            .iter()
            .filter(|(rid, _)| !rid.starts_with("_selfcheck"))
            .collect();
        assert_eq!(work.len(), 12, "one request per prompt");
        for (rid, body) in work {
            let prompt = body["prompt"].as_array().expect("token ids sent").len() as u64;
            let max = body["max_tokens"].as_u64().unwrap();
            let want = if clamp { 200.min(96 - prompt) } else { 200 };
            assert!(prompt > 0 && prompt < 96);
            assert_eq!(max, want, "clamp={clamp} {rid}: prompt {prompt} tokens");
        }
    }
}

fn upstream(api: Api, stream: bool) -> Upstream {
    Upstream::new(UpstreamOptions {
        api,
        model: "mock-model".into(),
        api_key: None,
        stream,
        request_timeout: Duration::from_secs(20),
        max_response_bytes: 1 << 20,
        pool_size: 4,
    })
    .unwrap()
}

/// The self-check tells SGLang's cumulative stream from its incremental one, and sees
/// whether ids and usage come back, whatever the server's flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_check_learns_the_stream_shape_ids_and_usage() {
    // Slow enough that 8 tokens come in several events.
    let slow = |incremental, no_token_ids, no_usage| spool::mock::MockConfig {
        time_scale: 1.0,
        per_request_tps: 300.0,
        capacity_tps: 5000.0,
        incremental,
        no_token_ids,
        no_usage,
        ..spool::mock::MockConfig::for_tests()
    };
    for (incremental, want) in [
        (false, StreamShape::Cumulative),
        (true, StreamShape::Incremental),
    ] {
        let mock = Mock::start(slow(incremental, false, false)).await;
        let c = self_check(
            &upstream(Api::Sglang, true),
            &mock.url,
            Api::Sglang,
            "mock-model",
            true,
            None,
            1,
        )
        .await
        .unwrap();
        assert_eq!(c.stream, Some(want), "{c:?}");
        assert!(c.events >= 2 && c.token_ids && c.usage, "{c:?}");
        mock.stop().await;
    }
    let mock = Mock::start(slow(false, true, true)).await;
    let c = self_check(
        &upstream(Api::Completions, true),
        &mock.url,
        Api::Completions,
        "mock-model",
        true,
        None,
        2,
    )
    .await
    .unwrap();
    assert_eq!(
        (c.stream, c.token_ids, c.usage),
        (Some(StreamShape::Incremental), false, false),
        "{c:?}"
    );
    let c = self_check(
        &upstream(Api::Chat, false),
        &mock.url,
        Api::Chat,
        "mock-model",
        false,
        None,
        3,
    )
    .await
    .unwrap();
    assert_eq!((c.stream, c.usage), (None, false), "{c:?}");
    mock.stop().await;
    let mock = Mock::start(slow(false, false, false)).await;
    let c = self_check(
        &upstream(Api::Completions, false),
        &mock.url,
        Api::Completions,
        "mock-model",
        false,
        None,
        4,
    )
    .await
    .unwrap();
    assert_eq!(
        (c.stream, c.token_ids, c.usage),
        (None, true, true),
        "{c:?}"
    );
    // The context length the run would use.
    let up = upstream(Api::Sglang, true);
    let found = spool::run::probe::discover_context(&up, &mock.url, "mock-model")
        .await
        .unwrap();
    assert_eq!(found.tokens, 32768);
    mock.stop().await;
}

/// A `.parquet` dataset runs end to end: rows numbered across row groups, bad rows in
/// `_rejected.jsonl` with their row number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_dataset_end_to_end() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_parquet(&dir.path().join("p.parquet"), &specs(), 2);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "p",
            file: "p.parquet",
            budget: None,
        }],
        &format!("{}\n", qwen_table()),
    );
    let summary = run_to_end(&cfg).await;
    let d = &summary.report.datasets[0];
    assert_eq!((d.items, d.done, d.rejected), (4, 4, 3));
    let out = dir.path().join("out");
    let mut rows: Vec<(u64, String)> = shard_rows(&out, "p")
        .into_iter()
        .map(|r| (r.row, r.id))
        .collect();
    rows.sort();
    assert_eq!(rows[0], (0, "10".to_string()));
    assert_eq!(rows[3], (6, "16".to_string()));
    let rej = std::fs::read_to_string(out.join("p/_rejected.jsonl")).unwrap();
    let rows: Vec<u64> = rej
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["row"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(rows, [3, 4, 5]);
    assert!(rej.contains("p.parquet"));
    mock.stop().await;
}

/// The boundary: a prompt of n tokens needs a context of at least n + 1 (one token to
/// generate); at exactly n it is rejected, and the count of prompts short of
/// `max_tokens` room is reported.
#[test]
fn context_limit_boundary_is_one_token_of_room() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.jsonl");
    std::fs::write(
        &file,
        "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"How long is this prompt?\"}]}\n",
    )
    .unwrap();
    let b = qwen_builder();
    let n = b
        .build_chat(&json!([{"role": "user", "content": "How long is this prompt?"}]))
        .unwrap()
        .token_ids
        .unwrap()
        .len() as u32;
    for (ctx, added) in [(n, 0), (n + 1, 1)] {
        let sub = dir.path().join(format!("ctx{ctx}"));
        let q = Queue::open(&sub.join("data")).unwrap();
        let ds = q.open_dataset("d").unwrap().index;
        let opts = IntakeOptions {
            context_length: Some(ctx),
            max_tokens: 100,
            threads: 2,
            ..Default::default()
        };
        let rep = intake(
            &q,
            ds,
            &dataset_cfg(&file, None),
            &b,
            &sub.join("out"),
            &opts,
        )
        .unwrap();
        assert_eq!(
            (rep.added, rep.over_context),
            (added, 1 - added),
            "context {ctx}, prompt {n}"
        );
        assert_eq!(rep.short_of_room, added, "{n} + 100 > {ctx}");
        assert_eq!(rep.prompt_tokens, u64::from(n) * added);
    }
}

/// With `turns = "all"` and `reasoning = "disable"`: a ShareGPT conversation keeps every
/// message (its trailing assistant turn too) and its prompt is turn 0's request rendered
/// with `enable_thinking = false` (never an original reply); a row's `tools` are rendered
/// into the prompt; a conversation with no turn to generate and bad
/// `tools` are rejected naming their lines.
#[test]
fn whole_conversations_tools_and_static_kwargs_at_intake() {
    use spool::config::{GenerationSpec, Reasoning, Turns};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.jsonl");
    let tools = json!([{"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {}}}}]);
    let lines = [
        json!({"id": "conv", "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U0"}, {"from": "gpt", "value": "ORIGINAL0"},
            {"from": "human", "value": "U1"}, {"from": "gpt", "value": "ORIGINAL1"}]}),
        json!({"id": "tooled", "messages": [{"role": "user", "content": "time?"}],
            "tools": tools}),
        json!({"id": "none", "messages": [{"role": "system", "content": "only a system"}]}),
        json!({"id": "badtools", "messages": [{"role": "user", "content": "x"}],
            "tools": "get_time"}),
        json!({"id": "badtool", "messages": [{"role": "user", "content": "x"}],
            "tools": [1]}),
    ];
    std::fs::write(
        &file,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let q = Queue::open(&dir.path().join("data")).unwrap();
    let ds = q.open_dataset("d").unwrap().index;
    let opts = IntakeOptions {
        threads: 2,
        max_tokens: 100,
        generation: GenerationSpec {
            reasoning: Reasoning::Disable,
            turns: Turns::All,
            samples: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let b = qwen_builder();
    let out = dir.path().join("out");
    let rep = intake(&q, ds, &dataset_cfg(&file, None), &b, &out, &opts).unwrap();
    assert_eq!((rep.added, rep.rejected), (2, 3));

    let conv = q.item(ds, 0).unwrap().unwrap();
    let messages: Value = serde_json::from_str(conv.messages.as_deref().unwrap()).unwrap();
    assert_eq!(messages.as_array().unwrap().len(), 5, "{messages}");
    assert_eq!(messages[4]["content"], "ORIGINAL1");
    let no_thinking = serde_json::Map::from_iter([("enable_thinking".into(), json!(false))]);
    let want = b
        .build_chat_with(
            &json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U0"}]),
            &no_thinking,
        )
        .unwrap();
    assert_eq!(conv.prompt, want.text);
    assert_eq!(conv.prompt_ids, want.token_ids);
    assert!(conv
        .prompt
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!conv.prompt.contains("ORIGINAL"));
    assert_eq!(conv.extra, None);

    // The item's `extra` ({"tools": [...]}) is checked where it is built
    // (`enqueue::tests::tools_go_into_the_item_extra`).
    let tooled = q.item(ds, 1).unwrap().unwrap();
    assert!(tooled.prompt.contains("# Tools"), "{}", tooled.prompt);
    assert!(
        tooled.prompt.contains("\"name\": \"get_time\""),
        "{}",
        tooled.prompt
    );

    let rejected = std::fs::read_to_string(out.join("d/_rejected.jsonl")).unwrap();
    let rejected: Vec<Value> = rejected
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let by_line: Vec<(u64, String)> = rejected
        .iter()
        .map(|r| {
            (
                r["line"].as_u64().unwrap(),
                r["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(by_line.len(), 3, "{by_line:?}");
    assert_eq!(by_line[0].0, 3);
    assert!(by_line[0].1.contains("no assistant turn"), "{by_line:?}");
    assert_eq!(by_line[1].0, 4);
    assert!(
        by_line[1].1.contains("`tools` must be an array"),
        "{by_line:?}"
    );
    assert_eq!(by_line[2].0, 5);
    assert!(
        by_line[2].1.contains("tools[0] must be an object"),
        "{by_line:?}"
    );
}

/// With the default `turns = "last"`, a ShareGPT conversation's trailing assistant turn is
/// still dropped and a row without tools keeps the id it always had (tools are content
/// only when present).
#[test]
fn last_turn_intake_is_unchanged_by_tools_support() {
    let row =
        r#"{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}"#;
    let plain = spool::input::row::parse_row("d", 0, row).unwrap();
    assert_eq!(
        plain.input,
        Input::Messages(json!([{"role": "user", "content": "a"}]))
    );
    let msgs = r#"{"messages": [{"role": "user", "content": "a"}]}"#;
    let a = spool::input::row::parse_row("d", 0, msgs).unwrap();
    assert_eq!(a.id, plain.id, "the dropped turn leaves the same content");
    let with_tools =
        r#"{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}"#;
    let t = spool::input::row::parse_row("d", 0, with_tools).unwrap();
    assert_ne!(t.id, a.id);
    assert_ne!(t.hash, a.hash);
    assert_eq!(t.tools, Some(json!([{"type": "function"}])));
}

/// A dataset kept in object storage (here `file://`, the same door as `s3://`) is fetched
/// into `data_dir/inputs/<dataset>/` under its own name, so a `.parquet` object reads as
/// the file does; fetched once, and again when the object changes; the config is left as
/// loaded.
#[tokio::test]
async fn a_parquet_object_is_fetched_once_and_reads_like_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    let object = store.join("prompts.parquet");
    write_parquet(&object, &specs(), 3);
    let cfg_path = crate::support::write_config(
        dir.path(),
        "http://127.0.0.1:9",
        "sglang",
        true,
        &[crate::support::Ds {
            name: "d",
            file: &format!("file://{}", object.display()),
            budget: None,
        }],
        "",
    );
    let cfg = crate::support::load(&cfg_path);
    let copies = spool::run::inputs::fetch_inputs(&cfg).await.unwrap();
    let local = copies["d"].clone();
    assert_eq!(local, dir.path().join("data/inputs/d/prompts.parquet"));
    // The copy is the run's plan; the config keeps the object's URL.
    assert!(cfg.datasets[0]
        .path
        .to_string_lossy()
        .starts_with("file://"));
    assert_eq!(
        summary(&read_all(&local, "d").unwrap()),
        summary(&read_all(&object, "d").unwrap())
    );
    // Unchanged: not fetched again (the copy's mtime stays).
    let t0 = std::fs::metadata(&local).unwrap().modified().unwrap();
    let again = crate::support::load(&cfg_path);
    spool::run::inputs::fetch_inputs(&again).await.unwrap();
    assert_eq!(std::fs::metadata(&local).unwrap().modified().unwrap(), t0);
    // Changed (other bytes): fetched again.
    write_parquet(&object, &specs()[..3], 2);
    let changed = crate::support::load(&cfg_path);
    spool::run::inputs::fetch_inputs(&changed).await.unwrap();
    assert_eq!(read_all(&local, "d").unwrap().len(), 3);
}
