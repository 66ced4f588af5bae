//! Drafter-training data end to end: thinking kept apart from the answer and in the ids,
//! every assistant turn regenerated after the model's own earlier replies, several samples
//! per prompt, tool calls captured and cached results spliced, conversations kept on one
//! server — against the mock (which logs each request's body), read back from the shards.

use crate::process::{assert_verify_clean, mock_log, LogLine, Proc};
use crate::support::*;
use rand::SeedableRng;
use serde_json::{json, Value};
use spool::store::row::ShardRow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// (row, sample, turn) of a generation.
type Generation = (u64, u32, u32);

/// A config of one dataset with the generation `keys` (TOML lines) added to it.
fn one_dataset(
    dir: &Path,
    url: &str,
    api: &str,
    stream: bool,
    ds: Ds<'_>,
    extra: &str,
    keys: &str,
) -> PathBuf {
    let name = ds.name;
    let cfg = write_config(dir, url, api, stream, &[ds], extra);
    with_keys(&cfg, name, keys);
    cfg
}

/// Adds `keys` (TOML lines) to dataset `name` of the config at `cfg`.
fn with_keys(cfg: &Path, name: &str, keys: &str) {
    let text = std::fs::read_to_string(cfg).unwrap();
    let at = format!("name = \"{name}\"\n");
    assert!(text.contains(&at), "no dataset {name}");
    std::fs::write(cfg, text.replace(&at, &format!("{at}{keys}\n"))).unwrap();
}

fn qwen3_table() -> String {
    let dir = fixtures().join("tokenizers/qwen3");
    format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        dir.join("tokenizer.json").display(),
        dir.join("tokenizer_config.json").display()
    )
}

