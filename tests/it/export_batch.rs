//! The OpenAI batch shape in and out: batch rows send their own sampling within the
//! dataset's limits, and `--format openai-batch` answers every custom_id (failed items
//! and rejected rows included) in vLLM's batch output schema.

use crate::process::mock_log;
use crate::support::*;
use serde_json::{json, Value};
use spool::observe::status::StatusReport;
use spool::output::export::{ExportOptions, ExportReport, Format};
use spool::store::queue::Queue;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

/// The mock's context: a prompt of this many words or more is refused with a 400.
const MOCK_CONTEXT: u32 = 1000;

fn export_batch(
    cfg: &spool::config::Config,
    out: &Path,
    status: Option<StatusReport>,
) -> Result<ExportReport, spool::output::export::error::ExportError> {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            status,
            ..ExportOptions::new(Format::OpenaiBatch, out)
        },
    )
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn batch_line(id: &str, url: &str, body: Value) -> String {
    json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string() + "\n"
}

/// Runs `tests/python/batch_schema.py` and returns its JSON answer.
fn schema(args: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/batch_schema.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "batch_schema.py {args:?} failed (needs pydantic 2 and openai: pip install pydantic openai): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Each batch row's request carries the row's own `max_tokens` (never above the
/// dataset's), temperature, top_p, seed and stop strings (added to none), rows without
/// them the dataset's; bad batch rows land in `_rejected.jsonl` naming line and key, with
/// their custom_id, and the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_rows_send_their_own_sampling_within_the_dataset_limits() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(spool::mock::MockConfig {
        log: Some(log.clone()),
        log_bodies: true,
        ..fast_mock()
    })
    .await;
    let chat = "/v1/chat/completions";
    let msgs = |q: &str| json!([{"role": "user", "content": q}]);
    let mut s = String::new();
    s += &batch_line(
        "r0",
        chat,
        json!({"model": "x", "messages": msgs("a"), "max_tokens": 7, "temperature": 0.1,
            "seed": 5, "stop": ["END"]}),
    );
    s += &batch_line(
        "r1",
        chat,
        json!({"messages": msgs("b"), "max_completion_tokens": 500, "max_tokens": 3}),
    );
    s += &batch_line(
        "r2",
        "/v1/completions",
        json!({"prompt": "Once upon a time", "max_tokens": 9, "top_p": 0.5}),
    );
    s += &batch_line("r3", chat, json!({"messages": msgs("d")}));
    s += &batch_line("bad-url", "/v1/embeddings", json!({"input": "x"}));
    s += &batch_line(
        "bad-type",
        chat,
        json!({"messages": msgs("e"), "max_tokens": "ten"}),
    );
    s += "{not json\n";
    std::fs::write(dir.path().join("batch.jsonl"), s).unwrap();
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "chat",
        false,
        &[Ds {
            name: "b",
            file: "batch.jsonl",
            budget: None,
        }],
        "",
    );
    let summary = run_to_end(&cfg_path).await;
    mock.stop().await;
    let d = &summary.report.datasets[0];
    assert_eq!((d.done, d.rejected, d.failed), (4, 3, 0));

    let reqs: HashMap<u64, Value> = mock_log(&log)
        .into_iter()
        .filter(|l| l.outcome == "ok")
        .map(|l| (l.row, l.request.expect("bodies are logged")))
        .collect();
    assert_eq!(reqs.len(), 4);
    let r0 = &reqs[&0];
    assert_eq!(r0["max_tokens"], 7);
    assert_eq!(r0["temperature"], 0.1);
    assert_eq!(r0["seed"], 5);
    assert_eq!(r0["stop"], json!(["END"]));
    assert_eq!(
        reqs[&1]["max_tokens"], 200,
        "a row's max_tokens never goes above the dataset's"
    );
    assert_eq!(reqs[&2]["max_tokens"], 9);
    assert_eq!(reqs[&2]["top_p"], 0.5);
    assert_eq!(
        reqs[&2]["temperature"], 0.7,
        "the dataset's, not set by the row"
    );
    let r3 = &reqs[&3];
    assert_eq!(
        (&r3["max_tokens"], &r3["temperature"], &r3["top_p"]),
        (&json!(200), &json!(0.7), &json!(0.95))
    );
    assert!(r3.get("seed").is_none() && r3.get("stop").is_none());

    let out = dir.path().join("out");
    let rows = shard_rows(&out, "b");
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, BTreeSet::from(["r0", "r1", "r2", "r3"]));
    let r0 = rows.iter().find(|r| r.id == "r0").unwrap();
    assert!(r0.completion_tokens <= 7);
    let sampling: Value = serde_json::from_str(r0.sampling.as_deref().unwrap()).unwrap();
    assert_eq!(sampling["max_tokens"], 7);
    assert_eq!(sampling["seed"], 5);

    let rejected = lines(&out.join("b/_rejected.jsonl"));
    let got: Vec<(u64, Option<&str>, &str)> = rejected
        .iter()
        .map(|r| {
            (
                r["line"].as_u64().unwrap(),
                r["id"].as_str(),
                r["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!((got[0].0, got[0].1), (5, Some("bad-url")));
    assert!(got[0].2.contains("`url` `/v1/embeddings`"), "{}", got[0].2);
    assert_eq!((got[1].0, got[1].1), (6, Some("bad-type")));
    assert!(
        got[1]
            .2
            .contains("`body.max_tokens` must be a positive integer, not a string"),
        "{}",
        got[1].2
    );
    assert_eq!((got[2].0, got[2].1), (7, None));
    assert!(rejected
        .iter()
        .all(|r| r["file"].as_str().unwrap().ends_with("batch.jsonl")));
}

/// A user-written batch file validates as vLLM's BatchRequestInput and spool takes its
/// rows in under their custom_ids; the `openai-batch` export validates line by line as
/// vLLM's BatchRequestOutput; custom_ids out = custom_ids in (the failed and rejected
/// ones as error lines); an item's samples are one line's choices; the counts match the
/// export's summary. While a run holds the queue, failed items are left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_batch_export_answers_every_custom_id_in_vllms_schema() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("batch.jsonl");
    let written = schema(&["write", input.to_str().unwrap()]);
    assert_eq!(
        written["invalid"],
        json!(["bad-url", "bad-type", "no-messages"]),
        "the rows vLLM's schema refuses"
    );
    let mut multi = String::new();
    for i in 0..3 {
        multi += &batch_line(
            &format!("m{i}"),
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("twice {i}")}], "n": 2,
                "max_tokens": 6}),
        );
    }
    let multi_path = dir.path().join("multi.jsonl");
    std::fs::write(&multi_path, multi).unwrap();

    let mock = Mock::start(spool::mock::MockConfig {
        context_len: MOCK_CONTEXT,
        ..fast_mock()
    })
    .await;
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "chat",
        true,
        &[
            Ds {
                name: "b",
                file: "batch.jsonl",
                budget: None,
            },
            Ds {
                name: "multi",
                file: "multi.jsonl",
                budget: None,
            },
        ],
        "",
    );
    // The last dataset table is `multi`'s.
    let mut toml = std::fs::read_to_string(&cfg_path).unwrap();
    toml += "samples = 2\n";
    std::fs::write(&cfg_path, toml).unwrap();
    let summary = run_to_end(&cfg_path).await;
    mock.stop().await;
    let b = &summary.report.datasets[0];
    assert_eq!(
        (b.failed, b.rejected),
        (1, 4),
        "too-long fails; 4 rows rejected"
    );

    // spool took the rows in under their custom_ids.
    let out = dir.path().join("out");
    let mut taken: BTreeSet<String> = shard_rows(&out, "b").into_iter().map(|r| r.id).collect();
    taken.insert(written["too_long"].as_str().unwrap().to_string());
    let read: BTreeSet<String> = written["read_by_spool"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(taken, read);

    let cfg = load(&cfg_path);
    // While the queue is held (as by a run), failed items cannot be read: left out.
    let held = Queue::open(&cfg.data_dir).unwrap();
    let status = StatusReport::from_queue(&held, &cfg, &|d| d.token_budget).unwrap();
    let partial = dir.path().join("export/held.jsonl");
    export_batch(&cfg, &partial, Some(status.clone())).unwrap();
    drop(held);
    let codes: Vec<Value> = lines(&partial)
        .iter()
        .map(|l| l["error"]["code"].clone())
        .collect();
    assert!(!codes.contains(&json!("request_failed")));
    assert_eq!(
        codes
            .iter()
            .filter(|c| **c == json!("rejected_row"))
            .count(),
        4
    );

    let path = dir.path().join("export/batch.jsonl");
    let report = export_batch(&cfg, &path, Some(status)).unwrap();
    assert_eq!(report.accounting.kept(), 16 + 6);
    let got = lines(&path);
    assert_eq!(got.len(), 16 + 3 + 1 + 4, "a line per request");
    let m0 = got.iter().find(|l| l["custom_id"] == "m0").unwrap();
    let choices = m0["response"]["body"]["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "n = 2 is one line with two choices");
    assert_eq!(
        (&choices[0]["index"], &choices[1]["index"]),
        (&json!(0), &json!(1))
    );
    let failed = got.iter().find(|l| l["custom_id"] == "too-long").unwrap();
    assert_eq!(failed["response"], Value::Null);
    assert_eq!(failed["error"]["code"], "request_failed");
    let text = got.iter().find(|l| l["custom_id"] == "text-0").unwrap();
    assert_eq!(text["response"]["body"]["object"], "text_completion");

    let check = schema(&[
        "check",
        path.to_str().unwrap(),
        spool::output::export::summary_path(&path).to_str().unwrap(),
        input.to_str().unwrap(),
        multi_path.to_str().unwrap(),
    ]);
    assert_eq!(check["invalid"], json!([]), "{check}");
    assert_eq!(check["lines"], 24);
    assert_eq!(check["same_ids"], true, "{check}");
    assert_eq!(check["failed"], check["summary_failed"]);
    assert_eq!(check["failed"], 1);
    assert_eq!(check["rejected"], check["summary_rejected"]);
    assert_eq!(check["rejected"], 4);
    assert_eq!(check["responses"], check["summary_items_kept"]);
    assert_eq!(check["choices"], check["summary_kept"]);
    let n = |k: &str| check[k].as_u64().unwrap();
    assert_eq!(
        n("responses") + n("failed") + n("rejected"),
        n("summary_input_rows"),
        "every input row is answered once"
    );
}
