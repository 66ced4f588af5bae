//! `spool export`: `tokens` rows are prompt ids ++ completion ids with the loss
//! mask aligned; `sharegpt` rows are the input turns plus the completion.

use crate::support::*;
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt8Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{json, Value};
use spool::output::export::{ExportOptions, ExportReport, Format};
use spool::store::row::ShardRow;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// Exports `cfg` in `format` to `out` with the default gates, like the CLI without flags.
fn export(
    cfg: &spool::config::Config,
    format: Format,
    out: &Path,
    dataset: Option<&str>,
) -> Result<ExportReport, spool::output::export::error::ExportError> {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            dataset: dataset.map(Into::into),
            ..ExportOptions::new(format, out)
        },
    )
}

/// Qwen3's end-of-turn id, which the export appends to a completion that stopped without it.
const IM_END: u32 = 151645;

/// (id, dataset, input_ids, loss_mask) of every row of a `tokens` file.
fn read_tokens(path: &Path) -> Vec<(String, String, Vec<i32>, Vec<u8>)> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let mut out = Vec::new();
    for b in reader {
        let b = b.unwrap();
        let id = b.column_by_name("id").unwrap().as_string::<i32>().clone();
        let ds = b
            .column_by_name("dataset")
            .unwrap()
            .as_string::<i32>()
            .clone();
        let ids = b
            .column_by_name("input_ids")
            .unwrap()
            .as_list::<i32>()
            .clone();
        let mask = b
            .column_by_name("loss_mask")
            .unwrap()
            .as_list::<i32>()
            .clone();
        for i in 0..b.num_rows() {
            out.push((
                id.value(i).to_string(),
                ds.value(i).to_string(),
                ids.value(i).as_primitive::<Int32Type>().values().to_vec(),
                mask.value(i).as_primitive::<UInt8Type>().values().to_vec(),
            ));
        }
    }
    out
}

