//! Drafter data as the model saw and wrote it: why each generation ended (`stop_reason`)
//! and the end-of-turn id exports append only to turns the model ended; cut turns ending
//! their conversation; `prompt` rows rendered as a user turn; the start-up warnings.
//! Real runs against the mock, which answers with Qwen3's real token ids and reports its
//! stops as SGLang and vLLM do.

use crate::support::*;
use serde_json::Value;
use spool::mock::MockConfig;
use spool::output::export::{ExportOptions, Format};
use spool::store::row::ShardRow;
use spool::store::stop_reason::StopReason;
use std::path::{Path, PathBuf};

/// Qwen3's `<|im_end|>`.
const IM_END: u32 = 151645;
/// The stop string: one of the mock's real words, met by about one completion in five.
const STOP: &str = " that";

fn qwen_dir() -> PathBuf {
    fixtures().join("tokenizers/qwen3")
}

fn qwen() -> spool::prompt::tokenizer::Tokenizer {
    spool::prompt::tokenizer::Tokenizer::from_file(&qwen_dir().join("tokenizer.json")).unwrap()
}

/// A mock answering in Qwen3's real tokens.
async fn qwen_mock() -> Mock {
    Mock::start(MockConfig {
        tokenizer: Some(qwen_dir().join("tokenizer.json")),
        ..fast_mock()
    })
    .await
}

