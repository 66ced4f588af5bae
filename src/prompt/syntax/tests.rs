//! The parsers against SGLang's own answers (`tests/fixtures/parsers/*.jsonl`, written by
//! running SGLang 0.5.23's parsers on the model outputs of SGLang's and vLLM's tests), and
//! the choice of syntax from real templates' markers.

use super::*;
use std::path::Path;

fn goldens() -> Vec<(String, Value)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parsers");
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        for (i, line) in std::fs::read_to_string(&f).unwrap().lines().enumerate() {
            out.push((
                format!("{name}:{}", i + 1),
                serde_json::from_str(line).unwrap(),
            ));
        }
    }
    out
}

/// Every golden: the reasoning, the answer and the calls (name, arguments text, and the
/// model's own id for Kimi) are exactly what SGLang's parsers return, for each family.
#[test]
fn every_golden_splits_as_sglang_does() {
    let all = goldens();
    let mut per_family = std::collections::BTreeMap::<String, usize>::new();
    for (at, g) in &all {
        let text = g["text"].as_str().unwrap();
        let prompt = g["prompt"].as_str().unwrap();
        let tools = g["tools"].as_array().unwrap().clone();
        let tools = if tools.is_empty() && g["tool_parser"] == "kimi_k2" {
            // Kimi's parser ignores the tools; the goldens offer one where none is named.
            vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {}}})]
        } else {
            tools
        };
        let (reasoning, answer) = match g["reasoning_parser"].as_str() {
            Some(r) => {
                let kwargs = g["kwargs"].as_object().cloned().unwrap_or_default();
                Reasoning::named(r).unwrap().split(text, prompt, &kwargs)
            }
            None => (None, text.to_owned()),
        };
        let (answer, calls) = match g["tool_parser"].as_str() {
            Some(t) => Tools::named(t).unwrap().split(&answer, &tools),
            None => (answer, None),
        };
        let want = &g["expected"];
        assert_eq!(
            reasoning.as_deref(),
            want["reasoning"].as_str(),
            "{at}: reasoning"
        );
        assert_eq!(answer, want["content"].as_str().unwrap(), "{at}: content");
        let calls = calls
            .map(|c| c.as_array().unwrap().clone())
            .unwrap_or_default();
        let want_calls = want["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), want_calls.len(), "{at}: calls {calls:?}");
        for (got, want) in calls.iter().zip(want_calls) {
            assert_eq!(got["type"], "function", "{at}");
            assert_eq!(got["function"]["name"], want["name"], "{at}");
            assert_eq!(got["function"]["arguments"], want["arguments"], "{at}");
            match want.get("id") {
                Some(id) => assert_eq!(&got["id"], id, "{at}"),
                None => assert!(got["id"].as_str().unwrap().starts_with("call_"), "{at}"),
            }
        }
        *per_family
            .entry(at.split(':').next().unwrap().to_owned())
            .or_default() += 1;
    }
    for family in [
        "deepseek",
        "glm",
        "gpt_oss",
        "kimi_k2",
        "minimax",
        "qwen3_coder",
    ] {
        let n = per_family
            .get(&format!("{family}.jsonl"))
            .copied()
            .unwrap_or(0);
        assert!(n >= 5, "{family}: {n} goldens");
    }
    eprintln!("goldens per file: {per_family:?}");
}

/// Each family's template markers choose its parsers; a template with only `<think>`
/// and `<tool_call>{json}` keeps spool's Qwen3 split; one with neither has none.
#[test]
fn templates_choose_their_family() {
    let cases = [
        (
            "{{ '<|start|>assistant<|channel|>final<|message|>' }}",
            "gpt-oss",
            "gpt-oss",
        ),
        (
            "<|tool_calls_section_begin|>{{ x }}<think></think>",
            "kimi_k2",
            "kimi_k2",
        ),
        (
            "<minimax:tool_call>\n<invoke name=",
            "minimax",
            "minimax-m2",
        ),
        ("<｜DSML｜function_calls>", "deepseek-v3", "deepseekv32"),
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ n }}<｜tool▁sep｜>",
            "deepseek-v3",
            "deepseekv31",
        ),
        (
            "<tool_call>{{ n }}<arg_key>k</arg_key><arg_value>v</arg_value>",
            "glm45",
            "glm45",
        ),
        (
            "<tool_call>\n<function={{ n }}>\n<parameter={{ p }}>",
            "none",
            "qwen3_coder",
        ),
        (
            "<think>{{ r }}</think><tool_call>\n{{ c | tojson }}\n</tool_call>",
            "qwen3",
            "hermes",
        ),
        (
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "none",
            "none",
        ),
    ];
    for (source, reasoning, tools) in cases {
        let s = Syntax::of_template(source);
        assert_eq!(
            s.reasoning.as_ref().map_or("none", Reasoning::name),
            reasoning,
            "{source}"
        );
        assert_eq!(
            s.tools.as_ref().map_or("none", Tools::name),
            tools,
            "{source}"
        );
    }
    let plain = Syntax::of_template("{{ messages }}");
    assert!(!plain.reads_token_text());
    assert_eq!(plain.family(), None);
    let over = Syntax::of_template("<think></think>").overridden(Some("glm45"), Some("glm45"));
    assert_eq!(
        (over.reasoning, over.tools),
        (Some(Reasoning::Glm45), Some(Tools::Glm45))
    );
    assert!(over.why.contains("from the config"), "{}", over.why);
}