/// The input turns of each row of a file written by `write_chats`/`write_prompts`, as
/// the model saw them (ShareGPT converted, trailing assistant turn dropped).
fn input_turns(path: &Path) -> HashMap<String, Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let id = v["id"].as_str().unwrap().to_string();
            let turns = if let Some(m) = v.get("messages") {
                m.clone()
            } else if let Some(c) = v.get("conversations") {
                let mut t: Vec<Value> = c
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| {
                        let role = match t["from"].as_str().unwrap() {
                            "human" => "user",
                            "gpt" => "assistant",
                            other => other,
                        };
                        json!({"role": role, "content": t["value"]})
                    })
                    .collect();
                if t.last().unwrap()["role"] == "assistant" {
                    t.pop();
                }
                Value::Array(t)
            } else {
                json!([{"role": "user", "content": v["prompt"]}])
            };
            (id, turns)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_tokens_and_sharegpt_from_a_real_run() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_chats(&dir.path().join("chat.jsonl"), "c", 60);
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
                name: "plain",
                file: "plain.jsonl",
                budget: None,
            },
        ],
        &format!("{}\n", qwen_table()),
    );
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let out = dir.path().join("out");
    let shards: Vec<ShardRow> = shard_rows(&out, "chat")
        .into_iter()
        .chain(shard_rows(&out, "plain"))
        .collect();
    assert_eq!(shards.len(), 70);
    assert!(
        shard_files(&out, "chat").len() >= 3,
        "60 rows at max_rows = 25"
    );
    let cfg = load(&cfg_path);

    // tokens: one row per completed item, in dataset, shard and row order.
    let tok_path = dir.path().join("export/tokens.parquet");
    let r = export(&cfg, Format::Tokens, &tok_path, None).unwrap();
    assert_eq!(r.accounting.kept(), 70);
    let rows = read_tokens(&tok_path);
    assert_eq!(rows.len(), shards.len());
    for ((id, ds, input_ids, mask), s) in rows.iter().zip(&shards) {
        assert_eq!((id, ds), (&s.id, &s.dataset));
        let p = s.prompt_token_ids.as_ref().unwrap();
        let c = s.completion_token_ids.as_ref().unwrap();
        assert!(!p.is_empty() && !c.is_empty());
        // A completion that stopped ends with the end-of-turn id, appended when the server
        // left it out.
        let mut c = c.clone();
        let appended = s.finish_reason == "stop" && c.last() != Some(&IM_END);
        if appended {
            c.push(IM_END);
        }
        let want: Vec<i32> = p.iter().chain(&c).map(|&t| t as i32).collect();
        assert_eq!(
            input_ids, &want,
            "{id}: input_ids = prompt ids ++ completion ids"
        );
        assert_eq!(mask.len(), input_ids.len(), "{id}");
        assert!(
            mask[..p.len()].iter().all(|&m| m == 0),
            "{id}: 0 per prompt id"
        );
        assert!(
            mask[p.len()..].iter().all(|&m| m == 1),
            "{id}: 1 per completion id"
        );
        assert_eq!(
            mask.iter().filter(|&&m| m == 1).count(),
            s.completion_tokens as usize + usize::from(appended)
        );
    }
    // No temporary file left next to the output.
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("export"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["tokens.parquet", "tokens.parquet.summary.json"]);

    // sharegpt: the input turns from the original files, then the completion.
    let sg_path = dir.path().join("export/chat.jsonl");
    let r = export(&cfg, Format::Sharegpt, &sg_path, Some("chat")).unwrap();
    assert_eq!(r.accounting.kept(), 60);
    let inputs = input_turns(&dir.path().join("chat.jsonl"));
    let by_id: HashMap<&str, &ShardRow> = shards.iter().map(|s| (s.id.as_str(), s)).collect();
    let text = std::fs::read_to_string(&sg_path).unwrap();
    let mut seen = 0;
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let id = v["id"].as_str().unwrap();
        assert_eq!(v["dataset"], "chat");
        let turns = v["conversations"].as_array().unwrap();
        let (last, input) = turns.split_last().unwrap();
        assert_eq!(
            &Value::Array(input.to_vec()),
            &inputs[id],
            "{id}: input turns round-trip"
        );
        assert_eq!(
            last,
            &json!({"role": "assistant", "content": by_id[id].completion, "tool_calls": "[]"}),
            "{id}"
        );
        seen += 1;
    }
    assert_eq!(seen, 60);
    // Prompt rows become one user turn.
    let plain_path = dir.path().join("export/plain.jsonl");
    export(&cfg, Format::Sharegpt, &plain_path, Some("plain")).unwrap();
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(&plain_path)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let inputs = input_turns(&dir.path().join("plain.jsonl"));
    let id = first["id"].as_str().unwrap();
    assert_eq!(first["conversations"][0], inputs[id][0]);
    assert_eq!(first["conversations"].as_array().unwrap().len(), 2);

    // The CLI: same file, and pyarrow (what training jobs use) reads it as documented.
    let cli_path = dir.path().join("export/cli.parquet");
    let st = Command::new(spool_bin())
        .args(["export", "-q", "--format", "tokens", "--out"])
        .arg(&cli_path)
        .arg("-c")
        .arg(&cfg_path)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    assert!(String::from_utf8_lossy(&st.stdout).contains("70 row(s)"));
    assert_eq!(read_tokens(&cli_path), rows);
    let py = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, pyarrow.parquet as pq\n\
             t = pq.read_table(sys.argv[1])\n\
             print(t.schema.field('input_ids').type, t.schema.field('loss_mask').type, t.num_rows)\n\
             r = t.slice(0, 1).to_pylist()[0]\n\
             assert len(r['input_ids']) == len(r['loss_mask'])",
        )
        .arg(&cli_path)
        .output()
        .expect("python3 with pyarrow");
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&py.stdout).trim(),
        "list<item: int32 not null> list<item: uint8 not null> 70"
    );

    // An unknown dataset is a usage error naming it, in the library and on the CLI (exit 2).
    let err = export(&cfg, Format::Tokens, &cli_path, Some("nope")).unwrap_err();
    assert!(format!("{err:#}").contains("nope"));
    let st = Command::new(spool_bin())
        .args([
            "export",
            "-q",
            "--format",
            "tokens",
            "--dataset",
            "nope",
            "--out",
        ])
        .arg(&cli_path)
        .arg("-c")
        .arg(&cfg_path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&st.stderr);
    assert_eq!(st.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--dataset") && stderr.contains("nope"),
        "{stderr}"
    );
}

/// Without a tokenizer there are no ids: a `tokens` export refuses, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_export_needs_token_ids() {
    let mock = Mock::start(spool::mock::MockConfig {
        no_token_ids: true,
        ..fast_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("p.jsonl"), "p", 5);
    let cfg_path = write_config(
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
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let cfg = load(&cfg_path);
    let out = dir.path().join("t.parquet");
    let err = format!(
        "{:#}",
        export(&cfg, Format::Tokens, &out, None).unwrap_err()
    );
    assert!(
        err.contains("5 completed rows") && err.contains("[tokenizer]"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written");
    let sg = dir.path().join("p.jsonl.out");
    assert_eq!(
        export(&cfg, Format::Sharegpt, &sg, None)
            .unwrap()
            .accounting
            .kept(),
        5
    );
}