/// `n` ShareGPT conversations of three user turns, each followed by an original reply
/// that must never reach a request (`ORIGINAL-<i>-<k>`).
fn write_conversations(path: &Path, prefix: &str, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        let mut conv = vec![json!({"from": "system", "value": "You are terse."})];
        for k in 0..3 {
            conv.push(
                json!({"from": "human", "value": format!("Question {k} of {prefix}{i}: why?")}),
            );
            conv.push(json!({"from": "gpt", "value": format!("ORIGINAL-{i}-{k}")}));
        }
        s.push_str(&json!({"id": format!("{prefix}{i}"), "conversations": conv}).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

/// A mock that logs every request with its body.
async fn logging_mock(dir: &Path, name: &str, cfg: spool::mock::MockConfig) -> (Mock, PathBuf) {
    let log = dir.join(name);
    let mock = Mock::start(spool::mock::MockConfig {
        log: Some(log.clone()),
        log_bodies: true,
        ..cfg
    })
    .await;
    (mock, log)
}

/// Rows by (id, sample, turn), asserting none is there twice.
fn by_generation(rows: &[ShardRow]) -> BTreeMap<(String, u32, u32), &ShardRow> {
    let mut m = BTreeMap::new();
    for r in rows {
        let prev = m.insert((r.id.clone(), r.sample, r.turn), r);
        assert!(prev.is_none(), "({}, {}, {}) twice", r.id, r.sample, r.turn);
    }
    m
}

/// The assistant contents of a chat request's messages, in order.
fn assistant_contents(req: &Value) -> Vec<String> {
    req["messages"]
        .as_array()
        .expect("a chat request has messages")
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["content"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The ok requests of the log with their bodies, by (row, sample, turn).
fn requests_by_generation(lines: &[LogLine]) -> HashMap<(u64, u32, u32), Vec<&Value>> {
    let mut m: HashMap<_, Vec<&Value>> = HashMap::new();
    for l in lines.iter().filter(|l| l.outcome == "ok") {
        let (s, t) = l
            .generation
            .expect("a generation's request id names its sample and turn");
        m.entry((l.row, s, t))
            .or_default()
            .push(l.request.as_ref().expect("the mock logs bodies"));
    }
    m
}

/// With `turns = "all"`, each of a conversation's three assistant turns is generated once,
/// in order, and the request of turn k carries the k replies generated before it — never
/// the source's originals; the row records the history it was generated after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_assistant_turn_is_regenerated_after_the_generated_history() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(dir.path(), "mock.log", fast_mock()).await;
    write_conversations(&dir.path().join("c.jsonl"), "c", 12);
    let cfg = one_dataset(
        dir.path(),
        &mock.url,
        "chat",
        true,
        Ds {
            name: "conv",
            file: "c.jsonl",
            budget: None,
        },
        "",
        "turns = \"all\"",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "conv");
    let gens = by_generation(&rows);
    assert_eq!(gens.len(), 36, "12 conversations × 3 turns");
    let lines = mock_log(&log);
    let reqs = requests_by_generation(&lines);
    for ((id, sample, turn), r) in &gens {
        assert_eq!((*sample, r.partial.as_deref()), (0, None), "{id}");
        let earlier: Vec<String> = (0..*turn)
            .map(|k| gens[&(id.clone(), 0, k)].completion.clone())
            .collect();
        let sent = &reqs[&(r.row, 0, *turn)];
        assert_eq!(
            sent.len(),
            1,
            "{id} turn {turn} requested {} times",
            sent.len()
        );
        assert_eq!(assistant_contents(sent[0]), earlier, "{id} turn {turn}");
        let body = sent[0].to_string();
        assert!(
            !body.contains("ORIGINAL"),
            "{id} turn {turn} sent an original reply: {body}"
        );
        let recorded: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        assert_eq!(
            recorded, sent[0]["messages"],
            "{id} turn {turn}: the row's history"
        );
    }
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// With the Qwen3 template and SGLang's `/generate`, the client renders each turn: turn
/// 2's prompt holds the two generated replies, not the originals, and its ids are that
/// text's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_rendered_client_side_carry_the_generated_replies() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    write_conversations(&dir.path().join("c.jsonl"), "c", 4);
    let cfg = one_dataset(
        dir.path(),
        &mock.url,
        "sglang",
        false,
        Ds {
            name: "conv",
            file: "c.jsonl",
            budget: None,
        },
        &qwen3_table(),
        "turns = \"all\"",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "conv");
    let gens = by_generation(&rows);
    assert_eq!(gens.len(), 12);
    let tok =
        spool::prompt::Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json"))
            .unwrap();
    for ((id, _, turn), r) in &gens {
        assert!(!r.prompt.contains("ORIGINAL"), "{id} turn {turn}");
        for k in 0..*turn {
            let reply = &gens[&(id.clone(), 0, k)].completion;
            assert!(
                r.prompt.contains(reply.trim()),
                "{id} turn {turn} lacks reply {k}"
            );
        }
        assert_eq!(
            r.prompt_token_ids.as_ref().unwrap(),
            &tok.encode(&r.prompt, false).unwrap()
        );
    }
    mock.stop().await;
}

/// `samples = 3` with a seed: three rows per prompt (samples 0, 1, 2), each sent with its
/// own seed (sample 0 the configured one), recorded in `sampling`, and the mock's seeded
/// outputs differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_give_each_prompt_n_rows_with_their_own_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(dir.path(), "mock.log", fast_mock()).await;
    write_prompts(&dir.path().join("p.jsonl"), "p", 10);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[Ds {
            name: "p",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_tokens = 200", "max_tokens = 200\nseed = 7");
    std::fs::write(&cfg, text).unwrap();
    with_keys(&cfg, "p", "samples = 3");
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "p");
    let gens = by_generation(&rows);
    assert_eq!(gens.len(), 30);
    for i in 0..10 {
        let id = format!("p{i}");
        let seeds: Vec<u64> = (0..3)
            .map(|s| {
                let r = gens[&(id.clone(), s, 0)];
                let sampling: Value =
                    serde_json::from_str(r.sampling.as_deref().expect("sampling recorded"))
                        .unwrap();
                sampling["seed"].as_u64().expect("a seed per sample")
            })
            .collect();
        assert_eq!(seeds[0], 7);
        assert_eq!(
            seeds.iter().collect::<HashSet<_>>().len(),
            3,
            "{id}: {seeds:?}"
        );
        let texts: HashSet<&str> = (0..3)
            .map(|s| gens[&(id.clone(), s, 0)].completion.as_str())
            .collect();
        assert_eq!(
            texts.len(),
            3,
            "{id}: samples with other seeds are other completions"
        );
    }
    // Each request carried its sample's seed.
    for l in mock_log(&log).iter().filter(|l| l.outcome == "ok") {
        let (s, _) = l.generation.unwrap();
        let want = gens[&(format!("p{}", l.row), s, 0)]
            .sampling
            .clone()
            .unwrap();
        let want: Value = serde_json::from_str(&want).unwrap();
        assert_eq!(l.request.as_ref().unwrap()["seed"], want["seed"]);
    }
    mock.stop().await;
}

/// A chat server with a reasoning parser: the thinking lands in `reasoning`, the answer in
/// `completion`, whole and streamed, with `reasoning_content` or vLLM's `reasoning`; the
/// ids cover both, and decode to exactly the think block and the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_kept_from_whole_and_streamed_chat_answers() {
    use spool::mock::ReasoningField::{Reasoning, ReasoningContent};
    for (stream, field) in [
        (false, ReasoningContent),
        (true, ReasoningContent),
        (true, Reasoning),
        (false, Reasoning),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mock = Mock::start(spool::mock::MockConfig {
            think: true,
            reasoning_parser: true,
            reasoning_field: field,
            ..fast_mock()
        })
        .await;
        write_chats(&dir.path().join("c.jsonl"), "c", 10);
        let cfg = write_config(
            dir.path(),
            &mock.url,
            "chat",
            stream,
            &[Ds {
                name: "c",
                file: "c.jsonl",
                budget: None,
            }],
            "",
        );
        run_to_end(&cfg).await;
        let rows = shard_rows(&dir.path().join("out"), "c");
        assert_eq!(rows.len(), 10);
        for r in &rows {
            let ctx = format!("stream={stream} field={field:?} id={}", r.id);
            let reasoning = r
                .reasoning
                .as_deref()
                .unwrap_or_else(|| panic!("{ctx}: no reasoning"));
            assert!(
                !reasoning.is_empty() && !r.completion.contains("think>"),
                "{ctx}"
            );
            let ids = r.completion_token_ids.as_ref().unwrap();
            assert_eq!(r.completion_tokens as usize, ids.len(), "{ctx}");
            assert_eq!(
                mock_text(ids),
                format!("<think>\n{reasoning}\n</think>\n\n{}", r.completion),
                "{ctx}: ids and text disagree"
            );
        }
        mock.stop().await;
    }
}

/// Raw text from `/generate` with the Qwen3 template: `reasoning = "save"` (the default)
/// splits the thinking out at the template's markers, `raw` leaves it in the completion;
/// the ids stay whole either way and decode to the raw text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_is_split_from_raw_text_at_the_templates_markers() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(spool::mock::MockConfig {
        think: true,
        ..fast_mock()
    })
    .await;
    write_chats(&dir.path().join("a.jsonl"), "a", 8);
    write_chats(&dir.path().join("b.jsonl"), "b", 8);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "save",
                file: "a.jsonl",
                budget: None,
            },
            Ds {
                name: "raw",
                file: "b.jsonl",
                budget: None,
            },
        ],
        &qwen3_table(),
    );
    with_keys(&cfg, "raw", "reasoning = \"raw\"");
    run_to_end(&cfg).await;
    let out = dir.path().join("out");
    let saved = shard_rows(&out, "save");
    assert_eq!(saved.len(), 8);
    for r in &saved {
        let reasoning = r.reasoning.as_deref().expect("split out");
        assert!(
            !r.completion.contains("<think>") && !reasoning.contains("think>"),
            "{}",
            r.id
        );
        let raw = mock_text(r.completion_token_ids.as_ref().unwrap());
        assert!(
            raw.contains(reasoning) && raw.ends_with(&r.completion),
            "{}: {raw:?}",
            r.id
        );
    }
    let raw_rows = shard_rows(&out, "raw");
    assert_eq!(raw_rows.len(), 8);
    for r in &raw_rows {
        assert_eq!(r.reasoning, None);
        assert!(r.completion.contains("<think>\n"), "{}", r.id);
        assert_eq!(
            r.completion,
            mock_text(r.completion_token_ids.as_ref().unwrap())
        );
    }
    mock.stop().await;
}

