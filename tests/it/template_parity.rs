//! Template parity with transformers: every chat template of `tests/fixtures/templates/`
//! (and Qwen3's) renders every conversation of `conversations.jsonl`, once with transformers'
//! own `render_jinja_template` (tests/python/render_templates.py, the oracle) and once with
//! spool's `ChatTemplate`. Every pair the oracle renders, spool renders to the same text (and,
//! where the family has a tokenizer here, to the same ids); every pair the oracle refuses,
//! spool refuses too, with the template's own message when the template raised it. Where a
//! template's `tokenizer_config.json` names Moonshot's tokenizer, the oracle runs Moonshot's
//! own `apply_chat_template` code first (tests/fixtures/moonshot/), as loading the model does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Map, Value};
use spool::prompt::{ChatTemplate, TemplateError, Tokenizer};

/// Each family: its name, its template (under tests/fixtures/) and the tokenizer its ids come
/// from, if one is in tests/fixtures/tokenizers/. Giving a family a tokenizer is one edit here.
const FAMILIES: &[(&str, &str, Option<&str>)] = &[
    (
        "qwen3",
        "tokenizers/qwen3/tokenizer_config.json",
        Some("tokenizers/qwen3/tokenizer.json"),
    ),
    (
        "qwen3-coder",
        "templates/qwen3-coder/chat_template.jinja",
        Some("tokenizers/qwen3/tokenizer.json"),
    ),
    (
        "kimi-k2",
        "templates/kimi-k2/chat_template.jinja",
        Some("tokenizers/kimi-k2"),
    ),
    // llama.cpp's edit of K2-Instruct-0905's template (no public copy of Moonshot's own).
    (
        "kimi-k2-instruct-llamacpp",
        "templates/kimi-k2-instruct/chat_template.jinja",
        Some("tokenizers/kimi-k2"),
    ),
    (
        "kimi-k2-thinking",
        "templates/kimi-k2-thinking/chat_template.jinja",
        Some("tokenizers/kimi-k2"),
    ),
    // Its tools are declared by Moonshot's tokenization_kimi.py (tools_ts_str).
    (
        "kimi-k2.5",
        "templates/kimi-k2.5/chat_template.jinja",
        Some("tokenizers/kimi-k2"),
    ),
    (
        "deepseek-v3.1",
        "templates/deepseek-v3.1/chat_template.jinja",
        None,
    ),
    (
        "deepseek-v3.2",
        "templates/deepseek-v3.2/chat_template.jinja",
        None,
    ),
    // llama.cpp's edits of Z.ai's templates (no public copy of Z.ai's own).
    (
        "glm-4.5-llamacpp",
        "templates/glm-4.5/chat_template.jinja",
        None,
    ),
    (
        "glm-4.6-llamacpp",
        "templates/glm-4.6/chat_template.jinja",
        None,
    ),
    (
        "minimax-m2",
        "templates/minimax-m2/chat_template.jinja",
        None,
    ),
    ("gpt-oss", "templates/gpt-oss/chat_template.jinja", None),
    // spool's own: jinja2 behaviours real templates lean on, one probe per expression.
    (
        "jinja-probes",
        "templates/jinja-probes/chat_template.jinja",
        None,
    ),
];

/// The fewest conversations every template must be tried on.
const MIN_CONVERSATIONS: usize = 20;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The oracle's verdict on one pair.
enum Verdict {
    Rendered { text: String, ids: Option<Vec<u32>> },
    Refused { message: String, raised: bool },
}

fn run_oracle(conversations: &Path) -> (String, BTreeMap<(String, String), Verdict>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/render_templates.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(conversations);
    for (name, template, tokenizer) in FAMILIES {
        let mut spec = format!("{name}={}", fixture(template).display());
        if let Some(tokenizer) = tokenizer {
            spec.push_str(&format!("={}", fixture(tokenizer).display()));
        }
        cmd.arg(spec);
    }
    let out = cmd.output().expect("python3 runs");
    assert!(
        out.status.success(),
        "render_templates.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("oracle output is UTF-8");
    let mut lines = stdout.lines();
    let versions = lines.next().expect("versions line").to_owned();
    let mut verdicts = BTreeMap::new();
    for line in lines {
        let record: Value = serde_json::from_str(line).expect("oracle line is JSON");
        let key = (
            record["template"].as_str().unwrap().to_owned(),
            record["id"].as_str().unwrap().to_owned(),
        );
        let verdict = match record.get("rendered") {
            Some(Value::String(text)) => Verdict::Rendered {
                text: text.clone(),
                ids: record.get("input_ids").map(|ids| {
                    ids.as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_u64().unwrap() as u32)
                        .collect()
                }),
            },
            _ => Verdict::Refused {
                message: record["error"].as_str().unwrap().to_owned(),
                // jinja2's `TemplateError` itself (not a subclass) is what transformers'
                // `raise_exception` throws.
                raised: record["error_type"] == "TemplateError",
            },
        };
        verdicts.insert(key, verdict);
    }
    (versions, verdicts)
}

