//! Reasoning and tool calls in each family's own syntax, through the real worker path: a
//! loopback server answers `/generate` and `/v1/completions` with a Kimi-, GLM- or
//! gpt-oss-style raw reply (thinking and a tool call, markers decoded away from its text
//! as a server's default `skip_special_tokens` does, the ids whole), and the shard's
//! `reasoning`, `completion` and `tool_calls` columns hold the split while the ids decode
//! to the raw reply; with `turns = "all"` the split reply goes back as history and the
//! template renders it as the model wrote it.

use crate::support::*;
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use spool::prompt::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One family: its chat template, its raw replies (a call after a user turn, an answer
/// after a tool result) and the markers a server's decoding drops from its text.
struct Family {
    name: &'static str,
    template: &'static str,
    call_reply: &'static str,
    final_reply: &'static str,
    specials: &'static [&'static str],
    /// The stop token the server's ids end with, when the test vocabulary has it.
    stop: Option<&'static str>,
    /// What the split leaves: (reasoning, completion, call name, call arguments, call id).
    expect: (
        &'static str,
        &'static str,
        &'static str,
        &'static str,
        Option<&'static str>,
    ),
}

/// Kimi K2-Thinking's own template (llama.cpp's copy of Moonshot's).
const KIMI: Family = Family {
    name: "kimi",
    template: "file:parsers/templates/moonshotai-Kimi-K2-Thinking.jinja",
    call_reply: "<think>The user wants a lookup.</think>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"q\": \"sled\"}<|tool_call_end|><|tool_calls_section_end|>",
    final_reply: "<think>Got it.</think>Sled is an embedded database.",
    specials: &["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"],
    stop: Some("<|im_end|>"),
    expect: ("The user wants a lookup.", "Let me look.", "search", "{\"q\": \"sled\"}", Some("functions.search:0")),
};

/// GLM-4.6's own template (llama.cpp's copy of Z.ai's); GLM writes `\n<think>`.
const GLM: Family = Family {
    name: "glm",
    template: "file:parsers/templates/GLM-4.6.jinja",
    call_reply: "\n<think>Need to search.</think>\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>sled</arg_value>\n</tool_call>",
    final_reply: "\n<think>Done.</think>\nSled is an embedded database.",
    specials: &[],
    stop: None,
    expect: ("Need to search.", "", "search", "{\"q\": \"sled\"}", None),
};

const GPT_OSS: Family = Family {
    name: "gptoss",
    template: "{%- for m in messages -%}\
{%- if m.role == 'assistant' -%}\
{%- if m.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>{% endif -%}\
{%- for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor -%}\
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif -%}\
{%- elif m.role == 'tool' -%}<|start|>functions.search to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>\
{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}\
{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}",
    call_reply: "<|channel|>analysis<|message|>Need to search.<|end|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"q\": \"sled\"}<|call|>",
    final_reply: "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>Sled is an embedded database.<|return|>",
    specials: &["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>", "<|return|>"],
    stop: None,
    expect: ("Need to search.", "", "search", "{\"q\": \"sled\"}", None),
};

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json")).unwrap())
}

/// The loopback server: decodes the prompt, answers the call reply, or the final reply
/// once the prompt holds the tool's result; records every prompt.
struct Server {
    tok: Arc<Tokenizer>,
    family: &'static Family,
    prompts: Mutex<Vec<String>>,
}

impl Server {
    fn answer(&self, prompt: String) -> (String, Vec<u32>) {
        let raw = if prompt.contains("CACHED-RESULT") {
            self.family.final_reply
        } else {
            self.family.call_reply
        };
        self.prompts.lock().unwrap().push(prompt);
        let mut text = raw.to_owned();
        for s in self.family.specials {
            text = text.replace(s, "");
        }
        let mut ids = self.tok.encode(raw, false).unwrap();
        // The stop token ends the ids (SGLang and vLLM return it), never the text.
        ids.extend(self.family.stop.and_then(|s| self.tok.token_to_id(s)));
        (text, ids)
    }