/// `reasoning = "disable"` reaches the template (Qwen3 renders the empty think block the
/// generation then follows) and the chat request (`chat_template_kwargs.enable_thinking =
/// false`); the mock then does not think.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_reaches_the_template_and_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(
        dir.path(),
        "mock.log",
        spool::mock::MockConfig {
            think: true,
            reasoning_parser: true,
            ..fast_mock()
        },
    )
    .await;
    write_chats(&dir.path().join("a.jsonl"), "a", 6);
    let cfg = one_dataset(
        dir.path(),
        &mock.url,
        "sglang",
        false,
        Ds {
            name: "a",
            file: "a.jsonl",
            budget: None,
        },
        &qwen3_table(),
        "reasoning = \"disable\"",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_eq!(rows.len(), 6);
    for r in &rows {
        assert!(
            r.prompt.ends_with("<think>\n\n</think>\n\n"),
            "{}: {:?}",
            r.id,
            r.prompt
        );
        assert_eq!(r.reasoning, None);
        assert!(!r.completion.contains("think>"));
    }
    // The chat API gets the switch in the request.
    let dir2 = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir2.path(),
        &mock.url,
        "chat",
        false,
        &[Ds {
            name: "a",
            file: "../a.jsonl",
            budget: None,
        }],
        "",
    );
    std::fs::copy(dir.path().join("a.jsonl"), dir2.path().join("a.jsonl")).unwrap();
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("../a.jsonl", "a.jsonl");
    std::fs::write(&cfg, text).unwrap();
    with_keys(&cfg, "a", "reasoning = \"disable\"");
    run_to_end(&cfg).await;
    let chat_reqs: Vec<Value> = mock_log(&log)
        .into_iter()
        .filter_map(|l| l.request)
        .filter(|r| r.get("messages").is_some())
        .collect();
    assert_eq!(chat_reqs.len(), 6);
    for r in &chat_reqs {
        assert_eq!(
            r["chat_template_kwargs"]["enable_thinking"],
            json!(false),
            "{r}"
        );
    }
    for r in shard_rows(&dir2.path().join("out"), "a") {
        assert_eq!(r.reasoning, None, "{}", r.id);
    }
    mock.stop().await;
}