/// Every name the config accepts is a parser, and back.
#[test]
fn every_known_name_is_a_parser() {
    for n in REASONING_PARSERS {
        assert!(Reasoning::named(n).is_some(), "{n}");
    }
    for n in TOOL_PARSERS {
        assert!(Tools::named(n).is_some(), "{n}");
    }
    assert!(Reasoning::named("qwen3-coder").is_none());
    assert!(Tools::named("kimi").is_none());
}

/// Without a call marker the answer is the text as written; ids of parsed calls are
/// stable for the same text and distinct within a reply.
#[test]
fn call_ids_are_stable_and_distinct() {
    let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
    let text = "<tool_call>f\n</tool_call><tool_call>f\n</tool_call>";
    let (_, a) = Tools::Glm45.split(text, &tools);
    let (_, b) = Tools::Glm45.split(text, &tools);
    let a = a.unwrap();
    assert_eq!(a, b.unwrap());
    assert_ne!(a[0]["id"], a[1]["id"]);
    assert_eq!(Tools::Glm45.split("plain", &tools), ("plain".into(), None));
}

/// Assistant tool-call arguments that are JSON objects become objects for the template;
/// other messages, and arguments that are not objects, stay as written.
#[test]
fn history_arguments_become_objects() {
    let m = json!([
        {"role": "user", "content": "{\"a\": 1}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"q\": \"x\"}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]},
    ]);
    let out = arguments_as_objects(&m).unwrap();
    assert_eq!(
        out[1]["tool_calls"][0]["function"]["arguments"],
        json!({"q": "x"})
    );
    assert_eq!(out[1]["tool_calls"][1]["function"]["arguments"], "[1]");
    assert_eq!(out[0], m[0]);
    assert_eq!(
        arguments_as_objects(&json!([{"role": "user", "content": "x"}])),
        None
    );
}

fn real_template(name: &str) -> crate::prompt::ChatTemplate {
    crate::prompt::ChatTemplate::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/parsers/templates")
            .join(name),
    )
    .unwrap()
}

/// The real Kimi K2-Thinking and GLM-4.6 templates choose their families' parsers and
/// ends of turn.
#[test]
fn real_templates_choose_their_family() {
    let kimi = Syntax::of_template(real_template("moonshotai-Kimi-K2-Thinking.jinja").source());
    assert_eq!(
        (kimi.reasoning.clone(), kimi.tools),
        (Some(Reasoning::KimiK2), Some(Tools::KimiK2))
    );
    assert_eq!(kimi.family(), Some(Family::Kimi));
    assert!(kimi.reads_token_text());
    let glm = Syntax::of_template(real_template("GLM-4.6.jinja").source());
    assert_eq!(
        (glm.reasoning.clone(), glm.tools),
        (Some(Reasoning::Glm45), Some(Tools::Glm45))
    );
    assert_eq!(glm.family(), Some(Family::Glm));
}

/// A GLM reply split here goes back into GLM-4.6's own template as history: with its
/// arguments as objects (as the servers pass them) the call renders as the model wrote
/// it; as JSON text the template cannot iterate them.
#[test]
fn a_split_glm_call_re_renders_in_glms_template() {
    let tpl = real_template("GLM-4.6.jinja");
    let raw = "\n<think>Need to search.</think>\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>sled</arg_value>\n</tool_call>";
    let tools = vec![json!({"type": "function", "function": {"name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}})];
    let (reasoning, answer) = Reasoning::Glm45.split(raw, "<|assistant|>", &Map::new());
    let (content, calls) = Tools::Glm45.split(&answer, &tools);
    let messages = json!([
        {"role": "user", "content": "What is sled?"},
        {"role": "assistant", "content": content, "reasoning_content": reasoning,
         "tool_calls": calls.unwrap()},
        {"role": "tool", "tool_call_id": "c", "content": "CACHED"},
    ]);
    let none = Map::new();
    let objects = arguments_as_objects(&messages).unwrap();
    let text = tpl.render(&objects, true, &none).unwrap();
    assert!(
        text.contains(&format!("<|assistant|>{raw}<|observation|>")),
        "{text:?}"
    );
    assert!(tpl.render(&messages, true, &none).is_err());
}