    fn prompt_of(&self, v: &Value, key: &str) -> String {
        match &v[key] {
            Value::String(s) => s.clone(),
            Value::Array(ids) => {
                let ids: Vec<u32> = ids.iter().map(|i| i.as_u64().unwrap() as u32).collect();
                self.tok.decode(&ids).unwrap()
            }
            other => panic!("no prompt in {other}"),
        }
    }
}

async fn generate(State(s): State<Arc<Server>>, Json(v): Json<Value>) -> Json<Value> {
    let key = if v.get("input_ids").is_some() {
        "input_ids"
    } else {
        "text"
    };
    let (text, ids) = s.answer(s.prompt_of(&v, key));
    Json(json!({"text": text, "output_ids": ids,
        "meta_info": {"completion_tokens": ids.len(), "prompt_tokens": 1, "finish_reason": {"type": "stop"}}}))
}

async fn completions(State(s): State<Arc<Server>>, Json(v): Json<Value>) -> Json<Value> {
    let (text, ids) = s.answer(s.prompt_of(&v, "prompt"));
    Json(
        json!({"choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": ids}],
        "usage": {"prompt_tokens": 1, "completion_tokens": ids.len()}}),
    )
}

async fn serve(family: &'static Family) -> (String, Arc<Server>) {
    let state = Arc::new(Server {
        tok: tokenizer(),
        family,
        prompts: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/health", get(|| async { "ok" }))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, state)
}

/// A row asking for a lookup, with the search tool and, for `turns = "all"`, the cached
/// tool result and an original final answer.
fn write_rows(path: &Path, multi: bool) {
    let tools = json!([{"type": "function", "function": {"name": "search", "description": "Search.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    let row = json!({"id": "r0", "tools": tools, "messages": [
        {"role": "user", "content": "What is sled?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "orig", "type": "function",
            "function": {"name": "search", "arguments": "{\"q\": \"sled\"}"}}]},
        {"role": "tool", "tool_call_id": "orig", "content": "CACHED-RESULT"},
        {"role": "assistant", "content": "ORIGINAL"}]});
    let row = if multi {
        row
    } else {
        json!({"id": "r0", "tools": row["tools"], "messages": [row["messages"][0]]})
    };
    std::fs::write(path, format!("{row}\n")).unwrap();
}

fn config(dir: &Path, url: &str, api: &str, family: &Family, keys: &str) -> PathBuf {
    let tpl = dir.join("chat_template.jinja");
    let source = match family.template.strip_prefix("file:") {
        Some(f) => std::fs::read_to_string(fixtures().join(f)).unwrap(),
        None => family.template.to_owned(),
    };
    std::fs::write(&tpl, source).unwrap();
    let table = format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        fixtures().join("tokenizers/qwen3/tokenizer.json").display(),
        tpl.display()
    );
    write_rows(&dir.join("t.jsonl"), keys.contains("turns"));
    let cfg = write_config(
        dir,
        url,
        api,
        false,
        &[Ds {
            name: "t",
            file: "t.jsonl",
            budget: None,
        }],
        &table,
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("name = \"t\"\n", &format!("name = \"t\"\n{keys}\n")),
    )
    .unwrap();
    cfg
}

/// Runs one family against one API; returns the rows and the prompts the server saw.
async fn run(
    family: &'static Family,
    api: &str,
    keys: &str,
) -> (Vec<spool::store::row::ShardRow>, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let (url, server) = serve(family).await;
    let cfg = config(dir.path(), &url, api, family, keys);
    run_to_end(&cfg).await;
    let rows = shard_rows(&dir.path().join("out"), "t");
    let prompts = server.prompts.lock().unwrap().clone();
    (rows, prompts)
}