/// Two servers: every turn of a conversation goes to the server its first turn went to,
/// and both servers get conversations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_turns_stay_on_one_server() {
    let dir = tempfile::tempdir().unwrap();
    let (a, log_a) = logging_mock(dir.path(), "a.log", fast_mock()).await;
    let (b, log_b) = logging_mock(dir.path(), "b.log", fast_mock()).await;
    write_conversations(&dir.path().join("c.jsonl"), "c", 24);
    let cfg = write_config(
        dir.path(),
        &a.url,
        "chat",
        true,
        &[Ds {
            name: "conv",
            file: "c.jsonl",
            budget: None,
        }],
        "",
    );
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        &format!("urls = [\"{}\"]", a.url),
        &format!("urls = [\"{}\", \"{}\"]", a.url, b.url),
    );
    std::fs::write(&cfg, text).unwrap();
    with_keys(&cfg, "conv", "turns = \"all\"\nsamples = 2");
    run_to_end(&cfg).await;
    let mut server_of: HashMap<(u64, u32), HashSet<&str>> = HashMap::new();
    let (la, lb) = (mock_log(&log_a), mock_log(&log_b));
    for (name, lines) in [("a", &la), ("b", &lb)] {
        assert!(
            lines.iter().any(|l| l.outcome == "ok"),
            "server {name} got no conversation"
        );
        for l in lines.iter().filter(|l| l.outcome == "ok") {
            server_of
                .entry((l.row, l.generation.unwrap().0))
                .or_default()
                .insert(name);
        }
    }
    assert_eq!(server_of.len(), 48, "24 conversations × 2 samples");
    let moved: Vec<_> = server_of.iter().filter(|(_, s)| s.len() > 1).collect();
    assert!(
        moved.is_empty(),
        "conversations split across servers: {moved:?}"
    );
    assert_eq!(shard_rows(&dir.path().join("out"), "conv").len(), 144);
    a.stop().await;
    b.stop().await;
}

