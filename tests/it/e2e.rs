//! End to end in-process: config → intake → mock server → queue → Parquet shards.

use crate::support::*;
use spool::prompt::remote::IdsSource;
use spool::store::row::ShardRow;

fn qwen_tokenizer_table() -> String {
    let dir = fixtures().join("tokenizers/qwen3");
    format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        dir.join("tokenizer.json").display(),
        dir.join("tokenizer_config.json").display()
    )
}

fn check_row(r: &ShardRow, api: &str, stream: bool, tok: &spool::prompt::Tokenizer) {
    let ctx = format!("{api} stream={stream} id={}", r.id);
    assert!(!r.prompt.is_empty(), "{ctx}");
    assert!(!r.completion.is_empty(), "{ctx}");
    let ids = r.completion_token_ids.as_ref().expect("completion ids");
    assert_eq!(r.completion_tokens as usize, ids.len(), "{ctx}");
    if api != "chat" {
        // The mock's text is the concatenation of its ids' texts.
        assert_eq!(r.completion, mock_text(ids), "{ctx}");
    }
    assert!(
        r.completion_tokens >= 1 && r.completion_tokens <= 200,
        "{ctx}"
    );
    assert!(
        matches!(r.finish_reason.as_str(), "stop" | "length"),
        "{ctx}: {}",
        r.finish_reason
    );
    assert_eq!(
        r.finish_reason == "length",
        r.completion_tokens == 200,
        "{ctx}"
    );
    assert_eq!(r.model, "mock-model");
    assert_eq!(r.attempts, 1, "{ctx}");
    assert_eq!(r.ttft_ms.is_some(), stream, "{ctx}");
    assert!(r.completed_at_ms > 1_700_000_000_000, "{ctx}");
    let pids = r
        .prompt_token_ids
        .as_ref()
        .expect("prompt ids with a tokenizer");
    if api != "chat" {
        assert_eq!(
            pids,
            &tok.encode(&r.prompt, false).unwrap(),
            "{ctx}: prompt ids"
        );
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Client), "{ctx}");
    } else {
        // The chat answer's prompt ids (the server rendered the messages itself) are the
        // ones kept.
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server), "{ctx}");
    }
    assert_eq!(
        r.prompt_tokens as usize,
        pids.len(),
        "{ctx}: server counted the ids kept"
    );
    if r.id.starts_with('c') {
        let m: serde_json::Value =
            serde_json::from_str(r.messages.as_ref().expect("messages")).unwrap();
        assert_eq!(
            m.as_array().unwrap().last().unwrap()["role"],
            "user",
            "{ctx}"
        );
        assert!(
            r.prompt.starts_with("<|im_start|>"),
            "{ctx}: rendered with the chat template"
        );
        assert!(
            r.prompt.ends_with("<|im_start|>assistant\n"),
            "{ctx}: generation prompt"
        );
    } else {
        // A `prompt` row goes in as one user turn (the default `prompt_format = "chat"`).
        let m: serde_json::Value =
            serde_json::from_str(r.messages.as_ref().expect("messages")).unwrap();
        assert_eq!(m.as_array().unwrap().len(), 1, "{ctx}");
        assert_eq!(m[0]["role"], "user", "{ctx}");
        assert!(
            m[0]["content"].as_str().unwrap().starts_with("Write item"),
            "{ctx}"
        );
        assert!(
            r.prompt.starts_with("<|im_start|>user\nWrite item"),
            "{ctx}: rendered with the chat template"
        );
    }
}

/// Every API, streaming and not, fills every column of the shards correctly: ids, rows,
/// rendered prompts and their ids, completions consistent with their ids, counts, finish
/// reasons, TTFT only when streaming, and the file metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_streaming_and_not_fills_every_column() {
    let tok =
        spool::prompt::Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json"))
            .unwrap();
    for api in ["sglang", "completions", "chat"] {
        for stream in [true, false] {
            let mock = Mock::start(fast_mock()).await;
            let dir = tempfile::tempdir().unwrap();
            write_prompts(&dir.path().join("p.jsonl"), "p", 30);
            write_chats(&dir.path().join("c.jsonl"), "c", 20);
            let cfg = write_config(
                dir.path(),
                &mock.url,
                api,
                stream,
                &[
                    Ds {
                        name: "plain",
                        file: "p.jsonl",
                        budget: None,
                    },
                    Ds {
                        name: "chat",
                        file: "c.jsonl",
                        budget: None,
                    },
                ],
                &qwen_tokenizer_table(),
            );
            let summary = run_to_end(&cfg).await;
            assert!(!summary.interrupted);
            assert_eq!(summary.report.failed(), 0);
            let out = dir.path().join("out");
            let plain = shard_rows(&out, "plain");
            let chat = shard_rows(&out, "chat");
            assert_exactly_once(
                &plain,
                &(0..30).map(|i| format!("p{i}")).collect::<Vec<_>>(),
            );
            assert_exactly_once(&chat, &(0..20).map(|i| format!("c{i}")).collect::<Vec<_>>());
            for r in plain.iter().chain(&chat) {
                check_row(r, api, stream, &tok);
                let expect_row: u64 = r.id[1..].parse().unwrap();
                assert_eq!(r.row, expect_row);
            }
            assert!(plain.iter().all(|r| r.dataset == "plain"));
            // 30 rows at max_rows = 25: two shards.
            assert_eq!(shard_files(&out, "plain").len(), 2);
            let meta =
                spool::output::reader::read_metadata(&shard_files(&out, "plain")[0]).unwrap();
            let keys: Vec<&str> = meta.iter().map(|(k, _)| k.as_str()).collect();
            for k in [
                "spool.version",
                "spool.config_sha256",
                "spool.sampling",
                "spool.tokenizer_sha256",
                "spool.count_source",
            ] {
                assert!(
                    keys.contains(&k),
                    "{api}/{stream}: metadata {k} missing in {keys:?}"
                );
            }
            assert_eq!(
                mock.stats().requests,
                50,
                "{api}/{stream}: one request per prompt"
            );
            mock.stop().await;
        }
    }
}

