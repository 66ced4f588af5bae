//! The server's own rendering, against the mock serving vLLM's, llama.cpp's and SGLang's
//! rendering endpoints with the real Qwen3 tokenizer: `[tokenizer] source = "server"`
//! stores (and sends) exactly the ids the server renders; the start-up template check
//! passes on the same template and stops a run on a different one with a readable diff;
//! chat answers' prompt ids are kept as the server's, and a count that disagrees with
//! spool's rendering is counted.

use crate::process::{edit_config, mock_log, spool, Proc};
use crate::support::*;
use serde_json::{json, Value};
use spool::mock::{MockConfig, TokenizeApi};
use spool::prompt::remote::IdsSource;
use spool::store::row::ShardRow;
use spool::upstream::render::{detect, Detected, RenderKind};
use spool::upstream::{Upstream, UpstreamOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn qwen_dir() -> PathBuf {
    fixtures().join("tokenizers/qwen3")
}

/// Qwen3's own template (what spool's `[tokenizer]` uses).
fn qwen_template() -> PathBuf {
    qwen_dir().join("tokenizer_config.json")
}

/// A ChatML template that differs from Qwen3's on purpose: its generation prompt closes
/// an empty think block, as Qwen3's does only with `enable_thinking = false`.
fn different_template(dir: &Path) -> PathBuf {
    let p = dir.join("different.jinja");
    std::fs::write(
        &p,
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
    )
    .unwrap();
    p
}

/// A fast mock with Qwen3's real tokenizer, rendering chat with `template`, serving `api`'s
/// rendering endpoints, logging request bodies to `dir/mock.log`.
fn mock_cfg(dir: &Path, api: Option<TokenizeApi>, template: PathBuf) -> MockConfig {
    MockConfig {
        tokenizer: Some(qwen_dir().join("tokenizer.json")),
        chat_template: Some(template),
        tokenize_api: api,
        log: Some(dir.join("mock.log")),
        log_bodies: true,
        ..fast_mock()
    }
}

/// A config of two datasets (chats and plain prompts) with the Qwen3 `[tokenizer]` and
/// `lines` added to it.
fn config(dir: &Path, url: &str, api: &str, lines: &str) -> PathBuf {
    write_chats(&dir.join("chat.jsonl"), "c", 8);
    write_prompts(&dir.join("plain.jsonl"), "p", 4);
    let ds = |name, file| Ds {
        name,
        file,
        budget: None,
    };
    write_config(
        dir,
        url,
        api,
        false,
        &[ds("chat", "chat.jsonl"), ds("plain", "plain.jsonl")],
        &format!("{}{lines}", qwen_table()),
    )
}

/// POSTs `body` to the mock's `path`: the status and the JSON answer.
async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    post_json(url, path, body).await
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not ids: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// What the vLLM-style mock renders for `messages`: text and ids.
async fn vllm_rendering(url: &str, messages: &Value) -> (String, Vec<u32>) {
    let (s, v) = post(
        url,
        "/tokenize",
        json!({"model": "mock-model", "messages": messages}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let ids = ids(&v["tokens"]);
    let (s, t) = post(url, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(s, 200, "{t}");
    (t["prompt"].as_str().unwrap().to_string(), ids)
}

/// What spool itself renders for `messages` (Qwen3's template and tokenizer).
fn spool_rendering(messages: &Value) -> Vec<u32> {
    static BUILDER: std::sync::OnceLock<spool::prompt::PromptBuilder> = std::sync::OnceLock::new();
    let builder = BUILDER.get_or_init(|| {
        spool::prompt::PromptBuilder::new(
            Some(spool::prompt::ChatTemplate::from_file(&qwen_template()).unwrap()),
            Some(spool::prompt::Tokenizer::from_file(&qwen_dir().join("tokenizer.json")).unwrap()),
        )
    });
    builder.build_chat(messages).unwrap().token_ids.unwrap()
}

fn rows_of(dir: &Path, dataset: &str) -> Vec<ShardRow> {
    let rows = shard_rows(&dir.join("out"), dataset);
    assert!(!rows.is_empty(), "no rows in {dataset}");
    rows
}

/// The `prompt` sent for each `(dataset, row)` in the mock's log.
fn sent_prompts(dir: &Path) -> std::collections::HashMap<(String, u64), Value> {
    mock_log(&dir.join("mock.log"))
        .into_iter()
        .filter(|l| l.outcome == "ok")
        .map(|l| ((l.ds, l.row), l.request.unwrap()["prompt"].clone()))
        .collect()
}

/// `source = "server"` against a vLLM-style server whose template differs from spool's:
/// every chat row stores exactly the ids and text the server's `/tokenize` and
/// `/detokenize` give for its messages — not spool's own rendering — marked `server`,
/// and those ids are what `/v1/completions` was sent; plain prompts are tokenized there
/// too. (`template_check = false`: the difference is the point here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_rendering_stores_and_sends_the_servers_ids() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Vllm),
        different_template(dir.path()),
    ))
    .await;
    let cfg = config(
        dir.path(),
        &mock.url,
        "completions",
        "source = \"server\"\ntemplate_check = false\n",
    );
    let summary = run_to_end(&cfg).await;
    assert_eq!(summary.exit_code(), 0);
    let sent = sent_prompts(dir.path());
    let chat = rows_of(dir.path(), "chat");
    assert_eq!(chat.len(), 8);
    for r in &chat {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        let (text, want) = vllm_rendering(&mock.url, &messages).await;
        assert_eq!(r.prompt_token_ids.as_ref(), Some(&want), "row {}", r.row);
        assert_eq!(r.prompt, text);
        assert!(
            text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{text}"
        );
        assert_ne!(
            spool_rendering(&messages),
            want,
            "spool renders the same: proves nothing"
        );
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
        assert_eq!(r.prompt_tokens as usize, want.len());
        assert_eq!(
            sent[&("chat".to_string(), r.row)],
            json!(want),
            "row {}",
            r.row
        );
    }
    for r in rows_of(dir.path(), "plain") {
        let (s, v) = post(&mock.url, "/tokenize", json!({"prompt": r.prompt})).await;
        assert_eq!(s, 200);
        assert_eq!(r.prompt_token_ids, Some(ids(&v["tokens"])));
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
    }
    mock.stop().await;
}

/// The same against a llama.cpp-style server: text from `/apply-template`, ids from its
/// `/tokenize` of that text. (On a current-thread runtime: intake's threads block on
/// requests the runtime's one thread drives.)
#[tokio::test]
async fn llama_cpp_rendering_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::LlamaCpp),
        different_template(dir.path()),
    ))
    .await;
    let cfg = config(
        dir.path(),
        &mock.url,
        "completions",
        "source = \"server\"\ntemplate_check = false\n",
    );
    run_to_end(&cfg).await;
    for r in rows_of(dir.path(), "chat") {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        let (s, t) = post(&mock.url, "/apply-template", json!({"messages": messages})).await;
        assert_eq!(s, 200, "{t}");
        let text = t["prompt"].as_str().unwrap();
        let (s, v) = post(
            &mock.url,
            "/tokenize",
            json!({"content": text, "add_special": true}),
        )
        .await;
        assert_eq!(s, 200);
        assert_eq!(r.prompt, text);
        assert_eq!(r.prompt_token_ids, Some(ids(&v["tokens"])));
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
    }
    mock.stop().await;
}