/// Tools: the model's tool call is captured in `tool_calls`; the next turn's request holds
/// the generated call and, after it, the result cached in the source, named by the
/// generated call's id. A conversation whose cached result is for another tool stops
/// after the call, recording why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_captured_and_cached_results_spliced() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(dir.path(), "mock.log", fast_mock()).await;
    let tools = json!([{"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    let row = |id: &str, called: &str| {
        json!({
            "id": id,
            "tools": tools,
            "messages": [
                {"role": "user", "content": format!("Look up {id}.")},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "orig_1", "type": "function", "function": {"name": called, "arguments": "{\"q\":\"x\"}"}}]},
                {"role": "tool", "tool_call_id": "orig_1", "content": format!("CACHED-{id}")},
                {"role": "assistant", "content": "ORIGINAL answer"}
            ]
        })
        .to_string()
    };
    std::fs::write(
        dir.path().join("t.jsonl"),
        format!("{}\n{}\n", row("ok", "search"), row("bad", "other")),
    )
    .unwrap();
    let cfg = one_dataset(
        dir.path(),
        &mock.url,
        "chat",
        false,
        Ds {
            name: "t",
            file: "t.jsonl",
            budget: None,
        },
        "",
        "turns = \"all\"",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "t");
    let gens = by_generation(&rows);
    let first = gens[&("ok".to_string(), 0, 0)];
    let calls: Value =
        serde_json::from_str(first.tool_calls.as_deref().expect("tool calls captured")).unwrap();
    assert_eq!(calls[0]["function"]["name"], "search");
    let call_id = calls[0]["id"].as_str().unwrap().to_string();
    assert!(first.tools.as_deref().unwrap().contains("\"search\""));
    let second = gens[&("ok".to_string(), 0, 1)];
    assert_eq!(second.partial, None);
    let lines = mock_log(&log);
    let reqs = requests_by_generation(&lines);
    let sent = &reqs[&(second.row, 0, 1)][0];
    let msgs = sent["messages"].as_array().unwrap();
    assert_eq!(msgs[1]["tool_calls"][0]["id"], json!(call_id));
    assert_eq!(msgs[2]["role"], "tool");
    assert_eq!(msgs[2]["tool_call_id"], json!(call_id));
    assert_eq!(msgs[2]["content"], "CACHED-ok");
    assert!(sent["tools"].is_array(), "tools are offered on every turn");
    // The mismatch: one row, marked with why; turn 1 never requested.
    let bad = gens[&("bad".to_string(), 0, 0)];
    assert!(
        bad.partial
            .as_deref()
            .unwrap_or("")
            .starts_with("tool_mismatch"),
        "{:?}",
        bad.partial
    );
    assert!(!gens.contains_key(&("bad".to_string(), 0, 1)));
    assert!(!reqs.contains_key(&(bad.row, 0, 1)));
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// A budget met mid-conversation stops conversations between turns: no turn starts after
/// it, the rows generated so far are written with `partial = "budget"`, every generation
/// counted is in a shard, and the overshoot is bounded by the turns in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_stops_conversations_between_turns_and_keeps_their_turns() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    write_conversations(&dir.path().join("c.jsonl"), "c", 200);
    let budget = 3000;
    let cfg = one_dataset(
        dir.path(),
        &mock.url,
        "chat",
        true,
        Ds {
            name: "conv",
            file: "c.jsonl",
            budget: Some(budget),
        },
        "",
        "turns = \"all\"",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "conv");
    let gens = by_generation(&rows);
    let tokens: u64 = rows.iter().map(|r| u64::from(r.completion_tokens)).sum();
    assert!(tokens >= budget, "{tokens}");
    assert!(
        tokens < budget + 16 * 200,
        "overshoot bounded by the turns in flight: {tokens}"
    );
    let status = crate::process::status_json(&cfg);
    assert_eq!(
        status["datasets"][0]["completion_tokens"].as_u64(),
        Some(tokens),
        "{status}"
    );
    let partial: Vec<_> = rows.iter().filter(|r| r.partial.is_some()).collect();
    assert!(
        !partial.is_empty(),
        "some conversation was cut by the budget"
    );
    for r in &partial {
        assert_eq!(r.partial.as_deref(), Some("budget"));
        assert!(
            !gens.contains_key(&(r.id.clone(), 0, 2)),
            "{}: a conversation cut by the budget has no last turn",
            r.id
        );
    }
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// The real binary SIGKILLed at random moments during a multi-turn run with two samples
/// per conversation: afterwards verify is clean, every (id, sample, turn) is in exactly
/// one row, every turn's recorded history is the generated replies of its own sample, and
/// no generation committed before a kill was requested again after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_multi_turn_runs_with_samples_keeps_every_generation_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(
        dir.path(),
        "mock.log",
        spool::mock::MockConfig {
            capacity_tps: 1.0,
            per_request_tps: 1.0,
            fail_500: 0.03,
            drop_mid_stream: 0.02,
            ..spool::mock::MockConfig::for_tests()
        },
    )
    .await;
    let n = 60;
    write_conversations(&dir.path().join("c.jsonl"), "c", n);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "chat",
        true,
        &[Ds {
            name: "conv",
            file: "c.jsonl",
            budget: None,
        }],
        "",
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_rows = 25", "max_rows = 7")
        .replace("max_attempts = 4", "max_attempts = 8")
        .replace("max_tokens = 200", "max_tokens = 200\nseed = 11");
    std::fs::write(&cfg, text).unwrap();
    with_keys(&cfg, "conv", "turns = \"all\"\nsamples = 2");
    let data = dir.path().join("data");
    let out = dir.path().join("out");
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    // (log lines at the kill, generations committed at the kill)
    let mut checkpoints: Vec<(usize, HashSet<Generation>)> = Vec::new();
    for _ in 0..10 {
        let mut p = Proc::spawn(&cfg, &["run", "-q"], &[]);
        tokio::time::sleep(Duration::from_millis(rand::Rng::random_range(
            &mut rng,
            300..1500,
        )))
        .await;
        if let Ok(Some(status)) = p.child.try_wait() {
            panic!("the run finished ({status:?}) before the kills were done");
        }
        p.child.kill().unwrap();
        p.wait(Duration::from_secs(10)).await;
        tokio::time::timeout(
            Duration::from_secs(20),
            mock.state.wait_until(|s| s.in_flight == 0),
        )
        .await
        .expect("mock drains");
        // What is committed now: kept generations of open items, and rows in the results
        // log or in shards (the queue read as the next run will read it).
        let mut committed = HashSet::new();
        {
            let q = spool::store::queue::Queue::open(&data).unwrap();
            let ds = q.states()[0].index;
            for row in 0..n as u64 {
                for g in q.generations(ds, row).unwrap() {
                    committed.insert((row, g.sample, g.turn));
                }
            }
            for r in q.unsharded(ds).unwrap() {
                committed.insert((r.row, r.sample, r.turn));
            }
        }
        for r in shard_rows(&out, "conv") {
            committed.insert((r.row, r.sample, r.turn));
        }
        checkpoints.push((mock_log(&log).len(), committed));
    }
    let mut p = Proc::spawn(&cfg, &["run", "-q"], &[]);
    let (status, _) = p.wait(Duration::from_secs(600)).await;
    assert_eq!(status.code(), Some(0), "final run: {}", p.stderr());
    assert_verify_clean(&cfg);
    let rows = shard_rows(&out, "conv");
    let gens = by_generation(&rows);
    assert_eq!(gens.len(), n * 2 * 3, "every (id, sample, turn) once");
    for ((id, sample, turn), r) in &gens {
        let earlier: Vec<String> = (0..*turn)
            .map(|k| gens[&(id.clone(), *sample, k)].completion.clone())
            .collect();
        let history: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        assert_eq!(
            assistant_contents(&json!({"messages": history})),
            earlier,
            "{id} sample {sample} turn {turn}: mixed history"
        );
    }
    let lines = mock_log(&log);
    assert!(
        checkpoints.iter().any(|(_, c)| !c.is_empty()),
        "no kill landed after a commit"
    );
    for (k, (from, committed)) in checkpoints.iter().enumerate() {
        for l in &lines[*from..] {
            let (s, t) = l.generation.unwrap();
            assert!(
                !committed.contains(&(l.row, s, t)),
                "row {} sample {s} turn {t} was committed at kill {k} but requested again",
                l.row
            );
        }
    }
    mock.stop().await;
}

