//! Bad input through the real binary: every kind of bad row is rejected with a message
//! naming the file, line and reason while the run goes on; bad files and configs exit 2
//! naming what is wrong, and write nothing; a second `spool run` on the same data dir
//! refuses without harming the first.

use crate::faults::{HandServer, Reply};
use crate::process::{assert_verify_clean, edit_config, mock_log, spool, status_json, Proc};
use crate::support::*;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

fn one_dataset(dir: &Path, url: &str) -> std::path::PathBuf {
    write_config(
        dir,
        url,
        "completions",
        false,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    )
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every file and folder under `dir` (relative paths), to show nothing was written.
fn tree(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            v.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    v.sort();
    v
}

/// One file with a good row between each kind of bad one: not JSON, none of the three
/// fields, two of them, wrong types (prompt, messages, id), an empty prompt, invalid
/// UTF-8, a single 100 MB line, a duplicate id. Each is rejected with its line and
/// reason (in the log and in `_rejected.jsonl`, whose lines stay small and valid JSON),
/// the good rows all complete (exit 0), `status` counts the rejections, and the 100 MB
/// line is never held whole (peak memory well under 100 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_row_is_rejected_with_line_and_reason_and_the_run_goes_on() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let bad: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "not valid JSON"),
        (br#"{"text": "x"}"#.to_vec(), "none of"),
        (
            br#"{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}"#.to_vec(),
            "several of",
        ),
        (br#"{"prompt": 5}"#.to_vec(), "`prompt` must be a string"),
        (
            br#"{"messages": "hi"}"#.to_vec(),
            "`messages` must be an array",
        ),
        (
            br#"{"id": [1], "prompt": "x"}"#.to_vec(),
            "`id` must be a string or an integer",
        ),
        (br#"{"prompt": ""}"#.to_vec(), "empty `prompt`"),
        (b"{\"prompt\": \"bad \xff utf8\"}".to_vec(), "invalid UTF-8"),
        (Vec::new(), "line longer than 16 MiB"), // the 100 MB line, written below
        (
            br#"{"id": "good0", "prompt": "again"}"#.to_vec(),
            "duplicate id `good0`",
        ),
    ];
    let path = dir.path().join("p.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut expect = Vec::new(); // (line, reason)
    let mut line = 0u64;
    for (i, (row, reason)) in bad.iter().enumerate() {
        writeln!(f, r#"{{"id": "good{i}", "prompt": "good prompt {i}"}}"#).unwrap();
        line += 1;
        if row.is_empty() {
            f.write_all(b"{\"prompt\": \"").unwrap();
            let chunk = vec![b'x'; 1 << 20];
            for _ in 0..100 {
                f.write_all(&chunk).unwrap();
            }
            f.write_all(b"\"}\n").unwrap();
        } else {
            f.write_all(row).unwrap();
            f.write_all(b"\n").unwrap();
        }
        line += 1;
        expect.push((line, *reason));
    }
    writeln!(f, r#"{{"id": "last", "prompt": "after all that"}}"#).unwrap();
    drop(f);
    let cfg = one_dataset(dir.path(), &mock.url);
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    let (status, peak) = p.wait(Duration::from_secs(120)).await;
    let log = p.stderr();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(peak < 100 << 20, "peak memory {} MB", peak >> 20);
    for (line, reason) in &expect {
        assert!(
            log.lines().any(|l| l.contains("row rejected")
                && l.contains("p.jsonl")
                && l.contains(&format!("line={line} "))
                && l.contains(reason)),
            "no log line for line {line} ({reason}):\n{log}"
        );
    }
    let rej_path = dir.path().join("out/a/_rejected.jsonl");
    assert!(std::fs::metadata(&rej_path).unwrap().len() < 64 << 10);
    let rej: Vec<Value> = std::fs::read_to_string(&rej_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rej.len(), expect.len());
    for (r, (line, reason)) in rej.iter().zip(&expect) {
        assert_eq!(r["line"].as_u64(), Some(*line));
        assert!(r["file"].as_str().unwrap().ends_with("p.jsonl"));
        assert!(r["reason"].as_str().unwrap().contains(reason), "{r}");
    }
    let mut good: Vec<String> = (0..bad.len()).map(|i| format!("good{i}")).collect();
    good.push("last".into());
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "a"), &good);
    let j = status_json(&cfg);
    assert_eq!(
        j["datasets"][0]["rejected"].as_u64(),
        Some(expect.len() as u64)
    );
    assert_verify_clean(&cfg);
}

/// A prompt over the server's context limit, where the server did not advertise it (so
/// intake cannot know): the server's 400 fails the item at its first attempt with the
/// server's own message, `status` shows it with the line, `run` exits 3, and `retry`
/// puts it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_context_fails_with_the_servers_message() {
    let msg = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens (8800 in the messages, 200 in the completion). Please reduce the length of the messages or completion.";
    let server = HandServer::start(Reply::Status(
        400,
        serde_json::json!({"object": "error", "message": msg, "type": "BadRequestError", "code": 400})
            .to_string(),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"very long\"}\n").unwrap();
    let cfg = one_dataset(dir.path(), &server.url);
    let o = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("1 item(s) failed permanently"));
    assert_eq!(
        server.posts.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "not retried"
    );
    let st = String::from_utf8_lossy(&spool(&cfg, &["status"], &[]).stdout).into_owned();
    assert!(
        st.contains("line 1") && st.contains(&format!("HTTP 400: {msg}")),
        "{st}"
    );
    let r = spool(&cfg, &["retry"], &[]);
    assert!(r.status.success());
    assert_eq!(status_json(&cfg)["datasets"][0]["pending"], 1);
}

/// The same with the bundled mock, which does advertise its context: the over-long
/// prompt is either rejected at intake with a reason naming the context, or failed with
/// the server's message — never sent twice, and the other rows complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_mocks_context_is_refused_clearly() {
    let mock = Mock::start(spool::mock::MockConfig {
        context_len: 64,
        ..fast_mock()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let long = "word ".repeat(500);
    std::fs::write(
        dir.path().join("p.jsonl"),
        format!("{{\"id\": \"ok\", \"prompt\": \"short\"}}\n{{\"id\": \"long\", \"prompt\": \"{long}\"}}\n"),
    )
    .unwrap();
    let cfg = one_dataset(dir.path(), &mock.url);
    let o = spool(&cfg, &["run", "-q"], &[]);
    let j = status_json(&cfg);
    let d = &j["datasets"][0];
    assert_eq!(d["done"], 1);
    let failures = d["failures"].to_string();
    let rejected =
        std::fs::read_to_string(dir.path().join("out/a/_rejected.jsonl")).unwrap_or_default();
    match o.status.code() {
        Some(3) => assert!(
            failures.contains("context length") && failures.contains("[2,"),
            "{failures}"
        ),
        Some(0) => assert!(
            rejected.contains("\"line\":2") && rejected.to_lowercase().contains("context"),
            "{rejected}"
        ),
        c => panic!("exit {c:?}: {}", stderr(&o)),
    }
    assert!(mock.stats().count(spool::mock::Outcome::BadRequest) <= 1);
}

/// A row that changed between runs: exit 2 naming the file and line; nothing sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_file_changed_between_runs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mock.log");
    let mock = Mock::start(spool::mock::MockConfig {
        log: Some(log.clone()),
        ..fast_mock()
    })
    .await;
    let file = dir.path().join("p.jsonl");
    write_prompts(&file, "p", 5);
    let cfg = one_dataset(dir.path(), &mock.url);
    assert!(spool(&cfg, &["run", "-q"], &[]).status.success());
    let requests = mock_log(&log).len();
    let text = std::fs::read_to_string(&file)
        .unwrap()
        .replace("item 2 of", "item TWO of");
    std::fs::write(&file, text).unwrap();
    let o = spool(&cfg, &["run", "-q"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("p.jsonl") && e.contains("line 3") && e.contains("changed"),
        "{e}"
    );
    assert_eq!(mock_log(&log).len(), requests, "an item was requested");
}

/// Unknown keys anywhere in the config: exit 2 naming the key and the file; nothing is
/// created.
#[test]
fn unknown_config_keys_exit_2_naming_key_and_file() {
    for (from, to, key) in [
        (
            "max_attempts = 4",
            "max_attempts = 4\nmax_atempts = 3",
            "max_atempts",
        ),
        (
            "data_dir = \"data\"",
            "data_dir = \"data\"\nouput_dir = \"x\"",
            "ouput_dir",
        ),
        ("[run]", "[run]\nconcurency = 3", "concurency"),
        (
            "name = \"a\"",
            "name = \"a\"\ntoken_budjet = 5",
            "token_budjet",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
        let cfg = one_dataset(dir.path(), "http://127.0.0.1:9");
        edit_config(&cfg, from, to);
        let before = tree(dir.path());
        let o = spool(&cfg, &["run"], &[]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(key) && e.contains("spool.toml"), "{e}");
        assert_eq!(tree(dir.path()), before, "something was written");
    }
}

/// The drafter-data keys through the binary: a misspelt key, an unknown value, a sample
/// count out of range and a weighted table with a zero weight each exit 2 naming the key
/// and the file, and nothing is written.
#[test]
fn bad_generation_keys_exit_2_naming_the_key() {
    for (to, key) in [
        ("name = \"a\"\nturn = \"all\"", "turn"),
        ("name = \"a\"\nturns = \"every\"", "every"),
        ("name = \"a\"\nsamples = 0", "dataset[0].samples"),
        (
            "name = \"a\"\nchat_template_kwargs = { reasoning_effort = { low = 0 } }",
            "chat_template_kwargs.reasoning_effort",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
        let cfg = one_dataset(dir.path(), "http://127.0.0.1:9");
        edit_config(&cfg, "name = \"a\"", to);
        let before = tree(dir.path());
        let o = spool(&cfg, &["run"], &[]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(key) && e.contains("spool.toml"), "{e}");
        assert_eq!(tree(dir.path()), before, "something was written");
    }
}

/// Dataset names that would leave `output_dir` (`/`, `..`, `.`): exit 2 naming the key,
/// and nothing written anywhere.
#[test]
fn dataset_names_that_leave_the_output_dir_exit_2_and_write_nothing() {
    for name in ["../evil", "a/b", "..", ".", "/abs", "a\\\\b"] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
        let cfg = one_dataset(dir.path(), "http://127.0.0.1:9");
        edit_config(&cfg, "name = \"a\"", &format!("name = \"{name}\""));
        let before = tree(dir.path());
        let o = spool(&cfg, &["run"], &[]);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
        assert!(stderr(&o).contains("dataset[0].name"), "{}", stderr(&o));
        assert_eq!(tree(dir.path()), before, "{name}: something was written");
    }
}

/// A missing tokenizer, chat template or dataset file: exit 2 naming the file.
#[test]
fn missing_files_exit_2_naming_the_file() {
    for (extra, named) in [
        (
            "[tokenizer]\npath = \"nope/tokenizer.json\"\n",
            "nope/tokenizer.json",
        ),
        (
            "[tokenizer]\npath = \"tok.json\"\nchat_template = \"nope/template.jinja\"\n",
            "nope/template.jinja",
        ),
        ("", "missing.jsonl"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
        std::fs::copy(
            fixtures().join("tokenizers/qwen3/tokenizer.json"),
            dir.path().join("tok.json"),
        )
        .unwrap();
        let cfg = write_config(
            dir.path(),
            "http://127.0.0.1:9",
            "completions",
            false,
            &[Ds {
                name: "a",
                file: if named == "missing.jsonl" {
                    "missing.jsonl"
                } else {
                    "p.jsonl"
                },
                budget: None,
            }],
            extra,
        );
        let o = spool(&cfg, &["run"], &[]);
        assert_eq!(o.status.code(), Some(2), "{named}: {}", stderr(&o));
        assert!(stderr(&o).contains(named), "{}", stderr(&o));
    }
}

/// Two `spool run` on one data dir: the second refuses at once (exit 2, naming the lock)
/// and writes nothing; the first finishes unharmed (exit 0, verify clean, every prompt
/// exactly once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_on_the_same_data_dir_refuses_and_the_first_is_unharmed() {
    let mock = Mock::start(spool::mock::MockConfig {
        capacity_tps: 3.0,
        per_request_tps: 2.0,
        ..spool::mock::MockConfig::for_tests()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("p.jsonl"), "p", 150);
    let cfg = one_dataset(dir.path(), &mock.url);
    let mut first = Proc::spawn(&cfg, &["run", "-q"], &[]);
    tokio::time::timeout(
        Duration::from_secs(30),
        mock.state
            .wait_until(|s| s.count(spool::mock::Outcome::Ok) >= 10),
    )
    .await
    .expect("first run under way");
    let second = spool(&cfg, &["run"], &[]);
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert!(
        stderr(&second).contains("used by another spool process"),
        "{}",
        stderr(&second)
    );
    let (status, _) = first.wait(Duration::from_secs(120)).await;
    assert_eq!(status.code(), Some(0), "{}", first.stderr());
    assert_verify_clean(&cfg);
    let ids: Vec<String> = (0..150).map(|i| format!("p{i}")).collect();
    assert_exactly_once(&shard_rows(&dir.path().join("out"), "a"), &ids);
}

/// Many rejections of one kind: the first 10 are logged one per line, the rest as count
/// lines naming `_rejected.jsonl` (summing to the rest), and every one is in that file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_ten_rejections_of_a_kind_the_log_counts_and_the_file_holds_all() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut f = std::fs::File::create(dir.path().join("p.jsonl")).unwrap();
    writeln!(f, r#"{{"id": "x", "prompt": "first"}}"#).unwrap();
    for i in 0..25 {
        writeln!(f, r#"{{"id": "x", "prompt": "again {i}"}}"#).unwrap();
    }
    drop(f);
    let cfg = one_dataset(dir.path(), &mock.url);
    let mut p = Proc::spawn(&cfg, &["run"], &[]);
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    let log = p.stderr();
    assert_eq!(status.code(), Some(0), "{log}");
    let per_row = log
        .lines()
        .filter(|l| l.contains("row rejected") && l.contains("duplicate id"))
        .count();
    assert_eq!(per_row, 10, "{log}");
    let counted: u64 = log
        .lines()
        .filter(|l| l.contains("more rows rejected") && l.contains("_rejected.jsonl"))
        .map(|l| {
            let n = l.split("rejected=").nth(1).unwrap();
            n.split(' ').next().unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(counted, 15, "{log}");
    let rej = std::fs::read_to_string(dir.path().join("out/a/_rejected.jsonl")).unwrap();
    assert_eq!(rej.lines().count(), 25);
}