/// With the server rendering as spool does (the same template), the check passes — it
/// says so and on how many rows — and the run stores spool's own ids, marked `client`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_check_passes_on_the_same_template() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Vllm),
        qwen_template(),
    ))
    .await;
    let cfg = config(dir.path(), &mock.url, "completions", "");
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    let (status, _) = p.wait(Duration::from_secs(60)).await;
    let stderr = p.stderr();
    assert_eq!(status.code(), Some(0), "{stderr}");
    // The first three rows of each dataset (the chats' fourth and later rows add no
    // system prompt or earlier assistant turn the first three lack).
    assert!(stderr.contains("template check passed"), "{stderr}");
    assert!(stderr.contains("rows=6"), "{stderr}");
    for r in rows_of(dir.path(), "chat") {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        assert_eq!(r.prompt_token_ids, Some(spool_rendering(&messages)));
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Client));
    }
    mock.stop().await;
}

/// A server whose template differs stops the run with exit 2 before anything is enqueued
/// or generated; the message names the dataset, the row, the first differing token and
/// character, and shows both renderings around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_template_stops_the_run_with_a_readable_diff() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Vllm),
        different_template(dir.path()),
    ))
    .await;
    let cfg = config(dir.path(), &mock.url, "completions", "");
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let messages = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Question 0: why?"}]);
    let ours = spool_rendering(&messages);
    let (_, theirs) = vllm_rendering(&mock.url, &messages).await;
    assert_eq!(
        &theirs[..ours.len()],
        &ours[..],
        "the server's adds to spool's"
    );
    for needle in [
        "template check: spool's rendering differs from the server's".to_string(),
        "dataset `chat`, row 0 (line 1, id `c0`)".to_string(),
        format!(
            "first difference at token {} (spool {} tokens, the server {})",
            ours.len(),
            ours.len(),
            theirs.len()
        ),
        r#"spool text:  "#.to_string(),
        r#"<|im_start|>assistant\n" >> """#.to_string(),
        r#"server text: "#.to_string(),
        r#"<|im_start|>assistant\n" >> "<think>\n\n</think>\n\n""#.to_string(),
        format!(">>{}", theirs[ours.len()]),
        "template_check = \"warn\"".to_string(),
    ] {
        assert!(stderr.contains(&needle), "no `{needle}` in:\n{stderr}");
    }
    // Plain prompts are tokenized alike: only chat rows differ.
    assert!(!stderr.contains("dataset `plain`"), "{stderr}");
    assert_eq!(mock.stats().requests, 0, "no generation before the check");
    let q = spool::store::queue::Queue::open(&dir.path().join("data")).unwrap();
    assert!(q.state(0).is_none_or(|s| s.items == 0), "nothing enqueued");
    mock.stop().await;
}