/// Weighted `chat_template_kwargs` draws: each generation's draw is in its row's
/// `sampling`, reaches the chat request as `chat_template_kwargs` and the client-side
/// template as a variable (an `enable_thinking` drawn false renders Qwen3's empty think
/// block), every value is drawn, and a fresh run over the same rows draws exactly the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_variables_are_drawn_per_generation_and_reach_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(dir.path(), "mock.log", fast_mock()).await;
    write_chats(&dir.path().join("c.jsonl"), "c", 30);
    let draws = "samples = 2\nchat_template_kwargs = { reasoning_effort = { low = 4, medium = 4, high = 2 } }";
    let mut runs = Vec::new();
    for run in ["one", "two"] {
        let sub = dir.path().join(run);
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::copy(dir.path().join("c.jsonl"), sub.join("c.jsonl")).unwrap();
        let cfg = one_dataset(
            &sub,
            &mock.url,
            "chat",
            run == "two",
            Ds {
                name: "c",
                file: "c.jsonl",
                budget: None,
            },
            "",
            draws,
        );
        run_to_end(&cfg).await;
        let drawn: BTreeMap<(String, u32), String> = shard_rows(&sub.join("out"), "c")
            .into_iter()
            .map(|r| {
                let s: Value = serde_json::from_str(r.sampling.as_deref().expect("drawn")).unwrap();
                let effort = s["chat_template_kwargs"]["reasoning_effort"]
                    .as_str()
                    .unwrap()
                    .to_string();
                ((r.id, r.sample), effort)
            })
            .collect();
        assert_eq!(drawn.len(), 60);
        runs.push(drawn);
    }
    assert_eq!(runs[0], runs[1], "another run draws the same");
    let values: HashSet<&str> = runs[0].values().map(|v| v.as_str()).collect();
    assert_eq!(values, HashSet::from(["low", "medium", "high"]));
    let lines = mock_log(&log);
    let ok: Vec<&LogLine> = lines.iter().filter(|l| l.outcome == "ok").collect();
    assert_eq!(ok.len(), 120);
    for l in ok {
        let (s, _) = l.generation.unwrap();
        let sent = &l.request.as_ref().unwrap()["chat_template_kwargs"]["reasoning_effort"];
        assert_eq!(
            sent,
            &json!(runs[0][&(format!("c{}", l.row), s)]),
            "row {} sample {s}",
            l.row
        );
    }
    // Client-side: the draw is a template variable.
    let sub = dir.path().join("qwen");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::copy(dir.path().join("c.jsonl"), sub.join("c.jsonl")).unwrap();
    let cfg = write_config(
        &sub,
        &mock.url,
        "sglang",
        false,
        &[Ds {
            name: "c",
            file: "c.jsonl",
            budget: None,
        }],
        &qwen3_table(),
    );
    with_keys(
        &cfg,
        "c",
        "chat_template_kwargs = { enable_thinking = { \"true\" = 1, \"false\" = 1 } }",
    );
    run_to_end(&cfg).await;
    let rows = shard_rows(&sub.join("out"), "c");
    assert_eq!(rows.len(), 30);
    let mut seen = HashSet::new();
    for r in &rows {
        let s: Value = serde_json::from_str(r.sampling.as_deref().unwrap()).unwrap();
        let on = s["chat_template_kwargs"]["enable_thinking"]
            .as_bool()
            .expect("a boolean draw");
        seen.insert(on);
        assert_eq!(
            r.prompt.ends_with("<think>\n\n</think>\n\n"),
            !on,
            "{}: {:?}",
            r.id,
            r.prompt
        );
    }
    assert_eq!(seen.len(), 2, "both values drawn");
    mock.stop().await;
}