/// A config of two chat datasets against `url` in `api`: `stops` sends the stop string,
/// `plain` none; `table` is the `[tokenizer]` table.
fn stop_config(dir: &Path, url: &str, api: &str, stream: bool, table: &str) -> PathBuf {
    write_chats(&dir.join("chat.jsonl"), "c", 40);
    let ds = |name, file| Ds {
        name,
        file,
        budget: None,
    };
    let cfg = write_config(
        dir,
        url,
        api,
        stream,
        &[ds("stops", "chat.jsonl"), ds("plain", "chat.jsonl")],
        table,
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    let stops = "name = \"stops\"\npath = \"chat.jsonl\"\n";
    let text = text.replace(
        stops,
        &format!("{stops}[dataset.sampling]\nstop = [\"{STOP}\"]\n"),
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// The `tokens-jsonl` lines of an export of `cfg`, by (dataset, id).
fn token_lines(
    cfg: &spool::config::Config,
    out: &Path,
    end_of_turn: Option<&str>,
) -> anyhow::Result<Vec<Value>> {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            end_of_turn: end_of_turn.map(Into::into),
            ..ExportOptions::new(Format::TokensJsonl, out)
        },
    )?;
    Ok(std::fs::read_to_string(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect())
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A stop string ends a generation without an end of turn, the model's own stop with one:
/// through SGLang's `/generate` (the match named: the string, or `<|im_end|>`'s id) and
/// vLLM's completions API streamed and whole (`stop_reason` the string, or null for the
/// EOS), the shard's `stop_reason` says which; the stopped-on-a-string completion's text
/// ends before the string while its ids keep the token that made it; and the `tokens`
/// export appends `<|im_end|>` exactly once to every EOS stop and never to a stop-string
/// stop or a cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_gets_no_end_of_turn_and_an_eos_stop_gets_one() {
    let tok = qwen();
    let stop_id = tok.encode(STOP, false).unwrap();
    assert_eq!(stop_id.len(), 1, "the stop string is one token");
    for (api, stream) in [
        ("sglang", true),
        ("completions", true),
        ("completions", false),
    ] {
        let ctx = format!("{api} stream={stream}");
        let mock = qwen_mock().await;
        let dir = tempfile::tempdir().unwrap();
        let cfg_path = stop_config(dir.path(), &mock.url, api, stream, &qwen_table());
        run_to_end(&cfg_path).await;
        mock.stop().await;
        let out = dir.path().join("out");
        let (mut by_string, mut by_eos) = (0, 0);
        let mut rows: Vec<ShardRow> = shard_rows(&out, "stops");
        for r in &rows {
            match &r.stop_reason {
                Some(StopReason::StopString(s)) => {
                    by_string += 1;
                    assert_eq!(s, STOP, "{ctx}");
                    assert_eq!(r.finish_reason, "stop", "{ctx}");
                    let ids = r.completion_token_ids.as_ref().unwrap();
                    assert_eq!(ids.last(), Some(&stop_id[0]), "{ctx} {}: ids keep it", r.id);
                    let text = tok.decode(ids).unwrap();
                    assert_eq!(format!("{}{STOP}", r.completion), text, "{ctx} {}", r.id);
                }
                Some(StopReason::Eos(id)) => {
                    by_eos += 1;
                    let want = if api == "sglang" { Some(IM_END) } else { None };
                    assert_eq!(*id, want, "{ctx} {}", r.id);
                    assert!(!r.completion.contains(STOP), "{ctx} {}", r.id);
                }
                other => panic!("{ctx} {}: {other:?}", r.id),
            }
        }
        assert!(
            by_string >= 3 && by_eos >= 3,
            "{ctx}: {by_string} by the string, {by_eos} by EOS"
        );
        let plain = shard_rows(&out, "plain");
        assert!(
            plain
                .iter()
                .all(|r| matches!(r.stop_reason, Some(StopReason::Eos(_)))),
            "{ctx}: without stop strings every stop is the model's"
        );
        rows.extend(plain);

        let cfg = load(&cfg_path);
        let lines = token_lines(&cfg, &dir.path().join("t.jsonl"), None).unwrap();
        assert_eq!(lines.len(), rows.len(), "{ctx}");
        for l in &lines {
            let r = rows
                .iter()
                .find(|r| r.dataset == l["dataset"] && r.id == l["id"])
                .unwrap();
            let ids = u32s(&l["input_ids"]);
            let p = r.prompt_token_ids.as_ref().unwrap().len();
            let sent = r.completion_token_ids.as_ref().unwrap();
            match r.stop_reason {
                Some(StopReason::Eos(_)) => {
                    assert_eq!(ids[p..].last(), Some(&IM_END), "{ctx} {}", r.id);
                    assert_eq!(ids[p..].len(), sent.len() + 1, "{ctx} {}", r.id);
                    let ends = ids[p..].iter().filter(|&&t| t == IM_END).count();
                    assert_eq!(ends, 1, "{ctx} {}", r.id);
                }
                _ => assert_eq!(&ids[p..], &sent[..], "{ctx} {}: nothing appended", r.id),
            }
        }
    }
}

/// A model folder whose end of turn spool cannot tell: Qwen3's tokenizer under a ChatML
/// template of no family spool knows, with a `generation_config.json` listing two stop ids
/// neither of which is the tokenizer config's `eos_token`.
fn unknown_family_table(dir: &Path) -> String {
    let folder = dir.join("model");
    std::fs::create_dir(&folder).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(qwen_dir().join(f), folder.join(f)).unwrap();
    }
    std::fs::write(
        folder.join("generation_config.json"),
        r#"{"eos_token_id": [151643, 151644]}"#,
    )
    .unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    std::fs::write(folder.join("chat.jinja"), template).unwrap();
    format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        folder.join("tokenizer.json").display(),
        folder.join("chat.jinja").display()
    )
}

