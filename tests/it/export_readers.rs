//! Every export form, and the shards themselves, load in the tools people use —
//! HuggingFace `datasets`, pandas, pyarrow and DuckDB — with the rows spool wrote: the
//! count, and a row's id, text and token ids (tests/python/read_exports.py).

use crate::support::*;
use serde_json::Value;
use spool::output::export::{ExportOptions, Format};
use spool::store::row::ShardRow;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// Qwen3's end-of-turn id, appended by exports to a completion that stopped without it.
const IM_END: u32 = 151645;

fn export(cfg: &spool::config::Config, format: Format, out: &Path) {
    spool::output::export::export(cfg, &ExportOptions::new(format, out))
        .unwrap_or_else(|e| panic!("{}: {e:#}", format.name()));
}

/// A real run (mock server, Qwen3 tokenizer, two datasets), exported in every built form;
/// each reader sees every row, and its first row's id, completion text and token ids are
/// the ones in the shards (ids with the end-of-turn id appended where the export appends
/// it). The `hf` folder loads as a `DatasetDict` with one split per dataset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_export_loads_in_datasets_pandas_pyarrow_and_duckdb() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_chats(&dir.path().join("chat.jsonl"), "c", 40);
    write_prompts(&dir.path().join("plain.jsonl"), "p", 10);
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "chat",
                file: "chat.jsonl",
                budget: None,
            },
            Ds {
                name: "plain-text",
                file: "plain.jsonl",
                budget: None,
            },
        ],
        &qwen_table(),
    );
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let out = dir.path().join("out");
    let shards: Vec<ShardRow> = shard_rows(&out, "chat")
        .into_iter()
        .chain(shard_rows(&out, "plain-text"))
        .collect();
    assert_eq!(shards.len(), 50);
    let by_id: HashMap<&str, &ShardRow> = shards.iter().map(|s| (s.id.as_str(), s)).collect();

    let cfg = load(&cfg_path);
    let ex = dir.path().join("export");
    // Every built form and its file; a new form is one line here and one in
    // read_exports.py's FORMATS.
    let forms = [
        (Format::Sharegpt, "sg.jsonl"),
        (Format::Tokens, "tokens.parquet"),
        (Format::TokensJsonl, "tokens.jsonl"),
        (Format::Hf, "hf"),
        (Format::Specforge, "specforge.jsonl"),
        (Format::SpecforgeChat, "specforge-chat.jsonl"),
        (Format::Speculators, "speculators.jsonl"),
        (Format::OpenaiBatch, "batch.jsonl"),
    ];
    let mut args: Vec<String> = vec![
        "shard".into(),
        format!("{}/*/part-*.parquet", out.display()),
        "50".into(),
    ];
    for (format, file) in forms {
        export(&cfg, format, &ex.join(file));
        let expected = match format {
            Format::Hf => "chat=40,plain_text=10",
            _ => "50",
        };
        args.extend([
            format.name().to_string(),
            ex.join(file).display().to_string(),
            expected.to_string(),
        ]);
    }

    // The hf card names the datasets' splits (`plain-text` is not a valid split name).
    let card = std::fs::read_to_string(ex.join("hf/README.md")).unwrap();
    assert!(
        card.contains("| `plain_text` | `plain-text` | 10 |"),
        "{card}"
    );

    let cache = dir.path().join("hf-cache");
    let py = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/read_exports.py"))
        .args(&args)
        .env("HF_HOME", &cache)
        .env("HF_DATASETS_CACHE", cache.join("datasets"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .expect("python3");
    assert!(
        py.status.success(),
        "read_exports.py: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    let report: Value = serde_json::from_slice(&py.stdout).unwrap();
    let results = report["results"].as_array().unwrap();

    let mut seen = Vec::new();
    for r in results {
        let (fmt, reader) = (r["format"].as_str().unwrap(), r["reader"].as_str().unwrap());
        seen.push(format!("{fmt}/{reader}"));
        assert_eq!(r["rows"], 50, "{fmt}/{reader}");
        let first = &r["first"];
        let id = first["id"].as_str().unwrap();
        let s = by_id
            .get(id)
            .unwrap_or_else(|| panic!("{fmt}/{reader}: id {id} is not in the shards"));
        if let Some(text) = first["text"].as_str() {
            assert_eq!(text, s.completion, "{fmt}/{reader}: {id}'s completion");
        } else {
            assert!(first["text"].is_null());
        }
        if !first["ids"].is_null() {
            let mut want: Vec<u32> = s.prompt_token_ids.clone().unwrap();
            let mut c = s.completion_token_ids.clone().unwrap();
            if fmt != "shard" && s.finish_reason == "stop" && c.last() != Some(&IM_END) {
                c.push(IM_END);
            }
            want.extend(c);
            let got: Vec<u32> = serde_json::from_value(first["ids"].clone()).unwrap();
            assert_eq!(got, want, "{fmt}/{reader}: {id}'s token ids");
        }
    }
    let readers = ["datasets", "pandas", "pyarrow", "duckdb"];
    let names = forms.iter().map(|(f, _)| f.name());
    for fmt in std::iter::once("shard").chain(names) {
        for reader in readers {
            assert!(
                seen.contains(&format!("{fmt}/{reader}")),
                "{fmt}/{reader}: {seen:?}"
            );
        }
    }
    assert!(seen.contains(&"hf/datasets-parquet".to_string()));
    let hf = results
        .iter()
        .find(|r| r["format"] == "hf" && r["reader"] == "datasets")
        .unwrap();
    assert_eq!(
        hf["splits"],
        serde_json::json!({"chat": 40, "plain_text": 10})
    );
    assert_eq!(hf["input_ids"], "List(Value('int32'))");
    assert!(
        hf["messages"]
            .as_str()
            .unwrap()
            .contains("'role': Value('string')"),
        "{}",
        hf["messages"]
    );
}
