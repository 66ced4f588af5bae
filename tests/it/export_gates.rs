//! The export's quality gates and accounting through the CLI: rows left out are counted by
//! reason, truncated rows are marked and never get an end-of-turn id, and the summary's
//! counts add up to the input rows with the queue's failed and rejected items.

use crate::support::*;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// Runs `spool export` and returns its stdout; panics with stderr when it fails.
fn export_cli(cfg: &Path, format: &str, out: &Path, extra: &[&str]) -> String {
    let o = Command::new(spool_bin())
        .args(["export", "-q", "--format", format, "--out"])
        .arg(out)
        .args(extra)
        .arg("-c")
        .arg(cfg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn summary(out: &Path) -> Value {
    let p = spool::output::export::summary_path(out);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// With `--exclude-finish length` the rows cut by `max_tokens` are left out and counted
/// under their reason; without it they are kept, marked and never closed with the
/// end-of-turn id. Either way the summary checks `kept + dropped = rows read` and
/// `rows read + failed + rejected = input rows` against the queue's own counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_gates_count_every_row_and_item() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("d.jsonl");
    write_prompts(&input, "p", 40);
    // One row the intake rejects: its prompt is not text.
    let mut text = std::fs::read_to_string(&input).unwrap();
    text.push_str("{\"id\": \"bad\", \"prompt\": 5}\n");
    std::fs::write(&input, text).unwrap();
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "d",
            file: "d.jsonl",
            budget: None,
        }],
        &qwen_table(),
    );
    // Completions of ~50 tokens against a cap of 45: a good share is cut.
    let cfg_text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("max_tokens = 200", "max_tokens = 45");
    std::fs::write(&cfg_path, cfg_text).unwrap();
    run_to_end(&cfg_path).await;
    mock.stop().await;

    let rows = shard_rows(&dir.path().join("out"), "d");
    assert_eq!(rows.len(), 40, "every valid row was generated");
    let finish: HashMap<String, String> = rows
        .iter()
        .map(|r| (r.id.clone(), r.finish_reason.clone()))
        .collect();
    let cut = rows.iter().filter(|r| r.finish_reason == "length").count();
    assert!(
        cut > 0 && cut < 40,
        "the test needs both stopped and cut rows, got {cut} cut"
    );

    // Default gates: every row kept, the cut ones marked.
    let all = dir.path().join("x/all.jsonl");
    let stdout = export_cli(&cfg_path, "tokens-jsonl", &all, &[]);
    assert!(
        stdout.contains(&format!("{cut} kept cut by max_tokens (marked)")),
        "{stdout}"
    );
    assert!(stdout.contains("keep every finish reason"), "{stdout}");
    let lines = jsonl(&all);
    assert_eq!(lines.len(), 40);
    for l in &lines {
        let id = l["id"].as_str().unwrap();
        assert_eq!(l["finish_reason"], finish[id].as_str(), "{id}");
        let last = l["input_ids"].as_array().unwrap().last().unwrap().clone();
        if finish[id] == "length" {
            assert_ne!(
                last, 151645,
                "{id}: a cut completion gets no end-of-turn id"
            );
        } else {
            assert_eq!(last, 151645, "{id}: a stopped completion ends its turn");
        }
    }
    let s = summary(&all);
    let d = &s["datasets"][0];
    assert_eq!(d["rows_in"], 40);
    assert_eq!(d["kept"], 40);
    assert_eq!(d["truncated_kept"], cut as u64);
    assert_eq!(s["checked"], true);

    // Excluding `length`: those rows are dropped under that reason, and the sums hold.
    let kept = dir.path().join("x/kept.jsonl");
    let stdout = export_cli(
        &cfg_path,
        "tokens-jsonl",
        &kept,
        &["--exclude-finish", "length,abort"],
    );
    assert!(
        stdout.contains(&format!(
            "40 row(s) read = {} kept + {cut} dropped",
            40 - cut
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("finish_reason=length: {cut}")),
        "{stdout}"
    );
    let lines = jsonl(&kept);
    assert_eq!(lines.len(), 40 - cut);
    assert!(lines.iter().all(|l| l["finish_reason"] != "length"));
    let s = summary(&kept);
    let d = &s["datasets"][0];
    assert_eq!(d["dropped"]["finish_reason=length"], cut as u64);
    let q = &d["queue"];
    assert_eq!(
        q["source"], "queue",
        "the run has stopped: the queue answered"
    );
    assert_eq!(q["rejected"], 1, "the row whose prompt is not text");
    assert_eq!(q["input_rows"], 41);
    let kept_n = d["kept"].as_u64().unwrap();
    let dropped: u64 = d["dropped"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        kept_n + dropped + q["failed"].as_u64().unwrap() + q["rejected"].as_u64().unwrap(),
        q["input_rows"].as_u64().unwrap(),
        "kept + dropped + failed + rejected = input rows"
    );
    assert_eq!(
        s["gates"]["exclude_finish"],
        serde_json::json!(["length", "abort"])
    );

    // A shard being written (its temporary file, garbage so far) is not read: an export
    // running beside `run` sees the sealed shards only.
    std::fs::write(
        dir.path().join("out/d/.part-000099.parquet.tmp"),
        b"PAR1 half a shard",
    )
    .unwrap();
    let again = dir.path().join("x/again.jsonl");
    export_cli(&cfg_path, "tokens-jsonl", &again, &[]);
    assert_eq!(jsonl(&again), jsonl(&all));
}