/// `history_reasoning`: by default a conversation's earlier replies go back without their
/// thinking; with `keep` each carries its generated reasoning as `reasoning_content`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_reasoning_is_sent_back_only_when_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, log) = logging_mock(
        dir.path(),
        "mock.log",
        spool::mock::MockConfig {
            think: true,
            reasoning_parser: true,
            ..fast_mock()
        },
    )
    .await;
    write_conversations(&dir.path().join("c.jsonl"), "c", 4);
    for name in ["drop", "keep"] {
        std::fs::copy(
            dir.path().join("c.jsonl"),
            dir.path().join(format!("{name}.jsonl")),
        )
        .unwrap();
    }
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "chat",
        true,
        &[
            Ds {
                name: "drop",
                file: "drop.jsonl",
                budget: None,
            },
            Ds {
                name: "keep",
                file: "keep.jsonl",
                budget: None,
            },
        ],
        "",
    );
    with_keys(&cfg, "drop", "turns = \"all\"");
    with_keys(
        &cfg,
        "keep",
        "turns = \"all\"\nhistory_reasoning = \"keep\"",
    );
    run_to_end(&cfg).await;
    let lines = mock_log(&log);
    for (name, keep) in [("drop", false), ("keep", true)] {
        let rows = shard_rows(&dir.path().join("out"), name);
        let gens = by_generation(&rows);
        assert_eq!(gens.len(), 12, "{name}");
        let mut checked = 0;
        for l in lines.iter().filter(|l| l.ds == name && l.outcome == "ok") {
            let (_, turn) = l.generation.unwrap();
            let id = format!("c{}", l.row);
            let sent: Vec<&Value> = l.request.as_ref().unwrap()["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "assistant")
                .collect();
            assert_eq!(sent.len() as u32, turn);
            for (k, m) in sent.iter().enumerate() {
                let thought = gens[&(id.clone(), 0, k as u32)]
                    .reasoning
                    .clone()
                    .expect("thinking kept");
                if keep {
                    assert_eq!(
                        m["reasoning_content"],
                        json!(thought),
                        "{name} {id} turn {turn}"
                    );
                } else {
                    assert!(
                        m.get("reasoning_content").is_none(),
                        "{name} {id} turn {turn}: {m}"
                    );
                }
                checked += 1;
            }
        }
        assert_eq!(
            checked, 12,
            "{name}: 4 conversations × (0 + 1 + 2) earlier replies"
        );
    }
    mock.stop().await;
}