/// When the server does not name the stop token (vLLM's `stop_reason: null`) and spool
/// cannot tell the model's end-of-turn id, an id export is refused, saying why and naming
/// `--end-of-turn`, rather than guessing one — in the library and through the CLI, which
/// writes nothing; `--end-of-turn <|im_end|>` (or its id) makes it, each EOS stop then
/// ending with that id once. A server that names the token (SGLang's `matched`) needs no
/// flag; a form without ids (`sharegpt`) is never refused for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_end_of_turn_is_refused_unless_named() {
    for api in ["completions", "sglang"] {
        let mock = qwen_mock().await;
        let dir = tempfile::tempdir().unwrap();
        let table = unknown_family_table(dir.path());
        write_chats(&dir.path().join("chat.jsonl"), "c", 12);
        let ds = Ds {
            name: "plain",
            file: "chat.jsonl",
            budget: None,
        };
        let cfg_path = write_config(dir.path(), &mock.url, api, true, &[ds], &table);
        run_to_end(&cfg_path).await;
        mock.stop().await;
        let cfg = load(&cfg_path);
        let rows = shard_rows(&dir.path().join("out"), "plain");
        let eos = rows
            .iter()
            .filter(|r| matches!(r.stop_reason, Some(StopReason::Eos(_))))
            .count();
        assert!(eos >= 6, "{api}: {eos} EOS stops");
        let out = dir.path().join("t.jsonl");
        if api == "sglang" {
            let lines = token_lines(&cfg, &out, None).unwrap();
            assert_eq!(lines.len(), rows.len());
            continue;
        }
        let err = token_lines(&cfg, &out, None).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("--end-of-turn") && msg.contains("several eos_token_id"),
            "{msg}"
        );
        assert!(!out.exists());
        let share = dir.path().join("s.jsonl");
        spool::output::export::export(&cfg, &ExportOptions::new(Format::Sharegpt, &share)).unwrap();
        for named in ["<|im_end|>", "151645"] {
            let lines = token_lines(&cfg, &out, Some(named)).unwrap();
            assert_eq!(lines.len(), rows.len());
            for (l, r) in lines.iter().zip(&rows) {
                let ids = u32s(&l["input_ids"]);
                let p = r.prompt_token_ids.as_ref().unwrap().len();
                if r.stop_reason == Some(StopReason::Eos(None)) {
                    assert_eq!(ids.last(), Some(&IM_END), "{named} {}", r.id);
                    assert_eq!(
                        ids[p..].len(),
                        r.completion_token_ids.as_ref().unwrap().len() + 1
                    );
                }
            }
        }
        // The CLI: refused (nothing written, the flag named), then made with the flag.
        let cli = |extra: &[&str]| {
            std::process::Command::new(spool_bin())
                .args(["export", "-c"])
                .arg(&cfg_path)
                .args(["--format", "specforge", "--out"])
                .arg(dir.path().join("sf.jsonl"))
                .args(extra)
                .output()
                .unwrap()
        };
        let o = cli(&[]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && stderr.contains("--end-of-turn"),
            "{stderr}"
        );
        assert!(!dir.path().join("sf.jsonl").exists());
        let o = cli(&["--end-of-turn", "<|im_end|>"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let first: Value = serde_json::from_str(
            std::fs::read_to_string(dir.path().join("sf.jsonl"))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        assert!(first["input_ids"].is_array());
    }
}

/// `n` conversations of three user turns, each followed by a source reply.
fn write_conversations(path: &Path, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        let mut m = Vec::new();
        for k in 0..3 {
            m.push(
                serde_json::json!({"role": "user", "content": format!("Question {k} of c{i}?")}),
            );
            m.push(serde_json::json!({"role": "assistant", "content": "source reply"}));
        }
        s.push_str(&serde_json::json!({"id": format!("c{i}"), "messages": m}).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

/// A turn cut by `max_tokens` ends its conversation by default: it is its sample's last
/// row, every row of that conversation is `partial = "length"`, and the mock was never
/// asked for a later turn of it — while conversations whose turns all stopped are whole
/// and complete. With `on_length = "continue"` the later turns are generated after the cut
/// reply, as before, and nothing is partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_turn_ends_its_conversation_unless_asked_to_continue() {
    for on_length in ["", "on_length = \"stop\"\n", "on_length = \"continue\"\n"] {
        let ctx = if on_length.is_empty() {
            "default"
        } else {
            on_length.trim()
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("mock.log");
        let mock = Mock::start(MockConfig {
            log: Some(log.clone()),
            ..fast_mock()
        })
        .await;
        write_conversations(&dir.path().join("c.jsonl"), 24);
        let ds = Ds {
            name: "conv",
            file: "c.jsonl",
            budget: None,
        };
        let cfg = write_config(dir.path(), &mock.url, "chat", true, &[ds], "");
        let text = std::fs::read_to_string(&cfg).unwrap().replace(
            "path = \"c.jsonl\"\n",
            &format!("path = \"c.jsonl\"\nturns = \"all\"\n{on_length}[dataset.sampling]\nmax_tokens = 50\n"),
        );
        std::fs::write(&cfg, text).unwrap();
        run_to_end(&cfg).await;
        mock.stop().await;
        let rows = shard_rows(&dir.path().join("out"), "conv");
        let requested: std::collections::HashSet<(u64, u32)> = crate::process::mock_log(&log)
            .iter()
            .filter_map(|l| l.generation.map(|(_, t)| (l.row, t)))
            .collect();
        let (mut ended_early, mut went_on) = (0, 0);
        for i in 0..24u64 {
            let conv: Vec<&ShardRow> = rows.iter().filter(|r| r.row == i).collect();
            assert!(!conv.is_empty(), "{ctx}: c{i}");
            let cut = conv.iter().position(|r| r.finish_reason == "length");
            match (cut, on_length.contains("continue")) {
                (Some(k), false) if k + 1 < 3 => {
                    ended_early += 1;
                    assert_eq!(
                        conv.len(),
                        k + 1,
                        "{ctx}: c{i} has no turn after its cut one"
                    );
                    assert!(
                        conv.iter().all(|r| r.partial.as_deref() == Some("length")),
                        "{ctx}: c{i}"
                    );
                    assert!(
                        !requested.contains(&(i, k as u32 + 1)),
                        "{ctx}: c{i} turn {} was asked",
                        k + 1
                    );
                }
                (Some(k), true) if k + 1 < 3 => {
                    went_on += 1;
                    assert_eq!(conv.len(), 3, "{ctx}: c{i}");
                    assert!(conv.iter().all(|r| r.partial.is_none()), "{ctx}: c{i}");
                }
                _ => {
                    assert_eq!(conv.len(), 3, "{ctx}: c{i}");
                    assert!(conv.iter().all(|r| r.partial.is_none()), "{ctx}: c{i}");
                }
            }
        }
        if on_length.contains("continue") {
            assert!(
                went_on >= 3,
                "{ctx}: {went_on} conversations went on after a cut"
            );
        } else {
            assert!(
                ended_early >= 3,
                "{ctx}: {ended_early} conversations ended at a cut"
            );
        }
    }
}

/// With a chat template, a `prompt` row reaches the server as the template renders one user
/// turn (the mock's logged body holds those ids: decoded, Qwen3's
/// `<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n`), and its row records that
/// turn as its messages; `prompt_format = "raw"` sends the text as is. `"chat"` without a
/// template to render it, and `"raw"` through the chat API, are refused naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_row_reaches_the_server_rendered_unless_raw() {
    let tok = qwen();
    for api in ["sglang", "completions"] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("mock.log");
        let mock = Mock::start(MockConfig {
            log: Some(log.clone()),
            log_bodies: true,
            ..fast_mock()
        })
        .await;
        write_prompts(&dir.path().join("p.jsonl"), "p", 6);
        let ds = |name| Ds {
            name,
            file: "p.jsonl",
            budget: None,
        };
        let cfg = write_config(
            dir.path(),
            &mock.url,
            api,
            false,
            &[ds("chat"), ds("raw")],
            &qwen_table(),
        );
        let text = std::fs::read_to_string(&cfg).unwrap().replace(
            "name = \"raw\"\npath = \"p.jsonl\"\n",
            "name = \"raw\"\npath = \"p.jsonl\"\nprompt_format = \"raw\"\n",
        );
        std::fs::write(&cfg, text).unwrap();
        run_to_end(&cfg).await;
        mock.stop().await;
        let bodies = crate::process::mock_log(&log);
        assert_eq!(bodies.len(), 12, "{api}");
        for l in &bodies {
            let body = l.request.as_ref().unwrap();
            let ids = match api {
                "sglang" => &body["input_ids"],
                _ => &body["prompt"],
            };
            let sent = tok.decode(&u32s(ids)).unwrap();
            let prompt = format!("Write item {} of p: tell me about number {}.", l.row, l.row);
            let want = match l.ds.as_str() {
                "chat" => format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"),
                _ => prompt,
            };
            assert_eq!(sent, want, "{api} {}", l.ds);
        }
        let out = dir.path().join("out");
        for r in shard_rows(&out, "chat") {
            let m: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
            assert_eq!(m[0]["role"], "user");
            assert!(r.prompt.starts_with("<|im_start|>user\n"), "{}", r.prompt);
        }
        assert!(shard_rows(&out, "raw").iter().all(|r| r.messages.is_none()));
    }

    // `"chat"` without a template: refused before anything is enqueued.
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("p.jsonl"), "p", 2);
    let ds = Ds {
        name: "d",
        file: "p.jsonl",
        budget: None,
    };
    let cfg = write_config(dir.path(), "http://127.0.0.1:9", "sglang", false, &[ds], "");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("prompt_format = \"chat\"\n{text}")).unwrap();
    init_logs();
    let err = spool::run::job::run(
        load(&cfg).into(),
        Default::default(),
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("prompt_format"), "{err}");
    assert_eq!(spool::error::exit_code(&err), 2, "{err}");
    // `"raw"` through the chat API: a config error naming the key.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("prompt_format = \"chat\"", "prompt_format = \"raw\"")
        .replace("api = \"sglang\"", "api = \"chat\"");
    std::fs::write(&cfg, text).unwrap();
    let err = spool::config::Config::load(&cfg, &Default::default()).unwrap_err();
    assert!(err.to_string().contains("prompt_format"), "{err}");
}