/// A second run over the same files sends nothing and writes nothing; rows appended to a
/// file since are added, and only they are requested.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_and_appended_rows_are_added() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.jsonl");
    write_prompts(&file, "p", 40);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    run_to_end(&cfg).await;
    let out = dir.path().join("out");
    let shards_before = shard_files(&out, "a");
    assert_eq!(mock.stats().requests, 40);

    let again = run_to_end(&cfg).await;
    assert_eq!(mock.stats().requests, 40, "nothing requested again");
    assert_eq!(shard_files(&out, "a"), shards_before, "no new shard");
    assert_eq!(again.report.datasets[0].items, 40);

    write_prompts(&dir.path().join("more.jsonl"), "q", 10);
    let mut all = std::fs::read_to_string(&file).unwrap();
    all.push_str(&std::fs::read_to_string(dir.path().join("more.jsonl")).unwrap());
    std::fs::write(&file, all).unwrap();
    let third = run_to_end(&cfg).await;
    assert_eq!(mock.stats().requests, 50, "only the appended rows");
    assert_eq!(third.report.datasets[0].done, 50);
    let ids: Vec<String> = (0..40)
        .map(|i| format!("p{i}"))
        .chain((0..10).map(|i| format!("q{i}")))
        .collect();
    assert_exactly_once(&shard_rows(&out, "a"), &ids);
}

/// A row that changed since it was enqueued makes `run` refuse with the file and line,
/// before any request is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_row_is_refused() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.jsonl");
    write_prompts(&file, "p", 5);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        true,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    run_to_end(&cfg).await;
    let text = std::fs::read_to_string(&file)
        .unwrap()
        .replace("item 3 of", "item THREE of");
    std::fs::write(&file, text).unwrap();
    let err = spool::run::job::run(
        load(&cfg).into(),
        spool::knobs::Knobs::default(),
        std::future::pending(),
    )
    .await
    .unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("p.jsonl") && msg.contains("line 4") && msg.contains("changed"),
        "{msg}"
    );
    assert_eq!(spool::error::exit_code(&err), 2);
    assert_eq!(mock.stats().requests, 5);
}

/// Bad rows are written to `_rejected.jsonl` with file, line and reason, counted, and the
/// rest of the dataset runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_rejected_and_the_run_goes_on() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("p.jsonl"),
        "{\"prompt\": \"good one\"}\n{not json\n{\"text\": \"x\"}\n{\"prompt\": \"dup\", \"id\": 1}\n{\"prompt\": \"dup2\", \"id\": 1}\n{\"prompt\": \"\"}\n",
    )
    .unwrap();
    let cfg = one_dataset(dir.path(), &mock.url);
    let s = run_to_end(&cfg).await;
    let d = &s.report.datasets[0];
    assert_eq!((d.done, d.rejected), (2, 4));
    let rej = std::fs::read_to_string(dir.path().join("out/a/_rejected.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = rej
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let got: Vec<u64> = lines.iter().map(|l| l["line"].as_u64().unwrap()).collect();
    assert_eq!(got, vec![2, 3, 5, 6]);
    assert!(lines[2]["reason"]
        .as_str()
        .unwrap()
        .contains("duplicate id"));
    assert!(lines[0]["file"].as_str().unwrap().ends_with("p.jsonl"));
    // A second run does not reject them again.
    run_to_end(&cfg).await;
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out/a/_rejected.jsonl")).unwrap(),
        rej
    );
}

/// A small budget stops dispatching early: the overshoot past the budget is bounded by
/// what the requests in flight could add, and reported; the rest stays pending. A second
/// run skips the dataset whose budget is met and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_stop_dispatch_and_met_budgets_are_skipped() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("a.jsonl"), "a", 300);
    write_prompts(&dir.path().join("b.jsonl"), "b", 20);
    let budget = 2000u64;
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "a",
                file: "a.jsonl",
                budget: Some(budget),
            },
            Ds {
                name: "b",
                file: "b.jsonl",
                budget: None,
            },
        ],
        "",
    );
    let s = run_to_end(&cfg).await;
    let a = &s.report.datasets[0];
    let b = &s.report.datasets[1];
    assert!(
        a.completion_tokens >= budget,
        "budget reached: {}",
        a.completion_tokens
    );
    // Bounded: at most one full slot set of max_tokens (16 × 200) past the budget, and in
    // practice far less because dispatch counts the expected tokens of work in flight.
    assert!(
        a.overshoot_tokens < 16 * 200,
        "overshoot {}",
        a.overshoot_tokens
    );
    assert_eq!(a.overshoot_tokens, a.completion_tokens - budget);
    assert!(
        a.pending > 200,
        "most prompts never sent: pending {}",
        a.pending
    );
    assert_eq!(b.done, 20, "the next dataset ran");
    let sent = mock.stats().requests;
    assert_eq!(sent, a.done + 20);

    let again = run_to_end(&cfg).await;
    assert_eq!(mock.stats().requests, sent, "a met budget is skipped");
    assert_eq!(again.report.datasets[0].state, "budget_met");
    let rows = shard_rows(&dir.path().join("out"), "a");
    assert_eq!(
        rows.iter().map(|r| r.completion_tokens as u64).sum::<u64>(),
        a.completion_tokens
    );
}