/// A chat server that splits thinking off but sends neither ids nor usage: no ids are made
/// up for the row (the split text cannot be put back byte for byte), and the count is the
/// tokenizer's count of the thinking and the answer, so the budget still sees both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_thinking_without_server_ids_is_counted_not_invented() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(spool::mock::MockConfig {
        think: true,
        reasoning_parser: true,
        no_token_ids: true,
        no_usage: true,
        ..fast_mock()
    })
    .await;
    write_chats(&dir.path().join("c.jsonl"), "c", 6);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "chat",
        true,
        &[Ds {
            name: "c",
            file: "c.jsonl",
            budget: None,
        }],
        &qwen3_table(),
    );
    run_to_end(&cfg).await;
    let tok =
        spool::prompt::Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json"))
            .unwrap();
    let rows = shard_rows(&dir.path().join("out"), "c");
    assert_eq!(rows.len(), 6);
    for r in &rows {
        let reasoning = r.reasoning.as_deref().expect("thinking kept");
        assert_eq!(r.completion_token_ids, None, "{}", r.id);
        let want = tok.encode(reasoning, false).unwrap().len()
            + tok.encode(&r.completion, false).unwrap().len();
        assert_eq!(r.completion_tokens as usize, want, "{}", r.id);
    }
    mock.stop().await;
}

/// SGLang's chat API refuses `return_token_ids` on a stream (400), which vLLM needs for the
/// ids: spool learns it from the first refusal, sends that server's streams without it and
/// loses no item (before, every streamed chat request failed for good); the ids are then
/// spool's own encoding of the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusing_stream_token_ids_is_streamed_without_them() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(spool::mock::MockConfig {
        refuse_stream_ids: true,
        ..fast_mock()
    })
    .await;
    write_chats(&dir.path().join("c.jsonl"), "c", 12);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "chat",
        true,
        &[Ds {
            name: "c",
            file: "c.jsonl",
            budget: None,
        }],
        &qwen3_table(),
    );
    let summary = run_to_end(&cfg).await;
    assert_eq!(summary.report.failed(), 0);
    let stats = mock.stats();
    let refused = stats.count(spool::mock::Outcome::BadRequest);
    assert!(
        refused >= 1,
        "the mock refused the first stream asking for ids"
    );
    assert!(
        refused <= 1 + 150,
        "refused at most once per request in flight at the first refusal: {refused}"
    );
    let tok =
        spool::prompt::Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json"))
            .unwrap();
    let rows = shard_rows(&dir.path().join("out"), "c");
    assert_eq!(rows.len(), 12);
    for r in &rows {
        let ids = r.completion_token_ids.as_ref().expect("spool's encoding");
        assert_eq!(*ids, tok.encode(&r.completion, false).unwrap(), "{}", r.id);
    }
    mock.stop().await;
}