/// `spool run` of `cfg` (a finished run, exit 0): its log.
fn run_log(cfg: &Path) -> String {
    let out = crate::process::spool(cfg, &["run"], &[]);
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{log}");
    log
}

/// A config of one chat dataset (2 rows) against `url` in `api`, not streaming, with the
/// self-check on; `top` goes first (top-level keys), `table` after the rest.
fn warn_config(dir: &Path, url: &str, api: &str, top: &str, table: &str) -> PathBuf {
    write_chats(&dir.join("chat.jsonl"), "c", 2);
    let ds = Ds {
        name: "d",
        file: "chat.jsonl",
        budget: None,
    };
    let cfg = write_config(dir, url, api, false, &[ds], table);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("self_check = false", "self_check = true");
    std::fs::write(&cfg, format!("{top}\n{text}")).unwrap();
    cfg
}

/// The `chat_template_kwargs` warning lists the keys Qwen3's template never reads
/// (`reasoning_effort`, and `thinking` with a text API) and only those: `enable_thinking`,
/// which the template reads, never; `thinking` not with `api = "chat"`, whose server reads
/// it; and a config of read keys gets no warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_template_kwargs_are_warned_about_by_name() {
    let mock = qwen_mock().await;
    const WARNING: &str = "chat_template_kwargs keys the chat template never reads";
    let all = "chat_template_kwargs = { reasoning_effort = \"high\", enable_thinking = false, thinking = true }";
    for (api, top, want) in [
        ("sglang", all, Some("keys=reasoning_effort, thinking")),
        ("chat", all, Some("keys=reasoning_effort ")),
        (
            "sglang",
            "chat_template_kwargs = { enable_thinking = false }",
            None,
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = warn_config(dir.path(), &mock.url, api, top, &qwen_table());
        let log = run_log(&cfg);
        match want {
            Some(keys) => {
                let line = log.lines().find(|l| l.contains(WARNING)).expect(&log);
                assert!(line.contains("WARN"), "{line}");
                assert!(line.contains(keys), "{api}: {line}");
                // Warned before intake, so before any generation.
                let at = log.find(WARNING).unwrap();
                assert!(at < log.find("enqueued").expect(&log), "{log}");
            }
            None => assert!(!log.contains(WARNING), "{log}"),
        }
    }
    mock.stop().await;
}