/// The first generation's columns hold the family's split; its ids decode to the raw
/// reply (with the stop token) and its text columns come from that raw text.
fn assert_split(family: &Family, api: &str, row: &spool::store::row::ShardRow) {
    let tok = tokenizer();
    let (reasoning, completion, name, args, id) = family.expect;
    let ids = row.completion_token_ids.as_ref().expect("ids kept");
    assert_eq!(
        tok.decode(ids).unwrap(),
        format!("{}{}", family.call_reply, family.stop.unwrap_or("")),
        "{} {api}: ids whole",
        family.name
    );
    assert_eq!(
        row.reasoning.as_deref(),
        Some(reasoning),
        "{} {api}",
        family.name
    );
    assert_eq!(row.completion, completion, "{} {api}", family.name);
    let calls: Value = serde_json::from_str(row.tool_calls.as_deref().expect("calls")).unwrap();
    assert_eq!(
        calls.as_array().unwrap().len(),
        1,
        "{} {api}: {calls}",
        family.name
    );
    assert_eq!(calls[0]["function"]["name"], name);
    assert_eq!(calls[0]["function"]["arguments"], args);
    match id {
        Some(id) => assert_eq!(calls[0]["id"], id),
        None => assert!(calls[0]["id"].as_str().unwrap().starts_with("call_")),
    }
}

/// Kimi, GLM and gpt-oss replies with thinking and a call, from `/generate` and from
/// `/v1/completions`: split into the three columns, the ids whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_familys_raw_reply_lands_split_in_the_shard() {
    for family in [&KIMI, &GLM, &GPT_OSS] {
        for api in ["sglang", "completions"] {
            let (rows, _) = run(family, api, "").await;
            assert_eq!(rows.len(), 1, "{} {api}", family.name);
            assert_split(family, api, &rows[0]);
        }
    }
}

/// With `turns = "all"` and `history_reasoning = "keep"`, the split reply goes back as
/// the next turn's history and the family's template (Kimi K2-Thinking's and GLM-4.6's
/// own, a gpt-oss-style one) renders it as the model wrote it, the arguments reaching
/// GLM's template as the mapping it iterates: the second prompt holds the raw reply
/// verbatim, then the cached tool result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_reply_re_renders_as_history() {
    for family in [&KIMI, &GPT_OSS] {
        let (rows, prompts) = run(
            family,
            "sglang",
            "turns = \"all\"\nhistory_reasoning = \"keep\"",
        )
        .await;
        assert_eq!(rows.len(), 2, "{}: {rows:?}", family.name);
        assert_eq!(prompts.len(), 2, "{}", family.name);
        let first = rows.iter().find(|r| r.turn == 0).unwrap();
        assert_split(family, "sglang", first);
        let second = &prompts[1];
        assert!(
            second.contains(family.call_reply),
            "{}: the history does not render the reply as written:\n{second}",
            family.name
        );
        assert!(
            second.contains("CACHED-RESULT") && !second.contains("ORIGINAL"),
            "{second}"
        );
        let last = rows.iter().find(|r| r.turn == 1).unwrap();
        assert_eq!(
            last.completion, "Sled is an embedded database.",
            "{}",
            family.name
        );
        assert_eq!(last.tool_calls, None);
    }
}

/// A template of no known family keeps today's behaviour: the raw text is the completion,
/// nothing split, although tools were offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_without_a_known_syntax_keeps_the_text() {
    static PLAIN: Family = Family {
        name: "plain",
        template: "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}",
        call_reply: "<think>x</think><tool_call>search\n<arg_key>q</arg_key>\n<arg_value>s</arg_value>\n</tool_call>",
        final_reply: "done",
        specials: &[],
        stop: None,
        expect: ("", "", "", "", None),
    };
    let (rows, _) = run(&PLAIN, "sglang", "").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].completion, PLAIN.call_reply);
    assert_eq!(rows[0].reasoning, None);
    assert_eq!(rows[0].tool_calls, None);
}
