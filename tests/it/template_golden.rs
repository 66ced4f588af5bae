//! Golden vectors made with HuggingFace transformers (tests/fixtures/tokenizers/*/goldens.jsonl):
//! every chat case must render byte for byte and encode to exactly `input_ids`, and every
//! plain-text case must encode to exactly `input_ids`. Failures are collected and reported
//! together; no case is skipped.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use spool::prompt::{ChatTemplate, PromptBuilder, Tokenizer};

fn family_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizers")
        .join(family)
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("input_ids is an array")
        .iter()
        .map(|v| v.as_u64().expect("id is an integer") as u32)
        .collect()
}

/// Cases that cannot pass, with the reason. Empty: every case of both families passes.
const KNOWN_FAILURES: &[(&str, &str, &str)] = &[];

struct Outcome {
    chat: usize,
    text: usize,
    failures: Vec<String>,
}

fn check_family(family: &str) -> Outcome {
    let dir = family_dir(family);
    let meta = read_json(&dir.join("meta.json"));
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json(&config_path);
    let mut failures = Vec::new();

    // The reference recipe: config's chat_template, meta's special tokens as variables.
    let source = config["chat_template"]
        .as_str()
        .expect("chat_template string");
    let tokens: Map<String, Value> = meta["template_context_special_tokens"]
        .as_object()
        .expect("template_context_special_tokens")
        .clone();
    let template = ChatTemplate::from_source(source, tokens.clone(), config_path.clone())
        .unwrap_or_else(|e| panic!("{family}: {e}"));
    assert_eq!(
        template.sha256(),
        meta["chat_template_sha256"].as_str().unwrap(),
        "{family}"
    );

    // from_file must find the same template and the same special tokens on its own.
    let loaded = ChatTemplate::from_file(&config_path).unwrap_or_else(|e| panic!("{family}: {e}"));
    assert_eq!(loaded.sha256(), template.sha256(), "{family}");
    assert_eq!(
        loaded.special_tokens(),
        &tokens,
        "{family}: special tokens from tokenizer_config.json"
    );

    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{family}: {e}"));
    assert_eq!(
        tokenizer.sha256(),
        meta["files_sha256"]["tokenizer.json"].as_str().unwrap(),
        "{family}"
    );
    let builder = PromptBuilder::new(Some(loaded), Some(tokenizer.clone()));

    let goldens = std::fs::read_to_string(dir.join("goldens.jsonl")).expect("goldens.jsonl");
    let (mut chat, mut text) = (0, 0);
    for line in goldens.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).expect("golden line is JSON");
        let id = case["id"].as_str().expect("id");
        let expected_ids = ids(&case["input_ids"]);
        let mut fail = |what: String| failures.push(format!("{family}/{id}: {what}"));
        match case["kind"].as_str() {
            Some("chat") => {
                chat += 1;
                assert!(
                    case.get("error").is_none(),
                    "{family}/{id}: error cases are not expected"
                );
                let add_gen = case["add_generation_prompt"]
                    .as_bool()
                    .expect("add_generation_prompt");
                let kwargs = case
                    .get("kwargs")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                let expected = case["rendered"].as_str().expect("rendered");
                let rendered = match template.render(&case["messages"], add_gen, &kwargs) {
                    Ok(r) => r,
                    Err(e) => {
                        fail(format!("render error: {e}"));
                        continue;
                    }
                };
                if rendered != expected {
                    fail(format!(
                        "rendered differs:\n got: {rendered:?}\nwant: {expected:?}"
                    ));
                    continue;
                }
                match tokenizer.encode(&rendered, false) {
                    Ok(got) if got == expected_ids => {}
                    Ok(got) => fail(format!(
                        "ids differ:\n got: {got:?}\nwant: {expected_ids:?}"
                    )),
                    Err(e) => fail(format!("encode error: {e}")),
                }
                // The builder path (generation prompt, no kwargs) gives the same result.
                if add_gen && kwargs.is_empty() {
                    match builder.build_chat(&case["messages"]) {
                        Ok(built)
                            if built.text == expected
                                && built.token_ids.as_ref() == Some(&expected_ids) => {}
                        Ok(built) => fail(format!("build_chat differs: {built:?}")),
                        Err(e) => fail(format!("build_chat error: {e}")),
                    }
                }
            }
            Some("text") => {
                text += 1;
                let input = case["text"].as_str().expect("text");
                let add_special = case["add_special_tokens"]
                    .as_bool()
                    .expect("add_special_tokens");
                match tokenizer.encode(input, add_special) {
                    Ok(got) if got == expected_ids => {}
                    Ok(got) => fail(format!(
                        "ids differ:\n got: {got:?}\nwant: {expected_ids:?}"
                    )),
                    Err(e) => fail(format!("encode error: {e}")),
                }
            }
            other => panic!("{family}/{id}: unknown kind {other:?}"),
        }
    }
    assert_eq!(
        chat as u64,
        meta["n_chat_cases"].as_u64().unwrap(),
        "{family}: chat cases"
    );
    assert_eq!(
        text as u64,
        meta["n_text_cases"].as_u64().unwrap(),
        "{family}: text cases"
    );
    Outcome {
        chat,
        text,
        failures,
    }
}