/// `reasoning = "raw"` through the chat API of a server whose reasoning parser splits the
/// thinking off (the self-check's answer has `reasoning_content`) is warned about before
/// generation; not when the server leaves the thinking in the text, nor when the thinking
/// is saved apart (`reasoning = "save"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_reasoning_against_a_splitting_chat_api_is_warned_about() {
    const WARNING: &str = "reasoning = \"raw\" but the server's chat API splits the thinking off";
    for (parser, reasoning, warned) in [
        (true, "raw", true),
        (false, "raw", false),
        (true, "save", false),
    ] {
        let mock = Mock::start(MockConfig {
            tokenizer: Some(qwen_dir().join("tokenizer.json")),
            think: true,
            reasoning_parser: parser,
            ..fast_mock()
        })
        .await;
        let dir = tempfile::tempdir().unwrap();
        let top = format!("reasoning = \"{reasoning}\"");
        let cfg = warn_config(dir.path(), &mock.url, "chat", &top, &qwen_table());
        let log = run_log(&cfg);
        assert_eq!(
            log.contains(WARNING),
            warned,
            "parser {parser}, {reasoning}: {log}"
        );
        if warned {
            let at = log.find(WARNING).unwrap();
            assert!(
                at < log.find("enqueued").expect(&log),
                "before intake: {log}"
            );
        }
        mock.stop().await;
    }
}