/// `template_check = "warn"` logs the same difference and goes on to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_check_warn_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Vllm),
        different_template(dir.path()),
    ))
    .await;
    let cfg = config(
        dir.path(),
        &mock.url,
        "completions",
        "template_check = \"warn\"\n",
    );
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("dataset `chat`, row 0 (line 1, id `c0`)"),
        "{stderr}"
    );
    assert_eq!(rows_of(dir.path(), "chat").len(), 8);
    mock.stop().await;
}

/// `api = "chat"`: with `return_token_ids` honoured, every row keeps the server's prompt
/// ids (equal to its `/tokenize` rendering), marked `server`; a server that ignores it
/// leaves spool's own ids, marked `client`, and when its `usage.prompt_tokens` disagrees
/// with spool's count (a different template) each row is counted in
/// `spool_prompt_token_disagreements_total` (logged at the end with its value) and
/// warned about once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_rows_keep_the_servers_prompt_ids_or_count_disagreements() {
    let dir = tempfile::tempdir().unwrap();
    let with_ids = dir.path().join("with");
    std::fs::create_dir_all(&with_ids).unwrap();
    let mock = Mock::start(mock_cfg(
        &with_ids,
        Some(TokenizeApi::Vllm),
        different_template(&with_ids),
    ))
    .await;
    let cfg = config(&with_ids, &mock.url, "chat", "template_check = false\n");
    run_to_end(&cfg).await;
    for r in rows_of(&with_ids, "chat") {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        let (_, theirs) = vllm_rendering(&mock.url, &messages).await;
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
        assert_eq!(r.prompt_token_ids.as_ref(), Some(&theirs));
        assert_ne!(spool_rendering(&messages), theirs);
    }
    mock.stop().await;

    let without = dir.path().join("without");
    std::fs::create_dir_all(&without).unwrap();
    let mock = Mock::start(MockConfig {
        no_token_ids: true,
        ..mock_cfg(&without, None, different_template(&without))
    })
    .await;
    let cfg = config(&without, &mock.url, "chat", "template_check = false\n");
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let chat = rows_of(&without, "chat");
    for r in &chat {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Client));
        assert_eq!(r.prompt_token_ids, Some(spool_rendering(&messages)));
    }
    assert_eq!(
        stderr
            .matches("the server rendered this prompt differently from spool's template")
            .count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("dataset=chat disagreements=8"),
        "the count of every chat row: {stderr}"
    );
    // Plain prompts, sent as one user turn, render alike in both templates.
    assert!(!stderr.contains("dataset=plain disagreements"), "{stderr}");
    mock.stop().await;
}