fn assert_family(family: &str, want_chat: usize, want_text: usize) {
    let outcome = check_family(family);
    assert_eq!(
        (outcome.chat, outcome.text),
        (want_chat, want_text),
        "{family}: case counts"
    );
    let unexpected: Vec<&String> = outcome
        .failures
        .iter()
        .filter(|f| {
            !KNOWN_FAILURES
                .iter()
                .any(|(fam, id, _)| *fam == family && f.starts_with(&format!("{fam}/{id}:")))
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "{} of {} {family} cases failed:\n{}",
        unexpected.len(),
        want_chat + want_text,
        unexpected
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn template_golden_qwen3() {
    assert_family("qwen3", 40, 14);
}

#[test]
fn template_golden_phi3() {
    assert_family("phi3", 32, 14);
}

/// `build_chat_with` renders as transformers' `apply_chat_template(messages, tools=…,
/// **kwargs)`: every Qwen3 golden made with kwargs and a generation prompt
/// (`enable_thinking=false`, `tools`) comes out byte for byte with its ids, through a
/// builder whose own variables say otherwise (`enable_thinking=true`), so `extra` wins;
/// the empty think block and the tools section are there.
#[test]
fn build_chat_with_matches_the_qwen3_kwargs_goldens() {
    let dir = family_dir("qwen3");
    let template = ChatTemplate::from_file(&dir.join("tokenizer_config.json")).unwrap();
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let builder =
        PromptBuilder::new(Some(template), Some(tokenizer)).with_template_kwargs(Map::from_iter([
            ("enable_thinking".to_owned(), Value::Bool(true)),
        ]));
    let goldens = std::fs::read_to_string(dir.join("goldens.jsonl")).unwrap();
    let (mut no_thinking, mut tools) = (0, 0);
    for line in goldens.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).unwrap();
        let Some(kwargs) = case.get("kwargs").and_then(Value::as_object) else {
            continue;
        };
        if case["add_generation_prompt"] != Value::Bool(true)
            || kwargs.contains_key("enable_thinking") && kwargs["enable_thinking"] != false
        {
            continue;
        }
        let mut extra = kwargs.clone();
        extra.entry("enable_thinking").or_insert(Value::Bool(true));
        let built = builder.build_chat_with(&case["messages"], &extra).unwrap();
        let want = case["rendered"].as_str().unwrap();
        assert_eq!(built.text, want, "{}", case["id"]);
        assert_eq!(
            built.token_ids.unwrap(),
            ids(&case["input_ids"]),
            "{}",
            case["id"]
        );
        if kwargs.get("enable_thinking") == Some(&Value::Bool(false)) {
            assert!(want.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
            no_thinking += 1;
        }
        if kwargs.contains_key("tools") {
            assert!(want.contains("# Tools\n\nYou may call one or more functions"));
            assert!(want.contains("<tools>\n{\"type\": \"function\""), "{want}");
            tools += 1;
        }
    }
    assert_eq!((no_thinking, tools), (1, 3));
}