/// A server whose ids are not the `[tokenizer]`'s (the mock without `--tokenizer` answers
/// with ids of its own) is warned about from the self-check, which decodes its ids and
/// compares them with its text; a server answering in Qwen3's real tokens is not. Both
/// text APIs and the chat API, streaming and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_ids_that_are_not_the_tokenizers_are_warned_about() {
    const WARNING: &str = "the server's token ids do not decode to its text with [tokenizer]";
    for real in [false, true] {
        let mock = Mock::start(MockConfig {
            tokenizer: real.then(|| qwen_dir().join("tokenizer.json")),
            ..fast_mock()
        })
        .await;
        for (api, stream) in [
            ("sglang", true),
            ("sglang", false),
            ("completions", true),
            ("chat", false),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = warn_config(dir.path(), &mock.url, api, "", &qwen_table());
            if stream {
                crate::process::edit_config(&cfg, "stream = false", "stream = true");
            }
            let log = run_log(&cfg);
            assert!(log.contains("self-check: "), "{log}");
            assert_eq!(
                log.contains(WARNING),
                !real,
                "{api} stream {stream}, real ids {real}: {log}"
            );
        }
        mock.stop().await;
    }
}

/// A run whose rows will have no prompt ids says at start which key is missing (`[tokenizer]`,
/// or with `api = "chat"` the chat template), and an id export of it names the same key,
/// not a missing `[tokenizer]` the config has; a run with both gets no such warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_ids_names_the_missing_key_at_start_and_in_the_export() {
    let mock = Mock::start(MockConfig {
        no_token_ids: true,
        ..fast_mock()
    })
    .await;
    let path_only = format!(
        "[tokenizer]\npath = \"{}\"\n",
        qwen_dir().join("tokenizer.json").display()
    );
    for (api, table, key) in [
        (
            "chat",
            path_only.as_str(),
            Some("set [tokenizer] chat_template"),
        ),
        ("sglang", "", Some("set [tokenizer] path")),
        ("chat", &qwen_table(), None),
        ("sglang", &qwen_table(), None),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = warn_config(dir.path(), &mock.url, api, "", table);
        // `prompt` rows: a text API sends them without a template.
        write_prompts(&dir.path().join("chat.jsonl"), "p", 2);
        let log = run_log(&cfg);
        let warned = log
            .lines()
            .find(|l| l.contains("WARN") && l.contains("the id exports need them"));
        match key {
            Some(key) => {
                assert!(warned.expect(&log).contains(key), "{api}: {log}");
                let err = spool::output::export::export(
                    &load(&cfg),
                    &ExportOptions::new(Format::TokensJsonl, dir.path().join("t.jsonl")),
                )
                .unwrap_err();
                let key = key.trim_start_matches("set ");
                assert!(format!("{err:#}").contains(key), "{api}: {err:#}");
            }
            None => assert!(warned.is_none(), "{api}: {log}"),
        }
    }
    mock.stop().await;
}