/// Each mock kind's rendering endpoints are found by spool's detection as that kind; a
/// server without any answers `NoEndpoint`, one that is down `Unreachable`.
#[tokio::test]
async fn detection_tells_each_server_kind() {
    let up = Upstream::new(UpstreamOptions {
        api: spool::config::Api::Completions,
        model: "mock-model".into(),
        api_key: None,
        stream: false,
        request_timeout: Duration::from_secs(5),
        max_response_bytes: 1 << 20,
        pool_size: 2,
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (api, want) in [
        (
            Some(TokenizeApi::Vllm),
            Detected::Renders(RenderKind::Tokenize),
        ),
        (
            Some(TokenizeApi::LlamaCpp),
            Detected::Renders(RenderKind::LlamaCpp),
        ),
        (
            Some(TokenizeApi::Sglang),
            Detected::Renders(RenderKind::TextOnly),
        ),
        (None, Detected::NoEndpoint),
    ] {
        let mock = Mock::start(mock_cfg(dir.path(), api, qwen_template())).await;
        assert_eq!(detect(&up, &mock.url, "mock-model").await, want, "{api:?}");
        mock.stop().await;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    assert_eq!(
        detect(&up, &dead, "mock-model").await,
        Detected::Unreachable
    );
}

/// The mock's rendering endpoints answer in their servers' shapes: vLLM's counts, its
/// 404 for another model and 400 for contradictory flags; llama.cpp's BOS-less template
/// text, no tokens without `content`, and its error body; SGLang's refusal of messages
/// and its batch of prompts.
#[tokio::test]
async fn the_mock_renders_in_each_servers_shape() {
    let dir = tempfile::tempdir().unwrap();
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let vllm = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Vllm),
        qwen_template(),
    ))
    .await;
    let (s, v) = post(&vllm.url, "/tokenize", json!({"prompt": "Hello world"})).await;
    assert_eq!(s, 200);
    assert_eq!(v["count"], json!(v["tokens"].as_array().unwrap().len()));
    assert_eq!(v["max_model_len"], 32768);
    let (_, chat) = post(&vllm.url, "/tokenize", json!({"messages": messages})).await;
    assert_eq!(ids(&chat["tokens"]), spool_rendering(&messages));
    let (s, e) = post(
        &vllm.url,
        "/tokenize",
        json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!((s, e["type"].as_str()), (404, Some("NotFoundError")));
    assert_eq!(e["message"], "The model `other` does not exist.");
    let both = json!({"messages": messages, "continue_final_message": true});
    let (s, e) = post(&vllm.url, "/tokenize", both).await;
    assert_eq!((s, e["object"].as_str()), (400, Some("error")));
    vllm.stop().await;

    let bos = dir.path().join("bos.jinja");
    std::fs::write(
        &bos,
        "<|endoftext|>{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let llama = Mock::start(mock_cfg(dir.path(), Some(TokenizeApi::LlamaCpp), bos)).await;
    let (s, t) = post(&llama.url, "/apply-template", json!({"messages": messages})).await;
    assert_eq!((s, t["prompt"].as_str()), (200, Some("<|endoftext|>Hi")));
    let (s, v) = post(&llama.url, "/tokenize", json!({"add_special": true})).await;
    assert_eq!((s, v), (200, json!({"tokens": []})));
    let (s, e) = post(&llama.url, "/apply-template", json!({})).await;
    assert_eq!(s, 400);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    llama.stop().await;

    let sglang = Mock::start(mock_cfg(
        dir.path(),
        Some(TokenizeApi::Sglang),
        qwen_template(),
    ))
    .await;
    let (s, _) = post(&sglang.url, "/v1/tokenize", json!({"messages": messages})).await;
    assert_eq!(s, 400);
    let (s, v) = post(&sglang.url, "/v1/tokenize", json!({"prompt": ["a", "b c"]})).await;
    assert_eq!(s, 200);
    assert_eq!(v["count"].as_array().unwrap().len(), 2);
    let (s, t) = post(
        &sglang.url,
        "/v1/detokenize",
        json!({"tokens": ids(&v["tokens"][1])}),
    )
    .await;
    assert_eq!((s, t["text"].as_str()), (200, Some("b c")));
    sglang.stop().await;
}

/// `source = "server"` with no server that renders is a config error naming the key
/// (exit 2); with a server that renders only text (SGLang), chat rows are rejected with
/// the reason and plain prompts are rendered there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_source_needs_a_server_that_renders() {
    let dir = tempfile::tempdir().unwrap();
    let none = dir.path().join("none");
    std::fs::create_dir_all(&none).unwrap();
    let mock = Mock::start(mock_cfg(&none, None, qwen_template())).await;
    let cfg = config(&none, &mock.url, "completions", "source = \"server\"\n");
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("key `tokenizer.source`"), "{stderr}");
    mock.stop().await;

    let text = dir.path().join("text");
    std::fs::create_dir_all(&text).unwrap();
    let mock = Mock::start(mock_cfg(&text, Some(TokenizeApi::Sglang), qwen_template())).await;
    let cfg = config(&text, &mock.url, "completions", "source = \"server\"\n");
    edit_config(&cfg, "max_tokens = 200", "max_tokens = 20");
    let out = spool(&cfg, &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let rejected = std::fs::read_to_string(text.join("out/chat/_rejected.jsonl")).unwrap();
    assert_eq!(rejected.lines().count(), 8, "{rejected}");
    assert!(
        rejected.contains("no server renders chat messages"),
        "{rejected}"
    );
    for r in rows_of(&text, "plain") {
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
    }
    mock.stop().await;
}
