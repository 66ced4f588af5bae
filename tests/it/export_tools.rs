//! Tools and tool calls in the chat-shaped exports load with HuggingFace `datasets` however
//! late they first appear: `datasets.load_dataset("json")` fixes a file's schema from its
//! first 10 MB, so the forms write `tools` and `tool_calls` as JSON strings on every line
//! (tests/python/load_tools.py reads them back).

use crate::support::*;
use serde_json::{json, Value};
use spool::output::export::{ExportOptions, Format};
use spool::output::schema;
use spool::output::shard::ShardLimits;
use spool::output::writer::ShardWriter;
use spool::store::row::ShardRow;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Rows of the dataset `tools`: `plain` long chats without tools, then `late` rows that
/// offered tools (each with its own schema shape) and made a call.
fn rows(plain: usize, late: usize) -> Vec<ShardRow> {
    let pad = "The quick brown fox jumps over the lazy dog. ".repeat(70);
    let mut v = Vec::new();
    for i in 0..plain + late {
        let messages = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": format!("Question {i}: {pad}")},
        ]);
        let mut r = ShardRow {
            id: format!("r{i}"),
            dataset: "tools".into(),
            row: i as u64,
            prompt: format!("<|im_start|>user\nQuestion {i}<|im_end|>\n"),
            messages: Some(messages.to_string()),
            completion: format!("Answer {i}."),
            reasoning: Some(format!("Thinking about {i}.")),
            prompt_tokens: 900,
            completion_tokens: 12,
            finish_reason: "stop".into(),
            model: "m".into(),
            attempts: 1,
            completed_at_ms: 1_767_225_600_000,
            ..ShardRow::default()
        };
        if i >= plain {
            // Schemas whose shapes differ from row to row, as real tool sets do.
            let params = match i % 3 {
                0 => {
                    json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
                }
                1 => {
                    json!({"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}, "deep": {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number"}}}}}})
                }
                _ => json!({"type": "object", "properties": {}}),
            };
            let name = format!("tool_{}", i % 3);
            r.tools = Some(
                json!([{"type": "function", "function": {"name": name, "description": "d", "parameters": params}}])
                    .to_string(),
            );
            r.tool_calls = Some(
                json!([{"id": format!("call_{i}"), "type": "function",
                    "function": {"name": name, "arguments": "{\"city\": \"Paris\"}"}}])
                .to_string(),
            );
            r.finish_reason = "tool_calls".into();
            r.completion = String::new();
        }
        v.push(r);
    }
    v
}

/// Writes `rows` as sealed shards of `out/<dataset>/`.
fn write_shards(out: &Path, rows: &[ShardRow]) {
    let dir = out.join("tools");
    let metadata = vec![
        (schema::META_VERSION.to_string(), "0.1.0-test".to_string()),
        (schema::META_CONFIG_SHA256.to_string(), "0f".repeat(32)),
        (schema::META_SAMPLING.to_string(), "{}".to_string()),
        (schema::META_COUNT_SOURCE.to_string(), "server".to_string()),
    ];
    let limits = ShardLimits {
        max_rows: 2000,
        max_bytes: 1 << 30,
        compression_level: 3,
    };
    for (k, chunk) in rows.chunks(2000).enumerate() {
        let mut w = ShardWriter::create(
            &dir,
            k as u64,
            &limits,
            metadata.clone(),
            &spool::knobs::Faults::default(),
        )
        .unwrap();
        w.append(chunk).unwrap();
        w.finish().unwrap();
    }
}

/// The byte offset of the first line of `path` holding `needle`.
fn first_offset(path: &Path, needle: &str) -> usize {
    let text = std::fs::read_to_string(path).unwrap();
    let mut at = 0;
    for l in text.split_inclusive('\n') {
        if l.contains(needle) {
            return at;
        }
        at += l.len();
    }
    panic!("{needle} is not in {}", path.display());
}

/// A file over 10 MB whose first row with tools comes after the first 10 MB loads with
/// `datasets.load_dataset("json")` in every chat-shaped JSONL form (`sharegpt`,
/// `specforge-chat`, `--per-turn`), every row there; the tools and tool calls read back
/// (JSON strings) are the ones generated, and a row without them has `"[]"`. The `hf` form
/// keeps `tools` too.
#[test]
fn tools_past_the_first_10_mb_load_with_datasets() {
    let dir = tempfile::tempdir().unwrap();
    let written = rows(3600, 30);
    write_shards(&dir.path().join("out"), &written);
    std::fs::write(dir.path().join("t.jsonl"), "").unwrap();
    let cfg_path = write_config(
        dir.path(),
        "http://127.0.0.1:9",
        "sglang",
        true,
        &[Ds {
            name: "tools",
            file: "t.jsonl",
            budget: None,
        }],
        "",
    );
    let cfg = load(&cfg_path);
    let want: BTreeMap<&str, &ShardRow> = written
        .iter()
        .filter(|r| r.tools.is_some())
        .map(|r| (r.id.as_str(), r))
        .collect();
    let mut args = Vec::new();
    for (format, per_turn, file) in [
        (Format::Sharegpt, false, "sg.jsonl"),
        (Format::SpecforgeChat, false, "chat.jsonl"),
        (Format::SpecforgeChat, true, "per.jsonl"),
        (Format::Hf, false, "hf"),
    ] {
        let out = dir.path().join(file);
        spool::output::export::export(
            &cfg,
            &ExportOptions {
                per_turn,
                ..ExportOptions::new(format, &out)
            },
        )
        .unwrap();
        if format != Format::Hf {
            let len = std::fs::metadata(&out).unwrap().len();
            assert!(len > 10 << 20, "{file}: {len} bytes");
            let first = first_offset(&out, "tool_0");
            assert!(
                first > 10 << 20,
                "{file}: the first tool row at byte {first}"
            );
        }
        args.push(out);
    }
    let py = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/load_tools.py"))
        .args(&args)
        .env("HF_HOME", dir.path().join("hf-home"))
        .env("HF_DATASETS_CACHE", dir.path().join("hf-cache"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .expect("python3 with datasets");
    assert!(
        py.status.success(),
        "load_tools.py: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    let report: Value = serde_json::from_slice(&py.stdout).unwrap();
    for (path, got) in args.iter().zip(report.as_array().unwrap()) {
        let name = path.file_name().unwrap().to_string_lossy();
        assert_eq!(got["rows"], written.len(), "{name}: every row loads");
        assert_eq!(got["without_tools"], "[]", "{name}: a row without tools");
        let tools = got["tools"].as_object().unwrap();
        assert_eq!(tools.len(), want.len(), "{name}");
        for (id, r) in &want {
            let t: Value = serde_json::from_str(tools[*id].as_str().unwrap()).unwrap();
            let w: Value = serde_json::from_str(r.tools.as_deref().unwrap()).unwrap();
            assert_eq!(t, w, "{name}: {id}'s tools");
            if name != "hf" {
                let c: Value =
                    serde_json::from_str(got["tool_calls"][*id].as_str().unwrap()).unwrap();
                let w: Value = serde_json::from_str(r.tool_calls.as_deref().unwrap()).unwrap();
                assert_eq!(c, w, "{name}: {id}'s tool calls");
            }
        }
    }
}