#[derive(Default)]
struct Counts {
    rendered: usize,
    refused: usize,
    agreeing: usize,
    /// Rendered pairs whose ids were compared too.
    ids: usize,
}

/// Every (template, conversation) pair: spool agrees with transformers on the text, the ids
/// where a tokenizer is here, and on which pairs are refused (with the template's message
/// when it raised one). Prints the counts per template; fails on any disagreement.
#[test]
fn templates_render_as_transformers_renders_them() {
    let conversations_path = fixture("templates/conversations.jsonl");
    let text = std::fs::read_to_string(&conversations_path).unwrap();
    let conversations: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("conversation line is JSON"))
        .collect();
    assert!(conversations.len() >= MIN_CONVERSATIONS);
    let (versions, verdicts) = run_oracle(&conversations_path);
    assert_eq!(verdicts.len(), FAMILIES.len() * conversations.len());

    let mut failures = Vec::new();
    let mut table = Vec::new();
    for (name, template_path, tokenizer_path) in FAMILIES {
        let template = ChatTemplate::from_file(&fixture(template_path))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let tokenizer = tokenizer_path
            .map(|p| Tokenizer::from_file(&fixture(p)).unwrap_or_else(|e| panic!("{name}: {e}")));
        let mut counts = Counts::default();
        for row in &conversations {
            let id = row["id"].as_str().unwrap();
            let mut fail = |what: String| failures.push(format!("{name}/{id}: {what}"));
            let mut extra: Map<String, Value> = row
                .get("kwargs")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            if let Some(tools) = row.get("tools") {
                extra.insert("tools".into(), tools.clone());
            }
            let add_gen = row["add_generation_prompt"].as_bool().unwrap();
            let ours = template.render(&row["messages"], add_gen, &extra);
            match (&verdicts[&(name.to_string(), id.to_owned())], ours) {
                (Verdict::Rendered { text, ids }, Ok(got)) => {
                    counts.rendered += 1;
                    if &got != text {
                        fail(format!(
                            "rendered differs at byte {}:\n  spool: {got:?}\n   want: {text:?}",
                            first_difference(&got, text)
                        ));
                        continue;
                    }
                    match (ids, &tokenizer) {
                        (Some(want), Some(tokenizer)) => {
                            let got = tokenizer.encode(&got, false).unwrap();
                            if &got != want {
                                fail(format!("ids differ:\n  spool: {got:?}\n   want: {want:?}"));
                                continue;
                            }
                            counts.ids += 1;
                        }
                        (None, Some(_)) => {
                            fail("the oracle gave no ids for a family with a tokenizer".into());
                            continue;
                        }
                        _ => {}
                    }
                    counts.agreeing += 1;
                }
                (Verdict::Rendered { .. }, Err(e)) => {
                    counts.rendered += 1;
                    fail(format!("transformers renders it, spool refuses: {e}"));
                }
                (Verdict::Refused { message, .. }, Ok(got)) => {
                    counts.refused += 1;
                    fail(format!(
                        "transformers refuses it ({message}), spool renders {got:?}"
                    ));
                }
                (Verdict::Refused { message, raised }, Err(e)) => {
                    counts.refused += 1;
                    match (&e, raised) {
                        (TemplateError::Raised { message: ours, .. }, true) if ours == message => {
                            counts.agreeing += 1
                        }
                        (_, true) => fail(format!(
                            "the template raised {message:?}; spool's error is {e}"
                        )),
                        (TemplateError::Raised { .. }, false) => fail(format!(
                            "transformers failed ({message}); spool says the template raised: {e}"
                        )),
                        (_, false) => counts.agreeing += 1,
                    }
                }
            }
        }
        table.push(format!(
            "{name:<25} rendered {:>3}  refused {:>3}  agreeing {:>3} / {}  ids compared {:>3}",
            counts.rendered,
            counts.refused,
            counts.agreeing,
            conversations.len(),
            counts.ids
        ));
    }
    println!("template parity against {versions}:");
    for line in &table {
        println!("  {line}");
    }
    assert!(
        failures.is_empty(),
        "{} disagreements with transformers:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn first_difference(a: &str, b: &str) -> usize {
    a.bytes()
        .zip(b.bytes())
        .position(|(x, y)| x != y)
        .unwrap_or_else(|| a.len().min(b.len()))
}
